//! Single-precision GEMM: C ← α·A·B + β·C with arbitrary row and column strides.
//!
//! The loop nest is the GotoBLAS/BLIS one, written once and generic over a micro-kernel:
//! B is packed into KC×NC blocks of NR-wide panels, A into MC×KC blocks of MR-tall panels, and
//! the micro-kernel computes an MR×NR tile of C from one panel of each. The AVX2+FMA kernel
//! (6×16, 12 accumulator registers) is chosen at run time; a portable kernel with the same
//! shape serves everywhere else. Packing buffers live in a [`GemmWorkspace`] allocated once,
//! so a call never allocates. Single-row problems (batch-1 inference) skip packing.
//!
//! Each element of C is summed in the same order whatever the thread count: k is never split
//! across threads, the route (row products or the blocked nest, transposed or not) is chosen
//! once for the whole product, and an edge tile rounds as a full tile does. So results are
//! deterministic, and the same on any number of threads.
//!
//! Every operand's extent is checked with checked arithmetic before anything is written, and
//! the elements of C must not share memory; after that, each task writes only its own rows (or
//! columns) of C through the raw views below.

mod kernel;
mod pack;
mod row;
#[cfg(test)]
mod tests;

use super::pool::Pool;
use crate::error::{zeros, Error, Result};
#[cfg(target_arch = "x86_64")]
use kernel::Avx2;
use kernel::{Kernel, Portable};
use pack::{pack_a, pack_b, row_panels};
use row::row_times_matrix;

const MR: usize = 6;
const NR: usize = 16;
const KC: usize = 256;
const MC: usize = 144;
const NC: usize = 1024;
/// Inner dimensions up to this skip packing when B's and C's rows are contiguous.
const SMALL_K: usize = 4;
/// Problems with fewer multiply-adds run on one thread: handing work to the pool costs µs.
const PARALLEL_MIN_MACS: usize = 96 * 1024;

/// One thread's packing buffers: MC·KC values of packed A, then KC·NC of packed B.
pub(crate) struct GemmScratch(Vec<f32>);

impl GemmScratch {
    const LEN: usize = MC * KC + KC * NC;
}

/// Packing buffers for each thread of a pool, allocated once (in `preallocate`) and reused by
/// every call. A product borrows it mutably, so two products never share one.
pub(crate) struct GemmWorkspace {
    workers: Vec<GemmScratch>,
}

impl GemmWorkspace {
    /// Buffers for `threads` workers (the pool's thread count), about 1.2 MB each; an
    /// allocation that cannot be had is an `Err` with its size.
    pub fn new(threads: usize) -> Result<GemmWorkspace> {
        let threads = threads.max(1);
        let mut workers = Vec::new();
        let bytes = threads.saturating_mul(size_of::<GemmScratch>());
        workers.try_reserve_exact(threads).map_err(|_| Error::OutOfMemory { what: "GEMM workers".into(), bytes })?;
        for _ in 0..threads {
            workers.push(GemmScratch(zeros(GemmScratch::LEN, || "GEMM packing buffers".into())?));
        }
        Ok(GemmWorkspace { workers })
    }

    /// No buffers, for a cache whose products run elsewhere (on a GPU); never passed to `sgemm`.
    pub fn none() -> GemmWorkspace {
        GemmWorkspace { workers: Vec::new() }
    }

    /// Number of workers this workspace serves.
    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// One scratch per worker, for [`Pool::run_with`].
    pub fn workers(&mut self) -> &mut [GemmScratch] {
        &mut self.workers
    }
}

/// A strided matrix operand: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// A strided output matrix: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Debug)]
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
        // SAFETY: inside the checked extent, so the offset is in the slice (no overflow).
        View { ptr: unsafe { self.ptr.add(i * self.rs + j * self.cs) }, ..self }
    }
}

impl ViewMut {
    /// # Safety
    /// (i, j) must lie inside the checked extent.
    unsafe fn at(self, i: usize, j: usize) -> ViewMut {
        // SAFETY: as `View::at`.
        ViewMut { ptr: unsafe { self.ptr.add(i * self.rs + j * self.cs) }, ..self }
    }
}

// SAFETY: the views point into slices borrowed for the whole call (A and B shared, C
// exclusively); tasks only read A and B and write disjoint sets of C's elements (distinct, as
// `check_operands` ensured). So for the four impls here.
unsafe impl Send for ViewMut {}
// SAFETY: as above.
unsafe impl Sync for ViewMut {}
// SAFETY: as above.
unsafe impl Send for View {}
// SAFETY: as above.
unsafe impl Sync for View {}

