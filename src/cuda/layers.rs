//! The GPU launches of the batch norm, layer norm, dropout and residual rooms
//! (src/layers/{batch_norm,layer_norm,dropout,residual}.rs; kernels/ of the same names): each
//! step's forward and backward as the rooms call them, and one typed launch per kernel, which
//! checks the views' lengths on the host (a panic on a short view: a bug in the caller) and
//! allocates nothing. As everything in `exec`, they only queue work on the pass's stream.

use super::bias_act::bias_grad_splits;
use super::buffer::DevBuf;
use super::context::{Gpu, Kernel};
use super::exec::{activation_backward, dz_pending, Backward, Forward, GpuBackward, GpuForward, Raw};
use super::launch::{aligned16, blocks, int, kernel_args, View, ViewMut, BLOCK};
use super::routes::{NormPass, NormRoute};
use crate::activation::Activation;
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::{batch_norm, dropout, layer_norm, Mode};
use cudarc::driver::CudaStream;
use std::ops::Range;

/// Most blocks of a kernel whose grid strides over rows or features.
const MAX_GRID: usize = 1 << 16;

/// Into how many parts batch norm splits each channel's sums over the samples (its statistics and
/// parameter gradients; 1: a block a channel), and how many samples a part takes: as many parts
/// as the convolutions' bias gradient takes for the same sizes ([`bias_grad_splits`]: the same
/// sums over the same layout), fewer where that leaves a part empty, so every part holds a sample
/// or more. It depends on the sizes alone, so a pass's bits do too.
pub(crate) fn batch_norm_parts(g: &batch_norm::Geometry) -> (usize, usize) {
    let chunk = g.batch.div_ceil(bias_grad_splits(g.channels, g.pixels, g.batch)).max(1);
    (g.batch.div_ceil(chunk), chunk)
}

/// How batch norm's element-wise kernels (`batch_norm_apply`, `batch_norm_input_grad`) cover
/// `rows` = batch × channels rows of `pixels` values: each row as items of four values (float4)
/// where `fours` (pixels a multiple of 4 and every pointer 16-byte aligned), else of one; a
/// block's threads in rows of `1 << lanes_log2` lanes (the least power of two that holds a row's
/// items, at most a block), so that a block takes whole rows and a thread finds its channel by
/// one division, not one a value; `grid`: (blocks of rows, blocks along a row, at most 65,535:
/// the kernels stride on past them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowTiles {
    pub fours: bool,
    pub lanes_log2: u32,
    pub grid: (u32, u32),
}

impl RowTiles {
    /// The tiles of `rows` rows of `pixels` values (rows below 2^31), `aligned`: whether every
    /// pointer the kernel takes is 16-byte aligned.
    pub(crate) fn of(rows: usize, pixels: usize, aligned: bool) -> RowTiles {
        let fours = aligned && pixels.is_multiple_of(4);
        let width = if fours { pixels / 4 } else { pixels };
        let lanes = width.next_power_of_two().min(BLOCK as usize);
        let rows_a_block = BLOCK as usize / lanes;
        let grid = (rows.div_ceil(rows_a_block).max(1) as u32, width.div_ceil(lanes).clamp(1, MAX_GRID - 1) as u32);
        RowTiles { fours, lanes_log2: lanes.trailing_zeros(), grid }
    }
}

/// Fours of `n` values that the residual kernels take as float4: all of them where every
/// pointer is 16-byte aligned, else none.
fn quads(n: usize, pointers: &[u64]) -> usize {
    if aligned16(pointers) {
        n / 4
    } else {
        0
    }
}

/// A pass's scratch of f32 values taken as f64 partial sums: its first `len / 2` f64 slots (a
/// device allocation's start is 256-byte aligned).
fn f64_scratch<'v>(scratch: &DevBuf<f32>) -> ViewMut<'v, f64> {
    Raw::of(scratch).at_mut(0..scratch.len() / 2)
}

