//! MaxPool: y[c, y, x] = max over the window at (y·sh, x·sw), no padding, as `nn.MaxPool2d`.
//! Backward sends each output gradient to the first maximum of its window (row-major order);
//! overlapping windows add. No parameters; the argmax is recomputed from the input, so no
//! index buffer is stored.

use super::kind::{LayerKind, Mode};
use super::{split2, BackPass, Pass};
use crate::chain::{Chain, Shape, Step};
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;
use crate::summary::pair;

/// Max-pooling: the maximum of each `window`, moved by `stride`, no padding, on an image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool {
    pub window: (usize, usize),
    pub stride: (usize, usize),
}

impl Chain {
    /// Max-pool with stride equal to the window.
    pub fn max_pool(self, window: (usize, usize)) -> Chain {
        self.max_pool_with(window, window)
    }

    /// Max-pool with an explicit stride.
    pub fn max_pool_with(self, window: (usize, usize), stride: (usize, usize)) -> Chain {
        self.layer(MaxPool { window, stride }.into())
    }
}

impl LayerKind for MaxPool {
    const WORD: &'static str = "maxpool";

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        pooled(input, self.window, self.stride)
    }

    /// `maxpool KH KW SH SW`
    fn describe(&self) -> String {
        let MaxPool { window, stride } = *self;
        format!("maxpool {} {} {} {}", window.0, window.1, stride.0, stride.1)
    }

    fn parse(words: &Words) -> Result<MaxPool> {
        if words.len() != 5 {
            return Err(words.unknown());
        }
        let [wh, ww, sh, sw] = words.numbers()?;
        Ok(MaxPool { window: (wh, ww), stride: (sh, sw) })
    }

    fn summary(&self, _input: Shape) -> String {
        format!("MaxPool({}×{}, stride {})", self.window.0, self.window.1, pair(self.stride))
    }

    fn forward(&self, step: &Step, pass: &mut Pass, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (xs, ys) = split2(pass.acts, x, y);
        forward(pass.pool, &self.geometry(step), pass.batch, xs, ys);
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (dxs, dys) = pass.dacts.split_at_mut(y.start);
        backward(pass.pool, &self.geometry(step), pass.batch, &pass.acts[x.clone()], &dys[..y.len()], &mut dxs[x]);
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (xs, ys) = split2(pass.acts, x, y);
        forward_spec(&self.geometry(step), pass.batch, xs, ys);
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let dys = pass.dacts[y].to_vec();
        backward_spec(&self.geometry(step), pass.batch, &pass.acts[x.clone()], &dys, &mut pass.dacts[x]);
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, _mode: Mode) -> Result<()> {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        pass.gpu.maxpool_forward(pass.stream, &self.geometry(step), pass.f.batch, pass.acts(x), pass.acts_mut(y))
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        if !pass.need_dx {
            return Ok(());
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let g = self.geometry(step);
        pass.gpu.maxpool_backward(pass.stream, &g, pass.f.batch, pass.acts(x.clone()), pass.dacts(y), pass.dacts_mut(x))
    }
}

/// The output of a pool of `window` moved by `stride`, no padding, on `input` (max and average
/// pooling share it).
pub(crate) fn pooled(input: Shape, window: (usize, usize), stride: (usize, usize)) -> std::result::Result<Shape, String> {
    let Shape::Image { channels, height, width } = input else {
        return Err("needs an image input".into());
    };
    if window.0 == 0 || window.1 == 0 || stride.0 == 0 || stride.1 == 0 {
        return Err("window and stride must be at least 1".into());
    }
    if window.0 > height || window.1 > width {
        return Err(format!("window {}×{} is larger than the input {height}×{width}", window.0, window.1));
    }
    Ok(Shape::Image { channels, height: (height - window.0) / stride.0 + 1, width: (width - window.1) / stride.1 + 1 })
}

impl MaxPool {
    fn geometry(&self, step: &Step) -> Geometry {
        Geometry::new(step.input, step.output, self.window, self.stride)
    }
}

