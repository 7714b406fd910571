//! Optimisers: each one pass over the flat parameter buffer with flat state, PyTorch's update
//! rules, spread over the model's threads (each element is independent, so the result does not
//! depend on the thread count). Gradient clipping (by global norm or by value) and weight decay
//! happen inside that pass, and the learning rate follows a [`Schedule`]: nothing is allocated
//! and, on a GPU, everything stays inside the step's graph.

use crate::cache::{Cache, Grads};
use crate::chain::Plan;
use crate::clip::{clip_coef, grad_norm, Grad, NORM_BLOCK};
use crate::cpu::{for_chunks, SharedMut};
use crate::dev::{DevOptim, Reduce};
use crate::device::{Device, ToDevice};
use crate::error::{zeros, Error, Result};
use crate::loss::Loss;
use crate::model::Model;
use crate::schedule::Schedule;

pub use crate::clip::Clip;
use std::borrow::Cow;
use std::sync::Arc;

/// An optimiser and its hyper-parameters. `g` below is the gradient as clipped ([`Clip`]).
///
/// `weight_decay` (λ) is PyTorch's: for SGD, Adam and RMSProp an L2 term added to the gradient
/// before the rule, g ← g + λ·p; for AdamW the decoupled decay p ← p·(1 − lr·λ). Zero (the
/// constructors' default) is none: [`Optim::with_weight_decay`] sets it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optim {
    /// buf ← μ·buf + g;  p ← p − lr·(g + μ·buf) with Nesterov, else p ← p − lr·buf.
    /// μ = 0 is plain SGD.
    Sgd { lr: f32, momentum: f32, nesterov: bool, weight_decay: f32 },
    /// m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;  p ← p − lr·m̂ / (√v̂ + ε), bias-corrected.
    Adam { lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32 },
    /// Adam with decoupled weight decay: p ← p·(1 − lr·λ) before the Adam step.
    AdamW { lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32 },
    /// v ← αv + (1−α)g²;  p ← p − lr·g / (√v + ε).
    RmsProp { lr: f32, alpha: f32, eps: f32, weight_decay: f32 },
}

impl Optim {
    /// The learning rate (the base of a [`Schedule`]).
    pub fn lr(&self) -> f32 {
        let mut config = *self;
        *config.lr_mut()
    }

    fn lr_mut(&mut self) -> &mut f32 {
        match self {
            Optim::Sgd { lr, .. } | Optim::Adam { lr, .. } | Optim::AdamW { lr, .. } | Optim::RmsProp { lr, .. } => lr,
        }
    }

    /// The weight decay λ.
    pub fn weight_decay(&self) -> f32 {
        let mut config = *self;
        *config.weight_decay_mut()
    }

    fn weight_decay_mut(&mut self) -> &mut f32 {
        match self {
            Optim::Sgd { weight_decay, .. }
            | Optim::Adam { weight_decay, .. }
            | Optim::AdamW { weight_decay, .. }
            | Optim::RmsProp { weight_decay, .. } => weight_decay,
        }
    }

    /// The same optimiser with weight decay λ (PyTorch's `weight_decay`: see [`Optim`]).
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Optim {
        *self.weight_decay_mut() = weight_decay;
        self
    }

    /// SGD with momentum μ (0 for none).
    pub fn sgd(lr: f32, momentum: f32) -> Optim {
        Optim::Sgd { lr, momentum, nesterov: false, weight_decay: 0.0 }
    }

    /// Adam with β₁ = 0.9, β₂ = 0.999, ε = 1e-8.
    pub fn adam(lr: f32) -> Optim {
        Optim::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }

    /// AdamW with β₁ = 0.9, β₂ = 0.999, ε = 1e-8 and decay λ.
    pub fn adamw(lr: f32, weight_decay: f32) -> Optim {
        Optim::AdamW { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay }
    }

