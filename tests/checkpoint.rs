//! Checkpoints: a run stopped, saved, loaded into a fresh model and optimiser and resumed ends
//! with the same bits as one that never stopped (on the CPU; on a GPU, `#[ignore]`d:
//! `--include-ignored` where there is one); the file carries PyTorch's names; wrong files are
//! refused by name and change nothing.

use flatnn::prelude::*;
use flatnn::testutil::{Rng, TempDir};
use safetensors::SafeTensors;
use std::path::Path;

fn chain() -> Chain {
    Chain::new(Input::image(1, 6, 6)).conv(3, (3, 3), Relu).flatten().dense(10, Tanh).dense(4, Identity)
}

/// The optimiser as the training program builds it: the rule, clipping and a schedule.
fn optimiser(model: &Model, optim: Optim) -> Optimizer {
    let mut opt = Optimizer::new(model, optim).unwrap();
    opt.set_clip(Clip::Norm(0.5)).unwrap();
    opt.set_schedule(Schedule::cosine(3, 20)).unwrap();
    opt
}

/// Training steps `from..to` of a fixed sequence of batches (batch k drawn from seed k).
fn train(model: &mut Model, opt: &mut Optimizer, fwd: &mut Cache, bwd: &mut Grads, steps: std::ops::Range<u64>) {
    for step in steps {
        let mut rng = Rng::new(100 + step);
        let n = if step % 3 == 2 { 5 } else { 8 };
        fwd.set_inputs(&rng.uniform(n * 36)).unwrap();
        fwd.set_labels(&(0..n).map(|_| rng.below(4) as u32).collect::<Vec<_>>()).unwrap();
        opt.train_step(model, bwd, fwd, Loss::LogitCrossEntropy).unwrap();
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// N + M steps straight, against N steps, a checkpoint, a fresh model and optimiser (other
/// initial weights, to show they are overwritten) loading it, then M steps: parameters,
/// state and step count, bit for bit.
fn resume_is_exact(device: &Device, dir: &Path) {
    let optims = [Optim::adam(1e-2).with_weight_decay(1e-3), Optim::adamw(1e-2, 0.1), Optim::sgd(0.1, 0.9), Optim::rmsprop(1e-3)];
    for optim in optims {
        let build = |seed: u64| chain().build().unwrap().init(Init::HeNormal, seed).with_threads(2).unwrap().to(device).unwrap();
        let (n, m) = (7, 9);
        let mut straight = build(1);
        let (mut fwd, mut bwd) = (straight.preallocate(8).unwrap(), straight.preallocate_grads(8).unwrap());
        let mut opt = optimiser(&straight, optim);
        train(&mut straight, &mut opt, &mut fwd, &mut bwd, 0..n + m);

        let mut first = build(1);
        let (mut fwd, mut bwd) = (first.preallocate(8).unwrap(), first.preallocate_grads(8).unwrap());
        let mut first_opt = optimiser(&first, optim);
        train(&mut first, &mut first_opt, &mut fwd, &mut bwd, 0..n);
        let path = dir.join("run.safetensors");
        first.save_checkpoint(&first_opt, &path).unwrap();

        let mut resumed = build(2);
        let mut resumed_opt = optimiser(&resumed, optim);
        resumed.load_checkpoint(&mut resumed_opt, &path).unwrap();
        assert_eq!(resumed_opt.steps(), n);
        assert_eq!(bits(&resumed.parameters().unwrap()), bits(&first.parameters().unwrap()), "{optim:?}: loaded parameters");
        let (mut fwd, mut bwd) = (resumed.preallocate(8).unwrap(), resumed.preallocate_grads(8).unwrap());
        train(&mut resumed, &mut resumed_opt, &mut fwd, &mut bwd, n..n + m);

        assert_eq!(resumed_opt.steps(), opt.steps());
        assert_eq!(bits(&resumed.parameters().unwrap()), bits(&straight.parameters().unwrap()), "{optim:?} on {device}: parameters");
        assert_eq!(bits(&resumed_opt.state().unwrap()), bits(&opt.state().unwrap()), "{optim:?} on {device}: optimiser state");
        assert_ne!(bits(&straight.parameters().unwrap()), bits(&first.parameters().unwrap()), "the last steps moved something");
        // the checkpoint is a model file too
        assert_eq!(Model::load(&path).unwrap().parameters().unwrap(), first.parameters().unwrap());
    }
}

#[test]
fn a_resumed_run_matches_one_that_never_stopped() {
    resume_is_exact(&Device::Cpu, &TempDir::new("checkpoint-resume"));
}

#[cfg(feature = "cuda")]
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_resumed_run_on_the_gpu_matches_one_that_never_stopped() {
    resume_is_exact(&flatnn::testutil::cuda_device(), &TempDir::new("checkpoint-resume-gpu"));
}

/// The optimiser's tensors carry PyTorch's `state_dict` names and shapes, in
/// `model.parameters()` order, and hold the flat state's values.
#[test]
fn the_file_uses_pytorchs_names() {
    let dir = TempDir::new("checkpoint-names");
    let mut model = chain().build().unwrap().init(Init::HeNormal, 1);
    let (mut fwd, mut bwd) = (model.preallocate(8).unwrap(), model.preallocate_grads(8).unwrap());
    let mut opt = optimiser(&model, Optim::adam(1e-2));
    train(&mut model, &mut opt, &mut fwd, &mut bwd, 0..3);
    let path = dir.join("adam.safetensors");
    model.save_checkpoint(&opt, &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut names = file.names();
    names.sort();
    // Conv2d(0) ReLU(1) Flatten(2) Linear(3) Tanh(4) Linear(5): parameters 0.weight, 0.bias,
    // 3.weight, 3.bias, 5.weight, 5.bias are the optimiser's 0 to 5
    let mut want = vec!["0.bias", "0.weight", "3.bias", "3.weight", "5.bias", "5.weight"].into_iter().map(String::from).collect::<Vec<_>>();
    for i in 0..6 {
        for name in ["exp_avg", "exp_avg_sq", "step"] {
            want.push(format!("optimizer.state.{i}.{name}"));
        }
    }
    want.sort();
    assert_eq!(names.into_iter().cloned().collect::<Vec<_>>(), want);
    let values = |name: &str| {
        file.tensor(name).unwrap().data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect::<Vec<_>>()
    };
    let state = opt.state().unwrap();
    let n = model.plan().param_len;
    // 3.weight: parameter 2, the dense layer's (10, 3·4·4) weights, right after the conv's 30
    // values; 3.bias after them
    assert_eq!(file.tensor("optimizer.state.2.exp_avg").unwrap().shape(), [10, 48]);
    assert_eq!(values("optimizer.state.2.exp_avg"), &state[30..510]);
    assert_eq!(values("optimizer.state.3.exp_avg_sq"), &state[n + 510..n + 520]);
    assert_eq!(values("optimizer.state.5.step"), [3.0]);
    assert_eq!(file.tensor("optimizer.state.5.step").unwrap().shape(), [] as [usize; 0]);
}

#[test]
fn wrong_checkpoints_are_refused_and_change_nothing() {
    let dir = TempDir::new("checkpoint-wrong");
    let mut model = chain().build().unwrap().init(Init::HeNormal, 1);
    let (mut fwd, mut bwd) = (model.preallocate(8).unwrap(), model.preallocate_grads(8).unwrap());
    let mut adam = optimiser(&model, Optim::adam(1e-2));
    train(&mut model, &mut adam, &mut fwd, &mut bwd, 0..2);
    let path = dir.join("adam.safetensors");
    model.save_checkpoint(&adam, &path).unwrap();
    let plain = dir.join("model.safetensors");
    model.save(&plain).unwrap();

    let mut target = chain().build().unwrap().init(Init::HeNormal, 5);
    let before = target.parameters().unwrap().to_vec();
    let format_error = |result: Result<(), Error>| match result {
        Err(e @ Error::Format { .. }) => e.to_string(),
        other => panic!("expected a format error, got {other:?}"),
    };
    // another kind of optimiser: state it does not keep, or lacks
    let mut sgd = Optimizer::new(&target, Optim::sgd(0.1, 0.0)).unwrap();
    let msg = format_error(target.load_checkpoint(&mut sgd, &path));
    assert!(msg.contains("does not keep") && msg.contains("optimizer.state.0.exp_avg"), "{msg}");
    let mut momentum = Optimizer::new(&target, Optim::sgd(0.1, 0.9)).unwrap();
    let msg = format_error(target.load_checkpoint(&mut momentum, &path));
    assert!(msg.contains("optimizer.state.0.momentum_buffer [3, 1, 3, 3] is missing"), "{msg}");
    // a model file is not a checkpoint
    let mut fresh = Optimizer::new(&target, Optim::adam(1e-2)).unwrap();
    assert!(format_error(target.load_checkpoint(&mut fresh, &plain)).contains("not a checkpoint"));
    // another architecture
    let mut other = Chain::new(Input::image(1, 6, 6)).conv(3, (3, 3), Relu).flatten().dense(10, Relu).dense(4, Identity).build().unwrap();
    let mut other_opt = Optimizer::new(&other, Optim::adam(1e-2)).unwrap();
    assert!(format_error(other.load_checkpoint(&mut other_opt, &path)).contains("another model"));
    // a step tensor that disagrees with the count
    let bytes = std::fs::read(&path).unwrap();
    let edited = dir.join("edited.safetensors");
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let seven = 7.0f32.to_le_bytes();
    let views: Vec<(String, safetensors::tensor::TensorView)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| match name.as_str() {
            "optimizer.state.4.step" => (name, safetensors::tensor::TensorView::new(view.dtype(), vec![], &seven).unwrap()),
            _ => (name, view),
        })
        .collect();
    std::fs::write(&edited, safetensors::serialize(views, header.metadata()).unwrap()).unwrap();
    let msg = format_error(target.load_checkpoint(&mut fresh, &edited));
    assert!(msg.contains("optimizer.state.4.step is 7, but the checkpoint's step count is 2"), "{msg}");
    // an optimiser of another model
    assert!(matches!(target.load_checkpoint(&mut adam, &path), Err(Error::Mismatch(_))));

    assert_eq!(target.parameters().unwrap(), &before[..], "nothing was loaded");
    assert_eq!((fresh.steps(), sgd.steps(), momentum.steps()), (0, 0, 0));
    assert!(fresh.state().unwrap().iter().all(|&v| v == 0.0));
    // and the right one loads
    target.load_checkpoint(&mut fresh, &path).unwrap();
    assert_eq!((target.parameters().unwrap(), fresh.steps()), (model.parameters().unwrap(), 2));
}
