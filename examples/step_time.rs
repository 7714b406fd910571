//! Times one kind of call at one batch size: a training step (backprop + Adam) or inference
//! (set_inputs + forward), median and p90 over repeated calls, on any device. Small enough to
//! run under a profiler (`ncu`, `compute-sanitizer`).
//!
//!   cargo run --release --example step_time -- [--model mlp|lenet|simplenn|autoencoder|gelu_mlp|vgg_small|resnet_small|ts_conv1d|gru_seq|lstm_seq]
//!       [--task train|train-split|train-copy|train-host|backprop|forward|forward-resident|serve|serve-resident]
//!       [--batch N] [--calls N] [--device cpu|cuda|cuda:N] [--graphs on|off] [--tf32 on|off] [--threads N]
//!       [--profile N]
//!       [--conv auto|cudnn|own] [--flush-subnormals on|off]
//!
//! `train-copy` sets the inputs from the host before every step, `train-host` the labels (or
//! targets) too, as a training loop over host data does; `train` keeps the batch on the device.
//! `train` is `Optimizer::train_step` (on a GPU, backprop and the update in one graph);
//! `train-split` the same step as `backprop` and then `update` (two launches); `backprop` is
//! the step without the optimiser's update.
//! `serve` and `serve-resident` time the same call as `forward` and `forward-resident` through a
//! [`Server`] (a resident kernel where the model allows one).
//!
//! `--profile N` runs N more calls, each waited for, between the CUDA profiler's start and stop
//! (`ncu --profile-from-start off` then profiles those alone, not the first calls' measuring).
//! `--conv` sets `FLATNN_CUDNN` (auto, 1, 0) for a model with convolutions on a GPU. The cache's
//! report (`Cache::routes`: which route each layer and direction took, and the others' times) is
//! printed before the times. `--flush-subnormals on` sets flush-to-zero and denormals-are-zero
//! on this program's thread (x86-64), as a program that wants them does on its own: flatnn's
//! pool threads take the mode of the thread that calls them.

#[path = "../benches/common/flush.rs"]
mod flush;

use flatnn::models;
use flatnn::prelude::*;
use flatnn::testutil::Rng;
use std::time::Instant;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (mut name, mut task, mut batch, mut calls, mut device, mut graphs, mut threads) =
        ("mlp".to_string(), "train".to_string(), 128usize, 1000usize, Device::Cpu, true, 1usize);
    let (mut profile, mut tf32) = (0usize, false);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = |v: &str| v.parse::<usize>().map_err(|_| format!("{flag}: {v:?} is not a whole number"));
        match flag.as_str() {
            "--model" => name = value,
            "--task" => task = value,
            "--batch" => batch = number(&value)?,
            "--calls" => calls = number(&value)?,
            "--threads" => threads = number(&value)?,
            "--profile" => profile = number(&value)?,
            "--device" => device = Device::parse(&value)?,
            "--graphs" => graphs = value == "on",
            "--tf32" => tf32 = value == "on",
            "--flush-subnormals" => match value.as_str() {
                "on" => flush::flush_subnormals()?,
                "off" => {}
                _ => return Err(format!("--flush-subnormals must be on or off, not {value:?}").into()),
            },
            "--conv" => {
                let mode = match value.as_str() {
                    "auto" => "auto",
                    "cudnn" => "1",
                    "own" => "0",
                    _ => return Err(format!("--conv must be auto, cudnn or own, not {value:?}").into()),
                };
                // read when the cache is made, below; nothing else runs yet
                std::env::set_var("FLATNN_CUDNN", mode);
            }
            _ => return Err(format!("unknown option {flag}").into()),
        }
    }
    let (chain, loss) = match name.as_str() {
        "mlp" => (models::mlp(), Loss::LogitCrossEntropy),
        "simplenn" => (models::simplenns_mlp(), Loss::Mse),
        "lenet" => (models::lenet5(), Loss::LogitCrossEntropy),
        "autoencoder" => (models::autoencoder(), Loss::Mse),
        "gelu_mlp" => (models::gelu_mlp(), Loss::LogitCrossEntropy),
        "vgg_small" => (models::vgg_small(), Loss::LogitCrossEntropy),
        "resnet_small" => (models::resnet_small(), Loss::LogitCrossEntropy),
        "ts_conv1d" => (models::ts_conv1d(), Loss::LogitCrossEntropy),
        "gru_seq" => (models::gru_seq(), Loss::Mse),
        "lstm_seq" => (models::lstm_seq(), Loss::LogitCrossEntropy),
        _ => {
            let names = "mlp, lenet, simplenn, autoencoder, gelu_mlp, vgg_small, resnet_small, ts_conv1d, gru_seq or lstm_seq";
            return Err(format!("--model must be {names}, not {name:?}").into());
        }
    };
    let tasks = ["train", "train-split", "train-copy", "train-host", "backprop", "forward", "forward-resident", "serve", "serve-resident"];
    if !tasks.contains(&task.as_str()) {
        return Err(format!("--task must be one of {}, not {task:?}", tasks.join(", ")).into());
    }
    if batch == 0 || calls == 0 {
        return Err("--batch and --calls must be at least 1".into());
    }
    if profile > 0 && device == Device::Cpu {
        return Err("--profile profiles CUDA calls: it needs --device cuda".into());
    }
    let options = GpuOptions { graphs, tf32, ..GpuOptions::default() };
    let mut model = chain.build()?.init(Init::HeNormal, 1).with_threads(threads)?.with_gpu_options(options)?.to(&device)?;
    let mut rng = Rng::new(3);
    let inputs = rng.uniform(batch * model.input_shape().len());
    let outputs = model.output_shape().len();
    let label = |graphs: bool| format!("{name} {task} batch {batch} on {device} (graphs {})", if graphs { "on" } else { "off" });
    if task.starts_with("serve") {
        let mut server = model.serve(batch)?;
        server.set_inputs(&inputs)?;
        let (per_call, times) = measure(calls, |_| {
            // serve-resident: the batch stays where the last set_inputs put it
            if task == "serve" {
                server.set_inputs(&inputs)?;
            }
            server.forward().map(|_| ())
        })?;
        report(&format!("{} (resident kernel: {})", label(graphs), server.is_resident()), per_call, &times, "");
        return Ok(());
    }
    let mut fwd = model.preallocate(batch)?;
    let mut bwd = model.preallocate_grads(batch)?;
    let mut opt = Optimizer::new(&model, Optim::adam(1e-4))?;
    fwd.set_inputs(&inputs)?;
    let (targets, labels) = (rng.uniform(batch * outputs), (0..batch).map(|i| (i % outputs) as u32).collect::<Vec<_>>());
    if loss.takes_labels() {
        fwd.set_labels(&labels)?
    } else {
        fwd.set_targets(&targets)?
    }
    let mut call = |wait: bool| -> flatnn::Result<()> {
        if task == "forward" || task == "forward-resident" {
            // forward-resident: the batch stays where set_inputs put it (no copy in)
            if task == "forward" {
                fwd.set_inputs(&inputs)?;
            }
            model.forward(&mut fwd)?;
        } else {
            if task == "train-copy" || task == "train-host" {
                // the inputs copied in from the host every step
                fwd.set_inputs(&inputs)?;
            }
            if task == "train-host" {
                // and the labels or targets too, as a training loop over host data
                if loss.takes_labels() {
                    fwd.set_labels(&labels)?
                } else {
                    fwd.set_targets(&targets)?
                }
            }
            if task == "backprop" || task == "train-split" {
                model.backprop(&mut bwd, &mut fwd, loss)?;
            } else {
                opt.train_step(&mut model, &mut bwd, &mut fwd, loss)?;
            }
            if task == "train-split" {
                opt.update(&mut model, &bwd)?;
            }
            if wait {
                bwd.last_loss()?;
            }
        }
        Ok(())
    };
    let (per_call, times) = measure(calls, &mut call)?;
    // Host time to queue one training step (the device idle at the start, no wait between):
    // where it is near the back-to-back time, the host, not the device, sets the pace.
    let queue_time = if task.starts_with("train") || task == "backprop" {
        let mut queued: Vec<f64> = (0..calls.min(100))
            .map(|_| {
                let start = Instant::now();
                call(false).map(|()| start.elapsed().as_secs_f64())
            })
            .collect::<flatnn::Result<_>>()?;
        call(true)?;
        queued.sort_by(f64::total_cmp);
        format!("; host time to queue one: p50 {:.1} µs", queued[queued.len() / 2] * 1e6)
    } else {
        String::new()
    };
    if profile > 0 {
        profiled(profile, &mut call)?;
    }
    let routes = fwd.routes();
    if !routes.is_empty() {
        println!("{routes}");
    }
    report(&label(graphs), per_call, &times, &queue_time);
    Ok(())
}

