//! The blocked loop nest, written once for every kernel and every form of the operands.

use super::kernel::{panels_for, InPlace, Kernel, Packed, PackedRows, Panel, Rows, RowsInPlace, Runs, Shifted, ShiftedRuns};
use super::pack::{pack_a, pack_b, row_panels};
use super::packed::{AView, BView};
use super::post::Post;
use super::{Product, View, ViewMut, KC, MC, NC};

/// The A operand: strided (read in place or packed here, block by block: [`ARead`]) or packed
/// once.
#[derive(Clone, Copy)]
pub(super) enum AOp {
    View(View),
    Packed(AView),
}

/// The B operand: strided (packed here), packed once, or rows read in place at offsets.
#[derive(Clone, Copy)]
pub(super) enum BOp {
    View(View),
    Packed(BView),
    /// Row p's column j at `base + offsets[p] + runs.at(j)`, each read reaching at most NR
    /// past its last run (see [`ShiftedRuns`]).
    Shifted {
        base: *const f32,
        offsets: *const usize,
        runs: Runs,
    },
}

/// How the nest reads A, decided once per product: a strided A's blocks read where they lie
/// where its rows are contiguous and a column of a tile's rows spreads over L1's sets
/// ([`column_fits_l1`]), else packed block by block; or packed once.
#[derive(Clone, Copy)]
enum ARead {
    InPlace(View),
    Pack(View),
    Packed(AView),
}

impl ARead {
    /// How `K`'s nest reads `a`, an operand of m×k.
    fn of<K: Kernel>(a: AOp, m: usize, k: usize) -> ARead {
        match a {
            AOp::View(a) if a.cs == 1 && column_fits_l1(K::MR.min(m), a.rs, k.min(KC) * K::NR) => ARead::InPlace(a),
            AOp::View(a) => ARead::Pack(a),
            AOp::Packed(a) => ARead::Packed(a),
        }
    }
}

// SAFETY: `Shifted`'s rows and offsets are slices borrowed for the whole product and only
// read; the other variants are Send and Sync themselves.
unsafe impl Send for BOp {}
// SAFETY: as above.
unsafe impl Sync for BOp {}

/// The product `p` on this thread: for each KC×NC block of B (packed into `scratch` unless it
/// was packed once), each MC×KC block of A likewise, the tiles of C; with the last block of
/// k, C then through `p`'s epilogue, if it has one ([`tiles`]).
///
/// # Safety
/// As [`Product::run`]: the operands cover m×k, k×n and m×n elements, C's distinct and ours
/// alone; `scratch` holds MC·KC + KC·NC values; `K` runs on this CPU and is the kernel a
/// packed operand was packed for.
pub(super) unsafe fn blocked<K: Kernel>(scratch: &mut [f32], p: &Product) {
    let (apack, bpack) = scratch.split_at_mut(MC * KC);
    let a = ARead::of::<K>(p.a, p.m, p.k);
    // Column blocks end where a packed B's blocks end: at multiples of NC from its column 0.
    let col0 = match p.b {
        BOp::Packed(b) => b.col0,
        _ => 0,
    };
    let mut jc = 0;
    while jc < p.n {
        let nc = (NC - (col0 + jc) % NC).min(p.n - jc);
        for pc in (0..p.k).step_by(KC) {
            let kc = KC.min(p.k - pc);
            let beta = if pc == 0 { p.beta } else { 1.0 };
            // SAFETY: rows pc..pc + kc ≤ k and columns jc..jc + nc ≤ n of B: inside its
            // extent; bpack holds KC·NC values; (0, jc) is an element of C.
            unsafe {
                let post = p.post.filter(|_| pc + kc == p.k).map(|post| post.at(0, jc));
                match p.b {
                    BOp::View(b) if p.m <= MC && b.cs == 1 && in_place_fits_l1(b.at(pc, jc).ptr as usize, kc, K::NR, b.rs) => {
                        in_place::<K>(apack, bpack, p, a, pc, kc, jc, nc, b, beta, post)
                    }
                    BOp::View(b) => {
                        pack_b(K::NR, kc, nc, b.at(pc, jc), bpack);
                        let panels = Packed { ptr: bpack.as_ptr(), stride: kc * K::NR };
                        row_blocks::<K, _>(apack, p, a, pc, kc, jc, nc, panels, beta, post);
                    }
                    BOp::Packed(b) => {
                        let panels = Packed { ptr: b.block(K::NR, jc, pc), stride: kc * K::NR };
                        row_blocks::<K, _>(apack, p, a, pc, kc, jc, nc, panels, beta, post);
                    }
                    // one run (contiguous columns) with the plainer panel
                    BOp::Shifted { base, offsets, runs } if runs.width == runs.pitch || runs.n <= runs.width => {
                        let rows = Shifted { base: base.add(jc), offsets: offsets.add(pc) };
                        row_blocks::<K, _>(apack, p, a, pc, kc, jc, nc, rows, beta, post);
                    }
                    BOp::Shifted { base, offsets, runs } => {
                        let rows = ShiftedRuns::at(base, offsets.add(pc), runs, jc, K::NR);
                        row_blocks::<K, _>(apack, p, a, pc, kc, jc, nc, rows, beta, post);
                    }
                }
            }
        }
        jc += nc;
    }
}

