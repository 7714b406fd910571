//! The kernels against f64 references over the whole f32 range, the paths against each other
//! bit for bit, special values, and the slice loops on odd lengths with poisoned outputs.

use super::kernels::{GateSigmoid, GateTanh};
use super::*;
use std::f64::consts::{PI, SQRT_2};

/// erf(x) for 0 ≤ x < 3: (2/√π)·e^{−x²}·Σ (2x²)ⁿ·x / (1·3·…·(2n+1)), every term positive.
fn erf_series(x: f64) -> f64 {
    let (mut term, mut sum, mut n) = (x, x, 0.0);
    while term > 1e-17 * sum {
        n += 1.0;
        term *= 2.0 * x * x / (2.0 * n + 1.0);
        sum += term;
    }
    2.0 / PI.sqrt() * (-x * x).exp() * sum
}

/// erfc(x) for x ≥ 3: e^{−x²}/√π / (x + ½/(x + 1/(x + (3/2)/(x + …)))), 50 levels deep
/// (0 from 27 on, where e^{−x²} underflows f64).
fn erfc_fraction(x: f64) -> f64 {
    if x > 27.0 {
        return 0.0;
    }
    let f = (1..=50).rev().fold(x, |f, k| x + k as f64 / 2.0 / f);
    (-x * x).exp() / PI.sqrt() / f
}

/// erfc(x) to about 1e-11 relative (1 − erf loses some digits below 3).
fn erfc_ref(x: f64) -> f64 {
    if x < 0.0 {
        2.0 - erfc_ref(-x)
    } else if x < 3.0 {
        1.0 - erf_series(x)
    } else {
        erfc_fraction(x)
    }
}

fn normal_cdf_ref(x: f64) -> f64 {
    0.5 * erfc_ref(-x / SQRT_2)
}

fn normal_density_ref(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * PI).sqrt()
}

fn sigmoid_ref(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        x.exp() / (1.0 + x.exp())
    }
}

/// A kernel, its f64 reference with the size its error is measured against (the exact result,
/// except for GELU′, which crosses zero: the larger of its two terms), and its bounds: in ulps
/// of that size, and relative to it where it is a normal f32.
struct Case {
    name: &'static str,
    run: fn(Isa, &[f32], &mut [f32]),
    reference: fn(f64) -> (f64, f64),
    bound: f64,
    relative: f64,
}

fn gelu_derivative_on(isa: Isa, x: &[f32], y: &mut [f32]) {
    binary::<GeluBackward>(isa, x, &vec![1.0; x.len()], y);
}

fn silu_derivative_on(isa: Isa, x: &[f32], y: &mut [f32]) {
    binary::<SiluBackward>(isa, x, &vec![1.0; x.len()], y);
}

