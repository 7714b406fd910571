//! Streaming latency: one time step of a GRU or an LSTM layer at batch 1 on one CPU thread
//! ([`Model::stream`]), every step timed on its own, against ONNX Runtime and PyTorch on the same
//! machine (`benches/peers/stream.py`, on the same weights; it first checks that each computes
//! flatnn's outputs) and against the floor: the time to read the weights a step reads (W_ih, W_hh
//! and the biases, in the stream's layout) once from cache, a vectorised sum over a buffer of that
//! size while it is hot.
//!
//!   cargo bench --bench stream -- [--steps 1000000] [--peer-steps 200000] [--hidden 16,32,64,128]
//!       [--features 1,4,8] [--cells gru,lstm] [--no-peers] [--python python3] [--out DIR]
//!
//! Prints, per cell, hidden size and input size, the percentiles p50, p99, p99.9 and the maximum
//! of flatnn's steps, the allocations made during them (counted), the floor, and the peers'
//! percentiles beside them; writes `stream.csv` in the output directory
//! (`target/flatnn-bench/stream` by default). Steps are timed with the CPU's time-stamp counter
//! (calibrated against the OS clock), which costs ~10 ns a reading on x86; elsewhere the OS clock.

use flatnn::prelude::*;
use flatnn::testutil::{allocations_in, Counting};
use flatnn::Result;
use serde_json::{json, Value};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[global_allocator]
static COUNTING: Counting = Counting;

struct Args {
    steps: usize,
    peer_steps: usize,
    hidden: Vec<usize>,
    features: Vec<usize>,
    cells: Vec<String>,
    peers: bool,
    python: String,
    out: PathBuf,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        steps: 1_000_000,
        peer_steps: 200_000,
        hidden: vec![16, 32, 64, 128],
        features: vec![1, 4, 8],
        cells: vec!["gru".into(), "lstm".into()],
        peers: true,
        python: "python3".into(),
        out: Path::new(env!("CARGO_MANIFEST_DIR")).join("target/flatnn-bench/stream"),
    };
    let list = |v: &str| {
        v.split(',').map(|s| s.parse::<usize>().map_err(|_| Error::Config(format!("not a number: {s}")))).collect::<Result<Vec<_>>>()
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| Error::Config(format!("{arg} needs a value")));
        match arg.as_str() {
            "--bench" | "--" => {}
            "--steps" => args.steps = list(&value()?)?[0],
            "--peer-steps" => args.peer_steps = list(&value()?)?[0],
            "--hidden" => args.hidden = list(&value()?)?,
            "--features" => args.features = list(&value()?)?,
            "--cells" => args.cells = value()?.split(',').map(String::from).collect(),
            "--no-peers" => args.peers = false,
            "--python" => args.python = value()?,
            "--out" => args.out = PathBuf::from(value()?),
            other => return Err(Error::Config(format!("unknown argument {other}"))),
        }
    }
    Ok(args)
}

/// A clock for single steps: the time-stamp counter where there is one (with fences, so that
/// the step lies between the readings), in ticks, and ticks per ns.
struct Clock {
    per_ns: f64,
}

