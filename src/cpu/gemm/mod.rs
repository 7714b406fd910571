//! Single-precision GEMM: C ← α·A·B + β·C with arbitrary row and column strides.
//!
//! The loop nest is the GotoBLAS/BLIS one, written once (`nest.rs`) and generic over a
//! micro-kernel: B is packed into KC×NC blocks of NR-wide panels, A into MC×KC blocks of row
//! panels at most MR tall, and the micro-kernel computes a tile of C from one panel of each.
//! Where A's rows are one block and B's rows are contiguous, B's full panels are read where
//! they lie if their rows spread over L1's sets (each panel then serves one sweep, and
//! packing it would be a pass of its own). Where A's rows are contiguous (X in Z = X·Wᵀ) and
//! a column of a tile's rows spreads over L1's sets beside the B panel, A is read where it
//! lies: the kernel broadcasts each value of A, so a panel's rows serve as well as a packed
//! copy, which would be a pass of its own over A.
//! The kernel is chosen at run time ([`Isa`]): AVX-512 (12×32 tiles), AVX2 + FMA (6×16), or
//! portable Rust (6×16). Packing buffers live in a [`GemmWorkspace`] allocated once, so a call
//! never allocates. Single-row problems with a plain B (batch-1 training) skip packing.
//!
//! A weight operand can also be packed once into a [`PackedB`] (the B of Z = X·Wᵀ) or a
//! [`PackedA`] (the A of a convolution's Z = W·col), kept by its owner and repacked only when
//! the weights change; products with it skip that operand's packing. A product of a few rows
//! (batch 1 to 4) with a packed B streams it with tiles several panels wide. A product can end
//! in a dense layer's bias and activation, run on C while it is in L1 ([`sgemm_bias_act`]).
//!
//! Each element of C is summed in the same order whatever the thread count: k is never split
//! across threads, the route (row products or the blocked nest, transposed or not) is chosen
//! once for the whole product, and each element is one chain of multiply-adds over k in order,
//! whatever tile holds it. So results are deterministic, and the same on any number of
//! threads; AVX2 and AVX-512 give the same bits (both FMA chains over the same KC blocks),
//! the portable kernel (separate multiply and add) may differ from them in the last bits.
//!
//! Every operand's extent is checked with checked arithmetic before anything is written, and
//! the elements of C must not share memory; after that, each task writes only its own rows (or
//! columns) of C through the raw views below.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod kernel;
mod nest;
mod pack;
mod packed;
mod post;
mod row;
mod shifted;
#[cfg(test)]
mod tests;

use super::isa::Isa;
use super::pool::Pool;
use crate::error::{zeros, Error, Result};
#[cfg(target_arch = "x86_64")]
use avx2::Avx2;
#[cfg(target_arch = "x86_64")]
use avx512::Avx512;
use kernel::{Kernel, Portable};
use nest::{blocked, AOp, BOp};
#[cfg(target_arch = "x86_64")]
pub(crate) use pack::transpose8x8;
pub(crate) use packed::{PackedA, PackedB};
use post::Post;
pub(crate) use post::{sgemm_bias_act, BiasAct, Weights};
use row::row_times_matrix;
pub(crate) use shifted::{sgemm_shifted_into, sgemm_shifted_on, shifted_runs_fit, shifted_slack};

/// Rows of B (and columns of A) per packed block: the same for every kernel, so that each
/// element's chain of FMAs, and its bits, are the same on AVX2 and AVX-512 (and a caller that
/// splits a sum over k at multiples of it, as the recurrent layers' weight gradients do, gets
/// the bits of one product).
pub(crate) const KC: usize = 256;
/// Rows of A per packed block (a multiple of every kernel's MR).
const MC: usize = 144;
/// Columns of B per packed block (a multiple of every kernel's NR).
const NC: usize = 1024;
/// Inner dimensions up to this skip packing when B's and C's rows are contiguous.
const SMALL_K: usize = 4;
/// Problems with fewer multiply-adds run on one thread: handing work to the pool costs µs.
const PARALLEL_MIN_MACS: usize = 96 * 1024;

