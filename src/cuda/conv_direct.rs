//! Direct convolutions (kernels/conv_direct.cu), flatnn's `own-direct` route: the forward
//! product and the weight gradient computed from x as staged in shared memory, with no lowered
//! matrix and no product routine; and a stride-1 layer's input gradient, which is a forward
//! convolution of dZ by the flipped, transposed weights ([`input_grad_geometry`]), by the forward
//! kernel reading W that way. They aim at layers whose reduction C·kh·kw is small (first
//! layers: LeNet's 1→6 5×5, VGG's 3→16 3×3), where the GEMM-shaped routes are far from the
//! memory floor; like every route, they are measured against the others per layer, direction
//! and batch size (`dnn.rs`), and taken only where they fit ([`DirectForward::of`],
//! [`DirectWgrad::of`]: shared memory and the weight gradient's register tiles).
//!
//! The weight gradient splits the samples into shares as the implicit product does
//! ([`wgrad_shares`], one block a share); with several shares their sums land in `b.partials`
//! and `conv_wgrad_join` adds them in share order: same inputs, same bits.

use super::context::{Gpu, Kernel};
use super::conv::{check_wgrad_operands, wgrad_shares, ConvParts};
use super::exec::{Backward, Forward, Raw};
use super::launch::{int, kernel_args, View, ViewMut, BLOCK};
use super::ops::{conv_dims, ints};
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::conv;
use cudarc::driver::CudaStream;

/// Shared memory a block of the direct or the tensor-core convolution kernels may have: 48 KB,
/// what a launch gets without opting in (at most four such blocks share an SM of the cards flatnn
/// runs on; the tensor-core kernels' launch bounds ask for two).
pub(crate) const DIRECT_SHARED: usize = 48 * 1024;
/// Output pixels a forward thread holds (CDF_PX in kernels/conv_direct.cu) ...
pub(crate) const FORWARD_PIXELS: usize = 4;
/// ... and output channels (CDF_OC).
pub(crate) const FORWARD_CHANNELS: usize = 8;
/// The forward's channel groups a block may have (8·groups channels, 256 / groups threads each).
pub(crate) const FORWARD_GROUPS: [usize; 4] = [1, 2, 4, 8];
/// The weight gradient's register tile: output channels (CDW_OC) × taps (CDW_R).
pub(crate) const WGRAD_CHANNELS: usize = 8;
pub(crate) const WGRAD_TAPS: usize = 4;
/// Pitch of the weight gradient's slice sums in shared memory (CDW_PITCH).
pub(crate) const WGRAD_PITCH: usize = BLOCK as usize + 1;
/// Pixel tiles the weight gradient may take, the largest that fits first.
pub(crate) const WGRAD_TILES: [usize; 6] = [1024, 512, 256, 128, 64, 32];

/// The most input rows and columns the band of a tile of `tile` consecutive output pixels reads
/// (conv_direct_band): the tile spans at most ⌈(tile − 1)/OW⌉ + 1 output rows (at most OH); over
/// more than one row, the band is as wide as the rows.
pub(crate) fn band_bound(g: &conv::Geometry, tile: usize) -> (usize, usize) {
    let (ow, oh) = (g.out_width, g.out_height);
    let span = (oh - 1).min((tile + ow - 2) / ow);
    let rows = span * g.stride.0 + (g.kernel.0 - 1) * g.dilation.0 + 1;
    let wide = if span > 0 { ow } else { tile.min(ow) };
    (rows, (wide - 1) * g.stride.1 + (g.kernel.1 - 1) * g.dilation.1 + 1)
}

