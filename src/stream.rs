//! Streaming inference: a model over sequences run one time step at a time ([`Stream`], from
//! [`Model::stream`]), its recurrent layers' state kept between calls; and the state of the
//! recurrent layers of a cache ([`Cache::set_state`], [`Cache::final_state`]).
//!
//! A stream runs a model of its own: the same layers over sequences of one step, each recurrent
//! layer carrying its final state over its initial one (and on the CPU reading its weights in the
//! packed layout of the fast path, `layers::recurrent`), parameters copied from the model when the
//! stream is made. Each
//! call is that model's `forward` on a cache of the stream's: the same kernels as a forward pass
//! over whole sequences, so n calls give the bits a forward pass over the n steps gives (on the
//! CPU; the tests check it).

use crate::cache::Cache;
use crate::chain::{Layer, Plan, Shape};
use crate::device::Device;
use crate::error::{zeros, Error, Result};
use crate::layers::recurrent::{self, Dims, Streaming, STATE};
use crate::layers::{gru::Gru, lstm::Lstm, region};
use crate::model::Model;
use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};

/// A model over sequences run one time step at a time, for a batch of up to `capacity`
/// sequences (often one): [`Stream::step`] takes each sequence's next step and gives the model's
/// outputs for it, the recurrent layers' hidden (and cell) states kept in the stream between
/// calls. Sample i of each call continues sequence i; [`Stream::reset_state`] starts new ones.
///
/// After `n` calls, the outputs are what [`Model::forward`] gives for the sequences of those `n`
/// steps (on the CPU, bit for bit): a recurrent layer's output at each step, or a model's output
/// on the last step so far where a layer keeps only the last step (so a
/// `gru(.., RnnOutput::LastStep).dense(..)` model gives its prediction at every step).
///
/// A call allocates nothing; on the CPU it takes no lock and makes no system call either (on one
/// thread, or a batch of one: the model's other threads are not woken), for a thread with a
/// deadline, such as an audio callback. The stream borrows the model, whose parameters cannot
/// change while it lives.
pub struct Stream<'m> {
    /// The model whose parameters the stream copied, borrowed so that they cannot change.
    _model: &'m Model,
    /// The model of one step (see the module docs) and its cache, which holds the states.
    step: Model,
    cache: Cache,
}

impl Model {
    /// A [`Stream`] of this model for up to `capacity` sequences at a time. The model must take
    /// sequences, and every layer must act on each step alone (recurrent layers, and layers
    /// after one that outputs its last step); a layer that mixes steps (a flatten of the
    /// sequence) is an [`Error::Config`] naming it. Allocates every buffer the stream will use,
    /// and copies the parameters (from a GPU, after the steps queued there).
    pub fn stream(&self, capacity: usize) -> Result<Stream<'_>> {
        let packed = self.device() == Device::Cpu;
        let plan = step_plan(&self.plan, if packed { Streaming::Packed } else { Streaming::Carry })?;
        let (params, buffers) = (self.parameters()?, self.buffers()?);
        let mut step_params = zeros(plan.param_len, || "a stream's parameters".into())?;
        for (whole, one) in self.plan.steps.iter().zip(&plan.steps) {
            let (src, dst) = (&params[whole.params.clone()], &mut step_params[one.params.clone()]);
            match recurrent::dims(one) {
                Some(d) if d.packed => recurrent::pack(&d, src, dst),
                _ => dst.copy_from_slice(src),
            }
        }
        let step = Model {
            plan: Arc::new(plan),
            params: step_params,
            buffers: RwLock::new(buffers.into_owned()),
            seed: self.seed,
            passes: AtomicU64::new(self.train_passes()),
            pool: Arc::clone(&self.pool),
            dev: None,
            gpu_options: self.gpu_options,
            version: crate::model::new_version(),
        };
        let step = match self.device() {
            Device::Cpu => step,
            device => step.to(&device)?,
        };
        let cache = step.preallocate(capacity)?;
        Ok(Stream { _model: self, step, cache })
    }
}

