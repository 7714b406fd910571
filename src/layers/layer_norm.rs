//! Layer norm, as PyTorch's `nn.LayerNorm(features)`: each row (a vector sample's features, or
//! one time step's features of a sequence) of F values x is normalised over those values,
//!
//!   μ = Σx/F,  σ² = Σ(x − μ)²/F,  x̂ = (x − μ)·r  with r = 1/√(σ² + ε),  y = x̂·γ + β
//!
//! with ε = 1e-5, the same in training and inference. Tensors `weight` (γ, F, ones) and `bias`
//! (β, F, zeros). Each pass keeps every row's μ and r (two kept regions of one value a row) for
//! the backward pass, with g = dy·γ:
//!
//!   dx = r·(g − (Σg + x̂·Σg·x̂)·(1/F)),  dγ = Σ_rows dy·x̂,  dβ = Σ_rows dy
//!
//! Every sum is taken in f64 in a fixed order (a row's in feature order, a feature's in row
//! order), so none depends on the thread count.

use super::batch_norm::inv_std;
use super::kind::{Kept, LayerKind, Mode, TensorSpec};
use super::{split2, BackPass, Pass};
use crate::chain::{Chain, Fill, Shape, Step};
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;
use std::ops::Range;

/// Layer normalisation over a vector's features, or over each step's features of a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerNorm;

impl Chain {
    /// Layer normalisation (PyTorch's `nn.LayerNorm(features)`) over a vector's features, or
    /// over each time step's features of a sequence; the same in training and inference.
    pub fn layer_norm(self) -> Chain {
        self.layer(LayerNorm.into())
    }
}

/// (rows per sample, features per row) of a sample of `shape`, which the shape rule let through.
fn layout(shape: Shape) -> (usize, usize) {
    match shape {
        Shape::Vector(n) => (1, n),
        Shape::Sequence { steps, features } => (steps, features),
        _ => unreachable!("layer norm takes vectors and sequences"),
    }
}

impl LayerKind for LayerNorm {
    const WORD: &'static str = "layer_norm";

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        match input {
            Shape::Vector(_) | Shape::Sequence { .. } => Ok(input),
            _ => Err("layer norm needs a vector or a sequence (it normalises the last dimension)".into()),
        }
    }

    /// `weight` (γ) ones, `bias` (β) zeros, one each per feature.
    fn params(&self, input: Shape, _output: Shape) -> Vec<TensorSpec> {
        let features = layout(input).1;
        vec![
            TensorSpec { name: "weight", shape: vec![features], fill: Fill::Constant(1.0) },
            TensorSpec { name: "bias", shape: vec![features], fill: Fill::Constant(0.0) },
        ]
    }

    /// Each row's μ, then each row's r.
    fn kept(&self, input: Shape, _output: Shape) -> Option<Kept> {
        let rows = layout(input).0;
        Some(Kept { regions: vec![rows, rows], saved: 0 })
    }

    /// `layer_norm`
    fn describe(&self) -> String {
        Self::WORD.into()
    }

    fn parse(words: &Words) -> Result<LayerNorm> {
        match words.len() {
            1 => Ok(LayerNorm),
            _ => Err(words.unknown()),
        }
    }

    fn summary(&self, input: Shape) -> String {
        format!("LayerNorm({})", layout(input).1)
    }

    fn forward(&self, step: &Step, pass: &mut Pass, _mode: Mode) {
        let g = Geometry::of(step, pass.batch);
        let [weight, bias] = tensors(step);
        let (gamma, beta) = (&pass.params[weight], &pass.params[bias]);
        let (x, y, means, invs) = regions(step, |r| pass.region(r));
        let (acts, kept) = pass.acts.split_at_mut(means.start);
        let (xs, ys) = split2(acts, x, y);
        let (mean, inv) = kept[..invs.end - means.start].split_at_mut(means.len());
        forward(pass.pool, &g, xs, gamma, beta, ys, mean, &mut inv[invs.start - means.end..]);
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        let g = Geometry::of(step, pass.batch);
        let [weight, bias] = tensors(step);
        let (x, y, means, invs) = regions(step, |r| pass.region(r));
        let (xs, mean, inv) = (&pass.acts[x.clone()], &pass.acts[means], &pass.acts[invs]);
        let need_dx = pass.needs_dx(step);
        let (dxs, dys) = pass.dacts.split_at_mut(y.start);
        let dys = &dys[..y.len()];
        let (dgamma, dbeta) = pass.grads[step.params.clone()].split_at_mut(weight.len());
        param_grads(pass.pool, &g, xs, dys, mean, inv, dgamma, dbeta);
        if need_dx {
            input_grad(pass.pool, &g, xs, dys, mean, inv, &pass.params[weight], &mut dxs[x]);
        }
        debug_assert_eq!(bias.end, step.params.end);
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        let g = Geometry::of(step, pass.batch);
        let [weight, bias] = tensors(step);
        let (x, y, means, invs) = regions(step, |r| pass.region(r));
        for row in 0..g.rows() {
            let xs = &pass.acts[x.start + row * g.features..][..g.features];
            let mean = xs.iter().map(|v| v.f64()).sum::<f64>() / g.features as f64;
            let var = xs.iter().map(|v| (v.f64() - mean).powi(2)).sum::<f64>() / g.features as f64;
            let (mean, inv) = (F::of(mean), inv_std(F::of(var)));
            for f in 0..g.features {
                let xhat = (pass.acts[x.start + row * g.features + f] - mean) * inv;
                pass.acts[y.start + row * g.features + f] = xhat * pass.params[weight.start + f] + pass.params[bias.start + f];
            }
            (pass.acts[means.start + row], pass.acts[invs.start + row]) = (mean, inv);
        }
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        let g = Geometry::of(step, pass.batch);
        let [weight, bias] = tensors(step);
        let (x, y, means, invs) = regions(step, |r| pass.region(r));
        let dys = pass.dacts[y].to_vec();
        let at = |row: usize, f: usize| row * g.features + f;
        let xhat = |row: usize, f: usize| (pass.acts[x.start + at(row, f)] - pass.acts[means.start + row]) * pass.acts[invs.start + row];
        for f in 0..g.features {
            let (mut dg, mut db) = (0.0f64, 0.0f64);
            for row in 0..g.rows() {
                dg += dys[at(row, f)].f64() * xhat(row, f).f64();
                db += dys[at(row, f)].f64();
            }
            (pass.grads[weight.start + f], pass.grads[bias.start + f]) = (F::of(dg), F::of(db));
        }
        if !pass.needs_dx(step) {
            return;
        }
        let inv_f = F::of(1.0 / g.features as f64);
        for row in 0..g.rows() {
            let grad = |f: usize| dys[at(row, f)] * pass.params[weight.start + f];
            let sum: f64 = (0..g.features).map(|f| grad(f).f64()).sum();
            let sum_xhat: f64 = (0..g.features).map(|f| grad(f).f64() * xhat(row, f).f64()).sum();
            let (sum, sum_xhat, inv) = (F::of(sum), F::of(sum_xhat), pass.acts[invs.start + row]);
            let dx: Vec<F> = (0..g.features).map(|f| inv * (grad(f) - (sum + xhat(row, f) * sum_xhat) * inv_f)).collect();
            pass.dacts[x.start + at(row, 0)..][..g.features].copy_from_slice(&dx);
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, _mode: Mode) -> Result<()> {
        crate::cuda::layers::layer_norm_forward(pass, step)
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        crate::cuda::layers::layer_norm_backward(pass, step)
    }
}

