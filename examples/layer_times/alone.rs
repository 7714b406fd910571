//! A model's steps as models of their own: what `layer_times` times, and what
//! `tests/layer_times.rs` checks computes the whole model's values.

use flatnn::chain::Step;
use flatnn::models;
use flatnn::prelude::*;
use flatnn::Result;

/// A zoo model's name and its chain.
pub type Named = (&'static str, fn() -> Chain);

/// The zoo's models, named as in `benches/zoo/engine.rs` (`ZOO`); the test checks the names.
pub const MODELS: [Named; 10] = [
    ("mlp", models::mlp),
    ("lenet5", models::lenet5),
    ("simplenn", models::simplenns_mlp),
    ("autoencoder", models::autoencoder),
    ("gelu_mlp", models::gelu_mlp),
    ("vgg_small", models::vgg_small),
    ("ts_conv1d", models::ts_conv1d),
    ("resnet_small", models::resnet_small),
    ("gru_seq", models::gru_seq),
    ("lstm_seq", models::lstm_seq),
];

/// The zoo's seed (He normal weights, inputs).
pub const SEED: u64 = 11;

/// One step of a model's plan, as the tool takes it.
pub enum Part {
    /// `Chain::new(step.input).layer(step.layer)`: the step's layer (its activation included)
    /// alone on the step's input shape, with the whole model's values of the step's parameters
    /// and its thread count.
    Alone(Box<Model>),
    /// A step that cannot run as a model of its own, and why.
    Not(&'static str),
}

/// Why `step` cannot run as a model of its own, if it cannot: a view (flatten, a residual
/// block's fork) keeps its input's region and runs nothing; a residual block's sum also reads
/// the block's input, which a model of one layer has not.
fn not_alone(step: &Step) -> Option<&'static str> {
    let view = step.output_region == step.input_region;
    match (step.skip.is_some(), view) {
        (true, true) => Some("opens a residual block: a view of its input, nothing runs"),
        (true, false) => Some("closes a residual block: it adds the block's input, which no one-layer model has"),
        (false, true) => Some("a view: nothing runs"),
        (false, false) => None,
    }
}

/// Each step of `model` (on the CPU) as a [`Part`]. A part's parameters are copied from the
/// model's, tensor by tensor in the step's order (their names and shapes checked); its buffers
/// (batch norm's running statistics) start at their constants, so the model's must be at
/// theirs too (an [`Error::Mismatch`] otherwise): a model as built, not one trained.
pub fn split(model: &Model) -> Result<Vec<Part>> {
    let (params, buffers) = (model.parameters()?, model.buffers()?);
    let mut parts = Vec::new();
    for (index, step) in model.plan().steps.iter().enumerate() {
        if let Some(why) = not_alone(step) {
            parts.push(Part::Not(why));
            continue;
        }
        let mut alone = Chain::new(step.input).layer(step.layer).build()?.init(Init::HeNormal, SEED).with_threads(model.threads())?;
        let mismatch = |what: &str| Error::Mismatch(format!("step {index} ({:?}) alone: {what}", step.layer));
        let own = &alone.plan().steps[0];
        let layout = |s: &Step| s.tensors.iter().map(|t| (t.name, t.shape.clone())).collect::<Vec<_>>();
        if layout(own) != layout(step) || own.buffers.len() != step.buffers.len() {
            return Err(mismatch("its tensors are not the step's"));
        }
        let step_buffers = step.buffers.first().zip(step.buffers.last()).map_or(0..0, |(a, b)| a.range.start..b.range.end);
        if buffers[step_buffers] != alone.buffers()?[..] {
            return Err(mismatch("the model's buffers are not at their starting values, which a model alone starts at"));
        }
        alone.set_parameters(&params[step.params.clone()])?;
        parts.push(Part::Alone(Box::new(alone)));
    }
    Ok(parts)
}
