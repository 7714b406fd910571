//! The dense routes chosen alone, checked in whole training steps ([`Routes::check_in_steps`]):
//! a step (forward, backward and, in a `train_step`, the optimiser's update, as it runs) timed
//! on the routes fastest alone and on variants of the backward routes, a variant kept where the
//! step is faster. Once per process for a (device, plan, loss, bucket, TF32, determinism, graphs):
//! the convolutions beside the dense layers may take other routes with non-deterministic
//! algorithms allowed, and a deterministic model must not take routes checked beside those.
//!
//! Inference is not checked: a forward pass runs its layers one after another on one stream, as
//! they were timed alone, and checking it in whole passes would change forward routes that a
//! training step's graph had captured (two caches of one model would then compute other bits
//! depending on whether one ran `forward` first) and run a stream's carried state on.

use super::{Choice, Routes, StepUs, Table, Timed};
use crate::chain::Plan;
use crate::cuda::dense::{Dir, Route};
use crate::error::Result;
use crate::loss::Loss;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

/// How much faster (a fraction of the step) a whole step must be on a variant for
/// [`Routes::check_in_steps`] to keep it: more than the noise of the median of a step's
/// replays.
const KEEP: f32 = 0.01;

/// A route that fits several layers' weight gradients (or input gradients) is tried on all of
/// them at once where it is at most this many times the fastest alone on each; a layer's own
/// runners-up where they are at most this many times its fastest. Every such runner-up is
/// tried, not the nearest few: how a route ranks alone says little of how it runs in a step (at
/// 512 samples the MLP's first weight gradient on the tile that splits the batch in two ranks
/// only fifth alone, yet it is the one in the faster step; BENCHMARKS.md, "GPU: MLP step").
const NEAR: f32 = 3.0;

/// Whole steps on the routes kept, and on those fastest alone, timed again before they are
/// kept ([`Routes::confirm`]).
const CONFIRM: usize = 3;

/// Passes over the variants at most (a pass after one that kept nothing would keep nothing).
const PASSES: usize = 3;

/// The directions a training step's check varies: those of the backward pass, whose weight
/// gradients run on a second stream beside the input gradients.
const DIRS: [Dir; 2] = [Dir::WeightGrad, Dir::InputGrad];

/// What a whole-step check is of: the device, the model's plan and loss, the bucket, TF32,
/// determinism (`GpuOptions::deterministic`) and graphs.
#[derive(PartialEq)]
struct StepKey {
    ordinal: usize,
    plan: Plan,
    loss: Loss,
    bucket: usize,
    tf32: bool,
    deterministic: bool,
    graphs: bool,
}

/// Every whole-step check in this process, with the routes it changed ((layer in the table,
/// direction, route)): the first check of a key is what every cache uses, where those routes fit
/// it (see [`Routes::set`]).
type StepChanges = Vec<(usize, Dir, Route)>;
static STEP_CHOICES: Mutex<Vec<(StepKey, StepChanges)>> = Mutex::new(Vec::new());

/// What checking a table takes: nothing (no variant to try), the routes a check of the same
/// key kept, or timing steps (the check's key).
enum ToCheck {
    Nothing,
    Known(StepChanges),
    Time(StepKey),
}

