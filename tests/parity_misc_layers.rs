//! flatnn against PyTorch on average and global average pooling, Conv1d and MaxPool1d, softmax
//! as a layer, the activations SiLU, ELU and Softplus, and the losses BCEWithLogits, L1 and
//! SmoothL1: each case's `nn.Sequential` state dict, saved by PyTorch, is loaded into the same
//! chain (`Model::load_weights`), and its outputs, its loss and the loss's gradient of every
//! parameter agree with PyTorch's within 1e-5 relative (‖a − b‖ / ‖b‖ per tensor).
//!
//! The fixtures are made by `tests/fixtures/make_misc_layers.py` (torch and safetensors): run
//! `python3 tests/fixtures/make_misc_layers.py` from the repository root. Without them this test
//! fails, saying so. They hold the gradient of the model's input too, which flatnn does not
//! compute (a model's first layer needs none); the first layer's weight gradient is made from
//! the same backward pass.

use flatnn::prelude::*;
use flatnn::testutil::rel_err;
use flatnn::{Conv1dOptions, Pool1dOptions};
use safetensors::tensor::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The flatnn twin of each case of the script (its `cases()`), module for module, and the loss.
fn cases() -> Vec<(&'static str, Chain, Loss)> {
    let same = ConvOptions { stride: (1, 1), padding: (1, 1) };
    vec![
        (
            "pool2d",
            Chain::new(Input::image(2, 9, 8))
                .conv_with(4, (3, 3), Silu, same)
                .avg_pool((2, 2))
                .conv(5, (2, 2), Elu(0.7))
                .avg_pool_with((2, 2), (1, 1))
                .global_avg_pool()
                .dense(3, Softplus),
            Loss::SmoothL1 { beta: 0.5 },
        ),
        (
            "signal",
            Chain::new(Input::signal(2, 24))
                .conv1d_with(3, 3, Elu(1.0), Conv1dOptions { stride: 2, padding: 2, dilation: 2 })
                .max_pool1d_with(3, Pool1dOptions { stride: 2, padding: 1, dilation: 2 })
                .conv1d(4, 2, Softplus)
                .max_pool1d(2)
                .global_avg_pool()
                .dense(2, Identity),
            Loss::BceWithLogits,
        ),
        ("softmax", Chain::new(Input::vector(6)).dense(5, Silu).dense(4, Identity).softmax(), Loss::L1),
    ]
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Every tensor of a safetensors file (all float32), by name.
fn read(path: &Path) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; the PyTorch fixtures are made by `python3 tests/fixtures/make_misc_layers.py` (torch, safetensors)",
            path.display()
        )
    });
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = HashMap::new();
    for (name, view) in file.tensors() {
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        out.insert(name, view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect());
    }
    out
}

/// ‖got − want‖ / ‖want‖ ≤ 1e-5, printed.
fn agree(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let err = rel_err(got, want);
    println!("{what}: rel err {err:.2e}");
    assert!(err <= 1e-5, "{what}: rel err {err:e}: {got:?} vs {want:?}");
}

#[test]
fn the_new_layers_activations_and_losses_agree_with_pytorch() {
    for (name, chain, loss) in cases() {
        let mut model = chain.build().unwrap().with_threads(1).unwrap();
        model.load_weights(fixture(&format!("misc_{name}.safetensors"))).unwrap_or_else(|e| {
            panic!("{name}: {e}; the PyTorch fixtures are made by `python3 tests/fixtures/make_misc_layers.py` (torch, safetensors)")
        });
        let data = read(&fixture(&format!("misc_{name}.data.safetensors")));
        let (x, target) = (&data["input"], &data["target"]);
        let batch = x.len() / model.input_shape().len();
        let (mut fwd, mut bwd) = (model.preallocate(batch).unwrap(), model.preallocate_grads(batch).unwrap());
        fwd.set_inputs(x).unwrap();
        fwd.set_targets(target).unwrap();
        agree(&format!("{name}: outputs"), model.forward(&mut fwd).unwrap(), &data["output"]);
        assert!((model.loss(&mut fwd, loss).unwrap() - data["loss"][0]).abs() <= 1e-5 * data["loss"][0].abs(), "{name}: loss");
        model.backprop(&mut bwd, &mut fwd, loss).unwrap();
        agree(&format!("{name}: training loss"), &[bwd.last_loss().unwrap()], &data["loss"]);
        let grads = bwd.gradients().unwrap();
        let mut checked = 0;
        for step in &model.plan().steps {
            for tensor in &step.tensors {
                let full = format!("{}.{}", step.module, tensor.name);
                agree(&format!("{name}: gradient of {full}"), &grads[tensor.range.clone()], &data[&format!("grad.{full}")]);
                checked += 1;
            }
        }
        // every parameter PyTorch has a gradient for, and the input's
        assert_eq!(checked + 1, data.keys().filter(|k| k.starts_with("grad.")).count(), "{name}");
    }
}
