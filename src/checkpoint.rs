//! Checkpoints: a model and its optimiser in one safetensors file, so that a run stopped and
//! resumed takes exactly the steps (the same bits) a run that never stopped would.
//!
//! The file is a model file (src/io.rs: PyTorch's `nn.Sequential` names, the architecture in
//! the metadata, so [`Model::load`] reads it) plus the optimiser's state under the names of
//! PyTorch's `optimizer.state_dict()`, flattened: `optimizer.state.{i}.{name}` for the i-th
//! tensor of `model.parameters()` (layers in order, weight then bias: the order of the flat
//! parameters), shaped as that parameter, `name` being `momentum_buffer` (SGD with momentum),
//! `exp_avg` and `exp_avg_sq` (Adam, AdamW) or `square_avg` (RMSProp); and, as PyTorch keeps it
//! for Adam, AdamW and RMSProp, `optimizer.state.{i}.step`, a scalar. The exact step count is
//! the metadata's `flatnn.steps`; `flatnn.optimizer` describes the settings for people
//! (loading takes the settings from the code that built the optimiser, as it does the model's).
//! `flatnn.seed` and `flatnn.train_passes` are the model's dropout seed and its count of
//! training passes ([`Model::train_passes`]), from which dropout draws the next pass's masks.

use crate::error::{Error, Result};
use crate::io::{describe, format_err, read_f32, tensors, views, write_atomically, Tensor, ARCHITECTURE_KEY, OPTIMIZER_PREFIX};
use crate::model::Model;
use crate::optim::{Optim, Optimizer};
use safetensors::tensor::{Dtype, SafeTensors};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

const STEPS_KEY: &str = "flatnn.steps";
const SETTINGS_KEY: &str = "flatnn.optimizer";
const SEED_KEY: &str = "flatnn.seed";
const PASSES_KEY: &str = "flatnn.train_passes";

/// PyTorch's names of an optimiser's per-parameter state, in the order of its flat state's
/// blocks ([`Optimizer::state`]).
fn state_names(config: Optim) -> &'static [&'static str] {
    match config {
        Optim::Sgd { .. } if config.state_per_param() == 0 => &[],
        Optim::Sgd { .. } => &["momentum_buffer"],
        Optim::Adam { .. } | Optim::AdamW { .. } => &["exp_avg", "exp_avg_sq"],
        Optim::RmsProp { .. } => &["square_avg"],
    }
}

/// Whether PyTorch keeps a step count with each parameter's state.
fn keeps_step(config: Optim) -> bool {
    !matches!(config, Optim::Sgd { .. })
}

/// The parameter tensors in `model.parameters()` order, which is the flat layout's.
fn parameter_order(model: &Model) -> Vec<Tensor> {
    let mut order = tensors(&model.plan);
    order.sort_by_key(|t| t.range.start);
    order
}

