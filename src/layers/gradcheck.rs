//! Gradients of every layer, activation and loss against central finite differences in f64 on
//! the plain-loop twin; then the fast f32 engine against that twin, buffers poisoned first.

use super::{spec, Mode};
use crate::chain::{Chain, ConvOptions, Plan, Shape};
use crate::init::Rng;
use crate::loss::{self, Loss};
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

/// Loss of the spec forward in f64.
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
    spec::forward(plan, params, &mut acts, batch, batch, Mode::Train);
    let last = plan.steps.last().unwrap().output_region;
    let out = super::region(plan, last, batch, batch);
    let mut dacts = vec![0.0; acts.len()];
    let value = match loss {
        Loss::LogitCrossEntropy => loss::logit_cross_entropy(&acts[out.clone()], labels, plan.output().len(), &mut dacts[out]),
        Loss::Mse => loss::mse(&acts[out.clone()], targets, &mut dacts[out]),
    };
    (value, acts, dacts)
}

#[test]
fn backward_matches_finite_differences() {
    let mut rng = Rng::new(5);
    for (name, chain) in models() {
        let model = chain.build().unwrap();
        let plan = &*model.plan;
        let batch = 3;
        let params: Vec<f64> = (0..plan.param_len).map(|_| rng.uniform() - 0.5).collect();
        let x: Vec<f64> = (0..batch * plan.input.len()).map(|_| 2.0 * rng.uniform() - 1.0).collect();
        let classes = plan.output().len();
        let labels: Vec<u32> = (0..batch).map(|_| rng.below(classes) as u32).collect();
        let targets: Vec<f64> = (0..batch * classes).map(|_| rng.normal()).collect();
        for loss in [Loss::LogitCrossEntropy, Loss::Mse] {
            let (_, acts, mut dacts) = spec_loss(plan, &params, &x, batch, loss, &labels, &targets);
            let mut grads = vec![f64::NAN; plan.param_len];
            spec::backward(plan, &params, &acts, &mut dacts, &mut grads, batch, batch);
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
}

#[test]
fn fast_engine_matches_spec_in_smaller_batches_with_poisoned_buffers() {
    let mut rng = Rng::new(9);
    for (name, chain) in models() {
        for threads in [1, 2, 3] {
            let model = chain.clone().build().unwrap().with_threads(threads).unwrap();
            let mut model: Model = model;
            let plan = model.plan.clone();
            model.params.iter_mut().for_each(|p| *p = (rng.uniform() - 0.5) as f32);
            let (capacity, batch) = (5, 3);
            let mut cache = model.preallocate(capacity).unwrap();
            let mut grads = model.preallocate_grads(capacity).unwrap();
            cache.acts.fill(f32::NAN);
            grads.dacts.fill(f32::NAN);
            grads.grads.fill(f32::NAN);
            cache.ws.cols.fill(f32::NAN);
            cache.ws.rnn.fill(f32::NAN);
            // the recurrent layers' initial states are inputs, zero as in the spec's buffers
            cache.reset_states().unwrap();
            grads.gws.dcols.fill(f32::NAN);
            grads.gws.partials.fill(f32::NAN);
            let x: Vec<f32> = (0..batch * plan.input.len()).map(|_| (2.0 * rng.uniform() - 1.0) as f32).collect();
            let classes = plan.output().len();
            let labels: Vec<u32> = (0..batch).map(|_| rng.below(classes) as u32).collect();
            cache.set_inputs(&x).unwrap();
            cache.set_labels(&labels).unwrap();
            model.backprop(&mut grads, &mut cache, Loss::LogitCrossEntropy).unwrap();
            let value = grads.last_loss().unwrap();

            let params64: Vec<f64> = model.params.iter().map(|&p| p as f64).collect();
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let (want, acts, mut dacts) = spec_loss(&plan, &params64, &x64, batch, Loss::LogitCrossEntropy, &labels, &[]);
            let mut want_grads = vec![0.0; plan.param_len];
            spec::backward(&plan, &params64, &acts, &mut dacts, &mut want_grads, batch, batch);
            assert!((value as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "{name}: loss {value} vs {want}");
            let want_out: Vec<f32> = {
                let last = plan.steps.last().unwrap().output_region;
                acts[super::region(&plan, last, batch, batch)].iter().map(|&v| v as f32).collect()
            };
            assert_close(cache.outputs(), &want_out, 1e-5, 1e-4, &format!("{name}, {threads} threads: outputs"));
            let want_grads: Vec<f32> = want_grads.iter().map(|&g| g as f32).collect();
            assert_close(&grads.grads, &want_grads, 1e-5, 1e-4, &format!("{name}, {threads} threads: gradients"));
            // nothing past the batch was written
            let last = plan.steps.last().unwrap().output_region;
            let tail = super::region(&plan, last, capacity, capacity);
            assert!(cache.acts[tail.start + batch * classes..tail.end].iter().all(|v| v.is_nan()), "{name}: wrote past the batch");
        }
    }
}
