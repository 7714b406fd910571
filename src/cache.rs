//! Caches: everything a step needs, allocated once for a batch capacity.
//!
//! [`Cache`] (from `Model::preallocate`) holds inputs, targets, activations and forward
//! scratch; [`Grads`] (from `Model::preallocate_grads`) holds the parameter gradients (the
//! parameters' layout), activation gradients and backward scratch. A batch smaller than the
//! capacity runs in the front of the same buffers; a larger one is an [`Error::Capacity`].

use crate::chain::{batch_len, Plan};
use crate::cpu::pool::Pool;
use crate::cpu::turns::fastest_in_turns;
use crate::dev::{DevCache, DevGrads};
use crate::device::{Device, ToDevice};
use crate::error::{zeros, Error, Result};
use crate::layers::{self, region, Buffers, Draw, GradWorkspace, Mode, Workspace};
use crate::loss::Loss;
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

/// Inputs, targets, activations and forward scratch for up to `capacity` samples, on the
/// device of the model that made it. On a GPU the host keeps the batch's inputs, labels and
/// targets as set, and the next step copies what changed to the device.
pub struct Cache {
    pub(crate) plan: Arc<Plan>,
    pub(crate) capacity: usize,
    pub(crate) threads: usize,
    /// Samples in the current batch (set by `set_inputs`).
    pub(crate) batch: usize,
    /// The batch's inputs are known to be finite (checked by `set_inputs`, or copied from a
    /// data set checked when it was made); if not, `forward` and `backprop` check them first.
    pub(crate) inputs_finite: bool,
    /// Every activation on the CPU; on a GPU only the inputs (region 0), as staged by the host.
    pub(crate) acts: Vec<f32>,
    pub(crate) labels: Vec<u32>,
    pub(crate) targets: Vec<f32>,
    /// Samples whose labels / targets were last set.
    pub(crate) labels_set: usize,
    pub(crate) targets_set: usize,
    pub(crate) ws: Workspace,
    /// Where a forward pass of one sample runs.
    pub(crate) one: BatchOne,
    pub(crate) dev: Option<DevCache>,
    /// What the host changed since the device last saw it (GPU caches only).
    pub(crate) inputs_dirty: bool,
    pub(crate) labels_dirty: bool,
    pub(crate) targets_dirty: bool,
    /// The inputs / labels / targets were written on the device (by a data loader; the labels
    /// from a data set checked when it was uploaded), so the host's copies are not theirs.
    pub(crate) inputs_on_device: bool,
    pub(crate) labels_on_device: bool,
    pub(crate) targets_on_device: bool,
}

impl Cache {
    pub(crate) fn new(plan: &Arc<Plan>, capacity: usize, threads: usize, dev: Option<DevCache>) -> Result<Cache> {
        check_capacity(capacity)?;
        // on a GPU the host stages inputs in the device half's page-locked buffers
        let acts_len = if dev.is_some() { 0 } else { plan.acts_len(capacity)? };
        let acts = zeros(acts_len, || format!("the activations of a cache for {capacity} samples"))?;
        let targets = batch_len(capacity, plan.output().len(), "targets")?;
        Ok(Cache {
            plan: Arc::clone(plan),
            capacity,
            threads,
            batch: 0,
            inputs_finite: true,
            acts,
            labels: zeros(capacity, || format!("the labels of a cache for {capacity} samples"))?,
            targets: zeros(targets, || format!("the targets of a cache for {capacity} samples"))?,
            labels_set: 0,
            targets_set: 0,
            ws: if dev.is_some() { Workspace::none() } else { Workspace::new(plan, capacity, threads)? },
            one: BatchOne { alone: Pool::new(1)?, times: None },
            dev,
            inputs_dirty: false,
            labels_dirty: false,
            targets_dirty: false,
            inputs_on_device: false,
            labels_on_device: false,
            targets_on_device: false,
        })
    }

    /// The device this cache's buffers live on.
    pub fn device(&self) -> Device {
        self.dev.as_ref().map_or(Device::Cpu, DevCache::device)
    }

