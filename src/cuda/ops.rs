//! Typed wrappers, one per kernel: each checks the views' lengths on the host (a panic on a
//! short view: that is a bug in the caller, not a user error), computes the launch shape and
//! launches. None allocates on the host; sizes of 2^30 values or more are an `Error::Shape`.
//!
//! Sizes are explicit (`batch`, `n`, a geometry); views may be longer than what is touched, as
//! the CPU fast paths take capacity-sized buffers.

use super::context::{Gpu, Kernel};
use super::launch::{blocks, int, kernel_args, launch_in_clusters, View, ViewMut, BLOCK};
use crate::error::Result;
use crate::layers::{conv, pool};
use crate::loss::Loss;
use crate::optim::{bias_step, Clip, Optim, Update};
use cudarc::driver::CudaStream;
use std::ffi::c_void;

/// Most blocks a loss kernel runs on (LOSS_BLOCKS): one value or sample per thread up to
/// 128 × 256, then grid-stride.
pub(super) const LOSS_BLOCKS: usize = 128;

/// f64 values of the scratch a loss kernel needs: a counter, then one partial sum per block
/// (or, after the counter, one a warp: the head's, src/cuda/head.rs).
pub const LOSS_SCRATCH: usize = LOSS_BLOCKS * (BLOCK as usize / 32) + 1;

/// f64 values of the buffer [`Gpu::grad_norm`] writes: the norm, a counter, then one partial
/// sum per block (at most [`LOSS_BLOCKS`], as a loss).
pub const NORM_SCRATCH: usize = LOSS_BLOCKS + 2;

/// Blocks of a loss kernel (or of the gradients' norm) over `n` samples or values: a function
/// of `n` alone, so the order in which the sum is taken never changes.
fn loss_blocks(n: usize) -> u32 {
    n.div_ceil(BLOCK as usize).clamp(1, LOSS_BLOCKS) as u32
}

/// The CPU's scales of a loss over `batch` samples of `outputs` values (src/loss.rs): the value's
/// (1/batch for cross-entropy, 1/(batch·outputs) for MSE) in f64, and the gradient's (that, or
/// twice that for MSE) rounded to f32.
pub(super) fn loss_scales(loss: Loss, batch: usize, outputs: usize) -> (f64, f32) {
    let mean = 1.0 / (batch * outputs) as f64;
    match loss {
        Loss::LogitCrossEntropy => (1.0 / batch as f64, (1.0 / batch as f64) as f32),
        Loss::Mse => (mean, (2.0 * mean) as f32),
        Loss::BceWithLogits | Loss::L1 | Loss::SmoothL1 { .. } => (mean, mean as f32),
    }
}

/// A loss as a graph's key tells it apart: an id below 8, and its parameter's bits (smooth L1's
/// β, which the graph's loss kernel holds; 0 for the others).
pub(super) fn loss_key(loss: Loss) -> (u8, u32) {
    match loss {
        Loss::LogitCrossEntropy => (1, 0),
        Loss::Mse => (2, 0),
        Loss::BceWithLogits => (3, 0),
        Loss::L1 => (4, 0),
        Loss::SmoothL1 { beta } => (5, beta.to_bits()),
    }
}

/// The `kind` and `beta` of kernels/loss.cu's `elementwise_loss` for `loss`; None for the losses
/// it does not compute.
fn elementwise_loss_kind(loss: Loss) -> Option<(i32, f32)> {
    match loss {
        Loss::BceWithLogits => Some((0, 0.0)),
        Loss::L1 => Some((1, 0.0)),
        Loss::SmoothL1 { beta } => Some((2, beta)),
        Loss::Mse | Loss::LogitCrossEntropy => None,
    }
}

/// Most outputs [`Gpu::finish_outputs`] copies (64 KiB): one block writing over the bus; larger
/// outputs are copied by the copy engine and waited for on the stream.
pub const FINISH_MAX: usize = 16_384;

