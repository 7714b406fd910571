//! The model on a GPU against the same model on the CPU: training steps (graphs on and off,
//! `train_step` against `backprop` then `update`, updates queued back to back, what `train_step`
//! checks before it queues), forward passes in FP32 and TF32, dense plans and the training head
//! at large batches, outputs through both return paths, and servers. Devices, moves between
//! them, device errors and threads: tests/gpu_devices.rs; no allocation per step:
//! tests/gpu_no_alloc.rs. The GPU tests are `#[ignore]`d: the runner counts them as ignored,
//! and `cargo test -- --include-ignored` runs them where there is a GPU.
#![cfg(feature = "cuda")]

use flatnn::models::{lenet5, mlp};
use flatnn::prelude::*;
use flatnn::testutil::{batch, cuda_device, rel_err, train_alternating, Rng};

/// An odd little net touching every layer kind, activation and option the GPU runs.
fn mixed() -> Chain {
    Chain::new(Input::image(2, 9, 7))
        .conv_with(3, (3, 2), Tanh, ConvOptions { stride: (2, 1), padding: (1, 1) })
        .max_pool_with((2, 2), (1, 2))
        .conv(4, (2, 2), Gelu)
        .flatten()
        .dense(11, Sigmoid)
        .dense(5, LeakyRelu(0.1))
        .dense(3, Identity)
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn training_on_the_gpu_matches_the_cpu() {
    let device = cuda_device();
    let cases = [
        ("mlp", mlp(), Optim::Sgd { lr: 0.05, momentum: 0.9, nesterov: true, weight_decay: 0.0 }, Loss::LogitCrossEntropy),
        ("mlp adam", mlp(), Optim::adam(1e-3), Loss::LogitCrossEntropy),
        ("lenet", lenet5(), Optim::sgd(0.05, 0.9), Loss::LogitCrossEntropy),
        ("lenet adam", lenet5(), Optim::adam(1e-3), Loss::LogitCrossEntropy),
        ("mixed mse", mixed(), Optim::rmsprop(1e-3), Loss::Mse),
        ("mixed adamw", mixed(), Optim::adamw(1e-3, 0.1), Loss::LogitCrossEntropy),
    ];
    for (name, chain, optim, loss) in cases {
        let cpu_model = chain.build().unwrap().init(Init::HeNormal, 3).with_threads(1).unwrap();
        let (cpu_losses, cpu_trained) = train_alternating(cpu_model.to(&Device::Cpu).unwrap(), optim, loss, 20, 9);
        for graphs in [true, false] {
            let gpu_model =
                cpu_model.to(&Device::Cpu).unwrap().with_gpu_options(GpuOptions { graphs, tf32: false, ..GpuOptions::default() }).unwrap();
            let gpu_model = gpu_model.to(&device).unwrap();
            assert_eq!(gpu_model.device(), device);
            let (gpu_losses, gpu_trained) = train_alternating(gpu_model, optim, loss, 20, 9);
            let params_err = rel_err(&gpu_trained.parameters().unwrap(), &cpu_trained.parameters().unwrap());
            let loss_err = rel_err(&gpu_losses, &cpu_losses);
            println!("{name} graphs={graphs}: 20 steps, parameters rel err {params_err:.2e}, losses rel err {loss_err:.2e}");
            assert!(loss_err <= 1e-4, "{name}: losses {gpu_losses:?} vs {cpu_losses:?}");
            assert!(params_err <= 1e-4, "{name}: parameters differ by {params_err:e}");
        }
    }
}

/// `Optimizer::train_step` (on a GPU with graphs: backprop and the update in one graph, the
/// update's arguments set before each replay) gives the same bits as `backprop` then `update`:
/// 24 steps queued back to back (the host never waits), two batch sizes (two graphs), the
/// learning rate changed before every step; each optimiser; graphs on and off. A replay that
/// kept the arguments it was captured with, or took a later step's, would differ; so would a
/// first `train_step` that left a trace of the steps it timed to check its routes, and so would
/// two caches that took other routes (their reports are compared too).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn train_step_matches_backprop_then_update() {
    let device = cuda_device();
    let optimisers = [Optim::adam(1e-3), Optim::adamw(1e-3, 0.1), Optim::sgd(0.05, 0.9), Optim::sgd(0.05, 0.0), Optim::rmsprop(1e-3)];
    for (optim, graphs) in optimisers.into_iter().flat_map(|o| [(o, true), (o, false)]) {
        let options = GpuOptions { graphs, tf32: false, ..GpuOptions::default() };
        let on_gpu = || mlp().build().unwrap().init(Init::HeNormal, 4).with_gpu_options(options).unwrap().to(&device).unwrap();
        let (mut split, mut joint) = (on_gpu(), on_gpu());
        let (mut split_fwd, mut split_bwd) = (split.preallocate(512).unwrap(), split.preallocate_grads(512).unwrap());
        let (mut joint_fwd, mut joint_bwd) = (joint.preallocate(512).unwrap(), joint.preallocate_grads(512).unwrap());
        let (mut split_opt, mut joint_opt) = (Optimizer::new(&split, optim).unwrap(), Optimizer::new(&joint, optim).unwrap());
        let mut rng = Rng::new(9);
        for step in 0..24 {
            let n = if step % 3 == 2 { 63 } else { 512 };
            let (x, labels) = batch(&mut rng, &split, n);
            let lr = optim.lr() * (1 + step % 4) as f32;
            for (fwd, opt) in [(&mut split_fwd, &mut split_opt), (&mut joint_fwd, &mut joint_opt)] {
                fwd.set_inputs(&x).unwrap();
                fwd.set_labels(&labels).unwrap();
                opt.set_lr(lr).unwrap();
            }
            let split_step = |split: &mut Model, split_opt: &mut Optimizer, split_bwd: &mut Grads, split_fwd: &mut Cache| {
                split.backprop(split_bwd, split_fwd, Loss::LogitCrossEntropy).unwrap();
                split_opt.update(split, split_bwd).unwrap();
            };
            // the first step of each batch size (0 and 2) joint first: where it checks the
            // routes in whole steps, it times them with the update and puts the state back
            let joint_first = matches!(step, 0 | 2);
            if !joint_first {
                split_step(&mut split, &mut split_opt, &mut split_bwd, &mut split_fwd);
            }
            joint_opt.train_step(&mut joint, &mut joint_bwd, &mut joint_fwd, Loss::LogitCrossEntropy).unwrap();
            if joint_first {
                split_step(&mut split, &mut split_opt, &mut split_bwd, &mut split_fwd);
            }
        }
        let what = format!("{optim:?}, graphs {graphs}");
        assert_eq!(joint_opt.steps(), 24, "{what}");
        // a route is timed once per process and every cache of the model takes the same ones:
        // each layer's line of the report (route, times) is the same in both
        let layers = |cache: &Cache| cache.routes().lines().filter(|l| l.contains(", step ")).map(String::from).collect::<Vec<_>>();
        assert_eq!(layers(&split_fwd), layers(&joint_fwd), "{what}: the two caches' routes");
        let (want, got) = (split.parameters().unwrap(), joint.parameters().unwrap());
        let differ = want.iter().zip(got.iter()).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        if differ != 0 {
            // which routes each took: the same routes with other bits would be a race
            println!("{what}, backprop then update:\n{}\n{what}, train_step:\n{}", split_fwd.routes(), joint_fwd.routes());
        }
        assert_eq!(differ, 0, "{what}: {differ} parameters differ (first at {:?})", want.iter().zip(got.iter()).position(|(a, b)| a != b));
        assert!(
            split.parameters().unwrap() != mlp().build().unwrap().init(Init::HeNormal, 4).parameters().unwrap().as_ref(),
            "{what}: trained"
        );
        let (want, got) = (split_opt.state().unwrap(), joint_opt.state().unwrap());
        assert!(want.iter().zip(got.iter()).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: optimiser state differs");
        assert_eq!(split_bwd.last_loss().unwrap().to_bits(), joint_bwd.last_loss().unwrap().to_bits(), "{what}: last loss");
    }
}

/// A model's first `train_step` checks its dense routes in whole steps, update included
/// (Adam, clipping by norm), and puts back all that the timed steps moved: a second model of
/// the same plan and initialisation, whose first step reuses the check, follows the same bits
/// for 12 steps (parameters, optimiser state, running statistics, last loss, gradient norm),
/// with batch norm and dropout in the chain and two batch sizes (a check each, the first
/// model's). The plan is this test's alone: a check of the same plan made elsewhere in the
/// process would be reused, and nothing timed here.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_first_train_step_leaves_no_trace_of_its_check() {
    let device = cuda_device();
    let chain = || Chain::new(Input::vector(27)).dense(64, Relu).batch_norm_with(Tanh).dropout(0.2).dense(40, Gelu).dense(9, Identity);
    let init = chain().build().unwrap().init(Init::HeNormal, 12);
    let capacity = 256;
    let new = || {
        let model = init.to(&device).unwrap();
        let (fwd, bwd) = (model.preallocate(capacity).unwrap(), model.preallocate_grads(capacity).unwrap());
        let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
        opt.set_clip(Clip::Norm(0.5)).unwrap();
        (model, fwd, bwd, opt)
    };
    let (mut a, mut a_fwd, mut a_bwd, mut a_opt) = new();
    let (mut b, mut b_fwd, mut b_bwd, mut b_opt) = new();
    let mut rng = Rng::new(21);
    for step in 0..12 {
        let n = if step % 2 == 0 { capacity } else { 45 };
        let (x, labels) = batch(&mut rng, &a, n);
        for (model, fwd, bwd, opt) in [(&mut a, &mut a_fwd, &mut a_bwd, &mut a_opt), (&mut b, &mut b_fwd, &mut b_bwd, &mut b_opt)] {
            fwd.set_inputs(&x).unwrap();
            fwd.set_labels(&labels).unwrap();
            opt.train_step(model, bwd, fwd, Loss::LogitCrossEntropy).unwrap();
        }
        if step == 0 {
            let (checked, reused) = (a_fwd.routes(), b_fwd.routes());
            assert!(checked.contains("; whole steps "), "the first model timed its whole steps:\n{checked}");
            assert!(!reused.contains("µs on the routes fastest alone"), "the second model reused the check:\n{reused}");
        }
    }
    let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    assert!(a.parameters().unwrap().as_ref() != init.parameters().unwrap().as_ref(), "trained");
    assert_eq!(bits(&a.parameters().unwrap()), bits(&b.parameters().unwrap()), "parameters");
    assert_eq!(bits(&a_opt.state().unwrap()), bits(&b_opt.state().unwrap()), "optimiser state");
    assert_eq!(bits(&a.buffers().unwrap()), bits(&b.buffers().unwrap()), "running statistics");
    assert_eq!(a_bwd.last_loss().unwrap().to_bits(), b_bwd.last_loss().unwrap().to_bits(), "last loss");
    let norm = a_opt.grad_norm().unwrap();
    assert!(norm.is_finite(), "the norm of a step that clipped by it");
    assert_eq!(norm.to_bits(), b_opt.grad_norm().unwrap().to_bits(), "gradient norm");
}

