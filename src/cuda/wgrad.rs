//! Weight gradients of narrow dense layers over many samples, split over the batch
//! (`weight_grad_split` in kernels/wgrad.cu, sm_90 and later): dW = dZᵀ · X and db = Σ dZ where
//! the layer has too few outputs (the MLP's 64 × 128 and 10 × 64) for kernels that sum each one
//! over the whole batch to cover the GPU. A cluster of [`SPLIT`] blocks shares each group of
//! outputs, one share of the samples a block, and adds the blocks' sums in rank order through
//! distributed shared memory, so every output is summed in one fixed order. One launch takes
//! up to two layers whose dZ are both written, such as a training step's last layer and the one
//! before it after the head (src/cuda/head.rs).
//!
//! It is one of a weight gradient's routes (src/cuda/dense.rs), measured against the others
//! (src/cuda/routes.rs) where it fits: sm_90 and later (clusters), unless
//! `Tuning::split_weight_grads` is off (`FLATNN_SPLIT=0`).

use super::context::{Gpu, Kernel};
use super::launch::{int, kernel_args, View, ViewMut, BLOCK};
use super::options::Tuning;
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
    /// inp)` together in one launch: one or two layers, on sm_90 and later (clusters) where
    /// `tuning` allows it, whose blocks all fit on the GPU at once (no launch of more has been
    /// checked against the plain loops).
    pub(crate) fn weight_grad_split_fits(&self, layers: &[(usize, usize)], tuning: &Tuning) -> bool {
        tuning.split_weight_grads && self.split_launch_fits(layers)
    }

    /// The launch limits of [`Gpu::weight_grad_split_fits`], whatever the tuning.
    pub(crate) fn split_launch_fits(&self, layers: &[(usize, usize)]) -> bool {
        let blocks: usize = layers.iter().map(|&(out, inp)| SPLIT * clusters(out, inp)).sum();
        self.has_clusters() && (1..=2).contains(&layers.len()) && blocks <= self.multiprocessors() as usize
    }

    /// Runs `jobs` (one or two) over `batch` samples in one launch, where
    /// [`Gpu::weight_grad_split_fits`] says they fit.
    pub(crate) fn weight_grad_split(&self, stream: &CudaStream, batch: usize, jobs: &[Job]) -> Result<()> {
        let shapes = [0, 1].map(|i| jobs.get(i).map_or((0, 0), |j| (j.out, j.inp)));
        assert!(self.split_launch_fits(&shapes[..jobs.len()]), "weight_grad_split: not for {shapes:?} over {batch}");
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
