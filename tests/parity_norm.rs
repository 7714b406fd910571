//! Batch norm, layer norm, dropout and residual blocks against PyTorch, on weights PyTorch
//! saved: tests/fixtures/make_norm.py builds the twins (its `Residual` is the module flatnn names
//! a block's tensors after: `<i>.body.<j>.<name>`), saves their state dicts, and PyTorch's
//! outputs in eval and train mode, the loss of one training pass, every parameter's gradient
//! and every buffer after that pass. This test loads the state dicts into the same chains
//! (`Model::load_weights`, num_batches_tracked read from int64) and agrees within 1e-5,
//! relative to each tensor's largest value (to the largest gradient of the model, for
//! gradients: those of the biases ahead of a batch norm are zero but for rounding). While the
//! fixtures are missing it fails, saying which script makes them.

use flatnn::prelude::*;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::PathBuf;

fn same() -> ConvOptions {
    ConvOptions { stride: (1, 1), padding: (1, 1) }
}

/// The chains of make_norm.py's cases, with dropout's p (its eval-mode twin), or with p = 0
/// (the training pass: flatnn's masks are not PyTorch's).
fn chain(case: &str, p: impl Fn(f32) -> f32) -> Chain {
    match case {
        "cnn" => Chain::new(Input::image(2, 5, 4))
            .conv_with(3, (3, 3), Identity, same())
            .batch_norm_with(Relu)
            .residual_with(Relu, |c| {
                c.conv_with(3, (3, 3), Identity, same()).batch_norm_with(Relu).conv_with(3, (3, 3), Identity, same()).batch_norm()
            })
            .flatten()
            .dense(6, Identity)
            .batch_norm_with(Tanh)
            .dense(4, Identity),
        "mlp" => Chain::new(Input::vector(7))
            .dense(8, Relu)
            .residual(|c| c.dense(8, Tanh).dropout(p(0.5)).dense(8, Identity))
            .batch_norm()
            .dropout(p(0.3))
            .dense(3, Identity),
        "sig" => Chain::new(Input::signal(2, 9)).conv1d(3, 3, Identity).batch_norm_with(Relu).flatten().dense(4, Identity),
        "seq" => Chain::new(Input::sequence(5, 6))
            .layer_norm()
            .residual(|c| c.layer_norm())
            .flatten()
            .dense(4, Identity)
            .layer_norm()
            .dense(3, Identity),
        _ => unreachable!("no case {case}"),
    }
}

fn fixture(name: &str) -> (PathBuf, Vec<u8>) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    match std::fs::read(&path) {
        Ok(bytes) => (path, bytes),
        Err(e) => panic!(
            "{}: {e}. The PyTorch fixtures are made by `python3 tests/fixtures/make_norm.py` (torch and safetensors), \
             run from the repository root, and committed",
            path.display()
        ),
    }
}

/// The tensors of an expectation file, as f32 (int64 counts and labels converted).
fn tensors(bytes: &[u8]) -> HashMap<String, Vec<f32>> {
    let file = SafeTensors::deserialize(bytes).expect("a safetensors file");
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = match view.dtype() {
                Dtype::F32 => view.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
                Dtype::I64 => view.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f32).collect(),
                other => panic!("{name} is {other:?}"),
            };
            (name, values)
        })
        .collect()
}

/// The largest magnitude among `values`.
fn largest<'a>(values: impl IntoIterator<Item = &'a f32>) -> f32 {
    values.into_iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// |got − want| ≤ 1e-5 · (scale + |want|) everywhere; `scale` None: the tensor's largest value.
fn agree(got: &[f32], want: &[f32], scale: Option<f32>, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {} values, PyTorch has {}", got.len(), want.len());
    let scale = scale.unwrap_or_else(|| largest(want));
    let worst = got.iter().zip(want).map(|(g, w)| (g - w).abs() / (scale + w.abs()).max(f32::MIN_POSITIVE)).fold(0.0f32, f32::max);
    println!("{what}: {} values, worst error {worst:.2e} of the scale", got.len());
    assert!(worst <= 1e-5, "{what}: flatnn {got:?}, PyTorch {want:?}");
}

/// Every tensor of `which` (the steps' parameters or buffers) by its PyTorch name, from the
/// flat values in the plan's layout.
fn named(model: &Model, flat: &[f32], buffers: bool) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    for step in &model.plan().steps {
        for t in if buffers { &step.buffers } else { &step.tensors } {
            out.push((format!("{}.{}", step.module, t.name), flat[t.range.clone()].to_vec()));
        }
    }
    out
}

#[test]
fn new_layers_agree_with_pytorch() {
    for case in ["cnn", "mlp", "sig", "seq"] {
        let (state, _) = fixture(&format!("norm_{case}.safetensors"));
        let expect = tensors(&fixture(&format!("norm_{case}_expect.safetensors")).1);
        let x = &expect["x"];
        let batch = x.len() / chain(case, |p| p).build().unwrap().input_shape().len();

        // eval mode: the running statistics PyTorch saved, dropout the identity
        let mut model = chain(case, |p| p).build().unwrap().with_threads(1).unwrap();
        model.load_weights(&state).unwrap();
        let mut fwd = model.preallocate(batch).unwrap();
        fwd.set_inputs(x).unwrap();
        agree(model.forward(&mut fwd).unwrap(), &expect["eval"], None, &format!("{case}: eval outputs"));

        // one training pass from the same state (dropout at p = 0 on both sides)
        let mut model = chain(case, |_| 0.0).build().unwrap().with_threads(1).unwrap();
        model.load_weights(&state).unwrap();
        let (mut fwd, mut bwd) = (model.preallocate(batch).unwrap(), model.preallocate_grads(batch).unwrap());
        fwd.set_inputs(x).unwrap();
        let loss = match expect.get("labels") {
            Some(labels) => {
                fwd.set_labels(&labels.iter().map(|&l| l as u32).collect::<Vec<_>>()).unwrap();
                Loss::LogitCrossEntropy
            }
            None => {
                fwd.set_targets(&expect["targets"]).unwrap();
                Loss::Mse
            }
        };
        model.backprop(&mut bwd, &mut fwd, loss).unwrap();
        agree(fwd.outputs(), &expect["train"], None, &format!("{case}: train outputs"));
        agree(&[bwd.last_loss().unwrap()], &expect["loss"], None, &format!("{case}: loss"));
        let grads = bwd.gradients().unwrap();
        let params = named(&model, &grads, false);
        let scale = largest(expect.iter().filter(|(k, _)| k.starts_with("grad.")).flat_map(|(_, v)| v));
        for (name, got) in &params {
            agree(got, &expect[&format!("grad.{name}")], Some(scale), &format!("{case}: gradient of {name}"));
        }
        let buffers = named(&model, &model.buffers().unwrap(), true);
        for (name, got) in &buffers {
            agree(got, &expect[&format!("after.{name}")], None, &format!("{case}: {name} after the training pass"));
        }
        // nothing PyTorch has was left out
        let compared = params.len() + buffers.len();
        assert_eq!(
            expect.keys().filter(|k| k.starts_with("grad.") || k.starts_with("after.")).count(),
            compared,
            "{case}: tensors compared"
        );
    }
}
