//! Weight gradients of narrow dense layers over many samples, split over the batch
//! (`weight_grad_split` in kernels/wgrad.cu, sm_90 and later): dW = dZᵀ · X and db = Σ dZ where
//! the layer has too few outputs (the MLP's 64 × 128 and 10 × 64) for kernels that sum each one
//! over the whole batch to cover the GPU. A cluster of [`SPLIT`] blocks shares each group of
//! outputs, one share of the samples a block, and adds the blocks' sums in rank order through
//! distributed shared memory, so every output is summed in one fixed order. One launch takes
//! up to two layers whose dZ are both written, such as a training step's last layer and the one
//! before it after the head (src/cuda/head.rs).
//!
//! `exec::backward` runs it for weight gradients on the side stream only. Measured on the H100
//! (same binary, `FLATNN_SPLIT=1` against `0`, two rounds, back to back): MLP step at 512
//! 34.1–34.3 against 40.2–40.8 µs (there the side stream's cuBLAS products and bias gradients,
//! four kernels that are not dependent launches, had become the step's critical path), 1024
//! 47.6–47.7 against 49.6–49.7, 2048 75.3–77.7 against 76.3–79.3, 4096 126.7–127.5 against
//! 129.2–129.3; 256 and the 100-200-1 unchanged. In-graph, both of the MLP's layers in one launch
//! took 5.9 µs over 512 samples, 8.6 over 1024, 14.1 over 2048.
//!
//! `FLATNN_SPLIT=0` (read when the device is set up) turns it off, for measuring against the
//! other kernels.

use super::context::{Gpu, Kernel};
use super::launch::{int, kernel_args, View, ViewMut, BLOCK};
use super::ops::PANEL_MAX_K;
use crate::error::Result;
use cudarc::driver::CudaStream;

/// Blocks a cluster (WG_SPLIT in kernels/wgrad.cu).
const SPLIT: usize = 8;
/// Samples a staging buffer holds, buffers, and the columns of dW a cluster takes (WG_CHUNK,
/// WG_STAGES, WG_COLS); the rows follow (WG_ROWS: a 2 × 4 patch a thread).
const CHUNK: usize = 32;
const STAGES: usize = 4;
const COLS: usize = 128;
const ROWS: usize = 2 * BLOCK as usize / (COLS / 4);
/// Bytes of dynamic shared memory a block uses: the staging buffers, then its sums.
const SHARED: usize = 4 * (STAGES * CHUNK * (ROWS + COLS) + ROWS * (COLS + 1));
/// Batches from which it runs: from where the panels (`ops::PANEL_MAX_K`) give way to cuBLAS.
const MIN_BATCH: usize = PANEL_MAX_K + 1;
/// Nor past this: each block takes its share of the samples one after the other (MLP step at
/// 16384: 360.9–362.1 against 340.2–341.5 µs).
const MAX_BATCH: usize = 4096;
/// Nor for a layer with fewer outputs than this (half a cluster's rows), where most of each
/// block's sums are of zeros: the 100-200-1's last layer (one output) lost 2.6 µs of its step at
/// 512 and 6.5 at 4096.
const MIN_ROWS: usize = ROWS / 2;

/// One layer's weight gradient: dW (`out × inp`, row-major) = dZᵀ · X and db = Σ dZ, dZ
/// `batch × out` and X `batch × inp` (rows contiguous).
pub(crate) struct Job<'a> {
    pub out: usize,
    pub inp: usize,
    pub dz: View<'a, f32>,
    pub x: View<'a, f32>,
    pub dw: ViewMut<'a, f32>,
    pub db: ViewMut<'a, f32>,
}

/// A job as the kernel takes it (WgJob in kernels/wgrad.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct Raw {
    dz: u64,
    x: u64,
    dw: u64,
    db: u64,
    out: i32,
    inp: i32,
    clusters: i32,
}

/// Clusters for an `out × inp` dW: groups of rows times groups of columns.
fn clusters(out: usize, inp: usize) -> usize {
    out.div_ceil(ROWS) * inp.div_ceil(COLS)
}

impl Gpu {
    /// Whether [`Gpu::weight_grad_split`] takes the weight gradients of layers of these `(out,
    /// inp)` together over `batch` samples: on sm_90 and later, from [`MIN_BATCH`] to
    /// [`MAX_BATCH`] samples, where each layer has at least [`MIN_ROWS`] outputs and does not
    /// run on the tensor-core tiles ([`Gpu::mma_tile`]), and the blocks fit on the GPU at once.
    pub(crate) fn weight_grad_split_takes(&self, layers: &[(usize, usize)], batch: usize) -> bool {
        let blocks: usize = layers.iter().map(|&(out, inp)| SPLIT * clusters(out, inp)).sum();
        let others = layers.iter().any(|&(out, inp)| out < MIN_ROWS || self.mma_tile(out, inp + 1, batch, true).is_some());
        self.split_enabled()
            && (1..=2).contains(&layers.len())
            && (MIN_BATCH..=MAX_BATCH).contains(&batch)
            && !others
            && blocks <= self.multiprocessors() as usize
    }

    /// Runs `jobs` (one or two) over `batch` samples in one launch, where
    /// [`Gpu::weight_grad_split_takes`] says so.
    pub(crate) fn weight_grad_split(&self, stream: &CudaStream, batch: usize, jobs: &[Job]) -> Result<()> {
        let shapes = [0, 1].map(|i| jobs.get(i).map_or((0, 0), |j| (j.out, j.inp)));
        assert!(self.weight_grad_split_takes(&shapes[..jobs.len()], batch), "weight_grad_split: not for {shapes:?} over {batch}");
        let raw = |job: Option<&Job>| -> Result<Raw> {
            let Some(j) = job else { return Ok(Raw { dz: 0, x: 0, dw: 0, db: 0, out: 0, inp: 0, clusters: 0 }) };
            assert!(
                j.dz.len() >= batch * j.out && j.x.len() >= batch * j.inp && j.dw.len() >= j.out * j.inp && j.db.len() >= j.out,
                "weight_grad_split: short view"
            );
            let (dz, x, dw, db) = (j.dz.ptr(), j.x.ptr(), j.dw.ptr(), j.db.ptr());
            Ok(Raw { dz, x, dw, db, out: int(j.out)?, inp: int(j.inp)?, clusters: int(clusters(j.out, j.inp))? })
        };
        let (first, second, rows) = (raw(jobs.first())?, raw(jobs.get(1))?, int(batch)?);
        let blocks = SPLIT * (first.clusters + second.clusters) as usize;
        let args = kernel_args![first, second, rows];
        self.run_blocks(stream, Kernel::WeightGradSplit, (blocks as u32, 1), SHARED as u32, args)
    }
}
