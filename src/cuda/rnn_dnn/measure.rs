//! How each recurrent layer's route is chosen for a mode (inference; or a training step's
//! forward and backward together, which must take one route and one algorithm: cuDNN's backward
//! reads what its forward kept in the reserve space), and the report of what was chosen: the
//! per-step route, the fused variants that fit and each of cuDNN's algorithms set up for the
//! batch get a first look (one eager call), those within `SLOW` times the fastest look are timed
//! as a step runs them (`timing.rs`), and the fastest is kept (a candidate only looked at reports
//! its one call). The timing runs on the cache's live buffers and writes only what the step
//! overwrites; a stream's layer (whose forward writes its final state over its initial one) has
//! its states put back after. A measurement is made once per process for a (device, layer shape,
//! batch, TF32, mode, with or without cuDNN's routes) and reused by every later cache, as the
//! convolutions' are.

use super::{Choice, Inner, LayerSetup, RnnDnn, ALGOS};
use crate::chain::Step;
use crate::cuda::buffer::DevBuf;
use crate::cuda::dnn::StepRun;
use crate::cuda::exec::Raw;
use crate::cuda::options::{Convs, RnnAlgos, Tuning};
use crate::cuda::recurrent::{backward_steps, forward_steps, Ctx};
use crate::cuda::rnn_cudnn::Algo;
use crate::cuda::rnn_fused::{self, Fused, VARIANTS};
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
    /// measured, after a first line saying why cuDNN is not used where it is not. Empty without
    /// recurrent layers.
    pub fn report(&self) -> String {
        let Some(c) = &self.inner else { return String::new() };
        let mut out = if self.note.is_empty() { String::new() } else { format!("recurrent layers: cuDNN not used ({})", self.note) };
        if let Some(value) = Tuning::rnn_algo_not_understood().filter(|_| c.rnn_algos == RnnAlgos::ALL) {
            let sep = if out.is_empty() { "" } else { "\n" };
            let _ = write!(out, "{sep}recurrent layers: FLATNN_RNN_ALGO={value:?} not understood, every route tried");
        }
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
                    // every route timed, the chosen one first (the per-step route's time is NaN
                    // where it runs unmeasured)
                    let mut timed: Vec<(String, f32)> = vec![("per-step".into(), ch.own_us)];
                    timed.extend(Fused::all().map(|v| (v.name(), ch.fused_us[v.index()])));
                    timed.extend(Algo::ALL.into_iter().map(|a| (format!("cudnn {}", a.name()), ch.cudnn_us[a.index()])));
                    let chosen = match (ch.cudnn, ch.fused) {
                        (Some(a), _) => 1 + VARIANTS + a.index(),
                        (None, Some(v)) => 1 + v.index(),
                        (None, None) => 0,
                    };
                    let (name, us) = timed.remove(chosen);
                    let rest: Vec<String> =
                        timed.into_iter().filter(|(_, us)| !us.is_nan()).map(|(n, us)| format!("{n} {us:.1} µs")).collect();
                    let rest = if rest.is_empty() { "no other route timed".into() } else { rest.join(", ") };
                    match us.is_nan() {
                        true => write!(out, "{name} ({rest});"),
                        false => write!(out, "{name} {us:.1} µs ({rest});"),
                    }
                    .unwrap_or(());
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
    /// for the same device, shape, batch, arithmetic, mode and routes allowed, else measured now; the fastest
    /// route timed (cuDNN's fastest algorithm wherever it has one with `FLATNN_CUDNN=1`). A
    /// failure of cuDNN leaves flatnn's routes to choose from, a failure of every timing the
    /// per-step route chosen (with a note).
    pub(super) fn decide(&self, i: usize, layer: &mut LayerSetup, s: &StepRun) -> Result<()> {
        let (index, d) = self.layers[i];
        let training = s.b.is_some();
        let ctx = step_ctx(s, index);
        let step = &s.plan.steps[index];
        let fused = self.fused_candidates(&d, s).unwrap_or_else(|why| {
            note(&mut layer.note, training, &why);
            Vec::new()
        });
        let (m, with_cudnn) = {
            let routes = self.cudnn_routes(layer, i, training);
            let cudnn = !routes.is_empty();
            let key = MeasureKey {
                ordinal: s.gpu.ordinal(),
                dims: d,
                batch: s.f.batch,
                tf32: s.options.tf32,
                training,
                cudnn,
                convs: self.convs,
                rnn_algos: self.rnn_algos,
            };
            match MEASURED.get(&key) {
                Some(m) => (m, cudnn),
                None => (MEASURED.keep(key, self.measure(&routes, &ctx, step, &d, &fused, s.options.graphs)?), cudnn),
            }
        };
        if !with_cudnn {
            let why = self.unavailable(training);
            if !why.is_empty() {
                note(&mut layer.note, training, &why);
            }
        }
        // the fastest of this setup's algorithms and this cache's variants that ran (a
        // measurement kept by another cache may time routes this one lacks)
        let timed = layer.candidates.iter().map(|c| (c.descs.algo(), m.cudnn_us[c.descs.algo().index()]));
        let fastest = timed.filter(|(_, us)| !us.is_nan()).min_by(|a, b| a.1.total_cmp(&b.1));
        let fused_fastest =
            fused.iter().map(|&v| (v, m.fused_us[v.index()])).filter(|(_, us)| !us.is_nan()).min_by(|a, b| a.1.total_cmp(&b.1));
        let own_us = if m.own_us.is_nan() { f32::INFINITY } else { m.own_us };
        let fused_us = fused_fastest.map_or(f32::INFINITY, |(_, us)| us);
        let mut cudnn = fastest.filter(|&(_, us)| self.convs == Convs::Cudnn || (us < own_us && us < fused_us)).map(|(algo, _)| algo);
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
        let fused = fused_fastest.filter(|&(_, us)| cudnn.is_none() && us < own_us).map(|(v, _)| v);
        layer.choices[training as usize] =
            Choice { decided: true, cudnn, fused, own_us: m.own_us, cudnn_us: m.cudnn_us, fused_us: m.fused_us };
        if !m.note.is_empty() {
            note(&mut layer.note, training, &m.note);
        }
        Ok(())
    }

    /// The fused variants that may be timed for layer `d` at the step's batch: those that fit
    /// (`rnn_fused::prepare`, which compiles their kernels on first need) where
    /// `FLATNN_RNN_ALGO` allows them (`fused` on one block, `cluster` on clusters) and cuDNN is
    /// not forced. Err (why) where their kernels could not be had.
    fn fused_candidates(&self, d: &Dims, s: &StepRun) -> std::result::Result<Vec<Fused>, String> {
        let algos = self.rnn_algos;
        if self.convs == Convs::Cudnn || !(algos.allows_fused() || algos.allows_cluster()) {
            return Ok(Vec::new());
        }
        let allowed = |v: &Fused| if v.clustered() { algos.allows_cluster() } else { algos.allows_fused() };
        Ok(rnn_fused::prepare(s.gpu, d, s.f.batch)?.into_iter().filter(allowed).collect())
    }

    /// Layer `i`'s cuDNN routes for the mode: one per algorithm set up at the batch.
    fn cudnn_routes<'a>(&'a self, layer: &'a LayerSetup, i: usize, training: bool) -> Vec<Route<'a>> {
        layer.candidates.iter().filter_map(|c| self.route_of(layer, i, c.descs.algo(), training)).collect()
    }

    /// Times the per-step route (where `FLATNN_RNN_ALGO` allows it and cuDNN is not forced),
    /// the `fused` variants and cuDNN's `routes` for the mode of `ctx` (a training step's
    /// forward and backward together), as a step runs them. A route that fails is left
    /// untimed, with a note.
    fn measure(&self, routes: &[Route], ctx: &Ctx, step: &Step, d: &Dims, fused: &[Fused], graphs: bool) -> Result<Measured> {
        let training = ctx.b.is_some();
        let mut m = Measured { own_us: f32::NAN, cudnn_us: [f32::NAN; ALGOS], fused_us: [f32::NAN; VARIANTS], note: String::new() };
        let per_step = self.convs != Convs::Cudnn && self.rnn_algos.allows_per_step();
        if routes.is_empty() && fused.is_empty() && !per_step {
            return Ok(m);
        }
        self.states_kept(ctx, step, d, || {
            let own = || {
                forward_steps(ctx, step, d)?;
                if training {
                    backward_steps(ctx, step, d)?;
                }
                Ok(())
            };
            let fused_runs: Vec<_> = fused
                .iter()
                .map(|&v| {
                    move || {
                        rnn_fused::forward(ctx, step, d, v)?;
                        if training {
                            rnn_fused::backward(ctx, step, d, v)?;
                        }
                        Ok(())
                    }
                })
                .collect();
            let runs: Vec<_> = routes.iter().map(|route| move || route.run(ctx, step, d, training)).collect();
            let mut candidates: Vec<(Candidate, &Work)> = Vec::new();
            if per_step {
                candidates.push((Candidate::PerStep, &own));
            }
            candidates.extend(fused.iter().zip(&fused_runs).map(|(&v, run)| (Candidate::Fused(v), run as &Work)));
            candidates.extend(routes.iter().zip(&runs).map(|(route, run)| (Candidate::Cudnn(route.descs.algo()), run as &Work)));
            // a first look at each (one eager call); timed in full only near the fastest look
            let looks: Vec<Result<f32>> = candidates.iter().map(|(_, run)| time_once(ctx.gpu, ctx.stream, *run)).collect();
            let fastest = looks.iter().filter_map(|look| look.as_ref().ok()).fold(f32::INFINITY, |a, &b| a.min(b));
            for ((candidate, run), look) in candidates.into_iter().zip(looks) {
                let us = match look {
                    Ok(once) if once > SLOW * fastest => Ok(once),
                    Ok(_) => time_calls(ctx.gpu, ctx.stream, graphs, run),
                    Err(e) => Err(e),
                };
                let slot = match candidate {
                    Candidate::PerStep => &mut m.own_us,
                    Candidate::Fused(v) => &mut m.fused_us[v.index()],
                    Candidate::Cudnn(algo) => &mut m.cudnn_us[algo.index()],
                };
                match us {
                    Ok(us) => *slot = us,
                    Err(e) => {
                        let sep = if m.note.is_empty() { "" } else { "; " };
                        let _ = write!(m.note, "{sep}{} failed: {e}", candidate.name());
                    }
                }
            }
            Ok(())
        })?;
        Ok(m)
    }

    /// Why a layer has no cuDNN route for the mode beyond what its setup's note says: the
    /// training buffers could not be had.
    fn unavailable(&self, training: bool) -> String {
        if self.handle.is_none() {
            return String::new();
        }
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
/// mode, whether cuDNN's routes were among those timed (a cache without them measures without
/// them, and one with them does not take that measurement), and which routes the model's
/// tuning let be timed (`FLATNN_CUDNN`, `FLATNN_RNN_ALGO`: a model that timed the fused route
/// alone leaves the per-step route untimed, which a model allowing both must not take as lost).
#[derive(Clone, Copy, PartialEq, Eq)]
struct MeasureKey {
    ordinal: usize,
    dims: Dims,
    batch: usize,
    tf32: bool,
    training: bool,
    cudnn: bool,
    convs: Convs,
    rnn_algos: RnnAlgos,
}

/// The routes timed: the per-step route, the fused variants in [`Fused::all`]'s order, cuDNN's
/// algorithms in [`Algo::ALL`]'s order (µs per call; NaN where not timed or where it failed).
#[derive(Clone)]
struct Measured {
    own_us: f32,
    fused_us: [f32; VARIANTS],
    cudnn_us: [f32; ALGOS],
    note: String,
}

/// A route being measured.
#[derive(Clone, Copy)]
enum Candidate {
    PerStep,
    Fused(Fused),
    Cudnn(Algo),
}

impl Candidate {
    fn name(self) -> String {
        match self {
            Candidate::PerStep => "the per-step route".into(),
            Candidate::Fused(v) => v.name(),
            Candidate::Cudnn(algo) => format!("cuDNN {}", algo.name()),
        }
    }
}

/// Every measurement made in this process: the first one of a key is what every cache uses.
static MEASURED: FirstMeasured<MeasureKey, Measured> = FirstMeasured::new();

fn note(notes: &mut String, training: bool, what: &str) {
    add_note(notes, if training { "training" } else { "inference" }, what);
}
