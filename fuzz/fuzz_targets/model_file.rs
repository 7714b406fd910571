//! Model-file reader: any bytes must give `Ok` or `Err` from `Model::from_bytes`, never a panic,
//! a hang or an allocation sized by an unchecked header or architecture. A model that loads and
//! is small is also run forward and backward on one sample, to catch plans that build but
//! break later.
//!
//! The target reads the mutated bytes as they are; only the mutator knows the format. After
//! libFuzzer's own mutation it usually (three times in four) makes the file's lengths agree again,
//! because safetensors refuses any file whose header length or data length is off by one byte:
//! without that, a digit inserted into the architecture text (the way to a large dimension) is
//! almost never followed by the one compensating change it needs, and sizes that overflow or
//! allocate too much stay unexplored.
#![no_main]

use flatnn::{Layer, Loss, Model, Plan, Shape};
use libfuzzer_sys::{fuzz_mutator, fuzz_target, fuzzer_mutate};
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
    // A conv step's im2col columns: in_channels × kh × kw × output pixels (a 1-D one's: × k ×
    // output length).
    let cols = plan.steps.iter().map(|s| match (s.layer, s.input, s.output) {
        (Layer::Conv(conv), Shape::Image { channels, .. }, Shape::Image { height, width, .. }) => {
            [conv.kernel.0, conv.kernel.1, height, width].iter().fold(channels, |acc, &n| acc.saturating_mul(n))
        }
        (Layer::Conv1d(conv), Shape::Signal { channels, .. }, Shape::Signal { length, .. }) => {
            channels.saturating_mul(conv.kernel).saturating_mul(length)
        }
        _ => 0,
    });
    plan.param_len <= RUN_LIMIT && plan.acts_len(1).is_ok_and(|n| n <= RUN_LIMIT) && cols.max().unwrap_or(0) <= RUN_LIMIT
}

fn run(model: &Model) {
    let mut cache = model.preallocate(1).expect("a cache for one sample");
    let mut grads = model.preallocate_grads(1).expect("gradients for one sample");
    let inputs: Vec<f32> = (0..model.input_shape().len()).map(|i| (i % 7) as f32 / 7.0 - 0.5).collect();
    cache.set_inputs(&inputs).expect("inputs of the model's input length");
    let outputs = model.forward(&mut cache).expect("forward").len();
    assert_eq!(outputs, model.output_shape().len());
    // cross-entropy where the outputs are class scores, else MSE
    let loss = match model.output_shape() {
        Shape::Vector(classes) if classes >= 2 => {
            cache.set_labels(&[0]).expect("label 0 is a class of any model");
            Loss::LogitCrossEntropy
        }
        _ => {
            cache.set_targets(&vec![0.0; outputs]).expect("a target for each output");
            Loss::Mse
        }
    };
    model.backprop(&mut grads, &mut cache, loss).expect("backprop");
}

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    let size = fuzzer_mutate(data, size, max_size);
    if seed.is_multiple_of(4) {
        return size;
    }
    repair(data, size, max_size).unwrap_or(size)
});

/// Where bytes 8.. start with a JSON object: sets the header length (bytes 0..8) to that
/// object's length and cuts or zero-pads what follows to the largest `data_offsets` end in it.
/// Returns the new size, or `None` (nothing changed) where that does not apply or fit.
fn repair(data: &mut [u8], size: usize, max_size: usize) -> Option<usize> {
    let mut stream = serde_json::Deserializer::from_slice(data.get(8..size)?).into_iter::<serde_json::Value>();
    let header = stream.next()?.ok()?;
    let n = stream.byte_offset();
    let ends = header.as_object()?.values().filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64());
    let total = usize::try_from(ends.max().unwrap_or(0)).ok()?.checked_add(8 + n)?;
    if total > max_size {
        return None;
    }
    data[..8].copy_from_slice(&(n as u64).to_le_bytes());
    if total > size {
        data[size..total].fill(0);
    }
    Some(total)
}
