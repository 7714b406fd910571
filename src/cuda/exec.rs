//! A plan run on the GPU: the twin of `layers::forward` / `layers::backward` and the loss, with
//! the same buffers in the same layout (region r of a capacity-`capacity` activation buffer
//! holds `capacity × plan.regions[r]` values, sample-major; a batch uses the front).
//!
//! Everything here only enqueues work on one stream (kernels and cuBLAS calls), so it can be
//! captured into a CUDA graph; nothing allocates, copies from the host or synchronises.

use super::blas::{Blas, DevMat, DevMatMut};
use super::buffer::DevBuf;
use super::context::Gpu;
use super::dnn::Dnn;
use super::head::{Head, HeadBuffers};
use super::launch::{View, ViewMut};
use super::ops::{DenseEpilogue, PANEL_MAX_K};
use super::pinned::Event;
use super::wgrad::Job;
use crate::activation::Activation;
use crate::chain::{Layer, Plan, Step};
use crate::error::Result;
use crate::layers::{region, Mode};
use crate::loss::Loss;
use cudarc::driver::{sys, CudaStream};
use std::ops::Range;

/// A buffer's address and length, from which views of disjoint regions are taken.
///
/// The plan's regions never overlap (input, z and output of a step are distinct regions, see
/// `Plan::new`), and each kernel below reads and writes the regions its CPU twin does, so the
/// views taken at once never alias a written range.
#[derive(Clone, Copy)]
pub(super) struct Raw {
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl Raw {
    pub(super) fn of<T>(buf: &DevBuf<T>) -> Raw {
        Raw { ptr: buf.ptr(), len: buf.len() }
    }

    pub(super) fn at<'a, T>(self, range: Range<usize>) -> View<'a, T> {
        assert!(range.end <= self.len, "device region {range:?} out of 0..{}", self.len);
        // SAFETY: inside a live buffer of the caller's (see the type's doc for aliasing).
        unsafe { View::from_raw(self.ptr + (range.start * size_of::<T>()) as u64, range.len()) }
    }

    pub(super) fn at_mut<'a, T>(self, range: Range<usize>) -> ViewMut<'a, T> {
        assert!(range.end <= self.len, "device region {range:?} out of 0..{}", self.len);
        // SAFETY: as above.
        unsafe { ViewMut::from_raw(self.ptr + (range.start * size_of::<T>()) as u64, range.len()) }
    }
}

/// The device buffers of one forward pass.
pub(crate) struct Forward<'a> {
    pub params: &'a DevBuf<f32>,
    pub acts: &'a DevBuf<f32>,
    /// im2col columns for a whole batch: `capacity × max lowered_len` values.
    pub cols: &'a DevBuf<f32>,
    pub capacity: usize,
    pub batch: usize,
    /// cuDNN, for the convolutions it was chosen for (`None`: flatnn's kernels for all).
    pub dnn: Option<&'a Dnn>,
    /// The model's buffers (running statistics), where its plan has any.
    pub buffers: Option<&'a DevBuf<f32>>,
    /// Where dropout draws its masks: the model's seed and its count of training passes, two
    /// words each, low first (see kernels/dropout.cu).
    pub draw: &'a DevBuf<u32>,
}

/// The extra device buffers of a backward pass.
pub(crate) struct Backward<'a> {
    pub dacts: &'a DevBuf<f32>,
    pub grads: &'a DevBuf<f32>,
    /// Lowered input gradients: as `cols`.
    pub dcols: &'a DevBuf<f32>,
    /// Per-sample conv weight gradients: `capacity × max conv weight length`.
    pub partials: &'a DevBuf<f32>,
    /// `capacity` ones, to sum the partials with one product.
    pub ones: &'a DevBuf<f32>,
}

/// Where the backward pass computes dense weight gradients: a second stream of the model, its
/// cuBLAS handle, and the events that fork work to it and join it back (see [`backward`]).
pub(crate) struct Side<'a> {
    pub blas: &'a Blas,
    pub stream: &'a CudaStream,
    pub fork: &'a Event,
    pub join: &'a Event,
    /// Where a step with a head sums the loss's terms, and the event that joins it back.
    pub loss_stream: &'a CudaStream,
    pub loss_join: &'a Event,
}

