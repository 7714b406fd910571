//! Gradients of every layer, activation and loss against central finite differences in f64 on
//! the plain-loop twin; then the fast f32 engine against that twin, buffers poisoned first.

use super::{spec, Draw, Mode};
use crate::chain::{Chain, ConvOptions, Plan, Shape};
use crate::init::Rng;
use crate::loss::Loss;
use crate::testutil::assert_close;
use crate::{Activation, Gelu, Identity, LeakyRelu, Model, RnnOutput, Sigmoid, Tanh};

fn models() -> Vec<(&'static str, Chain)> {
    let strided = ConvOptions { stride: (2, 1), padding: (1, 1) };
    vec![
        (
            "every activation",
            // a dense layer of each but the identity (a parameter 0.1 where it takes one), then
            // an identity layer
            Activation::ALL
                .iter()
                .filter(|&&act| act != Identity)
                .fold(Chain::new(Shape::vector(5)), |chain, act| chain.dense(4, act.with_param(0.1)))
                .dense(3, Identity),
        ),
        (
            "conv stride/padding, overlapping pool",
            Chain::new(Shape::image(2, 7, 6))
                .conv_with(3, (3, 3), Tanh, strided)
                .max_pool_with((2, 2), (1, 1))
                .conv(2, (2, 2), Gelu)
                .flatten()
                .dense(3, Sigmoid),
        ),
        (
            // batch norm over channels and over features, with and without an activation,
            // dropout, a residual block with an activation after it, convolutions, batch norm
            // and dropout in its body
            "batch norm, dropout, residual",
            Chain::new(Shape::image(2, 5, 4))
                .conv_with(3, (3, 3), Identity, ConvOptions { stride: (1, 1), padding: (1, 1) })
                .batch_norm_with(Tanh)
                .residual_with(Tanh, |c| {
                    c.conv_with(3, (3, 3), Gelu, ConvOptions { stride: (1, 1), padding: (1, 1) }).batch_norm().dropout(0.3)
                })
                .flatten()
                .dense(6, Sigmoid)
                .batch_norm_with(Gelu)
                .dense(5, Tanh)
                .batch_norm()
                .dropout(0.25)
                .dense(3, Identity),
        ),
        (
            // layer norm over a sequence's steps and over a vector, nested blocks, a block with
            // an empty body (y = 2x) and one whose body starts from an activated layer
            "layer norm, nested residuals",
            Chain::new(Shape::sequence(3, 4))
                .layer_norm()
                .residual(|c| c.dropout(0.5).residual(|c| c.layer_norm()))
                .flatten()
                .dense(5, Tanh)
                .residual_with(Tanh, |c| c.dense(5, Gelu).layer_norm().dense(5, Identity))
                .residual(|c| c)
                .dense(3, Identity),
        ),
        (
            "lenet-like",
            Chain::new(Shape::image(1, 8, 8))
                .conv_with(2, (3, 3), LeakyRelu(0.2), ConvOptions { stride: (1, 1), padding: (1, 1) })
                .max_pool((2, 2))
                .conv(3, (3, 3), Identity)
                .flatten()
                .dense(4, Tanh)
                .dense(3, Identity),
        ),
        (
            // a GRU's input gradient (an LSTM's output), every step's output and the last's;
            // 17 units: a padded block, and two vectors of units on an AVX2 machine
            "gru sequence, lstm last step",
            Chain::new(Shape::sequence(4, 3)).gru(5, RnnOutput::Sequence).lstm(17, RnnOutput::LastStep).dense(3, Identity),
        ),
        (
            "lstm sequence, gru sequence, flatten",
            Chain::new(Shape::sequence(3, 2)).lstm(4, RnnOutput::Sequence).gru(18, RnnOutput::Sequence).flatten().dense(3, Sigmoid),
        ),
    ]
}

/// Loss of the spec forward in f64: the value, the activations and their gradients (the loss's
/// in the last output region, the rest zero).
fn spec_loss(
    plan: &Plan,
    params: &[f64],
    x: &[f64],
    batch: usize,
    loss: Loss,
    labels: &[u32],
    targets: &[f64],
) -> (f64, Vec<f64>, Vec<f64>) {
    let mut acts = vec![0.0; plan.acts_len(batch).unwrap()];
    acts[..x.len()].copy_from_slice(x);
    spec::forward(plan, params, &mut acts, batch, batch, &mut start_buffers(plan), DRAW, Mode::Train);
    let last = plan.steps.last().unwrap().output_region;
    let out = super::region(plan, last, batch, batch);
    let mut dacts = vec![0.0; acts.len()];
    let value = loss.compute(&acts[out.clone()], labels, targets, plan.output().len(), &mut dacts[out]);
    (value, acts, dacts)
}