/// ln(1 + e^x) in f64: max(x, 0) + ln(1 + e^−|x|).
fn softplus_ref(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

fn cases() -> [Case; 11] {
    [
        Case { name: "exp", run: unary::<Exp>, reference: |x| (x.exp(), x.exp()), bound: 0.8, relative: 6.2e-8 },
        Case { name: "tanh", run: unary::<Tanh>, reference: |x| (x.tanh(), x.tanh()), bound: 1.35, relative: 1.5e-7 },
        Case { name: "sigmoid", run: unary::<Sigmoid>, reference: |x| (sigmoid_ref(x), sigmoid_ref(x)), bound: 0.85, relative: 8.9e-8 },
        Case {
            name: "gelu",
            run: unary::<Gelu>,
            reference: |x| (x * normal_cdf_ref(x), x * normal_cdf_ref(x)),
            bound: 4.65,
            relative: 3.2e-7,
        },
        Case {
            name: "gelu'",
            run: gelu_derivative_on,
            reference: |x| {
                let (cdf, density) = (normal_cdf_ref(x), x * normal_density_ref(x));
                (cdf + density, cdf.max(density.abs()))
            },
            bound: 4.65,
            relative: 3.4e-7,
        },
        Case { name: "expm1", run: unary::<Expm1>, reference: |x| (x.exp_m1(), x.exp_m1()), bound: 1.15, relative: 1.2e-7 },
        Case { name: "silu", run: unary::<Silu>, reference: |x| (x * sigmoid_ref(x), x * sigmoid_ref(x)), bound: 1.5, relative: 1.2e-7 },
        Case {
            name: "silu'",
            run: silu_derivative_on,
            reference: |x| {
                let (s, t) = (sigmoid_ref(x), x * sigmoid_ref(x) * sigmoid_ref(-x));
                (s + t, s.max(t.abs()))
            },
            bound: 2.6,
            relative: 1.9e-7,
        },
        Case { name: "softplus", run: unary::<Softplus>, reference: |x| (softplus_ref(x), softplus_ref(x)), bound: 2.0, relative: 1.8e-7 },
        Case { name: "gate tanh", run: unary::<GateTanh>, reference: |x| (x.tanh(), x.tanh()), bound: 1.55, relative: 1.6e-7 },
        Case {
            name: "gate sigmoid",
            run: unary::<GateSigmoid>,
            reference: |x| (sigmoid_ref(x), sigmoid_ref(x)),
            bound: 2.45,
            relative: 1.8e-7,
        },
    ]
}

/// An ulp of f32 at |v|: 2^(e−23) for |v| in [2^e, 2^(e+1)), 2⁻¹⁴⁹ below the normal range,
/// 2¹⁰⁴ from the top binade up.
fn ulp(v: f64) -> f64 {
    let e = ((v.abs().to_bits() >> 52) & 0x7ff) as i64 - 1023;
    f64::from_bits(((e.clamp(-126, 127) - 23 + 1023) as u64) << 52)
}

/// |got − want|, with ∞ counted as 2¹²⁸ (one ulp past the largest finite f32) and a NaN as an
/// infinite error.
fn abs_err(got: f32, want: f64) -> f64 {
    let top = 2f64.powi(128);
    let got = if got.is_infinite() { top.copysign(got as f64) } else { got as f64 };
    let err = (got - want.clamp(-top, top)).abs();
    if err.is_nan() {
        f64::INFINITY
    } else {
        err
    }
}

/// The largest error of `case` on `isa` over `xs` (NaN inputs skipped): in ulps, with its
/// input and output, and relative to the scale where that is a normal f32 (which ulps overstate
/// by up to 2× at the bottom of a binade).
#[derive(Clone, Copy, Default)]
struct Worst {
    ulps: f64,
    x: f32,
    y: f32,
    relative: f64,
}

impl Worst {
    fn max(self, other: Worst) -> Worst {
        let mut out = if other.ulps > self.ulps { other } else { self };
        out.relative = self.relative.max(other.relative);
        out
    }
}

/// The references are computed on every core.
fn max_error(case: &Case, isa: Isa, xs: &[f32]) -> Worst {
    let mut ys = vec![f32::NAN; xs.len()];
    (case.run)(isa, xs, &mut ys);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = xs.len().div_ceil(threads).max(1);
    let worst = |(xs, ys): (&[f32], &[f32])| {
        let mut worst = Worst::default();
        for (&x, &y) in xs.iter().zip(ys).filter(|(x, _)| !x.is_nan()) {
            let (want, scale) = (case.reference)(x as f64);
            let err = abs_err(y, want);
            let relative = if scale.abs() >= f32::MIN_POSITIVE as f64 { err / scale.abs() } else { 0.0 };
            let ulps = err / ulp(scale);
            worst = worst.max(Worst { ulps, x, y, relative });
        }
        worst
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = xs.chunks(chunk).zip(ys.chunks(chunk)).map(|pair| s.spawn(move || worst(pair))).collect();
        handles.into_iter().map(|h| h.join().expect("a sweep thread panicked")).fold(Worst::default(), Worst::max)
    })
}

/// Prints the worst error and asserts the bound.
fn report(case: &Case, isa: Isa, worst: Worst) {
    let Worst { ulps, x, y, relative } = worst;
    println!("{isa:?} {}: max {ulps:.3} ulp at x = {x:e} (got {y:e}), max relative {relative:.2e}", case.name);
    let want = (case.reference)(x as f64).0;
    assert!(ulps <= case.bound, "{isa:?} {}: {ulps} ulp at x = {x:e} ({:#x}): got {y:e}, want {want:e}", case.name, x.to_bits());
    assert!(relative <= case.relative, "{isa:?} {}: relative error {relative:e}", case.name);
}

/// 2^log2_count bit patterns evenly spaced over all 2³² (each with a scrambled low part, so
/// every exponent, both signs, NaNs and infinities are met with varied mantissas), then runs of
/// consecutive floats around where a kernel changes formula or its result saturates, overflows
/// or underflows.
fn sweep(log2_count: u32) -> Vec<f32> {
    let shift = 32 - log2_count;
    let mut xs: Vec<f32> = (0..1u64 << log2_count)
        .map(|k| f32::from_bits(((k << shift) as u32) | ((k as u32).wrapping_mul(0x9e37_79b9) >> log2_count)))
        .collect();
    let edges = [
        0.3466,
        0.5,
        0.625,
        1.0,
        1.0 / SQRT_2 as f32,
        1.2785,
        SQRT_2 as f32,
        9.01,
        10.0,
        14.5,
        15.0,
        17.0,
        87.3,
        88.72,
        89.0,
        103.9,
        104.0,
        120.6,
        200.0,
    ];
    for edge in edges {
        for sign in [1.0f32, -1.0] {
            let bits = (sign * edge).to_bits();
            xs.extend((bits - 2048..bits + 2048).map(f32::from_bits));
        }
    }
    xs
}

