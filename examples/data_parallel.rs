//! Data-parallel scaling: training samples/s of the zoo's models on one GPU and on several
//! (`DataParallel`, one process), at global batches from 256 to 16384; the efficiency
//! (rate on n GPUs / (n × rate on one)); and, per model, the time of the step's reduction
//! (its gradients and loss, as the step's graph runs it) against a plain NCCL all-reduce of
//! the same gradients timed alone in a loop (NCCL's `all_reduce_perf` figure), both as bus
//! bandwidth, 2(n − 1)/n · bytes / t.
//!
//!   cargo run --release --example data_parallel -- [--gpus 1,2] [--models mlp,lenet5,...]
//!       [--batches 256,1024,4096,16384] [--seconds 0.3]
//!
//! A one-GPU figure runs the model on its own (`Optimizer::train_step`); an n-GPU figure runs
//! `DataParallel::train_step` on the same global batch. Each point sets its batch once, then
//! times steps (Adam) for about `--seconds`, waiting for the last at the end. A point that
//! cannot run (a batch too large for one kernel, or for memory) prints dashes and the reason,
//! and the bench goes on. The reduction is timed on the group of the largest batch that ran.
//! NCCL must load (`libnccl.so.2` on the library path).

use flatnn::models;
use flatnn::prelude::*;
use flatnn::testutil::Rng;
use std::time::{Duration, Instant};

