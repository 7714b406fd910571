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
///
/// # Safety
/// `a` covers mc×kc elements.
pub(super) unsafe fn pack_a(mc: usize, kc: usize, a: View, out: &mut [f32]) {
    // Each panel reads rows i0..i0 + rows ≤ mc, columns 0..kc of A: inside the contract; `dst`
    // is a checked slice of `out`.
    for (i0, rows, height) in row_panels(mc) {
        let dst = &mut out[i0 * kc..][..height * kc];
        if a.cs == 1 && rows == height {
            // A stored by rows (X in X·Wᵀ): a transpose of `height` rows
            // SAFETY: `height` rows of kc contiguous values from row i0; dst holds kc runs of
            // `height`.
            unsafe { transpose(height, kc, a.ptr.add(i0 * a.rs), a.rs, dst.as_mut_ptr(), height) };
        } else if a.rs == 1 && rows == height {
            // A stored by columns (dZᵀ in dW = dZᵀ·X): each k is `height` contiguous values
            // SAFETY: element (i0, 0) of A.
            let src = unsafe { a.ptr.add(i0) };
            match height {
                // SAFETY: kc runs of `height` contiguous values (rs = 1), a.cs apart.
                MR => unsafe { copy_runs::<MR>(src, a.cs, dst) },
                // SAFETY: as above.
                _ => unsafe { copy_runs::<4>(src, a.cs, dst) },
            }
        } else {
            // SAFETY: `rows` lanes of kc values from row i0, with A's strides.
            unsafe { pack_lanes(height, rows, kc, a.ptr.add(i0 * a.rs), a.rs, a.cs, dst) };
        }
    }
}

/// dst's runs of H ← H values at src, src + stride, … (H known at compile time: a run of a
/// length known only at run time is a call to memcpy, ~10x the cost of the 24-byte copy).
///
/// # Safety
/// `src` covers dst.len() / H runs of H values `stride` apart.
unsafe fn copy_runs<const H: usize>(src: *const f32, stride: usize, dst: &mut [f32]) {
    for (p, out) in dst.chunks_exact_mut(H).enumerate() {
        // SAFETY: run p < dst.len() / H (the contract).
        out.copy_from_slice(unsafe { std::slice::from_raw_parts(src.add(p * stride), H) });
    }
}

/// Packs B (kc×nc) into NR-wide panels, row by row, zero-padding the last panel.
///
/// # Safety
/// `b` covers kc×nc elements.
pub(super) unsafe fn pack_b(kc: usize, nc: usize, b: View, out: &mut [f32]) {
    let mut done = 0;
    if b.cs == 1 {
        done = nc / NR;
        // SAFETY: the first nc / NR full panels of kc rows, contiguous (cs = 1).
        unsafe { pack_b_by_rows(kc, done, b, out) };
    }
    for (panel, j0) in (0..nc).step_by(NR).enumerate().skip(done) {
        let cols = NR.min(nc - j0);
        let dst = &mut out[panel * NR * kc..][..NR * kc];
        if b.rs == 1 && cols == NR {
            // B stored by columns (Wᵀ in X·Wᵀ): transposes of 8 columns into each half
            for half in [0, NR / 2] {
                // SAFETY: columns j0 + half + 0..8 < nc, each kc contiguous values (rs = 1);
                // dst[half..] holds kc runs NR apart.
                unsafe { transpose(NR / 2, kc, b.ptr.add((j0 + half) * b.cs), b.cs, dst[half..].as_mut_ptr(), NR) };
            }
        } else {
            // SAFETY: `cols` columns from j0 (j0 + cols ≤ nc) of kc values, with B's strides.
            unsafe { pack_lanes(NR, cols, kc, b.ptr.add(j0 * b.cs), b.cs, b.rs, dst) };
        }
    }
}

