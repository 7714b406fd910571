//! Which route runs each direction of each dense layer on a GPU, chosen by measurement (as the
//! convolutions choose between cuDNN and flatnn's kernels, src/cuda/dnn.rs): every route that
//! fits (`Gpu::dense_routes`) is timed as a step runs it (`timing::time_calls`: in a CUDA
//! graph, or eagerly where the model's graphs are off), on the cache's own buffers, and the
//! fastest is kept.
//!
//! Batches are measured by size bucket, the powers of two: a batch of `b` samples takes the
//! routes of bucket `b.next_power_of_two()`, measured at that many samples (at the capacity
//! where that is less). A bucket is measured the first time a batch of its sizes runs, before
//! its graph is captured (the forward direction by `forward`, the other two by the first
//! training step): that call waits for the device; once every bucket in use is measured, steps
//! and forward passes queue their graphs without waiting. (A cache's backward buffers come with
//! `preallocate_grads`, apart from `preallocate`, so nothing is measured when they are made.)
//!
//! Each route is timed once per process for a (device, direction, layer shape, bucket, TF32,
//! graphs, epilogue) and every later cache reuses the time, so the models of one process take
//! the same routes and compute the same bits (where the same routes fit: the tensor-core tiles
//! need 16-byte aligned operands, and where a layer's inputs start in the activations depends
//! on the capacity). Every route is deterministic; another process may measure otherwise and
//! take another route, whose results differ in the last bits. A
//! measurement writes only what the step it precedes overwrites (the layer's z and y, its
//! input gradient or its producer's dz, its weight gradient).

use super::dense::{Dir, Route};
use super::dense_pass::{dense_shape, forward_on, input_grad_on, operands, problem, producer, producer_activation, weight_grad_on, On};
use super::dnn::StepRun;
use super::driver_error;
use super::timing::{time_calls, time_once, SLOW};
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::loss::Loss;
use std::fmt::Write;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The bucket of a batch of `batch` samples.
fn bucket(batch: usize) -> usize {
    batch.next_power_of_two()
}

/// One direction of one layer in a [`Table`].
#[derive(Clone, Debug, PartialEq)]
enum Choice {
    /// Not measured yet (the backward directions until the first training step).
    Pending,
    /// Not run: the input gradient of a layer that reads the model's inputs.
    NotNeeded,
    /// The route chosen, the one fastest alone (another where whole steps chose otherwise: see
    /// [`Routes::check_in_steps`]), and every route that fits with its time alone (NaN where
    /// timing it failed).
    Chosen { route: Route, alone: Route, times: Vec<(Route, Timed)> },
}

/// A dense layer's routes in a [`Table`], per direction ([`Dir`] order).
#[derive(Clone, Debug)]
struct LayerRoutes {
    step: usize,
    label: String,
    choices: [Choice; 3],
}

/// The routes of one bucket and arithmetic.
#[derive(Clone, Debug)]
struct Table {
    bucket: usize,
    /// The samples it was measured at: the bucket, or the capacity where that is less.
    samples: usize,
    tf32: bool,
    layers: Vec<LayerRoutes>,
    /// Host time spent measuring its routes, in this cache.
    measuring: Duration,
    /// Whether its routes were checked in whole passes yet ([`Routes::check_in_steps`]), per
    /// [`Pass`].
    checked: [bool; 2],
    /// A training step's forward and backward pass (µs) on the routes fastest alone, and on
    /// those kept after the whole-step check (where this cache checked), per [`Pass`].
    step_us: [Option<(f32, f32)>; 2],
}

/// A cache's dense routes: a table per bucket (and TF32 setting) that has run.
pub(crate) struct Routes {
    tables: Vec<Table>,
    /// The table the last `prepare` picked: the one the calls of the step being run use.
    current: Option<usize>,
}

/// µs per call of a route: timed as a step runs it, or, for a route far slower than another at
/// a first look ([`SLOW`]), that one eager call.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Timed {
    us: f32,
    one_call: bool,
}

