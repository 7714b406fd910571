//! The micro-kernels: a tile of C ← α·(A panel)·(B panels) + β·C, one version per
//! instruction set ([`Portable`] here, `Avx2` and `Avx512` beside it).
//!
//! A tile is `height` rows (≤ MR) by `panels` B panels of NR columns side by side. Each
//! element of C is one chain of multiply-adds over k in order (FMAs on AVX2 and AVX-512), so
//! a tile's shape, the panels it spans and the instruction set's vector width never change
//! an element's bits: AVX2 and AVX-512 agree exactly.

use super::ViewMut;

/// How the values of an A panel (a tile's `height` ≤ MR rows, kc columns) are found. (The
/// height is passed in, a constant where the kernels call these, so it folds away.)
pub(super) trait Rows: Copy {
    /// Value (i, p) of the panel, i < height, p < kc.
    ///
    /// # Safety
    /// (i, p) lies in the panel of an operand the caller checked.
    unsafe fn at(self, i: usize, p: usize, height: usize) -> *const f32;

    /// The panel whose first row is row `ir` of this one's block (of kc columns).
    ///
    /// # Safety
    /// That row exists in the checked operand.
    unsafe fn down(self, ir: usize, kc: usize) -> Self;
}

/// A block packed into row panels (`pack_a`): the panel from row ir at `ptr + ir·kc`, k-major,
/// value (i, p) at `p·height + i`.
#[derive(Clone, Copy)]
pub(super) struct PackedRows {
    pub ptr: *const f32,
}

impl Rows for PackedRows {
    #[inline(always)]
    unsafe fn at(self, i: usize, p: usize, height: usize) -> *const f32 {
        // SAFETY: the caller's promise ((i, p) in the panel).
        unsafe { self.ptr.add(p * height + i) }
    }

    #[inline(always)]
    unsafe fn down(self, ir: usize, kc: usize) -> PackedRows {
        // SAFETY: the caller's promise (row ir exists; the panels above hold ir rows of kc).
        PackedRows { ptr: unsafe { self.ptr.add(ir * kc) } }
    }
}

/// A block read where it lies in an A whose rows are contiguous (X in Z = X·Wᵀ): value (i, p)
/// at `ptr + i·rs + p`. The kernels broadcast each value, so they read a row panel as well
/// from its rows as from a packed copy, and the copy is a pass of its own over A.
#[derive(Clone, Copy)]
pub(super) struct RowsInPlace {
    pub ptr: *const f32,
    pub rs: usize,
}

impl Rows for RowsInPlace {
    #[inline(always)]
    unsafe fn at(self, i: usize, p: usize, _height: usize) -> *const f32 {
        // SAFETY: the caller's promise ((i, p) in the panel).
        unsafe { self.ptr.add(i * self.rs + p) }
    }

    #[inline(always)]
    unsafe fn down(self, ir: usize, _kc: usize) -> RowsInPlace {
        // SAFETY: the caller's promise (row ir exists).
        RowsInPlace { ptr: unsafe { self.ptr.add(ir * self.rs) }, ..self }
    }
}

/// How the kc rows of a B panel are found: row p (p < kc) is NR contiguous values. (NR is
/// passed in, a constant where the kernels call these, so it folds away.)
pub(super) trait Panel: Copy {
    /// Row p of this panel: its first NR / 2 values (the second half is [`Panel::gap`] on).
    ///
    /// # Safety
    /// p < kc of an operand the caller checked.
    unsafe fn row(self, p: usize, nr: usize) -> *const f32;

    /// How far the second NR / 2 values of each row lie past its first: NR / 2 where a row is
    /// contiguous.
    fn gap(self, nr: usize) -> usize;

    /// The panel `q` places to the right (columns q·NR on).
    ///
    /// # Safety
    /// That panel exists in the checked operand.
    unsafe fn next(self, q: usize, nr: usize) -> Self;
}

/// Panels packed one after another, k-major: row p at `ptr + p·NR`, the next panel `stride`
/// values on (kc·NR).
#[derive(Clone, Copy)]
pub(super) struct Packed {
    pub ptr: *const f32,
    pub stride: usize,
}