impl Stream<'_> {
    /// Runs one time step: `inputs` holds the step's features for each sequence (`batch ×
    /// features`, sample-major, every value finite), and the outputs are the model's for it
    /// (`batch ×` the output length of one step). Sequences past the batch keep their state.
    pub fn step(&mut self, inputs: &[f32]) -> Result<&[f32]> {
        self.cache.set_inputs(inputs)?;
        self.step.forward_owned(&mut self.cache)
    }

    /// Every recurrent layer's state back to zeros, for new sequences.
    pub fn reset_state(&mut self) -> Result<()> {
        self.cache.reset_states()
    }

    /// Sets recurrent layer `layer`'s state, as [`Cache::set_state`].
    pub fn set_state(&mut self, layer: usize, values: &[f32]) -> Result<()> {
        self.cache.set_state(layer, values)
    }

    /// Recurrent layer `layer`'s state now, for every sequence of the capacity: per sequence h
    /// (`hidden` values), and an LSTM's c after it.
    pub fn state(&self, layer: usize) -> Result<Vec<f32>> {
        self.cache.state_slots(layer, self.cache.capacity)
    }

    /// The most sequences a call takes.
    pub fn capacity(&self) -> usize {
        self.cache.capacity
    }

    /// The device the stream runs on (the model's).
    pub fn device(&self) -> Device {
        self.step.device()
    }
}

/// The plan of one step of `plan`: its layers over a sequence of one step, the recurrent ones
/// `streaming`. Every other layer must have the same tensors, and an output of one step of its
/// output (else it mixes steps).
fn step_plan(plan: &Plan, streaming: Streaming) -> Result<Plan> {
    let Shape::Sequence { features, .. } = plan.input else {
        return Err(Error::Config(format!(
            "a stream runs a model over sequences one step at a time; this model's input is {}",
            plan.input
        )));
    };
    let layers: Vec<Layer> = plan.steps.iter().map(|s| stream_layer(s.layer, streaming)).collect();
    let one = Plan::new(Shape::sequence(1, features), &layers)
        .map_err(|e| Error::Config(format!("the model cannot run one step at a time: {e}")))?;
    let of_one_step = |shape: Shape| match shape {
        Shape::Sequence { features, .. } => Shape::Sequence { steps: 1, features },
        other => other,
    };
    let shapes = |tensors: &[crate::chain::Tensor]| tensors.iter().map(|t| t.shape.clone()).collect::<Vec<_>>();
    for (index, (whole, step)) in plan.steps.iter().zip(&one.steps).enumerate() {
        let same = recurrent::dims(step).is_some()
            || (shapes(&whole.tensors) == shapes(&step.tensors) && shapes(&whole.buffers) == shapes(&step.buffers));
        if !same || of_one_step(whole.output) != step.output {
            return Err(Error::Config(format!(
                "layer {index} ({:?}) mixes time steps (its output {} over one step is {}): the model cannot run one step at a time",
                whole.layer, whole.output, step.output
            )));
        }
    }
    Ok(one)
}

/// `layer`, a recurrent layer `streaming`.
fn stream_layer(layer: Layer, streaming: Streaming) -> Layer {
    match layer {
        Layer::Gru(gru) => Gru { streaming, ..gru }.into(),
        Layer::Lstm(lstm) => Lstm { streaming, ..lstm }.into(),
        other => other,
    }
}

impl Cache {
    /// Sets the initial state of recurrent layer `layer` (its index in the chain) for samples 0
    /// to n − 1: `values` holds n samples, each h₀ (`hidden` values) and, for an LSTM, c₀ after it
    /// (as PyTorch's `h0`, `c0` hold them, sample by sample). The other samples keep theirs. Until
    /// set, a state is zeros; `forward` and `backprop` start every sequence from it and leave it
    /// as it is. A NaN or infinite value is an [`Error::NonFinite`]; nothing is written on error.
    /// On a GPU this copies to the device (after its queued work) and waits.
    pub fn set_state(&mut self, layer: usize, values: &[f32]) -> Result<()> {
        let (d, range) = state_region(&self.plan, layer, self.capacity)?;
        let per_sample = per_sample(&d);
        if !values.len().is_multiple_of(per_sample) || values.len() / per_sample > self.capacity {
            return Err(Error::Shape(format!(
                "{} state values are not a whole number of samples of {per_sample} (h{}) up to the capacity of {}",
                values.len(),
                if per_sample > d.hidden { ", c" } else { "" },
                self.capacity
            )));
        }
        crate::cache::check_finite(values, "state")?;
        for (s, sample) in values.chunks_exact(per_sample).enumerate() {
            let at = range.start + s * d.state_len();
            for (slot, part) in sample.chunks_exact(d.hidden).enumerate() {
                self.write_acts(at + slot * d.padded, part)?;
            }
        }
        Ok(())
    }

