//! A model's last dense layer, the loss and that layer's input gradient in one launch
//! (kernels/head.cu), where the layer has at most [`MAX_OUTPUTS`] outputs and at most
//! [`MAX_INPUTS`] inputs, for batches above [`MIN_BATCH`] and up to [`MAX_BATCH`]. Run
//! separately, those are three kernels on a training step's critical path (the layer's forward,
//! the loss, the layer's input gradient), each a kernel boundary and a round of loads after it;
//! here one warp takes a sample through all three, with the layer's weights staged into shared
//! memory while the kernel ahead still runs. Where the dense layer before it is small enough
//! ([`MAX_INNER_WEIGHTS`]), that layer's forward and input gradient join it (the head is then
//! "deep", and takes a sample by two warps up to [`DEEP_PAIRS_MAX_BATCH`] samples): two kernels
//! fewer again. The layers' weight gradients stay with the dense kernels (`exec::backward`).
//!
//! `Tuning::head` (`FLATNN_HEAD=0`) turns it off, `Tuning::deep_head` (`FLATNN_HEAD=1`) keeps it
//! to the last layer, for measuring against the separate kernels.

use super::context::{Gpu, Kernel};
use super::launch::{int, kernel_args, BLOCK};
use super::ops::{loss_scales, LOSS_BLOCKS};
use super::options::Tuning;
use crate::chain::{Layer, Plan, Step};
use crate::error::Result;
use crate::layers::region;
use crate::loss::Loss;

/// Most outputs the kernel takes: one a lane (HEAD_MAX_OUTPUTS in kernels/head.cu).
pub(crate) const MAX_OUTPUTS: usize = 32;
/// Most inputs it takes: W and a row of inputs a warp live in a block's shared memory.
pub(crate) const MAX_INPUTS: usize = 1024;
/// Samples a block takes at a time, a warp each (HEAD_WARPS).
const WARPS: usize = BLOCK as usize / 32;

/// Batches up to this run the separate kernels, where the loss kernel is one block: the head
/// leaves a partial sum a warp for `Gpu::loss_sum` to add beside the rest of the step, and below
/// 257 samples the step was still slower with the head than without (`FLATNN_HEAD=1` against
/// `0`), as it was when the head's last block summed them through a fence and a counter.
const MIN_BATCH: usize = BLOCK as usize;
/// Nor past this: at 4096 samples (four a warp) both the MLP's and the 100-200-1's steps were
/// slower with the head, though at 16384 it gained again (why, not traced).
const MAX_BATCH: usize = 2048;
/// Most weights the layer before may have for a deep head: every block stages them, and a lane
/// computes its outputs one after another (sums of k0 terms), so that a large layer is better
/// left to the dense kernels, which spread it over the whole GPU.
pub(crate) const MAX_INNER_WEIGHTS: usize = 16_384;
/// Nor for batches past this: one sample a warp of the most blocks the kernel runs on. With two
/// a warp the MLP's step at 2048 was far slower than with the last layer alone.
const DEEP_MAX_BATCH: usize = LOSS_BLOCKS * WARPS;
/// Up to this batch a deep head takes a sample by two warps (`dense_head_deep2`), over at most
/// half a warp a scheduler otherwise: against a warp a sample, that made the MLP's step faster
/// from 257 to 512 samples, and slower from 768 (on 192 blocks).
pub(crate) const DEEP_PAIRS_MAX_BATCH: usize = 512;

/// How one step's head runs: where its buffers are and the launch's shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Head {
    /// The last step, which the kernel runs.
    pub step: usize,
    /// The step before it and that step as the kernel takes it, when the kernel runs that one
    /// too (a deep head): then it writes that step's z, y and dz as well.
    inner: Option<(usize, Dense)>,
    /// The step whose dz the kernel writes from the input gradient of the first step it runs
    /// (times the producer's activation's derivative), as `exec::backward` would fold it in;
    /// else that input gradient goes to the first step's input region, when that is not the
    /// plan's input.
    pub producer: Option<usize>,
    /// The last step as the kernel takes it, its outputs, and the offsets (floats) of its z and
    /// y in the activations (dz and dy are at z and y in their gradients: the two buffers have
    /// one layout).
    last: Dense,
    n: i32,
    z: i32,
    y: i32,
    /// Warps a sample (a deep head's: 1 or 2).
    unit: usize,
    blocks: usize,
    /// Bytes of dynamic shared memory a block needs: with a deep head, the layer before's W0
    /// (rows padded for 16-byte loads) and b0; W (rows of an odd stride) and b; and each unit's
    /// rows (kernels/head.cu).
    shared: usize,
}

/// A dense step as the kernel takes it (the last, or the one before it in a deep head): inputs
/// (0: none, [`Dense::NONE`]), activation, offsets (floats) of W and b in the parameters, of its
/// input in the activations, and where its input gradient goes ([`InputGrad`]'s `dx`, `prev_z`
/// and `prev_act`).
#[derive(Clone, Copy, Debug)]
struct Dense {
    k: i32,
    act: (i32, f32),
    w: i32,
    b: i32,
    x: i32,
    dx: i32,
    prev_z: i32,
    prev_act: (i32, f32),
}

