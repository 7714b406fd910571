//! flatnn's CPU GEMM against matrixmultiply at the shapes the models use, one thread, with
//! each instruction set this CPU runs side by side (AVX-512 and AVX2 where it has both).
//!
//!   cargo bench --bench gemm -- [--rounds N] [--quick] [--isas avx512,avx2,portable] [FILTER…]
//!
//! A figure is the time of one call by the process's CPU time (see `common/measure.rs`), GFLOP/s
//! (2·m·n·k per call) in brackets. flatnn's kernel is chosen once per process (`FLATNN_ISA`), so
//! each point runs in a process of its own: this binary again, with `FLATNN_ISA` set to the
//! column's set. For each shape the columns take turns, `--rounds` times (3; `--quick`: 1, and
//! shorter samples), in an order that rotates each round; the table gives the least of the
//! rounds' medians, stderr every round's. A forward product (B = Wᵀ) also has a `packed` column:
//! the weights packed once, as a layer's inference keeps them. FILTER words keep the shapes
//! whose name (`fwd_784x128`, `dw_128x784`, …) or product (`1x128x784`) contains one.
//!
//! The FMA peak (one thread, 8- and, where the CPU has them, 16-lane FMAs; and two threads'
//! by the wall clock) is measured before and after the table: the GEMM's rates are shares of
//! it, and a change between the two says the load changed. A FILTER no shape matches
//! (`cargo bench --bench gemm -- fma_peak`) gives the peak alone.

#[path = "common/measure.rs"]
mod measure;

use flatnn::gemm::{Gemm, Mat, MatMut};
use flatnn::testutil::Rng;
use measure::{least, Sampling};
use std::error::Error;
use std::process::Command;
use std::time::Duration;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// A product C (m×n) = A (m×k)·B (k×n) with the operand layouts a model step uses.
struct Shape {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    /// A stored transposed (k×m row-major), as dZᵀ in dW = dZᵀ·X.
    a_t: bool,
    /// B stored transposed (n×k row-major), as Wᵀ in the forward Y = X·Wᵀ.
    b_t: bool,
}

impl Shape {
    fn product(&self) -> String {
        format!("{}x{}x{}", self.m, self.n, self.k)
    }

    fn flops(&self) -> f64 {
        2.0 * (self.m * self.n * self.k) as f64
    }
}

fn shapes() -> Vec<Shape> {
    let mut out = Vec::new();
    for batch in [1, 32, 128, 1024, 4096] {
        out.push(Shape { name: "fwd_784x128", m: batch, n: 128, k: 784, a_t: false, b_t: true });
        out.push(Shape { name: "fwd_1024x1024", m: batch, n: 1024, k: 1024, a_t: false, b_t: true });
        out.push(Shape { name: "fwd_128x64", m: batch, n: 64, k: 128, a_t: false, b_t: true });
        out.push(Shape { name: "dw_128x784", m: 128, n: 784, k: batch, a_t: true, b_t: false });
        out.push(Shape { name: "dx_64x128", m: batch, n: 128, k: 64, a_t: false, b_t: false });
    }
    out.push(Shape { name: "square", m: 1024, n: 1024, k: 1024, a_t: false, b_t: false });
    out
}

/// What one column runs.
#[derive(Clone, Copy, PartialEq)]
enum Runner {
    /// `Gemm::sgemm`, both operands as they lie.
    Flatnn,
    /// `Gemm::sgemm_packed`, B packed once before timing.
    Packed,
    Matrixmultiply,
}

impl Runner {
    fn name(self) -> &'static str {
        match self {
            Runner::Flatnn => "flatnn",
            Runner::Packed => "packed",
            Runner::Matrixmultiply => "matrixmultiply",
        }
    }

    fn parse(name: &str) -> Option<Runner> {
        [Runner::Flatnn, Runner::Packed, Runner::Matrixmultiply].into_iter().find(|r| r.name() == name)
    }
}

/// A column of the table: flatnn's kernels of one instruction set, or matrixmultiply.
#[derive(Clone, Copy)]
struct Column {
    isa: Option<&'static str>,
    runner: Runner,
}

impl Column {
    fn title(self) -> String {
        match (self.isa, self.runner) {
            (Some(isa), Runner::Packed) => format!("{isa} packed"),
            (Some(isa), _) => isa.to_string(),
            (None, runner) => runner.name().to_string(),
        }
    }
}