    /// The largest batch this cache runs.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Samples in the current batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Copies a batch of inputs (`batch × input length`, sample-major) into the cache; the
    /// batch size is the length over the input length. A NaN or infinite value is an
    /// [`Error::NonFinite`]; the check reads the inputs once more than the copy does, and costs
    /// about what the copy does. Nothing is written on error.
    pub fn set_inputs(&mut self, inputs: &[f32]) -> Result<()> {
        let per_sample = self.plan.input.len();
        if inputs.is_empty() || !inputs.len().is_multiple_of(per_sample) {
            return Err(Error::Shape(format!(
                "{} input values is not a whole, non-zero number of samples of {} ({})",
                inputs.len(),
                per_sample,
                self.plan.input
            )));
        }
        let batch = inputs.len() / per_sample;
        check_finite(inputs, "inputs")?;
        self.inputs_mut(batch)?.copy_from_slice(inputs);
        self.inputs_finite = true;
        Ok(())
    }

    /// The input buffer for a batch of `batch` samples, to be filled in place (how the data
    /// loader writes without a copy); sets the batch size. What is written here is checked for
    /// NaN and infinities by the next `forward` or `backprop` (an [`Error::NonFinite`] before
    /// anything runs), once per batch written.
    pub fn inputs_mut(&mut self, batch: usize) -> Result<&mut [f32]> {
        if batch == 0 {
            return Err(Error::Shape("a batch needs at least one sample".into()));
        }
        if batch > self.capacity {
            return Err(Error::Capacity { batch, capacity: self.capacity });
        }
        let r = region(&self.plan, 0, self.capacity, batch);
        let inputs = match &mut self.dev {
            Some(dev) => dev.inputs_host_mut(r.len())?,
            None => &mut self.acts[r],
        };
        self.batch = batch;
        (self.inputs_dirty, self.inputs_on_device, self.inputs_finite) = (true, false, false);
        Ok(inputs)
    }

    /// The current batch's inputs as the host set them (a batch the data loader gathered on a
    /// GPU is not copied back: then these are the last inputs the host set).
    pub fn inputs(&self) -> &[f32] {
        let r = region(&self.plan, 0, self.capacity, self.batch);
        match &self.dev {
            Some(dev) => dev.inputs_host(r.len()),
            None => &self.acts[r],
        }
    }

    /// Sets class labels for [`crate::Loss::LogitCrossEntropy`], one per sample; each must be
    /// below the number of outputs. Nothing is written on error.
    pub fn set_labels(&mut self, labels: &[u32]) -> Result<()> {
        if labels.len() > self.capacity {
            return Err(Error::Capacity { batch: labels.len(), capacity: self.capacity });
        }
        check_labels(labels, self.plan.output().len())?;
        self.labels[..labels.len()].copy_from_slice(labels);
        self.labels_set = labels.len();
        (self.labels_dirty, self.labels_on_device) = (true, false);
        Ok(())
    }

    /// The label buffer for `batch` samples, to be filled in place; checked by `backprop`.
    pub fn labels_mut(&mut self, batch: usize) -> Result<&mut [u32]> {
        if batch > self.capacity {
            return Err(Error::Capacity { batch, capacity: self.capacity });
        }
        self.labels_set = batch;
        (self.labels_dirty, self.labels_on_device) = (true, false);
        Ok(&mut self.labels[..batch])
    }

    /// Sets real-valued targets for [`crate::Loss::Mse`] and the other losses that take them
    /// (`batch × outputs`); every value must be finite. Nothing is written on error.
    pub fn set_targets(&mut self, targets: &[f32]) -> Result<()> {
        let outputs = self.plan.output().len();
        if !targets.len().is_multiple_of(outputs) {
            return Err(Error::Shape(format!("{} target values is not a whole number of samples of {outputs}", targets.len())));
        }
        let batch = targets.len() / outputs;
        if batch > self.capacity {
            return Err(Error::Capacity { batch, capacity: self.capacity });
        }
        check_finite(targets, "targets")?;
        self.targets_mut(batch)?.copy_from_slice(targets);
        Ok(())
    }

    /// The target buffer for `batch` samples (`batch × outputs`), to be filled in place with
    /// finite values (how the data loader writes them).
    pub(crate) fn targets_mut(&mut self, batch: usize) -> Result<&mut [f32]> {
        if batch > self.capacity {
            return Err(Error::Capacity { batch, capacity: self.capacity });
        }
        self.targets_set = batch;
        (self.targets_dirty, self.targets_on_device) = (true, false);
        Ok(&mut self.targets[..batch * self.plan.output().len()])
    }

