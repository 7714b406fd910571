//! A built model: its plan, its flat parameters, and the threads it runs on.

use crate::cache::{check_finite, check_labels, Cache, Grads};
use crate::chain::{Plan, Shape};
use crate::cpu::pool::{max_threads, physical_cores, Pool};
use crate::dev::{DevModel, GpuOptions};
use crate::device::{Device, ToDevice};
use crate::error::{zeros, Error, Result};
use crate::init::{self, Init};
use crate::layers::{self, region, Buffers, Draw, Mode};
use crate::loss::Loss;
use std::borrow::Cow;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

/// A model with fixed shapes. Parameters are one flat buffer in the plan's layout: per layer,
/// Dense weight (out, in) row-major then bias; Conv weight (out_ch, in_ch, kh, kw) then bias.
/// Buffers (values that belong to the model but are not trained, such as running statistics)
/// are a second flat buffer, laid out by the plan in the same way.
///
/// A model lives on one [`Device`]: its parameters are in host memory (`Device::Cpu`, run on the
/// model's thread pool) or in the memory of one GPU (`Device::Cuda(n)`, run on the model's own
/// stream). [`Model::to`] copies it to another device.
///
/// Training passes ([`Model::backprop`], [`crate::Optimizer::train_step`]) run in training mode,
/// as PyTorch's `train()`: batch norm normalises by the batch's statistics and moves its running
/// statistics (a model's buffers change in every training pass, through `&self`), and dropout
/// draws its masks from the model's seed and the count of training passes. [`Model::forward`],
/// [`Model::loss`] and a [`crate::Server`] run in inference mode, as `eval()`.
pub struct Model {
    pub(crate) plan: Arc<Plan>,
    /// The parameters on the CPU; empty while the model is on a GPU (then in `dev`).
    pub(crate) params: Vec<f32>,
    /// The buffers on the CPU; empty while the model is on a GPU (then in `dev`). A training
    /// pass writes them (running statistics) while it holds the lock; inference reads them.
    pub(crate) buffers: RwLock<Vec<f32>>,
    /// Dropout's seed (from [`Model::init`]).
    pub(crate) seed: u64,
    /// Training passes taken: the number dropout draws the next pass's masks with.
    pub(crate) passes: AtomicU64,
    pub(crate) pool: Arc<Pool>,
    pub(crate) dev: Option<DevModel>,
    pub(crate) gpu_options: GpuOptions,
    /// Which values the CPU parameters hold: a number no other set of values of this process
    /// has had ([`new_version`]), drawn anew wherever they may change (an update,
    /// `set_parameters`, a load, a `parameters_mut` borrow). A cache keeps the weights it
    /// packed from them with the version they came from, and repacks when it differs.
    pub(crate) version: u64,
}

/// A parameter version no model of this process has had.
pub(crate) fn new_version() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// An inference pass on the CPU over the cache's batch with the parameters `params` of their
/// version, reading `buffers`, on `pool` (or, at batch 1, where the cache timed it faster); its
/// outputs.
fn infer<'c>(plan: &Plan, params: (&[f32], u64), pool: &Pool, draw: Draw, buffers: &[f32], cache: &'c mut Cache) -> &'c [f32] {
    let (buffers, pool) = (Buffers::Read(buffers), cache.one.pool(cache.batch, pool));
    layers::forward(plan, params, &mut cache.acts, cache.capacity, cache.batch, pool, &mut cache.ws, buffers, draw, Mode::Infer);
    cache.outputs()
}

/// A model's two flat vectors the plan lays out: its parameters and its buffers.
#[derive(Clone, Copy)]
enum Flat {
    Params,
    Buffers,
}

/// Threads a new model uses: `FLATNN_THREADS` if set, else the physical core count. A value
/// that is not a whole number from 1 to 4 per logical CPU is an [`Error::Config`] naming it.
pub fn default_threads() -> Result<usize> {
    threads_setting(std::env::var_os("FLATNN_THREADS").as_deref())
}

