//! The kernels, written once over [`Lanes`]: e^x and e^x − 1, tanh, the logistic sigmoid, the
//! GELU x·Φ(x) with its derivative Φ(x) + x·φ(x), the SiLU x·σ(x) with its derivative, and the
//! softplus ln(1 + e^x).
//!
//! Polynomial coefficients are minimax (Remez) fits in f64 of the relative error on the stated
//! interval, rounded to f32; the fit error is given beside each. The bound of each kernel, as
//! measured against f64 over every f32 input, is on the entry points in `vmath`.

use super::lanes::Lanes;
use std::f32::consts::{LN_2, LOG2_E};

/// 1.5·2²³: for |v| < 2²², (v + ROUND) − ROUND is v rounded to the nearest integer.
const ROUND: f32 = 12_582_912.0;
/// ln 2 = LN2_HI + LN2_LO, with LN2_HI = 355/512 short (9 bits) so that n·LN2_HI is exact for |n| < 2¹⁵.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// e^r = 1 + r + r²·P(r) on |r| ≤ ln2/2; fit error 3.1e-9.
const EXP_P: [f32; 5] = [0.499_999_94, 0.166_665_21, 0.041_668_39, 0.008_368_71, 0.001_381_461_3];
/// tanh(a) = a + a³·P(a²) on 0 ≤ a ≤ 0.625; fit error 4.4e-9.
const TANH_P: [f32; 5] = [-0.333_332_8, 0.133_314_42, -0.053_739_715, 0.020_639_088, -0.005_704_987_3];
/// Where tanh changes from its polynomial to 1 − 2/(e^{2a} + 1).
const TANH_SPLIT: f32 = 0.625;
/// ln(1 + t) = 2s + 2s³·P(s²) with s = t/(2 + t): P's coefficients are 1/3, 1/5, …, 1/17 (the
/// series of atanh), which for s ≤ ⅓ leave out less than s¹⁹/19·(9/8) ≈ 1.3e-10 of it.
const LOG1P_P: [f32; 8] = [1.0 / 3.0, 1.0 / 5.0, 1.0 / 7.0, 1.0 / 9.0, 1.0 / 11.0, 1.0 / 13.0, 1.0 / 15.0, 1.0 / 17.0];
/// e^{−v/2}/√(2π) = GAUSS_P(v) on |v| ≤ ln2, its first coefficient 1/√(2π) rounded to f32 (so that
/// GAUSS_P(0)·MILLS_Q(0)/MILLS_P(0) is ½ exactly); fit error 2.0e-9.
const GAUSS_P: [f32; 7] = [0.398_942_3, -0.199_471_15, 0.049_867_78, -0.008_311_18, 0.001_038_945_5, -0.000_104_400_15, 8.629_405e-6];
/// The Mills ratio Φ(−a)/φ(a) = Q(a)/(a·Q(a) + P(a)) on 0 ≤ a ≤ 15, times 1/(√(2π)·GAUSS_P(0))
/// (1 − 2.8e-8, GAUSS_P(0)'s rounding), with Q(0) = 1 and P(0) = 2·GAUSS_P(0) exactly: a
/// rational minimax fit of the relative error (linearised, reweighted least squares) in f64;
/// fit error 6.1e-10.
const MILLS_Q: [f32; 6] = [1.0, 1.078_981_6, 0.559_651_14, 0.167_982_98, 0.029_166_246, 0.002_416_519_2];
const MILLS_P: [f32; 5] = [0.797_884_6, 0.497_522_6, 0.163_463_7, 0.029_150_542, 0.002_416_902_2];
/// |x| beyond which the GELU's Φ(−|x|)·|x| and φ(x) are 0 in f32 (φ(15) ≈ 5.5e-50).
const GELU_CLAMP: f32 = 15.0;
/// φ is formed 2^GAUSS_K times too large, and scaled down by [`TWO_M40`].
const GAUSS_K: f32 = 40.0;
/// 2⁻⁴⁰
const TWO_M40: f32 = 1.0 / 1_099_511_627_776.0;