/// What a time is of: the device, the direction, the layer's (outputs, inputs), the bucket, TF32,
/// graphs, and whether the epilogue does more than the product's least (a forward's activation
/// into y, an input gradient's producer's act').
#[derive(Clone, Copy, PartialEq, Eq)]
struct Problem {
    ordinal: usize,
    dir: Dir,
    shape: (usize, usize),
    bucket: usize,
    tf32: bool,
    graphs: bool,
    epilogue: bool,
}

/// Every route timed in this process: the first time of a (problem, route) is what every cache
/// uses.
static TIMES: Mutex<Vec<(Problem, Route, Timed)>> = Mutex::new(Vec::new());

fn timed(problem: &Problem, route: Route) -> Option<Timed> {
    let all = TIMES.lock().unwrap_or_else(PoisonError::into_inner);
    all.iter().find(|(p, r, _)| p == problem && *r == route).map(|&(_, _, t)| t)
}

/// Keeps `time` for (problem, route) unless another cache got there first; what is kept.
fn remember(problem: Problem, route: Route, time: Timed) -> Timed {
    let mut all = TIMES.lock().unwrap_or_else(PoisonError::into_inner);
    match all.iter().find(|(p, r, _)| *p == problem && *r == route) {
        Some(&(_, _, first)) => first,
        None => {
            all.push((problem, route, time));
            time
        }
    }
}

/// How much faster (a fraction of the step) a whole step must be on a variant for
/// [`Routes::check_in_steps`] to keep it: more than the noise of the median of a step's
/// replays.
const KEEP: f32 = 0.01;

/// A route that fits every layer's weight gradient (or input gradient) is tried on all of them
/// at once where it is at most this many times the fastest alone on each; a layer's own
/// runners-up where they are at most this many times its fastest.
const NEAR: f32 = 3.0;

/// The runners-up of a direction of a layer tried one at a time, nearest first.
const RUNNERS_UP: usize = 3;

/// Passes over the variants at most (a pass after one that kept nothing would keep nothing).
const PASSES: usize = 3;

/// What [`Routes::check_in_steps`] times: an inference's forward pass (the forward routes), or
/// a training step's forward and backward pass (the backward routes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    Inference,
    Training,
}

impl Pass {
    /// The directions whose routes the pass checks.
    fn dirs(self) -> &'static [Dir] {
        match self {
            Pass::Inference => &[Dir::Forward],
            Pass::Training => &[Dir::WeightGrad, Dir::InputGrad],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Pass::Inference => "inference",
            Pass::Training => "forward and backward",
        }
    }
}

/// What a whole-step check is of: the pass, the device, the model's plan and loss, the bucket, TF32 and
/// graphs.
#[derive(PartialEq)]
struct StepKey {
    pass: Pass,
    ordinal: usize,
    plan: Plan,
    loss: Option<Loss>,
    bucket: usize,
    tf32: bool,
    graphs: bool,
}

/// Every whole-step check in this process, with the routes it changed ((layer in the table,
/// direction, route)): the first check of a key is what every cache uses.
type StepChanges = Vec<(usize, Dir, Route)>;
static STEP_CHOICES: Mutex<Vec<(StepKey, StepChanges)>> = Mutex::new(Vec::new());

/// The variants [`Routes::check_in_steps`] tries, in order, each a set of (layer in the table,
/// direction, route): first, for each backward direction, each route near the fastest alone
/// ([`NEAR`]) of two layers or more, on all of those at once (so that, say, two weight
/// gradients split over the batch go in one launch); then each layer's and direction's
/// runners-up one at a time, nearest first ([`RUNNERS_UP`]).
fn variants(table: &Table, pass: Pass) -> Vec<StepChanges> {
    let near = |times: &[(Route, Timed)]| -> Vec<Route> {
        let mut times: Vec<&(Route, Timed)> = times.iter().filter(|(_, t)| !t.one_call && t.us.is_finite()).collect();
        times.sort_by(|a, b| a.1.us.total_cmp(&b.1.us));
        let fastest = times.first().map_or(f32::INFINITY, |t| t.1.us);
        times.iter().filter(|t| t.1.us <= NEAR * fastest).map(|t| t.0).collect()
    };
    let mut out: Vec<StepChanges> = Vec::new();
    for &dir in pass.dirs() {
        let chosen: Vec<(usize, Route, Vec<Route>)> = (table.layers.iter().enumerate())
            .filter_map(|(i, l)| match &l.choices[dir as usize] {
                Choice::Chosen { route, times, .. } => Some((i, *route, near(times))),
                Choice::Pending | Choice::NotNeeded => None,
            })
            .collect();
        let mut shared: Vec<Route> = chosen.iter().flat_map(|c| c.2.iter().copied()).collect();
        shared.dedup();
        for route in shared.iter().enumerate().filter(|(i, r)| !shared[..*i].contains(r)).map(|(_, r)| *r) {
            let on: Vec<&(usize, Route, Vec<Route>)> = chosen.iter().filter(|c| c.2.contains(&route)).collect();
            let variant: StepChanges = on.iter().filter(|c| c.1 != route).map(|c| (c.0, dir, route)).collect();
            if on.len() > 1 && !variant.is_empty() && !out.contains(&variant) {
                out.push(variant);
            }
        }
        for (layer, route, near) in &chosen {
            for r in near.iter().filter(|r| *r != route).take(RUNNERS_UP) {
                if !out.contains(&vec![(*layer, dir, *r)]) {
                    out.push(vec![(*layer, dir, *r)]);
                }
            }
        }
    }
    out
}

