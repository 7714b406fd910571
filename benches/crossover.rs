//! Where the GPU overtakes the CPU: inference and a training step of three models at batch 1 to
//! 16384, on the CPU (one thread and every physical core) and on CUDA device 0 (graphs on, and
//! off for comparison), then a table of medians per model and task with the crossover batch,
//! a CSV and an SVG plot in `target/flatnn-bench/`.
//!
//!   cargo bench --bench crossover            # FLATNN_BENCH_QUICK=1 for a short run
//!
//! Timing: each measurement repeats the call until a sample lasts ≥ 2 ms, takes several samples
//! and reports the median time per call. Inference is `set_inputs` + `forward` (on the GPU that
//! includes the copy in, the graph replay, the copy back of the outputs and the wait for them).
//! A training step is `backprop` + `update` on a batch already in the cache; on the GPU the host
//! waits for the device at the end of every sample, so queued work is inside the timed region.
//! Configurations whose single call takes more than 0.5 s are skipped and marked so.

use flatnn::model::default_threads;
use flatnn::models;
use flatnn::prelude::*;
use flatnn::testutil::Rng;
use flatnn::Result;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

const BATCHES: [usize; 9] = [1, 4, 16, 64, 128, 256, 1024, 4096, 16384];
/// A configuration slower than this per call is skipped (and the larger batches after it).
const TOO_SLOW: Duration = Duration::from_millis(500);

struct Bench {
    name: &'static str,
    chain: Chain,
    loss: Loss,
}

fn models() -> Vec<Bench> {
    vec![
        Bench { name: "simplenn-100-200-1", chain: models::simplenns_mlp(), loss: Loss::Mse },
        Bench { name: "mlp-784-128-64-10", chain: models::mlp(), loss: Loss::LogitCrossEntropy },
        Bench { name: "lenet5", chain: models::lenet5(), loss: Loss::LogitCrossEntropy },
    ]
}

#[derive(Clone, Copy, PartialEq)]
enum Task {
    Forward,
    Train,
}

/// Where a measurement runs.
#[derive(Clone, Copy)]
struct Place {
    label: &'static str,
    device: Device,
    threads: usize,
    graphs: bool,
}

