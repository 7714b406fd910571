//! Typed wrappers, one per kernel: each checks the views' lengths on the host (a panic on a
//! short view: that is a bug in the caller, not a user error), computes the launch shape and
//! launches. None allocates on the host; sizes of 2^30 values or more are an `Error::Shape`.
//!
//! Sizes are explicit (`batch`, `n`, a geometry); views may be longer than what is touched, as
//! the CPU fast paths take capacity-sized buffers.

use super::blas::DevMat;
use super::context::{Gpu, Kernel};
use super::driver_error;
use super::launch::{blocks, int, kernel_args, launch, View, ViewMut, BLOCK};
use crate::activation::Activation;
use crate::error::Result;
use crate::layers::{conv, pool};
use crate::loss::Loss;
use crate::optim::{bias_step, Clip, Optim, Update};
use cudarc::driver::{result, CudaStream};
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

/// Rows per block of the row-chunked product (SKINNY_ROWS in kernels/dense.cu). A product of
/// more rows than that runs [`SKINNY_COLS`] columns per block (`dense_skinny4`: each row of A
/// read serves four columns; [`SKINNY_WIDE_COLS`] in `dense_skinny8` where that is needed to fit
/// in one wave), one chunk of rows one column per block (`dense_skinny`: more
/// blocks share the loads; `dense_row` for a single row, which keeps one row's sums instead of
/// eight). Measured on the H100 (MLP, same binary, back to back, 1 → 4 columns): training step
/// at batch 64 33.1–33.2 → 30.7 µs, 16 24.7–24.8 → 23.9–24.1, 32 27.1–27.2 → 26.4–26.7, but
/// batch 1 22.0–22.1 → 22.8–23.0 and batch-1 inference 13.7–14.1 → 15.0 µs.
/// `bias_grad` splits a channel's sum into parts while its channels give fewer blocks than
/// this (about two blocks an SM of the cards flatnn runs on; a constant, so the bits of a sum
/// depend on the sizes alone, not on the card) ...
const BIAS_GRAD_BLOCKS: usize = 256;
/// ... and each part has at least this many values to sum.
const BIAS_GRAD_MIN_PART: usize = 4096;

/// Into how many parts [`Gpu::bias_grad`] splits each channel's sum over `batch` samples of
/// `pixels` values (1: not split).
pub(crate) fn bias_grad_splits(channels: usize, pixels: usize, batch: usize) -> usize {
    let wanted = BIAS_GRAD_BLOCKS.div_ceil(channels.max(1));
    wanted.min(batch).min((batch * pixels).div_ceil(BIAS_GRAD_MIN_PART)).max(1)
}

