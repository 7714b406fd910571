//! What the one-thread CPU benches (`gemm`, `floor`) and `examples/layer_times` share: time per
//! call by the process's CPU time (or another clock), and a line naming the machine and its load.
//!
//! The development machine is shared with other jobs, so a wall clock there measures them too.
//! CPU time leaves out the time this process waits for a core; it still includes what their
//! caches cost it (its lines evicted while it waited), which the minimum over rounds leaves
//! out as far as it can: each bench takes, for each figure, the median over one round's
//! samples, and then the smallest of those medians over rounds that alternate the things
//! compared.

use std::time::Duration;

/// CPU time of this process (all its threads), in seconds.
pub fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live local; the clock id
    // is a constant every Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// How one figure is sampled: a warm-up of at least two calls and `warmup` of CPU time, then
/// `samples` samples of back-to-back calls, each at least `sample` long.
#[derive(Clone, Copy)]
pub struct Sampling {
    pub warmup: Duration,
    pub sample: Duration,
    pub samples: usize,
}

impl Sampling {
    /// The median over the samples of the CPU seconds per call of `call`.
    pub fn per_call(self, call: impl FnMut()) -> f64 {
        self.per_call_on(cpu_seconds, call)
    }

    /// The median over the samples of the seconds per call of `call` by `clock` (seconds from
    /// any fixed start): the warm-up and the samples' lengths are measured by it too.
    pub fn per_call_on(self, clock: fn() -> f64, mut call: impl FnMut()) -> f64 {
        let (start, mut calls) = (clock(), 0usize);
        let once = loop {
            let s = clock();
            call();
            calls += 1;
            let last = clock() - s;
            if calls >= 2 && clock() - start >= self.warmup.as_secs_f64() {
                break last.max(1e-9);
            }
        };
        let per_sample = ((self.sample.as_secs_f64() / once).ceil() as usize).max(1);
        let mut times: Vec<f64> = (0..self.samples.max(1))
            .map(|_| {
                let s = clock();
                (0..per_sample).for_each(|_| call());
                (clock() - s) / per_sample as f64
            })
            .collect();
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    }
}

/// The smallest value, the figure a bench reports from its rounds' medians.
pub fn least(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}

/// "AMD EPYC, family 25 model 17, avx2 fma avx512f; L1d 32K, L2 1024K, L3 32768K": what
/// /proc/cpuinfo and /sys say of CPU 0 (whatever of it this system has).
pub fn machine() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map_or(String::from("?"), |(_, v)| v.trim().to_string())
    };
    let flags = field("flags");
    let isa: Vec<&str> = ["avx2", "fma", "avx512f"].into_iter().filter(|f| flags.split_whitespace().any(|g| g == *f)).collect();
    let caches: Vec<String> = (0..8)
        .map_while(|i| {
            let read = |f: &str| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/{f}")).ok();
            let (level, kind, size) = (read("level")?, read("type")?, read("size")?);
            let name = match kind.trim() {
                "Instruction" => return Some(None),
                "Data" => format!("L{}d", level.trim()),
                _ => format!("L{}", level.trim()),
            };
            Some(Some(format!("{name} {}", size.trim())))
        })
        .flatten()
        .collect();
    format!("{}, family {} model {}, {}; {}", field("model name"), field("cpu family"), field("model"), isa.join(" "), caches.join(", "))
}

/// The 1-, 5- and 15-minute load averages, as /proc/loadavg gives them.
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(|_| "?".into(), |s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}
