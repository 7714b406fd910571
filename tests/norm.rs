//! Batch norm, layer norm, dropout and residual blocks as a user meets them on the CPU: what
//! training and inference do to the running statistics and the masks, the errors, model files,
//! checkpoints that resume dropout exactly, and the summary. (Gradients and the fast path
//! against the plain loop: src/layers; against PyTorch: tests/parity_norm.rs; on a GPU:
//! tests/gpu_layers.rs.)

use flatnn::prelude::*;
use flatnn::testutil::{Rng, TempDir};

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Column c of a batch of `features`-vectors: its mean, biased and unbiased variance, in f64.
fn column_stats(x: &[f32], features: usize, c: usize) -> (f64, f64, f64) {
    let values: Vec<f64> = x.chunks(features).map(|s| f64::from(s[c])).collect();
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let squares: f64 = values.iter().map(|v| (v - mean).powi(2)).sum();
    (mean, squares / n, squares / (n - 1.0))
}

/// A training pass normalises by the batch's statistics and moves the running ones (momentum
/// 0.1, the unbiased variance), every pass, optimiser or not; `forward` and `loss` normalise by
/// the running statistics and move nothing; each training pass is counted.
#[test]
fn running_statistics_move_in_every_training_pass_and_inference_uses_them() {
    let features = 3;
    // γ = 1 and β = 0 from init, as PyTorch starts them
    let model = Chain::new(Input::vector(features)).batch_norm().build().unwrap().init(Init::HeNormal, 1).with_threads(1).unwrap();
    assert_eq!(*model.parameters().unwrap(), [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
    // running_mean (3), running_var (3), num_batches_tracked: PyTorch's start
    assert_eq!(*model.buffers().unwrap(), [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]);
    let (mut fwd, mut bwd) = (model.preallocate(6).unwrap(), model.preallocate_grads(6).unwrap());
    let x: Vec<f32> = Rng::new(1).uniform(6 * features).iter().enumerate().map(|(i, v)| v + (i % features) as f32).collect();
    fwd.set_inputs(&x).unwrap();
    fwd.set_targets(&vec![0.0; 6 * features]).unwrap();
    let (mut want_mean, mut want_var) = (vec![0.0f64; features], vec![1.0f64; features]);
    for pass in 1..=2u64 {
        model.backprop(&mut bwd, &mut fwd, Loss::Mse).unwrap();
        assert_eq!(model.train_passes(), pass);
        let buffers = model.buffers().unwrap();
        for c in 0..features {
            let (mean, var, unbiased) = column_stats(&x, features, c);
            (want_mean[c], want_var[c]) = (0.9 * want_mean[c] + 0.1 * mean, 0.9 * want_var[c] + 0.1 * unbiased);
            assert!((f64::from(buffers[c]) - want_mean[c]).abs() < 1e-6, "pass {pass}: running mean {c}: {}", buffers[c]);
            assert!((f64::from(buffers[3 + c]) - want_var[c]).abs() < 1e-6, "pass {pass}: running var {c}: {}", buffers[3 + c]);
            // the training pass's outputs: normalised by the batch's statistics
            for (s, sample) in x.chunks(features).enumerate() {
                let want = (f64::from(sample[c]) - mean) / (var + 1e-5).sqrt();
                assert!((f64::from(fwd.outputs()[s * features + c]) - want).abs() < 1e-5, "pass {pass}: output {s}, {c}");
            }
        }
        assert_eq!(buffers[6], pass as f32, "num_batches_tracked");
    }
    // inference: by the running statistics, and nothing moves
    let before = model.buffers().unwrap().into_owned();
    let y = model.forward(&mut fwd).unwrap().to_vec();
    model.loss(&mut fwd, Loss::Mse).unwrap();
    assert_eq!(bits(&model.buffers().unwrap()), bits(&before));
    assert_eq!(model.train_passes(), 2);
    for (i, (&got, &x)) in y.iter().zip(&x).enumerate() {
        let c = i % features;
        let want = (f64::from(x) - want_mean[c]) / (want_var[c] + 1e-5).sqrt();
        assert!((f64::from(got) - want).abs() < 1e-5, "inference {i}: {got} against {want}");
    }
    // a train_step is a training pass too
    let mut model = model;
    let mut opt = Optimizer::new(&model, Optim::sgd(0.1, 0.0)).unwrap();
    opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::Mse).unwrap();
    assert_eq!((model.train_passes(), model.buffers().unwrap()[6]), (3, 3.0));
}

/// Training batch norm on one value a channel is an error before anything runs, as in PyTorch;
/// inference on one sample, and training on one image of several pixels, are fine.
#[test]
fn batch_norm_training_needs_two_values_a_channel() {
    let model = Chain::new(Input::vector(4)).dense(3, Relu).batch_norm().dense(2, Identity).build().unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(4).unwrap(), model.preallocate_grads(4).unwrap());
    fwd.set_inputs(&[0.5, -1.0, 2.0, 0.25]).unwrap();
    fwd.set_labels(&[1]).unwrap();
    match model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy) {
        Err(Error::Shape(msg)) => assert!(msg.contains("layer 1 (batch norm)") && msg.contains("needs 2 or more"), "{msg}"),
        other => panic!("expected a shape error, got {other:?}"),
    }
    assert_eq!(model.train_passes(), 0, "nothing ran");
    assert_eq!(model.buffers().unwrap()[6], 0.0);
    assert!(model.forward(&mut fwd).unwrap().iter().all(|v| v.is_finite()));
    let image = Chain::new(Input::image(2, 2, 2)).batch_norm().flatten().dense(2, Identity).build().unwrap();
    let (mut fwd, mut bwd) = (image.preallocate(1).unwrap(), image.preallocate_grads(1).unwrap());
    fwd.set_inputs(&Rng::new(2).uniform(8)).unwrap();
    fwd.set_labels(&[0]).unwrap();
    image.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
}

