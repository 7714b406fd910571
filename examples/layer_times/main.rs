//! Where a zoo model's CPU inference time goes: each step of its plan timed alone, beside the
//! whole model.
//!
//!   cargo run --release --example layer_times -- --model NAME --batch N [--threads T]
//!       [--rounds R] [--clock cpu|wall]
//!
//! `NAME` is a zoo model, named as in `benches/zoo/engine.rs`. The model is built as the zoo
//! builds it (He normal, seed 11) on `T` threads (default: the model's default), with a cache
//! for `N` samples whose inputs are uniform in [−1, 1). Each step of its plan that can run
//! alone becomes a model of its own, `Chain::new(step's input shape).layer(step's layer)` (its
//! activation included) with the whole model's values of its parameters and `T` threads, and
//! a cache of `N` samples of its input shape (uniform in [−1, 1) too); steps that cannot (a
//! residual block's fork and sum, flatten) are listed with the reason. A figure is
//! `Model::forward`'s time per call: in each round, after a warm-up, the median of 7 samples
//! of back-to-back calls, each at least 10 ms; the table gives the least of the `R` rounds'
//! figures (default 3; the whole model goes first in even rounds, last in odd ones). The clock
//! is the process's CPU time (`--clock cpu`, the default on one thread: it leaves out the time
//! this process waits for a core on a shared machine) or the wall clock (`wall`, the default on
//! several threads, whose CPU time adds up over the threads).
//!
//! The table gives, per step: the layer, its input and output shapes, its time alone and that
//! time's share of the whole model's; then the whole model's time, the sum of the parts' and
//! the difference, which is what running the steps together costs or saves (the whole model's
//! inference runs blocks of samples through every step while their activations are in cache,
//! and a convolution's inference takes in a batch norm and a residual sum after it, in its
//! epilogue: such steps are marked, and their time alone is then not spent in the whole model).
//! Last, the whole model's `Cache::routes()` lines for each step: which kernel it ran.
//!
//! `benches/peers/ort_profile.py NAME N T` gives ONNX Runtime's time per node of the same model
//! at the same batch and threads.

#[path = "../../benches/common/measure.rs"]
mod measure;

mod alone;

use alone::{Part, MODELS, SEED};
use flatnn::prelude::*;
use flatnn::testutil::Rng;
use flatnn::{Plan, Result};
use measure::{least, Sampling};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

struct Args {
    name: &'static str,
    chain: fn() -> Chain,
    batch: usize,
    threads: Option<usize>,
    rounds: usize,
    clock: Option<Clock>,
}

#[derive(Clone, Copy, PartialEq)]
enum Clock {
    Cpu,
    Wall,
}

const USAGE: &str = "usage: layer_times --model NAME --batch N [--threads T] [--rounds R] [--clock cpu|wall]";

fn parse_args() -> Result<Args> {
    let config = |what: String| Error::Config(format!("{what} ({USAGE})"));
    let (mut model, mut batch, mut threads, mut rounds, mut clock) = (None, None, None, 3, None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| config(format!("{flag} needs a value")))?;
        let count = || value.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| config(format!("{flag}: {value:?} is not a count")));
        match flag.as_str() {
            "--model" => {
                let names: Vec<&str> = MODELS.iter().map(|m| m.0).collect();
                let found = MODELS.into_iter().find(|m| m.0 == value);
                model = Some(found.ok_or_else(|| config(format!("--model: no zoo model {value:?} (one of {})", names.join(", "))))?);
            }
            "--batch" => batch = Some(count()?),
            "--threads" => threads = Some(count()?),
            "--rounds" => rounds = count()?,
            "--clock" => {
                clock = Some(match value.as_str() {
                    "cpu" => Clock::Cpu,
                    "wall" => Clock::Wall,
                    _ => return Err(config(format!("--clock: {value:?} is neither cpu nor wall"))),
                })
            }
            _ => return Err(config(format!("unknown option {flag}"))),
        }
    }
    let (name, chain) = model.ok_or_else(|| config("--model is required".into()))?;
    let batch = batch.ok_or_else(|| config("--batch is required".into()))?;
    Ok(Args { name, chain, batch, threads, rounds, clock })
}

/// Wall-clock seconds since the first call.
fn wall_seconds() -> f64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// A model with a cache of `batch` samples, its inputs set.
struct Timed {
    model: Model,
    cache: Cache,
    /// Its figure in each round.
    seconds: Vec<f64>,
}

impl Timed {
    fn new(model: Model, batch: usize) -> Result<Timed> {
        let mut cache = model.preallocate(batch)?;
        cache.set_inputs(&Rng::new(SEED).uniform(batch * model.input_shape().len()))?;
        Ok(Timed { model, cache, seconds: Vec::new() })
    }

    /// Times `forward` for one round.
    fn round(&mut self, sampling: Sampling, clock: Clock) -> Result<()> {
        let mut failed = None;
        let call = || {
            if let Err(e) = self.model.forward(&mut self.cache) {
                failed = Some(e);
            }
        };
        let seconds = match clock {
            Clock::Cpu => sampling.per_call(call),
            Clock::Wall => sampling.per_call_on(wall_seconds, call),
        };
        self.seconds.push(seconds);
        failed.map_or(Ok(()), Err)
    }
}

