//! flatnn's GRU and LSTM against PyTorch's `nn.GRU` and `nn.LSTM` on the weights, inputs and
//! initial states PyTorch saved (tests/fixtures/make_recurrent.py writes the files): the outputs
//! of every step and of the last, the final hidden and cell states, the loss and the gradient of
//! every parameter, each within 1e-5 of PyTorch's (relative, over the tensor). The input's
//! gradient, which the public API does not give, is checked against the same files inside the
//! crate (`layers::recurrent`'s tests). A missing file fails the test, naming the script.

use flatnn::prelude::*;
use flatnn::testutil::rel_err;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

const BATCH: usize = 2;

fn fixture(kind: &str) -> (PathBuf, Vec<u8>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/recurrent_{kind}.safetensors"));
    match std::fs::read(&path) {
        Ok(bytes) => (path, bytes),
        Err(e) => panic!("{}: {e}: make it with `python3 tests/fixtures/make_recurrent.py` (torch and safetensors)", path.display()),
    }
}

fn values(file: &SafeTensors, name: &str) -> Vec<f32> {
    let view = file.tensor(name).unwrap_or_else(|e| panic!("the fixture has no tensor {name}: {e}"));
    assert_eq!(view.dtype(), Dtype::F32, "{name}");
    view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// Per sample h then c (the LSTM's), as `Cache::set_state` takes them and `final_state` gives them.
fn state(file: &SafeTensors, h: &str, c: Option<&str>) -> Vec<f32> {
    let h = values(file, h);
    let Some(c) = c else { return h };
    let c = values(file, c);
    let n = h.len() / BATCH;
    (0..BATCH).flat_map(|s| h[s * n..][..n].iter().chain(&c[s * n..][..n]).copied().collect::<Vec<_>>()).collect()
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let err = rel_err(got, want);
    println!("{what}: rel err {err:.1e}");
    assert!(err <= 1e-5, "{what}: rel err {err:e}\n got {got:?}\nwant {want:?}");
}

fn check(kind: &str, chain: Chain) {
    let (path, bytes) = fixture(kind);
    let file = SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut model = chain.build().unwrap().with_threads(1).unwrap();
    // the state dict alone, for load_weights
    let names: Vec<(String, Vec<usize>)> = model
        .plan()
        .steps
        .iter()
        .flat_map(|s| s.tensors.iter().map(move |t| (format!("{}.{}", s.module, t.name), t.shape.clone())))
        .collect();
    let data: Vec<Vec<u8>> = names.iter().map(|(name, _)| values(&file, name).iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let views =
        names.iter().zip(&data).map(|((name, shape), data)| (name.as_str(), TensorView::new(Dtype::F32, shape.clone(), data).unwrap()));
    let weights = std::env::temp_dir().join(format!("flatnn-parity-{kind}-{}.safetensors", std::process::id()));
    std::fs::write(&weights, safetensors::serialize(views, &None).unwrap()).unwrap();
    model.load_weights(&weights).unwrap();
    std::fs::remove_file(&weights).unwrap();

    let lstm = kind == "lstm";
    let states: Vec<Vec<f32>> = (0..2).map(|i| state(&file, &format!("h0.{i}"), lstm.then(|| format!("c0.{i}")).as_deref())).collect();
    let (mut fwd, mut bwd) = (model.preallocate(BATCH).unwrap(), model.preallocate_grads(BATCH).unwrap());
    for (layer, values) in states.iter().enumerate() {
        fwd.set_state(layer, values).unwrap();
    }
    fwd.set_inputs(&values(&file, "x")).unwrap();
    fwd.set_targets(&values(&file, "target")).unwrap();
    close(model.forward(&mut fwd).unwrap(), &values(&file, "y"), &format!("{kind}: y"));
    for layer in 0..2 {
        let want = state(&file, &format!("h_n.{layer}"), lstm.then(|| format!("c_n.{layer}")).as_deref());
        close(&fwd.final_state(layer).unwrap(), &want, &format!("{kind}: layer {layer}'s final state"));
    }
    model.backprop(&mut bwd, &mut fwd, Loss::Mse).unwrap();
    close(&[bwd.last_loss().unwrap()], &values(&file, "loss"), &format!("{kind}: loss"));
    let grads = bwd.gradients().unwrap();
    for step in &model.plan().steps {
        for t in &step.tensors {
            let name = format!("{}.{}", step.module, t.name);
            close(&grads[t.range.clone()], &values(&file, &format!("grad.{name}")), &format!("{kind}: d loss / d {name}"));
        }
    }

    // the first layer's output at every step: the first layer alone, with its weights
    let first = model.plan().steps[0].params.clone();
    let mut alone = Chain::new(model.input_shape()).layer(model.plan().steps[0].layer).build().unwrap().with_threads(1).unwrap();
    alone.set_parameters(&model.parameters().unwrap()[first]).unwrap();
    let mut cache = alone.preallocate(BATCH).unwrap();
    cache.set_state(0, &states[0]).unwrap();
    cache.set_inputs(&values(&file, "x")).unwrap();
    close(alone.forward(&mut cache).unwrap(), &values(&file, "output.0"), &format!("{kind}: layer 0's output"));
}

#[test]
fn gru_matches_pytorch() {
    check("gru", Chain::new(Shape::sequence(4, 3)).gru(5, RnnOutput::Sequence).gru(4, RnnOutput::LastStep).dense(3, Identity));
}

#[test]
fn lstm_matches_pytorch() {
    check("lstm", Chain::new(Shape::sequence(4, 3)).lstm(5, RnnOutput::Sequence).lstm(4, RnnOutput::LastStep).dense(3, Identity));
}
