//! AvgPool: y[c, oy, ox] = (Σ of the kh×kw window at (oy·sh, ox·sw)) / (kh·kw), no padding, as
//! `nn.AvgPool2d(window, stride)` with its defaults (no padding, so every window counts its
//! kh·kw values). The window is summed in row-major order, then divided. Backward: each window
//! adds dy/(kh·kw) to every input it read, windows in output order (overlapping ones add).
//! No parameters, nothing kept. The fast CPU path is the plain loop itself, its samples spread
//! over the pool's threads; the GPU kernels (`kernels/avgpool.cu`) take the same operations in
//! the same order, so both devices give the same bits.

use super::kind::{LayerKind, Mode};
use super::pool::{pooled, Geometry};
use super::{split2, BackPass, Pass};
use crate::chain::{Chain, Shape, Step};
use crate::cpu::{for_chunks, SharedMut};
use crate::error::Result;
use crate::float::Float;
use crate::io::Words;
use crate::summary::pair;

/// Average pooling: the mean of each `window`, moved by `stride`, no padding, on an image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AvgPool {
    pub window: (usize, usize),
    pub stride: (usize, usize),
}

impl Chain {
    /// Average-pool with stride equal to the window (`nn.AvgPool2d(window)`).
    pub fn avg_pool(self, window: (usize, usize)) -> Chain {
        self.avg_pool_with(window, window)
    }

    /// Average-pool with an explicit stride (`nn.AvgPool2d(window, stride)`).
    pub fn avg_pool_with(self, window: (usize, usize), stride: (usize, usize)) -> Chain {
        self.layer(AvgPool { window, stride }.into())
    }
}

impl LayerKind for AvgPool {
    const WORD: &'static str = "avgpool";

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        pooled(input, self.window, self.stride)
    }

    /// `avgpool KH KW SH SW`
    fn describe(&self) -> String {
        let AvgPool { window, stride } = *self;
        format!("avgpool {} {} {} {}", window.0, window.1, stride.0, stride.1)
    }

    fn parse(words: &Words) -> Result<AvgPool> {
        if words.len() != 5 {
            return Err(words.unknown());
        }
        let [wh, ww, sh, sw] = words.numbers()?;
        Ok(AvgPool { window: (wh, ww), stride: (sh, sw) })
    }

    fn summary(&self, _input: Shape) -> String {
        format!("AvgPool({}×{}, stride {})", self.window.0, self.window.1, pair(self.stride))
    }

    fn forward(&self, step: &Step, pass: &mut Pass, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (xs, ys) = split2(pass.acts, x, y);
        let (g, batch) = (self.geometry(step), pass.batch);
        let ys = SharedMut::new(&mut ys[..batch * g.out_len()]);
        for_chunks(pass.pool, batch, 8, &|_, samples| {
            for s in samples {
                // SAFETY: chunks are disjoint sample ranges.
                let y = unsafe { ys.slice(s * g.out_len()..(s + 1) * g.out_len()) };
                forward_sample(&g, &xs[s * g.in_len()..][..g.in_len()], y);
            }
        });
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (g, batch) = (self.geometry(step), pass.batch);
        let (dxs, dys) = pass.dacts.split_at_mut(y.start);
        let dys = &dys[..y.len()];
        let dxs = SharedMut::new(&mut dxs[x]);
        for_chunks(pass.pool, batch, 8, &|_, samples| {
            for s in samples {
                // SAFETY: chunks are disjoint sample ranges.
                let dx = unsafe { dxs.slice(s * g.in_len()..(s + 1) * g.in_len()) };
                backward_sample(&g, &dys[s * g.out_len()..][..g.out_len()], dx);
            }
        });
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (g, batch) = (self.geometry(step), pass.batch);
        let (xs, ys) = split2(pass.acts, x, y);
        for s in 0..batch {
            forward_sample(&g, &xs[s * g.in_len()..][..g.in_len()], &mut ys[s * g.out_len()..][..g.out_len()]);
        }
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (g, batch) = (self.geometry(step), pass.batch);
        let dys = pass.dacts[y].to_vec();
        let dxs = &mut pass.dacts[x];
        for s in 0..batch {
            backward_sample(&g, &dys[s * g.out_len()..][..g.out_len()], &mut dxs[s * g.in_len()..][..g.in_len()]);
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, _mode: Mode) -> Result<()> {
        use crate::cuda::{blocks, kernel_args, Kernel};
        let (g, batch) = (self.geometry(step), pass.f.batch);
        let (x, y) = (pass.acts(pass.region(step.input_region)).ptr(), pass.acts_mut(pass.region(step.output_region)).ptr());
        let [c, h, w, oh, ow, kh, kw, sh, sw, b] = dims(&g, batch)?;
        pass.gpu.run(
            pass.stream,
            Kernel::AvgpoolForward,
            blocks(batch * g.out_len()),
            kernel_args![x, y, c, h, w, oh, ow, kh, kw, sh, sw, b],
        )
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        use crate::cuda::{blocks, kernel_args, Kernel};
        if !pass.need_dx {
            return Ok(());
        }
        let (g, batch) = (self.geometry(step), pass.f.batch);
        let (dy, dx) = (pass.dacts(pass.region(step.output_region)).ptr(), pass.dacts_mut(pass.region(step.input_region)).ptr());
        let [c, h, w, oh, ow, kh, kw, sh, sw, b] = dims(&g, batch)?;
        pass.gpu.run(
            pass.stream,
            Kernel::AvgpoolBackward,
            blocks(batch * g.in_len()),
            kernel_args![dy, dx, c, h, w, oh, ow, kh, kw, sh, sw, b],
        )
    }
}

