//! Tests of the CUDA layer. The CPU-only ones run everywhere; every GPU test is `#[ignore]`d
//! (the runner counts it as ignored; `--include-ignored` runs it) and starts with `test_gpu()`,
//! which fails the test, saying why, where CUDA is missing.

mod blaslt;
mod conv;
mod conv_direct;
mod conv_lowering;
mod conv_mma;
mod conv_mma_wgrad;
mod conv_wgrad;
mod dense;
mod dense_mma;
mod head;
mod infer;
mod layers;
mod norm;
mod ops;

use super::context::{activation_prelude, source_files, KERNELS};
use super::*;
use crate::activation::Activation;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};

/// Uploads `data` to a new device buffer.
fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, data: &[T]) -> CudaSlice<T> {
    stream.clone_htod(data).expect("upload")
}

/// Waits for the stream, then copies `buf` back.
fn download<T: DeviceRepr + Default + Clone>(stream: &Arc<CudaStream>, buf: &CudaSlice<T>) -> Vec<T> {
    stream.synchronize().expect("kernel ran");
    let out = stream.clone_dtoh(buf).expect("download");
    stream.synchronize().expect("copy done");
    out
}

/// Asserts |got − want| ≤ atol + rtol·|want| everywhere (NaN fails unless both are the same
/// NaN bits) and prints the largest errors, for the record.
fn check(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut max_abs, mut max_rel) = (0.0f32, 0.0f32);
    let mut bad = Vec::new();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() == w.to_bits() {
            continue;
        }
        let err = (g - w).abs();
        if (err.is_nan() || err > atol + rtol * w.abs()) && bad.len() < 5 {
            bad.push(format!("[{i}] {g} vs {w}"));
        }
        max_abs = max_abs.max(err);
        if w != 0.0 {
            max_rel = max_rel.max(err / w.abs());
        }
    }
    println!("{what}: {} values, max |err| {max_abs:e}, max rel err {max_rel:e}", got.len());
    assert!(bad.is_empty(), "{what}: {}", bad.join(", "));
}

/// Asserts two runs gave the same bits.
fn same_bits(what: &str, a: &[f32], b: &[f32]) {
    assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) && a.len() == b.len(), "{what}: runs differ");
}