/// Rows pc..pc + kc of the B block whose columns jc..jc + nc start at `b`, against each MC
/// block of A's rows (A read as `a` says); C ← α·A·B + β·C there, then through `post` (at C's
/// element (0, jc)) where given.
///
/// # Safety
/// As [`blocked`], for that block; `b`'s panels hold its kc rows; `a` is `p`'s A.
#[allow(clippy::too_many_arguments)]
unsafe fn row_blocks<K: Kernel, B: Panel>(
    apack: &mut [f32],
    p: &Product,
    a: ARead,
    pc: usize,
    kc: usize,
    jc: usize,
    nc: usize,
    b: B,
    beta: f32,
    post: Option<Post>,
) {
    for ic in (0..p.m).step_by(MC) {
        let mc = MC.min(p.m - ic);
        // SAFETY: rows ic..ic + mc ≤ m, columns pc..pc + kc ≤ k of A; apack holds MC·KC;
        // (ic, jc) is an element of C.
        unsafe {
            let (c, post) = (p.c.at(ic, jc), post.map(|post| post.at(ic, 0)));
            match a {
                ARead::InPlace(a) => {
                    let rows = RowsInPlace { ptr: a.at(ic, pc).ptr, rs: a.rs };
                    tiles::<K, _, B>(mc, nc, kc, rows, b, p.alpha, beta, c, post)
                }
                ARead::Pack(a) => {
                    pack_a(K::MR, mc, kc, a.at(ic, pc), apack);
                    tiles::<K, _, B>(mc, nc, kc, PackedRows { ptr: apack.as_ptr() }, b, p.alpha, beta, c, post)
                }
                ARead::Packed(a) => tiles::<K, _, B>(mc, nc, kc, PackedRows { ptr: a.block(ic, pc) }, b, p.alpha, beta, c, post),
            }
        }
    }
}

/// As [`row_blocks`] for m ≤ MC (one block of A's rows) and B's rows contiguous: the full
/// panels read where they lie, the last (narrower) one packed. With one block of rows each
/// B panel serves a single sweep down them, which packing would precede with a pass of its
/// own over the block (written out to L2 and read back).
///
/// # Safety
/// As [`row_blocks`], for `b` the strided B with cs = 1; m ≤ MC; bpack holds KC·NC values.
#[allow(clippy::too_many_arguments)]
unsafe fn in_place<K: Kernel>(
    apack: &mut [f32],
    bpack: &mut [f32],
    p: &Product,
    a: ARead,
    pc: usize,
    kc: usize,
    jc: usize,
    nc: usize,
    b: View,
    beta: f32,
    post: Option<Post>,
) {
    debug_assert!(p.m <= MC && b.cs == 1);
    // SAFETY: rows 0..m, columns pc..pc + kc ≤ k of A; apack holds MC·KC values.
    unsafe {
        match a {
            ARead::InPlace(a) => {
                let rows = RowsInPlace { ptr: a.at(0, pc).ptr, rs: a.rs };
                in_place_tiles::<K, _>(bpack, p, pc, kc, jc, nc, b, beta, rows, post)
            }
            ARead::Pack(a) => {
                pack_a(K::MR, p.m, kc, a.at(0, pc), apack);
                in_place_tiles::<K, _>(bpack, p, pc, kc, jc, nc, b, beta, PackedRows { ptr: apack.as_ptr() }, post)
            }
            ARead::Packed(a) => in_place_tiles::<K, _>(bpack, p, pc, kc, jc, nc, b, beta, PackedRows { ptr: a.block(0, pc) }, post),
        }
    }
}

