//! Convolutions through cuDNN (`FLATNN_CUDNN=1`) against the CPU and against flatnn's own GPU
//! kernels (`FLATNN_CUDNN=0`), and the automatic choice (`auto`). The tests are `#[ignore]`d:
//! `cargo test -- --include-ignored` runs them where there is a GPU; those that need cuDNN
//! print `skipped: no cuDNN 9 library` where it is missing, and pass.
//!
//! flatnn reads `FLATNN_CUDNN` once per process, so a test that needs a setting runs itself
//! again alone in a child process with it (`testutil::run_alone`).
#![cfg(feature = "cuda")]

use flatnn::cuda::cudnn_version;
use flatnn::models::lenet5;
use flatnn::prelude::*;
use flatnn::testutil::{batch, cuda_device, in_child, rel_err, run_alone, Rng};
use std::path::{Path, PathBuf};

/// Strides and paddings LeNet lacks: stride 2 with padding 1, a non-square kernel with
/// stride (2, 1), and a conv without activation (z is y).
fn strided() -> Chain {
    Chain::new(Input::image(3, 16, 15))
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

/// True where this test should run here: in a child process with `FLATNN_CUDNN=mode`. Else
/// (the parent) runs `test` in such a child and returns false.
fn in_mode(test: &str, mode: &str) -> bool {
    if in_child() {
        return true;
    }
    run_alone(test, &[("FLATNN_CUDNN", mode)]);
    false
}

/// Inputs that poison every activation they reach: the largest finite value (NaN inputs are
/// refused), whose products overflow to infinities and NaN, so that what a later call leaves
/// unwritten cannot pass for a right value.
const POISON: f32 = f32::MAX;

/// Forward outputs at batch sizes 1, 5, 64, 128 and 5 again, concatenated. Each call follows
/// one on poison inputs of the same batch size (which also measures the paths and captures the
/// graph), so that anything the real call leaves unwritten shows as non-finite or stale.
fn forwards(model: &Model, seed: u64) -> (Vec<f32>, String) {
    let mut fwd = model.preallocate(128).unwrap();
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    for n in [1, 5, 64, 128, 5] {
        fwd.set_inputs(&vec![POISON; n * model.input_shape().len()]).unwrap();
        model.forward(&mut fwd).unwrap();
        let (x, _) = batch(&mut rng, model, n);
        fwd.set_inputs(&x).unwrap();
        out.extend_from_slice(model.forward(&mut fwd).unwrap());
    }
    (out, fwd.conv_backends())
}

/// 20 Adam steps alternating batches of 32 and 17; the losses, the parameters, the report.
/// Before each step, a backprop on poison inputs (not applied) poisons the activations and all
/// gradients, so that anything the step leaves unwritten shows in the parameters.
fn train(model: &Model, seed: u64) -> (Vec<f32>, Vec<f32>, String) {
    train_at(model, seed, [32, 17])
}

/// [`train`] alternating batches of `sizes[0]` (the capacity) and `sizes[1]`.
fn train_at(model: &Model, seed: u64, sizes: [usize; 2]) -> (Vec<f32>, Vec<f32>, String) {
    let mut model = model.to(&model.device()).unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(sizes[0]).unwrap(), model.preallocate_grads(sizes[0]).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let mut rng = Rng::new(seed);
    let mut losses = Vec::new();
    for step in 0..20 {
        let n = sizes[step % 2];
        let (x, labels) = batch(&mut rng, &model, n);
        fwd.set_inputs(&vec![POISON; x.len()]).unwrap();
        fwd.set_labels(&labels).unwrap();
        model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        fwd.set_inputs(&x).unwrap();
        model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        losses.push(bwd.last_loss().unwrap());
        opt.update(&mut model, &bwd).unwrap();
    }
    (losses, model.parameters().unwrap().into_owned(), fwd.conv_backends())
}

fn on_gpu(cpu: &Model, device: &Device, options: GpuOptions) -> Model {
    cpu.to(&Device::Cpu).unwrap().with_gpu_options(options).unwrap().to(device).unwrap()
}

fn fp32(graphs: bool) -> GpuOptions {
    GpuOptions { graphs, tf32: false, ..GpuOptions::default() }
}

/// Convolution directions the report says cuDNN runs.
fn cudnn_directions(report: &str) -> usize {
    ["forward cudnn", "weight grad cudnn", "input grad cudnn"].iter().map(|d| report.matches(d).count()).sum()
}

/// The report line of every conv layer at `batch` in `arith` ("FP32" or "TF32").
fn lines_at<'r>(report: &'r str, batch: usize, arith: &str) -> Vec<&'r str> {
    let prefix = format!("batch {batch} {arith},");
    report.lines().filter(|l| l.starts_with(&prefix)).collect()
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn cudnn_forward_and_training_match_the_cpu() {
    let device = cuda_device();
    let Some(version) = cudnn_version() else {
        println!("skipped: no cuDNN 9 library");
        return;
    };
    if !in_mode("cudnn_forward_and_training_match_the_cpu", "1") {
        return;
    }
    for (name, chain) in models() {
        let cpu = chain.build().unwrap().init(Init::HeNormal, 3).with_threads(1).unwrap();
        let convs = cpu.plan().steps.iter().filter(|s| matches!(s.layer, flatnn::Layer::Conv(_))).count();
        let (want, _) = forwards(&cpu, 4);
        let (cpu_losses, cpu_params, _) = train(&cpu, 9);
        // graphs off first: the paths are measured by eager calls, and every later cache of
        // this process reuses those measurements
        for graphs in [false, true] {
            let gpu = on_gpu(&cpu, &device, fp32(graphs));
            let (got, report) = forwards(&gpu, 4);
            println!("{name} graphs={graphs}, cuDNN {version}:\n{report}");
            assert!(report.contains("FLATNN_CUDNN=1"), "{report}");
            // every layer's forward through cuDNN at every batch size, in plain FP32
            for n in [1, 5, 64, 128] {
                let lines = lines_at(&report, n, "FP32");
                assert_eq!(lines.len(), convs, "{name} batch {n}: {report}");
                assert!(lines.iter().all(|l| l.contains("forward cudnn")), "{name} batch {n}: {report}");
            }
            assert!(!report.contains("MATH"), "{name}: a math type other than FMA without TF32: {report}");
            assert!(!report.contains("non-deterministic"), "{name}: by default, deterministic algorithms only: {report}");
            let err = rel_err(&got, &want);
            println!("{name} graphs={graphs}: cuDNN forward rel err {err:.2e}");
            assert!(err <= 1e-5, "{name} graphs={graphs}: cuDNN forward differs from the CPU by {err:e}");

            let (losses, params, report) = train(&gpu, 9);
            println!("{report}");
            for n in [32, 17] {
                let lines = lines_at(&report, n, "FP32");
                assert_eq!(lines.len(), convs, "{name} batch {n}: {report}");
                assert!(lines.iter().all(|l| l.contains("forward cudnn") && l.contains("weight grad cudnn")), "{report}");
            }
            assert!(report.contains("input grad cudnn"), "{name}: no input gradient through cuDNN: {report}");
            assert!(!report.contains("non-deterministic"), "{name}: by default, deterministic algorithms only: {report}");
            let (loss_err, params_err) = (rel_err(&losses, &cpu_losses), rel_err(&params, &cpu_params));
            println!("{name} graphs={graphs}: 20 steps through cuDNN, losses rel err {loss_err:.2e}, parameters {params_err:.2e}");
            assert!(loss_err <= 1e-4, "{name}: losses {losses:?} vs {cpu_losses:?}");
            assert!(params_err <= 1e-4, "{name}: parameters differ by {params_err:e}");
        }
        // TF32: cuDNN runs each algorithm with the math type it was found and timed with
        let gpu = on_gpu(&cpu, &device, GpuOptions { graphs: true, tf32: true, ..GpuOptions::default() });
        let (got, report) = forwards(&gpu, 4);
        let (losses, _, train_report) = train(&gpu, 9);
        println!("{name} TF32:\n{report}\n{train_report}");
        assert!(lines_at(&report, 64, "TF32").iter().all(|l| l.contains("forward cudnn")), "{report}");
        assert!(!report.contains("ALLOW_CONVERSION") && !train_report.contains("ALLOW_CONVERSION"), "{report}");
        assert!(!train_report.contains("non-deterministic"), "{name} TF32: deterministic algorithms only: {train_report}");
        // TF32 searches FP32's algorithms too: every direction FP32 ran through cuDNN has one
        for n in [32, 17] {
            let lines = lines_at(&train_report, n, "TF32");
            assert_eq!(lines.len(), convs, "{name} TF32 batch {n}: {train_report}");
            assert!(lines.iter().all(|l| l.contains("forward cudnn") && l.contains("weight grad cudnn")), "{name} TF32: {train_report}");
        }
        assert!(train_report.contains("input grad cudnn"), "{name} TF32: no input gradient through cuDNN: {train_report}");
        let (err, loss_err) = (rel_err(&got, &want), rel_err(&losses, &cpu_losses));
        println!("{name} TF32: forward rel err {err:.2e}, 20-step losses {loss_err:.2e}");
        assert!(err <= 5e-3 && loss_err <= 5e-3, "{name} TF32: forward {err:e}, losses {loss_err:e}");
    }
}

