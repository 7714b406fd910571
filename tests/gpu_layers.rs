//! Batch norm, layer norm, dropout and residual blocks on a GPU against the CPU: training
//! (dropout draws the CPU's masks, so the two runs follow one trajectory), the running
//! statistics, inference by them, the fusions that read a region's readers (a residual block
//! after an activated layer; a dense layer, and the training head, after a batch norm with an
//! activation), and checkpoints resumed on the GPU. `#[ignore]`d: `cargo test --
//! --include-ignored` runs them where there is a GPU.
#![cfg(feature = "cuda")]

use flatnn::prelude::*;
use flatnn::testutil::{cuda_device, rel_err, Rng};

fn same() -> ConvOptions {
    ConvOptions { stride: (1, 1), padding: (1, 1) }
}

/// A ResNet-like CNN: batch norm with and without an activation over channels and features, a
/// block after an activated layer, dropout, and a dense layer after a batch norm's activation.
fn cnn() -> Chain {
    Chain::new(Input::image(3, 9, 7))
        .conv_with(4, (3, 3), Identity, same())
        .batch_norm_with(Relu)
        .residual_with(Relu, |c| {
            c.conv_with(4, (3, 3), Identity, same()).batch_norm_with(Relu).conv_with(4, (3, 3), Identity, same()).batch_norm()
        })
        .dropout(0.2)
        .flatten()
        .dense(16, Relu)
        .batch_norm_with(Tanh)
        .dense(10, Identity)
}

/// Batch norm over few channels of many values each (3 and 4 channels of 32 × 32 at 64 and 37
/// samples): the GPU sums each channel's statistics and parameter gradients in parts
/// (`cuda::layers::batch_norm_parts`: 16 and 10 parts), in the convolutions' scratch.
fn wide_cnn() -> Chain {
    Chain::new(Input::image(3, 32, 32))
        .conv_with(3, (3, 3), Identity, same())
        .batch_norm_with(Relu)
        .conv_with(4, (3, 3), Identity, same())
        .batch_norm()
        .global_avg_pool()
        .dense(10, Identity)
}

/// Dense layers: a block whose body starts with a dense layer, after an activated dense layer
/// (the body's first layer must not fold its input gradient into that layer's dz: the block
/// input has a second reader), layer norm, dropout, nested and empty blocks.
fn mlp() -> Chain {
    Chain::new(Input::vector(20))
        .dense(32, Relu)
        .residual(|c| c.dense(32, Relu).layer_norm().dropout(0.3).residual(|c| c.dense(32, Gelu)).dense(32, Identity))
        .residual(|c| c)
        .layer_norm()
        .dense(24, Tanh)
        .batch_norm_with(Relu)
        .dense(10, Identity)
}

/// Layer norm over each step of a sequence, dropout, a block over a sequence.
fn sequence() -> Chain {
    Chain::new(Input::sequence(6, 8)).layer_norm().dropout(0.25).residual_with(Tanh, |c| c.layer_norm()).flatten().dense(10, Identity)
}

/// `steps` training steps (train_step, or backprop then update on odd steps), batches cycling
/// through `sizes`; the losses.
fn train(model: &mut Model, opt: &mut Optimizer, sizes: &[usize], steps: usize, seed: u64) -> Vec<f32> {
    let capacity = *sizes.iter().max().unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(capacity).unwrap(), model.preallocate_grads(capacity).unwrap());
    let mut rng = Rng::new(seed);
    let inputs = model.input_shape().len();
    (0..steps)
        .map(|step| {
            let n = sizes[step % sizes.len()];
            fwd.set_inputs(&rng.uniform(n * inputs)).unwrap();
            fwd.set_labels(&(0..n).map(|_| rng.below(10) as u32).collect::<Vec<_>>()).unwrap();
            if step % 2 == 0 {
                opt.train_step(model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
            } else {
                model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                opt.update(model, &bwd).unwrap();
            }
            bwd.last_loss().unwrap()
        })
        .collect()
}

/// The optimiser of the GPU-against-CPU trajectories (see below for why not Adam).
fn optim() -> Optim {
    Optim::sgd(1e-2, 0.9)
}

fn outputs(model: &Model, x: &[f32]) -> Vec<f32> {
    let mut fwd = model.preallocate(x.len() / model.input_shape().len()).unwrap();
    fwd.set_inputs(x).unwrap();
    model.forward(&mut fwd).unwrap().to_vec()
}

