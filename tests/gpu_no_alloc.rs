//! A GPU training step, an inference call and a call to a resident server allocate nothing on
//! the host and leave the device's free memory as it was, over 1,000 of each. Its own test binary: no other test
//! allocates device memory while the free memory is read (the test runs itself in a child
//! process per `FLATNN_CUDNN` setting, one at a time). `#[ignore]`d: `cargo test --
//! --include-ignored` runs it where there is a GPU.
#![cfg(feature = "cuda")]

use flatnn::models::{lenet5, mlp};
use flatnn::prelude::*;
use flatnn::testutil::{allocations_in, cuda_device, in_child, pooling_net, run_alone, signal_net, Counting, Rng};

#[global_allocator]
static COUNTING: Counting = Counting;

/// Batch norm (with and without an activation, over channels and features), layer norm,
/// dropout (whose pass count moves on inside the step) and residual blocks.
fn norm() -> Chain {
    let same = ConvOptions { stride: (1, 1), padding: (1, 1) };
    Chain::new(Input::image(1, 12, 12))
        .conv_with(4, (3, 3), Identity, same)
        .batch_norm_with(Relu)
        .residual_with(Relu, |c| c.conv_with(4, (3, 3), Identity, same).batch_norm().dropout(0.1))
        .max_pool((2, 2))
        .flatten()
        .dense(32, Relu)
        .layer_norm()
        .dropout(0.2)
        .batch_norm_with(Relu)
        .dense(10, Identity)
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_gpu_step_allocates_nothing_and_device_memory_stays_put() {
    let device = cuda_device();
    // FLATNN_CUDNN is read once per process: the MLP and LeNet on flatnn's kernels in one child
    // process, LeNet through cuDNN (on flatnn's kernels again where cuDNN is missing) in another
    if !in_child() {
        for cudnn in ["0", "1"] {
            run_alone("a_gpu_step_allocates_nothing_and_device_memory_stays_put", &[("FLATNN_CUDNN", cudnn)]);
        }
        return;
    }
    let cudnn = std::env::var("FLATNN_CUDNN").unwrap_or_default();
    // the pooling, 1-D and softmax layers, with the element-wise losses' kernel, on flatnn's
    // kernels and (the 1-D convolutions as 2-D ones of height 1) through cuDNN
    let xent = Loss::LogitCrossEntropy;
    let cases = match cudnn.as_str() {
        "0" => vec![
            ("mlp", mlp(), xent),
            ("lenet", lenet5(), xent),
            ("norm", norm(), xent),
            ("pooling", pooling_net(), Loss::BceWithLogits),
            ("signal", signal_net(), Loss::SmoothL1 { beta: 0.5 }),
        ],
        _ => vec![("lenet cudnn", lenet5(), xent), ("signal cudnn", signal_net(), Loss::L1)],
    };
    for (name, chain, loss) in cases {
        for graphs in [true, false] {
            let model = chain.clone().build().unwrap().init(Init::HeNormal, 1);
            let mut model =
                model.with_gpu_options(GpuOptions { graphs, tf32: false, ..GpuOptions::default() }).unwrap().to(&device).unwrap();
            // 512 samples: the step ends in the head kernel (above 256, src/cuda/head.rs) and
            // the last two weight gradients run split over the batch (src/cuda/wgrad.rs); 63:
            // in the separate kernels
            let (mut fwd, mut bwd) = (model.preallocate(512).unwrap(), model.preallocate_grads(512).unwrap());
            // clipping by norm (a kernel of its own in the step), L2 decay and a schedule (the
            // rate set in the graph before each replay)
            let mut opt = Optimizer::new(&model, Optim::adam(1e-3).with_weight_decay(1e-4)).unwrap();
            opt.set_clip(Clip::Norm(1.0)).unwrap();
            opt.set_schedule(Schedule::cosine(100, 2000)).unwrap();
            let mut rng = Rng::new(1);
            let x = rng.uniform(512 * model.input_shape().len());
            let labels: Vec<u32> = (0..512).map(|i| i % 10).collect();
            let targets = rng.uniform(512 * 10);
            // a training step (train_step, one graph, on two calls in four; backprop + update on
            // the others, so both batch sizes go both ways), or inference (set_inputs + forward)
            let mut calls = 0usize;
            let mut step = |n: usize, train: bool| {
                fwd.set_inputs(&x[..n * model.input_shape().len()]).unwrap();
                calls += 1;
                if train {
                    if loss.takes_labels() {
                        fwd.set_labels(&labels[..n]).unwrap();
                    } else {
                        fwd.set_targets(&targets[..n * 10]).unwrap();
                    }
                    if calls % 4 < 2 {
                        opt.train_step(&mut model, &mut bwd, &mut fwd, loss).unwrap();
                    } else {
                        model.backprop(&mut bwd, &mut fwd, loss).unwrap();
                        opt.update(&mut model, &bwd).unwrap();
                    }
                } else {
                    assert!(model.forward(&mut fwd).unwrap()[0].is_finite());
                }
            };
            // warm-up: every batch size and call, so every graph is captured
            for (n, train) in [(512, true), (63, true), (512, true), (63, true), (64, false), (1, false)] {
                step(n, train);
            }
            let free_before = device.memory().unwrap().0;
            let allocations = allocations_in(|| {
                for i in 0..1000 {
                    step(if i % 2 == 0 { 512 } else { 63 }, true);
                }
            });
            let inference_allocations = allocations_in(|| {
                for i in 0..1000 {
                    step(if i % 2 == 0 { 64 } else { 1 }, false);
                }
            });
            let loss = bwd.last_loss().unwrap();
            let free_after = device.memory().unwrap().0;
            let report = fwd.conv_backends();
            if cudnn == "1" && flatnn::cuda::cudnn_version().is_some() {
                assert!(report.contains("weight grad cudnn"), "{name}: cuDNN not used: {report}");
            }
            println!("{name} graphs={graphs}: {report}");
            println!(
                "{name} graphs={graphs}: 1000 steps, {allocations} host allocations+frees; 1000 forward calls, \
                 {inference_allocations}; free device memory {free_before} -> {free_after}, loss {loss}"
            );
            assert_eq!(allocations, 0, "{name} graphs={graphs}: host allocations in 1000 steps");
            assert_eq!(inference_allocations, 0, "{name} graphs={graphs}: host allocations in 1000 forward calls");
            assert_eq!(free_before, free_after, "{name} graphs={graphs}: device memory changed");
            assert!(loss.is_finite());
        }
    }
    if cudnn == "0" {
        a_server_call_allocates_nothing(&device);
    }
    // on the per-step route with "0", through cuDNN's RNN kernels (where cuDNN loads) with "1"
    recurrent_steps_allocate_nothing(&device, cudnn == "1" && flatnn::cuda::cudnn_version().is_some());
}

/// 1,000 training steps (one graph each, two batch sizes) of an LSTM and a GRU over sequences,
/// and 1,000 calls of a stream of the model, batch 1 and 2 in turn; through cuDNN where `cudnn`.
fn recurrent_steps_allocate_nothing(device: &Device, cudnn: bool) {
    let chain = Chain::new(Shape::sequence(12, 3)).lstm(20, RnnOutput::Sequence).gru(16, RnnOutput::LastStep).dense(10, Identity);
    let mut model = chain.build().unwrap().init(Init::GlorotUniform, 1).to(device).unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(300).unwrap(), model.preallocate_grads(300).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let x = Rng::new(2).uniform(300 * 36);
    let labels: Vec<u32> = (0..300).map(|i| i % 10).collect();
    // 300: the last layer in the training head (above 256 samples); 31: the separate kernels
    let mut step = |i: usize| {
        let n = if i.is_multiple_of(2) { 300 } else { 31 };
        fwd.set_inputs(&x[..n * 36]).unwrap();
        fwd.set_labels(&labels[..n]).unwrap();
        opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
    };
    for i in 0..4 {
        step(i);
    }
    let free_before = device.memory().unwrap().0;
    let allocations = allocations_in(|| (0..1000).for_each(&mut step));
    assert!(bwd.last_loss().unwrap().is_finite());
    let free_after = device.memory().unwrap().0;
    let report = fwd.conv_backends();
    println!("lstm + gru: {report}");
    if cudnn {
        assert!(report.lines().all(|l| !l.contains("step ") || l.contains("training cudnn")), "cuDNN not used: {report}");
    }
    let mut stream = model.stream(2).unwrap();
    let mut call = |i: usize| assert!(stream.step(&x[..(1 + i % 2) * 3]).unwrap()[0].is_finite());
    (0..4).for_each(&mut call);
    let stream_allocations = allocations_in(|| (0..1000).for_each(&mut call));
    println!("lstm + gru: 1000 steps, {allocations} host allocations+frees; 1000 stream calls, {stream_allocations}; free device memory {free_before} -> {free_after}");
    assert_eq!((allocations, stream_allocations), (0, 0), "host allocations in recurrent steps or stream calls");
    assert_eq!(free_before, free_after, "device memory changed over recurrent steps");
}

/// 1,000 calls to a resident server, new inputs and the same again, batch 128 and 1, with a
/// pause in the middle after which the kernel is launched again.
fn a_server_call_allocates_nothing(device: &Device) {
    let model = flatnn::models::simplenns_mlp().build().unwrap().init(Init::HeNormal, 1).to(device).unwrap();
    let mut server = model.serve(128).unwrap();
    assert!(server.is_resident());
    let x = Rng::new(2).uniform(128 * 100);
    let mut call = |i: usize| {
        if i % 3 != 2 {
            server.set_inputs(&x[..if i.is_multiple_of(2) { 128 * 100 } else { 100 }]).unwrap();
        }
        assert!(server.forward().unwrap()[0].is_finite());
    };
    for i in 0..10 {
        call(i);
    }
    let free_before = device.memory().unwrap().0;
    let allocations = allocations_in(|| {
        for i in 0..1000 {
            if i == 500 {
                // the kernel leaves after 1 ms without a call; the next call launches it again
                std::thread::sleep(std::time::Duration::from_millis(3));
            }
            call(i);
        }
    });
    let free_after = device.memory().unwrap().0;
    println!("server: 1000 calls, {allocations} host allocations+frees; free device memory {free_before} -> {free_after}");
    assert_eq!(allocations, 0, "host allocations in 1000 server calls");
    assert_eq!(free_before, free_after, "device memory changed over 1000 server calls");
}