/// Updates queued back to back (the host never waits) give the same bits as the same updates
/// with the host waiting after each: each optimiser reads the parameters and its state only
/// once the update ahead of it has written them (inside `train_step` it reads them early, where
/// only gradients are written ahead of it: kernels/optim.cu).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn updates_queued_back_to_back_match_updates_one_at_a_time() {
    let device = cuda_device();
    let optimisers = [Optim::adam(1e-3), Optim::adamw(1e-3, 0.1), Optim::sgd(0.05, 0.9), Optim::sgd(0.05, 0.0), Optim::rmsprop(1e-3)];
    for optim in optimisers {
        let on_gpu = || mlp().build().unwrap().init(Init::HeNormal, 6).to(&device).unwrap();
        let (mut queued, mut waited) = (on_gpu(), on_gpu());
        let (mut queued_opt, mut waited_opt) = (Optimizer::new(&queued, optim).unwrap(), Optimizer::new(&waited, optim).unwrap());
        let (x, labels) = batch(&mut Rng::new(11), &queued, 64);
        for (model, opt, wait) in [(&mut queued, &mut queued_opt, false), (&mut waited, &mut waited_opt, true)] {
            let (mut fwd, mut bwd) = (model.preallocate(64).unwrap(), model.preallocate_grads(64).unwrap());
            fwd.set_inputs(&x).unwrap();
            fwd.set_labels(&labels).unwrap();
            model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
            for _ in 0..6 {
                opt.update(model, &bwd).unwrap();
                if wait {
                    model.parameters().unwrap();
                }
            }
        }
        let (want, got) = (waited.parameters().unwrap(), queued.parameters().unwrap());
        assert!(want != mlp().build().unwrap().init(Init::HeNormal, 6).parameters().unwrap().as_ref(), "{optim:?}: trained");
        let differ = want.iter().zip(got.iter()).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{optim:?}: {differ} parameters differ");
        let (want, got) = (waited_opt.state().unwrap(), queued_opt.state().unwrap());
        assert!(want.iter().zip(got.iter()).all(|(a, b)| a.to_bits() == b.to_bits()), "{optim:?}: optimiser state differs");
        assert_eq!(queued_opt.steps(), 6, "{optim:?}");
    }
}