/// The loss's inputs and outputs on the device.
pub(crate) struct LossBuffers<'a> {
    pub labels: &'a DevBuf<u32>,
    pub targets: &'a DevBuf<f32>,
    /// [last loss, sum since reset, count since reset].
    pub loss: &'a DevBuf<f64>,
    /// The loss kernels' counter and partial sums ([`super::LOSS_SCRATCH`]).
    pub scratch: &'a DevBuf<f64>,
}

/// What a step's GPU forward (`LayerKind::gpu_forward`) launches with: the pass's device, cuBLAS
/// handle, stream and buffers, and where the pass is.
pub(crate) struct GpuForward<'a> {
    pub gpu: &'a Gpu,
    pub blas: &'a Blas,
    pub stream: &'a CudaStream,
    pub plan: &'a Plan,
    pub f: &'a Forward<'a>,
    /// The step's index in the plan.
    pub index: usize,
    /// The kernel ahead of the step's first launch writes no weights, so that launch may read
    /// its weights before waiting for it (see [`forward`]).
    pub weights_early: bool,
}

impl GpuForward<'_> {
    /// Values of region `r` for the batch.
    pub fn region(&self, r: usize) -> Range<usize> {
        region(self.plan, r, self.f.capacity, self.f.batch)
    }

    /// `range` of the activations, read.
    pub fn acts<'v>(&self, range: Range<usize>) -> View<'v, f32> {
        Raw::of(self.f.acts).at(range)
    }

    /// `range` of the activations, written.
    pub fn acts_mut<'v>(&self, range: Range<usize>) -> ViewMut<'v, f32> {
        Raw::of(self.f.acts).at_mut(range)
    }
}

/// Steps `0..upto`'s outputs for the first `f.batch` samples (as `layers::forward`); returns
/// whether the kernel after them may read weights before waiting for the one ahead of it.
///
/// `after_copy`: the kernel ahead of the pass in `stream` is the copy of its inputs (which
/// writes no weights), so even the first layer reads its weights before waiting for it; else
/// that kernel may be an optimiser's, and the first layer waits first.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    gpu: &Gpu,
    blas: &Blas,
    stream: &CudaStream,
    plan: &Plan,
    f: &Forward,
    after_copy: bool,
    upto: usize,
    mode: Mode,
) -> Result<bool> {
    let mut pass = GpuForward { gpu, blas, stream, plan, f, index: 0, weights_early: after_copy };
    // whether the kernel ahead writes no weights: after the pass's own first launch it never does
    let mut early_next = after_copy;
    for (index, step) in plan.steps[..upto].iter().enumerate() {
        (pass.index, pass.weights_early) = (index, early_next);
        early_next |= !step.layer.is_view();
        step.layer.gpu_forward(step, &pass, mode)?;
    }
    Ok(early_next)
}

/// A dense step's forward: Z (batch × out) = X (batch × in) · Wᵀ, with + b and Y = act(Z) in the
/// same launch where the product runs fused, else after it.
pub(crate) fn dense_forward(pass: &GpuForward, step: &Step, out_features: usize, activation: Activation) -> Result<()> {
    let GpuForward { gpu, blas, stream, f, weights_early, .. } = *pass;
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let batch = f.batch;
    let (x, z, y) = (pass.region(step.input_region), pass.region(step.z_region), pass.region(step.output_region));
    let (w, b) = step.weight_and_bias();
    let in_features = step.input.len();
    let xm = DevMat { data: acts.at(x), rs: in_features, cs: 1 };
    let wt = DevMat { data: params.at(w), rs: 1, cs: in_features };
    let tiles = gpu.dense_on_tensor_cores(batch, out_features, in_features, &xm, &wt, false);
    if tiles || fused(gpu, batch, out_features, in_features) {
        let y = (z != y).then(|| acts.at_mut(y));
        let epilogue = DenseEpilogue::Forward { bias: params.at(b), z: acts.at_mut(z), y, act: activation };
        return gpu.dense(stream, batch, out_features, in_features, xm, wt, epilogue, weights_early);
    }
    let zm = DevMatMut { data: acts.at_mut(z), rs: out_features, cs: 1 };
    blas.sgemm(batch, out_features, in_features, 1.0, xm, wt, 0.0, zm)?;
    bias_act(pass, step, activation, b, (out_features, 1))
}

