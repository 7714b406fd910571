//! Data-parallel scaling: training samples/s of the zoo's models on one GPU and on several
//! (`DataParallel`, one process), at global batches from 256 to 65536; the speed-up and the
//! efficiency against one GPU (rate on n / (n × rate on one)); per model and GPU count the
//! crossover batch, from which n GPUs are faster than one; and per model and GPU count the
//! time of the step's reduction (its gradients and loss, as the step's graph runs it) against
//! a plain NCCL all-reduce of the same gradients timed alone in a loop (NCCL's
//! `all_reduce_perf` figure), both as bus bandwidth, 2(n − 1)/n · bytes / t.
//!
//!   cargo run --release --example data_parallel -- [--gpus 1,2,4,8] [--models mlp,lenet5,...]
//!       [--batches 256,1024,4096,16384,65536] [--seconds 0.3]
//!
//! `--gpus` defaults to 1, 2, 4 and 8, those the machine has; `--models` to every model below
//! but the recurrent ones (`gru_seq`, `lstm_seq`: on request). A one-GPU figure runs the model on
//! its own (`Optimizer::train_step`); an n-GPU figure runs `DataParallel::train_step` on the
//! same global batch. Each point sets its batch once, then times steps (Adam) for about
//! `--seconds` after 3 untimed ones (the first of a batch size times the convolutions'
//! candidates: seconds at large batches), waiting for the last at the end. A point that cannot
//! run (a batch too large for one kernel, or for memory) prints dashes and the reason, and the
//! bench goes on; an n-GPU point first makes sure one GPU runs a replica's share (a group whose
//! step fails keeps its memory to the end of the process). The reduction is timed on the group
//! of the largest batch that ran.
//!
//! At the end, the tables in markdown, as BENCHMARKS.md holds them. Where one GPU could not run a
//! batch that n GPUs could, the speed-up is against one GPU's best rate at a batch it ran
//! (marked `*`). The crossover batch is the smallest batch from which every larger one has a
//! speed-up above 1 ("none" where the largest has not; "≤" where it is the smallest measured).
//! NCCL must load (`libnccl.so.2` on the library path); NVLink multicast is as the environment
//! sets it (`NCCL_NVLS_ENABLE`, printed in the header).

use flatnn::models;
use flatnn::prelude::*;
use flatnn::testutil::Rng;
use std::time::{Duration, Instant};

