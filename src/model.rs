//! A built model: its plan, its flat parameters, and the threads it runs on.

use crate::cache::{check_labels, Cache, Grads};
use crate::chain::{Plan, Shape};
use crate::cpu::pool::{physical_cores, Pool};
use crate::error::{Error, Result};
use crate::init::{self, Init};
use crate::layers::{self, region};
use crate::loss::{self, Loss};
use std::sync::Arc;

/// A model with fixed shapes. Parameters are one flat buffer in the plan's layout: per layer,
/// Dense weight (out, in) row-major then bias; Conv weight (out_ch, in_ch, kh, kw) then bias.
#[derive(Clone)]
pub struct Model {
    pub(crate) plan: Arc<Plan>,
    pub(crate) params: Vec<f32>,
    pub(crate) pool: Arc<Pool>,
}

/// Threads a new model uses: `FLATNN_THREADS` if set to a positive number, else the physical
/// core count.
pub fn default_threads() -> usize {
    std::env::var("FLATNN_THREADS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or_else(physical_cores)
}

impl Model {
    pub(crate) fn from_plan(plan: Plan) -> Result<Model> {
        let params = vec![0.0; plan.param_len];
        Ok(Model { plan: Arc::new(plan), params, pool: Arc::new(new_pool(default_threads())?) })
    }

    /// Fills the parameters from an initialiser and a seed (biases zero).
    pub fn init(mut self, init: Init, seed: u64) -> Model {
        init::fill(&self.plan, &mut self.params, init, seed);
        self
    }

    /// The same model on `threads` threads (the caller's included). Caches and gradient
    /// buffers must be preallocated after this.
    pub fn with_threads(mut self, threads: usize) -> Result<Model> {
        if threads == 0 {
            return Err(Error::Config("a model needs at least one thread".into()));
        }
        self.pool = Arc::new(new_pool(threads)?);
        Ok(self)
    }

    /// Threads this model runs on.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The compiled plan: every layer's shapes and buffer ranges.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Shape of one input sample.
    pub fn input_shape(&self) -> Shape {
        self.plan.input
    }

    /// Shape of one output sample.
    pub fn output_shape(&self) -> Shape {
        self.plan.output()
    }

    /// All parameters, flat.
    pub fn parameters(&self) -> &[f32] {
        &self.params
    }

    /// All parameters, flat and writable.
    pub fn parameters_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }

    /// A cache (inputs, targets, activations, scratch) for batches of up to `capacity`.
    pub fn preallocate(&self, capacity: usize) -> Result<Cache> {
        Cache::new(&self.plan, capacity, self.threads())
    }

    /// Gradient buffers for batches of up to `capacity`.
    pub fn preallocate_grads(&self, capacity: usize) -> Result<Grads> {
        Grads::new(&self.plan, capacity, self.threads())
    }

    /// Runs the model on the cache's current batch and returns the outputs
    /// (`batch × outputs`). Allocates nothing.
    pub fn forward<'c>(&self, cache: &'c mut Cache) -> Result<&'c [f32]> {
        self.check_cache(cache)?;
        layers::forward(&self.plan, &self.params, &mut cache.acts, cache.capacity, cache.batch, &self.pool, &mut cache.ws);
        Ok(cache.outputs())
    }

    /// Forward, loss and backward on the cache's current batch: fills `grads` with the
    /// gradient of the loss, which stays in `grads` ([`Grads::last_loss`], [`Grads::mean_loss`]),
    /// so a GPU step never waits for it. Targets come from `set_labels` (cross-entropy) or
    /// `set_targets` (MSE) and must cover the batch. Every check runs before any buffer is
    /// written. Allocates nothing.
    pub fn backprop(&self, grads: &mut Grads, cache: &mut Cache, loss: Loss) -> Result<()> {
        self.check_cache(cache)?;
        if !Arc::ptr_eq(&grads.plan, &self.plan) {
            return Err(Error::Mismatch("these gradient buffers were preallocated for another model".into()));
        }
        if grads.threads != self.threads() {
            return Err(Error::Mismatch(format!(
                "gradient buffers built for {} threads, model runs {}: preallocate again",
                grads.threads,
                self.threads()
            )));
        }
        let batch = cache.batch;
        if batch > grads.capacity {
            return Err(Error::Capacity { batch, capacity: grads.capacity });
        }
        let outputs = self.plan.output().len();
        match loss {
            Loss::LogitCrossEntropy => {
                if cache.labels_set != batch {
                    return Err(Error::Shape(format!("{} labels set for a batch of {batch}: call set_labels", cache.labels_set)));
                }
                check_labels(&cache.labels[..batch], outputs)?;
            }
            Loss::Mse => {
                if cache.targets_set != batch {
                    return Err(Error::Shape(format!("{} targets set for a batch of {batch}: call set_targets", cache.targets_set)));
                }
            }
        }
        let (plan, capacity) = (&*self.plan, cache.capacity);
        layers::forward(plan, &self.params, &mut cache.acts, capacity, batch, &self.pool, &mut cache.ws);
        let last = plan.steps.last().expect("a plan has steps").output_region;
        let out = region(plan, last, capacity, batch);
        let (y, dy) = (&cache.acts[out.clone()], &mut grads.dacts[out]);
        let value = match loss {
            Loss::LogitCrossEntropy => loss::logit_cross_entropy(y, &cache.labels[..batch], outputs, dy),
            Loss::Mse => loss::mse(y, &cache.targets[..batch * outputs], dy),
        };
        layers::backward(
            plan,
            &self.params,
            &cache.acts,
            &mut grads.dacts,
            &mut grads.grads,
            capacity,
            batch,
            &self.pool,
            &mut cache.ws,
            &mut grads.gws,
        );
        grads.record_loss(value);
        Ok(())
    }

    fn check_cache(&self, cache: &Cache) -> Result<()> {
        if !Arc::ptr_eq(&cache.plan, &self.plan) {
            return Err(Error::Mismatch("this cache was preallocated for another model".into()));
        }
        if cache.threads != self.threads() {
            return Err(Error::Mismatch(format!(
                "cache built for {} threads, model runs {}: preallocate again",
                cache.threads,
                self.threads()
            )));
        }
        if cache.batch == 0 {
            return Err(Error::Shape("no inputs set: call set_inputs first".into()));
        }
        Ok(())
    }
}

fn new_pool(threads: usize) -> Result<Pool> {
    Pool::new(threads).map_err(|e| Error::Config(format!("cannot start {threads} threads: {e}")))
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("input", &self.plan.input)
            .field("layers", &self.plan.steps.iter().map(|s| s.layer).collect::<Vec<_>>())
            .field("parameters", &self.params.len())
            .field("threads", &self.threads())
            .finish()
    }
}