/// `train_step` on a GPU checks what backprop and update check before it queues anything:
/// missing labels, another model's cache and another model's optimiser are errors that leave
/// the parameters and the optimiser's step count as they were; then a step goes through.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn train_step_checks_before_it_queues() {
    let device = cuda_device();
    let build = || mlp().build().unwrap().init(Init::HeNormal, 5).to(&device).unwrap();
    let (mut model, other) = (build(), build());
    let (mut fwd, mut bwd) = (model.preallocate(64).unwrap(), model.preallocate_grads(64).unwrap());
    let mut other_fwd = other.preallocate(64).unwrap();
    let (x, labels) = batch(&mut Rng::new(3), &model, 64);
    fwd.set_inputs(&x).unwrap();
    other_fwd.set_inputs(&x).unwrap();
    other_fwd.set_labels(&labels).unwrap();
    let (mut opt, mut other_opt) = (Optimizer::new(&model, Optim::adam(1e-3)).unwrap(), Optimizer::new(&other, Optim::adam(1e-3)).unwrap());
    let before = model.parameters().unwrap().to_vec();
    let xent = Loss::LogitCrossEntropy;
    assert!(matches!(opt.train_step(&mut model, &mut bwd, &mut fwd, xent), Err(Error::Shape(_))), "no labels");
    fwd.set_labels(&labels).unwrap();
    assert!(matches!(opt.train_step(&mut model, &mut bwd, &mut other_fwd, xent), Err(Error::Mismatch(_))), "another model's cache");
    assert!(matches!(other_opt.train_step(&mut model, &mut bwd, &mut fwd, xent), Err(Error::Mismatch(_))), "another model's optimiser");
    assert_eq!((opt.steps(), other_opt.steps()), (0, 0));
    assert!(model.parameters().unwrap().iter().zip(&before).all(|(a, b)| a.to_bits() == b.to_bits()), "a refused step ran");
    opt.train_step(&mut model, &mut bwd, &mut fwd, xent).unwrap();
    assert_eq!(opt.steps(), 1);
    assert!(model.parameters().unwrap().as_ref() != &before[..], "the step did not update");
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn forward_matches_the_cpu_in_fp32_and_within_bound_in_tf32() {
    let device = cuda_device();
    let mut rng = Rng::new(4);
    for (name, chain) in [("mlp", mlp()), ("lenet", lenet5()), ("mixed", mixed())] {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 5).with_threads(1).unwrap();
        let mut cpu_fwd = cpu.preallocate(200).unwrap();
        for tf32 in [false, true] {
            let gpu = cpu
                .to(&Device::Cpu)
                .unwrap()
                .with_gpu_options(GpuOptions { graphs: true, tf32, ..GpuOptions::default() })
                .unwrap()
                .to(&device)
                .unwrap();
            let mut gpu_fwd = gpu.preallocate(200).unwrap();
            // dense layers run on flatnn's kernels up to batch 128 (and up to 256 where k ≤ 256)
            // and on cuBLAS (where TF32 applies) above; convolutions on cuDNN or cuBLAS
            for n in [1, 5, 64, 128, 200, 5] {
                let (x, _) = batch(&mut rng, &cpu, n);
                cpu_fwd.set_inputs(&x).unwrap();
                gpu_fwd.set_inputs(&x).unwrap();
                let want = cpu.forward(&mut cpu_fwd).unwrap().to_vec();
                let got = gpu.forward(&mut gpu_fwd).unwrap().to_vec();
                assert_eq!(gpu_fwd.outputs(), &got[..]);
                let err = rel_err(&got, &want);
                let bound = if tf32 { 5e-3 } else { 1e-5 };
                println!("{name} tf32={tf32} batch {n}: forward rel err {err:.2e} (bound {bound:e})");
                assert!(err <= bound, "{name} tf32={tf32} batch {n}: {err:e}");
            }
        }
    }
}