struct Args {
    rounds: usize,
    quick: bool,
    isas: Vec<&'static str>,
    filters: Vec<String>,
    /// `--point ISA RUNNER SHAPE`: time one point in this process and print its seconds.
    point: Option<(String, Runner, usize)>,
}

const ISAS: [&str; 3] = ["avx512", "avx2", "portable"];

/// The x86 sets this CPU runs, best first (portable where it runs neither).
fn detected_isas() -> Vec<&'static str> {
    let mut isas = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        if is_x86_feature_detected!("avx512f") {
            isas.push("avx512");
        }
        isas.push("avx2");
    }
    if isas.is_empty() {
        isas.push("portable");
    }
    isas
}

fn parse_args() -> Result<Args> {
    let mut args = Args { rounds: 3, quick: false, isas: detected_isas(), filters: Vec::new(), point: None };
    let mut rounds = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--bench" => {}
            "--rounds" => rounds = Some(value()?.parse::<usize>().map_err(|e| format!("--rounds: {e}"))?.max(1)),
            "--quick" => args.quick = true,
            "--isas" => {
                let list = value()?;
                args.isas = list
                    .split(',')
                    .map(|s| ISAS.into_iter().find(|&i| i == s).ok_or_else(|| format!("--isas: unknown set {s:?}")))
                    .collect::<std::result::Result<_, _>>()?;
            }
            "--point" => {
                let (isa, runner, shape) = (value()?, value()?, value()?);
                let runner = Runner::parse(&runner).ok_or_else(|| format!("--point: unknown runner {runner:?}"))?;
                args.point = Some((isa, runner, shape.parse().map_err(|e| format!("--point: shape {shape:?}: {e}"))?));
            }
            filter if !filter.starts_with('-') => args.filters.push(filter.to_string()),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    args.rounds = rounds.unwrap_or(if args.quick { 1 } else { 3 });
    Ok(args)
}

fn sampling(quick: bool) -> Sampling {
    if quick {
        Sampling { warmup: Duration::from_millis(10), sample: Duration::from_millis(2), samples: 3 }
    } else {
        Sampling { warmup: Duration::from_millis(30), sample: Duration::from_millis(5), samples: 7 }
    }
}

/// CPU seconds per call of one point, in this process; `isa` must be the set its kernels run.
fn point(isa: &str, runner: Runner, s: &Shape, sampling: Sampling) -> Result<f64> {
    let mut rng = Rng::new(1);
    let (a, b) = (rng.uniform(s.m * s.k), rng.uniform(s.k * s.n));
    let mut out = vec![0.0f32; s.m * s.n];
    let (ars, acs) = if s.a_t { (1, s.m) } else { (s.k, 1) };
    let (brs, bcs) = if s.b_t { (1, s.k) } else { (s.n, 1) };
    let (am, bm) = (Mat { data: &a, rs: ars, cs: acs }, Mat { data: &b, rs: brs, cs: bcs });
    let mut gemm = Gemm::new(1)?;
    if runner != Runner::Matrixmultiply && gemm.isa() != isa {
        return Err(format!("asked for {isa} kernels, the process runs {} (FLATNN_ISA caps the CPU's)", gemm.isa()).into());
    }
    let mut failed = None;
    let seconds = match runner {
        Runner::Flatnn => sampling.per_call(|| {
            if let Err(e) = gemm.sgemm(s.m, s.n, s.k, 1.0, am, bm, 0.0, MatMut { data: &mut out, rs: s.n, cs: 1 }) {
                failed = Some(e);
            }
        }),
        Runner::Packed => {
            let packed = gemm.pack(s.k, s.n, bm)?;
            sampling.per_call(|| {
                if let Err(e) = gemm.sgemm_packed(s.m, 1.0, am, &packed, 0.0, MatMut { data: &mut out, rs: s.n, cs: 1 }) {
                    failed = Some(e);
                }
            })
        }
        Runner::Matrixmultiply => sampling.per_call(|| {
            let (ars, acs, brs, bcs) = (ars as isize, acs as isize, brs as isize, bcs as isize);
            // SAFETY: the buffers hold the matrices at the given strides (m×k, k×n, m×n).
            unsafe {
                matrixmultiply::sgemm(
                    s.m,
                    s.k,
                    s.n,
                    1.0,
                    a.as_ptr(),
                    ars,
                    acs,
                    b.as_ptr(),
                    brs,
                    bcs,
                    0.0,
                    out.as_mut_ptr(),
                    s.n as isize,
                    1,
                )
            }
        }),
    };
    std::hint::black_box(&out);
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(seconds),
    }
}

