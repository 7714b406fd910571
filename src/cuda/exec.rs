//! A plan run on the GPU: the twin of `layers::forward` / `layers::backward` and the loss, with
//! the same buffers in the same layout (region r of a capacity-`capacity` activation buffer
//! holds `capacity × plan.regions[r]` values, sample-major; a batch uses the front).
//!
//! Everything here only enqueues work on one stream (kernels and cuBLAS calls), so it can be
//! captured into a CUDA graph; nothing allocates, copies from the host or synchronises.
//!
//! An inference pass skips the steps a convolution takes in (`layers::Fused`, as the CPU's
//! `Workspace::taken_in`: a batch norm after it, a residual sum after that), which its forward
//! runs in one pass after its product (`conv.rs`); a training pass runs every step.

use super::blas::Blas;
use super::buffer::DevBuf;
use super::context::Gpu;
pub(crate) use super::dense_pass::{dense_backward, dense_forward, split_weight_grads};
use super::dnn::Dnn;
use super::head::{Head, HeadBuffers};
use super::launch::{View, ViewMut};
use super::pinned::Event;
use super::routes::Routes;
use crate::activation::Activation;
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::{region, Fused, Mode};
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
    /// The routes of the dense layers at this batch size (`None`: cuBLAS for all).
    pub routes: Option<&'a Routes>,
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
    /// The steps after this one that its forward runs too (a convolution's in inference, those
    /// of them the pass runs; none otherwise).
    pub fused: Fused,
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

/// Steps `0..upto`'s outputs for the first `f.batch` samples (as `layers::forward`: in
/// inference, of the steps a convolution takes in, only the last one's output); returns whether
/// the kernel after them may read weights before waiting for the one ahead of it.
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
    let mut pass = GpuForward { gpu, blas, stream, plan, f, index: 0, weights_early: after_copy, fused: Fused::default() };
    // whether the kernel ahead writes no weights: after the pass's own first launch it never does
    let mut early_next = after_copy;
    // the first step not yet run: those before it were run or taken in
    let mut next = 0;
    for (index, step) in plan.steps[..upto].iter().enumerate() {
        if index < next {
            continue;
        }
        let fused = match mode {
            Mode::Infer => Fused::of(plan, index).before(upto),
            Mode::Train => Fused::default(),
        };
        next = fused.last(index) + 1;
        (pass.index, pass.weights_early, pass.fused) = (index, early_next, fused);
        early_next |= !step.layer.is_view();
        step.layer.gpu_forward(step, &pass, mode)?;
    }
    Ok(early_next)
}

/// z[s, c, p] += b[c] over the step's z, then y = act(z) where the step has a y of its own; in
/// inference z + b goes to y alone (no step reads a z after an inference pass).
pub(super) fn bias_act(
    pass: &GpuForward,
    step: &Step,
    act: Activation,
    bias: Range<usize>,
    (channels, pixels): (usize, usize),
    mode: Mode,
) -> Result<()> {
    let (z, y) = (pass.region(step.z_region), pass.region(step.output_region));
    let out = (z != y).then(|| pass.acts_mut(y));
    let params = Raw::of(pass.f.params);
    let keep_z = mode == Mode::Train;
    pass.gpu.bias_act(pass.stream, act, params.at(bias), channels, pixels, pass.f.batch, pass.acts_mut(z), out, keep_z)
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
    pub(super) side: &'a Side<'a>,
    pub(super) head: Option<(&'a Head, &'a LossBuffers<'a>, Loss)>,
    pub(super) cleared: Option<Range<usize>>,
    /// The step's index in the plan.
    pub index: usize,
    /// The head ran the step (and wrote its dz and its input gradient).
    in_head: bool,
    /// The pass needs the step's input gradient: not the model input's, nor one the head wrote.
    pub need_dx: bool,
    /// Bit i: step i's dz was written by the layer after it (steps past 127 are never fused).
    pub(super) dz_ready: u128,
    /// Bit i: step i's weight gradient went with the head's (see `dense_backward`).
    pub(super) split_done: u128,
    /// Work was forked to the side stream, to be joined back at the end.
    pub(super) forked: bool,
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
pub(super) fn bit(i: usize) -> u128 {
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
        // gradients: behind those on the side stream it finished last and made the step slower,
        // and ahead of them it would delay them
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

/// Whether the step's dz is still to be computed from its dy: it has a y of its own, and neither
/// the layer after it nor the head wrote its dz.
pub(super) fn dz_pending(pass: &GpuBackward, step: &Step) -> bool {
    pass.region(step.z_region) != pass.region(step.output_region) && pass.dz_ready & bit(pass.index) == 0 && !pass.in_head
}

/// dz = dy ⊙ act'(z) where [`dz_pending`].
pub(super) fn activation_backward(pass: &GpuBackward, step: &Step, act: Activation) -> Result<()> {
    let (z, y) = (pass.region(step.z_region), pass.region(step.output_region));
    if dz_pending(pass, step) {
        pass.gpu.act_backward(pass.stream, act, z.len(), pass.acts(z.clone()), pass.acts(y.clone()), pass.dacts(y), pass.dacts_mut(z))?;
    }
    Ok(())
}
