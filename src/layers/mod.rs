//! Layers: the registry of kinds below, one room per kind (`layers/<room>.rs`, with
//! `kernels/<room>.cu` beside it), and the CPU executor that runs a plan over flat buffers: the
//! fast path here, the plain loops it is tested against in `spec`. Each room implements
//! [`LayerKind`](kind::LayerKind) on its spec struct; the registry makes the public [`Layer`] enum and one
//! exhaustive `match` per operation, so a kind added to the registry that lacks an operation
//! does not compile.
//!
//! Buffers: `params`/`grads` in the plan's parameter layout; `acts`/`dacts` hold, per region
//! r, `capacity × plan.regions[r]` values, sample-major; a batch ≤ capacity uses the front.
//!
//! A new kind is a room (`layers/<room>.rs`: its spec struct and builder method, shape rule,
//! tensors, buffers and kept values, model-file words, summary row, plain loops, fast CPU path
//! and GPU launches), its kernels (`kernels/<room>.cu`, compiled in registry order) and a line
//! in the registry below. The plan (`src/plan.rs`) lays it out from what `LayerKind` declares;
//! nothing else names it.
//!
//! # How the kinds to come fit
//!
//! **Batch norm, layer norm, dropout and residual blocks** are in: `batch_norm.rs`,
//! `layer_norm.rs`, `dropout.rs` and `residual.rs` say how. Their passes read the model's
//! buffers ([`Buffers`]: batch norm's running statistics, which a training pass moves, as in
//! PyTorch, through the model's lock, so `backprop` keeps `&self`) and, in training, where
//! dropout draws its masks ([`Draw`]: the model's seed and its count of training passes; on a
//! GPU both live in device memory, so that a captured step draws new masks on each replay).
//! A count buffer (`num_batches_tracked`) is a `Fill::Count`: f32 in the flat buffers, an
//! integer in a model file.
//!
//! **Conv1d and MaxPool1d** (done) over a `Signal { channels, length }` (PyTorch's `(N, C, L)`;
//! see `chain.rs` for why not an `Image` of height 1): rooms `conv1d.rs` and `pool1d.rs`, weight
//! (out, in, k) and bias, stride, padding and dilation. `conv::Geometry` and the lowering
//! (`lowering.rs`) have a dilation and serve both convolutions; Conv1d runs the 2-D
//! convolution's code over a height of 1 on both devices (so it has no kernel file, and gets
//! cuDNN's measured routes), MaxPool1d (padding, dilation) kernels of its own.
//!
//! A kind may stand for more than one module of PyTorch's `nn.Sequential`
//! ([`LayerKind::modules`](kind::LayerKind::modules)): global average pooling is
//! `AdaptiveAvgPool2d(1)` then `Flatten`, two.
//!
//! **GRU and LSTM** over a `Sequence { steps, features }`: tensors `weight_ih_l0` (G·H,
//! features), `weight_hh_l0` (G·H, H), `bias_ih_l0`, `bias_hh_l0` (G·H), G = 3 (GRU, gates r, z,
//! n) or 4 (LSTM, i, f, g, o) in PyTorch's order; output a sequence (steps, H), or a vector (H)
//! with the last step only; kept regions per sample: every step's gates (steps × G·H, the GRU's
//! recurrent product of n apart, as its reset gate multiplies it), every step's hidden state
//! where the output does not hold it, and the LSTM's cell states (steps × H), which
//! backpropagation through time reads. The
//! input products of all steps are one GEMM into the gates region, the recurrent ones a GEMM per
//! step. The initial state (zeros, or set by the caller) and the state that streaming inference
//! carries between calls are a kept region the cache exposes (a per-sample value, not a
//! buffer: each cache has its own).
//!
//! **Residual blocks**: a hidden `Fork` step, the body, and an `Add` step, in the plan as it
//! is (see `src/plan.rs`); `Fork` is a view and `Add` a room with no tensors.

pub mod avgpool;
pub mod batch_norm;
pub mod conv;
pub mod conv1d;
mod conv_fast;
pub mod dense;
pub mod dropout;
pub mod flatten;
pub mod globalpool;
#[cfg(test)]
mod gradcheck;
pub mod gru;
pub(crate) mod kind;
pub mod layer_norm;
mod lowering;
pub mod lstm;
pub mod pool;
pub mod pool1d;
pub(crate) mod recurrent;
pub mod residual;
pub mod softmax;
#[cfg(test)]
pub mod spec;
mod workspace;

