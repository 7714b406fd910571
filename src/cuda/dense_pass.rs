//! A dense step on the GPU, as the plan runs it (the twin of src/layers/dense.rs): each direction
//! (forward, input gradient, weight gradient) on the route the cache measured for the batch's
//! size (src/cuda/routes.rs), and the launches of each route (src/cuda/dense.rs).

use super::blas::{Blas, DevMat, DevMatMut};
use super::context::Gpu;
use super::dense::{DenseEpilogue, Dir, Route};
use super::exec::{activation_backward, bit, Backward, Forward, GpuBackward, GpuForward, Raw};
use super::head::Head;
use super::wgrad::Job;
use crate::activation::Activation;
use crate::chain::{Layer, Plan, Step};
use crate::error::Result;
use crate::layers::{region, Mode};
use cudarc::driver::CudaStream;
use std::ops::Range;

/// Where a dense step's launches go: the device, cuBLAS bound to `stream`, the plan and the
/// pass's buffers (for `f.batch` samples).
#[derive(Clone, Copy)]
pub(crate) struct On<'a> {
    pub gpu: &'a Gpu,
    pub blas: &'a Blas,
    pub stream: &'a CudaStream,
    pub plan: &'a Plan,
    pub f: &'a Forward<'a>,
}

impl On<'_> {
    fn region(&self, r: usize) -> Range<usize> {
        region(self.plan, r, self.f.capacity, self.f.batch)
    }
}

/// A dense step's (outputs, inputs), or None for other layers.
pub(crate) fn dense_shape(step: &Step) -> Option<(usize, usize)> {
    let Layer::Dense(dense) = step.layer else { return None };
    Some((dense.out_features, step.input.len()))
}

/// The product (m, n, k) of `dir` of an `out × inp` dense layer over `batch` samples.
pub(crate) fn problem(dir: Dir, (out, inp): (usize, usize), batch: usize) -> (usize, usize, usize) {
    match dir {
        Dir::Forward => (batch, out, inp),
        Dir::InputGrad => (batch, inp, out),
        Dir::WeightGrad => (out, inp, batch),
    }
}

/// A and B of `dir` of dense step `step` as [`Gpu::dense_on`] takes them: forward X (batch ×
/// in) and Wᵀ; input gradient dZ (batch × out) and W (out × in); weight gradient dZᵀ and X.
pub(crate) fn operands<'a>(dir: Dir, plan: &Plan, step: &Step, f: &Forward<'a>, b: Option<&Backward<'a>>) -> (DevMat<'a>, DevMat<'a>) {
    let (out, inp) = dense_shape(step).expect("a dense layer");
    let (x, z) = (region(plan, step.input_region, f.capacity, f.batch), region(plan, step.z_region, f.capacity, f.batch));
    let (w, _) = step.weight_and_bias();
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let dacts = || Raw::of(b.expect("a backward direction has gradient buffers").dacts);
    match dir {
        Dir::Forward => (DevMat { data: acts.at(x), rs: inp, cs: 1 }, DevMat { data: params.at(w), rs: 1, cs: inp }),
        Dir::InputGrad => (DevMat { data: dacts().at(z), rs: out, cs: 1 }, DevMat { data: params.at(w), rs: inp, cs: 1 }),
        Dir::WeightGrad => (DevMat { data: dacts().at(z), rs: 1, cs: out }, DevMat { data: acts.at(x), rs: inp, cs: 1 }),
    }
}

/// The step whose dz a dense step's input gradient writes on a fused route (its producer's
/// activation folded in): its activated producer, as the plan gives it, but none past step 127
/// (the backward pass's masks, `exec::bit`).
pub(crate) fn producer(step: &Step) -> Option<usize> {
    step.activated_input.filter(|&p| bit(p) != 0)
}

