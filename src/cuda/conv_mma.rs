//! Tensor-core convolutions (kernels/conv_mma.cu), flatnn's `own-mma` route: the forward as an
//! implicit product on mma.sync (sm_80 and later), the input's band staged in shared memory as
//! the direct kernels stage it and each warp's operands gathered from it, with no lowered
//! matrix; and a stride-1 layer's input gradient, a forward convolution of dZ by the flipped,
//! transposed weights ([`input_grad_geometry`]). In FP32 it runs the 3xTF32 split (FP32's
//! accuracy, three products), where the model's TF32 is on one product of TF32 roundings. Like
//! every route it is measured against the others per layer, direction, batch size and
//! arithmetic (`dnn.rs`), and taken only where it fits ([`MmaForward::of`]: shared memory, and
//! a device of compute capability 8.0 or later).

use super::context::{Gpu, Kernel};
use super::conv::ConvParts;
use super::conv_direct::{band_bound, input_grad_geometry, DIRECT_SHARED};
use super::exec::{Backward, Forward, Raw};
use super::launch::{int, kernel_args, View, ViewMut};
use super::ops::{conv_dims, ints};
use crate::chain::{Plan, Step};
use crate::error::{Error, Result};
use crate::layers::conv;
use cudarc::driver::CudaStream;

/// Output pixels a block computes (CMM_TILE in kernels/conv_mma.cu): 8 warps of 2 strips of 16.
pub(crate) const MMA_TILE: usize = 256;
/// Output channels a block may compute (the kernels' BN = 8·NF), the fewest that hold a layer's.
pub(crate) const MMA_CHANNELS: [usize; 3] = [8, 16, 32];

/// How the tensor-core forward covers a layer: blocks of `channels` output channels (`oc_tiles`
/// of them) × [`MMA_TILE`] output pixels of one sample (`pixel_tiles` a sample), the input
/// channels staged `chunk` at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MmaForward {
    pub channels: usize,
    pub oc_tiles: usize,
    pub pixel_tiles: usize,
    pub chunk: usize,
}

impl MmaForward {
    /// The fewest channels a block that hold the layer's output channels (else 32), and the most
    /// input channels a chunk whose two stages fit in [`DIRECT_SHARED`], a multiple of 8 where they
    /// are not all (then chunk·kh·kw is a multiple of 8: no padded k); None where not even one
    /// input channel fits, or the layer has no outputs.
    pub fn of(g: &conv::Geometry) -> Option<MmaForward> {
        let oc = g.out_channels;
        if g.ohw() == 0 || oc == 0 || g.in_channels == 0 {
            return None;
        }
        let channels = MMA_CHANNELS.into_iter().find(|&n| n >= oc).unwrap_or(MMA_CHANNELS[MMA_CHANNELS.len() - 1]);
        let most = (1..=g.in_channels).rev().find(|&chunk| 4 * Self::floats(g, channels, chunk) <= DIRECT_SHARED)?;
        let chunk = if most < g.in_channels && most >= 8 { most / 8 * 8 } else { most };
        Some(MmaForward { channels, oc_tiles: oc.div_ceil(channels), pixel_tiles: g.ohw().div_ceil(MMA_TILE), chunk })
    }

    /// How it covers the input gradient of `g` ([`input_grad_geometry`]): None where that is not
    /// a forward convolution or the forward does not fit it.
    pub fn input_grad(g: &conv::Geometry) -> Option<MmaForward> {
        MmaForward::of(&input_grad_geometry(g)?)
    }

    /// Floats of shared memory at `chunk`: the taps' offsets (kc8 = chunk·kh·kw rounded up to 8),
    /// then two stages of the weights ([channels][kc8 + 4]) and the band of `chunk` channels,
    /// each rounded up to 4 floats (the weights' rows 16-byte aligned in both, for ldmatrix).
    fn floats(g: &conv::Geometry, channels: usize, chunk: usize) -> usize {
        let (rows, cols) = band_bound(g, MMA_TILE);
        let kc8 = (chunk * g.kernel.0 * g.kernel.1).next_multiple_of(8);
        kc8 + 2 * (channels * (kc8 + 4) + chunk * rows * cols).next_multiple_of(4)
    }

    /// Bytes of dynamic shared memory a block takes.
    pub fn shared_bytes(&self, g: &conv::Geometry) -> usize {
        4 * Self::floats(g, self.channels, self.chunk)
    }

    /// The kernel: its channels a block, one product of TF32 roundings where `tf32`, else 3xTF32.
    fn kernel(&self, tf32: bool) -> Kernel {
        match (self.channels, tf32) {
            (8, true) => Kernel::ConvMma8Tf32,
            (16, true) => Kernel::ConvMma16Tf32,
            (_, true) => Kernel::ConvMma32Tf32,
            (8, false) => Kernel::ConvMma8X3,
            (16, false) => Kernel::ConvMma16X3,
            (_, false) => Kernel::ConvMma32X3,
        }
    }
}

