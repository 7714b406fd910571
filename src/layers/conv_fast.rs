//! The convolutions' fast CPU path (2-D and 1-D): each step's weights packed once per parameter
//! version in the cache ([`ConvCache`]), and per direction and batch bucket the `cpu::conv`
//! route that was faster on the layer's shape when this process first timed them
//! (`cpu::conv::choice`); a dilated convolution, which `cpu::conv` does not compute, through
//! `layers/lowering.rs` instead ([`packed`]).

#![deny(clippy::undocumented_unsafe_blocks)]

use super::conv::{geometry, packed, Geometry};
use super::lowering::{backward, forward, Scratch};
use super::{split2, BackPass, Pass};
use crate::activation::Activation;
use crate::chain::Step;
use crate::cpu::conv::choice::{self, Bucket, Choice, Direction};
use crate::cpu::conv::{ConvRoute, ConvShape, ConvWeights, ConvWorkspace};
use crate::cpu::isa::Isa;
use crate::cpu::SharedMut;

/// A convolution step's fast forward (2-D or 1-D, as `g` says): Z = conv(X, W), then + b and
/// Y = act(Z). On `cpu::conv` with the step's packed weights and forward route, or for a dilated
/// convolution through the lowering ([`packed`]).
pub(crate) fn step_forward(g: &Geometry, activation: Activation, step: &Step, pass: &mut Pass) {
    let (x, z) = (pass.region(step.input_region), pass.region(step.z_region));
    let (w, b) = step.weight_and_bias();
    let (xs, zs) = split2(pass.acts, x, z);
    if packed(g) {
        let (gemm, cache) = pass.ws.conv(pass.index);
        let route = cache.routes[Bucket::of(pass.batch) as usize];
        crate::cpu::conv::forward(route, pass.pool, gemm, &mut cache.ws, &cache.weights, pass.batch, xs, zs);
    } else {
        let ws = &mut *pass.ws;
        let scratch = Scratch { col_len: ws.col_len, cols: SharedMut::new(&mut ws.cols) };
        forward(pass.pool, &mut ws.gemm, &scratch, g, pass.batch, &pass.params[w], xs, zs);
    }
    pass.bias_act(step, activation, b, (g.out_channels, g.ohw()));
}

/// A convolution step's fast backward: dZ, dW, db and (where needed) dX, on the same path as
/// [`step_forward`] with the step's backward route.
pub(crate) fn step_backward(geometry: &Geometry, activation: Activation, step: &Step, pass: &mut BackPass) {
    let index = pass.index;
    let g = pass.weighted(step, activation, (geometry.out_channels, geometry.ohw()));
    if packed(geometry) {
        let (gemm, cache) = g.ws.conv(index);
        let grads = g.gws.steps[index].as_mut().expect("a convolution's gradient cache");
        let route = grads.routes[Bucket::of(g.batch) as usize];
        crate::cpu::conv::backward(route, g.pool, gemm, &mut grads.ws, &cache.weights, g.batch, g.x, g.dz, g.dw, g.dx);
    } else {
        let scratch = Scratch { col_len: g.ws.col_len, cols: SharedMut::new(&mut g.ws.cols) };
        let dscratch = Scratch { col_len: g.ws.col_len, cols: SharedMut::new(&mut g.gws.dcols) };
        let partials = &mut g.gws.partials;
        backward(g.pool, &mut g.ws.gemm, &scratch, &dscratch, partials, geometry, g.batch, g.w, g.x, g.dz, g.dw, g.dx);
    }
}

/// The shape `cpu::conv` runs for a convolution step.
fn conv_shape(step: &Step) -> ConvShape {
    let g = geometry(step);
    ConvShape {
        in_channels: g.in_channels,
        height: g.height,
        width: g.width,
        out_channels: g.out_channels,
        kernel: g.kernel,
        stride: g.stride,
        padding: g.padding,
    }
}

/// The routes of each batch bucket a cache for `capacity` samples runs, chosen by timing
/// (`choice`); a bucket it never runs takes batch 1's.
fn routes(isa: Isa, shape: &ConvShape, direction: Direction, capacity: usize) -> crate::error::Result<[ConvRoute; 2]> {
    let mut routes = [ConvRoute::Lowered; 2];
    for &bucket in Bucket::up_to(capacity) {
        routes[bucket as usize] = choice::choose(isa, shape, direction, bucket)?.route;
    }
    if capacity <= 1 {
        routes[Bucket::Many as usize] = routes[Bucket::One as usize];
    }
    Ok(routes)
}

/// The direction of a step's backward pass: with the input gradient unless its input is the
/// model's (`BackPass::needs_dx`).
fn backward_direction(step: &Step) -> Direction {
    Direction::Backward { input_grad: step.input_region != 0 }
}

