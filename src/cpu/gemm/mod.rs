//! Single-precision GEMM: C ← α·A·B + β·C with arbitrary row and column strides.
//!
//! The loop nest is the GotoBLAS/BLIS one, written once and generic over a micro-kernel:
//! B is packed into KC×NC blocks of NR-wide panels, A into MC×KC blocks of MR-tall panels, and
//! the micro-kernel computes an MR×NR tile of C from one panel of each. The AVX2+FMA kernel
//! (6×16, 12 accumulator registers) is chosen at run time; a portable kernel with the same
//! shape serves everywhere else. Packing buffers live in a [`GemmWorkspace`] allocated once,
//! so a call never allocates. Single-row problems (batch-1 inference) skip packing.
//!
//! Each element of C is summed in the same order whatever the thread count (k is never split
//! across threads), so results are deterministic.

mod kernel;
mod pack;
mod row;
#[cfg(test)]
mod tests;

use super::pool::Pool;
#[cfg(target_arch = "x86_64")]
use kernel::Avx2;
use kernel::{Kernel, Portable};
use pack::{pack_a, pack_b, row_panels};
use row::row_times_matrix;
use std::cell::UnsafeCell;

const MR: usize = 6;
const NR: usize = 16;
const KC: usize = 256;
const MC: usize = 144;
const NC: usize = 1024;
/// Inner dimensions up to this skip packing when B's and C's rows are contiguous.
const SMALL_K: usize = 4;
/// Problems with fewer multiply-adds run on one thread: handing work to the pool costs µs.
const PARALLEL_MIN_MACS: usize = 96 * 1024;

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
        GemmWorkspace { scratch: (0..threads.max(1)).map(|_| UnsafeCell::new(vec![0.0; MC * KC + KC * NC])).collect() }
    }

    /// No buffers, for a cache whose products run elsewhere (on a GPU); never passed to `sgemm`.
    pub(crate) fn none() -> GemmWorkspace {
        GemmWorkspace { scratch: Vec::new() }
    }

    /// Number of workers this workspace serves.
    pub fn threads(&self) -> usize {
        self.scratch.len()
    }

    /// # Safety
    /// `worker` must be the calling task's worker index (no other thread uses that scratch).
    #[allow(clippy::mut_from_ref)]
    unsafe fn scratch(&self, worker: usize) -> &mut [f32] {
        // SAFETY: see the function's contract.
        unsafe { &mut *self.scratch[worker].get() }
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

/// Raw views used inside the loop nest, after the extents were checked.
#[derive(Clone, Copy)]
struct View {
    ptr: *const f32,
    rs: usize,
    cs: usize,
}

#[derive(Clone, Copy)]
struct ViewMut {
    ptr: *mut f32,
    rs: usize,
    cs: usize,
}

impl View {
    /// # Safety
    /// (i, j) must lie inside the checked extent.
    unsafe fn at(self, i: usize, j: usize) -> View {
        View { ptr: unsafe { self.ptr.add(i * self.rs + j * self.cs) }, ..self }
    }
}

impl ViewMut {
    /// # Safety
    /// (i, j) must lie inside the checked extent.
    unsafe fn at(self, i: usize, j: usize) -> ViewMut {
        ViewMut { ptr: unsafe { self.ptr.add(i * self.rs + j * self.cs) }, ..self }
    }
}

// SAFETY: the views point into slices borrowed for the whole call; tasks write disjoint
// blocks of C.
unsafe impl Send for ViewMut {}
unsafe impl Sync for ViewMut {}
unsafe impl Send for View {}
unsafe impl Sync for View {}

/// Panics unless every element (i < rows, j < cols) is inside `len`.
fn check_extent(what: &str, len: usize, rows: usize, cols: usize, rs: usize, cs: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    let last = (rows - 1) * rs + (cols - 1) * cs;
    assert!(last < len, "gemm: {what} of {rows}×{cols} with strides ({rs}, {cs}) needs {} values, has {len}", last + 1);
}

/// C (m×n) ← α·A (m×k)·B (k×n) + β·C, split over the pool's threads.
/// If β is zero, C need not be initialised (NaN in C is overwritten, not propagated).
/// Panics if an operand slice is too short for its shape and strides (an internal bug).
#[allow(clippy::too_many_arguments)]
pub fn sgemm(pool: &Pool, ws: &GemmWorkspace, m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) {
    let threads = pool.threads().min(ws.threads());
    if threads == 1 || m * n * k < PARALLEL_MIN_MACS {
        return sgemm_on(ws, 0, m, n, k, alpha, a, b, beta, c);
    }
    check_extent("A", a.data.len(), m, k, a.rs, a.cs);
    check_extent("B", b.data.len(), k, n, b.rs, b.cs);
    check_extent("C", c.data.len(), m, n, c.rs, c.cs);
    let (av, bv) = (View { ptr: a.data.as_ptr(), rs: a.rs, cs: a.cs }, View { ptr: b.data.as_ptr(), rs: b.rs, cs: b.cs });
    let cv = ViewMut { ptr: c.data.as_mut_ptr(), rs: c.rs, cs: c.cs };
    // Split the longer side of C into `threads` parts aligned to the micro-tile.
    let split_rows = m.div_ceil(MR) >= n.div_ceil(NR);
    let (len, unit) = if split_rows { (m, MR) } else { (n, NR) };
    let tiles = len.div_ceil(unit);
    let tasks = threads.min(tiles);
    pool.run(tasks, &|task, worker| {
        let (t0, t1) = (tiles * task / tasks, tiles * (task + 1) / tasks);
        let (start, end) = (t0 * unit, (t1 * unit).min(len));
        // SAFETY: the extents were checked above; each task owns the rows (or columns)
        // start..end of C, and `worker` is this task's worker index.
        unsafe {
            let scratch = ws.scratch(worker);
            if split_rows {
                gemm_serial(scratch, end - start, n, k, alpha, av.at(start, 0), bv, beta, cv.at(start, 0));
            } else {
                gemm_serial(scratch, m, end - start, k, alpha, av, bv.at(0, start), beta, cv.at(0, start));
            }
        }
    });
}

/// As [`sgemm`], on the calling thread only, with `worker`'s scratch (call it from inside a
/// pool task with that task's worker index).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_on(ws: &GemmWorkspace, worker: usize, m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) {
    check_extent("A", a.data.len(), m, k, a.rs, a.cs);
    check_extent("B", b.data.len(), k, n, b.rs, b.cs);
    check_extent("C", c.data.len(), m, n, c.rs, c.cs);
    let (av, bv) = (View { ptr: a.data.as_ptr(), rs: a.rs, cs: a.cs }, View { ptr: b.data.as_ptr(), rs: b.rs, cs: b.cs });
    let cv = ViewMut { ptr: c.data.as_mut_ptr(), rs: c.rs, cs: c.cs };
    // SAFETY: extents checked above; the caller passes its own worker index.
    unsafe { gemm_serial(ws.scratch(worker), m, n, k, alpha, av, bv, beta, cv) }
}