impl Routes {
    pub fn new() -> Routes {
        Routes { tables: Vec::new(), current: None }
    }

    /// The route of `dir` of step `index` for the batch [`Routes::prepare`] was last called
    /// for; None where it was not measured.
    pub fn route(&self, index: usize, dir: Dir) -> Option<Route> {
        let table = &self.tables[self.current?];
        match &table.layers.iter().find(|l| l.step == index)?.choices[dir as usize] {
            Choice::Chosen { route, .. } => Some(*route),
            Choice::Pending | Choice::NotNeeded => None,
        }
    }

    /// Whether the routes `pass` chooses in the table [`Routes::prepare`] last picked are
    /// measured but not yet checked in whole passes.
    pub fn unchecked(&self, pass: Pass) -> bool {
        self.current.is_some_and(|index| {
            let table = &self.tables[index];
            let measured = |l: &LayerRoutes| pass.dirs().iter().all(|&d| l.choices[d as usize] != Choice::Pending);
            !table.checked[pass as usize] && table.layers.iter().all(measured)
        })
    }

    /// Checks the routes `pass` chooses in the table [`Routes::prepare`] last picked, in whole
    /// passes. Timed alone, a route misses what runs beside and around it: a step's weight
    /// gradients run on a side stream, beside the input gradients, and a route that is fastest
    /// alone may take the SMs the other stream needed; a layer's and the head's weight
    /// gradients go in one launch only where both take the same route (the split over the
    /// batch); a kernel's start overlaps the end of the one before it differently. So
    /// `time_pass` (`pass` on the routes given, µs a pass) times the routes fastest alone, then
    /// each variant in turn ([`variants`]: a route several layers can take, on all of them;
    /// each direction's nearest runners-up), and a variant is kept where the pass is faster by
    /// more than [`KEEP`]. Once per process for a (pass, device, plan, loss, bucket, TF32,
    /// graphs): later caches take the same routes.
    pub fn check_in_steps(
        &mut self,
        pass: Pass,
        plan: &Plan,
        loss: Option<Loss>,
        graphs: bool,
        ordinal: usize,
        time_pass: &dyn Fn(&Routes) -> Result<f32>,
    ) -> Result<()> {
        let index = self.current.expect("a table picked by prepare");
        let table = &self.tables[index];
        let key = StepKey { pass, ordinal, plan: plan.clone(), loss, bucket: table.bucket, tf32: table.tf32, graphs };
        let known = {
            let all = STEP_CHOICES.lock().unwrap_or_else(PoisonError::into_inner);
            all.iter().find(|(k, _)| *k == key).map(|(_, changes)| changes.clone())
        };
        match known {
            Some(changes) => {
                self.set(index, &changes);
            }
            None => {
                let start = Instant::now();
                let alone = time_pass(self)?;
                let mut best = alone;
                let mut changes = Vec::new();
                // again from the routes kept while a pass keeps one (what is fastest beside
                // the others depends on them), at most PASSES times
                for _ in 0..PASSES {
                    let mut kept = false;
                    for variant in variants(&self.tables[index], pass) {
                        let before = self.set(index, &variant);
                        let us = time_pass(self)?;
                        if us < best * (1.0 - KEEP) {
                            (best, kept) = (us, true);
                            changes.retain(|c: &(usize, Dir, Route)| !variant.iter().any(|v| (v.0, v.1) == (c.0, c.1)));
                            changes.extend(variant);
                        } else {
                            self.set(index, &before);
                        }
                    }
                    if !kept {
                        break;
                    }
                }
                let table = &mut self.tables[index];
                table.step_us[pass as usize] = Some((alone, best));
                table.measuring += start.elapsed();
                let mut all = STEP_CHOICES.lock().unwrap_or_else(PoisonError::into_inner);
                match all.iter().find(|(k, _)| *k == key) {
                    // another cache of the same model got there first: take its routes
                    Some((_, first)) => {
                        let first = first.clone();
                        drop(all);
                        let alone: Vec<_> = changes.iter().map(|&(layer, dir, _)| (layer, dir, self.alone(index, layer, dir))).collect();
                        self.set(index, &alone);
                        self.set(index, &first);
                    }
                    None => all.push((key, changes)),
                }
            }
        }
        self.tables[index].checked[pass as usize] = true;
        Ok(())
    }

