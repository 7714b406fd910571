//! Which route runs each direction of each dense layer on a GPU, chosen by measurement (as the
//! convolutions choose between cuDNN and flatnn's kernels, src/cuda/dnn.rs): every route that
//! fits (`Gpu::dense_routes`) is timed as a step runs it (`timing::time_calls`: in a CUDA
//! graph, or eagerly where the model's graphs are off), on the cache's own buffers, and the
//! fastest is kept.
//!
//! Batches are measured by size bucket, the powers of two: a batch of `b` samples takes the
//! routes of bucket `b.next_power_of_two()`, measured at that many samples (at the capacity
//! where that is less). A bucket is measured the first time a batch of its sizes runs, before
//! its graph is captured (the forward direction by `forward` or a training step, whichever
//! comes first; the other two by the first training step): that call waits for the device;
//! once every bucket in use is measured, steps and forward passes queue their graphs without
//! waiting. (A cache's backward buffers come with `preallocate_grads`, apart from `preallocate`,
//! so nothing is measured when they are made.)
//!
//! Each route is timed once per process for a (device, direction, layer shape, bucket, TF32,
//! graphs, epilogue) and every later cache reuses the time, so the models of one process take
//! the same routes and compute the same bits (where the same routes fit: the tensor-core tiles
//! need 16-byte aligned operands, and where a layer's inputs start in the activations depends
//! on the capacity). Every route is deterministic; another process may measure otherwise and
//! take another route, whose results differ in the last bits. A measurement writes only what
//! the step it precedes overwrites (the layer's z and y, its input gradient or its producer's
//! dz, its weight gradient).
//!
//! A training step's backward routes fastest alone are then checked in whole steps
//! (`routes/check.rs`).

mod check;
mod norm;

pub(crate) use norm::{NormPass, NormRoute};

use super::dense::{Dir, Route};
use super::dense_pass::{
    dense_shape, forward_on, input_grad_on, lt_routes, operands, problem, producer, producer_activation, weight_grad_on, On,
};
use super::dnn::StepRun;
use super::driver_error;
use super::timing::{time_routes, FirstMeasured, Timed};
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::Mode;
use std::fmt::Write;
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

/// The routes of one bucket, arithmetic and determinism: dense routes are the same either way,
/// but the whole-step check times them beside the convolutions, whose routes are not.
#[derive(Clone, Debug)]
struct Table {
    bucket: usize,
    /// The samples it was measured at: the bucket, or the capacity where that is less.
    samples: usize,
    tf32: bool,
    /// `GpuOptions::deterministic` of the models it was made for.
    deterministic: bool,
    layers: Vec<LayerRoutes>,
    /// Host time spent measuring its routes, in this cache.
    measuring: Duration,
    /// Whether its backward routes were checked in whole steps yet ([`Routes::check_in_steps`]).
    checked: bool,
    /// The training steps the whole-step check timed (where this cache checked), or why it
    /// could not time the first one (the routes fastest alone then stay).
    step_us: Option<std::result::Result<StepUs, String>>,
}

/// A training step's time (µs) on the routes fastest alone and on those kept after the
/// whole-step check, and whether the step timed was whole (the optimiser's update included)
/// or its forward and backward passes alone (where the call was `backprop`, or the copies that
/// put the parameters and the optimiser's state back could not be had).
#[derive(Clone, Copy, Debug)]
struct StepUs {
    alone: f32,
    kept: f32,
    with_update: bool,
}

