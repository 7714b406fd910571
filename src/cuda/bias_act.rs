//! The launches of kernels/activation.cu: a layer's bias and activation (forward), the
//! activation's gradient, and the bias gradient (alone, or with the activation's gradient in the
//! same pass); as ops.rs's wrappers, each checks its views on the host and allocates nothing.

use super::context::{Gpu, Kernel};
use super::launch::{aligned16, blocks, int, kernel_args, View, ViewMut};
use super::ops::ints;
use crate::activation::Activation;
use crate::error::Result;
use cudarc::driver::CudaStream;

/// `bias_grad` splits a channel's sum into parts while its channels give fewer blocks than
/// this (about eight blocks an SM: each thread keeps one load in flight, so the memory's rate
/// needs many); a constant, not measured per card, so a sum's bits depend on the sizes alone ...
const BIAS_GRAD_BLOCKS: usize = 1024;
/// ... and each part has at least this many values to sum.
const BIAS_GRAD_MIN_PART: usize = 4096;

/// Into how many parts [`Gpu::bias_grad`] splits each channel's sum over `batch` samples of
/// `pixels` values (1: not split).
pub(crate) fn bias_grad_splits(channels: usize, pixels: usize, batch: usize) -> usize {
    let wanted = BIAS_GRAD_BLOCKS.div_ceil(channels.max(1));
    wanted.min(batch).min((batch * pixels).div_ceil(BIAS_GRAD_MIN_PART)).max(1)
}

/// How a bias gradient's sums run: into `partials` (its address) in [`bias_grad_splits`] parts of
/// `chunk` samples where that splits and `partials` holds as many parts, else (None) one part of
/// every sample, a block a channel writing db; returns (partials, chunk, parts).
fn bias_grad_parts(channels: usize, pixels: usize, batch: usize, partials: Option<ViewMut<f32>>) -> (Option<u64>, usize, usize) {
    let splits = bias_grad_splits(channels, pixels, batch);
    match partials {
        Some(partials) if splits > 1 && partials.len() >= splits * channels => (Some(partials.ptr()), batch.div_ceil(splits), splits),
        _ => (None, batch, 1),
    }
}

impl Gpu {
    /// `z[s, c, p] += bias[c]` for `batch` samples of `channels × pixels`; then y = act(z) when
    /// `y` is given. Without `y` only the bias is added (an identity layer, whose z is its y).
    /// With `y` and not `keep_z`, y = act(z + b) and z is left as it was (an inference pass,
    /// where nothing reads z again: one pass over it fewer).
    #[allow(clippy::too_many_arguments)]
    pub fn bias_act(
        &self,
        stream: &CudaStream,
        act: Activation,
        bias: View<f32>,
        channels: usize,
        pixels: usize,
        batch: usize,
        z: ViewMut<f32>,
        y: Option<ViewMut<f32>>,
        keep_z: bool,
    ) -> Result<()> {
        let len = batch * channels * pixels;
        assert!(bias.len() >= channels && z.len() >= len, "bias_act: short bias or z");
        assert!(y.as_ref().is_none_or(|y| y.len() >= len), "bias_act: short y");
        if len == 0 {
            return Ok(());
        }
        let (code, slope) = act.gpu_code();
        // fours as float4 where every pointer is 16-byte aligned and a four lies in one row
        // (see bias_act_forward)
        let rows_fit = if pixels == 1 { channels.is_multiple_of(4) } else { pixels.is_multiple_of(4) };
        let (z, y, bias) = (z.ptr(), y.map_or(0, |y| y.ptr()), bias.ptr());
        let quads = if rows_fit && aligned16(&[z, y, bias]) { len / 4 } else { 0 };
        let (channels, pixels, quads, n, keep_z) = (int(channels)?, int(pixels)?, int(quads)?, int(len)?, i32::from(keep_z));
        let args = kernel_args![z, y, bias, code, slope, channels, pixels, quads, n, keep_z];
        self.run(stream, Kernel::BiasActForward, blocks(len.div_ceil(4)), args)
    }

    /// dz = dy ⊙ act'(z) over the first `n` values (y = act(z), from the forward pass).
    #[allow(clippy::too_many_arguments)]
    pub fn act_backward(
        &self,
        stream: &CudaStream,
        act: Activation,
        n: usize,
        z: View<f32>,
        y: View<f32>,
        dy: View<f32>,
        dz: ViewMut<f32>,
    ) -> Result<()> {
        assert!(z.len() >= n && y.len() >= n && dy.len() >= n && dz.len() >= n, "act_backward: a view is shorter than {n}");
        if n == 0 {
            return Ok(());
        }
        let ((code, slope), reads) = (act.gpu_code(), act.derivative_reads());
        let (z, y, dy, dz, len) = (z.ptr(), y.ptr(), dy.ptr(), dz.ptr(), int(n)?);
        // fours of values as float4 where every pointer the kernel may touch is 16-byte aligned
        let quads = if aligned16(&[z, y, dy, dz]) { len / 4 } else { 0 };
        let args = kernel_args![z, y, dy, dz, code, slope, reads, quads, len];
        self.run(stream, Kernel::ActBackward, blocks(n.div_ceil(4)), args)
    }