/// The sweep's size: 2²⁴ patterns in release, 2¹⁸ in a debug build.
fn log2_sweep() -> u32 {
    if cfg!(debug_assertions) {
        18
    } else {
        24
    }
}

/// Every case within its bound on `isa` over `xs`.
fn check_bounds(isa: Isa, xs: &[f32]) {
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    for case in cases() {
        report(&case, isa, max_error(&case, isa, xs));
    }
}

/// Every case on `isa` gives the portable path's bits over `xs`.
fn check_same_bits(isa: Isa, xs: &[f32]) {
    for case in cases() {
        let (mut got, mut want) = (vec![f32::NAN; xs.len()], vec![f32::NAN; xs.len()]);
        (case.run)(isa, xs, &mut got);
        (case.run)(Isa::Portable, xs, &mut want);
        let differs = |i: &usize| got[*i].to_bits() != want[*i].to_bits() && !(got[*i].is_nan() && want[*i].is_nan());
        if let Some(i) = (0..xs.len()).find(differs) {
            panic!("{isa:?} {}: x = {:e} gives {:e}, the portable path {:e}", case.name, xs[i], got[i], want[i]);
        }
    }
}

/// The portable path is slow on an x86 without FMA hardware (`mul_add` is a library call), so it
/// is swept 64 times more sparsely; the vector paths, swept densely, must give its bits.
#[test]
fn portable_kernels_are_within_their_bounds() {
    check_bounds(Isa::Portable, &sweep(log2_sweep() - 6));
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_kernels_are_within_their_bounds_and_give_the_portable_bits() {
    check_bounds(Isa::Avx2, &sweep(log2_sweep()));
    check_same_bits(Isa::Avx2, &sweep(log2_sweep() - 6));
}

#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512F: run with --include-ignored on a host that has it"]
fn avx512_kernels_are_within_their_bounds_and_give_the_portable_bits() {
    check_bounds(Isa::Avx512, &sweep(log2_sweep()));
    check_same_bits(Isa::Avx512, &sweep(log2_sweep() - 6));
}

/// The instruction sets this CPU runs.
fn available() -> Vec<Isa> {
    [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|isa| isa.available()).collect()
}

#[test]
fn special_values_give_the_limits() {
    let (inf, max, tiny) = (f32::INFINITY, f32::MAX, f32::from_bits(1));
    let nans = [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0xffc0_1234)];
    let ln2 = std::f32::consts::LN_2;
    #[rustfmt::skip]
    let table: [(&str, &[(f32, f32)]); 11] = [
        ("exp", &[(inf, inf), (-inf, 0.0), (0.0, 1.0), (-0.0, 1.0), (89.0, inf), (-104.0, 0.0), (max, inf), (-max, 0.0)]),
        ("tanh", &[(inf, 1.0), (-inf, -1.0), (0.0, 0.0), (-0.0, -0.0), (max, 1.0), (-max, -1.0), (tiny, tiny), (-tiny, -tiny)]),
        ("sigmoid", &[(inf, 1.0), (-inf, 0.0), (0.0, 0.5), (-0.0, 0.5), (max, 1.0), (-max, 0.0)]),
        ("gelu", &[(inf, inf), (-inf, -0.0), (0.0, 0.0), (-0.0, -0.0), (max, max), (-max, -0.0)]),
        ("gelu'", &[(inf, 1.0), (-inf, -0.0), (0.0, 0.5), (-0.0, 0.5), (max, 1.0), (-max, -0.0)]),
        ("expm1", &[(inf, inf), (-inf, -1.0), (0.0, 0.0), (-0.0, -0.0), (89.0, inf), (-104.0, -1.0), (max, inf), (-max, -1.0), (tiny, tiny), (-tiny, -tiny)]),
        ("silu", &[(inf, inf), (-inf, -0.0), (0.0, 0.0), (-0.0, -0.0), (max, max), (-max, -0.0)]),
        ("silu'", &[(inf, 1.0), (-inf, -0.0), (0.0, 0.5), (-0.0, 0.5), (max, 1.0), (-max, -0.0)]),
        ("softplus", &[(inf, inf), (-inf, 0.0), (0.0, ln2), (-0.0, ln2), (max, max), (-max, 0.0), (20.0, 20.0), (-104.0, 0.0)]),
        ("gate tanh", &[(inf, 1.0), (-inf, -1.0), (0.0, 0.0), (-0.0, -0.0), (max, 1.0), (-max, -1.0), (tiny, tiny), (-tiny, -tiny)]),
        ("gate sigmoid", &[(inf, 1.0), (-inf, 0.0), (0.0, 0.5), (-0.0, 0.5), (max, 1.0), (-max, 0.0)]),
    ];
    for isa in available() {
        for (case, (name, pairs)) in cases().iter().zip(table) {
            assert_eq!(case.name, name);
            let xs: Vec<f32> = pairs.iter().map(|p| p.0).chain(nans).collect();
            let mut ys = vec![0.5f32; xs.len()];
            (case.run)(isa, &xs, &mut ys);
            for (&(x, want), &got) in pairs.iter().zip(&ys) {
                assert_eq!(got.to_bits(), want.to_bits(), "{isa:?} {name}({x:e}) = {got:e}, want {want:e}");
            }
            assert!(ys[pairs.len()..].iter().all(|y| y.is_nan()), "{isa:?} {name}: a NaN input gave {:?}", &ys[pairs.len()..]);
        }
    }
}