impl Panel for Packed {
    #[inline(always)]
    unsafe fn row(self, p: usize, nr: usize) -> *const f32 {
        // SAFETY: the caller's promise (row p of this panel).
        unsafe { self.ptr.add(p * nr) }
    }

    #[inline(always)]
    fn gap(self, nr: usize) -> usize {
        nr / 2
    }

    #[inline(always)]
    unsafe fn next(self, q: usize, _nr: usize) -> Self {
        // SAFETY: the caller's promise (panel q exists).
        Packed { ptr: unsafe { self.ptr.add(q * self.stride) }, ..self }
    }
}

/// Panels read where they lie in a B whose rows are contiguous: row p at `ptr + p·rs`, the
/// next panel NR values on.
#[derive(Clone, Copy)]
pub(super) struct InPlace {
    pub ptr: *const f32,
    pub rs: usize,
}

impl Panel for InPlace {
    #[inline(always)]
    unsafe fn row(self, p: usize, _nr: usize) -> *const f32 {
        // SAFETY: the caller's promise (row p of this panel).
        unsafe { self.ptr.add(p * self.rs) }
    }

    #[inline(always)]
    fn gap(self, nr: usize) -> usize {
        nr / 2
    }

    #[inline(always)]
    unsafe fn next(self, q: usize, nr: usize) -> Self {
        // SAFETY: the caller's promise (panel q exists).
        InPlace { ptr: unsafe { self.ptr.add(q * nr) }, ..self }
    }
}

/// Rows read in place from one buffer, each at its own offset: row p of the panel at
/// `base + offsets[p]`, the next panel NR values on. (A convolution's input, each row a
/// shifted window of the same planes: no lowered copy.)
#[derive(Clone, Copy)]
pub(super) struct Shifted {
    pub base: *const f32,
    pub offsets: *const usize,
}

impl Panel for Shifted {
    #[inline(always)]
    unsafe fn row(self, p: usize, _nr: usize) -> *const f32 {
        // SAFETY: the caller's promise: offsets has kc entries, each row inside the buffer.
        unsafe { self.base.add(*self.offsets.add(p)) }
    }

    #[inline(always)]
    fn gap(self, nr: usize) -> usize {
        nr / 2
    }

    #[inline(always)]
    unsafe fn next(self, q: usize, nr: usize) -> Self {
        // SAFETY: the caller's promise (panel q lies inside the buffer for every offset).
        Shifted { base: unsafe { self.base.add(q * nr) }, ..self }
    }
}

/// As [`Shifted`], each row in runs: column j of row p at `origin + offsets[p] + (j /
/// width)·pitch + j % width` (a convolution's output pixels, rows of `width` that lie `pitch`
/// apart in its input planes). A panel's halves each lie in one run: `width` is a multiple of
/// NR / 2. A half wholly at or past column n (computed and dropped) is read right after the
/// first half, so that no read reaches past the last run by more than NR.
#[derive(Clone, Copy)]
pub(super) struct ShiftedRuns {
    /// `origin` at the panel's first column.
    base: *const f32,
    offsets: *const usize,
    /// Distance from the first half of a row to its second.
    gap: usize,
    origin: *const f32,
    /// The panel's first column: run `run`, place `x` in it.
    run: usize,
    x: usize,
    runs: Runs,
}

/// Columns 0..n in runs of `width`, `pitch` apart (see [`ShiftedRuns`]).
#[derive(Clone, Copy)]
pub(super) struct Runs {
    pub width: usize,
    pub pitch: usize,
    pub n: usize,
}

impl Runs {
    /// Where column j lies, from the start of its row of B.
    pub fn at(self, j: usize) -> usize {
        (j / self.width) * self.pitch + j % self.width
    }
}

impl ShiftedRuns {
    /// The panel whose first column is `col` (< n).
    ///
    /// # Safety
    /// The runs lie inside the buffer at `origin` from every offset (the caller checked).
    pub unsafe fn at(origin: *const f32, offsets: *const usize, runs: Runs, col: usize, nr: usize) -> ShiftedRuns {
        // SAFETY: the contract.
        unsafe { ShiftedRuns::place(origin, offsets, runs, col / runs.width, col % runs.width, nr) }
    }