/// [`default_threads`] for a given value of `FLATNN_THREADS` (`None`: not set).
fn threads_setting(value: Option<&OsStr>) -> Result<usize> {
    let Some(value) = value else {
        return Ok(physical_cores());
    };
    let limit = max_threads();
    match value.to_str().and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(threads) if (1..=limit).contains(&threads) => Ok(threads),
        _ => Err(Error::Config(format!("FLATNN_THREADS={value:?}: the thread count must be a whole number from 1 to {limit} here"))),
    }
}

impl Model {
    /// The model of `plan`, its parameters zero and its buffers at their starting constants: an
    /// [`Error::OutOfMemory`] if they cannot be had.
    pub(crate) fn from_plan(plan: Plan) -> Result<Model> {
        let params = zeros(plan.param_len, || format!("the {} parameters of the model", plan.param_len))?;
        let mut buffers = zeros(plan.buffer_len, || format!("the {} buffer values of the model", plan.buffer_len))?;
        init::fill_buffers(&plan, &mut buffers);
        let pool = Arc::new(Pool::new(default_threads()?)?);
        let (buffers, passes) = (RwLock::new(buffers), AtomicU64::new(0));
        let version = new_version();
        Ok(Model { plan: Arc::new(plan), params, buffers, seed: 0, passes, pool, dev: None, gpu_options: GpuOptions::default(), version })
    }

    /// Fills the parameters from an initialiser and a seed (biases zero), on the CPU, and makes
    /// `seed` dropout's seed too; call it before moving the model to a GPU.
    pub fn init(mut self, init: Init, seed: u64) -> Model {
        if self.dev.is_none() {
            let plan = Arc::clone(&self.plan);
            init::fill(&plan, self.params_to_write(), init, seed);
            self.seed = seed;
        }
        self
    }

    /// Training passes taken so far (each [`Model::backprop`] and each
    /// [`crate::Optimizer::train_step`] is one, from 0 for a model built or loaded): dropout
    /// draws pass k's masks from the model's seed and k, on either device, and a checkpoint
    /// keeps the count, so a resumed run draws the masks the uninterrupted one would have.
    pub fn train_passes(&self) -> u64 {
        self.passes.load(Ordering::Relaxed)
    }

    /// Sets dropout's seed and the count of training passes taken (what a checkpoint restores).
    pub(crate) fn set_train_passes(&mut self, seed: u64, passes: u64) -> Result<()> {
        if let Some(dev) = &mut self.dev {
            dev.set_draw(seed, passes)?;
        }
        (self.seed, self.passes) = (seed, AtomicU64::new(passes));
        Ok(())
    }

    /// Where a training pass draws dropout's masks: the seed, and the count of passes before it.
    fn draw(&self, pass: u64) -> Draw {
        Draw { seed: self.seed, pass, replica: 0 }
    }

    /// The device this model's parameters live on.
    pub fn device(&self) -> Device {
        self.dev.as_ref().map_or(Device::Cpu, DevModel::device)
    }

