//! Softmax over a vector's features: y_j = e^(x_j − m) / Σ_k e^(x_k − m), m = max_k x_k (the
//! same value as without m, which keeps e^ from overflowing), as PyTorch's `nn.Softmax(dim=1)`:
//! probabilities out, for a model whose last layer should give them. Backward:
//! dx_j = y_j · (dy_j − Σ_k dy_k·y_k). No parameters; it reads its own output in the backward
//! pass, so it keeps nothing beyond it.
//!
//! To train a classifier, leave it out and use [`Loss::LogitCrossEntropy`](crate::Loss) on the
//! scores (the same model, and a stabler gradient); a model trained that way can have a softmax
//! added after for inference, with the same parameters.
//!
//! The fast CPU path takes the exponentials vectorised (`vmath::exp_in_place`, 0.8 ulp) and the
//! sums with 8 partial sums (`layers::lane_sum`); the GPU a warp a sample (`kernels/softmax.cu`),
//! each lane its strided share in order, then a fixed tree. They agree with the spec to rounding.

use super::kind::{LayerKind, Mode};
use super::{lane_sum, split2, BackPass, Pass};
use crate::chain::{Chain, Shape, Step};
use crate::cpu::{for_chunks, vmath, SharedMut};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// Softmax over a vector: probabilities that sum to 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Softmax;

impl Chain {
    /// Softmax over the features of a vector (`nn.Softmax(dim=1)`): probabilities out.
    pub fn softmax(self) -> Chain {
        self.layer(Softmax.into())
    }
}