    /// `db[c] = Σ_{s,p} dz[s, c, p]`, overwritten; a fixed summation order for given sizes
    /// (bit-identical runs). One block a channel, or, where that would leave the GPU idle and
    /// `partials` holds [`bias_grad_splits`]` × channels` values, each channel summed in parts
    /// over the samples into `partials` and the parts added (two launches).
    #[allow(clippy::too_many_arguments)]
    pub fn bias_grad(
        &self,
        stream: &CudaStream,
        channels: usize,
        pixels: usize,
        batch: usize,
        dz: View<f32>,
        db: ViewMut<f32>,
        partials: Option<ViewMut<f32>>,
    ) -> Result<()> {
        assert!(dz.len() >= batch * channels * pixels && db.len() >= channels, "bias_grad: short dz or db");
        if channels == 0 {
            return Ok(());
        }
        let _ = int(batch * channels * pixels)?;
        let (parts, chunk, splits) = bias_grad_parts(channels, pixels, batch, partials);
        let (dz, db, c, p, b, chunk) = (dz.ptr(), db.ptr(), int(channels)?, int(pixels)?, int(batch)?, int(chunk)?);
        match parts {
            Some(partials) => {
                self.run_grid(stream, Kernel::BiasGradSplit, (c as u32, splits as u32), kernel_args![dz, partials, c, p, b, chunk])?;
                self.join_bias_grad(stream, channels, splits, partials, db)
            }
            None => self.run(stream, Kernel::BiasGrad, c as u32, kernel_args![dz, db, c, p, b]),
        }
    }

    /// [`Gpu::act_backward`] then [`Gpu::bias_grad`] in one pass over the values (`act_bias_grad`):
    /// dz = dy ⊙ act'(z) (y = act(z)) for `batch` samples of `channels × pixels`, and
    /// `db[c] = Σ_{s,p} dz[s, c, p]`, both overwritten, the same bits as the two launches on the
    /// same views; dz is written, never read back, so the bias gradient costs no second pass
    /// over it. `partials` as [`Gpu::bias_grad`]'s.
    #[allow(clippy::too_many_arguments)]
    pub fn act_bias_grad(
        &self,
        stream: &CudaStream,
        act: Activation,
        (channels, pixels, batch): (usize, usize, usize),
        z: View<f32>,
        y: View<f32>,
        dy: View<f32>,
        dz: ViewMut<f32>,
        db: ViewMut<f32>,
        partials: Option<ViewMut<f32>>,
    ) -> Result<()> {
        let n = batch * channels * pixels;
        assert!(z.len() >= n && y.len() >= n && dy.len() >= n && dz.len() >= n, "act_bias_grad: a view is shorter than {n}");
        assert!(db.len() >= channels, "act_bias_grad: short db");
        if channels == 0 {
            return Ok(());
        }
        let _ = int(n)?;
        let ((code, slope), reads) = (act.gpu_code(), act.derivative_reads());
        let (parts, chunk, splits) = bias_grad_parts(channels, pixels, batch, partials);
        let (z, y, dy, dz, db) = (z.ptr(), y.ptr(), dy.ptr(), dz.ptr(), db.ptr());
        let out = parts.unwrap_or(db);
        let (c, p, b, chunk) = (int(channels)?, int(pixels)?, int(batch)?, int(chunk)?);
        let args = kernel_args![z, y, dy, dz, out, code, slope, reads, c, p, b, chunk];
        self.run_grid(stream, Kernel::ActBiasGrad, (c as u32, splits as u32), args)?;
        match parts {
            Some(partials) => self.join_bias_grad(stream, channels, splits, partials, db),
            None => Ok(()),
        }
    }

    /// `bias_grad_join`: db[c] = Σ_k partials[k·channels + c], the `splits` parts in order.
    fn join_bias_grad(&self, stream: &CudaStream, channels: usize, splits: usize, partials: u64, db: u64) -> Result<()> {
        let [c, k] = ints([channels, splits])?;
        self.run(stream, Kernel::BiasGradJoin, blocks(channels), kernel_args![partials, db, c, k])
    }
}
