//! GRU and LSTM on a GPU against the CPU: forward outputs and final states from set initial
//! states, gradients (the batch under and over the training head's lower bound, in a cache of a
//! larger capacity after a batch of it), training steps in a graph, and a stream. Each test runs
//! itself in a child process per route (`FLATNN_CUDNN=0`: flatnn's routes, per-step or fused,
//! whichever was measured faster; `1`: cuDNN's RNN kernels; `auto`: the fastest of all), one at a
//! time; one runs each of cuDNN's RNN algorithms alone (`FLATNN_RNN_ALGO`), one the fused route
//! alone. `#[ignore]`d: `cargo test --test gpu_recurrent -- --include-ignored` runs them where
//! there is a GPU.
#![cfg(feature = "cuda")]

use flatnn::cuda::cudnn_version;
use flatnn::prelude::*;
use flatnn::testutil::{assert_close, cuda_device, in_child, rel_err, run_alone, Rng};
use flatnn::Layer;

/// In the test process: runs `test` in a child per route and returns None. In a child: the
/// route's `FLATNN_CUDNN`.
fn in_each_route(test: &str) -> Option<String> {
    if in_child() {
        return Some(std::env::var("FLATNN_CUDNN").unwrap_or_default());
    }
    for mode in ["0", "1", "auto"] {
        run_alone(test, &[("FLATNN_CUDNN", mode)]);
    }
    None
}

/// Checks that the report of a cache that ran forward and backward passes on its recurrent
/// layers names the route `mode` takes: flatnn's with `0` (cuDNN not used); cuDNN's for both
/// modes of every layer with `1` (where cuDNN loads); with `auto`, the per-step route and cuDNN
/// timed.
fn check_report(report: &str, mode: &str, what: &str) {
    println!("{what}: {report}");
    let layers: Vec<&str> = report.lines().filter(|l| l.contains("GRU") || l.contains("LSTM")).collect();
    match mode {
        "0" => assert!(report.contains("recurrent layers: cuDNN not used (FLATNN_CUDNN=0)"), "{what}: {report}"),
        _ if cudnn_version().is_none() => assert!(report.contains("recurrent layers: cuDNN not used"), "{what}: {report}"),
        "1" => {
            assert!(!layers.is_empty(), "{what}: no recurrent layer reported: {report}");
            for line in layers {
                assert!(line.contains("inference cudnn") && line.contains("training cudnn"), "{what}: cuDNN not used: {line}");
            }
        }
        _ => {
            assert!(!layers.is_empty(), "{what}: no recurrent layer reported: {report}");
            for line in layers {
                // each mode: the per-step route's time and at least one cuDNN algorithm's
                let timed = !line.contains("NaN") && !line.contains("not measured") && line.matches(" µs").count() >= 4;
                let timed = timed && line.matches("per-step ").count() >= 2 && line.matches("cudnn ").count() >= 2;
                assert!(timed, "{what}: a route not timed: {line}");
            }
        }
    }
}

/// Models touching each kind, both outputs, padded blocks (17 and 40 units), a recurrent layer's
/// input gradient, and a dense layer after one.
fn models() -> Vec<(&'static str, Chain, Loss)> {
    vec![
        (
            "gru sequence → gru last → dense",
            Chain::new(Shape::sequence(6, 3)).gru(17, RnnOutput::Sequence).gru(16, RnnOutput::LastStep).dense(4, Identity),
            Loss::LogitCrossEntropy,
        ),
        (
            "lstm sequence → lstm last → dense",
            Chain::new(Shape::sequence(5, 2)).lstm(16, RnnOutput::Sequence).lstm(40, RnnOutput::LastStep).dense(1, Identity),
            Loss::Mse,
        ),
        ("gru → flatten → dense", Chain::new(Shape::sequence(4, 8)).gru(32, RnnOutput::Sequence).flatten().dense(3, Tanh), Loss::Mse),
    ]
}

/// A batch's inputs, labels, targets and initial states.
struct Batch {
    x: Vec<f32>,
    labels: Vec<u32>,
    targets: Vec<f32>,
    init: Vec<(usize, Vec<f32>)>,
}

/// Random initial states for every recurrent layer of `model`, `batch` samples.
fn states(model: &Model, batch: usize, rng: &mut Rng) -> Vec<(usize, Vec<f32>)> {
    let mut out = Vec::new();
    for (index, step) in model.plan().steps.iter().enumerate() {
        let per_sample = match step.layer {
            Layer::Gru(gru) => gru.hidden,
            Layer::Lstm(lstm) => 2 * lstm.hidden,
            _ => continue,
        };
        out.push((index, rng.uniform(batch * per_sample)));
    }
    out
}