    /// The panel whose first column is place x of run `run`, found without a division (a
    /// tile finds its panels a few times per kc·MR multiply-adds).
    ///
    /// # Safety
    /// As [`ShiftedRuns::at`]; that column is before n.
    #[inline(always)]
    unsafe fn place(origin: *const f32, offsets: *const usize, runs: Runs, run: usize, x: usize, nr: usize) -> ShiftedRuns {
        let (first, col) = (run * runs.pitch + x, run * runs.width + x);
        // the second half's column; a run holds whole halves, so it starts this run or the next
        let second = if x + nr / 2 < runs.width { first + nr / 2 } else { (run + 1) * runs.pitch + x + nr / 2 - runs.width };
        let gap = if col + nr / 2 < runs.n { second - first } else { nr / 2 };
        // SAFETY: column col < n lies in the runs (the contract).
        ShiftedRuns { base: unsafe { origin.add(first) }, offsets, gap, origin, run, x, runs }
    }
}

impl Panel for ShiftedRuns {
    #[inline(always)]
    unsafe fn row(self, p: usize, _nr: usize) -> *const f32 {
        // SAFETY: the caller's promise: offsets has kc entries, each row inside the buffer.
        unsafe { self.base.add(*self.offsets.add(p)) }
    }

    #[inline(always)]
    fn gap(self, _nr: usize) -> usize {
        self.gap
    }

    #[inline(always)]
    unsafe fn next(self, q: usize, nr: usize) -> Self {
        if q == 0 {
            return self;
        }
        let (mut run, mut x) = (self.run, self.x + q * nr);
        while x >= self.runs.width {
            (run, x) = (run + 1, x - self.runs.width);
        }
        // SAFETY: the caller's promise (panel q, whose first column is before n, exists).
        unsafe { ShiftedRuns::place(self.origin, self.offsets, self.runs, run, x, nr) }
    }
}

/// B panels a tile of `height` rows spans: few rows share each B load, so more panels give
/// the 8 or more independent accumulator chains that hide the FMA latency (batch-1 products
/// then stream B at full width).
pub(super) const fn panels_for(height: usize) -> usize {
    match height {
        1 => 4,
        2 | 3 => 2,
        _ => 1,
    }
}

/// A micro-kernel for one instruction set.
pub(super) trait Kernel {
    /// Most rows of a tile (the packed A panels' height).
    const MR: usize;
    /// Columns of a B panel.
    const NR: usize;

    /// C tile (height × cols) ← α·Σ_p a_p b_pᵀ + β·C tile (β = 0: C not read), C's rows
    /// contiguous (c.cs = 1); the tile spans `panels` B panels and its first `cols` columns
    /// are stored (cols ≤ panels·NR, the rest computed and dropped).
    ///
    /// # Safety
    /// 1 ≤ height ≤ MR and 1 ≤ panels ≤ `panels_for(height)`; `a`'s panel holds `height`
    /// rows of kc values; `b`'s panels hold kc rows of NR readable values each; `c` covers
    /// height×cols elements that no other thread touches during the call; the CPU runs the
    /// kernel's instruction set.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<A: Rows, B: Panel>(height: usize, panels: usize, kc: usize, a: A, b: B, alpha: f32, beta: f32, c: ViewMut, cols: usize);

    /// α·v + β·c (β ≠ 0) for one element, rounded as `tile` rounds its stores, so that a
    /// tile computed with α = 1, β = 0 and blended here has a full tile's bits.
    fn blend(alpha: f32, v: f32, beta: f32, c: f32) -> f32;
}

/// The blend of the FMA kernels: c + v for α = β = 1 (a training step's accumulation),
/// else fma(α, v, β·c).
#[inline(always)]
pub(super) fn blend_fma(alpha: f32, v: f32, beta: f32, c: f32) -> f32 {
    if alpha == 1.0 && beta == 1.0 {
        c + v
    } else {
        alpha.mul_add(v, beta * c)
    }
}