const SKINNY_ROWS: usize = 8;
/// Columns per block of `dense_skinny4`.
const SKINNY_COLS: usize = 4;
/// Columns per block of `dense_skinny8`: each row of A read serves eight, and half as many
/// blocks read it. Used only where k is above [`PANEL_MAX_K`] and the product has at least
/// [`SKINNY_WIDE_MIN`] columns, and only eight columns a block fit in one wave: on the H100 the
/// MLP's first layer at 65–128 samples. Measured on the H100 (same run, two rounds, before → after): MLP
/// step at 100 25.0–25.1 → 24.8 µs, 128 26.7–26.8 → 26.0, forward at 128 (inputs on the device)
/// 16.2–16.6 → 15.2–15.6; used wherever only it fits in one wave, products with k ≤ 256 too
/// (instead of panels), the step went 29.7–29.8 → 30.4–30.5 at 160, 32.3–32.4 → 33.7 at 200 and
/// 35.5 → 36.7–36.9 at 256.
const SKINNY_WIDE_COLS: usize = 8;
const SKINNY_WIDE_MIN: usize = 32;
/// Output tile of the panel product (PANEL_M × PANEL_N in kernels/dense.cu).
const PANEL_M: usize = 16;
const PANEL_N: usize = 32;
/// Forward and input-gradient products of at most this many rows run row-chunked: it spreads k
/// over a block (measured on the H100, the MLP's forward at batch 64 took 18.2 µs row-chunked,
/// 31.1 µs in panels, whose first layer has k = 784: seven waits on memory per block), and so do
/// products with k above [`PANEL_MAX_K`] whatever their height, products whose row-chunked
/// blocks all fit on the GPU at once ([`SKINNY_BLOCKS_PER_SM`]), and products of fewer than
/// [`PANEL_MIN_COLS`] columns except where panels fit and row-chunked does not. Everything else,
/// and every weight gradient, runs in panels (where the tensor-core tiles do not take them:
/// [`Gpu::mma_tile`]).
const PANEL_MIN_ROWS: usize = 64;
/// Row-chunked blocks an SM holds at once (256 threads; on sm_90, 80 registers a thread with
/// four columns a block, 128 with eight, which `__launch_bounds__` caps for two blocks an SM). A product whose
/// row-chunked grid fits in one such wave runs row-chunked at any height. Measured on the H100
/// (in-graph, batch 128, row-chunked against panels): 128 × 64 over k = 128 (256 blocks) 2.22
/// against 4.25 µs, 128 × 64 over k = 10 (256 blocks) 2.11 against 3.01, but 128 × 128 over k = 64
/// (512 blocks) 3.81 against 3.56 and 256 × 128 over k = 64 6.48 against 3.59; 100-200-1 step at
/// 128 (800 blocks) 17.7 µs in panels against 21.5 row-chunked.
const SKINNY_BLOCKS_PER_SM: usize = 2;
/// Above this k a panel waits on memory once per 128 values of k, so products of any height run
/// row-chunked (the MLP's first layer forward at batch 128, k = 784: step 43.2 → 39.1–39.4 µs
/// against cuBLAS with separate bias and activation kernels).
pub(super) const PANEL_MAX_K: usize = 256;
/// Below this many columns most of a 32-wide panel would be idle, so such products run
/// row-chunked; but where that takes more than one wave and panels are at most one an SM, they
/// run in panels instead of cuBLAS and a bias/activation kernel. Measured on the H100 (MLP,
/// whose last layer has 10 columns; same run, two rounds, before → after): step at 1024 63.0–63.2
/// → 57.0–57.5 µs, at 2048 81.5–81.6 → 77.5–78.3, forward at 1024 (inputs on the device)
/// 39.1–39.5 → 34.5–34.9; at two panels an SM (4096) the step went 129.3 → 134.8 and the
/// 100-200-1's 53.3 → 56.5, hence one an SM.
const PANEL_MIN_COLS: usize = 16;