/// Runs `batch` samples in caches of `capacity` samples of `cpu` and of it moved to `device`,
/// each after a full batch of other values (so a batch below the capacity runs behind stale
/// samples and states), and checks that the GPU's outputs, final states, loss and gradients are
/// the CPU's; the GPU cache's report.
fn forward_and_gradients_match(
    cpu: &Model,
    device: &Device,
    loss: Loss,
    (capacity, batch): (usize, usize),
    rng: &mut Rng,
    what: &str,
) -> String {
    let gpu = cpu.to(device).unwrap();
    let outputs = cpu.output_shape().len();
    let batch_of = |n: usize, rng: &mut Rng| {
        let x = rng.uniform(n * cpu.input_shape().len());
        let labels: Vec<u32> = (0..n).map(|_| rng.below(outputs.max(2)) as u32).collect();
        Batch { x, labels, targets: rng.uniform(n * outputs), init: states(cpu, n, rng) }
    };
    let (full, this) = (batch_of(capacity, rng), batch_of(batch, rng));
    let run = |model: &Model| {
        let (mut fwd, mut bwd) = (model.preallocate(capacity).unwrap(), model.preallocate_grads(capacity).unwrap());
        let mut pass = |Batch { x, labels, targets, init }: &Batch| {
            for (layer, values) in init {
                fwd.set_state(*layer, values).unwrap();
            }
            fwd.set_inputs(x).unwrap();
            match loss {
                Loss::LogitCrossEntropy => fwd.set_labels(labels).unwrap(),
                _ => fwd.set_targets(targets).unwrap(),
            }
            let out = model.forward(&mut fwd).unwrap().to_vec();
            let finals: Vec<Vec<f32>> = init.iter().map(|(layer, _)| fwd.final_state(*layer).unwrap()).collect();
            model.backprop(&mut bwd, &mut fwd, loss).unwrap();
            (out, finals, bwd.last_loss().unwrap(), bwd.gradients().unwrap().into_owned())
        };
        pass(&full);
        let result = pass(&this);
        (result, fwd.conv_backends())
    };
    let ((cpu_out, cpu_finals, cpu_loss, cpu_grads), _) = run(cpu);
    let ((gpu_out, gpu_finals, gpu_loss, gpu_grads), report) = run(&gpu);
    assert_close(&gpu_out, &cpu_out, 1e-5, 1e-4, &format!("{what}: outputs"));
    for (g, c) in gpu_finals.iter().zip(&cpu_finals) {
        assert_close(g, c, 1e-5, 1e-4, &format!("{what}: final states"));
    }
    assert!((gpu_loss - cpu_loss).abs() <= 1e-5 * cpu_loss.abs().max(1.0), "{what}: loss {gpu_loss} vs {cpu_loss}");
    let err = rel_err(&gpu_grads, &cpu_grads);
    println!("{what}: gradients rel err {err:.2e}");
    assert!(err <= 1e-4, "{what}: gradients differ by {err:e}");
    report
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn recurrent_forward_and_gradients_on_the_gpu_match_the_cpu() {
    let device = cuda_device();
    let Some(mode) = in_each_route("recurrent_forward_and_gradients_on_the_gpu_match_the_cpu") else { return };
    let mut rng = Rng::new(12);
    for (name, chain, loss) in models() {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 3).with_threads(1).unwrap();
        // 301: the last dense layer in the training head (above 256 samples); both odd
        for batch in [3, 301] {
            let what = format!("{name}, batch {batch} (FLATNN_CUDNN={mode})");
            let report = forward_and_gradients_match(&cpu, &device, loss, (batch + 4, batch), &mut rng, &what);
            check_report(&report, &mode, &what);
        }
    }
}

/// cuDNN's RNN algorithms, as `FLATNN_RNN_ALGO` names them.
const ALGOS: [&str; 2] = ["standard", "persist_static_small_h"];