/// `tile` through a full-width stack tile for kernels that store whole vectors: computes
/// height × width (width = panels·NR ≤ 4·NR, height·width ≤ MR·NR ≤ 384) with α = 1, β = 0,
/// then writes the first `cols` columns of each row with `blend`.
///
/// # Safety
/// As [`Kernel::tile`]; `full(…)` is the kernel's full-tile store with the same contract for
/// a C of `width` contiguous columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn through_stack(
    height: usize,
    width: usize,
    alpha: f32,
    beta: f32,
    c: ViewMut,
    cols: usize,
    blend: fn(f32, f32, f32, f32) -> f32,
    full: impl FnOnce(ViewMut),
) {
    let mut edge = [0.0f32; 384];
    debug_assert!(height * width <= edge.len());
    full(ViewMut { ptr: edge.as_mut_ptr(), rs: width, cs: 1 });
    for i in 0..height {
        for j in 0..cols {
            // SAFETY: (i < height, j < cols) is an element of the tile (the contract).
            let p = unsafe { c.ptr.add(i * c.rs + j) };
            let v = edge[i * width + j];
            // SAFETY: as above.
            unsafe { *p = if beta == 0.0 { alpha * v } else { blend(alpha, v, beta, *p) } };
        }
    }
}

/// Plain Rust, auto-vectorised where the target allows: 6×16 tiles, no FMA.
pub(super) struct Portable;

impl Kernel for Portable {
    const MR: usize = 6;
    const NR: usize = 16;

    unsafe fn tile<A: Rows, B: Panel>(height: usize, panels: usize, kc: usize, a: A, b: B, alpha: f32, beta: f32, c: ViewMut, cols: usize) {
        // SAFETY: panel q < panels exists and its columns q·NR.. lie in the tile (the contract);
        // a panel past `cols` is not computed.
        unsafe {
            for q in 0..panels {
                let (bq, cq) = (b.next(q, 16), c.at(0, q * 16));
                let width = cols.saturating_sub(q * 16).min(16);
                if width == 0 {
                    break;
                }
                match height {
                    1 => portable_tile::<1, A, B>(kc, a, bq, alpha, beta, cq, width),
                    2 => portable_tile::<2, A, B>(kc, a, bq, alpha, beta, cq, width),
                    3 => portable_tile::<3, A, B>(kc, a, bq, alpha, beta, cq, width),
                    4 => portable_tile::<4, A, B>(kc, a, bq, alpha, beta, cq, width),
                    5 => portable_tile::<5, A, B>(kc, a, bq, alpha, beta, cq, width),
                    _ => portable_tile::<6, A, B>(kc, a, bq, alpha, beta, cq, width),
                }
            }
        }
    }

    fn blend(alpha: f32, v: f32, beta: f32, c: f32) -> f32 {
        alpha * v + beta * c
    }
}

/// One M×16 panel of [`Portable::tile`], its first `cols` columns stored.
///
/// # Safety
/// As [`Kernel::tile`] for one panel, `cols` ≤ 16.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn portable_tile<const M: usize, A: Rows, B: Panel>(kc: usize, a: A, b: B, alpha: f32, beta: f32, c: ViewMut, cols: usize) {
    let mut acc = [[0.0f32; 16]; M];
    for p in 0..kc {
        // SAFETY: column p < kc of the A panel and row p of the B panel (the contract).
        let (ap, lo, hi) = unsafe {
            let row = b.row(p, 16);
            (
                std::array::from_fn::<f32, M, _>(|i| *a.at(i, p, M)),
                std::slice::from_raw_parts(row, 8),
                std::slice::from_raw_parts(row.add(b.gap(16)), 8),
            )
        };
        for i in 0..M {
            for j in 0..8 {
                acc[i][j] += ap[i] * lo[j];
                acc[i][j + 8] += ap[i] * hi[j];
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, &v) in row.iter().enumerate().take(cols) {
            // SAFETY: (i, j < cols) is inside the tile `c` covers, ours alone (the contract).
            let p = unsafe { c.ptr.add(i * c.rs + j) };
            // SAFETY: as above.
            unsafe { *p = if beta == 0.0 { alpha * v } else { Portable::blend(alpha, v, beta, *p) } };
        }
    }
}