/// `calls` more calls, each waited for, between the driver's profiler start and stop: with
/// `ncu --profile-from-start off` only these are profiled, not the measuring of routes and
/// algorithms that the first calls did (which the profiler's replays would distort).
#[cfg(feature = "cuda")]
fn profiled(calls: usize, call: &mut impl FnMut(bool) -> flatnn::Result<()>) -> Result<(), Box<dyn std::error::Error>> {
    use cudarc::driver::sys;
    // SAFETY: no arguments; the calls below made the context current on this thread.
    unsafe { sys::cuProfilerStart() }.result()?;
    (0..calls).try_for_each(|_| call(true))?;
    // SAFETY: as above.
    unsafe { sys::cuProfilerStop() }.result()?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn profiled(_: usize, _: &mut impl FnMut(bool) -> flatnn::Result<()>) -> Result<(), Box<dyn std::error::Error>> {
    Err("--profile needs the cuda feature".into())
}

/// Times `call` (its argument: whether the host waits for the result): `calls` calls back to
/// back with one wait at the end (seconds a call), then up to 2,000 calls each waited for
/// (seconds each, sorted), after 20 warm-up calls.
fn measure(calls: usize, mut call: impl FnMut(bool) -> flatnn::Result<()>) -> flatnn::Result<(f64, Vec<f64>)> {
    for _ in 0..calls.min(20) {
        call(true)?;
    }
    let start = Instant::now();
    for i in 0..calls {
        call(i + 1 == calls)?;
    }
    let per_call = start.elapsed().as_secs_f64() / calls as f64;
    let mut times: Vec<f64> = (0..calls.min(2000))
        .map(|_| {
            let start = Instant::now();
            call(true).map(|()| start.elapsed().as_secs_f64())
        })
        .collect::<flatnn::Result<_>>()?;
    times.sort_by(f64::total_cmp);
    Ok((per_call, times))
}

fn report(what: &str, per_call: f64, times: &[f64], extra: &str) {
    let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)] * 1e6;
    println!(
        "{what}: {:.1} µs per call queued back to back; waited each: p50 {:.1} µs, p90 {:.1} µs{extra}",
        per_call * 1e6,
        at(0.5),
        at(0.9)
    );
}