/// Where a product runs on the tensor-core tiles ([`Gpu::mma_tile`]): from this many
/// multiply-adds, and k in this range. Measured on the H100 (in-graph, epilogue included, the
/// MLP's first layer; the tiles against the kernel that ran before): forward at 160 samples 5.9
/// against 7.2 µs (row-chunked), at 256 6.1 against ~10.4, at 1024 10.9 against 14.6 (cuBLAS +
/// bias and activation); weight gradient over 128 samples 3.4 against 4.7 (panels), over 160
/// 3.8 against 6.3, over 1024 12.2 against 15.6 (cuBLAS + bias gradient). But with two waves
/// of blocks or more (the forward at 2048, the 100-200-1's first layer at 1024) or k of 2048
/// and more the MLP step at 2048 went 76.5 → 78.3 µs and at 4096 130.5 → 138.8, and below half
/// a wave (the forward at 128: 64 blocks) the forward took 5.8 against 4.8 µs row-chunked.
/// Weight gradients over more than [`MMA_MAX_SMALL_SAMPLES`] run only on the 32 × 32 tiles
/// (the MLP's first layer over 1024 samples 12.0 against 15.7 µs in-graph, over 2048 22.1
/// against 25.3): on 16 × 16 tiles the 100-200-1's first layer over 1024 (91 blocks) took its
/// step 33.1 → 35.4 µs. Over more than [`MMA_MAX_SAMPLES`] they stay on cuBLAS.
const MMA_MIN_FMAS: usize = 1 << 22;
const MMA_MIN_K: usize = 256;
/// A weight gradient's k (its batch) from which it runs on the tiles.
const MMA_MIN_SAMPLES: usize = 128;
const MMA_MAX_K: usize = 1024;
const MMA_MAX_SAMPLES: usize = 2048;
/// Over more samples than this, a weight gradient runs only on the 32 × 32 tiles.
const MMA_MAX_SMALL_SAMPLES: usize = 512;
/// From this many samples, weight gradients on the tiles split their slices over two blocks
/// ([`Gpu::mma_split`]), each adding its half into dW and db, cleared first. Measured on the
/// H100 (MLP step, same binary, two rounds, `FLATNN_MMA_SPLIT=0` against split, when the halves
/// were still added through a cluster's shared memory): 512 26.4–26.6 → 26.0–26.1 µs, 768
/// 34.0–34.2 → 32.4, 1024 38.1 → 34.3–34.5, 2048 68.6 → 64.9–65.0; from 256 samples, 256 went
/// 27.4 → 33.5 and 384 was unchanged. Adding them with atomics instead (the head clearing dW
/// and db beside the forward pass): 640 30.3 → 29.4, 768 31.3–31.6 → 30.0–30.1, 1024 34.4–34.6
/// → 32.2–32.3, 2048 65.2–65.3 → 61.6 (with 8-byte fragment loads in the weight gradient's
/// layout, −0.3 at 1024 and −0.9 at 2048 of it). Not split: forwards over k from 512 (the
/// first layer's at 384–1024 lost 0.2–0.9 µs, and 3.7 at 1024 beside split weight gradients),
/// clusters of four (1024 +9 µs), nor the smaller tiles (the 100-200-1's first layer over 512
/// samples on 16 × 16 tiles: 17.1–17.2 → 17.6–17.8).
const MMA_SPLIT_MIN_SAMPLES: usize = 512;

/// One shape of the tensor-core tiles (`dense_mma_*` in kernels/dense.cu): BM × BN outputs a
/// block of [`BLOCK`] threads (MMA_THREADS there), a kernel for each of the two layouts they
/// take, and for the 32 × 32 tile the weight gradient's with a tile's slices split over two
/// blocks (SPLIT 2, sm_90 and later: [`Gpu::mma_split`]).
#[derive(Clone, Copy)]
pub(crate) struct MmaTile {
    pub forward: Kernel,
    pub weight_grad: Kernel,
    pub weight_grad_split: Option<Kernel>,
    pub rows: usize,
    pub cols: usize,
}

pub(crate) const MMA_TILES: [MmaTile; 4] = [
    MmaTile { forward: Kernel::DenseMma16x16Kk, weight_grad: Kernel::DenseMma16x16Mn, weight_grad_split: None, rows: 16, cols: 16 },
    MmaTile { forward: Kernel::DenseMma32x16Kk, weight_grad: Kernel::DenseMma32x16Mn, weight_grad_split: None, rows: 32, cols: 16 },
    MmaTile { forward: Kernel::DenseMma16x32Kk, weight_grad: Kernel::DenseMma16x32Mn, weight_grad_split: None, rows: 16, cols: 32 },
    MmaTile {
        forward: Kernel::DenseMma32x32Kk,
        weight_grad: Kernel::DenseMma32x32Mn,
        weight_grad_split: Some(Kernel::DenseMma32x32Mn2),
        rows: 32,
        cols: 32,
    },
];

/// Values of k a slice of the tiles holds, and slices in flight (MMA_KC, MMA_STAGES).
const MMA_KC: usize = 64;
const MMA_STAGES: usize = 4;

