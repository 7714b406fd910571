//! The model zoo against PyTorch and ONNX Runtime, in one run: flatnn's figures, then the peers'
//! (`benches/peers/zoo.py`, one process), then one table per device and task with the ratio
//! best peer / flatnn, a table with every peer, a CSV and an SVG plot; and `routes.txt`, each
//! flatnn point's `Cache::routes` (what every layer ran on, with the others' times), from which
//! one can tell which routes ever win.
//!
//!   cargo bench --bench zoo -- [--models a,b] [--tasks train,infer,latency]
//!       [--devices cpu1,cpu,gpu,gpu-tf32] [--batches 1,8,64] [--peers|--no-peers] [--compile]
//!       [--quick] [--cpu1-clock wall|cpu] [--out DIR] [--python PATH] [--check] [--from FILE.csv]
//!       [--nondeterministic] [--flush-subnormals]
//!
//! `--nondeterministic` runs the GPU devices with `GpuOptions::deterministic` off (cuDNN's
//! non-deterministic convolution algorithms allowed, as the peers' `cudnn.benchmark` allows
//! them), named `gpu-nd` and `gpu-tf32-nd` in the tables and the CSV.
//!
//! `--flush-subnormals` runs every side with flush-to-zero and denormals-are-zero: flatnn on this
//! thread (its pool's threads take the caller's floating-point mode), PyTorch through
//! `torch.set_flush_denormal`, ONNX Runtime through its session option.
//!
//! `--from FILE.csv` measures nothing: it writes `zoo.txt` and `zoo.svg` again from a CSV the zoo
//! wrote, for the models, devices, tasks and batches chosen (all of the file's by default).
//!
//! See BENCHMARKS.md, "Zoo", for what each task includes on each side and how points are timed.

mod check;
mod engine;
mod figures;
#[path = "../common/flush.rs"]
mod flush;
mod peers;
mod replot;
mod report;
mod svg;
mod timing;

use crate::engine::{ZooModel, ZOO};
use crate::figures::{Figure, Place, Task};
use crate::replot::{Replot, Selection};
use crate::report::Results;
use crate::timing::Timing;
use ::flatnn::prelude::*;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `Result` with flatnn's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

const BATCHES: [usize; 6] = [1, 8, 64, 256, 1024, 4096];
/// The batches `--compile` measures torch.compile at (and adds to the default list).
const COMPILE_BATCHES: [usize; 3] = [8, 64, 512];
const LATENCY_MAX_BATCH: usize = 128;

struct Args {
    models: Vec<&'static ZooModel>,
    tasks: Vec<Task>,
    places: Vec<Place>,
    batches: Vec<usize>,
    peers: bool,
    compile: bool,
    quick: bool,
    check: bool,
    /// Time `cpu1` points by process CPU time (both sides), not the wall clock.
    cpu1_cpu_clock: bool,
    out: PathBuf,
    python: String,
    /// A CSV to write the tables and plot from, instead of measuring.
    from: Option<PathBuf>,
    /// Which of `--models`, `--tasks`, `--devices`, `--batches` were given.
    chosen: Chosen,
    /// Flush-to-zero and denormals-are-zero on every side.
    flush_subnormals: bool,
}

#[derive(Default)]
struct Chosen {
    models: bool,
    tasks: bool,
    places: bool,
    batches: bool,
}

const USAGE: &str = "cargo bench --bench zoo -- [--models a,b] [--tasks train,infer,latency] [--devices cpu1,cpu,gpu,gpu-tf32] \
[--batches 1,8,64] [--peers|--no-peers] [--compile] [--quick] [--cpu1-clock wall|cpu] [--out DIR] [--python PATH] [--check] \
[--from FILE.csv] [--nondeterministic] [--flush-subnormals]\n--from FILE.csv: measure nothing; write zoo.txt and zoo.svg again from a CSV the zoo wrote \
(add --quick where that run was quick: the CSV does not hold its per-call limit)\n--nondeterministic: flatnn's GPU devices with \
GpuOptions::deterministic off (cuDNN's non-deterministic algorithms allowed), named gpu-nd and gpu-tf32-nd \
(also accepted by --devices)\n--flush-subnormals: every side with flush-to-zero and denormals-are-zero";

fn list<T>(text: &str, what: &str, parse: impl Fn(&str) -> Option<T>) -> Result<Vec<T>> {
    text.split(',').filter(|s| !s.is_empty()).map(|s| parse(s).ok_or_else(|| Error::Config(format!("unknown {what} {s:?}")))).collect()
}

fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        models: ZOO.iter().collect(),
        tasks: Task::ALL.to_vec(),
        places: Place::ALL.to_vec(),
        batches: Vec::new(),
        peers: true,
        compile: false,
        quick: false,
        check: false,
        cpu1_cpu_clock: false,
        out: manifest_dir().join("target/flatnn-bench"),
        python: "python3".into(),
        from: None,
        chosen: Chosen::default(),
        flush_subnormals: false,
    };
    let mut nondeterministic = false;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| Error::Config(format!("{arg} needs a value; usage: {USAGE}")));
        match arg.as_str() {
            "--bench" | "--" => {}
            "--models" => (args.models, args.chosen.models) = (list(&value()?, "model", |s| ZOO.iter().find(|m| m.name == s))?, true),
            "--tasks" => {
                (args.tasks, args.chosen.tasks) = (list(&value()?, "task", |s| Task::ALL.into_iter().find(|t| t.label() == s))?, true)
            }
            "--devices" => {
                (args.places, args.chosen.places) =
                    (list(&value()?, "device", |s| Place::NAMED.into_iter().find(|p| p.label() == s))?, true)
            }
            "--batches" => {
                (args.batches, args.chosen.batches) = (list(&value()?, "batch", |s| s.parse().ok().filter(|&b: &usize| b > 0))?, true)
            }
            "--peers" => args.peers = true,
            "--no-peers" => args.peers = false,
            "--compile" => args.compile = true,
            "--quick" => args.quick = true,
            "--check" => args.check = true,
            "--cpu1-clock" => {
                args.cpu1_cpu_clock = match value()?.as_str() {
                    "cpu" => true,
                    "wall" => false,
                    other => return Err(Error::Config(format!("--cpu1-clock {other:?}: expected cpu or wall"))),
                }
            }
            "--out" => args.out = PathBuf::from(value()?),
            "--python" => args.python = value()?,
            "--from" => args.from = Some(PathBuf::from(value()?)),
            "--nondeterministic" => nondeterministic = true,
            "--flush-subnormals" => args.flush_subnormals = true,
            "--help" | "-h" => {
                println!("{USAGE}\nmodels: {}", ZOO.iter().map(|m| m.name).collect::<Vec<_>>().join(", "));
                std::process::exit(0);
            }
            other => return Err(Error::Config(format!("unknown argument {other:?}; usage: {USAGE}"))),
        }
    }
    if args.batches.is_empty() {
        args.batches = BATCHES.to_vec();
        if args.compile {
            args.batches.extend(COMPILE_BATCHES);
        }
    }
    args.batches.sort_unstable();
    args.batches.dedup();
    if nondeterministic {
        let mut places = Vec::new();
        for place in args.places.iter().map(|p| p.without_determinism()) {
            if !places.contains(&place) {
                places.push(place);
            }
        }
        // under --from, the figures of these devices alone, as a run with the flag measures
        (args.places, args.chosen.places) = (places, true);
    }
    Ok(args)
}

/// CUDA device 0 if flatnn can use it, else why not.
fn gpu() -> std::result::Result<Device, String> {
    #[cfg(feature = "cuda")]
    {
        if ::flatnn::cuda::is_functional() {
            return Device::cuda(0).map_err(|e| format!("no CUDA device ({e})"));
        }
    }
    Err("no CUDA device".into())
}

/// The commit, with "-dirty" where tracked files changed, if git is there.
fn commit(dir: &Path) -> String {
    let git = |args: &[&str]| std::process::Command::new("git").arg("-C").arg(dir).args(args).output().ok().filter(|o| o.status.success());
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(o) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|o| !o.stdout.is_empty());
            format!("{}{}", String::from_utf8_lossy(&o.stdout).trim(), if dirty { "-dirty" } else { "" })
        }
        None => "unknown (no git)".into(),
    }
}

/// The CPU's model name and the flags that matter, from /proc/cpuinfo.
fn cpu_line() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| info.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string());
    let mut name = field("model name").unwrap_or_else(|| "unknown".into());
    if let (Some(family), Some(model)) = (field("cpu family"), field("model\t")) {
        name = format!("{name} (family {family}, model {model})");
    }
    let flags = field("flags").unwrap_or_default();
    let has: Vec<&str> = ["avx2", "fma", "avx512f"].into_iter().filter(|f| flags.split_whitespace().any(|x| x == *f)).collect();
    let logical = info.lines().filter(|l| l.starts_with("processor")).count();
    format!("{name}, {logical} logical CPUs, flags: {}", if has.is_empty() { "none of avx2/fma/avx512f".into() } else { has.join(" ") })
}