/// Odd lengths (whole vectors and tails), outputs inside a NaN-poisoned buffer: every output is
/// the portable kernel's value for its input, and nothing around the slice is written.
#[test]
fn slices_of_every_length_are_mapped_whole_and_alone() {
    let mut rng = crate::testutil::Rng::new(7);
    for isa in available() {
        for n in (0..=40).chain([255, 1001]) {
            let x: Vec<f32> = rng.uniform(n).iter().map(|v| 8.0 * v).collect();
            let dy = rng.uniform(n);
            let one = |f: &dyn Fn(&mut [f32])| {
                let mut buf = vec![f32::NAN; n + 2];
                f(&mut buf[1..n + 1]);
                assert!(buf[0].is_nan() && buf[n + 1].is_nan(), "{isa:?}, n = {n}: wrote outside the slice");
                buf[1..n + 1].to_vec()
            };
            let each = |f: &dyn Fn(&[f32], &mut [f32])| -> Vec<f32> {
                (0..n)
                    .map(|i| {
                        let mut y = [f32::NAN];
                        f(&x[i..i + 1], &mut y);
                        y[0]
                    })
                    .collect()
            };
            type Ops = (&'static str, fn(Isa, &[f32], &mut [f32]), fn(Isa, &mut [f32]));
            let ops: [Ops; 7] = [
                ("exp", unary::<Exp>, in_place::<Exp>),
                ("tanh", unary::<Tanh>, in_place::<Tanh>),
                ("sigmoid", unary::<Sigmoid>, in_place::<Sigmoid>),
                ("gelu", unary::<Gelu>, in_place::<Gelu>),
                ("expm1", unary::<Expm1>, in_place::<Expm1>),
                ("silu", unary::<Silu>, in_place::<Silu>),
                ("softplus", unary::<Softplus>, in_place::<Softplus>),
            ];
            for (name, map, map_in_place) in ops {
                let want = each(&|x, y| map(Isa::Portable, x, y));
                assert_eq!(one(&|y| map(isa, &x, y)), want, "{isa:?} {name}, n = {n}");
                let in_place_result = one(&|y| {
                    y.copy_from_slice(&x);
                    map_in_place(isa, y)
                });
                assert_eq!(in_place_result, want, "{isa:?} {name} in place, n = {n}");
            }
            type Binaries = (&'static str, fn(Isa, &[f32], &[f32], &mut [f32]));
            let binaries: [Binaries; 3] = [
                ("gelu_backward", binary::<GeluBackward>),
                ("silu_backward", binary::<SiluBackward>),
                ("sigmoid_times", binary::<SigmoidTimes>),
            ];
            for (name, map2) in binaries {
                let want: Vec<f32> = (0..n)
                    .map(|i| {
                        let mut dz = [f32::NAN];
                        map2(Isa::Portable, &x[i..i + 1], &dy[i..i + 1], &mut dz);
                        dz[0]
                    })
                    .collect();
                assert_eq!(one(&|dz| map2(isa, &x, &dy, dz)), want, "{isa:?} {name}, n = {n}");
            }
        }
    }
}

/// Every f32 of magnitude 2⁻³⁰ to 2⁷, where every kernel's formulas change, saturate or
/// underflow (beyond, the sweeps above see each exponent), on the widest instruction set:
/// where the bounds on the entry points come from.
#[test]
#[ignore = "every f32 from 2^-30 to 2^7 in magnitude: minutes"]
fn exhaustive() {
    let isa = Isa::best();
    let (lo, hi) = (2f32.powi(-30).to_bits(), 2f32.powi(7).to_bits());
    for case in cases() {
        let mut worst = Worst::default();
        for sign in [0, 1 << 31] {
            for start in (lo..hi).step_by(1 << 24) {
                let xs: Vec<f32> = (start..hi.min(start + (1 << 24))).map(|b| f32::from_bits(b | sign)).collect();
                worst = worst.max(max_error(&case, isa, &xs));
            }
        }
        report(&case, isa, worst);
    }
}
