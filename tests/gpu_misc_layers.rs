//! The pooling, 1-D and softmax layers, the activations SiLU, ELU and Softplus and the losses
//! BCEWithLogits, L1 and SmoothL1 on a GPU against the same model on the CPU: training steps
//! (forward, loss, backward, update) at odd batches, graphs on and off, with flatnn's kernels
//! and with cuDNN's where it was measured faster; and inference. `#[ignore]`d: `cargo test --
//! --include-ignored` runs them where there is a GPU.
#![cfg(feature = "cuda")]

use flatnn::models::ts_conv1d;
use flatnn::prelude::*;
use flatnn::testutil::{cuda_device, pooling_net, rel_err, signal_net, Rng};

/// A dense net ending in a layer the head kernel would take (narrow, dense) at 257 samples and
/// more: with the element-wise losses it must refuse it and run the loss kernel.
fn head_net() -> Chain {
    Chain::new(Input::vector(20)).dense(24, Softplus).dense(9, Silu).dense(5, Elu(0.3))
}

/// `steps` training steps at alternating batches `sizes`, inputs in [−1, 1), labels or targets
/// in [0, 1) for `loss`; the losses and the model.
fn train(mut model: Model, loss: Loss, sizes: [usize; 2], steps: usize) -> (Vec<f32>, Model) {
    let capacity = sizes[0].max(sizes[1]);
    let (mut fwd, mut bwd) = (model.preallocate(capacity).unwrap(), model.preallocate_grads(capacity).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let (mut rng, outputs) = (Rng::new(5), model.output_shape().len());
    let mut losses = Vec::new();
    for step in 0..steps {
        let n = sizes[step % 2];
        fwd.set_inputs(&rng.uniform(n * model.input_shape().len())).unwrap();
        if loss.takes_labels() {
            fwd.set_labels(&(0..n).map(|_| rng.below(outputs) as u32).collect::<Vec<_>>()).unwrap();
        } else {
            fwd.set_targets(&rng.uniform(n * outputs).iter().map(|v| v.abs()).collect::<Vec<_>>()).unwrap();
        }
        if step % 3 == 0 {
            model.backprop(&mut bwd, &mut fwd, loss).unwrap();
            opt.update(&mut model, &bwd).unwrap();
        } else {
            opt.train_step(&mut model, &mut bwd, &mut fwd, loss).unwrap();
        }
        losses.push(bwd.last_loss().unwrap());
    }
    (losses, model)
}

/// Each net and loss trained 12 steps on the GPU (graphs on and off) and on the CPU from the same
/// parameters: the losses and the parameters agree within 1e-4 (the GPU sums in other orders,
/// and the max-pools' choices amplify rounding into whole gradients only at ties, which random
/// inputs do not make). Then inference on a fresh batch agrees within 1e-5.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_new_layers_and_losses_train_on_the_gpu_as_on_the_cpu() {
    let device = cuda_device();
    let xent = Loss::LogitCrossEntropy;
    let cases = [
        ("pooling", pooling_net(), Loss::BceWithLogits, [33, 7]),
        ("pooling xent", pooling_net(), xent, [5, 16]),
        ("signal", signal_net(), Loss::SmoothL1 { beta: 0.25 }, [19, 3]),
        ("signal l1", signal_net(), Loss::L1, [8, 1]),
        ("ts_conv1d", ts_conv1d(), xent, [31, 64]),
        // the head's batches: 300 samples
        ("head l1", head_net(), Loss::L1, [300, 13]),
        ("head bce", head_net(), Loss::BceWithLogits, [300, 257]),
        ("head smooth", head_net(), Loss::SmoothL1 { beta: 0.0 }, [300, 2]),
    ];
    for (name, chain, loss, sizes) in cases {
        let cpu = chain.build().unwrap().init(Init::HeNormal, 3).with_threads(1).unwrap();
        let (cpu_losses, cpu_trained) = train(cpu.to(&Device::Cpu).unwrap(), loss, sizes, 12);
        for graphs in [true, false] {
            let gpu = cpu
                .to(&Device::Cpu)
                .unwrap()
                .with_gpu_options(GpuOptions { graphs, tf32: false, ..GpuOptions::default() })
                .unwrap()
                .to(&device)
                .unwrap();
            let (gpu_losses, gpu_trained) = train(gpu, loss, sizes, 12);
            let params_err = rel_err(&gpu_trained.parameters().unwrap(), &cpu_trained.parameters().unwrap());
            let loss_err = rel_err(&gpu_losses, &cpu_losses);
            println!("{name} graphs={graphs}: losses rel err {loss_err:.2e}, parameters {params_err:.2e}");
            assert!(loss_err <= 1e-4, "{name} graphs={graphs}: losses {gpu_losses:?} vs {cpu_losses:?}");
            assert!(params_err <= 1e-4, "{name} graphs={graphs}: parameters differ by {params_err:e}");
            // inference with the CPU's trained parameters
            let n = sizes[0];
            let x = Rng::new(8).uniform(n * cpu.input_shape().len());
            let gpu_same = cpu_trained
                .to(&Device::Cpu)
                .unwrap()
                .with_gpu_options(GpuOptions { graphs, tf32: false, ..GpuOptions::default() })
                .unwrap();
            let gpu_same = gpu_same.to(&device).unwrap();
            let (mut cpu_fwd, mut gpu_fwd) = (cpu_trained.preallocate(n).unwrap(), gpu_same.preallocate(n).unwrap());
            cpu_fwd.set_inputs(&x).unwrap();
            gpu_fwd.set_inputs(&x).unwrap();
            let want = cpu_trained.forward(&mut cpu_fwd).unwrap().to_vec();
            let got = gpu_same.forward(&mut gpu_fwd).unwrap().to_vec();
            let err = rel_err(&got, &want);
            println!("{name} graphs={graphs}: forward rel err {err:.2e}");
            assert!(err <= 1e-5, "{name} graphs={graphs}: forward {err:e}");
        }
    }
}