/// c[0] + x·(c[1] + x·(c[2] + …)), by Horner's rule in fused multiply-adds.
#[inline(always)]
fn poly<V: Lanes>(x: V, c: &[f32]) -> V {
    let (last, rest) = c.split_last().expect("a polynomial has coefficients");
    let mut acc = V::splat(*last);
    for &k in rest.iter().rev() {
        acc = acc.mul_add(x, V::splat(k));
    }
    acc
}

/// |x|: the sign bit cleared.
#[inline(always)]
fn abs<V: Lanes>(x: V) -> V {
    x.and(V::splat(f32::from_bits(0x7fff_ffff)))
}

/// `magnitude` (sign bit clear) with the sign of `x`.
#[inline(always)]
fn with_sign_of<V: Lanes>(magnitude: V, x: V) -> V {
    magnitude.or(x.and(V::splat(-0.0)))
}

/// 2^k for integral k in [−126, 127]: k + 127 lands in the low mantissa bits of k + ROUND + 127,
/// and the shift moves them into the exponent field.
#[inline(always)]
fn pow2<V: Lanes>(k: V) -> V {
    (k + V::splat(ROUND + 127.0)).shl23()
}

/// e^x, rounded once from its parts.
#[inline(always)]
pub(super) fn exp<V: Lanes>(x: V) -> V {
    let e = ExpParts::at(x, 0.0);
    e.scale(e.hi + e.lo)
}

/// e^x·2^k = (hi + lo)·2ᵃ·2ᵇ, unrounded: hi + lo ∈ [0.7, 1.5] with |lo| < 0.1 < |hi|, and a, b
/// in [−75, 77], so scaling either part is exact unless the result is subnormal.
struct ExpParts<V> {
    hi: V,
    lo: V,
    pow2_a: V,
    pow2_b: V,
}

impl<V: Lanes> ExpParts<V> {
    /// For integral k in [0, 24]. Inputs are clamped to [−104 − k·ln2, 89] (e^89 overflows,
    /// e^−104 rounds to 0), so n + k stays in [−150, 153]; NaN passes the clamp (`max` and `min`
    /// return their second operand for it).
    #[inline(always)]
    fn at(x: V, k: f32) -> ExpParts<V> {
        let x = V::splat(89.0).min(V::splat(-104.0 - k * LN_2).max(x));
        // x = n·ln2 + r, n = round(x·log₂e), |r| ≤ ln2/2, r = r_hi + c: r_hi = x − n·LN2_HI is
        // exact (Cody–Waite), c = −n·LN2_LO is within 2⁻³⁰
        let n = x.mul_add(V::splat(LOG2_E), V::splat(ROUND)) - V::splat(ROUND);
        let r_hi = n.mul_add(V::splat(-LN2_HI), x);
        let c = n * V::splat(-LN2_LO);
        let r = r_hi + c;
        // e^r = 1 + r + r²·P(r) = hi + (r²·P + c + e), with 1 + r_hi = hi + e exactly
        let one = V::splat(1.0);
        let hi = one + r_hi;
        let e = r_hi - (hi - one);
        let lo = (r * r).mul_add(poly(r, &EXP_P), c + e);
        // 2ᵐ, m = n + k, as 2ᵃ·2ᵐ⁻ᵃ with a = ⌊m/2⌋
        let m = n + V::splat(k);
        let a = (m.mul_add(V::splat(0.5), V::splat(-0.25)) + V::splat(ROUND)) - V::splat(ROUND);
        ExpParts { hi, lo, pow2_a: pow2(a), pow2_b: pow2(m - a) }
    }

    /// v·2ᵃ·2ᵇ: the first product is exact, the second rounds once, so overflow gives ∞ and
    /// underflow the rounded subnormal or 0.
    #[inline(always)]
    fn scale(&self, v: V) -> V {
        v * self.pow2_a * self.pow2_b
    }
}