impl LayerKind for Softmax {
    const WORD: &'static str = "softmax";

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        match input {
            Shape::Vector(n) if n > 0 => Ok(input),
            Shape::Vector(_) => Err("the input has no values".into()),
            Shape::Image { .. } | Shape::Sequence { .. } | Shape::Signal { .. } => {
                Err("softmax needs a vector input: add .flatten() before it".into())
            }
        }
    }

    /// `softmax`
    fn describe(&self) -> String {
        Self::WORD.into()
    }

    fn parse(words: &Words) -> Result<Softmax> {
        match words.len() {
            1 => Ok(Softmax),
            _ => Err(words.unknown()),
        }
    }

    fn summary(&self, input: Shape) -> String {
        format!("Softmax({})", input.len())
    }

    fn forward(&self, step: &Step, pass: &mut Pass, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let n = step.input.len();
        let (xs, ys) = split2(pass.acts, x, y);
        let ys = SharedMut::new(ys);
        for_chunks(pass.pool, pass.batch, (4096 / n).max(1), &|_, samples| {
            // SAFETY: chunks are disjoint sample ranges.
            let ys = unsafe { ys.slice(samples.start * n..samples.end * n) };
            for (x, y) in xs[samples.start * n..samples.end * n].chunks_exact(n).zip(ys.chunks_exact_mut(n)) {
                let max = x.iter().fold(x[0], |m, &v| m.max(v));
                y.iter_mut().zip(x).for_each(|(y, &v)| *y = v - max);
                vmath::exp_in_place(y);
                let inv = 1.0 / lane_sum(y);
                y.iter_mut().for_each(|v| *v *= inv);
            }
        });
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let n = step.input.len();
        let (dxs, dys) = pass.dacts.split_at_mut(y.start);
        let (dys, ys) = (&dys[..y.len()], &pass.acts[y]);
        let dxs = SharedMut::new(&mut dxs[x]);
        for_chunks(pass.pool, pass.batch, (4096 / n).max(1), &|_, samples| {
            // SAFETY: chunks are disjoint sample ranges.
            let dxs = unsafe { dxs.slice(samples.start * n..samples.end * n) };
            let rows = samples.start * n..samples.end * n;
            for ((dx, dy), y) in dxs.chunks_exact_mut(n).zip(dys[rows.clone()].chunks_exact(n)).zip(ys[rows].chunks_exact(n)) {
                // Σ dy·y, into dx first so that the lanes sum it
                dx.iter_mut().zip(dy).zip(y).for_each(|((d, &dy), &y)| *d = dy * y);
                let dot = lane_sum(dx);
                dx.iter_mut().zip(dy).zip(y).for_each(|((d, &dy), &y)| *d = y * (dy - dot));
            }
        });
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let n = step.input.len();
        let (xs, ys) = split2(pass.acts, x, y);
        for (x, y) in xs.chunks_exact(n).zip(ys.chunks_exact_mut(n)) {
            let max = x.iter().fold(x[0], |m, &v| m.max(v));
            let mut sum = F::ZERO;
            for (y, &v) in y.iter_mut().zip(x) {
                *y = (v - max).exp();
                sum += *y;
            }
            y.iter_mut().for_each(|v| *v = *v / sum);
        }
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let n = step.input.len();
        let dys = pass.dacts[y.clone()].to_vec();
        let (ys, dxs) = (&pass.acts[y], &mut pass.dacts[x]);
        for ((dx, dy), y) in dxs.chunks_exact_mut(n).zip(dys.chunks_exact(n)).zip(ys.chunks_exact(n)) {
            let dot = dy.iter().zip(y).fold(F::ZERO, |sum, (&dy, &y)| sum + dy * y);
            for ((dx, &dy), &y) in dx.iter_mut().zip(dy).zip(y) {
                *dx = y * (dy - dot);
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, _mode: Mode) -> Result<()> {
        use crate::cuda::{int, kernel_args, Kernel};
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (n, rows) = (int(step.input.len())?, int(pass.f.batch)?);
        int(x.len())?;
        let (x, y) = (pass.acts(x).ptr(), pass.acts_mut(y).ptr());
        pass.gpu.run(pass.stream, Kernel::SoftmaxForward, warp_blocks(pass.f.batch), kernel_args![x, y, n, rows])
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        use crate::cuda::{int, kernel_args, Kernel};
        if !pass.need_dx {
            return Ok(());
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (n, rows) = (int(step.input.len())?, int(pass.f.batch)?);
        int(x.len())?;
        let (ys, dy, dx) = (pass.acts(y.clone()).ptr(), pass.dacts(y).ptr(), pass.dacts_mut(x).ptr());
        pass.gpu.run(pass.stream, Kernel::SoftmaxBackward, warp_blocks(pass.f.batch), kernel_args![ys, dy, dx, n, rows])
    }
}

/// Blocks of a launch that takes a sample a warp (8 warps a block), at most 2¹⁶ (the kernels
/// loop over the rest).
#[cfg(feature = "cuda")]
fn warp_blocks(rows: usize) -> u32 {
    rows.div_ceil(8).clamp(1, 1 << 16) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::gradcheck::{fast_matches_spec, gradients_match_finite_differences};
    use crate::{Identity, Loss, Tanh};

    #[test]
    fn probabilities_out_and_large_scores_do_not_overflow() {
        let model = Chain::new(Shape::vector(3)).softmax().build().unwrap().with_threads(1).unwrap();
        let mut cache = model.preallocate(2).unwrap();
        cache.set_inputs(&[0.0, 0.0, 0.0, 1000.0, 1000.5, -1000.0]).unwrap();
        let y = model.forward(&mut cache).unwrap();
        let e = 0.5f32.exp();
        let want = [1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / (1.0 + e), e / (1.0 + e), 0.0];
        assert!(y.iter().zip(want).all(|(&y, w)| (y - w).abs() < 1e-6), "{y:?}");
        assert!(Chain::new(Shape::image(1, 2, 2)).softmax().build().unwrap_err().to_string().contains("add .flatten()"));
    }

    #[test]
    fn gradients_and_the_fast_path_match_the_spec() {
        let chain = |classes| Chain::new(Shape::vector(5)).dense(classes, Tanh).softmax();
        for loss in [Loss::Mse, Loss::BceWithLogits, Loss::L1] {
            gradients_match_finite_differences("softmax", chain(4), &[loss], 51);
        }
        // 37 classes: whole vectors and a tail; one: a softmax of one value is 1, its gradient 0
        for (classes, seed) in [(4, 52), (37, 53), (1, 54)] {
            for threads in [1, 3] {
                let model = chain(classes).dense(3, Identity).build().unwrap().with_threads(threads).unwrap();
                fast_matches_spec(&model, seed, &format!("softmax of {classes}"));
            }
        }
    }
}