/// The loss's labels (cross-entropy) or targets (MSE) into both caches, then a backprop of each
/// model on its cache.
fn backprop_both(
    models: (&Model, &Model),
    fwd: (&mut Cache, &mut Cache),
    bwd: (&mut Grads, &mut Grads),
    loss: Loss,
    labels: &[u32],
    targets: &[f32],
) {
    for (model, fwd, bwd) in [(models.0, fwd.0, bwd.0), (models.1, fwd.1, bwd.1)] {
        if loss.takes_labels() {
            fwd.set_labels(labels).unwrap()
        } else {
            fwd.set_targets(targets).unwrap()
        }
        model.backprop(bwd, fwd, loss).unwrap();
    }
}

/// Dense plans of odd widths, every activation, one layer or several, at batches that run on
/// the fused kernels (≤ 128, and above where k ≤ 256 and the kernel's blocks fit on the GPU at
/// once: at 512 and 1024 some of these products do, some do not), on the tensor-core tiles (the
/// MLP's first layer; at 2048 its weight gradient on a 32 × 32 tile) and on cuBLAS: forward against
/// the CPU, then a backprop on the same batch without new inputs, which checks that the forward
/// left the inputs on the device.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn dense_plans_match_the_cpu() {
    let device = cuda_device();
    let chains = [
        ("100-200-1", Chain::new(Input::vector(100)).dense(200, Relu).dense(1, Identity)),
        ("1000-13", Chain::new(Input::vector(1000)).dense(13, Gelu)),
        ("20-7", Chain::new(Input::vector(20)).dense(7, Sigmoid)),
        ("37-256-9-250-3", Chain::new(Input::vector(37)).dense(256, Tanh).dense(9, Sigmoid).dense(250, LeakyRelu(0.2)).dense(3, Identity)),
        ("mlp", mlp()),
        ("5-300-4", Chain::new(Input::vector(5)).dense(300, Relu).dense(4, Identity)),
    ];
    let (mut rng, mut target_rng) = (Rng::new(8), Rng::new(9));
    for (name, chain) in chains {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 2).with_threads(1).unwrap();
        let gpu = cpu.to(&device).unwrap();
        let (mut cpu_fwd, mut gpu_fwd) = (cpu.preallocate(2048).unwrap(), gpu.preallocate(2048).unwrap());
        let (mut cpu_bwd, mut gpu_bwd) = (cpu.preallocate_grads(2048).unwrap(), gpu.preallocate_grads(2048).unwrap());
        // 2048 last, so the batches before it draw what they drew before it was added
        for n in [1, 7, 8, 9, 64, 128, 200, 256, 512, 1024, 3, 2048] {
            let (x, labels) = batch(&mut rng, &cpu, n);
            cpu_fwd.set_inputs(&x).unwrap();
            gpu_fwd.set_inputs(&x).unwrap();
            let want = cpu.forward(&mut cpu_fwd).unwrap().to_vec();
            let got = gpu.forward(&mut gpu_fwd).unwrap().to_vec();
            let err = rel_err(&got, &want);
            // one output: softmax cross-entropy would give zero gradients, so MSE (targets from
            // their own generator, so the other plans keep their inputs: with ReLU, a
            // pre-activation within ~1e-7 of 0 may fall on the other side on the GPU, which sums
            // in another order, and change its unit's gradients by ~1e-3; a draw that put the
            // MLP's batch 256 there was checked on the CPU, min |z| 1.6e-7)
            let loss = if cpu.output_shape().len() == 1 { Loss::Mse } else { Loss::LogitCrossEntropy };
            let targets = if loss == Loss::Mse { target_rng.uniform(n) } else { Vec::new() };
            backprop_both((&cpu, &gpu), (&mut cpu_fwd, &mut gpu_fwd), (&mut cpu_bwd, &mut gpu_bwd), loss, &labels, &targets);
            let grad_err = rel_err(&gpu_bwd.gradients().unwrap(), &cpu_bwd.gradients().unwrap());
            println!("{name} batch {n}: forward rel err {err:.2e}, gradients after it {grad_err:.2e}");
            assert!(err <= 1e-5, "{name} batch {n}: forward {err:e}");
            assert!(grad_err <= 1e-5, "{name} batch {n}: gradients {grad_err:e}");
        }
    }
}

