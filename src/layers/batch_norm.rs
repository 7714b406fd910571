//! Batch norm, as PyTorch's `nn.BatchNorm1d` over a vector's features (a batch (N, C)) or a
//! signal's channels ((N, C, L)), and `nn.BatchNorm2d` over an image's channels ((N, C, H, W)).
//! Per channel c, over its n = batch × pixels values x (a signal's pixels are its length):
//!
//!   training   μ = Σx/n,  σ² = Σ(x − μ)²/n,  y = ((x − μ)·r)·γ + β  with r = 1/√(σ² + ε);
//!              running_mean ← (1 − m)·running_mean + m·μ,
//!              running_var ← (1 − m)·running_var + m·Σ(x − μ)²/(n − 1)  (unbiased, as PyTorch),
//!              num_batches_tracked ← num_batches_tracked + 1
//!   inference  y = ((x − running_mean)·r)·γ + β  with r = 1/√(running_var + ε)
//!
//! then, where it takes one, an activation (`batch_norm_with(Relu)`: y above is its z), as a
//! dense layer's; in PyTorch a module of its own after the `BatchNorm`, as ResNet's
//! `bn → relu`.
//!
//! ε = 1e-5 and m = 0.1, PyTorch's defaults. Tensors `weight` (γ, C, ones) and `bias` (β, C,
//! zeros); buffers `running_mean` (C, zeros), `running_var` (C, ones) and `num_batches_tracked`
//! (a count, a 64-bit integer in a model file). The running statistics move in every training
//! pass (`backprop`, `train_step`), whether or not an optimiser steps, as they do in PyTorch.
//!
//! Training needs two values a channel or more (n ≥ 2), as in PyTorch: [`check_batch`]. A pass
//! keeps μ and r of each channel (saved values, 2·C a batch) for the backward pass:
//!
//!   x̂ = (x − μ)·r,  dβ = Σ dz,  dγ = Σ dz·x̂,  dx = (γ·r)·(dz − (dβ + x̂·dγ)·(1/n))
//!
//! with dz = dy ⊙ act'(z).
//!
//! The sums (μ, σ², dβ, dγ) are taken in f64, each channel's in sample order, so they do not
//! depend on the thread count.

use super::kind::{Kept, LayerKind, Mode, TensorSpec};
use super::{act_backward, split2, BackPass, Layer, Pass};
use crate::activation::Activation;
use crate::chain::{Chain, Fill, Plan, Shape, Step};
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
use crate::error::{Error, Result};
use crate::float::Float;
use crate::io::Words;
use std::ops::Range;

/// ε, added to the variance under the square root.
pub(crate) const EPS: f32 = 1e-5;
/// m, the running statistics' momentum.
pub(crate) const MOMENTUM: f32 = 0.1;

/// Batch normalisation per channel of an image or a signal, or per feature of a vector, then act.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNorm {
    pub activation: Activation,
}

impl Chain {
    /// Batch normalisation (PyTorch's `nn.BatchNorm1d` after a dense layer or a 1-D
    /// convolution, `nn.BatchNorm2d` after a 2-D one), ε = 1e-5: by the batch's statistics in training, which also move
    /// the running statistics (momentum 0.1, the unbiased variance) in every `backprop` and
    /// `train_step`, whether or not an optimiser steps, as in PyTorch; by the running
    /// statistics in inference (`forward`, `loss`, a `Server`). A training batch needs two
    /// values per channel or more (two samples after a dense layer), as in PyTorch.
    pub fn batch_norm(self) -> Chain {
        self.batch_norm_with(Activation::Identity)
    }

    /// [`Chain::batch_norm`], then `activation` (ResNet's `bn → relu`).
    pub fn batch_norm_with(self, activation: Activation) -> Chain {
        self.layer(BatchNorm { activation }.into())
    }
}

/// (channels, pixels per channel) of a sample of `shape`, which the shape rule let through.
fn layout(shape: Shape) -> (usize, usize) {
    match shape {
        Shape::Vector(n) => (n, 1),
        Shape::Image { channels, height, width } => (channels, height * width),
        Shape::Signal { channels, length } => (channels, length),
        _ => unreachable!("batch norm takes vectors, images and signals"),
    }
}

