//! A convolution run on the GPU: its forward and backward launches, through cuDNN where the
//! cache chose it for a direction (`dnn.rs`), else flatnn's kernels (im2col, cuBLAS products,
//! col2im), with flatnn's bias, activation and bias-gradient kernels on every route.
//!
//! The weight gradient has another route of flatnn's own here, also measured: the implicit product
//! ([`conv_weight_grad_implicit`], `conv_wgrad_*` in kernels/conv.cu), which gathers x as it
//! reads it instead of lowering the batch into `f.cols` (batch × CKK × OHW floats written and
//! read again), tiles dW over the output channels and taps, and splits the samples into shares
//! ([`WgradSplit`]) whose sums land in `b.partials` and are added in share order: the same
//! bits run after run, and a split that depends on the sizes alone, not on the card.
//!
//! In inference a convolution may take in the steps after it (`layers::Fused`, as on the CPU: a
//! batch norm right after it, a residual block's sum right after that): its product is written
//! to z as in training, then one kernel ([`Gpu::conv_epilogue`], kernels/conv.cu) adds the bias,
//! normalises by the running statistics, adds the block's input and applies the last step's
//! activation, writing the last step's output alone (no step reads the others', as on the CPU),
//! where the steps one by one would make a pass over the values each. `exec::forward` then skips
//! the steps taken in. Training runs every step: a batch norm needs the batch's statistics.

use super::blas::{Blas, DevMat, DevMatMut};
use super::context::{Gpu, Kernel};
use super::conv_direct::{conv_forward_direct, conv_input_grad_direct, conv_weight_grad_direct};
use super::conv_mma::{conv_forward_mma, conv_input_grad_mma};
use super::conv_mma_wgrad::conv_weight_grad_mma;
use super::cudnn::Dir;
use super::dnn::Route;
use super::exec::{bias_act, dz_pending, Backward, Forward, GpuBackward, GpuForward, Raw};
use super::launch::{aligned16, blocks, int, kernel_args, View, ViewMut, BLOCK};
use super::ops::{conv_dims, ints};
use crate::activation::Activation;
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::{batch_norm, conv, region, Fused, Mode};
use cudarc::driver::CudaStream;
use std::ops::Range;

/// A convolution step's forward: Z without the bias through cuDNN where it was chosen, else
/// flatnn's kernels; then + b and Y = act(Z), or in inference the steps it takes in
/// ([`GpuForward::fused`]) in one pass ([`epilogue`]); `layout` = (channels, pixels per channel).
/// In inference, where the step has a y of its own, z keeps the product without the bias (see
/// [`bias_act`]).
pub(crate) fn conv_forward(pass: &GpuForward, step: &Step, activation: Activation, layout: (usize, usize), mode: Mode) -> Result<()> {
    let GpuForward { gpu, blas, stream, plan, f, index, .. } = *pass;
    if !f.dnn.map_or(Ok(false), |d| d.forward(index, plan, f))? {
        match f.dnn.map_or(Route::Own, |d| d.route(Dir::Forward, index, f.batch)) {
            Route::Direct => conv_forward_direct(gpu, stream, plan, step, f)?,
            Route::Mma => conv_forward_mma(gpu, stream, plan, step, f, f.dnn.is_some_and(|d| d.tf32()))?,
            _ => conv_forward_own(gpu, blas, stream, plan, step, f)?,
        }
    }
    if pass.fused.is_empty() {
        return bias_act(pass, step, activation, step.weight_and_bias().1, layout, mode);
    }
    epilogue(pass, step, layout)
}

