//! The convolution's weight gradient on the tensor cores (kernels/conv_mma_wgrad.cu), the
//! weight-gradient half of flatnn's `own-mma` route: dW (OC × CKK) = Σ over the samples and
//! pixels of dZ[oc][p]·A[p][r], an implicit product on mma.sync (sm_80 and later) whose A, the
//! input's values at each tap, is gathered from the band staged in shared memory, as the
//! tensor-core forward gathers it. 3xTF32 in FP32 (FP32's accuracy), one product of TF32
//! roundings where the model's TF32 is on. The samples go in the shares of [`wgrad_shares`] (one
//! block a share and tile of dW), whose sums land in `b.partials` and `conv_wgrad_join` adds in
//! share order, as the direct and implicit weight gradients do: same inputs, same bits. Measured
//! against the other routes like every route (`dnn.rs`), and taken only where it fits
//! ([`MmaWgrad::of`]: shared memory, and a device of compute capability 8.0 or later).

use super::context::{Gpu, Kernel};
use super::conv::{check_wgrad_operands, wgrad_shares, ConvParts};
use super::conv_direct::{band_bound, DIRECT_SHARED};
use super::conv_mma::mma_runs_on;
use super::exec::{Backward, Forward, Raw};
use super::launch::{int, kernel_args, View, ViewMut};
use super::ops::{conv_dims, ints};
use crate::chain::{Plan, Step};
use crate::error::{Error, Result};
use crate::layers::conv;
use cudarc::driver::CudaStream;

/// Output channels a block may sum (the kernels' BM = 16·MF); its taps are 1024 / BM (BN = 8·NF,
/// MF·NF = 8).
pub(crate) const WGRAD_MMA_CHANNELS: [usize; 2] = [16, 32];
/// Pixel tiles a block may stage (multiples of the 8 warps' 8 pixels a k-step that divide the
/// block's 256 threads), the largest that fits first.
pub(crate) const WGRAD_MMA_TILES: [usize; 3] = [256, 128, 64];
/// The block's warps (CMW_WARPS): each sums its own k-steps, the warps' totals added at the end.
pub(crate) const WGRAD_MMA_WARPS: usize = 8;

/// How the tensor-core weight gradient covers a layer at a batch size: blocks of `channels`
/// output channels (`oc_tiles` of them) × [`MmaWgrad::taps`] taps (`r_tiles`) for each share
/// of `chunk` samples (`shares` of them, the last the rest), a sample in tiles of `tile` output
/// pixels, each staged with its band: `bands` input channels of `rows` × `cols` (the bound of
/// every tile's band).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MmaWgrad {
    pub channels: usize,
    pub oc_tiles: usize,
    pub r_tiles: usize,
    pub tile: usize,
    pub rows: usize,
    pub cols: usize,
    pub bands: usize,
    pub chunk: usize,
    pub shares: usize,
}

impl MmaWgrad {
    /// 16 channels a block where they hold the layer's output channels, else 32; the largest tile
    /// whose two stages (and, at the end, the warps' totals) fit in [`DIRECT_SHARED`], at most the
    /// sample's pixels rounded up to a power of two; None where no tile fits or the layer (or
    /// the batch) is empty.
    pub fn of(g: &conv::Geometry, batch: usize) -> Option<MmaWgrad> {
        let (oc, ckk, taps) = (g.out_channels, g.ckk(), g.kernel.0 * g.kernel.1);
        if g.ohw() == 0 || oc == 0 || ckk == 0 || batch == 0 {
            return None;
        }
        let channels = if oc <= WGRAD_MMA_CHANNELS[0] { WGRAD_MMA_CHANNELS[0] } else { WGRAD_MMA_CHANNELS[1] };
        let bn = Self::taps_of(channels);
        let r_tiles = ckk.div_ceil(bn);
        // the input channels the taps rt·bn .. of a block belong to, the most of any block
        let bands = (0..r_tiles).map(|rt| ((rt * bn + bn).min(ckk) - 1) / taps - rt * bn / taps + 1).max()?;
        let (most, last) = (g.ohw().next_power_of_two(), WGRAD_MMA_TILES[WGRAD_MMA_TILES.len() - 1]);
        let oc_tiles = oc.div_ceil(channels);
        let (chunk, shares) = wgrad_shares(g, batch, oc_tiles * r_tiles);
        WGRAD_MMA_TILES.into_iter().filter(|&t| t <= most || t == last).find_map(|tile| {
            let (rows, cols) = band_bound(g, tile);
            let d = MmaWgrad { channels, oc_tiles, r_tiles, tile, rows, cols, bands, chunk, shares };
            (d.shared_bytes() <= DIRECT_SHARED).then_some(d)
        })
    }

