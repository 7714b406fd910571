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

use crate::activation::Activation;
use crate::chain::{batch_len, Plan, Step};
use crate::cpu::gemm::GemmWorkspace;
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
use crate::error::{zeros, Result};
pub(crate) use dropout::Draw;
use kind::layers;
pub(crate) use kind::{Buffers, Kept, Mode, TensorSpec};
use std::ops::Range;

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

/// Borrows two ordered, disjoint ranges: the first shared, the second mutable.
pub(crate) fn split2<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    debug_assert!(a.end <= b.start);
    let (lo, hi) = buf.split_at_mut(b.start);
    (&lo[a], &mut hi[..b.end - b.start])
}

/// Scratch a forward pass needs beyond the activations, allocated once per cache.
pub(crate) struct Workspace {
    pub gemm: GemmWorkspace,
    pub cols: Vec<f32>,
    pub col_len: usize,
    /// A recurrent layer's weights as its fast passes read them (`recurrent::Dims::workspace_len`).
    pub rnn: Vec<f32>,
}

impl Workspace {
    /// A lowered sample's columns for each of `threads` threads; an error, not an abort, when
    /// they cannot be had.
    pub fn new(plan: &Plan, threads: usize) -> Result<Workspace> {
        let col_len = conv::max_col_len(plan);
        let cols = zeros(batch_len(threads, col_len, "convolution columns")?, || format!("the convolution columns of {threads} threads"))?;
        let rnn = zeros(recurrent::workspace_len(plan), || "the recurrent layers' weights".into())?;
        Ok(Workspace { gemm: GemmWorkspace::new(threads)?, cols, col_len, rnn })
    }

    /// No scratch: for a cache whose steps run on a GPU.
    pub fn none() -> Workspace {
        Workspace { gemm: GemmWorkspace::none(), cols: Vec::new(), col_len: 0, rnn: Vec::new() }
    }
}

/// Scratch a backward pass needs beyond the gradients: lowered-gradient columns and per-block
/// partial conv weight gradients (see `conv::backward`).
pub(crate) struct GradWorkspace {
    pub dcols: Vec<f32>,
    pub partials: Vec<f32>,
}

impl GradWorkspace {
    /// As [`Workspace::new`], for the backward pass: a lowered gradient's columns a thread, and
    /// the partial conv weight gradients of the sample blocks after the first
    /// ([`conv::wgrad_blocks`], fixed by the capacity, not the thread count).
    pub fn new(plan: &Plan, capacity: usize, threads: usize) -> Result<GradWorkspace> {
        let w_len = conv::steps(plan).map(Step::weight_len).max().unwrap_or(0);
        let dcols = batch_len(threads, conv::max_col_len(plan), "convolution gradient columns")?;
        let partials = batch_len(conv::wgrad_blocks(capacity) - 1, w_len, "partial weight gradients")?;
        Ok(GradWorkspace {
            dcols: zeros(dcols, || format!("the convolution gradient columns of {threads} threads"))?,
            partials: zeros(partials, || "the partial conv weight gradients".into())?,
        })
    }

    /// No scratch: for gradients computed on a GPU.
    pub fn none() -> GradWorkspace {
        GradWorkspace { dcols: Vec::new(), partials: Vec::new() }
    }
}

/// The buffers of one fast CPU forward pass over the first `batch` samples of a cache built
/// for `capacity`, as each step's [`LayerKind::forward`](kind::LayerKind::forward) takes them.
pub(crate) struct Pass<'a> {
    pub plan: &'a Plan,
    pub params: &'a [f32],
    pub acts: &'a mut [f32],
    pub capacity: usize,
    pub batch: usize,
    pub pool: &'a Pool,
    pub ws: &'a mut Workspace,
    /// The model's buffers (running statistics): written in training, read in inference.
    pub buffers: Buffers<'a>,
    /// Where a training pass draws dropout's masks.
    pub draw: Draw,
}

impl Pass<'_> {
    /// Values of region `r` for the batch.
    pub fn region(&self, r: usize) -> Range<usize> {
        region(self.plan, r, self.capacity, self.batch)
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

/// The fast forward: every step's output for the first `batch` samples.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    plan: &Plan,
    params: &[f32],
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
    let mut pass = Pass { plan, params, acts, capacity, batch, pool, ws, buffers, draw };
    for step in &plan.steps {
        step.layer.forward(step, &mut pass, mode);
    }
}

/// The buffers of one fast CPU backward pass, as each step's [`LayerKind::backward`](kind::LayerKind::backward) takes
/// them: `dacts` holds the gradient of every region computed so far (the loss's, in the last
/// step's output region, first).
pub(crate) struct BackPass<'a> {
    pub plan: &'a Plan,
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
/// gradient is not computed.
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
    let mut pass = BackPass { plan, params, acts, dacts, grads, capacity, batch, pool, ws, gws, draw };
    for step in plan.steps.iter().rev() {
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
    use std::path::Path;

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
        let engine = ["mod.rs", "kind.rs", "lowering.rs", "recurrent.rs", "spec.rs", "gradcheck.rs"];
        for entry in std::fs::read_dir(root.join("src/layers")).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            let registered = REGISTRY.iter().any(|kind| name == format!("{}.rs", kind.room));
            assert!(registered || engine.contains(&name.as_str()), "src/layers/{name} is neither a registered room nor the engine's");
        }
    }
}
