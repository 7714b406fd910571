//! Timing work on the GPU as a step runs it: used to choose between ways of computing the same
//! thing (cuDNN or flatnn's kernels, see `dnn.rs`; a dense layer's routes, see `routes.rs`).

use super::context::Gpu;
use super::{driver_error, graph};
use crate::error::Result;
use cudarc::driver::{result as driver, sys as driver_sys, CudaStream};
use std::fmt::Write;
use std::sync::{Mutex, PoisonError};

/// A candidate (a route, an algorithm) whose first eager call takes more than this many times
/// the fastest first call of the others is not timed further: it cannot win, and timing it in
/// full would make the slowest candidates (say a row a block over a thousand samples, or a
/// persistent RNN kernel far past its batch) most of the measuring time.
pub(super) const SLOW: f32 = 4.0;

/// Calls per captured graph (or eager run) at most, and runs timed.
const REPS: usize = 10;
const SAMPLES: usize = 5;

/// A run of `REPS` calls is cut to as many as take about this many microseconds (one at least,
/// by a first eager call): longer runs add nothing to a timing's precision (the events' and a
/// graph launch's few microseconds are then under 1 %), and measuring a step of a large batch
/// (milliseconds a call) would take seconds of its first call.
const RUN_US: f32 = 200.0;

/// Whole training steps a run of [`time_steps`] holds at most, and about how many microseconds
/// of them it holds.
const STEPS: usize = 40;
const STEP_RUN_US: f32 = 1000.0;

/// Microseconds per call of `work` as a step runs it: `work` run twice eagerly under the
/// device-wide lock (a first call may load modules or allocate, which would break another
/// thread's capture) and once more timed ([`time_once`]), which sets the calls of a run
/// (`REPS`, fewer for work over [`RUN_US`] / `REPS`); then, with `graphs`, a run captured into a
/// graph and the median of `SAMPLES` replays after one more; without, the median of `SAMPLES`
/// eager runs after one more. `work` must only enqueue on `stream`.
pub(super) fn time_calls(gpu: &Gpu, stream: &CudaStream, graphs: bool, work: &dyn Fn() -> Result<()>) -> Result<f32> {
    let once = time_once(gpu, stream, work)?;
    let calls = ((RUN_US / once).ceil() as usize).clamp(1, REPS);
    let exec = match graphs {
        true => Some(graph::capture(stream.cu_stream(), None, || (0..calls).try_for_each(|_| work()))?),
        false => None,
    };
    median_run(gpu, stream, calls, &|| match &exec {
        Some(exec) => exec.launch(stream),
        None => (0..calls).try_for_each(|_| work()),
    })
}

/// Microseconds per step of `step` (a whole training step) as a training loop runs it: with
/// `graphs`, one step captured into a graph and that graph launched back to back, as
/// `train_step` launches its step's graph; without, eager steps. A graph of several steps
/// ([`time_calls`]) is not that: its steps overlap otherwise than a loop's, so it times
/// another step than the one a loop runs, and ranks the variants otherwise. A run holds as many steps as take about [`STEP_RUN_US`] (from [`STEPS`] down to
/// one), so that the first step's start from an idle device is a small part of it.
pub(super) fn time_steps(gpu: &Gpu, stream: &CudaStream, graphs: bool, step: &dyn Fn() -> Result<()>) -> Result<f32> {
    let once = time_once(gpu, stream, step)?;
    let steps = ((STEP_RUN_US / once).ceil() as usize).clamp(1, STEPS);
    let exec = match graphs {
        true => Some(graph::capture(stream.cu_stream(), None, step)?),
        false => None,
    };
    median_run(gpu, stream, steps, &|| {
        (0..steps).try_for_each(|_| match &exec {
            Some(exec) => exec.launch(stream),
            None => step(),
        })
    })
}

/// The median over `SAMPLES` timed runs of `run` (after one untimed), in microseconds per
/// call of the `calls` a run makes.
fn median_run(gpu: &Gpu, stream: &CudaStream, calls: usize, run: &dyn Fn() -> Result<()>) -> Result<f32> {
    run()?;
    gpu.bind()?;
    let (start, end) = (TimingEvent::new()?, TimingEvent::new()?);
    let mut samples = [0f32; SAMPLES];
    for sample in &mut samples {
        start.record(stream)?;
        run()?;
        end.record(stream)?;
        // SAFETY: live events, both recorded on `stream`; the host waits for the second.
        let ms = unsafe { driver::event::synchronize(end.0).and_then(|()| driver::event::elapsed(start.0, end.0)) }
            .map_err(|e| driver_error("timing work on the device", e))?;
        *sample = ms * 1000.0 / calls as f32;
    }
    samples.sort_by(f32::total_cmp);
    Ok(samples[SAMPLES / 2])
}

