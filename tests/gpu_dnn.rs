//! Convolutions through cuDNN (`FLATNN_CUDNN=1`) against the CPU and against flatnn's own GPU
//! kernels (`FLATNN_CUDNN=0`), and the automatic choice (`auto`). Every test prints
//! `skipped: no CUDA device` where CUDA is missing; those that need cuDNN print
//! `skipped: no cuDNN 9 library` where it is missing, and pass.
//!
//! `FLATNN_CUDNN` is read when a cache is made, so the tests of this binary set it under one
//! lock and run one at a time.
#![cfg(feature = "cuda")]

use flatnn::cuda::cudnn_version;
use flatnn::models::lenet5;
use flatnn::prelude::*;
use flatnn::testutil::{cuda_or_skip, Rng};
use std::sync::{Mutex, MutexGuard, PoisonError};

static ENV: Mutex<()> = Mutex::new(());

/// Holds the lock and sets `FLATNN_CUDNN` to `mode` until the guard drops.
fn cudnn_mode(mode: &str) -> MutexGuard<'static, ()> {
    let guard = ENV.lock().unwrap_or_else(PoisonError::into_inner);
    std::env::set_var("FLATNN_CUDNN", mode);
    guard
}

/// Strides and paddings LeNet lacks: stride 2 with padding 1, a non-square kernel with
/// stride (2, 1), and a conv without activation (z is y).
fn strided() -> Chain {
    Chain::new(Input::image(16, 15, 3))
        .conv_with(8, (3, 3), Relu, ConvOptions { stride: (2, 2), padding: (1, 1) })
        .conv_with(6, (3, 3), Tanh, ConvOptions { stride: (1, 1), padding: (1, 1) })
        .max_pool((2, 2))
        .conv_with(5, (2, 3), Identity, ConvOptions { stride: (2, 1), padding: (0, 1) })
        .flatten()
        .dense(10, Identity)
}