/// A batch-norm step's (μ, r) ranges in the activations: its saved values.
fn batch_norm_saved(pass_plan: &Plan, step: &Step, capacity: usize, channels: usize) -> (Range<usize>, Range<usize>) {
    let saved = pass_plan.saved_values(step, capacity);
    (saved.start..saved.start + channels, saved.start + channels..saved.start + 2 * channels)
}

/// A batch-norm step's forward: in training the batch's statistics (saved for the backward
/// pass) and the running ones moved, then the normalisation, on the route measured for the
/// batch (`routes/norm.rs`); in inference the normalisation by the running statistics; then y =
/// act(z) where the step has a y of its own.
pub(crate) fn batch_norm_forward(pass: &GpuForward, step: &Step, act: Activation, mode: Mode) -> Result<()> {
    let GpuForward { gpu, stream, plan, f, index, .. } = *pass;
    if mode == Mode::Train {
        let route = f.routes.map_or(NormRoute::Split, |r| r.norm(index, NormPass::Forward));
        return batch_norm_train_forward(gpu, stream, plan, f, step, act, route);
    }
    let g = batch_norm::Geometry::of(step, f.batch);
    let [weight, bias] = batch_norm::tensors(step);
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let buffers = Raw::of(f.buffers.expect("a model with batch norm has buffers"));
    let [running_mean, running_var] = [0, 1].map(|i| buffers.at(step.buffers[i].range.clone()));
    let (x, z, y) = (pass.region(step.input_region), pass.region(step.z_region), pass.region(step.output_region));
    let affine = (params.at(weight), params.at(bias));
    let out = (acts.at_mut(z.clone()), (z != y).then(|| (acts.at_mut(y), act)));
    gpu.batch_norm_apply(stream, &g, acts.at(x), out, (running_mean, running_var), affine, true)
}

/// A batch-norm step's training forward on `route`: split, the statistics (summed in parts in
/// the convolutions' lowered columns, free between their launches, where that is worth it) then
/// the normalisation; fused, one launch.
pub(crate) fn batch_norm_train_forward(
    gpu: &Gpu,
    stream: &CudaStream,
    plan: &Plan,
    f: &Forward,
    step: &Step,
    act: Activation,
    route: NormRoute,
) -> Result<()> {
    let g = batch_norm::Geometry::of(step, f.batch);
    let [weight, bias] = batch_norm::tensors(step);
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let buffers = Raw::of(f.buffers.expect("a model with batch norm has buffers"));
    let running = [0, 1, 2].map(|i| buffers.at_mut(step.buffers[i].range.clone()));
    let region = |r| crate::layers::region(plan, r, f.capacity, f.batch);
    let (x, z, y) = (region(step.input_region), region(step.z_region), region(step.output_region));
    let (mean, inv) = batch_norm_saved(plan, step, f.capacity, g.channels);
    let stats = (acts.at_mut(mean.clone()), acts.at_mut(inv.clone()));
    let affine = (params.at(weight), params.at(bias));
    let out = (acts.at_mut(z.clone()), (z != y).then(|| (acts.at_mut(y), act)));
    match route {
        NormRoute::Split => {
            gpu.batch_norm_stats(stream, &g, acts.at(x.clone()), stats, running, Some(f64_scratch(f.cols)))?;
            gpu.batch_norm_apply(stream, &g, acts.at(x), out, (acts.at(mean), acts.at(inv)), affine, false)
        }
        NormRoute::Fused(parts) => gpu.batch_norm_train_forward(stream, &g, parts, acts.at(x), out, stats, running, affine),
    }
}

/// A batch-norm step's backward (after a training forward), on the route measured for the
/// batch: its dz (unless written), dγ and dβ, then dx where needed.
pub(crate) fn batch_norm_backward(pass: &mut GpuBackward, step: &Step, act: Activation) -> Result<()> {
    let dz_pending = dz_pending(pass, step);
    let GpuBackward { gpu, stream, plan, f, b, need_dx, index, .. } = *pass;
    let route = f.routes.map_or(NormRoute::Split, |r| r.norm(index, NormPass::Backward));
    batch_norm_train_backward(gpu, stream, plan, (f, b), step, act, route, (dz_pending, need_dx))
}