impl MmaTile {
    /// The tile whose kernel `kernel` is, if it is one of theirs.
    pub(crate) fn of(kernel: Kernel) -> Option<MmaTile> {
        MMA_TILES.into_iter().find(|t| t.kernels().any(|k| k == kernel))
    }

    /// The tile's kernels: forward layout, weight-gradient layout, the latter split.
    pub(crate) fn kernels(&self) -> impl Iterator<Item = Kernel> {
        [self.forward, self.weight_grad].into_iter().chain(self.weight_grad_split)
    }

    /// Blocks a tile of `kernel` (one of this tile's) runs on: two for the split kernel.
    pub(crate) fn split(&self, kernel: Kernel) -> usize {
        if Some(kernel) == self.weight_grad_split {
            2
        } else {
            1
        }
    }

    /// The grid of `kernel` (one of this tile's) for an `m × cols` product.
    pub(crate) fn grid(&self, kernel: Kernel, m: usize, cols: usize) -> (u32, u32) {
        (cols.div_ceil(self.cols) as u32, (self.split(kernel) * m.div_ceil(self.rows)) as u32)
    }

    /// Whether `kernel` (this tile's `forward` or a weight gradient's) takes A and B as laid
    /// out: forward's layout, A and B contiguous along k; weight gradient's, along m and n;
    /// either 16-byte aligned with rows of a multiple of four values (its copies are 16 bytes).
    fn takes(&self, kernel: Kernel, a: &DevMat, b: &DevMat) -> bool {
        let aligned = |d: &DevMat, stride: usize| d.data.ptr().is_multiple_of(16) && stride.is_multiple_of(4);
        if kernel == self.forward {
            a.cs == 1 && b.rs == 1 && aligned(a, a.rs) && aligned(b, b.cs)
        } else {
            self.kernels().any(|k| k == kernel) && a.rs == 1 && b.cs == 1 && aligned(a, a.cs) && aligned(b, b.rs)
        }
    }

    /// Bytes of shared memory a block needs: MMA_STAGES slice buffers of A and B, as
    /// `mma_buf` in kernels/dense.cu lays them out (along k, rows padded to MMA_KC + 8; else
    /// rows of k padded to the tile's side + 8).
    fn shared_bytes(&self, kernel: Kernel) -> u32 {
        let along_k = kernel == self.forward;
        let buf = |side: usize| if along_k { side * (MMA_KC + 8) } else { MMA_KC * (side + 8) };
        (4 * MMA_STAGES * (buf(self.rows) + buf(self.cols))) as u32
    }
}