    /// Copies the batch's labels (for cross-entropy) or targets (the other losses) back into the host's
    /// buffers where a loader wrote them on the device, for a loss computed on the host.
    pub(crate) fn targets_to_host(&mut self, loss: Loss) -> Result<()> {
        let len = self.batch * self.plan.output().len();
        match &self.dev {
            Some(dev) if loss.takes_labels() && self.labels_on_device => dev.download_labels(&mut self.labels[..self.batch]),
            Some(dev) if !loss.takes_labels() && self.targets_on_device => dev.download_targets(&mut self.targets[..len]),
            _ => Ok(()),
        }
    }

    /// The model's outputs for the current batch: on the CPU valid after `forward` or
    /// `backprop`; from a GPU, the copy the last `forward` brought back.
    pub fn outputs(&self) -> &[f32] {
        let len = self.batch * self.plan.output().len();
        if let Some(dev) = &self.dev {
            return dev.outputs(len);
        }
        let last = self.plan.steps.last().map_or(0, |s| s.output_region);
        &self.acts[region(&self.plan, last, self.capacity, self.batch)]
    }

    /// How this cache's convolutions run on a GPU, for logs and benchmarks: a first line with
    /// cuDNN's version, `FLATNN_CUDNN` and the workspace (or why cuDNN is not used), then, for
    /// each batch size run so far, one line per conv layer giving, for the forward product, the
    /// weight gradient and the input gradient, the route chosen (`cudnn ALGO`; `own`, flatnn's
    /// lowering and products; for the weight gradient `own-implicit`, flatnn's product without
    /// a lowered matrix; `own-direct`, flatnn's direct kernels (the forward, the weight gradient
    /// and a stride-1 layer's input gradient), where they fit; `own-mma`, flatnn's tensor-core
    /// kernels (the forward, the weight gradient and a stride-1 layer's input gradient; sm_80
    /// on), where they fit) and the time per call measured for each candidate when the choice was
    /// made (`own (the only route)` where nothing else was a candidate); then, for
    /// each batch size run so far, one line per GRU or LSTM layer giving, for inference and for
    /// a training step's forward and backward, the route chosen (`cudnn ALGO`, cuDNN's RNN
    /// kernels with that algorithm, or `per-step`, flatnn's) and the time per call of each route
    /// and algorithm timed, with why cuDNN refused any (or one line saying why cuDNN is not used
    /// for them). Empty on the CPU and for models with neither.
    ///
    /// `FLATNN_CUDNN`, read once per process (when the first cache is made): `0` flatnn's
    /// kernels only, `1` cuDNN wherever it has an algorithm, `auto` (default; also what a value
    /// not understood means, which the first line says) whichever was measured faster, per
    /// layer, direction (or mode) and batch size. Without a cuDNN 9 library every convolution
    /// and recurrent layer runs on flatnn's kernels.
    pub fn conv_backends(&self) -> String {
        self.dev.as_ref().map_or_else(String::new, DevCache::conv_report)
    }

    /// Times a forward pass of one sample (zeros: the inputs of a new cache) on the parameters
    /// `params` of `version` and the model's `buffers` (`draw`: its dropout's, unused in
    /// inference), on `pool` and on the calling thread alone, and keeps the faster for every
    /// later pass of one sample ([`BatchOne`]): [`fastest_in_turns`] with [`ONE_RUNS`] calls
    /// each after two warm-up calls (the second packs the weights), a call on the pool counting
    /// only where it handed no work to the workers or they ran some of it ([`Pool::handed`]);
    /// the calling thread alone where none counted. Leaves the weights packed for `version`.
    /// For a cache on the CPU, before its first batch.
    pub(crate) fn time_batch_one(&mut self, (params, version): (&[f32], u64), buffers: &[f32], draw: Draw, pool: &Pool) {
        if pool.threads() == 1 || self.dev.is_some() {
            return;
        }
        let (plan, capacity, acts, ws, alone) = (&self.plan, self.capacity, &mut self.acts, &mut self.ws, &self.one.alone);
        let [alone_time, pooled] = fastest_in_turns::<2>(ONE_RUNS, 2, |i| {
            let way = [alone, pool][i];
            let before = way.handed();
            layers::forward(plan, (params, version), acts, capacity, 1, way, ws, Buffers::Read(buffers), draw, Mode::Infer);
            let after = way.handed();
            if i == 0 {
                // the pool's turn is next: its workers, asleep after a pass longer than they
                // spin, would otherwise come late to it, as they do not to back-to-back passes
                pool.wake();
            }
            after.0 == before.0 || after.1 > before.1
        });
        // (the calling thread's calls always count)
        self.one.times = Some((alone_time.unwrap_or(Duration::MAX), pooled.unwrap_or(Duration::MAX)));
    }

