//! Transcendentals over slices of f32, vectorised: e^x for the softmax, and for the activation
//! passes tanh, the logistic sigmoid, the GELU and the SiLU with their derivatives, e^x − 1 for
//! the ELU and the softplus.
//!
//! Each kernel is written once (`kernels.rs`) over [`lanes::Lanes`] and compiled three times:
//! for AVX-512F (16 lanes), for AVX2+FMA (8 lanes), and as the portable one-lane fallback; the
//! widest the CPU runs is chosen at run time. The three paths perform the same IEEE operations
//! in the same order (fused multiply-adds everywhere; the fallback's `f32::mul_add` is a library
//! call on an x86 without FMA, correct but slow), so they give the same bits, which the tests
//! check.
//!
//! Bounds are against the exact value, in ulps of it in f32 (2⁻¹⁴⁹ where it is subnormal; an ulp
//! is 6e-8 to 1.2e-7 of a normal value), as measured over every f32 of magnitude 2⁻³⁰ to 2⁷ (the
//! `exhaustive` test; below and above the kernels are trivial or saturate, and sampled sweeps
//! cover them). NaN in gives NaN out, ±∞ the function's limit, and no other input gives NaN.
//!
//! - e^x: 0.8 ulp (6.2e-8 relative);
//! - tanh: 1.35 ulp (1.5e-7);
//! - sigmoid: 0.85 ulp (8.9e-8);
//! - GELU: 4.65 ulp (3.2e-7);
//! - GELU′, which crosses zero: 4.65 ulp of the larger of Φ(x) and |x|·φ(x) (3.4e-7 of it);
//! - e^x − 1: 1.15 ulp (1.2e-7);
//! - SiLU x·σ(x): 1.5 ulp (1.2e-7);
//! - SiLU′ = σ(x)·(1 + x·σ(−x)), which crosses zero: 2.6 ulp of the larger of σ(x) and
//!   |x|·σ(x)·σ(−x) (1.9e-7 of it);
//! - softplus ln(1 + e^x): 2.0 ulp (1.8e-7);
//! - the recurrent gates' tanh and sigmoid (`kernels::gate_tanh`, `kernels::gate_sigmoid`, fewer
//!   operations and divisions): 1.55 ulp (1.6e-7) and 2.45 ulp (1.8e-7).
//!
//! The relative figures are for normal results; subnormal ones are within the ulp bounds in
//! units of 2⁻¹⁴⁹.

pub(crate) mod epilogue;
pub(crate) mod kernels;
pub(crate) mod lanes;
#[cfg(test)]
mod tests;

use kernels::{Binary, Exp, Expm1, Gelu, GeluBackward, Sigmoid, SigmoidTimes, Silu, SiluBackward, Softplus, Tanh, Unary};
use lanes::Lanes;

/// An instruction set the kernels are compiled for (also the recurrent layers', `cpu::recurrent`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Portable,
    Avx2,
    Avx512,
}

impl Isa {
    /// The widest this CPU runs, capped by `FLATNN_ISA` as the GEMM's is ([`crate::cpu::isa`]).
    pub(crate) fn best() -> Isa {
        match crate::cpu::isa::Isa::best() {
            crate::cpu::isa::Isa::Portable => Isa::Portable,
            crate::cpu::isa::Isa::Avx2 => Isa::Avx2,
            crate::cpu::isa::Isa::Avx512 => Isa::Avx512,
        }
    }

    /// Whether this CPU runs it.
    pub(crate) fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::has_avx2_fma(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => super::has_avx2_fma() && is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }
}

/// e^v in place. Within 0.8 ulp.
pub(crate) fn exp_in_place(v: &mut [f32]) {
    in_place::<Exp>(Isa::best(), v);
}

/// y = tanh(z). Within 1.35 ulp.
pub(crate) fn tanh(z: &[f32], y: &mut [f32]) {
    unary::<Tanh>(Isa::best(), z, y);
}

/// y = 1/(1 + e^−z). Within 0.85 ulp.
pub(crate) fn sigmoid(z: &[f32], y: &mut [f32]) {
    unary::<Sigmoid>(Isa::best(), z, y);
}

/// y = z·Φ(z), Φ the standard normal CDF. Within 4.65 ulp (3.2e-7 relative).
pub(crate) fn gelu(z: &[f32], y: &mut [f32]) {
    unary::<Gelu>(Isa::best(), z, y);
}

/// dz = dy·GELU′(z), GELU′(z) = Φ(z) + z·φ(z): GELU′ within 4.65 ulp of max(Φ(z), |z|·φ(z))
/// (it crosses zero), dz then rounded once more.
pub(crate) fn gelu_backward(z: &[f32], dy: &[f32], dz: &mut [f32]) {
    binary::<GeluBackward>(Isa::best(), z, dy, dz);
}

/// y = e^z − 1, accurate near 0. Within 1.15 ulp.
pub(crate) fn expm1(z: &[f32], y: &mut [f32]) {
    unary::<Expm1>(Isa::best(), z, y);
}

/// y = z·σ(z) (SiLU). Within 1.5 ulp.
pub(crate) fn silu(z: &[f32], y: &mut [f32]) {
    unary::<Silu>(Isa::best(), z, y);
}

/// dz = dy·SiLU′(z), SiLU′(z) = σ(z)·(1 + z·σ(−z)): SiLU′ within 2.6 ulp of max(σ(z),
/// |z|·σ(z)·σ(−z)) (it crosses zero), dz then rounded once more.
pub(crate) fn silu_backward(z: &[f32], dy: &[f32], dz: &mut [f32]) {
    binary::<SiluBackward>(Isa::best(), z, dy, dz);
}