/// Sizes as the kernels' ints.
pub(super) fn ints<const N: usize>(values: [usize; N]) -> Result<[i32; N]> {
    let mut out = [0i32; N];
    for (o, v) in out.iter_mut().zip(values) {
        *o = int(v)?;
    }
    Ok(out)
}

/// What takes a kernel, its grid (of [`BLOCK`]-thread blocks) and its arguments: a launch, or
/// the setting of those arguments in a graph.
pub(crate) type LaunchArgs<'a> = dyn FnMut(Kernel, u32, &mut [*mut c_void]) -> Result<()> + 'a;

/// The kernel of an optimiser's update.
pub(crate) fn optim_kernel(config: Optim) -> Kernel {
    match config {
        Optim::Sgd { momentum: 0.0, .. } => Kernel::Sgd,
        Optim::Sgd { .. } => Kernel::SgdMomentum,
        Optim::Adam { .. } | Optim::AdamW { .. } => Kernel::Adam,
        Optim::RmsProp { .. } => Kernel::RmsProp,
    }
}

impl Gpu {
    /// Launches `kernel` on `grid` blocks of [`BLOCK`] threads. Callers (the wrappers below, and
    /// the layers' rooms for their own kernels) pass the kernel's parameters in order with their
    /// C types, and have checked that each device range holds what the kernel touches.
    pub(crate) fn run<const N: usize>(&self, stream: &CudaStream, kernel: Kernel, grid: u32, args: [*mut c_void; N]) -> Result<()> {
        self.run_grid(stream, kernel, (grid, 1), args)
    }

    /// Launches `kernel` on a 2-D grid of [`BLOCK`]-thread blocks.
    pub(super) fn run_grid<const N: usize>(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        grid: (u32, u32),
        args: [*mut c_void; N],
    ) -> Result<()> {
        self.run_blocks(stream, kernel, grid, 0, args)
    }

    /// Launches `kernel` on a 2-D grid of [`BLOCK`]-thread blocks with `shared` bytes of
    /// dynamic shared memory each.
    pub(super) fn run_blocks<const N: usize>(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        grid: (u32, u32),
        shared: u32,
        mut args: [*mut c_void; N],
    ) -> Result<()> {
        self.launch_args(stream, kernel, grid, shared, &mut args)
    }

    /// [`Gpu::run_blocks`] with the arguments in a slice.
    pub(crate) fn launch_args(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        grid: (u32, u32),
        shared: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_in(stream, kernel, grid, shared, 1, args)
    }

    /// [`Gpu::run_blocks`] on `blocks` blocks along x in clusters of `cluster` (1: none; more
    /// only where [`Gpu::has_clusters`], `blocks` a multiple of it, and `kernel` written for
    /// clusters).
    pub(crate) fn run_clusters<const N: usize>(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        blocks: u32,
        cluster: u32,
        mut args: [*mut c_void; N],
    ) -> Result<()> {
        assert!(
            cluster == 1 || (self.has_clusters() && blocks.is_multiple_of(cluster)),
            "run_clusters: {blocks} blocks in clusters of {cluster}"
        );
        self.launch_in(stream, kernel, (blocks, 1), 0, cluster, &mut args)
    }

    /// [`Gpu::launch_args`] with the blocks in clusters of `cluster` along x (checked by the
    /// caller against the device and the grid).
    fn launch_in(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        grid: (u32, u32),
        shared: u32,
        cluster: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        assert_eq!(stream.context().cu_ctx(), self.ctx.cu_ctx(), "a stream of another device");
        self.bind()?;
        // SAFETY: every caller (the wrappers here, the layers' rooms) passes its kernel's
        // parameters in order with their C types, after checking on the host that each view
        // holds what the kernel touches, and a cluster size the device and grid allow.
        unsafe {
            launch_in_clusters(
                self.function(kernel),
                (grid.0, grid.1, 1),
                (BLOCK, 1, 1),
                shared,
                stream.cu_stream(),
                self.dependent_launch,
                cluster,
                args,
            )
        }
    }