/// The tiles of [`in_place`] from `a`, A's block of rows 0..m and columns pc..pc + kc.
///
/// # Safety
/// As [`in_place`]; `a` is that block.
#[allow(clippy::too_many_arguments)]
unsafe fn in_place_tiles<K: Kernel, A: Rows>(
    bpack: &mut [f32],
    p: &Product,
    pc: usize,
    kc: usize,
    jc: usize,
    nc: usize,
    b: View,
    beta: f32,
    a: A,
    post: Option<Post>,
) {
    // SAFETY: rows pc..pc + kc and columns jc..jc + nc of B, the full panels' rows NR
    // contiguous values each (cs = 1); bpack holds KC·NC values; (0, jc) and (0, jc + full)
    // are elements of C and each tile lies inside m × nc from (0, jc).
    unsafe {
        let full = nc - nc % K::NR;
        if full > 0 {
            let panels = InPlace { ptr: b.at(pc, jc).ptr, rs: b.rs };
            tiles::<K, _, _>(p.m, full, kc, a, panels, p.alpha, beta, p.c.at(0, jc), post);
        }
        if full < nc {
            pack_b(K::NR, kc, nc - full, b.at(pc, jc + full), bpack);
            let panels = Packed { ptr: bpack.as_ptr(), stride: kc * K::NR };
            let post = post.map(|post| post.at(0, full));
            tiles::<K, _, _>(p.m, nc - full, kc, a, panels, p.alpha, beta, p.c.at(0, jc + full), post);
        }
    }
}

/// Sets of an L1 data cache: 64 on every x86 core (virtually indexed by the 4 KiB page
/// offset, lines of 64 bytes).
const L1_SETS: usize = 64;
/// Ways of each set: 8 on the cores with the fewest (12 on some newer ones).
const L1_WAYS: usize = 8;

/// Whether the kc rows of a B panel, nr values each, `rs` values apart from address `first`,
/// stay in L1 while the row panels sweep past it: no set holds more than L1_WAYS − 1 of their
/// lines, so that the A panels and C's tiles streaming past find a way in every set without
/// evicting the panel (which would then come back from L2 on every sweep). A stride of a
/// multiple of 256 values puts every row in the same few sets, where the packed panel,
/// contiguous, spreads over all of them; a long panel (kc·nr values near L1's size) fills
/// every set. Panels further right lie whole lines further on and fill the same pattern of
/// sets.
pub(super) fn in_place_fits_l1(first: usize, kc: usize, nr: usize, rs: usize) -> bool {
    let mut lines = [0usize; L1_SETS];
    for p in 0..kc {
        let row = first.wrapping_add(p.wrapping_mul(rs).wrapping_mul(size_of::<f32>()));
        let (first_line, last_line) = (row / 64, row.wrapping_add(nr * size_of::<f32>() - 1) / 64);
        for line in first_line..=last_line {
            let set = &mut lines[line % L1_SETS];
            *set += 1;
            if *set >= L1_WAYS {
                return false;
            }
        }
    }
    true
}

/// Whether the lines that hold one column of `rows` rows, `rs` values apart, fit beside a
/// B panel of `panel` contiguous values in every L1 set, whatever the column, with a way to
/// spare for C and the streams. A tile read in place keeps those lines, one per row, in L1
/// while it sweeps a line's 16 columns, and the B panel stays in L1 while it serves the row
/// panels, spread evenly over the sets (unless it fills L1 by itself: AVX-512's of 32 KiB,
/// read from L2 whatever A does). Rows a multiple of 1024 values apart (4 KiB) fall in one
/// set, where they evict the panel's lines, or each other; a packed A's rows are one
/// contiguous run. Rows a multiple of 16 values apart start their lines together, so one
/// column tells; else each of a line's 16 columns is tried.
pub(super) fn column_fits_l1(rows: usize, rs: usize, panel: usize) -> bool {
    let panel_lines = (panel * size_of::<f32>()).div_ceil(L1_SETS * 64);
    let taken = if panel_lines < L1_WAYS { panel_lines } else { 0 };
    if rows + taken < L1_WAYS {
        return true;
    }
    // Row i's value in column p lies i·stride + 4p bytes past the first row's line start,
    // modulo the 4 KiB that the sets span.
    let stride = rs % (L1_SETS * 16) * size_of::<f32>();
    let columns = if stride.is_multiple_of(64) { 1 } else { 16 };
    (0..columns).all(|p| {
        let (mut lines, mut last) = ([0usize; L1_SETS], usize::MAX);
        (0..rows).all(|i| {
            let line = (i * stride + p * size_of::<f32>()) / 64;
            // rows under 16 values apart (stride unreduced) share lines
            if rs < 16 && line == last {
                return true;
            }
            last = line;
            let set = &mut lines[line % L1_SETS];
            *set += 1;
            *set + taken < L1_WAYS
        })
    })
}