    /// Taps (r = (c, i, j)) a block of `channels` output channels sums: BN = 1024 / BM.
    fn taps_of(channels: usize) -> usize {
        1024 / channels
    }

    /// Taps (r = (c, i, j)) a block sums.
    pub fn taps(&self) -> usize {
        Self::taps_of(self.channels)
    }

    /// Floats of one stage: dZ ([channels][tile + 4]), the pixels' offsets (tile) and the band.
    pub fn stage_floats(&self) -> usize {
        self.channels * (self.tile + 4) + self.tile + self.bands * self.rows * self.cols
    }

    /// Bytes of dynamic shared memory a block takes: two stages while it sums, the warps' totals
    /// ([warps][channels][taps]) at the end.
    pub fn shared_bytes(&self) -> usize {
        4 * (2 * self.stage_floats()).max(WGRAD_MMA_WARPS * self.channels * self.taps())
    }

    /// The kernel: its channels a block, one product of TF32 roundings where `tf32`, else 3xTF32.
    fn kernel(&self, tf32: bool) -> Kernel {
        match (self.channels, tf32) {
            (16, true) => Kernel::ConvMmaWgrad16Tf32,
            (_, true) => Kernel::ConvMmaWgrad32Tf32,
            (16, false) => Kernel::ConvMmaWgrad16X3,
            (_, false) => Kernel::ConvMmaWgrad32X3,
        }
    }
}

impl Gpu {
    /// dW (OC × CKK) ← Σ_s Σ_p dZ[s, :, p] · x gathered at p, overwritten, by `conv_mma_wgrad_*`
    /// as [`MmaWgrad::of`] covers the layer, in TF32 where `tf32` (else 3xTF32); with several
    /// shares, their sums go to `partials` (shares × OC·CKK values, at most batch × OC·CKK) and
    /// `conv_wgrad_join` adds them in share order. An Err where it does not fit or the device is
    /// older than compute capability 8.0.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_mma_wgrad(
        &self,
        stream: &CudaStream,
        g: &conv::Geometry,
        batch: usize,
        x: View<f32>,
        dz: View<f32>,
        partials: ViewMut<f32>,
        dw: ViewMut<f32>,
        tf32: bool,
    ) -> Result<()> {
        let d = MmaWgrad::of(g, batch).filter(|_| mma_runs_on(self.compute_capability())).ok_or_else(|| does_not_fit(g))?;
        let w_len = check_wgrad_operands("conv_mma_wgrad", g, batch, d.shares, [x.len(), dz.len(), dw.len(), partials.len()])?;
        let kernel = d.kernel(tf32);
        let (x, dz, dw, partials) = (x.ptr(), dz.ptr(), dw.ptr(), partials.ptr());
        let out = if d.shares == 1 { dw } else { partials };
        let [c, h, wi, kh, kw, sh, sw, ph, pw, dh, dwi, oh, ow, b] = conv_dims(g, batch)?;
        let [oc, chunk, tile, rows, cols, bands, oc_tiles] = ints([g.out_channels, d.chunk, d.tile, d.rows, d.cols, d.bands, d.oc_tiles])?;
        let grid = (int(d.oc_tiles * d.r_tiles)? as u32, int(d.shares)? as u32);
        let args =
            kernel_args![x, dz, out, c, h, wi, kh, kw, sh, sw, ph, pw, dh, dwi, oc, oh, ow, b, chunk, tile, rows, cols, bands, oc_tiles];
        self.run_blocks(stream, kernel, grid, d.shared_bytes() as u32, args)?;
        self.join_wgrad_shares(stream, d.shares, w_len, partials, dw)
    }
}

fn does_not_fit(g: &conv::Geometry) -> Error {
    Error::Shape(format!("the tensor-core weight gradient does not fit {g:?} on this device"))
}

/// dW (OC, C, kh, kw), overwritten, by the tensor-core weight gradient (TF32 where `tf32`, else
/// 3xTF32); its shares' sums in `b.partials`.
pub(super) fn conv_weight_grad_mma(
    gpu: &Gpu,
    stream: &CudaStream,
    plan: &Plan,
    step: &Step,
    f: &Forward,
    b: &Backward,
    tf32: bool,
) -> Result<()> {
    let (acts, dacts, grads, partials) = (Raw::of(f.acts), Raw::of(b.dacts), Raw::of(b.grads), Raw::of(b.partials));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    gpu.conv_mma_wgrad(stream, &g, f.batch, acts.at(x), dacts.at(z), partials.at_mut(0..b.partials.len()), grads.at_mut(w), tf32)
}
