//! MaxPool: y[c, y, x] = max over the window at (y·sh, x·sw), no padding, as `nn.MaxPool2d`.
//! Backward sends each output gradient to the first maximum of its window (row-major order);
//! overlapping windows add. No parameters; the argmax is recomputed from the input, so no
//! index buffer is stored.

use crate::chain::Shape;
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
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
    #[inline(always)]
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

/// The forward for one sample, written once for the spec and the fast path.
fn forward_sample<F: Float>(g: &Geometry, xs: &[F], ys: &mut [F]) {
    for c in 0..g.channels {
        for y in 0..g.out_height {
            for x in 0..g.out_width {
                ys[(c * g.out_height + y) * g.out_width + x] = xs[g.argmax(xs, c, y, x)];
            }
        }
    }
}

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
pub fn forward_spec<F: Float>(g: &Geometry, batch: usize, x: &[F], y: &mut [F]) {
    for s in 0..batch {
        forward_sample(g, &x[s * g.in_len()..][..g.in_len()], &mut y[s * g.out_len()..][..g.out_len()]);
    }
}

/// Plain-loop backward (the spec): dX overwritten.
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

/// Fast forward: the spec's per-sample loop, samples spread over the pool.
pub fn forward(pool: &Pool, g: &Geometry, batch: usize, x: &[f32], y: &mut [f32]) {
    let y = SharedMut::new(&mut y[..batch * g.out_len()]);
    for_chunks(pool, batch, 8, &|_, samples| {
        // SAFETY: chunks are disjoint sample ranges.
        let ys = unsafe { y.slice(samples.start * g.out_len()..samples.end * g.out_len()) };
        forward_spec(g, samples.len(), &x[samples.start * g.in_len()..samples.end * g.in_len()], ys);
    });
}

/// Fast backward: dX overwritten, samples spread over the pool.
pub fn backward(pool: &Pool, g: &Geometry, batch: usize, x: &[f32], dy: &[f32], dx: &mut [f32]) {
    let dx = SharedMut::new(&mut dx[..batch * g.in_len()]);
    for_chunks(pool, batch, 8, &|_, samples| {
        // SAFETY: chunks are disjoint sample ranges.
        let dxs = unsafe { dx.slice(samples.start * g.in_len()..samples.end * g.in_len()) };
        let (xs, dys) =
            (&x[samples.start * g.in_len()..samples.end * g.in_len()], &dy[samples.start * g.out_len()..samples.end * g.out_len()]);
        backward_spec(g, samples.len(), xs, dys, dxs);
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
}