/// Geometry of one pool (max or average), derived from its plan step.
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
            unreachable!("the plan gives 2-D pools image shapes");
        };
        Geometry { channels, height, width, out_height: oh, out_width: ow, window, stride }
    }

    pub(crate) fn in_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    pub(crate) fn out_len(&self) -> usize {
        self.channels * self.out_height * self.out_width
    }

    /// Whether the windows tile the input: stride = window, and H = OH·kh, W = OW·kw, so that
    /// every input lies in exactly one window (none overlap, none is left out at an edge).
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn tiles(&self) -> bool {
        self.stride == self.window && self.height == self.out_height * self.window.0 && self.width == self.out_width * self.window.1
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
            if g.window == (2, 2) && g.stride == (2, 2) {
                forward_2x2(g, xs, ys);
            } else {
                each_window(g, |out, top, wh, ww| ys[out] = window_max(xs, g.width, top, wh, ww).1);
            }
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
            if g.window == (2, 2) && g.stride == (2, 2) {
                backward_2x2(g, xs, dys, dxs);
            } else {
                each_window(g, |out, top, wh, ww| dxs[window_max(xs, g.width, top, wh, ww).0] += dys[out]);
            }
        }
    });
}

/// One step of [`window_max`]'s rule: whether `v` replaces the running maximum `best`
/// (unless v ≤ best, so NaN wins), and the new maximum.
#[inline(always)]
#[allow(clippy::neg_cmp_op_on_partial_ord)]
fn replace(v: f32, best: f32) -> (bool, f32) {
    let take = !(v <= best);
    // a bit-mask select: LLVM turns `if take` into a branch, which mispredicts on real data
    let mask = u32::from(take).wrapping_neg();
    (take, f32::from_bits((v.to_bits() & mask) | (best.to_bits() & !mask)))
}

/// The input rows (2y, 2y + 1) of each output row y of a 2×2, stride-2 pool, with the output
/// row (or its gradient): the windows do not overlap, so each one is a pair of 2-value chunks
/// (at odd edges, an input row or column no window reads).
#[inline(always)]
fn rows_2x2(g: &Geometry, c: usize, y: usize) -> (usize, usize) {
    let top = (c * g.height + 2 * y) * g.width;
    (top, top + g.width)
}

/// Forward of a 2×2, stride-2 pool for one sample: the common case, without index arithmetic
/// per element.
fn forward_2x2(g: &Geometry, xs: &[f32], ys: &mut [f32]) {
    let ow = g.out_width;
    for c in 0..g.channels {
        for y in 0..g.out_height {
            let (r0, r1) = rows_2x2(g, c, y);
            let (r0, r1) = (&xs[r0..r0 + 2 * ow], &xs[r1..r1 + 2 * ow]);
            let out = &mut ys[(c * g.out_height + y) * ow..][..ow];
            for ((o, p), q) in out.iter_mut().zip(r0.chunks_exact(2)).zip(r1.chunks_exact(2)) {
                *o = replace(q[1], replace(q[0], replace(p[1], p[0]).1).1).1;
            }
        }
    }
}

/// Backward of a 2×2, stride-2 pool for one sample: the windows do not overlap, so each of
/// the four inputs gets dy or 0; `dxs` must be zero where no window reads (odd edges).
fn backward_2x2(g: &Geometry, xs: &[f32], dys: &[f32], dxs: &mut [f32]) {
    let ow = g.out_width;
    for c in 0..g.channels {
        for y in 0..g.out_height {
            let (r0, r1) = rows_2x2(g, c, y);
            let (x0, x1) = (&xs[r0..r0 + 2 * ow], &xs[r1..r1 + 2 * ow]);
            let (d0, d1) = dxs[r0..r1 + 2 * ow].split_at_mut(g.width);
            let dy = &dys[(c * g.out_height + y) * ow..][..ow];
            for x0w in (0..ow).step_by(LANES) {
                let n = LANES.min(ow - x0w);
                let w = 2 * x0w..2 * (x0w + n);
                backward_2x2_lanes(&x0[w.clone()], &x1[w.clone()], &dy[x0w..x0w + n], &mut d0[w.clone()], &mut d1[w]);
            }
        }
    }
}

/// Windows handled together by [`backward_2x2_lanes`].
const LANES: usize = 8;

