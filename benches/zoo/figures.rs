//! What the zoo measures and what it records: devices, tasks, and one figure per point and runner.

use std::fmt;

/// Where a point runs, as the tables name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Place {
    /// The CPU, one thread.
    Cpu1,
    /// The CPU, the model's default thread count (every physical core).
    Cpu,
    /// CUDA device 0, FP32 (peers: TF32 off everywhere).
    Gpu,
    /// CUDA device 0, TF32 allowed (peers: PyTorch's defaults, and TF32 on everywhere).
    GpuTf32,
    /// `Gpu` with flatnn's `GpuOptions::deterministic` off (`--nondeterministic`): cuDNN's
    /// non-deterministic convolution algorithms allowed, as the peers' `cudnn.benchmark` allows
    /// them (the peers as on `Gpu`).
    GpuNd,
    /// `GpuTf32` with `GpuOptions::deterministic` off (the peers as on `GpuTf32`).
    GpuTf32Nd,
}

impl Place {
    /// The devices a run measures unless `--devices` says otherwise.
    pub const ALL: [Place; 4] = [Place::Cpu1, Place::Cpu, Place::Gpu, Place::GpuTf32];
    /// Every device a run (or its CSV) may name.
    pub const NAMED: [Place; 6] = [Place::Cpu1, Place::Cpu, Place::Gpu, Place::GpuTf32, Place::GpuNd, Place::GpuTf32Nd];

    pub fn label(self) -> &'static str {
        match self {
            Place::Cpu1 => "cpu1",
            Place::Cpu => "cpu",
            Place::Gpu => "gpu",
            Place::GpuTf32 => "gpu-tf32",
            Place::GpuNd => "gpu-nd",
            Place::GpuTf32Nd => "gpu-tf32-nd",
        }
    }

    pub fn is_gpu(self) -> bool {
        matches!(self, Place::Gpu | Place::GpuTf32 | Place::GpuNd | Place::GpuTf32Nd)
    }

    /// Whether flatnn runs with `GpuOptions::deterministic` off here.
    pub fn nondeterministic(self) -> bool {
        matches!(self, Place::GpuNd | Place::GpuTf32Nd)
    }

    /// The place `--nondeterministic` measures instead of this one: a GPU's twin with
    /// `GpuOptions::deterministic` off; the CPUs unchanged.
    pub fn without_determinism(self) -> Place {
        match self {
            Place::Gpu => Place::GpuNd,
            Place::GpuTf32 => Place::GpuTf32Nd,
            other => other,
        }
    }

    /// The place whose peers this one is compared with (the peers' determinism does not change).
    pub fn peers(self) -> Place {
        match self {
            Place::GpuNd => Place::Gpu,
            Place::GpuTf32Nd => Place::GpuTf32,
            other => other,
        }
    }

    /// How the tables' titles name it: the label, and for `gpu-nd` and `gpu-tf32-nd` what
    /// flatnn gave up.
    pub fn title(self) -> String {
        match self.nondeterministic() {
            true => format!("{} (flatnn: GpuOptions::deterministic off, cuDNN's non-deterministic algorithms allowed)", self.label()),
            false => self.label().to_string(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Task {
    /// `Optimizer::train_step` (Adam) on a batch resident in the cache.
    Train,
    /// `Model::forward` on resident inputs (from a GPU, outputs copied back).
    Infer,
    /// `set_inputs` from the host, `forward`, outputs on the host: p50 and p99 of single calls.
    Latency,
}

impl Task {
    pub const ALL: [Task; 3] = [Task::Train, Task::Infer, Task::Latency];

    pub fn label(self) -> &'static str {
        match self {
            Task::Train => "train",
            Task::Infer => "infer",
            Task::Latency => "latency",
        }
    }
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The runner name of flatnn's own figures.
pub const FLATNN: &str = "flatnn";

/// One measured (or skipped) point of one runner.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    pub model: String,
    pub place: Place,
    pub task: Task,
    pub batch: usize,
    /// `flatnn`, or a peer's name (`ort`, `pt-graph:fp32`, …).
    pub runner: String,
    /// Median seconds per call (p50 for latency); `None` where skipped, and `note` says why.
    pub seconds: Option<f64>,
    pub p99: Option<f64>,
    pub calls: usize,
    pub note: Option<String>,
}

/// "12.3 µs", "4.56 ms", "1.23 s".
pub fn fmt_seconds(t: f64) -> String {
    let (v, unit) = if t < 1e-3 {
        (t * 1e6, "µs")
    } else if t < 1.0 {
        (t * 1e3, "ms")
    } else {
        (t, "s")
    };
    if v >= 100.0 {
        format!("{v:.0} {unit}")
    } else if v >= 10.0 {
        format!("{v:.1} {unit}")
    } else {
        format!("{v:.2} {unit}")
    }
}