/// z[s, c, p] += b[c] over the step's z, then y = act(z) where the step has a y of its own.
pub(super) fn bias_act(
    pass: &GpuForward,
    step: &Step,
    act: Activation,
    bias: Range<usize>,
    (channels, pixels): (usize, usize),
) -> Result<()> {
    let (z, y) = (pass.region(step.z_region), pass.region(step.output_region));
    let out = (z != y).then(|| pass.acts_mut(y));
    let params = Raw::of(pass.f.params);
    pass.gpu.bias_act(pass.stream, act, params.at(bias), channels, pixels, pass.f.batch, pass.acts_mut(z), out)
}

/// The loss of the last step's output: its gradient into `dacts`, its value into `l.loss`.
pub(crate) fn loss(gpu: &Gpu, stream: &CudaStream, plan: &Plan, f: &Forward, b: &Backward, l: &LossBuffers, loss: Loss) -> Result<()> {
    let last = plan.steps.last().expect("a plan has steps").output_region;
    let out = region(plan, last, f.capacity, f.batch);
    let (acts, dacts) = (Raw::of(f.acts), Raw::of(b.dacts));
    let (value, scratch) = (Raw::of(l.loss).at_mut(0..l.loss.len()), Raw::of(l.scratch).at_mut(0..l.scratch.len()));
    let outputs = plan.output().len();
    match loss {
        Loss::LogitCrossEntropy => {
            let labels = Raw::of(l.labels).at(0..f.batch);
            gpu.softmax_xent(stream, outputs, f.batch, acts.at(out.clone()), labels, dacts.at_mut(out), value, scratch)
        }
        Loss::Mse => {
            let n = out.len();
            gpu.mse(stream, n, acts.at(out.clone()), Raw::of(l.targets).at(0..n), dacts.at_mut(out), value, scratch)
        }
        Loss::BceWithLogits | Loss::L1 | Loss::SmoothL1 { .. } => {
            let n = out.len();
            gpu.elementwise_loss(stream, loss, n, acts.at(out.clone()), Raw::of(l.targets).at(0..n), dacts.at_mut(out), value, scratch)
        }
    }
}

/// The head of a training step in one launch (src/cuda/head.rs): the last step's forward, the
/// loss's terms, and that step's dz and input gradient (and the same for the step before it
/// where the head is deep); `backward` then runs with the head,
/// and sums the loss's terms on a stream of their own ([`Side::loss_stream`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn head(
    gpu: &Gpu,
    stream: &CudaStream,
    f: &Forward,
    b: &Backward,
    l: &LossBuffers,
    loss: Loss,
    head: &Head,
    weights_early: bool,
    clear: Option<Range<usize>>,
) -> Result<()> {
    let outputs = head.outputs();
    assert!(l.labels.len() >= f.batch && l.targets.len() >= f.batch * outputs, "head: short labels or targets");
    assert!(l.loss.len() >= 3 && l.scratch.len() >= super::LOSS_SCRATCH, "head: short loss or scratch");
    assert!(f.capacity >= f.batch && b.dacts.len() == f.acts.len(), "head: activations and their gradients differ");
    let buffers = HeadBuffers {
        params: f.params.ptr(),
        acts: f.acts.ptr(),
        dacts: b.dacts.ptr(),
        labels: l.labels.ptr(),
        targets: l.targets.ptr(),
        partials: head_partials(l, head).ptr(),
        clear: clear.map_or((0, 0), |c| {
            let grads: ViewMut<f32> = Raw::of(b.grads).at_mut(c);
            (grads.ptr(), grads.len())
        }),
    };
    gpu.dense_head(stream, head, f.batch, loss, &buffers, weights_early)
}