/// Ok when every element (i < rows, j < cols) lies inside `len`; the offset of the last one is
/// computed with checked arithmetic, so a stride that would wrap around is an error too.
fn check_extent(what: &str, len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let last = (rows - 1).checked_mul(rs).zip((cols - 1).checked_mul(cs)).and_then(|(r, c)| r.checked_add(c));
    match last {
        Some(last) if last < len => Ok(()),
        Some(last) => Err(Error::Shape(format!(
            "gemm: {what} of {rows}×{cols} with strides ({rs}, {cs}) needs {} values, has {len}",
            last as u128 + 1
        ))),
        None => Err(Error::Shape(format!("gemm: {what} of {rows}×{cols} with strides ({rs}, {cs}) reaches past usize::MAX"))),
    }
}

/// Ok when no two elements of C (rows × cols, strides rs, cs) share a place: the dimension with
/// the smaller stride (of those longer than 1) must have a stride of at least 1, and the other
/// must step past all of it. (This leaves out interleaved layouts, which no product needs.)
fn check_distinct(rows: usize, cols: usize, rs: usize, cs: usize) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let (mut dims, mut count) = ([(0, 0); 2], 0);
    for (extent, stride) in [(rows, rs), (cols, cs)] {
        if extent > 1 {
            dims[count] = (extent, stride);
            count += 1;
        }
    }
    let dims = &mut dims[..count];
    dims.sort_by_key(|&(_, stride)| stride);
    let distinct = match *dims {
        [] => true,
        [(_, stride)] => stride >= 1,
        [(inner, s1), (_, s2)] => s1 >= 1 && (inner - 1).checked_mul(s1).is_some_and(|span| s2 > span),
        _ => unreachable!("two dimensions"),
    };
    if distinct {
        Ok(())
    } else {
        Err(Error::Shape(format!("gemm: C of {rows}×{cols} with strides ({rs}, {cs}) has elements that share memory")))
    }
}

/// The checks every entry makes before it touches memory.
pub(crate) fn check_operands(m: usize, n: usize, k: usize, a: &Mat, b: &Mat, c: &MatMut) -> Result<()> {
    check_extent("A", a.data.len(), m, k, a.rs, a.cs)?;
    check_extent("B", b.data.len(), k, n, b.rs, b.cs)?;
    check_extent("C", c.data.len(), m, n, c.rs, c.cs)?;
    check_distinct(m, n, c.rs, c.cs)
}

/// How a product is computed; chosen once for the whole product (see [`Product::new`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Route {
    /// k = 0: C ← β·C.
    Scale,
    /// Row by row with `row_times_matrix`: a single row, or a rank-k update (k ≤ SMALL_K)
    /// with the rows of B and C contiguous, where packing would cost more than it saves.
    Rows,
    /// The packed, blocked loop nest.
    Blocked,
}

/// A checked product, possibly transposed, with its route.
#[derive(Clone, Copy)]
struct Product {
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: View,
    b: View,
    beta: f32,
    c: ViewMut,
    route: Route,
}

impl Product {
    /// The product C ← α·A·B + β·C over checked operands, transposed (Cᵀ = Bᵀ·Aᵀ) where that
    /// makes it a single row, makes C's rows contiguous (vector stores) or fills the micro-tiles
    /// better. A transposed product sums each element over k in the same order.
    #[allow(clippy::too_many_arguments)]
    fn new(m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) -> Product {
        let (a, b) = (View { ptr: a.data.as_ptr(), rs: a.rs, cs: a.cs }, View { ptr: b.data.as_ptr(), rs: b.rs, cs: b.cs });
        let c = ViewMut { ptr: c.data.as_mut_ptr(), rs: c.rs, cs: c.cs };
        let p = Product { m, n, k, alpha, a, b, beta, c, route: Route::Blocked };
        // (an empty C is never run, so only m, n ≥ 1 reach the tile count)
        let transpose = m > 1 && n >= 1 && (n == 1 || (c.cs != 1 && (c.rs == 1 || tile_waste(n, m) < tile_waste(m, n))));
        let p = if transpose { p.transposed() } else { p };
        let route = if k == 0 {
            Route::Scale
        } else if p.m == 1 || (k <= SMALL_K && p.b.cs == 1 && p.c.cs == 1) {
            Route::Rows
        } else {
            Route::Blocked
        };
        Product { route, ..p }
    }