use crate::activation::Activation;
use crate::chain::{Plan, Step};
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
#[cfg(feature = "cuda")]
pub(crate) use conv_fast::Fused;
pub(crate) use dropout::Draw;
use kind::layers;
pub(crate) use kind::{Buffers, Kept, Mode, TensorSpec};
use std::ops::Range;
#[cfg(test)]
pub(crate) use workspace::StepCache;
pub(crate) use workspace::{GradWorkspace, Workspace};

layers! {
    /// y = act(W·x + b) (PyTorch's `nn.Linear`, then the activation).
    Dense(dense::Dense, "dense.cu"),
    /// 2-D cross-correlation with stride and zero padding, then act (`nn.Conv2d`).
    Conv(conv::Conv, "conv.cu"),
    /// The maximum of each window (`nn.MaxPool2d`).
    MaxPool(pool::MaxPool, "pool.cu"),
    /// Image (C, H, W) → vector (C·H·W), in that order; no data moves (`nn.Flatten`).
    Flatten(flatten::Flatten, none),
    /// Per channel (or feature), normalised by the batch's statistics in training and the
    /// running ones in inference, then scaled and shifted (`nn.BatchNorm1d`, `nn.BatchNorm2d`).
    BatchNorm(batch_norm::BatchNorm, "batch_norm.cu"),
    /// Each sample's features (each step's, in a sequence) normalised, scaled and shifted
    /// (`nn.LayerNorm`).
    LayerNorm(layer_norm::LayerNorm, "layer_norm.cu"),
    /// Zeroes each value with probability p and scales the rest by 1/(1 − p) in training; the
    /// identity in inference (`nn.Dropout`).
    Dropout(dropout::Dropout, "dropout.cu"),
    /// Opens a residual block (`Chain::residual`): its output is its input, seen again.
    Fork(residual::Fork, none),
    /// Closes a residual block: the body's output plus the block's input, then act.
    Add(residual::Add, "residual.cu"),
    /// The mean of each window (`nn.AvgPool2d`).
    AvgPool(avgpool::AvgPool, "avgpool.cu"),
    /// 1-D cross-correlation over a signal with stride, zero padding and dilation, then act
    /// (`nn.Conv1d`); it runs the 2-D convolution's kernels (`conv.cu`) over a height of 1.
    Conv1d(conv1d::Conv1d, none),
    /// The maximum of each window of a signal (`nn.MaxPool1d`).
    MaxPool1d(pool1d::MaxPool1d, "pool1d.cu"),
    /// Probabilities over a vector's features (`nn.Softmax(dim=1)`).
    Softmax(softmax::Softmax, "softmax.cu"),
    /// The mean of each channel: image (C, H, W) or signal (C, L) → vector (C)
    /// (`nn.AdaptiveAvgPool2d(1)` or `1d`, then `nn.Flatten`).
    GlobalAvgPool(globalpool::GlobalAvgPool, "globalpool.cu"),
    /// A GRU over a sequence (`nn.GRU`, one layer, batch first).
    Gru(gru::Gru, "gru.cu"),
    /// An LSTM over a sequence (`nn.LSTM`, one layer, batch first).
    Lstm(lstm::Lstm, "lstm.cu"),
}

/// Values of region `r` for `batch` samples, in a buffer built for `capacity`.
pub(crate) fn region(plan: &Plan, r: usize, capacity: usize, batch: usize) -> Range<usize> {
    let start = plan.region_offset(r, capacity);
    start..start + batch * plan.regions[r]
}

/// As [`region`], for a pass over a block of samples (see [`forward`]): from sample `first` of
/// the model's input and output regions, from sample 0 of every other, where each block in turn
/// holds its values; or with no block, from sample 0 of every region.
pub(crate) fn block_region(plan: &Plan, r: usize, capacity: usize, batch: usize, block: Option<usize>) -> Range<usize> {
    let range = region(plan, r, capacity, batch);
    let output = plan.steps.last().map_or(0, |s| s.output_region);
    let first = block.filter(|_| r == 0 || r == output).unwrap_or(0);
    let shift = first * plan.regions[r];
    range.start + shift..range.end + shift
}

/// Borrows two ordered, disjoint ranges: the first shared, the second mutable.
pub(crate) fn split2<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    debug_assert!(a.end <= b.start);
    let (lo, hi) = buf.split_at_mut(b.start);
    (&lo[a], &mut hi[..b.end - b.start])
}