/// Whether the tensor-core kernels run on a device of compute capability `cc` (mma.sync on
/// TF32 and cp.async: 8.0 on).
pub(crate) fn mma_runs_on(cc: (u32, u32)) -> bool {
    cc.0 >= 8
}

impl Gpu {
    /// Z (batch, OC, OH, OW) = conv(X, W) without the bias, overwritten, by `conv_mma_*` as
    /// [`MmaForward::of`] covers the layer, in TF32 where `tf32` (else 3xTF32); an Err where it
    /// does not fit or the device is older than compute capability 8.0.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_mma_forward(
        &self,
        stream: &CudaStream,
        g: &conv::Geometry,
        batch: usize,
        x: View<f32>,
        w: View<f32>,
        z: ViewMut<f32>,
        tf32: bool,
    ) -> Result<()> {
        self.mma_forward(stream, g, batch, (x, w, z), tf32, false)
    }

    /// dX (batch, C, H, W) = convᵀ(dZ, W) of a stride-1 layer `g`, overwritten, by `conv_mma_*`
    /// on [`input_grad_geometry`] with W (OC, C, kh, kw) read flipped and transposed, in TF32
    /// where `tf32`; an Err where that is not a forward convolution or does not fit.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_mma_input_grad(
        &self,
        stream: &CudaStream,
        g: &conv::Geometry,
        batch: usize,
        dz: View<f32>,
        w: View<f32>,
        dx: ViewMut<f32>,
        tf32: bool,
    ) -> Result<()> {
        let t = input_grad_geometry(g).ok_or_else(|| does_not_fit(g))?;
        self.mma_forward(stream, &t, batch, (dz, w, dx), tf32, true)
    }

    /// `conv_mma_*` on geometry `g`, its weights W (OC, C, kh, kw) read as stored, or with
    /// `transposed` as W' of a layer whose input gradient `g` is (W of shape (C, OC, kh, kw)).
    fn mma_forward(
        &self,
        stream: &CudaStream,
        g: &conv::Geometry,
        batch: usize,
        (x, w, z): (View<f32>, View<f32>, ViewMut<f32>),
        tf32: bool,
        transposed: bool,
    ) -> Result<()> {
        let d = MmaForward::of(g).filter(|_| mma_runs_on(self.compute_capability())).ok_or_else(|| does_not_fit(g))?;
        assert!(x.len() >= batch * g.in_len() && z.len() >= batch * g.out_len(), "conv_mma_forward: short x or z");
        assert!(w.len() >= g.out_channels * g.ckk(), "conv_mma_forward: short w");
        if batch == 0 {
            return Ok(());
        }
        // the kernel's offsets within a sample and into W are ints; a sample's start is a long
        let _ = ints([batch * g.in_len(), batch * g.out_len(), g.out_channels * g.ckk()])?;
        let grid = int(batch * d.oc_tiles * d.pixel_tiles)? as u32;
        let kernel = d.kernel(tf32);
        let (x, w, z) = (x.ptr(), w.ptr(), z.ptr());
        let [c, h, wi, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, _] = conv_dims(g, batch)?;
        let [oc, chunk, pixel_tiles, oc_tiles] = ints([g.out_channels, d.chunk, d.pixel_tiles, d.oc_tiles])?;
        let transposed = i32::from(transposed);
        let args = kernel_args![x, w, z, c, h, wi, kh, kw, sh, sw, ph, pw, dh, dw, oc, oh, ow, chunk, pixel_tiles, oc_tiles, transposed];
        self.run_blocks(stream, kernel, (grid, 1), d.shared_bytes(g) as u32, args)
    }
}

fn does_not_fit(g: &conv::Geometry) -> Error {
    Error::Shape(format!("the tensor-core convolution does not fit {g:?} on this device"))
}

/// Z (batch, OC, OH, OW) = conv(X, W) without the bias, by the tensor-core forward (TF32 where
/// `tf32`, else 3xTF32).
pub(super) fn conv_forward_mma(gpu: &Gpu, stream: &CudaStream, plan: &Plan, step: &Step, f: &Forward, tf32: bool) -> Result<()> {
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    gpu.conv_mma_forward(stream, &g, f.batch, acts.at(x), params.at(w), acts.at_mut(z), tf32)
}

/// dX (batch, C, H, W), overwritten, by the tensor-core forward on the input gradient's geometry
/// (stride 1): dZ its input, W read flipped and transposed; the producer's activation is not
/// applied.
pub(super) fn conv_input_grad_mma(
    gpu: &Gpu,
    stream: &CudaStream,
    plan: &Plan,
    step: &Step,
    f: &Forward,
    b: &Backward,
    tf32: bool,
) -> Result<()> {
    let (params, dacts) = (Raw::of(f.params), Raw::of(b.dacts));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    gpu.conv_mma_input_grad(stream, &g, f.batch, dacts.at(z), params.at(w), dacts.at_mut(x), tf32)
}