/// The tiles of an mc×nc block of C from an A block (in the row panels of `row_panels`) and
/// the B panels from `b`. A block of 4 rows or fewer is one panel, and spans several B panels
/// a tile ([`panels_for`]). Tiles of a C whose rows are not contiguous go through a stack
/// tile and are blended out one element at a time. With `post` (at the block's element (0, 0)),
/// the block then goes through it while it is in L1: whole where it holds at most
/// [`POST_VALUES`], else a column of tiles at a time (the block's rows, a B panel's columns or
/// those of the few a tile spans); a call for as many values as stay in L1, so that its cost is
/// spread over all of them.
///
/// # Safety
/// As [`row_blocks`]: `a` is a block of mc rows of kc values, `c` covers mc×nc elements; with
/// `post`, C's rows are contiguous (cs = 1).
#[allow(clippy::too_many_arguments)]
unsafe fn tiles<K: Kernel, A: Rows, B: Panel>(
    mc: usize,
    nc: usize,
    kc: usize,
    a: A,
    b: B,
    alpha: f32,
    beta: f32,
    c: ViewMut,
    post: Option<Post>,
) {
    debug_assert!(post.is_none() || c.cs == 1);
    let wide = if mc <= 4 { panels_for(mc) } else { 1 };
    let panels_in_block = nc.div_ceil(K::NR);
    for q0 in (0..panels_in_block).step_by(wide) {
        let panels = wide.min(panels_in_block - q0);
        let j = q0 * K::NR;
        let cols = (nc - j).min(panels * K::NR);
        for (ir, height) in row_panels(K::MR, mc) {
            // The tile is rows ir..ir + height ≤ mc and columns j..j + cols ≤ nc of the block.
            // SAFETY: panel q0 exists; (ir, j) is an element of C; the tile lies in the block.
            unsafe {
                let (ap, bq, ct) = (a.down(ir, kc), b.next(q0, K::NR), c.at(ir, j));
                if c.cs == 1 {
                    K::tile(height, panels, kc, ap, bq, alpha, beta, ct, cols);
                } else {
                    let mut edge = [0.0f32; 384];
                    let width = panels * K::NR;
                    debug_assert!(height * width <= edge.len());
                    K::tile(height, panels, kc, ap, bq, 1.0, 0.0, ViewMut { ptr: edge.as_mut_ptr(), rs: width, cs: 1 }, width);
                    for i in 0..height {
                        for jj in 0..cols {
                            let out = ct.ptr.add(i * ct.rs + jj * ct.cs);
                            let v = edge[i * width + jj];
                            *out = if beta == 0.0 { alpha * v } else { K::blend(alpha, v, beta, *out) };
                        }
                    }
                }
            }
        }
        if let Some(post) = post.filter(|_| mc * nc > POST_VALUES) {
            // SAFETY: columns j..j + cols of the block's mc rows, just computed (C's rows
            // contiguous: the contract).
            unsafe { post.at(0, j).apply(mc, cols, c.at(0, j)) };
        }
    }
    if let Some(post) = post.filter(|_| mc * nc <= POST_VALUES) {
        // SAFETY: the block, just computed (C's rows contiguous: the contract).
        unsafe { post.apply(mc, nc, c) };
    }
}

/// Values of C a block may hold to go through its epilogue whole (16 KiB, half of L1): a
/// blocking size, as KC, MC and NC are.
const POST_VALUES: usize = 4096;