/// A zoo model: its name, its layers and its loss.
type ZooModel = (&'static str, fn() -> Chain, Loss);

const MODELS: [ZooModel; 5] = [
    ("mlp", models::mlp, Loss::LogitCrossEntropy),
    ("lenet5", models::lenet5, Loss::LogitCrossEntropy),
    ("autoencoder", models::autoencoder, Loss::Mse),
    ("gelu_mlp", models::gelu_mlp, Loss::LogitCrossEntropy),
    ("vgg_small", models::vgg_small, Loss::LogitCrossEntropy),
];

struct Options {
    gpus: Vec<usize>,
    models: Vec<String>,
    batches: Vec<usize>,
    seconds: f64,
}

fn parse() -> Result<Options, String> {
    let mut o = Options {
        gpus: vec![1, 2],
        models: MODELS.iter().map(|(name, _, _)| name.to_string()).collect(),
        batches: vec![256, 512, 1024, 2048, 4096, 8192, 16384],
        seconds: 0.3,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let numbers =
            |v: &str| v.split(',').map(|n| n.trim().parse::<usize>().map_err(|_| format!("{flag}: {n:?}"))).collect::<Result<Vec<_>, _>>();
        match flag.as_str() {
            "--gpus" => o.gpus = numbers(&value)?,
            "--batches" => o.batches = numbers(&value)?,
            "--models" => o.models = value.split(',').map(str::to_string).collect(),
            "--seconds" => o.seconds = value.parse().map_err(|_| format!("--seconds: {value:?}"))?,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    if let Some(bad) = o.models.iter().find(|m| !MODELS.iter().any(|(name, _, _)| name == m)) {
        return Err(format!("unknown model {bad}"));
    }
    if o.gpus.iter().any(|&n| n == 0 || n > flatnn::cuda::device_count()) {
        return Err(format!("--gpus {:?}: this machine has {} CUDA devices", o.gpus, flatnn::cuda::device_count()));
    }
    Ok(o)
}

/// A global batch for `model` and `loss`: inputs, labels, targets.
fn data(model: &Model, loss: Loss, batch: usize) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let mut rng = Rng::new(1);
    let (inputs, outputs) = (rng.uniform(batch * model.input_shape().len()), model.output_shape().len());
    if loss.takes_labels() {
        (inputs, (0..batch).map(|_| rng.below(outputs) as u32).collect(), Vec::new())
    } else {
        // the autoencoder's sigmoid outputs: targets in [0, 1)
        (inputs, Vec::new(), rng.uniform(batch * outputs).iter().map(|v| 0.5 + 0.5 * v).collect())
    }
}

/// Seconds a step of `step` over about `seconds` (after 3 untimed); `step(true)` also waits
/// for the device (every 16th step, and the last).
fn time(seconds: f64, mut step: impl FnMut(bool) -> flatnn::Result<()>) -> flatnn::Result<f64> {
    for i in 0..3 {
        step(i == 2)?;
    }
    let (start, mut steps) = (Instant::now(), 0u32);
    loop {
        steps += 1;
        let last = steps >= 5 && start.elapsed().as_secs_f64() >= seconds;
        step(last || steps.is_multiple_of(16))?;
        if last {
            return Ok(start.elapsed().as_secs_f64() / f64::from(steps));
        }
    }
}

/// Seconds a training step of `batch` on one GPU.
fn one_gpu(model: &Model, loss: Loss, batch: usize, seconds: f64) -> flatnn::Result<f64> {
    let mut model = model.to(&Device::cuda(0)?)?;
    let (mut fwd, mut bwd) = (model.preallocate(batch)?, model.preallocate_grads(batch)?);
    let mut opt = Optimizer::new(&model, Optim::adam(1e-4))?;
    let (x, labels, targets) = data(&model, loss, batch);
    fwd.set_inputs(&x)?;
    if loss.takes_labels() {
        fwd.set_labels(&labels)?
    } else {
        fwd.set_targets(&targets)?
    }
    time(seconds, |wait| {
        opt.train_step(&mut model, &mut bwd, &mut fwd, loss)?;
        if wait {
            bwd.last_loss()?;
        }
        Ok(())
    })
}

/// Seconds a training step of global `batch` on `gpus` GPUs, and the group (for the
/// reduction's timing).
fn gpus(model: &Model, loss: Loss, batch: usize, count: usize, seconds: f64) -> flatnn::Result<(f64, DataParallel)> {
    let devices: Vec<Device> = (0..count).map(Device::Cuda).collect();
    let mut dp = DataParallel::new(model, &devices, batch, Optim::adam(1e-4))?;
    let (x, labels, targets) = data(model, loss, batch);
    dp.set_inputs(&x)?;
    if loss.takes_labels() {
        dp.set_labels(&labels)?
    } else {
        dp.set_targets(&targets)?
    }
    let t = time(seconds, |wait| {
        dp.train_step(loss)?;
        if wait {
            dp.synchronize()?;
        }
        Ok(())
    })?;
    Ok((t, dp))
}

/// 2(n − 1)/n · bytes / t, in GB/s.
fn bus_bandwidth(bytes: usize, gpus: usize, t: Duration) -> f64 {
    2.0 * (gpus - 1) as f64 / gpus as f64 * bytes as f64 / t.as_secs_f64() / 1e9
}

/// Per model and GPU count: the model, its gradients' length, the GPUs, and the reduction
/// timed on the group of the largest batch that ran (the step's, NCCL's plain sum), or why it
/// could not be.
type Reduction = (&'static str, usize, usize, Result<(Duration, Duration), String>);

/// A dash for a figure a point did not give.
const NONE: &str = "–";

fn run(o: &Options) -> flatnn::Result<()> {
    let (major, minor, patch) = flatnn::cuda::nccl_version()?;
    let names: Vec<String> = (0..flatnn::cuda::device_count()).map(|i| Device::Cuda(i).name()).collect::<flatnn::Result<_>>()?;
    println!("NCCL {major}.{minor}.{patch}; devices: {}", names.join(", "));
    println!("{:<12} {:>6} {:>5} {:>12} {:>10} {:>8} {:>11}", "model", "batch", "gpus", "samples/s", "step ms", "speed-up", "efficiency");
    let mut reductions: Vec<Reduction> = Vec::new();
    for (name, chain, loss) in MODELS.iter().filter(|(name, _, _)| o.models.iter().any(|m| m == name)) {
        let model = chain().build()?.init(Init::HeNormal, 1);
        for &batch in &o.batches {
            let mut base = None;
            for &count in &o.gpus {
                // a point that cannot run (too large for a kernel or for memory) is a row of
                // dashes with the reason, and the bench goes on
                let t = if count == 1 {
                    one_gpu(&model, *loss, batch, o.seconds)
                } else {
                    gpus(&model, *loss, batch, count, o.seconds).map(|(t, mut dp)| {
                        let timed = dp.time_reduction(200).map_err(|e| e.to_string());
                        reductions.retain(|r| (r.0, r.2) != (*name, count));
                        reductions.push((name, model.plan().param_len, count, timed));
                        t
                    })
                };
                let t = match t {
                    Ok(t) => t,
                    Err(e) => {
                        println!("{name:<12} {batch:>6} {count:>5} {NONE:>12} {NONE:>10} {NONE:>8} {NONE:>11}  ({e})");
                        continue;
                    }
                };
                let rate = batch as f64 / t;
                if count == 1 {
                    base = Some(rate);
                }
                let (speed_up, efficiency) = match base {
                    Some(base) => {
                        let speed_up = rate / base;
                        (format!("{speed_up:.2}"), format!("{:.0}%", 100.0 * speed_up / count as f64))
                    }
                    None => (NONE.to_string(), NONE.to_string()),
                };
                println!("{name:<12} {batch:>6} {count:>5} {rate:>12.0} {:>10.3} {speed_up:>8} {efficiency:>11}", t * 1e3);
            }
        }
    }
    println!("\nthe reduction alone (200 calls back to back), bus bandwidth 2(n-1)/n * bytes / t:");
    println!(
        "{:<12} {:>10} {:>5} {:>12} {:>10} {:>12} {:>10} {:>7}",
        "model", "grad MB", "gpus", "step's µs", "GB/s", "ncclSum µs", "GB/s", "ratio"
    );
    for (name, params, count, timed) in reductions {
        let bytes = 4 * params;
        let mb = bytes as f64 / 1e6;
        match timed {
            Ok((step, plain)) => {
                let (step_bw, plain_bw) = (bus_bandwidth(bytes, count, step), bus_bandwidth(bytes, count, plain));
                println!(
                    "{name:<12} {mb:>10.2} {count:>5} {:>12.1} {step_bw:>10.1} {:>12.1} {plain_bw:>10.1} {:>7.2}",
                    step.as_secs_f64() * 1e6,
                    plain.as_secs_f64() * 1e6,
                    step_bw / plain_bw
                );
            }
            Err(e) => println!("{name:<12} {mb:>10.2} {count:>5} {NONE:>12} {NONE:>10} {NONE:>12} {NONE:>10} {NONE:>7}  ({e})"),
        }
    }
    Ok(())
}

fn main() {
    let outcome = parse().map_err(|e| e.to_string()).and_then(|o| run(&o).map_err(|e| e.to_string()));
    if let Err(e) = outcome {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}