    /// Which kernel runs each layer, for logs and benchmarks. On a GPU: for each batch size
    /// bucket run so far (the powers of two: a batch of 100 takes bucket 128's routes), one line
    /// per dense layer and direction (forward, input gradient, weight gradient) with the route
    /// chosen (a kernel of flatnn's, `weight_grad_split`, or `cublas`) and its time per call,
    /// then every other route that fits and its time; each bucket is measured at its first call
    /// (see the README's GPU section); then [`Cache::conv_backends`]'s lines; then a line for
    /// each convolution whose inference runs the steps after it in its epilogue (as on the
    /// CPU, below), naming them. On the CPU: a
    /// first line with the instruction set of the kernels (see `FLATNN_ISA` in
    /// the README), the threads and the capacity, then one line per layer with weights: a
    /// dense layer multiplies by its weights packed once (again after each change of the
    /// parameters); a convolution gives, for batches of 1 and of 2 or more, the route of its
    /// forward and backward passes (`lowered`: im2col and a GEMM; `direct`: a GEMM on shifted
    /// windows of the padded input) and the time per call of both routes when they were timed
    /// (the backward's once gradient buffers were made for the layer's shape); under it, an
    /// indented line per pass and batch below the thread count where this cache timed splitting
    /// a sample's output rows over the threads (the parts kept, and both times).
    ///
    /// The routes are timed once per process for each layer shape and bucket, and every later
    /// cache, whatever its thread count, takes the same: in one process the same inputs and
    /// parameters give the same bits. They round differently from each other, so the outputs
    /// of a batch of 1 and of the same sample in a larger batch may differ in the last bits,
    /// and so may another process, which times them again. (A convolution's split of a
    /// sample's rows is timed per cache; it changes no bits.)
    pub fn routes(&self) -> String {
        match &self.dev {
            Some(dev) => dev.routes_report(&self.plan),
            None => self.ws.report(&self.plan, self.capacity) + &self.one.report(self.threads),
        }
    }
}

/// Calls of each way that must count when [`Cache::time_batch_one`] times a pass of one sample.
const ONE_RUNS: usize = 7;

/// Where a forward pass of one sample runs: on the model's pool, or on the calling thread alone,
/// whichever was faster when `Model::preallocate` timed both (the same bits either way). A
/// layer large enough to be split hands parts to the pool's threads and waits for them; for a
/// small network one thread may finish first, and then the whole pass runs without a hand-off.
pub(crate) struct BatchOne {
    /// A pool of the calling thread alone (no threads of its own).
    alone: Pool,
    /// The times per call (alone, on the pool) when they were measured.
    times: Option<(Duration, Duration)>,
}

impl BatchOne {
    /// The pool a forward pass of `batch` samples runs on, `pool` being the model's.
    pub fn pool<'a>(&'a self, batch: usize, pool: &'a Pool) -> &'a Pool {
        match self.times {
            Some((alone, pooled)) if batch == 1 && alone < pooled => &self.alone,
            _ => pool,
        }
    }

    /// The line of `Cache::routes`, if there was a choice.
    fn report(&self, threads: usize) -> String {
        let us = |t: Duration| t.as_secs_f64() * 1e6;
        match self.times {
            Some((alone, Duration::MAX)) => format!(
                "\nbatch 1: the whole forward pass on the calling thread, {:.1} µs (on {threads} threads the workers never came while timed)",
                us(alone)
            ),
            Some((alone, pooled)) if alone < pooled => {
                format!(
                    "\nbatch 1: the whole forward pass on the calling thread, {:.1} µs ({threads} threads {:.1} µs)",
                    us(alone),
                    us(pooled)
                )
            }
            Some((alone, pooled)) => format!("\nbatch 1: forward on {threads} threads, {:.1} µs (alone {:.1} µs)", us(pooled), us(alone)),
            None if threads > 1 => "\nbatch 1: forward on the pool (not timed)".into(),
            None => String::new(),
        }
    }
}

/// Parameter gradients (the parameters' layout), activation gradients and backward scratch.
pub struct Grads {
    pub(crate) plan: Arc<Plan>,
    pub(crate) capacity: usize,
    pub(crate) threads: usize,
    pub(crate) grads: Vec<f32>,
    pub(crate) dacts: Vec<f32>,
    pub(crate) gws: GradWorkspace,
    /// The last loss, and the sum and count of losses since `mean_loss` last read them (CPU).
    last_loss: f64,
    loss_sum: f64,
    losses: usize,
    pub(crate) dev: Option<DevGrads>,
}