impl LayerKind for BatchNorm {
    const WORD: &'static str = "batch_norm";

    fn activation(&self) -> Option<Activation> {
        Some(self.activation)
    }

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        match input {
            Shape::Vector(_) | Shape::Image { .. } | Shape::Signal { .. } => Ok(input),
            _ => Err("batch norm needs a vector, an image or a signal (over each step of a sequence: layer_norm)".into()),
        }
    }

    /// `weight` (γ) ones, `bias` (β) zeros, one each per channel.
    fn params(&self, input: Shape, _output: Shape) -> Vec<TensorSpec> {
        let channels = layout(input).0;
        vec![
            TensorSpec { name: "weight", shape: vec![channels], fill: Fill::Constant(1.0) },
            TensorSpec { name: "bias", shape: vec![channels], fill: Fill::Constant(0.0) },
        ]
    }

    fn buffers(&self, input: Shape, _output: Shape) -> Vec<TensorSpec> {
        let channels = layout(input).0;
        vec![
            TensorSpec { name: "running_mean", shape: vec![channels], fill: Fill::Constant(0.0) },
            TensorSpec { name: "running_var", shape: vec![channels], fill: Fill::Constant(1.0) },
            TensorSpec { name: "num_batches_tracked", shape: Vec::new(), fill: Fill::Count },
        ]
    }

    /// μ and r of each channel, per batch.
    fn kept(&self, input: Shape, _output: Shape) -> Option<Kept> {
        Some(Kept { regions: Vec::new(), saved: layout(input).0.checked_mul(2)? })
    }

    /// `batch_norm ACTIVATION`
    fn describe(&self) -> String {
        format!("{} {}", Self::WORD, self.activation.name())
    }

    fn parse(words: &Words) -> Result<BatchNorm> {
        Ok(BatchNorm { activation: words.activation(1)? })
    }

    fn summary(&self, input: Shape) -> String {
        match input {
            Shape::Image { channels, .. } => format!("BatchNorm2d({channels})"),
            Shape::Signal { channels, .. } => format!("BatchNorm1d({channels})"),
            _ => format!("BatchNorm1d({})", input.len()),
        }
    }

    fn forward(&self, step: &Step, pass: &mut Pass, mode: Mode) {
        let g = Geometry::of(step, pass.batch);
        let [weight, bias] = tensors(step);
        let (gamma, beta) = (&pass.params[weight], &pass.params[bias]);
        let saved = pass.plan.saved_values(step, pass.capacity);
        let (x, z) = (pass.region(step.input_region), pass.region(step.z_region));
        let (acts, saved) = pass.acts.split_at_mut(saved.start);
        let (xs, zs) = split2(acts, x, z);
        let (mean, inv) = saved[..2 * g.channels].split_at_mut(g.channels);
        match mode {
            Mode::Train => {
                let [running_mean, running_var, count] = running_mut(step, pass.buffers.get_mut());
                batch_stats(pass.pool, &g, xs, mean, inv, running_mean, running_var);
                count[0] += 1.0;
            }
            Mode::Infer => {
                let buffers = pass.buffers.get();
                let (rm, rv) = (&buffers[step.buffers[0].range.clone()], &buffers[step.buffers[1].range.clone()]);
                for c in 0..g.channels {
                    (mean[c], inv[c]) = (rm[c], inv_std(rv[c]));
                }
            }
        }
        normalise(pass.pool, &g, xs, mean, inv, gamma, beta, zs);
        activate(pass, step, self.activation);
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        let g = Geometry::of(step, pass.batch);
        let [weight, bias] = tensors(step);
        let saved = pass.plan.saved_values(step, pass.capacity);
        let (mean, inv) = pass.acts[saved].split_at(g.channels);
        let (x, z, y) = (pass.region(step.input_region), pass.region(step.z_region), pass.region(step.output_region));
        if z != y {
            let (dzs, dys) = pass.dacts[z.start..y.end].split_at_mut(y.start - z.start);
            act_backward(pass.pool, self.activation, &pass.acts[z.clone()], &pass.acts[y.clone()], &dys[..y.len()], &mut dzs[..z.len()]);
        }
        let xs = &pass.acts[x.clone()];
        let need_dx = pass.needs_dx(step);
        let (dxs, dzs) = pass.dacts.split_at_mut(z.start);
        let dzs = &dzs[..z.len()];
        let (dgamma, dbeta) = pass.grads[step.params.clone()].split_at_mut(weight.len());
        param_grads(pass.pool, &g, xs, dzs, mean, inv, dgamma, dbeta);
        if need_dx {
            input_grad(pass.pool, &g, xs, dzs, mean, inv, &pass.params[weight], dgamma, dbeta, &mut dxs[x]);
        }
        debug_assert_eq!(bias.end, step.params.end);
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, mode: Mode) {
        let g = Geometry::of(step, pass.batch);
        let [weight, bias] = tensors(step);
        let saved = pass.plan.saved_values(step, pass.capacity);
        let (x, z) = (pass.region(step.input_region), pass.region(step.z_region));
        let (acts, saved) = pass.acts.split_at_mut(saved.start);
        let (xs, zs) = split2(acts, x, z);
        let (mean, inv) = saved[..2 * g.channels].split_at_mut(g.channels);
        for c in 0..g.channels {
            (mean[c], inv[c]) = match mode {
                Mode::Train => {
                    let (m, var, unbiased) = stats(&g, xs, c);
                    let rm = step.buffers[0].range.start + c;
                    let rv = step.buffers[1].range.start + c;
                    let keep = F::of(f64::from(1.0 - MOMENTUM));
                    pass.buffers[rm] = keep * pass.buffers[rm] + F::of(f64::from(MOMENTUM)) * F::of(m);
                    pass.buffers[rv] = keep * pass.buffers[rv] + F::of(f64::from(MOMENTUM)) * F::of(unbiased);
                    (F::of(m), inv_std(F::of(var)))
                }
                Mode::Infer => {
                    let (rm, rv) = (step.buffers[0].range.start + c, step.buffers[1].range.start + c);
                    (pass.buffers[rm], inv_std(pass.buffers[rv]))
                }
            };
            for (s, p) in g.values() {
                let i = g.at(s, c, p);
                zs[i] = (xs[i] - mean[c]) * inv[c] * pass.params[weight.start + c] + pass.params[bias.start + c];
            }
        }
        if mode == Mode::Train {
            pass.buffers[step.buffers[2].range.start] += F::ONE;
        }
        pass.activate(step, self.activation);
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        let g = Geometry::of(step, pass.batch);
        let [weight, bias] = tensors(step);
        let saved = pass.plan.saved_values(step, pass.capacity);
        let (x, z, y) = (pass.region(step.input_region), pass.region(step.z_region), pass.region(step.output_region));
        if z != y {
            for i in 0..z.len() {
                let (zv, yv) = (pass.acts[z.start + i], pass.acts[y.start + i]);
                pass.dacts[z.start + i] = pass.dacts[y.start + i] * self.activation.derivative(zv, yv);
            }
        }
        let dys = pass.dacts[z].to_vec();
        let xs = &pass.acts[x.clone()];
        let inv_n = F::of(1.0 / g.n() as f64);
        for c in 0..g.channels {
            let (mean, inv) = (pass.acts[saved.start + c], pass.acts[saved.start + g.channels + c]);
            let xhat = |i: usize| (xs[i] - mean) * inv;
            let (mut db, mut dg) = (0.0f64, 0.0f64);
            for (s, p) in g.values() {
                let i = g.at(s, c, p);
                db += dys[i].f64();
                dg += dys[i].f64() * xhat(i).f64();
            }
            let (db, dg) = (F::of(db), F::of(dg));
            (pass.grads[weight.start + c], pass.grads[bias.start + c]) = (dg, db);
            if pass.needs_dx(step) {
                let k = pass.params[weight.start + c] * inv;
                for (s, p) in g.values() {
                    let i = g.at(s, c, p);
                    pass.dacts[x.start + i] = k * (dys[i] - (db + xhat(i) * dg) * inv_n);
                }
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, mode: Mode) -> Result<()> {
        crate::cuda::layers::batch_norm_forward(pass, step, self.activation, mode)
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        crate::cuda::layers::batch_norm_backward(pass, step, self.activation)
    }
}

/// y = act(z) where the step has a y of its own, values spread over the pool.
fn activate(pass: &mut Pass, step: &Step, act: Activation) {
    let (z, y) = (pass.region(step.z_region), pass.region(step.output_region));
    if z == y {
        return;
    }
    let (zs, ys) = split2(pass.acts, z, y);
    let ys = SharedMut::new(ys);
    for_chunks(pass.pool, zs.len(), 16384, &|_, r| {
        // SAFETY: chunks are disjoint ranges.
        act.apply_slice(&zs[r.clone()], unsafe { ys.slice(r) });
    });
}

/// The ranges of a batch-norm step's `weight` (γ) and `bias` (β).
pub(crate) fn tensors(step: &Step) -> [Range<usize>; 2] {
    let [weight, bias] = &step.tensors[..] else { unreachable!("a batch norm has a weight and a bias") };
    [weight.range.clone(), bias.range.clone()]
}

/// The running mean, running variance and batch count of a step, in the model's buffers.
fn running_mut<'b>(step: &Step, buffers: &'b mut [f32]) -> [&'b mut [f32]; 3] {
    let [mean, var, count] = &step.buffers[..] else { unreachable!("a batch norm has three buffers") };
    debug_assert!(mean.range.end == var.range.start && var.range.end == count.range.start);
    let (mean_var, rest) = buffers[mean.range.start..count.range.end].split_at_mut(2 * mean.range.len());
    let (m, v) = mean_var.split_at_mut(mean.range.len());
    [m, v, rest]
}

