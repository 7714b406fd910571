//! Gradient clipping inside an optimiser's update: what the update rule sees of each gradient
//! value, and the global norm it may be scaled by. kernels/optim.cu does the same on a GPU.

use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
use crate::error::{Error, Result};

/// Gradient clipping, applied inside each update (on a GPU, inside the step's graph) to the
/// gradient the rule sees; the gradient buffers keep the gradient as computed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Clip {
    /// No clipping.
    #[default]
    None,
    /// By the global norm over every parameter, as PyTorch's `clip_grad_norm_(max_norm)`:
    /// g ← g·min(1, max_norm / (‖g‖₂ + 10⁻⁶)). ‖g‖₂ is summed in f64;
    /// [`crate::Optimizer::grad_norm`] reads it after the step.
    Norm(f32),
    /// Each value to [−c, c], as PyTorch's `clip_grad_value_(c)` (a NaN stays NaN).
    Value(f32),
}

impl Clip {
    pub(crate) fn check(&self) -> Result<()> {
        match *self {
            Clip::Norm(v) | Clip::Value(v) if !(v.is_finite() && v > 0.0) => {
                Err(Error::Config(format!("{self:?}: the bound must be a positive number")))
            }
            _ => Ok(()),
        }
    }

    /// The bound of each value: c for [`Clip::Value`], ∞ (none) otherwise.
    pub(crate) fn value_bound(&self) -> f32 {
        if let Clip::Value(c) = *self {
            c
        } else {
            f32::INFINITY
        }
    }
}

/// Values per block of the CPU's Σg² for clipping by norm: a split fixed by the length alone,
/// so the norm does not depend on the thread count.
pub(crate) const NORM_BLOCK: usize = 4096;

/// ‖g‖₂, the sum of squares in f64 (each square exact): per [`NORM_BLOCK`] values into
/// `partials` (one per block), over the pool, then those in order.
pub(crate) fn grad_norm(pool: &Pool, g: &[f32], partials: &mut [f64]) -> f32 {
    debug_assert_eq!(partials.len(), g.len().div_ceil(NORM_BLOCK));
    let count = partials.len();
    let blocks = SharedMut::new(partials);
    for_chunks(pool, count, 4, &|_, r| {
        // SAFETY: chunks are disjoint ranges of the blocks.
        let out = unsafe { blocks.slice(r.clone()) };
        for (sum, b) in out.iter_mut().zip(r) {
            let values = &g[b * NORM_BLOCK..((b + 1) * NORM_BLOCK).min(g.len())];
            *sum = values.iter().fold(0.0, |s, &v| s + f64::from(v) * f64::from(v));
        }
    });
    partials.iter().fold(0.0, |s, &v| s + v).sqrt() as f32
}

/// The factor clipping by norm scales the gradients by, min(1, max_norm / (‖g‖ + 10⁻⁶)), in
/// f32 as PyTorch computes it (a NaN norm gives 1: its NaNs go on into the parameters).
pub(crate) fn clip_coef(norm: f32, max_norm: f32) -> f32 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

/// What the rule sees of a gradient value g of parameter p: g·coef (clipping by norm; 1
/// otherwise), then clamped to [−clip, clip] (∞: none), then g + λ·p where λ ≠ 0 (L2 decay),
/// in PyTorch's order (clip_grad_*, then the optimiser's weight_decay). kernels/optim.cu
/// (optim_grad) does the same operations.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grad {
    pub coef: f32,
    pub clip: f32,
    pub decay: f32,
}

impl Grad {
    /// The gradient as computed.
    #[cfg(test)]
    pub const PLAIN: Grad = Grad { coef: 1.0, clip: f32::INFINITY, decay: 0.0 };

    #[inline(always)]
    pub fn of(self, g: f32, p: f32) -> f32 {
        let g = g * self.coef;
        // comparisons rather than min/max, so that a NaN stays NaN
        let g = if g > self.clip {
            self.clip
        } else if g < -self.clip {
            -self.clip
        } else {
            g
        };
        if self.decay != 0.0 {
            g + self.decay * p
        } else {
            g
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The norm is summed in a fixed order: the same bits on one thread and on three, and
    /// √Σg² within f32's rounding of the f64 sum.
    #[test]
    fn the_norm_does_not_depend_on_the_threads() {
        let g: Vec<f32> = (0..3 * NORM_BLOCK + 5).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect();
        let want = g.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt();
        let mut partials = vec![f64::NAN; g.len().div_ceil(NORM_BLOCK)];
        let norms: Vec<f32> = [1, 3].iter().map(|&t| grad_norm(&Pool::new(t).unwrap(), &g, &mut partials)).collect();
        assert_eq!(norms[0].to_bits(), norms[1].to_bits());
        assert!((f64::from(norms[0]) - want).abs() <= want * 1e-7, "{} against {want}", norms[0]);
        assert_eq!(clip_coef(4.0, 8.0), 1.0);
        assert_eq!(clip_coef(f32::NAN, 1.0), 1.0);
        assert_eq!(clip_coef(10.0, 1.0), 1.0 / (10.0 + 1e-6));
    }

    #[test]
    fn bad_bounds_are_errors() {
        for bad in [Clip::Norm(0.0), Clip::Value(-1.0), Clip::Norm(f32::NAN), Clip::Value(f32::INFINITY)] {
            assert!(matches!(bad.check(), Err(Error::Config(_))), "{bad:?}");
        }
        assert!(Clip::Norm(1.0).check().is_ok() && Clip::None.check().is_ok());
    }
}
