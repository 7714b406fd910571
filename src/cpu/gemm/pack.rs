//! Packing: A into row panels at most MR tall and B into NR-wide column panels, each stored
//! k-major, so that the micro-kernel reads both as contiguous streams.

use super::View;

/// Row panels of an mc-row block as (first row, height): ⌈mc / MR⌉ panels of near-equal
/// height (differing by at most one), so a remainder never leaves a thin panel whose tile
/// shares each load of B between few rows (64 rows in 12-row panels: 4 of 11 and 2 of 10).
pub(super) fn row_panels(mr: usize, mc: usize) -> impl Iterator<Item = (usize, usize)> {
    let panels = mc.div_ceil(mr);
    let (base, extra) = (mc.checked_div(panels).unwrap_or(0), mc.checked_rem(panels).unwrap_or(0));
    (0..panels).map(move |p| (p * base + p.min(extra), base + usize::from(p < extra)))
}

/// Packs A (mc×kc) into the panels of `row_panels`: panel (i0, h) is kc runs of h values
/// (column p of its rows) from out[i0·kc].
///
/// # Safety
/// `a` covers mc×kc elements; `out` holds mc·kc values.
pub(super) unsafe fn pack_a(mr: usize, mc: usize, kc: usize, a: View, out: &mut [f32]) {
    // Each panel reads rows i0..i0 + h ≤ mc, columns 0..kc of A: inside the contract; `dst`
    // is a checked slice of `out`.
    for (i0, h) in row_panels(mr, mc) {
        let dst = &mut out[i0 * kc..][..h * kc];
        // SAFETY: element (i0, 0) of A.
        let src = unsafe { a.ptr.add(i0 * a.rs) };
        if a.cs == 1 && h == 1 {
            // a single row (batch 1): a copy
            // SAFETY: row i0, kc contiguous values (cs = 1).
            dst.copy_from_slice(unsafe { std::slice::from_raw_parts(src, kc) });
        } else if a.cs == 1 {
            // A stored by rows (X in X·Wᵀ): transposes of up to 8 rows at a time
            for r0 in (0..h).step_by(8) {
                // SAFETY: rows r0..r0 + min(8, h − r0) of the panel, kc contiguous values each;
                // dst[r0..] holds kc runs h apart.
                unsafe { transpose((h - r0).min(8), kc, src.add(r0 * a.rs), a.rs, dst[r0..].as_mut_ptr(), h) };
            }
        } else if a.rs == 1 {
            // A stored by columns (dZᵀ in dW = dZᵀ·X): each k is h contiguous values
            // SAFETY: kc runs of h contiguous values (rs = 1), a.cs apart.
            unsafe { copy_runs(h, src, a.cs, dst) };
        } else {
            // SAFETY: h lanes of kc values from row i0, with A's strides.
            unsafe { pack_lanes(h, h, kc, src, a.rs, a.cs, dst) };
        }
    }
}

/// dst's runs of h ← h values at src, src + stride, …, for h ≤ 12 (h a constant in each
/// copy: a run of a length known only at run time is a call to memcpy, ~10x the cost).
///
/// # Safety
/// `src` covers dst.len() / h runs of h values `stride` apart.
unsafe fn copy_runs(h: usize, src: *const f32, stride: usize, dst: &mut [f32]) {
    /// # Safety
    /// As `copy_runs` with h = H.
    unsafe fn runs<const H: usize>(src: *const f32, stride: usize, dst: &mut [f32]) {
        for (p, out) in dst.chunks_exact_mut(H).enumerate() {
            // SAFETY: run p < dst.len() / H (the contract).
            out.copy_from_slice(unsafe { std::slice::from_raw_parts(src.add(p * stride), H) });
        }
    }
    // SAFETY: the contract, for the H matching h.
    unsafe {
        match h {
            1 => runs::<1>(src, stride, dst),
            2 => runs::<2>(src, stride, dst),
            3 => runs::<3>(src, stride, dst),
            4 => runs::<4>(src, stride, dst),
            5 => runs::<5>(src, stride, dst),
            6 => runs::<6>(src, stride, dst),
            7 => runs::<7>(src, stride, dst),
            8 => runs::<8>(src, stride, dst),
            9 => runs::<9>(src, stride, dst),
            10 => runs::<10>(src, stride, dst),
            11 => runs::<11>(src, stride, dst),
            12 => runs::<12>(src, stride, dst),
            _ => unreachable!("panels are at most 12 rows tall"),
        }
    }
}

