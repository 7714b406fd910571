//! Single-precision GEMM: C ← α·A·B + β·C with arbitrary row and column strides.
//!
//! STUB: plain loops with the final signature; the packed AVX2+FMA version replaces the body.

use super::pool::Pool;
use std::cell::UnsafeCell;

/// Per-thread packing buffers, allocated once (in `preallocate`) and reused by every call.
pub struct GemmWorkspace {
    scratch: Vec<UnsafeCell<Vec<f32>>>,
}

// SAFETY: each worker index touches only its own scratch, and a pool never runs two tasks with
// the same worker index at once.
unsafe impl Sync for GemmWorkspace {}

impl GemmWorkspace {
    /// Buffers for `threads` workers (the pool's thread count).
    pub fn new(threads: usize) -> GemmWorkspace {
        GemmWorkspace { scratch: (0..threads.max(1)).map(|_| UnsafeCell::new(Vec::new())).collect() }
    }

    /// Number of workers this workspace serves.
    pub fn threads(&self) -> usize {
        self.scratch.len()
    }
}

/// A strided matrix operand: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// A strided output matrix: element (i, j) is `data[i * rs + j * cs]`.
pub struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rs: usize,
    pub cs: usize,
}

/// C (m×n) ← α·A (m×k)·B (k×n) + β·C, split over the pool's threads.
/// If β is zero, C need not be initialised (NaN in C is overwritten, not propagated).
/// Panics if an operand slice is too short for its shape and strides (an internal bug).
#[allow(clippy::too_many_arguments)]
pub fn sgemm(pool: &Pool, ws: &GemmWorkspace, m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) {
    let _ = pool;
    sgemm_on(ws, 0, m, n, k, alpha, a, b, beta, c)
}

/// As [`sgemm`], on the calling thread only, with `worker`'s scratch (call it from inside a
/// pool task with that task's worker index).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_on(ws: &GemmWorkspace, worker: usize, m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) {
    let _ = (ws, worker);
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for p in 0..k {
                acc += a.data[i * a.rs + p * a.cs] * b.data[p * b.rs + j * b.cs];
            }
            let cij = &mut c.data[i * c.rs + j * c.cs];
            *cij = if beta == 0.0 { alpha * acc } else { alpha * acc + beta * *cij };
        }
    }
}