    /// `loss[0]` = Σ of `count` partial sums (in a fixed order) × `scale`; `loss[1] +=
    /// loss[0]`, `loss[2] += 1`: the loss of a launch that left its terms' sums in `partials`
    /// (the head's, src/cuda/head.rs). One block.
    pub(crate) fn loss_sum(&self, stream: &CudaStream, partials: View<f64>, count: usize, scale: f64, loss: ViewMut<f64>) -> Result<()> {
        assert!(partials.len() >= count && loss.len() >= 3, "loss_sum: short partials or loss");
        let (partials, count, loss) = (partials.ptr(), int(count)?, loss.ptr());
        self.run(stream, Kernel::LossSum, 1, kernel_args![partials, count, scale, loss])
    }

    /// Softmax cross-entropy of logits y (batch, classes) against `labels`: dy as
    /// [`crate::loss::logit_cross_entropy`] computes it, and `loss[0]` (f64) = the mean over the
    /// batch, summed on the device in a fixed order (one launch; `scratch`: [`LOSS_SCRATCH`]
    /// values, zero before the first call and left so); `loss[1] += loss[0]`, `loss[2] += 1`. A
    /// label outside 0..classes makes the loss NaN (labels are checked on the host).
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_xent(
        &self,
        stream: &CudaStream,
        classes: usize,
        batch: usize,
        y: View<f32>,
        labels: View<u32>,
        dy: ViewMut<f32>,
        loss: ViewMut<f64>,
        scratch: ViewMut<f64>,
    ) -> Result<()> {
        let len = batch * classes;
        assert!(y.len() >= len && dy.len() >= len && labels.len() >= batch, "softmax_xent: short y, dy or labels");
        assert!(loss.len() >= 3 && scratch.len() >= LOSS_SCRATCH, "softmax_xent: short loss or scratch");
        assert!(batch > 0 && classes > 0, "softmax_xent: empty batch");
        let _ = int(len)?;
        let (y, labels, dy, loss, scratch) = (y.ptr(), labels.ptr(), dy.ptr(), loss.ptr(), scratch.ptr());
        let (mean_scale, scale) = loss_scales(Loss::LogitCrossEntropy, batch, classes);
        let (c, b) = (int(classes)?, int(batch)?);
        self.run(stream, Kernel::SoftmaxXent, loss_blocks(batch), kernel_args![y, labels, dy, loss, scratch, c, b, scale, mean_scale])
    }

    /// Mean squared error over the first `n` values: dy = 2(y − t)/n, and `loss[0]` (f64) =
    /// Σ(y − t)²/n summed on the device in a fixed order (one launch; `scratch` as for
    /// [`Gpu::softmax_xent`]); `loss[1] += loss[0]`, `loss[2] += 1`.
    #[allow(clippy::too_many_arguments)]
    pub fn mse(
        &self,
        stream: &CudaStream,
        n: usize,
        y: View<f32>,
        t: View<f32>,
        dy: ViewMut<f32>,
        loss: ViewMut<f64>,
        scratch: ViewMut<f64>,
    ) -> Result<()> {
        assert!(y.len() >= n && t.len() >= n && dy.len() >= n, "mse: a view is shorter than {n}");
        assert!(loss.len() >= 3 && scratch.len() >= LOSS_SCRATCH, "mse: short loss or scratch");
        assert!(n > 0, "mse: no values");
        // n values, as one sample of n outputs
        let (mean_scale, grad_scale) = loss_scales(Loss::Mse, 1, n);
        let (y, t, dy, loss, scratch, len) = (y.ptr(), t.ptr(), dy.ptr(), loss.ptr(), scratch.ptr(), int(n)?);
        self.run(stream, Kernel::Mse, loss_blocks(n), kernel_args![y, t, dy, loss, scratch, len, grad_scale, mean_scale])
    }