/// With `FLATNN_CUDNN=0` flatnn's weight-gradient routes (the lowered one, `own`, the implicit
/// product, `own-implicit`, the direct kernel, `own-direct`, and the tensor-core one, `own-mma`,
/// which fit every layer of these models, the latter on sm_80 and later alone) are timed for
/// every conv layer at every training batch size and the report names the one chosen, every
/// time measured; the forward's three (`own`, `own-direct`, `own-mma`: the
/// tensor-core kernels fit these layers too, on sm_80 and later) likewise, and the input
/// gradient's of a stride-1 layer after the first; another's input gradient has one route,
/// timed for nothing; 20 steps of LeNet and of the strided model match the CPU.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn flatnn_kernels_alone_measure_both_weight_gradient_routes() {
    const TEST: &str = "flatnn_kernels_alone_measure_both_weight_gradient_routes";
    let device = cuda_device();
    if !in_mode(TEST, "0") {
        return;
    }
    let tensor_cores = flatnn::testutil::cuda_tensor_cores();
    for (name, chain) in models() {
        let cpu = chain.build().unwrap().init(Init::HeNormal, 51).with_threads(1).unwrap();
        let convs = cpu.plan().steps.iter().filter(|s| matches!(s.layer, flatnn::Layer::Conv(_))).count();
        let (cpu_losses, cpu_params, _) = train(&cpu, 52);
        let (losses, params, report) = train(&on_gpu(&cpu, &device, fp32(true)), 52);
        println!("{name}, FLATNN_CUDNN=0:\n{report}");
        assert!(report.starts_with("cuDNN not used (FLATNN_CUDNN=0)"), "{report}");
        for n in [32, 17] {
            let lines = lines_at(&report, n, "FP32");
            assert_eq!(lines.len(), convs, "{name} batch {n}: {report}");
            for line in lines {
                // the forward is in the line's first part, after its label: "…: forward own …"
                let part = |dir: &str| {
                    line.split(';').find_map(|p| p.split_once(dir).map(|(_, rest)| rest.trim())).unwrap_or_else(|| panic!("{dir}: {line}"))
                };
                // the chosen route first, then every other candidate with its time
                // (the tensor-core route, `own-mma`, the last of each: a candidate on sm_80 and later)
                let mma = usize::from(tensor_cores);
                let mut dirs = vec![
                    ("weight grad ", &["own", "own-implicit", "own-direct", "own-mma"][..3 + mma]),
                    ("forward ", &["own", "own-direct", "own-mma"][..2 + mma]),
                ];
                if line.contains(" stride 1×1 ") && !line.contains(", step 0 conv") {
                    dirs.push(("input grad ", &["own", "own-direct", "own-mma"][..2 + mma]));
                } else {
                    assert!(["own (the only route)", "not needed"].contains(&part("input grad ")), "{line}");
                }
                for (dir, routes) in dirs {
                    let words = part(dir);
                    let chosen = words.split_whitespace().next().unwrap();
                    assert!(routes.contains(&chosen), "{line}");
                    for other in routes.iter().filter(|&&r| r != chosen) {
                        assert!(words.contains(&format!("{other} ")), "{other}: {line}");
                    }
                    assert!(!words.contains("NaN") && !words.contains("cudnn"), "{line}");
                }
            }
        }
        let (loss_err, params_err) = (rel_err(&losses, &cpu_losses), rel_err(&params, &cpu_params));
        println!("{name}: 20 steps on flatnn's kernels: losses rel err {loss_err:.2e}, parameters {params_err:.2e}");
        assert!(loss_err <= 1e-4 && params_err <= 1e-4, "{name}");
    }
}

