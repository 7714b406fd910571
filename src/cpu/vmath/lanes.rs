//! The vector of f32 lanes the kernels are written over, once, and its three instruction sets:
//! `f32` itself (one lane, portable), AVX2+FMA (8 lanes) and AVX-512F (16 lanes).
//!
//! Every operation is one IEEE operation rounded once (`mul_add` is fused on every path), and
//! `max`, `min` and `lt` are defined by the x86 rule below on every path, so a kernel gives the
//! same bits whichever type it runs on.

use std::ops::{Add, Div, Mul, Neg, Sub};

/// Lanes of f32 and the operations the kernels use.
pub(crate) trait Lanes:
    Copy + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Div<Output = Self> + Neg<Output = Self>
{
    /// Values per vector.
    const LANES: usize;
    /// One flag per lane, from a comparison.
    type Mask: Copy;
    /// Every lane `c`.
    fn splat(c: f32) -> Self;
    /// The first `LANES` values of `src` (which must hold that many).
    fn load(src: &[f32]) -> Self;
    /// Writes the lanes to the first `LANES` values of `dst` (which must hold that many).
    fn store(self, dst: &mut [f32]);
    /// self·b + c, rounded once.
    fn mul_add(self, b: Self, c: Self) -> Self;
    /// self > b ? self : b per lane: `b` where either is NaN (x86 `maxps`).
    fn max(self, b: Self) -> Self;
    /// self < b ? self : b per lane: `b` where either is NaN (x86 `minps`).
    fn min(self, b: Self) -> Self;
    /// self < b per lane; false where either is NaN.
    fn lt(self, b: Self) -> Self::Mask;
    /// m ? a : b per lane.
    fn select(m: Self::Mask, a: Self, b: Self) -> Self;
    /// Bitwise and of the lanes' bit patterns.
    fn and(self, b: Self) -> Self;
    /// Bitwise or of the lanes' bit patterns.
    fn or(self, b: Self) -> Self;
    /// Each lane's bit pattern shifted left by 23: the low bits of an integer become an
    /// exponent field.
    fn shl23(self) -> Self;
}

impl Lanes for f32 {
    const LANES: usize = 1;
    type Mask = bool;
    #[inline(always)]
    fn splat(c: f32) -> f32 {
        c
    }
    #[inline(always)]
    fn load(src: &[f32]) -> f32 {
        src[0]
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32]) {
        dst[0] = self;
    }
    #[inline(always)]
    fn mul_add(self, b: f32, c: f32) -> f32 {
        f32::mul_add(self, b, c)
    }
    #[inline(always)]
    fn max(self, b: f32) -> f32 {
        if self > b {
            self
        } else {
            b
        }
    }
    #[inline(always)]
    fn min(self, b: f32) -> f32 {
        if self < b {
            self
        } else {
            b
        }
    }
    #[inline(always)]
    fn lt(self, b: f32) -> bool {
        self < b
    }
    #[inline(always)]
    fn select(m: bool, a: f32, b: f32) -> f32 {
        if m {
            a
        } else {
            b
        }
    }
    #[inline(always)]
    fn and(self, b: f32) -> f32 {
        f32::from_bits(self.to_bits() & b.to_bits())
    }
    #[inline(always)]
    fn or(self, b: f32) -> f32 {
        f32::from_bits(self.to_bits() | b.to_bits())
    }
    #[inline(always)]
    fn shl23(self) -> f32 {
        f32::from_bits(self.to_bits() << 23)
    }
}

/// Two vectors as one of twice the lanes, each operation applied to both in turn: a kernel over
/// a pair runs two independent chains of operations side by side, one operation of each at a
/// time. A kernel's chain is long (tens of dependent operations, two divisions), and a core
/// keeps only so many operations waiting for their inputs: with one vector's chain it fills
/// that window before the next vector's operations come into it, with the two interleaved
/// each has the other's to overlap. The same operations per lane, so the same bits.
#[derive(Clone, Copy)]
pub(crate) struct Pair<V>(V, V);

/// Implements an arithmetic operator of [`Pair`] lane by lane.
macro_rules! pair_operator {
    ($trait:ident, $f:ident) => {
        impl<V: Lanes> $trait for Pair<V> {
            type Output = Pair<V>;
            #[inline(always)]
            fn $f(self, b: Pair<V>) -> Pair<V> {
                Pair(self.0.$f(b.0), self.1.$f(b.1))
            }
        }
    };
}

pair_operator!(Add, add);
pair_operator!(Sub, sub);
pair_operator!(Mul, mul);
pair_operator!(Div, div);

impl<V: Lanes> Neg for Pair<V> {
    type Output = Pair<V>;
    #[inline(always)]
    fn neg(self) -> Pair<V> {
        Pair(-self.0, -self.1)
    }
}