impl Grads {
    pub(crate) fn new(plan: &Arc<Plan>, capacity: usize, threads: usize, dev: Option<DevGrads>) -> Result<Grads> {
        check_capacity(capacity)?;
        let on_cpu = dev.is_none();
        let (grads, dacts) = if on_cpu { (plan.param_len, plan.acts_len(capacity)?) } else { (0, 0) };
        Ok(Grads {
            plan: Arc::clone(plan),
            capacity,
            threads,
            grads: zeros(grads, || "the parameter gradients".into())?,
            dacts: zeros(dacts, || format!("the activation gradients for {capacity} samples"))?,
            gws: if on_cpu { GradWorkspace::new(plan, capacity, threads)? } else { GradWorkspace::none() },
            last_loss: f64::NAN,
            loss_sum: 0.0,
            losses: 0,
            dev,
        })
    }

    /// The device these buffers live on.
    pub fn device(&self) -> Device {
        self.dev.as_ref().map_or(Device::Cpu, DevGrads::device)
    }

    pub(crate) fn record_loss(&mut self, value: f64) {
        self.last_loss = value;
        self.loss_sum += value;
        self.losses += 1;
    }

    /// The loss of the last `backprop` (NaN before the first). On a GPU the loss stays on the
    /// device until asked for: this waits for the queued steps.
    ///
    /// A loss that is NaN or infinite means training diverged (a learning rate too large, say):
    /// that step's gradients are not finite either, and an update from them (`update`, or the
    /// rest of `train_step`, which does not stop) writes NaN into the parameters and the
    /// optimiser's state, so later losses stay NaN. [`Grads::diverged`] asks whether that
    /// happened in any step since [`Grads::mean_loss`] last read the losses.
    pub fn last_loss(&self) -> Result<f32> {
        match &self.dev {
            Some(dev) => dev.last_loss(),
            None => Ok(self.last_loss as f32),
        }
    }

    /// The mean loss of every `backprop` since the previous call (NaN if there was none), and
    /// starts a new count: an epoch's training loss without reading each step's. On a GPU the
    /// sum is kept on the device; this waits for the queued steps.
    pub fn mean_loss(&mut self) -> Result<f32> {
        if let Some(dev) = &mut self.dev {
            return dev.mean_loss();
        }
        let mean = self.loss_sum / self.losses as f64;
        (self.loss_sum, self.losses) = (0.0, 0);
        Ok(mean as f32)
    }

    /// Whether the loss of any `backprop` since [`Grads::mean_loss`] last read the losses (or
    /// since these buffers were made) was NaN or infinite: training diverged, and the
    /// parameters updated after that step are likely NaN (see [`Grads::last_loss`]). The steps
    /// keep the sum of their losses anyway (on a GPU, on the device), and a sum is finite
    /// exactly when every term is (losses are at least 0, so no two infinities cancel), so this
    /// adds nothing to a step. On a GPU it waits for the queued steps, as `last_loss` does.
    pub fn diverged(&self) -> Result<bool> {
        let sum = match &self.dev {
            Some(dev) => dev.loss_sum()?,
            None => self.loss_sum,
        };
        Ok(!sum.is_finite())
    }

    /// The gradient of the last loss with respect to every parameter, in the parameters'
    /// layout: borrowed on the CPU, copied from a GPU (after its queued steps).
    pub fn gradients(&self) -> Result<Cow<'_, [f32]>> {
        match &self.dev {
            None => Ok(Cow::Borrowed(&self.grads)),
            Some(dev) => {
                let mut out = zeros(self.plan.param_len, || "a host copy of the gradients".into())?;
                dev.download(&mut out)?;
                Ok(Cow::Owned(out))
            }
        }
    }

    /// The largest batch these buffers serve.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

fn check_capacity(capacity: usize) -> Result<()> {
    if capacity == 0 {
        return Err(Error::Config("a cache needs a capacity of at least one sample".into()));
    }
    Ok(())
}

pub(crate) fn check_labels(labels: &[u32], classes: usize) -> Result<()> {
    match labels.iter().position(|&l| l as usize >= classes) {
        Some(index) => Err(Error::Label { index, label: labels[index], classes }),
        None => Ok(()),
    }
}

/// An [`Error::NonFinite`] naming `what` and the first NaN or infinity in `values`, if any.
pub(crate) fn check_finite(values: &[f32], what: &'static str) -> Result<()> {
    match first_non_finite(values) {
        Some(index) => Err(Error::NonFinite { what, index }),
        None => Ok(()),
    }
}