/// Where a child of `cudnn_and_flatnn_kernels_agree` writes `what` of `model`.
fn result_path(dir: &Path, model: &str, what: &str) -> PathBuf {
    dir.join(format!("{model}-{what}.f32"))
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn cudnn_and_flatnn_kernels_agree() {
    const TEST: &str = "cudnn_and_flatnn_kernels_agree";
    let device = cuda_device();
    if cudnn_version().is_none() {
        println!("skipped: no cuDNN 9 library");
        return;
    }
    if in_child() {
        // this process's FLATNN_CUDNN: write forward outputs, losses and parameters
        let dir = PathBuf::from(std::env::var("FLATNN_TEST_OUT").unwrap());
        let own = std::env::var("FLATNN_CUDNN").unwrap() == "0";
        for (name, chain) in models() {
            let cpu = chain.build().unwrap().init(Init::GlorotUniform, 7).with_threads(1).unwrap();
            let gpu = on_gpu(&cpu, &device, fp32(true));
            let ((out, out_report), (losses, params, report)) = (forwards(&gpu, 5), train(&gpu, 11));
            println!("{name}:\n{report}");
            if own {
                assert!(out_report.starts_with("cuDNN not used (FLATNN_CUDNN=0)"), "{out_report}");
                assert_eq!(cudnn_directions(&report), 0, "{report}");
            } else {
                assert!(cudnn_directions(&report) > 0, "{report}");
            }
            for (what, values) in [("out", out), ("losses", losses), ("params", params)] {
                let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                std::fs::write(result_path(&dir, name, what), bytes).unwrap();
            }
        }
        return;
    }
    let read = |dir: &Path, model: &str, what: &str| -> Vec<f32> {
        let bytes = std::fs::read(result_path(dir, model, what)).unwrap();
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    };
    let dirs = ["0", "1"].map(|mode| {
        let dir = std::env::temp_dir().join(format!("flatnn-{TEST}-{}-{mode}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        run_alone(TEST, &[("FLATNN_CUDNN", mode), ("FLATNN_TEST_OUT", dir.to_str().unwrap())]);
        dir
    });
    for (name, _) in models() {
        let [out_err, loss_err, params_err] =
            ["out", "losses", "params"].map(|what| rel_err(&read(&dirs[1], name, what), &read(&dirs[0], name, what)));
        println!(
            "{name}: cuDNN vs flatnn's kernels: forward rel err {out_err:.2e}, 20-step losses {loss_err:.2e}, parameters {params_err:.2e}"
        );
        assert!(out_err <= 1e-5 && loss_err <= 1e-4 && params_err <= 1e-4, "{name}");
    }
    for dir in dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_automatic_choice_matches_the_cpu_and_reports_itself() {
    let device = cuda_device();
    if !in_mode("the_automatic_choice_matches_the_cpu_and_reports_itself", "auto") {
        return;
    }
    for (name, chain) in models() {
        let cpu = chain.build().unwrap().init(Init::HeNormal, 5).with_threads(1).unwrap();
        let (want, _) = forwards(&cpu, 6);
        let (cpu_losses, cpu_params, _) = train(&cpu, 13);
        let gpu = on_gpu(&cpu, &device, fp32(true));
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
        // each direction names a route there is (the implicit product for weight gradients alone)
        for part in report
            .lines()
            .filter(|l| l.starts_with("batch ") && l.contains(" conv "))
            .flat_map(|l| l.split(';'))
            .filter(|p| p.contains(" grad ") || p.contains(" forward "))
        {
            let (dir, rest) = ["forward ", "weight grad ", "input grad "]
                .iter()
                .find_map(|d| part.split_once(d).map(|(_, rest)| (*d, rest)))
                .unwrap_or_else(|| panic!("{part}"));
            let route = rest.split_whitespace().next().unwrap_or("");
            let routes: &[&str] = match dir {
                "weight grad " => &["own", "own-implicit", "own-direct", "own-mma", "cudnn"],
                "forward " => &["own", "own-direct", "own-mma", "cudnn"],
                _ => &["own", "own-direct", "own-mma", "cudnn"],
            };
            assert!(routes.contains(&route) || rest.starts_with("not needed"), "{name}: {part}");
        }
        let (err, loss_err, params_err) = (rel_err(&got, &want), rel_err(&losses, &cpu_losses), rel_err(&params, &cpu_params));
        println!("{name}: forward rel err {err:.2e}, 20-step losses {loss_err:.2e}, parameters {params_err:.2e}");
        assert!(err <= 1e-5 && loss_err <= 1e-4 && params_err <= 1e-4, "{name}");
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_flatnn_cudnn_not_understood_is_reported_and_means_auto() {
    let device = cuda_device();
    if !in_mode("a_flatnn_cudnn_not_understood_is_reported_and_means_auto", "sometimes") {
        return;
    }
    let model = lenet5().build().unwrap().to(&device).unwrap();
    let report = model.preallocate(4).unwrap().conv_backends();
    println!("{report}");
    assert!(report.contains(r#"FLATNN_CUDNN="sometimes" not understood, taken as auto"#), "{report}");
    if cudnn_version().is_some() {
        assert!(report.starts_with("cuDNN 9."), "{report}");
    }
}

/// Two LeNets, one initialisation, with caches (and gradients) of 256 and of 64 samples,
/// trained side by side on the same batches of 64 and 17: every cache has the same cuDNN
/// workspace, so both take the same path for each layer and batch size and compute the same
/// bits. (The workspace once depended on the capacity, and the path on which cache measured
/// first.) In both `FLATNN_CUDNN=1` and `auto`.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn caches_of_any_capacity_compute_the_same_bits() {
    const TEST: &str = "caches_of_any_capacity_compute_the_same_bits";
    let device = cuda_device();
    if !in_child() {
        for mode in ["1", "auto"] {
            run_alone(TEST, &[("FLATNN_CUDNN", mode)]);
        }
        return;
    }
    let cpu = lenet5().build().unwrap().init(Init::HeNormal, 21);
    let mut models = [on_gpu(&cpu, &device, fp32(true)), on_gpu(&cpu, &device, fp32(true))];
    // the larger cache first: it measures every path
    let mut caches: Vec<_> = models
        .iter()
        .zip([256, 64])
        .map(|(m, capacity)| (m.preallocate(capacity).unwrap(), m.preallocate_grads(capacity).unwrap()))
        .collect();
    let mut opts: Vec<_> = models.iter().map(|m| Optimizer::new(m, Optim::adam(1e-3)).unwrap()).collect();
    let mut rng = Rng::new(22);
    for step in 0..12 {
        let n = if step % 3 == 2 { 17 } else { 64 };
        let (x, labels) = batch(&mut rng, &models[0], n);
        for ((model, (fwd, bwd)), opt) in models.iter_mut().zip(&mut caches).zip(&mut opts) {
            fwd.set_inputs(&x).unwrap();
            fwd.set_labels(&labels).unwrap();
            model.backprop(bwd, fwd, Loss::LogitCrossEntropy).unwrap();
            opt.update(model, bwd).unwrap();
        }
    }
    let reports: Vec<String> = caches.iter().map(|(fwd, _)| fwd.conv_backends()).collect();
    println!("capacity 256:\n{}\ncapacity 64:\n{}", reports[0], reports[1]);
    assert_eq!(reports[0], reports[1], "the two caches took different paths");
    let params: Vec<Vec<f32>> = models.iter().map(|m| m.parameters().unwrap().into_owned()).collect();
    assert!(params[0].iter().all(|v| v.is_finite()));
    assert!(params[0] == params[1], "parameters differ: rel err {:e}", rel_err(&params[1], &params[0]));
}

/// A cache dropped in the middle of training and a new one of the same capacity in its place
/// (which may be given the freed cache's addresses): the gradients' captured graphs must not
/// replay against the old cache's buffers or cuDNN workspace. The same bits as training with one
/// cache throughout.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_new_cache_in_a_freed_caches_place_trains_as_the_old_one() {
    let device = cuda_device();
    let cpu = lenet5().build().unwrap().init(Init::HeNormal, 31);
    let run = |swap: bool| -> Vec<f32> {
        let mut model = on_gpu(&cpu, &device, fp32(true));
        let (mut fwd, mut bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
        let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
        let mut rng = Rng::new(32);
        for step in 0..8 {
            if swap && step == 4 {
                drop(fwd);
                fwd = model.preallocate(32).unwrap();
            }
            let (x, labels) = batch(&mut rng, &model, 32);
            fwd.set_inputs(&x).unwrap();
            fwd.set_labels(&labels).unwrap();
            model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
            opt.update(&mut model, &bwd).unwrap();
        }
        model.parameters().unwrap().into_owned()
    };
    let (once, swapped) = (run(false), run(true));
    assert!(once.iter().all(|v| v.is_finite()));
    assert!(swapped == once, "parameters differ: rel err {:e}", rel_err(&swapped, &once));
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_model_without_convolutions_reports_nothing() {
    let device = cuda_device();
    let model = flatnn::models::mlp().build().unwrap().to(&device).unwrap();
    assert_eq!(model.preallocate(4).unwrap().conv_backends(), "");
    let cpu = lenet5().build().unwrap();
    assert_eq!(cpu.preallocate(4).unwrap().conv_backends(), "");
}

/// The cuDNN algorithms the report names (`cudnn NAME`, each with what follows it up to the
/// next `;`), by direction.
fn cudnn_algorithms(report: &str) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    for line in report.lines() {
        for part in line.split(';') {
            for dir in ["forward", "weight grad", "input grad"] {
                let Some((_, rest)) = part.split_once(&format!(" {dir} ")) else { continue };
                let Some((_, named)) = rest.split_once("cudnn ") else { continue };
                if !named.starts_with('-') {
                    out.push((dir, named.trim_end_matches(')').to_string()));
                }
            }
        }
    }
    out
}

/// Whether cuDNN's `name` (as the report spells it) is one flatnn may run for `dir` in plain
/// FP32 with non-deterministic algorithms allowed: the product algorithms (no FFT, no
/// Winograd), and "(non-deterministic)" only after those cuDNN documents as atomic.
fn allowed(dir: &str, named: &str) -> bool {
    let (products, atomic): (&[&str], &[&str]) = match dir {
        "forward" => (&["FWD_ALGO_IMPLICIT_GEMM", "FWD_ALGO_IMPLICIT_PRECOMP_GEMM", "FWD_ALGO_GEMM", "FWD_ALGO_DIRECT"], &[]),
        "weight grad" => (&["BWD_FILTER_ALGO_0", "BWD_FILTER_ALGO_1", "BWD_FILTER_ALGO_3"], &["BWD_FILTER_ALGO_0", "BWD_FILTER_ALGO_3"]),
        _ => (&["BWD_DATA_ALGO_0", "BWD_DATA_ALGO_1"], &["BWD_DATA_ALGO_0"]),
    };
    let name = named.split_whitespace().next().unwrap_or("");
    let marked = named.contains("(non-deterministic)");
    products.contains(&name) && (!marked || atomic.contains(&name)) && !named.contains("MATH")
}

/// `GpuOptions { deterministic: false, .. }` with cuDNN wherever it has an algorithm
/// (`FLATNN_CUDNN=1`): LeNet (batches of 32 and 17) and the zoo's VGG (128 and 17) train 20
/// Adam steps within 2e-3 (relative, parameters and losses) of the CPU twin, where the atomic
/// algorithms were measured 3e-4 to 8e-4 from it on LeNet (deterministic ones ~1e-7); the
/// report names only product algorithms in FP32, marks the atomic ones, and says the setups
/// allow them. Deterministic models trained after them in the same process take none of their
/// choices (which every later model would, were the process's measurements not told apart):
/// their reports mark nothing, and two of them compute the same bits.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn non_deterministic_algorithms_train_near_the_cpu_and_stay_apart() {
    const TEST: &str = "non_deterministic_algorithms_train_near_the_cpu_and_stay_apart";
    let device = cuda_device();
    if cudnn_version().is_none() {
        println!("skipped: no cuDNN 9 library");
        return;
    }
    if !in_mode(TEST, "1") {
        return;
    }
    let any_order = GpuOptions { deterministic: false, ..fp32(true) };
    for (name, chain, sizes) in [("lenet", lenet5(), [32, 17]), ("vgg_small", flatnn::models::vgg_small(), [128, 17])] {
        let cpu = chain.build().unwrap().init(Init::HeNormal, 41).with_threads(1).unwrap();
        let (cpu_losses, cpu_params, _) = train_at(&cpu, 42, sizes);
        let (losses, params, report) = train_at(&on_gpu(&cpu, &device, any_order), 42, sizes);
        println!("{name}, non-deterministic allowed:\n{report}");
        let setups = format!("batch {} FP32 (non-deterministic allowed),", sizes[0]);
        assert!(report.lines().any(|l| l.starts_with(&setups)), "{name}: the setups do not say so: {report}");
        let algorithms = cudnn_algorithms(&report);
        assert!(algorithms.iter().any(|(dir, _)| *dir == "weight grad"), "{name}: no weight gradient through cuDNN: {report}");
        for (dir, named) in &algorithms {
            assert!(allowed(dir, named), "{name}: {dir} {named:?} is not allowed: {report}");
        }
        let atomic = algorithms.iter().filter(|(_, n)| n.contains("(non-deterministic)")).count();
        let (loss_err, params_err) = (rel_err(&losses, &cpu_losses), rel_err(&params, &cpu_params));
        println!("{name}: {atomic} of {} cuDNN algorithms non-deterministic; 20 steps: losses rel err {loss_err:.2e}, parameters {params_err:.2e}", algorithms.len());
        assert!(params.iter().all(|v| v.is_finite()), "{name}");
        assert!(loss_err <= 2e-3 && params_err <= 2e-3, "{name}: losses {loss_err:e}, parameters {params_err:e}");

        // deterministic, after them: nothing of theirs taken, the same bits twice
        let (det_losses, det_params, det_report) = train_at(&on_gpu(&cpu, &device, fp32(true)), 42, sizes);
        let (again_losses, again_params, again_report) = train_at(&on_gpu(&cpu, &device, fp32(true)), 42, sizes);
        for r in [&det_report, &again_report] {
            assert!(!r.contains("non-deterministic"), "{name}: a deterministic model's report: {r}");
            assert!(cudnn_algorithms(r).iter().all(|(dir, named)| allowed(dir, named)), "{r}");
        }
        let det_err = rel_err(&det_params, &cpu_params);
        println!("{name}: deterministic, 20 steps: parameters rel err {det_err:.2e}");
        // 20 Adam steps of vgg_small drift from the CPU's order of sums as far either way (H200:
        // 5.75e-4 deterministic, 5.85e-4 not); what determinism promises is the bits below
        assert!(det_err <= 2e-3, "{name}: deterministic parameters differ from the CPU's by {det_err:e}");
        assert!(again_losses == det_losses, "{name}: two deterministic models' losses differ");
        assert!(again_params == det_params, "{name}: parameters differ: rel err {:e}", rel_err(&again_params, &det_params));
    }
}