/// A cache's dense routes: a table per bucket (and TF32 and determinism setting) that has run.
pub(crate) struct Routes {
    tables: Vec<Table>,
    /// The table the last `prepare` picked: the one the calls of the step being run use.
    current: Option<usize>,
    /// The batch-norm layers' routes (`routes/norm.rs`).
    norms: norm::NormRoutes,
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
static TIMES: FirstMeasured<(Problem, Route), Timed> = FirstMeasured::new();

impl Routes {
    pub fn new() -> Routes {
        Routes { tables: Vec::new(), current: None, norms: norm::NormRoutes::new() }
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

    /// The route of batch-norm step `index`'s training `pass` for the batch
    /// [`Routes::prepare`] was last called for (`split` where none was measured).
    pub fn norm(&self, index: usize, pass: NormPass) -> NormRoute {
        self.norms.route(index, pass)
    }

    /// Readies the dense layers of a step on `f.batch` samples (and their backward with `b`),
    /// and its batch-norm layers' training passes (`routes/norm.rs`):
    /// the first time the batch's bucket (or TF32 setting) runs, measures its routes (see the
    /// module doc); later only picks its table. Call it before the step is run or captured, on
    /// the model's stream; it may wait for the device.
    pub fn prepare(&mut self, s: &StepRun) -> Result<()> {
        self.norms.prepare(s)?;
        let StepRun { plan, f, b, options, .. } = *s;
        let (bucket, tf32, deterministic) = (bucket(f.batch), options.tf32, options.deterministic);
        let index = match self.tables.iter().position(|t| t.bucket == bucket && t.tf32 == tf32 && t.deterministic == deterministic) {
            Some(index) => index,
            None => {
                self.tables.push(new_table(plan, bucket, f.capacity, tf32, deterministic));
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
            Table { bucket, samples: 0, tf32, deterministic, layers: Vec::new(), measuring: Duration::ZERO, checked: false, step_us: None },
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
    /// of every route that fits (fastest first); then the batch-norm layers' lines
    /// (`routes/norm.rs`).
    pub fn report(&self) -> String {
        let mut out = String::new();
        for table in self.tables.iter().filter(|t| !t.layers.is_empty()) {
            let arith = super::options::arithmetic(table.tf32, table.deterministic);
            let first = table.bucket / 2 + 1;
            let sizes = if first >= table.samples { format!("{}", table.samples) } else { format!("{first}–{}", table.samples) };
            let ms = table.measuring.as_secs_f64() * 1e3;
            let _ = write!(out, "{}batch {sizes} {arith}: dense routes measured in {ms:.1} ms", if out.is_empty() { "" } else { "\n" });
            match &table.step_us {
                Some(Ok(StepUs { alone, kept, with_update })) => {
                    let what = if *with_update { "whole steps" } else { "forward and backward" };
                    let _ = write!(out, "; {what} {alone:.1} µs on the routes fastest alone, {kept:.1} µs on those kept");
                }
                Some(Err(why)) => {
                    let _ = write!(out, "; whole steps not timed ({why}): the routes fastest alone");
                }
                None => {}
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
        let norms = self.norms.report();
        if !norms.is_empty() {
            out += if out.is_empty() { "" } else { "\n" };
            out += &norms;
        }
        out
    }
}

/// A table for `bucket`, nothing measured yet: every dense step of `plan`.
fn new_table(plan: &Plan, bucket: usize, capacity: usize, tf32: bool, deterministic: bool) -> Table {
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
    let samples = bucket.min(capacity);
    Table { bucket, samples, tf32, deterministic, layers, measuring: Duration::ZERO, checked: false, step_us: None }
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
    let mut routes = gpu.dense_routes(&options.tuning, options.tf32, dir, problem(dir, shape, samples), &a, &bm);
    // cuBLASLt's algorithms, where it loads; where its heuristic fails, the others alone (as a
    // route whose timing fails is left out)
    if options.tuning.blaslt {
        routes.extend(lt_routes(&on, b, step, dir, options.deterministic).unwrap_or_default());
    }
    let epilogue = match dir {
        Dir::Forward => step.z_region != step.output_region,
        Dir::InputGrad => producer(step).is_some(),
        Dir::WeightGrad => false,
    };
    let key = Problem { ordinal: gpu.ordinal(), dir, shape, bucket, tf32: options.tf32, graphs: options.graphs, epilogue };
    let backward = || b.expect("a backward direction has gradient buffers");
    let run = |route: Route| match dir {
        // as a training pass runs it, z written: an inference pass leaves out that one write
        // of Z on every route
        Dir::Forward => forward_on(&on, step, route, true, Mode::Train),
        Dir::InputGrad => {
            input_grad_on(&on, backward(), step, route)?;
            // on cuBLAS(Lt) the producer's pass then computes its dz: part of the route's cost
            match route.leaves_producer() {
                true => producer_activation(&on, backward(), step),
                false => Ok(()),
            }
        }
        // (timed reading X early, as a step does but after a deep head: see dense_pass.rs)
        Dir::WeightGrad => weight_grad_on(&on, backward(), step, route, false, true),
    };
    let times = time_routes(gpu, stream, options.graphs, routes, |r| TIMES.get(&(key, r)), |r, t| TIMES.keep((key, r), t), &run);
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
        let mut table = new_table(&plan, 128, 100, false, true);
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
        let routes = Routes { tables: vec![table, new_table(&plan, 1, 100, true, false)], current: None, norms: norm::NormRoutes::new() };
        let want = [
            "batch 65–100 FP32: dense routes measured in 12.3 ms",
            "batch 65–100 FP32, step 0 dense 20→16, forward: dense_skinny4 2.3 µs (others: cublas 9.5)",
            "batch 65–100 FP32, step 0 dense 20→16, input gradient: not needed",
            "batch 65–100 FP32, step 0 dense 20→16, weight gradient: cublas 4.0 µs (others: dense_row 80.0 (one call))",
            "batch 65–100 FP32, step 1 dense 16→3, forward: not measured yet",
            "batch 65–100 FP32, step 1 dense 16→3, input gradient: not measured yet",
            "batch 65–100 FP32, step 1 dense 16→3, weight gradient: not measured yet",
            "batch 1 TF32 (non-deterministic allowed): dense routes measured in 0.0 ms",
            "batch 1 TF32 (non-deterministic allowed), step 0 dense 20→16, forward: not measured yet",
        ];
        let report = routes.report();
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(lines.len(), 14, "{report}");
        assert_eq!(lines[..9], want, "{report}");
        assert_eq!(routes.route(0, Dir::Forward), None, "no table picked yet");
    }
}