    /// RMSProp with α = 0.99, ε = 1e-8 (PyTorch's defaults).
    pub fn rmsprop(lr: f32) -> Optim {
        Optim::RmsProp { lr, alpha: 0.99, eps: 1e-8, weight_decay: 0.0 }
    }

    /// Number of state values kept per parameter.
    pub(crate) fn state_per_param(&self) -> usize {
        match self {
            Optim::Sgd { momentum, .. } => usize::from(*momentum != 0.0),
            Optim::Adam { .. } | Optim::AdamW { .. } => 2,
            Optim::RmsProp { .. } => 1,
        }
    }

    /// The λ of the L2 term added to the gradient (AdamW decays the parameters instead: 0).
    pub(crate) fn l2(&self) -> f32 {
        match *self {
            Optim::AdamW { .. } => 0.0,
            config => config.weight_decay(),
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |what: &str, v: f32| Err(Error::Config(format!("{what} = {v} is out of range in {self:?}")));
        let unit = |v: f32| (0.0..1.0).contains(&v);
        let (lr, eps) = match *self {
            Optim::Sgd { lr, momentum, .. } => {
                if !unit(momentum) {
                    return bad("momentum", momentum);
                }
                (lr, 1.0)
            }
            Optim::Adam { lr, beta1, beta2, eps, .. } | Optim::AdamW { lr, beta1, beta2, eps, .. } => {
                if !unit(beta1) {
                    return bad("beta1", beta1);
                }
                if !unit(beta2) {
                    return bad("beta2", beta2);
                }
                (lr, eps)
            }
            Optim::RmsProp { lr, alpha, eps, .. } => {
                if !unit(alpha) {
                    return bad("alpha", alpha);
                }
                (lr, eps)
            }
        };
        if !(lr.is_finite() && lr > 0.0) {
            return bad("lr", lr);
        }
        if !(eps.is_finite() && eps > 0.0) {
            return bad("eps", eps);
        }
        let weight_decay = self.weight_decay();
        if !(weight_decay.is_finite() && weight_decay >= 0.0) {
            return bad("weight_decay", weight_decay);
        }
        Ok(())
    }
}

/// One update's rule: the optimiser with this step's learning rate, and the clipping.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Update {
    pub config: Optim,
    pub clip: Clip,
}

/// The step number Adam's bias corrections raise β to: `step` (1-based), held at i32::MAX
/// (where βᵗ is 0 in f32 long before).
pub(crate) fn bias_step(step: u64) -> i32 {
    step.min(i32::MAX as u64) as i32
}

/// An optimiser bound to one model: its state is flat, in the parameters' layout, on the
/// model's device.
pub struct Optimizer {
    config: Optim,
    clip: Clip,
    schedule: Schedule,
    plan: Arc<Plan>,
    /// The state on the CPU; empty while it is on a GPU (then in `dev`).
    state: Vec<f32>,
    /// Σg² of each [`NORM_BLOCK`] values of the gradients (CPU clipping by norm).
    partials: Vec<f64>,
    /// ‖g‖₂ of the last update's gradients where it clipped by norm on the CPU (on a GPU the
    /// device holds it), and whether the last update clipped by norm.
    norm: f32,
    norm_known: bool,
    steps: u64,
    dev: Option<DevOptim>,
}

impl Optimizer {
    /// State for `model`, zero-initialised, no clipping, a constant rate. Out-of-range
    /// hyper-parameters are an error, and so is state that cannot be allocated
    /// ([`Error::OutOfMemory`]).
    pub fn new(model: &Model, config: Optim) -> Result<Optimizer> {
        config.check()?;
        // at most 2 × param_len, which is at most plan::MAX_VALUES: no overflow
        let state = zeros(config.state_per_param() * model.plan.param_len, || format!("the state of {config:?}"))?;
        let dev = model.dev.as_ref().map(|d| d.new_optim(&state)).transpose()?;
        let state = if dev.is_some() { Vec::new() } else { state };
        let partials = zeros(model.plan.param_len.div_ceil(NORM_BLOCK), || "the clipping norm's partial sums".into())?;
        Ok(Optimizer {
            config,
            clip: Clip::None,
            schedule: Schedule::Constant,
            plan: Arc::clone(&model.plan),
            state,
            partials,
            norm: f32::NAN,
            norm_known: false,
            steps: 0,
            dev,
        })
    }

