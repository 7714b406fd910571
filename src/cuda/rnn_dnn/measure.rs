//! How each recurrent layer's route is chosen for a mode (inference; or a training step's
//! forward and backward together, which must take one route and one algorithm: cuDNN's backward
//! reads what its forward kept in the reserve space), and the report of what was chosen: the
//! per-step route and each of cuDNN's algorithms set up for the batch get a first look (one eager
//! call), those within `SLOW` times the fastest look are timed as a step runs them (`timing.rs`),
//! and the fastest is kept (a candidate only looked at reports its one call). The timing runs on the cache's live buffers and writes
//! only what the step overwrites; a stream's layer (whose forward writes its final state over
//! its initial one) has its states put back after. A measurement is made once per process for a
//! (device, layer shape, batch, TF32, mode) and reused by every later cache, as the
//! convolutions' are.

use super::{Choice, Inner, LayerSetup, RnnDnn, ALGOS};
use crate::chain::Step;
use crate::cuda::buffer::DevBuf;
use crate::cuda::dnn::StepRun;
use crate::cuda::exec::Raw;
use crate::cuda::options::{Convs, RnnAlgos, Tuning};
use crate::cuda::recurrent::{backward_steps, forward_steps, Ctx};
use crate::cuda::rnn_cudnn::Algo;
use crate::cuda::rnn_route::Route;
use crate::cuda::timing::{add_note, time_calls, time_once, FirstMeasured, SLOW};
use crate::cuda::{device_wide, driver_error};
use crate::error::Result;
use crate::layers::recurrent::{Dims, RnnOutput, STATE};
use cudarc::driver::result as driver;
use std::fmt::Write;

/// Work queued on a stream, as the timing functions take it.
type Work<'a> = dyn Fn() -> Result<()> + 'a;

impl RnnDnn {
    /// One line per recurrent layer and batch size set up: each mode's route and the times
    /// measured (or a first line saying why cuDNN is not used). Empty without recurrent layers.
    pub fn report(&self) -> String {
        let Some(c) = &self.inner else {
            return if self.note.is_empty() {
                String::new()
            } else {
                format!("recurrent layers: cuDNN not used ({}): per-step", self.note)
            };
        };
        let not_understood = Tuning::rnn_algo_not_understood().filter(|_| c.rnn_algos == RnnAlgos::ALL);
        let mut out = match not_understood {
            Some(value) => format!("recurrent layers: FLATNN_RNN_ALGO={value:?} not understood, every cuDNN algorithm tried"),
            None => String::new(),
        };
        for setup in &c.setups {
            for (&(index, d), layer) in c.layers.iter().zip(&setup.layers) {
                let arith = if setup.tf32 { "TF32" } else { "FP32" };
                let sep = if out.is_empty() { "" } else { "\n" };
                let _ = write!(out, "{sep}batch {} {arith}, step {index} {}:", setup.batch, label(&d));
                for (mode, ch) in ["inference", "training"].iter().zip(&layer.choices) {
                    let _ = write!(out, " {mode} ");
                    if !ch.decided {
                        out.push_str("not measured yet;");
                        continue;
                    }
                    // the times of the algorithms that ran, but `chosen`
                    let others = |chosen: Option<Algo>| {
                        let ran = Algo::ALL.into_iter().filter(|&a| Some(a) != chosen && !ch.cudnn_us[a.index()].is_nan());
                        ran.map(|a| format!("{} {:.1} µs", a.name(), ch.cudnn_us[a.index()])).collect::<Vec<_>>().join(", ")
                    };
                    match ch.cudnn {
                        Some(a) => {
                            let (us, rest) = (ch.cudnn_us[a.index()], others(Some(a)));
                            let sep = if rest.is_empty() { "" } else { ", cudnn " };
                            let _ = write!(out, "cudnn {} {us:.1} µs (per-step {:.1} µs{sep}{rest});", a.name(), ch.own_us);
                        }
                        None => {
                            let ran = others(None);
                            let ran = if ran.is_empty() { "not run".into() } else { ran };
                            let _ = write!(out, "per-step {:.1} µs (cudnn {ran});", ch.own_us);
                        }
                    }
                }
                if !layer.note.is_empty() {
                    let _ = write!(out, " note: {}", layer.note);
                }
            }
        }
        out
    }
}