/// The steps a convolution's inference takes in, in one pass over its z (which holds the
/// product): the last one's output = act(((z + b − μ)·r)·γ + β + skip), by the batch norm's
/// running statistics and parameters and the residual block's input where those are taken in,
/// the last step's activation; `layout` = (channels, pixels per channel).
fn epilogue(pass: &GpuForward, step: &Step, (channels, pixels): (usize, usize)) -> Result<()> {
    let GpuForward { gpu, stream, plan, f, index, fused, .. } = *pass;
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let norm = fused.batch_norm.map(|bn| {
        let (bn, buffers) = (&plan.steps[bn], Raw::of(f.buffers.expect("a model with batch norm has buffers")));
        let [gamma, beta] = batch_norm::tensors(bn);
        let [mean, var] = [0, 1].map(|i| buffers.at(bn.buffers[i].range.clone()));
        Norm { mean, var, gamma: params.at(gamma), beta: params.at(beta) }
    });
    let skip = fused.add.map(|add| acts.at(pass.region(plan.steps[add].skip.expect("an Add has its block input"))));
    let last = &plan.steps[fused.last(index)];
    let (z, y, bias) =
        (acts.at(pass.region(step.z_region)), acts.at_mut(pass.region(last.output_region)), params.at(step.weight_and_bias().1));
    gpu.conv_epilogue(stream, (channels, pixels, f.batch), z, bias, norm, skip, last.layer.activation(), y)
}

/// A line for each convolution of `plan` that takes steps in on an inference pass, as the CPU's
/// routes report says it: "step 0 conv …: inference: the batch norm of step 1 in its epilogue".
pub(crate) fn epilogue_report(plan: &Plan) -> String {
    let lines = plan.steps.iter().enumerate().filter_map(|(index, step)| {
        let taken = Fused::of(plan, index).describe()?;
        Some(format!("step {index} {}: inference: {taken} in its epilogue", step.layer.summary(step.input)))
    });
    lines.collect::<Vec<_>>().join("\n")
}

/// A batch norm's running mean and variance and its γ and β, a value a channel each.
pub(crate) struct Norm<'a> {
    pub mean: View<'a, f32>,
    pub var: View<'a, f32>,
    pub gamma: View<'a, f32>,
    pub beta: View<'a, f32>,
}

/// How `conv_epilogue` covers `planes` planes of `pixels` values, `vec4` whether it moves
/// float4s: a row of threads a plane, as many as the plane's loads up to the block (a power of
/// two), the block's rows on consecutive planes; the grid (planes, chunks of a plane) and the
/// row's length.
fn epilogue_grid(planes: usize, pixels: usize, vec4: bool) -> ((u32, u32), u32) {
    let loads = if vec4 { pixels / 4 } else { pixels };
    let row = loads.next_power_of_two().min(BLOCK as usize);
    let rows = BLOCK as usize / row;
    let grid = (planes.div_ceil(rows), loads.div_ceil(row).min(u16::MAX as usize));
    ((grid.0 as u32, grid.1 as u32), row as u32)
}

/// The checks both flatnn weight-gradient kernels (implicit, direct) make of their operands, by
/// lengths [x, dz, dw, partials]: x and dz hold `batch` samples, dw OC·CKK values, and where there
/// are several `shares`, partials shares × OC·CKK; the kernels' offsets fit ints (`int` refuses
/// 2^30 or more). Returns OC·CKK.
pub(crate) fn check_wgrad_operands(name: &str, g: &conv::Geometry, batch: usize, shares: usize, lens: [usize; 4]) -> Result<usize> {
    let [x, dz, dw, partials] = lens;
    let w_len = g.out_channels * g.ckk();
    assert!(x >= batch * g.in_len() && dz >= batch * g.out_len(), "{name}: short x or dz");
    assert!(dw >= w_len, "{name}: short dw");
    assert!(shares == 1 || partials >= shares * w_len, "{name}: short partials");
    let _ = ints([batch * g.in_len(), batch * g.out_len(), shares * w_len])?;
    Ok(w_len)
}