    /// The device the state lives on.
    pub fn device(&self) -> Device {
        self.dev.as_ref().map_or(Device::Cpu, DevOptim::device)
    }

    /// The flat state (momenta, moments): borrowed on the CPU, copied from a GPU. Laid out
    /// as the parameters, one such block per state value: SGD's momentum buffer; Adam's
    /// first moment then its second; RMSProp's square average.
    pub fn state(&self) -> Result<Cow<'_, [f32]>> {
        match &self.dev {
            None => Ok(Cow::Borrowed(&self.state)),
            Some(dev) => {
                let mut out = zeros(self.config.state_per_param() * self.plan.param_len, || "a host copy of the optimiser state".into())?;
                dev.download(&mut out)?;
                Ok(Cow::Owned(out))
            }
        }
    }

    /// Replaces the state (laid out as [`Optimizer::state`] gives it) and the count of steps
    /// taken (which Adam's bias corrections and the schedule read), on any device: what a
    /// checkpoint restores. On a GPU the copy is queued after the steps queued before it.
    pub fn set_state(&mut self, values: &[f32], steps: u64) -> Result<()> {
        let len = self.config.state_per_param() * self.plan.param_len;
        if values.len() != len {
            return Err(Error::Shape(format!("{} state values for an optimiser that keeps {len}", values.len())));
        }
        match &mut self.dev {
            None => self.state.copy_from_slice(values),
            Some(dev) => dev.upload(values)?,
        }
        (self.steps, self.norm, self.norm_known) = (steps, f32::NAN, false);
        Ok(())
    }

    /// The hyper-parameters (with the base learning rate).
    pub fn config(&self) -> Optim {
        self.config
    }

    /// Changes the base learning rate (the schedule's base).
    pub fn set_lr(&mut self, new_lr: f32) -> Result<()> {
        let mut config = self.config;
        *config.lr_mut() = new_lr;
        config.check()?;
        self.config = config;
        Ok(())
    }

    /// The learning rate the next step takes: the schedule's, from the base rate and the steps
    /// taken.
    pub fn lr(&self) -> f32 {
        self.schedule.lr(self.config.lr(), self.steps)
    }

    /// The learning-rate schedule.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// Makes the learning rate follow `schedule` from the next step on (its position is the
    /// count of steps taken, [`Optimizer::steps`]).
    pub fn set_schedule(&mut self, schedule: Schedule) -> Result<()> {
        schedule.check()?;
        self.schedule = schedule;
        Ok(())
    }

    /// The gradient clipping.
    pub fn clip(&self) -> Clip {
        self.clip
    }

    /// Clips the gradients of the next steps by `clip`.
    pub fn set_clip(&mut self, clip: Clip) -> Result<()> {
        clip.check()?;
        self.clip = clip;
        Ok(())
    }

    /// The global norm ‖g‖₂ of the gradients the last update saw, before clipping: NaN before
    /// the first step and when the last one did not clip by norm. On a GPU, waits for it.
    pub fn grad_norm(&self) -> Result<f32> {
        match &self.dev {
            Some(dev) if self.norm_known => dev.norm(),
            _ if self.norm_known => Ok(self.norm),
            _ => Ok(f32::NAN),
        }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The next step's rule: the schedule's rate and the clipping.
    fn next_update(&self) -> Update {
        let mut config = self.config;
        *config.lr_mut() = self.lr();
        Update { config, clip: self.clip }
    }

    /// One update of `model`'s parameters from `grads`. Allocates nothing.
    pub fn update(&mut self, model: &mut Model, grads: &Grads) -> Result<()> {
        self.check(model, grads)?;
        let update = self.next_update();
        if let (Some(dev_model), Some(dev)) = (&mut model.dev, &mut self.dev) {
            dev_model.update(update, self.steps + 1, dev, grads)?;
            self.steps += 1;
            self.norm_known = matches!(update.clip, Clip::Norm(_));
            return Ok(());
        }
        self.steps += 1;
        let g = &grads.grads[..];
        let coef = match update.clip {
            Clip::Norm(max_norm) => {
                self.norm = grad_norm(&model.pool, g, &mut self.partials);
                clip_coef(self.norm, max_norm)
            }
            _ => 1.0,
        };
        self.norm_known = matches!(update.clip, Clip::Norm(_));
        let grad = Grad { coef, clip: update.clip.value_bound(), decay: update.config.l2() };
        let n = model.params.len();
        let params = SharedMut::new(&mut model.params);
        let state = SharedMut::new(&mut self.state);
        let (t, config) = (bias_step(self.steps), update.config);
        let per = config.state_per_param();
        for_chunks(&model.pool, n, 16384, &|_, r| {
            // SAFETY: chunks are disjoint ranges of the parameters and of each state vector.
            let p = unsafe { params.slice(r.clone()) };
            let s1 = (per >= 1).then(|| unsafe { state.slice(r.clone()) });
            let s2 = (per >= 2).then(|| unsafe { state.slice(n + r.start..n + r.end) });
            step(config, t, grad, p, &g[r], s1, s2);
        });
        Ok(())
    }

    /// A whole training step: `model.backprop(grads, cache, loss)` and then
    /// `self.update(model, grads)`, with the same results. On a GPU with graphs (the default)
    /// the two are one graph, the update its last kernel (after the norm's, when clipping by
    /// norm), so the update costs no launch of its own; the step's number and the learning
    /// rate are set in that graph before each replay, so steps queued back to back each use
    /// their own (`set_lr` between them included). Every check of both calls runs before any
    /// buffer is written. Allocates nothing. A step whose loss comes out NaN or infinite still
    /// updates: see [`Grads::diverged`].
    pub fn train_step(&mut self, model: &mut Model, grads: &mut Grads, cache: &mut Cache, loss: Loss) -> Result<()> {
        self.train_step_with(model, grads, cache, loss, None)
    }

    /// [`Optimizer::train_step`], with the gradients and the loss reduced over a data-parallel
    /// group by `reduce` between the backward pass and the update (a GPU model only).
    pub(crate) fn train_step_with(
        &mut self,
        model: &mut Model,
        grads: &mut Grads,
        cache: &mut Cache,
        loss: Loss,
        reduce: Option<&Reduce>,
    ) -> Result<()> {
        self.check(model, grads)?;
        model.check_backprop(grads, cache, loss)?;
        cache.inputs_finite = true;
        let update = self.next_update();
        if let (Some(dev_model), Some(dev)) = (&mut model.dev, &mut self.dev) {
            // counts the step once its update is queued
            let outcome = dev_model.train_step(&model.plan, grads, cache, loss, update, &mut self.steps, dev, reduce);
            self.norm_known = outcome.is_ok() && matches!(update.clip, Clip::Norm(_));
            if outcome.is_ok() {
                // the step's training pass, as `Model::backprop` counts its own
                *model.passes.get_mut() += 1;
            }
            return outcome;
        }
        debug_assert!(reduce.is_none(), "a data-parallel step on the CPU");
        model.backprop(grads, cache, loss)?;
        self.update(model, grads)
    }

    /// [`Optimizer::update`]'s checks: the same model, and everything on one device.
    fn check(&self, model: &Model, grads: &Grads) -> Result<()> {
        if !Arc::ptr_eq(&self.plan, &model.plan) {
            return Err(Error::Mismatch("this optimiser was built for another model".into()));
        }
        if !Arc::ptr_eq(&grads.plan, &model.plan) {
            return Err(Error::Mismatch("these gradients belong to another model".into()));
        }
        let device = model.device();
        if self.device() != device || grads.device() != device {
            return Err(Error::Mismatch(format!(
                "model on {device}, optimiser state on {}, gradients on {}: move them together",
                self.device(),
                grads.device()
            )));
        }
        Ok(())
    }

    /// The model this optimiser was built for is the one with this plan.
    pub(crate) fn plan(&self) -> &Arc<Plan> {
        &self.plan
    }
}

