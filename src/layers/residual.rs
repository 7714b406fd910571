//! Residual blocks: `Chain::residual(|c| body)` adds the body's output to its input,
//!
//!   y = act(x + body(x))   (act the identity for `residual`, the one given to `residual_with`)
//!
//! as two steps around the body's in the plan (see `src/plan.rs`): a [`Fork`], which opens the
//! block and is a view (its output is its input, nothing runs forward), and an [`Add`], which
//! closes it: z = body output + block input, then y = act(z), in a region of its own. The plan
//! checks that the body gives back its input's shape, and counts the Add as a second reader of
//! the block input.
//!
//! Backward, steps run in reverse: the Add's dz = dy ⊙ act'(z) becomes the gradient of the
//! body's output (copied into its region); the body's steps run, its first overwriting the
//! block input's gradient; then the Fork adds dz into it, the gradient of the skip.
//!
//! In PyTorch the block is one module of the sequence around it, holding the body as an
//! `nn.Sequential` named `body`:
//!
//! ```python
//! class Residual(nn.Module):
//!     def __init__(self, *layers):
//!         super().__init__()
//!         self.body = nn.Sequential(*layers)
//!
//!     def forward(self, x):
//!         return x + self.body(x)
//! ```
//!
//! so the tensors of the body's module j in the block at index i are `{i}.body.{j}.weight` and
//! so on (a nested block's, `{i}.body.{j}.body.{k}.weight`); `residual_with(act, ..)` is that
//! module followed by the activation's (`Residual(...), nn.ReLU()`): one module more in the
//! sequence, as a dense layer's activation is.

use super::kind::{LayerKind, Mode};
use super::{act_backward, BackPass, Pass};
use crate::activation::Activation;
use crate::chain::{Chain, Shape, Step};
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// Opens a residual block: a view of its input, which the block's [`Add`] adds back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fork;

/// Closes a residual block: y = act(body output + block input).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Add {
    pub activation: Activation,
}

impl Chain {
    /// A residual block: y = x + body(x), where `body` appends the block's layers to the chain
    /// it is given (`.residual(|c| c.dense(64, Relu).dense(64, Identity))`); the body must give
    /// back its input's shape, which `build` checks. Any layer may be in a body, blocks too.
    pub fn residual(self, body: impl FnOnce(Chain) -> Chain) -> Chain {
        self.residual_with(Activation::Identity, body)
    }

    /// A residual block followed by an activation: y = act(x + body(x)), as in ResNet's blocks.
    pub fn residual_with(self, activation: Activation, body: impl FnOnce(Chain) -> Chain) -> Chain {
        body(self.layer(Fork.into())).layer(Add { activation }.into())
    }
}

impl LayerKind for Fork {
    const WORD: &'static str = "residual";

    fn is_view(&self) -> bool {
        true
    }

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        Ok(input)
    }

    /// `residual`
    fn describe(&self) -> String {
        Self::WORD.into()
    }

    fn parse(words: &Words) -> Result<Fork> {
        match words.len() {
            1 => Ok(Fork),
            _ => Err(words.unknown()),
        }
    }

    fn summary(&self, _input: Shape) -> String {
        "Residual".into()
    }

    fn forward(&self, _step: &Step, _pass: &mut Pass, _mode: Mode) {}

    /// d(block input) += dz of the block's Add (the body's first step wrote the rest).
    fn backward(&self, step: &Step, pass: &mut BackPass) {
        if pass.needs_dx(step) {
            let (x, dz) = (pass.region(step.input_region), pass.region(skip(step)));
            add_into(pass.pool, pass.dacts, dz, x);
        }
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, _step: &Step, _pass: &mut super::spec::Pass<F>, _mode: Mode) {}

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        if pass.needs_dx(step) {
            let (x, dz) = (pass.region(step.input_region), pass.region(skip(step)));
            for i in 0..x.len() {
                let add = pass.dacts[dz.start + i];
                pass.dacts[x.start + i] += add;
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, _step: &Step, _pass: &crate::cuda::exec::GpuForward, _mode: Mode) -> Result<()> {
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        crate::cuda::layers::fork_backward(pass, step, skip(step))
    }
}

impl LayerKind for Add {
    const WORD: &'static str = "add";

    fn activation(&self) -> Option<Activation> {
        Some(self.activation)
    }