#[test]
fn every_launched_kernel_is_defined_in_the_sources() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .expect("kernels/ exists")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".cu"))
        .collect();
    on_disk.sort();
    // the main program's files, and the fused recurrences' (compiled apart)
    let sources: Vec<_> = source_files().into_iter().chain([super::rnn_fused::SOURCE]).collect();
    let mut compiled: Vec<String> = sources.iter().map(|(name, _)| name.to_string()).collect();
    compiled.sort();
    assert_eq!(on_disk, compiled, "every kernels/*.cu file is compiled, and only those");
    let mut defined = Vec::new();
    let mut optim_early = Vec::new();
    for (name, text) in &sources {
        let file = *name;
        let on_disk = std::fs::read_to_string(dir.join(name)).unwrap();
        assert_eq!(&on_disk, text, "{name} changed since the build");
        let mut rest = *text;
        while let Some(at) = rest.find("extern \"C\" __global__ ") {
            rest = &rest[at + "extern \"C\" __global__ ".len()..];
            // an occupancy bound may come before the return type
            if let Some(bounded) = rest.strip_prefix("__launch_bounds__(") {
                rest = bounded[bounded.find(')').unwrap() + 1..].trim_start();
            }
            rest = rest.strip_prefix("void ").expect("a kernel returns void");
            // the name is the last word before the parameters (an attribute such as a
            // cluster's dimensions may come before it)
            let name = rest[..rest.find('(').unwrap()].split_whitespace().last().unwrap().to_string();
            // Launched as programmatic dependents: nothing may run before the wait, except a
            // dense product's loads of B when the launch says B is weights that the kernel
            // ahead does not write (`b_early`; the wait follows those loads in dense.cu and
            // dense_mma.cu)
            let (params, body) = rest.split_at(rest.find('{').unwrap());
            if name.starts_with("dense_head") {
                // both heads are dense_head_impl, checked below
                assert!(params.contains("(HEAD_PARAMS)"), "{name} does not take HEAD_PARAMS");
                assert!(body[1..].trim_start().starts_with("dense_head_impl<"), "{name} is not dense_head_impl");
            } else if name.starts_with("dense_") {
                assert!(params.contains("int b_early)"), "kernel {name} does not take b_early");
            } else if file == "optim.cu" && name != "grad_norm" {
                // the optimisers, with `early`, read their first values before the wait: checked below
                assert!(params.contains("int early)"), "kernel {name} does not take early");
                assert!(body[1..].trim_start().starts_with("OPTIM_EARLY;"), "kernel {name} does not begin with OPTIM_EARLY");
                let early = &body[..body.find("after_prior();").expect("an optimiser waits")];
                optim_early.push((name.clone(), early.to_string()));
            } else {
                assert!(body[1..].trim_start().starts_with("after_prior();"), "kernel {name} does not begin with after_prior()");
            }
            // the DENSE_MMA macro's kernels are named below, from its uses
            if !name.contains("##") {
                defined.push(name);
            }
        }
    }
    // The heads stage the layers' weights (from `params`) before the wait when told the kernel
    // ahead does not write them, and touch no other buffer before it
    let head = sources.iter().find(|(name, _)| *name == "head.cu").unwrap().1;
    let params = &head[head.find("#define HEAD_PARAMS").expect("head.cu defines HEAD_PARAMS")..];
    assert!(params[..params.find("\n#define").unwrap()].ends_with("int weights_early"), "the heads do not take weights_early last");
    let body = &head[head.find("void dense_head_impl(HEAD_PARAMS) {").expect("head.cu defines dense_head_impl")..];
    let first = body.find("if (!weights_early) after_prior();").expect("dense_head waits first without weights_early");
    let declarations = ["extern __shared__ ", "__shared__ "];
    for line in body[body.find('{').unwrap() + 1..first].lines().map(str::trim) {
        assert!(line.is_empty() || declarations.iter().any(|d| line.starts_with(d)), "dense_head: {line:?} before the wait");
    }
    let early = &body[first..body.find("if (weights_early) after_prior();").expect("dense_head waits after staging")];
    for buffer in ["acts", "labels", "targets", "partials"] {
        assert!(!early.contains(buffer), "dense_head reads {buffer} before the wait");
    }
    // besides staging, it only clears the gradients that split weight gradients add into,
    // which nothing ahead of it in the step touches
    assert_eq!(early.matches("clear[").count(), 1, "dense_head writes nothing but `clear` before the wait");
    assert!(early.contains("GRID_STRIDE(i, clear_len) clear[i] = 0.0f;"), "dense_head clears `clear` before the wait");
    // the tensor-core tiles are defined by three macros: DENSE_MMA_ENTRY (one kernel, which
    // takes b_early), used by DENSE_MMA_KERNEL for a layout's 3xTF32 kernel and its one-product
    // one (`_tf32`), used by DENSE_MMA for the two layouts of a tile shape
    let source = |file: &str| sources.iter().find(|(name, _)| *name == file).unwrap_or_else(|| panic!("{file} is compiled")).1;
    let dense_mma = source("dense_mma.cu");
    let macro_body = |name: &str| {
        let body = &dense_mma[dense_mma.find(&format!("#define {name}(")).unwrap_or_else(|| panic!("dense_mma.cu defines {name}"))..];
        &body[..body.find("\n#define").unwrap_or(body.len())]
    };
    assert_eq!(macro_body("DENSE_MMA_ENTRY").matches("int b_early)").count(), 1, "DENSE_MMA_ENTRY's kernel takes b_early");
    let entries = macro_body("DENSE_MMA_KERNEL").split("DENSE_MMA_ENTRY(BM, BN, NAME, AK, SPLIT, ").skip(1);
    let suffixes: Vec<&str> = entries.map(|rest| rest[rest.find(", ").unwrap() + 2..rest.find(')').unwrap()].trim()).collect();
    assert_eq!(suffixes, ["", "_tf32"], "the kernels of a tile shape and layout");
    let mma = &dense_mma[dense_mma.find("#define DENSE_MMA(").expect("dense_mma.cu defines DENSE_MMA")..];
    let mma = &mma[..mma.find("\nDENSE_MMA(").unwrap()];
    let names: Vec<&str> = mma.split("DENSE_MMA_KERNEL(BM, BN, ").skip(1).map(|rest| &rest[..rest.find(',').unwrap()]).collect();
    assert_eq!(names, ["kk", "mn"], "the kernels of a tile shape");
    let mut tiles = Vec::new();
    for line in dense_mma.lines().filter(|l| l.starts_with("DENSE_MMA(")) {
        let shape: Vec<&str> = line["DENSE_MMA(".len()..line.len() - 1].split(", ").collect();
        tiles.extend(names.iter().map(|name| format!("dense_mma_{}x{}_{name}", shape[0], shape[1])));
    }
    // and one more kernel of one shape
    for line in dense_mma.lines().filter(|l| l.starts_with("DENSE_MMA_KERNEL(")) {
        let args: Vec<&str> = line["DENSE_MMA_KERNEL(".len()..line.len() - 1].split(", ").collect();
        tiles.push(format!("dense_mma_{}x{}_{}", args[0], args[1], args[2]));
    }
    defined.extend(tiles.iter().flat_map(|tile| suffixes.iter().map(move |suffix| format!("{tile}{suffix}"))));
    // in the dense products, the only work before the wait is in `if (b_early) { .. }` just
    // ahead of it: loads of B and of the epilogue's inputs
    let products = [("dense.cu", "row-chunked, panels", 2), ("dense_mma.cu", "tensor-core tiles", 1)];
    for (file, kernels, count) in products {
        let text = source(file);
        let waits: Vec<usize> = text.match_indices("after_prior(").map(|(at, _)| at).collect();
        assert_eq!(waits.len(), count, "{file}: one wait in each of its products ({kernels})");
        for at in waits {
            let early = &text[text[..at].rfind("if (b_early) {").expect("loads before the wait only with b_early")..at];
            for line in early.lines().skip(1).map(str::trim) {
                let allowed = [
                    "}",
                    "dense_skinny_load_b<",
                    "dense_panel_load_b(",
                    "if (stores) e = dense_epilogue_in(",
                    "e0 = dense_epilogue_in(",
                    "e1 = dense_epilogue_in(",
                    "for (int s = 0; s < MMA_STAGES - 1 && s < slices; s++) b_in.load(",
                    "epilogue_in();",
                ];
                assert!(line.is_empty() || allowed.iter().any(|a| line.starts_with(a)), "{file}: {line:?} before the wait");
            }
        }
    }
    // Before its wait an optimiser only reads, where `early` says so (OPTIM_EARLY's `pre`), the
    // thread's first value of each of its buffers but the gradient and the norm, which the
    // kernels ahead of it write (every statement after OPTIM_EARLY is
    // `float x0 = pre ? x[first] : 0.0f, …;`)
    assert_eq!(optim_early.len(), 4, "sgd, sgd_momentum, adam and rmsprop");
    for (name, early) in &optim_early {
        let statements = early[1..].trim().strip_prefix("OPTIM_EARLY;").unwrap().trim();
        for declaration in statements.split(';').map(str::trim).filter(|d| !d.is_empty()) {
            let values = declaration.strip_prefix("float ").unwrap_or_else(|| panic!("{name}: {declaration:?} before the wait"));
            for value in values.split(", ") {
                let (_, read) = value.split_once(" = pre ? ").unwrap_or_else(|| panic!("{name}: {value:?} before the wait"));
                let buffer = read.strip_suffix("[first] : 0.0f").unwrap_or_else(|| panic!("{name}: {read:?} before the wait"));
                let written_ahead = buffer == "g" || buffer == "norm";
                assert!(!written_ahead && buffer.chars().all(|c| c.is_ascii_alphanumeric()), "{name} reads {buffer} before the wait");
            }
        }
    }
    for kernel in KERNELS {
        assert!(defined.iter().any(|d| d == kernel), "kernel {kernel} is launched but not defined in kernels/*.cu");
    }
    for d in &defined {
        let looked_up = KERNELS.contains(&d.as_str()) || super::rnn_fused::kernel_names().contains(d);
        assert!(looked_up, "kernel {d} is defined but never looked up");
    }
}