/// tanh(x): a + a³·P(a²) for a = |x| < 0.625, else 1 − 2/(e^{2a} + 1) (1 for large a, as
/// e^{2a} → ∞); the sign of x restored.
#[inline(always)]
pub(crate) fn tanh<V: Lanes>(x: V) -> V {
    let a = abs(x);
    let s = a * a;
    let small = (a * s).mul_add(poly(s, &TANH_P), a);
    let one = V::splat(1.0);
    let large = one - V::splat(2.0) / (exp(a + a) + one);
    with_sign_of(V::select(a.lt(V::splat(TANH_SPLIT)), small, large), x)
}

/// 1/(1 + e^−x) = num/(1 + e), e = e^−|x|, num = 1 for x ≥ 0 and e for x < 0 (no overflow, and
/// small results keep their relative accuracy down to the subnormals). e is kept unrounded as
/// e_hi + e_lo (e_hi the rounded e), 1 + e as d_hi + d_lo (exactly, as e ≤ 1), and the quotient q
/// of the rounded parts is corrected by its residual: num/(1 + e) = q + (num − q·(1 + e))/d_hi,
/// to first order.
#[inline(always)]
pub(crate) fn sigmoid<V: Lanes>(x: V) -> V {
    let parts = ExpParts::at(-abs(x), 0.0);
    let hi = parts.hi + parts.lo;
    let (e_hi, e_lo) = (parts.scale(hi), parts.scale(parts.lo - (hi - parts.hi)));
    let one = V::splat(1.0);
    let d_hi = one + e_hi;
    let d_lo = (e_hi - (d_hi - one)) + e_lo;
    let negative = x.lt(V::splat(0.0));
    let (num_hi, num_lo) = (V::select(negative, e_hi, one), V::select(negative, e_lo, V::splat(0.0)));
    let q = (num_hi + num_lo) / d_hi;
    let residual = (-q).mul_add(d_hi, num_hi) + (-q).mul_add(d_lo, num_lo);
    q + residual / d_hi
}

/// e^x for x ≤ 0 (NaN passes), in fewer operations than [`exp`]: x = n·ln2 + r by two fused
/// multiply-adds (r rounded once), e^r = 1 + (r + r²·P(r)), scaled by 2ⁿ as 2ᵃ·2ⁿ⁻ᵃ (so that the
/// subnormals round once). Clamped at −104, below which e^x rounds to 0.
#[inline(always)]
fn exp_nonpositive<V: Lanes>(x: V) -> V {
    let x = V::splat(-104.0).max(x);
    let n = x.mul_add(V::splat(LOG2_E), V::splat(ROUND)) - V::splat(ROUND);
    let r = n.mul_add(V::splat(-LN2_LO), n.mul_add(V::splat(-LN2_HI), x));
    let e_r = V::splat(1.0) + (r * r).mul_add(poly(r, &EXP_P), r);
    let a = (n.mul_add(V::splat(0.5), V::splat(-0.25)) + V::splat(ROUND)) - V::splat(ROUND);
    e_r * pow2(a) * pow2(n - a)
}

/// The recurrent layers' gates' logistic sigmoid: num/(1 + e), e = e^−|x| and num = 1 for x ≥ 0,
/// e for x < 0, one rounded quotient: fewer operations and one division where [`sigmoid`] has
/// two (it corrects the quotient by its residual), for a few tenths of an ulp more error: within
/// 2.45 ulp (and 1.8e-7 relative) of the f64 function, as the tests check over the float range.
#[inline(always)]
pub(crate) fn gate_sigmoid<V: Lanes>(x: V) -> V {
    let e = exp_nonpositive(-abs(x));
    let num = V::select(x.lt(V::splat(0.0)), e, V::splat(1.0));
    num / (V::splat(1.0) + e)
}