/// The lines of `routes` (a `Cache::routes()` report) for step `index`: its own and the indented
/// ones under it.
fn route_lines(routes: &str, index: usize) -> Vec<&str> {
    let own = format!("step {index} ");
    let mut lines = routes.lines().skip_while(|l| !l.starts_with(&own));
    lines.next().into_iter().chain(lines.take_while(|l| l.starts_with(' '))).collect()
}

/// The step whose route line says it takes in step `index` ("the batch norm of step 1"), if any.
fn taken_in_by(routes: &str, index: usize) -> Option<usize> {
    let needle = format!(" of step {index}");
    routes.lines().find(|l| l.starts_with("step ") && l.contains(&needle))?.split_whitespace().nth(1)?.parse().ok()
}

/// The table of the steps, and the whole model's time against the sum of its parts'.
fn print_table(plan: &Plan, whole: &Timed, steps: &[std::result::Result<Timed, &str>], routes: &str) {
    let whole_s = least(&whole.seconds);
    println!("| step | layer | shape | µs alone | share of the whole |");
    println!("|---|---|---|---|---|");
    // the parts alone, and those of them the whole model does not run in a convolution's epilogue
    let (mut sum, mut apart, mut taken) = (0.0, 0.0, false);
    for (index, (step, t)) in plan.steps.iter().zip(steps).enumerate() {
        let taken_in = taken_in_by(routes, index);
        taken |= taken_in.is_some();
        let fused = taken_in.map_or(String::new(), |k| format!(" (in the whole model, in step {k}'s epilogue)"));
        let (alone, share) = match t {
            Ok(t) => {
                let s = least(&t.seconds);
                sum += s;
                if taken_in.is_none() {
                    apart += s;
                }
                (us(s), format!("{:.1} %{fused}", 100.0 * s / whole_s))
            }
            Err(why) => ("—".into(), format!("does not run alone: {why}{fused}")),
        };
        println!("| {index} | {:?} | {} → {} | {alone} | {share} |", step.layer, step.input, step.output);
    }
    let parts = |what: &str, s: f64| {
        format!("{what}: {} µs ({:.1} % of the whole; whole − parts {} µs)", us(s), 100.0 * s / whole_s, us(whole_s - s))
    };
    println!("\nwhole model: {} µs; {}", us(whole_s), parts("the parts alone", sum));
    if taken {
        println!("{}", parts("the parts alone less those the whole model runs in an epilogue", apart));
    }
}

/// The whole model's `Cache::routes` lines: the first, each step's in order, those of no step.
fn print_routes(plan: &Plan, routes: &str) {
    println!("\nroutes of the whole model (Cache::routes):");
    println!("{}", routes.lines().next().unwrap_or_default());
    let mut missing = Vec::new();
    for index in 0..plan.steps.len() {
        let lines = route_lines(routes, index);
        if lines.is_empty() {
            missing.push(index.to_string());
        }
        for line in lines {
            println!("{line}");
        }
    }
    if !missing.is_empty() {
        println!("(steps with no line: {})", missing.join(", "));
    }
    for line in routes.lines().skip(1).filter(|l| !l.starts_with("step ") && !l.starts_with(' ') && !l.is_empty()) {
        println!("{line}");
    }
}

fn us(seconds: f64) -> String {
    format!("{:.1}", seconds * 1e6)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<()> {
    let args = parse_args()?;
    let model = (args.chain)().build()?.init(Init::HeNormal, SEED);
    let model = match args.threads {
        Some(threads) => model.with_threads(threads)?,
        None => model,
    };
    let threads = model.threads();
    let clock = args.clock.unwrap_or(if threads == 1 { Clock::Cpu } else { Clock::Wall });
    let clock_name = match clock {
        Clock::Cpu => "process CPU time",
        Clock::Wall => "wall clock",
    };
    let parts = alone::split(&model)?;
    let plan = model.plan().clone();
    let mut whole = Timed::new(model, args.batch)?;
    // each step: timed alone, or why it cannot be
    let mut steps: Vec<std::result::Result<Timed, &str>> = parts
        .into_iter()
        .map(|part| match part {
            Part::Alone(m) => Timed::new(*m, args.batch).map(Ok),
            Part::Not(why) => Ok(Err(why)),
        })
        .collect::<Result<_>>()?;
    let sampling = Sampling { warmup: Duration::from_millis(30), sample: Duration::from_millis(10), samples: 7 };
    println!("machine: {}", measure::machine());
    println!("load average at the start: {}", measure::load());
    for round in 0..args.rounds {
        if round % 2 == 0 {
            whole.round(sampling, clock)?;
        }
        for t in steps.iter_mut().flatten() {
            t.round(sampling, clock)?;
        }
        if round % 2 == 1 {
            whole.round(sampling, clock)?;
        }
        eprintln!("round {round}: whole {} µs", us(whole.seconds[round]));
    }
    let routes = whole.cache.routes();
    let what = format!("{}, batch {}, {threads} thread{}", args.name, args.batch, if threads == 1 { "" } else { "s" });
    println!("\n{what}; {clock_name}, the least of {} rounds' medians of 7 samples of ≥ 10 ms\n", args.rounds);
    print_table(&plan, &whole, &steps, &routes);
    print_routes(&plan, &routes);
    println!("\nload average at the end: {}", measure::load());
    Ok(())
}
