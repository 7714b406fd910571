//! The AVX2 + FMA micro-kernel: 6×16 tiles, 12 accumulator registers of 8 lanes.

use super::kernel::{blend_fma, through_stack, Kernel, Panel, Rows};
use super::ViewMut;
use std::arch::x86_64::*;

pub(super) struct Avx2;

impl Kernel for Avx2 {
    const MR: usize = 6;
    const NR: usize = 16;

    #[inline(always)]
    unsafe fn tile<A: Rows, B: Panel>(height: usize, panels: usize, kc: usize, a: A, b: B, alpha: f32, beta: f32, c: ViewMut, cols: usize) {
        let width = panels * 16;
        if cols < width {
            // SAFETY: the same contract, for a full tile on the stack.
            return unsafe {
                through_stack(height, width, alpha, beta, c, cols, Self::blend, |edge| {
                    Self::tile(height, panels, kc, a, b, 1.0, 0.0, edge, width)
                })
            };
        }
        // SAFETY: the same contract; (height, panels) is one the contract allows.
        unsafe {
            match (height, panels) {
                (1, 1) => tile::<1, 1, A, B>(kc, a, b, alpha, beta, c),
                (1, 2) => tile::<1, 2, A, B>(kc, a, b, alpha, beta, c),
                (1, 3) => tile::<1, 3, A, B>(kc, a, b, alpha, beta, c),
                (1, _) => tile::<1, 4, A, B>(kc, a, b, alpha, beta, c),
                (2, 1) => tile::<2, 1, A, B>(kc, a, b, alpha, beta, c),
                (2, _) => tile::<2, 2, A, B>(kc, a, b, alpha, beta, c),
                (3, 1) => tile::<3, 1, A, B>(kc, a, b, alpha, beta, c),
                (3, _) => tile::<3, 2, A, B>(kc, a, b, alpha, beta, c),
                (4, _) => tile::<4, 1, A, B>(kc, a, b, alpha, beta, c),
                (5, _) => tile::<5, 1, A, B>(kc, a, b, alpha, beta, c),
                _ => tile::<6, 1, A, B>(kc, a, b, alpha, beta, c),
            }
        }
    }

    fn blend(alpha: f32, v: f32, beta: f32, c: f32) -> f32 {
        blend_fma(alpha, v, beta, c)
    }
}

/// 2·M·P accumulators of 8 lanes; per k and panel, two loads of B and M broadcasts of A feed
/// 2·M FMAs.
///
/// # Safety
/// As [`Kernel::tile`] with height M, P panels and every column stored; AVX2 and FMA present.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const M: usize, const P: usize, A: Rows, B: Panel>(kc: usize, a: A, b: B, alpha: f32, beta: f32, c: ViewMut) {
    // SAFETY: `Kernel::tile`'s contract: every load is in the A panel or in row p < kc of
    // one of the P panels, every prefetch and store in the M rows of 16·P contiguous values
    // of the C tile.
    unsafe {
        // C's rows are far apart, so the hardware prefetcher misses them, and after the first
        // KC panel they come back from L3: start fetching them now, under the kc·2·M FMAs.
        debug_assert_eq!(c.cs, 1);
        for i in 0..M {
            _mm_prefetch::<_MM_HINT_T0>(c.ptr.add(i * c.rs) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.ptr.add(i * c.rs + 16 * P - 1) as *const i8);
        }
        let mut bq = [b; P];
        for (q, panel) in bq.iter_mut().enumerate() {
            *panel = b.next(q, 16);
        }
        let mut acc = [[[_mm256_setzero_ps(); 2]; P]; M];
        for p in 0..kc {
            for (q, panel) in bq.iter().enumerate() {
                let row = panel.row(p, 16);
                let (b0, b1) = (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(panel.gap(16))));
                for (i, acc_i) in acc.iter_mut().enumerate() {
                    let ai = _mm256_broadcast_ss(&*a.at(i, p, M));
                    acc_i[q][0] = _mm256_fmadd_ps(ai, b0, acc_i[q][0]);
                    acc_i[q][1] = _mm256_fmadd_ps(ai, b1, acc_i[q][1]);
                }
            }
        }
        let (va, vb) = (_mm256_set1_ps(alpha), _mm256_set1_ps(beta));
        // One loop per case, so that each unrolls with the accumulators left in registers
        // (a branch inside spilled them all to the stack). α = 1 (every call in training)
        // skips the multiplies, which on Zen 3 take the FMA pipes; the sums are the same bits.
        // (no closures around the intrinsics: a closure would not inherit the target features)
        let at = |i: usize, v: usize| c.ptr.add(i * c.rs + 8 * v);
        if beta == 0.0 && alpha == 1.0 {
            for (i, acc_i) in acc.iter().enumerate() {
                for (v, &x) in acc_i.as_flattened().iter().enumerate() {
                    _mm256_storeu_ps(at(i, v), x);
                }
            }
        } else if beta == 0.0 {
            for (i, acc_i) in acc.iter().enumerate() {
                for (v, &x) in acc_i.as_flattened().iter().enumerate() {
                    _mm256_storeu_ps(at(i, v), _mm256_mul_ps(va, x));
                }
            }
        } else if alpha == 1.0 && beta == 1.0 {
            for (i, acc_i) in acc.iter().enumerate() {
                for (v, &x) in acc_i.as_flattened().iter().enumerate() {
                    _mm256_storeu_ps(at(i, v), _mm256_add_ps(_mm256_loadu_ps(at(i, v)), x));
                }
            }
        } else {
            for (i, acc_i) in acc.iter().enumerate() {
                for (v, &x) in acc_i.as_flattened().iter().enumerate() {
                    _mm256_storeu_ps(at(i, v), _mm256_fmadd_ps(va, x, _mm256_mul_ps(vb, _mm256_loadu_ps(at(i, v)))));
                }
            }
        }
    }
}