impl<V: Lanes> Lanes for Pair<V> {
    const LANES: usize = 2 * V::LANES;
    type Mask = (V::Mask, V::Mask);
    #[inline(always)]
    fn splat(c: f32) -> Pair<V> {
        Pair(V::splat(c), V::splat(c))
    }
    #[inline(always)]
    fn load(src: &[f32]) -> Pair<V> {
        Pair(V::load(src), V::load(&src[V::LANES..]))
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32]) {
        self.0.store(dst);
        self.1.store(&mut dst[V::LANES..]);
    }
    #[inline(always)]
    fn mul_add(self, b: Pair<V>, c: Pair<V>) -> Pair<V> {
        Pair(self.0.mul_add(b.0, c.0), self.1.mul_add(b.1, c.1))
    }
    #[inline(always)]
    fn max(self, b: Pair<V>) -> Pair<V> {
        Pair(self.0.max(b.0), self.1.max(b.1))
    }
    #[inline(always)]
    fn min(self, b: Pair<V>) -> Pair<V> {
        Pair(self.0.min(b.0), self.1.min(b.1))
    }
    #[inline(always)]
    fn lt(self, b: Pair<V>) -> (V::Mask, V::Mask) {
        (self.0.lt(b.0), self.1.lt(b.1))
    }
    #[inline(always)]
    fn select(m: (V::Mask, V::Mask), a: Pair<V>, b: Pair<V>) -> Pair<V> {
        Pair(V::select(m.0, a.0, b.0), V::select(m.1, a.1, b.1))
    }
    #[inline(always)]
    fn and(self, b: Pair<V>) -> Pair<V> {
        Pair(self.0.and(b.0), self.1.and(b.1))
    }
    #[inline(always)]
    fn or(self, b: Pair<V>) -> Pair<V> {
        Pair(self.0.or(b.0), self.1.or(b.1))
    }
    #[inline(always)]
    fn shl23(self) -> Pair<V> {
        Pair(self.0.shl23(), self.1.shl23())
    }
}