/// Training steps whose last layer, loss and input gradient run in one kernel (src/cuda/head.rs,
/// 257 to 2048 samples), with the layer before it (a deep head: forward and input gradient, a
/// warp a sample at 513 to 1024, two up to 512) where it fits, against the CPU: batches past
/// 1024, which take its warps round more than once, 700, just above 256, and one sample (the
/// separate kernels); a layer before it with and without an
/// activation, taking the plan's input or another layer's output, activated or not; an
/// activated last layer, both losses, 1 to 32 outputs. `dense_plans_match_the_cpu` runs the MLP
/// (deep, both layers activated) and a layer before too large to stage (the 100-200-1).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn large_batches_through_the_head_match_the_cpu() {
    let device = cuda_device();
    let chains = [
        ("33-40-7", Chain::new(Input::vector(33)).dense(40, Tanh).dense(7, Identity), Loss::LogitCrossEntropy),
        ("6-9-9-2", Chain::new(Input::vector(6)).dense(9, Identity).dense(9, Gelu).dense(2, Sigmoid), Loss::Mse),
        (
            "50-20-30-5",
            Chain::new(Input::vector(50)).dense(20, LeakyRelu(0.1)).dense(30, Identity).dense(5, Identity),
            Loss::LogitCrossEntropy,
        ),
    ];
    let mut rng = Rng::new(12);
    for (name, chain, loss) in chains {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 4).with_threads(1).unwrap();
        let gpu = cpu.to(&device).unwrap();
        let (mut cpu_fwd, mut gpu_fwd) = (cpu.preallocate(2048).unwrap(), gpu.preallocate(2048).unwrap());
        let (mut cpu_bwd, mut gpu_bwd) = (cpu.preallocate_grads(2048).unwrap(), gpu.preallocate_grads(2048).unwrap());
        for n in [2048, 1100, 700, 257, 1] {
            let (x, labels) = batch(&mut rng, &cpu, n);
            for f in [&mut cpu_fwd, &mut gpu_fwd] {
                f.set_inputs(&x).unwrap();
            }
            let targets = if loss == Loss::Mse { rng.uniform(n * cpu.output_shape().len()) } else { Vec::new() };
            backprop_both((&cpu, &gpu), (&mut cpu_fwd, &mut gpu_fwd), (&mut cpu_bwd, &mut gpu_bwd), loss, &labels, &targets);
            let grad_err = rel_err(&gpu_bwd.gradients().unwrap(), &cpu_bwd.gradients().unwrap());
            let loss_err = rel_err(&[gpu_bwd.last_loss().unwrap()], &[cpu_bwd.last_loss().unwrap()]);
            println!("{name} batch {n}: gradients rel err {grad_err:.2e}, loss {loss_err:.2e}");
            assert!(grad_err <= 1e-5, "{name} batch {n}: gradients {grad_err:e}");
            assert!(loss_err <= 1e-6, "{name} batch {n}: loss {loss_err:e}");
        }
    }
}