/// A batch-norm step's backward on `route`: split, dz = dy ⊙ act'(z) where `dz_pending`, dγ and
/// dβ (summed in parts where that is worth it, in the convolutions' scratch of per-sample
/// weight gradients, as their bias gradients are), then dx where `need_dx`; fused, one launch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_train_backward(
    gpu: &Gpu,
    stream: &CudaStream,
    plan: &Plan,
    (f, b): (&Forward, &Backward),
    step: &Step,
    act: Activation,
    route: NormRoute,
    (dz_pending, need_dx): (bool, bool),
) -> Result<()> {
    let g = batch_norm::Geometry::of(step, f.batch);
    let [weight, bias] = batch_norm::tensors(step);
    let (params, acts, dacts, grads) = (Raw::of(f.params), Raw::of(f.acts), Raw::of(b.dacts), Raw::of(b.grads));
    let region = |r| crate::layers::region(plan, r, f.capacity, f.batch);
    let (x, z, y) = (region(step.input_region), region(step.z_region), region(step.output_region));
    let (mean, inv) = batch_norm_saved(plan, step, f.capacity, g.channels);
    let stats = (acts.at(mean), acts.at(inv));
    let param_grads = (grads.at_mut(weight.clone()), grads.at_mut(bias.clone()));
    let from_dy = dz_pending.then(|| (acts.at(z.clone()), acts.at(y.clone()), dacts.at(y.clone()), act));
    match route {
        NormRoute::Split => {
            if let Some((zv, yv, dy, act)) = from_dy {
                gpu.act_backward(stream, act, z.len(), zv, yv, dy, dacts.at_mut(z.clone()))?;
            }
            let inputs = (acts.at(x.clone()), dacts.at(z.clone()));
            gpu.batch_norm_param_grads(stream, &g, inputs, stats, param_grads, Some(f64_scratch(b.partials)))?;
            if need_dx {
                let param_grads = (grads.at(weight.clone()), grads.at(bias));
                gpu.batch_norm_input_grad(
                    stream,
                    &g,
                    acts.at(x.clone()),
                    dacts.at(z),
                    dacts.at_mut(x),
                    stats,
                    params.at(weight),
                    param_grads,
                )?;
            }
            Ok(())
        }
        NormRoute::Fused(parts) => {
            let dx = need_dx.then(|| dacts.at_mut(x.clone()));
            gpu.batch_norm_train_backward(
                stream,
                &g,
                parts,
                acts.at(x),
                (from_dy, dacts.at_mut(z)),
                dx,
                stats,
                params.at(weight),
                param_grads,
            )
        }
    }
}

/// A layer-norm step's forward: every row's μ and r (kept), and y.
pub(crate) fn layer_norm_forward(pass: &GpuForward, step: &Step) -> Result<()> {
    let g = layer_norm::Geometry::of(step, pass.f.batch);
    let [weight, bias] = layer_norm::tensors(step);
    let (x, y, means, invs) = layer_norm::regions(step, |r| pass.region(r));
    let (params, acts) = (Raw::of(pass.f.params), Raw::of(pass.f.acts));
    let affine = (params.at(weight), params.at(bias));
    pass.gpu.layer_norm_forward(pass.stream, &g, acts.at(x), acts.at_mut(y), (acts.at_mut(means), acts.at_mut(invs)), affine)
}

