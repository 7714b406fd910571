//! C (m×n) ← A (m×k)·Bᵀ (+ C), with the rows of A and of B (n×k) contiguous: every element of
//! C is the dot product of a row of A and a row of B.
//!
//! This is a convolution's weight gradient, dW (OC × CKK) += dZ_s (OC × OHW)·col_sᵀ, where
//! m and n are small (6 or 16 channels, 25 or 150 lowered rows) and k = OHW is long. The
//! packed GEMM would transpose-pack both operands for every sample; here both are read in
//! place, 3 rows of A against 4 rows of B at a time (12 accumulators, 7 loads per 12 FMAs).
//!
//! The rows of B may also lie anywhere in one buffer ([`rowdot_at`]): a direct convolution's
//! shifted input windows, dW[oc, (c, i, j)] += Σ_q dZ[oc, q]·plane_c[q + i·wp + j].
//!
//! Each element is summed in a fixed order (8 lanes over k, then the lanes in a fixed tree),
//! whatever the caller's threading, so results are deterministic.

/// Rows of A and of B per register tile.
const MB: usize = 3;
const NB: usize = 4;

/// Where the rows of B start in its slice.
#[derive(Clone, Copy)]
enum Rows<'a> {
    /// Row j at j·ldb.
    Strided(usize),
    /// Row j at offsets[j].
    At(&'a [usize]),
}

impl Rows<'_> {
    #[inline(always)]
    fn start(self, j: usize) -> usize {
        match self {
            Rows::Strided(ldb) => j * ldb,
            Rows::At(offsets) => offsets[j],
        }
    }
}

/// C (m×n, row stride ldc) ← A·Bᵀ, or += when `accumulate`; A is m rows of k at stride lda,
/// B is n rows of k at stride ldb. Panics, before writing anything, if a row stride is shorter
/// than its row or a slice is too short for its shape (extents in checked arithmetic).
#[allow(clippy::too_many_arguments)]
pub fn rowdot(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize, accumulate: bool) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(ldb >= k, "rowdot: a row stride is shorter than its row");
    assert!(fits(b.len(), n, ldb, k), "rowdot: B too short for {n} rows of {k} at stride {ldb}");
    rowdot_rows(m, n, k, a, lda, b, Rows::Strided(ldb), c, ldc, accumulate);
}

/// As [`rowdot`], with row j of B at `b[offsets[j]..][..k]` (n = offsets.len(); rows may
/// overlap). Panics, before writing anything, if a row reaches past `b`.
#[allow(clippy::too_many_arguments)]
pub fn rowdot_at(m: usize, k: usize, a: &[f32], lda: usize, b: &[f32], offsets: &[usize], c: &mut [f32], ldc: usize, accumulate: bool) {
    let n = offsets.len();
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        offsets.iter().all(|&o| o.checked_add(k).is_some_and(|end| end <= b.len())),
        "rowdot: a row of B reaches past its {} values",
        b.len()
    );
    rowdot_rows(m, n, k, a, lda, b, Rows::At(offsets), c, ldc, accumulate);
}

/// rows·stride values, the last row counted only up to its end (in checked arithmetic).
fn fits(len: usize, rows: usize, stride: usize, row: usize) -> bool {
    (rows - 1).checked_mul(stride).and_then(|s| s.checked_add(row)).is_some_and(|need| need <= len)
}

