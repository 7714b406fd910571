//! The plain-loop twin of the engine: the same plan and buffer layout, generic over the
//! scalar, written for clarity. The fast path is tested against it in f32, and gradients are
//! checked by finite differences on it in f64.

use super::{conv, conv_geometry, dense, pool, pool_geometry, region, split2};
use crate::chain::{Layer, Plan};
use crate::float::Float;

/// Forward pass over `batch` samples, as [`super::forward`].
pub fn forward<F: Float>(plan: &Plan, params: &[F], acts: &mut [F], capacity: usize, batch: usize) {
    for step in &plan.steps {
        let x = region(plan, step.input_region, capacity, batch);
        let z = region(plan, step.z_region, capacity, batch);
        let y = region(plan, step.output_region, capacity, batch);
        let (w_range, b_range) = step.weight_and_bias();
        let (w, b) = (&params[w_range], &params[b_range]);
        match step.layer {
            Layer::Dense { out_features, .. } => {
                let (xs, zs) = split2(acts, x, z.clone());
                dense::forward_spec(batch, step.input.len(), out_features, w, b, xs, zs);
            }
            Layer::Conv { .. } => {
                let (xs, zs) = split2(acts, x, z.clone());
                conv::forward_spec(&conv_geometry(step), batch, w, b, xs, zs);
            }
            Layer::MaxPool { .. } => {
                let (xs, ys) = split2(acts, x, y);
                pool::forward_spec(&pool_geometry(step), batch, xs, ys);
                continue;
            }
            Layer::Flatten => continue,
        }
        if z != y {
            let act = step.layer.activation();
            let (zs, ys) = split2(acts, z, y);
            ys.iter_mut().zip(zs).for_each(|(y, &z)| *y = act.apply(z));
        }
    }
}

/// Backward pass, as [`super::backward`]: `dacts` holds the loss gradient in the last output
/// region; `grads` is overwritten.
pub fn backward<F: Float>(plan: &Plan, params: &[F], acts: &[F], dacts: &mut [F], grads: &mut [F], capacity: usize, batch: usize) {
    for step in plan.steps.iter().rev() {
        let x = region(plan, step.input_region, capacity, batch);
        let z = region(plan, step.z_region, capacity, batch);
        let y = region(plan, step.output_region, capacity, batch);
        let dx = (step.input_region != 0).then_some(x.clone());
        match step.layer {
            Layer::Dense { .. } | Layer::Conv { .. } => {
                if z != y {
                    let act = step.layer.activation();
                    let (dys, dzs) = (dacts[y.clone()].to_vec(), &mut dacts[z.clone()]);
                    for i in 0..dzs.len() {
                        dzs[i] = dys[i] * act.derivative(acts[z.start + i], acts[y.start + i]);
                    }
                }
                let (w_range, _) = step.weight_and_bias();
                let (dw, db) = grads[step.params.clone()].split_at_mut(w_range.len());
                let dz = dacts[z].to_vec();
                let mut dx_buf = dx.as_ref().map(|r| vec![F::ZERO; r.len()]);
                let (w, xs) = (&params[w_range], &acts[x]);
                if let Layer::Dense { out_features, .. } = step.layer {
                    dense::backward_spec(batch, step.input.len(), out_features, w, xs, &dz, dw, db, dx_buf.as_deref_mut());
                } else {
                    conv::backward_spec(&conv_geometry(step), batch, w, xs, &dz, dw, db, dx_buf.as_deref_mut());
                }
                if let (Some(r), Some(buf)) = (dx, dx_buf) {
                    dacts[r].copy_from_slice(&buf);
                }
            }
            Layer::MaxPool { .. } => {
                if let Some(r) = dx {
                    let dys = dacts[y].to_vec();
                    pool::backward_spec(&pool_geometry(step), batch, &acts[x], &dys, &mut dacts[r]);
                }
            }
            Layer::Flatten => {}
        }
    }
}