impl Gpu {
    /// dW (OC × CKK) ← Σ_s dZ_s · col_sᵀ, overwritten, without the lowered matrix: the
    /// products gathered from x (batch, C, H, W) and dZ (batch, OC, OHW) by `conv_wgrad_*`
    /// (kernels/conv.cu), split over the samples as [`WgradSplit::of`] says; where that gives
    /// several shares, their sums go to `partials` (shares × OC·CKK values, at most batch ×
    /// OC·CKK) and `conv_wgrad_join` adds them in share order. Same inputs, same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_weight_grad_implicit(
        &self,
        stream: &CudaStream,
        g: &conv::Geometry,
        batch: usize,
        x: View<f32>,
        dz: View<f32>,
        partials: ViewMut<f32>,
        dw: ViewMut<f32>,
    ) -> Result<()> {
        let split = WgradSplit::of(g, batch);
        let w_len =
            check_wgrad_operands("conv_weight_grad_implicit", g, batch, split.shares, [x.len(), dz.len(), dw.len(), partials.len()])?;
        let (x, dz, dw, partials) = (x.ptr(), dz.ptr(), dw.ptr(), partials.ptr());
        let out = if split.shares == 1 { dw } else { partials };
        let [c, h, w, kh, kw, sh, sw, ph, pw, dh, dwi, _, ow, b] = conv_dims(g, batch)?;
        let [oc, ohw, chunk, shares] = ints([g.out_channels, g.ohw(), split.chunk, split.shares])?;
        let kernel = match split.oc_tile {
            16 => Kernel::ConvWgrad16,
            32 => Kernel::ConvWgrad32,
            _ => Kernel::ConvWgrad64,
        };
        let tiles = int(split.oc_tiles * split.r_tiles)? as u32;
        let args = kernel_args![x, dz, out, c, h, w, kh, kw, sh, sw, ph, pw, dh, dwi, oc, ow, ohw, b, chunk];
        self.run_grid(stream, kernel, (tiles, shares as u32), args)?;
        self.join_wgrad_shares(stream, split.shares, w_len, partials, dw)
    }

    /// Where a weight gradient's samples were split into several `shares` (this file's implicit
    /// product, the direct and the tensor-core kernels), `conv_wgrad_join`: dW (`w_len` values)
    /// = the shares' sums in `partials`, added in share order; with one share the kernel wrote
    /// dW itself and nothing runs.
    pub(super) fn join_wgrad_shares(&self, stream: &CudaStream, shares: usize, w_len: usize, partials: u64, dw: u64) -> Result<()> {
        if shares > 1 {
            let [n, shares] = ints([w_len, shares])?;
            self.run(stream, Kernel::ConvWgradJoin, blocks(w_len), kernel_args![partials, dw, n, shares])?;
        }
        Ok(())
    }

    /// `conv_epilogue`: y[s, c, p] = act(v) for `batch` samples of `channels × pixels`, with
    /// v = z + bias[c], then v = ((v − μ[c])·r)·γ[c] + β[c], r = 1/√(var[c] + ε), with `norm`
    /// (a batch norm's inference), then v + skip with `skip` (a residual block's sum); each step
    /// rounded as its own kernel rounds it. z, skip and y are distinct regions.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn conv_epilogue(
        &self,
        stream: &CudaStream,
        (channels, pixels, batch): (usize, usize, usize),
        z: View<f32>,
        bias: View<f32>,
        norm: Option<Norm>,
        skip: Option<View<f32>>,
        act: Activation,
        y: ViewMut<f32>,
    ) -> Result<()> {
        let (planes, len) = (batch * channels, batch * channels * pixels);
        assert!(z.len() >= len && y.len() >= len && skip.is_none_or(|s| s.len() >= len), "conv_epilogue: short z, skip or y");
        let short = norm.as_ref().is_some_and(|n| [n.mean, n.var, n.gamma, n.beta].iter().any(|v| v.len() < channels));
        assert!(bias.len() >= channels && !short, "conv_epilogue: short bias or batch norm");
        if len == 0 {
            return Ok(());
        }
        let (z, y, skip) = (z.ptr(), y.ptr(), skip.map_or(0, |s| s.ptr()));
        let vec4 = pixels % 4 == 0 && aligned16(&[z, y, skip]);
        let (grid, row) = epilogue_grid(planes, pixels, vec4);
        let [mean, var, gamma, beta] = norm.map_or([0; 4], |n| [n.mean.ptr(), n.var.ptr(), n.gamma.ptr(), n.beta.ptr()]);
        let ((code, slope), bias, eps) = (act.gpu_code(), bias.ptr(), batch_norm::EPS);
        // the values' count an `int` as every kernel's (the kernel indexes within a plane as int)
        int(len)?;
        let (channels, pixels, planes, row, vec4) = (int(channels)?, int(pixels)?, int(planes)?, int(row as usize)?, i32::from(vec4));
        let args = kernel_args![z, bias, mean, var, gamma, beta, skip, y, code, slope, channels, pixels, planes, row, vec4, eps];
        self.run_blocks(stream, Kernel::ConvEpilogue, grid, 0, args)
    }
}

