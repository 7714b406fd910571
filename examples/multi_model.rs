//! Several models trained at once on one GPU: N threads, each with its own model, cache,
//! gradients, optimiser and data set (in device memory); each model runs on its own stream, so
//! the N training loops overlap on the device. Prints the total and per-model samples/s for
//! each N, over a fixed number of steps on synthetic data.
//!
//!   cargo run --release --example multi_model -- [--model lenet|mlp] [--steps N] [--batch N]
//!       [--counts 1,2,4,8] [--device cpu|cuda|cuda:N|auto]
//!
//! Where there is no GPU it says so and runs on the CPU, one thread per model and fewer steps.

use flatnn::data::{Dataset, DeviceDataset, Loader};
use flatnn::prelude::*;
use std::sync::Barrier;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: multi_model [--model lenet|mlp] [--steps N] [--batch N] [--counts 1,2,4,8] [--device cpu|cuda|cuda:N|auto]";

/// Samples in each model's synthetic data set.
const SAMPLES: usize = 4096;

struct Options {
    model: String,
    steps: Option<usize>,
    batch: usize,
    counts: Vec<usize>,
    device: String,
}

fn parse() -> Result<Options, String> {
    let mut o = Options { model: "lenet".into(), steps: None, batch: 128, counts: vec![1, 2, 4, 8], device: "auto".into() };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number =
            |v: &str| v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| format!("{flag}: {v:?} is not a positive whole number"));
        match flag.as_str() {
            "--model" => o.model = value,
            "--steps" => o.steps = Some(number(&value)?),
            "--batch" => o.batch = number(&value)?,
            "--counts" => o.counts = value.split(',').map(|v| number(v.trim())).collect::<Result<_, _>>()?,
            "--device" => o.device = value,
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if !["lenet", "mlp"].contains(&o.model.as_str()) {
        return Err(format!("--model must be lenet or mlp, not {:?}", o.model));
    }
    Ok(o)
}

fn chain(name: &str) -> Chain {
    match name {
        "mlp" => flatnn::models::mlp(),
        _ => flatnn::models::lenet5(),
    }
}

/// `SAMPLES` random samples of `shape` in [0, 1) with random labels below 10 (xorshift from
/// `seed`).
fn synthetic(shape: Shape, seed: u64) -> flatnn::Result<Dataset> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let samples = (0..SAMPLES * shape.len()).map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32).collect();
    let labels = (0..SAMPLES).map(|_| (next() % 10) as u32).collect();
    Dataset::new(samples, labels, shape)
}

/// One model's training state: everything a thread owns.
struct Trainer {
    model: Model,
    fwd: Cache,
    bwd: Grads,
    opt: Optimizer,
    loader: Loader,
    host: Dataset,
    device: Option<DeviceDataset>,
}

impl Trainer {
    fn new(name: &str, device: &Device, seed: u64, batch: usize) -> flatnn::Result<Trainer> {
        let mut model = chain(name).build()?.init(Init::HeNormal, seed);
        if !device.is_cuda() {
            model = model.with_threads(1)?;
        }
        let model = model.to(device)?;
        let host = synthetic(model.input_shape(), seed)?;
        let device_data = if device.is_cuda() { Some(host.to_device(device, 10)?) } else { None };
        let (fwd, bwd) = (model.preallocate(batch)?, model.preallocate_grads(batch)?);
        let opt = Optimizer::new(&model, Optim::adam(1e-3))?;
        // whole batches only, so every step is the same work
        let mut loader = Loader::new(host.len(), batch, seed, true)?;
        loader.shuffle();
        Ok(Trainer { model, fwd, bwd, opt, loader, host, device: device_data })
    }

    /// One training step, queued on the model's stream (a new epoch when the last one ended).
    fn step(&mut self) -> flatnn::Result<()> {
        while self.next_batch()?.is_none() {
            self.loader.shuffle();
        }
        self.opt.train_step(&mut self.model, &mut self.bwd, &mut self.fwd, Loss::LogitCrossEntropy)
    }

    fn next_batch(&mut self) -> flatnn::Result<Option<usize>> {
        match &mut self.device {
            Some(data) => self.loader.next_device_batch(data, &mut self.fwd),
            None => self.loader.next_batch(&self.host, &mut self.fwd),
        }
    }

    /// `steps` steps, then waits for them (reading the loss); the time taken and the loss.
    fn run(&mut self, steps: usize) -> flatnn::Result<(Duration, f32)> {
        let start = Instant::now();
        for _ in 0..steps {
            self.step()?;
        }
        let loss = self.bwd.last_loss()?;
        Ok((start.elapsed(), loss))
    }
}

/// A thread's work: set up, warm up (graphs captured), wait at `start` for the others, train.
fn worker(o: &Options, device: &Device, seed: u64, steps: usize, start: &Barrier) -> Result<(Duration, f32), String> {
    let ready = Trainer::new(&o.model, device, seed, o.batch).and_then(|mut t| t.run(3).map(|_| t));
    // every thread reaches the barrier, ready or not, so none waits forever
    start.wait();
    let mut trainer = ready.map_err(|e| e.to_string())?;
    trainer.run(steps).map_err(|e| e.to_string())
}

fn run(o: Options) -> Result<(), String> {
    let device = match o.device.as_str() {
        "auto" => Device::cuda(0).unwrap_or_else(|e| {
            println!("no GPU here ({e}): running on the CPU, one thread per model");
            Device::Cpu
        }),
        other => Device::parse(other).map_err(|e| e.to_string())?,
    };
    let steps = o.steps.unwrap_or(if device.is_cuda() { 300 } else { 10 });
    let where_ = match device {
        Device::Cpu => "the CPU".to_string(),
        Device::Cuda(n) => {
            format!("CUDA device {n} ({}), one stream per model, data in device memory", Device::Cuda(n).name().map_err(|e| e.to_string())?)
        }
    };
    println!("{} models, batch {}, {steps} steps each, on {where_}", o.model, o.batch);
    for &n in &o.counts {
        let start = Barrier::new(n + 1);
        let (elapsed, results) = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|i| {
                    s.spawn({
                        let (o, device, start) = (&o, &device, &start);
                        move || worker(o, device, i as u64 + 1, steps, start)
                    })
                })
                .collect();
            start.wait();
            let began = Instant::now();
            let results: Vec<_> =
                handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a training thread panicked".into()))).collect();
            (began.elapsed(), results)
        });
        let results = results.into_iter().collect::<Result<Vec<_>, _>>()?;
        let samples = (steps * o.batch) as f64;
        let total = n as f64 * samples / elapsed.as_secs_f64();
        let per_model: Vec<f64> = results.iter().map(|(t, _)| samples / t.as_secs_f64()).collect();
        let mean = per_model.iter().sum::<f64>() / n as f64;
        let losses: Vec<String> = results.iter().map(|(_, loss)| format!("{loss:.3}")).collect();
        println!(
            "N = {n}: {total:>9.0} samples/s in all, {mean:>9.0} samples/s per model (slowest {:.0}), {:.2} s; last losses {}",
            per_model.iter().cloned().fold(f64::INFINITY, f64::min),
            elapsed.as_secs_f64(),
            losses.join(" ")
        );
    }
    Ok(())
}

fn main() {
    if let Err(e) = parse().and_then(run) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}