/// One point in a process of its own, `FLATNN_ISA` set to its column's set.
fn point_in_child(column: Column, shape: usize, quick: bool) -> Result<f64> {
    let exe = std::env::current_exe()?;
    let isa = column.isa.unwrap_or("portable");
    let mut cmd = Command::new(exe);
    cmd.args(["--point", isa, column.runner.name(), &shape.to_string()]);
    if quick {
        cmd.arg("--quick");
    }
    if column.isa.is_some() {
        cmd.env("FLATNN_ISA", isa);
    }
    let out = cmd.output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!("{} at shape {shape}: {}{}", column.title(), text.trim(), String::from_utf8_lossy(&out.stderr).trim()).into());
    }
    Ok(text.trim().parse::<f64>().map_err(|e| format!("{} at shape {shape}: {text:?}: {e}", column.title()))?)
}

/// "7.9 µs (25)": a time and its GFLOP/s.
fn cell(seconds: f64, flops: f64) -> String {
    let time = if seconds >= 1e-3 { format!("{:.2} ms", seconds * 1e3) } else { format!("{:.1} µs", seconds * 1e6) };
    format!("{time} ({:.0})", flops / seconds / 1e9)
}

/// Rounds of 12 independent 8-lane FMAs in [`fma_chains`].
const PEAK_ROUNDS: u64 = 100_000;

/// 12 independent accumulator chains (more than FMA latency × ports), so this measures the
/// core's FMA throughput: the "peak" that the GEMM rates are shares of.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_chains(x: f32) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(x), _mm256_set1_ps(0.999));
    let mut acc = [_mm256_set1_ps(1.0); 12];
    for _ in 0..PEAK_ROUNDS {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, b, a);
        }
    }
    let mut out = [0.0f32; 8];
    let sum = acc.iter().fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v));
    _mm256_storeu_ps(out.as_mut_ptr(), sum);
    out.iter().sum()
}

/// As [`fma_chains`] with 16-lane FMAs: 16 chains fit the 32 registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_chains_512(x: f32) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(x), _mm512_set1_ps(0.999));
    let mut acc = [_mm512_set1_ps(1.0); 16];
    for _ in 0..PEAK_ROUNDS {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, b, a);
        }
    }
    _mm512_reduce_add_ps(acc.iter().fold(_mm512_setzero_ps(), |s, &v| _mm512_add_ps(s, v)))
}