/// Dropout: a copy in inference; in training a share p of the values zeroed and the rest scaled
/// by 1/(1 − p), a new mask each pass, the same masks from the same seed and pass count; a
/// probability outside [0, 1) is refused when the chain is built.
#[test]
fn dropout_masks_follow_the_seed_and_the_pass() {
    let n = 20_000;
    let build = |seed| Chain::new(Input::vector(n)).dropout(0.3).build().unwrap().init(Init::HeNormal, seed);
    let x: Vec<f32> = Rng::new(3).uniform(n).iter().map(|v| v + 2.0).collect();
    let run = |model: &Model, passes: usize| -> Vec<Vec<f32>> {
        let (mut fwd, mut bwd) = (model.preallocate(1).unwrap(), model.preallocate_grads(1).unwrap());
        fwd.set_inputs(&x).unwrap();
        fwd.set_targets(&vec![0.0; n]).unwrap();
        assert_eq!(bits(model.forward(&mut fwd).unwrap()), bits(&x), "inference is a copy");
        (0..passes)
            .map(|_| {
                model.backprop(&mut bwd, &mut fwd, Loss::Mse).unwrap();
                fwd.outputs().to_vec()
            })
            .collect()
    };
    let masks = run(&build(5), 2);
    let scale = (1.0 / (1.0 - 0.3f64)) as f32;
    for y in &masks {
        let dropped = y.iter().filter(|&&v| v == 0.0).count() as f64 / n as f64;
        assert!((dropped - 0.3).abs() < 5.0 * (0.3 * 0.7 / n as f64).sqrt(), "dropped {dropped}");
        assert!(y.iter().zip(&x).all(|(&y, &x)| y == 0.0 || y == x * scale), "kept values are scaled by 1/(1 − p)");
    }
    assert_ne!(masks[0], masks[1], "a new mask each pass");
    assert_eq!(run(&build(5), 2), masks, "the same seed draws the same masks");
    assert_ne!(run(&build(6), 1)[0], masks[0], "another seed, another mask");
    for p in [1.0, -0.1, f32::NAN] {
        match Chain::new(Input::vector(3)).dropout(p).build() {
            Err(Error::Shape(msg)) => assert!(msg.contains("is not in [0, 1)"), "{msg}"),
            other => panic!("p = {p}: expected a shape error, got {other:?}"),
        }
    }
}