    /// A copy of this model on `device` (parameters and buffers copied; caches, gradient
    /// buffers and optimisers must be made or moved for it). From a GPU, waits for the steps
    /// queued there.
    pub fn to(&self, device: &Device) -> Result<Model> {
        let (params, buffers) = (self.parameters()?, self.buffers()?);
        let dev = match *device {
            Device::Cpu => None,
            Device::Cuda(ordinal) => Some(DevModel::on(ordinal, &params, &buffers, self.draw(self.train_passes()), self.gpu_options)?),
        };
        let (params, buffers) = if dev.is_some() { (Vec::new(), Vec::new()) } else { (params.into_owned(), buffers.into_owned()) };
        let (pool, buffers, passes) = (Arc::clone(&self.pool), RwLock::new(buffers), AtomicU64::new(self.train_passes()));
        let (seed, gpu_options, version) = (self.seed, self.gpu_options, new_version());
        Ok(Model { plan: Arc::clone(&self.plan), params, buffers, seed, passes, pool, dev, gpu_options, version })
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

    /// The same model on `threads` threads (the caller's included), from 1 to 4 per logical CPU
    /// of this machine (more is an [`Error::Config`]). Caches and gradient buffers must be
    /// preallocated after this.
    pub fn with_threads(mut self, threads: usize) -> Result<Model> {
        self.pool = Arc::new(Pool::new(threads)?);
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
        self.flat(Flat::Params)
    }

    /// All parameters, flat and writable, for a model on the CPU (on a GPU: an error; use
    /// [`Model::set_parameters`]). Unlike `set_parameters`, nothing checks what is written
    /// here: a NaN or an infinity goes into every later step.
    pub fn parameters_mut(&mut self) -> Result<&mut [f32]> {
        match self.dev {
            None => Ok(self.params_to_write()),
            Some(_) => Err(Error::Mismatch(format!("the parameters live on {}: use set_parameters", self.device()))),
        }
    }

    /// Replaces every parameter, on any device. A NaN or infinite value is an
    /// [`Error::NonFinite`]; nothing is written on error.
    pub fn set_parameters(&mut self, values: &[f32]) -> Result<()> {
        self.set_flat(Flat::Params, values)
    }

    /// The CPU parameters, to be written: under a new version, so that caches repack.
    pub(crate) fn params_to_write(&mut self) -> &mut [f32] {
        self.version = new_version();
        &mut self.params
    }

    /// All buffers (values of the model that are not trained, such as running statistics), flat
    /// in the plan's layout: borrowed on the CPU, copied from a GPU (after its queued steps).
    pub fn buffers(&self) -> Result<Cow<'_, [f32]>> {
        self.flat(Flat::Buffers)
    }

    /// Replaces every buffer value, on any device, as [`Model::set_parameters`] does the
    /// parameters.
    pub(crate) fn set_buffers(&mut self, values: &[f32]) -> Result<()> {
        self.set_flat(Flat::Buffers, values)
    }