/// What a convolution keeps in a cache: its weights packed for every route and direction, its
/// forward scratch, and the forward route of each batch bucket ([`Bucket`] as index).
pub(crate) struct ConvCache {
    pub weights: ConvWeights,
    pub ws: ConvWorkspace,
    pub routes: [ConvRoute; 2],
}

impl ConvCache {
    /// For `step` (a convolution) on `threads` threads, batches of up to `capacity` samples.
    pub fn new(step: &Step, isa: Isa, threads: usize, capacity: usize) -> crate::error::Result<ConvCache> {
        let shape = conv_shape(step);
        Ok(ConvCache {
            weights: ConvWeights::new(isa, &shape)?,
            ws: ConvWorkspace::new(isa, &shape, threads, 0)?,
            routes: routes(isa, &shape, Direction::Forward, capacity)?,
        })
    }

    /// Packs `w` (OC, C, kh, kw) in: after every change of the parameters.
    pub fn pack(&mut self, w: &[f32]) {
        self.weights.pack(w);
    }

    /// Each direction's route per batch bucket, with the times that chose it; the backward's
    /// where gradient buffers have been made for this shape.
    pub fn report(&self, step: &Step, capacity: usize) -> String {
        let (shape, isa) = (conv_shape(step), self.weights.isa());
        let mut parts = Vec::new();
        for &bucket in Bucket::up_to(capacity) {
            let one = |direction: Direction, name: &str| match choice::chosen(isa, &shape, direction, bucket) {
                Some(Choice { route, times }) => {
                    let us = |r: ConvRoute| times[r as usize].as_secs_f64() * 1e6;
                    let other = ConvRoute::ALL[1 - route as usize];
                    format!("{name} {} {:.1} µs ({} {:.1} µs)", route.name(), us(route), other.name(), us(other))
                }
                None => format!("{name} not timed"),
            };
            let (fwd, bwd) = (one(Direction::Forward, "forward"), one(backward_direction(step), "backward"));
            parts.push(format!("batch {}: {fwd}, {bwd}", bucket.label()));
        }
        parts.join("; ")
    }
}

/// What a convolution keeps in gradient buffers: its backward scratch and partial weight
/// gradients, and the backward route of each batch bucket.
pub(crate) struct ConvGrads {
    pub ws: ConvWorkspace,
    pub routes: [ConvRoute; 2],
}