/// Each of cuDNN's RNN algorithms alone (`FLATNN_CUDNN=1`, `FLATNN_RNN_ALGO` naming it), in a
/// child process each, in layers of the zoo's sizes (a GRU of 64 units, an LSTM of 128): forward
/// outputs, final states and gradients at the capacity and below it, and training steps in a
/// graph, against the CPU. Where cuDNN refuses the algorithm the report must say why (and the
/// per-step route runs the layer); the standard algorithm must run.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn each_cudnn_rnn_algorithm_matches_the_cpu() {
    const TEST: &str = "each_cudnn_rnn_algorithm_matches_the_cpu";
    let device = cuda_device();
    if !in_child() {
        for algo in ALGOS {
            run_alone(TEST, &[("FLATNN_CUDNN", "1"), ("FLATNN_RNN_ALGO", algo)]);
        }
        return;
    }
    let algo = std::env::var("FLATNN_RNN_ALGO").unwrap();
    let mut rng = Rng::new(21);
    for (name, chain, loss) in [
        ("gru 1→64, sequence", Chain::new(Shape::sequence(24, 1)).gru(64, RnnOutput::Sequence).flatten().dense(1, Identity), Loss::Mse),
        (
            "lstm 5→128, last step",
            Chain::new(Shape::sequence(10, 5)).lstm(128, RnnOutput::LastStep).dense(3, Identity),
            Loss::LogitCrossEntropy,
        ),
    ] {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 9).with_threads(1).unwrap();
        for batch in [8, 3] {
            let what = format!("{name}, batch {batch} of 8 ({algo})");
            let report = forward_and_gradients_match(&cpu, &device, loss, (8, batch), &mut rng, &what);
            println!("{what}: {report}");
            if cudnn_version().is_none() {
                assert!(report.contains("recurrent layers: cuDNN not used"), "{what}: {report}");
                continue;
            }
            let line = report.lines().find(|l| l.starts_with(&format!("batch {batch} ")) && (l.contains("GRU") || l.contains("LSTM")));
            let line = line.unwrap_or_else(|| panic!("{what}: no recurrent layer reported at this batch: {report}"));
            let used = line.contains(&format!("inference cudnn {algo} ")) && line.contains(&format!("training cudnn {algo} "));
            // not used: cuDNN refused it, at the descriptors, the sizes or a call
            let refused = line.contains(&format!("{algo}: ")) || line.contains(&format!("cuDNN {algo} failed"));
            assert!(used || (algo != "standard" && refused), "{what}: {algo} neither used nor refused: {line}");
        }
        training_steps_match(&cpu, &device, loss, &format!("{name} ({algo})"));
    }
}

/// The fused route alone, in a child process per kind of its variants (`FLATNN_CUDNN=0`,
/// `FLATNN_RNN_ALGO=fused`: on one block a sample slice; `cluster`: the forward on a cluster of
/// blocks, where the device has clusters): GRU and LSTM layers whose only fitting variants keep
/// no weights in registers (12 and 8 units, padded 16) or keep 32 there (an LSTM of 128, the
/// zoo's), blocks padded past the units (12, 40, 8), clusters whose last block owns fewer units
/// (12 and 40 units on 8 blocks: 2 and 5 a block), sequence and last-step outputs, a recurrent
/// layer's input gradient; forward outputs, final states and gradients at batches of 13 and 5 in
/// caches of 13 (S = 2, 4, 8 do not divide them), and training steps in a graph, against the
/// CPU. The report must name a variant of the kind for both modes of every layer.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_fused_recurrent_route_matches_the_cpu() {
    const TEST: &str = "the_fused_recurrent_route_matches_the_cpu";
    let device = cuda_device();
    if !in_child() {
        run_alone(TEST, &[("FLATNN_CUDNN", "0"), ("FLATNN_RNN_ALGO", "fused")]);
        match device.compute_capability().unwrap() {
            (major, _) if major >= 9 => {
                run_alone(TEST, &[("FLATNN_CUDNN", "0"), ("FLATNN_RNN_ALGO", "cluster")]);
            }
            cc => println!("{TEST}: the cluster forwards not run (sm_{}{}: no clusters)", cc.0, cc.1),
        }
        return;
    }
    let kind = std::env::var("FLATNN_RNN_ALGO").unwrap();
    let mut rng = Rng::new(33);
    for (name, chain, loss) in [
        (
            "gru 2→12 sequence → gru 40 last → dense",
            Chain::new(Shape::sequence(7, 2)).gru(12, RnnOutput::Sequence).gru(40, RnnOutput::LastStep).dense(3, Identity),
            Loss::LogitCrossEntropy,
        ),
        ("lstm 3→128, last step", Chain::new(Shape::sequence(5, 3)).lstm(128, RnnOutput::LastStep).dense(2, Identity), Loss::Mse),
        ("lstm 1→8, sequence", Chain::new(Shape::sequence(9, 1)).lstm(8, RnnOutput::Sequence).flatten().dense(1, Tanh), Loss::Mse),
    ] {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 13).with_threads(1).unwrap();
        for batch in [13, 5] {
            let what = format!("{name}, batch {batch} of 13 ({kind})");
            let report = forward_and_gradients_match(&cpu, &device, loss, (13, batch), &mut rng, &what);
            println!("{what}: {report}");
            let lines: Vec<&str> = report.lines().filter(|l| l.starts_with(&format!("batch {batch} ")) && l.contains(" over ")).collect();
            assert!(!lines.is_empty(), "{what}: no recurrent layer reported at this batch: {report}");
            for line in lines {
                for mode in ["inference", "training"] {
                    // the chosen route, as the report names it first: `fused s1 r32 c8 12.3 µs (…`
                    let chosen = line.split(&format!(" {mode} ")).nth(1).and_then(|rest| rest.split(" (").next()).unwrap_or("");
                    let clustered = chosen.contains(" c4 ") || chosen.contains(" c8 ");
                    let fused = chosen.starts_with("fused s") && clustered == (kind == "cluster");
                    assert!(fused, "{what}: {mode} not by a {kind} variant: {line}");
                }
            }
        }
        training_steps_match(&cpu, &device, loss, &format!("{name} ({kind})"));
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn recurrent_training_steps_in_a_graph_match_the_cpu() {
    let device = cuda_device();
    let Some(mode) = in_each_route("recurrent_training_steps_in_a_graph_match_the_cpu") else { return };
    for (name, chain, loss) in models() {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 5).with_threads(1).unwrap();
        training_steps_match(&cpu, &device, loss, &format!("{name} (FLATNN_CUDNN={mode})"));
    }
}