/// The update rule on one chunk; `t` is the 1-based step number.
fn step(config: Optim, t: i32, grad: Grad, p: &mut [f32], g: &[f32], s1: Option<&mut [f32]>, s2: Option<&mut [f32]>) {
    match (config, s1, s2) {
        (Optim::Sgd { lr, .. }, None, _) => p.iter_mut().zip(g).for_each(|(p, &g)| *p -= lr * grad.of(g, *p)),
        (Optim::Sgd { lr, momentum, nesterov, .. }, Some(buf), _) => {
            for i in 0..p.len() {
                let gi = grad.of(g[i], p[i]);
                buf[i] = momentum * buf[i] + gi;
                let d = if nesterov { gi + momentum * buf[i] } else { buf[i] };
                p[i] -= lr * d;
            }
        }
        (Optim::Adam { lr, beta1, beta2, eps, .. }, Some(m), Some(v)) => adam(lr, beta1, beta2, eps, 0.0, t, grad, p, g, m, v),
        (Optim::AdamW { lr, beta1, beta2, eps, weight_decay }, Some(m), Some(v)) => {
            adam(lr, beta1, beta2, eps, weight_decay, t, grad, p, g, m, v)
        }
        (Optim::RmsProp { lr, alpha, eps, .. }, Some(v), _) => {
            for i in 0..p.len() {
                let gi = grad.of(g[i], p[i]);
                v[i] = alpha * v[i] + (1.0 - alpha) * gi * gi;
                p[i] -= lr * gi / (v[i].sqrt() + eps);
            }
        }
        _ => unreachable!("state sized by state_per_param"),
    }
}