/// # Safety
/// Views cover m×k, k×n and m×n; `scratch` holds MC·KC + KC·NC values.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_serial(scratch: &mut [f32], m: usize, n: usize, k: usize, alpha: f32, a: View, b: View, beta: f32, c: ViewMut) {
    if m == 0 || n == 0 {
        return;
    }
    unsafe {
        if k == 0 {
            return scale(m, n, beta, c);
        }
        if m == 1 {
            return row_times_matrix(n, k, alpha, a, b, beta, c);
        }
        if n == 1 {
            // Cᵀ = Bᵀ·Aᵀ: a single row again.
            return row_times_matrix(m, k, alpha, transpose(b), transpose(a), beta, transpose_mut(c));
        }
        if k <= SMALL_K && b.cs == 1 && c.cs == 1 {
            // A rank-k update (batch-1 dW is an outer product): packing would cost more than it saves.
            for i in 0..m {
                row_times_matrix(n, k, alpha, a.at(i, 0), b, beta, c.at(i, 0));
            }
            return;
        }
        if c.cs != 1 && (c.rs == 1 || tile_waste(n, m) < tile_waste(m, n)) {
            // Cᵀ = Bᵀ·Aᵀ makes C's rows contiguous (vector stores) or fills the micro-tiles
            // better; each element is still summed over k in the same order, so the bits do
            // not change.
            return gemm_serial(scratch, n, m, k, alpha, transpose(b), transpose(a), beta, transpose_mut(c));
        }
        #[cfg(target_arch = "x86_64")]
        if super::has_avx2_fma() {
            return blocked::<Avx2>(scratch, m, n, k, alpha, a, b, beta, c);
        }
        blocked::<Portable>(scratch, m, n, k, alpha, a, b, beta, c)
    }
}

