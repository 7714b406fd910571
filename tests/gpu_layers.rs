//! Batch norm, layer norm, dropout and residual blocks on a GPU against the CPU: training
//! (dropout draws the CPU's masks, so the two runs follow one trajectory), the running
//! statistics, inference by them, the fusions that read a region's readers (a residual block
//! after an activated layer; a dense layer, and the training head, after a batch norm with an
//! activation; in inference, a convolution's batch norm and residual sum in its epilogue), and
//! checkpoints resumed on the GPU. `#[ignore]`d: `cargo test -- --include-ignored` runs them
//! where there is a GPU.
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

/// Batch norm over 7 × 7 planes (pixels % 4 ≠ 0: read one value at a time) of 2 channels: at
/// 500 samples each channel's sums go in 6 parts of 84 (`cuda::layers::batch_norm_parts`), at
/// one sample in one block a channel.
fn narrow_cnn() -> Chain {
    Chain::new(Input::image(3, 7, 7))
        .conv_with(2, (3, 3), Identity, same())
        .batch_norm_with(Relu)
        .residual(|c| c.conv_with(2, (3, 3), Identity, same()).batch_norm())
        .flatten()
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
        ("cnn, 7 x 7 batch norm in 6 parts and of one sample", narrow_cnn, [500, 1]),
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

/// Two GPU runs of the same training from the same start give the same bits (losses,
/// parameters, running statistics), graphs on and off: batch norm's sums in parts and their
/// joins, in fours and one value at a time, at batches below the capacity.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn batch_norm_training_on_the_gpu_repeats_its_bits() {
    let device = cuda_device();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (name, chain, sizes) in [("wide", wide_cnn as fn() -> Chain, [64, 37, 5]), ("narrow", narrow_cnn, [500, 1, 333])] {
        for graphs in [true, false] {
            let run = || {
                let start = chain().build().unwrap().init(Init::HeNormal, 7);
                let mut gpu = start.with_gpu_options(GpuOptions { graphs, ..GpuOptions::default() }).unwrap().to(&device).unwrap();
                let mut opt = Optimizer::new(&gpu, optim()).unwrap();
                let losses = train(&mut gpu, &mut opt, &sizes, 6, 13);
                (bits(&losses), bits(&gpu.parameters().unwrap()), bits(&gpu.buffers().unwrap()))
            };
            let (a, b) = (run(), run());
            assert_eq!(a.0, b.0, "{name}, graphs {graphs}: losses");
            assert_eq!(a.1, b.1, "{name}, graphs {graphs}: parameters");
            assert_eq!(a.2, b.2, "{name}, graphs {graphs}: running statistics");
        }
    }
}

/// Inputs that poison every activation they reach (NaN inputs are refused): products overflow
/// to infinities and NaN, so what a later pass leaves unwritten cannot pass for a right value.
const POISON: f32 = f32::MAX;

/// What a chain's convolutions take in on an inference pass: (the convolution's step, its batch
/// norm's, its residual sum's) for each that takes a step in.
type Taken = Vec<(usize, Option<usize>, Option<usize>)>;