/// The recurrent layers' gates' tanh: a + a³·P(a²) for a = |x| < 0.625 (as [`tanh`]), else
/// (1 − e)/(1 + e) with e = e^−2a (≤ 0.29, so that 1 − e does not cancel); the sign of x
/// restored. Fewer operations than [`tanh`], whose e^2a is formed to 0.8 ulp: within 1.55 ulp
/// (and 1.6e-7 relative) of the f64 function, as the tests check over the float range.
#[inline(always)]
pub(crate) fn gate_tanh<V: Lanes>(x: V) -> V {
    let a = abs(x);
    let s = a * a;
    let small = (a * s).mul_add(poly(s, &TANH_P), a);
    let one = V::splat(1.0);
    let e = exp_nonpositive(-(a + a));
    let large = (one - e) / (one + e);
    with_sign_of(V::select(a.lt(V::splat(TANH_SPLIT)), small, large), x)
}

/// e^x − 1 = (2ⁿ·hi − 1) + 2ⁿ·lo from [`ExpParts`] (hi + lo = e^r, x = n·ln2 + r): 2ⁿ·hi − 1 is
/// exact for 2ⁿ·hi from ½ to 2 and rounds once below, and for n = 0 (|x| ≤ ln2/2) it is
/// hi − 1 = r − (the rounding of hi), which lo holds, so that the result keeps its relative
/// accuracy near 0 (where e^x − 1 would cancel). Below −104 (clamped) it is −1; above 89, ∞.
#[inline(always)]
pub(super) fn expm1<V: Lanes>(x: V) -> V {
    let e = ExpParts::at(x, 0.0);
    // the sign of x, for −0 (the magnitude's own sign is x's everywhere else)
    with_sign_of(abs((e.scale(e.hi) - V::splat(1.0)) + e.scale(e.lo)), x)
}

/// The logistic function's parts at x, both ways round: with e = e^−|x| (unrounded, as
/// e_hi + e_lo) and d = 1 + e (exactly, as d_hi + d_lo), σ(|x|) = 1/d and σ(−|x|) = e/d. Each is
/// the quotient of the rounded parts corrected by its residual, to first order (see
/// [`sigmoid`]); σ(−|x|) is formed 2^k times too large (k integral in [0, 24]), so that it keeps
/// its relative accuracy where it is subnormal once scaled down.
struct Logistic<V> {
    /// σ(|x|)
    upper: V,
    /// σ(−|x|)·2^k
    lower_2k: V,
}

impl<V: Lanes> Logistic<V> {
    #[inline(always)]
    fn at(x: V, k: f32) -> Logistic<V> {
        let parts = ExpParts::at(-abs(x), k);
        let hi = parts.hi + parts.lo;
        // e·2^k as e_hi + e_lo, then e itself (exactly, unless it is subnormal, where it is
        // below an ulp of 1 and only d_lo sees it)
        let (e_hi, e_lo) = (parts.scale(hi), parts.scale(parts.lo - (hi - parts.hi)));
        let unscale = V::splat(f32::from_bits(((127.0 - k) as u32) << 23));
        let one = V::splat(1.0);
        let d_hi = e_hi.mul_add(unscale, one);
        let d_lo = (e_hi * unscale - (d_hi - one)) + e_lo * unscale;
        Logistic { upper: quotient(one, V::splat(0.0), d_hi, d_lo), lower_2k: quotient(e_hi, e_lo, d_hi, d_lo) }
    }
}

/// (n_hi + n_lo)/(d_hi + d_lo): the quotient of the rounded parts, corrected by its residual to
/// first order. (A function, not a closure: it must be inlined into the `#[target_feature]`
/// entry points, see `vmath`.)
#[inline(always)]
fn quotient<V: Lanes>(n_hi: V, n_lo: V, d_hi: V, d_lo: V) -> V {
    let q = (n_hi + n_lo) / d_hi;
    let residual = (-q).mul_add(d_hi, n_hi) + (-q).mul_add(d_lo, n_lo);
    q + residual / d_hi
}

/// SiLU's σ(−|x|) is formed 2^LOGISTIC_K times too large, and scaled down by [`TWO_M24`].
const LOGISTIC_K: f32 = 24.0;
/// 2⁻²⁴
const TWO_M24: f32 = 1.0 / 16_777_216.0;

