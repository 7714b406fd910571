//! Where a model runs, and the GPU's promises: a model trained on the GPU saves and loads on the
//! CPU; a model, its optimiser and its caches move between devices together; mismatched devices
//! and device errors are errors that leave the device usable; `FLATNN_DEVICE` and
//! `CUDA_VISIBLE_DEVICES` choose devices as documented; models trained on several threads give
//! the bits of each alone. (The model against the CPU: tests/gpu.rs.) The GPU tests are
//! `#[ignore]`d: the runner counts them as ignored, and `cargo test -- --include-ignored` runs
//! them where there is a GPU.
#![cfg(feature = "cuda")]

use flatnn::cuda;
use flatnn::models::{lenet5, mlp};
use flatnn::prelude::*;
use flatnn::testutil::{batch, cuda_device, rel_err, train_alternating, Rng};

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn saved_on_the_gpu_loads_on_the_cpu() {
    let device = cuda_device();
    let model = mlp().build().unwrap().init(Init::HeNormal, 1).to(&device).unwrap();
    let (_, trained) = train_alternating(model, Optim::adam(1e-3), Loss::LogitCrossEntropy, 5, 2);
    let path = std::env::temp_dir().join(format!("flatnn-gpu-save-{}.safetensors", std::process::id()));
    trained.save(&path).unwrap();
    let loaded = Model::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(loaded.device(), Device::Cpu);
    let want = trained.parameters().unwrap();
    let got = loaded.parameters().unwrap();
    assert!(want.iter().zip(got.iter()).all(|(a, b)| a.to_bits() == b.to_bits()), "parameters changed on the way");
    // the same outputs from the loaded model on the CPU and the trained one on the GPU
    let mut rng = Rng::new(3);
    let (x, _) = batch(&mut rng, &loaded, 8);
    let (mut cpu_fwd, mut gpu_fwd) = (loaded.preallocate(8).unwrap(), trained.preallocate(8).unwrap());
    cpu_fwd.set_inputs(&x).unwrap();
    gpu_fwd.set_inputs(&x).unwrap();
    let err = rel_err(trained.forward(&mut gpu_fwd).unwrap(), loaded.forward(&mut cpu_fwd).unwrap());
    assert!(err <= 1e-5, "outputs differ by {err:e}");
}