    fn transposed(self) -> Product {
        let t = |v: View| View { rs: v.cs, cs: v.rs, ..v };
        Product { m: self.n, n: self.m, a: t(self.b), b: t(self.a), c: ViewMut { rs: self.c.cs, cs: self.c.rs, ..self.c }, ..self }
    }

    /// Rows `rows` and columns `cols` of this product, on the same route.
    ///
    /// # Safety
    /// The ranges are non-empty and lie inside 0..m and 0..n, and k ≥ 1.
    unsafe fn part(self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Product {
        debug_assert!(!rows.is_empty() && !cols.is_empty() && rows.end <= self.m && cols.end <= self.n && self.k >= 1);
        // SAFETY: with non-empty ranges and k ≥ 1, (rows.start, 0) of A, (0, cols.start) of B
        // and (rows.start, cols.start) of C are elements inside the checked extents.
        let (a, b, c) = unsafe { (self.a.at(rows.start, 0), self.b.at(0, cols.start), self.c.at(rows.start, cols.start)) };
        Product { m: rows.len(), n: cols.len(), a, b, c, ..self }
    }

    /// Runs the product on the calling thread.
    ///
    /// # Safety
    /// The views cover m×k, k×n and m×n (checked), the elements of C are distinct, and no other
    /// thread touches them during the call.
    unsafe fn run(self, scratch: &mut GemmScratch) {
        let Product { m, n, k, alpha, a, b, beta, c, route } = self;
        if m == 0 || n == 0 {
            return;
        }
        // SAFETY: this function's contract; each path stays inside the extents it is given.
        unsafe {
            match route {
                Route::Scale => scale(m, n, beta, c),
                Route::Rows => {
                    for i in 0..m {
                        row_times_matrix(n, k, alpha, a.at(i, 0), b, beta, c.at(i, 0));
                    }
                }
                #[cfg(target_arch = "x86_64")]
                Route::Blocked if super::has_avx2_fma() => blocked::<Avx2>(&mut scratch.0, m, n, k, alpha, a, b, beta, c),
                Route::Blocked => blocked::<Portable>(&mut scratch.0, m, n, k, alpha, a, b, beta, c),
            }
        }
    }
}

/// C (m×n) ← α·A (m×k)·B (k×n) + β·C, split over the pool's threads (`ws` serves at least as
/// many). If β is zero, C need not be initialised (NaN in C is overwritten, not propagated).
/// Panics, before writing anything, if an operand slice is too short for its shape and strides
/// or C's elements overlap (an internal bug: the public entry, `crate::gemm`, returns an `Err`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(pool: &Pool, ws: &mut GemmWorkspace, m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) {
    if let Err(e) = check_operands(m, n, k, &a, &b, &c) {
        panic!("{e}");
    }
    assert!(ws.threads() >= pool.threads(), "a GEMM workspace for {} threads on a pool of {}", ws.threads(), pool.threads());
    let p = Product::new(m, n, k, alpha, a, b, beta, c);
    let threads = pool.threads();
    if threads == 1 || m.saturating_mul(n).saturating_mul(k) < PARALLEL_MIN_MACS {
        // SAFETY: checked above; C is borrowed exclusively for this call.
        return unsafe { p.run(&mut ws.workers[0]) };
    }
    // Split the longer side of C into `threads` parts aligned to the micro-tile.
    let split_rows = p.m.div_ceil(MR) >= p.n.div_ceil(NR);
    let (len, unit) = if split_rows { (p.m, MR) } else { (p.n, NR) };
    let tiles = len.div_ceil(unit);
    let tasks = threads.min(tiles);
    pool.run_with(tasks, ws.workers(), &|task, _, scratch| {
        let (t0, t1) = (tiles * task / tasks, tiles * (task + 1) / tasks);
        let part = t0 * unit..(t1 * unit).min(len);
        // SAFETY: the operands were checked above and C's elements are distinct; k ≥ 1 (the
        // product is large); each task owns the rows (or columns) `part` of C, non-empty
        // (tasks ≤ tiles) and disjoint from every other task's.
        unsafe {
            let p = if split_rows { p.part(part, 0..p.n) } else { p.part(0..p.m, part) };
            p.run(scratch)
        }
    });
}

/// As [`sgemm`], on the calling thread only, with one worker's packing buffers.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm_on(scratch: &mut GemmScratch, m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) {
    if let Err(e) = check_operands(m, n, k, &a, &b, &c) {
        panic!("{e}");
    }
    // SAFETY: checked above; C is borrowed exclusively for this call.
    unsafe { Product::new(m, n, k, alpha, a, b, beta, c).run(scratch) }
}

