//! The MR×NR micro-kernels: C tile ← α·(packed A panel)·(packed B panel) + β·C tile.

use super::{ViewMut, NR};

/// An M×NR micro-kernel over packed panels (M = MR, or 4 for the last rows of a block).
pub(super) trait Kernel {
    /// C tile ← α·Σ_p a_p b_pᵀ + β·C tile (β = 0: C not read), for a full M×NR tile whose
    /// rows are contiguous (c.cs = 1).
    ///
    /// # Safety
    /// `a` holds kc columns of M values and `b` kc rows of NR; `c` covers M×NR elements that no
    /// other thread touches during the call; `Avx2` needs AVX2 and FMA.
    unsafe fn tile<const M: usize>(kc: usize, a: *const f32, b: *const f32, alpha: f32, beta: f32, c: ViewMut);

    /// α·v + β·c (β ≠ 0) for one element, rounded as `tile` rounds its stores, so that an edge
    /// tile (computed with α = 1, β = 0, then blended here) has a full tile's bits.
    fn blend(alpha: f32, v: f32, beta: f32, c: f32) -> f32;
}

pub(super) struct Portable;

impl Kernel for Portable {
    #[inline(always)]
    unsafe fn tile<const M: usize>(kc: usize, a: *const f32, b: *const f32, alpha: f32, beta: f32, c: ViewMut) {
        let mut acc = [[0.0f32; NR]; M];
        for p in 0..kc {
            // SAFETY: column p < kc of the packed panels (the contract).
            let (ap, bp) = unsafe { (std::slice::from_raw_parts(a.add(p * M), M), std::slice::from_raw_parts(b.add(p * NR), NR)) };
            for i in 0..M {
                for j in 0..NR {
                    acc[i][j] += ap[i] * bp[j];
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                // SAFETY: (i, j) is inside the M×NR tile `c` covers, ours alone (the contract).
                let p = unsafe { c.ptr.add(i * c.rs + j * c.cs) };
                // SAFETY: as above.
                unsafe { *p = if beta == 0.0 { alpha * v } else { Self::blend(alpha, v, beta, *p) } };
            }
        }
    }

    fn blend(alpha: f32, v: f32, beta: f32, c: f32) -> f32 {
        alpha * v + beta * c
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Kernel for Avx2 {
    #[inline(always)]
    unsafe fn tile<const M: usize>(kc: usize, a: *const f32, b: *const f32, alpha: f32, beta: f32, c: ViewMut) {
        // SAFETY: the same contract.
        unsafe { avx2_tile::<M>(kc, a, b, alpha, beta, c) }
    }

    fn blend(alpha: f32, v: f32, beta: f32, c: f32) -> f32 {
        if alpha == 1.0 && beta == 1.0 {
            c + v
        } else {
            alpha.mul_add(v, beta * c)
        }
    }
}

/// 2·M accumulators of 8 lanes; per k, two loads of B and M broadcasts of A feed 2·M FMAs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_tile<const M: usize>(kc: usize, a: *const f32, b: *const f32, alpha: f32, beta: f32, c: ViewMut) {
    use std::arch::x86_64::*;
    // SAFETY: `Kernel::tile`'s contract: every load is in the packed panels (p < kc), every
    // prefetch and store in the M rows of 16 contiguous values of the C tile.
    unsafe {
        // C's rows are far apart, so the hardware prefetcher misses them, and after the first
        // KC panel they come back from L3: start fetching them now, under the kc·2·M FMAs.
        debug_assert_eq!(c.cs, 1);
        for i in 0..M {
            _mm_prefetch::<_MM_HINT_T0>(c.ptr.add(i * c.rs) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.ptr.add(i * c.rs + NR - 1) as *const i8);
        }
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
        // One loop per case, so that each unrolls with the accumulators left in registers
        // (a branch inside spilled all 2·M to the stack). α = 1 (every call in training)
        // skips the multiplies, which on Zen 3 take the FMA pipes; the sums are the same bits.
        let row = |i: usize, h: usize| c.ptr.add(i * c.rs + 8 * h);
        if beta == 0.0 && alpha == 1.0 {
            for (i, r) in acc.iter().enumerate() {
                for (h, &v) in r.iter().enumerate() {
                    _mm256_storeu_ps(row(i, h), v);
                }
            }
        } else if beta == 0.0 {
            for (i, r) in acc.iter().enumerate() {
                for (h, &v) in r.iter().enumerate() {
                    _mm256_storeu_ps(row(i, h), _mm256_mul_ps(va, v));
                }
            }
        } else if alpha == 1.0 && beta == 1.0 {
            for (i, r) in acc.iter().enumerate() {
                for (h, &v) in r.iter().enumerate() {
                    _mm256_storeu_ps(row(i, h), _mm256_add_ps(_mm256_loadu_ps(row(i, h)), v));
                }
            }
        } else {
            for (i, r) in acc.iter().enumerate() {
                for (h, &v) in r.iter().enumerate() {
                    let p = row(i, h);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(va, v, _mm256_mul_ps(vb, _mm256_loadu_ps(p))));
                }
            }
        }
    }
}