/// A convolution step's backward: its dz (unless written) and db, in one pass where dz is still
/// to be computed ([`Gpu::act_bias_grad`]: dz is written and summed as it is computed, not
/// read back); then dW and (where needed) dX, each through cuDNN where it was chosen, else
/// flatnn's kernels (dW by the implicit product, dW and dX by the direct kernels and by the
/// tensor-core ones, where chosen); `layout` = (channels, pixels per channel).
pub(crate) fn conv_backward(pass: &mut GpuBackward, step: &Step, activation: Activation, (channels, pixels): (usize, usize)) -> Result<()> {
    let GpuBackward { gpu, blas, stream, plan, f, b, index, need_dx, .. } = *pass;
    let (z, y) = (pass.region(step.z_region), pass.region(step.output_region));
    let (_, bias) = step.weight_and_bias();
    let db = Raw::of(b.grads).at_mut(bias);
    // the per-sample weight gradients' scratch is free until the weight gradient below
    let partials = Some(Raw::of(b.partials).at_mut(0..b.partials.len()));
    if dz_pending(pass, step) {
        let (z_in, y_in, dy, dz) = (pass.acts(z.clone()), pass.acts(y.clone()), pass.dacts(y), pass.dacts_mut(z));
        gpu.act_bias_grad(stream, activation, (channels, pixels, f.batch), z_in, y_in, dy, dz, db, partials)?;
    } else {
        gpu.bias_grad(stream, channels, pixels, f.batch, pass.dacts(z), db, partials)?;
    }
    if !f.dnn.map_or(Ok(false), |d| d.weight_grad(index, plan, f, b))? {
        match f.dnn.map_or(Route::Own, |d| d.route(Dir::Weight, index, f.batch)) {
            Route::Implicit => conv_weight_grad_implicit(gpu, stream, plan, step, f, b)?,
            Route::Direct => conv_weight_grad_direct(gpu, stream, plan, step, f, b)?,
            Route::Mma => conv_weight_grad_mma(gpu, stream, plan, step, f, b, f.dnn.is_some_and(|d| d.tf32()))?,
            _ => conv_weight_grad_own(gpu, blas, stream, plan, step, f, b)?,
        }
    }
    if need_dx && !f.dnn.map_or(Ok(false), |d| d.input_grad(index, plan, f, b))? {
        match f.dnn.map_or(Route::Own, |d| d.route(Dir::Input, index, f.batch)) {
            Route::Direct => conv_input_grad_direct(gpu, stream, plan, step, f, b)?,
            Route::Mma => conv_input_grad_mma(gpu, stream, plan, step, f, b, f.dnn.is_some_and(|d| d.tf32()))?,
            _ => conv_input_grad_own(gpu, blas, stream, plan, step, f, b)?,
        }
    }
    Ok(())
}

/// A convolution step's regions for the batch (input x, pre-activation z), its weight range and
/// its geometry.
pub(super) struct ConvParts {
    pub x: Range<usize>,
    pub z: Range<usize>,
    pub w: Range<usize>,
    pub g: conv::Geometry,
}

impl ConvParts {
    pub fn of(plan: &Plan, step: &Step, f: &Forward) -> ConvParts {
        let (capacity, batch) = (f.capacity, f.batch);
        let (x, z) = (region(plan, step.input_region, capacity, batch), region(plan, step.z_region, capacity, batch));
        ConvParts { x, z, w: step.weight_and_bias().0, g: conv::geometry(step) }
    }
}