/// r = 1/√(σ² + ε), the same expression on both devices.
pub(crate) fn inv_std<F: Float>(var: F) -> F {
    F::ONE / (var + F::of(f64::from(EPS))).sqrt()
}

/// The shape of one batch-norm pass: `batch` samples of `channels × pixels` values.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub channels: usize,
    pub pixels: usize,
    pub batch: usize,
}

impl Geometry {
    pub fn of(step: &Step, batch: usize) -> Geometry {
        let (channels, pixels) = layout(step.input);
        Geometry { channels, pixels, batch }
    }

    /// Values per channel: n.
    pub fn n(&self) -> usize {
        self.batch * self.pixels
    }

    /// Index of value (s, c, p) in the batch.
    fn at(&self, s: usize, c: usize, p: usize) -> usize {
        (s * self.channels + c) * self.pixels + p
    }

    /// (sample, pixel) of every value of a channel, in the order its sums are taken.
    #[cfg(test)]
    fn values(&self) -> impl Iterator<Item = (usize, usize)> {
        let pixels = self.pixels;
        (0..self.batch).flat_map(move |s| (0..pixels).map(move |p| (s, p)))
    }

    /// Channel c's values in sample `s`.
    fn row(&self, s: usize, c: usize) -> Range<usize> {
        let start = self.at(s, c, 0);
        start..start + self.pixels
    }
}

