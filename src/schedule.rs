//! Learning-rate schedules: the rate of each step as a function of the steps taken before it,
//! computed on the host before the step (in f64, rounded once to f32), so a schedule allocates
//! nothing, costs a few flops a step, and a resumed run (the step count restored from a
//! checkpoint) takes the same rates as one that never stopped. On a GPU the rate is an argument
//! of the step's graph, set before each replay.

use crate::error::{Error, Result};
use std::f64::consts::PI;

/// How the learning rate moves from step to step. `base` below is the optimiser's rate
/// ([`crate::Optim::lr`], changed by [`crate::Optimizer::set_lr`]) and `s` the number of steps
/// taken before this one (0 for the first).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Schedule {
    /// lr = base.
    #[default]
    Constant,
    /// lr = base·γ^⌊s / every⌋ (PyTorch's `StepLR(step_size=every, gamma)`, stepped per step).
    Step { every: u64, gamma: f32 },
    /// lr = base·γ^s (PyTorch's `ExponentialLR`, stepped per step).
    Exponential { gamma: f32 },
    /// Linear warm-up, then a cosine decay to `min_lr`: lr = base·(s + 1)/warmup for
    /// s < warmup; then, with p = (s − warmup)/(total − warmup) (at most 1),
    /// lr = min_lr + (base − min_lr)·(1 + cos πp)/2, which holds `min_lr` from step `total` on
    /// (PyTorch's `CosineAnnealingLR(T_max=total − warmup, eta_min=min_lr)` after the warm-up).
    Cosine { warmup: u64, total: u64, min_lr: f32 },
    /// PyTorch's `OneCycleLR(max_lr=base, total_steps=total, pct_start, anneal_strategy="cos",
    /// div_factor, final_div_factor, cycle_momentum=False)`: from base/div_factor up to base
    /// over the first pct_start·total steps, then down to base/(div_factor·final_div_factor)
    /// at step total − 1, both halves cosine; held there after (PyTorch refuses to go on).
    OneCycle { total: u64, pct_start: f32, div_factor: f32, final_div_factor: f32 },
}

impl Schedule {
    /// [`Schedule::Cosine`] to zero.
    pub fn cosine(warmup: u64, total: u64) -> Schedule {
        Schedule::Cosine { warmup, total, min_lr: 0.0 }
    }

    /// [`Schedule::OneCycle`] with PyTorch's defaults: pct_start 0.3, div_factor 25,
    /// final_div_factor 10⁴.
    pub fn one_cycle(total: u64) -> Schedule {
        Schedule::OneCycle { total, pct_start: 0.3, div_factor: 25.0, final_div_factor: 1e4 }
    }

    /// The rate of the step taken after `steps` others, for the base rate `base`.
    pub fn lr(&self, base: f32, steps: u64) -> f32 {
        let (base, s) = (f64::from(base), steps as f64);
        let rate = match *self {
            Schedule::Constant => base,
            Schedule::Step { every, gamma } => base * f64::from(gamma).powf((steps / every) as f64),
            Schedule::Exponential { gamma } => base * f64::from(gamma).powf(s),
            Schedule::Cosine { warmup, .. } if steps < warmup => base * (s + 1.0) / warmup as f64,
            Schedule::Cosine { warmup, total, min_lr } => {
                let p = ((s - warmup as f64) / (total - warmup) as f64).min(1.0);
                anneal(base, f64::from(min_lr), p)
            }
            Schedule::OneCycle { total, pct_start, div_factor, final_div_factor } => {
                let initial = base / f64::from(div_factor);
                let last = initial / f64::from(final_div_factor);
                // the phases end at these steps, as PyTorch computes them
                let (up_end, down_end) = (f64::from(pct_start) * total as f64 - 1.0, total as f64 - 1.0);
                if s <= up_end {
                    anneal(initial, base, s / up_end)
                } else {
                    anneal(base, last, ((s - up_end) / (down_end - up_end)).min(1.0))
                }
            }
        };
        rate as f32
    }

