//! MaxPool: y[c, y, x] = max over the window at (y·sh, x·sw), no padding, as `nn.MaxPool2d`.
//! Backward sends each output gradient to the first maximum of its window (row-major order);
//! overlapping windows add. No parameters; the argmax is recomputed from the input, so no
//! index buffer is stored.

use crate::chain::Shape;
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
#[cfg(test)]
use crate::float::Float;

/// Geometry of one max-pool, derived from its plan step.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub out_height: usize,
    pub out_width: usize,
    pub window: (usize, usize),
    pub stride: (usize, usize),
}

impl Geometry {
    /// From the layer's shapes, window and stride.
    pub fn new(input: Shape, output: Shape, window: (usize, usize), stride: (usize, usize)) -> Geometry {
        let (Shape::Image { channels, height, width }, Shape::Image { height: oh, width: ow, .. }) = (input, output) else {
            unreachable!("the plan gives pools image shapes");
        };
        Geometry { channels, height, width, out_height: oh, out_width: ow, window, stride }
    }

    fn in_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    fn out_len(&self) -> usize {
        self.channels * self.out_height * self.out_width
    }

    /// Index in the sample's input of the first maximum of window (c, y, x).
    #[cfg(test)]
    fn argmax<F: Float>(&self, xs: &[F], c: usize, y: usize, x: usize) -> usize {
        let (y0, x0) = (y * self.stride.0, x * self.stride.1);
        let mut best = (c * self.height + y0) * self.width + x0;
        for i in 0..self.window.0 {
            let row = (c * self.height + y0 + i) * self.width + x0;
            for j in 0..self.window.1 {
                // a NaN wins (it compares as neither smaller nor equal), as in PyTorch
                if matches!(xs[row + j].partial_cmp(&xs[best]), Some(std::cmp::Ordering::Greater) | None) {
                    best = row + j;
                }
            }
        }
        best
    }
}

/// The spec's forward for one sample.
#[cfg(test)]
fn forward_sample<F: Float>(g: &Geometry, xs: &[F], ys: &mut [F]) {
    for c in 0..g.channels {
        for y in 0..g.out_height {
            for x in 0..g.out_width {
                ys[(c * g.out_height + y) * g.out_width + x] = xs[g.argmax(xs, c, y, x)];
            }
        }
    }
}

#[cfg(test)]
fn backward_sample<F: Float>(g: &Geometry, xs: &[F], dys: &[F], dxs: &mut [F]) {
    dxs.iter_mut().for_each(|v| *v = F::ZERO);
    for c in 0..g.channels {
        for y in 0..g.out_height {
            for x in 0..g.out_width {
                dxs[g.argmax(xs, c, y, x)] += dys[(c * g.out_height + y) * g.out_width + x];
            }
        }
    }
}

/// Plain-loop forward (the spec).
#[cfg(test)]
pub fn forward_spec<F: Float>(g: &Geometry, batch: usize, x: &[F], y: &mut [F]) {
    for s in 0..batch {
        forward_sample(g, &x[s * g.in_len()..][..g.in_len()], &mut y[s * g.out_len()..][..g.out_len()]);
    }
}

/// Plain-loop backward (the spec): dX overwritten.
#[cfg(test)]
pub fn backward_spec<F: Float>(g: &Geometry, batch: usize, x: &[F], dy: &[F], dx: &mut [F]) {
    for s in 0..batch {
        backward_sample(
            g,
            &x[s * g.in_len()..][..g.in_len()],
            &dy[s * g.out_len()..][..g.out_len()],
            &mut dx[s * g.in_len()..][..g.in_len()],
        );
    }
}

/// Index (in the sample) and value of the first maximum of the `wh × ww` window whose
/// top-left input pixel is `top`: the spec's rule (a value replaces the running maximum unless
/// it is ≤ it, so NaN wins) with the window's rows read as slices.
#[inline(always)]
fn window_max(xs: &[f32], width: usize, top: usize, wh: usize, ww: usize) -> (usize, f32) {
    let (mut at, mut best) = (top, xs[top]);
    for i in 0..wh {
        let start = top + i * width;
        for (j, &v) in xs[start..start + ww].iter().enumerate() {
            // selects, not a branch: on real data the winner is unpredictable
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            let take = !(v <= best);
            at = if take { start + j } else { at };
            best = if take { v } else { best };
        }
    }
    (at, best)
}

/// Calls `f(output index, window's top-left input index)` for every output of one sample, in
/// output order, with the window size passed on as `wh, ww` (constants for the common 2×2, so
/// the window loop unrolls once `f` is inlined).
#[inline(always)]
fn each_window(g: &Geometry, mut f: impl FnMut(usize, usize, usize, usize)) {
    let mut visit = |wh: usize, ww: usize| {
        let mut out = 0;
        for c in 0..g.channels {
            for y in 0..g.out_height {
                let row = (c * g.height + y * g.stride.0) * g.width;
                for x in 0..g.out_width {
                    f(out, row + x * g.stride.1, wh, ww);
                    out += 1;
                }
            }
        }
    };
    match g.window {
        (2, 2) => visit(2, 2),
        (wh, ww) => visit(wh, ww),
    }
}