/// `GRU 3→17 over 6 steps, sequence`
fn label(d: &Dims) -> String {
    let output = match d.output {
        RnnOutput::Sequence => "sequence",
        RnnOutput::LastStep => "last step",
    };
    let carry = if d.carry { ", carried state" } else { "" };
    format!("{} {}→{} over {} steps, {output}{carry}", d.cell.name(), d.features, d.hidden, d.steps)
}

impl Inner {
    /// Records the route of layer `i` for the mode of `s`: as measured before in this process
    /// for the same device, shape, batch, arithmetic and mode, else measured now; cuDNN's
    /// fastest algorithm where it beat the per-step route (or `FLATNN_CUDNN=1`). A failure of
    /// cuDNN, or of timing the per-step route, leaves the per-step route chosen (with a note).
    pub(super) fn decide(&self, i: usize, layer: &mut LayerSetup, s: &StepRun) -> Result<()> {
        let (index, d) = self.layers[i];
        let training = s.b.is_some();
        let key = MeasureKey { ordinal: s.gpu.ordinal(), dims: d, batch: s.f.batch, tf32: s.options.tf32, training };
        let ctx = step_ctx(s, index);
        let step = &s.plan.steps[index];
        let m = match MEASURED.get(&key) {
            Some(m) => m,
            None => match self.measure(i, layer, &ctx, step, &d, s.options.graphs)? {
                Some(m) => MEASURED.keep(key, m),
                // not measured: nothing kept for other caches, which may have what this one lacks
                None => Measured { own_us: f32::NAN, cudnn_us: [f32::NAN; ALGOS], note: self.unavailable(training) },
            },
        };
        // the fastest of this setup's algorithms that ran (a measurement kept by another cache
        // may time algorithms this one lacks)
        let timed = layer.candidates.iter().map(|c| (c.descs.algo(), m.cudnn_us[c.descs.algo().index()]));
        let fastest = timed.filter(|(_, us)| !us.is_nan()).min_by(|a, b| a.1.total_cmp(&b.1));
        let mut cudnn = fastest.filter(|&(_, us)| self.convs == Convs::Cudnn || us < m.own_us).map(|(algo, _)| algo);
        if let Some(algo) = cudnn {
            // Run it eagerly before any capture (measuring did, in the cache that measured): a
            // new handle's first call may load modules or allocate, which would break a capture
            // running on another thread.
            let ran = match self.route_of(layer, i, algo, training) {
                Some(route) => self.states_kept(&ctx, step, &d, || {
                    let _exclusive = device_wide();
                    route.run(&ctx, step, &d, training)?;
                    ctx.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))
                }),
                None => Err(crate::error::Error::Cuda { what: "its buffers are missing".into() }),
            };
            if let Err(e) = ran {
                note(&mut layer.note, training, &format!("cuDNN {} failed: {e}", algo.name()));
                cudnn = None;
            }
        }
        layer.choices[training as usize] = Choice { decided: true, cudnn, own_us: m.own_us, cudnn_us: m.cudnn_us };
        if !m.note.is_empty() {
            note(&mut layer.note, training, &m.note);
        }
        Ok(())
    }

    /// Times the per-step route (unless `FLATNN_CUDNN=1`) and each of cuDNN's algorithms set up
    /// for layer `i` in the mode of `ctx` (a training step's forward and backward together), as
    /// a step runs them; None where this cache has no cuDNN route for the layer (its note, or
    /// `unavailable`, says why). An algorithm that fails is left untimed, with a note.
    fn measure(&self, i: usize, layer: &LayerSetup, ctx: &Ctx, step: &Step, d: &Dims, graphs: bool) -> Result<Option<Measured>> {
        let training = ctx.b.is_some();
        let mut m = Measured { own_us: f32::NAN, cudnn_us: [f32::NAN; ALGOS], note: String::new() };
        let routes: Vec<Route> = layer.candidates.iter().filter_map(|c| self.route_of(layer, i, c.descs.algo(), training)).collect();
        if routes.is_empty() {
            return Ok(None);
        }
        self.states_kept(ctx, step, d, || {
            let own = || {
                forward_steps(ctx, step, d)?;
                if training {
                    backward_steps(ctx, step, d)?;
                }
                Ok(())
            };
            let runs: Vec<_> = routes.iter().map(|route| move || route.run(ctx, step, d, training)).collect();
            // (None: the per-step route, timed unless cuDNN is forced)
            let mut candidates: Vec<(Option<Algo>, &Work)> = Vec::new();
            if self.convs == Convs::Measured {
                candidates.push((None, &own));
            }
            candidates.extend(routes.iter().zip(&runs).map(|(route, run)| (Some(route.descs.algo()), run as &Work)));
            // a first look at each (one eager call); timed in full only near the fastest look
            let looks: Vec<Result<f32>> = candidates.iter().map(|(_, run)| time_once(ctx.gpu, ctx.stream, *run)).collect();
            let fastest = looks.iter().filter_map(|look| look.as_ref().ok()).fold(f32::INFINITY, |a, &b| a.min(b));
            for ((algo, run), look) in candidates.into_iter().zip(looks) {
                let us = match look {
                    Ok(once) if once > SLOW * fastest => Ok(once),
                    Ok(_) => time_calls(ctx.gpu, ctx.stream, graphs, run),
                    Err(e) => Err(e),
                };
                match (algo, us) {
                    (None, Ok(us)) => m.own_us = us,
                    (None, Err(e)) => {
                        m.note = format!("timing the per-step route failed ({e}): per-step chosen");
                        return Ok(());
                    }
                    (Some(algo), Ok(us)) => m.cudnn_us[algo.index()] = us,
                    (Some(algo), Err(e)) => {
                        let sep = if m.note.is_empty() { "" } else { "; " };
                        let _ = write!(m.note, "{sep}cuDNN {} failed: {e}", algo.name());
                    }
                }
            }
            Ok(())
        })?;
        Ok(Some(m))
    }

    /// Why a layer has no cuDNN route for the mode beyond what its setup's note says: the
    /// training buffers could not be had.
    fn unavailable(&self, training: bool) -> String {
        match self.bufs.as_ref().and_then(|b| b.train.as_ref()) {
            Some(Err(why)) if training => why.clone(),
            _ => String::new(),
        }
    }

    /// Runs `work` with the step's state rows put back after it where its layer carries its
    /// state (a stream's: its forward writes the final state over the initial one).
    fn states_kept<T>(&self, ctx: &Ctx, step: &Step, d: &Dims, work: impl FnOnce() -> Result<T>) -> Result<T> {
        if !d.carry {
            return work();
        }
        let state = ctx.region(step.kept.start + STATE);
        let bytes = state.len() * size_of::<f32>();
        let kept = DevBuf::<f32>::zeros(&self.gpu, ctx.stream, state.len())?;
        let at = Raw::of(ctx.f.acts).at_mut::<f32>(state).ptr();
        let copy = |dst: u64, src: u64| {
            // SAFETY: both hold `bytes` bytes (the state rows of the batch; a buffer of as many
            // values), queued in the stream's order.
            unsafe { driver::memcpy_dtod_async(dst, src, bytes, ctx.stream.cu_stream()) }
                .map_err(|e| driver_error("keeping a recurrent state", e))
        };
        copy(kept.ptr(), at)?;
        let outcome = work();
        copy(at, kept.ptr())?;
        ctx.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
        outcome
    }
}

/// The launches' context for step `index` of the step about to run.
fn step_ctx<'a>(s: &'a StepRun<'a>, index: usize) -> Ctx<'a> {
    let need_dx = s.plan.steps[index].input_region != 0;
    Ctx { gpu: s.gpu, blas: s.blas, stream: s.stream, plan: s.plan, f: s.f, b: s.b, index, need_dx }
}

/// What a measurement is of: the device, the layer's sizes, the batch, the arithmetic and the
/// mode.
#[derive(Clone, Copy, PartialEq, Eq)]
struct MeasureKey {
    ordinal: usize,
    dims: Dims,
    batch: usize,
    tf32: bool,
    training: bool,
}

/// Both routes timed, cuDNN's per algorithm in [`Algo::ALL`]'s order (µs per call; NaN where
/// not timed or where it failed).
#[derive(Clone)]
struct Measured {
    own_us: f32,
    cudnn_us: [f32; ALGOS],
    note: String,
}

/// Every measurement made in this process: the first one of a key is what every cache uses.
static MEASURED: FirstMeasured<MeasureKey, Measured> = FirstMeasured::new();

fn note(notes: &mut String, training: bool, what: &str) {
    add_note(notes, if training { "training" } else { "inference" }, what);
}