/// Where [`head`] leaves its partial sums of the loss: after the loss kernels' counter, which
/// it leaves alone.
fn head_partials<'a>(l: &LossBuffers<'a>, head: &Head) -> View<'a, f64> {
    Raw::of(l.scratch).at(1..1 + head.partials())
}

/// The loss's value from the partial sums [`head`] left, queued on `stream`.
fn head_loss(gpu: &Gpu, stream: &CudaStream, f: &Forward, l: &LossBuffers, loss: Loss, head: &Head) -> Result<()> {
    let (mean_scale, _) = super::ops::loss_scales(loss, f.batch, head.outputs());
    gpu.loss_sum(stream, head_partials(l, head), head.partials(), mean_scale, Raw::of(l.loss).at_mut(0..3))
}

/// Batches up to this run each dense layer through flatnn's fused kernels (product, bias and
/// activation in one launch; weight and bias gradients in one; the input gradient with the
/// previous activation's derivative in one); larger ones use cuBLAS and separate bias and
/// activation kernels. Measured on the H100, MLP 784-128-64-10 training step (back to back):
/// batch 16: 27 µs fused, 91 µs cuBLAS; 64: 44 / 60; 128: 71 / 67; 256: 124 / 76; 1024:
/// 438 / 91. Past ~100 samples the fused forward re-reads too much through L2 and the fused
/// weight gradient, a k-loop over the batch in few blocks, waits on memory latency. Since the
/// row-chunked kernel computes four columns per block and weight gradients run in panels
/// (2026-11-23, same binary, back to back): batch 128 43.5–43.8 → 39.1–39.4 µs fused up to 128
/// against 64, but 256 48.2–48.4 → 58.9 µs fused up to 256.
const FUSED_BATCH: usize = 128;

/// Whether a forward or input-gradient product (`batch × n` over `k`: a dense layer's inputs,
/// or outputs for the input gradient) runs fused. Above [`FUSED_BATCH`], those with k at most
/// [`PANEL_MAX_K`] still do (the panel kernel: k staged in shared memory 128 at a time) where
/// their blocks all fit on the GPU at once (two an SM, [`Gpu::dense_wave`], which panels hold
/// too). Measured on the H100 against cuBLAS + separate
/// bias/activation kernels (`step_time`, p50): 100-200-1 forward at batch 128 13.8 → 11.7 µs, at
/// 256 15.7 → 12.1 µs, but at 1024 (448 panels, two waves) 15.8 → 23.0 µs; MLP forward at 128
/// 31.9 → 24.9 µs (when its first layer, k = 784, still ran on cuBLAS there; at batches up to
/// [`FUSED_BATCH`] it is now fused too). The one-wave rule replaced a fixed limit of batch 256
/// (2026-11-23, same run, back to back, before → after): MLP step at 512 61.5–61.8 → 50.5–50.8
/// µs, 256, 1024 and 2048 unchanged; 100-200-1 step at 512 30.2–30.3 → 27.6–27.7, at 1024
/// 33.9–34.1 → 32.6–32.7; 100-200-1 forward at 512 (inputs on the device) 14.1–14.4 → 13.2; MLP
/// forward at 1024 40.7–40.9 → 39.3–39.7.
///
/// A product with k above [`PANEL_MAX_K`] (row-chunked) whose grid takes at most [`FUSED_WAVES`]
/// such waves runs fused too; panels in more than one wave stay on cuBLAS (the 100-200-1 at
/// 1024, whose first layer is 448 panels, same run: step 33.0–33.2 µs that way against 34.2–34.4
/// in panels, forward with the inputs on the device 15.6–15.9 against 17.2–17.8).
///
/// A forward that runs on the tensor-core tiles (`Gpu::dense_on_tensor_cores`) runs fused too.
fn fused(gpu: &Gpu, batch: usize, n: usize, k: usize) -> bool {
    let one_wave = gpu.dense_wave();
    let blocks = gpu.dense_blocks(batch, n, k, false);
    batch <= FUSED_BATCH || (k <= PANEL_MAX_K && blocks <= one_wave) || (k > PANEL_MAX_K && blocks <= FUSED_WAVES * one_wave)
}