/// Z (batch, OC, OH, OW) = conv(X, W) without the bias, through flatnn's kernels: im2col, then
/// one strided-batched product.
pub(super) fn conv_forward_own(gpu: &Gpu, blas: &Blas, stream: &CudaStream, plan: &Plan, step: &Step, f: &Forward) -> Result<()> {
    let (params, acts, cols) = (Raw::of(f.params), Raw::of(f.acts), Raw::of(f.cols));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    let batch = f.batch;
    let (oc, ckk, ohw, lowered) = (g.out_channels, g.ckk(), g.ohw(), g.lowered_len());
    gpu.im2col(stream, &g, batch, acts.at(x), cols.at_mut(0..batch * lowered))?;
    // Z_s (OC × OHW) = W (OC × CKK) · col_s (CKK × OHW), for every sample s
    let wm = DevMat { data: params.at(w), rs: ckk, cs: 1 };
    let colm = DevMat { data: cols.at(0..batch * lowered), rs: ohw, cs: 1 };
    let zm = DevMatMut { data: acts.at_mut(z), rs: ohw, cs: 1 };
    blas.sgemm_batched(batch, oc, ohw, ckk, 1.0, (wm, 0), (colm, lowered), 0.0, (zm, oc * ohw))
}

/// dW (OC, C, kh, kw) = Σ_s dZ_s · col_sᵀ, overwritten, through flatnn's kernels: im2col,
/// per-sample products, then their sum as one product with a row of ones.
pub(super) fn conv_weight_grad_own(
    gpu: &Gpu,
    blas: &Blas,
    stream: &CudaStream,
    plan: &Plan,
    step: &Step,
    f: &Forward,
    b: &Backward,
) -> Result<()> {
    let (acts, cols) = (Raw::of(f.acts), Raw::of(f.cols));
    let (dacts, grads, partials, ones) = (Raw::of(b.dacts), Raw::of(b.grads), Raw::of(b.partials), Raw::of(b.ones));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    let batch = f.batch;
    let (oc, ckk, ohw, lowered) = (g.out_channels, g.ckk(), g.ohw(), g.lowered_len());
    let w_len = oc * ckk;
    gpu.im2col(stream, &g, batch, acts.at(x), cols.at_mut(0..batch * lowered))?;
    // dW_s (OC × CKK) = dZ_s (OC × OHW) · col_sᵀ (OHW × CKK), one per sample ...
    let dzm = DevMat { data: dacts.at(z), rs: ohw, cs: 1 };
    let colt = DevMat { data: cols.at(0..batch * lowered), rs: 1, cs: ohw };
    let pm = DevMatMut { data: partials.at_mut(0..batch * w_len), rs: ckk, cs: 1 };
    blas.sgemm_batched(batch, oc, ckk, ohw, 1.0, (dzm, oc * ohw), (colt, lowered), 0.0, (pm, w_len))?;
    // ... then dW (1 × OC·CKK) = 1ᵀ (1 × batch) · partials (batch × OC·CKK)
    let onesm = DevMat { data: ones.at(0..batch), rs: batch, cs: 1 };
    let pm = DevMat { data: partials.at(0..batch * w_len), rs: w_len, cs: 1 };
    blas.sgemm(1, w_len, batch, 1.0, onesm, pm, 0.0, DevMatMut { data: grads.at_mut(w), rs: w_len, cs: 1 })
}

/// dW (OC, C, kh, kw) = Σ_s Σ_p dZ[s, :, p] · x gathered at p, overwritten, through flatnn's
/// implicit product (`conv_wgrad_*` in kernels/conv.cu): no lowered matrix; the batch split into
/// [`WgradSplit::of`]'s shares, their sums in `b.partials` and added in share order.
pub(super) fn conv_weight_grad_implicit(gpu: &Gpu, stream: &CudaStream, plan: &Plan, step: &Step, f: &Forward, b: &Backward) -> Result<()> {
    let (acts, dacts, grads, partials) = (Raw::of(f.acts), Raw::of(b.dacts), Raw::of(b.grads), Raw::of(b.partials));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    gpu.conv_weight_grad_implicit(stream, &g, f.batch, acts.at(x), dacts.at(z), partials.at_mut(0..b.partials.len()), grads.at_mut(w))
}