/// The ranges of a layer-norm step's `weight` (γ) and `bias` (β).
pub(crate) fn tensors(step: &Step) -> [Range<usize>; 2] {
    let [weight, bias] = &step.tensors[..] else { unreachable!("a layer norm has a weight and a bias") };
    [weight.range.clone(), bias.range.clone()]
}

/// A layer-norm step's input, output, row means and row r for the batch (`region` of a pass).
pub(crate) fn regions(step: &Step, region: impl Fn(usize) -> Range<usize>) -> (Range<usize>, Range<usize>, Range<usize>, Range<usize>) {
    let means = step.kept.start;
    (region(step.input_region), region(step.output_region), region(means), region(means + 1))
}

/// The shape of one layer-norm pass: `batch` samples of `rows × features` values.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub rows_per_sample: usize,
    pub features: usize,
    pub batch: usize,
}

impl Geometry {
    pub fn of(step: &Step, batch: usize) -> Geometry {
        let (rows_per_sample, features) = layout(step.input);
        Geometry { rows_per_sample, features, batch }
    }

    /// Rows of the batch.
    pub fn rows(&self) -> usize {
        self.batch * self.rows_per_sample
    }
}

/// Rows a thread takes at least.
fn min_rows(g: &Geometry) -> usize {
    (4096 / g.features).max(1)
}

/// Every row's μ and r, and y; rows spread over the pool.
#[allow(clippy::too_many_arguments)]
fn forward(pool: &Pool, g: &Geometry, xs: &[f32], gamma: &[f32], beta: &[f32], ys: &mut [f32], mean: &mut [f32], inv: &mut [f32]) {
    let features = g.features;
    let (ys, mean, inv) = (SharedMut::new(ys), SharedMut::new(mean), SharedMut::new(inv));
    for_chunks(pool, g.rows(), min_rows(g), &|_, rows| {
        // SAFETY: chunks are disjoint row ranges.
        let ys = unsafe { ys.slice(rows.start * features..rows.end * features) };
        // SAFETY: as above.
        let (mean, inv) = unsafe { (mean.slice(rows.clone()), inv.slice(rows.clone())) };
        for (i, (x, y)) in
            xs[rows.start * features..rows.end * features].chunks_exact(features).zip(ys.chunks_exact_mut(features)).enumerate()
        {
            let mu = x.iter().map(|&v| f64::from(v)).sum::<f64>() / features as f64;
            let var = x.iter().map(|&v| (f64::from(v) - mu).powi(2)).sum::<f64>() / features as f64;
            let (m, r) = (mu as f32, inv_std(var as f32));
            for (((y, &x), &w), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
                *y = (x - m) * r * w + b;
            }
            (mean[i], inv[i]) = (m, r);
        }
    });
}