/// Outputs of up to 16,384 values come back through a kernel that writes them to the host and
/// sets a flag; larger ones through a copy and a stream wait. Calls alternate between the two on
/// one cache (the flag's count must stay in step), with graphs on and off.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn forward_outputs_on_both_sides_of_the_flag_path_match_the_cpu() {
    let device = cuda_device();
    let chain = Chain::new(Input::vector(20)).dense(64, Relu).dense(40, Identity);
    let cpu = chain.build().unwrap().init(Init::GlorotUniform, 4).with_threads(1).unwrap();
    let mut rng = Rng::new(21);
    for graphs in [true, false] {
        let gpu = cpu
            .to(&Device::Cpu)
            .unwrap()
            .with_gpu_options(GpuOptions { graphs, tf32: false, ..GpuOptions::default() })
            .unwrap()
            .to(&device)
            .unwrap();
        let (mut cpu_fwd, mut gpu_fwd) = (cpu.preallocate(420).unwrap(), gpu.preallocate(420).unwrap());
        // 40 outputs a sample: 409 samples are 16,360 values (flag), 410 are 16,400 (copy)
        for n in [1, 409, 410, 3, 420, 410, 409, 2] {
            let (x, _) = batch(&mut rng, &cpu, n);
            cpu_fwd.set_inputs(&x).unwrap();
            gpu_fwd.set_inputs(&x).unwrap();
            let want = cpu.forward(&mut cpu_fwd).unwrap().to_vec();
            let got = gpu.forward(&mut gpu_fwd).unwrap().to_vec();
            let err = rel_err(&got, &want);
            println!("graphs={graphs} batch {n} ({} outputs): rel err {err:.2e}", got.len());
            assert_eq!(got.len(), n * 40);
            assert!(err <= 1e-5, "graphs={graphs} batch {n}: {err:e}");
        }
    }
}