/// μ, σ² (biased) and Σ(x − μ)²/(n − 1) (unbiased) of channel c, in f64, summed in sample order.
fn stats<F: Float>(g: &Geometry, xs: &[F], c: usize) -> (f64, f64, f64) {
    let n = g.n() as f64;
    let mean = (0..g.batch).flat_map(|s| &xs[g.row(s, c)]).map(|x| x.f64()).sum::<f64>() / n;
    let squares: f64 = (0..g.batch).flat_map(|s| &xs[g.row(s, c)]).map(|x| (x.f64() - mean).powi(2)).sum();
    (mean, squares / n, squares / (n - 1.0))
}

/// Channels a thread takes at least, where the statistics and parameter gradients spread over
/// the pool.
const MIN_CHANNELS: usize = 4;

/// μ and r of every channel of the batch, and the running mean and variance moved by it,
/// channels spread over the pool.
#[allow(clippy::too_many_arguments)]
fn batch_stats(
    pool: &Pool,
    g: &Geometry,
    xs: &[f32],
    mean: &mut [f32],
    inv: &mut [f32],
    running_mean: &mut [f32],
    running_var: &mut [f32],
) {
    let (mean, inv) = (SharedMut::new(mean), SharedMut::new(inv));
    let (running_mean, running_var) = (SharedMut::new(running_mean), SharedMut::new(running_var));
    for_chunks(pool, g.channels, MIN_CHANNELS, &|_, channels| {
        // SAFETY: chunks are disjoint channel ranges.
        let (mean, inv) = unsafe { (mean.slice(channels.clone()), inv.slice(channels.clone())) };
        // SAFETY: as above.
        let (rm, rv) = unsafe { (running_mean.slice(channels.clone()), running_var.slice(channels.clone())) };
        for (i, c) in channels.enumerate() {
            let (mu, var, unbiased) = stats(g, xs, c);
            (mean[i], inv[i]) = (mu as f32, inv_std(var as f32));
            rm[i] = (1.0 - MOMENTUM) * rm[i] + MOMENTUM * mean[i];
            rv[i] = (1.0 - MOMENTUM) * rv[i] + MOMENTUM * unbiased as f32;
        }
    });
}