/// The input gradient of a stride-1 convolution `g` as a forward convolution, dX = conv(dZ, W'):
/// OC input channels of OH×OW, C output channels of H×W, the kernel and dilation unchanged,
/// padding p' = (k − 1)·d − p in each dimension (then H = OH + 2·p' − (k − 1)·d, as
/// OH = H + 2·p − (k − 1)·d), W'[c][oc][i][j] = W[oc][c][kh − 1 − i][kw − 1 − j]. None where the
/// stride is not (1, 1) or p > (k − 1)·d (a negative p').
pub(crate) fn input_grad_geometry(g: &conv::Geometry) -> Option<conv::Geometry> {
    if g.stride != (1, 1) {
        return None;
    }
    let pad = |k: usize, d: usize, p: usize| k.checked_sub(1)?.checked_mul(d)?.checked_sub(p);
    let padding = (pad(g.kernel.0, g.dilation.0, g.padding.0)?, pad(g.kernel.1, g.dilation.1, g.padding.1)?);
    let t = conv::Geometry {
        in_channels: g.out_channels,
        height: g.out_height,
        width: g.out_width,
        out_channels: g.in_channels,
        out_height: g.height,
        out_width: g.width,
        kernel: g.kernel,
        stride: (1, 1),
        padding,
        dilation: g.dilation,
    };
    debug_assert_eq!(
        (t.height + 2 * padding.0, t.width + 2 * padding.1),
        (g.height + (g.kernel.0 - 1) * g.dilation.0, g.width + (g.kernel.1 - 1) * g.dilation.1)
    );
    Some(t)
}

/// How the direct forward covers a layer: blocks of `groups` channel groups (8·groups output
/// channels, `tile` = 4·256/groups output pixels of one sample), `oc_tiles` × `pixel_tiles` a
/// sample, the input channels staged `chunk` at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DirectForward {
    pub groups: usize,
    pub oc_tiles: usize,
    pub tile: usize,
    pub pixel_tiles: usize,
    pub chunk: usize,
}

impl DirectForward {
    /// The fewest groups that hold every output channel (else 8); None where not even one input
    /// channel's weights and band fit in [`DIRECT_SHARED`].
    pub fn of(g: &conv::Geometry) -> Option<DirectForward> {
        let oc = g.out_channels;
        let groups = FORWARD_GROUPS.into_iter().find(|&k| k * FORWARD_CHANNELS >= oc).unwrap_or(8);
        let tile = BLOCK as usize / groups * FORWARD_PIXELS;
        let chunk = (DIRECT_SHARED / 4 / Self::per_channel(g, groups, tile)).min(g.in_channels);
        let (oc_tiles, pixel_tiles) = (oc.div_ceil(groups * FORWARD_CHANNELS), g.ohw().div_ceil(tile));
        (chunk > 0 && g.ohw() > 0).then_some(DirectForward { groups, oc_tiles, tile, pixel_tiles, chunk })
    }

    /// How it covers the input gradient of `g` ([`input_grad_geometry`]): None where that is not
    /// a forward convolution or the forward does not fit it.
    pub fn input_grad(g: &conv::Geometry) -> Option<DirectForward> {
        DirectForward::of(&input_grad_geometry(g)?)
    }

    /// Floats of shared memory an input channel takes: its weights for the block's channels and
    /// its band.
    fn per_channel(g: &conv::Geometry, groups: usize, tile: usize) -> usize {
        let (rows, cols) = band_bound(g, tile);
        g.kernel.0 * g.kernel.1 * groups * FORWARD_CHANNELS + rows * cols
    }

    /// Bytes of dynamic shared memory a block takes.
    pub fn shared_bytes(&self, g: &conv::Geometry) -> usize {
        4 * self.chunk * Self::per_channel(g, self.groups, self.tile)
    }
}

/// How the direct weight gradient covers a layer at a batch size: one block a share of `chunk`
/// samples (`shares` of them, the last the rest), each sample in tiles of `tile` output pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DirectWgrad {
    pub tile: usize,
    pub chunk: usize,
    pub shares: usize,
}

impl DirectWgrad {
    /// None where the register tiles of every output (⌈OC/8⌉ × ⌈CKK/4⌉) are more than a block's
    /// threads, or no tile's two staging buffers (dZ, offsets and band of all C channels: one
    /// summed while the next is loaded) fit in [`DIRECT_SHARED`]; else the largest tile that
    /// fits, at most the sample's pixels rounded up to a power of two.
    pub fn of(g: &conv::Geometry, batch: usize) -> Option<DirectWgrad> {
        let items = g.out_channels.div_ceil(WGRAD_CHANNELS) * g.ckk().div_ceil(WGRAD_TAPS);
        if items > BLOCK as usize || g.ohw() == 0 || batch == 0 {
            return None;
        }
        let most = g.ohw().next_power_of_two().max(WGRAD_TILES[WGRAD_TILES.len() - 1]);
        let tile = WGRAD_TILES.into_iter().filter(|&t| t <= most).find(|&t| Self::floats(g, t) <= DIRECT_SHARED / 4)?;
        let (chunk, shares) = wgrad_shares(g, batch, 1);
        Some(DirectWgrad { tile, chunk, shares })
    }