/// Targets for `loss` on `batch` samples of `outputs`: probabilities in (0, 1) for binary
/// cross-entropy, else normal draws.
fn targets_for(rng: &mut Rng, loss: Loss, batch: usize, outputs: usize) -> Vec<f64> {
    (0..batch * outputs).map(|_| if loss == Loss::BceWithLogits { rng.uniform() } else { rng.normal() }).collect()
}

/// Every parameter's gradient of `chain`'s plain loops (a batch of 3, parameters and inputs
/// drawn from `seed`) against central finite differences of its loss in f64, for each of
/// `losses`.
pub(super) fn gradients_match_finite_differences(name: &str, chain: Chain, losses: &[Loss], seed: u64) {
    let mut rng = Rng::new(seed);
    let model = chain.build().unwrap();
    let plan = &*model.plan;
    let batch = 3;
    let params: Vec<f64> = (0..plan.param_len).map(|_| rng.uniform() - 0.5).collect();
    let x: Vec<f64> = (0..batch * plan.input.len()).map(|_| 2.0 * rng.uniform() - 1.0).collect();
    let outputs = plan.output().len();
    let labels: Vec<u32> = (0..batch).map(|_| rng.below(outputs) as u32).collect();
    for &loss in losses {
        let targets = targets_for(&mut rng, loss, batch, outputs);
        let (_, acts, mut dacts) = spec_loss(plan, &params, &x, batch, loss, &labels, &targets);
        let mut grads = vec![f64::NAN; plan.param_len];
        spec::backward(plan, &params, &acts, &mut dacts, &mut grads, batch, batch, DRAW);
        for i in 0..plan.param_len {
            let h = 1e-6;
            let (mut plus, mut minus) = (params.clone(), params.clone());
            plus[i] += h;
            minus[i] -= h;
            let numeric = (spec_loss(plan, &plus, &x, batch, loss, &labels, &targets).0
                - spec_loss(plan, &minus, &x, batch, loss, &labels, &targets).0)
                / (2.0 * h);
            let tol = 1e-7 + 1e-4 * numeric.abs();
            assert!((numeric - grads[i]).abs() <= tol, "{name}, {loss:?}: d/dparam[{i}] numeric {numeric} vs backprop {}", grads[i]);
        }
    }
}

#[test]
fn backward_matches_finite_differences() {
    for (name, chain) in models() {
        gradients_match_finite_differences(name, chain, &[Loss::LogitCrossEntropy, Loss::Mse], 5);
    }
}

