//! A built model: its plan, its flat parameters, and the threads it runs on.

use crate::cache::{check_labels, Cache, Grads};
use crate::chain::{Plan, Shape};
use crate::cpu::pool::{physical_cores, Pool};
use crate::dev::{DevModel, GpuOptions};
use crate::device::{Device, ToDevice};
use crate::error::{Error, Result};
use crate::init::{self, Init};
use crate::layers::{self, region};
use crate::loss::{self, Loss};
use std::borrow::Cow;
use std::sync::Arc;

/// A model with fixed shapes. Parameters are one flat buffer in the plan's layout: per layer,
/// Dense weight (out, in) row-major then bias; Conv weight (out_ch, in_ch, kh, kw) then bias.
///
/// A model lives on one [`Device`]: its parameters are in host memory (`Device::Cpu`, run on the
/// model's thread pool) or in the memory of one GPU (`Device::Cuda(n)`, run on the model's own
/// stream). [`Model::to`] copies it to another device.
pub struct Model {
    pub(crate) plan: Arc<Plan>,
    /// The parameters on the CPU; empty while the model is on a GPU (then in `dev`).
    pub(crate) params: Vec<f32>,
    pub(crate) pool: Arc<Pool>,
    pub(crate) dev: Option<DevModel>,
    pub(crate) gpu_options: GpuOptions,
}