/// Waves of blocks up to which a forward or input-gradient product over k above [`PANEL_MAX_K`]
/// runs fused (row-chunked), rather than as a cuBLAS call, whose kernels are not dependent
/// launches (the kernel after one starts only once it has finished), and a bias/activation
/// kernel. Measured on the H100 (2026-11-23, same run, two rounds, before → after; the MLP's first
/// layer row-chunked: 2.4 waves at 160, 3 at 200, 3.9 at 256): MLP step at 160 32.5–32.7 →
/// 29.5–29.9 µs, 200 33.6–33.8 → 32.5–32.6, 256 35.1–35.2 → 35.3–35.4; MLP forward at 160 with the
/// inputs on the device 22.2–22.6 → 18.3–18.6, at 256 unchanged (22.0–23.1); LeNet at 256 (its
/// first dense layer, 3.6 waves) 360.5–361.6 → 358.1–358.3, at 512 unchanged.
const FUSED_WAVES: usize = 4;

/// Whether the weight gradient of a dense layer (`out × inp`, and its bias) runs fused (the
/// panel kernel, db from a column of ones), not as cuBLAS and a bias-gradient kernel: up to
/// [`FUSED_BATCH`], and above it where the batch (its k) is at most [`PANEL_MAX_K`] and the
/// panels all fit on the GPU at once (two an SM, [`Gpu::dense_wave`]). Measured on the H100
/// (2026-11-23, same run, three rounds, before → after): panels at most one an SM instead of
/// cuBLAS above [`FUSED_BATCH`], MLP step at 256 41.4–41.5 → 40.7–40.8 µs, at 200 39.3–39.5 →
/// 38.6–38.8; then two an SM (the MLP's first layer, 200 panels at 256, once its panels read X
/// before waiting for the kernel ahead), MLP step at 160 34.0 → 32.6–32.7, 200 35.8–35.9 →
/// 33.7–33.9, 256 37.8 → 35.4–35.5, with the 100-200-1 and LeNet at 256 unchanged.
///
/// One that runs on the tensor-core tiles (`Gpu::dense_on_tensor_cores`) runs fused too.
fn fused_weight_grad(gpu: &Gpu, batch: usize, out: usize, inp: usize) -> bool {
    batch <= FUSED_BATCH || (batch <= PANEL_MAX_K && gpu.dense_blocks(out, inp, batch, true) <= gpu.dense_wave())
}

/// What a step's GPU backward (`LayerKind::gpu_backward`) launches with: the pass's device,
/// handles, streams and buffers, the head that ran (if any), where the pass is, and what the
/// steps after it (run before it) left for it.
pub(crate) struct GpuBackward<'a> {
    pub gpu: &'a Gpu,
    pub blas: &'a Blas,
    pub stream: &'a CudaStream,
    pub plan: &'a Plan,
    pub f: &'a Forward<'a>,
    pub b: &'a Backward<'a>,
    side: &'a Side<'a>,
    head: Option<(&'a Head, &'a LossBuffers<'a>, Loss)>,
    cleared: Option<Range<usize>>,
    /// The step's index in the plan.
    pub index: usize,
    /// The head ran the step (and wrote its dz and its input gradient).
    in_head: bool,
    /// The pass needs the step's input gradient: not the model input's, nor one the head wrote.
    pub need_dx: bool,
    /// Bit i: step i's dz was written by the layer after it (steps past 127 are never fused).
    dz_ready: u128,
    /// Bit i: step i's weight gradient went with the head's (see `dense_backward`).
    split_done: u128,
    /// Work was forked to the side stream, to be joined back at the end.
    forked: bool,
}