/// A layer-norm step's backward: dγ and dβ, then dx where needed.
pub(crate) fn layer_norm_backward(pass: &mut GpuBackward, step: &Step) -> Result<()> {
    let GpuBackward { gpu, stream, f, b, need_dx, .. } = *pass;
    let g = layer_norm::Geometry::of(step, f.batch);
    let [weight, bias] = layer_norm::tensors(step);
    let (x, y, means, invs) = layer_norm::regions(step, |r| pass.region(r));
    let (params, acts, dacts, grads) = (Raw::of(f.params), Raw::of(f.acts), Raw::of(b.dacts), Raw::of(b.grads));
    let stats = (acts.at(means), acts.at(invs));
    gpu.layer_norm_param_grads(
        stream,
        &g,
        acts.at(x.clone()),
        dacts.at(y.clone()),
        stats,
        grads.at_mut(weight.clone()),
        grads.at_mut(bias),
    )?;
    if need_dx {
        gpu.layer_norm_input_grad(stream, &g, acts.at(x.clone()), dacts.at(y), dacts.at_mut(x), stats, params.at(weight))?;
    }
    Ok(())
}

/// A dropout step's forward: y = x·m in training, y = x in inference.
pub(crate) fn dropout_forward(pass: &GpuForward, step: &Step, p: f32, mode: Mode) -> Result<()> {
    let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
    let acts = Raw::of(pass.f.acts);
    let mask = (pass.f.draw.all(), step.output_region, p);
    pass.gpu.dropout(pass.stream, x.len(), acts.at(x), acts.at_mut(y), mask, mode == Mode::Train)
}

/// A dropout step's backward: dx = dy·m where needed, the mask drawn again.
pub(crate) fn dropout_backward(pass: &mut GpuBackward, step: &Step, p: f32) -> Result<()> {
    if !pass.need_dx {
        return Ok(());
    }
    let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
    let dacts = Raw::of(pass.b.dacts);
    let mask = (pass.f.draw.all(), step.output_region, p);
    pass.gpu.dropout(pass.stream, x.len(), dacts.at(y), dacts.at_mut(x), mask, true)
}

/// Moves the model's count of training passes on by one, on the device (the last kernel of a
/// training step of a plan with dropout: the next step, replayed from the same graph, draws
/// new masks).
pub(crate) fn next_pass(gpu: &Gpu, stream: &CudaStream, draw: &DevBuf<u32>) -> Result<()> {
    assert!(draw.len() >= 4, "next_pass: short draw");
    let draw = draw.ptr();
    gpu.run_blocks(stream, Kernel::DropoutNextPass, (1, 1), 0, kernel_args![draw])
}

/// A residual block's Add forward: z = body output + block input (region `skip`), then y = act(z)
/// where the step has a y of its own.
pub(crate) fn add_forward(pass: &GpuForward, step: &Step, skip: usize, act: Activation) -> Result<()> {
    let (a, b) = (pass.region(step.input_region), pass.region(skip));
    let (z, y) = (pass.region(step.z_region), pass.region(step.output_region));
    let acts = Raw::of(pass.f.acts);
    let out = (z != y).then(|| acts.at_mut(y));
    pass.gpu.residual_add(pass.stream, act, acts.at(a), acts.at(b), acts.at_mut(z), out)
}

/// A residual block's Add backward: its dz (unless the layer after it wrote it), then the
/// body output's gradient = dz where needed.
pub(crate) fn add_backward(pass: &mut GpuBackward, step: &Step, act: Activation) -> Result<()> {
    activation_backward(pass, step, act)?;
    if pass.need_dx {
        let (x, z) = (pass.region(step.input_region), pass.region(step.z_region));
        let dacts = Raw::of(pass.b.dacts);
        pass.gpu.residual_grad(pass.stream, dacts.at(z), dacts.at_mut(x), false)?;
    }
    Ok(())
}

/// A residual block's Fork backward: the block input's gradient += the Add's dz (region `skip`).
pub(crate) fn fork_backward(pass: &mut GpuBackward, step: &Step, skip: usize) -> Result<()> {
    if pass.need_dx {
        let (x, dz) = (pass.region(step.input_region), pass.region(skip));
        let dacts = Raw::of(pass.b.dacts);
        pass.gpu.residual_grad(pass.stream, dacts.at(dz), dacts.at_mut(x), true)?;
    }
    Ok(())
}