    /// Sets the routes `changes` ((layer in the table, direction, route)) in table `index`;
    /// the routes they replace.
    fn set(&mut self, index: usize, changes: &[(usize, Dir, Route)]) -> Vec<(usize, Dir, Route)> {
        let layers = &mut self.tables[index].layers;
        changes
            .iter()
            .filter_map(|&(layer, dir, new)| match &mut layers[layer].choices[dir as usize] {
                Choice::Chosen { route, .. } => Some((layer, dir, std::mem::replace(route, new))),
                Choice::Pending | Choice::NotNeeded => None,
            })
            .collect()
    }

    /// The route of `dir` of the table's `layer` fastest alone.
    fn alone(&self, index: usize, layer: usize, dir: Dir) -> Route {
        match &self.tables[index].layers[layer].choices[dir as usize] {
            Choice::Chosen { alone, .. } => *alone,
            Choice::Pending | Choice::NotNeeded => Route::Cublas,
        }
    }

    /// Readies the dense layers of a step on `f.batch` samples (and their backward with `b`):
    /// the first time the batch's bucket (or TF32 setting) runs, measures its routes (see the
    /// module doc); later only picks its table. Call it before the step is run or captured, on
    /// the model's stream; it may wait for the device.
    pub fn prepare(&mut self, s: &StepRun) -> Result<()> {
        let StepRun { plan, f, b, options, .. } = *s;
        let (bucket, tf32) = (bucket(f.batch), options.tf32);
        let index = match self.tables.iter().position(|t| t.bucket == bucket && t.tf32 == tf32) {
            Some(index) => index,
            None => {
                self.tables.push(new_table(plan, bucket, f.capacity, tf32));
                self.tables.len() - 1
            }
        };
        self.current = Some(index);
        let dirs: &[Dir] = if b.is_some() { &Dir::ALL } else { &[Dir::Forward] };
        let table = &self.tables[index];
        if !table.layers.iter().any(|l| dirs.iter().any(|&d| l.choices[d as usize] == Choice::Pending)) {
            return Ok(());
        }
        let start = Instant::now();
        let mut table = std::mem::replace(
            &mut self.tables[index],
            Table { bucket, samples: 0, tf32, layers: Vec::new(), measuring: Duration::ZERO, checked: [false; 2], step_us: [None; 2] },
        );
        let outcome = (|| {
            for layer in &mut table.layers {
                for &dir in dirs {
                    if layer.choices[dir as usize] == Choice::Pending {
                        layer.choices[dir as usize] = choose(s, &plan.steps[layer.step], dir, bucket, table.samples)?;
                    }
                }
            }
            Ok(())
        })();
        table.measuring += start.elapsed();
        self.tables[index] = table;
        outcome
    }