    /// Checks the schedule's own settings (the base rate is the optimiser's to check).
    pub(crate) fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Config(format!("{what} in {self:?}")));
        let positive = |v: f32| v.is_finite() && v > 0.0;
        match *self {
            Schedule::Constant => Ok(()),
            Schedule::Step { every: 0, .. } => bad("every must be at least 1"),
            Schedule::Step { gamma, .. } | Schedule::Exponential { gamma } if !positive(gamma) => bad("gamma must be a positive number"),
            Schedule::Step { .. } | Schedule::Exponential { .. } => Ok(()),
            Schedule::Cosine { warmup, total, .. } if total <= warmup => bad("total must be more than warmup"),
            Schedule::Cosine { min_lr, .. } if !(min_lr.is_finite() && min_lr >= 0.0) => bad("min_lr must be a number ≥ 0"),
            Schedule::Cosine { .. } => Ok(()),
            Schedule::OneCycle { pct_start, total, .. } if !(pct_start > 0.0 && pct_start < 1.0) => {
                bad(&format!("pct_start must be in (0, 1) (total {total})"))
            }
            // both phases at least one step long, as PyTorch needs them
            Schedule::OneCycle { pct_start, total, .. } if f64::from(pct_start) * (total as f64) < 2.0 => {
                bad("pct_start·total must be at least 2 steps")
            }
            Schedule::OneCycle { pct_start, total, .. } if (total as f64) - f64::from(pct_start) * (total as f64) < 1.0 => {
                bad("the decay needs at least one step after pct_start·total")
            }
            Schedule::OneCycle { div_factor, final_div_factor, .. } if !(positive(div_factor) && positive(final_div_factor)) => {
                bad("div_factor and final_div_factor must be positive numbers")
            }
            Schedule::OneCycle { .. } => Ok(()),
        }
    }
}

/// From `start` at p = 0 to `end` at p = 1 along half a cosine (PyTorch's `_annealing_cos`).
fn anneal(start: f64, end: f64, p: f64) -> f64 {
    end + (start - end) / 2.0 * ((PI * p).cos() + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(schedule: Schedule, base: f32, steps: u64) -> Vec<f32> {
        schedule.check().unwrap();
        (0..steps).map(|s| schedule.lr(base, s)).collect()
    }

    fn close(a: f32, b: f64) -> bool {
        (f64::from(a) - b).abs() <= 1e-6 * b.abs().max(1e-12)
    }

    #[test]
    fn step_exponential_and_constant() {
        assert_eq!(rates(Schedule::Constant, 0.5, 3), [0.5; 3]);
        assert_eq!(rates(Schedule::Step { every: 2, gamma: 0.5 }, 1.0, 5), [1.0, 1.0, 0.5, 0.5, 0.25]);
        assert_eq!(rates(Schedule::Exponential { gamma: 0.5 }, 2.0, 4), [2.0, 1.0, 0.5, 0.25]);
    }

    #[test]
    fn cosine_warms_up_then_decays_to_its_floor() {
        let r = rates(Schedule::Cosine { warmup: 4, total: 12, min_lr: 0.1 }, 1.0, 15);
        assert_eq!(&r[..4], [0.25, 0.5, 0.75, 1.0]);
        assert_eq!(r[4], 1.0);
        // halfway through the decay: the mean of base and floor
        assert!(close(r[8], 0.55), "{}", r[8]);
        assert!(r[4..=12].windows(2).all(|w| w[1] < w[0]), "{r:?}");
        assert_eq!(&r[12..], [0.1; 3]);
        assert_eq!(Schedule::cosine(0, 10).lr(2.0, 0), 2.0);
    }

    /// The rates PyTorch 2.x's OneCycleLR gives for max_lr 1, total_steps 10 and its defaults
    /// (cycle_momentum off), from its formula: up over steps 0..=2, down over 2..=9.
    #[test]
    fn one_cycle_follows_pytorch() {
        let r = rates(Schedule::one_cycle(10), 1.0, 12);
        let (initial, last) = (1.0 / 25.0, 1.0 / 25.0 / 1e4);
        let up_end = 0.3 * 10.0 - 1.0;
        for (s, &got) in r.iter().enumerate().take(10) {
            let s = s as f64;
            let want = if s <= up_end { anneal(initial, 1.0, s / up_end) } else { anneal(1.0, last, (s - up_end) / (9.0 - up_end)) };
            assert!(close(got, want), "step {s}: {got} against {want}");
        }
        assert!(close(r[0], initial) && r[2] == 1.0 && close(r[9], last), "{r:?}");
        assert_eq!(r[10..], [r[9]; 2]);
    }

    #[test]
    fn bad_settings_are_errors() {
        for bad in [
            Schedule::Step { every: 0, gamma: 0.5 },
            Schedule::Exponential { gamma: 0.0 },
            Schedule::Exponential { gamma: f32::NAN },
            Schedule::cosine(10, 10),
            Schedule::Cosine { warmup: 0, total: 5, min_lr: -1.0 },
            Schedule::one_cycle(3),
            Schedule::OneCycle { total: 100, pct_start: 1.0, div_factor: 25.0, final_div_factor: 1e4 },
            Schedule::OneCycle { total: 100, pct_start: 0.3, div_factor: 0.0, final_div_factor: 1e4 },
        ] {
            assert!(matches!(bad.check(), Err(Error::Config(_))), "{bad:?}");
        }
    }
}