/// The buffers of one fast CPU forward pass over the first `batch` samples of a cache built
/// for `capacity`, as each step's [`LayerKind::forward`](kind::LayerKind::forward) takes them.
pub(crate) struct Pass<'a> {
    pub plan: &'a Plan,
    /// The step running: its index in the plan.
    pub index: usize,
    pub params: &'a [f32],
    pub acts: &'a mut [f32],
    pub capacity: usize,
    pub batch: usize,
    /// In an inference pass run block by block, the block's first sample ([`block_region`]).
    pub block: Option<usize>,
    pub pool: &'a Pool,
    pub ws: &'a mut Workspace,
    /// The model's buffers (running statistics): written in training, read in inference.
    pub buffers: Buffers<'a>,
    /// Where a training pass draws dropout's masks.
    pub draw: Draw,
}

impl Pass<'_> {
    /// Values of region `r` for the batch (or the block: [`block_region`]).
    pub fn region(&self, r: usize) -> Range<usize> {
        block_region(self.plan, r, self.capacity, self.batch, self.block)
    }

    /// z[s, c, p] += bias[c] over the step's z, `layout` = (channels, pixels per channel) of a
    /// sample; then y = act(z) where the step has a y of its own (an activation).
    pub fn bias_act(&mut self, step: &Step, act: Activation, bias: Range<usize>, (channels, pixels): (usize, usize)) {
        let (z, y) = (self.region(step.z_region), self.region(step.output_region));
        let b = &self.params[bias];
        if z == y {
            bias_act(self.pool, act, b, channels, pixels, self.batch, &mut self.acts[z], None);
        } else {
            let (zs, ys) = self.acts[z.start..y.end].split_at_mut(y.start - z.start);
            bias_act(self.pool, act, b, channels, pixels, self.batch, zs, Some(&mut ys[..]));
        }
    }
}

/// The fast forward: every step's output for the first `batch` samples. `version` names the
/// values of `params` (`Model::version`), which the workspace's packed weights are checked
/// against ([`Workspace`]).
///
/// An inference pass over more samples than the workspace's block ([`Workspace::block`]) runs
/// block by block, each through every step, its values in the first samples of every region
/// but the model's input and output: a block's activations then stay in cache from one step to
/// the next, where the whole batch's would go to memory and back between steps. Only the
/// output is defined after it. No block is of one sample (a last one joins the block before),
/// so every block takes the convolutions' routes of the whole batch, and a sample's outputs
/// have the bits they have in a pass over the whole batch at once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    plan: &Plan,
    (params, version): (&[f32], u64),
    acts: &mut [f32],
    capacity: usize,
    batch: usize,
    pool: &Pool,
    ws: &mut Workspace,
    buffers: Buffers,
    draw: Draw,
    mode: Mode,
) {
    debug_assert!(mode == Mode::Infer || matches!(buffers, Buffers::Write(_)), "training writes the buffers");
    ws.prepare(plan, params, version, pool, mode);
    let size = if mode == Mode::Infer { ws.block() } else { batch };
    let mut pass = Pass { plan, index: 0, params, acts, capacity, batch, block: None, pool, ws, buffers, draw };
    let mut first = 0;
    while first < batch {
        // a block of `size`, with a last one of a single sample joined to it
        let rest = batch - first;
        let samples = if rest <= size.saturating_add(1) { rest } else { size };
        (pass.batch, pass.block) = (samples, (samples < batch).then_some(first));
        for (index, step) in plan.steps.iter().enumerate() {
            if mode == Mode::Infer && pass.ws.taken_in(index) {
                continue;
            }
            pass.index = index;
            step.layer.forward(step, &mut pass, mode);
        }
        first += samples;
    }
}

/// The buffers of one fast CPU backward pass, as each step's [`LayerKind::backward`](kind::LayerKind::backward) takes
/// them: `dacts` holds the gradient of every region computed so far (the loss's, in the last
/// step's output region, first).
pub(crate) struct BackPass<'a> {
    pub plan: &'a Plan,
    /// The step running: its index in the plan.
    pub index: usize,
    pub params: &'a [f32],
    pub acts: &'a [f32],
    pub dacts: &'a mut [f32],
    pub grads: &'a mut [f32],
    pub capacity: usize,
    pub batch: usize,
    pub pool: &'a Pool,
    pub ws: &'a mut Workspace,
    pub gws: &'a mut GradWorkspace,
    /// Where the training pass drew dropout's masks.
    pub draw: Draw,
}