/// SiLU x·σ(x): x·σ(x) for x ≥ 0; for x < 0, (x·σ(x)·2²⁴)·2⁻²⁴ (rounded once more where it is
/// subnormal), with x held at −200 or above so that −∞ gives −0 rather than −∞·0.
#[inline(always)]
pub(super) fn silu<V: Lanes>(x: V) -> V {
    let l = Logistic::at(x, LOGISTIC_K);
    let negative = V::splat(-200.0).max(x) * l.lower_2k * V::splat(TWO_M24);
    V::select(x.lt(V::splat(0.0)), negative, x * l.upper)
}

/// SiLU′ = σ(x)·(1 + x·σ(−x)): σ(−x) = 1 − σ(x) formed directly rather than by the subtraction,
/// which would lose its relative accuracy for large x. For x < 0, σ(x) is the scaled lower part,
/// and x is held at −200 or above as in [`silu`].
#[inline(always)]
pub(super) fn silu_derivative<V: Lanes>(x: V) -> V {
    let l = Logistic::at(x, LOGISTIC_K);
    let lower = l.lower_2k * V::splat(TWO_M24);
    let one = V::splat(1.0);
    // x held at 200 or below, so that +∞ gives 1 rather than ∞·0
    let positive = l.upper * V::splat(200.0).min(x).mul_add(lower, one);
    let xc = V::splat(-200.0).max(x);
    let negative = l.lower_2k * xc.mul_add(l.upper, one) * V::splat(TWO_M24);
    V::select(x.lt(V::splat(0.0)), negative, positive)
}

/// ln(1 + t) for t in [0, 1]: 2·atanh(s) with s = t/(2 + t) in [0, ⅓], the series
/// 2s + 2s³·P(s²). 2 + t is kept exact as a sum of two floats, and q = 2s = 2t/(2 + t) (formed
/// as such, so that it is not halved into the subnormals) is corrected by its residual, so that
/// it is within about half an ulp.
#[inline(always)]
fn log1p_unit<V: Lanes>(t: V) -> V {
    let two = V::splat(2.0);
    let d = two + t;
    let d_lo = t - (d - two);
    let t2 = t + t;
    let q = t2 / d;
    let q = q + ((-q).mul_add(d, t2) - q * d_lo) / d;
    let s2 = V::splat(0.25) * q * q;
    (q * s2).mul_add(poly(s2, &LOG1P_P), q)
}

/// Softplus ln(1 + e^x) = max(x, 0) + ln(1 + e^−|x|), which is x itself from 17 on (e^−17 is
/// below half an ulp of 17), as PyTorch's threshold of 20 gives.
#[inline(always)]
pub(super) fn softplus<V: Lanes>(x: V) -> V {
    let tail = log1p_unit(exp(-abs(x)));
    V::splat(0.0).max(x) + tail
}
/// φ(a)·2⁴⁰ = e^{−a²/2}/√(2π)·2⁴⁰ for 0 ≤ a ≤ 15 (NaN passes), normal throughout (2⁻¹²³ at
/// a = 15), so that the products formed with it round once, where they are scaled back down
/// into the subnormals. a² = 2n·ln2 + v, so e^{−a²/2} = 2⁻ⁿ·e^{−v/2}, with n = round(a²/(2·ln2))
/// held in the low bits of `biased` beside the exponent bias and GAUSS_K, so that `biased`
/// shifted into the exponent field is 2⁴⁰⁻ⁿ. n·2·LN2_HI is exact, so v = (a² − n·2·LN2_HI) −
/// n·2·LN2_LO rounds twice, each time by at most 2⁻²⁵ (|v| < 0.8), with a² exact inside the FMA
/// (a²'s own rounding would cost up to a²·2⁻²⁵ relative).
#[inline(always)]
fn density_2p40<V: Lanes>(a: V) -> V {
    let bias = ROUND + 127.0 + GAUSS_K;
    let biased = (a * a).mul_add(V::splat(-0.5 * LOG2_E), V::splat(bias));
    let minus_n = biased - V::splat(bias);
    let v = minus_n.mul_add(V::splat(2.0 * LN2_LO), a.mul_add(a, minus_n * V::splat(2.0 * LN2_HI)));
    poly(v, &GAUSS_P) * biased.shl23()
}