/// What the fused dense product does with each value c of C = A·B.
pub enum DenseEpilogue<'a> {
    /// `z = c + bias[j]`, and `y = act(z)` when `y` is given (a layer's forward).
    Forward { bias: View<'a, f32>, z: ViewMut<'a, f32>, y: Option<ViewMut<'a, f32>>, act: Activation },
    /// dx = c, times act'(z, y) of the layer that produced x when `prev` is given (so dx is
    /// that layer's dz).
    InputGrad { dx: ViewMut<'a, f32>, prev: Option<(View<'a, f32>, View<'a, f32>, Activation)> },
    /// `dW = C` (m × n), and `db[i] = Σ_k A(i, k)` (B gets a column of ones). A tile split
    /// over two blocks ([`Gpu::weight_grad_splits`]) adds each block's half into dW and db, so
    /// they must hold zeros first: with `cleared` the caller has seen to it (in a training step
    /// the head kernel clears them, beside the forward pass); otherwise [`Gpu::dense`] clears
    /// them on the stream before the product.
    WeightGrad { dw: ViewMut<'a, f32>, db: ViewMut<'a, f32>, cleared: bool },
}

/// Values a `rows × cols` matrix with strides (rs, cs) spans.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// Sizes as the kernels' ints.
fn ints<const N: usize>(values: [usize; N]) -> Result<[i32; N]> {
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
    fn run_grid<const N: usize>(&self, stream: &CudaStream, kernel: Kernel, grid: (u32, u32), args: [*mut c_void; N]) -> Result<()> {
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
        assert_eq!(stream.context().cu_ctx(), self.ctx.cu_ctx(), "a stream of another device");
        self.bind()?;
        // SAFETY: every caller (the wrappers here, the layers' rooms) passes its kernel's
        // parameters in order with their C types, after checking on the host that each view
        // holds what the kernel touches.
        unsafe {
            launch(self.function(kernel), (grid.0, grid.1, 1), (BLOCK, 1, 1), shared, stream.cu_stream(), self.dependent_launch, args)
        }
    }

    /// C (m × n) = A (m × k) · B (k × n), then `epilogue` on each value of C (see
    /// [`DenseEpilogue`] and kernels/dense.cu): one launch per dense layer and direction.
    /// Outputs are row-major with rows of `n`. Each value is summed in a fixed order.
    ///
    /// `b_early`: the kernel ahead of this one in `stream` writes nothing in B nor in the
    /// epilogue's inputs (the forward's bias, the input gradient's `prev`): B is a layer's
    /// weights and that kernel is not an optimiser's, or B is a weight gradient's X and `prev`
    /// is from the forward pass while that kernel is the backward pass's. The kernel then reads
    /// them before it waits for that kernel, so those loads overlap it (with dependent launch;
    /// otherwise the stream orders them anyway).
    #[allow(clippy::too_many_arguments)]
    pub fn dense(
        &self,
        stream: &CudaStream,
        m: usize,
        n: usize,
        k: usize,
        a: DevMat,
        b: DevMat,
        epilogue: DenseEpilogue,
        b_early: bool,
    ) -> Result<()> {
        let (kernel, grid) = match epilogue {
            DenseEpilogue::Forward { .. } => self.dense_choice(m, n, k, &a, &b, false),
            DenseEpilogue::WeightGrad { .. } => self.dense_choice(m, n + 1, k, &a, &b, true),
            // the tensor-core tiles take a forward's or a weight gradient's epilogue only
            DenseEpilogue::InputGrad { .. } => self.dense_kernel(m, n, k, false),
        };
        self.dense_on(stream, kernel, grid, m, n, k, a, b, epilogue, b_early)
    }

    /// The kernel and grid [`Gpu::dense`] runs an `m × cols` product over `k` on (`cols`
    /// counts a weight gradient's column of ones): the tensor-core tiles where they take it
    /// ([`Gpu::mma_tile`]), else [`Gpu::dense_kernel`]'s.
    pub(crate) fn dense_choice(&self, m: usize, cols: usize, k: usize, a: &DevMat, b: &DevMat, weight_grad: bool) -> (Kernel, (u32, u32)) {
        match self.mma_choice(m, cols, k, a, b, weight_grad) {
            Some((kernel, tile)) => (kernel, tile.grid(kernel, m, cols)),
            None => self.dense_kernel(m, cols, k, weight_grad),
        }
    }

    /// The tensor-core tile for the product and its kernel (a forward's, or a weight
    /// gradient's: each layout has its epilogue), where it takes the operands as laid out
    /// ([`Gpu::mma_tile`], [`MmaTile::takes`]); a weight gradient's split where
    /// [`Gpu::mma_split`] says.
    fn mma_choice(&self, m: usize, cols: usize, k: usize, a: &DevMat, b: &DevMat, weight_grad: bool) -> Option<(Kernel, MmaTile)> {
        let tile = self.mma_tile(m, cols, k, weight_grad)?;
        let kernel = match weight_grad {
            true => tile.weight_grad_split.filter(|_| self.mma_split(k)).unwrap_or(tile.weight_grad),
            false => tile.forward,
        };
        tile.takes(kernel, a, b).then_some((kernel, tile))
    }

    /// Whether [`Gpu::dense`] runs the weight gradient of an `m × n` dense layer over `k`
    /// samples (A = dZᵀ, B = X) on a tile split over two blocks, which adds into dW and db
    /// (see [`DenseEpilogue::WeightGrad`]).
    pub(crate) fn weight_grad_splits(&self, m: usize, n: usize, k: usize, a: &DevMat, b: &DevMat) -> bool {
        self.mma_choice(m, n + 1, k, a, b, true).is_some_and(|(kernel, tile)| tile.split(kernel) > 1)
    }

    /// Whether a weight gradient over `k` samples on the 32 × 32 tiles splits each tile's
    /// slices over two blocks: on sm_90 and later (where it was measured), over
    /// [`MMA_SPLIT_MIN_SAMPLES`] or more (where [`Gpu::mma_tile`] takes it, its grid is at most
    /// one block an SM, so the split one holds two an SM).
    pub(crate) fn mma_split(&self, k: usize) -> bool {
        self.mma_split_enabled() && k >= MMA_SPLIT_MIN_SAMPLES
    }

    /// [`Gpu::dense`] on the given kernel and grid.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dense_on(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        grid: (u32, u32),
        m: usize,
        n: usize,
        k: usize,
        a: DevMat,
        b: DevMat,
        epilogue: DenseEpilogue,
        b_early: bool,
    ) -> Result<()> {
        assert!(a.data.len() >= extent(m, k, a.rs, a.cs) && b.data.len() >= extent(k, n, b.rs, b.cs), "dense: A or B is short");
        if m == 0 || n == 0 {
            return Ok(());
        }
        let null = 0u64;
        let mut cleared = false;
        let (mode, cols, bias, out0, out1, z_prev, y_prev, act) = match epilogue {
            DenseEpilogue::Forward { bias, z, y, act } => {
                assert!(bias.len() >= n && z.len() >= m * n && y.as_ref().is_none_or(|y| y.len() >= m * n), "dense forward: short output");
                (0, n, bias.ptr(), z.ptr(), y.map_or(null, |y| y.ptr()), null, null, act)
            }
            DenseEpilogue::InputGrad { dx, prev } => {
                assert!(dx.len() >= m * n && prev.as_ref().is_none_or(|p| p.0.len() >= m * n && p.1.len() >= m * n), "dense dx: short");
                let (z, y, act) = prev.map_or((null, null, Activation::Identity), |(z, y, act)| (z.ptr(), y.ptr(), act));
                (1, n, null, dx.ptr(), null, z, y, act)
            }
            DenseEpilogue::WeightGrad { dw, db, cleared: c } => {
                assert!(dw.len() >= m * n && db.len() >= m, "dense dw: short dW or db");
                cleared = c;
                (2, n + 1, null, dw.ptr(), db.ptr(), null, null, Activation::Identity)
            }
        };
        let (code, slope) = act.gpu_code();
        let (ap, bp) = (a.data.ptr(), b.data.ptr());
        let [a_rs, a_cs, b_rs, b_cs, mi, ni, ki, ldc] = ints([a.rs, a.cs, b.rs, b.cs, m, cols, k, n])?;
        let _ = int(m * cols)?;
        let early = i32::from(b_early);
        let args =
            kernel_args![ap, a_rs, a_cs, bp, b_rs, b_cs, mi, ni, ki, mode, ldc, bias, out0, out1, z_prev, y_prev, code, slope, early];
        let tile = MmaTile::of(kernel);
        assert!(tile.is_none_or(|t| t.takes(kernel, &a, &b)), "dense: {kernel:?} does not take A and B as laid out");
        // a tile's epilogue follows from its layout (kernels/dense.cu): the forward's, or a
        // weight gradient's
        assert!(tile.is_none_or(|t| mode == if kernel == t.forward { 0 } else { 2 }), "dense: {kernel:?} takes another epilogue");
        if tile.is_some_and(|t| t.split(kernel) > 1) && !cleared {
            // SAFETY: the weight gradient's dW and db, checked above to hold m·n and m values
            unsafe {
                let zero = |ptr: u64, len: usize| result::memset_d8_async(ptr, 0, 4 * len, stream.cu_stream());
                zero(out0, m * n).and_then(|_| zero(out1, m)).map_err(|e| driver_error("clearing a weight gradient", e))?;
            }
        }
        self.run_blocks(stream, kernel, grid, tile.map_or(0, |t| t.shared_bytes(kernel)), args)
    }

    /// Blocks of the dense kernels the GPU holds at once: [`SKINNY_BLOCKS_PER_SM`] an SM.
    pub(crate) fn dense_wave(&self) -> usize {
        SKINNY_BLOCKS_PER_SM * self.multiprocessors() as usize
    }

    /// The kernel and grid [`Gpu::dense`] runs an `m × cols` product over `k` on where the
    /// tensor-core tiles do not take it (`cols` counts a weight gradient's column of ones).
    fn dense_kernel(&self, m: usize, cols: usize, k: usize, weight_grad: bool) -> (Kernel, (u32, u32)) {
        // row-chunked blocks against the blocks the GPU holds at once: four columns a block, or
        // eight where only that fits in one wave and k is too deep for panels
        let one_wave = self.dense_wave();
        let blocks = |per_block: usize| cols.div_ceil(per_block) * m.div_ceil(SKINNY_ROWS);
        let eight = cols >= SKINNY_WIDE_MIN && k > PANEL_MAX_K && blocks(SKINNY_COLS) > one_wave && blocks(SKINNY_WIDE_COLS) <= one_wave;
        let (wide, per_block) = if eight { (Kernel::DenseSkinny8, SKINNY_WIDE_COLS) } else { (Kernel::DenseSkinny4, SKINNY_COLS) };
        let fits = blocks(per_block) <= one_wave;
        // a narrow product too tall for one wave row-chunked runs in panels where they are at
        // most one an SM (see PANEL_MIN_COLS)
        let panels_fit = k <= PANEL_MAX_K && cols.div_ceil(PANEL_N) * m.div_ceil(PANEL_M) <= self.multiprocessors() as usize;
        let narrow = cols < PANEL_MIN_COLS && !panels_fit;
        let row_chunked = !weight_grad && (m <= PANEL_MIN_ROWS || narrow || k > PANEL_MAX_K || fits);
        if row_chunked && m.div_ceil(SKINNY_ROWS) <= 65_535 {
            // one row: a kernel that keeps one row's sums (the same order as eight rows')
            let (kernel, per_block) = match m {
                1 => (Kernel::DenseRow, 1),
                2..=SKINNY_ROWS => (Kernel::DenseSkinny, 1),
                _ => (wide, per_block),
            };
            (kernel, (cols.div_ceil(per_block) as u32, m.div_ceil(SKINNY_ROWS) as u32))
        } else {
            (Kernel::DensePanel, (cols.div_ceil(PANEL_N) as u32, m.div_ceil(PANEL_M) as u32))
        }
    }

    /// The tensor-core tile (`dense_mma_*`) for an `m × cols` product over `k`, where they
    /// run it (given operands laid out as a forward's or a weight gradient's and 16-byte
    /// aligned, which [`Gpu::dense`] checks): on sm_80 and later, for k from [`MMA_MIN_K`] to
    /// [`MMA_MAX_K`] (a weight gradient, whose k is the batch: [`MMA_MIN_SAMPLES`] to
    /// [`MMA_MAX_SAMPLES`]) and at least [`MMA_MIN_FMAS`] multiply-adds, where a tile shape
    /// gives between half as many blocks as the GPU has multiprocessors and as many; of those,
    /// the shape whose blocks read the fewest values (BM + BN a value of k).
    pub(crate) fn mma_tile(&self, m: usize, cols: usize, k: usize, weight_grad: bool) -> Option<MmaTile> {
        let ks = if weight_grad { MMA_MIN_SAMPLES..=MMA_MAX_SAMPLES } else { MMA_MIN_K..=MMA_MAX_K };
        if self.compute_capability().0 < 8 || !ks.contains(&k) || m * cols * k < MMA_MIN_FMAS {
            return None;
        }
        let sms = self.multiprocessors() as usize;
        let deep = weight_grad && k > MMA_MAX_SMALL_SAMPLES;
        MMA_TILES
            .into_iter()
            .filter(|t| (sms / 2..=sms).contains(&(cols.div_ceil(t.cols) * m.div_ceil(t.rows))))
            .filter(|t| !deep || t.rows * t.cols >= 32 * 32)
            .min_by_key(|t| t.rows + t.cols)
    }

    /// Whether [`Gpu::dense`] runs an `m × n` product over `k` of these operands (a weight
    /// gradient's, with its column of ones, when `weight_grad`) on the tensor-core tiles.
    pub fn dense_on_tensor_cores(&self, m: usize, n: usize, k: usize, a: &DevMat, b: &DevMat, weight_grad: bool) -> bool {
        self.mma_choice(m, n + usize::from(weight_grad), k, a, b, weight_grad).is_some()
    }

    /// Blocks [`Gpu::dense`] launches off the tensor-core tiles for an `m × n` product over `k`
    /// (a weight gradient's, with its column of ones for the bias, when `weight_grad`).
    pub fn dense_blocks(&self, m: usize, n: usize, k: usize, weight_grad: bool) -> usize {
        let (_, (x, y)) = self.dense_kernel(m, n + usize::from(weight_grad), k, weight_grad);
        x as usize * y as usize
    }

    /// `z[s, c, p] += bias[c]` for `batch` samples of `channels × pixels`; then y = act(z) when
    /// `y` is given. Without `y` only the bias is added (an identity layer, whose z is its y).
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
    ) -> Result<()> {
        let len = batch * channels * pixels;
        assert!(bias.len() >= channels && z.len() >= len, "bias_act: short bias or z");
        assert!(y.as_ref().is_none_or(|y| y.len() >= len), "bias_act: short y");
        if len == 0 {
            return Ok(());
        }
        let (code, slope) = act.gpu_code();
        let (z, y, bias) = (z.ptr(), y.map_or(0, |y| y.ptr()), bias.ptr());
        let (channels, pixels, n) = (int(channels)?, int(pixels)?, int(len)?);
        self.run(stream, Kernel::BiasActForward, blocks(len), kernel_args![z, y, bias, code, slope, channels, pixels, n])
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
        let (code, slope) = act.gpu_code();
        let (z, y, dy, dz, len) = (z.ptr(), y.ptr(), dy.ptr(), dz.ptr(), int(n)?);
        self.run(stream, Kernel::ActBackward, blocks(n), kernel_args![z, y, dy, dz, code, slope, len])
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
        let splits = bias_grad_splits(channels, pixels, batch);
        let (dz, db, c, p, b) = (dz.ptr(), db.ptr(), int(channels)?, int(pixels)?, int(batch)?);
        match partials {
            Some(partials) if splits > 1 && partials.len() >= splits * channels => {
                let (partials, chunk, k) = (partials.ptr(), int(batch.div_ceil(splits))?, int(splits)?);
                self.run_grid(stream, Kernel::BiasGradSplit, (c as u32, k as u32), kernel_args![dz, partials, c, p, b, chunk])?;
                self.run(stream, Kernel::BiasGradJoin, blocks(channels), kernel_args![partials, db, c, k])
            }
            _ => self.run(stream, Kernel::BiasGrad, c as u32, kernel_args![dz, db, c, p, b]),
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
        let _ = int(batch * in_len)?;
        let (x, col) = (x.ptr(), col.ptr());
        let [c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, b] = conv_dims(g, batch)?;
        let args = kernel_args![x, col, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, b];
        self.run(stream, Kernel::Im2col, blocks(batch * g.lowered_len()), args)
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
fn conv_dims(g: &conv::Geometry, batch: usize) -> Result<[i32; 14]> {
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