/// Fast forward: [`window_max`] per output, samples spread over the pool.
pub fn forward(pool: &Pool, g: &Geometry, batch: usize, x: &[f32], y: &mut [f32]) {
    let y = SharedMut::new(&mut y[..batch * g.out_len()]);
    for_chunks(pool, batch, 8, &|_, samples| {
        for s in samples {
            // SAFETY: chunks are disjoint sample ranges.
            let ys = unsafe { y.slice(s * g.out_len()..(s + 1) * g.out_len()) };
            let xs = &x[s * g.in_len()..][..g.in_len()];
            each_window(g, |out, top, wh, ww| ys[out] = window_max(xs, g.width, top, wh, ww).1);
        }
    });
}

/// Fast backward: dX overwritten, each dy added at its window's first maximum; samples spread
/// over the pool.
pub fn backward(pool: &Pool, g: &Geometry, batch: usize, x: &[f32], dy: &[f32], dx: &mut [f32]) {
    let dx = SharedMut::new(&mut dx[..batch * g.in_len()]);
    for_chunks(pool, batch, 8, &|_, samples| {
        for s in samples {
            // SAFETY: chunks are disjoint sample ranges.
            let dxs = unsafe { dx.slice(s * g.in_len()..(s + 1) * g.in_len()) };
            let (xs, dys) = (&x[s * g.in_len()..][..g.in_len()], &dy[s * g.out_len()..][..g.out_len()]);
            dxs.fill(0.0);
            each_window(g, |out, top, wh, ww| dxs[window_max(xs, g.width, top, wh, ww).0] += dys[out]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::poisoned;

    #[test]
    fn first_maximum_takes_the_gradient_and_overlaps_add() {
        // 1 channel 3×3, window 2×2 stride 1: windows overlap on the centre.
        let g = Geometry::new(Shape::image(3, 3, 1), Shape::image(2, 2, 1), (2, 2), (1, 1));
        let x = [1.0f32, 2.0, 0.0, 0.0, 9.0, 0.0, 3.0, 3.0, 1.0];
        let mut y = poisoned(4);
        forward_spec(&g, 1, &x, &mut y);
        assert_eq!(y, [9.0, 9.0, 9.0, 9.0]);
        let mut dx = poisoned(9);
        backward_spec(&g, 1, &x, &[1.0, 2.0, 3.0, 4.0], &mut dx);
        assert_eq!(dx, [0.0, 0.0, 0.0, 0.0, 10.0, 0.0, 0.0, 0.0, 0.0]);
        // ties: the first in row-major order wins
        let x = [5.0f32, 5.0, 5.0, 5.0];
        let g = Geometry::new(Shape::image(2, 2, 1), Shape::image(1, 1, 1), (2, 2), (2, 2));
        let mut dx = poisoned(4);
        backward_spec(&g, 1, &x, &[1.0], &mut dx);
        assert_eq!(dx, [1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn fast_matches_spec_with_ties_nan_and_odd_shapes() {
        let mut rng = crate::testutil::Rng::new(5);
        // (input, window, stride): square, overlapping, ragged edge, one window per channel
        let cases = [
            (Shape::image(28, 28, 6), (2, 2), (2, 2)),
            (Shape::image(7, 9, 3), (3, 2), (2, 3)),
            (Shape::image(5, 5, 2), (2, 2), (1, 1)),
            (Shape::image(8, 8, 8), (4, 4), (4, 4)),
            (Shape::image(3, 4, 1), (3, 4), (1, 1)),
        ];
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            for (input, window, stride) in cases {
                let Shape::Image { channels, height, width } = input else { unreachable!() };
                let output = Shape::image((height - window.0) / stride.0 + 1, (width - window.1) / stride.1 + 1, channels);
                let g = Geometry::new(input, output, window, stride);
                for batch in [1, 3, 17] {
                    // small ints make ties common; a few NaNs test the NaN rule
                    let mut x = rng.ints(batch * g.in_len());
                    for _ in 0..batch {
                        let i = rng.below(x.len());
                        x[i] = f32::NAN;
                    }
                    let dy = rng.ints(batch * g.out_len());
                    let (mut y_spec, mut dx_spec) = (poisoned(batch * g.out_len()), poisoned(batch * g.in_len()));
                    forward_spec(&g, batch, &x, &mut y_spec);
                    backward_spec(&g, batch, &x, &dy, &mut dx_spec);
                    let (mut y, mut dx) = (poisoned(batch * g.out_len() + 2), poisoned(batch * g.in_len() + 2));
                    forward(&pool, &g, batch, &x, &mut y);
                    backward(&pool, &g, batch, &x, &dy, &mut dx);
                    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(same(&y[..y_spec.len()], &y_spec), "forward {g:?}");
                    assert!(same(&dx[..dx_spec.len()], &dx_spec), "backward {g:?}");
                    assert!(y[y_spec.len()..].iter().chain(&dx[dx_spec.len()..]).all(|v| v.is_nan()), "wrote past the batch");
                }
            }
        }
    }
}
