//! GlobalAvgPool: the mean of each channel, y[c] = (Σ_p x[c, p]) / P over the P = H·W pixels
//! of an image (C, H, W) or the P = L values of a signal (C, L); the output is a vector (C).
//! Backward: dx[c, p] = dy[c] / P. No parameters, nothing kept.
//!
//! PyTorch has no single module for it: it is `nn.AdaptiveAvgPool2d(1)` (or `1d` for a signal)
//! then `nn.Flatten()`, two modules of an `nn.Sequential`, and the plan counts it as two, so the
//! layers after it are named as in that `Sequential` (it has no tensors of its own).
//!
//! The fast CPU path sums a channel in 8 interleaved partial sums (`layers::lane_sum`), the spec
//! in order; the GPU a warp a channel (`kernels/globalpool.cu`), each lane its strided share in
//! order, then a fixed tree. The three agree to rounding, and exactly on small integers.

use super::kind::{LayerKind, Mode};
use super::{lane_sum, split2, BackPass, Pass};
use crate::chain::{Chain, Shape, Step};
use crate::cpu::{for_chunks, SharedMut};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// Global average pooling: image (C, H, W) or signal (C, L) → vector (C), each channel's mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalAvgPool;

impl Chain {
    /// The mean of each channel of an image or a signal, as a vector (`nn.AdaptiveAvgPool2d(1)`,
    /// or `1d`, then `nn.Flatten()`).
    pub fn global_avg_pool(self) -> Chain {
        self.layer(GlobalAvgPool.into())
    }
}

impl LayerKind for GlobalAvgPool {
    const WORD: &'static str = "globalavgpool";

    /// `AdaptiveAvgPool2d(1)` (or `1d`) and `Flatten`.
    fn modules(&self) -> usize {
        2
    }

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        match input {
            Shape::Image { channels, .. } | Shape::Signal { channels, .. } if !input.is_empty() => Ok(Shape::Vector(channels)),
            Shape::Image { .. } | Shape::Signal { .. } => Err("the input has no values to average".into()),
            Shape::Vector(_) | Shape::Sequence { .. } => Err("needs an image or a signal input".into()),
        }
    }

    /// `globalavgpool`
    fn describe(&self) -> String {
        Self::WORD.into()
    }

    fn parse(words: &Words) -> Result<GlobalAvgPool> {
        match words.len() {
            1 => Ok(GlobalAvgPool),
            _ => Err(words.unknown()),
        }
    }

    fn summary(&self, input: Shape) -> String {
        match input {
            Shape::Image { height, width, .. } => format!("GlobalAvgPool({height}×{width})"),
            Shape::Signal { length, .. } => format!("GlobalAvgPool({length})"),
            Shape::Vector(_) | Shape::Sequence { .. } => "GlobalAvgPool".into(),
        }
    }

    fn forward(&self, step: &Step, pass: &mut Pass, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (xs, ys) = split2(pass.acts, x, y);
        let (pixels, scale) = (pixels(step), pixels(step) as f32);
        let rows = ys.len();
        let ys = SharedMut::new(ys);
        for_chunks(pass.pool, rows, (4096 / pixels).max(1), &|_, range| {
            // SAFETY: chunks are disjoint ranges of rows (a sample's channels).
            let ys = unsafe { ys.slice(range.clone()) };
            for (y, row) in ys.iter_mut().zip(xs[range.start * pixels..range.end * pixels].chunks_exact(pixels)) {
                *y = lane_sum(row) / scale;
            }
        });
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let pixels = pixels(step);
        let (dxs, dys) = pass.dacts.split_at_mut(y.start);
        let (dys, rows) = (&dys[..y.len()], y.len());
        let dxs = SharedMut::new(&mut dxs[x]);
        for_chunks(pass.pool, rows, (16384 / pixels).max(1), &|_, range| {
            // SAFETY: chunks are disjoint ranges of rows.
            let dxs = unsafe { dxs.slice(range.start * pixels..range.end * pixels) };
            for (row, &dy) in dxs.chunks_exact_mut(pixels).zip(&dys[range]) {
                row.fill(dy / pixels as f32);
            }
        });
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let pixels = pixels(step);
        let (xs, ys) = split2(pass.acts, x, y);
        for (y, row) in ys.iter_mut().zip(xs.chunks_exact(pixels)) {
            *y = row.iter().fold(F::ZERO, |sum, &v| sum + v) / F::of(pixels as f64);
        }
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let pixels = pixels(step);
        let dys = pass.dacts[y].to_vec();
        for (row, &dy) in pass.dacts[x].chunks_exact_mut(pixels).zip(&dys) {
            row.iter_mut().for_each(|v| *v = dy / F::of(pixels as f64));
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, _mode: Mode) -> Result<()> {
        use crate::cuda::{int, kernel_args, Kernel};
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        int(x.len())?;
        let rows = int(y.len())?;
        let (x, y, pixels) = (pass.acts(x).ptr(), pass.acts_mut(y).ptr(), int(pixels(step))?);
        // a warp a row, 8 a block
        let grid = (rows as u32).div_ceil(8).min(1 << 16);
        pass.gpu.run(pass.stream, Kernel::GlobalAvgpoolForward, grid, kernel_args![x, y, pixels, rows])
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        use crate::cuda::{blocks, int, kernel_args, Kernel};
        if !pass.need_dx {
            return Ok(());
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (n, pixels) = (int(x.len())?, int(pixels(step))?);
        let grid = blocks(x.len());
        let (dy, dx) = (pass.dacts(y).ptr(), pass.dacts_mut(x).ptr());
        pass.gpu.run(pass.stream, Kernel::GlobalAvgpoolBackward, grid, kernel_args![dy, dx, pixels, n])
    }
}

/// Values a channel of the step's input averages: H·W, or L.
fn pixels(step: &Step) -> usize {
    match (step.input, step.output) {
        (input, Shape::Vector(channels)) => input.len() / channels,
        _ => unreachable!("the plan gives global pooling a vector output"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_and_signals_pool_to_a_vector_of_channels_counted_as_two_modules() {
        let model = Chain::new(Shape::image(3, 4, 5)).global_avg_pool().dense(2, crate::Identity).build().unwrap();
        let plan = &*model.plan;
        assert_eq!(plan.steps[0].output, Shape::Vector(3));
        // AdaptiveAvgPool2d(1) (0), Flatten (1), Linear (2)
        assert_eq!(plan.steps[1].module, "2");
        assert_eq!(plan.steps[1].tensors[0].shape, [2, 3]);
        let signal = Chain::new(Shape::signal(4, 7)).global_avg_pool().build().unwrap();
        assert_eq!(signal.output_shape(), Shape::Vector(4));
        for input in [Shape::vector(3), Shape::sequence(2, 3), Shape::image(2, 0, 3)] {
            assert!(Chain::new(input).global_avg_pool().build().is_err(), "{input}");
        }
    }

    #[test]
    fn fast_matches_spec_on_odd_shapes() {
        for threads in [1, 3] {
            for input in [Shape::image(3, 5, 7), Shape::image(5, 1, 1), Shape::signal(2, 37), Shape::image(64, 8, 8)] {
                // behind a layer, so that its input gradient is computed
                let chain = match input {
                    Shape::Image { .. } => Chain::new(input).avg_pool((1, 1)).global_avg_pool(),
                    _ => Chain::new(input).conv1d(2, 3, crate::Tanh).global_avg_pool(),
                };
                let model = chain.build().unwrap().with_threads(threads).unwrap();
                crate::layers::gradcheck::fast_matches_spec(&model, 23, &format!("global average pool of {input}"));
            }
        }
    }
}