/// Z (batch × out) = X · Wᵀ, with + b and Y = act(Z) in the same launch on a fused route, after
/// it on cuBLAS; on cuBLASLt + b in its epilogue where there is no activation, else as on cuBLAS
/// (and as on cuBLAS where the algorithm does not take this batch: see [`Blas::lt_matmul`]).
/// `weights_early` as [`Gpu::dense_on`]'s `b_early`. In inference, where the step has a y of its
/// own, Z + b goes to Y alone: Z is left unwritten on a fused route and holds X · Wᵀ on cuBLAS
/// (no step reads a z after an inference pass; a training pass runs its own forward).
pub(crate) fn forward_on(on: &On, step: &Step, route: Route, weights_early: bool, mode: Mode) -> Result<()> {
    let On { gpu, blas, stream, plan, f } = *on;
    let (out, inp) = dense_shape(step).expect("a dense layer");
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let (z, y) = (on.region(step.z_region), on.region(step.output_region));
    let (_, bias) = step.weight_and_bias();
    let act = step.layer.activation();
    let (xm, wt) = operands(Dir::Forward, plan, step, f, None);
    let keep_z = mode == Mode::Train;
    match route {
        Route::Fused(kernel) => {
            let activated = z != y;
            let (z, y) = ((keep_z || !activated).then(|| acts.at_mut(z)), activated.then(|| acts.at_mut(y)));
            let epilogue = DenseEpilogue::Forward { bias: params.at(bias), z, y, act };
            gpu.dense_on(stream, kernel, f.batch, out, inp, xm, wt, epilogue, weights_early)
        }
        Route::Cublas | Route::Lt(_) => {
            let zm = || DevMatMut { data: acts.at_mut(z.clone()), rs: out, cs: 1 };
            // cuBLASLt adds the bias where no activation follows (z is y)
            let bias_in_lt = matches!(route, Route::Lt(_)) && z == y;
            let ran = match route {
                Route::Lt(lt) => blas.lt_matmul(lt, f.batch, out, inp, xm, wt, zm(), bias_in_lt.then(|| params.at(bias.clone())))?,
                _ => false,
            };
            if ran && bias_in_lt {
                return Ok(());
            }
            if !ran {
                blas.sgemm(f.batch, out, inp, 1.0, xm, wt, 0.0, zm())?;
            }
            let y = (z != y).then(|| acts.at_mut(y));
            gpu.bias_act(stream, act, params.at(bias), out, 1, f.batch, acts.at_mut(z), y, keep_z)
        }
        Route::Split => unreachable!("a forward is never split over the batch"),
    }
}

/// dX (batch × in) = dZ · W: on a fused route times act' of the step's [`producer`], written as
/// that step's dz (returned, so that its own pass skips its activation); on cuBLAS or cuBLASLt
/// into the step's input gradient, the producer's activation left to its own pass.
pub(crate) fn input_grad_on(on: &On, b: &Backward, step: &Step, route: Route) -> Result<Option<usize>> {
    let On { gpu, blas, stream, plan, f } = *on;
    let (out, inp) = dense_shape(step).expect("a dense layer");
    let (acts, dacts) = (Raw::of(f.acts), Raw::of(b.dacts));
    let x = on.region(step.input_region);
    let (dzm, wm) = operands(Dir::InputGrad, plan, step, f, Some(b));
    match route {
        Route::Fused(kernel) => {
            let producer = producer(step);
            let epilogue = match producer {
                Some(p) => {
                    let ps = &plan.steps[p];
                    let pz = on.region(ps.z_region);
                    DenseEpilogue::InputGrad { dx: dacts.at_mut(pz.clone()), prev: Some((acts.at(pz), acts.at(x), ps.layer.activation())) }
                }
                None => DenseEpilogue::InputGrad { dx: dacts.at_mut(x), prev: None },
            };
            // after the loss in the same pass: the weights are read at once
            gpu.dense_on(stream, kernel, f.batch, inp, out, dzm, wm, epilogue, true)?;
            Ok(producer)
        }
        Route::Cublas | Route::Lt(_) => {
            let dx = || DevMatMut { data: dacts.at_mut(x.clone()), rs: inp, cs: 1 };
            let ran = match route {
                Route::Lt(lt) => blas.lt_matmul(lt, f.batch, inp, out, dzm, wm, dx(), None)?,
                _ => false,
            };
            if !ran {
                blas.sgemm(f.batch, inp, out, 1.0, dzm, wm, 0.0, dx())?;
            }
            Ok(None)
        }
        Route::Split => unreachable!("an input gradient is never split over the batch"),
    }
}

/// The producer's dz = dy ⊙ act'(z) from the step's input gradient, as the producer's own pass
/// computes it after a cuBLAS input gradient (to time that route as a step runs it).
pub(crate) fn producer_activation(on: &On, b: &Backward, step: &Step) -> Result<()> {
    let Some(p) = producer(step) else { return Ok(()) };
    let ps = &on.plan.steps[p];
    let (acts, dacts) = (Raw::of(on.f.acts), Raw::of(b.dacts));
    let (z, y) = (on.region(ps.z_region), on.region(ps.output_region));
    on.gpu.act_backward(on.stream, ps.layer.activation(), z.len(), acts.at(z.clone()), acts.at(y.clone()), dacts.at(y), dacts.at_mut(z))
}

