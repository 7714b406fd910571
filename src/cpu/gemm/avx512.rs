//! The AVX-512 micro-kernel: 12×32 tiles, 24 accumulator registers of 16 lanes (of 32).
//!
//! Per k, two loads of B and 12 broadcasts of A feed 24 FMAs: within the two loads and two
//! FMAs a cycle of cores with two 512-bit FMA units. Edge columns are stored under lane masks;
//! a tile whose columns lie in the first half of its panel (a layer of 16 outputs or fewer, a
//! last panel of 16 columns or fewer) computes that half alone, one vector a row: the FMAs on
//! the zero padding would be half the tile's.

use super::kernel::{blend_fma, Kernel, Panel, Rows};
use super::ViewMut;
use std::arch::x86_64::*;

pub(super) struct Avx512;

impl Kernel for Avx512 {
    const MR: usize = 12;
    const NR: usize = 32;

    #[inline(always)]
    unsafe fn tile<A: Rows, B: Panel>(height: usize, panels: usize, kc: usize, a: A, b: B, alpha: f32, beta: f32, c: ViewMut, cols: usize) {
        // SAFETY: the same contract; (height, panels) is one the contract allows.
        unsafe {
            if panels == 1 && cols <= 16 {
                // the stored columns lie in the panel's first half: its second is not computed
                return match height {
                    1 => tile::<1, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    2 => tile::<2, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    3 => tile::<3, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    4 => tile::<4, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    5 => tile::<5, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    6 => tile::<6, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    7 => tile::<7, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    8 => tile::<8, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    9 => tile::<9, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    10 => tile::<10, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    11 => tile::<11, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                    _ => tile::<12, 1, 1, A, B>(kc, a, b, alpha, beta, c, cols),
                };
            }
            match (height, panels) {
                (1, 1) => tile::<1, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (1, 2) => tile::<1, 2, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (1, 3) => tile::<1, 3, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (1, _) => tile::<1, 4, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (2, 1) => tile::<2, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (2, _) => tile::<2, 2, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (3, 1) => tile::<3, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (3, _) => tile::<3, 2, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (4, _) => tile::<4, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (5, _) => tile::<5, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (6, _) => tile::<6, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (7, _) => tile::<7, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (8, _) => tile::<8, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (9, _) => tile::<9, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (10, _) => tile::<10, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                (11, _) => tile::<11, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
                _ => tile::<12, 1, 2, A, B>(kc, a, b, alpha, beta, c, cols),
            }
        }
    }

    fn blend(alpha: f32, v: f32, beta: f32, c: f32) -> f32 {
        blend_fma(alpha, v, beta, c)
    }
}

/// The lanes of vector v (columns 16·v..) that lie inside `cols`.
#[inline(always)]
fn lanes(cols: usize, v: usize) -> __mmask16 {
    match cols.saturating_sub(16 * v) {
        0 => 0,
        n if n >= 16 => 0xFFFF,
        n => (1u16 << n) - 1,
    }
}

/// V·M·P accumulators of 16 lanes (V = 2: whole panels; V = 1: each panel's first half),
/// then the first `cols` columns stored under masks.
///
/// # Safety
/// As [`Kernel::tile`] with height M and P panels, and cols ≤ 16·V where V = 1; AVX-512F,
/// AVX2 and FMA present.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn tile<const M: usize, const P: usize, const V: usize, A: Rows, B: Panel>(
    kc: usize,
    a: A,
    b: B,
    alpha: f32,
    beta: f32,
    c: ViewMut,
    cols: usize,
) {
    // SAFETY: `Kernel::tile`'s contract: every load is in the A panel or in row p < kc of one
    // of the P panels; every prefetch is of the C tile's rows (a prefetch never faults), and
    // every load and store of C is of the masked lanes, columns < cols of the M rows.
    unsafe {
        debug_assert!(c.cs == 1 && (V == 2 || cols <= 16));
        // C's rows are far apart: fetch them under the FMAs (see the AVX2 kernel).
        for i in 0..M {
            _mm_prefetch::<_MM_HINT_T0>(c.ptr.add(i * c.rs) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.ptr.wrapping_add(i * c.rs + cols - 1) as *const i8);
        }
        let mut bq = [b; P];
        for (q, panel) in bq.iter_mut().enumerate() {
            *panel = b.next(q, 32);
        }
        let mut acc = [[[_mm512_setzero_ps(); V]; P]; M];
        for p in 0..kc {
            for (q, panel) in bq.iter().enumerate() {
                let row = panel.row(p, 32);
                let mut bv = [_mm512_setzero_ps(); V];
                bv[0] = _mm512_loadu_ps(row);
                if V == 2 {
                    bv[V - 1] = _mm512_loadu_ps(row.add(panel.gap(32)));
                }
                for (i, acc_i) in acc.iter_mut().enumerate() {
                    let ai = _mm512_set1_ps(*a.at(i, p, M));
                    for (acc_v, &b_v) in acc_i[q].iter_mut().zip(&bv) {
                        *acc_v = _mm512_fmadd_ps(ai, b_v, *acc_v);
                    }
                }
            }
        }
        // vector (q, v) holds columns 32·q + 16·v..: the 2·q + v-th run of 16
        let mut masks = [[0 as __mmask16; V]; P];
        for (q, mask_q) in masks.iter_mut().enumerate() {
            for (v, mask) in mask_q.iter_mut().enumerate() {
                *mask = lanes(cols, 2 * q + v);
            }
        }
        let (va, vb) = (_mm512_set1_ps(alpha), _mm512_set1_ps(beta));
        // One loop per case, as in the AVX2 kernel; a masked store of a full vector costs
        // what an unmasked one does. (No closures around the intrinsics: a closure would not
        // inherit the target features.)
        // (wrapping: a vector wholly past `cols` may start past C; its mask is empty)
        let at = |i: usize, q: usize, v: usize| c.ptr.wrapping_add(i * c.rs + 32 * q + 16 * v);
        if beta == 0.0 && alpha == 1.0 {
            for (i, acc_i) in acc.iter().enumerate() {
                for (q, acc_q) in acc_i.iter().enumerate() {
                    for (v, &x) in acc_q.iter().enumerate() {
                        _mm512_mask_storeu_ps(at(i, q, v), masks[q][v], x);
                    }
                }
            }
        } else if beta == 0.0 {
            for (i, acc_i) in acc.iter().enumerate() {
                for (q, acc_q) in acc_i.iter().enumerate() {
                    for (v, &x) in acc_q.iter().enumerate() {
                        _mm512_mask_storeu_ps(at(i, q, v), masks[q][v], _mm512_mul_ps(va, x));
                    }
                }
            }
        } else if alpha == 1.0 && beta == 1.0 {
            for (i, acc_i) in acc.iter().enumerate() {
                for (q, acc_q) in acc_i.iter().enumerate() {
                    for (v, &x) in acc_q.iter().enumerate() {
                        let old = _mm512_maskz_loadu_ps(masks[q][v], at(i, q, v));
                        _mm512_mask_storeu_ps(at(i, q, v), masks[q][v], _mm512_add_ps(old, x));
                    }
                }
            }
        } else {
            for (i, acc_i) in acc.iter().enumerate() {
                for (q, acc_q) in acc_i.iter().enumerate() {
                    for (v, &x) in acc_q.iter().enumerate() {
                        let old = _mm512_maskz_loadu_ps(masks[q][v], at(i, q, v));
                        _mm512_mask_storeu_ps(at(i, q, v), masks[q][v], _mm512_fmadd_ps(va, x, _mm512_mul_ps(vb, old)));
                    }
                }
            }
        }
    }
}