/// A server on the GPU: small dense models are answered by the resident kernel and match the
/// CPU, with new inputs and with the last ones again (outputs poisoned with NaN before each
/// call, so a call that writes none fails), at partial batches, after the kernel left for want
/// of calls (on the host's side of the margin, and on the kernel's, which makes the host
/// relaunch it mid-call), and with the model's own graphs run between calls; models it cannot
/// take (a convolution, weights too large for shared memory, no dense layer) are served through
/// `forward`.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_server_matches_the_cpu() {
    let device = cuda_device();
    let chains = [
        ("100-200-1", Chain::new(Input::vector(100)).dense(200, Relu).dense(1, Identity), 128),
        ("20-7", Chain::new(Input::vector(20)).dense(7, Sigmoid), 1),
        ("37-256-9-250-3", Chain::new(Input::vector(37)).dense(256, Tanh).dense(9, Sigmoid).dense(250, LeakyRelu(0.2)).dense(3, Gelu), 300),
        ("mlp", mlp(), 16),
        ("mixed", mixed(), 8),
        ("flatten", Chain::new(Input::image(1, 2, 3)).flatten(), 4),
    ];
    let default_idle = std::time::Duration::from_millis(1);
    let mut rng = Rng::new(12);
    for (name, chain, capacity) in chains {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 2).with_threads(1).unwrap();
        let gpu = cpu.to(&device).unwrap();
        let mut cpu_fwd = cpu.preallocate(capacity).unwrap();
        let mut server = gpu.serve(capacity).unwrap();
        let resident = server.is_resident();
        println!("{name}: resident {resident}");
        assert_eq!(resident, !matches!(name, "mlp" | "mixed" | "flatten"), "{name}");
        let mut gpu_fwd = gpu.preallocate(capacity).unwrap();
        let mut check = |server: &mut Server, n: usize, idle: std::time::Duration, what: &str| {
            let (x, _) = batch(&mut rng, &cpu, n);
            cpu_fwd.set_inputs(&x).unwrap();
            let want = cpu.forward(&mut cpu_fwd).unwrap().to_vec();
            server.set_inputs(&x).unwrap();
            server.poison_for_test(idle);
            let got = server.forward().unwrap().to_vec();
            let err = rel_err(&got, &want);
            // the same inputs again, from the device's copy
            server.poison_for_test(idle);
            let again = server.forward().unwrap().to_vec();
            println!("{name} batch {n}{what}: rel err {err:.2e}");
            assert_eq!(got.len(), want.len(), "{name} batch {n}{what}");
            assert!(err <= 1e-5, "{name} batch {n}{what}: {err:e}");
            assert_eq!(again, got, "{name} batch {n}{what}: the same inputs again");
            x
        };
        for (round, n) in [capacity, 1, capacity.div_ceil(3), capacity].into_iter().enumerate() {
            let x = check(&mut server, n, default_idle, "");
            match round {
                // long enough for the kernel to leave by itself
                1 => std::thread::sleep(std::time::Duration::from_millis(5)),
                // the model's own forward (a graph, on its stream) while the kernel is resident
                2 => {
                    gpu_fwd.set_inputs(&x).unwrap();
                    assert_eq!(gpu.forward(&mut gpu_fwd).unwrap().len(), x.len() / cpu.input_shape().len() * cpu.output_shape().len());
                }
                _ => {}
            }
        }
        if resident {
            // the kernel leaves after 20 µs without a call from its next launch (the host,
            // assuming 1 ms, stops it before the next call and launches it so); the calls
            // after 300 µs find it gone, and the host launches it again mid-call
            let short = std::time::Duration::from_micros(20);
            server.poison_for_test(short);
            std::thread::sleep(std::time::Duration::from_millis(5));
            for _ in 0..5 {
                std::thread::sleep(std::time::Duration::from_micros(300));
                check(&mut server, capacity, short, " after the kernel left");
            }
        }
        assert!(matches!(server.set_inputs(&vec![0.0; (capacity + 1) * cpu.input_shape().len()]), Err(Error::Capacity { .. })));
    }
}