/// The product, B's rows already checked; m, n ≥ 1.
#[allow(clippy::too_many_arguments)]
fn rowdot_rows(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], rows: Rows, c: &mut [f32], ldc: usize, accumulate: bool) {
    assert!(lda >= k && ldc >= n, "rowdot: a row stride is shorter than its row");
    assert!(fits(a.len(), m, lda, k), "rowdot: A too short for {m} rows of {k} at stride {lda}");
    assert!(fits(c.len(), m, ldc, n), "rowdot: C too short for {m} rows of {n} at stride {ldc}");
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: every row read or written lies inside its slice (checked above and by the
        // callers without overflow, so the offsets the kernel forms do not wrap); C's rows do
        // not overlap (ldc ≥ n); the CPU has AVX2 and FMA.
        return unsafe { avx2::rowdot(m, n, k, a, lda, b, rows, c, ldc, accumulate) };
    }
    for i in 0..m {
        for j in 0..n {
            let (ar, br) = (&a[i * lda..][..k], &b[rows.start(j)..][..k]);
            let v = ar.iter().zip(br).fold(0.0f32, |s, (x, y)| s + x * y);
            let out = &mut c[i * ldc + j];
            *out = if accumulate { *out + v } else { v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Rows, MB, NB};
    use std::arch::x86_64::*;

    /// # Safety
    /// Extents as checked by [`super::rowdot_rows`] and its callers; AVX2 and FMA present.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rowdot(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], rows: Rows, c: &mut [f32], ldc: usize, acc: bool) {
        let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        // lanes k8..k of the last vector, loaded under a mask (no read past a row)
        let tail = k % 8;
        let lanes: [i32; 8] = std::array::from_fn(|l| if l < tail { -1 } else { 0 });
        // SAFETY: 8 i32 of a local array.
        let mask = unsafe { _mm256_loadu_si256(lanes.as_ptr().cast()) };
        for i0 in (0..m).step_by(MB) {
            for j0 in (0..n).step_by(NB) {
                let (mb, nb) = (MB.min(m - i0), NB.min(n - j0));
                // SAFETY: row i0 < m of A and of C, rows j0.. < n of B (the last repeated where
                // the tile is narrower, and not read): inside the checked slices.
                let (a0, c0) = unsafe { (ap.add(i0 * lda), cp.add(i0 * ldc + j0)) };
                let mut b0 = [bp; NB];
                for (jj, row) in b0.iter_mut().enumerate() {
                    // SAFETY: as above.
                    *row = unsafe { bp.add(rows.start(j0 + jj.min(nb - 1))) };
                }
                // SAFETY: the tile's rows lie inside the checked extents.
                unsafe {
                    match (mb, nb) {
                        (3, 4) => tile::<3, 4>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (3, 3) => tile::<3, 3>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (3, 2) => tile::<3, 2>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (3, 1) => tile::<3, 1>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (2, 4) => tile::<2, 4>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (2, 3) => tile::<2, 3>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (2, 2) => tile::<2, 2>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (2, 1) => tile::<2, 1>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (1, 4) => tile::<1, 4>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (1, 3) => tile::<1, 3>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        (1, 2) => tile::<1, 2>(k, mask, a0, lda, &b0, c0, ldc, acc),
                        _ => tile::<1, 1>(k, mask, a0, lda, &b0, c0, ldc, acc),
                    }
                }
            }
        }
    }

    /// One M×N tile of C: M·N dot products of length k.
    ///
    /// # Safety
    /// M rows of k values at `a` (stride lda) and N at the first N pointers of `b`, M rows of N
    /// values at `c` (ldc ≥ N) that no one else touches; `mask` has the first k % 8 lanes set.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const M: usize, const N: usize>(
        k: usize,
        mask: __m256i,
        a: *const f32,
        lda: usize,
        b: &[*const f32; NB],
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        // SAFETY: `step` reads values p..p + 8 ≤ k (the last 8 under the mask) of the rows this
        // function's contract covers; the stores are the M×N elements of C.
        unsafe {
            let mut s = [[_mm256_setzero_ps(); N]; M];
            let full = k - k % 8;
            let mut p = 0;
            while p < full {
                step::<M, N, false>(p, mask, a, lda, b, &mut s);
                p += 8;
            }
            if p < k {
                step::<M, N, true>(p, mask, a, lda, b, &mut s);
            }
            for (i, row) in s.iter().enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    let (v, out) = (hsum(v), c.add(i * ldc + j));
                    *out = if accumulate { *out + v } else { v };
                }
            }
        }
    }

    /// s[i][j] += A[i, p..p+8] ⊙ B[j, p..p+8], lanes past k masked off when `MASKED`.
    ///
    /// # Safety
    /// Values p..p + 8 of M rows at `a` and of the first N rows of `b` are readable (with
    /// `MASKED`, those lanes of `mask`).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn step<const M: usize, const N: usize, const MASKED: bool>(
        p: usize,
        mask: __m256i,
        a: *const f32,
        lda: usize,
        b: &[*const f32; NB],
        s: &mut [[__m256; N]; M],
    ) {
        // SAFETY: this function's contract.
        unsafe {
            // no closures here: they would not inherit the target features
            let mut av = [_mm256_setzero_ps(); M];
            for (i, v) in av.iter_mut().enumerate() {
                let q = a.add(i * lda + p);
                *v = if MASKED { _mm256_maskload_ps(q, mask) } else { _mm256_loadu_ps(q) };
            }
            for (j, &b_row) in b.iter().enumerate().take(N) {
                let q = b_row.add(p);
                let bv = if MASKED { _mm256_maskload_ps(q, mask) } else { _mm256_loadu_ps(q) };
                for (row, &ai) in s.iter_mut().zip(&av) {
                    row[j] = _mm256_fmadd_ps(ai, bv, row[j]);
                }
            }
        }
    }

    /// Sum of the 8 lanes in a fixed order: (0+4, 1+5, 2+6, 3+7), then pairs.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hsum(v: __m256) -> f32 {
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Rng;

    #[test]
    fn matches_the_plain_loop_on_odd_shapes_and_strides() {
        let mut rng = Rng::new(9);
        for (m, n, k) in [(1, 1, 1), (3, 4, 8), (6, 25, 784), (16, 150, 100), (5, 7, 13), (2, 9, 3), (7, 5, 17), (4, 1, 0)] {
            for (pad_a, pad_b, pad_c) in [(0, 0, 0), (3, 5, 2)] {
                let (lda, ldb, ldc) = (k + pad_a, k + pad_b, n + pad_c);
                let (a, b) = (rng.ints(m * lda), rng.ints(n * ldb));
                for accumulate in [false, true] {
                    let c0 = if accumulate { rng.ints(m * ldc) } else { vec![f32::NAN; m * ldc] };
                    let mut got = c0.clone();
                    rowdot(m, n, k, &a, lda, &b, ldb, &mut got, ldc, accumulate);
                    for i in 0..m {
                        for j in 0..ldc {
                            let at = i * ldc + j;
                            if j >= n {
                                assert!(got[at].to_bits() == c0[at].to_bits(), "{m}×{n}×{k}: padding at {at} touched");
                                continue;
                            }
                            let dot: f32 = (0..k).map(|p| a[i * lda + p] * b[j * ldb + p]).sum();
                            let want = if accumulate { c0[at] + dot } else { dot };
                            assert_eq!(got[at], want, "{m}×{n}×{k} acc={accumulate} at ({i}, {j})");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rows_at_offsets_match_the_plain_loop() {
        let mut rng = Rng::new(10);
        for (m, n, k) in [(1, 1, 1), (6, 25, 100), (16, 9, 37), (5, 7, 8), (3, 4, 0)] {
            let (a, b) = (rng.ints(m * k), rng.ints(3 * n * k + 1));
            // rows anywhere, overlapping, in no order
            let offsets: Vec<usize> = (0..n).map(|_| rng.below(2 * n * k + 1)).collect();
            for accumulate in [false, true] {
                let c0 = if accumulate { rng.ints(m * n) } else { vec![f32::NAN; m * n] };
                let mut got = c0.clone();
                rowdot_at(m, k, &a, k, &b, &offsets, &mut got, n, accumulate);
                for i in 0..m {
                    for (j, &o) in offsets.iter().enumerate() {
                        let dot: f32 = (0..k).map(|p| a[i * k + p] * b[o + p]).sum();
                        let want = if accumulate { c0[i * n + j] + dot } else { dot };
                        assert_eq!(got[i * n + j], want, "{m}×{n}×{k} acc={accumulate} at ({i}, {j})");
                    }
                }
            }
        }
        let r = std::panic::catch_unwind(|| rowdot_at(1, 4, &[1.0; 4], 4, &[1.0; 6], &[3], &mut [0.0], 1, false));
        assert!(r.is_err(), "a row past B must panic");
    }

    #[test]
    fn strides_whose_extent_wraps_panic_before_any_access() {
        // (rows − 1)·stride + row wraps to 0 in usize: an unchecked test let the kernel read
        // and write at offset usize::MAX
        let (a, b) = (vec![1.0; 8], vec![1.0; 8]);
        for (lda, ldb, ldc, what) in
            [(usize::MAX, 1, 2, "A too short"), (1, usize::MAX, 2, "B too short"), (1, 1, usize::MAX, "C too short")]
        {
            let mut c = vec![f32::NAN; 8];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rowdot(2, 2, 1, &a, lda, &b, ldb, &mut c, ldc, false)));
            let msg = r.expect_err("a wrapping extent must panic").downcast::<String>().expect("a message");
            assert!(msg.contains(what), "{msg}");
            assert!(c.iter().all(|v| v.is_nan()), "C written before the panic");
        }
    }
}