/// GFLOP/s of two threads each running [`fma_chains`] `calls` times at once, by the wall clock
/// (CPU time would count both): what the machine's two cores give together, the best of
/// `samples` tries.
#[cfg(target_arch = "x86_64")]
fn fma_peak_two_threads(calls: usize, samples: usize) -> f64 {
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"), "the FMA peak needs AVX2 and FMA");
    let best = (0..samples.max(1))
        .map(|_| {
            let start = std::time::Instant::now();
            std::thread::scope(|scope| {
                for _ in 0..2 {
                    scope.spawn(|| {
                        for _ in 0..calls {
                            // SAFETY: AVX2 and FMA were detected above.
                            std::hint::black_box(unsafe { fma_chains(std::hint::black_box(1e-3)) });
                        }
                    });
                }
            });
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    (2 * calls as u64 * PEAK_ROUNDS * 12 * 8 * 2) as f64 / best / 1e9
}

/// "8-lane 117, 16-lane 117 GFLOP/s; two threads …": the FMA peak, as far as the CPU has the
/// lanes.
fn fma_peak(sampling: Sampling) -> String {
    let mut parts = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        let s = sampling.per_call(|| {
            // SAFETY: AVX2 and FMA were detected above.
            std::hint::black_box(unsafe { fma_chains(std::hint::black_box(1e-3)) });
        });
        parts.push(format!("8-lane {:.0}", (PEAK_ROUNDS * 12 * 8 * 2) as f64 / s / 1e9));
        if is_x86_feature_detected!("avx512f") {
            let s = sampling.per_call(|| {
                // SAFETY: AVX-512F was detected.
                std::hint::black_box(unsafe { fma_chains_512(std::hint::black_box(1e-3)) });
            });
            parts.push(format!("16-lane {:.0}", (PEAK_ROUNDS * 16 * 16 * 2) as f64 / s / 1e9));
        }
    }
    if parts.is_empty() {
        return "no x86 FMA".into();
    }
    #[cfg(target_arch = "x86_64")]
    let two = format!("; two threads, 8-lane, by the wall clock: {:.0}", fma_peak_two_threads(40, sampling.samples));
    #[cfg(not(target_arch = "x86_64"))]
    let two = String::new();
    parts.join(", ") + " GFLOP/s" + &two
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let sampling = sampling(args.quick);
    let shapes = shapes();
    if let Some((isa, runner, index)) = &args.point {
        let shape = shapes.get(*index).ok_or_else(|| format!("--point: no shape {index}"))?;
        println!("{:e}", point(isa, *runner, shape, sampling)?);
        return Ok(());
    }
    let chosen: Vec<usize> = (0..shapes.len())
        .filter(|&i| {
            let s = &shapes[i];
            args.filters.is_empty() || args.filters.iter().any(|f| s.name.contains(f.as_str()) || s.product().contains(f.as_str()))
        })
        .collect();
    let columns = |s: &Shape| -> Vec<Column> {
        let mut cols = Vec::new();
        for &isa in &args.isas {
            cols.push(Column { isa: Some(isa), runner: Runner::Flatnn });
            if s.b_t {
                cols.push(Column { isa: Some(isa), runner: Runner::Packed });
            }
        }
        cols.push(Column { isa: None, runner: Runner::Matrixmultiply });
        cols
    };
    println!("machine: {}", measure::machine());
    println!("load average at the start: {}", measure::load());
    println!("FMA peak before: one thread {}", fma_peak(sampling));
    if chosen.is_empty() {
        return Ok(());
    }
    println!(
        "one thread; the least of {} rounds' medians of process CPU time per call (columns alternating), GFLOP/s in brackets\n",
        args.rounds
    );
    let mut header = vec!["product (m×n×k)".to_string()];
    header.extend(args.isas.iter().flat_map(|isa| [isa.to_string(), format!("{isa} packed")]));
    header.push("matrixmultiply".into());
    header.extend(args.isas.iter().map(|isa| format!("mm / {isa}")));
    println!("| {} |", header.join(" | "));
    println!("|{}", "---|".repeat(header.len()));
    for &i in &chosen {
        let s = &shapes[i];
        let cols = columns(s);
        let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); cols.len()];
        for round in 0..args.rounds {
            for c in (0..cols.len()).map(|c| (c + round) % cols.len()) {
                rounds[c].push(point_in_child(cols[c], i, args.quick)?);
            }
        }
        let best: Vec<f64> = rounds.iter().map(|r| least(r)).collect();
        for (c, r) in cols.iter().zip(&rounds) {
            let us: Vec<String> = r.iter().map(|t| format!("{:.2}", t * 1e6)).collect();
            eprintln!("{} {} {}: {} µs", s.name, s.product(), c.title(), us.join(" "));
        }
        let find = |isa: Option<&str>, runner: Runner| cols.iter().position(|c| c.isa == isa && c.runner == runner).map(|c| best[c]);
        let mm = find(None, Runner::Matrixmultiply).unwrap_or(f64::NAN);
        let mut row = vec![format!("{} {}", s.name.split('_').next().unwrap_or(s.name), s.product().replace('x', "×"))];
        for &isa in &args.isas {
            for runner in [Runner::Flatnn, Runner::Packed] {
                row.push(find(Some(isa), runner).map_or("—".into(), |t| cell(t, s.flops())));
            }
        }
        row.push(cell(mm, s.flops()));
        for &isa in &args.isas {
            row.push(find(Some(isa), Runner::Flatnn).map_or("—".into(), |t| format!("{:.2}×", mm / t)));
        }
        println!("| {} |", row.join(" | "));
    }
    println!("\nFMA peak after: one thread {}", fma_peak(sampling));
    println!("load average at the end: {}", measure::load());
    Ok(())
}