/// The general packing of one panel, for layouts the fast paths above do not take: `width`
/// lanes (rows of A, or columns of B) of kc values each, k-major (dst[p·width + l]), lanes from
/// `lanes` on zero. Value p of lane l is at src + l·lane_stride + p·k_stride.
///
/// # Safety
/// `src` covers `lanes` lanes of kc values with those strides; dst holds width·kc values.
unsafe fn pack_lanes(width: usize, lanes: usize, kc: usize, src: *const f32, lane_stride: usize, k_stride: usize, dst: &mut [f32]) {
    if k_stride == 1 {
        for l in 0..width {
            if l < lanes {
                // SAFETY: lane l < lanes, kc contiguous values (k_stride = 1).
                let run = unsafe { std::slice::from_raw_parts(src.add(l * lane_stride), kc) };
                for (p, &v) in run.iter().enumerate() {
                    dst[p * width + l] = v;
                }
            } else {
                (0..kc).for_each(|p| dst[p * width + l] = 0.0);
            }
        }
    } else {
        for p in 0..kc {
            for l in 0..width {
                // SAFETY: value p < kc of lane l < lanes.
                dst[p * width + l] = if l < lanes { unsafe { *src.add(l * lane_stride + p * k_stride) } } else { 0.0 };
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
///
/// # Safety
/// `b` covers kc rows of panels·NR contiguous values (cs = 1).
unsafe fn pack_b_by_rows(kc: usize, panels: usize, b: View, out: &mut [f32]) {
    for p0 in (0..kc).step_by(PACK_ROWS) {
        let rows = PACK_ROWS.min(kc - p0);
        for panel in 0..panels {
            let dst = &mut out[panel * NR * kc + p0 * NR..][..rows * NR];
            for (r, d) in dst.chunks_exact_mut(NR).enumerate() {
                // SAFETY: row p0 + r < kc, columns panel·NR.. + NR ≤ panels·NR (the contract).
                d.copy_from_slice(unsafe { std::slice::from_raw_parts(b.ptr.add((p0 + r) * b.rs + panel * NR), NR) });
            }
        }
    }
}

/// dst[p·dst_stride + i] = src[i·stride + p] for i < h, p < kc: h strided rows (h ≤ 8) become
/// kc runs of h values.
///
/// # Safety
/// `src` covers h rows of kc values `stride` apart; `dst` covers kc runs `dst_stride ≥ h` apart.
unsafe fn transpose(h: usize, kc: usize, src: *const f32, stride: usize, dst: *mut f32, dst_stride: usize) {
    debug_assert!(h <= 8 && h <= dst_stride);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx2_fma() {
        // SAFETY: as this function's contract; AVX2 was detected.
        let done = unsafe { transpose_avx2(h, kc, src, stride, dst, dst_stride) };
        // SAFETY: the remaining columns lie inside the same extents.
        return unsafe { transpose_scalar(h, done..kc, src, stride, dst, dst_stride) };
    }
    // SAFETY: this function's contract.
    unsafe { transpose_scalar(h, 0..kc, src, stride, dst, dst_stride) }
}

/// `transpose` for the columns in `cols`, one value at a time.
///
/// # Safety
/// As [`transpose`], for columns `cols` (inside 0..kc).
unsafe fn transpose_scalar(h: usize, cols: std::ops::Range<usize>, src: *const f32, stride: usize, dst: *mut f32, dst_stride: usize) {
    for p in cols {
        for i in 0..h {
            // SAFETY: row i < h, column p < kc of src; run p, place i < dst_stride of dst.
            unsafe { *dst.add(p * dst_stride + i) = *src.add(i * stride + p) };
        }
    }
}

/// `transpose` 8 columns at a time (8×8 register transposes, rows past h read as zero and
/// not stored); returns how many columns it did (kc rounded down to 8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_avx2(h: usize, kc: usize, src: *const f32, stride: usize, dst: *mut f32, dst_stride: usize) -> usize {
    use std::arch::x86_64::*;
    let mut p0 = 0;
    while p0 + 8 <= kc {
        let mut r = [_mm256_setzero_ps(); 8];
        for (i, v) in r.iter_mut().enumerate().take(h) {
            // SAFETY: row i < h, columns p0..p0 + 8 ≤ kc.
            *v = unsafe { _mm256_loadu_ps(src.add(i * stride + p0)) };
            // the rows are separate short streams: fetch 4 lines ahead (never faults)
            _mm_prefetch::<_MM_HINT_T0>(src.wrapping_add(i * stride + p0 + 64) as *const i8);
        }
        // (a b) pairs, then quads, then halves: column p of the 8×8 block ends in c[p]
        let t = [
            _mm256_unpacklo_ps(r[0], r[1]),
            _mm256_unpackhi_ps(r[0], r[1]),
            _mm256_unpacklo_ps(r[2], r[3]),
            _mm256_unpackhi_ps(r[2], r[3]),
            _mm256_unpacklo_ps(r[4], r[5]),
            _mm256_unpackhi_ps(r[4], r[5]),
            _mm256_unpacklo_ps(r[6], r[7]),
            _mm256_unpackhi_ps(r[6], r[7]),
        ];
        let q = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        let c = [
            _mm256_permute2f128_ps::<0x20>(q[0], q[4]),
            _mm256_permute2f128_ps::<0x20>(q[1], q[5]),
            _mm256_permute2f128_ps::<0x20>(q[2], q[6]),
            _mm256_permute2f128_ps::<0x20>(q[3], q[7]),
            _mm256_permute2f128_ps::<0x31>(q[0], q[4]),
            _mm256_permute2f128_ps::<0x31>(q[1], q[5]),
            _mm256_permute2f128_ps::<0x31>(q[2], q[6]),
            _mm256_permute2f128_ps::<0x31>(q[3], q[7]),
        ];
        for (p, &v) in c.iter().enumerate() {
            // SAFETY: run p0 + p < kc, h ≤ dst_stride values.
            unsafe {
                let out = dst.add((p0 + p) * dst_stride);
                match h {
                    8 => _mm256_storeu_ps(out, v),
                    4 => _mm_storeu_ps(out, _mm256_castps256_ps128(v)),
                    6 => {
                        _mm_storeu_ps(out, _mm256_castps256_ps128(v));
                        _mm_storel_epi64(out.add(4) as *mut __m128i, _mm_castps_si128(_mm256_extractf128_ps::<1>(v)));
                    }
                    _ => {
                        let mut lanes = [0.0f32; 8];
                        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                        std::ptr::copy_nonoverlapping(lanes.as_ptr(), out, h);
                    }
                }
            }
        }
        p0 += 8;
    }
    p0
}