/// Where a step's input gradient goes: its producer's dz (offset `dx`, the same as `prev_z`,
/// with the producer's activation), or its input region (`prev_z` −1), or nowhere (both −1).
struct InputGrad {
    producer: Option<usize>,
    dx: i32,
    prev_z: i32,
    prev_act: (i32, f32),
}

impl Dense {
    const NONE: Dense = Dense { k: 0, act: (0, 0.0), w: -1, b: -1, x: -1, dx: -1, prev_z: -1, prev_act: (0, 0.0) };

    /// Step `s` (dense) whose input gradient goes where `grad` says; `at` gives a region's
    /// offset.
    fn of(s: &Step, grad: &InputGrad, at: impl Fn(usize) -> Option<i32>) -> Option<Dense> {
        let (w, b) = s.weight_and_bias();
        Some(Dense {
            k: int(s.input.len()).ok()?,
            act: s.layer.activation().gpu_code(),
            w: int(w.start).ok()?,
            b: int(b.start).ok()?,
            x: at(s.input_region)?,
            dx: grad.dx,
            prev_z: grad.prev_z,
            prev_act: grad.prev_act,
        })
    }
}

/// The device buffers the head reads and writes (see `exec::LossBuffers`): `partials` takes
/// [`Head::partials`] f64 sums of the loss's terms, which `Gpu::loss_sum` adds up.
pub(crate) struct HeadBuffers {
    pub params: u64,
    pub acts: u64,
    pub dacts: u64,
    pub labels: u64,
    pub targets: u64,
    pub partials: u64,
    /// Gradients the kernel sets to zero (address and length): those of the weight gradients
    /// that the step runs split over two blocks, which add into them (`exec::head`).
    pub clear: (u64, usize),
}

impl Head {
    /// The head of `plan`'s training step with `loss` on `gpu` at `batch` samples (buffers of
    /// `capacity`), or None where the kernel does not take it (see the module doc; of the losses
    /// it computes cross-entropy and MSE, and refuses the others) or `tuning` turns it off.
    pub(crate) fn of(gpu: &Gpu, plan: &Plan, capacity: usize, batch: usize, loss: Loss, tuning: &Tuning) -> Option<Head> {
        // the kernel computes these losses alone (its `xent` flag: cross-entropy, else MSE)
        if !matches!(loss, Loss::LogitCrossEntropy | Loss::Mse) {
            return None;
        }
        let step_index = plan.steps.len().checked_sub(1)?;
        let step = &plan.steps[step_index];
        let (k, n) = (step.input.len(), step.output.len());
        let dense = |s: &Step| matches!(s.layer, Layer::Dense(_));
        if !tuning.head || !dense(step) || n > MAX_OUTPUTS || k > MAX_INPUTS || batch <= MIN_BATCH || batch > MAX_BATCH {
            return None;
        }
        let at = |r: usize| int(region(plan, r, capacity, batch).start).ok();
        // where a step's input gradient goes (the producer's dz, or the input region, or
        // nowhere) and the producer: as exec::backward, a producer past step 127 gets its dz
        // from its own pass
        let input_grad = |s: &Step| -> Option<InputGrad> {
            Some(match s.activated_input.filter(|&p| p < 128) {
                Some(p) => {
                    let ps = &plan.steps[p];
                    let z = at(ps.z_region)?;
                    InputGrad { producer: Some(p), dx: z, prev_z: z, prev_act: ps.layer.activation().gpu_code() }
                }
                None if s.input_region != 0 => InputGrad { producer: None, dx: at(s.input_region)?, prev_z: -1, prev_act: (0, 0.0) },
                None => InputGrad { producer: None, dx: -1, prev_z: -1, prev_act: (0, 0.0) },
            })
        };
        let grad = input_grad(step)?;
        let producer = grad.producer;
        // bytes of shared memory, as kernels/head.cu lays it out: with a deep head W0 (rows of
        // k0 rounded up to a multiple of 32, plus 4; k rounded up to a multiple of 4 of them) and
        // b0, then W (rows of an odd stride) and b, then each warp's rows of floats (the inputs,
        // the producer's z, and with a deep head the input gradient, the layer before's inputs
        // and its producer's z), each rounded up to a multiple of 4
        let pad4 = |v: usize| v.next_multiple_of(4);
        let own = pad4(n * (k | 1) + n);
        let shallow_shared = 4 * (own + WARPS * pad4(k) * (1 + usize::from(producer.is_some())));
        // the layer before, where it takes it: dense, feeding the last directly, its producer
        // (if activated) the one the last layer's dz folds into
        let inner = step_index.checked_sub(1).filter(|&i| {
            let s = &plan.steps[i];
            let k0 = s.input.len();
            tuning.deep_head
                && batch <= DEEP_MAX_BATCH
                && dense(s)
                && s.output_region == step.input_region
                // the last step is its output's only reader: its input gradient is the whole of
                // that output's gradient (a skip connection's would be added after)
                && plan.consumers[step.input_region] == 1
                // the last step's dz folds this one's activation in, if it has one (a producer
                // past step 127 does not: its activation would be skipped)
                && step.activated_input == producer
                && k0 <= MAX_INPUTS
                && k * k0 <= MAX_INNER_WEIGHTS
        });
        // a deep head's warps a sample
        let deep_unit = if batch <= DEEP_PAIRS_MAX_BATCH { 2 } else { 1 };
        let deep_shared = |s: &Step, inner_producer: bool| {
            let k0 = s.input.len();
            let row = pad4(k) * (2 + usize::from(producer.is_some())) + pad4(k0) * (1 + usize::from(inner_producer));
            4 * (pad4(k) * (k0.next_multiple_of(32) + 4) + pad4(k) + own + WARPS / deep_unit * row)
        };
        let inner = inner.and_then(|i| {
            let s = &plan.steps[i];
            let inner_grad = input_grad(s)?;
            let shared = deep_shared(s, inner_grad.producer.is_some());
            let deep = Dense::of(s, &inner_grad, at)?;
            (shared <= gpu.head_shared_limit()).then_some(((i, deep), inner_grad.producer, shared))
        });
        let (inner, producer, shared, unit) = match inner {
            Some((inner, p, shared)) => (Some(inner), p, shared, deep_unit),
            None if shallow_shared <= gpu.head_shared_limit() => (None, producer, shallow_shared, 1),
            None => return None,
        };
        Some(Head {
            step: step_index,
            inner,
            producer,
            last: Dense::of(step, &grad, at)?,
            n: int(n).ok()?,
            z: at(step.z_region)?,
            y: at(step.output_region)?,
            unit,
            // a unit a sample, up to the loss's most partial sums; a deep head's samples take
            // longer, so they are spread over twice the blocks where that adds multiprocessors
            // (with a warp a sample, half of each block's warps; with two, all of them)
            blocks: batch.div_ceil(if inner.is_some() { WARPS / 2 } else { WARPS }).min(LOSS_BLOCKS),
            shared,
        })
    }