/// Median seconds per call of `call`, or `None` if one call takes longer than [`TOO_SLOW`].
/// `call(true)` ends a sample: it must wait for the device.
fn median_time(quick: bool, mut call: impl FnMut(bool)) -> Option<f64> {
    call(true); // warm-up: graph capture, first touches
    let start = Instant::now();
    call(true);
    let once = start.elapsed();
    if once > TOO_SLOW {
        return None;
    }
    let per_sample = ((2e-3 / once.as_secs_f64().max(1e-9)).ceil() as usize).max(1);
    let samples = if quick { 5 } else { 11 };
    let mut times: Vec<f64> = (0..samples)
        .map(|_| {
            let start = Instant::now();
            for i in 0..per_sample {
                call(i + 1 == per_sample);
            }
            start.elapsed().as_secs_f64() / per_sample as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    Some(times[times.len() / 2])
}

/// Median seconds per call at one configuration.
fn measure(bench: &Bench, place: Place, task: Task, batch: usize, quick: bool) -> Result<Option<f64>> {
    let options = GpuOptions { graphs: place.graphs, tf32: false, ..GpuOptions::default() };
    let model = bench.chain.clone().build()?.init(Init::HeNormal, 1).with_threads(place.threads)?.with_gpu_options(options)?;
    let mut model = model.to(&place.device)?;
    let mut rng = Rng::new(7);
    let inputs = rng.uniform(batch * model.input_shape().len());
    let outputs = model.output_shape().len();
    let mut fwd = model.preallocate(batch)?;
    fwd.set_inputs(&inputs)?;
    if bench.loss.takes_labels() {
        fwd.set_labels(&(0..batch).map(|i| (i % outputs) as u32).collect::<Vec<_>>())?
    } else {
        fwd.set_targets(&rng.uniform(batch * outputs))?
    }
    let time = match task {
        Task::Forward => median_time(quick, |_| {
            fwd.set_inputs(&inputs).expect("set_inputs");
            model.forward(&mut fwd).expect("forward");
        }),
        Task::Train => {
            let mut bwd = model.preallocate_grads(batch)?;
            let mut opt = Optimizer::new(&model, Optim::adam(1e-4))?;
            median_time(quick, |last| {
                opt.train_step(&mut model, &mut bwd, &mut fwd, bench.loss).expect("train_step");
                if last {
                    // reading the loss waits for the device (and costs nothing on the CPU)
                    bwd.last_loss().expect("loss");
                }
            })
        }
    };
    Ok(time)
}

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; a filter argument is not supported: the run is the table.
    let quick = std::env::var("FLATNN_BENCH_QUICK").is_ok_and(|v| v == "1");
    let cores = default_threads()?;
    let mut places = vec![Place { label: "cpu-1t", device: Device::Cpu, threads: 1, graphs: true }];
    if cores > 1 {
        places.push(Place { label: "cpu-all", device: Device::Cpu, threads: cores, graphs: true });
    }
    let gpu = match Device::cuda(0) {
        Ok(device) => {
            println!("GPU: {} ({} MiB)", device.name()?, device.memory()?.1 >> 20);
            // convolutions: cuDNN where measured faster (auto), or as FLATNN_CUDNN=0|1 forces
            #[cfg(feature = "cuda")]
            {
                let cudnn = flatnn::cuda::cudnn_version().map_or("not found".to_string(), |v| v.to_string());
                println!("cuDNN: {cudnn}, FLATNN_CUDNN={}", std::env::var("FLATNN_CUDNN").unwrap_or_else(|_| "auto".into()));
            }
            places.push(Place { label: "gpu-graphs", device, threads: 1, graphs: true });
            places.push(Place { label: "gpu-eager", device, threads: 1, graphs: false });
            true
        }
        Err(e) => {
            println!("GPU half skipped: no CUDA device ({e})");
            false
        }
    };
    println!("CPU: {cores} physical cores used for cpu-all");
    let mut csv = String::from("model,task,place,batch,seconds_per_call,seconds_per_sample\n");
    let mut summary = String::new();
    let mut series = Vec::new();
    for bench in models() {
        for task in [Task::Forward, Task::Train] {
            let task_name = if task == Task::Forward { "forward" } else { "train" };
            let mut table: Vec<Vec<Option<f64>>> = Vec::new();
            for place in &places {
                let mut row = Vec::new();
                let mut too_slow = false;
                for &batch in &BATCHES {
                    let t = if too_slow { None } else { measure(&bench, *place, task, batch, quick)? };
                    too_slow |= t.is_none();
                    if let Some(t) = t {
                        let _ = writeln!(csv, "{},{task_name},{},{batch},{t:.9},{:.9}", bench.name, place.label, t / batch as f64);
                    }
                    row.push(t);
                }
                series.push((bench.name, task_name, place.label, row.clone()));
                table.push(row);
            }
            print_table(&mut summary, bench.name, task_name, &places, &table, gpu);
        }
    }
    println!("{summary}");
    let dir = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into())).join("target/flatnn-bench");
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io { path: dir.clone(), source })?;
    for (name, text) in [("crossover.csv", csv), ("crossover.svg", svg(&series)), ("crossover.txt", summary)] {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|source| Error::Io { path: path.clone(), source })?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn fmt_time(t: Option<f64>) -> String {
    match t {
        None => "skipped".into(),
        Some(t) if t < 1e-3 => format!("{:.1} µs", t * 1e6),
        Some(t) if t < 1.0 => format!("{:.2} ms", t * 1e3),
        Some(t) => format!("{t:.2} s"),
    }
}

/// The table of medians for one model and task, and its crossover batch: the smallest batch
/// from which the GPU (graphs) is faster than the fastest CPU column at every larger batch.
fn print_table(out: &mut String, model: &str, task: &str, places: &[Place], table: &[Vec<Option<f64>>], gpu: bool) {
    let _ = writeln!(out, "\n{model}, {task} (median per call)");
    let _ = write!(out, "{:>7}", "batch");
    for p in places {
        let _ = write!(out, " {:>12}", p.label);
    }
    let _ = writeln!(out);
    for (i, batch) in BATCHES.iter().enumerate() {
        let _ = write!(out, "{batch:>7}");
        for row in table {
            let _ = write!(out, " {:>12}", fmt_time(row[i]));
        }
        let _ = writeln!(out);
    }
    if !gpu {
        let _ = writeln!(out, "crossover: GPU half skipped");
        return;
    }
    let gpu_row = &table[places.iter().position(|p| p.label == "gpu-graphs").expect("gpu column")];
    let best_cpu =
        |i: usize| table.iter().zip(places).filter(|(_, p)| p.device == Device::Cpu).filter_map(|(row, _)| row[i]).reduce(f64::min);
    let gpu_wins = |i: usize| match (gpu_row[i], best_cpu(i)) {
        (Some(g), Some(c)) => g < c,
        (Some(_), None) => true, // every CPU column was too slow
        _ => false,
    };
    let crossover = (0..BATCHES.len()).find(|&i| (i..BATCHES.len()).all(gpu_wins));
    match crossover {
        Some(i) => {
            let _ = writeln!(out, "crossover: the GPU is faster from batch {}", BATCHES[i]);
        }
        None => {
            let _ = writeln!(out, "crossover: none in 1..16384 (the CPU is faster at the largest batch measured)");
        }
    }
}