/// A zoo model: its name, its layers, its loss, and whether it runs unless asked for.
type ZooModel = (&'static str, fn() -> Chain, Loss, bool);

const MODELS: [ZooModel; 9] = [
    ("mlp", models::mlp, Loss::LogitCrossEntropy, true),
    ("lenet5", models::lenet5, Loss::LogitCrossEntropy, true),
    ("autoencoder", models::autoencoder, Loss::Mse, true),
    ("gelu_mlp", models::gelu_mlp, Loss::LogitCrossEntropy, true),
    ("vgg_small", models::vgg_small, Loss::LogitCrossEntropy, true),
    ("resnet_small", models::resnet_small, Loss::LogitCrossEntropy, true),
    ("ts_conv1d", models::ts_conv1d, Loss::LogitCrossEntropy, true),
    ("gru_seq", models::gru_seq, Loss::Mse, false),
    ("lstm_seq", models::lstm_seq, Loss::LogitCrossEntropy, false),
];

/// The speed-up each GPU count is asked for where the step is compute-bound (BENCHMARKS.md's
/// targets): shown in bold where met.
fn goal(gpus: usize) -> Option<f64> {
    match gpus {
        2 => Some(1.8),
        4 => Some(3.5),
        8 => Some(6.5),
        _ => None,
    }
}

struct Options {
    gpus: Vec<usize>,
    models: Vec<String>,
    batches: Vec<usize>,
    seconds: f64,
}

fn parse() -> Result<Options, String> {
    let devices = flatnn::cuda::device_count();
    let mut o = Options {
        gpus: [1, 2, 4, 8].into_iter().filter(|&n| n <= devices).collect(),
        models: MODELS.iter().filter(|m| m.3).map(|m| m.0.to_string()).collect(),
        batches: vec![256, 1024, 4096, 16384, 65536],
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
    if let Some(bad) = o.models.iter().find(|m| !MODELS.iter().any(|z| z.0 == m.as_str())) {
        return Err(format!("unknown model {bad}"));
    }
    if o.gpus.is_empty() || o.gpus.iter().any(|&n| n == 0 || n > devices) {
        return Err(format!("--gpus {:?}: this machine has {devices} CUDA devices", o.gpus));
    }
    if o.batches.contains(&0) {
        return Err("--batches: a batch of 0".into());
    }
    o.gpus.sort_unstable();
    o.gpus.dedup();
    o.batches.sort_unstable();
    o.batches.dedup();
    Ok(o)
}

/// A global batch for `model` and `loss`: inputs, labels, targets.
fn data(model: &Model, loss: Loss, batch: usize) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let mut rng = Rng::new(1);
    let (inputs, outputs) = (rng.uniform(batch * model.input_shape().len()), model.output_shape().len());
    if loss.takes_labels() {
        (inputs, (0..batch).map(|_| rng.below(outputs) as u32).collect(), Vec::new())
    } else {
        // MSE against targets in [0, 1) (the autoencoder's sigmoid outputs)
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

type Batch = (Vec<f32>, Vec<u32>, Vec<f32>);

/// One GPU (device 0) set to train `model` on the first `batch` samples of `data`.
fn single(model: &Model, loss: Loss, (x, labels, targets): &Batch, batch: usize) -> flatnn::Result<(Model, Cache, Grads, Optimizer)> {
    let model = model.to(&Device::cuda(0)?)?;
    let (mut fwd, bwd) = (model.preallocate(batch)?, model.preallocate_grads(batch)?);
    let opt = Optimizer::new(&model, Optim::adam(1e-4))?;
    fwd.set_inputs(&x[..batch * model.input_shape().len()])?;
    if loss.takes_labels() {
        fwd.set_labels(&labels[..batch])?
    } else {
        fwd.set_targets(&targets[..batch * model.output_shape().len()])?
    }
    Ok((model, fwd, bwd, opt))
}

/// Seconds a training step of the whole of `data` on one GPU.
fn one_gpu(model: &Model, loss: Loss, data: &Batch, seconds: f64) -> flatnn::Result<f64> {
    let (mut model, mut fwd, mut bwd, mut opt) = single(model, loss, data, data.0.len() / model.input_shape().len())?;
    time(seconds, |wait| {
        opt.train_step(&mut model, &mut bwd, &mut fwd, loss)?;
        if wait {
            bwd.last_loss()?;
        }
        Ok(())
    })
}

/// Whether one GPU runs a training step on a replica's share of `share` samples of `data`
/// (the one-GPU point of that batch answers it where there is one). A group whose step fails
/// is aborted and leaves its replicas' device memory to the process, which would starve the
/// points after it: a share that cannot run is found out on one GPU first.
fn share_runs(points: &[Point], model: &Model, name: &str, loss: Loss, data: &Batch, share: usize) -> Result<(), String> {
    let why = |e: &dyn std::fmt::Display| format!("one GPU cannot train on a share of {share}: {e}");
    if let Some(p) = points.iter().find(|p| p.model == name && p.gpus == 1 && p.batch == share) {
        return p.step.as_ref().map(|_| ()).map_err(|e| why(e));
    }
    let probe = || -> flatnn::Result<()> {
        let (mut model, mut fwd, mut bwd, mut opt) = single(model, loss, data, share)?;
        opt.train_step(&mut model, &mut bwd, &mut fwd, loss)?;
        bwd.last_loss().map(|_| ())
    };
    probe().map_err(|e| why(&e))
}

/// Seconds a training step of the global batch on GPUs 0..`count`, and the group (for the
/// reduction's timing).
fn gpus(model: &Model, loss: Loss, (x, labels, targets): &Batch, count: usize, seconds: f64) -> flatnn::Result<(f64, DataParallel)> {
    let devices: Vec<Device> = (0..count).map(Device::Cuda).collect();
    let batch = x.len() / model.input_shape().len();
    let mut dp = DataParallel::new(model, &devices, batch, Optim::adam(1e-4))?;
    dp.set_inputs(x)?;
    if loss.takes_labels() {
        dp.set_labels(labels)?
    } else {
        dp.set_targets(targets)?
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

/// One point measured: a model, a global batch and a GPU count, and seconds a step or why
/// not.
struct Point {
    model: &'static str,
    batch: usize,
    gpus: usize,
    step: Result<f64, String>,
}

impl Point {
    fn rate(&self) -> Option<f64> {
        self.step.as_ref().ok().map(|t| self.batch as f64 / t)
    }
}

/// Per model and GPU count: the model, its gradients' length, the GPUs, and the reduction
/// timed on the group of the largest batch that ran (the step's, NCCL's plain sum), or why it
/// could not be.
type Reduction = (&'static str, usize, usize, Result<(Duration, Duration), String>);

/// A dash for a figure a point did not give.
const NONE: &str = "–";

/// The speed-up of `p` against one GPU: on the same batch, or (true) where one GPU did not run
/// it, against one GPU's best rate at a batch it ran; None without a one-GPU figure.
fn speed_up(points: &[Point], p: &Point) -> Option<(f64, bool)> {
    let rate = p.rate()?;
    let one = |q: &&Point| q.model == p.model && q.gpus == 1;
    if let Some(base) = points.iter().filter(one).find(|q| q.batch == p.batch).and_then(Point::rate) {
        return Some((rate / base, false));
    }
    let best = points.iter().filter(one).filter_map(Point::rate).reduce(f64::max)?;
    Some((rate / best, true))
}

/// The smallest batch from which every larger batch of `model` on `gpus` GPUs has a speed-up
/// above 1: "none" where the largest has not, "≤ b" where it is the smallest with a figure.
fn crossover(points: &[Point], model: &str, gpus: usize) -> String {
    let ups: Vec<(usize, f64)> =
        points.iter().filter(|p| p.model == model && p.gpus == gpus).filter_map(|p| Some((p.batch, speed_up(points, p)?.0))).collect();
    let from = ups.iter().rev().take_while(|(_, up)| *up > 1.0).last().map(|(batch, _)| *batch);
    match (from, ups.first()) {
        (_, None) => NONE.into(),
        (None, _) => "none".into(),
        (Some(from), Some((smallest, _))) if from == *smallest => format!("≤ {from}"),
        (Some(from), _) => from.to_string(),
    }
}

/// A rate in samples/s, three significant figures: "9.27 M", "704 k".
fn si(rate: f64) -> String {
    let (v, unit) = match rate {
        r if r >= 1e6 => (r / 1e6, " M"),
        r if r >= 1e3 => (r / 1e3, " k"),
        r => (r, ""),
    };
    match v {
        v if v >= 100.0 => format!("{v:.0}{unit}"),
        v if v >= 10.0 => format!("{v:.1}{unit}"),
        v => format!("{v:.2}{unit}"),
    }
}

fn run(o: &Options) -> flatnn::Result<()> {
    let (major, minor, patch) = flatnn::cuda::nccl_version()?;
    let names: Vec<String> = (0..flatnn::cuda::device_count()).map(|i| Device::Cuda(i).name()).collect::<flatnn::Result<_>>()?;
    let nvls = std::env::var("NCCL_NVLS_ENABLE").unwrap_or_else(|_| "unset".into());
    println!("NCCL {major}.{minor}.{patch} (NCCL_NVLS_ENABLE {nvls}); devices: {}", names.join(", "));
    println!("{:<12} {:>6} {:>5} {:>12} {:>10} {:>8} {:>11}", "model", "batch", "gpus", "samples/s", "step ms", "speed-up", "efficiency");
    let start = Instant::now();
    let (mut points, mut reductions): (Vec<Point>, Vec<Reduction>) = (Vec::new(), Vec::new());
    for &(name, chain, loss, _) in MODELS.iter().filter(|z| o.models.iter().any(|m| m == z.0)) {
        let model = chain().build()?.init(Init::HeNormal, 1);
        for &batch in &o.batches {
            let data = data(&model, loss, batch);
            for &count in &o.gpus {
                // a point that cannot run (too large for a kernel or for memory) is a row of
                // dashes with the reason, and the bench goes on
                let step = if count == 1 {
                    one_gpu(&model, loss, &data, o.seconds).map_err(|e| e.to_string())
                } else {
                    share_runs(&points, &model, name, loss, &data, batch.div_ceil(count)).and_then(|()| {
                        let (t, mut dp) = gpus(&model, loss, &data, count, o.seconds).map_err(|e| e.to_string())?;
                        let timed = dp.time_reduction(200).map_err(|e| e.to_string());
                        reductions.retain(|r| (r.0, r.2) != (name, count));
                        reductions.push((name, model.plan().param_len, count, timed));
                        Ok(t)
                    })
                };
                points.push(Point { model: name, batch, gpus: count, step });
                let p = points.last().expect("just pushed");
                match &p.step {
                    Ok(t) => {
                        let (up, efficiency) = match speed_up(&points, p) {
                            Some((up, best)) => {
                                let star = if best { "*" } else { "" };
                                (format!("{up:.2}{star}"), format!("{:.0}%", 100.0 * up / count as f64))
                            }
                            None => (NONE.into(), NONE.into()),
                        };
                        let rate = batch as f64 / t;
                        println!("{name:<12} {batch:>6} {count:>5} {rate:>12.0} {:>10.3} {up:>8} {efficiency:>11}", t * 1e3);
                    }
                    Err(e) => println!("{name:<12} {batch:>6} {count:>5} {NONE:>12} {NONE:>10} {NONE:>8} {NONE:>11}  ({e})"),
                }
            }
        }
    }
    println!("\n{:.0} s", start.elapsed().as_secs_f64());
    print_tables(o, &points, &reductions);
    Ok(())
}

/// The markdown tables: samples/s with speed-up and efficiency per model, batch and GPU count;
/// the crossover batches; the reduction against NCCL's plain sum.
fn print_tables(o: &Options, points: &[Point], reductions: &[Reduction]) {
    let gpus = |n: usize| if n == 1 { "1 GPU".to_string() } else { format!("{n} GPUs") };
    let heads: Vec<String> = o.gpus.iter().map(|&n| gpus(n)).collect();
    let rule = |n: usize| "|---|---:|".to_string() + &"---:|".repeat(n);
    println!("\nsamples/s; speed-up and efficiency against 1 GPU at the same global batch (bold: the goal for that many GPUs met; * against 1 GPU's best rate, where it could not run the batch):\n");
    println!("| model | global batch | {} |", heads.join(" | "));
    println!("{}", rule(o.gpus.len()));
    let mut reasons = Vec::new();
    let models: Vec<&str> = MODELS.iter().map(|z| z.0).filter(|m| o.models.iter().any(|n| n == m)).collect();
    for &model in &models {
        for &batch in &o.batches {
            let cells: Vec<String> = o
                .gpus
                .iter()
                .map(|&n| {
                    let Some(p) = points.iter().find(|p| p.model == model && p.batch == batch && p.gpus == n) else { return NONE.into() };
                    let Some(rate) = p.rate() else {
                        reasons.push(format!("- {model}, {batch}, {}: {}", gpus(n), p.step.as_ref().err().map_or("", String::as_str)));
                        return NONE.into();
                    };
                    match (n, speed_up(points, p)) {
                        (1, _) | (_, None) => si(rate),
                        (_, Some((up, best))) => {
                            let star = if best { "*" } else { "" };
                            let efficiency = 100.0 * up / n as f64;
                            match goal(n) {
                                Some(goal) if up >= goal => format!("{}, **{up:.2}×**{star}, {efficiency:.0} %", si(rate)),
                                _ => format!("{}, {up:.2}×{star}, {efficiency:.0} %", si(rate)),
                            }
                        }
                    }
                })
                .collect();
            println!("| {model} | {batch} | {} |", cells.join(" | "));
        }
    }
    if !reasons.is_empty() {
        println!("\n–: the point could not run:\n\n{}", reasons.join("\n"));
    }
    let several: Vec<usize> = o.gpus.iter().copied().filter(|&n| n > 1).collect();
    if several.is_empty() {
        return;
    }
    println!("\ncrossover batch: the smallest global batch from which n GPUs are faster than 1 at every larger batch:\n");
    println!("| model | {} |", several.iter().map(|&n| gpus(n)).collect::<Vec<_>>().join(" | "));
    println!("|---|{}", "---:|".repeat(several.len()));
    for &model in &models {
        let cells: Vec<String> = several.iter().map(|&n| crossover(points, model, n)).collect();
        println!("| {model} | {} |", cells.join(" | "));
    }
    println!("\nthe reduction alone (200 calls back to back after one untimed), bus bandwidth 2(n − 1)/n · bytes / t:\n");
    println!("| model | gradients | GPUs | the step's reduction | `ncclAllReduce` alone | ratio |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, params, count, timed) in reductions {
        let bytes = 4 * params;
        let mb = bytes as f64 / 1e6;
        match timed {
            Ok((step, plain)) => {
                let (step_bw, plain_bw) = (bus_bandwidth(bytes, *count, *step), bus_bandwidth(bytes, *count, *plain));
                println!(
                    "| {name} | {mb:.2} MB | {count} | {:.1} µs, {step_bw:.1} GB/s | {:.1} µs, {plain_bw:.1} GB/s | {:.2} |",
                    step.as_secs_f64() * 1e6,
                    plain.as_secs_f64() * 1e6,
                    step_bw / plain_bw
                );
            }
            Err(e) => println!("| {name} | {mb:.2} MB | {count} | {NONE} ({e}) | {NONE} | {NONE} |"),
        }
    }
}

fn main() {
    let outcome = parse().map_err(|e| e.to_string()).and_then(|o| run(&o).map_err(|e| e.to_string()));
    if let Err(e) = outcome {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}
