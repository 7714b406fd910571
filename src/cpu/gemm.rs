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

use super::pool::Pool;
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

/// The 1×k·k×n case: no packing. Row-contiguous B sums α·a_p·B[p, :] rows into C (axpy);
/// otherwise each C element is a dot product.
#[allow(clippy::too_many_arguments)]
unsafe fn row_times_matrix(n: usize, k: usize, alpha: f32, a: View, b: View, beta: f32, c: ViewMut) {
    unsafe {
        #[cfg(target_arch = "x86_64")]
        if super::has_avx2_fma() {
            return row_times_matrix_avx2(n, k, alpha, a, b, beta, c);
        }
        row_times_matrix_body(n, k, alpha, a, b, beta, c)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn row_times_matrix_avx2(n: usize, k: usize, alpha: f32, a: View, b: View, beta: f32, c: ViewMut) {
    unsafe { row_times_matrix_body(n, k, alpha, a, b, beta, c) }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn row_times_matrix_body(n: usize, k: usize, alpha: f32, a: View, b: View, beta: f32, c: ViewMut) {
    let at = |p: usize| unsafe { *a.ptr.add(p * a.cs) };
    let store = |j: usize, acc: f32| {
        let p = unsafe { c.ptr.add(j * c.cs) };
        unsafe { *p = if beta == 0.0 { alpha * acc } else { alpha * acc + beta * *p } };
    };
    if b.cs == 1 && c.cs == 1 && k == 1 {
        // One term (a batch-1 dW row): a single pass, C ← α·(a₀·B) + β·C.
        let (a0, row) = (at(0), unsafe { std::slice::from_raw_parts(b.ptr, n) });
        let out = unsafe { std::slice::from_raw_parts_mut(c.ptr, n) };
        if beta == 0.0 {
            out.iter_mut().zip(row).for_each(|(o, &v)| *o = alpha * (a0 * v));
        } else {
            out.iter_mut().zip(row).for_each(|(o, &v)| *o = alpha * (a0 * v) + beta * *o);
        }
    } else if b.cs == 1 && c.cs == 1 {
        // Accumulate rows of B in a stack tile of up to 256 columns at a time.
        let mut tile = [0.0f32; 256];
        for j0 in (0..n).step_by(256) {
            let w = (n - j0).min(256);
            let acc = &mut tile[..w];
            acc.fill(0.0);
            for p in 0..k {
                let (ap, row) = (at(p), unsafe { std::slice::from_raw_parts(b.ptr.add(p * b.rs + j0), w) });
                acc.iter_mut().zip(row).for_each(|(s, &v)| *s += ap * v);
            }
            let out = unsafe { std::slice::from_raw_parts_mut(c.ptr.add(j0), w) };
            if beta == 0.0 {
                out.iter_mut().zip(acc.iter()).for_each(|(o, &s)| *o = alpha * s);
            } else {
                out.iter_mut().zip(acc.iter()).for_each(|(o, &s)| *o = alpha * s + beta * *o);
            }
        }
    } else if b.rs == 1 && a.cs == 1 {
        let arow = unsafe { std::slice::from_raw_parts(a.ptr, k) };
        for j in 0..n {
            let col = unsafe { std::slice::from_raw_parts(b.ptr.add(j * b.cs), k) };
            store(j, dot(arow, col));
        }
    } else {
        for j in 0..n {
            let mut acc = 0.0f32;
            for p in 0..k {
                acc += at(p) * unsafe { *b.ptr.add(p * b.rs + j * b.cs) };
            }
            store(j, acc);
        }
    }
}

/// Dot product with 8 independent partial sums (vectorises; fixed order).
#[inline(always)]
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut part = [0.0f32; 16];
    let (xc, yc) = (x.chunks_exact(16), y.chunks_exact(16));
    let (xr, yr) = (xc.remainder(), yc.remainder());
    for (xs, ys) in xc.zip(yc) {
        for l in 0..16 {
            part[l] += xs[l] * ys[l];
        }
    }
    let mut sum = part.iter().sum::<f32>();
    for (a, b) in xr.iter().zip(yr) {
        sum += a * b;
    }
    sum
}

/// An M×NR micro-kernel over packed panels (M = MR, or 4 for the last rows of a block).
trait Kernel {
    /// C tile ← α·Σ_p a_p b_pᵀ + β·C tile (β = 0: C not read), for a full M×NR tile.
    /// `a` holds kc columns of M, `b` kc rows of NR.
    unsafe fn tile<const M: usize>(kc: usize, a: *const f32, b: *const f32, alpha: f32, beta: f32, c: ViewMut);
}

struct Portable;

impl Kernel for Portable {
    #[inline(always)]
    unsafe fn tile<const M: usize>(kc: usize, a: *const f32, b: *const f32, alpha: f32, beta: f32, c: ViewMut) {
        let mut acc = [[0.0f32; NR]; M];
        for p in 0..kc {
            let (ap, bp) = unsafe { (std::slice::from_raw_parts(a.add(p * M), M), std::slice::from_raw_parts(b.add(p * NR), NR)) };
            for i in 0..M {
                for j in 0..NR {
                    acc[i][j] += ap[i] * bp[j];
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                let p = unsafe { c.ptr.add(i * c.rs + j * c.cs) };
                unsafe { *p = if beta == 0.0 { alpha * v } else { alpha * v + beta * *p } };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Kernel for Avx2 {
    #[inline(always)]
    unsafe fn tile<const M: usize>(kc: usize, a: *const f32, b: *const f32, alpha: f32, beta: f32, c: ViewMut) {
        unsafe { avx2_tile::<M>(kc, a, b, alpha, beta, c) }
    }
}

/// 2·M accumulators of 8 lanes; per k, two loads of B and M broadcasts of A feed 2·M FMAs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_tile<const M: usize>(kc: usize, a: *const f32, b: *const f32, alpha: f32, beta: f32, c: ViewMut) {
    use std::arch::x86_64::*;
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; M];
        for p in 0..kc {
            let b0 = _mm256_loadu_ps(b.add(p * NR));
            let b1 = _mm256_loadu_ps(b.add(p * NR + 8));
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = _mm256_broadcast_ss(&*a.add(p * M + i));
                row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
                row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
            }
        }
        let (va, vb) = (_mm256_set1_ps(alpha), _mm256_set1_ps(beta));
        if c.cs == 1 {
            for (i, row) in acc.iter().enumerate() {
                for (h, &v) in row.iter().enumerate() {
                    let p = c.ptr.add(i * c.rs + 8 * h);
                    let out =
                        if beta == 0.0 { _mm256_mul_ps(va, v) } else { _mm256_fmadd_ps(va, v, _mm256_mul_ps(vb, _mm256_loadu_ps(p))) };
                    _mm256_storeu_ps(p, out);
                }
            }
        } else {
            let mut lanes = [0.0f32; 8];
            for (i, row) in acc.iter().enumerate() {
                for (h, &v) in row.iter().enumerate() {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                    for (l, &s) in lanes.iter().enumerate() {
                        let p = c.ptr.add(i * c.rs + (8 * h + l) * c.cs);
                        *p = if beta == 0.0 { alpha * s } else { alpha * s + beta * *p };
                    }
                }
            }
        }
    }
}

/// Row panels of an mc-row block as (first row, rows, packed height). Panels are MR tall;
/// a remainder of 4 rows, or of 2 (taken with the last full panel as 4 + 4), gets 4-tall
/// panels that the kernel runs at full width, so power-of-two batches waste no lanes.
fn row_panels(mc: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let (full, rem) = (mc / MR, mc % MR);
    let (full, tail): (usize, &[usize]) = match rem {
        0 => (full, &[]),
        4 => (full, &[4]),
        2 if full > 0 => (full - 1, &[4, 4]),
        r => (full, std::slice::from_ref(&ROW_REMAINDERS[r])),
    };
    let heads = (0..full).map(|p| (p * MR, MR, MR));
    let tails = tail.iter().scan(full * MR, |start, &rows| {
        let s = *start;
        *start += rows;
        Some((s, rows, if rows == 4 { 4 } else { MR }))
    });
    heads.chain(tails)
}

const ROW_REMAINDERS: [usize; MR] = [0, 1, 2, 3, 4, 5];

/// The blocked loop nest. Edge tiles go through a stack tile and are copied out.
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
                        match (mr, height, nr == NR) {
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

/// Packs A (mc×kc) into the panels of `row_panels`, column by column, zero-padding a short
/// last panel to its packed height.
unsafe fn pack_a(mc: usize, kc: usize, a: View, out: &mut [f32]) {
    for (i0, rows, height) in row_panels(mc) {
        let dst = &mut out[i0 * kc..][..height * kc];
        if a.cs == 1 && rows == MR && height == MR {
            // k outer, so the panel is written in order: MR row streams in, one stream out
            let src: [&[f32]; MR] = std::array::from_fn(|i| unsafe { std::slice::from_raw_parts(a.ptr.add((i0 + i) * a.rs), kc) });
            for (p, out) in dst.chunks_exact_mut(MR).enumerate() {
                for (o, row) in out.iter_mut().zip(&src) {
                    *o = row[p];
                }
            }
        } else if a.rs == 1 && rows == MR && height == MR {
            // A stored by columns (dZᵀ in dW = dZᵀ·X): each k is MR contiguous values
            for (p, out) in dst.chunks_exact_mut(MR).enumerate() {
                out.copy_from_slice(unsafe { std::slice::from_raw_parts(a.ptr.add(i0 + p * a.cs), MR) });
            }
        } else if a.cs == 1 {
            for i in 0..height {
                if i < rows {
                    let src = unsafe { std::slice::from_raw_parts(a.ptr.add((i0 + i) * a.rs), kc) };
                    for (p, &v) in src.iter().enumerate() {
                        dst[p * height + i] = v;
                    }
                } else {
                    (0..kc).for_each(|p| dst[p * height + i] = 0.0);
                }
            }
        } else {
            for p in 0..kc {
                for i in 0..height {
                    dst[p * height + i] = if i < rows { unsafe { *a.ptr.add((i0 + i) * a.rs + p * a.cs) } } else { 0.0 };
                }
            }
        }
    }
}

/// Packs B (kc×nc) into NR-wide panels, row by row, zero-padding the last panel.
unsafe fn pack_b(kc: usize, nc: usize, b: View, out: &mut [f32]) {
    for (panel, j0) in (0..nc).step_by(NR).enumerate() {
        let cols = NR.min(nc - j0);
        let dst = &mut out[panel * NR * kc..][..NR * kc];
        if b.cs == 1 && cols == NR {
            for p in 0..kc {
                let src = unsafe { std::slice::from_raw_parts(b.ptr.add(p * b.rs + j0), NR) };
                dst[p * NR..(p + 1) * NR].copy_from_slice(src);
            }
        } else if b.rs == 1 && cols == NR {
            // B stored by columns (Wᵀ in X·Wᵀ): k outer, so the panel is written in order
            let src: [&[f32]; NR] = std::array::from_fn(|j| unsafe { std::slice::from_raw_parts(b.ptr.add((j0 + j) * b.cs), kc) });
            for (p, out) in dst.chunks_exact_mut(NR).enumerate() {
                for (o, col) in out.iter_mut().zip(&src) {
                    *o = col[p];
                }
            }
        } else if b.rs == 1 {
            for j in 0..NR {
                if j < cols {
                    let src = unsafe { std::slice::from_raw_parts(b.ptr.add((j0 + j) * b.cs), kc) };
                    for (p, &v) in src.iter().enumerate() {
                        dst[p * NR + j] = v;
                    }
                } else {
                    (0..kc).for_each(|p| dst[p * NR + j] = 0.0);
                }
            }
        } else {
            for p in 0..kc {
                for j in 0..NR {
                    dst[p * NR + j] = if j < cols { unsafe { *b.ptr.add(p * b.rs + (j0 + j) * b.cs) } } else { 0.0 };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Rng;

    #[allow(clippy::too_many_arguments)]
    fn reference(m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: &mut [f32], rsc: usize, csc: usize) {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f32;
                for p in 0..k {
                    acc += a.data[i * a.rs + p * a.cs] * b.data[p * b.rs + j * b.cs];
                }
                let v = &mut c[i * rsc + j * csc];
                *v = if beta == 0.0 { alpha * acc } else { alpha * acc + beta * *v };
            }
        }
    }

    /// (rs, cs, len) of an r×c matrix in one of four layouts: row-major, column-major, and
    /// each with padded leading dimension.
    fn layout(kind: usize, r: usize, c: usize) -> (usize, usize, usize) {
        let pad = 3;
        match kind {
            0 => (c, 1, r * c),
            1 => (1, r, r * c),
            2 => (c + pad, 1, r * (c + pad)),
            _ => (1, r + pad, c * (r + pad)),
        }
    }

    fn check(
        pool: &Pool,
        ws: &GemmWorkspace,
        rng: &mut Rng,
        (m, n, k): (usize, usize, usize),
        kinds: (usize, usize, usize),
        alpha: f32,
        beta: f32,
    ) {
        let (ars, acs, alen) = layout(kinds.0, m, k);
        let (brs, bcs, blen) = layout(kinds.1, k, n);
        let (crs, ccs, clen) = layout(kinds.2, m, n);
        let (a, b) = (rng.ints(alen), rng.ints(blen));
        let c0 = if beta == 0.0 { vec![f32::NAN; clen] } else { rng.ints(clen) };
        let mut want = c0.clone();
        let (am, bm) = (Mat { data: &a, rs: ars, cs: acs }, Mat { data: &b, rs: brs, cs: bcs });
        reference(m, n, k, alpha, am, bm, beta, &mut want, crs, ccs);
        let mut got = c0.clone();
        sgemm(pool, ws, m, n, k, alpha, am, bm, beta, MatMut { data: &mut got, rs: crs, cs: ccs });
        let mut inside = vec![false; clen];
        (0..m).for_each(|i| (0..n).for_each(|j| inside[i * crs + j * ccs] = true));
        for idx in 0..clen {
            if inside[idx] {
                assert_eq!(got[idx], want[idx], "{m}×{n}×{k} layouts {kinds:?} α={alpha} β={beta} at {idx}");
            } else {
                assert!(got[idx].to_bits() == c0[idx].to_bits(), "{m}×{n}×{k}: padding at {idx} touched");
            }
        }
    }

    #[test]
    fn matches_the_plain_loop_on_odd_shapes_and_layouts() {
        let mut rng = Rng::new(1);
        let shapes = [
            (0, 3, 2),
            (3, 0, 2),
            (2, 3, 0),
            (1, 1, 1),
            (1, 17, 5),
            (5, 1, 9),
            (2, 5, 17),
            (7, 33, 65),
            (17, 16, 6),
            (65, 127, 18),
            (6, 16, 300),
            (64, 40, 33),
            (32, 20, 7),
            (10, 48, 9),
            (9, 37, 1),
            (130, 300, 1),
        ];
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            let ws = GemmWorkspace::new(threads);
            for &shape in &shapes {
                for kinds in [(0, 0, 0), (1, 1, 1), (0, 1, 0), (1, 0, 2), (2, 2, 3), (3, 3, 0)] {
                    for (alpha, beta) in [(1.0, 0.0), (0.5, 1.0), (-1.5, 0.5), (1.0, -1.5)] {
                        check(&pool, &ws, &mut rng, shape, kinds, alpha, beta);
                    }
                }
            }
        }
    }

    #[test]
    fn large_shapes_cross_every_block_boundary() {
        let mut rng = Rng::new(2);
        for threads in [1, 2] {
            let pool = Pool::new(threads).unwrap();
            let ws = GemmWorkspace::new(threads);
            // m > MC, n > NC, k > KC, none a multiple of the tiles; small ints keep sums exact
            check(&pool, &ws, &mut rng, (MC + 7, NC + 19, KC + 11), (0, 1, 0), 1.0, 0.0);
            check(&pool, &ws, &mut rng, (266, 265, 257), (1, 0, 2), 1.0, 1.0);
        }
    }

    #[test]
    fn portable_kernel_matches_the_plain_loop() {
        let mut rng = Rng::new(3);
        let (m, n, k) = (13, 37, 300);
        let (a, b) = (rng.ints(m * k), rng.ints(k * n));
        let mut want = vec![0.0; m * n];
        let (am, bm) = (Mat { data: &a, rs: k, cs: 1 }, Mat { data: &b, rs: 1, cs: k });
        reference(m, n, k, 2.0, am, bm, 0.0, &mut want, n, 1);
        let mut got = vec![f32::NAN; m * n];
        let mut scratch = vec![0.0; MC * KC + KC * NC];
        let (av, bv) = (View { ptr: a.as_ptr(), rs: k, cs: 1 }, View { ptr: b.as_ptr(), rs: 1, cs: k });
        // SAFETY: views cover their matrices; scratch has the documented size.
        unsafe { blocked::<Portable>(&mut scratch, m, n, k, 2.0, av, bv, 0.0, ViewMut { ptr: got.as_mut_ptr(), rs: n, cs: 1 }) };
        assert_eq!(got, want);
    }

    #[test]
    fn matches_matrixmultiply_on_real_values() {
        let mut rng = Rng::new(4);
        let pool = Pool::new(2).unwrap();
        let ws = GemmWorkspace::new(2);
        for (m, n, k) in [(128, 784, 128), (1, 128, 784), (64, 10, 128), (300, 200, 100)] {
            let (a, b) = (rng.uniform(m * k), rng.uniform(k * n));
            let mut want = vec![0.0; m * n];
            // SAFETY: row-major buffers of the stated sizes.
            unsafe {
                matrixmultiply::sgemm(
                    m,
                    k,
                    n,
                    1.0,
                    a.as_ptr(),
                    k as isize,
                    1,
                    b.as_ptr(),
                    n as isize,
                    1,
                    0.0,
                    want.as_mut_ptr(),
                    n as isize,
                    1,
                )
            };
            let mut got = vec![f32::NAN; m * n];
            sgemm(
                &pool,
                &ws,
                m,
                n,
                k,
                1.0,
                Mat { data: &a, rs: k, cs: 1 },
                Mat { data: &b, rs: n, cs: 1 },
                0.0,
                MatMut { data: &mut got, rs: n, cs: 1 },
            );
            crate::testutil::assert_close(&got, &want, 1e-5, 1e-5, "vs matrixmultiply");
        }
    }

    #[test]
    #[should_panic(expected = "gemm: B")]
    fn short_operands_are_caught() {
        let ws = GemmWorkspace::new(1);
        let (a, b, mut c) = (vec![0.0; 6], vec![0.0; 5], vec![0.0; 4]);
        sgemm_on(
            &ws,
            0,
            2,
            2,
            3,
            1.0,
            Mat { data: &a, rs: 3, cs: 1 },
            Mat { data: &b, rs: 2, cs: 1 },
            0.0,
            MatMut { data: &mut c, rs: 2, cs: 1 },
        );
    }
}
