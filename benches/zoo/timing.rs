//! The zoo's timing method; `benches/peers/zoo_timing.py` is its twin and gets these constants
//! as JSON, so both sides time alike.
//!
//! `repeated`: a warm-up (at least two calls and `warmup_s`), then samples of back-to-back calls,
//! each at least `min_sample_s` long (the last call of a sample gets `end = true` and must wait
//! for the device), between `min_samples` and `max_samples` samples within about `point_s`;
//! the median time per call. `single`: the warm-up, then `latency_s` worth of calls (between
//! `min_calls` and `max_calls`), each timed alone; p50 and p99 by nearest rank. A call over
//! `limit_s` ends the point.

use crate::Result;
use ::flatnn::prelude::*;
use std::sync::OnceLock;
use std::time::Instant;

#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub warmup_s: f64,
    pub min_sample_s: f64,
    pub min_samples: usize,
    pub max_samples: usize,
    pub point_s: f64,
    pub limit_s: f64,
    pub latency_s: f64,
    pub min_calls: usize,
    pub max_calls: usize,
    /// A point whose call is predicted (from the batch before, scaled by the batch) to take
    /// longer than this many limits is not started.
    pub prediction_slack: f64,
    /// Time calls by the process's CPU time instead of the wall clock.
    pub cpu_clock: bool,
}

impl Timing {
    pub fn new(quick: bool) -> Timing {
        if quick {
            Timing {
                warmup_s: 0.02,
                min_sample_s: 0.005,
                min_samples: 3,
                max_samples: 5,
                point_s: 0.3,
                limit_s: 0.25,
                latency_s: 0.15,
                min_calls: 10,
                max_calls: 1000,
                prediction_slack: 4.0,
                cpu_clock: false,
            }
        } else {
            Timing {
                warmup_s: 0.05,
                min_sample_s: 0.01,
                min_samples: 3,
                max_samples: 11,
                point_s: 1.0,
                limit_s: 1.0,
                latency_s: 0.5,
                min_calls: 20,
                max_calls: 5000,
                prediction_slack: 4.0,
                cpu_clock: false,
            }
        }
    }

    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({
            "warmup_s": self.warmup_s, "min_sample_s": self.min_sample_s, "min_samples": self.min_samples,
            "max_samples": self.max_samples, "point_s": self.point_s, "limit_s": self.limit_s,
            "latency_s": self.latency_s, "min_calls": self.min_calls, "max_calls": self.max_calls,
            "prediction_slack": self.prediction_slack, "cpu_clock": self.cpu_clock,
        })
    }

    /// One line for the report's header.
    pub fn describe(self) -> String {
        format!(
            "warm-up ≥ 2 calls and {} ms; median over {}–{} samples of ≥ {} ms (about {} s a point); latency: {}–{} single calls (about {} s); a call over {} s ends the point (and the larger batches), as does one predicted over {}× that",
            self.warmup_s * 1e3,
            self.min_samples,
            self.max_samples,
            self.min_sample_s * 1e3,
            self.point_s,
            self.min_calls,
            self.max_calls,
            self.latency_s,
            self.limit_s,
            self.prediction_slack
        )
    }
}

impl Timing {
    /// Seconds on this timing's clock, from an arbitrary origin.
    fn now(&self) -> f64 {
        if self.cpu_clock {
            process_cpu_seconds()
        } else {
            static ORIGIN: OnceLock<Instant> = OnceLock::new();
            ORIGIN.get_or_init(Instant::now).elapsed().as_secs_f64()
        }
    }
}

/// CPU time of this process (all its threads), in seconds.
fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live local; the clock id
    // is a constant every Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// A point that was not measured.
pub enum Skip {
    /// One call took this many seconds, over the limit.
    OverLimit(f64),
    Failed(Error),
}

impl From<Error> for Skip {
    fn from(e: Error) -> Skip {
        Skip::Failed(e)
    }
}