    /// What runs each dense layer: for each bucket a line with the host time its measuring
    /// took, then one line per layer and direction, with the route chosen and the time per call
    /// of every route that fits (fastest first).
    pub fn report(&self) -> String {
        let mut out = String::new();
        for table in self.tables.iter().filter(|t| !t.layers.is_empty()) {
            let arith = if table.tf32 { "TF32" } else { "FP32" };
            let first = table.bucket / 2 + 1;
            let sizes = if first >= table.samples { format!("{}", table.samples) } else { format!("{first}–{}", table.samples) };
            let ms = table.measuring.as_secs_f64() * 1e3;
            let _ = write!(out, "{}batch {sizes} {arith}: dense routes measured in {ms:.1} ms", if out.is_empty() { "" } else { "\n" });
            for pass in [Pass::Inference, Pass::Training] {
                if let Some((alone, kept)) = table.step_us[pass as usize] {
                    let _ = write!(out, "; {} {alone:.1} µs on the routes fastest alone, {kept:.1} µs on those kept", pass.name());
                }
            }
            for layer in &table.layers {
                for dir in Dir::ALL {
                    let _ =
                        write!(out, "{}batch {sizes} {arith}, {}, {}: ", if out.is_empty() { "" } else { "\n" }, layer.label, dir.name());
                    match &layer.choices[dir as usize] {
                        Choice::Pending => out.push_str("not measured yet"),
                        Choice::NotNeeded => out.push_str("not needed"),
                        Choice::Chosen { route, alone, times } => {
                            let mut times = times.clone();
                            times.sort_by(|a, b| a.1.us.total_cmp(&b.1.us));
                            let us = |r: Route| times.iter().find(|t| t.0 == r).map_or(f32::NAN, |t| t.1.us);
                            let _ = write!(out, "{} {:.1} µs", route.name(), us(*route));
                            let time = |(r, t): &(Route, Timed)| {
                                format!("{} {:.1}{}", r.name(), t.us, if t.one_call { " (one call)" } else { "" })
                            };
                            if alone != route {
                                let _ = write!(out, ", kept in whole steps over {} (fastest alone)", alone.name());
                            }
                            let others: Vec<String> = times.iter().filter(|t| t.0 != *route).map(time).collect();
                            if !others.is_empty() {
                                let _ = write!(out, " (others: {})", others.join(", "));
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// A table for `bucket`, nothing measured yet: every dense step of `plan`.
fn new_table(plan: &Plan, bucket: usize, capacity: usize, tf32: bool) -> Table {
    let layers = plan
        .steps
        .iter()
        .enumerate()
        .filter_map(|(index, step)| {
            let (out, inp) = dense_shape(step)?;
            let label = format!("step {index} dense {inp}→{out}");
            Some(LayerRoutes { step: index, label, choices: [Choice::Pending, Choice::Pending, Choice::Pending] })
        })
        .collect();
    Table { bucket, samples: bucket.min(capacity), tf32, layers, measuring: Duration::ZERO, checked: [false; 2], step_us: [None; 2] }
}

/// Times every route of `dir` of dense step `step` that fits (at `samples` samples, as routes
/// of `bucket`), each at most once per process, and keeps the fastest.
fn choose(s: &StepRun, step: &Step, dir: Dir, bucket: usize, samples: usize) -> Result<Choice> {
    let StepRun { gpu, blas, stream, plan, f, b, options } = *s;
    if dir == Dir::InputGrad && step.input_region == 0 {
        return Ok(Choice::NotNeeded);
    }
    let shape = dense_shape(step).expect("a dense layer");
    let f = crate::cuda::exec::Forward { batch: samples, ..*f };
    let on = On { gpu, blas, stream, plan, f: &f };
    let (a, bm) = operands(dir, plan, step, &f, b);
    let routes = gpu.dense_routes(&options.tuning, dir, problem(dir, shape, samples), &a, &bm);
    let epilogue = match dir {
        Dir::Forward => step.z_region != step.output_region,
        Dir::InputGrad => producer(step).is_some(),
        Dir::WeightGrad => false,
    };
    let key = Problem { ordinal: gpu.ordinal(), dir, shape, bucket, tf32: options.tf32, graphs: options.graphs, epilogue };
    let backward = || b.expect("a backward direction has gradient buffers");
    let run = |route: Route| match dir {
        Dir::Forward => forward_on(&on, step, route, true),
        Dir::InputGrad => {
            input_grad_on(&on, backward(), step, route)?;
            // on cuBLAS the producer's pass then computes its dz: part of the route's cost
            match route {
                Route::Cublas => producer_activation(&on, backward(), step),
                _ => Ok(()),
            }
        }
        // (timed reading X early, as a step does but after a deep head: see dense_pass.rs)
        Dir::WeightGrad => weight_grad_on(&on, backward(), step, route, false, true),
    };
    // what this process timed already, else a first look: one eager call (NaN where it failed)
    let first: Vec<(Route, Result<Timed, f32>)> = routes
        .into_iter()
        .map(|route| (route, timed(&key, route).ok_or_else(|| time_once(gpu, stream, &|| run(route)).unwrap_or(f32::NAN))))
        .collect();
    let fastest = first.iter().map(|(_, t)| t.map_or_else(|once| once, |t| t.us)).filter(|us| !us.is_nan()).fold(f32::INFINITY, f32::min);
    let times: Vec<(Route, Timed)> = first
        .into_iter()
        .map(|(route, t)| {
            let time = match t {
                Ok(known) => return (route, known),
                Err(once) if once.is_nan() || once > SLOW * fastest => Timed { us: once, one_call: true },
                Err(_) => Timed { us: time_calls(gpu, stream, options.graphs, &|| run(route)).unwrap_or(f32::NAN), one_call: false },
            };
            (route, remember(key, route, time))
        })
        .collect();
    // cuBLAS where no route could be timed
    let best = times.iter().filter(|t| !t.1.us.is_nan()).min_by(|a, b| a.1.us.total_cmp(&b.1.us)).map_or(Route::Cublas, |t| t.0);
    // Run it eagerly before any capture (timing did, but perhaps in another cache): a first
    // call (cuBLAS's, on a new handle or shape) may load modules, which would break a capture
    // running on another thread.
    gpu.bind()?;
    {
        let _exclusive = super::device_wide();
        run(best)?;
        stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
    }
    Ok(Choice::Chosen { route: best, alone: best, times })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{Chain, Input};
    use crate::cuda::context::Kernel;
    use crate::{Identity, Relu};

    /// The report names every bucket (with the time its measuring took), dense layer and
    /// direction, the route chosen with its time,
    /// then the others fastest first, one-call looks marked; directions not measured or not
    /// needed say so.
    #[test]
    fn the_report_names_each_layer_and_direction() {
        let plan = Chain::new(Input::vector(20)).dense(16, Relu).dense(3, Identity).build().unwrap().plan().clone();
        let mut table = new_table(&plan, 128, 100, false);
        let t = |us, one_call| Timed { us, one_call };
        let skinny = Route::Fused(Kernel::DenseSkinny4);
        table.layers[0].choices = [
            Choice::Chosen { route: skinny, alone: skinny, times: vec![(Route::Cublas, t(9.5, false)), (skinny, t(2.31, false))] },
            Choice::NotNeeded,
            Choice::Chosen {
                route: Route::Cublas,
                alone: Route::Cublas,
                times: vec![(Route::Fused(Kernel::DenseRow), t(80.0, true)), (Route::Cublas, t(4.0, false))],
            },
        ];
        table.measuring = Duration::from_micros(12_340);
        let routes = Routes { tables: vec![table, new_table(&plan, 1, 100, true)], current: None };
        let want = [
            "batch 65–100 FP32: dense routes measured in 12.3 ms",
            "batch 65–100 FP32, step 0 dense 20→16, forward: dense_skinny4 2.3 µs (others: cublas 9.5)",
            "batch 65–100 FP32, step 0 dense 20→16, input gradient: not needed",
            "batch 65–100 FP32, step 0 dense 20→16, weight gradient: cublas 4.0 µs (others: dense_row 80.0 (one call))",
            "batch 65–100 FP32, step 1 dense 16→3, forward: not measured yet",
            "batch 65–100 FP32, step 1 dense 16→3, input gradient: not measured yet",
            "batch 65–100 FP32, step 1 dense 16→3, weight gradient: not measured yet",
            "batch 1 TF32: dense routes measured in 0.0 ms",
            "batch 1 TF32, step 0 dense 20→16, forward: not measured yet",
        ];
        let report = routes.report();
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(lines.len(), 14, "{report}");
        assert_eq!(lines[..9], want, "{report}");
        assert_eq!(routes.route(0, Dir::Forward), None, "no table picked yet");
    }

    /// A table of a 20-16-3 model whose two weight gradients are measured: the first fastest
    /// alone on `first`, the second on `second`, both also on the split over the batch.
    fn measured(first: Route, second: Route) -> Routes {
        let plan = Chain::new(Input::vector(20)).dense(16, Relu).dense(3, Identity).build().unwrap().plan().clone();
        let mut table = new_table(&plan, 128, 128, false);
        let t = |us| Timed { us, one_call: false };
        for (layer, alone) in [first, second].into_iter().enumerate() {
            let times = vec![(alone, t(2.0)), (Route::Split, t(3.0)), (Route::Fused(Kernel::DenseRow), t(50.0))];
            table.layers[layer].choices = [Choice::Pending, Choice::NotNeeded, Choice::Chosen { route: alone, alone, times }];
        }
        Routes { tables: vec![table], current: Some(0) }
    }

    /// Whole steps keep a variant only where the step is faster on it: here both weight
    /// gradients split over the batch (one launch), though each is slower so alone; a route far
    /// slower alone (`NEAR`) is not tried; a second cache of the same model takes the first's
    /// routes without timing.
    #[test]
    fn whole_steps_keep_the_faster_variant() {
        let (mma, panel) = (Route::Fused(Kernel::DenseMma32x32Mn), Route::Fused(Kernel::DensePanel));
        let plan = Chain::new(Input::vector(20)).dense(16, Relu).dense(3, Identity).build().unwrap().plan().clone();
        let mut routes = measured(mma, panel);
        assert!(routes.unchecked(Pass::Training) && !routes.unchecked(Pass::Inference));
        let tried = std::cell::RefCell::new(Vec::new());
        let step = |r: &Routes| {
            let now = (r.route(0, Dir::WeightGrad).unwrap(), r.route(1, Dir::WeightGrad).unwrap());
            tried.borrow_mut().push(now);
            assert!(now.0 != Route::Fused(Kernel::DenseRow) && now.1 != Route::Fused(Kernel::DenseRow), "{now:?}");
            Ok(if now == (Route::Split, Route::Split) {
                10.0
            } else if now == (mma, panel) {
                12.0
            } else {
                12.5
            })
        };
        routes.check_in_steps(Pass::Training, &plan, Some(Loss::LogitCrossEntropy), true, 9001, &step).unwrap();
        assert!(!routes.unchecked(Pass::Training));
        assert_eq!((routes.route(0, Dir::WeightGrad), routes.route(1, Dir::WeightGrad)), (Some(Route::Split), Some(Route::Split)));
        assert_eq!(tried.borrow()[..2], [(mma, panel), (Route::Split, Route::Split)], "the routes alone, then both split");
        let report = routes.report();
        assert!(report.contains("forward and backward 12.0 µs on the routes fastest alone, 10.0 µs on those kept"), "{report}");
        assert!(
            report.contains("weight gradient: weight_grad_split 3.0 µs, kept in whole steps over dense_mma_32x32_mn (fastest alone)"),
            "{report}"
        );

        let mut second = measured(mma, panel);
        let untimed = |_: &Routes| -> Result<f32> { panic!("the first cache's check is reused") };
        second.check_in_steps(Pass::Training, &plan, Some(Loss::LogitCrossEntropy), true, 9001, &untimed).unwrap();
        assert_eq!(second.route(0, Dir::WeightGrad), Some(Route::Split));

        // where no variant is faster, the routes fastest alone stay
        let mut slower = measured(mma, panel);
        slower
            .check_in_steps(Pass::Training, &plan, Some(Loss::LogitCrossEntropy), true, 9002, &|r: &Routes| {
                Ok(if r.route(0, Dir::WeightGrad) == Some(mma) && r.route(1, Dir::WeightGrad) == Some(panel) { 12.0 } else { 12.05 })
            })
            .unwrap();
        assert_eq!((slower.route(0, Dir::WeightGrad), slower.route(1, Dir::WeightGrad)), (Some(mma), Some(panel)));
    }
}