/// Multiply-adds wasted on padding when an m×n product is cut into MR×NR tiles, per mille.
fn tile_waste(m: usize, n: usize) -> usize {
    let padded = m.div_ceil(MR) * MR * n.div_ceil(NR) * NR;
    1000 * (padded - m * n) / padded
}

fn transpose(v: View) -> View {
    View { rs: v.cs, cs: v.rs, ..v }
}

fn transpose_mut(v: ViewMut) -> ViewMut {
    ViewMut { rs: v.cs, cs: v.rs, ..v }
}

/// C ← β·C (β = 0 writes zeros without reading C).
unsafe fn scale(m: usize, n: usize, beta: f32, c: ViewMut) {
    for i in 0..m {
        for j in 0..n {
            let p = unsafe { c.ptr.add(i * c.rs + j * c.cs) };
            unsafe { *p = if beta == 0.0 { 0.0 } else { beta * *p } };
        }
    }
}

/// The blocked loop nest. Edge tiles, and tiles of a C whose rows are not contiguous, go
/// through a stack tile and are copied out.
#[allow(clippy::too_many_arguments)]
unsafe fn blocked<K: Kernel>(scratch: &mut [f32], m: usize, n: usize, k: usize, alpha: f32, a: View, b: View, beta: f32, c: ViewMut) {
    let (apack, bpack) = scratch.split_at_mut(MC * KC);
    let mut edge = [0.0f32; MR * NR];
    let edge_view = ViewMut { ptr: edge.as_mut_ptr(), rs: NR, cs: 1 };
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            unsafe { pack_b(kc, nc, b.at(pc, jc), bpack) };
            let beta_block = if pc == 0 { beta } else { 1.0 };
            for ic in (0..m).step_by(MC) {
                let mc = MC.min(m - ic);
                unsafe { pack_a(mc, kc, a.at(ic, pc), apack) };
                for jr in (0..nc).step_by(NR) {
                    let nr = NR.min(nc - jr);
                    for (ir, mr, height) in row_panels(mc) {
                        let (ap, bp) = (apack[ir * kc..].as_ptr(), bpack[jr * kc..].as_ptr());
                        let ct = unsafe { c.at(ic + ir, jc + jr) };
                        match (mr, height, nr == NR && c.cs == 1) {
                            (MR, MR, true) => unsafe { K::tile::<MR>(kc, ap, bp, alpha, beta_block, ct) },
                            (4, 4, true) => unsafe { K::tile::<4>(kc, ap, bp, alpha, beta_block, ct) },
                            _ => {
                                if height == 4 {
                                    unsafe { K::tile::<4>(kc, ap, bp, 1.0, 0.0, edge_view) };
                                } else {
                                    unsafe { K::tile::<MR>(kc, ap, bp, 1.0, 0.0, edge_view) };
                                }
                                for i in 0..mr {
                                    for j in 0..nr {
                                        let p = unsafe { ct.ptr.add(i * ct.rs + j * ct.cs) };
                                        let v = edge[i * NR + j];
                                        unsafe { *p = if beta_block == 0.0 { alpha * v } else { alpha * v + beta_block * *p } };
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