/// The 1-D convolutions through cuDNN (run in a child process with `FLATNN_CUDNN=1`, read once
/// per process): a strided, padded, dilated Conv1d as a 2-D convolution of height 1 against the
/// CPU, when cuDNN is there.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn dilated_conv1d_through_cudnn_matches_the_cpu() {
    let device = cuda_device();
    if !flatnn::testutil::in_child() {
        flatnn::testutil::run_alone("dilated_conv1d_through_cudnn_matches_the_cpu", &[("FLATNN_CUDNN", "1")]);
        return;
    }
    let cpu = signal_net().build().unwrap().init(Init::HeNormal, 4).with_threads(1).unwrap();
    let (cpu_losses, cpu_trained) = train(cpu.to(&Device::Cpu).unwrap(), Loss::LogitCrossEntropy, [64, 9], 6);
    let gpu = cpu.to(&device).unwrap();
    let mut fwd = gpu.preallocate(64).unwrap();
    fwd.set_inputs(&Rng::new(1).uniform(64 * 784)).unwrap();
    gpu.forward(&mut fwd).unwrap();
    let report = fwd.conv_backends();
    println!("{report}");
    if flatnn::cuda::cudnn_version().is_some() {
        assert!(report.contains("forward cudnn"), "cuDNN not used: {report}");
    }
    let (gpu_losses, gpu_trained) = train(gpu, Loss::LogitCrossEntropy, [64, 9], 6);
    let params_err = rel_err(&gpu_trained.parameters().unwrap(), &cpu_trained.parameters().unwrap());
    let loss_err = rel_err(&gpu_losses, &cpu_losses);
    println!("signal through cuDNN: losses rel err {loss_err:.2e}, parameters {params_err:.2e}");
    assert!(loss_err <= 1e-4 && params_err <= 1e-4, "losses {gpu_losses:?} vs {cpu_losses:?}, parameters {params_err:e}");
}