    /// Floats of shared memory a block takes at `tile`: two staging buffers while it sums, the
    /// slices' sums at the end.
    fn floats(g: &conv::Geometry, tile: usize) -> usize {
        (2 * Self::buffer(g, tile)).max(WGRAD_CHANNELS * WGRAD_TAPS * WGRAD_PITCH)
    }

    /// Floats of one staging buffer at `tile`: dZ ([tile][OC8], OC8 = OC rounded up to 8), the
    /// offsets (tile) and the band of all channels, rounded up to a multiple of 4 (the second
    /// buffer's dZ is read 16 bytes at a time; tile·(OC8 + 1) is a multiple of 32).
    fn buffer(g: &conv::Geometry, tile: usize) -> usize {
        let (rows, cols) = band_bound(g, tile);
        let oc8 = g.out_channels.div_ceil(WGRAD_CHANNELS) * WGRAD_CHANNELS;
        tile * (oc8 + 1) + (g.in_channels * rows * cols).next_multiple_of(4)
    }

    /// Floats of one of the kernel's two staging buffers (they are this far apart).
    pub fn buffer_floats(&self, g: &conv::Geometry) -> usize {
        Self::buffer(g, self.tile)
    }

    /// Bytes of dynamic shared memory a block takes.
    pub fn shared_bytes(&self, g: &conv::Geometry) -> usize {
        4 * Self::floats(g, self.tile)
    }
}

impl Gpu {
    /// Z (batch, OC, OH, OW) = conv(X, W) without the bias, overwritten, by `conv_direct_forward`
    /// as [`DirectForward::of`] covers the layer; an Err where it does not fit.
    pub fn conv_direct_forward(
        &self,
        stream: &CudaStream,
        g: &conv::Geometry,
        batch: usize,
        x: View<f32>,
        w: View<f32>,
        z: ViewMut<f32>,
    ) -> Result<()> {
        self.direct_forward(stream, g, batch, x, w, z, false)
    }

    /// dX (batch, C, H, W) = convᵀ(dZ, W) of a stride-1 layer `g`, overwritten, by
    /// `conv_direct_forward` on [`input_grad_geometry`] with W (OC, C, kh, kw) read flipped and
    /// transposed; an Err where that is not a forward convolution or does not fit.
    pub fn conv_direct_input_grad(
        &self,
        stream: &CudaStream,
        g: &conv::Geometry,
        batch: usize,
        dz: View<f32>,
        w: View<f32>,
        dx: ViewMut<f32>,
    ) -> Result<()> {
        let t = input_grad_geometry(g).ok_or_else(|| does_not_fit(g))?;
        self.direct_forward(stream, &t, batch, dz, w, dx, true)
    }

    /// `conv_direct_forward` on geometry `g`, its weights W (OC, C, kh, kw) read as stored, or
    /// with `transposed` as W' of a layer whose input gradient `g` is (W of shape (C, OC, kh, kw)).
    #[allow(clippy::too_many_arguments)]
    fn direct_forward(
        &self,
        stream: &CudaStream,
        g: &conv::Geometry,
        batch: usize,
        x: View<f32>,
        w: View<f32>,
        z: ViewMut<f32>,
        transposed: bool,
    ) -> Result<()> {
        let d = DirectForward::of(g).ok_or_else(|| does_not_fit(g))?;
        assert!(x.len() >= batch * g.in_len() && z.len() >= batch * g.out_len(), "conv_direct_forward: short x or z");
        assert!(w.len() >= g.out_channels * g.ckk(), "conv_direct_forward: short w");
        if batch == 0 {
            return Ok(());
        }
        // the kernel's offsets within a sample are ints; a sample's start is a long
        let _ = ints([batch * g.in_len(), batch * g.out_len()])?;
        let grid = int(batch * d.oc_tiles * d.pixel_tiles)? as u32;
        let (x, w, z) = (x.ptr(), w.ptr(), z.ptr());
        let [c, h, wi, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, _] = conv_dims(g, batch)?;
        let [oc, groups, chunk, pixel_tiles, oc_tiles] = ints([g.out_channels, d.groups, d.chunk, d.pixel_tiles, d.oc_tiles])?;
        let transposed = i32::from(transposed);
        let args =
            kernel_args![x, w, z, c, h, wi, kh, kw, sh, sw, ph, pw, dh, dw, oc, oh, ow, groups, chunk, pixel_tiles, oc_tiles, transposed];
        self.run_blocks(stream, Kernel::ConvDirectForward, (grid, 1), d.shared_bytes(g) as u32, args)
    }

