//! A model's last dense layer, the loss and that layer's input gradient in one launch
//! (kernels/head.cu), where the layer has at most [`MAX_OUTPUTS`] outputs and at most
//! [`MAX_INPUTS`] inputs, for batches above [`MIN_BATCH`] and up to [`MAX_BATCH`]. Run separately, those are three kernels on a training step's critical
//! path (the layer's forward, the loss, the layer's input gradient), each a kernel boundary and a
//! round of loads after it (≥ ~1.5 µs each in-graph on the H100); here one warp takes a sample
//! through all three, with the layer's weights staged into shared memory while the kernel ahead
//! still runs. The layer's weight gradient stays with the dense kernels (`exec::backward`).
//!
//! `FLATNN_HEAD=0` (read when the device is set up) turns it off, for measuring against the
//! separate kernels.

use super::context::{Gpu, Kernel};
use super::launch::{int, kernel_args, BLOCK};
use super::ops::{act_code, loss_scales, LOSS_BLOCKS};
use crate::chain::{Layer, Plan};
use crate::error::Result;
use crate::layers::region;
use crate::loss::Loss;

/// Most outputs the kernel takes: one a lane (HEAD_MAX_OUTPUTS in kernels/head.cu).
pub(crate) const MAX_OUTPUTS: usize = 32;
/// Most inputs it takes: W and a row of inputs a warp live in a block's shared memory.
pub(crate) const MAX_INPUTS: usize = 1024;
/// Samples a block takes at a time, a warp each (HEAD_WARPS).
const WARPS: usize = BLOCK as usize / 32;
/// Batches up to this run the separate kernels: there the loss kernel is one block, while the
/// head's loss was summed across its blocks (a warp a sample), through a fence, a counter and the
/// last block (`finish_loss` in kernels/loss.cu), which took back what the fusion saved.
/// Measured on the H100 (same binary, `FLATNN_HEAD=1` against `0`, two rounds, back to back):
/// MLP step at 1 15.2 against 16.6 µs, 64 21.9–22.1 against 20.6–20.7, 128 25.0 against 25.9,
/// 160 28.3 against 27.3, 200 29.6 against 28.3–28.5, 256 30.6–30.8 against 29.9, 512 40.4–40.5
/// against 41.0–41.2, 1024 49.5–49.6 against 53.1–53.3; 100-200-1 at 1 11.9–12.1 against 11.5,
/// 128 16.3 against 15.6–15.7, 1024 30.3 against 32.8. With the loss summed beside the rest of
/// the step (`Gpu::loss_sum`, twentieth session; that run summed it ahead of the side stream's
/// weight gradients) the head still lost below 257 samples: MLP step at 16 17.1 against 16.5
/// µs, 64 20.1 against 19.3, 160 27.3 against 25.5, 256 31.0 against 27.5.
const MIN_BATCH: usize = BLOCK as usize;
/// Nor past this: at 4096 samples (4 a warp) the step lost (MLP 133.2–134.2 against 129.1–129.6
/// µs, 100-200-1 57.2–57.6 against 53.3–53.5; same run), at 2048 it gained ~0.5 µs, at 16384 it
/// gained (331.3–331.9 against 342.4–344.2), not traced.
const MAX_BATCH: usize = 2048;

/// How one step's head runs: where its buffers are and the launch's shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Head {
    /// The last step, which the kernel runs.
    pub step: usize,
    /// The step whose dz the kernel writes (the input gradient times its activation's
    /// derivative), as `exec::backward` would fold it in; else the input gradient goes to the
    /// layer's input region, when that is not the plan's input.
    pub producer: Option<usize>,
    k: i32,
    n: i32,
    act: (i32, f32),
    /// Offsets (floats) of W and b in the parameters; of x, z, y and the producer's z (−1:
    /// none) in the activations, and of the input gradient (−1: none) in their gradients (dz and
    /// dy are at z and y there: the two buffers have one layout).
    w: i32,
    b: i32,
    x: i32,
    z: i32,
    y: i32,
    prev_z: i32,
    dx: i32,
    prev_act: (i32, f32),
    blocks: usize,
    /// Bytes of dynamic shared memory a block needs: W (rows of an odd stride), b, a row of
    /// inputs a warp, and of the producer's z.
    shared: usize,
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
}

impl Head {
    /// The head of `plan`'s training step on `gpu` at `batch` samples (buffers of `capacity`),
    /// or None where the kernel does not take it (see the module doc).
    pub(crate) fn of(gpu: &Gpu, plan: &Plan, capacity: usize, batch: usize) -> Option<Head> {
        let step_index = plan.steps.len().checked_sub(1)?;
        let step = &plan.steps[step_index];
        let (k, n) = (step.input.len(), step.output.len());
        // as exec::backward: a producer past step 127 gets its dz from its own pass
        let producer = step.activated_input.filter(|&p| p < 128);
        let rows_a_warp = if producer.is_some() { 2 } else { 1 };
        let shared = 4 * (n * (k | 1) + n + rows_a_warp * WARPS * k);
        let fits = matches!(step.layer, Layer::Dense { .. }) && n <= MAX_OUTPUTS && k <= MAX_INPUTS && shared <= gpu.head_shared_limit();
        if !gpu.head_enabled() || !fits || batch <= MIN_BATCH || batch > MAX_BATCH {
            return None;
        }
        let at = |r: usize| int(region(plan, r, capacity, batch).start).ok();
        let (w, b) = step.weight_and_bias();
        let (dx, prev_z, prev_act) = match producer {
            Some(p) => {
                let ps = &plan.steps[p];
                let z = at(ps.z_region)?;
                (z, z, act_code(ps.layer.activation()))
            }
            None if step.input_region != 0 => (at(step.input_region)?, -1, (0, 0.0)),
            None => (-1, -1, (0, 0.0)),
        };
        let (z, y) = (at(step.z_region)?, at(step.output_region)?);
        Some(Head {
            step: step_index,
            producer,
            k: int(k).ok()?,
            n: int(n).ok()?,
            act: act_code(step.layer.activation()),
            w: int(w.start).ok()?,
            b: int(b.start).ok()?,
            x: at(step.input_region)?,
            z,
            y,
            prev_z,
            dx,
            prev_act,
            // a warp a sample, up to the loss's most partial sums
            blocks: batch.div_ceil(WARPS).min(LOSS_BLOCKS),
            shared,
        })
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

    /// Partial sums of the loss the kernel leaves: one a warp.
    pub(crate) fn partials(&self) -> usize {
        self.blocks * WARPS
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
        let HeadBuffers { params, acts, dacts, labels, targets, partials } = *buffers;
        let xent = i32::from(loss == Loss::LogitCrossEntropy);
        let (_, grad_scale) = loss_scales(loss, batch, head.outputs());
        let Head { k, n, act: (act, slope), w, b, x, z, y, prev_z, dx, prev_act: (prev_act, prev_slope), .. } = *head;
        let (rows, early) = (int(batch)?, i32::from(weights_early));
        let args = kernel_args![
            params, acts, dacts, k, n, act, slope, w, b, x, z, y, dx, prev_z, prev_act, prev_slope, xent, labels, targets, partials,
            grad_scale, rows, early
        ];
        self.run_blocks(stream, Kernel::DenseHead, (head.blocks as u32, 1), head.shared as u32, args)
    }
}