    /// A loss of one term per value (binary cross-entropy on logits, L1, smooth L1) over the
    /// first `n` values, as [`Loss::compute`] computes it: dy = ℓ′(y, t)/n, and `loss[0]` (f64) =
    /// Σ ℓ(y, t)/n summed on the device in a fixed order (one launch; `scratch` as for
    /// [`Gpu::softmax_xent`]); `loss[1] += loss[0]`, `loss[2] += 1`.
    #[allow(clippy::too_many_arguments)]
    pub fn elementwise_loss(
        &self,
        stream: &CudaStream,
        loss_kind: Loss,
        n: usize,
        y: View<f32>,
        t: View<f32>,
        dy: ViewMut<f32>,
        loss: ViewMut<f64>,
        scratch: ViewMut<f64>,
    ) -> Result<()> {
        let (kind, beta) = elementwise_loss_kind(loss_kind).unwrap_or_else(|| panic!("{loss_kind:?} is not an element-wise loss"));
        assert!(y.len() >= n && t.len() >= n && dy.len() >= n, "elementwise_loss: a view is shorter than {n}");
        assert!(loss.len() >= 3 && scratch.len() >= LOSS_SCRATCH, "elementwise_loss: short loss or scratch");
        assert!(n > 0, "elementwise_loss: no values");
        let (mean_scale, grad_scale) = loss_scales(loss_kind, 1, n);
        let (y, t, dy, loss, scratch, len) = (y.ptr(), t.ptr(), dy.ptr(), loss.ptr(), scratch.ptr(), int(n)?);
        let args = kernel_args![y, t, dy, loss, scratch, len, kind, beta, grad_scale, mean_scale];
        self.run(stream, Kernel::ElementwiseLoss, loss_blocks(n), args)
    }

    /// Max-pool forward of `batch` samples, as `pool::forward_spec`.
    pub fn maxpool_forward(&self, stream: &CudaStream, g: &pool::Geometry, batch: usize, x: View<f32>, y: ViewMut<f32>) -> Result<()> {
        let (in_len, out_len) = (g.channels * g.height * g.width, g.channels * g.out_height * g.out_width);
        assert!(x.len() >= batch * in_len && y.len() >= batch * out_len, "maxpool_forward: short x or y");
        if batch * out_len == 0 {
            return Ok(());
        }
        let _ = int(batch * in_len)?;
        let (x, y) = (x.ptr(), y.ptr());
        let [c, h, w, oh, ow, kh, kw, sh, sw, b] = pool_dims(g, batch)?;
        self.run(stream, Kernel::MaxpoolForward, blocks(batch * out_len), kernel_args![x, y, c, h, w, oh, ow, kh, kw, sh, sw, b])
    }

    /// Max-pool backward, dx overwritten, as `pool::backward_spec` (bit-equal: the same sums
    /// in the same order).
    pub fn maxpool_backward(
        &self,
        stream: &CudaStream,
        g: &pool::Geometry,
        batch: usize,
        x: View<f32>,
        dy: View<f32>,
        dx: ViewMut<f32>,
    ) -> Result<()> {
        let (in_len, out_len) = (g.channels * g.height * g.width, g.channels * g.out_height * g.out_width);
        assert!(x.len() >= batch * in_len && dx.len() >= batch * in_len && dy.len() >= batch * out_len, "maxpool_backward: short view");
        if batch * in_len == 0 {
            return Ok(());
        }
        let (x, dy, dx) = (x.ptr(), dy.ptr(), dx.ptr());
        let [c, h, w, oh, ow, kh, kw, sh, sw, b] = pool_dims(g, batch)?;
        // windows that tile the input: one thread a window, no gather
        if g.tiles() {
            let windows = int(batch * out_len)?;
            return self.run(
                stream,
                Kernel::MaxpoolBackwardTiles,
                blocks(batch * out_len),
                kernel_args![x, dy, dx, h, w, oh, ow, kh, kw, windows],
            );
        }
        self.run(stream, Kernel::MaxpoolBackward, blocks(batch * in_len), kernel_args![x, dy, dx, c, h, w, oh, ow, kh, kw, sh, sw, b])
    }