    /// dW (OC × CKK) ← Σ_s Σ_p dZ[s, :, p] · x gathered at p, overwritten, by `conv_direct_wgrad`
    /// as [`DirectWgrad::of`] covers the layer (an Err where it does not fit); with several
    /// shares, their sums go to `partials` (shares × OC·CKK values, at most batch × OC·CKK) and
    /// `conv_wgrad_join` adds them in share order.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_direct_wgrad(
        &self,
        stream: &CudaStream,
        g: &conv::Geometry,
        batch: usize,
        x: View<f32>,
        dz: View<f32>,
        partials: ViewMut<f32>,
        dw: ViewMut<f32>,
    ) -> Result<()> {
        let d = DirectWgrad::of(g, batch).ok_or_else(|| does_not_fit(g))?;
        let w_len = check_wgrad_operands("conv_direct_wgrad", g, batch, d.shares, [x.len(), dz.len(), dw.len(), partials.len()])?;
        let (x, dz, dw, partials) = (x.ptr(), dz.ptr(), dw.ptr(), partials.ptr());
        let out = if d.shares == 1 { dw } else { partials };
        let [c, h, wi, kh, kw, sh, sw, ph, pw, dh, dwi, oh, ow, b] = conv_dims(g, batch)?;
        let [oc, chunk, tile, buffer, shares] = ints([g.out_channels, d.chunk, d.tile, d.buffer_floats(g), d.shares])?;
        let args = kernel_args![x, dz, out, c, h, wi, kh, kw, sh, sw, ph, pw, dh, dwi, oc, oh, ow, b, chunk, tile, buffer];
        self.run_blocks(stream, Kernel::ConvDirectWgrad, (shares as u32, 1), d.shared_bytes(g) as u32, args)?;
        self.join_wgrad_shares(stream, d.shares, w_len, partials, dw)
    }
}

fn does_not_fit(g: &conv::Geometry) -> crate::error::Error {
    crate::error::Error::Shape(format!("the direct convolution does not fit {g:?}"))
}

/// Z (batch, OC, OH, OW) = conv(X, W) without the bias, by the direct forward.
pub(super) fn conv_forward_direct(gpu: &Gpu, stream: &CudaStream, plan: &Plan, step: &Step, f: &Forward) -> Result<()> {
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    gpu.conv_direct_forward(stream, &g, f.batch, acts.at(x), params.at(w), acts.at_mut(z))
}

/// dW (OC, C, kh, kw), overwritten, by the direct weight gradient; its shares' sums in
/// `b.partials`.
pub(super) fn conv_weight_grad_direct(gpu: &Gpu, stream: &CudaStream, plan: &Plan, step: &Step, f: &Forward, b: &Backward) -> Result<()> {
    let (acts, dacts, grads, partials) = (Raw::of(f.acts), Raw::of(b.dacts), Raw::of(b.grads), Raw::of(b.partials));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    gpu.conv_direct_wgrad(stream, &g, f.batch, acts.at(x), dacts.at(z), partials.at_mut(0..b.partials.len()), grads.at_mut(w))
}

/// dX (batch, C, H, W), overwritten, by the direct forward on the input gradient's geometry
/// (stride 1): dZ its input, W read flipped and transposed; the producer's activation is not
/// applied.
pub(super) fn conv_input_grad_direct(gpu: &Gpu, stream: &CudaStream, plan: &Plan, step: &Step, f: &Forward, b: &Backward) -> Result<()> {
    let (params, dacts) = (Raw::of(f.params), Raw::of(b.dacts));
    let ConvParts { x, z, w, g } = ConvParts::of(plan, step, f);
    gpu.conv_direct_input_grad(stream, &g, f.batch, dacts.at(z), params.at(w), dacts.at_mut(x))
}