/// Output channels × taps (r = (c, i, j)) of a block's tile of the implicit weight gradient:
/// one of [`WgradSplit::OC_TILES`] (WGI_TR in kernels/conv.cu).
pub(crate) const WGRAD_R_TILE: usize = 64;
/// Values of k = (sample, pixel) a block stages at a time (WGI_KC; the launch does not need it).
#[cfg(test)]
pub(crate) const WGRAD_STEP: usize = 64;
/// The blocks the implicit weight gradient aims at (about four an SM of the cards flatnn runs
/// on; a constant, so that the bits of a sum depend on the sizes alone, not on the card) ...
const WGRAD_BLOCKS: usize = 512;
/// ... while each block still has at least this many (sample, pixel) pairs to sum over.
const WGRAD_MIN_PIXELS: usize = 2048;

/// How the implicit weight gradient covers a layer at a batch size: tiles of `oc_tile` output
/// channels × [`WGRAD_R_TILE`] taps, and the samples in `shares` shares of `chunk` (the last
/// share the rest). With one share the blocks write dW; else each writes its share's sums to
/// the partials (`shares × OC·CKK`, share-major), added per element in share order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WgradSplit {
    pub oc_tile: usize,
    pub oc_tiles: usize,
    pub r_tiles: usize,
    pub chunk: usize,
    pub shares: usize,
}

impl WgradSplit {
    /// The output-channel tiles there are kernels for (`conv_wgrad_16`, `_32`, `_64`).
    pub const OC_TILES: [usize; 3] = [16, 32, 64];

    /// The smallest tile that holds every output channel (else the largest); the shares of
    /// [`wgrad_shares`].
    pub fn of(g: &conv::Geometry, batch: usize) -> WgradSplit {
        let oc = g.out_channels;
        let oc_tile = Self::OC_TILES.into_iter().find(|&t| t >= oc).unwrap_or(Self::OC_TILES[2]);
        let (oc_tiles, r_tiles) = (oc.div_ceil(oc_tile), g.ckk().div_ceil(WGRAD_R_TILE));
        let (chunk, shares) = wgrad_shares(g, batch, oc_tiles * r_tiles);
        WgradSplit { oc_tile, oc_tiles, r_tiles, chunk, shares }
    }
}

/// (chunk, shares): the samples of a weight gradient whose every share takes `blocks` blocks, in
/// `shares` shares of `chunk` (the last the rest): as many as give about [`WGRAD_BLOCKS`]
/// blocks, at most one a sample and at least [`WGRAD_MIN_PIXELS`] pairs a share, then as many as
/// the chunk needs (none empty). The sizes alone decide it, not the card.
pub(crate) fn wgrad_shares(g: &conv::Geometry, batch: usize, blocks: usize) -> (usize, usize) {
    let wanted = WGRAD_BLOCKS.div_ceil(blocks.max(1));
    let shares = wanted.min(batch * g.ohw() / WGRAD_MIN_PIXELS).min(batch).max(1);
    let chunk = batch.div_ceil(shares).max(1);
    (chunk, batch.div_ceil(chunk).max(1))
}

/// dX (batch, C, H, W) = convᵀ(dZ, W), overwritten, through flatnn's kernels: per-sample
/// products into lowered form, then col2im.
pub(super) fn conv_input_grad_own(
    gpu: &Gpu,
    blas: &Blas,
    stream: &CudaStream,
    plan: &Plan,
    step: &Step,
    f: &Forward,
    b: &Backward,
) -> Result<()> {
    let params = Raw::of(f.params);
    let (dacts, dcols) = (Raw::of(b.dacts), Raw::of(b.dcols));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    let batch = f.batch;
    let (oc, ckk, ohw, lowered) = (g.out_channels, g.ckk(), g.ohw(), g.lowered_len());
    // dcol_s (CKK × OHW) = Wᵀ (CKK × OC) · dZ_s (OC × OHW), then col2im
    let wt = DevMat { data: params.at(w), rs: 1, cs: ckk };
    let dzm = DevMat { data: dacts.at(z), rs: ohw, cs: 1 };
    let dcolm = DevMatMut { data: dcols.at_mut(0..batch * lowered), rs: ohw, cs: 1 };
    blas.sgemm_batched(batch, ckk, ohw, oc, 1.0, (wt, 0), (dzm, oc * ohw), 0.0, (dcolm, lowered))?;
    gpu.col2im(stream, &g, batch, dcols.at(0..batch * lowered), dacts.at_mut(x))
}
