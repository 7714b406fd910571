//! Optimisers: each one pass over the flat parameter buffer with flat state, PyTorch's update
//! rules, spread over the model's threads (each element is independent, so the result does not
//! depend on the thread count).

use crate::cache::{Cache, Grads};
use crate::chain::Plan;
use crate::cpu::{for_chunks, SharedMut};
use crate::dev::DevOptim;
use crate::device::{Device, ToDevice};
use crate::error::{zeros, Error, Result};
use crate::loss::Loss;
use crate::model::Model;
use std::borrow::Cow;
use std::sync::Arc;

/// An optimiser and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optim {
    /// buf ← μ·buf + g;  p ← p − lr·(g + μ·buf) with Nesterov, else p ← p − lr·buf.
    /// μ = 0 is plain SGD.
    Sgd { lr: f32, momentum: f32, nesterov: bool },
    /// m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;  p ← p − lr·m̂ / (√v̂ + ε), bias-corrected.
    Adam { lr: f32, beta1: f32, beta2: f32, eps: f32 },
    /// Adam with decoupled weight decay: p ← p·(1 − lr·λ) before the Adam step.
    AdamW { lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32 },
    /// v ← αv + (1−α)g²;  p ← p − lr·g / (√v + ε).
    RmsProp { lr: f32, alpha: f32, eps: f32 },
}

impl Optim {
    /// The learning rate.
    pub fn lr(&self) -> f32 {
        let mut config = *self;
        *config.lr_mut()
    }

    fn lr_mut(&mut self) -> &mut f32 {
        match self {
            Optim::Sgd { lr, .. } | Optim::Adam { lr, .. } | Optim::AdamW { lr, .. } | Optim::RmsProp { lr, .. } => lr,
        }
    }

    /// SGD with momentum μ (0 for none).
    pub fn sgd(lr: f32, momentum: f32) -> Optim {
        Optim::Sgd { lr, momentum, nesterov: false }
    }

    /// Adam with β₁ = 0.9, β₂ = 0.999, ε = 1e-8.
    pub fn adam(lr: f32) -> Optim {
        Optim::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }

    /// AdamW with β₁ = 0.9, β₂ = 0.999, ε = 1e-8 and decay λ.
    pub fn adamw(lr: f32, weight_decay: f32) -> Optim {
        Optim::AdamW { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay }
    }

    /// RMSProp with α = 0.99, ε = 1e-8 (PyTorch's defaults).
    pub fn rmsprop(lr: f32) -> Optim {
        Optim::RmsProp { lr, alpha: 0.99, eps: 1e-8 }
    }