/// What the weight and input gradients of a step with a weight, a bias and an activation (dense,
/// conv) read and write, once [`BackPass::weighted`] has made its dz and db.
pub(crate) struct Weighted<'p> {
    pub pool: &'p Pool,
    pub ws: &'p mut Workspace,
    pub gws: &'p mut GradWorkspace,
    pub batch: usize,
    pub w: &'p [f32],
    pub x: &'p [f32],
    pub dz: &'p [f32],
    pub dw: &'p mut [f32],
    /// Where the pass needs the input gradient.
    pub dx: Option<&'p mut [f32]>,
}

impl BackPass<'_> {
    /// Values of region `r` for the batch.
    pub fn region(&self, r: usize) -> Range<usize> {
        region(self.plan, r, self.capacity, self.batch)
    }

    /// Whether the pass needs the gradient of the step's input: not of the model's input.
    pub fn needs_dx(&self, step: &Step) -> bool {
        step.input_region != 0
    }

    /// For a step whose tensors are a weight and a bias and whose output is act(z): dz = dy ⊙
    /// act'(z) where it has a y of its own, db[c] = Σ_{s,p} dz[s, c, p] (`layout` = (channels,
    /// pixels per channel) of a sample); then the rest of its gradients' operands.
    pub fn weighted(&mut self, step: &Step, act: Activation, (channels, pixels): (usize, usize)) -> Weighted<'_> {
        let (x, z, y) = (self.region(step.input_region), self.region(step.z_region), self.region(step.output_region));
        let need_dx = self.needs_dx(step);
        let (acts, dacts) = (self.acts, &mut *self.dacts);
        if z != y {
            let (dzs, dys) = dacts[z.start..y.end].split_at_mut(y.start - z.start);
            act_backward(self.pool, act, &acts[z.clone()], &acts[y.clone()], &dys[..y.len()], &mut dzs[..z.len()]);
        }
        let (w_range, _) = step.weight_and_bias();
        let (dw, db) = self.grads[step.params.clone()].split_at_mut(w_range.len());
        let (dxs, dzs) = dacts.split_at_mut(z.start);
        let dz = &dzs[..z.len()];
        bias_grad(channels, pixels, self.batch, dz, db);
        Weighted {
            pool: self.pool,
            ws: &mut *self.ws,
            gws: &mut *self.gws,
            batch: self.batch,
            w: &self.params[w_range],
            x: &acts[x.clone()],
            dz,
            dw,
            dx: need_dx.then(|| &mut dxs[x]),
        }
    }
}

/// The fast backward. `dacts` holds the loss gradient in the last step's output region;
/// fills `grads` (overwriting) and every needed activation gradient. The model input's
/// gradient is not computed. `ws` has served the forward pass of these parameters (its packed
/// weights are theirs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    plan: &Plan,
    params: &[f32],
    acts: &[f32],
    dacts: &mut [f32],
    grads: &mut [f32],
    capacity: usize,
    batch: usize,
    pool: &Pool,
    ws: &mut Workspace,
    gws: &mut GradWorkspace,
    draw: Draw,
) {
    let mut pass = BackPass { plan, index: 0, params, acts, dacts, grads, capacity, batch, pool, ws, gws, draw };
    for (index, step) in plan.steps.iter().enumerate().rev() {
        pass.index = index;
        step.layer.backward(step, &mut pass);
    }
}

/// z[s, c, p] += b[c]; y = act(z) when `y` is given (else the activation is the identity).
/// Both passes run over a block of samples at a time, so the activation reads z from L1.
#[allow(clippy::too_many_arguments)]
fn bias_act(pool: &Pool, act: Activation, b: &[f32], channels: usize, pixels: usize, batch: usize, z: &mut [f32], y: Option<&mut [f32]>) {
    /// Values of z per block: z and y together take 16 KiB, within every L1.
    const BLOCK: usize = 2048;
    let per_sample = channels * pixels;
    let block = (BLOCK / per_sample).max(1) * per_sample;
    let z = SharedMut::new(&mut z[..batch * per_sample]);
    let y = y.map(|y| SharedMut::new(&mut y[..batch * per_sample]));
    for_chunks(pool, batch, (8192 / per_sample).max(1), &|_, samples| {
        let range = samples.start * per_sample..samples.end * per_sample;
        // SAFETY: chunks are disjoint sample ranges.
        let zs = unsafe { z.slice(range.clone()) };
        // SAFETY: as above.
        let mut ys = y.as_ref().map(|y| unsafe { y.slice(range) });
        for (i, zs) in zs.chunks_mut(block).enumerate() {
            for sample in zs.chunks_exact_mut(per_sample) {
                if pixels == 1 {
                    // a dense layer: one bias per value, added as a vector
                    sample.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                } else {
                    for (c, row) in sample.chunks_exact_mut(pixels).enumerate() {
                        row.iter_mut().for_each(|v| *v += b[c]);
                    }
                }
            }
            if let Some(ys) = ys.as_deref_mut() {
                act.apply_slice(zs, &mut ys[i * block..][..zs.len()]);
            }
        }
    });
}