/// Threads a new model uses: `FLATNN_THREADS` if set to a positive number, else the physical
/// core count.
pub fn default_threads() -> usize {
    std::env::var("FLATNN_THREADS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or_else(physical_cores)
}

impl Model {
    pub(crate) fn from_plan(plan: Plan) -> Result<Model> {
        let params = vec![0.0; plan.param_len];
        let pool = Arc::new(new_pool(default_threads())?);
        Ok(Model { plan: Arc::new(plan), params, pool, dev: None, gpu_options: GpuOptions::default() })
    }

    /// Fills the parameters from an initialiser and a seed (biases zero), on the CPU; call it
    /// before moving the model to a GPU.
    pub fn init(mut self, init: Init, seed: u64) -> Model {
        if self.dev.is_none() {
            init::fill(&self.plan, &mut self.params, init, seed);
        }
        self
    }

    /// The device this model's parameters live on.
    pub fn device(&self) -> Device {
        self.dev.as_ref().map_or(Device::Cpu, DevModel::device)
    }

    /// A copy of this model on `device` (parameters copied; caches, gradient buffers and
    /// optimisers must be made or moved for it). From a GPU, waits for the steps queued there.
    pub fn to(&self, device: &Device) -> Result<Model> {
        let params = self.parameters()?;
        let dev = match *device {
            Device::Cpu => None,
            Device::Cuda(ordinal) => Some(DevModel::on(ordinal, &params, self.gpu_options)?),
        };
        let params = if dev.is_some() { Vec::new() } else { params.into_owned() };
        Ok(Model { plan: Arc::clone(&self.plan), params, pool: Arc::clone(&self.pool), dev, gpu_options: self.gpu_options })
    }

    /// The same model with these GPU options (graphs, TF32), which take effect when it is next
    /// moved to a GPU, or now if it is on one. Caches must be preallocated after this.
    pub fn with_gpu_options(self, options: GpuOptions) -> Result<Model> {
        let mut model = Model { gpu_options: options, ..self };
        if let Some(device) = model.dev.as_ref().map(DevModel::device) {
            model = model.to(&Device::Cpu)?.to(&device)?;
        }
        Ok(model)
    }

    /// The GPU options this model runs with.
    pub fn gpu_options(&self) -> GpuOptions {
        self.gpu_options
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

    /// All parameters, flat: borrowed on the CPU, copied from a GPU (after its queued steps).
    pub fn parameters(&self) -> Result<Cow<'_, [f32]>> {
        match &self.dev {
            None => Ok(Cow::Borrowed(&self.params)),
            Some(dev) => {
                let mut out = vec![0.0; self.plan.param_len];
                dev.download(&mut out)?;
                Ok(Cow::Owned(out))
            }
        }
    }

    /// All parameters, flat and writable, for a model on the CPU (on a GPU: an error; use
    /// [`Model::set_parameters`]).
    pub fn parameters_mut(&mut self) -> Result<&mut [f32]> {
        match self.dev {
            None => Ok(&mut self.params),
            Some(_) => Err(Error::Mismatch(format!("the parameters live on {}: use set_parameters", self.device()))),
        }
    }

    /// Replaces every parameter, on any device.
    pub fn set_parameters(&mut self, values: &[f32]) -> Result<()> {
        if values.len() != self.plan.param_len {
            return Err(Error::Shape(format!("{} parameter values for a model of {}", values.len(), self.plan.param_len)));
        }
        match &mut self.dev {
            None => self.params.copy_from_slice(values),
            Some(dev) => dev.upload(values)?,
        }
        Ok(())
    }

    /// A cache (inputs, targets, activations, scratch) for batches of up to `capacity`, on
    /// this model's device.
    pub fn preallocate(&self, capacity: usize) -> Result<Cache> {
        let dev = self.dev.as_ref().map(|d| d.new_cache(&self.plan, capacity)).transpose()?;
        Cache::new(&self.plan, capacity, self.threads(), dev)
    }

    /// Gradient buffers for batches of up to `capacity`, on this model's device.
    pub fn preallocate_grads(&self, capacity: usize) -> Result<Grads> {
        let dev = self.dev.as_ref().map(|d| d.new_grads(&self.plan, capacity)).transpose()?;
        Grads::new(&self.plan, capacity, self.threads(), dev)
    }

    /// Runs the model on the cache's current batch and returns the outputs
    /// (`batch × outputs`; from a GPU, copied back after the host waits for them). Allocates
    /// nothing.
    pub fn forward<'c>(&self, cache: &'c mut Cache) -> Result<&'c [f32]> {
        self.check_cache(cache)?;
        if let Some(dev) = &self.dev {
            return dev.forward(&self.plan, cache);
        }
        layers::forward(&self.plan, &self.params, &mut cache.acts, cache.capacity, cache.batch, &self.pool, &mut cache.ws);
        Ok(cache.outputs())
    }

    /// Forward, loss and backward on the cache's current batch: fills `grads` with the
    /// gradient of the loss, which stays in `grads` ([`Grads::last_loss`], [`Grads::mean_loss`]),
    /// so a GPU step never waits for it. Targets come from `set_labels` (cross-entropy) or
    /// `set_targets` (MSE) and must cover the batch. Every check runs before any buffer is
    /// written. Allocates nothing. On a GPU the step is queued and the host goes on.
    pub fn backprop(&self, grads: &mut Grads, cache: &mut Cache, loss: Loss) -> Result<()> {
        self.check_backprop(grads, cache, loss)?;
        if let Some(dev) = &self.dev {
            return dev.backprop(&self.plan, grads, cache, loss);
        }
        let (batch, outputs) = (cache.batch, self.plan.output().len());
        let (plan, capacity) = (&*self.plan, cache.capacity);
        layers::forward(plan, &self.params, &mut cache.acts, capacity, batch, &self.pool, &mut cache.ws);
        let last = plan.steps.last().expect("a plan has steps").output_region;
        let out = region(plan, last, capacity, batch);
        let (y, dy) = (&cache.acts[out.clone()], &mut grads.dacts[out]);
        let value = match loss {
            Loss::LogitCrossEntropy => loss::logit_cross_entropy_fast(y, &cache.labels[..batch], outputs, dy),
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

    /// [`Model::backprop`]'s checks of its arguments.
    pub(crate) fn check_backprop(&self, grads: &Grads, cache: &Cache, loss: Loss) -> Result<()> {
        self.check_cache(cache)?;
        if !Arc::ptr_eq(&grads.plan, &self.plan) {
            return Err(Error::Mismatch("these gradient buffers were preallocated for another model".into()));
        }
        if grads.device() != self.device() {
            return Err(Error::Mismatch(format!("gradient buffers on {}, model on {}", grads.device(), self.device())));
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
                if !cache.labels_on_device {
                    check_labels(&cache.labels[..batch], outputs)?;
                }
            }
            Loss::Mse => {
                if cache.targets_set != batch {
                    return Err(Error::Shape(format!("{} targets set for a batch of {batch}: call set_targets", cache.targets_set)));
                }
            }
        }
        Ok(())
    }

    fn check_cache(&self, cache: &Cache) -> Result<()> {
        if !Arc::ptr_eq(&cache.plan, &self.plan) {
            return Err(Error::Mismatch("this cache was preallocated for another model".into()));
        }
        if cache.device() != self.device() {
            return Err(Error::Mismatch(format!("cache on {}, model on {}: move them together", cache.device(), self.device())));
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
            .field("parameters", &self.plan.param_len)
            .field("device", &self.device())
            .field("threads", &self.threads())
            .finish()
    }
}

impl ToDevice for Model {
    fn to_device(self, device: &Device) -> Result<Self> {
        if self.device() == *device {
            return Ok(self);
        }
        self.to(device)
    }
}