/// The cuBLASLt routes of `dir` of dense step `step` at `f.batch` samples ([`Blas::lt_routes`]),
/// for the product as the step runs it: a forward's bias in the epilogue where z is y (no
/// activation). None where cuBLASLt is missing or offers nothing.
pub(crate) fn lt_routes(on: &On, b: Option<&Backward>, step: &Step, dir: Dir, deterministic: bool) -> Result<Vec<Route>> {
    let On { blas, plan, f, .. } = *on;
    let (out, inp) = dense_shape(step).expect("a dense layer");
    let (a, bm) = operands(dir, plan, step, f, b);
    let (m, n, k) = problem(dir, (out, inp), f.batch);
    let (w, bias) = step.weight_and_bias();
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let backward = || b.expect("a backward direction has gradient buffers");
    let (c, bias) = match dir {
        Dir::Forward => {
            let (z, y) = (on.region(step.z_region), on.region(step.output_region));
            (acts.at_mut(z.clone()), (z == y).then(|| params.at(bias)))
        }
        Dir::InputGrad => (Raw::of(backward().dacts).at_mut(on.region(step.input_region)), None),
        Dir::WeightGrad => (Raw::of(backward().grads).at_mut(w), None),
    };
    let c = DevMatMut { data: c, rs: n, cs: 1 };
    Ok(blas.lt_routes(m, n, k, &a, &bm, &c, bias, deterministic)?.into_iter().map(Route::Lt).collect())
}

/// dW (out × in) = dZᵀ · X and db = Σ_batch dZ, on `route`; a route that adds into them
/// ([`Route::adds`]) finds them cleared where `cleared`, else clears them first. `x_early`: no
/// kernel this one depends on writes X, so a fused route reads it before waiting for them.
pub(crate) fn weight_grad_on(on: &On, b: &Backward, step: &Step, route: Route, cleared: bool, x_early: bool) -> Result<()> {
    let On { gpu, blas, stream, plan, f } = *on;
    let (out, inp) = dense_shape(step).expect("a dense layer");
    let (w, bias) = step.weight_and_bias();
    let (dacts, grads) = (Raw::of(b.dacts), Raw::of(b.grads));
    let (dzt, xm) = operands(Dir::WeightGrad, plan, step, f, Some(b));
    match route {
        Route::Fused(kernel) => {
            let epilogue = DenseEpilogue::WeightGrad { dw: grads.at_mut(w), db: grads.at_mut(bias), cleared };
            // B is X: read early where the caller says no kernel it waits for writes it
            gpu.dense_on(stream, kernel, out, inp, f.batch, dzt, xm, epilogue, x_early)
        }
        Route::Split => gpu.weight_grad_split(stream, f.batch, &[job(on, b, step)]),
        Route::Cublas | Route::Lt(_) => {
            gpu.bias_grad(stream, out, 1, f.batch, dacts.at(on.region(step.z_region)), grads.at_mut(bias), None)?;
            let dw = || DevMatMut { data: grads.at_mut(w.clone()), rs: inp, cs: 1 };
            let ran = match route {
                Route::Lt(lt) => blas.lt_matmul(lt, out, inp, f.batch, dzt, xm, dw(), None)?,
                _ => false,
            };
            if !ran {
                blas.sgemm(out, inp, f.batch, 1.0, dzt, xm, 0.0, dw())?;
            }
            Ok(())
        }
    }
}

/// Whether step `index`'s X (its weight gradient's B) was written by the forward pass, before
/// the kernels its weight gradient waits for, so that a fused route may read it before waiting
/// (`b_early`). Not the last step's after a deep head: its X is the layer before's y, which the
/// head writes. That weight gradient runs on the side stream after an event recorded behind the
/// head, and that wait does not keep a dependent launch from reading before the head is done (in
/// a captured graph the head is the kernel node it depends on, and a dependent launch's edge from
/// it is then programmatic): read early, X could be the values left from before the step (at the
/// first step of a bucket, the measuring's, from the previous batch's inputs, which the step's
/// graph copies in after it). Reading it early there, the 33-40-7 model's gradients at 700
/// samples (deep head) were 5e-2 off the CPU's, and two models trained alike differed.
fn x_from_forward(head: Option<&Head>, index: usize) -> bool {
    !head.is_some_and(|h| h.inner().is_some() && h.step == index)
}