fn state_name(index: usize, name: &str) -> String {
    format!("{OPTIMIZER_PREFIX}state.{index}.{name}")
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `opt` must have been built for `model` (or a copy of it on another device).
fn check_pair(model: &Model, opt: &Optimizer) -> Result<()> {
    if !Arc::ptr_eq(opt.plan(), &model.plan) {
        return Err(Error::Mismatch("this optimiser was built for another model".into()));
    }
    Ok(())
}

impl Model {
    /// Writes this model and `opt` (its state, step count and, for people, its settings) as
    /// one safetensors file, atomically as [`Model::save`] does; from a GPU, after the queued
    /// steps. [`Model::load_checkpoint`] restores both; [`Model::load`] reads the model alone.
    pub fn save_checkpoint(&self, opt: &Optimizer, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        check_pair(self, opt)?;
        let state = opt.state()?;
        let (n, config, steps) = (self.plan.param_len, opt.config(), opt.steps());
        let mut entries = self.file_tensors()?;
        for (i, t) in parameter_order(self).into_iter().enumerate() {
            for (block, name) in state_names(config).iter().enumerate() {
                entries.push((state_name(i, name), Dtype::F32, le_bytes(&state[block * n..][t.range.clone()]), t.shape.clone()));
            }
            if keeps_step(config) {
                entries.push((state_name(i, "step"), Dtype::F32, le_bytes(&[steps as f32]), Vec::new()));
            }
        }
        let views = views(&entries, path)?;
        let settings = format!("{config:?}; {:?}; {:?}", opt.clip(), opt.schedule());
        let metadata = HashMap::from([
            (ARCHITECTURE_KEY.to_owned(), describe(&self.plan)),
            (STEPS_KEY.to_owned(), steps.to_string()),
            (SETTINGS_KEY.to_owned(), settings),
            (SEED_KEY.to_owned(), self.seed.to_string()),
            (PASSES_KEY.to_owned(), self.train_passes().to_string()),
        ]);
        let file = safetensors::serialize(views, &Some(metadata)).map_err(|e| format_err(path, e))?;
        write_atomically(path, &file)
    }

    /// Restores this model's parameters and `opt`'s state and step count from a file written
    /// by [`Model::save_checkpoint`], on whatever devices they are: build both as the run that
    /// saved it did (the same chain, optimiser, clipping and schedule), then load, then go on.
    /// A file of another architecture, or of another kind of optimiser (state it does not
    /// keep, or lacking state it keeps), is an [`Error::Format`] saying which, and neither is
    /// changed.
    pub fn load_checkpoint(&mut self, opt: &mut Optimizer, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        check_pair(self, opt)?;
        let bad = |what: String| Error::Format { path: path.to_owned(), what };
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| format_err(path, e))?;
        let metadata = header.metadata().as_ref();
        let get = |key: &str| {
            metadata.and_then(|m| m.get(key)).ok_or_else(|| bad(format!("no {key} metadata: not a checkpoint (Model::save_checkpoint)")))
        };
        let architecture = describe(&self.plan);
        if *get(ARCHITECTURE_KEY)? != architecture {
            return Err(bad(format!("a checkpoint of another model ({:?}); this one is {architecture:?}", get(ARCHITECTURE_KEY)?)));
        }
        let count =
            |key: &str, value: &String| -> Result<u64> { value.parse().map_err(|_| bad(format!("{key} {value:?} is not a whole number"))) };
        let steps = count(STEPS_KEY, get(STEPS_KEY)?)?;
        // (a checkpoint written before dropout came has neither: the model keeps its own)
        let draw = |key: &str, own: u64| metadata.and_then(|m| m.get(key)).map_or(Ok(own), |v| count(key, v));
        let (seed, passes) = (draw(SEED_KEY, self.seed)?, draw(PASSES_KEY, self.train_passes())?);
        let file = SafeTensors::deserialize(&bytes).map_err(|e| format_err(path, e))?;
        let (params, buffers) = self.read_tensors(&file, path)?;
        let (n, config) = (self.plan.param_len, opt.config());
        let names = state_names(config);
        let mut state = vec![0.0; names.len() * n];
        let mut kept = HashSet::new();
        for (i, t) in parameter_order(self).into_iter().enumerate() {
            for (block, name) in names.iter().enumerate() {
                let name = state_name(i, name);
                read_f32(&file, &name, &t.shape, &mut state[block * n..][t.range.clone()], path)?;
                kept.insert(name);
            }
            if keeps_step(config) {
                let (name, mut step) = (state_name(i, "step"), [0.0f32]);
                read_f32(&file, &name, &[], &mut step, path)?;
                if step[0] != steps as f32 {
                    return Err(bad(format!("{name} is {}, but the checkpoint's step count is {steps}", step[0])));
                }
                kept.insert(name);
            }
        }
        let mut extra: Vec<&String> = file.names().into_iter().filter(|n| n.starts_with(OPTIMIZER_PREFIX) && !kept.contains(*n)).collect();
        extra.sort();
        if !extra.is_empty() {
            return Err(bad(format!("optimiser state that {config:?} does not keep (a checkpoint of another optimiser?): {extra:?}")));
        }
        self.set_parameters(&params)?;
        self.set_buffers(&buffers)?;
        self.set_train_passes(seed, passes)?;
        opt.set_state(&state, steps)
    }
}
