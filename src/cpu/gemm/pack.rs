//! Packing: A into MR-tall row panels and B into NR-wide column panels, each stored k-major,
//! so that the micro-kernel reads both as contiguous streams.

use super::{View, MR, NR};

/// Row panels of an mc-row block as (first row, rows, packed height). Panels are MR tall;
/// a remainder of 4 rows, or of 2 (taken with the last full panel as 4 + 4), gets 4-tall
/// panels that the kernel runs at full width, so power-of-two batches waste no lanes.
pub(super) fn row_panels(mc: usize) -> impl Iterator<Item = (usize, usize, usize)> {
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

/// Packs A (mc×kc) into the panels of `row_panels`, column by column, zero-padding a short
/// last panel to its packed height.
pub(super) unsafe fn pack_a(mc: usize, kc: usize, a: View, out: &mut [f32]) {
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
pub(super) unsafe fn pack_b(kc: usize, nc: usize, b: View, out: &mut [f32]) {
    let mut done = 0;
    if b.cs == 1 {
        done = nc / NR;
        unsafe { pack_b_by_rows(kc, done, b, out) };
    }
    for (panel, j0) in (0..nc).step_by(NR).enumerate().skip(done) {
        let cols = NR.min(nc - j0);
        let dst = &mut out[panel * NR * kc..][..NR * kc];
        if b.rs == 1 && cols == NR {
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

/// Rows of B packed together (see `pack_b_by_rows`).
const PACK_ROWS: usize = 8;

/// The first `panels` full panels of row-major B (X in dW = dZᵀ·X, B in 1024³), PACK_ROWS rows
/// at a time across all panels: B is read in address order, each line once, where packing a
/// panel at a time walks down columns, a row stride apart (one L1 set when the stride is 4 KiB)
/// and reads every line twice when rows are not 64-byte aligned.
unsafe fn pack_b_by_rows(kc: usize, panels: usize, b: View, out: &mut [f32]) {
    for p0 in (0..kc).step_by(PACK_ROWS) {
        let rows = PACK_ROWS.min(kc - p0);
        for panel in 0..panels {
            let dst = &mut out[panel * NR * kc + p0 * NR..][..rows * NR];
            for (r, d) in dst.chunks_exact_mut(NR).enumerate() {
                d.copy_from_slice(unsafe { std::slice::from_raw_parts(b.ptr.add((p0 + r) * b.rs + panel * NR), NR) });
            }
        }
    }
}