    /// The parameters or the buffers: on the CPU the parameters borrowed and the buffers copied
    /// (a training pass may write them), copied from a GPU.
    fn flat(&self, which: Flat) -> Result<Cow<'_, [f32]>> {
        let (len, what) = match which {
            Flat::Params => (self.plan.param_len, "parameters"),
            Flat::Buffers => (self.plan.buffer_len, "buffers"),
        };
        if let (None, Flat::Params) = (&self.dev, which) {
            return Ok(Cow::Borrowed(&self.params));
        }
        let mut out = zeros(len, || format!("a host copy of the {what}"))?;
        match (&self.dev, which) {
            (None, _) => out.copy_from_slice(&self.buffers.read().unwrap_or_else(PoisonError::into_inner)),
            (Some(dev), Flat::Params) => dev.download(&mut out)?,
            (Some(dev), Flat::Buffers) => dev.download_buffers(&mut out)?,
        }
        Ok(Cow::Owned(out))
    }

    /// The parameters or the buffers replaced by `values`, checked first (length, finite).
    fn set_flat(&mut self, which: Flat, values: &[f32]) -> Result<()> {
        let (host, len, (one, what)) = match which {
            Flat::Params => (&mut self.params, self.plan.param_len, ("parameter", "parameters")),
            Flat::Buffers => (self.buffers.get_mut().unwrap_or_else(PoisonError::into_inner), self.plan.buffer_len, ("buffer", "buffers")),
        };
        if values.len() != len {
            return Err(Error::Shape(format!("{} {one} values for a model of {len}", values.len())));
        }
        check_finite(values, what)?;
        if matches!(which, Flat::Params) {
            self.version = new_version();
        }
        match (&mut self.dev, which) {
            (None, _) => host.copy_from_slice(values),
            (Some(dev), Flat::Params) => dev.upload(values)?,
            (Some(dev), Flat::Buffers) => dev.upload_buffers(values)?,
        }
        Ok(())
    }

    /// A cache (inputs, targets, activations, scratch) for batches of up to `capacity`, on
    /// this model's device.
    pub fn preallocate(&self, capacity: usize) -> Result<Cache> {
        let dev = self.dev.as_ref().map(|d| d.new_cache(&self.plan, capacity)).transpose()?;
        let mut cache = Cache::new(&self.plan, capacity, self.threads(), dev)?;
        let buffers = self.buffers.read().unwrap_or_else(PoisonError::into_inner);
        cache.time_batch_one((&self.params, self.version), &buffers, self.draw(self.train_passes()), &self.pool);
        Ok(cache)
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
        cache.inputs_finite = true;
        if let Some(dev) = &self.dev {
            return dev.forward(&self.plan, cache);
        }
        let buffers = self.buffers.read().unwrap_or_else(PoisonError::into_inner);
        Ok(infer(&self.plan, (&self.params, self.version), &self.pool, self.draw(self.train_passes()), &buffers, cache))
    }

    /// [`Model::forward`] through `&mut self`: the buffers are borrowed, not locked, so a caller
    /// that owns its model (a stream's step) takes no lock.
    pub(crate) fn forward_owned<'c>(&mut self, cache: &'c mut Cache) -> Result<&'c [f32]> {
        if self.dev.is_some() {
            return self.forward(cache);
        }
        self.check_cache(cache)?;
        cache.inputs_finite = true;
        let draw = self.draw(self.train_passes());
        let buffers = self.buffers.get_mut().unwrap_or_else(PoisonError::into_inner);
        Ok(infer(&self.plan, (&self.params, self.version), &self.pool, draw, buffers, cache))
    }

    /// Forward, loss and backward on the cache's current batch: fills `grads` with the
    /// gradient of the loss, which stays in `grads` ([`Grads::last_loss`], [`Grads::mean_loss`]),
    /// so a GPU step never waits for it. Targets come from `set_labels` (cross-entropy) or
    /// `set_targets` (the other losses) and must cover the batch. Every check runs before any buffer is
    /// written. Allocates nothing. On a GPU the step is queued and the host goes on.
    ///
    /// Cross-entropy needs a vector of at least 2 outputs (class scores). A loss that comes out
    /// NaN or infinite (divergence) is recorded as it is: see [`Grads::last_loss`] and
    /// [`Grads::diverged`].
    pub fn backprop(&self, grads: &mut Grads, cache: &mut Cache, loss: Loss) -> Result<()> {
        self.check_backprop(grads, cache, loss)?;
        cache.inputs_finite = true;
        if let Some(dev) = &self.dev {
            dev.backprop(&self.plan, grads, cache, loss)?;
            self.passes.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let (batch, outputs) = (cache.batch, self.plan.output().len());
        let (plan, capacity) = (&*self.plan, cache.capacity);
        // the lock is taken first: passes on two threads take their numbers in the order they run
        let mut buffers = self.buffers.write().unwrap_or_else(PoisonError::into_inner);
        let draw = self.draw(self.passes.fetch_add(1, Ordering::Relaxed));
        let buffers = Buffers::Write(&mut buffers);
        let params = (&self.params[..], self.version);
        layers::forward(plan, params, &mut cache.acts, capacity, batch, &self.pool, &mut cache.ws, buffers, draw, Mode::Train);
        let last = plan.steps.last().expect("a plan has steps").output_region;
        let out = region(plan, last, capacity, batch);
        let (y, dy) = (&cache.acts[out.clone()], &mut grads.dacts[out]);
        let value = loss.fast(y, &cache.labels[..batch], &cache.targets[..batch * outputs], outputs, dy);
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
            draw,
        );
        grads.record_loss(value);
        Ok(())
    }

    /// The loss on the cache's current batch in inference mode, as [`Model::forward`] runs it
    /// (no gradient, no [`Grads`]): a validation loss. Targets as for `backprop`, covering the
    /// batch (set, or gathered by a loader). On the CPU it is the value `backprop` reports for
    /// the same batch, bit for bit. On a GPU the forward pass runs there and the value is
    /// computed on the host from the outputs it brings back (and from the targets, copied back
    /// where a loader gathered them on the device); the host waits. Allocates nothing.
    pub fn loss(&self, cache: &mut Cache, loss: Loss) -> Result<f32> {
        self.check_cache(cache)?;
        self.check_targets(cache, loss)?;
        self.forward(cache)?;
        cache.targets_to_host(loss)?;
        let (batch, outputs) = (cache.batch, self.plan.output().len());
        let value = loss.fast_value(cache.outputs(), &cache.labels[..batch], &cache.targets[..batch * outputs], outputs);
        Ok(value as f32)
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
        layers::batch_norm::check_batch(&self.plan, batch)?;
        self.check_targets(cache, loss)
    }

    /// The cache holds `loss`'s targets (labels, or real values) for its whole batch.
    pub(crate) fn check_targets(&self, cache: &Cache, loss: Loss) -> Result<()> {
        let (batch, outputs) = (cache.batch, self.plan.output().len());
        if let Loss::SmoothL1 { beta } = loss {
            if !(beta.is_finite() && beta >= 0.0) {
                return Err(Error::Config(format!("SmoothL1's beta must be a finite number of at least 0, not {beta}")));
            }
        }
        match loss {
            Loss::LogitCrossEntropy => {
                // one score gives a loss of 0 and no gradient; an image is not a set of scores
                if !matches!(self.plan.output(), Shape::Vector(classes) if classes >= 2) {
                    return Err(Error::Shape(format!(
                        "cross-entropy needs a vector of at least 2 class scores per sample; the model outputs {}",
                        self.plan.output()
                    )));
                }
                if cache.labels_set != batch {
                    return Err(Error::Shape(format!("{} labels set for a batch of {batch}: call set_labels", cache.labels_set)));
                }
                if !cache.labels_on_device {
                    check_labels(&cache.labels[..batch], outputs)?;
                }
            }
            Loss::Mse | Loss::BceWithLogits | Loss::L1 | Loss::SmoothL1 { .. } => {
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
        if !cache.inputs_finite {
            // written in place (`Cache::inputs_mut`) since the last check
            check_finite(cache.inputs(), "inputs")?;
        }
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flatnn_threads_is_a_whole_number_from_one_to_the_limit() {
        let limit = max_threads();
        assert_eq!(threads_setting(None).unwrap(), physical_cores());
        assert_eq!(threads_setting(Some(OsStr::new("1"))).unwrap(), 1);
        assert_eq!(threads_setting(Some(OsStr::new(&limit.to_string()))).unwrap(), limit);
        let too_many = (limit + 1).to_string();
        for bad in ["garbage", "0", "-1", "2.5", "", "100000", "99999999999999999999999", &too_many] {
            match threads_setting(Some(OsStr::new(bad))) {
                Err(Error::Config(msg)) => {
                    assert!(msg.contains(&format!("FLATNN_THREADS={bad:?}")) && msg.contains(&limit.to_string()), "{msg}")
                }
                other => panic!("FLATNN_THREADS={bad:?}: expected a Config error, got {other:?}"),
            }
        }
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            assert!(matches!(threads_setting(Some(OsStr::from_bytes(b"4\xff"))), Err(Error::Config(_))));
        }
    }

    #[test]
    fn with_threads_refuses_counts_past_the_limit_naming_both() {
        let limit = max_threads();
        for threads in [0, limit + 1, 30_000] {
            let model = crate::models::mlp().build().unwrap();
            match model.with_threads(threads) {
                Err(Error::Config(msg)) => {
                    assert!(msg.contains(&format!("{threads} threads")) && msg.contains(&limit.to_string()), "{msg}")
                }
                other => panic!("{threads} threads: expected a Config error, got {other:?}"),
            }
        }
        let model = crate::models::mlp().build().unwrap().with_threads(limit.min(3)).unwrap();
        assert_eq!(model.threads(), limit.min(3));
    }
}