/// dγ = Σ_rows dy·x̂ and dβ = Σ_rows dy (overwritten), features spread over the pool.
#[allow(clippy::too_many_arguments)]
fn param_grads(pool: &Pool, g: &Geometry, xs: &[f32], dys: &[f32], mean: &[f32], inv: &[f32], dgamma: &mut [f32], dbeta: &mut [f32]) {
    let features = g.features;
    let (dgamma, dbeta) = (SharedMut::new(dgamma), SharedMut::new(dbeta));
    for_chunks(pool, features, 16, &|_, range| {
        // SAFETY: chunks are disjoint feature ranges.
        let (dgamma, dbeta) = unsafe { (dgamma.slice(range.clone()), dbeta.slice(range.clone())) };
        let (mut dg, mut db) = ([0.0f64; 64], [0.0f64; 64]);
        // 64 features at a time: their sums stay in registers while the rows stream by
        for start in (range.start..range.end).step_by(64) {
            let len = 64.min(range.end - start);
            dg[..len].fill(0.0);
            db[..len].fill(0.0);
            for row in 0..g.rows() {
                let (m, r) = (mean[row], inv[row]);
                let at = row * features + start;
                for (j, (&x, &dy)) in xs[at..at + len].iter().zip(&dys[at..at + len]).enumerate() {
                    dg[j] += f64::from(dy) * f64::from((x - m) * r);
                    db[j] += f64::from(dy);
                }
            }
            let out = start - range.start..start - range.start + len;
            dgamma[out.clone()].iter_mut().zip(&dg[..len]).for_each(|(o, &v)| *o = v as f32);
            dbeta[out].iter_mut().zip(&db[..len]).for_each(|(o, &v)| *o = v as f32);
        }
    });
}

/// dx = r·(g − (Σg + x̂·Σg·x̂)·(1/F)), g = dy·γ, per row (overwritten); rows spread over the pool.
#[allow(clippy::too_many_arguments)]
fn input_grad(pool: &Pool, g: &Geometry, xs: &[f32], dys: &[f32], mean: &[f32], inv: &[f32], gamma: &[f32], dxs: &mut [f32]) {
    let features = g.features;
    let inv_f = (1.0 / features as f64) as f32;
    let dxs = SharedMut::new(&mut dxs[..g.rows() * features]);
    for_chunks(pool, g.rows(), min_rows(g), &|_, rows| {
        // SAFETY: chunks are disjoint row ranges.
        let dxs = unsafe { dxs.slice(rows.start * features..rows.end * features) };
        for (row, dx) in rows.zip(dxs.chunks_exact_mut(features)) {
            let at = row * features..(row + 1) * features;
            let (x, dy, m, r) = (&xs[at.clone()], &dys[at], mean[row], inv[row]);
            let (mut sum, mut sum_xhat) = (0.0f64, 0.0f64);
            for ((&x, &dy), &w) in x.iter().zip(dy).zip(gamma) {
                sum += f64::from(dy * w);
                sum_xhat += f64::from(dy * w) * f64::from((x - m) * r);
            }
            let (sum, sum_xhat) = (sum as f32, sum_xhat as f32);
            for (((dx, &x), &dy), &w) in dx.iter_mut().zip(x).zip(dy).zip(gamma) {
                *dx = r * (dy * w - (sum + (x - m) * r * sum_xhat) * inv_f);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::gradcheck::fast_matches_spec_f32;
    use crate::chain::{Chain, Shape};

    /// One feature up to hundreds, a vector or a sequence's steps, batches below the capacity:
    /// the same bits as the plain loop.
    #[test]
    fn fast_matches_spec_on_odd_shapes() {
        let cases = [
            (Shape::vector(1), 3, 2),
            (Shape::vector(13), 5, 4),
            (Shape::sequence(5, 7), 3, 3),
            (Shape::sequence(1, 300), 4, 3),
            (Shape::sequence(40, 3), 9, 8),
            (Shape::vector(130), 37, 33),
        ];
        for (input, capacity, batch) in cases {
            fast_matches_spec_f32(Chain::new(input).dropout(0.0).layer_norm(), capacity, batch, (0.0, 0.0));
        }
    }
}