impl GpuBackward<'_> {
    /// Values of region `r` for the batch.
    pub fn region(&self, r: usize) -> Range<usize> {
        region(self.plan, r, self.f.capacity, self.f.batch)
    }

    /// `range` of the activations, read.
    pub fn acts<'v>(&self, range: Range<usize>) -> View<'v, f32> {
        Raw::of(self.f.acts).at(range)
    }

    /// `range` of the activation gradients, read.
    pub fn dacts<'v>(&self, range: Range<usize>) -> View<'v, f32> {
        Raw::of(self.b.dacts).at(range)
    }

    /// `range` of the activation gradients, written.
    pub fn dacts_mut<'v>(&self, range: Range<usize>) -> ViewMut<'v, f32> {
        Raw::of(self.b.dacts).at_mut(range)
    }
}

/// Bit `i` of the backward pass's step masks (0 past step 127).
fn bit(i: usize) -> u128 {
    1u128.checked_shl(i as u32).unwrap_or(0)
}

/// The backward pass (as `layers::backward`): `b.dacts` holds the loss gradient in the last
/// step's output region; fills `b.grads` (overwriting) and every needed activation gradient.
///
/// A dense layer writes its input gradient already multiplied by act' of the layer that
/// produced its input (that layer's dz), so that layer skips its own activation pass.
///
/// A dense layer's weight and bias gradients run on `side.stream`, forked from `stream` after
/// its dZ is written and joined back before this returns, so that they overlap the input
/// gradients of the layers below (they read dZ and X, which nothing in the backward pass
/// writes afterwards, and write only their own gradients). The layer with no input gradient
/// (the first) keeps them on `stream`: nothing is left to overlap them with, and there they
/// start as dependent launches instead of after an event.
///
/// After [`head`] (`head` given), the steps it ran need only their weight gradients, and the
/// head's producer's dz is written.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    gpu: &Gpu,
    blas: &Blas,
    stream: &CudaStream,
    plan: &Plan,
    f: &Forward,
    b: &Backward,
    side: &Side,
    head: Option<(&Head, &LossBuffers, Loss)>,
    cleared: Option<Range<usize>>,
) -> Result<()> {
    let dz_ready = head.and_then(|(h, ..)| h.producer).map_or(0, bit);
    let mut pass = GpuBackward {
        gpu,
        blas,
        stream,
        plan,
        f,
        b,
        side,
        head,
        cleared,
        index: 0,
        in_head: false,
        need_dx: false,
        dz_ready,
        split_done: 0,
        forked: false,
    };
    if let Some((h, l, loss)) = head {
        // the loss's value from the head's terms, on a stream of its own beside the weight
        // gradients: behind those on the side stream it came last (the MLP step at 1024 took
        // 32.3 µs that way against 30.9–31.0), and ahead of them it would delay them
        side.fork.record(stream)?;
        side.fork.wait_in(side.loss_stream)?;
        head_loss(gpu, side.loss_stream, f, l, loss, h)?;
        side.loss_join.record(side.loss_stream)?;
    }
    for (index, step) in plan.steps.iter().enumerate().rev() {
        pass.index = index;
        // the head wrote its dz and its input gradient
        pass.in_head = head.is_some_and(|(h, ..)| h.runs(index));
        pass.need_dx = step.input_region != 0 && !pass.in_head;
        step.layer.gpu_backward(step, &mut pass)?;
    }
    if pass.forked {
        side.join.record(side.stream)?;
        side.join.wait_in(stream)?;
    }
    if head.is_some() {
        side.loss_join.wait_in(stream)?;
    }
    Ok(())
}

/// dz = dy ⊙ act'(z) for a step with a y of its own, unless the layer after it (or the head)
/// wrote its dz already.
pub(super) fn activation_backward(pass: &GpuBackward, step: &Step, act: Activation) -> Result<()> {
    let (z, y) = (pass.region(step.z_region), pass.region(step.output_region));
    if z != y && pass.dz_ready & bit(pass.index) == 0 && !pass.in_head {
        pass.gpu.act_backward(pass.stream, act, z.len(), pass.acts(z.clone()), pass.acts(y.clone()), pass.dacts(y), pass.dacts_mut(z))?;
    }
    Ok(())
}