/// Packs B (kc×nc) into NR-wide panels, row by row, zero-padding the last panel; `out` holds
/// kc·⌈nc / NR⌉·NR values.
///
/// # Safety
/// `b` covers kc×nc elements; nr is a multiple of 8.
pub(super) unsafe fn pack_b(nr: usize, kc: usize, nc: usize, b: View, out: &mut [f32]) {
    if b.cs == 1 {
        // SAFETY: kc rows of nc contiguous values (cs = 1).
        return unsafe { pack_b_by_rows(nr, kc, nc, b, out) };
    }
    for (panel, j0) in (0..nc).step_by(nr).enumerate() {
        let cols = nr.min(nc - j0);
        let dst = &mut out[panel * nr * kc..][..nr * kc];
        if b.rs == 1 && cols == nr {
            // B stored by columns (Wᵀ in X·Wᵀ): transposes of 8 columns into each eighth
            for part in (0..nr).step_by(8) {
                // SAFETY: columns j0 + part + 0..8 < nc, each kc contiguous values (rs = 1);
                // dst[part..] holds kc runs nr apart.
                unsafe { transpose(8, kc, b.ptr.add((j0 + part) * b.cs), b.cs, dst[part..].as_mut_ptr(), nr) };
            }
        } else if b.rs == 1 {
            // the last panel, narrower: the same transposes of up to 8 columns, then zeros
            for part in (0..cols).step_by(8) {
                // SAFETY: columns j0 + part + 0..min(8, cols − part) < nc, each kc contiguous
                // values; dst[part..] holds kc runs nr apart.
                unsafe { transpose((cols - part).min(8), kc, b.ptr.add((j0 + part) * b.cs), b.cs, dst[part..].as_mut_ptr(), nr) };
            }
            dst.chunks_exact_mut(nr).for_each(|run| run[cols..].fill(0.0));
        } else {
            // SAFETY: `cols` columns from j0 (j0 + cols ≤ nc) of kc values, with B's strides.
            unsafe { pack_lanes(nr, cols, kc, b.ptr.add(j0 * b.cs), b.cs, b.rs, dst) };
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

/// The panels of row-major B (X in dW = dZᵀ·X, B in 1024³), the last zero-padded, PACK_ROWS
/// rows at a time across all panels: B is read in address order, each line once, where packing
/// a panel at a time walks down columns, a row stride apart (one L1 set when the stride is
/// 4 KiB) and reads every line twice when rows are not 64-byte aligned.
///
/// # Safety
/// `b` covers kc rows of nc contiguous values (cs = 1); nr is a multiple of 8.
unsafe fn pack_b_by_rows(nr: usize, kc: usize, nc: usize, b: View, out: &mut [f32]) {
    for p0 in (0..kc).step_by(PACK_ROWS) {
        let rows = PACK_ROWS.min(kc - p0);
        for (panel, j0) in (0..nc).step_by(nr).enumerate() {
            let dst = &mut out[panel * nr * kc + p0 * nr..][..rows * nr];
            for (r, d) in dst.chunks_exact_mut(nr).enumerate() {
                // SAFETY: row p0 + r < kc, columns j0..j0 + min(nr, nc − j0) ≤ nc (the contract).
                let src = unsafe { std::slice::from_raw_parts(b.ptr.add((p0 + r) * b.rs + j0), nr.min(nc - j0)) };
                copy_padded(src, d);
            }
        }
    }
}

/// dst ← src, then zeros: in runs of 8 values, a length known when compiled (a copy of a
/// length known only at run time is a call to memcpy, which costs more than a panel row of
/// 16 or 32 values).
fn copy_padded(src: &[f32], dst: &mut [f32]) {
    let (runs, tail) = src.as_chunks::<8>();
    let (dst_runs, _) = dst.as_chunks_mut::<8>();
    for (d, s) in dst_runs.iter_mut().zip(runs) {
        *d = *s;
    }
    let rest = &mut dst[runs.len() * 8..];
    let (head, zeros) = rest.split_at_mut(tail.len());
    for (d, &s) in head.iter_mut().zip(tail) {
        *d = s;
    }
    zeros.fill(0.0);
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
        // SAFETY: as this function's contract, for the H matching h; AVX2 was detected.
        let done = unsafe {
            match h {
                1 => transpose_avx2::<1>(kc, src, stride, dst, dst_stride),
                2 => transpose_avx2::<2>(kc, src, stride, dst, dst_stride),
                3 => transpose_avx2::<3>(kc, src, stride, dst, dst_stride),
                4 => transpose_avx2::<4>(kc, src, stride, dst, dst_stride),
                5 => transpose_avx2::<5>(kc, src, stride, dst, dst_stride),
                6 => transpose_avx2::<6>(kc, src, stride, dst, dst_stride),
                7 => transpose_avx2::<7>(kc, src, stride, dst, dst_stride),
                _ => transpose_avx2::<8>(kc, src, stride, dst, dst_stride),
            }
        };
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

/// The 8×8 block whose rows are `r`, transposed: element p of result i is element i of r[p].
/// (a b) pairs of rows interleaved, then pairs of pairs, then the 128-bit halves exchanged.
///
/// # Safety
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline]
pub(crate) unsafe fn transpose8x8(r: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
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
    [
        _mm256_permute2f128_ps::<0x20>(q[0], q[4]),
        _mm256_permute2f128_ps::<0x20>(q[1], q[5]),
        _mm256_permute2f128_ps::<0x20>(q[2], q[6]),
        _mm256_permute2f128_ps::<0x20>(q[3], q[7]),
        _mm256_permute2f128_ps::<0x31>(q[0], q[4]),
        _mm256_permute2f128_ps::<0x31>(q[1], q[5]),
        _mm256_permute2f128_ps::<0x31>(q[2], q[6]),
        _mm256_permute2f128_ps::<0x31>(q[3], q[7]),
    ]
}

/// `transpose` of H rows, 8 columns at a time (8×8 register transposes, rows past H read as
/// zero and not stored); returns how many columns it did (kc rounded down to 8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_avx2<const H: usize>(kc: usize, src: *const f32, stride: usize, dst: *mut f32, dst_stride: usize) -> usize {
    use std::arch::x86_64::*;
    let mut p0 = 0;
    while p0 + 8 <= kc {
        let mut r = [_mm256_setzero_ps(); 8];
        for (i, v) in r.iter_mut().enumerate().take(H) {
            // SAFETY: row i < h, columns p0..p0 + 8 ≤ kc.
            *v = unsafe { _mm256_loadu_ps(src.add(i * stride + p0)) };
            // the rows are separate short streams: fetch 4 lines ahead (never faults)
            _mm_prefetch::<_MM_HINT_T0>(src.wrapping_add(i * stride + p0 + 64) as *const i8);
        }
        // SAFETY: this function enables AVX2, a superset of what transpose8x8 needs.
        let c = unsafe { transpose8x8(r) };
        for (p, &v) in c.iter().enumerate() {
            // SAFETY: run p0 + p < kc, h ≤ dst_stride values.
            unsafe {
                let out = dst.add((p0 + p) * dst_stride);
                if H == 8 {
                    _mm256_storeu_ps(out, v);
                } else {
                    store_lanes(out, _mm256_castps256_ps128(v), H.min(4));
                    store_lanes(out.add(4), _mm256_extractf128_ps::<1>(v), H.saturating_sub(4));
                }
            }
        }
        p0 += 8;
    }
    p0
}

/// out[..n] ← the first n ≤ 4 lanes of v, in plain stores (a store of a run-time count of
/// values would be a call to memcpy; masked stores are slow on AMD cores).
///
/// # Safety
/// `out` covers n values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store_lanes(out: *mut f32, v: std::arch::x86_64::__m128, n: usize) {
    use std::arch::x86_64::*;
    // SAFETY: each store writes lanes < n of `out`.
    unsafe {
        match n {
            4 => _mm_storeu_ps(out, v),
            2 | 3 => {
                _mm_storel_epi64(out as *mut __m128i, _mm_castps_si128(v));
                if n == 3 {
                    _mm_store_ss(out.add(2), _mm_movehl_ps(v, v));
                }
            }
            1 => _mm_store_ss(out, v),
            _ => {}
        }
    }
}