    /// The first step the kernel runs (the forward pass stops before it).
    pub(crate) fn first(&self) -> usize {
        self.inner().unwrap_or(self.step)
    }

    /// The step before the last, when the kernel runs it too (a deep head).
    pub(crate) fn inner(&self) -> Option<usize> {
        self.inner.map(|(i, _)| i)
    }

    /// Whether the kernel runs step `index` (and so writes its dz and its input gradient).
    pub(crate) fn runs(&self, index: usize) -> bool {
        index == self.step || Some(index) == self.inner()
    }

    /// The layer's outputs a sample.
    pub(crate) fn outputs(&self) -> usize {
        self.n as usize
    }

    /// Blocks the kernel runs on.
    #[cfg(test)]
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    /// Partial sums of the loss the kernel leaves: one a unit.
    pub(crate) fn partials(&self) -> usize {
        self.blocks * WARPS / self.unit
    }
}

impl Gpu {
    /// Runs `head` of a step on `batch` samples (see the module doc); `weights_early` as
    /// [`Gpu::dense`]'s `b_early` for the layer's weights.
    pub(crate) fn dense_head(
        &self,
        stream: &cudarc::driver::CudaStream,
        head: &Head,
        batch: usize,
        loss: Loss,
        buffers: &HeadBuffers,
        weights_early: bool,
    ) -> Result<()> {
        let HeadBuffers { params, acts, dacts, labels, targets, partials, clear: (clear, clear_len) } = *buffers;
        assert!(matches!(loss, Loss::LogitCrossEntropy | Loss::Mse), "the head kernel does not compute {loss:?}");
        let xent = i32::from(loss == Loss::LogitCrossEntropy);
        let (_, grad_scale) = loss_scales(loss, batch, head.outputs());
        let Head { last, n, z, y, inner, .. } = *head;
        let Dense { k, act: (act, slope), w, b, x, dx, prev_z, prev_act: (prev_act, prev_slope) } = last;
        let deep = inner.map_or(Dense::NONE, |(_, deep)| deep);
        let Dense { k: k0, act: (act0, slope0), w: w0, b: b0, x: x0, dx: dx0, prev_z: prev_z0, prev_act: (prev_act0, prev_slope0) } = deep;
        let (rows, early, clear_len) = (int(batch)?, i32::from(weights_early), int(clear_len)?);
        let args = kernel_args![
            params,
            acts,
            dacts,
            k,
            n,
            act,
            slope,
            w,
            b,
            x,
            z,
            y,
            dx,
            prev_z,
            prev_act,
            prev_slope,
            k0,
            act0,
            slope0,
            w0,
            b0,
            x0,
            dx0,
            prev_z0,
            prev_act0,
            prev_slope0,
            xent,
            labels,
            targets,
            partials,
            grad_scale,
            rows,
            clear,
            clear_len,
            early
        ];
        let kernel = match (head.inner, head.unit) {
            (None, _) => Kernel::DenseHead,
            (Some(_), 1) => Kernel::DenseHeadDeep,
            (Some(_), _) => Kernel::DenseHeadDeep2,
        };
        self.run_blocks(stream, kernel, (head.blocks as u32, 1), head.shared as u32, args)
    }
}