/// Every activation of the Rust enum has its device functions in kernels/activation.cu; the
/// prelude NVRTC reads first gives each kind its id (its place in the enum) and a case of the
/// switches that call those functions; and no kernel file compares an activation id with a
/// number, or switches on one, by itself.
#[test]
fn every_activation_has_its_device_functions_and_ids_from_the_enum() {
    let sources = source_files();
    let activation = sources.iter().find(|(name, _)| *name == "activation.cu").unwrap().1;
    let prelude = activation_prelude();
    println!("{prelude}");
    for (id, act) in Activation::ALL.iter().enumerate() {
        let name = act.kind_name();
        assert_eq!(act.gpu_id() as usize, id, "{name}: the id is its place in Activation::ALL");
        for function in
            [format!("float act_apply_{name}(float p, float z) {{"), format!("float act_derivative_{name}(float p, float z, float y) {{")]
        {
            assert!(activation.contains(&function), "kernels/activation.cu does not define {function}");
        }
        assert!(prelude.contains(&format!("#define ACT_{} {id}\n", name.to_uppercase())), "{name}: no id in the prelude");
        for call in [format!(" return act_apply_{name}(slope, z); "), format!(" return act_derivative_{name}(slope, z, y); ")] {
            assert_eq!(prelude.matches(&call).count(), 1, "{name}: the prelude's switch does not call {call:?} once");
        }
    }
    assert!(activation.contains("ACT_APPLY_SWITCH(act, slope, z)") && activation.contains("ACT_DERIVATIVE_SWITCH(act, slope, z, y)"));
    for (file, text) in &sources {
        assert!(!text.contains("switch (act"), "{file} switches on an activation id itself");
        for line in text.lines() {
            let words: Vec<&str> = line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '=' || c == '!')).collect();
            for pair in words.windows(3) {
                let numbered = pair[2].starts_with(|c: char| c.is_ascii_digit());
                assert!(!(pair[0].starts_with("act") && (pair[1] == "!=" || pair[1] == "==") && numbered), "{file}: {line:?}");
            }
        }
    }
}