/// dz = dy ⊙ act'(z), element-wise, spread over the pool.
fn act_backward(pool: &Pool, act: Activation, z: &[f32], y: &[f32], dy: &[f32], dz: &mut [f32]) {
    let n = dz.len();
    let dz = SharedMut::new(dz);
    for_chunks(pool, n, 16384, &|_, r| {
        // SAFETY: chunks are disjoint element ranges.
        let dz = unsafe { dz.slice(r.clone()) };
        act.backward_slice(&z[r.clone()], &y[r.clone()], &dy[r], dz);
    });
}

/// db[c] = Σ_{s,p} dz[s, c, p], in a fixed order.
fn bias_grad(channels: usize, pixels: usize, batch: usize, dz: &[f32], db: &mut [f32]) {
    db.fill(0.0);
    for sample in dz[..batch * channels * pixels].chunks_exact(channels * pixels) {
        if pixels == 1 {
            db.iter_mut().zip(sample).for_each(|(d, v)| *d += v);
        } else {
            for (d, row) in db.iter_mut().zip(sample.chunks_exact(pixels)) {
                *d += lane_sum(row);
            }
        }
    }
}

/// Σ row with 8 partial sums (lane l takes the values at l mod 8), then the lanes and the
/// tail in a fixed order: vectorises (a plain `sum` is one serial chain of adds) and stays
/// deterministic.
pub(crate) fn lane_sum(row: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(s, &v)| *s += v);
    }
    lanes.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::REGISTRY;
    use crate::prelude::*;
    use crate::testutil::Rng;
    use std::path::Path;

    /// A cache's packed weights follow the parameters' version: served as they are while
    /// nothing changed (poisoned, they show in the outputs), repacked after any change (a
    /// `parameters_mut` borrow, `set_parameters`, an update), a dense layer's from the second
    /// pass on, with the first pass's bits; the outputs are a new cache's, bit for bit. A copy of
    /// the model with the same values is served the same packed weights, and the original,
    /// changed, gets its own again.
    #[test]
    fn packed_weights_follow_the_parameter_version() {
        let conv = Chain::new(Input::image(2, 8, 8)).conv(3, (3, 3), Tanh).flatten().dense(4, Identity);
        let dense = Chain::new(Input::vector(128)).dense(40, Relu).dense(4, Identity);
        for chain in [conv, dense] {
            let mut model = chain.build().unwrap().init(Init::HeNormal, 5).with_threads(1).unwrap();
            let x = Rng::new(6).uniform(2 * 128);
            let bits =
                |model: &Model, cache: &mut Cache| -> Vec<u32> { model.forward(cache).unwrap().iter().map(|v| v.to_bits()).collect() };
            let fresh = |model: &Model| {
                let mut cache = model.preallocate(2).unwrap();
                cache.set_inputs(&x).unwrap();
                bits(model, &mut cache)
            };
            let mut cache = model.preallocate(2).unwrap();
            cache.set_inputs(&x).unwrap();
            let first = bits(&model, &mut cache);
            assert_eq!(first, fresh(&model));
            assert_eq!(bits(&model, &mut cache), first, "packed on the second pass");
            let poisoned = |model: &Model, cache: &mut Cache| {
                cache.ws.poison_packed();
                model.forward(cache).unwrap().iter().all(|v| v.is_nan())
            };
            assert!(poisoned(&model, &mut cache), "repacked with nothing changed");
            model.parameters_mut().unwrap();
            assert_eq!(bits(&model, &mut cache), first, "not repacked after a parameters_mut borrow");
            assert_eq!(bits(&model, &mut cache), first, "not repacked on the second pass after it");

            model.parameters_mut().unwrap().iter_mut().for_each(|p| *p *= 1.5);
            let changed = bits(&model, &mut cache);
            assert_ne!(changed, first);
            assert_eq!(changed, fresh(&model), "after a write through parameters_mut");
            let values: Vec<f32> = model.parameters().unwrap().iter().map(|v| v * 0.5).collect();
            model.set_parameters(&values).unwrap();
            assert_eq!(bits(&model, &mut cache), fresh(&model), "after set_parameters");
            let mut grads = model.preallocate_grads(2).unwrap();
            let mut opt = Optimizer::new(&model, Optim::sgd(0.1, 0.0)).unwrap();
            cache.set_labels(&[1, 3]).unwrap();
            opt.train_step(&mut model, &mut grads, &mut cache, Loss::LogitCrossEntropy).unwrap();
            let trained = bits(&model, &mut cache);
            assert_eq!(trained, fresh(&model), "after an update");
            assert_eq!(bits(&model, &mut cache), trained, "packed after an update");

            let copy = model.clone();
            assert!(poisoned(&copy, &mut cache), "the copy's values were repacked");
            model.parameters_mut().unwrap()[1] += 0.5;
            assert_eq!(bits(&model, &mut cache), fresh(&model), "the changed original on the copy's cache");
            assert_eq!(bits(&model, &mut cache), fresh(&model), "the changed original, packed");
            assert_eq!(bits(&copy, &mut cache), trained, "the copy after the original");
            assert_eq!(bits(&copy, &mut cache), trained, "the copy after the original, packed");
        }
    }

    /// `Cache::routes` names every layer with weights and each convolution's route per
    /// direction and batch bucket, the backward's once gradient buffers were made; a model on
    /// another thread count takes the same routes (chosen once per process).
    #[test]
    fn the_routes_report_names_each_layers_kernel() {
        let model = crate::models::lenet5().build().unwrap().with_threads(1).unwrap();
        let cache = model.preallocate(4).unwrap();
        let lines = |report: &str| report.lines().filter(|l| l.starts_with("step ")).map(str::to_string).collect::<Vec<_>>();
        let report = cache.routes();
        assert!(report.starts_with("CPU, ") && report.contains("1 thread, batches up to 4"), "{report}");
        let steps = lines(&report);
        let (convs, denses) = (steps.iter().filter(|l| l.contains("Conv(")).count(), steps.iter().filter(|l| l.contains("Dense(")).count());
        assert_eq!((convs, denses, steps.len()), (2, 3, 5), "{report}");
        for line in steps.iter().filter(|l| l.contains("Conv(")) {
            for bucket in ["batch 1: forward ", "batch 2+: forward "] {
                let after = &line[line.find(bucket).unwrap_or_else(|| panic!("{line}")) + bucket.len()..];
                assert!(after.starts_with("direct ") || after.starts_with("lowered "), "{line}");
            }
        }
        let dense = ": Z = X·Wᵀ, Wᵀ packed once (training passes of up to 4 samples: W read in place)";
        assert!(steps.iter().all(|l| !l.contains("Dense(") || l.ends_with(dense)), "{report}");
        let _grads = model.preallocate_grads(4).unwrap();
        let timed = cache.routes();
        assert!(!timed.contains("not timed") && timed.matches("backward ").count() == 4, "{timed}");
        let other = model.with_threads(2).unwrap();
        assert_eq!(lines(&other.preallocate(4).unwrap().routes()), lines(&timed));
    }

    /// Every kind in the registry has its room, `src/layers/<room>.rs`, and, unless the registry
    /// says it needs none, its kernels beside it, `kernels/<room>.cu`; every file in
    /// `src/layers/` is a registered room or a part of the engine named here.
    #[test]
    fn every_registered_kind_has_its_room_and_kernels() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        for kind in REGISTRY {
            let room = root.join("src/layers").join(format!("{}.rs", kind.room));
            assert!(room.is_file(), "{}: no room {}", kind.kind, room.display());
            if let Some(file) = kind.kernels {
                assert_eq!(file, format!("{}.cu", kind.room), "{}: its kernels are not beside its room", kind.kind);
                assert!(root.join("kernels").join(file).is_file(), "{}: no kernels/{file}", kind.kind);
            }
        }
        let engine = [
            "mod.rs",
            "kind.rs",
            "lowering.rs",
            "recurrent.rs",
            "recurrent",
            "spec.rs",
            "gradcheck.rs",
            "conv_fast.rs",
            "conv_fast",
            "workspace.rs",
        ];
        for entry in std::fs::read_dir(root.join("src/layers")).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            let registered = REGISTRY.iter().any(|kind| name == format!("{}.rs", kind.room));
            assert!(registered || engine.contains(&name.as_str()), "src/layers/{name} is neither a registered room nor the engine's");
        }
    }
}