/// `work` run twice eagerly under the device-wide lock (a first call may load modules or
/// allocate, which would break another thread's capture), then waited for.
fn warm_up(stream: &CudaStream, work: &dyn Fn() -> Result<()>) -> Result<()> {
    let _exclusive = super::device_wide();
    work()?;
    work()?;
    stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))
}

/// Microseconds of one eager call of `work` after [`warm_up`]'s two: a first look, much cheaper
/// than [`time_calls`] for slow work, and an overestimate for short work (the launch's cost
/// is in it). `work` must only enqueue on `stream`.
pub(super) fn time_once(gpu: &Gpu, stream: &CudaStream, work: &dyn Fn() -> Result<()>) -> Result<f32> {
    warm_up(stream, work)?;
    gpu.bind()?;
    let (start, end) = (TimingEvent::new()?, TimingEvent::new()?);
    start.record(stream)?;
    work()?;
    end.record(stream)?;
    // SAFETY: live events, both recorded on `stream`; the host waits for the second.
    let ms = unsafe { driver::event::synchronize(end.0).and_then(|()| driver::event::elapsed(start.0, end.0)) }
        .map_err(|e| driver_error("timing work on the device", e))?;
    Ok(ms * 1000.0)
}

/// An event that records time (flatnn's other events do not).
struct TimingEvent(driver_sys::CUevent);

impl TimingEvent {
    fn new() -> Result<TimingEvent> {
        let event = driver::event::create(driver_sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| driver_error("creating an event", e))?;
        Ok(TimingEvent(event))
    }

    fn record(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: a live event and stream of the current context.
        unsafe { driver::event::record(self.0, stream.cu_stream()) }.map_err(|e| driver_error("recording an event", e))
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once (the driver waits for a pending record).
        let _ = unsafe { driver::event::destroy(self.0) };
    }
}

/// µs per call of a route: timed as a step runs it, or, for a route far slower than another at
/// a first look ([`SLOW`]), that one eager call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Timed {
    pub us: f32,
    pub one_call: bool,
}

/// Each of `routes` timed as a step runs it (`run` runs one): `known`'s time where this process
/// timed it already; else a first look, one eager call ([`time_once`]; NaN where it failed),
/// then, for a route within [`SLOW`] times the fastest first look, [`time_calls`]. Each new time
/// goes through `keep`, which gives back the time to use (another cache's, where one got there
/// first).
pub(super) fn time_routes<R: Copy>(
    gpu: &Gpu,
    stream: &CudaStream,
    graphs: bool,
    routes: Vec<R>,
    known: impl Fn(R) -> Option<Timed>,
    keep: impl Fn(R, Timed) -> Timed,
    run: &dyn Fn(R) -> Result<()>,
) -> Vec<(R, Timed)> {
    let first: Vec<(R, std::result::Result<Timed, f32>)> =
        routes.into_iter().map(|r| (r, known(r).ok_or_else(|| time_once(gpu, stream, &|| run(r)).unwrap_or(f32::NAN)))).collect();
    let fastest = first.iter().map(|(_, t)| t.map_or_else(|once| once, |t| t.us)).filter(|us| !us.is_nan()).fold(f32::INFINITY, f32::min);
    first
        .into_iter()
        .map(|(route, t)| {
            let time = match t {
                Ok(known) => return (route, known),
                Err(once) if once.is_nan() || once > SLOW * fastest => Timed { us: once, one_call: true },
                Err(_) => Timed { us: time_calls(gpu, stream, graphs, &|| run(route)).unwrap_or(f32::NAN), one_call: false },
            };
            (route, keep(route, time))
        })
        .collect()
}

/// Measurements kept for the whole process, the first one of a key winning, so that every
/// cache of a process takes the same path for the same work.
pub(super) struct FirstMeasured<K, V>(Mutex<Vec<(K, V)>>);

impl<K: PartialEq, V: Clone> FirstMeasured<K, V> {
    pub const fn new() -> Self {
        FirstMeasured(Mutex::new(Vec::new()))
    }

    /// What was kept for `key`, if anything.
    pub fn get(&self, key: &K) -> Option<V> {
        let all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        all.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    /// Keeps `v` for `key` unless another cache got there first; what is kept.
    pub fn keep(&self, key: K, v: V) -> V {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match all.iter().find(|(k, _)| *k == key) {
            Some((_, first)) => first.clone(),
            None => {
                all.push((key, v.clone()));
                v
            }
        }
    }
}

/// Adds `label: what` to a report's notes, `; ` between notes.
pub(super) fn add_note(notes: &mut String, label: &str, what: &str) {
    if !notes.is_empty() {
        notes.push_str("; ");
    }
    let _ = write!(notes, "{label}: {what}");
}