    /// Every recurrent layer's initial state back to zeros.
    pub fn reset_states(&mut self) -> Result<()> {
        for index in 0..self.plan.steps.len() {
            if recurrent::dims(&self.plan.steps[index]).is_some() {
                let (_, range) = state_region(&self.plan, index, self.capacity)?;
                self.zero_acts(range)?;
            }
        }
        Ok(())
    }

    /// The final state of recurrent layer `layer` after the last `forward` or `backprop`, for
    /// each sample of the batch: h_T (`hidden` values) and, for an LSTM, c_T after it (PyTorch's
    /// `h_n`, `c_n`). On a GPU this waits for the queued work and copies from the device.
    pub fn final_state(&self, layer: usize) -> Result<Vec<f32>> {
        self.state_slots(layer, self.batch)
    }

    /// The final-state slots of `layer` for `samples` samples (for a streaming model, its state
    /// now).
    fn state_slots(&self, layer: usize, samples: usize) -> Result<Vec<f32>> {
        let (d, range) = state_region(&self.plan, layer, self.capacity)?;
        let mut all = zeros(samples * d.state_len(), || "a copy of a recurrent state".into())?;
        self.read_acts(range.start..range.start + all.len(), &mut all)?;
        let (h, c) = d.final_slots();
        let slots: &[usize] = if per_sample(&d) > d.hidden { &[h, c] } else { &[h] };
        let mut out = Vec::with_capacity(samples * per_sample(&d));
        for sample in all.chunks_exact(d.state_len()) {
            for &slot in slots {
                out.extend_from_slice(&sample[slot..][..d.hidden]);
            }
        }
        Ok(out)
    }

    /// Writes `values` into the activations from `at` (on a GPU, in device memory).
    fn write_acts(&mut self, at: usize, values: &[f32]) -> Result<()> {
        match &mut self.dev {
            Some(dev) => dev.write_acts(at, values),
            None => {
                self.acts[at..at + values.len()].copy_from_slice(values);
                Ok(())
            }
        }
    }

    /// Zeros the activations `range`.
    fn zero_acts(&mut self, range: Range<usize>) -> Result<()> {
        match &mut self.dev {
            Some(dev) => dev.zero_acts(range),
            None => {
                self.acts[range].fill(0.0);
                Ok(())
            }
        }
    }

    /// Copies the activations `range` into `out`.
    fn read_acts(&self, range: Range<usize>, out: &mut [f32]) -> Result<()> {
        match &self.dev {
            Some(dev) => dev.read_acts(range.start, out),
            None => {
                out.copy_from_slice(&self.acts[range]);
                Ok(())
            }
        }
    }
}

/// State values a sample gives or gets: h, and an LSTM's c.
fn per_sample(d: &Dims) -> usize {
    d.state_len() / 2 / d.padded * d.hidden
}

/// Recurrent layer `layer`'s sizes and its state region in a cache of `capacity` samples.
fn state_region(plan: &Plan, layer: usize, capacity: usize) -> Result<(Dims, Range<usize>)> {
    let layers = plan.steps.len();
    let step = plan.steps.get(layer).ok_or_else(|| Error::Config(format!("layer {layer}: the model has {layers} layers")))?;
    let d = recurrent::dims(step)
        .ok_or_else(|| Error::Config(format!("layer {layer} ({:?}) is not a recurrent layer: it has no state", step.layer)))?;
    Ok((d, region(plan, step.kept.start + STATE, capacity, capacity)))
}