impl Clock {
    #[cfg(target_arch = "x86_64")]
    fn now() -> u64 {
        // SAFETY: lfence and rdtsc exist on every x86_64.
        unsafe {
            std::arch::x86_64::_mm_lfence();
            let t = std::arch::x86_64::_rdtsc();
            std::arch::x86_64::_mm_lfence();
            t
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn now() -> u64 {
        use std::sync::OnceLock;
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }

    /// Ticks per ns, measured against the OS clock over 200 ms.
    fn new() -> Clock {
        let (t0, i0) = (Clock::now(), Instant::now());
        while i0.elapsed() < Duration::from_millis(200) {}
        let (t1, elapsed) = (Clock::now(), i0.elapsed());
        Clock { per_ns: (t1 - t0) as f64 / elapsed.as_nanos() as f64 }
    }
}

/// p50, p99, p99.9 and the maximum of `ticks`, in ns.
fn percentiles(ticks: &mut [u64], clock: &Clock) -> [f64; 4] {
    ticks.sort_unstable();
    let at = |q: f64| ticks[((ticks.len() - 1) as f64 * q).round() as usize] as f64 / clock.per_ns;
    [at(0.5), at(0.99), at(0.999), at(1.0)]
}

/// A noisy signal, `features` values a step.
fn signal(steps: usize, features: usize) -> Vec<f32> {
    let mut rng = flatnn::testutil::Rng::new(5);
    let noise = rng.uniform(steps * features);
    (0..steps * features).map(|i| (0.05 * (i / features) as f32 + i as f32).sin() + 0.1 * noise[i]).collect()
}

/// The time to read `len` floats once while they are in cache: a vectorised sum over them, 100
/// passes back to back between two readings of the clock (so that its own cost does not count),
/// the best of 2,000 such readings, per pass, in ns; the faster of two sums (32 lanes of AVX2,
/// 64 of AVX-512, where the CPU has them).
fn floor(len: usize, clock: &Clock) -> f64 {
    let buf: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
    let mut best = f64::MAX;
    for sum in sums() {
        let mut sink = 0.0;
        for round in 0..2_100 {
            let t0 = Clock::now();
            for _ in 0..100 {
                sink += std::hint::black_box(sum(std::hint::black_box(&buf)));
            }
            let t1 = Clock::now();
            if round >= 100 {
                best = best.min((t1 - t0) as f64 / clock.per_ns / 100.0);
            }
        }
        std::hint::black_box(sink);
    }
    best
}

/// What reading the clock twice costs, in ns: the median of 100,000 empty intervals (each step's
/// time includes it).
fn timer_cost(clock: &Clock) -> f64 {
    let mut ticks: Vec<u64> = (0..100_000).map(|_| Clock::now().wrapping_neg().wrapping_add(Clock::now())).collect();
    ticks.sort_unstable();
    ticks[ticks.len() / 2] as f64 / clock.per_ns
}

/// Vectorised sums of a buffer this CPU runs: `LANES` independent accumulators, so that the sum
/// is bound by the loads rather than by the adds' latency.
fn sums() -> Vec<fn(&[f32]) -> f32> {
    #[allow(unused_mut)]
    let mut sums: Vec<fn(&[f32]) -> f32> = vec![sum_lanes::<32>];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") {
            // SAFETY: this CPU has AVX2 (checked just above).
            sums.push(|buf| unsafe { sum_avx2(buf) });
        }
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: this CPU has AVX-512F (checked just above).
            sums.push(|buf| unsafe { sum_avx512(buf) });
        }
    }
    sums
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_avx2(buf: &[f32]) -> f32 {
    sum_lanes::<32>(buf)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_avx512(buf: &[f32]) -> f32 {
    sum_lanes::<64>(buf)
}

#[inline(always)]
fn sum_lanes<const LANES: usize>(buf: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = buf.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (a, v) in acc.iter_mut().zip(chunk) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// One configuration's model: a layer of `hidden` units over `features` inputs, every step's
/// output.
fn model(cell: &str, hidden: usize, features: usize) -> Result<Model> {
    let chain = Chain::new(Shape::sequence(1, features));
    let chain = if cell == "gru" { chain.gru(hidden, RnnOutput::Sequence) } else { chain.lstm(hidden, RnnOutput::Sequence) };
    chain.build()?.init(Init::GlorotUniform, 3).with_threads(1)
}

/// Values the stream reads a step: the four tensors in its layout (each gate's block of units
/// padded to 16).
fn weights_read(cell: &str, hidden: usize, features: usize) -> usize {
    let gates = if cell == "gru" { 3 } else { 4 };
    (features + hidden + 2) * gates * hidden.next_multiple_of(16)
}

struct Point {
    cell: String,
    hidden: usize,
    features: usize,
    flatnn: [f64; 4],
    /// ns a step over the best block of 1,000 steps timed together (no clock around each).
    mean: f64,
    allocations: usize,
    floor: f64,
    peers: Vec<(String, [f64; 4])>,
    check: Vec<(String, f64)>,
}

fn main() -> Result<()> {
    let args = parse_args()?;
    std::fs::create_dir_all(&args.out).map_err(|source| Error::Io { path: args.out.clone(), source })?;
    let clock = Clock::new();
    println!(
        "time-stamp counter: {:.3} ticks/ns, {:.0} ns to read it twice (in every step's time); {} steps a point on one thread, batch 1",
        clock.per_ns,
        timer_cost(&clock),
        args.steps
    );
    let (check_steps, mut points, mut cases) = (32, Vec::new(), Vec::new());
    for cell in &args.cells {
        for &hidden in &args.hidden {
            for &features in &args.features {
                let model = model(cell, hidden, features)?;
                let name = format!("{cell}_{hidden}_{features}");
                let weights = args.out.join(format!("{name}.safetensors"));
                model.save(&weights)?;
                let x = signal(args.steps + check_steps, features);
                // the first steps' outputs, for the peers to check theirs against
                let mut stream = model.stream(1)?;
                let check: Vec<f32> =
                    x[..check_steps * features].chunks_exact(features).flat_map(|x| stream.step(x).unwrap().to_vec()).collect();
                stream.reset_state()?;
                let mut ticks = vec![0u64; args.steps];
                let mut sink = 0.0f32;
                for x in x.chunks_exact(features).take(10_000) {
                    sink += stream.step(x)?[0];
                }
                let allocations = allocations_in(|| {
                    for (t, x) in ticks.iter_mut().zip(x.chunks_exact(features)) {
                        let t0 = Clock::now();
                        let out = stream.step(x).expect("a finite step");
                        let t1 = Clock::now();
                        sink += out[0];
                        *t = t1 - t0;
                    }
                });
                // the mean of a step with no clock around it: blocks of 1,000 steps, the best block
                let mut best = u64::MAX;
                for block in x.chunks_exact(features * 1_000).take(args.steps / 1_000) {
                    let t0 = Clock::now();
                    for x in block.chunks_exact(features) {
                        sink += stream.step(x).expect("a finite step")[0];
                    }
                    best = best.min(Clock::now() - t0);
                }
                std::hint::black_box(sink);
                let mean = best as f64 / clock.per_ns / 1_000.0;
                let flatnn = percentiles(&mut ticks, &clock);
                let floor = floor(weights_read(cell, hidden, features), &clock);
                println!(
                    "{name}: p50 {:.0} ns, p99 {:.0}, p99.9 {:.0}, max {:.0}; {allocations} allocations; {mean:.0} ns a step in blocks; floor {floor:.0} ns",
                    flatnn[0], flatnn[1], flatnn[2], flatnn[3]
                );
                let (peers, checked) = (Vec::new(), Vec::new());
                points.push(Point { cell: cell.clone(), hidden, features, flatnn, mean, allocations, floor, peers, check: checked });
                cases.push(json!({
                    "name": name, "cell": cell, "hidden": hidden, "features": features, "weights": weights,
                    "inputs": &x[..check_steps * features], "outputs": check,
                }));
            }
        }
    }
    if args.peers {
        run_peers(&args, &cases, &mut points);
    }
    report(&args, &points)
}

/// Runs `benches/peers/stream.py` on the cases and adds its results to the points.
fn run_peers(args: &Args, cases: &[Value], points: &mut [Point]) {
    let file = args.out.join("cases.json");
    if let Err(e) = std::fs::write(&file, Value::Array(cases.to_vec()).to_string()) {
        println!("peers: cannot write {}: {e}", file.display());
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/peers/stream.py");
    let output = std::process::Command::new(&args.python).arg(&script).arg(&file).arg(args.peer_steps.to_string()).output();
    let output = match output {
        Ok(o) => o,
        Err(e) => return println!("peers: cannot run {} {}: {e}", args.python, script.display()),
    };
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Some(json) = line.strip_prefix("@stream ") else {
            println!("{line}");
            continue;
        };
        let Ok(v) = serde_json::from_str::<Value>(json) else { continue };
        let Some(point) = points.iter_mut().find(|p| v["name"] == format!("{}_{}_{}", p.cell, p.hidden, p.features)) else { continue };
        let peer = v["peer"].as_str().unwrap_or("?").to_string();
        if let Some(q) = v["ns"].as_array() {
            let q: Vec<f64> = q.iter().filter_map(Value::as_f64).collect();
            if let [a, b, c, d] = q[..] {
                point.peers.push((peer.clone(), [a, b, c, d]));
            }
        }
        if let Some(diff) = v["max_abs_diff"].as_f64() {
            point.check.push((peer, diff));
        }
    }
}

/// The table and the CSV.
fn report(args: &Args, points: &[Point]) -> Result<()> {
    let mut csv = String::from("cell,hidden,features,who,p50_ns,p99_ns,p999_ns,max_ns,mean_ns,allocations,floor_ns,max_abs_diff\n");
    println!(
        "\n{:<5} {:>4} {:>2}  {:>28}  {:>6}  {:>7}  {:>7}  peers (p50 / p99 / p99.9 / max, ns)",
        "cell", "H", "F", "flatnn p50/p99/p99.9/max ns", "mean", "floor", "mean/fl"
    );
    for p in points {
        let q = |v: &[f64; 4]| format!("{:.0}/{:.0}/{:.0}/{:.0}", v[0], v[1], v[2], v[3]);
        let peers: Vec<String> = p.peers.iter().map(|(peer, v)| format!("{peer} {}", q(v))).collect();
        let (cell, h, f) = (&p.cell, p.hidden, p.features);
        println!(
            "{cell:<5} {h:>4} {f:>2}  {:>28}  {:>6.0}  {:>7.0}  {:>7.1}  {}",
            q(&p.flatnn),
            p.mean,
            p.floor,
            p.mean / p.floor,
            peers.join("; ")
        );
        let row = |who: &str, v: &[f64; 4], mean: String, diff: String| {
            format!("{cell},{h},{f},{who},{:.1},{:.1},{:.1},{:.1},{mean},{},{:.1},{diff}\n", v[0], v[1], v[2], v[3], p.allocations, p.floor)
        };
        csv += &row("flatnn", &p.flatnn, format!("{:.1}", p.mean), String::new());
        for (peer, v) in &p.peers {
            let diff = p.check.iter().find(|(c, _)| c == peer).map_or(String::new(), |(_, d)| format!("{d:e}"));
            csv += &row(peer, v, String::new(), diff);
        }
    }
    for p in points.iter().filter(|p| !p.check.is_empty()) {
        let checks: Vec<String> = p.check.iter().map(|(peer, d)| format!("{peer} {d:.1e}")).collect();
        println!(
            "{}_{}_{}: largest difference from flatnn's outputs over the check steps: {}",
            p.cell,
            p.hidden,
            p.features,
            checks.join(", ")
        );
    }
    let path = args.out.join("stream.csv");
    let mut file = std::fs::File::create(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
    file.write_all(csv.as_bytes()).map_err(|source| Error::Io { path: path.clone(), source })?;
    println!("wrote {}", path.display());
    Ok(())
}
