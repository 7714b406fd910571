//! The pooling, 1-D and softmax layers, the new activations and losses as a user meets them:
//! model files round-trip, the summary names them, bad settings are errors, and a 1-D CNN learns
//! (its PyTorch parity: tests/parity_misc_layers.rs; on a GPU: tests/gpu_misc_layers.rs).

use flatnn::models::ts_conv1d;
use flatnn::prelude::*;
use flatnn::testutil::{pooling_net, signal_net, Rng, TempDir};

fn nets() -> Vec<(&'static str, Chain)> {
    vec![
        ("pooling", pooling_net()),
        ("signal", signal_net()),
        ("ts_conv1d", ts_conv1d()),
        ("softmax", Chain::new(Input::vector(7)).dense(5, Softplus).dense(3, Elu(0.25)).softmax()),
    ]
}

#[test]
fn model_files_round_trip_and_summaries_name_every_new_layer() {
    let dir = TempDir::new("misc-layers");
    for (name, chain) in nets() {
        let model = chain.clone().build().unwrap().init(Init::HeNormal, 7).with_threads(1).unwrap();
        let path = dir.join(format!("{name}.safetensors"));
        model.save(&path).unwrap();
        let loaded = Model::load(&path).unwrap().with_threads(1).unwrap();
        assert_eq!(loaded.plan(), model.plan(), "{name}");
        let x = Rng::new(3).uniform(3 * model.input_shape().len());
        let outputs = |m: &Model| {
            let mut fwd = m.preallocate(3).unwrap();
            fwd.set_inputs(&x).unwrap();
            m.forward(&mut fwd).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(outputs(&loaded), outputs(&model), "{name}");
        // the PyTorch-named tensors alone, into the chain built again
        let mut fresh = chain.build().unwrap();
        fresh.load_weights(&path).unwrap();
        assert_eq!(fresh.parameters().unwrap(), model.parameters().unwrap(), "{name}");
    }
    let summary = format!("{}\n{}", pooling_net().build().unwrap(), signal_net().build().unwrap());
    for row in [
        "AvgPool(2×2, stride 2)",
        "AvgPool(3×3, stride 2)",
        "GlobalAvgPool(5×5)",
        "Softmax(10)",
        "signal(1×784)",
        "Conv1d(1 → 4, 5, stride 2, pad 2, dilation 2)",
        "MaxPool1d(3, stride 2, pad 1, dilation 2)",
        "elu:0.5",
        "silu",
        "softplus",
    ] {
        assert!(summary.contains(row), "{row:?} missing from\n{summary}");
    }
}

#[test]
fn a_smooth_l1_beta_below_zero_or_not_finite_is_refused_before_anything_runs() {
    let model = Chain::new(Input::vector(2)).dense(2, Identity).build().unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(1).unwrap(), model.preallocate_grads(1).unwrap());
    fwd.set_inputs(&[1.0, 2.0]).unwrap();
    fwd.set_targets(&[0.0, 1.0]).unwrap();
    for beta in [-0.5, f32::NAN, f32::INFINITY] {
        let loss = Loss::SmoothL1 { beta };
        for err in [model.backprop(&mut bwd, &mut fwd, loss).unwrap_err(), model.loss(&mut fwd, loss).unwrap_err()] {
            assert!(matches!(err, Error::Config(_)) && err.to_string().contains("beta"), "{beta}: {err}");
        }
    }
    assert!(bwd.last_loss().unwrap().is_nan(), "a step ran");
    for beta in [0.0, 2.0] {
        model.backprop(&mut bwd, &mut fwd, Loss::SmoothL1 { beta }).unwrap();
    }
}

/// Signals of 1×256: a sine of 2, 5, 11 or 23 cycles (the class) with a random phase and
/// amplitude, and noise.
fn signals(rng: &mut Rng, n: usize) -> (Vec<f32>, Vec<u32>) {
    let cycles = [2.0f32, 5.0, 11.0, 23.0];
    let (mut x, mut labels) = (Vec::with_capacity(n * 256), Vec::with_capacity(n));
    for _ in 0..n {
        let class = rng.below(4);
        let [phase, amplitude] = [rng.uniform(1)[0] * std::f32::consts::PI, 0.75 + 0.25 * rng.uniform(1)[0]];
        let noise = rng.uniform(256);
        x.extend((0..256).map(|t| amplitude * (cycles[class] * std::f32::consts::TAU * t as f32 / 256.0 + phase).sin() + 0.2 * noise[t]));
        labels.push(class as u32);
    }
    (x, labels)
}

/// The zoo's 1-D CNN learns to tell four frequencies apart: over 90% of a fresh batch right
/// after 150 Adam steps of 32 (it starts near 25%).
#[test]
fn ts_conv1d_learns_frequencies() {
    let mut model = ts_conv1d().build().unwrap().init(Init::HeNormal, 1);
    let (mut fwd, mut bwd) = (model.preallocate(64).unwrap(), model.preallocate_grads(64).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(3e-3)).unwrap();
    let mut rng = Rng::new(4);
    for _ in 0..150 {
        let (x, labels) = signals(&mut rng, 32);
        fwd.set_inputs(&x).unwrap();
        fwd.set_labels(&labels).unwrap();
        opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
    }
    let (x, labels) = signals(&mut rng, 64);
    fwd.set_inputs(&x).unwrap();
    fwd.set_labels(&labels).unwrap();
    let accuracy = model.accuracy(&mut fwd).unwrap();
    println!("ts_conv1d: accuracy {accuracy} on 64 fresh signals after 150 steps, loss {}", bwd.last_loss().unwrap());
    assert!(accuracy > 0.9, "accuracy {accuracy}");
}