/// The Mills ratio's parts at a ≥ 0: Φ(−a)/φ(a) = q/(a·q + p). An error in q or p moves the
/// ratio by it times p/(a·q + p) only (q enters both sides), which is below 1/(1 + a²), so the
/// Horner sums' roundings, which grow with a, do not show in it.
#[inline(always)]
fn mills_parts<V: Lanes>(a: V) -> (V, V) {
    (poly(a, &MILLS_Q), poly(a, &MILLS_P))
}

/// GELU x·Φ(x) = max(x, 0) − a·m·φ(a), with a = min(|x|, 15), φ(a) and the Mills ratio
/// m = Φ(−a)/φ(a) (for x ≥ 0, a = x, or a·m·φ is 0 beside x). a·m is one rounded quotient,
/// a·q/(a·q + p), with the rounded a·q on both sides, so that its rounding is damped as q's is;
/// x below −15 gives −0 (where −∞·0 would be NaN), and −0 gives −0 (`max` returns its second
/// operand). One path for the whole range: no branch of it is computed and thrown away.
#[inline(always)]
pub(super) fn gelu<V: Lanes>(x: V) -> V {
    let a = V::splat(GELU_CLAMP).min(abs(x));
    let (q, p) = mills_parts(a);
    let aq = a * q;
    let tail_2p40 = aq / (aq + p) * density_2p40(a);
    tail_2p40.mul_add(V::splat(-TWO_M40), V::splat(0.0).max(x))
}

/// GELU′ = Φ(x) + x·φ(x), with a, φ(a) and m as in [`gelu`]: Φ(−a) − a·φ(a) = φ·(m − a) for
/// x < 0, 1 − φ·(m − a) for x ≥ 0.
#[inline(always)]
pub(super) fn gelu_derivative<V: Lanes>(x: V) -> V {
    let a = V::splat(GELU_CLAMP).min(abs(x));
    let (q, p) = mills_parts(a);
    let lower_2p40 = density_2p40(a) * (q / a.mul_add(q, p) - a);
    let positive = lower_2p40.mul_add(V::splat(-TWO_M40), V::splat(1.0));
    V::select(x.lt(V::splat(0.0)), lower_2p40 * V::splat(TWO_M40), positive)
}

/// A one-argument kernel, as a type, so that the loops call it directly (and inline it).
pub(super) trait Unary {
    fn at<V: Lanes>(x: V) -> V;
}

/// A two-argument kernel, as [`Unary`].
pub(super) trait Binary {
    fn at<V: Lanes>(a: V, b: V) -> V;
}

macro_rules! unary {
    ($name:ident, $f:ident) => {
        pub(super) struct $name;
        impl Unary for $name {
            #[inline(always)]
            fn at<V: Lanes>(x: V) -> V {
                $f(x)
            }
        }
    };
}

unary!(Exp, exp);
unary!(Expm1, expm1);
unary!(Tanh, tanh);
unary!(Sigmoid, sigmoid);
unary!(Gelu, gelu);
unary!(Silu, silu);
unary!(Softplus, softplus);
#[cfg(test)]
unary!(GateSigmoid, gate_sigmoid);
#[cfg(test)]
unary!(GateTanh, gate_tanh);

/// dy·GELU′(z)
pub(super) struct GeluBackward;

impl Binary for GeluBackward {
    #[inline(always)]
    fn at<V: Lanes>(z: V, dy: V) -> V {
        dy * gelu_derivative(z)
    }
}

/// dy·SiLU′(z)
pub(super) struct SiluBackward;

impl Binary for SiluBackward {
    #[inline(always)]
    fn at<V: Lanes>(z: V, dy: V) -> V {
        dy * silu_derivative(z)
    }
}

/// dy·σ(z): the softplus's derivative
pub(super) struct SigmoidTimes;

impl Binary for SigmoidTimes {
    #[inline(always)]
    fn at<V: Lanes>(z: V, dy: V) -> V {
        dy * sigmoid(z)
    }
}