    /// col (batch, CKK, OHW) ← the lowered samples of x (batch, C, H, W), padding read as 0:
    /// per sample exactly the CPU's im2col, so Z_s = W · col_s.
    pub fn im2col(&self, stream: &CudaStream, g: &conv::Geometry, batch: usize, x: View<f32>, col: ViewMut<f32>) -> Result<()> {
        let in_len = g.in_channels * g.height * g.width;
        assert!(x.len() >= batch * in_len && col.len() >= batch * g.lowered_len(), "im2col: short x or col");
        if batch * g.lowered_len() == 0 {
            return Ok(());
        }
        // the kernel's 32-bit sizes: a sample's input, taps (CKK) and output pixels (OHW)
        let _ = (int(batch * in_len)?, int(g.ckk())?, int(g.ohw())?);
        let (x, col) = (x.ptr(), col.ptr());
        let [c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, b] = conv_dims(g, batch)?;
        let args = kernel_args![x, col, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, b];
        // a block takes BLOCK / lanes taps of a sample at a time, lanes the power of two ≥ OHW
        // (at most BLOCK); the grid's y the samples
        let lanes = g.ohw().next_power_of_two().min(BLOCK as usize);
        let grid = (blocks(g.ckk() * lanes), batch.clamp(1, 65_535) as u32);
        self.run_grid(stream, Kernel::Im2col, grid, args)
    }

    /// dx (batch, C, H, W) ← col2im(dcol), overwritten: each pixel the sum of the lowered
    /// entries read from it, gathered in the CPU's order.
    pub fn col2im(&self, stream: &CudaStream, g: &conv::Geometry, batch: usize, dcol: View<f32>, dx: ViewMut<f32>) -> Result<()> {
        let in_len = g.in_channels * g.height * g.width;
        assert!(dx.len() >= batch * in_len && dcol.len() >= batch * g.lowered_len(), "col2im: short dx or dcol");
        if batch * in_len == 0 {
            return Ok(());
        }
        let _ = int(batch * g.lowered_len())?;
        let (dcol, dx) = (dcol.ptr(), dx.ptr());
        let [c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, b] = conv_dims(g, batch)?;
        let args = kernel_args![dcol, dx, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, b];
        self.run(stream, Kernel::Col2im, blocks(batch * in_len), args)
    }

