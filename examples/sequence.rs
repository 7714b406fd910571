//! A recurrent model in real time: a GRU (or an LSTM) learns to predict the next value of a noisy
//! signal from windows of it, then runs on the signal one sample at a time, as an audio or control
//! thread would call it, printing the latency of each step (p50, p99, p99.9, max) and how many
//! steps allocated (a counting allocator watches them all).
//!
//!   cargo run --release --example sequence -- [--cell gru|lstm] [--hidden N] [--train-steps N]
//!       [--steps N] [--device cpu|cuda]
//!
//! Defaults: a GRU of 32 units over windows of 32 samples, 2,000 training steps of 64 windows,
//! then 1,000,000 streamed steps on the CPU. With `--device cuda` the model trains and streams on
//! the GPU (a launch a step: a CPU answers a batch of one sooner).

use flatnn::prelude::*;
use flatnn::testutil::{allocations_in, Counting, Rng};
use std::time::Instant;

#[global_allocator]
static COUNTING: Counting = Counting;

/// Samples a window holds.
const WINDOW: usize = 32;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

/// Two tones of incommensurate periods and a slow drift in amplitude, plus noise: v(t), t = 0, 1, …
struct Signal {
    rng: Rng,
}

impl Signal {
    fn at(&mut self, t: usize) -> f32 {
        let t = t as f32;
        let clean = (0.13 * t).sin() * (0.8 + 0.2 * (0.0031 * t).sin()) + 0.4 * (0.047 * t + 1.0).sin();
        clean + 0.05 * self.rng.uniform(1)[0]
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (mut cell, mut hidden, mut train_steps, mut steps, mut device) =
        ("gru".to_string(), 32usize, 2_000usize, 1_000_000usize, Device::Cpu);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || value.parse::<usize>().map_err(|_| format!("{flag}: {value:?} is not a whole number"));
        match flag.as_str() {
            "--cell" => cell = value.clone(),
            "--hidden" => hidden = number()?,
            "--train-steps" => train_steps = number()?,
            "--steps" => steps = number()?,
            "--device" => device = Device::parse(&value)?,
            _ => {
                return Err(format!(
                "unknown option {flag} (usage: sequence [--cell gru|lstm] [--hidden N] [--train-steps N] [--steps N] [--device cpu|cuda])"
            )
                .into())
            }
        }
    }
    if steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    let chain = Chain::new(Input::sequence(WINDOW, 1));
    let chain = match cell.as_str() {
        "gru" => chain.gru(hidden, RnnOutput::LastStep),
        "lstm" => chain.lstm(hidden, RnnOutput::LastStep),
        _ => return Err(format!("--cell must be gru or lstm, not {cell:?}").into()),
    };
    let mut model = chain.dense(1, Identity).build()?.init(Init::GlorotUniform, 7).with_threads(1)?.to(&device)?;
    println!("{model}");

    // training: windows of the signal's first 200,000 samples, each labelled with the sample after it
    let mut signal = Signal { rng: Rng::new(1) };
    let history: Vec<f32> = (0..200_000).map(|t| signal.at(t)).collect();
    let batch = 64;
    let (mut fwd, mut bwd) = (model.preallocate(batch)?, model.preallocate_grads(batch)?);
    let mut opt = Optimizer::new(&model, Optim::adam(3e-3))?;
    opt.set_schedule(Schedule::cosine(100, train_steps as u64))?;
    let mut pick = Rng::new(2);
    let (mut x, mut y) = (vec![0.0; batch * WINDOW], vec![0.0; batch]);
    let started = Instant::now();
    for step in 1..=train_steps {
        for s in 0..batch {
            let at = pick.below(history.len() - WINDOW - 1);
            x[s * WINDOW..][..WINDOW].copy_from_slice(&history[at..at + WINDOW]);
            y[s] = history[at + WINDOW];
        }
        fwd.set_inputs(&x)?;
        fwd.set_targets(&y)?;
        opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::Mse)?;
        if step % 500 == 0 || step == train_steps {
            println!("step {step}: training loss {:.5}", bwd.mean_loss()?);
        }
    }
    println!("trained in {:.1} s", started.elapsed().as_secs_f64());

    // streaming: the signal one sample at a time, from t = 200,000 on (samples the model has not
    // seen), the prediction of the next sample each step
    let mut stream = model.stream(1)?;
    let future: Vec<f32> = (0..steps + 1).map(|t| signal.at(200_000 + t)).collect();
    let mut nanos = vec![0u32; steps];
    let (mut model_err, mut last_err, mut prediction) = (0.0f64, 0.0f64, 0.0f32);
    let allocations = allocations_in(|| {
        for (t, ns) in nanos.iter_mut().enumerate() {
            let now = future[t];
            // the prediction made a step ago against this sample, and the naive one (no change)
            if t > 0 {
                model_err += f64::from(prediction - now).powi(2);
                last_err += f64::from(future[t - 1] - now).powi(2);
            }
            let start = Instant::now();
            let out = stream.step(&[now]).expect("a finite sample");
            *ns = start.elapsed().as_nanos().min(u32::MAX as u128) as u32;
            prediction = out[0];
        }
    });
    nanos.sort_unstable();
    let at = |q: f64| nanos[((nanos.len() - 1) as f64 * q).round() as usize];
    println!(
        "streamed {steps} steps on {}: per step p50 {} ns, p99 {} ns, p99.9 {} ns, max {} ns (Instant::now around each, ~20-30 ns of it)",
        stream.device(),
        at(0.5),
        at(0.99),
        at(0.999),
        at(1.0)
    );
    println!("{allocations} heap allocations during the {steps} steps");
    let n = (steps - 1).max(1) as f64;
    println!(
        "prediction of the next sample: mean squared error {:.5}, against {:.5} for \"no change\" (noise alone: {:.5})",
        model_err / n,
        last_err / n,
        0.05f64.powi(2) / 3.0
    );
    Ok(())
}
