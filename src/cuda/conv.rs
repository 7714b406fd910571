//! A convolution run on the GPU: its forward and backward launches, through cuDNN where the
//! cache chose it for a direction (`dnn.rs`), else flatnn's kernels (im2col, cuBLAS products,
//! col2im), with flatnn's bias, activation and bias-gradient kernels on both paths.

use super::blas::{Blas, DevMat, DevMatMut};
use super::context::Gpu;
use super::exec::{activation_backward, bias_act, Backward, Forward, GpuBackward, GpuForward, Raw};
use crate::activation::Activation;
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::{conv, region};
use cudarc::driver::CudaStream;
use std::ops::Range;

/// A convolution step's forward: Z without the bias through cuDNN where it was chosen, else
/// flatnn's kernels; then + b and Y = act(Z), `layout` = (channels, pixels per channel).
pub(crate) fn conv_forward(pass: &GpuForward, step: &Step, activation: Activation, layout: (usize, usize)) -> Result<()> {
    let GpuForward { gpu, blas, stream, plan, f, index, .. } = *pass;
    if !f.dnn.map_or(Ok(false), |d| d.forward(index, plan, f))? {
        conv_forward_own(gpu, blas, stream, plan, step, f)?;
    }
    bias_act(pass, step, activation, step.weight_and_bias().1, layout)
}

/// A convolution step's backward: its dz (unless written), db, then dW and (where needed) dX,
/// each through cuDNN where it was chosen, else flatnn's kernels; `layout` = (channels, pixels
/// per channel).
pub(crate) fn conv_backward(pass: &mut GpuBackward, step: &Step, activation: Activation, (channels, pixels): (usize, usize)) -> Result<()> {
    activation_backward(pass, step, activation)?;
    let GpuBackward { gpu, blas, stream, plan, f, b, index, need_dx, .. } = *pass;
    let z = pass.region(step.z_region);
    let (_, bias) = step.weight_and_bias();
    // the per-sample weight gradients' scratch is free until the weight gradient below
    let partials = Raw::of(b.partials).at_mut(0..b.partials.len());
    gpu.bias_grad(stream, channels, pixels, f.batch, pass.dacts(z), Raw::of(b.grads).at_mut(bias), Some(partials))?;
    if !f.dnn.map_or(Ok(false), |d| d.weight_grad(index, plan, f, b))? {
        conv_weight_grad_own(gpu, blas, stream, plan, step, f, b)?;
    }
    if need_dx && !f.dnn.map_or(Ok(false), |d| d.input_grad(index, plan, f, b))? {
        conv_input_grad_own(gpu, blas, stream, plan, step, f, b)?;
    }
    Ok(())
}

/// A convolution step's regions for the batch (input x, pre-activation z), its weight range and
/// its geometry.
struct ConvParts {
    x: Range<usize>,
    z: Range<usize>,
    w: Range<usize>,
    g: conv::Geometry,
}

impl ConvParts {
    fn of(plan: &Plan, step: &Step, f: &Forward) -> ConvParts {
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