/// The variants [`Routes::check_in_steps`] tries, in order, each a set of (layer in the table,
/// direction, route): first, for each backward direction, each route near the fastest alone
/// ([`NEAR`]) of two layers or more, on all of those at once (so that, say, two weight
/// gradients split over the batch go in one launch); then each layer's and direction's
/// runners-up near its fastest one at a time, nearest first. Not the input gradients of the
/// steps `in_head` says the step's head kernel runs: it writes them itself, so their routes
/// would change nothing in the step.
fn variants(table: &Table, in_head: &dyn Fn(usize) -> bool) -> Vec<StepChanges> {
    let near = |times: &[(Route, Timed)]| -> Vec<Route> {
        let mut times: Vec<&(Route, Timed)> = times.iter().filter(|(_, t)| !t.one_call && t.us.is_finite()).collect();
        times.sort_by(|a, b| a.1.us.total_cmp(&b.1.us));
        let fastest = times.first().map_or(f32::INFINITY, |t| t.1.us);
        times.iter().filter(|t| t.1.us <= NEAR * fastest).map(|t| t.0).collect()
    };
    let mut out: Vec<StepChanges> = Vec::new();
    for dir in DIRS {
        let chosen: Vec<(usize, Route, Vec<Route>)> = (table.layers.iter().enumerate())
            .filter(|(_, l)| !(dir == Dir::InputGrad && in_head(l.step)))
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
            for r in near.iter().filter(|r| *r != route) {
                if !out.contains(&vec![(*layer, dir, *r)]) {
                    out.push(vec![(*layer, dir, *r)]);
                }
            }
        }
    }
    out
}

/// µs a step the routes chosen for the backward directions of `table`'s layers take, each as
/// timed alone.
fn backward_us(table: &Table) -> f32 {
    let chosen = |choice: &Choice| match choice {
        Choice::Chosen { route, times, .. } => times.iter().find(|t| t.0 == *route).map_or(0.0, |t| t.1.us),
        Choice::Pending | Choice::NotNeeded => 0.0,
    };
    table.layers.iter().flat_map(|l| DIRS.map(|d| chosen(&l.choices[d as usize]))).sum()
}

impl Routes {
    /// Whether the backward routes of the table [`Routes::prepare`] last picked are measured but
    /// not yet checked in whole steps.
    pub fn unchecked(&self) -> bool {
        self.current.is_some_and(|index| {
            let table = &self.tables[index];
            let measured = table.layers.iter().all(|l| DIRS.iter().all(|&d| l.choices[d as usize] != Choice::Pending));
            !table.checked && measured
        })
    }

    /// Whether [`Routes::check_in_steps`], called now with these arguments, would time a step
    /// (and so move what a step moves): not where there is no variant to try, nor where the
    /// check of the same key was made already (by another cache of the model). Another cache
    /// may still make it meanwhile; then nothing is timed after all.
    pub fn will_time(&self, plan: &Plan, loss: Loss, graphs: bool, ordinal: usize, in_head: &dyn Fn(usize) -> bool) -> bool {
        self.current.is_some_and(|index| matches!(self.to_check(index, plan, loss, graphs, ordinal, in_head), ToCheck::Time(_)))
    }

    /// What checking table `index` takes ([`ToCheck`]).
    fn to_check(&self, index: usize, plan: &Plan, loss: Loss, graphs: bool, ordinal: usize, in_head: &dyn Fn(usize) -> bool) -> ToCheck {
        let table = &self.tables[index];
        if variants(table, in_head).is_empty() {
            return ToCheck::Nothing;
        }
        let (bucket, tf32, deterministic) = (table.bucket, table.tf32, table.deterministic);
        let key = StepKey { ordinal, plan: plan.clone(), loss, bucket, tf32, deterministic, graphs };
        let all = STEP_CHOICES.lock().unwrap_or_else(PoisonError::into_inner);
        match all.iter().find(|(k, _)| *k == key) {
            Some((_, changes)) => ToCheck::Known(changes.clone()),
            None => ToCheck::Time(key),
        }
    }