/// A model of every new kind, trained a little (so that its running statistics and counts are
/// not their starting values): the file holds them under PyTorch's names, the count as an
/// integer, and loads into the same plan, parameters and buffers, with the same outputs.
fn every_kind() -> Chain {
    Chain::new(Input::image(2, 6, 5))
        .conv_with(4, (3, 3), Identity, ConvOptions { stride: (1, 1), padding: (1, 1) })
        .batch_norm_with(Relu)
        .residual_with(Relu, |c| {
            c.conv_with(4, (3, 3), Identity, ConvOptions { stride: (1, 1), padding: (1, 1) })
                .batch_norm_with(LeakyRelu(0.1))
                .residual(|c| c.dropout(0.2))
                .batch_norm()
        })
        .flatten()
        .dense(12, Tanh)
        .layer_norm()
        .dropout(0.5)
        .dense(3, Identity)
}

fn train(model: &mut Model, opt: &mut Optimizer, steps: std::ops::Range<u64>) {
    let (mut fwd, mut bwd) = (model.preallocate(6).unwrap(), model.preallocate_grads(6).unwrap());
    for step in steps {
        let mut rng = Rng::new(200 + step);
        let n = if step % 2 == 0 { 6 } else { 4 };
        fwd.set_inputs(&rng.uniform(n * 60)).unwrap();
        fwd.set_labels(&(0..n).map(|_| rng.below(3) as u32).collect::<Vec<_>>()).unwrap();
        opt.train_step(model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
    }
}

#[test]
fn every_new_kind_round_trips_through_a_model_file() {
    let dir = TempDir::new("norm-file");
    let mut model = every_kind().build().unwrap().init(Init::HeNormal, 4).with_threads(2).unwrap();
    let mut opt = Optimizer::new(&model, Optim::adam(1e-2)).unwrap();
    train(&mut model, &mut opt, 0..3);
    let path = dir.join("every.safetensors");
    model.save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let count = file.tensor("1.num_batches_tracked").unwrap();
    assert_eq!((count.dtype(), count.shape()), (safetensors::Dtype::I64, &[][..]));
    assert_eq!(i64::from_le_bytes(count.data().try_into().unwrap()), 3);
    // Conv2d(0) BatchNorm2d(1) ReLU(2) Residual(3: Conv2d BatchNorm2d LeakyReLU Residual(Dropout)
    // BatchNorm2d) ReLU(4) Flatten(5) Linear(6) Tanh(7) LayerNorm(8) Dropout(9) Linear(10)
    for name in ["0.weight", "1.running_var", "3.body.1.weight", "3.body.4.running_mean", "3.body.4.bias", "8.weight", "8.bias", "10.bias"]
    {
        assert!(file.tensor(name).is_ok(), "{name} is not in the file");
    }
    let loaded = Model::load(&path).unwrap();
    assert_eq!(loaded.plan(), model.plan());
    assert_eq!(bits(&loaded.parameters().unwrap()), bits(&model.parameters().unwrap()));
    assert_eq!(bits(&loaded.buffers().unwrap()), bits(&model.buffers().unwrap()));
    let x = Rng::new(9).uniform(2 * 60);
    let outputs = |m: &Model| {
        let mut fwd = m.preallocate(2).unwrap();
        fwd.set_inputs(&x).unwrap();
        bits(m.forward(&mut fwd).unwrap())
    };
    assert_eq!(outputs(&loaded), outputs(&model));
    let mut fresh = every_kind().build().unwrap();
    fresh.load_weights(&path).unwrap();
    assert_eq!(outputs(&fresh), outputs(&model));
}

/// Dropout's masks follow the training passes, which a checkpoint keeps: a run stopped,
/// saved, loaded into a fresh model (another seed) and resumed ends with the bits of one that
/// never stopped (parameters, running statistics and the optimiser's state).
#[test]
fn a_resumed_run_draws_the_masks_the_uninterrupted_one_would() {
    let dir = TempDir::new("norm-resume");
    let build = |seed| every_kind().build().unwrap().init(Init::HeNormal, seed).with_threads(2).unwrap();
    let (n, m) = (4, 5);
    let mut straight = build(1);
    let mut opt = Optimizer::new(&straight, Optim::adam(1e-2)).unwrap();
    train(&mut straight, &mut opt, 0..n + m);

    let mut first = build(1);
    let mut first_opt = Optimizer::new(&first, Optim::adam(1e-2)).unwrap();
    train(&mut first, &mut first_opt, 0..n);
    let path = dir.join("run.safetensors");
    first.save_checkpoint(&first_opt, &path).unwrap();
    let mut resumed = build(2);
    let mut resumed_opt = Optimizer::new(&resumed, Optim::adam(1e-2)).unwrap();
    resumed.load_checkpoint(&mut resumed_opt, &path).unwrap();
    assert_eq!(resumed.train_passes(), n);
    train(&mut resumed, &mut resumed_opt, n..n + m);
    assert_eq!(bits(&resumed.parameters().unwrap()), bits(&straight.parameters().unwrap()), "parameters");
    assert_eq!(bits(&resumed.buffers().unwrap()), bits(&straight.buffers().unwrap()), "running statistics");
    assert_eq!(bits(&resumed_opt.state().unwrap()), bits(&opt.state().unwrap()), "optimiser state");
    // a checkpoint resumed into a model of another seed without the count would draw other masks
    let mut other = build(2);
    let mut other_opt = Optimizer::new(&other, Optim::adam(1e-2)).unwrap();
    other.set_parameters(&first.parameters().unwrap()).unwrap();
    other_opt.set_state(&first_opt.state().unwrap(), n).unwrap();
    train(&mut other, &mut other_opt, n..n + m);
    assert_ne!(bits(&other.parameters().unwrap()), bits(&straight.parameters().unwrap()), "the masks matter");
}

#[test]
fn the_summary_indents_a_blocks_body() {
    let model = Chain::new(Input::vector(4))
        .dense(8, Identity)
        .batch_norm_with(Relu)
        .residual_with(Relu, |c| c.dense(8, Identity).layer_norm().dropout(0.1))
        .dense(2, Identity)
        .build()
        .unwrap()
        .with_threads(1)
        .unwrap();
    let want = "\
#  layer                output     parameters  activation
   input                vector(4)
0  Dense(4 → 8)         vector(8)          40  identity
1  BatchNorm1d(8)       vector(8)          16  relu
2  Residual             vector(8)           0
3    Dense(8 → 8)       vector(8)          72  identity
4    LayerNorm(8)       vector(8)          16
5    Dropout(p = 0.1)   vector(8)           0
6  Add (+ block input)  vector(8)           0  relu
7  Dense(8 → 2)         vector(2)          18  identity
162 parameters (0.6 KiB), on cpu (1 thread)";
    assert_eq!(model.to_string(), want);
}

/// Batch norm takes vectors and images, layer norm vectors and sequences; the other shapes are
/// refused when the chain is built, naming the layer.
#[test]
fn each_norm_refuses_the_shapes_it_does_not_normalise() {
    let cases = [
        (
            Chain::new(Input::sequence(3, 4)).batch_norm(),
            "layer 0 (BatchNorm { activation: Identity }) with input sequence(3×4): batch norm needs",
        ),
        (Chain::new(Input::image(1, 2, 2)).layer_norm(), "layer 0 (LayerNorm) with input image(1×2×2): layer norm needs"),
    ];
    for (chain, needle) in cases {
        match chain.build() {
            Err(Error::Shape(msg)) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
            other => panic!("expected a shape error with {needle:?}, got {other:?}"),
        }
    }
}