/// Trains an MLP three steps on each device of `stops` in turn, moving the model, optimiser
/// and caches together between them, and returns the parameters' relative error against the
/// same steps on the CPU alone.
fn train_moving(stops: &[Device]) -> f64 {
    let optim = Optim::sgd(0.05, 0.9);
    let model = mlp().build().unwrap().init(Init::HeNormal, 8).with_threads(1).unwrap();
    let (_, reference) = train_alternating(model.to(&Device::Cpu).unwrap(), optim, Loss::LogitCrossEntropy, 3 * stops.len(), 4);
    let (fwd, bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
    let opt = Optimizer::new(&model, optim).unwrap();
    let mut set = (model, opt, fwd, bwd);
    let mut rng = Rng::new(4);
    for step in 0..3 * stops.len() {
        if step % 3 == 0 {
            let device = stops[step / 3];
            set = set.to_device(&device).unwrap();
            assert!([set.0.device(), set.1.device(), set.2.device(), set.3.device()].iter().all(|d| *d == device));
        }
        let (model, opt, fwd, bwd) = (&mut set.0, &mut set.1, &mut set.2, &mut set.3);
        let n = if step % 2 == 0 { 32 } else { 17 };
        let (x, labels) = batch(&mut rng, model, n);
        fwd.set_inputs(&x).unwrap();
        fwd.set_labels(&labels).unwrap();
        model.backprop(bwd, fwd, Loss::LogitCrossEntropy).unwrap();
        opt.update(model, bwd).unwrap();
    }
    assert_eq!(set.1.steps(), 3 * stops.len() as u64);
    let (back, ..) = flatnn::cpu(set).unwrap();
    assert_eq!(back.device(), Device::Cpu);
    rel_err(&back.parameters().unwrap(), &reference.parameters().unwrap())
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn model_optimiser_and_caches_move_together() {
    let device = cuda_device();
    let err = train_moving(&[Device::Cpu, device]);
    println!("moved CPU -> GPU mid-training: parameters rel err {err:.2e}");
    assert!(err <= 1e-5, "{err:e}");
}

#[ignore = "needs two or more CUDA devices: run with --include-ignored where there are (--skip many_gpus elsewhere)"]
#[test]
fn moves_between_many_gpus() {
    cuda_device();
    let count = cuda::device_count();
    assert!(count >= 2, "this test needs two or more CUDA devices, and there are {count}");
    // cuda:0 -> cuda:1 -> ... -> cuda:n-1 -> cuda:0 -> CPU
    let stops: Vec<Device> = (0..count).chain([0]).map(Device::Cuda).chain([Device::Cpu]).collect();
    let err = train_moving(&stops);
    println!("moved through {count} GPUs and back to the CPU mid-training: parameters rel err {err:.2e}");
    assert!(err <= 1e-5, "{err:e}");
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn mismatched_devices_are_errors() {
    let device = cuda_device();
    let cpu_model = mlp().build().unwrap().init(Init::HeNormal, 1);
    let mut gpu_model = cpu_model.to(&device).unwrap();
    let mut cpu_cache = cpu_model.preallocate(4).unwrap();
    cpu_cache.set_inputs(&vec![0.5; 4 * 784]).unwrap();
    assert!(matches!(gpu_model.forward(&mut cpu_cache), Err(Error::Mismatch(_))));
    let mut cpu_opt = Optimizer::new(&cpu_model, Optim::adam(1e-3)).unwrap();
    let gpu_grads = gpu_model.preallocate_grads(4).unwrap();
    assert!(matches!(cpu_opt.update(&mut gpu_model, &gpu_grads), Err(Error::Mismatch(_))));
    assert!(matches!(gpu_model.parameters_mut(), Err(Error::Mismatch(_))));
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_device_error_is_an_err_and_the_device_stays_usable() {
    let device = cuda_device();
    let model = mlp().build().unwrap().init(Init::HeNormal, 1).to(&device).unwrap();
    // activations for 2^27 samples: ~630 GB, more than any GPU has
    match model.preallocate(1 << 27) {
        Err(e @ Error::OutOfMemory { .. }) => println!("oversized cache: {e}"),
        Err(e) => panic!("oversized cache gave {e}"),
        Ok(_) => panic!("an oversized cache was allocated"),
    }
    let (losses, _) = train_alternating(model, Optim::adam(1e-3), Loss::LogitCrossEntropy, 3, 1);
    assert!(losses.iter().all(|l| l.is_finite()), "the device is still usable: {losses:?}");
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn flatnn_device_chooses_the_device() {
    cuda_device();
    // The only test in this binary that reads or sets FLATNN_DEVICE.
    let with = |value: Option<&str>| {
        match value {
            Some(v) => std::env::set_var("FLATNN_DEVICE", v),
            None => std::env::remove_var("FLATNN_DEVICE"),
        }
        flatnn::device()
    };
    assert_eq!(with(None), Device::Cuda(0));
    assert_eq!(with(Some("cpu")), Device::Cpu);
    assert_eq!(with(Some("cuda")), Device::Cuda(0));
    assert_eq!(with(Some("cuda:0")), Device::Cuda(0));
    assert_eq!(with(Some("cuda:99")), Device::Cpu, "a device that is not there falls back");
    assert_eq!(with(Some("auto")), Device::Cuda(0));
    std::env::remove_var("FLATNN_DEVICE");
    assert_eq!(flatnn::gpu_or_cpu(), Device::Cuda(0));
}

/// Run by `cuda_visible_devices_is_honoured` in a child process; does nothing otherwise.
#[ignore = "run by cuda_visible_devices_is_honoured in a child process"]
#[test]
fn child_process_sees_expected_devices() {
    let Ok(expected) = std::env::var("FLATNN_TEST_EXPECT_DEVICES") else { return };
    let expected: usize = expected.parse().unwrap();
    println!("child: CUDA_VISIBLE_DEVICES={:?}, device_count {}", std::env::var("CUDA_VISIBLE_DEVICES"), cuda::device_count());
    assert_eq!(cuda::device_count(), expected);
    assert_eq!(cuda::is_functional(), expected > 0);
    if expected == 0 {
        assert_eq!(flatnn::device(), Device::Cpu);
        assert!(matches!(Device::cuda(0), Err(Error::Cuda { .. })));
        assert_eq!(flatnn::gpu(mlp().build().unwrap()).unwrap().device(), Device::Cpu, "gpu() falls back");
    }
    println!("child: ok");
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn cuda_visible_devices_is_honoured() {
    cuda_device();
    for (visible, expected) in [("", 0), ("0", 1), ("-1", 0)] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_process_sees_expected_devices", "--include-ignored", "--nocapture", "--test-threads=1"])
            .env("CUDA_VISIBLE_DEVICES", visible)
            .env("FLATNN_TEST_EXPECT_DEVICES", expected.to_string())
            .env_remove("FLATNN_DEVICE")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        println!("CUDA_VISIBLE_DEVICES={visible:?}: {}", text.lines().filter(|l| l.starts_with("child")).collect::<Vec<_>>().join("; "));
        assert!(out.status.success() && text.contains("child: ok"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn several_models_on_several_threads_match_one_at_a_time() {
    let device = cuda_device();
    let model = |seed| lenet5().build().unwrap().init(Init::HeNormal, seed).to(&device).unwrap();
    let alone: Vec<Vec<f32>> = (0..4)
        .map(|seed| {
            train_alternating(model(seed), Optim::adam(1e-3), Loss::LogitCrossEntropy, 10, seed).1.parameters().unwrap().into_owned()
        })
        .collect();
    let together: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|seed| {
                s.spawn(move || {
                    train_alternating(model(seed), Optim::adam(1e-3), Loss::LogitCrossEntropy, 10, seed)
                        .1
                        .parameters()
                        .unwrap()
                        .into_owned()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, b) in alone.iter().zip(&together) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "a model trained beside others gave other bits");
    }
}