/// A dense step's backward: its dz (unless written), dW = dZᵀ · X and db = Σ_batch dZ (on the
/// side stream but the first layer's), and dX = dZ · W where needed, times act' of the layer
/// that made X when there is one (then that layer's dz).
pub(crate) fn dense_backward(pass: &mut GpuBackward, step: &Step, activation: Activation) -> Result<()> {
    activation_backward(pass, step, activation)?;
    let GpuBackward { gpu, blas, stream, plan, f, b, side, head, index, need_dx, .. } = *pass;
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let (dacts, grads) = (Raw::of(b.dacts), Raw::of(b.grads));
    let (capacity, batch) = (f.capacity, f.batch);
    let head_step = head.map(|(h, ..)| h.step);
    let (x, z) = (pass.region(step.input_region), pass.region(step.z_region));
    let (w, bias) = step.weight_and_bias();
    let (out, inp) = dense_shape(step).expect("a dense layer");
    // dW (out × in) = dZᵀ (out × batch) · X (batch × in), db = Σ_batch dZ
    let (dzt, xm) = weight_grad_operands(plan, step, f, b, out, inp);
    // the first layer's (no input gradient follows it) stays on the step's
    // stream: nothing is left to overlap it with there (nor is one that went
    // with the head's forked again)
    let (w_stream, w_blas) = if step.input_region != 0 && pass.split_done & bit(index) == 0 {
        side.fork.record(stream)?;
        side.fork.wait_in(side.stream)?;
        pass.forked = true;
        (side.stream, side.blas)
    } else {
        (stream, blas)
    };
    // Split over the batch (src/cuda/wgrad.rs) only on the side stream: on the
    // step's own it lost to the other kernels (the 100-200-1's first layer). The
    // dz of the head's layer before (or of its producer) is written too: where its
    // weight gradient also runs on the side stream, both go in one launch.
    let side_split = |layers: &[(usize, usize)]| step.input_region != 0 && gpu.weight_grad_split_takes(layers, batch);
    let pair = head
        .and_then(|(h, ..)| h.inner().or(h.producer))
        .filter(|&p| head_step == Some(index) && plan.steps[p].input_region != 0 && bit(p) != 0);
    let pair = pair.filter(|&p| dense_shape(&plan.steps[p]).is_some_and(|ps| side_split(&[(out, inp), ps])));
    if pass.split_done & bit(index) != 0 {
        // launched with the head's
    } else if pair.is_some() || side_split(&[(out, inp)]) {
        let job = |s: &Step| {
            let (out, inp) = dense_shape(s).expect("a dense layer");
            let (w, b) = s.weight_and_bias();
            let (x, z) = (region(plan, s.input_region, capacity, batch), region(plan, s.z_region, capacity, batch));
            Job { out, inp, dz: dacts.at(z), x: acts.at(x), dw: grads.at_mut(w), db: grads.at_mut(b) }
        };
        match pair {
            Some(p) => {
                pass.split_done |= bit(p);
                gpu.weight_grad_split(w_stream, batch, &[job(step), job(&plan.steps[p])])?;
            }
            None => gpu.weight_grad_split(w_stream, batch, &[job(step)])?,
        }
    } else if gpu.dense_on_tensor_cores(out, inp, batch, &dzt, &xm, true) || fused_weight_grad(gpu, batch, out, inp) {
        // split over two blocks, it adds into dW and db, which the head cleared
        // where it ran (else the product clears them first)
        let cleared = pass.cleared.as_ref().is_some_and(|c| c.start <= step.params.start && step.params.end <= c.end);
        let epilogue = DenseEpilogue::WeightGrad { dw: grads.at_mut(w.clone()), db: grads.at_mut(bias), cleared };
        // B is X, from the forward pass: the kernel ahead (the backward
        // pass's, the loss or the head) does not write it (a deep head writes
        // the last step's X, but that step's weight gradient runs on the side
        // stream, after an event: its input region is never the plan's)
        gpu.dense(w_stream, out, inp, batch, dzt, xm, epilogue, true)?;
    } else {
        gpu.bias_grad(w_stream, out, 1, batch, dacts.at(z.clone()), grads.at_mut(bias), None)?;
        let dw = DevMatMut { data: grads.at_mut(w.clone()), rs: inp, cs: 1 };
        w_blas.sgemm(out, inp, batch, 1.0, dzt, xm, 0.0, dw)?;
    }
    if need_dx && !fused(gpu, batch, inp, out) {
        // dX (batch × in) = dZ (batch × out) · W (out × in)
        let dzm = DevMat { data: dacts.at(z), rs: out, cs: 1 };
        let wm = DevMat { data: params.at(w), rs: inp, cs: 1 };
        blas.sgemm(batch, inp, out, 1.0, dzm, wm, 0.0, DevMatMut { data: dacts.at_mut(x), rs: inp, cs: 1 })?;
    } else if need_dx {
        // dX (batch × in) = dZ (batch × out) · W (out × in), times act' of the
        // layer that made X when there is one (then it is that layer's dZ)
        let dzm = DevMat { data: dacts.at(z), rs: out, cs: 1 };
        let wm = DevMat { data: params.at(w), rs: inp, cs: 1 };
        let producer = step.activated_input.filter(|&p| bit(p) != 0);
        let epilogue = match producer {
            Some(p) => {
                pass.dz_ready |= bit(p);
                let ps = &plan.steps[p];
                let pz = region(plan, ps.z_region, capacity, batch);
                DenseEpilogue::InputGrad { dx: dacts.at_mut(pz.clone()), prev: Some((acts.at(pz), acts.at(x), ps.layer.activation())) }
            }
            None => DenseEpilogue::InputGrad { dx: dacts.at_mut(x), prev: None },
        };
        // after the loss in the same pass: the weights are read at once
        gpu.dense(stream, batch, inp, out, dzm, wm, epilogue, true)?;
    }
    Ok(())
}

