//! Batch-1 inference latency in a host program (the embedded use case): p50, p99, p99.9 and
//! max over many calls of `forward` on one sample, after a warm-up.
//!
//!   cargo run --release --example latency -- [--model mlp|cnn|simplenn] [--calls N] [--threads N] [--device cpu|cuda]
//!       [--serve]
//!
//! `--serve` makes the calls through a [`flatnn::Server`] (a resident kernel on a GPU where the
//! model allows one: the SimpleNNs 100-200-1 does, the MLP does not) instead of `forward`.

use flatnn::prelude::*;
use std::time::Instant;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (mut name, mut calls, mut threads, mut device, mut serve) = ("mlp".to_string(), 100_000usize, 1usize, Device::Cpu, false);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--serve" {
            serve = true;
            continue;
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => name = value,
            "--calls" => calls = value.parse().map_err(|_| format!("--calls: {value:?} is not a whole number"))?,
            "--threads" => threads = value.parse().map_err(|_| format!("--threads: {value:?} is not a whole number"))?,
            "--device" => device = Device::parse(&value)?,
            _ => {
                return Err(format!(
                    "unknown option {flag} (usage: latency [--model mlp|cnn|simplenn] [--calls N] [--threads N] [--device cpu|cuda|cuda:N|auto] [--serve])"
                )
                .into())
            }
        }
    }
    let chain = match name.as_str() {
        "mlp" => flatnn::models::mlp(),
        "cnn" => flatnn::models::simplenns_cnn(),
        "simplenn" => flatnn::models::simplenns_mlp(),
        _ => return Err(format!("--model must be mlp, cnn or simplenn, not {name:?}").into()),
    };
    if calls == 0 {
        return Err("--calls must be at least 1".into());
    }
    let model = chain.build()?.init(Init::HeNormal, 1).with_threads(threads)?.to(&device)?;
    let sample = flatnn::testutil::Rng::new(2).uniform(model.input_shape().len());
    let mut nanos = vec![0u64; calls];
    let mut checksum = 0.0f32;
    // a new sample arrives, is copied in, and its outputs come back
    let mut time = |call: &mut dyn FnMut() -> flatnn::Result<f32>| -> flatnn::Result<()> {
        for _ in 0..calls.min(1000) {
            call()?;
        }
        for slot in nanos.iter_mut() {
            let start = Instant::now();
            checksum += call()?;
            *slot = start.elapsed().as_nanos() as u64;
        }
        Ok(())
    };
    let how = if serve {
        let mut server = model.serve(1)?;
        time(&mut || {
            server.set_inputs(&sample)?;
            Ok(server.forward()?[0])
        })?;
        format!("Server (resident kernel: {})", server.is_resident())
    } else {
        let mut fwd = model.preallocate(1)?;
        time(&mut || {
            fwd.set_inputs(&sample)?;
            Ok(model.forward(&mut fwd)?[0])
        })?;
        "set_inputs + forward".to_string()
    };
    nanos.sort_unstable();
    let at = |q: f64| nanos[((calls as f64 * q) as usize).min(calls - 1)] as f64 / 1000.0;
    let place = if device == Device::Cpu { format!("CPU, {threads} thread(s)") } else { format!("{device}") };
    println!("{name}, batch 1, {place}, {calls} calls through {how} (checksum {checksum:.3})");
    println!("  p50 {:.2} µs   p99 {:.2} µs   p99.9 {:.2} µs   max {:.2} µs", at(0.5), at(0.99), at(0.999), at(1.0));
    Ok(())
}