#[test]
fn probing_never_panics_and_errors_name_what_is_missing() {
    let functional = is_functional();
    let count = device_count();
    println!("is_functional = {functional}, device_count = {count}");
    assert!(!functional || count > 0);
    let Err(Error::Cuda { what }) = gpu(count + 3) else { panic!("device {} should not exist", count + 3) };
    if driver_present() {
        assert!(what.contains(&format!("no CUDA device {} ({count} present)", count + 3)) || what.contains("not found"), "{what}");
    } else {
        assert!(what.contains("libcuda not found"), "{what}");
        assert!(matches!(device_info(0), Err(Error::Cuda { .. })));
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn device_info_reads_the_device() {
    let gpu = test_gpu();
    let info = device_info(0).unwrap();
    println!("device 0: {info:?}; {gpu:?}, {} SMs", gpu.multiprocessors());
    assert!(info.total_memory > 0 && info.free_memory <= info.total_memory);
    assert_eq!(info.compute_capability, gpu.compute_capability());
    assert!(Arc::ptr_eq(&gpu, &super::gpu(0).unwrap()), "one Gpu per device per process");
}

/// The kernels that stage through shared memory ask for the most of it an SM can give (see
/// `SHARED_CARVEOUT_KERNELS` in src/cuda/context.rs); the others leave it to the driver.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn staging_kernels_ask_for_the_largest_shared_memory_split() {
    use super::context::{Kernel, CARVEOUT_MAX_SHARED, SHARED_CARVEOUT_KERNELS};
    let gpu = test_gpu();
    if std::env::var("FLATNN_CARVEOUT").is_ok_and(|v| v == "0") {
        println!("skipped: FLATNN_CARVEOUT=0");
        return;
    }
    let carveout = |kernel: Kernel| {
        let mut value = 0;
        let attribute = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT;
        // SAFETY: writes one int; a kernel of the device's module.
        unsafe { cudarc::driver::sys::cuFuncGetAttribute(&mut value, attribute, gpu.function(kernel)) }.result().unwrap();
        value
    };
    let tiles = super::dense::MMA_TILES.iter().flat_map(|t| t.kernels());
    for kernel in SHARED_CARVEOUT_KERNELS.into_iter().chain(tiles) {
        assert_eq!(carveout(kernel), CARVEOUT_MAX_SHARED, "{kernel:?}");
    }
    for kernel in [Kernel::DenseHead, Kernel::Adam, Kernel::LossSum, Kernel::BiasActForward] {
        assert_ne!(carveout(kernel), CARVEOUT_MAX_SHARED, "{kernel:?}");
    }
}

#[global_allocator]
static COUNTING: crate::testutil::Counting = crate::testutil::Counting;

/// A captured step makes no stream-ordered allocations: cuBLAS keeps the workspace it was given
/// (`cublasSetStream` drops it, so it is set again after), at every batch where cuBLAS runs.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn captured_steps_hold_no_allocation_nodes() {
    let _gpu = test_gpu();
    let device = crate::device::Device::Cuda(0);
    let model = crate::models::mlp().build().unwrap().init(crate::init::Init::HeNormal, 3).to(&device).unwrap();
    let mut opt = crate::optim::Optimizer::new(&model, crate::optim::Optim::adam(1e-3)).unwrap();
    let mut model = model;
    let mut rng = crate::testutil::Rng::new(4);
    for batch in [1, 128, 1024] {
        let (mut fwd, mut bwd) = (model.preallocate(batch).unwrap(), model.preallocate_grads(batch).unwrap());
        let (x, labels) = crate::testutil::batch(&mut rng, &model, batch);
        fwd.set_inputs(&x).unwrap();
        fwd.set_labels(&labels).unwrap();
        model.backprop(&mut bwd, &mut fwd, crate::loss::Loss::LogitCrossEntropy).unwrap();
        opt.update(&mut model, &bwd).unwrap();
        model.forward(&mut fwd).unwrap();
        assert!(bwd.last_loss().unwrap().is_finite());
    }
    let allocations = super::graph::ALLOCATION_NODES.with(|c| c.get());
    assert_eq!(allocations, 0, "allocation and free nodes in the captured MLP steps");
}