/// The first three fields of /proc/loadavg: how busy the host was (other jobs included).
fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let fields: Vec<&str> = text.split_whitespace().take(3).collect();
    if fields.is_empty() {
        "unknown".into()
    } else {
        fields.join(" ")
    }
}

fn write(dir: &Path, name: &str, text: &str) -> Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, text).map_err(|source| Error::Io { path: path.clone(), source })?;
    println!("wrote {}", path.display());
    Ok(())
}

/// `--from`: the tables and plot of the CSV's figures, as a run that measured them would write them.
fn replot(args: &Args, path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
    let names: Vec<&str> = args.models.iter().map(|m| m.name).collect();
    let chosen = Selection {
        models: args.chosen.models.then_some(&names[..]),
        places: args.chosen.places.then_some(&args.places[..]),
        tasks: args.chosen.tasks.then_some(&args.tasks[..]),
        batches: args.chosen.batches.then_some(&args.batches[..]),
    };
    let replot = Replot::new(replot::parse(&text, path)?, &chosen);
    let title = format!("flatnn zoo, tables rebuilt from {}", path.display());
    let (tables, plot) = replot.files(&title, Timing::new(args.quick).limit_s);
    println!("{tables}");
    write(&args.out, "zoo.txt", &tables)?;
    write(&args.out, "zoo.svg", &plot)
}