    /// One optimiser update over the first `n` parameters, as `Optimizer::update` on the CPU:
    /// `step` is the 1-based step number; `state` holds the optimiser's flat state in the CPU's
    /// layout (`state[..n]` first moment / momentum / square average, `state[n..2n]` Adam's
    /// second moment), zero before the first step; `norm` the buffer [`Gpu::grad_norm`] wrote
    /// ‖g‖ into ahead of it, read where `update` clips by norm.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn optim_step(
        &self,
        stream: &CudaStream,
        update: Update,
        step: u64,
        n: usize,
        params: ViewMut<f32>,
        grads: View<f32>,
        state: ViewMut<f32>,
        norm: View<f64>,
    ) -> Result<()> {
        let launch = |kernel, grid, args: &mut [*mut c_void]| self.launch_args(stream, kernel, (grid, 1), 0, args);
        self.optim_call(update, step, n, params, grads, state, norm, false, launch)
    }

    /// The kernel, grid and arguments of [`Gpu::optim_step`], given to `call` (which launches
    /// them, or sets them in a step's graph); nothing is called when `n` is 0. `early`: the
    /// kernel reads parameters and state before waiting for the kernels ahead of it, which
    /// must write neither (a training step's backward pass: kernels/optim.cu).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn optim_call(
        &self,
        update: Update,
        step: u64,
        n: usize,
        params: ViewMut<f32>,
        grads: View<f32>,
        state: ViewMut<f32>,
        norm: View<f64>,
        early: bool,
        call: impl FnOnce(Kernel, u32, &mut [*mut c_void]) -> Result<()>,
    ) -> Result<()> {
        let Update { config, clip } = update;
        assert!(params.len() >= n && grads.len() >= n && state.len() >= config.state_per_param() * n, "optim_step: short view");
        assert!(norm.len() > 0, "optim_step: no norm");
        if n == 0 {
            return Ok(());
        }
        let (p, g, s1, s2, len, grid) = (params.ptr(), grads.ptr(), state.ptr(), state.ptr() + 4 * n as u64, int(n)?, blocks(n));
        let (kernel, early) = (optim_kernel(config), i32::from(early));
        // the clipping and the L2 term (optim_grad in kernels/optim.cu): a null norm where not
        // clipping by norm
        let (norm, max_norm) = match clip {
            Clip::Norm(max_norm) => (norm.ptr(), max_norm),
            _ => (0u64, 0.0f32),
        };
        let (bound, decay) = (clip.value_bound(), config.l2());
        match config {
            Optim::Sgd { lr, momentum: 0.0, .. } => {
                call(kernel, grid, &mut kernel_args![p, g, norm, max_norm, bound, decay, lr, len, early])
            }
            Optim::Sgd { lr, momentum, nesterov, .. } => {
                let nesterov = i32::from(nesterov);
                call(kernel, grid, &mut kernel_args![p, g, norm, max_norm, bound, decay, s1, lr, momentum, nesterov, len, early])
            }
            Optim::Adam { lr, beta1, beta2, eps, .. } | Optim::AdamW { lr, beta1, beta2, eps, .. } => {
                let decoupled = if let Optim::AdamW { weight_decay, .. } = config { weight_decay } else { 0.0 };
                // the CPU's scalars, computed the same way (src/optim.rs, adam)
                let t = bias_step(step);
                let step_size = lr / (1.0 - beta1.powi(t));
                let inv_bias2 = 1.0 / (1.0 - beta2.powi(t)).sqrt();
                let shrink = 1.0 - lr * decoupled;
                call(
                    kernel,
                    grid,
                    &mut kernel_args![
                        p, g, norm, max_norm, bound, decay, s1, s2, beta1, beta2, eps, step_size, inv_bias2, shrink, len, early
                    ],
                )
            }
            Optim::RmsProp { lr, alpha, eps, .. } => {
                call(kernel, grid, &mut kernel_args![p, g, norm, max_norm, bound, decay, s1, lr, alpha, eps, len, early])
            }
        }
    }

    /// `norm[0]` = ‖g‖₂ of the first `n` gradients rounded to f32, Σg² in f64 in a fixed order
    /// (kernels/optim.cu, grad_norm); `norm` holds [`NORM_SCRATCH`] values, the second zero
    /// before the first launch (a counter the kernel resets).
    pub(crate) fn grad_norm(&self, stream: &CudaStream, n: usize, grads: View<f32>, norm: ViewMut<f64>) -> Result<()> {
        assert!(grads.len() >= n && norm.len() >= NORM_SCRATCH, "grad_norm: short view");
        if n == 0 {
            return Ok(());
        }
        let (g, len, out) = (grads.ptr(), int(n)?, norm.ptr());
        self.run(stream, Kernel::GradNorm, loss_blocks(n), kernel_args![g, len, out])
    }

    /// `out[b, ..] = data[indices[b], ..]` for `batch` samples of `sample_len` f32 values; the data
    /// set `data` is (samples, sample_len) on the device, already normalised. An index past the
    /// data set gives a NaN sample.
    pub fn gather_batch(
        &self,
        stream: &CudaStream,
        sample_len: usize,
        batch: usize,
        data: View<f32>,
        indices: View<u32>,
        out: ViewMut<f32>,
    ) -> Result<()> {
        assert!(sample_len > 0 && indices.len() >= batch && out.len() >= batch * sample_len, "gather_batch: short indices or out");
        if batch == 0 {
            return Ok(());
        }
        let (samples, n) = (data.len() / sample_len, int(batch * sample_len)?);
        let (data, indices, out, len, b, samples) = (data.ptr(), indices.ptr(), out.ptr(), int(sample_len)?, int(batch)?, int(samples)?);
        self.run(stream, Kernel::GatherBatch, blocks(n as usize), kernel_args![data, indices, out, len, b, samples])
    }

    /// Copies `n` values from page-locked host memory at `src` (its device address, 16-byte
    /// aligned) into `dst` (16-byte aligned), by a kernel (see kernels/data.cu).
    /// Launches in chunks of 2^28 values (the kernels' sizes are `int`).
    pub fn copy_from_host(&self, stream: &CudaStream, n: usize, src: u64, dst: ViewMut<f32>) -> Result<()> {
        assert!(dst.len() >= n && src.is_multiple_of(16) && dst.ptr().is_multiple_of(16), "copy_from_host: short or misaligned");
        const CHUNK: usize = 1 << 28;
        for start in (0..n).step_by(CHUNK) {
            let len = CHUNK.min(n - start);
            let (from, to, ni) = (src + (start * 4) as u64, dst.ptr() + (start * 4) as u64, int(len)?);
            self.run(stream, Kernel::CopyFromHost, blocks(len.div_ceil(4)), kernel_args![from, to, ni])?;
        }
        Ok(())
    }

    /// Copies `n` values of `src` to page-locked host memory at `host_dst` (its device address),
    /// then writes the next value of `counter` to the page-locked flag at `host_flag`: one block,
    /// for outputs of at most `FINISH_MAX` values (see kernels/data.cu).
    pub fn finish_outputs(
        &self,
        stream: &CudaStream,
        n: usize,
        src: View<f32>,
        host_dst: u64,
        counter: ViewMut<u32>,
        host_flag: u64,
    ) -> Result<()> {
        assert!(n <= FINISH_MAX && src.len() >= n && !counter.is_empty(), "finish_outputs: too many values or short views");
        let (src, counter, ni) = (src.ptr(), counter.ptr(), int(n)?);
        self.run(stream, Kernel::FinishOutputs, 1, kernel_args![src, host_dst, ni, counter, host_flag])
    }

    /// `out[b] = labels[indices[b]]`; an index past the labels gives 0xFFFF_FFFF.
    pub fn gather_labels(&self, stream: &CudaStream, batch: usize, labels: View<u32>, indices: View<u32>, out: ViewMut<u32>) -> Result<()> {
        assert!(indices.len() >= batch && out.len() >= batch, "gather_labels: short indices or out");
        if batch == 0 {
            return Ok(());
        }
        let (labels, samples, indices, out, b) = (labels.ptr(), int(labels.len())?, indices.ptr(), out.ptr(), int(batch)?);
        self.run(stream, Kernel::GatherLabels, blocks(batch), kernel_args![labels, indices, out, b, samples])
    }
}

/// A pool's sizes as the kernels' ints: channels, height, width, out h/w, window, stride, batch.
fn pool_dims(g: &pool::Geometry, batch: usize) -> Result<[i32; 10]> {
    ints([g.channels, g.height, g.width, g.out_height, g.out_width, g.window.0, g.window.1, g.stride.0, g.stride.1, batch])
}

/// A convolution's sizes as the kernels' ints: channels, height, width, kernel, stride,
/// padding, dilation, out h/w, batch.
pub(super) fn conv_dims(g: &conv::Geometry, batch: usize) -> Result<[i32; 14]> {
    ints([
        g.in_channels,
        g.height,
        g.width,
        g.kernel.0,
        g.kernel.1,
        g.stride.0,
        g.stride.1,
        g.padding.0,
        g.padding.1,
        g.dilation.0,
        g.dilation.1,
        g.out_height,
        g.out_width,
        batch,
    ])
}
