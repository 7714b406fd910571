//! The blocked loop nest, written once for every kernel and every form of the operands.

use super::kernel::{panels_for, InPlace, Kernel, Packed, Panel, Runs, Shifted, ShiftedRuns};
use super::pack::{pack_a, pack_b, row_panels};
use super::packed::{AView, BView};
use super::{Product, View, ViewMut, KC, MC, NC};

/// The A operand: strided (packed here, block by block) or packed once.
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

// SAFETY: `Shifted`'s rows and offsets are slices borrowed for the whole product and only
// read; the other variants are Send and Sync themselves.
unsafe impl Send for BOp {}
// SAFETY: as above.
unsafe impl Sync for BOp {}

/// The product `p` on this thread: for each KC×NC block of B (packed into `scratch` unless it
/// was packed once), each MC×KC block of A likewise, the tiles of C.
///
/// # Safety
/// As [`Product::run`]: the operands cover m×k, k×n and m×n elements, C's distinct and ours
/// alone; `scratch` holds MC·KC + KC·NC values; `K` runs on this CPU and is the kernel a
/// packed operand was packed for.
pub(super) unsafe fn blocked<K: Kernel>(scratch: &mut [f32], p: &Product) {
    let (apack, bpack) = scratch.split_at_mut(MC * KC);
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
            // extent; bpack holds KC·NC values.
            unsafe {
                match p.b {
                    BOp::View(b) if p.m <= MC && b.cs == 1 && in_place_fits_l1(b.at(pc, jc).ptr as usize, kc, K::NR, b.rs) => {
                        in_place::<K>(apack, bpack, p, pc, kc, jc, nc, b, beta)
                    }
                    BOp::View(b) => {
                        pack_b(K::NR, kc, nc, b.at(pc, jc), bpack);
                        row_blocks::<K, _>(apack, p, pc, kc, jc, nc, Packed { ptr: bpack.as_ptr(), stride: kc * K::NR }, beta);
                    }
                    BOp::Packed(b) => {
                        let panels = Packed { ptr: b.block(K::NR, jc, pc), stride: kc * K::NR };
                        row_blocks::<K, _>(apack, p, pc, kc, jc, nc, panels, beta);
                    }
                    // one run (contiguous columns) with the plainer panel
                    BOp::Shifted { base, offsets, runs } if runs.width == runs.pitch || runs.n <= runs.width => {
                        let rows = Shifted { base: base.add(jc), offsets: offsets.add(pc) };
                        row_blocks::<K, _>(apack, p, pc, kc, jc, nc, rows, beta);
                    }
                    BOp::Shifted { base, offsets, runs } => {
                        let rows = ShiftedRuns::at(base, offsets.add(pc), runs, jc, K::NR);
                        row_blocks::<K, _>(apack, p, pc, kc, jc, nc, rows, beta);
                    }
                }
            }
        }
        jc += nc;
    }
}

/// Rows pc..pc + kc of the B block whose columns jc..jc + nc start at `b`, against each MC
/// block of A's rows; C ← α·A·B + β·C there.
///
/// # Safety
/// As [`blocked`], for that block; `b`'s panels hold its kc rows.
#[allow(clippy::too_many_arguments)]
unsafe fn row_blocks<K: Kernel, B: Panel>(apack: &mut [f32], p: &Product, pc: usize, kc: usize, jc: usize, nc: usize, b: B, beta: f32) {
    for ic in (0..p.m).step_by(MC) {
        let mc = MC.min(p.m - ic);
        // SAFETY: rows ic..ic + mc ≤ m, columns pc..pc + kc ≤ k of A; apack holds MC·KC;
        // (ic, jc) is an element of C.
        unsafe {
            let a = match p.a {
                AOp::View(a) => {
                    pack_a(K::MR, mc, kc, a.at(ic, pc), apack);
                    apack.as_ptr()
                }
                AOp::Packed(a) => a.block(ic, pc),
            };
            tiles::<K, B>(mc, nc, kc, a, b, p.alpha, beta, p.c.at(ic, jc));
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
    pc: usize,
    kc: usize,
    jc: usize,
    nc: usize,
    b: View,
    beta: f32,
) {
    debug_assert!(p.m <= MC && b.cs == 1);
    // SAFETY: rows 0..m, columns pc..pc + kc ≤ k of A (apack holds MC·KC); rows pc..pc + kc
    // and columns jc..jc + nc of B, the full panels' rows NR contiguous values each (cs = 1);
    // bpack holds KC·NC values; (0, jc) and (0, jc + full) are elements of C and each tile
    // lies inside m × nc from (0, jc).
    unsafe {
        let a = match p.a {
            AOp::View(a) => {
                pack_a(K::MR, p.m, kc, a.at(0, pc), apack);
                apack.as_ptr()
            }
            AOp::Packed(a) => a.block(0, pc),
        };
        let full = nc - nc % K::NR;
        if full > 0 {
            tiles::<K, _>(p.m, full, kc, a, InPlace { ptr: b.at(pc, jc).ptr, rs: b.rs }, p.alpha, beta, p.c.at(0, jc));
        }
        if full < nc {
            pack_b(K::NR, kc, nc - full, b.at(pc, jc + full), bpack);
            let panels = Packed { ptr: bpack.as_ptr(), stride: kc * K::NR };
            tiles::<K, _>(p.m, nc - full, kc, a, panels, p.alpha, beta, p.c.at(0, jc + full));
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

/// The tiles of an mc×nc block of C from a packed A block (row panels of `row_panels`) and
/// the B panels from `b`. A block of 4 rows or fewer is one panel, and spans several B panels
/// a tile ([`panels_for`]). Tiles of a C whose rows are not contiguous go through a stack
/// tile and are blended out one element at a time.
///
/// # Safety
/// As [`row_blocks`]: `a` holds mc·kc packed values, `c` covers mc×nc elements.
#[allow(clippy::too_many_arguments)]
unsafe fn tiles<K: Kernel, B: Panel>(mc: usize, nc: usize, kc: usize, a: *const f32, b: B, alpha: f32, beta: f32, c: ViewMut) {
    let wide = if mc <= 4 { panels_for(mc) } else { 1 };
    let panels_in_block = nc.div_ceil(K::NR);
    for q0 in (0..panels_in_block).step_by(wide) {
        let panels = wide.min(panels_in_block - q0);
        let j = q0 * K::NR;
        let cols = (nc - j).min(panels * K::NR);
        for (ir, height) in row_panels(K::MR, mc) {
            // The tile is rows ir..ir + height ≤ mc and columns j..j + cols ≤ nc of the block;
            // its A panel starts at ir·kc (the panels above hold ir rows of kc).
            // SAFETY: panel q0 exists; (ir, j) is an element of C; the tile lies in the block.
            unsafe {
                let (ap, bq, ct) = (a.add(ir * kc), b.next(q0, K::NR), c.at(ir, j));
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
    }
}