/// (MR, NR) of `isa`'s kernel: the most rows of a tile and the columns of a B panel.
pub(crate) fn tile_shape(isa: Isa) -> (usize, usize) {
    match isa {
        Isa::Portable => (Portable::MR, Portable::NR),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => (Avx2::MR, Avx2::NR),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (Avx512::MR, Avx512::NR),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("x86 instruction sets are never detected elsewhere"),
    }
}

/// One thread's packing buffers: MC·KC values of packed A, then KC·NC of packed B; and the
/// kernel they serve.
pub(crate) struct GemmScratch {
    isa: Isa,
    buf: Vec<f32>,
}

impl GemmScratch {
    const LEN: usize = MC * KC + KC * NC;
}

/// Packing buffers for each thread of a pool, allocated once (in `preallocate`) and reused by
/// every call. A product borrows it mutably, so two products never share one.
pub(crate) struct GemmWorkspace {
    workers: Vec<GemmScratch>,
}

impl GemmWorkspace {
    /// Buffers for `threads` workers (the pool's thread count), about 1.2 MB each, for the
    /// best kernel of this CPU; an allocation that cannot be had is an `Err` with its size.
    pub fn new(threads: usize) -> Result<GemmWorkspace> {
        GemmWorkspace::with_isa(threads, Isa::best())
    }

