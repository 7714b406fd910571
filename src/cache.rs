//! Caches: everything a step needs, allocated once for a batch capacity.
//!
//! [`Cache`] (from `Model::preallocate`) holds inputs, targets, activations and forward
//! scratch; [`Grads`] (from `Model::preallocate_grads`) holds the parameter gradients (the
//! parameters' layout), activation gradients and backward scratch. A batch smaller than the
//! capacity runs in the front of the same buffers; a larger one is an [`Error::Capacity`].

use crate::chain::Plan;
use crate::error::{Error, Result};
use crate::layers::{region, GradWorkspace, Workspace};
use std::sync::Arc;

/// Inputs, targets, activations and forward scratch for up to `capacity` samples.
pub struct Cache {
    pub(crate) plan: Arc<Plan>,
    pub(crate) capacity: usize,
    pub(crate) threads: usize,
    /// Samples in the current batch (set by `set_inputs`).
    pub(crate) batch: usize,
    pub(crate) acts: Vec<f32>,
    pub(crate) labels: Vec<u32>,
    pub(crate) targets: Vec<f32>,
    /// Samples whose labels / targets were last set.
    pub(crate) labels_set: usize,
    pub(crate) targets_set: usize,
    pub(crate) ws: Workspace,
}

impl Cache {
    pub(crate) fn new(plan: &Arc<Plan>, capacity: usize, threads: usize) -> Result<Cache> {
        check_capacity(capacity)?;
        let outputs = plan.output().len();
        Ok(Cache {
            plan: Arc::clone(plan),
            capacity,
            threads,
            batch: 0,
            acts: vec![0.0; plan.acts_len(capacity)],
            labels: vec![0; capacity],
            targets: vec![0.0; capacity * outputs],
            labels_set: 0,
            targets_set: 0,
            ws: Workspace::new(plan, threads),
        })
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
    /// batch size is the length over the input length. Nothing is written on error.
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
        self.inputs_mut(batch)?.copy_from_slice(inputs);
        Ok(())
    }

    /// The input buffer for a batch of `batch` samples, to be filled in place (how the data
    /// loader writes without a copy); sets the batch size.
    pub fn inputs_mut(&mut self, batch: usize) -> Result<&mut [f32]> {
        if batch == 0 {
            return Err(Error::Shape("a batch needs at least one sample".into()));
        }
        if batch > self.capacity {
            return Err(Error::Capacity { batch, capacity: self.capacity });
        }
        self.batch = batch;
        let r = region(&self.plan, 0, self.capacity, batch);
        Ok(&mut self.acts[r])
    }

    /// The current batch's inputs.
    pub fn inputs(&self) -> &[f32] {
        &self.acts[region(&self.plan, 0, self.capacity, self.batch)]
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
        Ok(())
    }

    /// The label buffer for `batch` samples, to be filled in place; checked by `backprop`.
    pub fn labels_mut(&mut self, batch: usize) -> Result<&mut [u32]> {
        if batch > self.capacity {
            return Err(Error::Capacity { batch, capacity: self.capacity });
        }
        self.labels_set = batch;
        Ok(&mut self.labels[..batch])
    }

    /// Sets real-valued targets for [`crate::Loss::Mse`] (`batch × outputs`); every value must
    /// be finite. Nothing is written on error.
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
        self.targets[..targets.len()].copy_from_slice(targets);
        self.targets_set = batch;
        Ok(())
    }

    /// The model's outputs for the current batch (valid after `forward` or `backprop`).
    pub fn outputs(&self) -> &[f32] {
        let last = self.plan.steps.last().map_or(0, |s| s.output_region);
        &self.acts[region(&self.plan, last, self.capacity, self.batch)]
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
    /// The last loss, and the sum and count of losses since `mean_loss` last read them.
    last_loss: f64,
    loss_sum: f64,
    losses: usize,
}

impl Grads {
    pub(crate) fn new(plan: &Arc<Plan>, capacity: usize, threads: usize) -> Result<Grads> {
        check_capacity(capacity)?;
        Ok(Grads {
            plan: Arc::clone(plan),
            capacity,
            threads,
            grads: vec![0.0; plan.param_len],
            dacts: vec![0.0; plan.acts_len(capacity)],
            gws: GradWorkspace::new(plan, threads),
            last_loss: f64::NAN,
            loss_sum: 0.0,
            losses: 0,
        })
    }

    pub(crate) fn record_loss(&mut self, value: f64) {
        self.last_loss = value;
        self.loss_sum += value;
        self.losses += 1;
    }

    /// The loss of the last `backprop` (NaN before the first).
    pub fn last_loss(&self) -> Result<f32> {
        Ok(self.last_loss as f32)
    }

    /// The mean loss of every `backprop` since the previous call (NaN if there was none), and
    /// starts a new count: an epoch's training loss without reading each step's.
    pub fn mean_loss(&mut self) -> Result<f32> {
        let mean = self.loss_sum / self.losses as f64;
        (self.loss_sum, self.losses) = (0.0, 0);
        Ok(mean as f32)
    }

    /// The gradient of the last loss with respect to every parameter, in the parameters' layout.
    pub fn gradients(&self) -> &[f32] {
        &self.grads
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

pub(crate) fn check_finite(values: &[f32], what: &'static str) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(Error::NonFinite { what, index }),
        None => Ok(()),
    }
}