/// A capture that fails, because the work returned an error or because it did something a
/// capture forbids (waiting for the stream), is an `Err`; nothing is kept under its key or run,
/// and the stream captures and replays the next work as usual.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_failed_capture_is_an_err_and_the_stream_goes_on() {
    use super::graph::{Graphs, Key};
    use super::launch::{View, ViewMut};
    use crate::activation::Activation::Identity;
    use crate::error::Error;
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let (five, one) = (upload(&stream, &[5.0f32; 4]), upload(&stream, &[1.0f32; 4]));
    let z = upload(&stream, &[0.0f32; 4]);
    let zp = View::of(&z).ptr();
    // z += bias, queued on the stream (captured, during a capture)
    let add = |bias: &CudaSlice<f32>| {
        // SAFETY: `z`, four values, lives to the end of the test; only this stream touches it.
        gpu.bias_act(&stream, Identity, View::of(bias), 4, 1, 1, unsafe { ViewMut::from_raw(zp, 4) }, None, true)
    };
    let mut graphs = Graphs::new();
    let key = Key {
        kind: 0,
        loss_param: 0,
        capacity: 1,
        batch: 1,
        tf32: false,
        deterministic: true,
        cache: u64::MAX,
        buffers: [zp, 0, 0, 0],
        model: [0, 0],
        update: None,
        reduce: 0,
    };
    let planted = graphs.run(true, &stream, key, || {
        add(&five)?;
        Err(Error::Cuda { what: "planted".into() })
    });
    assert!(matches!(&planted, Err(Error::Cuda { what }) if what == "planted"), "{planted:?}");
    let forbidden = graphs.run(true, &stream, key, || {
        add(&five)?;
        stream.synchronize().map_err(|e| driver_error("waiting inside a capture", e))
    });
    assert!(forbidden.is_err(), "a wait inside a capture went through");
    // captured now, then replayed: two additions of 1, none of the 5s ran
    for _ in 0..2 {
        graphs.run(true, &stream, key, || add(&one)).unwrap();
    }
    assert_eq!(download(&stream, &z), [2.0f32; 4]);
}