/// 16 steps on the GPU (graphs on and off) against the CPU: losses, parameters, running
/// statistics, the pass count; and the GPU's inference by its running statistics against the
/// CPU's on the same parameters. Batches of 32 and 17,
/// and of 300 (where the step ends in the training head, src/cuda/head.rs, whose producer is
/// then a batch norm's activation) and 19; of 64 and 37 where batch norm sums in parts.
///
/// SGD with momentum, not Adam: a convolution's bias before a batch norm has a gradient of
/// zero but for rounding, which Adam (dividing by its own size) turns into steps of the full
/// learning rate whose signs are the rounding's, so any two correct implementations part by
/// about lr per step there (the CPU's AVX2 and portable kernels: parameters 1.6e-3 apart after
/// these 16 steps with Adam, 2.4e-5 with SGD). Adam on the GPU is checked against the CPU in
/// the optimiser's own tests.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn new_layers_train_on_the_gpu_as_on_the_cpu() {
    let device = cuda_device();
    let cases = [
        ("cnn", cnn as fn() -> Chain, [32, 17]),
        ("cnn, batch norm in parts", wide_cnn, [64, 37]),
        ("mlp", mlp, [32, 17]),
        ("mlp head", mlp, [300, 19]),
        ("sequence", sequence, [32, 17]),
    ];
    for (name, chain, sizes) in cases {
        let sizes = &sizes[..];
        let start = chain().build().unwrap().init(Init::HeNormal, 3).with_threads(1).unwrap();
        let mut cpu = start.to(&Device::Cpu).unwrap();
        let mut cpu_opt = Optimizer::new(&cpu, optim()).unwrap();
        let cpu_losses = train(&mut cpu, &mut cpu_opt, sizes, 16, 9);
        let x = Rng::new(5).uniform(7 * start.input_shape().len());
        for graphs in [true, false] {
            let gpu =
                start.to(&Device::Cpu).unwrap().with_gpu_options(GpuOptions { graphs, tf32: false, ..GpuOptions::default() }).unwrap();
            let mut gpu = gpu.to(&device).unwrap();
            let mut opt = Optimizer::new(&gpu, optim()).unwrap();
            let losses = train(&mut gpu, &mut opt, sizes, 16, 9);
            let what = format!("{name}, graphs {graphs}");
            let errs = [
                ("losses", rel_err(&losses, &cpu_losses)),
                ("parameters", rel_err(&gpu.parameters().unwrap(), &cpu.parameters().unwrap())),
                ("buffers", rel_err(&gpu.buffers().unwrap(), &cpu.buffers().unwrap())),
                // inference by the GPU's own parameters and statistics on both devices: the
                // trajectories' rounding (above) grows through the running variances, so
                // comparing with the CPU run's outputs would measure the drift, not the kernels
                ("inference", rel_err(&outputs(&gpu, &x), &outputs(&gpu.to(&Device::Cpu).unwrap(), &x))),
            ];
            println!("{what}: rel errs {errs:?}");
            for (part, err) in errs {
                assert!(err <= 1e-4, "{what}: {part} differ by {err:e}");
            }
            assert_eq!(gpu.train_passes(), 16, "{what}: passes counted");
            assert!(cpu.buffers().unwrap().is_empty() || gpu.buffers().unwrap() != start.buffers().unwrap(), "{what}: statistics moved");
        }
    }
}

/// A run stopped, checkpointed, loaded into a fresh model on the GPU and resumed ends with the
/// bits of one that never stopped: the GPU's pass count comes back from the file, so dropout
/// draws the same masks.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_resumed_gpu_run_draws_the_masks_the_uninterrupted_one_would() {
    let device = cuda_device();
    let dir = std::env::temp_dir().join(format!("flatnn-gpu-layers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let build = |seed| cnn().build().unwrap().init(Init::HeNormal, seed).to(&device).unwrap();
    let (n, m) = (5, 6);
    let mut straight = build(1);
    let mut opt = Optimizer::new(&straight, Optim::adam(1e-3)).unwrap();
    train(&mut straight, &mut opt, &[32], n + m, 4);

    let mut first = build(1);
    let mut first_opt = Optimizer::new(&first, Optim::adam(1e-3)).unwrap();
    train(&mut first, &mut first_opt, &[32], n, 4);
    let path = dir.join("run.safetensors");
    first.save_checkpoint(&first_opt, &path).unwrap();
    let mut resumed = build(2);
    let mut resumed_opt = Optimizer::new(&resumed, Optim::adam(1e-3)).unwrap();
    resumed.load_checkpoint(&mut resumed_opt, &path).unwrap();
    assert_eq!(resumed.train_passes(), n as u64);
    // the batches of steps n.. are those of the straight run: draw the first n again
    let mut fwd = resumed.preallocate(32).unwrap();
    let mut bwd = resumed.preallocate_grads(32).unwrap();
    let mut rng = Rng::new(4);
    let inputs = resumed.input_shape().len();
    for step in 0..n + m {
        let (x, labels) = (rng.uniform(32 * inputs), (0..32).map(|_| rng.below(10) as u32).collect::<Vec<_>>());
        if step < n {
            continue;
        }
        fwd.set_inputs(&x).unwrap();
        fwd.set_labels(&labels).unwrap();
        if step % 2 == 0 {
            resumed_opt.train_step(&mut resumed, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        } else {
            resumed.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
            resumed_opt.update(&mut resumed, &bwd).unwrap();
        }
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&resumed.parameters().unwrap()), bits(&straight.parameters().unwrap()), "parameters");
    assert_eq!(bits(&resumed.buffers().unwrap()), bits(&straight.buffers().unwrap()), "running statistics");
    assert_eq!(resumed.train_passes(), straight.train_passes());
    let _ = std::fs::remove_dir_all(&dir);
}