impl Gpu {
    /// `batch_norm_stats`: μ and r of each channel into `mean` and `inv`, and the running mean,
    /// running variance and count moved; one block a channel, or, where [`batch_norm_parts`]
    /// splits the channels' sums and `partials` holds 2 × parts × channels values, a block a part
    /// of a channel into `partials` and the parts added (two launches).
    pub(crate) fn batch_norm_stats(
        &self,
        stream: &CudaStream,
        g: &batch_norm::Geometry,
        x: View<f32>,
        (mean, inv): (ViewMut<f32>, ViewMut<f32>),
        [running_mean, running_var, count]: [ViewMut<f32>; 3],
        partials: Option<ViewMut<f64>>,
    ) -> Result<()> {
        let c = g.channels;
        assert!(x.len() >= g.batch * c * g.pixels, "batch_norm_stats: short x");
        assert!(
            mean.len() >= c && inv.len() >= c && running_mean.len() >= c && running_var.len() >= c && !count.is_empty(),
            "batch_norm_stats: short view"
        );
        let _ = int(g.batch * c * g.pixels)?;
        let (x, mean, inv, rm, rv, count) = (x.ptr(), mean.ptr(), inv.ptr(), running_mean.ptr(), running_var.ptr(), count.ptr());
        let (channels, pixels, batch, momentum, eps) = (int(c)?, int(g.pixels)?, int(g.batch)?, batch_norm::MOMENTUM, batch_norm::EPS);
        match (partials, batch_norm_parts(g)) {
            (Some(partials), (parts, chunk)) if parts > 1 && partials.len() >= 2 * parts * c => {
                // Σx of part k of channel c at sums[k·channels + c], its Σ(x − m_k)² as far on
                let (sums, squares) = (partials.ptr(), partials.ptr() + (parts * c * size_of::<f64>()) as u64);
                let (chunk, parts) = (int(chunk)?, int(parts)?);
                let args = kernel_args![x, sums, squares, channels, pixels, batch, chunk];
                self.run_blocks(stream, Kernel::BatchNormStatsSplit, (channels as u32, parts as u32), 0, args)?;
                let args = kernel_args![sums, squares, mean, inv, rm, rv, count, channels, pixels, batch, chunk, parts, momentum, eps];
                self.run_blocks(stream, Kernel::BatchNormStatsJoin, (channels as u32, 1), 0, args)
            }
            _ => {
                let args = kernel_args![x, mean, inv, rm, rv, count, channels, pixels, batch, momentum, eps];
                self.run_blocks(stream, Kernel::BatchNormStats, (channels as u32, 1), 0, args)
            }
        }
    }

