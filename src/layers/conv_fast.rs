//! The convolutions' fast CPU path (2-D and 1-D): each step's weights packed once per parameter
//! version in the cache ([`ConvCache`]), and per direction and batch bucket the `cpu::conv`
//! route that was faster on the layer's shape when this process first timed them
//! (`cpu::conv::choice`); a dilated convolution, which `cpu::conv` does not compute, through
//! `layers/lowering.rs` instead ([`packed`]).
//!
//! `cpu::conv` runs the bias and the activation as the epilogue of each block of output rows
//! (`cpu::conv::Epilogue`), while the block is in cache. In inference it runs more there
//! ([`Fused`]): a batch norm right after the convolution, as a scale and shift per channel
//! (`batch_norm::inference_affine`), and a residual block's sum right after that, with the
//! block's activation; those steps then do not run, and only the last one's output is written
//! (no step reads the others'). Training runs every step: a batch norm needs the batch's
//! statistics of the convolution's output. Which steps a convolution takes in, and the tests of
//! that inference against the steps one by one: `conv_fast/fused.rs`.

#![deny(clippy::undocumented_unsafe_blocks)]

mod fused;

pub(crate) use fused::Fused;

use super::conv::{geometry, packed, Geometry};
use super::lowering::{backward, forward, Scratch};
use super::{batch_norm, split2, BackPass, Mode, Pass};
use crate::activation::Activation;
use crate::chain::{Plan, Step};
use crate::cpu::conv::choice::{self, Bucket, Choice, Direction};
use crate::cpu::conv::split::Splits;
use crate::cpu::conv::{ConvRoute, ConvShape, ConvWeights, ConvWorkspace, Epilogue};
use crate::cpu::isa::Isa;
use crate::cpu::SharedMut;
use crate::error::zeros;

