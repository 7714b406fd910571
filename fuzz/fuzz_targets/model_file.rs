//! Model-file reader: any bytes must give `Ok` or `Err` from `Model::from_bytes`, never a panic,
//! a hang or an allocation sized by an unchecked header or architecture. A model that loads and
//! is small is also run forward and backward on one sample, to catch plans that build but
//! break later.
#![no_main]

use flatnn::{Layer, Loss, Model, Plan, Shape};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

/// Models whose parameters, activations and conv columns each stay under this many values are
/// also run; larger ones only load.
const RUN_LIMIT: usize = 1 << 16;

fuzz_target!(
    init: {
        // One thread: no worker threads started for every input.
        std::env::set_var("FLATNN_THREADS", "1");
    },
    |data: &[u8]| {
        if let Ok(model) = Model::from_bytes(data, Path::new("fuzz")) {
            if small(model.plan()) {
                run(&model);
            }
        }
    }
);

fn small(plan: &Plan) -> bool {
    // A conv step's im2col columns: in_channels × kh × kw × output pixels.
    let cols = plan.steps.iter().map(|s| match (s.layer, s.input, s.output) {
        (Layer::Conv { kernel, .. }, Shape::Image { channels, .. }, Shape::Image { height, width, .. }) => {
            [kernel.0, kernel.1, height, width].iter().fold(channels, |acc, &n| acc.saturating_mul(n))
        }
        _ => 0,
    });
    plan.param_len <= RUN_LIMIT && plan.acts_len(1) <= RUN_LIMIT && cols.max().unwrap_or(0) <= RUN_LIMIT
}

fn run(model: &Model) {
    let mut cache = model.preallocate(1).expect("a cache for one sample");
    let mut grads = model.preallocate_grads(1).expect("gradients for one sample");
    let inputs: Vec<f32> = (0..model.input_shape().len()).map(|i| (i % 7) as f32 / 7.0 - 0.5).collect();
    cache.set_inputs(&inputs).expect("inputs of the model's input length");
    let outputs = model.forward(&mut cache).expect("forward").len();
    assert_eq!(outputs, model.output_shape().len());
    cache.set_labels(&[0]).expect("label 0 is a class of any model");
    model.backprop(&mut grads, &mut cache, Loss::LogitCrossEntropy).expect("backprop");
}