/// A dense step's weight gradient (dW = dZᵀ · X) as [`Gpu::dense`] takes it: A, B.
fn weight_grad_operands<'a>(
    plan: &Plan,
    step: &Step,
    f: &Forward<'a>,
    b: &Backward<'a>,
    out: usize,
    inp: usize,
) -> (DevMat<'a>, DevMat<'a>) {
    let x = region(plan, step.input_region, f.capacity, f.batch);
    let z = region(plan, step.z_region, f.capacity, f.batch);
    (DevMat { data: Raw::of(b.dacts).at(z), rs: 1, cs: out }, DevMat { data: Raw::of(f.acts).at(x), rs: inp, cs: 1 })
}

/// The gradients (a range of them) that cover every dense step's whose weight gradient runs on
/// a tile split over two blocks ([`Gpu::weight_grad_splits`]: each block adds its half into
/// them), or None if no step's does. The head clears them before [`backward`] runs (every
/// gradient in the range is written again after it).
pub(crate) fn split_weight_grads(gpu: &Gpu, plan: &Plan, f: &Forward, b: &Backward) -> Option<Range<usize>> {
    let splits = |step: &&Step| {
        dense_shape(step).is_some_and(|(out, inp)| {
            let (dzt, xm) = weight_grad_operands(plan, step, f, b, out, inp);
            gpu.weight_grad_splits(out, inp, f.batch, &dzt, &xm)
        })
    };
    let ranges = plan.steps.iter().filter(splits).map(|s| s.params.clone());
    ranges.reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
}

/// A dense step's (outputs, inputs), or None for other layers.
fn dense_shape(step: &Step) -> Option<(usize, usize)> {
    let Layer::Dense(dense) = step.layer else { return None };
    Some((dense.out_features, step.input.len()))
}