/// The Adam rule over one chunk, compiled twice: for AVX2+FMA when the CPU has it (chosen at
/// run time), and for the baseline target. The body is the same plain loop. `decay`: AdamW's.
#[allow(clippy::too_many_arguments)]
fn adam(lr: f32, beta1: f32, beta2: f32, eps: f32, decay: f32, t: i32, grad: Grad, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    // p ← p·(1 − lr·λ) − (lr / (1−β₁ᵗ))·m / (√v / √(1−β₂ᵗ) + ε)
    let step_size = lr / (1.0 - beta1.powi(t));
    let inv_bias2 = 1.0 / (1.0 - beta2.powi(t)).sqrt();
    let shrink = 1.0 - lr * decay;
    let args = (beta1, beta2, eps, step_size, inv_bias2, shrink);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { adam_avx2(args, grad, p, g, m, v) };
    }
    adam_loop(args, grad, p, g, m, v)
}

type AdamArgs = (f32, f32, f32, f32, f32, f32);

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn adam_avx2(args: AdamArgs, grad: Grad, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    adam_loop(args, grad, p, g, m, v)
}

#[inline(always)]
fn adam_loop(
    (beta1, beta2, eps, step_size, inv_bias2, shrink): AdamArgs,
    grad: Grad,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let gi = grad.of(g[i], p[i]);
        m[i] = beta1 * m[i] + (1.0 - beta1) * gi;
        v[i] = beta2 * v[i] + (1.0 - beta2) * gi * gi;
        p[i] = p[i] * shrink - step_size * m[i] / (v[i].sqrt() * inv_bias2 + eps);
    }
}