/// A convolution step's fast forward (2-D or 1-D, as `g` says): Z = conv(X, W) + b and
/// Y = act(Z); in inference Y alone, or the output of the steps it takes in ([`Fused`]). On
/// `cpu::conv` with the step's packed weights and forward route, or for a dilated convolution
/// through the lowering ([`packed`]).
pub(crate) fn step_forward(g: &Geometry, activation: Activation, step: &Step, pass: &mut Pass, mode: Mode) {
    let (w, b) = step.weight_and_bias();
    if !packed(g) {
        let (x, z) = (pass.region(step.input_region), pass.region(step.z_region));
        let (xs, zs) = split2(pass.acts, x, z);
        let ws = &mut *pass.ws;
        let scratch = Scratch { col_len: ws.col_len, cols: SharedMut::new(&mut ws.cols) };
        forward(pass.pool, &mut ws.gemm, &scratch, g, pass.batch, &pass.params[w], xs, zs);
        return pass.bias_act(step, activation, b, (g.out_channels, g.ohw()));
    }
    let Pass { plan, index, params, acts, capacity, batch, block, pool, ws, buffers, .. } = pass;
    let region = |r: usize| super::block_region(plan, r, *capacity, *batch, *block);
    let x = region(step.input_region);
    let (gemm, cache) = ws.conv(*index);
    let routes = if mode == Mode::Train { cache.routes } else { cache.infer_routes };
    let route = routes[Bucket::of(*batch) as usize];
    let bias = &params[b];
    if mode == Mode::Train {
        // z ← conv + b, kept for the backward pass; y ← act(z) where the step has a y
        let (z, y) = (region(step.z_region), region(step.output_region));
        let (before, own) = acts.split_at_mut(z.start);
        let (zs, ys) = own[..y.end - z.start].split_at_mut(z.len());
        let ys = (z != y).then(move || &mut ys[y.start - z.end..]);
        let epilogue = Epilogue { scale: None, shift: Some(bias), skip: None, act: activation };
        let (weights, cws, shape, xs, mut ys) = (&cache.weights, &mut cache.ws, conv_shape(step), &before[x], ys);
        return cache.splits[0].run(&shape, *batch, pool.threads(), |parts| {
            crate::cpu::conv::forward(route, pool, gemm, cws, weights, (*batch, parts), xs, &epilogue, zs, ys.as_deref_mut())
        });
    }
    // inference: the output of the last step taken in, alone, the activation in place
    let fused = cache.fused;
    let last = &plan.steps[fused.last(*index)];
    let out = region(last.output_region);
    let skip = fused.add.map(|add| region(plan.steps[add].skip.expect("an Add has its block input")));
    let (before, own) = acts.split_at_mut(out.start);
    let (scale, shift) = match fused.batch_norm {
        Some(bn) => {
            let (scale, shift) = cache.folded.split_at_mut(g.out_channels);
            batch_norm::inference_affine(&plan.steps[bn], params, buffers.get(), bias, scale, shift);
            (Some(&*scale), &*shift)
        }
        None => (None, bias),
    };
    let (before, skip) = (&*before, skip.map(|r| &before[r]));
    let epilogue = Epilogue { scale, shift: Some(shift), skip, act: last.layer.activation() };
    let (weights, cws, shape, xs, out) = (&cache.weights, &mut cache.ws, conv_shape(step), &before[x], &mut own[..out.len()]);
    cache.splits[1].run(&shape, *batch, pool.threads(), |parts| {
        crate::cpu::conv::forward(route, pool, gemm, cws, weights, (*batch, parts), xs, &epilogue, out, None)
    });
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

/// The routes of each batch bucket a cache for `capacity` samples runs in `direction`, chosen
/// by timing (`choice`): the fastest of those `allowed`; a bucket it never runs takes batch 1's.
fn routes(
    isa: Isa,
    shape: &ConvShape,
    direction: Direction,
    capacity: usize,
    allowed: fn(ConvRoute) -> bool,
) -> crate::error::Result<[ConvRoute; 2]> {
    let mut routes = [ConvRoute::Lowered; 2];
    for &bucket in Bucket::up_to(capacity) {
        routes[bucket as usize] = choice::choose(isa, shape, direction, bucket)?.fastest(allowed);
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

/// What a convolution keeps in a cache: its weights packed for every route and direction (the
/// Winograd route's packed by the first inference pass of a version that runs it, with that
/// version), its forward scratch, the forward route of each batch bucket ([`Bucket`] as index)
/// in training and in inference, the steps its inference takes in, and room for a batch norm's
/// scale and shift (2·OC values, the scale first) where it takes one in.
pub(crate) struct ConvCache {
    pub weights: ConvWeights,
    pub ws: ConvWorkspace,
    pub routes: [ConvRoute; 2],
    pub infer_routes: [ConvRoute; 2],
    /// The parts of each sample's rows, per batch size below the thread count, in training and
    /// in inference.
    pub splits: [Splits; 2],
    pub fused: Fused,
    folded: Vec<f32>,
    winograd_version: u64,
}

impl ConvCache {
    /// For step `index` of `plan` (a convolution) on `threads` threads, batches of up to
    /// `capacity` samples.
    pub fn new(plan: &Plan, index: usize, isa: Isa, threads: usize, capacity: usize) -> crate::error::Result<ConvCache> {
        let step = &plan.steps[index];
        let shape = conv_shape(step);
        let fused = Fused::of(plan, index);
        let folded = if fused.batch_norm.is_some() { 2 * shape.out_channels } else { 0 };
        Ok(ConvCache {
            weights: ConvWeights::new(isa, &shape)?,
            ws: ConvWorkspace::new(isa, &shape, threads, 0)?,
            routes: routes(isa, &shape, Direction::Forward, capacity, ConvRoute::trains)?,
            infer_routes: routes(isa, &shape, Direction::Forward, capacity, |_| true)?,
            splits: [Splits::new(capacity, threads)?, Splits::new(capacity, threads)?],
            fused,
            folded: zeros(folded, || "a batch norm's scale and shift".into())?,
            winograd_version: 0,
        })
    }

    /// Packs `w` (OC, C, kh, kw) in: after every change of the parameters.
    pub fn pack(&mut self, w: &[f32]) {
        self.weights.pack(w);
    }

    /// Whether an inference pass on parameters of `version` must first pack the weights for the
    /// Winograd route: where a bucket runs it, and they come from another version.
    pub fn winograd_stale(&self, version: u64) -> bool {
        self.infer_routes.contains(&ConvRoute::Winograd) && self.winograd_version != version
    }

    /// Packs `w` of `version` in for the Winograd route.
    pub fn pack_winograd(&mut self, w: &[f32], version: u64) {
        self.weights.pack_winograd(w);
        self.winograd_version = version;
    }

    /// Each direction's route per batch bucket, with the times that chose it; the backward's
    /// where gradient buffers have been made for this shape. Then a line for each pass and
    /// batch whose split of a sample's rows was timed (batches below the thread count, at
    /// their first call): the parts kept and their fastest call, and the other's.
    pub fn report(&self, step: &Step, capacity: usize) -> String {
        let (shape, isa) = (conv_shape(step), self.weights.isa());
        let mut parts = Vec::new();
        for &bucket in Bucket::up_to(capacity) {
            // the route taken (training's, forward) with its time, then the others'
            let one = |direction: Direction, route: ConvRoute, name: &str| match choice::chosen(isa, &shape, direction, bucket) {
                Some(Choice { times, .. }) => {
                    let us = |r: ConvRoute| times[r as usize].map(|t| format!("{} {:.1} µs", r.name(), t.as_secs_f64() * 1e6));
                    let others: Vec<String> = ConvRoute::ALL.into_iter().filter(|&r| r != route).filter_map(us).collect();
                    format!("{name} {} ({})", us(route).unwrap_or_default(), others.join(", "))
                }
                None => format!("{name} not timed"),
            };
            let b = bucket as usize;
            let fwd = one(Direction::Forward, self.routes[b], "forward");
            let bwd = match choice::chosen(isa, &shape, backward_direction(step), bucket) {
                Some(c) => one(backward_direction(step), c.route, "backward"),
                None => "backward not timed".into(),
            };
            let infer =
                if self.infer_routes[b] == self.routes[b] { String::new() } else { format!(", inference {}", self.infer_routes[b].name()) };
            parts.push(format!("batch {}: {fwd}{infer}, {bwd}", bucket.label()));
        }
        if let Some(taken) = self.fused.describe() {
            parts.push(format!("inference: {taken} in its epilogue"));
        }
        let mut report = parts.join("; ");
        for (pass, splits) in ["training", "inference"].into_iter().zip(&self.splits) {
            for (batch, split) in splits.timed() {
                report.push_str(&format!("\n  batch {batch} {pass}, a sample's rows in {}", split.describe()));
            }
        }
        report
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
            routes: routes(isa, &shape, backward_direction(step), capacity, |_| true)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{Chain, Shape};
    use crate::layers::conv::{backward_spec, forward_spec};
    use crate::layers::{backward as run_backward, forward as run_forward, region, Buffers, Draw, GradWorkspace, StepCache, Workspace};
    use crate::layers::{Layer, Mode};
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

    /// Two convolutions (strided and padded, then plain and 3 wide; identity activations) run
    /// through the engine with each route forced in both directions where it computes them (the
    /// direct route elsewhere: the Winograd route runs the second forward alone, in inference),
    /// with small integers (exact sums) and poisoned buffers: outputs of a training pass and of
    /// an inference pass after it, weight and bias gradients and the second layer's input
    /// gradient equal the plain loops', and nothing past the batch is written.
    #[test]
    fn every_route_through_the_layer_matches_the_spec() {
        let strided = crate::ConvOptions { stride: (2, 1), padding: (1, 1) };
        let chain =
            Chain::new(Shape::image(3, 9, 8)).conv_with(4, (3, 3), Activation::Identity, strided).conv(5, (2, 3), Activation::Identity);
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
                let or_direct = |step: &Step, direction| if route.serves(&conv_shape(step), direction) { route } else { ConvRoute::Direct };
                for (step, cache) in plan.steps.iter().zip(&mut ws.steps) {
                    if let StepCache::Conv(conv) = cache {
                        let forward = or_direct(step, Direction::Forward);
                        conv.infer_routes = [forward; 2];
                        conv.routes = [if forward.trains() { forward } else { ConvRoute::Direct }; 2];
                        conv.ws.poison();
                    }
                }
                for (step, conv) in plan.steps.iter().zip(&mut gws.steps) {
                    if let Some(conv) = conv {
                        conv.routes = [or_direct(step, backward_direction(step)); 2];
                        conv.ws.poison();
                    }
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

                    let mut infer = poisoned(acts.len());
                    infer[region(&plan, 0, capacity, batch)].copy_from_slice(&x);
                    let buffers = Buffers::Read(&[]);
                    run_forward(
                        &plan,
                        (&model.params, model.version),
                        &mut infer,
                        capacity,
                        batch,
                        pool,
                        &mut ws,
                        buffers,
                        draw,
                        Mode::Infer,
                    );
                    assert_eq!(infer[region(&plan, r2, capacity, batch)], z2, "{route:?}: inference, batch {batch}");
                }
            }
        }
    }

    /// A model of `chain` with parameters and running statistics drawn from `seed` (variances
    /// in [0.5, 1.5)), as a batch norm has them after training.
    pub(super) fn drawn(chain: Chain, seed: u64, threads: usize) -> crate::Model {
        let mut model = chain.build().unwrap().with_threads(threads).unwrap();
        let mut rng = Rng::new(seed);
        let params = rng.uniform(model.plan.param_len);
        model.set_parameters(&params).unwrap();
        let mut buffers = rng.uniform(model.plan.buffer_len);
        for step in model.plan.steps.iter().filter(|s| matches!(s.layer, Layer::BatchNorm(_))) {
            buffers[step.buffers[1].range.clone()].iter_mut().for_each(|v| *v = 1.0 + *v / 2.0);
            buffers[step.buffers[2].range.clone()].fill(0.0);
        }
        model.set_buffers(&buffers).unwrap();
        model
    }

    /// The Winograd route's weights, forced into inference, are packed by the first inference
    /// pass of each version and by no training pass: outputs equal the plain loops' before and
    /// after training steps and a write through `parameters_mut`; poisoned, the packed weights
    /// show in the outputs until the parameters change.
    #[test]
    fn winograd_weights_follow_the_parameter_version() {
        let chain = Chain::new(Shape::image(2, 6, 7)).conv(3, (2, 3), Activation::Tanh).flatten().dense(3, Activation::Identity);
        let mut model = drawn(chain, 70, 1);
        let plan = model.plan.clone();
        let batch = 2;
        let x = Rng::new(71).uniform(batch * plan.input.len());
        let mut cache = model.preallocate(batch).unwrap();
        cache.set_inputs(&x).unwrap();
        cache.set_labels(&[0, 2]).unwrap();
        let StepCache::Conv(conv) = &mut cache.ws.steps[0] else { panic!("a convolution") };
        conv.infer_routes = [ConvRoute::Winograd; 2];
        let check = |model: &crate::Model, cache: &mut crate::Cache, what: &str| {
            let got = model.forward(cache).unwrap().to_vec();
            let mut spec = vec![0.0; plan.acts_len(batch).unwrap()];
            spec[..x.len()].copy_from_slice(&x);
            crate::layers::spec::forward(&plan, &model.params, &mut spec, batch, batch, &mut Vec::new(), DRAW, Mode::Infer);
            let out = region(&plan, plan.steps.last().unwrap().output_region, batch, batch);
            crate::testutil::assert_close(&got, &spec[out], 1e-5, 1e-5, what);
        };
        check(&model, &mut cache, "first pass");
        let mut grads = model.preallocate_grads(batch).unwrap();
        let mut opt = crate::Optimizer::new(&model, crate::Optim::sgd(0.1, 0.0)).unwrap();
        opt.train_step(&mut model, &mut grads, &mut cache, crate::Loss::LogitCrossEntropy).unwrap();
        check(&model, &mut cache, "after a training step");
        cache.ws.poison_packed();
        assert!(model.forward(&mut cache).unwrap().iter().all(|v| v.is_nan()), "repacked with nothing changed");
        model.parameters_mut().unwrap()[0] += 0.25;
        check(&model, &mut cache, "after parameters_mut");
    }

    /// Inference on 1, 2 and 3 threads gives the same bits at batches below the thread count,
    /// whichever parts of a sample's rows the first call timed faster (each call after it runs
    /// the choice), the batch norm and residual sums in the epilogue included.
    #[test]
    fn inference_gives_the_same_bits_whatever_the_split() {
        for chain in [crate::models::resnet_small, crate::models::vgg_small] {
            for batch in [1, 2] {
                let x = Rng::new(72).uniform(batch * 3 * 32 * 32);
                let mut first: Option<Vec<u32>> = None;
                for threads in 1..=3 {
                    let model = chain().build().unwrap().init(crate::Init::HeNormal, 5).with_threads(threads).unwrap();
                    let mut cache = model.preallocate(batch).unwrap();
                    cache.set_inputs(&x).unwrap();
                    for call in 0..2 {
                        let got: Vec<u32> = model.forward(&mut cache).unwrap().iter().map(|v| v.to_bits()).collect();
                        let want = first.get_or_insert_with(|| got.clone());
                        assert!(
                            *want == got,
                            "batch {batch}, {threads} threads, call {call}: bits differ from 1 thread's\n{}",
                            cache.routes()
                        );
                    }
                }
            }
        }
    }

    /// On 2 threads, each convolution reports the split of a sample's rows at batch 1 that its
    /// first call timed (inference's in `preallocate`, training's at the first training pass),
    /// on a line of its own below its step's; on 1 thread nothing splits, and no such line.
    #[test]
    fn the_routes_report_shows_each_split_timed() {
        let count = |report: &str, pass: &str| {
            let line = format!("  batch 1 {pass}, a sample's rows in ");
            report.lines().filter(|l| l.starts_with(&line) && l.contains(" part") && l.contains(" µs")).count()
        };
        for threads in [1, 2] {
            let model = crate::models::lenet5().build().unwrap().init(crate::Init::HeNormal, 1).with_threads(threads).unwrap();
            let (mut cache, mut grads) = (model.preallocate(4).unwrap(), model.preallocate_grads(4).unwrap());
            let (convs, report) = (2 * (threads - 1), cache.routes());
            assert_eq!((count(&report, "inference"), count(&report, "training")), (convs, 0), "{report}");
            cache.set_inputs(&Rng::new(3).uniform(model.input_shape().len())).unwrap();
            cache.set_labels(&[1]).unwrap();
            model.backprop(&mut grads, &mut cache, crate::Loss::LogitCrossEntropy).unwrap();
            let report = cache.routes();
            assert_eq!((count(&report, "inference"), count(&report, "training")), (convs, convs), "{report}");
        }
    }

    pub(super) const DRAW: Draw = Draw { seed: 0, pass: 0, replica: 0 };
}