/// Time per sample against batch, log-log, one panel per model: solid lines train, dashed
/// lines forward, one colour per place.
fn svg(series: &[(&str, &str, &str, Vec<Option<f64>>)]) -> String {
    let models: Vec<&str> = series.iter().map(|s| s.0).fold(Vec::new(), |mut v, m| {
        if !v.contains(&m) {
            v.push(m);
        }
        v
    });
    let (pw, ph, margin) = (360.0, 300.0, 55.0);
    let width = models.len() as f64 * (pw + margin) + margin;
    let height = ph + 2.0 * margin + 40.0;
    let colours = [("cpu-1t", "#1f77b4"), ("cpu-all", "#2ca02c"), ("gpu-graphs", "#d62728"), ("gpu-eager", "#ff7f0e")];
    let per_sample = |s: &(&str, &str, &str, Vec<Option<f64>>)| -> Vec<(f64, f64)> {
        s.3.iter().zip(BATCHES).filter_map(|(t, b)| t.map(|t| (b as f64, t / b as f64))).collect()
    };
    let all: Vec<f64> = series.iter().flat_map(per_sample).map(|(_, y)| y).collect();
    let (lo, hi) =
        (all.iter().cloned().fold(f64::INFINITY, f64::min).log10().floor(), all.iter().cloned().fold(0.0, f64::max).log10().ceil());
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (m, model) in models.iter().enumerate() {
        let x0 = margin + m as f64 * (pw + margin);
        let y0 = margin;
        let sx = |b: f64| x0 + b.log10() / 16384f64.log10() * pw;
        let sy = |t: f64| y0 + (hi - t.log10()) / (hi - lo).max(1.0) * ph;
        let _ = writeln!(out, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"13\">{model}</text>", x0 + pw / 2.0, y0 - 10.0);
        let _ = writeln!(out, "<rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#444\"/>");
        for b in BATCHES {
            let x = sx(b as f64);
            let _ = writeln!(out, "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{b}</text>", y0 + ph + 14.0);
        }
        let mut e = lo;
        while e <= hi {
            let y = sy(10f64.powf(e));
            let _ = writeln!(out, "<line x1=\"{x0}\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"#ddd\"/>", x0 + pw);
            let _ = writeln!(out, "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">1e{}</text>", x0 - 4.0, y + 4.0, e as i32);
            e += 1.0;
        }
        for s in series.iter().filter(|s| s.0 == *model) {
            let colour = colours.iter().find(|c| c.0 == s.2).map_or("#000", |c| c.1);
            let dash = if s.1 == "forward" { " stroke-dasharray=\"5,3\"" } else { "" };
            let points: Vec<String> = per_sample(s).iter().map(|&(b, t)| format!("{:.1},{:.1}", sx(b), sy(t))).collect();
            let _ =
                writeln!(out, "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.8\"{dash} points=\"{}\"/>", points.join(" "));
        }
        let _ = writeln!(out, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">batch</text>", x0 + pw / 2.0, y0 + ph + 30.0);
    }
    let _ = writeln!(
        out,
        "<text x=\"12\" y=\"{}\" transform=\"rotate(-90 12 {})\" text-anchor=\"middle\">seconds per sample</text>",
        margin + ph / 2.0,
        margin + ph / 2.0
    );
    let mut lx = margin;
    let ly = height - 14.0;
    for (label, colour) in colours {
        let _ = writeln!(out, "<line x1=\"{lx}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{colour}\" stroke-width=\"2\"/><text x=\"{}\" y=\"{}\">{label}</text>", lx + 20.0, lx + 24.0, ly + 4.0);
        lx += 110.0;
    }
    let _ = writeln!(out, "<text x=\"{lx}\" y=\"{}\">solid: training step, dashed: inference</text>", ly + 4.0);
    out.push_str("</svg>\n");
    out
}