/// Seconds per call (median, or p50 for single calls), p99 for single calls, calls timed.
pub struct Measured {
    pub seconds: f64,
    pub p99: Option<f64>,
    pub calls: usize,
}

fn warm_up(t: &Timing, call: &mut impl FnMut(bool) -> Result<()>) -> Result<f64, Skip> {
    let start = t.now();
    let mut calls = 0;
    loop {
        let s = t.now();
        call(true)?;
        let last = t.now() - s;
        calls += 1;
        // the first call may carry one-time costs (first touch of the buffers, a graph capture,
        // an algorithm search), so it gets the slack a prediction gets
        let limit = if calls == 1 { t.prediction_slack * t.limit_s } else { t.limit_s };
        if last > limit {
            return Err(Skip::OverLimit(last));
        }
        if calls >= 2 && t.now() - start >= t.warmup_s {
            return Ok(last.max(1e-9));
        }
    }
}

pub fn repeated(t: &Timing, mut call: impl FnMut(bool) -> Result<()>) -> Result<Measured, Skip> {
    let once = warm_up(t, &mut call)?;
    let per_sample = ((t.min_sample_s / once).ceil() as usize).max(1);
    let samples = ((t.point_s / (per_sample as f64 * once)) as usize).clamp(t.min_samples, t.max_samples);
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let start = t.now();
        for i in 0..per_sample {
            call(i + 1 == per_sample)?;
        }
        times.push((t.now() - start) / per_sample as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(Measured { seconds: times[times.len() / 2], p99: None, calls: samples * per_sample })
}

fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    sorted[((q * sorted.len() as f64).ceil() as usize).max(1) - 1]
}

pub fn single(t: &Timing, mut call: impl FnMut(bool) -> Result<()>) -> Result<Measured, Skip> {
    let once = warm_up(t, &mut call)?;
    let calls = ((t.latency_s / once) as usize).clamp(t.min_calls, t.max_calls);
    let mut times = Vec::with_capacity(calls);
    for _ in 0..calls {
        let start = t.now();
        call(true)?;
        times.push(t.now() - start);
    }
    times.sort_by(f64::total_cmp);
    Ok(Measured { seconds: nearest_rank(&times, 0.5), p99: Some(nearest_rank(&times, 0.99)), calls })
}

/// The state of one series of points (a runner, model, place and task, batches ascending): the
/// batch that went over the limit, and the last (batch, seconds) measured.
#[derive(Default)]
pub struct Series {
    over: Option<usize>,
    last: Option<(usize, f64)>,
}

impl Series {
    /// Why `batch` is not to be measured, if so.
    pub fn skip(&mut self, batch: usize, t: &Timing) -> Option<String> {
        if let Some(at) = self.over {
            return Some(format!("over the limit at batch {at}"));
        }
        let (b0, t0) = self.last?;
        let predicted = t0 * batch as f64 / b0 as f64;
        if predicted > t.prediction_slack * t.limit_s {
            self.over = Some(batch);
            return Some(format!("predicted over the limit ({predicted:.2} s from batch {b0})"));
        }
        None
    }

    /// Records a point's outcome, and turns it into a figure's (seconds, p99, calls) or a note.
    pub fn record(&mut self, batch: usize, outcome: Result<Measured, Skip>) -> std::result::Result<Measured, String> {
        match outcome {
            Ok(m) => {
                self.last = Some((batch, m.seconds));
                Ok(m)
            }
            Err(Skip::OverLimit(s)) => {
                self.over = Some(batch);
                Err(format!("over the limit: one call took {s:.2} s"))
            }
            Err(Skip::Failed(e)) => Err(failure(&e)),
        }
    }
}

/// Why a point could not be set up or measured, as the tables' footnotes say it.
pub fn failure(e: &Error) -> String {
    let text = e.to_string();
    if text.contains("memory") {
        format!("does not fit memory: {text}")
    } else {
        format!("error: {text}")
    }
}