    /// The body's output shape, which the plan has checked against the block input's.
    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        Ok(input)
    }

    /// `add ACTIVATION`
    fn describe(&self) -> String {
        format!("add {}", self.activation.name())
    }

    fn parse(words: &Words) -> Result<Add> {
        Ok(Add { activation: words.activation(1)? })
    }

    fn summary(&self, _input: Shape) -> String {
        "Add (+ block input)".into()
    }

    fn forward(&self, step: &Step, pass: &mut Pass, _mode: Mode) {
        let (body, block, z, y) =
            (pass.region(step.input_region), pass.region(skip(step)), pass.region(step.z_region), pass.region(step.output_region));
        // the body's output and the block input come before the step's own regions
        let (before, own) = pass.acts.split_at_mut(z.start);
        let (zs, ys) = match z == y {
            true => (&mut own[..z.len()], None),
            false => {
                let (zs, ys) = own.split_at_mut(y.start - z.start);
                (&mut zs[..z.len()], Some(&mut ys[..y.len()]))
            }
        };
        add(pass.pool, self.activation, &before[body], &before[block], zs, ys);
    }

    /// dz = dy ⊙ act'(z) where it has a y of its own; d(body output) = dz.
    fn backward(&self, step: &Step, pass: &mut BackPass) {
        let (x, z, y) = (pass.region(step.input_region), pass.region(step.z_region), pass.region(step.output_region));
        if z != y {
            let (dzs, dys) = pass.dacts[z.start..y.end].split_at_mut(y.start - z.start);
            act_backward(pass.pool, self.activation, &pass.acts[z.clone()], &pass.acts[y.clone()], &dys[..y.len()], &mut dzs[..z.len()]);
        }
        if pass.needs_dx(step) {
            let (dxs, dzs) = split2_mut(pass.dacts, x, z);
            copy(pass.pool, dzs, dxs);
        }
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        let (body, block, z) = (pass.region(step.input_region), pass.region(skip(step)), pass.region(step.z_region));
        for i in 0..z.len() {
            pass.acts[z.start + i] = pass.acts[body.start + i] + pass.acts[block.start + i];
        }
        pass.activate(step, self.activation);
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        let (x, z, y) = (pass.region(step.input_region), pass.region(step.z_region), pass.region(step.output_region));
        if z != y {
            for i in 0..z.len() {
                let (zv, yv) = (pass.acts[z.start + i], pass.acts[y.start + i]);
                pass.dacts[z.start + i] = pass.dacts[y.start + i] * self.activation.derivative(zv, yv);
            }
        }
        if pass.needs_dx(step) {
            let dz = pass.dacts[z].to_vec();
            pass.dacts[x].copy_from_slice(&dz);
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, _mode: Mode) -> Result<()> {
        crate::cuda::layers::add_forward(pass, step, skip(step), self.activation)
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        crate::cuda::layers::add_backward(pass, step, self.activation)
    }
}

/// The other region of a Fork or Add step (`Step::skip`), which the plan always sets.
fn skip(step: &Step) -> usize {
    step.skip.expect("the plan gives a residual block's steps their other region")
}

/// Borrows `a` mutably and `b` (after it) shared from one buffer.
fn split2_mut<T>(buf: &mut [T], a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> (&mut [T], &[T]) {
    debug_assert!(a.end <= b.start);
    let (lo, hi) = buf.split_at_mut(b.start);
    (&mut lo[a], &hi[..b.end - b.start])
}

/// Values a thread takes at least.
const MIN_VALUES: usize = 16384;

/// z = a + b, then y = act(z) where given; spread over the pool.
fn add(pool: &Pool, act: Activation, a: &[f32], b: &[f32], z: &mut [f32], y: Option<&mut [f32]>) {
    let n = z.len();
    let z = SharedMut::new(z);
    let y = y.map(SharedMut::new);
    for_chunks(pool, n, MIN_VALUES, &|_, r| {
        // SAFETY: chunks are disjoint ranges.
        let zs = unsafe { z.slice(r.clone()) };
        zs.iter_mut().zip(&a[r.clone()]).zip(&b[r.clone()]).for_each(|((z, &a), &b)| *z = a + b);
        if let Some(y) = &y {
            // SAFETY: as above.
            act.apply_slice(zs, unsafe { y.slice(r) });
        }
    });
}

/// dacts[to] += dacts[from] (`from` after `to`), spread over the pool.
fn add_into(pool: &Pool, dacts: &mut [f32], from: std::ops::Range<usize>, to: std::ops::Range<usize>) {
    let (dst, src) = split2_mut(dacts, to, from);
    let n = dst.len();
    let dst = SharedMut::new(dst);
    for_chunks(pool, n, MIN_VALUES, &|_, r| {
        // SAFETY: chunks are disjoint ranges.
        unsafe { dst.slice(r.clone()) }.iter_mut().zip(&src[r]).for_each(|(d, &s)| *d += s);
    });
}

/// dst = src, spread over the pool.
fn copy(pool: &Pool, src: &[f32], dst: &mut [f32]) {
    let n = dst.len();
    let dst = SharedMut::new(dst);
    for_chunks(pool, n, MIN_VALUES, &|_, r| {
        // SAFETY: chunks are disjoint ranges.
        unsafe { dst.slice(r.clone()) }.copy_from_slice(&src[r]);
    });
}

#[cfg(test)]
mod tests {
    use super::super::gradcheck::fast_matches_spec_f32;
    use crate::activation::{Identity, Relu};
    use crate::chain::{Chain, Shape};

    /// Bodies of normalisations and dropout (the same bits as the plain loop), an empty body,
    /// nested blocks, and dense layers (their products summed in another order: within
    /// rounding).
    #[test]
    fn fast_matches_spec_on_odd_shapes() {
        let exact = [
            Chain::new(Shape::vector(6)).dropout(0.0).residual(|c| c.batch_norm_with(Relu).layer_norm()),
            Chain::new(Shape::sequence(3, 5)).dropout(0.0).residual_with(Relu, |c| c),
            Chain::new(Shape::image(2, 3, 5)).dropout(0.0).residual_with(Relu, |c| c.residual(|c| c.batch_norm()).dropout(0.5)),
        ];
        for chain in exact {
            fast_matches_spec_f32(chain, 5, 3, (0.0, 0.0));
        }
        let dense = Chain::new(Shape::vector(9)).dropout(0.0).residual(|c| c.dense(9, Relu).dense(9, Identity)).dense(4, Identity);
        fast_matches_spec_f32(dense, 19, 17, (1e-6, 1e-5));
    }
}