fn models() -> [(&'static str, Chain); 2] {
    [("lenet", lenet5()), ("strided", strided())]
}

/// ‖a − b‖ / ‖b‖.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}

/// A batch of inputs and labels for `model`.
fn batch(rng: &mut Rng, model: &Model, n: usize) -> (Vec<f32>, Vec<u32>) {
    let x = rng.uniform(n * model.input_shape().len());
    let classes = model.output_shape().len();
    let labels = (0..n).map(|_| (rng.uniform(1)[0] * classes as f32) as u32 % classes as u32).collect();
    (x, labels)
}

/// Forward outputs at batch sizes 1, 5, 64, 128 and 5 again, concatenated.
fn forwards(model: &Model, seed: u64) -> (Vec<f32>, String) {
    let mut fwd = model.preallocate(128).unwrap();
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    for n in [1, 5, 64, 128, 5] {
        let (x, _) = batch(&mut rng, model, n);
        fwd.set_inputs(&x).unwrap();
        out.extend_from_slice(model.forward(&mut fwd).unwrap());
    }
    (out, fwd.conv_backends())
}

/// 20 Adam steps alternating batches of 32 and 17; the losses, the parameters, the report.
fn train(model: &Model, seed: u64) -> (Vec<f32>, Vec<f32>, String) {
    let mut model = model.to(&model.device()).unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let mut rng = Rng::new(seed);
    let mut losses = Vec::new();
    for step in 0..20 {
        let n = if step % 2 == 0 { 32 } else { 17 };
        let (x, labels) = batch(&mut rng, &model, n);
        fwd.set_inputs(&x).unwrap();
        fwd.set_labels(&labels).unwrap();
        model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        losses.push(bwd.last_loss().unwrap());
        opt.update(&mut model, &bwd).unwrap();
    }
    (losses, model.parameters().unwrap().into_owned(), fwd.conv_backends())
}

fn on_gpu(cpu: &Model, device: &Device, graphs: bool) -> Model {
    cpu.to(&Device::Cpu).unwrap().with_gpu_options(GpuOptions { graphs, tf32: false }).unwrap().to(device).unwrap()
}

/// Convolution directions the report says cuDNN runs.
fn cudnn_directions(report: &str) -> usize {
    ["forward cudnn", "weight grad cudnn", "input grad cudnn"].iter().map(|d| report.matches(d).count()).sum()
}

/// The report line of every conv layer at `batch`.
fn lines_at(report: &str, batch: usize) -> Vec<&str> {
    let prefix = format!("batch {batch} FP32,");
    report.lines().filter(|l| l.starts_with(&prefix)).collect()
}

#[test]
fn cudnn_forward_and_training_match_the_cpu() {
    let Some(device) = cuda_or_skip() else { return };
    let Some(version) = cudnn_version() else {
        println!("skipped: no cuDNN 9 library");
        return;
    };
    let _mode = cudnn_mode("1");
    for (name, chain) in models() {
        let cpu = chain.build().unwrap().init(Init::HeNormal, 3).with_threads(1).unwrap();
        let convs = cpu.plan().steps.iter().filter(|s| matches!(s.layer, flatnn::Layer::Conv { .. })).count();
        let (want, _) = forwards(&cpu, 4);
        let (cpu_losses, cpu_params, _) = train(&cpu, 9);
        for graphs in [true, false] {
            let gpu = on_gpu(&cpu, &device, graphs);
            let (got, report) = forwards(&gpu, 4);
            println!("{name} graphs={graphs}, cuDNN {version}:\n{report}");
            assert!(report.contains("FLATNN_CUDNN=1"), "{report}");
            // every layer's forward through cuDNN at every batch size
            for n in [1, 5, 64, 128] {
                let lines = lines_at(&report, n);
                assert_eq!(lines.len(), convs, "{name} batch {n}: {report}");
                assert!(lines.iter().all(|l| l.contains("forward cudnn")), "{name} batch {n}: {report}");
            }
            let err = rel_err(&got, &want);
            println!("{name} graphs={graphs}: cuDNN forward rel err {err:.2e}");
            assert!(err <= 1e-5, "{name} graphs={graphs}: cuDNN forward differs from the CPU by {err:e}");

            let (losses, params, report) = train(&gpu, 9);
            println!("{report}");
            for n in [32, 17] {
                let lines = lines_at(&report, n);
                assert_eq!(lines.len(), convs, "{name} batch {n}: {report}");
                assert!(lines.iter().all(|l| l.contains("forward cudnn") && l.contains("weight grad cudnn")), "{report}");
            }
            assert!(report.contains("input grad cudnn"), "{name}: no input gradient through cuDNN: {report}");
            let (loss_err, params_err) = (rel_err(&losses, &cpu_losses), rel_err(&params, &cpu_params));
            println!("{name} graphs={graphs}: 20 steps through cuDNN, losses rel err {loss_err:.2e}, parameters {params_err:.2e}");
            assert!(loss_err <= 1e-4, "{name}: losses {losses:?} vs {cpu_losses:?}");
            assert!(params_err <= 1e-4, "{name}: parameters differ by {params_err:e}");
        }
    }
}

#[test]
fn cudnn_and_flatnn_kernels_agree() {
    let Some(device) = cuda_or_skip() else { return };
    if cudnn_version().is_none() {
        println!("skipped: no cuDNN 9 library");
        return;
    }
    for (name, chain) in models() {
        let cpu = chain.build().unwrap().init(Init::GlorotUniform, 7).with_threads(1).unwrap();
        let gpu = on_gpu(&cpu, &device, true);
        let ((own_out, own_report), (own_losses, own_params, _)) = {
            let _mode = cudnn_mode("0");
            (forwards(&gpu, 5), train(&gpu, 11))
        };
        assert!(own_report.starts_with("cuDNN not used (FLATNN_CUDNN=0)"), "{own_report}");
        assert_eq!(cudnn_directions(&own_report), 0);
        let ((out, _), (losses, params, report)) = {
            let _mode = cudnn_mode("1");
            (forwards(&gpu, 5), train(&gpu, 11))
        };
        assert!(cudnn_directions(&report) > 0, "{report}");
        let (out_err, loss_err, params_err) = (rel_err(&out, &own_out), rel_err(&losses, &own_losses), rel_err(&params, &own_params));
        println!(
            "{name}: cuDNN vs flatnn's kernels: forward rel err {out_err:.2e}, 20-step losses {loss_err:.2e}, parameters {params_err:.2e}"
        );
        assert!(out_err <= 1e-5 && loss_err <= 1e-4 && params_err <= 1e-4, "{name}");
    }
}

#[test]
fn the_automatic_choice_matches_the_cpu_and_reports_itself() {
    let Some(device) = cuda_or_skip() else { return };
    let _mode = cudnn_mode("auto");
    for (name, chain) in models() {
        let cpu = chain.build().unwrap().init(Init::HeNormal, 5).with_threads(1).unwrap();
        let (want, _) = forwards(&cpu, 6);
        let (cpu_losses, cpu_params, _) = train(&cpu, 13);
        let gpu = on_gpu(&cpu, &device, true);
        let (got, _) = forwards(&gpu, 6);
        let (losses, params, report) = train(&gpu, 13);
        println!("{name}, FLATNN_CUDNN=auto:\n{report}");
        match cudnn_version() {
            Some(_) => {
                assert!(report.contains("FLATNN_CUDNN=auto"), "{report}");
                assert!(!report.contains("not measured yet"), "{report}");
            }
            None => assert!(report.starts_with("cuDNN not used"), "{report}"),
        }
        let (err, loss_err, params_err) = (rel_err(&got, &want), rel_err(&losses, &cpu_losses), rel_err(&params, &cpu_params));
        println!("{name}: forward rel err {err:.2e}, 20-step losses {loss_err:.2e}, parameters {params_err:.2e}");
        assert!(err <= 1e-5 && loss_err <= 1e-4 && params_err <= 1e-4, "{name}");
    }
}

#[test]
fn a_model_without_convolutions_reports_nothing() {
    let Some(device) = cuda_or_skip() else { return };
    let _mode = cudnn_mode("auto");
    let model = flatnn::models::mlp().build().unwrap().to(&device).unwrap();
    assert_eq!(model.preallocate(4).unwrap().conv_backends(), "");
    let cpu = lenet5().build().unwrap();
    assert_eq!(cpu.preallocate(4).unwrap().conv_backends(), "");
}