/// The inference map of a batch-norm step, after a layer that adds `bias` (a convolution's),
/// as one scale and shift a channel: x + b ↦ ((x + b − μ)·r)·γ + β = x·scale + shift with
///
///   scale = γ·r,  shift = (b − μ)·scale + β,   μ, r = the running mean, 1/√(running var + ε)
///
/// (the same map up to rounding: the fused inference of `layers/conv_fast.rs` is tested
/// against the steps one after the other).
pub(crate) fn inference_affine(step: &Step, params: &[f32], buffers: &[f32], bias: &[f32], scale: &mut [f32], shift: &mut [f32]) {
    let [weight, beta] = tensors(step);
    let (gamma, beta) = (&params[weight], &params[beta]);
    let (mean, var) = (&buffers[step.buffers[0].range.clone()], &buffers[step.buffers[1].range.clone()]);
    for c in 0..gamma.len() {
        scale[c] = gamma[c] * inv_std(var[c]);
        shift[c] = (bias[c] - mean[c]) * scale[c] + beta[c];
    }
}

/// y = ((x − μ)·r)·γ + β over the batch, samples spread over the pool.
#[allow(clippy::too_many_arguments)]
fn normalise(pool: &Pool, g: &Geometry, xs: &[f32], mean: &[f32], inv: &[f32], gamma: &[f32], beta: &[f32], ys: &mut [f32]) {
    let per_sample = g.channels * g.pixels;
    let ys = SharedMut::new(&mut ys[..g.batch * per_sample]);
    for_chunks(pool, g.batch, (8192 / per_sample).max(1), &|_, samples| {
        for s in samples {
            // SAFETY: chunks are disjoint sample ranges.
            let ys = unsafe { ys.slice(s * per_sample..(s + 1) * per_sample) };
            for c in 0..g.channels {
                let (m, r, w, b) = (mean[c], inv[c], gamma[c], beta[c]);
                let row = g.row(s, c);
                let offset = row.start - s * per_sample;
                for (y, &x) in ys[offset..offset + g.pixels].iter_mut().zip(&xs[row]) {
                    *y = (x - m) * r * w + b;
                }
            }
        }
    });
}