impl ToDevice for Optimizer {
    /// The state copied to `device` (the step count, hyper-parameters, schedule and clipping
    /// kept; the last norm is not: [`Optimizer::grad_norm`] is NaN until the next step).
    fn to_device(self, device: &Device) -> Result<Self> {
        if self.device() == *device {
            return Ok(self);
        }
        let state = self.state()?.into_owned();
        let dev = match *device {
            Device::Cpu => None,
            Device::Cuda(ordinal) => Some(DevOptim::on(ordinal, &state)?),
        };
        let state = if dev.is_some() { Vec::new() } else { state };
        Ok(Optimizer { state, dev, norm: f32::NAN, norm_known: false, ..self })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: Grad = Grad::PLAIN;

    /// One scalar parameter p = 1 with g = 0.5 each step, against the rules written out.
    #[test]
    fn rules_match_their_formulas() {
        let run = |config: Optim, grad: Grad, steps: i32| {
            let mut p = [1.0f32];
            let (mut s1, mut s2) = ([0.0f32], [0.0f32]);
            for t in 1..=steps {
                let per = config.state_per_param();
                step(config, t, grad, &mut p, &[0.5], (per >= 1).then_some(&mut s1[..]), (per >= 2).then_some(&mut s2[..]));
            }
            p[0]
        };
        assert_eq!(run(Optim::sgd(0.1, 0.0), PLAIN, 2), 1.0 - 2.0 * 0.05);
        // momentum 0.9: buf 0.5, 0.95 → p = 1 − 0.1·(0.5 + 0.95)
        assert!((run(Optim::sgd(0.1, 0.9), PLAIN, 2) - (1.0 - 0.145)).abs() < 1e-6);
        // nesterov: d1 = 0.5 + 0.45, d2 = 0.5 + 0.855
        let nesterov = Optim::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 0.0 };
        assert!((run(nesterov, PLAIN, 2) - (1.0 - 0.1 * (0.95 + 1.355))).abs() < 1e-6);
        // Adam's first step moves by lr·g/|g| = lr (up to ε)
        assert!((run(Optim::adam(0.01), PLAIN, 1) - 0.99).abs() < 1e-6);
        // AdamW: decay first, then the same step
        assert!((run(Optim::adamw(0.01, 0.1), PLAIN, 1) - (1.0 * (1.0 - 0.001) - 0.01)).abs() < 1e-6);
        // RMSProp first step: v = 0.01·0.25, p −= lr·0.5/0.05
        assert!((run(Optim::rmsprop(0.001), PLAIN, 1) - (1.0 - 0.01)).abs() < 1e-5);
        // L2 decay 0.2: g = 0.5·coef clamped to ±0.25, + 0.2·p
        let clipped = Grad { coef: 0.8, clip: 0.25, decay: 0.2 };
        assert_eq!(clipped.of(0.5, 1.0), 0.25 + 0.2);
        assert_eq!(clipped.of(0.25, 1.0), 0.2 + 0.2);
        assert_eq!(Grad { decay: 0.0, ..clipped }.of(-1.0, 5.0), -0.25);
        assert!(clipped.of(f32::NAN, 1.0).is_nan(), "a NaN gradient stays NaN");
        assert_eq!(run(Optim::sgd(0.1, 0.0), clipped, 1), 1.0 - 0.1 * 0.45);
        // Adam with L2: the first step still moves by lr (the sign of g + λp)
        assert!((run(Optim::adam(0.01), clipped, 1) - 0.99).abs() < 1e-6);
        assert_eq!(Optim::adamw(0.01, 0.1).l2(), 0.0);
        assert_eq!(Optim::rmsprop(0.01).with_weight_decay(0.3).l2(), 0.3);
    }

    #[test]
    fn bad_hyper_parameters_are_errors() {
        for bad in [
            Optim::adam(0.0),
            Optim::adam(f32::NAN),
            Optim::sgd(0.1, 1.0),
            Optim::adamw(0.1, -1.0),
            Optim::sgd(0.1, 0.0).with_weight_decay(f32::INFINITY),
            Optim::Adam { lr: 0.1, beta1: 0.9, beta2: 1.0, eps: 1e-8, weight_decay: 0.0 },
        ] {
            assert!(matches!(bad.check(), Err(Error::Config(_))), "{bad:?}");
        }
    }
}