/// A dense step's weight gradient as [`Gpu::weight_grad_split`] takes it.
fn job<'a>(on: &On<'a>, b: &Backward<'a>, s: &Step) -> Job<'a> {
    let (out, inp) = dense_shape(s).expect("a dense layer");
    let (w, bias) = s.weight_and_bias();
    let (acts, dacts, grads) = (Raw::of(on.f.acts), Raw::of(b.dacts), Raw::of(b.grads));
    let (x, z) = (on.region(s.input_region), on.region(s.z_region));
    Job { out, inp, dz: dacts.at(z), x: acts.at(x), dw: grads.at_mut(w), db: grads.at_mut(bias) }
}

/// The route the pass's cache measured for `dir` of step `index` at this batch size; cuBLAS
/// where none was (a pass whose routes were not prepared).
fn route_of(f: &Forward, index: usize, dir: Dir) -> Route {
    f.routes.and_then(|r| r.route(index, dir)).unwrap_or(Route::Cublas)
}

/// A dense step's forward (`out_features` and `activation` are the step's layer's).
pub(crate) fn dense_forward(pass: &GpuForward, step: &Step, out_features: usize, activation: Activation, mode: Mode) -> Result<()> {
    debug_assert_eq!((dense_shape(step).map(|s| s.0), step.layer.activation()), (Some(out_features), activation));
    let GpuForward { gpu, blas, stream, plan, f, index, weights_early, .. } = *pass;
    forward_on(&On { gpu, blas, stream, plan, f }, step, route_of(f, index, Dir::Forward), weights_early, mode)
}

/// A dense step's backward: its dz (unless written), dW = dZᵀ · X and db = Σ_batch dZ (on the
/// side stream but the first layer's), and dX = dZ · W where needed (see [`input_grad_on`]).
pub(crate) fn dense_backward(pass: &mut GpuBackward, step: &Step, activation: Activation) -> Result<()> {
    activation_backward(pass, step, activation)?;
    let GpuBackward { gpu, blas, stream, plan, f, b, side, head, index, need_dx, .. } = *pass;
    let (out, inp) = dense_shape(step).expect("a dense layer");
    let route = route_of(f, index, Dir::WeightGrad);
    // the first layer's (no input gradient follows it) stays on the step's stream: nothing is
    // left to overlap it with there (nor is one that went with the head's forked again)
    let done = pass.split_done & bit(index) != 0;
    let (w_stream, w_blas) = if step.input_region != 0 && !done {
        side.fork.record(stream)?;
        side.fork.wait_in(side.stream)?;
        pass.forked = true;
        (side.stream, side.blas)
    } else {
        (stream, blas)
    };
    let w_on = On { gpu, blas: w_blas, stream: w_stream, plan, f };
    // The dz of the head's layer before (or of its producer) is written too: where both its
    // weight gradient and this one's are split over the batch on the side stream, they go in
    // one launch.
    let pair = head
        .and_then(|(h, ..)| h.inner().or(h.producer))
        .filter(|&p| head.is_some_and(|(h, ..)| h.step == index) && step.input_region != 0 && plan.steps[p].input_region != 0)
        .filter(|&p| bit(p) != 0 && route == Route::Split && route_of(f, p, Dir::WeightGrad) == Route::Split)
        .filter(|&p| dense_shape(&plan.steps[p]).is_some_and(|ps| gpu.split_launch_fits(&[(out, inp), ps])));
    if done {
        // launched with the head's
    } else if let Some(p) = pair {
        pass.split_done |= bit(p);
        gpu.weight_grad_split(w_stream, f.batch, &[job(&w_on, b, step), job(&w_on, b, &plan.steps[p])])?;
    } else {
        // a route that adds into dW and db finds them cleared where the head cleared them
        let cleared = pass.cleared.as_ref().is_some_and(|c| c.start <= step.params.start && step.params.end <= c.end);
        weight_grad_on(&w_on, b, step, route, cleared, x_from_forward(head.map(|(h, ..)| h), index))?;
    }
    if need_dx {
        let on = On { gpu, blas, stream, plan, f };
        if let Some(p) = input_grad_on(&on, b, step, route_of(f, index, Dir::InputGrad))? {
            pass.dz_ready |= bit(p);
        }
    }
    Ok(())
}

/// The gradients (a range of them) that cover every dense step's whose weight gradient runs on
/// a route that adds into them ([`Route::adds`]), or None if no step's does. The head clears
/// them before `exec::backward` runs (every gradient in the range is written again after it).
pub(crate) fn split_weight_grads(plan: &Plan, f: &Forward) -> Option<Range<usize>> {
    let adds = |(index, step): &(usize, &Step)| dense_shape(step).is_some() && route_of(f, *index, Dir::WeightGrad).adds();
    let ranges = plan.steps.iter().enumerate().filter(adds).map(|(_, s)| s.params.clone());
    ranges.reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
}