/// Implements the arithmetic operators of a vector newtype with the given intrinsics.
#[cfg(target_arch = "x86_64")]
macro_rules! operators {
    ($t:ident, $add:ident, $sub:ident, $mul:ident, $div:ident) => {
        impl Add for $t {
            type Output = $t;
            #[inline(always)]
            fn add(self, b: $t) -> $t {
                // SAFETY: see the type's invariant.
                $t(unsafe { $add(self.0, b.0) })
            }
        }
        impl Sub for $t {
            type Output = $t;
            #[inline(always)]
            fn sub(self, b: $t) -> $t {
                // SAFETY: see the type's invariant.
                $t(unsafe { $sub(self.0, b.0) })
            }
        }
        impl Mul for $t {
            type Output = $t;
            #[inline(always)]
            fn mul(self, b: $t) -> $t {
                // SAFETY: see the type's invariant.
                $t(unsafe { $mul(self.0, b.0) })
            }
        }
        impl Div for $t {
            type Output = $t;
            #[inline(always)]
            fn div(self, b: $t) -> $t {
                // SAFETY: see the type's invariant.
                $t(unsafe { $div(self.0, b.0) })
            }
        }
        impl Neg for $t {
            type Output = $t;
            /// The sign bit flipped (as `-x` on an f32).
            #[inline(always)]
            fn neg(self) -> $t {
                $t::xor_sign(self)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// 8 lanes in an AVX register.
    ///
    /// Invariant: its methods execute AVX2 and FMA instructions, so they run only inside the
    /// `#[target_feature(enable = "avx2,fma")]` entry points of `vmath` and `cpu::recurrent`,
    /// which are called only after `Isa::Avx2.available()`.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2(__m256);

    impl Avx2 {
        #[inline(always)]
        fn xor_sign(self) -> Avx2 {
            // SAFETY: see the type's invariant.
            Avx2(unsafe { _mm256_xor_ps(self.0, _mm256_set1_ps(-0.0)) })
        }
    }

    operators!(Avx2, _mm256_add_ps, _mm256_sub_ps, _mm256_mul_ps, _mm256_div_ps);

    impl Lanes for Avx2 {
        const LANES: usize = 8;
        type Mask = __m256;
        #[inline(always)]
        fn splat(c: f32) -> Avx2 {
            // SAFETY: see the type's invariant.
            Avx2(unsafe { _mm256_set1_ps(c) })
        }
        #[inline(always)]
        fn load(src: &[f32]) -> Avx2 {
            assert!(src.len() >= 8);
            // SAFETY: 8 values are readable (checked above); see the type's invariant.
            Avx2(unsafe { _mm256_loadu_ps(src.as_ptr()) })
        }
        #[inline(always)]
        fn store(self, dst: &mut [f32]) {
            assert!(dst.len() >= 8);
            // SAFETY: 8 values are writable (checked above); see the type's invariant.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        fn mul_add(self, b: Avx2, c: Avx2) -> Avx2 {
            // SAFETY: see the type's invariant.
            Avx2(unsafe { _mm256_fmadd_ps(self.0, b.0, c.0) })
        }
        #[inline(always)]
        fn max(self, b: Avx2) -> Avx2 {
            // SAFETY: see the type's invariant.
            Avx2(unsafe { _mm256_max_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn min(self, b: Avx2) -> Avx2 {
            // SAFETY: see the type's invariant.
            Avx2(unsafe { _mm256_min_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn lt(self, b: Avx2) -> __m256 {
            // SAFETY: see the type's invariant.
            unsafe { _mm256_cmp_ps::<_CMP_LT_OQ>(self.0, b.0) }
        }
        #[inline(always)]
        fn select(m: __m256, a: Avx2, b: Avx2) -> Avx2 {
            // SAFETY: see the type's invariant.
            Avx2(unsafe { _mm256_blendv_ps(b.0, a.0, m) })
        }
        #[inline(always)]
        fn and(self, b: Avx2) -> Avx2 {
            // SAFETY: see the type's invariant.
            Avx2(unsafe { _mm256_and_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn or(self, b: Avx2) -> Avx2 {
            // SAFETY: see the type's invariant.
            Avx2(unsafe { _mm256_or_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn shl23(self) -> Avx2 {
            // SAFETY: see the type's invariant.
            Avx2(unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_castps_si256(self.0))) })
        }
    }

    /// 16 lanes in an AVX-512 register.
    ///
    /// Invariant: its methods execute AVX-512F instructions, so they run only inside the
    /// `#[target_feature(enable = "avx512f")]` entry points of `vmath` and `cpu::recurrent`,
    /// which are called only after `Isa::Avx512.available()`.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx512(__m512);

    impl Avx512 {
        #[inline(always)]
        fn xor_sign(self) -> Avx512 {
            // SAFETY: see the type's invariant.
            Avx512(unsafe { _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(self.0), _mm512_set1_epi32(i32::MIN))) })
        }
    }

    operators!(Avx512, _mm512_add_ps, _mm512_sub_ps, _mm512_mul_ps, _mm512_div_ps);

    impl Lanes for Avx512 {
        const LANES: usize = 16;
        type Mask = __mmask16;
        #[inline(always)]
        fn splat(c: f32) -> Avx512 {
            // SAFETY: see the type's invariant.
            Avx512(unsafe { _mm512_set1_ps(c) })
        }
        #[inline(always)]
        fn load(src: &[f32]) -> Avx512 {
            assert!(src.len() >= 16);
            // SAFETY: 16 values are readable (checked above); see the type's invariant.
            Avx512(unsafe { _mm512_loadu_ps(src.as_ptr()) })
        }
        #[inline(always)]
        fn store(self, dst: &mut [f32]) {
            assert!(dst.len() >= 16);
            // SAFETY: 16 values are writable (checked above); see the type's invariant.
            unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        fn mul_add(self, b: Avx512, c: Avx512) -> Avx512 {
            // SAFETY: see the type's invariant.
            Avx512(unsafe { _mm512_fmadd_ps(self.0, b.0, c.0) })
        }
        #[inline(always)]
        fn max(self, b: Avx512) -> Avx512 {
            // SAFETY: see the type's invariant.
            Avx512(unsafe { _mm512_max_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn min(self, b: Avx512) -> Avx512 {
            // SAFETY: see the type's invariant.
            Avx512(unsafe { _mm512_min_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn lt(self, b: Avx512) -> __mmask16 {
            // SAFETY: see the type's invariant.
            unsafe { _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, b.0) }
        }
        #[inline(always)]
        fn select(m: __mmask16, a: Avx512, b: Avx512) -> Avx512 {
            // SAFETY: see the type's invariant.
            Avx512(unsafe { _mm512_mask_blend_ps(m, b.0, a.0) })
        }
        #[inline(always)]
        fn and(self, b: Avx512) -> Avx512 {
            // SAFETY: see the type's invariant.
            Avx512(unsafe { _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(self.0), _mm512_castps_si512(b.0))) })
        }
        #[inline(always)]
        fn or(self, b: Avx512) -> Avx512 {
            // SAFETY: see the type's invariant.
            Avx512(unsafe { _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(self.0), _mm512_castps_si512(b.0))) })
        }
        #[inline(always)]
        fn shl23(self) -> Avx512 {
            // SAFETY: see the type's invariant.
            Avx512(unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_castps_si512(self.0))) })
        }
    }
}
