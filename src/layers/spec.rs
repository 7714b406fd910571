//! The plain-loop twin of the engine: the same plan and buffer layout, generic over the
//! scalar, written for clarity. The fast path is tested against it in f32, and gradients are
//! checked by finite differences on it in f64. Each room's `spec_forward` / `spec_backward` runs
//! its step; this file holds the passes and what dense and conv share.

use super::{region, split2, Draw, Mode};
use crate::activation::Activation;
use crate::chain::{Plan, Step};
use crate::float::Float;
use std::ops::Range;

/// The buffers of one plain-loop forward pass, as [`super::Pass`].
pub struct Pass<'a, F> {
    pub plan: &'a Plan,
    pub params: &'a [F],
    pub acts: &'a mut [F],
    pub capacity: usize,
    pub batch: usize,
    /// The model's buffers: read in inference, written in training.
    pub buffers: &'a mut [F],
    pub draw: Draw,
}

impl<F: Float> Pass<'_, F> {
    /// Values of region `r` for the batch.
    pub fn region(&self, r: usize) -> Range<usize> {
        region(self.plan, r, self.capacity, self.batch)
    }

    /// y = act(z) where the step has a y of its own.
    pub fn activate(&mut self, step: &Step, act: Activation) {
        let (z, y) = (self.region(step.z_region), self.region(step.output_region));
        if z != y {
            let (zs, ys) = split2(self.acts, z, y);
            ys.iter_mut().zip(zs).for_each(|(y, &z)| *y = act.apply(z));
        }
    }
}

/// Forward pass over `batch` samples, as [`super::forward`].
#[allow(clippy::too_many_arguments)]
pub fn forward<F: Float>(
    plan: &Plan,
    params: &[F],
    acts: &mut [F],
    capacity: usize,
    batch: usize,
    buffers: &mut [F],
    draw: Draw,
    mode: Mode,
) {
    let mut pass = Pass { plan, params, acts, capacity, batch, buffers, draw };
    for step in &plan.steps {
        step.layer.spec_forward(step, &mut pass, mode);
    }
}

/// The buffers of one plain-loop backward pass, as [`super::BackPass`].
pub struct BackPass<'a, F> {
    pub plan: &'a Plan,
    pub params: &'a [F],
    pub acts: &'a [F],
    pub dacts: &'a mut [F],
    pub grads: &'a mut [F],
    pub capacity: usize,
    pub batch: usize,
    pub draw: Draw,
}

impl<F: Float> BackPass<'_, F> {
    /// Values of region `r` for the batch.
    pub fn region(&self, r: usize) -> Range<usize> {
        region(self.plan, r, self.capacity, self.batch)
    }

    /// Whether the pass needs the gradient of the step's input: not of the model's input.
    pub fn needs_dx(&self, step: &Step) -> bool {
        step.input_region != 0
    }

    /// For a step with a weight, a bias and an activation: dz = dy ⊙ act'(z) where it has a y
    /// of its own, then `grads(w, x, dz, dW, db, dX)` with dW and db the step's gradients and dX
    /// where the pass needs it (zeroed, then copied into the input's gradient).
    #[allow(clippy::type_complexity)]
    pub fn weighted(&mut self, step: &Step, act: Activation, grads: impl FnOnce(&[F], &[F], &[F], &mut [F], &mut [F], Option<&mut [F]>)) {
        let (x, z, y) = (self.region(step.input_region), self.region(step.z_region), self.region(step.output_region));
        if z != y {
            let (dys, dzs) = (self.dacts[y.clone()].to_vec(), &mut self.dacts[z.clone()]);
            for i in 0..dzs.len() {
                dzs[i] = dys[i] * act.derivative(self.acts[z.start + i], self.acts[y.start + i]);
            }
        }
        let (w_range, _) = step.weight_and_bias();
        let dz = self.dacts[z].to_vec();
        let mut dx = self.needs_dx(step).then(|| vec![F::ZERO; x.len()]);
        let (dw, db) = self.grads[step.params.clone()].split_at_mut(w_range.len());
        grads(&self.params[w_range], &self.acts[x.clone()], &dz, dw, db, dx.as_deref_mut());
        if let Some(dx) = dx {
            self.dacts[x].copy_from_slice(&dx);
        }
    }
}

/// Backward pass, as [`super::backward`]: `dacts` holds the loss gradient in the last output
/// region; `grads` is overwritten.
#[allow(clippy::too_many_arguments)]
pub fn backward<F: Float>(
    plan: &Plan,
    params: &[F],
    acts: &[F],
    dacts: &mut [F],
    grads: &mut [F],
    capacity: usize,
    batch: usize,
    draw: Draw,
) {
    let mut pass = BackPass { plan, params, acts, dacts, grads, capacity, batch, draw };
    for step in plan.steps.iter().rev() {
        step.layer.spec_backward(step, &mut pass);
    }
}