    /// As [`GemmWorkspace::new`], for the kernel of `isa`; `Error::Config` if this CPU does
    /// not run it.
    pub fn with_isa(threads: usize, isa: Isa) -> Result<GemmWorkspace> {
        isa.check()?;
        let threads = threads.max(1);
        let mut workers = Vec::new();
        let bytes = threads.saturating_mul(size_of::<GemmScratch>());
        workers.try_reserve_exact(threads).map_err(|_| Error::OutOfMemory { what: "GEMM workers".into(), bytes })?;
        for _ in 0..threads {
            workers.push(GemmScratch { isa, buf: zeros(GemmScratch::LEN, || "GEMM packing buffers".into())? });
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

    /// The instruction set of its kernel (that of packed operands made for it).
    pub fn isa(&self) -> Isa {
        self.workers.first().map_or(Isa::best(), |w| w.isa)
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

/// An output matrix by pointer: element (i, j) at `ptr + i·rs + j·cs`, `len` values from `ptr`.
/// For a product whose C other threads write other elements of meanwhile (a convolution's
/// output rows shared out among tasks, each task's C interleaved with the others' over the
/// channels), which no `&mut` slice may then cover.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutPtr {
    pub ptr: *mut f32,
    pub len: usize,
    pub rs: usize,
    pub cs: usize,
}

impl MatMut<'_> {
    /// The same matrix by pointer (borrowed exclusively: no other thread writes it).
    fn out(self) -> OutPtr {
        OutPtr { ptr: self.data.as_mut_ptr(), len: self.data.len(), rs: self.rs, cs: self.cs }
    }
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
    /// The transpose: rows and columns swapped.
    fn t(self) -> View {
        View { rs: self.cs, cs: self.rs, ..self }
    }

    /// # Safety
    /// (i, j) must lie inside the checked extent.
    unsafe fn at(self, i: usize, j: usize) -> View {
        // SAFETY: inside the checked extent, so the offset is in the slice (no overflow).
        View { ptr: unsafe { self.ptr.add(i * self.rs + j * self.cs) }, ..self }
    }
}

impl ViewMut {
    /// The transpose: rows and columns swapped.
    fn t(self) -> ViewMut {
        ViewMut { rs: self.cs, cs: self.rs, ..self }
    }

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
pub(crate) fn check_extent(what: &str, len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> Result<()> {
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
    check_c(m, n, c)
}

/// How a product is computed; chosen once for the whole product.
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

/// A checked product, possibly transposed, with its route and kernel.
#[derive(Clone, Copy)]
struct Product {
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: AOp,
    b: BOp,
    beta: f32,
    c: ViewMut,
    route: Route,
    isa: Isa,
    /// The epilogue C goes through once its sums are done, a block or a column of tiles at a
    /// time while it is in L1 (blocked nest only).
    post: Option<Post>,
}

impl Product {
    /// The product C ← α·A·B + β·C over checked strided operands, transposed (Cᵀ = Bᵀ·Aᵀ)
    /// where that makes it a single row, makes C's rows contiguous (vector stores) or fills
    /// the panels of B better. A transposed product sums each element over k in the same order.
    #[allow(clippy::too_many_arguments)]
    fn new(isa: Isa, m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) -> Product {
        let (a, b) = (View { ptr: a.data.as_ptr(), rs: a.rs, cs: a.cs }, View { ptr: b.data.as_ptr(), rs: b.rs, cs: b.cs });
        let c = ViewMut { ptr: c.data.as_mut_ptr(), rs: c.rs, cs: c.cs };
        let nr = tile_shape(isa).1;
        // (an empty C is never run, so only m, n ≥ 1 reach the waste)
        let transpose = m > 1 && n >= 1 && (n == 1 || (c.cs != 1 && (c.rs == 1 || panel_waste(m, nr) < panel_waste(n, nr))));
        let (m, n, a, b, c) = if transpose { (n, m, b.t(), a.t(), c.t()) } else { (m, n, a, b, c) };
        let route = if k == 0 {
            Route::Scale
        } else if m == 1 || (k <= SMALL_K && b.cs == 1 && c.cs == 1) {
            Route::Rows
        } else {
            Route::Blocked
        };
        Product { m, n, k, alpha, a: AOp::View(a), b: BOp::View(b), beta, c, route, isa, post: None }
    }

    /// A product through the blocked nest (never transposed), or C ← β·C where k = 0; the
    /// operands packed once, or packed as it goes.
    #[allow(clippy::too_many_arguments)]
    fn packed(isa: Isa, m: usize, n: usize, k: usize, alpha: f32, a: AOp, b: BOp, beta: f32, c: OutPtr) -> Product {
        let c = ViewMut { ptr: c.ptr, rs: c.rs, cs: c.cs };
        let route = if k == 0 { Route::Scale } else { Route::Blocked };
        Product { m, n, k, alpha, a, b, beta, c, route, isa, post: None }
    }

    /// Rows `rows` and columns `cols` of this product, on the same route. A packed A is
    /// never split by rows, a shifted B never at all (their entries run on one thread).
    ///
    /// # Safety
    /// The ranges are non-empty and lie inside 0..m and 0..n, and k ≥ 1.
    unsafe fn part(self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Product {
        debug_assert!(!rows.is_empty() && !cols.is_empty() && rows.end <= self.m && cols.end <= self.n && self.k >= 1);
        // SAFETY: with non-empty ranges and k ≥ 1, (rows.start, 0) of A, (0, cols.start) of B
        // and (rows.start, cols.start) of C are elements inside the checked extents.
        unsafe {
            let a = match self.a {
                AOp::View(a) => AOp::View(a.at(rows.start, 0)),
                AOp::Packed(a) => {
                    assert!(rows == (0..self.m), "a packed A is not split by rows");
                    AOp::Packed(a)
                }
            };
            let b = match self.b {
                BOp::View(b) => BOp::View(b.at(0, cols.start)),
                BOp::Packed(b) => BOp::Packed(b.at_column(cols.start)),
                BOp::Shifted { .. } => {
                    assert!(cols == (0..self.n), "a shifted B is not split");
                    self.b
                }
            };
            let post = self.post.map(|post| post.at(rows.start, cols.start));
            Product { m: rows.len(), n: cols.len(), a, b, c: self.c.at(rows.start, cols.start), post, ..self }
        }
    }

    /// Runs the product on the calling thread.
    ///
    /// # Safety
    /// The operands cover m×k, k×n and m×n (checked), the elements of C are distinct, no
    /// other thread touches them during the call, and this CPU runs `isa`.
    unsafe fn run(self, scratch: &mut GemmScratch) {
        let Product { m, n, k, alpha, a, b, beta, c, route, isa, post } = self;
        if m == 0 || n == 0 {
            return;
        }
        // SAFETY: this function's contract; each path stays inside the extents it is given.
        unsafe {
            match (route, a, b) {
                (Route::Scale, ..) => {
                    scale(m, n, beta, c);
                    if let Some(post) = post {
                        post.apply(m, n, c);
                    }
                }
                (Route::Rows, AOp::View(a), BOp::View(b)) => {
                    debug_assert!(post.is_none(), "an epilogue runs in the blocked nest");
                    for i in 0..m {
                        row_times_matrix(n, k, alpha, a.at(i, 0), b, beta, c.at(i, 0));
                    }
                }
                (Route::Rows, ..) => unreachable!("only plain operands go row by row"),
                (Route::Blocked, ..) => match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => blocked::<Avx512>(&mut scratch.buf, &self),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => blocked::<Avx2>(&mut scratch.buf, &self),
                    _ => blocked::<Portable>(&mut scratch.buf, &self),
                },
            }
        }
    }

    /// Runs the product split over the pool's threads (`ws` serves at least as many): the
    /// longer side of C (only columns for a packed A) in parts aligned to the tile.
    ///
    /// # Safety
    /// As [`Product::run`], for every worker of the pool.
    unsafe fn run_on(self, pool: &Pool, ws: &mut GemmWorkspace) {
        assert!(ws.threads() >= pool.threads(), "a GEMM workspace for {} threads on a pool of {}", ws.threads(), pool.threads());
        let threads = pool.threads();
        if threads == 1 || self.m.saturating_mul(self.n).saturating_mul(self.k) < PARALLEL_MIN_MACS {
            // SAFETY: this function's contract.
            return unsafe { self.run(&mut ws.workers[0]) };
        }
        let (mr, nr) = tile_shape(self.isa);
        let split_rows = matches!(self.a, AOp::View(_)) && self.m.div_ceil(mr) >= self.n.div_ceil(nr);
        let (len, unit) = if split_rows { (self.m, mr) } else { (self.n, nr) };
        let tiles = len.div_ceil(unit);
        let tasks = threads.min(tiles);
        pool.run_with(tasks, ws.workers(), &|task, _, scratch| {
            let (t0, t1) = (tiles * task / tasks, tiles * (task + 1) / tasks);
            let part = t0 * unit..(t1 * unit).min(len);
            // SAFETY: the operands were checked and C's elements are distinct; k ≥ 1 (the
            // product is large); each task owns the rows (or columns) `part` of C, non-empty
            // (tasks ≤ tiles) and disjoint from every other task's.
            unsafe {
                let p = if split_rows { self.part(part, 0..self.n) } else { self.part(0..self.m, part) };
                p.run(scratch)
            }
        });
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
    let p = Product::new(ws.isa(), m, n, k, alpha, a, b, beta, c);
    // SAFETY: checked above; C is borrowed exclusively for this call; the workspace's kernel
    // was one this CPU runs when it was made.
    unsafe { p.run_on(pool, ws) }
}

/// As [`sgemm`], on the calling thread only, with one worker's packing buffers.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm_on(scratch: &mut GemmScratch, m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) {
    if let Err(e) = check_operands(m, n, k, &a, &b, &c) {
        panic!("{e}");
    }
    // SAFETY: checked above; C is borrowed exclusively for this call.
    unsafe { Product::new(scratch.isa, m, n, k, alpha, a, b, beta, c).run(scratch) }
}

/// C (m×n) ← α·A (m×k)·B + β·C with B (k×n) packed once ([`PackedB`]), split over the pool's
/// threads. Rows of C have the bits they would have in a product with B unpacked (each a
/// chain of FMAs over k), so a batch of 1 and the same sample in a batch of 64 agree. Panics,
/// before writing anything, if A or C is too short, C's elements overlap, or `b` was packed for
/// another kernel than `ws`'s.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm_packed_b(pool: &Pool, ws: &mut GemmWorkspace, m: usize, alpha: f32, a: Mat, b: &PackedB, beta: f32, c: MatMut) {
    let (n, k) = (b.n(), b.k());
    check_extent("A", a.data.len(), m, k, a.rs, a.cs).and_then(|_| check_c(m, n, &c)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(b.isa(), ws.isa(), "B packed for another kernel than the workspace's");
    let a = AOp::View(View { ptr: a.data.as_ptr(), rs: a.rs, cs: a.cs });
    let p = Product::packed(b.isa(), m, n, k, alpha, a, BOp::Packed(b.view()), beta, c.out());
    // SAFETY: checked above (B by its construction); C is borrowed exclusively for this call.
    unsafe { p.run_on(pool, ws) }
}

/// C (m×n) ← α·A·B (k×n) + β·C through the blocked nest, both operands packed here as the
/// call goes (B's panels perhaps read in place; never transposed, never row by row), split
/// over the pool's threads: the bits [`sgemm_packed_b`] and [`sgemm_packed_a`] give with
/// either operand packed once, for a first product that cannot yet tell whether packing once
/// would be repaid. Panics as [`sgemm`]. (The dense layers run this route through
/// [`sgemm_bias_act`], with their epilogue; the tests run it plain.)
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm_blocked(
    pool: &Pool,
    ws: &mut GemmWorkspace,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat,
    b: Mat,
    beta: f32,
    c: MatMut,
) {
    check_operands(m, n, k, &a, &b, &c).unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = (View { ptr: a.data.as_ptr(), rs: a.rs, cs: a.cs }, View { ptr: b.data.as_ptr(), rs: b.rs, cs: b.cs });
    let p = Product::packed(ws.isa(), m, n, k, alpha, AOp::View(a), BOp::View(b), beta, c.out());
    // SAFETY: checked above; C is borrowed exclusively for this call; the workspace's kernel
    // was one this CPU runs when it was made.
    unsafe { p.run_on(pool, ws) }
}

/// C (m×n) ← α·A·B (k×n) + β·C with A (m×k) packed once ([`PackedA`]), on the calling thread.
/// Panics as [`sgemm_packed_b`] does.
pub(crate) fn sgemm_packed_a_on(scratch: &mut GemmScratch, n: usize, alpha: f32, a: &PackedA, b: Mat, beta: f32, c: MatMut) {
    // SAFETY: C is borrowed exclusively for this call.
    unsafe { sgemm_packed_a_into(scratch, n, alpha, a, b, beta, c.out()) }
}

/// [`sgemm_packed_a_on`] into a C given by pointer.
///
/// # Safety
/// The `c.len` values from `c.ptr` are valid to read and write (the extent is checked here),
/// and no other thread reads or writes C's m×n elements during the call.
pub(crate) unsafe fn sgemm_packed_a_into(scratch: &mut GemmScratch, n: usize, alpha: f32, a: &PackedA, b: Mat, beta: f32, c: OutPtr) {
    let (m, k) = (a.m(), a.k());
    check_extent("B", b.data.len(), k, n, b.rs, b.cs).and_then(|_| check_out(m, n, &c)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.isa(), scratch.isa, "A packed for another kernel than the scratch's");
    let b = BOp::View(View { ptr: b.data.as_ptr(), rs: b.rs, cs: b.cs });
    // SAFETY: checked above (A by its construction); C's elements are ours alone (the contract).
    unsafe { Product::packed(a.isa(), m, n, k, alpha, AOp::Packed(a.view()), b, beta, c).run(scratch) }
}

/// C's extent and the distinctness of its elements.
pub(crate) fn check_c(m: usize, n: usize, c: &MatMut) -> Result<()> {
    check_extent("C", c.data.len(), m, n, c.rs, c.cs)?;
    check_distinct(m, n, c.rs, c.cs)
}

/// As [`check_c`], for a C given by pointer.
fn check_out(m: usize, n: usize, c: &OutPtr) -> Result<()> {
    check_extent("C", c.len, m, n, c.rs, c.cs)?;
    check_distinct(m, n, c.rs, c.cs)
}

/// Share of a row of n values (n ≥ 1) that padding its last B panel to NR columns wastes,
/// per mille.
fn panel_waste(n: usize, nr: usize) -> usize {
    let padded = n.next_multiple_of(nr);
    1000 * (padded - n) / padded
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