/// The fast engine against the plain loops in f64 on `model`, with parameters, inputs and
/// labels drawn from `seed`: a cross-entropy training step (MSE where the model's output is not
/// a vector of at least two scores) on a batch of 3 in buffers for 5, every buffer poisoned with NaN first. The
/// outputs, the loss, the parameters' gradients and every activation gradient of the batch agree
/// (a NaN only where the spec has one, as in the gradient of a region nothing reads), and nothing
/// past the batch is written.
pub(super) fn fast_matches_spec(model: &Model, seed: u64, name: &str) {
    let mut rng = Rng::new(seed);
    let mut model = model.clone();
    // the spec's masks: seed and pass as DRAW
    (model.seed, model.passes) = (DRAW.seed, std::sync::atomic::AtomicU64::new(DRAW.pass));
    let plan = model.plan.clone();
    model.parameters_mut().unwrap().iter_mut().for_each(|p| *p = (rng.uniform() - 0.5) as f32);
    let (capacity, batch) = (5, 3);
    let mut cache = model.preallocate(capacity).unwrap();
    let mut grads = model.preallocate_grads(capacity).unwrap();
    cache.acts.fill(f32::NAN);
    grads.dacts.fill(f32::NAN);
    grads.grads.fill(f32::NAN);
    cache.ws.cols.fill(f32::NAN);
    cache.ws.poison_rnn();
    // the recurrent layers' initial states are inputs, zero as in the spec's buffers
    cache.reset_states().unwrap();
    grads.gws.dcols.fill(f32::NAN);
    grads.gws.partials.fill(f32::NAN);
    for step in &mut cache.ws.steps {
        if let super::StepCache::Conv(conv) = step {
            conv.ws.poison();
        }
    }
    grads.gws.steps.iter_mut().flatten().for_each(|conv| conv.ws.poison());
    let x: Vec<f32> = (0..batch * plan.input.len()).map(|_| (2.0 * rng.uniform() - 1.0) as f32).collect();
    let outputs = plan.output().len();
    let loss = if matches!(plan.output(), Shape::Vector(n) if n >= 2) { Loss::LogitCrossEntropy } else { Loss::Mse };
    let labels: Vec<u32> = (0..batch).map(|_| rng.below(outputs) as u32).collect();
    let targets: Vec<f32> = targets_for(&mut rng, loss, batch, outputs).iter().map(|&t| t as f32).collect();
    cache.set_inputs(&x).unwrap();
    cache.set_labels(&labels).unwrap();
    cache.set_targets(&targets).unwrap();
    model.backprop(&mut grads, &mut cache, loss).unwrap();
    let value = grads.last_loss().unwrap();

    let params64: Vec<f64> = model.params.iter().map(|&p| p as f64).collect();
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let targets64: Vec<f64> = targets.iter().map(|&t| t as f64).collect();
    let (want, acts, mut dacts) = spec_loss(&plan, &params64, &x64, batch, loss, &labels, &targets64);
    // the spec's gradients poisoned too, but the loss's
    let out = super::region(&plan, plan.steps.last().unwrap().output_region, batch, batch);
    let loss_grad = dacts[out.clone()].to_vec();
    dacts.fill(f64::NAN);
    dacts[out].copy_from_slice(&loss_grad);
    let mut want_grads = vec![f64::NAN; plan.param_len];
    spec::backward(&plan, &params64, &acts, &mut dacts, &mut want_grads, batch, batch, DRAW);
    let threads = model.threads();
    assert!((value as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "{name}: loss {value} vs {want}");
    let f32s = |v: &[f64]| v.iter().map(|&g| g as f32).collect::<Vec<f32>>();
    let last = plan.steps.last().unwrap().output_region;
    let want_out = f32s(&acts[super::region(&plan, last, batch, batch)]);
    assert_close(cache.outputs(), &want_out, 1e-5, 1e-4, &format!("{name}, {threads} threads: outputs"));
    assert_close(&grads.grads, &f32s(&want_grads), 1e-5, 1e-4, &format!("{name}, {threads} threads: gradients"));
    // the recurrent layers' initial states, which reset_states zeroed for the whole capacity
    let states: Vec<usize> =
        plan.steps.iter().filter(|s| super::recurrent::dims(s).is_some()).map(|s| s.kept.start + super::recurrent::STATE).collect();
    for r in 1..plan.regions.len() {
        let (got, want) = (super::region(&plan, r, capacity, batch), super::region(&plan, r, batch, batch));
        let (got, want) = (&grads.dacts[got], f32s(&dacts[want]));
        let (got, want): (Vec<f32>, Vec<f32>) = got.iter().zip(&want).filter(|(_, w)| !w.is_nan()).map(|(&g, &w)| (g, w)).unzip();
        assert_close(&got, &want, 1e-5, 1e-4, &format!("{name}, {threads} threads: gradient of region {r}"));
        // nothing past the batch was written
        let tail = super::region(&plan, r, capacity, capacity);
        let tail = tail.start + batch * plan.regions[r]..tail.end;
        let untouched = |v: &f32| if states.contains(&r) { *v == 0.0 } else { v.is_nan() };
        let acts_kept = cache.acts[tail.clone()].iter().all(untouched);
        assert!(acts_kept && grads.dacts[tail].iter().all(|v| v.is_nan()), "{name}: region {r} written past the batch");
    }
}

#[test]
fn fast_engine_matches_spec_in_smaller_batches_with_poisoned_buffers() {
    for (i, (name, chain)) in models().into_iter().enumerate() {
        for threads in [1, 2, 3] {
            let model = chain.clone().build().unwrap().with_threads(threads).unwrap();
            fast_matches_spec(&model, 9 + i as u64, name);
        }
    }
}

/// The draw of every training pass the checks run (a fixed mask for each dropout step).
const DRAW: Draw = Draw { seed: 0x5eed_0000_0001, pass: 7, replica: 0 };

/// The plan's buffers at their starting values, in F (the spec's training passes write them).
fn start_buffers<F: crate::float::Float>(plan: &Plan) -> Vec<F> {
    let mut buffers = vec![0.0f32; plan.buffer_len];
    crate::init::fill_buffers(plan, &mut buffers);
    buffers.iter().map(|&v| F::of(f64::from(v))).collect()
}

/// |a − b| ≤ atol + rtol·|b| everywhere, or both NaN (a value neither pass wrote).
fn same_or_both_unwritten(a: &[f32], b: &[f32], (atol, rtol): (f32, f32), what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let bad: Vec<String> = (0..a.len())
        .filter(|&i| {
            !(a[i].is_nan() && b[i].is_nan()) && (a[i] - b[i]).abs().partial_cmp(&(atol + rtol * b[i].abs())).is_none_or(|o| o.is_gt())
        })
        .take(5)
        .map(|i| format!("[{i}] {} vs {}", a[i], b[i]))
        .collect();
    assert!(bad.is_empty(), "{what}: {}", bad.join(", "));
}

/// The fast CPU path against the plain loop, both in f32, on `chain`, whose first step must
/// copy its input (`dropout(0.0)`, which keeps every value), so that every step after it
/// computes its input gradient: a training pass over `batch` samples in buffers for
/// `capacity`, then a backward pass from a random output gradient, then an inference pass by
/// the running statistics the training pass left; every buffer poisoned with NaN first, and
/// every value (activations, kept and saved values, gradients, running statistics) compared
/// within `tol` = (atol, rtol), (0, 0) being the same bits, values neither pass wrote (past
/// the batch) left NaN by both; on 1, 2 and 3 threads.
pub(super) fn fast_matches_spec_f32(chain: Chain, capacity: usize, batch: usize, tol: (f32, f32)) {
    use super::{Buffers, GradWorkspace, Workspace};
    use crate::cpu::pool::Pool;
    let plan = chain.build().unwrap().plan.clone();
    assert!(matches!(plan.steps[0].layer, super::Layer::Dropout(super::dropout::Dropout { p: 0.0 })), "starts with dropout(0.0)");
    let mut rng = crate::testutil::Rng::new(17);
    let params = rng.uniform(plan.param_len);
    let x = rng.uniform(batch * plan.input.len());
    let last = plan.steps.last().unwrap().output_region;
    let dy = rng.uniform(batch * plan.regions[last]);
    let what = |threads: usize, part: &str| format!("{:?} ({threads} threads, {batch} of {capacity}): {part}", plan.steps[1].layer);
    // the plain loop, once
    let len = plan.acts_len(capacity).unwrap();
    let (mut acts, mut dacts, mut grads) = (vec![f32::NAN; len], vec![f32::NAN; len], vec![f32::NAN; plan.param_len]);
    acts[..x.len()].copy_from_slice(&x);
    let mut buffers = start_buffers::<f32>(&plan);
    spec::forward(&plan, &params, &mut acts, capacity, batch, &mut buffers, DRAW, Mode::Train);
    let out = super::region(&plan, last, capacity, batch);
    dacts[out.clone()].copy_from_slice(&dy);
    spec::backward(&plan, &params, &acts, &mut dacts, &mut grads, capacity, batch, DRAW);
    let mut infer = vec![f32::NAN; len];
    infer[..x.len()].copy_from_slice(&x);
    spec::forward(&plan, &params, &mut infer, capacity, batch, &mut buffers.clone(), DRAW, Mode::Infer);
    assert!(grads.iter().all(|g| !g.is_nan()), "every parameter gradient written");
    for threads in [1, 2, 3] {
        let pool = Pool::new(threads).unwrap();
        let (mut ws, mut gws) = (Workspace::new(&plan, capacity, threads).unwrap(), GradWorkspace::new(&plan, capacity, threads).unwrap());
        let version = crate::model::new_version();
        let (mut fast, mut dfast, mut gfast) = (vec![f32::NAN; len], vec![f32::NAN; len], vec![f32::NAN; plan.param_len]);
        fast[..x.len()].copy_from_slice(&x);
        let mut fast_buffers = start_buffers::<f32>(&plan);
        super::forward(
            &plan,
            (&params, version),
            &mut fast,
            capacity,
            batch,
            &pool,
            &mut ws,
            Buffers::Write(&mut fast_buffers),
            DRAW,
            Mode::Train,
        );
        same_or_both_unwritten(&fast, &acts, tol, &what(threads, "training pass"));
        same_or_both_unwritten(&fast_buffers, &buffers, tol, &what(threads, "running statistics"));
        dfast[out.clone()].copy_from_slice(&dy);
        super::backward(&plan, &params, &fast, &mut dfast, &mut gfast, capacity, batch, &pool, &mut ws, &mut gws, DRAW);
        same_or_both_unwritten(&dfast, &dacts, tol, &what(threads, "activation gradients"));
        same_or_both_unwritten(&gfast, &grads, tol, &what(threads, "parameter gradients"));
        let mut fast_infer = vec![f32::NAN; len];
        fast_infer[..x.len()].copy_from_slice(&x);
        super::forward(
            &plan,
            (&params, version),
            &mut fast_infer,
            capacity,
            batch,
            &pool,
            &mut ws,
            Buffers::Read(&fast_buffers),
            DRAW,
            Mode::Infer,
        );
        same_or_both_unwritten(&fast_infer[..out.end], &infer[..out.end], tol, &what(threads, "inference"));
    }
}