fn main() -> Result<()> {
    let started = Instant::now();
    let args = parse_args()?;
    let script = manifest_dir().join("benches/peers/zoo.py");
    std::fs::create_dir_all(&args.out).map_err(|source| Error::Io { path: args.out.clone(), source })?;
    if let Some(path) = &args.from {
        return replot(&args, path);
    }
    if args.check {
        let ok = check::run(&args.models, &args.out.join("check"), &args.python, &script)?;
        println!("check: {}", if ok { "every output and loss agrees" } else { "MISMATCH (see above)" });
        std::process::exit(if ok { 0 } else { 1 });
    }
    let timing = Timing::new(args.quick);
    if args.flush_subnormals {
        flush::flush_subnormals().map_err(|e| Error::Config(format!("--flush-subnormals: {e}")))?;
    }
    let threads = Chain::new(Input::vector(1)).dense(1, Identity).build()?.threads();
    let gpu = if args.places.iter().any(|p| p.is_gpu()) { Some(gpu()) } else { None };
    let mut header = format!("flatnn zoo, commit {}\nCPU: {}\nthreads: cpu1 = 1, cpu = {threads}\n", commit(&manifest_dir()), cpu_line());
    let places: Vec<Place> = args.places.iter().copied().filter(|p| !p.is_gpu() || matches!(gpu, Some(Ok(_)))).collect();
    match &gpu {
        Some(Ok(device)) => {
            let _ = writeln!(header, "GPU (flatnn): {}", device.name()?);
            let nd: Vec<&str> = places.iter().filter(|p| p.nondeterministic()).map(|p| p.label()).collect();
            if !nd.is_empty() {
                let _ = writeln!(
                    header,
                    "{}: flatnn with GpuOptions::deterministic off (cuDNN's non-deterministic algorithms allowed); the peers as on gpu, gpu-tf32",
                    nd.join(", ")
                );
            }
        }
        Some(Err(why)) => {
            let skipped: Vec<&str> = args.places.iter().filter(|p| p.is_gpu()).map(|p| p.label()).collect();
            let _ = writeln!(header, "{}: skipped: {why}", skipped.join(", "));
        }
        None => {}
    }
    if args.flush_subnormals {
        header.push_str("flush-to-zero and denormals-are-zero on every side (flatnn: this thread's MXCSR, which its pool follows; PyTorch: torch.set_flush_denormal; ONNX Runtime: session.set_denormal_as_zero)\n");
    }
    print!("{header}");
    let names: Vec<&str> = args.models.iter().map(|m| m.name).collect();
    let config = serde_json::json!({
        "timing": timing.to_json(), "threads": threads, "latency_max_batch": LATENCY_MAX_BATCH,
        "compile_batches": COMPILE_BATCHES, "flush_subnormals": args.flush_subnormals,
    });
    // the peer process, and why it stopped answering (or never started)
    let (mut peer, mut peers_failed) = match (args.peers, places.is_empty()) {
        (false, _) => (None, Some("not run (--no-peers)".to_string())),
        (true, true) => (None, Some("not run (nothing to measure here)".to_string())),
        (true, false) => match peers::Peer::start(&args.python, &script, &config, args.compile) {
            Ok(p) => (Some(p), None),
            Err(why) => (None, Some(why)),
        },
    };
    if let Some(p) = &peer {
        // the peers must run the same networks: the same parameter count, model by model
        for zoo in &args.models {
            let ours = (zoo.chain)().build()?.parameters()?.len();
            match p.params.iter().find(|(n, _)| n == zoo.name) {
                Some(&(_, theirs)) if theirs != ours => {
                    return Err(Error::Mismatch(format!(
                        "{}: flatnn has {ours} parameters, the peers' twin {theirs}: not the same network",
                        zoo.name
                    )));
                }
                Some(_) => {}
                None => {
                    let _ = writeln!(header, "peers: no model {} in benches/peers/zoo_models.py", zoo.name);
                }
            }
        }
    }
    let load_before = load_average();
    let device = gpu.and_then(Result::ok);
    let (mut figures, mut routes): (Vec<Figure>, String) = (Vec::new(), String::new());
    for &zoo in &args.models {
        for &place in &places {
            let mut runner = engine::Runner::new(zoo, place, device);
            let timing = Timing { cpu_clock: args.cpu1_cpu_clock && place == Place::Cpu1, ..timing };
            for &batch in &args.batches {
                let tasks: Vec<Task> = args.tasks.iter().copied().filter(|&t| t != Task::Latency || batch <= LATENCY_MAX_BATCH).collect();
                if tasks.is_empty() {
                    continue;
                }
                figures.extend(runner.batch(batch, &tasks, &timing));
                let Some(p) = peer.as_mut().filter(|p| peers_failed.is_none() && p.params.iter().any(|(n, _)| n == zoo.name)) else {
                    continue;
                };
                match p.point(zoo.name, place, batch, &tasks, timing.cpu_clock) {
                    Ok(theirs) => figures.extend(theirs),
                    Err(why) => peers_failed = Some(why),
                }
            }
            routes += &runner.routes;
        }
    }
    let _ = writeln!(header, "load average (1, 5, 15 min) before: {load_before}; after: {}", load_average());
    let (mut missing, mut peers_s) = (Vec::new(), 0.0);
    if let Some(p) = peer {
        let env: Vec<String> = p.env.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(header, "peers: {}", env.join(", "));
        if !p.not_importable.is_empty() {
            let _ = writeln!(header, "peers: {}", p.not_importable);
        }
        let sources: Vec<String> = p.onnx_source.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        if !sources.is_empty() {
            let _ = writeln!(header, "ONNX files: {}", sources.join("; "));
        }
        (missing, peers_s) = (p.missing.clone(), p.seconds);
        p.finish();
    }
    if let Some(why) = &peers_failed {
        let _ = writeln!(header, "peers: {why}");
    }
    let _ = writeln!(header, "timing: {}", timing.describe());
    if args.cpu1_cpu_clock {
        let _ = writeln!(header, "cpu1 timed by process CPU time on both sides (--cpu1-clock cpu): the load of other jobs left out");
    }
    let _ = writeln!(header, "total {:.0} s (peers {peers_s:.0} s of it)", started.elapsed().as_secs_f64());
    let results = Results {
        figures: &figures,
        models: &names,
        places: &places,
        tasks: &args.tasks,
        missing: &missing,
        peers_failed: peers_failed.as_deref(),
        limit_s: timing.limit_s,
    };
    let text = header.clone() + &report::tables(&results);
    println!("{}", &text[header.len()..]);
    println!("{}", header.lines().last().unwrap_or_default());
    write(&args.out, "zoo.txt", &text)?;
    write(&args.out, "zoo.csv", &report::csv(&results))?;
    write(&args.out, "routes.txt", &routes)?;
    let title = header.lines().take(2).collect::<Vec<_>>().join(" — ");
    write(&args.out, "zoo.svg", &svg::plot(&results, &title))?;
    Ok(())
}