/// Multiply-adds wasted on padding when an m×n product is cut into MR×NR tiles, per mille
/// (m, n ≥ 1 and m·n values in a slice, so neither rounds past usize; the product in u128).
fn tile_waste(m: usize, n: usize) -> u128 {
    let padded = (m.div_ceil(MR) * MR) as u128 * (n.div_ceil(NR) * NR) as u128;
    1000 * (padded - (m as u128 * n as u128)) / padded
}

/// C ← β·C (β = 0 writes zeros without reading C).
///
/// # Safety
/// `c` covers m×n elements no other thread touches during the call.
unsafe fn scale(m: usize, n: usize, beta: f32, c: ViewMut) {
    for i in 0..m {
        for j in 0..n {
            // SAFETY: element (i < m, j < n) of C.
            let p = unsafe { c.ptr.add(i * c.rs + j * c.cs) };
            // SAFETY: as above.
            unsafe { *p = if beta == 0.0 { 0.0 } else { beta * *p } };
        }
    }
}

/// The blocked loop nest. Edge tiles, and tiles of a C whose rows are not contiguous, go
/// through a stack tile and are copied out.
///
/// # Safety
/// As [`Product::run`]: the views cover m×k, k×n and m×n elements, C's distinct and ours
/// alone; `scratch` holds MC·KC + KC·NC values; `K` runs on this CPU.
#[allow(clippy::too_many_arguments)]
unsafe fn blocked<K: Kernel>(scratch: &mut [f32], m: usize, n: usize, k: usize, alpha: f32, a: View, b: View, beta: f32, c: ViewMut) {
    let (apack, bpack) = scratch.split_at_mut(MC * KC);
    let mut edge = [0.0f32; MR * NR];
    let edge_view = ViewMut { ptr: edge.as_mut_ptr(), rs: NR, cs: 1 };
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            // SAFETY: rows pc..pc + kc ≤ k, columns jc..jc + nc ≤ n of B; bpack holds KC·NC.
            unsafe { pack_b(kc, nc, b.at(pc, jc), bpack) };
            let beta_block = if pc == 0 { beta } else { 1.0 };
            for ic in (0..m).step_by(MC) {
                let mc = MC.min(m - ic);
                // SAFETY: rows ic..ic + mc ≤ m, columns pc..pc + kc ≤ k of A; apack holds MC·KC.
                unsafe { pack_a(mc, kc, a.at(ic, pc), apack) };
                for jr in (0..nc).step_by(NR) {
                    let nr = NR.min(nc - jr);
                    for (ir, mr, height) in row_panels(mc) {
                        let (ap, bp) = (apack[ir * kc..].as_ptr(), bpack[jr * kc..].as_ptr());
                        // The tile is rows ic + ir.. + mr ≤ m and columns jc + jr.. + nr ≤ n of C;
                        // the panels hold kc columns of `height` and kc rows of NR values.
                        // SAFETY: (ic + ir, jc + jr) is an element of C.
                        let ct = unsafe { c.at(ic + ir, jc + jr) };
                        match (mr, height, nr == NR && c.cs == 1) {
                            // SAFETY: a full tile of C with contiguous rows.
                            (MR, MR, true) => unsafe { K::tile::<MR>(kc, ap, bp, alpha, beta_block, ct) },
                            // SAFETY: as above.
                            (4, 4, true) => unsafe { K::tile::<4>(kc, ap, bp, alpha, beta_block, ct) },
                            _ => {
                                if height == 4 {
                                    // SAFETY: `edge` is a full MR×NR tile (rows of NR), ours.
                                    unsafe { K::tile::<4>(kc, ap, bp, 1.0, 0.0, edge_view) };
                                } else {
                                    // SAFETY: as above.
                                    unsafe { K::tile::<MR>(kc, ap, bp, 1.0, 0.0, edge_view) };
                                }
                                for i in 0..mr {
                                    for j in 0..nr {
                                        // SAFETY: (i < mr, j < nr) of the tile is an element of C.
                                        let p = unsafe { ct.ptr.add(i * ct.rs + j * ct.cs) };
                                        let v = edge[i * NR + j];
                                        // SAFETY: as above.
                                        unsafe { *p = if beta_block == 0.0 { alpha * v } else { K::blend(alpha, v, beta_block, *p) } };
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