/// 12 Adam steps of batches of 32 and 19 in caches of 32 samples, of `cpu` and of it moved to
/// `device`: the losses and the parameters after must agree.
fn training_steps_match(cpu: &Model, device: &Device, loss: Loss, what: &str) {
    let mut trained = Vec::new();
    for model in [cpu.to(&Device::Cpu).unwrap(), cpu.to(device).unwrap()] {
        let mut model = model;
        let (mut fwd, mut bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
        let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
        let mut rng = Rng::new(2);
        let mut losses = Vec::new();
        for step in 0..12 {
            let n = if step % 2 == 0 { 32 } else { 19 };
            fwd.set_inputs(&rng.uniform(n * model.input_shape().len())).unwrap();
            let outputs = model.output_shape().len();
            match loss {
                Loss::LogitCrossEntropy => fwd.set_labels(&(0..n).map(|i| (i % outputs) as u32).collect::<Vec<_>>()).unwrap(),
                _ => fwd.set_targets(&rng.uniform(n * outputs)).unwrap(),
            }
            opt.train_step(&mut model, &mut bwd, &mut fwd, loss).unwrap();
            losses.push(bwd.last_loss().unwrap());
        }
        trained.push((losses, model.parameters().unwrap().into_owned()));
    }
    let (losses_err, params_err) = (rel_err(&trained[1].0, &trained[0].0), rel_err(&trained[1].1, &trained[0].1));
    println!("{what}: 12 steps, losses rel err {losses_err:.2e}, parameters rel err {params_err:.2e}");
    assert!(losses_err <= 1e-4 && params_err <= 1e-4, "{what}: losses {:?} vs {:?}", trained[1].0, trained[0].0);
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_stream_on_the_gpu_matches_the_cpu_and_the_gpu_forward() {
    let device = cuda_device();
    if in_each_route("a_stream_on_the_gpu_matches_the_cpu_and_the_gpu_forward").is_none() {
        return;
    }
    let mut rng = Rng::new(4);
    for (name, chain) in [
        ("gru", Chain::new(Shape::sequence(9, 3)).gru(17, RnnOutput::Sequence).gru(8, RnnOutput::LastStep).dense(2, Identity)),
        ("lstm", Chain::new(Shape::sequence(9, 1)).lstm(32, RnnOutput::LastStep).dense(1, Identity)),
    ] {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 7).with_threads(1).unwrap();
        let gpu = cpu.to(&device).unwrap();
        let (batch, steps, features) = (2, 9, cpu.input_shape().len() / 9);
        let x = rng.uniform(batch * steps * features);
        let (mut cpu_stream, mut gpu_stream) = (cpu.stream(batch).unwrap(), gpu.stream(batch).unwrap());
        assert_eq!(gpu_stream.device(), device);
        let mut last = Vec::new();
        for t in 0..steps {
            let step_x: Vec<f32> = (0..batch).flat_map(|s| x[(s * steps + t) * features..][..features].to_vec()).collect();
            let want = cpu_stream.step(&step_x).unwrap().to_vec();
            last = gpu_stream.step(&step_x).unwrap().to_vec();
            assert_close(&last, &want, 1e-5, 1e-4, &format!("{name}: step {t}"));
        }
        let mut fwd = gpu.preallocate(batch).unwrap();
        fwd.set_inputs(&x).unwrap();
        assert_close(&last, gpu.forward(&mut fwd).unwrap(), 1e-5, 1e-4, &format!("{name}: the stream against the forward pass"));
        assert_close(&gpu_stream.state(0).unwrap(), &cpu_stream.state(0).unwrap(), 1e-5, 1e-4, &format!("{name}: states"));
        gpu_stream.reset_state().unwrap();
        assert!(gpu_stream.state(0).unwrap().iter().all(|&v| v == 0.0), "{name}: reset");
    }
}