/// Chains whose convolutions take steps in on an inference pass, with what each takes in (the
/// convolution's step, its batch norm's, its residual sum's): batch norms with and without an
/// activation after 2-D and 1-D convolutions (a dilated one among them, which the CPU runs one
/// step at a time), residual sums with ReLU, tanh and no activation after a batch norm or right
/// after the convolution, planes of odd and of multiple-of-4 lengths; a convolution with its own
/// activation, and one whose output a residual block also reads, which take nothing in;
/// resnet_small. Each ends in 10 outputs, for `train`'s labels.
fn fusing_chains() -> Vec<(&'static str, Chain, Taken)> {
    let padded = Conv1dOptions { stride: 1, padding: 1, dilation: 1 };
    let dilated = Conv1dOptions { stride: 1, padding: 2, dilation: 2 };
    let images = Chain::new(Input::image(3, 7, 9))
        .conv_with(5, (3, 3), Identity, same())
        .batch_norm_with(Relu)
        .residual_with(Relu, |c| {
            c.conv_with(5, (3, 3), Identity, same()).batch_norm_with(Tanh).conv_with(5, (3, 3), Identity, same()).batch_norm()
        })
        .residual_with(Tanh, |c| c.conv_with(5, (3, 3), Identity, same()))
        .conv_with(4, (2, 2), Relu, ConvOptions::default())
        .batch_norm()
        .global_avg_pool()
        .dense(10, Identity);
    let signals = Chain::new(Input::signal(2, 40))
        .conv1d(6, 5, Identity)
        .batch_norm_with(Relu)
        .residual(|c| c.conv1d_with(6, 3, Identity, padded).batch_norm())
        .flatten()
        .dense(10, Identity);
    let odd_signals = Chain::new(Input::signal(3, 23))
        .conv1d_with(4, 3, Identity, dilated)
        .batch_norm_with(Tanh)
        .residual_with(Relu, |c| c.conv1d_with(4, 3, Identity, padded))
        .flatten()
        .dense(10, Identity);
    let shared =
        Chain::new(Input::image(2, 6, 6)).conv_with(3, (3, 3), Identity, same()).residual(|c| c.batch_norm()).flatten().dense(10, Identity);
    vec![
        ("images", images, vec![(0, Some(1), None), (3, Some(4), None), (5, Some(6), Some(7)), (9, None, Some(10))]),
        ("signals", signals, vec![(0, Some(1), None), (3, Some(4), Some(5))]),
        ("odd signals", odd_signals, vec![(0, Some(1), None), (3, None, Some(4))]),
        ("shared", shared, vec![]),
        (
            "resnet_small",
            flatnn::models::resnet_small(),
            vec![
                (0, Some(1), None),
                (3, Some(4), None),
                (5, Some(6), Some(7)),
                (9, Some(10), None),
                (11, Some(12), Some(13)),
                (15, Some(16), None),
                (17, Some(18), Some(19)),
            ],
        ),
    ]
}

/// How the routes report names what a convolution takes in.
fn described(norm: Option<usize>, add: Option<usize>) -> String {
    let norm = norm.map(|i| format!("the batch norm of step {i}"));
    let add = add.map(|i| format!("the residual sum of step {i}"));
    [norm, add].into_iter().flatten().collect::<Vec<_>>().join(" and ")
}

/// Inference on the GPU, where convolutions take the steps after them in (one kernel after the
/// product), against the CPU's on the same parameters and running statistics (moved from their
/// start by three training steps): within 1e-5 at batches 1, 5 and 16 of a capacity of 16,
/// graphs on and off, each pass after one on poison inputs. The GPU's routes report names what
/// each convolution takes in, and nothing for the others.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn inference_with_steps_in_a_convolutions_epilogue_matches_the_cpu() {
    let device = cuda_device();
    for (name, chain, taken) in fusing_chains() {
        let mut cpu = chain.build().unwrap().init(Init::HeNormal, 3).with_threads(1).unwrap();
        let start = cpu.buffers().unwrap().into_owned();
        let mut opt = Optimizer::new(&cpu, Optim::sgd(0.01, 0.9)).unwrap();
        train(&mut cpu, &mut opt, &[8], 3, 11);
        assert_ne!(cpu.buffers().unwrap().into_owned(), start, "{name}: running statistics moved");
        let inputs = cpu.input_shape().len();
        for graphs in [true, false] {
            let gpu = cpu.to(&Device::Cpu).unwrap().with_gpu_options(GpuOptions { graphs, tf32: false, ..GpuOptions::default() }).unwrap();
            let gpu = gpu.to(&device).unwrap();
            let (mut fwd, mut want) = (gpu.preallocate(16).unwrap(), cpu.preallocate(16).unwrap());
            let mut rng = Rng::new(21);
            for n in [1, 5, 16] {
                let what = format!("{name}, graphs {graphs}, batch {n}");
                fwd.set_inputs(&vec![POISON; n * inputs]).unwrap();
                gpu.forward(&mut fwd).unwrap();
                let x = rng.uniform(n * inputs);
                fwd.set_inputs(&x).unwrap();
                want.set_inputs(&x).unwrap();
                let got = gpu.forward(&mut fwd).unwrap().to_vec();
                let err = rel_err(&got, cpu.forward(&mut want).unwrap());
                println!("{what}: rel err {err:.2e}");
                assert!(err <= 1e-5, "{what}: outputs differ by {err:e}");
            }
            let report = fwd.routes();
            let lines: Vec<&str> = report.lines().filter(|l| l.ends_with(" in its epilogue")).collect();
            assert_eq!(lines.len(), taken.len(), "{name}: {report}");
            for &(step, norm, add) in &taken {
                let line = lines.iter().find(|l| l.starts_with(&format!("step {step} "))).unwrap_or_else(|| panic!("{name}: {report}"));
                assert!(line.ends_with(&format!(": inference: {} in its epilogue", described(norm, add))), "{name}: {line}");
            }
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