    /// `batch_norm_apply`: z = ((x − μ)·r)·γ + β, (μ, r) from `stats` (the saved values), or
    /// with `from_running` from (running mean, running variance); then y = act(z) where a y
    /// and its activation are given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn batch_norm_apply(
        &self,
        stream: &CudaStream,
        g: &batch_norm::Geometry,
        x: View<f32>,
        (z, y): (ViewMut<f32>, Option<(ViewMut<f32>, Activation)>),
        (mean, inv): (View<f32>, View<f32>),
        (gamma, beta): (View<f32>, View<f32>),
        from_running: bool,
    ) -> Result<()> {
        let (c, len) = (g.channels, g.batch * g.channels * g.pixels);
        assert!(x.len() >= len && z.len() >= len && y.as_ref().is_none_or(|(y, _)| y.len() >= len), "batch_norm_apply: short x, z or y");
        assert!(mean.len() >= c && inv.len() >= c && gamma.len() >= c && beta.len() >= c, "batch_norm_apply: short view");
        let ((act, slope), y) = match y {
            Some((y, act)) => (act.gpu_code(), y.ptr()),
            None => (Activation::Identity.gpu_code(), 0),
        };
        let (x, z, mean, inv, gamma, beta) = (x.ptr(), z.ptr(), mean.ptr(), inv.ptr(), gamma.ptr(), beta.ptr());
        let _ = int(len)?;
        let tiles = RowTiles::of(g.batch * c, g.pixels, aligned16(&[x, z, y]));
        let (channels, pixels, rows, eps, from_running) =
            (int(c)?, int(g.pixels)?, int(g.batch * c)?, batch_norm::EPS, i32::from(from_running));
        let (fours, lanes_log2) = (i32::from(tiles.fours), tiles.lanes_log2 as i32);
        let args = kernel_args![x, z, y, mean, inv, gamma, beta, act, slope, channels, pixels, rows, fours, lanes_log2, eps, from_running];
        self.run_blocks(stream, Kernel::BatchNormApply, tiles.grid, 0, args)
    }

    /// `batch_norm_param_grads`: dγ = Σ dy·x̂ and dβ = Σ dy per channel, overwritten; one block
    /// a channel, or split in parts as [`Gpu::batch_norm_stats`] (`partials`: 2 × parts ×
    /// channels values).
    pub(crate) fn batch_norm_param_grads(
        &self,
        stream: &CudaStream,
        g: &batch_norm::Geometry,
        (x, dy): (View<f32>, View<f32>),
        (mean, inv): (View<f32>, View<f32>),
        (dgamma, dbeta): (ViewMut<f32>, ViewMut<f32>),
        partials: Option<ViewMut<f64>>,
    ) -> Result<()> {
        let (c, len) = (g.channels, g.batch * g.channels * g.pixels);
        assert!(x.len() >= len && dy.len() >= len, "batch_norm_param_grads: short x or dy");
        assert!(mean.len() >= c && inv.len() >= c && dgamma.len() >= c && dbeta.len() >= c, "batch_norm_param_grads: short view");
        let _ = int(len)?;
        let (x, dy, mean, inv, dgamma, dbeta) = (x.ptr(), dy.ptr(), mean.ptr(), inv.ptr(), dgamma.ptr(), dbeta.ptr());
        let (channels, pixels, batch) = (int(c)?, int(g.pixels)?, int(g.batch)?);
        match (partials, batch_norm_parts(g)) {
            (Some(partials), (parts, chunk)) if parts > 1 && partials.len() >= 2 * parts * c => {
                // Σ dy of part k of channel c at sums[k·channels + c], its Σ dy·x̂ as far on
                let (sums, sums_xhat) = (partials.ptr(), partials.ptr() + (parts * c * size_of::<f64>()) as u64);
                let (chunk, parts) = (int(chunk)?, int(parts)?);
                let args = kernel_args![x, dy, mean, inv, sums, sums_xhat, channels, pixels, batch, chunk];
                self.run_blocks(stream, Kernel::BatchNormParamGradsSplit, (channels as u32, parts as u32), 0, args)?;
                let args = kernel_args![sums, sums_xhat, dgamma, dbeta, channels, parts];
                self.run_blocks(stream, Kernel::BatchNormParamGradsJoin, (channels as u32, 1), 0, args)
            }
            _ => {
                let args = kernel_args![x, dy, mean, inv, dgamma, dbeta, channels, pixels, batch];
                self.run_blocks(stream, Kernel::BatchNormParamGrads, (channels as u32, 1), 0, args)
            }
        }
    }

    /// `batch_norm_input_grad`: dx = (γ·r)·(dy − (dβ + x̂·dγ)/n), overwritten.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn batch_norm_input_grad(
        &self,
        stream: &CudaStream,
        g: &batch_norm::Geometry,
        x: View<f32>,
        dy: View<f32>,
        dx: ViewMut<f32>,
        (mean, inv): (View<f32>, View<f32>),
        gamma: View<f32>,
        (dgamma, dbeta): (View<f32>, View<f32>),
    ) -> Result<()> {
        let (c, len) = (g.channels, g.batch * g.channels * g.pixels);
        assert!(x.len() >= len && dy.len() >= len && dx.len() >= len, "batch_norm_input_grad: short x, dy or dx");
        assert!(
            [mean.len(), inv.len(), gamma.len(), dgamma.len(), dbeta.len()].iter().all(|&l| l >= c),
            "batch_norm_input_grad: short view"
        );
        let (x, dy, dx, mean, inv, gamma, dgamma, dbeta) =
            (x.ptr(), dy.ptr(), dx.ptr(), mean.ptr(), inv.ptr(), gamma.ptr(), dgamma.ptr(), dbeta.ptr());
        let _ = int(len)?;
        let tiles = RowTiles::of(g.batch * c, g.pixels, aligned16(&[x, dy, dx]));
        let (channels, pixels, rows, inv_count) = (int(c)?, int(g.pixels)?, int(g.batch * c)?, (1.0 / g.n() as f64) as f32);
        let (fours, lanes_log2) = (i32::from(tiles.fours), tiles.lanes_log2 as i32);
        let args = kernel_args![x, dy, dx, mean, inv, gamma, dgamma, dbeta, channels, pixels, rows, fours, lanes_log2, inv_count];
        self.run_blocks(stream, Kernel::BatchNormInputGrad, tiles.grid, 0, args)
    }

    /// `layer_norm_forward`: every row's μ and r into `stats`, and y (a block a row).
    pub(crate) fn layer_norm_forward(
        &self,
        stream: &CudaStream,
        g: &layer_norm::Geometry,
        x: View<f32>,
        y: ViewMut<f32>,
        (mean, inv): (ViewMut<f32>, ViewMut<f32>),
        (gamma, beta): (View<f32>, View<f32>),
    ) -> Result<()> {
        let (rows, features) = (g.rows(), g.features);
        assert!(x.len() >= rows * features && y.len() >= rows * features, "layer_norm_forward: short x or y");
        assert!(
            mean.len() >= rows && inv.len() >= rows && gamma.len() >= features && beta.len() >= features,
            "layer_norm_forward: short view"
        );
        let _ = int(rows * features)?;
        let (x, y, mean, inv, gamma, beta) = (x.ptr(), y.ptr(), mean.ptr(), inv.ptr(), gamma.ptr(), beta.ptr());
        let (grid, rows, features, eps) = (rows.clamp(1, MAX_GRID) as u32, int(rows)?, int(features)?, batch_norm::EPS);
        let args = kernel_args![x, y, mean, inv, gamma, beta, rows, features, eps];
        self.run_blocks(stream, Kernel::LayerNormForward, (grid, 1), 0, args)
    }

    /// `layer_norm_param_grads`: dγ = Σ_rows dy·x̂ and dβ = Σ_rows dy, overwritten (a block a
    /// feature).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_norm_param_grads(
        &self,
        stream: &CudaStream,
        g: &layer_norm::Geometry,
        x: View<f32>,
        dy: View<f32>,
        (mean, inv): (View<f32>, View<f32>),
        dgamma: ViewMut<f32>,
        dbeta: ViewMut<f32>,
    ) -> Result<()> {
        let (rows, features) = (g.rows(), g.features);
        assert!(x.len() >= rows * features && dy.len() >= rows * features, "layer_norm_param_grads: short x or dy");
        assert!(
            mean.len() >= rows && inv.len() >= rows && dgamma.len() >= features && dbeta.len() >= features,
            "layer_norm_param_grads: short view"
        );
        let _ = int(rows * features)?;
        let (x, dy, mean, inv, dgamma, dbeta) = (x.ptr(), dy.ptr(), mean.ptr(), inv.ptr(), dgamma.ptr(), dbeta.ptr());
        let (grid, rows, features) = (features.clamp(1, MAX_GRID) as u32, int(rows)?, int(features)?);
        let args = kernel_args![x, dy, mean, inv, dgamma, dbeta, rows, features];
        self.run_blocks(stream, Kernel::LayerNormParamGrads, (grid, 1), 0, args)
    }

    /// `layer_norm_input_grad`: dx = r·(g − (Σg + x̂·Σg·x̂)/F), g = dy·γ, overwritten (a block
    /// a row).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_norm_input_grad(
        &self,
        stream: &CudaStream,
        g: &layer_norm::Geometry,
        x: View<f32>,
        dy: View<f32>,
        dx: ViewMut<f32>,
        (mean, inv): (View<f32>, View<f32>),
        gamma: View<f32>,
    ) -> Result<()> {
        let (rows, features) = (g.rows(), g.features);
        let len = rows * features;
        assert!(x.len() >= len && dy.len() >= len && dx.len() >= len, "layer_norm_input_grad: short x, dy or dx");
        assert!(mean.len() >= rows && inv.len() >= rows && gamma.len() >= features, "layer_norm_input_grad: short view");
        let _ = int(len)?;
        let (x, dy, dx, mean, inv, gamma) = (x.ptr(), dy.ptr(), dx.ptr(), mean.ptr(), inv.ptr(), gamma.ptr());
        let inv_features = (1.0 / features as f64) as f32;
        let (grid, rows, features) = (rows.clamp(1, MAX_GRID) as u32, int(rows)?, int(features)?);
        let args = kernel_args![x, dy, dx, mean, inv, gamma, rows, features, inv_features];
        self.run_blocks(stream, Kernel::LayerNormInputGrad, (grid, 1), 0, args)
    }

    /// `dropout`: with `train`, out = in·m over the first `n` values, m the mask of
    /// `(draw, output_region, p)` (`layers::dropout`); else out = in.
    pub(crate) fn dropout(
        &self,
        stream: &CudaStream,
        n: usize,
        input: View<f32>,
        out: ViewMut<f32>,
        (draw, output_region, p): (View<u32>, usize, f32),
        train: bool,
    ) -> Result<()> {
        assert!(input.len() >= n && out.len() >= n && draw.len() >= 5, "dropout: short view");
        if n == 0 {
            return Ok(());
        }
        let (input, out, draw) = (input.ptr(), out.ptr(), draw.ptr());
        let (layer, threshold, scale) = (dropout::layer_key(output_region), dropout::threshold(p), dropout::scale(p));
        let (len, train) = (int(n)?, i32::from(train));
        let args = kernel_args![input, out, draw, layer, threshold, scale, len, train];
        self.run_blocks(stream, Kernel::Dropout, (blocks(n), 1), 0, args)
    }

    /// `residual_add`: z = a + b, then y = act(z) where `y` is given.
    pub(crate) fn residual_add(
        &self,
        stream: &CudaStream,
        act: Activation,
        a: View<f32>,
        b: View<f32>,
        z: ViewMut<f32>,
        y: Option<ViewMut<f32>>,
    ) -> Result<()> {
        let n = z.len();
        assert!(a.len() >= n && b.len() >= n && y.as_ref().is_none_or(|y| y.len() >= n), "residual_add: short view");
        if n == 0 {
            return Ok(());
        }
        let (code, slope) = act.gpu_code();
        let (a, b, z, y, len) = (a.ptr(), b.ptr(), z.ptr(), y.map_or(0, |y| y.ptr()), int(n)?);
        let fours = quads(n, &[a, b, z, y]);
        let q = fours as i32;
        self.run_blocks(stream, Kernel::ResidualAdd, (blocks(n - 3 * fours), 1), 0, kernel_args![a, b, z, y, code, slope, q, len])
    }

    /// `residual_grad`: dst = src, or dst += src with `accumulate`, over `dst`'s values.
    pub(crate) fn residual_grad(&self, stream: &CudaStream, src: View<f32>, dst: ViewMut<f32>, accumulate: bool) -> Result<()> {
        let n = dst.len();
        assert!(src.len() >= n, "residual_grad: short src");
        if n == 0 {
            return Ok(());
        }
        let (src, dst, len, accumulate) = (src.ptr(), dst.ptr(), int(n)?, i32::from(accumulate));
        let fours = quads(n, &[src, dst]);
        let q = fours as i32;
        self.run_blocks(stream, Kernel::ResidualGrad, (blocks(n - 3 * fours), 1), 0, kernel_args![src, dst, q, len, accumulate])
    }
}