/// dγ = Σ dy·x̂ and dβ = Σ dy of every channel (overwritten), channels spread over the pool.
#[allow(clippy::too_many_arguments)]
fn param_grads(pool: &Pool, g: &Geometry, xs: &[f32], dys: &[f32], mean: &[f32], inv: &[f32], dgamma: &mut [f32], dbeta: &mut [f32]) {
    let (dgamma, dbeta) = (SharedMut::new(dgamma), SharedMut::new(dbeta));
    for_chunks(pool, g.channels, MIN_CHANNELS, &|_, channels| {
        // SAFETY: chunks are disjoint channel ranges.
        let (dgamma, dbeta) = unsafe { (dgamma.slice(channels.clone()), dbeta.slice(channels.clone())) };
        for (c, (dg, db)) in channels.zip(dgamma.iter_mut().zip(dbeta)) {
            let (m, r) = (mean[c], inv[c]);
            let (mut sum_dy, mut sum_dy_xhat) = (0.0f64, 0.0f64);
            for s in 0..g.batch {
                let row = g.row(s, c);
                for (&x, &dy) in xs[row.clone()].iter().zip(&dys[row]) {
                    sum_dy += f64::from(dy);
                    sum_dy_xhat += f64::from(dy) * f64::from((x - m) * r);
                }
            }
            (*dg, *db) = (sum_dy_xhat as f32, sum_dy as f32);
        }
    });
}

/// dx = (γ·r)·(dy − (dβ + x̂·dγ)·(1/n)) over the batch (overwritten), samples spread over the
/// pool.
#[allow(clippy::too_many_arguments)]
fn input_grad(
    pool: &Pool,
    g: &Geometry,
    xs: &[f32],
    dys: &[f32],
    mean: &[f32],
    inv: &[f32],
    gamma: &[f32],
    dgamma: &[f32],
    dbeta: &[f32],
    dxs: &mut [f32],
) {
    let per_sample = g.channels * g.pixels;
    let inv_n = (1.0 / g.n() as f64) as f32;
    let dxs = SharedMut::new(&mut dxs[..g.batch * per_sample]);
    for_chunks(pool, g.batch, (8192 / per_sample).max(1), &|_, samples| {
        for s in samples {
            // SAFETY: chunks are disjoint sample ranges.
            let dxs = unsafe { dxs.slice(s * per_sample..(s + 1) * per_sample) };
            for c in 0..g.channels {
                let (m, r, k, dg, db) = (mean[c], inv[c], gamma[c] * inv[c], dgamma[c], dbeta[c]);
                let row = g.row(s, c);
                let offset = row.start - s * per_sample;
                let dx = &mut dxs[offset..offset + g.pixels];
                for ((dx, &x), &dy) in dx.iter_mut().zip(&xs[row.clone()]).zip(&dys[row]) {
                    *dx = k * (dy - (db + (x - m) * r * dg) * inv_n);
                }
            }
        }
    });
}

/// Training a plan with batch norm on `batch` samples needs two values a channel or more (the
/// unbiased variance divides by n − 1; PyTorch refuses such a batch too): an [`Error::Shape`]
/// naming the first step that would not have them.
pub(crate) fn check_batch(plan: &Plan, batch: usize) -> Result<()> {
    for (index, step) in plan.steps.iter().enumerate().filter(|(_, s)| matches!(s.layer, Layer::BatchNorm(_))) {
        let n = Geometry::of(step, batch).n();
        if n < 2 {
            return Err(Error::Shape(format!(
                "layer {index} (batch norm) with input {} takes {n} value per channel from a batch of {batch}: training needs 2 or more",
                step.input
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::gradcheck::fast_matches_spec_f32;
    use crate::activation::{Identity, Relu, Tanh};
    use crate::chain::{Chain, Shape};

    /// Over channels and over features, two values a channel up to many, batches below the
    /// capacity: the same bits as the plain loop (with tanh, whose fast path is vectorised,
    /// within rounding).
    #[test]
    fn fast_matches_spec_on_odd_shapes() {
        let cases = [
            (Shape::vector(7), 6, 5),
            (Shape::vector(1), 3, 2),
            (Shape::image(3, 5, 7), 4, 3),
            (Shape::image(1, 1, 1), 2, 2),
            (Shape::image(9, 3, 3), 17, 17),
            (Shape::signal(3, 11), 4, 3),
        ];
        for (input, capacity, batch) in cases {
            for act in [Identity, Relu] {
                fast_matches_spec_f32(Chain::new(input).dropout(0.0).batch_norm_with(act), capacity, batch, (0.0, 0.0));
            }
            fast_matches_spec_f32(Chain::new(input).dropout(0.0).batch_norm_with(Tanh), capacity, batch, (1e-6, 1e-6));
        }
    }
}