    /// Number of state values kept per parameter.
    pub(crate) fn state_per_param(&self) -> usize {
        match self {
            Optim::Sgd { momentum, .. } => usize::from(*momentum != 0.0),
            Optim::Adam { .. } | Optim::AdamW { .. } => 2,
            Optim::RmsProp { .. } => 1,
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
            Optim::Adam { lr, beta1, beta2, eps } | Optim::AdamW { lr, beta1, beta2, eps, .. } => {
                if !unit(beta1) {
                    return bad("beta1", beta1);
                }
                if !unit(beta2) {
                    return bad("beta2", beta2);
                }
                (lr, eps)
            }
            Optim::RmsProp { lr, alpha, eps } => {
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
        if let Optim::AdamW { weight_decay, .. } = *self {
            if !(weight_decay.is_finite() && weight_decay >= 0.0) {
                return bad("weight_decay", weight_decay);
            }
        }
        Ok(())
    }
}

/// An optimiser bound to one model: its state is flat, in the parameters' layout, on the
/// model's device.
pub struct Optimizer {
    config: Optim,
    plan: Arc<Plan>,
    /// The state on the CPU; empty while it is on a GPU (then in `dev`).
    state: Vec<f32>,
    steps: u64,
    dev: Option<DevOptim>,
}

impl Optimizer {
    /// State for `model`, zero-initialised. Out-of-range hyper-parameters are an error, and so
    /// is state that cannot be allocated ([`Error::OutOfMemory`]).
    pub fn new(model: &Model, config: Optim) -> Result<Optimizer> {
        config.check()?;
        // at most 2 × param_len, which is at most chain::MAX_VALUES: no overflow
        let state = zeros(config.state_per_param() * model.plan.param_len, || format!("the state of {config:?}"))?;
        let dev = model.dev.as_ref().map(|d| d.new_optim(&state)).transpose()?;
        let state = if dev.is_some() { Vec::new() } else { state };
        Ok(Optimizer { config, plan: Arc::clone(&model.plan), state, steps: 0, dev })
    }

    /// The device the state lives on.
    pub fn device(&self) -> Device {
        self.dev.as_ref().map_or(Device::Cpu, DevOptim::device)
    }

    /// The flat state (momenta, moments): borrowed on the CPU, copied from a GPU.
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

    /// The hyper-parameters.
    pub fn config(&self) -> Optim {
        self.config
    }

    /// Changes the learning rate (for a schedule).
    pub fn set_lr(&mut self, new_lr: f32) -> Result<()> {
        let mut config = self.config;
        *config.lr_mut() = new_lr;
        config.check()?;
        self.config = config;
        Ok(())
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One update of `model`'s parameters from `grads`. Allocates nothing.
    pub fn update(&mut self, model: &mut Model, grads: &Grads) -> Result<()> {
        self.check(model, grads)?;
        if let (Some(dev_model), Some(dev)) = (&mut model.dev, &mut self.dev) {
            dev_model.update(self.config, self.steps + 1, dev, grads)?;
            self.steps += 1;
            return Ok(());
        }
        self.steps += 1;
        let n = model.params.len();
        let params = SharedMut::new(&mut model.params);
        let state = SharedMut::new(&mut self.state);
        let (g, t, per) = (&grads.grads[..], self.steps as i32, self.config.state_per_param());
        let config = self.config;
        for_chunks(&model.pool, n, 16384, &|_, r| {
            // SAFETY: chunks are disjoint ranges of the parameters and of each state vector.
            let p = unsafe { params.slice(r.clone()) };
            let s1 = (per >= 1).then(|| unsafe { state.slice(r.clone()) });
            let s2 = (per >= 2).then(|| unsafe { state.slice(n + r.start..n + r.end) });
            step(config, t, p, &g[r], s1, s2);
        });
        Ok(())
    }

    /// A whole training step: `model.backprop(grads, cache, loss)` and then
    /// `self.update(model, grads)`, with the same results. On a GPU with graphs (the default)
    /// the two are one graph, the update its last kernel, so the update costs no launch of its
    /// own; the step's number and the learning rate are set in that graph before each replay,
    /// so steps queued back to back each use their own (`set_lr` between them included). Every
    /// check of both calls runs before any buffer is written. Allocates nothing. A step whose
    /// loss comes out NaN or infinite still updates: see [`Grads::diverged`].
    pub fn train_step(&mut self, model: &mut Model, grads: &mut Grads, cache: &mut Cache, loss: Loss) -> Result<()> {
        self.check(model, grads)?;
        model.check_backprop(grads, cache, loss)?;
        cache.inputs_finite = true;
        if let (Some(dev_model), Some(dev)) = (&mut model.dev, &mut self.dev) {
            // counts the step once its update is queued
            return dev_model.train_step(&model.plan, grads, cache, loss, self.config, &mut self.steps, dev);
        }
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
}

/// The update rule on one chunk; `t` is the 1-based step number.
fn step(config: Optim, t: i32, p: &mut [f32], g: &[f32], s1: Option<&mut [f32]>, s2: Option<&mut [f32]>) {
    match (config, s1, s2) {
        (Optim::Sgd { lr, .. }, None, _) => p.iter_mut().zip(g).for_each(|(p, g)| *p -= lr * g),
        (Optim::Sgd { lr, momentum, nesterov }, Some(buf), _) => {
            for i in 0..p.len() {
                buf[i] = momentum * buf[i] + g[i];
                let d = if nesterov { g[i] + momentum * buf[i] } else { buf[i] };
                p[i] -= lr * d;
            }
        }
        (Optim::Adam { lr, beta1, beta2, eps }, Some(m), Some(v)) => adam(lr, beta1, beta2, eps, 0.0, t, p, g, m, v),
        (Optim::AdamW { lr, beta1, beta2, eps, weight_decay }, Some(m), Some(v)) => {
            adam(lr, beta1, beta2, eps, weight_decay, t, p, g, m, v)
        }
        (Optim::RmsProp { lr, alpha, eps }, Some(v), _) => {
            for i in 0..p.len() {
                v[i] = alpha * v[i] + (1.0 - alpha) * g[i] * g[i];
                p[i] -= lr * g[i] / (v[i].sqrt() + eps);
            }
        }
        _ => unreachable!("state sized by state_per_param"),
    }
}

/// The Adam rule over one chunk, compiled twice: for AVX2+FMA when the CPU has it (chosen at
/// run time), and for the baseline target. The body is the same plain loop.
#[allow(clippy::too_many_arguments)]
fn adam(lr: f32, beta1: f32, beta2: f32, eps: f32, decay: f32, t: i32, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    // p ← p·(1 − lr·λ) − (lr / (1−β₁ᵗ))·m / (√v / √(1−β₂ᵗ) + ε)
    let step_size = lr / (1.0 - beta1.powi(t));
    let inv_bias2 = 1.0 / (1.0 - beta2.powi(t)).sqrt();
    let shrink = 1.0 - lr * decay;
    let args = (beta1, beta2, eps, step_size, inv_bias2, shrink);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { adam_avx2(args, p, g, m, v) };
    }
    adam_loop(args, p, g, m, v)
}

type AdamArgs = (f32, f32, f32, f32, f32, f32);

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn adam_avx2(args: AdamArgs, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    adam_loop(args, p, g, m, v)
}

#[inline(always)]
fn adam_loop((beta1, beta2, eps, step_size, inv_bias2, shrink): AdamArgs, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        m[i] = beta1 * m[i] + (1.0 - beta1) * g[i];
        v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i];
        p[i] = p[i] * shrink - step_size * m[i] / (v[i].sqrt() * inv_bias2 + eps);
    }
}

impl ToDevice for Optimizer {
    /// The state copied to `device` (the step count and hyper-parameters kept).
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
        Ok(Optimizer { state, dev, ..self })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One scalar parameter p = 1 with g = 0.5 each step, against the rules written out.
    #[test]
    fn rules_match_their_formulas() {
        let run = |config: Optim, steps: i32| {
            let mut p = [1.0f32];
            let (mut s1, mut s2) = ([0.0f32], [0.0f32]);
            for t in 1..=steps {
                let per = config.state_per_param();
                step(config, t, &mut p, &[0.5], (per >= 1).then_some(&mut s1[..]), (per >= 2).then_some(&mut s2[..]));
            }
            p[0]
        };
        assert_eq!(run(Optim::sgd(0.1, 0.0), 2), 1.0 - 2.0 * 0.05);
        // momentum 0.9: buf 0.5, 0.95 → p = 1 − 0.1·(0.5 + 0.95)
        assert!((run(Optim::sgd(0.1, 0.9), 2) - (1.0 - 0.145)).abs() < 1e-6);
        // nesterov: d1 = 0.5 + 0.45, d2 = 0.5 + 0.855
        let nesterov = Optim::Sgd { lr: 0.1, momentum: 0.9, nesterov: true };
        assert!((run(nesterov, 2) - (1.0 - 0.1 * (0.95 + 1.355))).abs() < 1e-6);
        // Adam's first step moves by lr·g/|g| = lr (up to ε)
        assert!((run(Optim::adam(0.01), 1) - 0.99).abs() < 1e-6);
        // AdamW: decay first, then the same step
        assert!((run(Optim::adamw(0.01, 0.1), 1) - (1.0 * (1.0 - 0.001) - 0.01)).abs() < 1e-6);
        // RMSProp first step: v = 0.01·0.25, p −= lr·0.5/0.05
        assert!((run(Optim::rmsprop(0.001), 1) - (1.0 - 0.01)).abs() < 1e-5);
    }

    #[test]
    fn bad_hyper_parameters_are_errors() {
        for bad in [
            Optim::adam(0.0),
            Optim::adam(f32::NAN),
            Optim::sgd(0.1, 1.0),
            Optim::adamw(0.1, -1.0),
            Optim::Adam { lr: 0.1, beta1: 0.9, beta2: 1.0, eps: 1e-8 },
        ] {
            assert!(matches!(bad.check(), Err(Error::Config(_))), "{bad:?}");
        }
    }
}
