//! Element-wise activations: y = act(z), and the derivative used by backprop.

use crate::cpu::vmath;
use crate::float::Float;

/// Defines [`Activation`] from one list, and what follows from the list alone: every kind
/// (`Activation::ALL`, each with its parameter at 0), each kind's name (model files write it,
/// with `:` and the parameter where it takes one; the CUDA sources define `act_apply_<name>` and
/// `act_derivative_<name>` for it) and its id on the GPU, its place in the list.
macro_rules! activations {
    (@zero $param:ident) => { 0.0 };
    (@ty $param:ident) => { f32 };
    ($( $(#[$doc:meta])* $kind:ident $(($param:ident))? = $name:literal, )*) => {
        /// An activation applied after a Dense or Conv layer.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum Activation {
            $( $(#[$doc])* $kind $((activations!(@ty $param)))?, )*
        }

        impl Activation {
            /// Every kind, in the order of their GPU ids, each with its parameter at 0.
            pub(crate) const ALL: &[Activation] = &[ $( Activation::$kind $((activations!(@zero $param)))?, )* ];

            /// The kind's name: `"relu"`, `"leaky_relu"`.
            pub(crate) fn kind_name(self) -> &'static str {
                match self { $( Activation::$kind { .. } => $name, )* }
            }

            /// The kind's id in the CUDA sources (`ACT_<NAME>`, `cuda::context`'s prelude): its
            /// place in [`Activation::ALL`].
            #[cfg(feature = "cuda")]
            pub(crate) fn gpu_id(self) -> i32 {
                enum Id { $( $kind, )* }
                match self { $( Activation::$kind { .. } => Id::$kind as i32, )* }
            }
        }
    };
}

activations! {
    /// y = z
    Identity = "identity",
    /// y = max(0, z)
    Relu = "relu",
    /// y = z for z > 0, else slope·z (PyTorch's default slope is 0.01)
    LeakyRelu(slope) = "leaky_relu",
    /// y = tanh(z)
    Tanh = "tanh",
    /// y = 1 / (1 + e^−z)
    Sigmoid = "sigmoid",
    /// y = z·Φ(z), Φ the standard normal CDF (PyTorch's exact `GELU()`, erf-based)
    Gelu = "gelu",
    /// y = z·σ(z) = z / (1 + e^−z) (PyTorch's `SiLU()`, also called swish)
    Silu = "silu",
    /// y = z for z > 0, else alpha·(e^z − 1) (PyTorch's `ELU(alpha)`; its default alpha is 1)
    Elu(alpha) = "elu",
    /// y = ln(1 + e^z), and z itself above 20 (PyTorch's `Softplus()`: beta 1, threshold 20)
    Softplus = "softplus",
}

pub use Activation::{Elu, Gelu, Identity, LeakyRelu, Relu, Sigmoid, Silu, Softplus, Tanh};

/// Where Softplus is z itself (PyTorch's default threshold, with beta 1): beyond it ln(1 + e^z)
/// differs from z by less than e^−20 ≈ 2e-9.
const SOFTPLUS_THRESHOLD: f64 = 20.0;

const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

impl Activation {
    /// y = act(z).
    #[inline(always)]
    pub fn apply<F: Float>(self, z: F) -> F {
        match self {
            Identity => z,
            Relu => z.max(F::ZERO),
            LeakyRelu(slope) => {
                if z > F::ZERO {
                    z
                } else {
                    F::of(slope as f64) * z
                }
            }
            Tanh => z.tanh(),
            Sigmoid => F::ONE / (F::ONE + (-z).exp()),
            Gelu => z * normal_cdf(z),
            Silu => z / (F::ONE + (-z).exp()),
            Elu(alpha) => {
                if z > F::ZERO {
                    z
                } else {
                    F::of(alpha as f64) * z.exp_m1()
                }
            }
            Softplus => {
                if z > F::of(SOFTPLUS_THRESHOLD) {
                    z
                } else {
                    z.exp().ln_1p()
                }
            }
        }
    }

    /// What [`Activation::derivative`] reads: 1 for z, 2 for y (as a bit set, 0 for neither).
    /// The GPU's gradient kernel loads only those (kernels/activation.cu: the device functions
    /// read the same).
    #[cfg(feature = "cuda")]
    pub(crate) fn derivative_reads(self) -> i32 {
        match self {
            Identity => 0,
            Relu | LeakyRelu(_) | Gelu | Silu | Elu(_) | Softplus => 1,
            Tanh | Sigmoid => 2,
        }
    }

    /// d act / dz at z, given also y = act(z) (cheaper for tanh and sigmoid).
    #[inline(always)]
    pub fn derivative<F: Float>(self, z: F, y: F) -> F {
        match self {
            Identity => F::ONE,
            Relu => {
                if z > F::ZERO {
                    F::ONE
                } else {
                    F::ZERO
                }
            }
            LeakyRelu(slope) => {
                if z > F::ZERO {
                    F::ONE
                } else {
                    F::of(slope as f64)
                }
            }
            Tanh => F::ONE - y * y,
            Sigmoid => y * (F::ONE - y),
            // d/dz z·Φ(z) = Φ(z) + z·φ(z)
            Gelu => normal_cdf(z) + z * F::of(FRAC_1_SQRT_2PI) * (-(z * z) * F::of(0.5)).exp(),
            // d/dz z·σ(z) = σ(z)·(1 + z·(1 − σ(z)))
            Silu => {
                let s = F::ONE / (F::ONE + (-z).exp());
                s * (F::ONE + z * (F::ONE - s))
            }
            // alpha·e^z rather than y + alpha, which cancels to 0 where e^z is below an ulp
            Elu(alpha) => {
                if z > F::ZERO {
                    F::ONE
                } else {
                    F::of(alpha as f64) * z.exp()
                }
            }
            // σ(z)
            Softplus => {
                if z > F::of(SOFTPLUS_THRESHOLD) {
                    F::ONE
                } else {
                    F::ONE / (F::ONE + (-z).exp())
                }
            }
        }
    }

    /// `y[i] = act(z[i])` for every i: the fast CPU path of [`Activation::apply`], vectorised.
    ///
    /// Tanh, Sigmoid, Gelu, Silu, Elu and Softplus are polynomial approximations (AVX-512, AVX2
    /// or portable, all giving the same bits) within, of the exact value: tanh 1.35 ulp, sigmoid
    /// 0.85 ulp, GELU 5.25 ulp (3.6e-7 relative), SiLU 1.5 ulp, ELU's e^z − 1 1.15 ulp (then
    /// times alpha, rounded once more), softplus 2.0 ulp, measured over every f32 from 2⁻³⁰ to 2⁷
    /// in magnitude (`cpu::vmath`). ±∞ give the limits (GELU(−∞) and SiLU(−∞) are −0, where
    /// `apply` gives NaN) and NaN gives NaN. The others are exact.
    ///
    /// # Panics
    /// If `z` and `y` differ in length.
    pub fn apply_slice(self, z: &[f32], y: &mut [f32]) {
        assert_eq!(z.len(), y.len(), "apply_slice: z and y differ in length");
        // the match hoisted out of the loop so each arm vectorises
        fn map(z: &[f32], y: &mut [f32], f: impl Fn(f32) -> f32) {
            y.iter_mut().zip(z).for_each(|(y, &z)| *y = f(z));
        }
        match self {
            Identity => y.copy_from_slice(z),
            Relu => map(z, y, |v| Relu.apply(v)),
            LeakyRelu(_) => map(z, y, |v| self.apply(v)),
            Tanh => vmath::tanh(z, y),
            Sigmoid => vmath::sigmoid(z, y),
            Gelu => vmath::gelu(z, y),
            Silu => vmath::silu(z, y),
            Elu(alpha) => {
                // α·(e^z − 1) at every z, then z itself where it is positive
                vmath::expm1(z, y);
                y.iter_mut().zip(z).for_each(|(y, &z)| *y = if z > 0.0 { z } else { alpha * *y });
            }
            Softplus => vmath::softplus(z, y),
        }
    }

    /// `dz[i] = dy[i]·act′(z[i])` for every i, given y = act(z): the fast CPU path of
    /// [`Activation::derivative`]. Tanh′ = 1 − y² and sigmoid′ = y·(1 − y) are as there;
    /// GELU′ = Φ(z) + z·φ(z) and SiLU′ = σ(z)·(1 + z·σ(−z)) are vectorised and within 3.75 and
    /// 2.6 ulp of the larger of their two terms; ELU′ = alpha·e^z takes e^z within 0.8 ulp and
    /// softplus′ = σ(z) within 0.85 ulp (dz then has one or two more roundings).
    ///
    /// # Panics
    /// If the four slices differ in length.
    pub fn backward_slice(self, z: &[f32], y: &[f32], dy: &[f32], dz: &mut [f32]) {
        let n = dz.len();
        assert!(z.len() == n && y.len() == n && dy.len() == n, "backward_slice: the slices differ in length");
        fn map(z: &[f32], y: &[f32], dy: &[f32], dz: &mut [f32], f: impl Fn(f32, f32) -> f32) {
            for i in 0..dz.len() {
                dz[i] = dy[i] * f(z[i], y[i]);
            }
        }
        match self {
            Identity => dz.copy_from_slice(dy),
            Relu => map(z, y, dy, dz, |z, y| Relu.derivative(z, y)),
            LeakyRelu(_) => map(z, y, dy, dz, |z, y| self.derivative(z, y)),
            Tanh => map(z, y, dy, dz, |z, y| Tanh.derivative(z, y)),
            Sigmoid => map(z, y, dy, dz, |z, y| Sigmoid.derivative(z, y)),
            Gelu => vmath::gelu_backward(z, dy, dz),
            Silu => vmath::silu_backward(z, dy, dz),
            Elu(alpha) => {
                // e^z into dz, then dy·α·e^z, or dy where z is positive
                dz.copy_from_slice(z);
                vmath::exp_in_place(dz);
                for i in 0..n {
                    dz[i] = if z[i] > 0.0 { dy[i] } else { dy[i] * (alpha * dz[i]) };
                }
            }
            Softplus => vmath::sigmoid_times(z, dy, dz),
        }
    }

    /// Its parameter, where its kind takes one (leaky ReLU's slope).
    pub(crate) fn param(self) -> Option<f32> {
        match self {
            LeakyRelu(slope) => Some(slope),
            Elu(alpha) => Some(alpha),
            Identity | Relu | Tanh | Sigmoid | Gelu | Silu | Softplus => None,
        }
    }

    /// What its parameter is, for errors (`"leaky ReLU slope"`), where its kind takes one.
    pub(crate) fn param_name(self) -> Option<&'static str> {
        match self {
            LeakyRelu(_) => Some("leaky ReLU slope"),
            Elu(_) => Some("ELU alpha"),
            Identity | Relu | Tanh | Sigmoid | Gelu | Silu | Softplus => None,
        }
    }

    /// The same kind with parameter `value` (itself where the kind takes none).
    pub(crate) fn with_param(self, value: f32) -> Activation {
        match self {
            LeakyRelu(_) => LeakyRelu(value),
            Elu(_) => Elu(value),
            Identity | Relu | Tanh | Sigmoid | Gelu | Silu | Softplus => self,
        }
    }

    /// Its id and parameter (0 where it takes none), as the CUDA kernels take them.
    #[cfg(feature = "cuda")]
    pub(crate) fn gpu_code(self) -> (i32, f32) {
        (self.gpu_id(), self.param().unwrap_or(0.0))
    }

    /// The name used in model files (`"relu"`, `"leaky_relu:0.01"`, …).
    pub fn name(self) -> String {
        match self.param() {
            Some(value) => format!("{}:{value}", self.kind_name()),
            None => self.kind_name().into(),
        }
    }

    /// Parses what [`Activation::name`] writes.
    pub fn from_name(name: &str) -> Option<Activation> {
        let (kind, value) = match name.split_once(':') {
            Some((kind, value)) => (kind, Some(value.parse::<f32>().ok()?)),
            None => (name, None),
        };
        let act = *Activation::ALL.iter().find(|a| a.kind_name() == kind)?;
        match (act.param(), value) {
            (Some(_), Some(value)) => Some(act.with_param(value)),
            (None, None) => Some(act),
            _ => None,
        }
    }
}

/// Φ(z) = (1 + erf(z/√2)) / 2.
#[inline(always)]
fn normal_cdf<F: Float>(z: F) -> F {
    F::of(0.5) * (F::ONE + erf(z * F::of(std::f64::consts::FRAC_1_SQRT_2)))
}

/// erf(x) with absolute error below 1.2e-7 (Numerical Recipes' erfc Chebyshev fit), accurate
/// enough for f32 and smooth, so its finite differences agree with the analytic derivative.
#[inline(always)]
fn erf<F: Float>(x: F) -> F {
    let z = if x < F::ZERO { -x } else { x };
    let t = F::ONE / (F::ONE + F::of(0.5) * z);
    let poly = F::of(-1.265_512_23)
        + t * (F::of(1.000_023_68)
            + t * (F::of(0.374_091_96)
                + t * (F::of(0.096_784_18)
                    + t * (F::of(-0.186_288_06)
                        + t * (F::of(0.278_868_07)
                            + t * (F::of(-1.135_203_98)
                                + t * (F::of(1.488_515_87) + t * (F::of(-0.822_152_23) + t * F::of(0.170_872_77)))))))));
    let erfc = t * (-(z * z) + poly).exp();
    let r = F::ONE - erfc;
    if x < F::ZERO {
        -r
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [(0.0, 0.0), (0.5, 0.520_499_877_8), (1.0, 0.842_700_792_9), (-2.0, -0.995_322_265)] {
            assert!((erf::<f64>(x) - want).abs() < 2e-7, "erf({x})");
        }
    }

    #[test]
    fn names_round_trip() {
        for a in [Identity, Relu, LeakyRelu(0.1), Tanh, Sigmoid, Gelu, Silu, Elu(1.0), Elu(0.5), Softplus] {
            assert_eq!(Activation::from_name(&a.name()), Some(a));
        }
        assert_eq!(Activation::from_name("swish"), None);
    }

    /// The fast passes against the spec, on odd lengths (vectors and tails), outputs poisoned
    /// with NaN and a guard past them. The vectorised ones against the spec in f64 within the
    /// bounds on `apply_slice` and `backward_slice` (an ulp of v is at most 2⁻²³·|v|, and the
    /// spec's erf is itself within 1.2e-7, so Φ within 6e-8); the rest against the spec in f32,
    /// exactly.
    #[test]
    fn fast_passes_match_the_spec() {
        let ulp = |v: f64| v.abs() * 2f64.powi(-23) + 2f64.powi(-149);
        let mut rng = crate::testutil::Rng::new(3);
        for act in [Identity, Relu, LeakyRelu(0.1), Tanh, Sigmoid, Gelu, Silu, Elu(0.7), Softplus] {
            for n in (0..=37).chain([1000, 1001]) {
                let z: Vec<f32> = rng.uniform(n).iter().map(|v| 12.0 * v).collect();
                let dy = rng.uniform(n);
                let (mut y, mut dz) = (vec![f32::NAN; n + 1], vec![f32::NAN; n + 1]);
                act.apply_slice(&z, &mut y[..n]);
                act.backward_slice(&z, &y[..n], &dy, &mut dz[..n]);
                assert!(y[n].is_nan() && dz[n].is_nan(), "{act:?}, n = {n}: wrote past the slice");
                for i in 0..n {
                    let (z64, dy64) = (z[i] as f64, dy[i] as f64);
                    let sigmoid = |v: f64| Sigmoid.apply(v);
                    // the f64 reference of dz and the bound on it, where dz is not exact
                    let (y_tol, dz_want) = match act {
                        Tanh => (1.35 * ulp(z64.tanh()), None),
                        Sigmoid => (0.85 * ulp(Sigmoid.apply(z64)), None),
                        Gelu => {
                            let (cdf, density) = (normal_cdf(z64), z64 * FRAC_1_SQRT_2PI * (-z64 * z64 / 2.0).exp());
                            let dz_tol = dy64.abs() * (3.75 * ulp(cdf.max(density.abs())) + 6e-8) + ulp(dy64 * (cdf + density));
                            (5.25 * ulp(Gelu.apply(z64)) + z64.abs() * 6e-8, Some((dy64 * Gelu.derivative(z64, 0.0), dz_tol)))
                        }
                        Silu => {
                            let (s, t) = (sigmoid(z64), z64 * sigmoid(z64) * sigmoid(-z64));
                            let want = dy64 * (s + t);
                            (1.5 * ulp(Silu.apply(z64)), Some((want, dy64.abs() * 2.6 * ulp(s.max(t.abs())) + ulp(want))))
                        }
                        Elu(alpha) if z64 <= 0.0 => {
                            let (alpha, e) = (alpha as f64, z64.exp());
                            let want = dy64 * alpha * e;
                            let y_tol = alpha * 1.15 * ulp(z64.exp_m1()) + ulp(alpha * z64.exp_m1());
                            (y_tol, Some((want, dy64.abs() * (alpha * 0.8 * ulp(e) + ulp(alpha * e)) + ulp(want))))
                        }
                        Softplus => {
                            let want = dy64 * sigmoid(z64);
                            (2.0 * ulp(Softplus.apply(z64)), Some((want, dy64.abs() * 0.85 * ulp(sigmoid(z64)) + ulp(want))))
                        }
                        _ => (0.0, None),
                    };
                    let y_want = if y_tol > 0.0 { act.apply(z64) } else { act.apply(z[i]) as f64 };
                    assert!((y[i] as f64 - y_want).abs() <= y_tol, "{act:?}({}) = {}, want {y_want}", z[i], y[i]);
                    match dz_want {
                        Some((want, tol)) => {
                            assert!((dz[i] as f64 - want).abs() <= tol, "{act:?}: dz at z = {} is {}, want {want}", z[i], dz[i])
                        }
                        None => assert_eq!(dz[i], dy[i] * act.derivative(z[i], y[i]), "{act:?}: dz at z = {}", z[i]),
                    }
                }
            }
        }
    }

    #[test]
    fn every_kind_is_listed_once_and_parameters_are_named() {
        let names: Vec<&str> = Activation::ALL.iter().map(|a| a.kind_name()).collect();
        assert_eq!(names, ["identity", "relu", "leaky_relu", "tanh", "sigmoid", "gelu", "silu", "elu", "softplus"]);
        for a in Activation::ALL {
            let with = a.with_param(0.25);
            assert_eq!(Activation::from_name(&with.name()), Some(with), "{a:?}");
            assert_eq!(with.param().is_some(), with != *a, "{a:?}");
        }
        for bad in ["leaky_relu", "leaky_relu:x", "relu:0.5", "", ":1"] {
            assert_eq!(Activation::from_name(bad), None, "{bad:?}");
        }
        assert!(Activation::from_name("leaky_relu:NaN").is_some_and(|a| a.param().is_some_and(f32::is_nan)));
    }

    /// What `derivative_reads` says the derivative does not read changes nothing (a NaN there
    /// would show): the GPU's gradient kernel does not load it.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_derivative_reads_only_what_derivative_reads_says() {
        let slopes = [0.0, 0.02, 1.5];
        for &kind in Activation::ALL {
            for slope in slopes {
                let act = match kind {
                    LeakyRelu(_) => LeakyRelu(slope),
                    Elu(_) => Elu(slope),
                    other => other,
                };
                let reads = act.derivative_reads();
                for z in [-25.0f32, -3.0, -0.5, 0.0, 0.75, 4.0, 25.0] {
                    let (y, want) = (act.apply(z), act.derivative(z, act.apply(z)));
                    let got = act.derivative(if reads & 1 == 0 { f32::NAN } else { z }, if reads & 2 == 0 { f32::NAN } else { y });
                    assert_eq!(got.to_bits(), want.to_bits(), "{act:?} at {z}: reads {reads}");
                }
            }
        }
    }
}
