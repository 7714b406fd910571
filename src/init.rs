//! Parameter initialisers, seeded and deterministic. Biases start at zero.

use crate::chain::{Fill, Plan};

/// How to draw initial weights. fan_in / fan_out are in·(kh·kw) and out·(kh·kw) for a conv.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// Every weight zero (a model that cannot learn past symmetry; for tests).
    Zeros,
    /// N(0, 2 / (fan_in + fan_out))
    GlorotNormal,
    /// U(±√(6 / (fan_in + fan_out)))
    GlorotUniform,
    /// N(0, 2 / fan_in)
    HeNormal,
    /// U(±√(6 / fan_in))
    HeUniform,
    /// N(0, 1 / fan_in)
    LecunNormal,
    /// U(±√(3 / fan_in))
    LecunUniform,
}

/// A small, fast, seedable generator (SplitMix64); the same seed gives the same stream.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (n > 0), without modulo bias worth noticing for n ≪ 2⁶⁴.
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Fisher–Yates shuffle in place.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

/// Fills `params` (the plan's layout) from `init` and `seed`: each tensor drawn with its fans,
/// in plan order, or set to its constant (biases zero).
pub fn fill(plan: &Plan, params: &mut [f32], init: Init, seed: u64) {
    let mut rng = Rng::new(seed);
    for tensor in plan.steps.iter().flat_map(|s| &s.tensors) {
        let (fan_in, fan_out) = match tensor.fill {
            Fill::Fans { fan_in, fan_out } => (fan_in as f64, fan_out as f64),
            Fill::Constant(value) => {
                params[tensor.range.clone()].fill(value);
                continue;
            }
            Fill::Count => {
                params[tensor.range.clone()].fill(0.0);
                continue;
            }
        };
        let mut draw: Box<dyn FnMut(&mut Rng) -> f64> = match init {
            Init::Zeros => Box::new(|_| 0.0),
            Init::GlorotNormal => normal((2.0 / (fan_in + fan_out)).sqrt()),
            Init::GlorotUniform => uniform((6.0 / (fan_in + fan_out)).sqrt()),
            Init::HeNormal => normal((2.0 / fan_in).sqrt()),
            Init::HeUniform => uniform((6.0 / fan_in).sqrt()),
            Init::LecunNormal => normal((1.0 / fan_in).sqrt()),
            Init::LecunUniform => uniform((3.0 / fan_in).sqrt()),
        };
        params[tensor.range.clone()].iter_mut().for_each(|p| *p = draw(&mut rng) as f32);
    }
}

/// Sets every buffer tensor of `plan` in `buffers` (the plan's buffer layout) to its constant
/// (a count to 0).
pub(crate) fn fill_buffers(plan: &Plan, buffers: &mut [f32]) {
    for tensor in plan.steps.iter().flat_map(|s| &s.buffers) {
        let value = match tensor.fill {
            Fill::Constant(value) => value,
            Fill::Count => 0.0,
            Fill::Fans { .. } => unreachable!("a buffer starts at a constant (Plan::new)"),
        };
        buffers[tensor.range.clone()].fill(value);
    }
}

fn normal(std: f64) -> Box<dyn FnMut(&mut Rng) -> f64> {
    Box::new(move |rng| std * rng.normal())
}

fn uniform(limit: f64) -> Box<dyn FnMut(&mut Rng) -> f64> {
    Box::new(move |rng| limit * (2.0 * rng.uniform() - 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Shape;
    use crate::layers::dense::Dense;

    #[test]
    fn seeded_and_scaled() {
        let plan = Plan::new(Shape::vector(400), &[Dense { out_features: 300, activation: crate::Relu }.into()]).unwrap();
        let mut a = vec![f32::NAN; plan.param_len];
        let mut b = vec![f32::NAN; plan.param_len];
        fill(&plan, &mut a, Init::HeNormal, 3);
        fill(&plan, &mut b, Init::HeNormal, 3);
        assert_eq!(a, b);
        let w = &a[..120_000];
        let var = w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / w.len() as f64;
        assert!((var - 2.0 / 400.0).abs() < 0.05 * 2.0 / 400.0, "variance {var}");
        assert!(a[120_000..].iter().all(|&v| v == 0.0));
        fill(&plan, &mut b, Init::GlorotUniform, 3);
        let limit = (6.0f32 / 700.0).sqrt();
        assert!(b[..120_000].iter().all(|v| v.abs() <= limit));
        fill(&plan, &mut b, Init::HeNormal, 4);
        assert_ne!(a, b);
    }
}