/// A server keeps answering, right, while another thread's model keeps the GPU busy with large
/// products (its blocks may then wait for SMs, and the kernel must not leave before every block
/// has finished a call).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_server_answers_while_other_work_holds_the_gpu() {
    let device = cuda_device();
    let cpu = Chain::new(Input::vector(100)).dense(200, Relu).dense(1, Identity).build().unwrap().init(Init::GlorotUniform, 4);
    let gpu = cpu.to(&device).unwrap();
    let (x, _) = batch(&mut Rng::new(5), &cpu, 128);
    let mut cpu_fwd = cpu.preallocate(128).unwrap();
    cpu_fwd.set_inputs(&x).unwrap();
    let want = cpu.forward(&mut cpu_fwd).unwrap().to_vec();
    let (stop, busy_calls) = (std::sync::atomic::AtomicBool::new(false), std::sync::atomic::AtomicUsize::new(0));
    std::thread::scope(|scope| {
        let busy = scope.spawn(|| {
            let big = Chain::new(Input::vector(4096)).dense(4096, Relu).build().unwrap().init(Init::GlorotUniform, 1);
            let big = big.to(&device).unwrap();
            let mut fwd = big.preallocate(4096).unwrap();
            fwd.set_inputs(&vec![0.5; 4096 * 4096]).unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                big.forward(&mut fwd).unwrap();
                busy_calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        // the server starts, and calls come, while the other model's products hold the SMs
        while busy_calls.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        let before = busy_calls.load(std::sync::atomic::Ordering::Relaxed);
        let mut server = gpu.serve(128).unwrap();
        assert!(server.is_resident());
        server.set_inputs(&x).unwrap();
        // at least 3,000 calls, and on until the other model has run two forward calls beside
        // them (a few times in a row it had run none by the 3,000th)
        let beside = || busy_calls.load(std::sync::atomic::Ordering::Relaxed) - before;
        let mut calls = 0;
        while calls < 3000 || (beside() < 2 && calls < 300_000) {
            let got = server.forward().unwrap();
            assert!(rel_err(got, &want) <= 1e-5, "call {calls}");
            calls += 1;
        }
        let beside = beside();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        busy.join().unwrap();
        assert!(beside >= 2, "the other model ran {beside} forward calls beside the server");
        println!("{calls} server calls beside {beside} forward calls of a 4096-4096 layer at batch 4096");
    });
}