/// Up to `LANES` windows of one row pair: copied into fixed-size lanes, so the rule below runs
/// as vector compares and blends. (With a variable trip count LLVM leaves a scalar remainder
/// and turns its selects into branches, which mispredict on real data: many times slower.)
fn backward_2x2_lanes(x0: &[f32], x1: &[f32], dy: &[f32], d0: &mut [f32], d1: &mut [f32]) {
    let n = dy.len();
    let ([mut a, mut b, mut c, mut d], mut grad) = ([[0.0f32; LANES]; 4], [0.0f32; LANES]);
    for l in 0..n {
        (a[l], b[l], c[l], d[l], grad[l]) = (x0[2 * l], x0[2 * l + 1], x1[2 * l], x1[2 * l + 1], dy[l]);
    }
    let mut out = [[0.0f32; LANES]; 4];
    for l in 0..LANES {
        // the rule of `window_max` as masks: tK = "value K replaced the running maximum";
        // the last replacement wins
        let (t1, best) = replace(b[l], a[l]);
        let (t2, best) = replace(c[l], best);
        let (t3, _) = replace(d[l], best);
        // dy or 0 by masking bits; + 0.0 as the spec's 0 + dy (−0 → +0)
        let put = |on: bool| f32::from_bits(grad[l].to_bits() & u32::from(on).wrapping_neg()) + 0.0;
        out[0][l] = put(!t1 & !t2 & !t3);
        out[1][l] = put(t1 & !t2 & !t3);
        out[2][l] = put(t2 & !t3);
        out[3][l] = put(t3);
    }
    for l in 0..n {
        (d0[2 * l], d0[2 * l + 1], d1[2 * l], d1[2 * l + 1]) = (out[0][l], out[1][l], out[2][l], out[3][l]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::poisoned;

    #[test]
    fn first_maximum_takes_the_gradient_and_overlaps_add() {
        // 1 channel 3×3, window 2×2 stride 1: windows overlap on the centre.
        let g = Geometry::new(Shape::image(1, 3, 3), Shape::image(1, 2, 2), (2, 2), (1, 1));
        let x = [1.0f32, 2.0, 0.0, 0.0, 9.0, 0.0, 3.0, 3.0, 1.0];
        let mut y = poisoned(4);
        forward_spec(&g, 1, &x, &mut y);
        assert_eq!(y, [9.0, 9.0, 9.0, 9.0]);
        let mut dx = poisoned(9);
        backward_spec(&g, 1, &x, &[1.0, 2.0, 3.0, 4.0], &mut dx);
        assert_eq!(dx, [0.0, 0.0, 0.0, 0.0, 10.0, 0.0, 0.0, 0.0, 0.0]);
        // ties: the first in row-major order wins
        let x = [5.0f32, 5.0, 5.0, 5.0];
        let g = Geometry::new(Shape::image(1, 2, 2), Shape::image(1, 1, 1), (2, 2), (2, 2));
        let mut dx = poisoned(4);
        backward_spec(&g, 1, &x, &[1.0], &mut dx);
        assert_eq!(dx, [1.0, 0.0, 0.0, 0.0]);
    }

    /// Windows tile an input only where they neither overlap nor leave out a row or column.
    #[test]
    fn windows_tile_only_an_input_they_cover_without_overlap() {
        let tiles = |input: Shape, window, stride| Geometry::new(input, pooled(input, window, stride).unwrap(), window, stride).tiles();
        assert!(tiles(Shape::image(2, 4, 6), (2, 2), (2, 2)));
        assert!(tiles(Shape::image(1, 6, 6), (3, 2), (3, 2)));
        assert!(tiles(Shape::image(1, 1, 12), (1, 4), (1, 4)));
        assert!(tiles(Shape::image(3, 5, 5), (5, 5), (5, 5)));
        // a row, a column, or both left out
        assert!(!tiles(Shape::image(2, 5, 6), (2, 2), (2, 2)));
        assert!(!tiles(Shape::image(2, 4, 7), (2, 2), (2, 2)));
        assert!(!tiles(Shape::image(2, 7, 9), (2, 2), (2, 2)));
        // overlapping windows, and windows with gaps between them
        assert!(!tiles(Shape::image(1, 4, 4), (2, 2), (1, 1)));
        assert!(!tiles(Shape::image(1, 4, 4), (2, 2), (2, 1)));
        assert!(!tiles(Shape::image(1, 6, 6), (2, 2), (3, 3)));
        assert!(!tiles(Shape::image(1, 4, 4), (1, 1), (2, 2)));
    }

    #[test]
    fn fast_matches_spec_with_ties_nan_and_odd_shapes() {
        let mut rng = crate::testutil::Rng::new(5);
        // (input, window, stride): square, overlapping, ragged edge, one window per channel
        let cases = [
            (Shape::image(6, 28, 28), (2, 2), (2, 2)),
            (Shape::image(2, 7, 9), (2, 2), (2, 2)),
            (Shape::image(3, 7, 9), (3, 2), (2, 3)),
            (Shape::image(2, 5, 5), (2, 2), (1, 1)),
            (Shape::image(8, 8, 8), (4, 4), (4, 4)),
            (Shape::image(1, 3, 4), (3, 4), (1, 1)),
        ];
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            for (input, window, stride) in cases {
                let Shape::Image { channels, height, width } = input else { unreachable!() };
                let output = Shape::image(channels, (height - window.0) / stride.0 + 1, (width - window.1) / stride.1 + 1);
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