impl ConvGrads {
    /// For `step` (a convolution) on `threads` threads, batches of up to `capacity` samples.
    pub fn new(step: &Step, isa: Isa, threads: usize, capacity: usize) -> crate::error::Result<ConvGrads> {
        let shape = conv_shape(step);
        Ok(ConvGrads {
            ws: ConvWorkspace::new(isa, &shape, threads, capacity)?,
            routes: routes(isa, &shape, backward_direction(step), capacity)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{Chain, Shape};
    use crate::layers::conv::{backward_spec, forward_spec};
    use crate::layers::Mode;
    use crate::layers::{backward as run_backward, forward as run_forward, region, Buffers, Draw, GradWorkspace, StepCache, Workspace};
    use crate::testutil::{poisoned, Rng};

    /// A dilated 1-D convolution runs through the lowering (no packed weights nor routes:
    /// `cpu::conv` has no dilation), the undilated one after it on `cpu::conv`; lowered columns
    /// are allocated for the dilated one alone (none in a plan without one), and the routes report
    /// says which runs where. That both match the plain loops, poisoned scratch included, is
    /// `conv1d`'s `gradients_and_the_fast_path_match_the_spec`.
    #[test]
    fn dilated_convolutions_run_through_the_lowering() {
        let dilated = crate::Conv1dOptions { stride: 2, padding: 2, dilation: 3 };
        let chain = Chain::new(Shape::signal(2, 19)).conv1d_with(3, 3, Activation::Tanh, dilated).conv1d(4, 2, Activation::Identity);
        let (capacity, threads) = (4, 2);
        let model = chain.build().unwrap().with_threads(threads).unwrap();
        let (ws, gws) =
            (Workspace::new(&model.plan, capacity, threads).unwrap(), GradWorkspace::new(&model.plan, capacity, threads).unwrap());
        assert!(matches!(ws.steps[0], StepCache::None) && matches!(ws.steps[1], StepCache::Conv(_)));
        assert!(gws.steps[0].is_none() && gws.steps[1].is_some());
        let g = geometry(&model.plan.steps[0]);
        assert_eq!((ws.col_len, ws.cols.len(), gws.dcols.len()), (g.col_len(), threads * g.col_len(), threads * g.col_len()));
        let report = model.preallocate(capacity).unwrap().routes();
        let lines: Vec<&str> = report.lines().filter(|l| l.starts_with("step ")).collect();
        assert!(lines.len() == 2 && lines[0].ends_with("lowered, dilated (not on cpu::conv)"), "{report}");
        assert!(lines[1].contains("forward ") && lines[1].contains("backward "), "{report}");
        let plain = Chain::new(Shape::signal(2, 19)).conv1d(4, 2, Activation::Identity).build().unwrap();
        let (ws, gws) = (Workspace::new(&plain.plan, capacity, 1).unwrap(), GradWorkspace::new(&plain.plan, capacity, 1).unwrap());
        assert!(ws.cols.is_empty() && gws.dcols.is_empty() && gws.partials.is_empty());
    }

    /// Two convolutions (strided and padded, then plain; identity activations) run through the
    /// engine with each route forced in both directions, with small integers (exact sums) and
    /// poisoned buffers: outputs, weight and bias gradients and the second layer's input
    /// gradient equal the plain loops', and nothing past the batch is written.
    #[test]
    fn every_route_through_the_layer_matches_the_spec() {
        let strided = crate::ConvOptions { stride: (2, 1), padding: (1, 1) };
        let chain =
            Chain::new(Shape::image(3, 9, 8)).conv_with(4, (3, 3), Activation::Identity, strided).conv(5, (2, 2), Activation::Identity);
        let mut rng = Rng::new(21);
        let capacity = 5;
        for threads in [1, 3] {
            let mut model = chain.clone().build().unwrap().with_threads(threads).unwrap();
            let params = rng.ints(model.plan.param_len);
            model.set_parameters(&params).unwrap();
            let plan = model.plan.clone();
            let (g1, g2) = (geometry(&plan.steps[0]), geometry(&plan.steps[1]));
            let ((w1, b1), (w2, b2)) = (plan.steps[0].weight_and_bias(), plan.steps[1].weight_and_bias());
            for route in ConvRoute::ALL {
                let mut ws = Workspace::new(&plan, capacity, threads).unwrap();
                let mut gws = GradWorkspace::new(&plan, capacity, threads).unwrap();
                for step in &mut ws.steps {
                    if let StepCache::Conv(conv) = step {
                        conv.routes = [route; 2];
                        conv.ws.poison();
                    }
                }
                for conv in gws.steps.iter_mut().flatten() {
                    conv.routes = [route; 2];
                    conv.ws.poison();
                }
                for batch in [1, 3] {
                    let mut acts = poisoned(plan.acts_len(capacity).unwrap());
                    let x = rng.ints(batch * plan.input.len());
                    acts[region(&plan, 0, capacity, batch)].copy_from_slice(&x);
                    let pool = &model.pool;
                    // (convolutions keep no buffers and draw nothing)
                    let (buffers, draw) = (Buffers::Write(&mut Vec::new()), Draw { seed: 0, pass: 0, replica: 0 });
                    run_forward(
                        &plan,
                        (&model.params, model.version),
                        &mut acts,
                        capacity,
                        batch,
                        pool,
                        &mut ws,
                        buffers,
                        draw,
                        Mode::Train,
                    );
                    let (mut z1, mut z2) = (vec![0.0; batch * g1.out_len()], vec![0.0; batch * g2.out_len()]);
                    forward_spec(&g1, batch, &params[w1.clone()], &params[b1.clone()], &x, &mut z1);
                    forward_spec(&g2, batch, &params[w2.clone()], &params[b2.clone()], &z1, &mut z2);
                    let (r1, r2) = (plan.steps[0].output_region, plan.steps[1].output_region);
                    assert_eq!(acts[region(&plan, r1, capacity, batch)], z1, "{route:?}: layer 1, batch {batch}");
                    assert_eq!(acts[region(&plan, r2, capacity, batch)], z2, "{route:?}: layer 2, batch {batch}");
                    let past = region(&plan, r2, capacity, capacity);
                    assert!(acts[past.start + batch * g2.out_len()..past.end].iter().all(|v| v.is_nan()), "wrote past the batch");

                    let mut dacts = poisoned(acts.len());
                    let dz2 = rng.ints(batch * g2.out_len());
                    dacts[region(&plan, r2, capacity, batch)].copy_from_slice(&dz2);
                    let mut grads = poisoned(plan.param_len);
                    run_backward(&plan, &model.params, &acts, &mut dacts, &mut grads, capacity, batch, pool, &mut ws, &mut gws, draw);
                    let mut want = vec![0.0; plan.param_len];
                    let mut dz1 = vec![0.0; z1.len()];
                    let (first, second) = want.split_at_mut(w2.start);
                    let (dw2, db2) = second.split_at_mut(w2.len());
                    backward_spec(&g2, batch, &params[w2.clone()], &z1, &dz2, dw2, db2, Some(&mut dz1));
                    let (dw1, db1) = first.split_at_mut(w1.len());
                    backward_spec(&g1, batch, &params[w1.clone()], &x, &dz1, dw1, db1, None);
                    assert_eq!(dacts[region(&plan, r1, capacity, batch)], dz1, "{route:?}: input gradient, batch {batch}");
                    assert_eq!(grads, want, "{route:?}: parameter gradients, batch {batch}");
                }
            }
        }
    }
}
