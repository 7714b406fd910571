//! The parts `examples/layer_times` times alone do the whole model's work: each zoo model's
//! steps, run one after another as the models of their own it builds (a residual block's fork
//! and sum done here), give the model's values after every step outside a residual block (a
//! model of the steps up to it, with the model's parameters) and its outputs.

#[path = "../examples/layer_times/alone.rs"]
mod alone;

use alone::{Part, MODELS, SEED};
use flatnn::prelude::*;
use flatnn::testutil::{assert_close, Rng};
use flatnn::Layer;

/// Outputs of `model` for `inputs`, a batch of `batch` samples.
fn forward(model: &Model, inputs: &[f32], batch: usize) -> Vec<f32> {
    let mut cache = model.preallocate(batch).unwrap();
    cache.set_inputs(inputs).unwrap();
    model.forward(&mut cache).unwrap().to_vec()
}

/// The model of `model`'s steps up to `last` (no residual block open after it), with the
/// model's values of their parameters, which come first in its flat parameters.
fn prefix(model: &Model, last: usize) -> Model {
    let plan = model.plan();
    let chain = plan.steps[..=last].iter().fold(Chain::new(plan.input), |chain, step| chain.layer(step.layer));
    let mut prefix = chain.build().unwrap().with_threads(1).unwrap();
    prefix.set_parameters(&model.parameters().unwrap()[..plan.steps[last].params.end]).unwrap();
    prefix
}

/// Every zoo model's parts, one after another on a batch of 3, give the values of the steps up
/// to each (within 1e-5 + 1e-4·|v|: a convolution's inference takes a batch norm and a residual
/// sum into its epilogue, which rounds otherwise), and the model's outputs.
#[test]
fn the_parts_of_every_zoo_model_give_its_values() {
    let batch = 3;
    for (name, chain) in MODELS {
        let model = chain().build().unwrap().init(Init::HeNormal, SEED).with_threads(1).unwrap();
        let inputs = Rng::new(5).uniform(batch * model.input_shape().len());
        let parts = alone::split(&model).unwrap();
        assert_eq!(parts.len(), model.plan().steps.len(), "{name}");
        // the values after each step, and the inputs of the residual blocks open
        let (mut values, mut blocks) = (inputs.clone(), Vec::new());
        for (index, (step, part)) in model.plan().steps.iter().zip(&parts).enumerate() {
            let what = format!("{name} step {index} ({:?})", step.layer);
            match (part, step.layer) {
                (Part::Alone(alone), _) => {
                    assert_eq!((alone.input_shape(), alone.output_shape(), alone.threads()), (step.input, step.output, 1), "{what}");
                    values = forward(alone, &values, batch);
                }
                (Part::Not(_), Layer::Fork(_)) => blocks.push(values.clone()),
                (Part::Not(_), Layer::Add(add)) => {
                    let block_input = blocks.pop().expect("an Add closes a block");
                    let z: Vec<f32> = values.iter().zip(&block_input).map(|(body, input)| body + input).collect();
                    add.activation.apply_slice(&z, &mut values);
                }
                (Part::Not(_), Layer::Flatten(_)) => {}
                (Part::Not(why), _) => panic!("{what} does not run alone: {why}"),
            }
            assert_eq!(values.len(), batch * step.output.len(), "{what}");
            if blocks.is_empty() {
                assert_close(&values, &forward(&prefix(&model, index), &inputs, batch), 1e-5, 1e-4, &what);
            }
        }
        assert_close(&values, &forward(&model, &inputs, batch), 1e-5, 1e-4, name);
    }
}

/// The tool's models are the zoo's, by name and in its order.
#[test]
fn the_tools_models_are_the_zoos() {
    let engine = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/benches/zoo/engine.rs")).unwrap();
    let zoo = &engine[engine.find("pub const ZOO").expect("engine.rs defines ZOO")..];
    let zoo = &zoo[..zoo.find("];").expect("ZOO ends")];
    let names: Vec<&str> = zoo.split("name: \"").skip(1).filter_map(|rest| rest.split('"').next()).collect();
    assert_eq!(names, MODELS.map(|m| m.0));
}

/// A model whose batch norm's running statistics moved (one training pass) is refused: its
/// parts would start from other statistics than its own.
#[test]
fn a_model_whose_buffers_moved_is_not_split() {
    let model = Chain::new(Input::vector(4)).dense(4, Relu).batch_norm().dense(2, Identity).build().unwrap();
    let model = model.init(Init::HeNormal, SEED).with_threads(1).unwrap();
    assert_eq!(alone::split(&model).unwrap().len(), 3);
    let (mut cache, mut grads) = (model.preallocate(2).unwrap(), model.preallocate_grads(2).unwrap());
    cache.set_inputs(&Rng::new(5).uniform(8)).unwrap();
    cache.set_targets(&[0.5, -0.5, 1.0, 0.0]).unwrap();
    model.backprop(&mut grads, &mut cache, Loss::Mse).unwrap();
    match alone::split(&model) {
        Err(Error::Mismatch(why)) => assert!(why.contains("step 1 (BatchNorm") && why.contains("buffers"), "{why}"),
        Err(e) => panic!("expected a mismatch, got {e}"),
        Ok(_) => panic!("a model with moved running statistics was split"),
    }
}