impl AvgPool {
    fn geometry(&self, step: &Step) -> Geometry {
        Geometry::new(step.input, step.output, self.window, self.stride)
    }
}

/// The kernels' sizes: channels, height, width, out height, out width, window, stride, batch;
/// a Shape error where the batch's input is too large for one kernel.
#[cfg(feature = "cuda")]
fn dims(g: &Geometry, batch: usize) -> Result<[i32; 10]> {
    use crate::cuda::int;
    int(batch * g.in_len())?;
    let sizes = [g.channels, g.height, g.width, g.out_height, g.out_width, g.window.0, g.window.1, g.stride.0, g.stride.1, batch];
    let mut out = [0; 10];
    for (o, v) in out.iter_mut().zip(sizes) {
        *o = int(v)?;
    }
    Ok(out)
}

/// Calls `f(output index, window's top-left input index)` for every output of one sample, in
/// output order.
#[inline(always)]
fn each_window(g: &Geometry, mut f: impl FnMut(usize, usize)) {
    let mut out = 0;
    for c in 0..g.channels {
        for y in 0..g.out_height {
            let row = (c * g.height + y * g.stride.0) * g.width;
            for x in 0..g.out_width {
                f(out, row + x * g.stride.1);
                out += 1;
            }
        }
    }
}

/// One sample's outputs: each window summed row by row, in order, then divided by its size.
fn forward_sample<F: Float>(g: &Geometry, xs: &[F], ys: &mut [F]) {
    let ((wh, ww), count) = (g.window, F::of((g.window.0 * g.window.1) as f64));
    each_window(g, |out, top| {
        let mut acc = F::ZERO;
        for i in 0..wh {
            for &v in &xs[top + i * g.width..][..ww] {
                acc += v;
            }
        }
        ys[out] = acc / count;
    });
}

/// One sample's input gradient, overwritten: dy/(kh·kw) added to each input of each window, in
/// output order.
fn backward_sample<F: Float>(g: &Geometry, dys: &[F], dxs: &mut [F]) {
    let ((wh, ww), count) = (g.window, F::of((g.window.0 * g.window.1) as f64));
    dxs.iter_mut().for_each(|v| *v = F::ZERO);
    each_window(g, |out, top| {
        let d = dys[out] / count;
        for i in 0..wh {
            for v in &mut dxs[top + i * g.width..][..ww] {
                *v += d;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::poisoned;

    #[test]
    fn windows_average_and_overlaps_add() {
        // 1 channel 3×3, window 2×2 stride 1: the windows overlap on the centre
        let g = Geometry::new(Shape::image(1, 3, 3), Shape::image(1, 2, 2), (2, 2), (1, 1));
        let x = [1.0f32, 2.0, 0.0, 0.0, 9.0, 0.0, 3.0, 3.0, 1.0];
        let mut y = poisoned(4);
        forward_sample(&g, &x, &mut y);
        assert_eq!(y, [3.0, 2.75, 3.75, 3.25]);
        let mut dx = poisoned(9);
        backward_sample(&g, &[4.0, 8.0, 12.0, 16.0], &mut dx);
        assert_eq!(dx, [1.0, 3.0, 2.0, 4.0, 10.0, 6.0, 3.0, 7.0, 4.0]);
    }

    /// Through average pools (one strided, one overlapping) and a global average pool, between
    /// convolutions whose parameters take the gradients.
    #[test]
    fn gradients_match_finite_differences() {
        let chain = Chain::new(Shape::image(2, 9, 8))
            .conv(3, (2, 2), crate::Tanh)
            .avg_pool_with((3, 2), (2, 3))
            .conv(2, (2, 1), crate::Silu)
            .avg_pool_with((2, 2), (1, 1))
            .global_avg_pool()
            .dense(3, crate::Identity);
        crate::layers::gradcheck::gradients_match_finite_differences("avgpool", chain, &[crate::Loss::Mse], 22);
    }

    #[test]
    fn fast_matches_spec_on_odd_shapes() {
        let cases = [
            (Shape::image(3, 7, 9), (2, 2), (2, 2)),
            (Shape::image(2, 7, 9), (3, 2), (2, 3)),
            (Shape::image(2, 5, 5), (2, 2), (1, 1)),
            (Shape::image(1, 3, 4), (3, 4), (1, 1)),
        ];
        for threads in [1, 3] {
            for (input, window, stride) in cases {
                // a pool of a pool, so the first one's input gradient is computed too
                let chain = Chain::new(input).avg_pool_with((1, 1), (1, 1)).avg_pool_with(window, stride);
                let model = chain.build().unwrap().with_threads(threads).unwrap();
                crate::layers::gradcheck::fast_matches_spec(&model, 21, &format!("avgpool {input} {window:?} {stride:?}"));
            }
        }
    }
}