    /// Checks the backward routes of the table [`Routes::prepare`] last picked, in whole
    /// training steps. Timed alone, a route misses what runs beside it: a step's weight
    /// gradients run on a side stream, beside the input gradients, and a route that is fastest
    /// alone may take the SMs the other stream needed; a layer's and the head's weight
    /// gradients go in one launch only where both take the same route (the split over the
    /// batch). So `time_step` (a training step on the routes given, µs a step; its update
    /// included where `with_update` says so once the steps are timed, as the report then says) times the routes fastest
    /// alone, then each variant in turn ([`variants`]), and a variant is kept where the step is
    /// faster by more than [`KEEP`] (and stays where timed again so, [`Routes::confirm`]); one
    /// whose timing fails is put back and not kept. Nothing is timed where there is no variant
    /// ([`Routes::will_time`] says beforehand), nor past the first step where the dense layers'
    /// backward routes take under [`KEEP`] of it. `in_head` says which steps (of `plan`) the
    /// step's head kernel runs. Once per process for a (device, plan, loss, bucket, TF32,
    /// determinism, graphs): later caches take the same routes where they fit them.
    #[allow(clippy::too_many_arguments)]
    pub fn check_in_steps(
        &mut self,
        plan: &Plan,
        loss: Loss,
        graphs: bool,
        ordinal: usize,
        in_head: &dyn Fn(usize) -> bool,
        with_update: &dyn Fn() -> bool,
        time_step: &dyn Fn(&Routes) -> Result<f32>,
    ) -> Result<()> {
        let index = self.current.expect("a table picked by prepare");
        match self.to_check(index, plan, loss, graphs, ordinal, in_head) {
            ToCheck::Nothing => {}
            ToCheck::Known(changes) => {
                self.set(index, &changes);
            }
            ToCheck::Time(key) => {
                let start = Instant::now();
                let alone = match time_step(self) {
                    Ok(us) => us,
                    Err(e) => {
                        // the routes fastest alone stay, for this key in every cache of the
                        // process: a check that cannot time a step (say, for want of memory
                        // for its graph) must not fail every training call after it
                        let table = &mut self.tables[index];
                        (table.step_us, table.checked) = (Some(Err(e.to_string())), true);
                        table.measuring += start.elapsed();
                        let mut all = STEP_CHOICES.lock().unwrap_or_else(PoisonError::into_inner);
                        if !all.iter().any(|(k, _)| *k == key) {
                            all.push((key, Vec::new()));
                        }
                        return Ok(());
                    }
                };
                let mut best = alone;
                let mut changes = Vec::new();
                // A variant can save at most the time its routes took: where the backward
                // routes of the dense layers take (alone) under KEEP of the step, as beside the
                // convolutions of a large batch, no variant could be kept, and timing them
                // would cost seconds.
                let passes = if backward_us(&self.tables[index]) < KEEP * alone { 0 } else { PASSES };
                // again from the routes kept while a pass keeps one (what is fastest beside
                // the others depends on them), at most PASSES times
                for _ in 0..passes {
                    let mut kept = false;
                    for variant in variants(&self.tables[index], in_head) {
                        let before = self.set(index, &variant);
                        match time_step(self) {
                            Ok(us) if us < best * (1.0 - KEEP) => {
                                (best, kept) = (us, true);
                                changes.retain(|c: &(usize, Dir, Route)| !variant.iter().any(|v| (v.0, v.1) == (c.0, c.1)));
                                changes.extend(variant);
                            }
                            Ok(_) | Err(_) => {
                                self.set(index, &before);
                            }
                        }
                    }
                    if !kept {
                        break;
                    }
                }
                let (alone, best) = match changes.is_empty() {
                    true => (alone, best),
                    false => self.confirm(index, alone, &mut changes, time_step),
                };
                let table = &mut self.tables[index];
                table.step_us = Some(Ok(StepUs { alone, kept: best, with_update: with_update() }));
                table.measuring += start.elapsed();
                let mut all = STEP_CHOICES.lock().unwrap_or_else(PoisonError::into_inner);
                match all.iter().find(|(k, _)| *k == key) {
                    // another cache of the same model got there first: take its routes (the
                    // times this cache measured stay in its report)
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
        self.tables[index].checked = true;
        Ok(())
    }

    /// The routes `changes` kept in table `index` (set there) timed again in whole steps
    /// ([`CONFIRM`] times, alternating with the routes fastest alone): the fastest of many
    /// variants owes part of its lead to the luck of its timing. They stay where the median is
    /// still faster by more than [`KEEP`]; else (or where a timing fails) the routes fastest
    /// alone are put back and `changes` emptied. The medians, alone and as left (`first`, the
    /// step's first timing on the routes fastest alone, where a timing failed).
    fn confirm(
        &mut self,
        index: usize,
        first: f32,
        changes: &mut Vec<(usize, Dir, Route)>,
        time_step: &dyn Fn(&Routes) -> Result<f32>,
    ) -> (f32, f32) {
        let alone: Vec<_> = changes.iter().map(|&(layer, dir, _)| (layer, dir, self.alone(index, layer, dir))).collect();
        let (mut on_alone, mut on_kept) = ([0f32; CONFIRM], [0f32; CONFIRM]);
        // in turns, which of the two goes first alternating, so that a drift of the clocks
        // favours neither
        let timed = (0..CONFIRM).try_for_each(|i| {
            for kept in [i % 2 == 1, i % 2 == 0] {
                let (routes, times) = if kept { (&changes[..], &mut on_kept) } else { (&alone[..], &mut on_alone) };
                self.set(index, routes);
                times[i] = time_step(self)?;
            }
            Ok::<(), crate::Error>(())
        });
        let median = |times: &mut [f32; CONFIRM]| {
            times.sort_by(f32::total_cmp);
            times[CONFIRM / 2]
        };
        let (alone_us, kept_us) = (median(&mut on_alone), median(&mut on_kept));
        if timed.is_ok() && kept_us < alone_us * (1.0 - KEEP) {
            return (alone_us, kept_us);
        }
        self.set(index, &alone);
        changes.clear();
        // where a timing failed, the step's first timing (the others may be unfilled)
        let alone_us = if timed.is_ok() { alone_us } else { first };
        (alone_us, alone_us)
    }

    /// Sets the routes `changes` ((layer in the table, direction, route)) in table `index`, each
    /// where it is one of the routes that fit that layer and direction in this cache (the tiles'
    /// alignment depends on the capacity: another cache of the model may have kept a route that
    /// does not fit this one); the routes they replace.
    fn set(&mut self, index: usize, changes: &[(usize, Dir, Route)]) -> Vec<(usize, Dir, Route)> {
        let layers = &mut self.tables[index].layers;
        changes
            .iter()
            .filter_map(|&(layer, dir, new)| match &mut layers[layer].choices[dir as usize] {
                Choice::Chosen { route, times, .. } if times.iter().any(|t| t.0 == new) => {
                    Some((layer, dir, std::mem::replace(route, new)))
                }
                Choice::Chosen { .. } | Choice::Pending | Choice::NotNeeded => None,
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
}

#[cfg(test)]
mod tests {
    use super::super::new_table;
    use super::*;
    use crate::chain::{Chain, Input};
    use crate::cuda::context::Kernel;
    use crate::{Identity, Relu};

    /// The plan of the tests' 20-16-3 model.
    fn plan() -> Plan {
        Chain::new(Input::vector(20)).dense(16, Relu).dense(3, Identity).build().unwrap().plan().clone()
    }

    /// A table of the 20-16-3 model whose two weight gradients are measured: the first fastest
    /// alone on `first`, the second on `second`, both also on the split over the batch.
    fn measured(first: Route, second: Route) -> Routes {
        let mut table = new_table(&plan(), 128, 128, false, true);
        let t = |us| Timed { us, one_call: false };
        for (layer, alone) in [first, second].into_iter().enumerate() {
            let times = vec![(alone, t(2.0)), (Route::Split, t(3.0)), (Route::Fused(Kernel::DenseRow), t(50.0))];
            table.layers[layer].choices = [Choice::Pending, Choice::NotNeeded, Choice::Chosen { route: alone, alone, times }];
        }
        Routes { tables: vec![table], current: Some(0), norms: crate::cuda::routes::norm::NormRoutes::new() }
    }

    /// Whole steps keep a variant only where the step is faster on it: here both weight
    /// gradients split over the batch (one launch), though each is slower so alone; a route far
    /// slower alone (`NEAR`) is not tried; a second cache of the same model takes the first's
    /// routes without timing.
    #[test]
    fn whole_steps_keep_the_faster_variant() {
        let (mma, panel) = (Route::Fused(Kernel::DenseMma32x32Mn), Route::Fused(Kernel::DensePanel));
        let plan = plan();
        let mut routes = measured(mma, panel);
        assert!(routes.unchecked());
        assert!(routes.will_time(&plan, Loss::LogitCrossEntropy, true, 9001, &|_| false));
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
        routes.check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9001, &|_| false, &|| true, &step).unwrap();
        assert!(!routes.unchecked());
        assert_eq!((routes.route(0, Dir::WeightGrad), routes.route(1, Dir::WeightGrad)), (Some(Route::Split), Some(Route::Split)));
        assert_eq!(tried.borrow()[..2], [(mma, panel), (Route::Split, Route::Split)], "the routes alone, then both split");
        let report = routes.report();
        assert!(report.contains("whole steps 12.0 µs on the routes fastest alone, 10.0 µs on those kept"), "{report}");
        assert!(
            report.contains("weight gradient: weight_grad_split 3.0 µs, kept in whole steps over dense_mma_32x32_mn (fastest alone)"),
            "{report}"
        );

        let mut second = measured(mma, panel);
        assert!(!second.will_time(&plan, Loss::LogitCrossEntropy, true, 9001, &|_| false), "the first cache's check is reused");
        let untimed = |_: &Routes| -> Result<f32> { panic!("the first cache's check is reused") };
        second.check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9001, &|_| false, &|| true, &untimed).unwrap();
        assert_eq!(second.route(0, Dir::WeightGrad), Some(Route::Split));

        // where no variant is faster, the routes fastest alone stay
        let mut slower = measured(mma, panel);
        slower
            .check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9002, &|_| false, &|| true, &|r: &Routes| {
                Ok(if r.route(0, Dir::WeightGrad) == Some(mma) && r.route(1, Dir::WeightGrad) == Some(panel) { 12.0 } else { 12.05 })
            })
            .unwrap();
        assert_eq!((slower.route(0, Dir::WeightGrad), slower.route(1, Dir::WeightGrad)), (Some(mma), Some(panel)));
    }

    /// A variant whose timing fails is put back and not kept (the routes fastest alone stay,
    /// and the check completes); a route another cache kept is taken only where it fits this
    /// cache's layer (is among its routes timed); a table with nothing to vary times nothing.
    #[test]
    fn a_failed_variant_is_put_back_and_a_route_that_does_not_fit_is_not_taken() {
        let (mma, panel) = (Route::Fused(Kernel::DenseMma32x32Mn), Route::Fused(Kernel::DensePanel));
        let plan = plan();
        let mut routes = measured(mma, panel);
        routes
            .check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9003, &|_| false, &|| true, &|r: &Routes| {
                let now = (r.route(0, Dir::WeightGrad).unwrap(), r.route(1, Dir::WeightGrad).unwrap());
                match now == (Route::Split, Route::Split) {
                    true => Err(crate::Error::Cuda { what: "a variant failed to run".into() }),
                    false => Ok(12.0),
                }
            })
            .unwrap();
        assert!(!routes.unchecked());
        assert_eq!((routes.route(0, Dir::WeightGrad), routes.route(1, Dir::WeightGrad)), (Some(mma), Some(panel)));

        // a cache of the model whose first layer cannot take the split (another capacity)
        let mut kept = measured(mma, panel);
        kept.check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9004, &|_| false, &|| true, &|r: &Routes| {
            Ok(if r.route(0, Dir::WeightGrad) == Some(Route::Split) && r.route(1, Dir::WeightGrad) == Some(Route::Split) {
                10.0
            } else {
                12.0
            })
        })
        .unwrap();
        let mut other = measured(mma, panel);
        if let Choice::Chosen { times, .. } = &mut other.tables[0].layers[0].choices[Dir::WeightGrad as usize] {
            times.retain(|t| t.0 != Route::Split);
        }
        other
            .check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9004, &|_| false, &|| true, &|_: &Routes| {
                panic!("the first cache's check is reused")
            })
            .unwrap();
        assert_eq!((other.route(0, Dir::WeightGrad), other.route(1, Dir::WeightGrad)), (Some(mma), Some(Route::Split)));

        // one route to choose from in every direction: nothing to vary, nothing timed
        let mut single = measured(mma, panel);
        for layer in &mut single.tables[0].layers {
            if let Choice::Chosen { route, times, .. } = &mut layer.choices[Dir::WeightGrad as usize] {
                times.retain(|t| t.0 == *route);
            }
        }
        assert!(!single.will_time(&plan, Loss::LogitCrossEntropy, true, 9005, &|_| false));
        single
            .check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9005, &|_| false, &|| true, &|_: &Routes| panic!("nothing to time"))
            .unwrap();
        assert!(!single.unchecked());
    }
    /// Every runner-up near the fastest alone is tried, however many rank ahead of it (here
    /// the fifth, kept because the step is fastest on it); the input gradient of a step the
    /// head kernel runs is not varied (the head writes it: the step could not change).
    #[test]
    fn every_near_runner_up_is_tried_but_not_the_heads_input_gradients() {
        let k = |kernel| Route::Fused(kernel);
        let fastest = k(Kernel::DenseMma32x32Mn);
        let order =
            [Kernel::DenseMma16x16Mn, Kernel::DenseMma32x16Mn, Kernel::DenseMma16x32Mn, Kernel::DensePanel, Kernel::DenseMma32x32Mn2];
        let plan = plan();
        let mut table = new_table(&plan, 128, 128, false, true);
        let t = |us| Timed { us, one_call: false };
        let mut times = vec![(fastest, t(7.0))];
        times.extend(order.iter().enumerate().map(|(i, &kernel)| (k(kernel), t(7.5 + i as f32))));
        table.layers[0].choices = [Choice::Pending, Choice::NotNeeded, Choice::Chosen { route: fastest, alone: fastest, times }];
        let (panel, cublas) = (k(Kernel::DensePanel), Route::Cublas);
        let input = vec![(panel, t(2.0)), (cublas, t(2.5))];
        let weight = vec![(k(Kernel::DenseSkinny4), t(2.0))];
        table.layers[1].choices = [
            Choice::Pending,
            Choice::Chosen { route: panel, alone: panel, times: input },
            Choice::Chosen { route: k(Kernel::DenseSkinny4), alone: k(Kernel::DenseSkinny4), times: weight },
        ];
        let mut routes = Routes { tables: vec![table], current: Some(0), norms: crate::cuda::routes::norm::NormRoutes::new() };
        let head_step = routes.tables[0].layers[1].step;
        let step = |r: &Routes| {
            assert_eq!(r.route(1, Dir::InputGrad), Some(panel), "the head's input gradient varied");
            Ok(if r.route(0, Dir::WeightGrad) == Some(k(Kernel::DenseMma32x32Mn2)) { 10.0 } else { 12.0 })
        };
        routes.check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9006, &|s| s == head_step, &|| true, &step).unwrap();
        assert_eq!(routes.route(0, Dir::WeightGrad), Some(k(Kernel::DenseMma32x32Mn2)));
    }
    /// A variant that was faster only in its one timing (the luck of many tries) is timed
    /// again against the routes fastest alone and not kept.
    #[test]
    fn a_variant_faster_once_is_not_kept() {
        let (mma, panel) = (Route::Fused(Kernel::DenseMma32x32Mn), Route::Fused(Kernel::DensePanel));
        let plan = plan();
        let mut routes = measured(mma, panel);
        let lucky = std::cell::Cell::new(true);
        let step = |r: &Routes| {
            let split = r.route(0, Dir::WeightGrad) == Some(Route::Split) && r.route(1, Dir::WeightGrad) == Some(Route::Split);
            Ok(if split && lucky.replace(false) { 10.0 } else { 12.0 })
        };
        routes.check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9007, &|_| false, &|| true, &step).unwrap();
        assert!(!lucky.get(), "the split was timed");
        assert_eq!((routes.route(0, Dir::WeightGrad), routes.route(1, Dir::WeightGrad)), (Some(mma), Some(panel)));
        assert!(routes.report().contains("whole steps 12.0 µs on the routes fastest alone, 12.0 µs on those kept"));
    }
    /// Where the dense layers' backward routes take under `KEEP` of the step (a small head
    /// behind large convolutions), the step is timed once and no variant is tried.
    #[test]
    fn no_variant_is_timed_where_the_dense_layers_are_a_sliver_of_the_step() {
        let (mma, panel) = (Route::Fused(Kernel::DenseMma32x32Mn), Route::Fused(Kernel::DensePanel));
        let plan = plan();
        let mut routes = measured(mma, panel);
        let timed = std::cell::Cell::new(0);
        let step = |_: &Routes| {
            timed.set(timed.get() + 1);
            Ok(1000.0)
        };
        routes.check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9008, &|_| false, &|| true, &step).unwrap();
        assert_eq!(timed.get(), 1);
        assert!(!routes.unchecked());
        assert_eq!((routes.route(0, Dir::WeightGrad), routes.route(1, Dir::WeightGrad)), (Some(mma), Some(panel)));
    }
    /// Where a timing fails while the kept routes are timed again, the routes fastest alone
    /// are put back and the report gives the step's first timing, not an unfilled one (of a
    /// step timed without its update, as after `backprop`: "forward and backward", not "whole
    /// steps").
    #[test]
    fn a_failed_confirmation_puts_the_routes_back_and_reports_the_first_timing() {
        let (mma, panel) = (Route::Fused(Kernel::DenseMma32x32Mn), Route::Fused(Kernel::DensePanel));
        let plan = plan();
        let mut routes = measured(mma, panel);
        let split_timings = std::cell::Cell::new(0);
        let step = |r: &Routes| {
            let split = r.route(0, Dir::WeightGrad) == Some(Route::Split) && r.route(1, Dir::WeightGrad) == Some(Route::Split);
            if !split {
                return Ok(12.0);
            }
            split_timings.set(split_timings.get() + 1);
            match split_timings.get() {
                1 => Ok(10.0),
                _ => Err(crate::Error::Cuda { what: "a timing failed".into() }),
            }
        };
        routes.check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9009, &|_| false, &|| false, &step).unwrap();
        assert!(split_timings.get() >= 2, "the split was timed again");
        assert_eq!((routes.route(0, Dir::WeightGrad), routes.route(1, Dir::WeightGrad)), (Some(mma), Some(panel)));
        let report = routes.report();
        assert!(report.contains("forward and backward 12.0 µs on the routes fastest alone, 12.0 µs on those kept"), "{report}");
    }

    /// A first step that cannot be timed (say, its graph finds no memory beside the check's
    /// copies) leaves the routes fastest alone, checked, and says so; another cache of the
    /// same key times nothing and takes them too: training goes on.
    #[test]
    fn a_step_that_cannot_be_timed_leaves_the_routes_alone_and_training_goes_on() {
        let (mma, panel) = (Route::Fused(Kernel::DenseMma32x32Mn), Route::Fused(Kernel::DensePanel));
        let plan = plan();
        let mut routes = measured(mma, panel);
        let failing = |_: &Routes| Err(crate::Error::Cuda { what: "out of memory".into() });
        routes.check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9010, &|_| false, &|| true, &failing).unwrap();
        assert!(!routes.unchecked());
        assert_eq!((routes.route(0, Dir::WeightGrad), routes.route(1, Dir::WeightGrad)), (Some(mma), Some(panel)));
        let report = routes.report();
        assert!(report.contains("whole steps not timed (") && report.contains("out of memory"), "{report}");
        let mut second = measured(mma, panel);
        assert!(!second.will_time(&plan, Loss::LogitCrossEntropy, true, 9010, &|_| false));
        second.check_in_steps(&plan, Loss::LogitCrossEntropy, true, 9010, &|_| false, &|| true, &|_: &Routes| panic!("known")).unwrap();
        assert!(!second.unchecked());
    }
}