/// The index of the first NaN or infinity in `values`, if any.
///
/// An f32 is NaN or infinite exactly when its 8 exponent bits are all ones. The scan tests
/// blocks of 8 values with bitwise operations and no branch per value, so it vectorises, and
/// looks for the index only when a block failed.
pub(crate) fn first_non_finite(values: &[f32]) -> Option<usize> {
    const EXPONENT: u32 = 0x7f80_0000;
    let non_finite = |v: &f32| v.to_bits() & EXPONENT == EXPONENT;
    let mut blocks = values.chunks_exact(8);
    let any = blocks.by_ref().fold(false, |any, block| block.iter().fold(any, |any, v| any | non_finite(v)));
    if !any && !blocks.remainder().iter().any(non_finite) {
        return None;
    }
    values.iter().position(non_finite)
}

impl ToDevice for Cache {
    /// The same capacity on `device`, holding the same batch (inputs, labels, targets); the
    /// activations are not state and are not copied.
    fn to_device(self, device: &Device) -> Result<Self> {
        if self.device() == *device {
            return Ok(self);
        }
        let dev = match *device {
            Device::Cpu => None,
            Device::Cuda(ordinal) => Some(DevCache::on(ordinal, &self.plan, self.capacity)?),
        };
        let mut moved = Cache::new(&self.plan, self.capacity, self.threads, dev)?;
        // a batch gathered on the old device is not on the host: it must be set again
        if self.batch > 0 && !self.inputs_on_device {
            moved.inputs_mut(self.batch)?.copy_from_slice(self.inputs());
            moved.inputs_finite = self.inputs_finite;
        }
        (moved.labels, moved.targets) = (self.labels, self.targets);
        let labels_set = if self.labels_on_device { 0 } else { self.labels_set };
        let targets_set = if self.targets_on_device { 0 } else { self.targets_set };
        (moved.labels_set, moved.targets_set) = (labels_set, targets_set);
        (moved.inputs_dirty, moved.labels_dirty, moved.targets_dirty) = (true, true, true);
        Ok(moved)
    }
}

impl ToDevice for Grads {
    /// Gradient buffers of the same capacity on `device`; gradients and loss totals are
    /// recomputed by the next step, not copied.
    fn to_device(self, device: &Device) -> Result<Self> {
        if self.device() == *device {
            return Ok(self);
        }
        let dev = match *device {
            Device::Cpu => None,
            Device::Cuda(ordinal) => Some(DevGrads::on(ordinal, &self.plan, self.capacity)?),
        };
        Grads::new(&self.plan, self.capacity, self.threads, dev)
    }
}

#[cfg(test)]
mod tests {
    use crate::prelude::*;
    use std::time::Duration;

    /// A pass of one sample runs where `Model::preallocate` timed it faster, and gives the same
    /// bits alone as on the pool; larger batches always run on the pool.
    #[test]
    fn one_sample_runs_where_it_was_faster_with_the_same_bits() {
        let model = crate::models::mlp().build().unwrap().init(Init::HeNormal, 4).with_threads(2).unwrap();
        let mut cache = model.preallocate(3).unwrap();
        assert!(cache.routes().lines().last().unwrap().starts_with("batch 1: "), "{}", cache.routes());
        cache.set_inputs(&crate::testutil::Rng::new(5).uniform(784)).unwrap();
        let mut outputs = Vec::new();
        for (alone, pooled) in [(1, 2), (2, 1)] {
            cache.one.times = Some((Duration::from_nanos(alone), Duration::from_nanos(pooled)));
            let pool = cache.one.pool(1, &model.pool);
            assert_eq!(std::ptr::eq(pool, &cache.one.alone), alone < pooled);
            assert!(std::ptr::eq(cache.one.pool(2, &model.pool), &*model.pool));
            outputs.push(model.forward(&mut cache).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
        assert_eq!(outputs[0], outputs[1]);
        // a pool whose workers never came while timed: the calling thread, and the report says why
        cache.one.times = Some((Duration::from_micros(20), Duration::MAX));
        assert!(std::ptr::eq(cache.one.pool(1, &model.pool), &cache.one.alone));
        let line = cache.routes().lines().last().unwrap().to_string();
        assert!(line.ends_with("20.0 µs (on 2 threads the workers never came while timed)"), "{line}");
    }
}