/// y = ln(1 + e^z) (softplus). Within 2.0 ulp.
pub(crate) fn softplus(z: &[f32], y: &mut [f32]) {
    unary::<Softplus>(Isa::best(), z, y);
}

/// dz = dy·σ(z), the softplus's derivative: σ within 0.85 ulp, dz then rounded once more.
pub(crate) fn sigmoid_times(z: &[f32], dy: &[f32], dz: &mut [f32]) {
    binary::<SigmoidTimes>(Isa::best(), z, dy, dz);
}

/// y = K(x) on `isa`.
fn unary<K: Unary>(isa: Isa, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "vmath: input and output differ in length");
    assert!(isa.available(), "vmath: {isa:?} is not available on this CPU");
    match isa {
        Isa::Portable => map::<f32, K>(x, y),
        // SAFETY: the CPU has the instruction set (checked above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::map::<K>(x, y) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::map::<K>(x, y) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

/// v = K(v) on `isa`.
fn in_place<K: Unary>(isa: Isa, v: &mut [f32]) {
    assert!(isa.available(), "vmath: {isa:?} is not available on this CPU");
    match isa {
        Isa::Portable => map_in_place::<f32, K>(v),
        // SAFETY: the CPU has the instruction set (checked above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::map_in_place::<K>(v) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::map_in_place::<K>(v) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

/// out = K(a, b) on `isa`.
fn binary<K: Binary>(isa: Isa, a: &[f32], b: &[f32], out: &mut [f32]) {
    assert!(a.len() == out.len() && b.len() == out.len(), "vmath: the inputs and the output differ in length");
    assert!(isa.available(), "vmath: {isa:?} is not available on this CPU");
    match isa {
        Isa::Portable => map2::<f32, K>(a, b, out),
        // SAFETY: the CPU has the instruction set (checked above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::map2::<K>(a, b, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::map2::<K>(a, b, out) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

// The loops below and the kernels they call are all `#[inline(always)]`, down to the lanes'
// intrinsics, so that they are compiled inside the `#[target_feature]` entry points: a call
// left standing (through a closure or a fn pointer) would run without the features.

/// y = K(x) over whole vectors, then the tail through a zero-padded vector.
#[inline(always)]
fn map<V: Lanes, K: Unary>(x: &[f32], y: &mut [f32]) {
    let (mut xs, mut ys) = (x.chunks_exact(V::LANES), y.chunks_exact_mut(V::LANES));
    for (x, y) in (&mut xs).zip(&mut ys) {
        K::at(V::load(x)).store(y);
    }
    let (xt, yt) = (xs.remainder(), ys.into_remainder());
    if !xt.is_empty() {
        let mut buf = [0.0f32; 16];
        buf[..xt.len()].copy_from_slice(xt);
        K::at(V::load(&buf)).store(&mut buf);
        yt.copy_from_slice(&buf[..yt.len()]);
    }
}

/// v = K(v), as [`map`].
#[inline(always)]
fn map_in_place<V: Lanes, K: Unary>(v: &mut [f32]) {
    let mut vs = v.chunks_exact_mut(V::LANES);
    for v in &mut vs {
        K::at(V::load(v)).store(v);
    }
    let vt = vs.into_remainder();
    if !vt.is_empty() {
        let mut buf = [0.0f32; 16];
        buf[..vt.len()].copy_from_slice(vt);
        K::at(V::load(&buf)).store(&mut buf);
        vt.copy_from_slice(&buf[..vt.len()]);
    }
}

/// out = K(a, b), as [`map`].
#[inline(always)]
fn map2<V: Lanes, K: Binary>(a: &[f32], b: &[f32], out: &mut [f32]) {
    let (mut as_, mut bs, mut outs) = (a.chunks_exact(V::LANES), b.chunks_exact(V::LANES), out.chunks_exact_mut(V::LANES));
    for ((a, b), out) in (&mut as_).zip(&mut bs).zip(&mut outs) {
        K::at(V::load(a), V::load(b)).store(out);
    }
    let (at, bt, outt) = (as_.remainder(), bs.remainder(), outs.into_remainder());
    if !at.is_empty() {
        let (mut abuf, mut bbuf) = ([0.0f32; 16], [0.0f32; 16]);
        abuf[..at.len()].copy_from_slice(at);
        bbuf[..bt.len()].copy_from_slice(bt);
        K::at(V::load(&abuf), V::load(&bbuf)).store(&mut abuf);
        outt.copy_from_slice(&abuf[..outt.len()]);
    }
}

/// The loops compiled for one instruction set.
macro_rules! instantiate {
    ($name:ident, $lanes:ty, $features:literal) => {
        mod $name {
            use super::*;

            #[target_feature(enable = $features)]
            pub(super) fn map<K: Unary>(x: &[f32], y: &mut [f32]) {
                super::map::<$lanes, K>(x, y)
            }

            #[target_feature(enable = $features)]
            pub(super) fn map_in_place<K: Unary>(v: &mut [f32]) {
                super::map_in_place::<$lanes, K>(v)
            }

            #[target_feature(enable = $features)]
            pub(super) fn map2<K: Binary>(a: &[f32], b: &[f32], out: &mut [f32]) {
                super::map2::<$lanes, K>(a, b, out)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
instantiate!(avx2, lanes::Avx2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
instantiate!(avx512, lanes::Avx512, "avx512f");
