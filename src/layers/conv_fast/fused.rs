//! Which steps after a convolution its inference pass runs in the convolution's epilogue
//! ([`Fused`], read by `conv_fast.rs`'s forward pass and by the GPU's, `cuda/conv.rs`), and the
//! tests of that inference against the steps one by one.

use crate::chain::Plan;
use crate::layers::Layer;

/// The steps after a convolution that an inference pass runs in the convolution's epilogue: a
/// batch norm right after it, and a residual block's Add right after that (or after the
/// convolution). A step is taken in where the one before it has no activation of its own and
/// its output is read by that step alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fused {
    pub batch_norm: Option<usize>,
    pub add: Option<usize>,
}

impl Fused {
    /// What step `index` of `plan` takes in: nothing unless it is a convolution (2-D or 1-D).
    pub fn of(plan: &Plan, index: usize) -> Fused {
        if !crate::layers::conv::is_conv(&plan.steps[index].layer) {
            return Fused::default();
        }
        // step `next` is of the kind `is`, reads step `from`'s output, which nothing else reads
        // and which is `from`'s z (no activation)
        let takes = |from: usize, is: fn(&Layer) -> bool| {
            let (a, next) = (&plan.steps[from], from + 1);
            let reads = plan.steps.get(next).is_some_and(|b| is(&b.layer) && b.input_region == a.output_region);
            (reads && a.z_region == a.output_region && plan.consumers[a.output_region] == 1).then_some(next)
        };
        let batch_norm = takes(index, |l| matches!(l, Layer::BatchNorm(_)));
        let add = takes(batch_norm.unwrap_or(index), |l| matches!(l, Layer::Add(_)));
        Fused { batch_norm, add }
    }

    /// The last step it runs: the convolution's `index`, or one it takes in.
    pub fn last(&self, index: usize) -> usize {
        self.add.or(self.batch_norm).unwrap_or(index)
    }

    /// Whether it takes in step `index`.
    pub fn takes(&self, index: usize) -> bool {
        self.batch_norm == Some(index) || self.add == Some(index)
    }

    /// Whether it takes in no step.
    #[cfg(any(test, feature = "cuda"))]
    pub fn is_empty(&self) -> bool {
        *self == Fused::default()
    }

    /// What it takes in of a pass that runs steps `0..upto` alone: the steps before `upto` (a
    /// batch norm's Add is after it, so never an Add without its batch norm).
    #[cfg(any(test, feature = "cuda"))]
    pub fn before(self, upto: usize) -> Fused {
        Fused { batch_norm: self.batch_norm.filter(|&i| i < upto), add: self.add.filter(|&i| i < upto) }
    }

    /// The steps it takes in, for the routes reports ("the batch norm of step 1 and the residual
    /// sum of step 2"); None where it takes in none.
    pub fn describe(&self) -> Option<String> {
        let bn = self.batch_norm.map(|i| format!("the batch norm of step {i}"));
        let taken: Vec<String> = [bn, self.add.map(|i| format!("the residual sum of step {i}"))].into_iter().flatten().collect();
        (!taken.is_empty()).then(|| taken.join(" and "))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{drawn, DRAW};
    use super::*;
    use crate::activation::Activation;
    use crate::chain::{Chain, Shape};
    use crate::layers::{forward as run_forward, region, Buffers, Mode, StepCache, Workspace};
    use crate::testutil::{poisoned, Rng};

    /// Chains whose convolutions take in a batch norm (2-D and 1-D), a batch norm and a residual
    /// sum, or a residual sum alone, with ReLU, tanh or no activation after; and where they take
    /// nothing in: an activation of their own, an output a residual block also reads. With each,
    /// what its convolution steps take in.
    fn fusing_chains() -> Vec<(Chain, Vec<(usize, Fused)>)> {
        let same = crate::ConvOptions { stride: (1, 1), padding: (1, 1) };
        let padded = crate::Conv1dOptions { stride: 1, padding: 1, dilation: 1 };
        let fused = |batch_norm: Option<usize>, add: Option<usize>| Fused { batch_norm, add };
        let (identity, relu, tanh) = (Activation::Identity, Activation::Relu, Activation::Tanh);
        let images = Chain::new(Shape::image(3, 7, 9))
            .conv_with(5, (3, 3), identity, same)
            .batch_norm_with(relu)
            .residual_with(relu, |c| {
                c.conv_with(5, (3, 3), identity, same).batch_norm_with(tanh).conv_with(5, (3, 3), identity, same).batch_norm()
            })
            .residual_with(tanh, |c| c.conv_with(5, (3, 3), identity, same))
            .conv_with(4, (2, 2), relu, crate::ConvOptions::default())
            .batch_norm()
            .global_avg_pool()
            .dense(3, identity);
        let signals = Chain::new(Shape::signal(2, 40))
            .conv1d(6, 5, identity)
            .batch_norm_with(relu)
            .residual(|c| c.conv1d_with(6, 3, identity, padded).batch_norm())
            .flatten()
            .dense(3, identity);
        let shared = Chain::new(Shape::image(2, 6, 6))
            .conv_with(3, (3, 3), identity, same)
            .residual(|c| c.batch_norm())
            .flatten()
            .dense(2, identity);
        vec![
            (
                images,
                vec![
                    (0, fused(Some(1), None)),
                    (3, fused(Some(4), None)),
                    (5, fused(Some(6), Some(7))),
                    (9, fused(None, Some(10))),
                    (11, Fused::default()),
                ],
            ),
            (signals, vec![(0, fused(Some(1), None)), (3, fused(Some(4), Some(5)))]),
            (shared, vec![(0, Fused::default())]),
        ]
    }

    /// Only a convolution takes steps in: a dense layer before a batch norm, or before a residual
    /// block's sum, takes none. A pass that stops inside a group (steps `0..upto`) takes in the
    /// steps before its end alone. The reports name what is taken in.
    #[test]
    fn only_convolutions_take_steps_in_and_only_those_a_pass_runs() {
        let identity = Activation::Identity;
        let dense = Chain::new(Shape::vector(6)).dense(4, identity).batch_norm().residual(|c| c.dense(4, identity)).dense(2, identity);
        let plan = dense.build().unwrap().plan;
        assert!((0..plan.steps.len()).all(|i| Fused::of(&plan, i).is_empty()), "{:?}", plan.steps);
        let (images, want) = fusing_chains().swap_remove(0);
        let plan = images.build().unwrap().plan;
        let (both, bn) = (Fused::of(&plan, 5), Fused { batch_norm: Some(6), add: None });
        assert_eq!(both, want[2].1);
        assert_eq!(both.before(plan.steps.len()), both);
        assert_eq!((both.before(8), both.before(7), both.before(6)), (both, bn, Fused::default()));
        assert!(Fused::default().is_empty() && !bn.is_empty() && !both.is_empty());
        assert_eq!(both.describe().as_deref(), Some("the batch norm of step 6 and the residual sum of step 7"));
        assert_eq!(Fused::of(&plan, 9).describe().as_deref(), Some("the residual sum of step 10"));
        assert_eq!(bn.describe().as_deref(), Some("the batch norm of step 6"));
        assert_eq!(Fused::default().describe(), None);
    }

    /// Inference with the steps each convolution takes in, against the plain loops running every
    /// step (f32, the batch norm's own formula): the output of every step that runs, or of the
    /// last it takes in, within rounding, on 1 and 3 threads, a batch of 3 in buffers for 5,
    /// everything poisoned first; nothing past the batch written, nor the regions the taken-in
    /// steps would have written but their last. The steps taken in are the ones listed.
    #[test]
    fn inference_with_steps_taken_in_matches_the_steps_one_by_one() {
        let (capacity, batch) = (5, 3);
        for (seed, (chain, want)) in fusing_chains().into_iter().enumerate() {
            let model = drawn(chain, 40 + seed as u64, 1);
            let plan = model.plan.clone();
            let buffers = model.buffers().unwrap().to_vec();
            let x = Rng::new(50 + seed as u64).uniform(batch * plan.input.len());
            let len = plan.acts_len(capacity).unwrap();
            let mut spec = poisoned(len);
            spec[..x.len()].copy_from_slice(&x);
            crate::layers::spec::forward(&plan, &model.params, &mut spec, capacity, batch, &mut buffers.clone(), DRAW, Mode::Infer);
            for threads in [1, 3] {
                let pool = crate::cpu::pool::Pool::new(threads).unwrap();
                let mut ws = Workspace::new(&plan, capacity, threads).unwrap();
                let got: Vec<(usize, Fused)> = (ws.steps.iter().enumerate())
                    .filter_map(|(i, c)| if let StepCache::Conv(c) = c { Some((i, c.fused)) } else { None })
                    .collect();
                assert_eq!(got, want, "{:?}", plan.steps[0].layer);
                let mut fast = poisoned(len);
                fast[..x.len()].copy_from_slice(&x);
                run_forward(
                    &plan,
                    (&model.params, model.version),
                    &mut fast,
                    capacity,
                    batch,
                    &pool,
                    &mut ws,
                    Buffers::Read(&buffers),
                    DRAW,
                    Mode::Infer,
                );
                // a step in a group (a convolution and what it takes in) writes its output if it is the last
                let writes = |i: usize| want.iter().find(|(c, f)| *c == i || f.takes(i)).is_none_or(|(c, f)| f.last(*c) == i);
                for (index, step) in plan.steps.iter().enumerate().filter(|(_, s)| !s.layer.is_view()) {
                    let (r, what) = (step.output_region, format!("{threads} threads, step {index} {:?}", step.layer));
                    let (mine, all) = (region(&plan, r, capacity, batch), region(&plan, r, capacity, capacity));
                    if writes(index) {
                        crate::testutil::assert_close(&fast[mine.clone()], &spec[mine.clone()], 1e-5, 1e-5, &what);
                    } else {
                        assert!(fast[mine.clone()].iter().all(|v| v.is_nan()), "{what}: written, though in a group");
                    }
                    assert!(fast[mine.end..all.end].iter().all(|v| v.is_nan()), "{what}: written past the batch");
                }
            }
        }
    }

    /// The scale and shift a batch norm folds into are computed on every inference pass from
    /// the values of that moment: after training steps (which move the running statistics and
    /// the parameters) and after a write of the batch norm's parameters alone, a cache that
    /// served inference before gives the same bits as a new one, and those agree with the
    /// steps one by one.
    #[test]
    fn steps_taken_in_follow_their_parameters_and_running_statistics() {
        let (chain, _) = fusing_chains().swap_remove(0);
        let mut model = drawn(chain, 60, 2);
        let plan = model.plan.clone();
        let batch = 4;
        let x = Rng::new(61).uniform(batch * plan.input.len());
        let mut cache = model.preallocate(batch).unwrap();
        cache.set_inputs(&x).unwrap();
        let check = |model: &crate::Model, cache: &mut crate::Cache, what: &str| {
            let got = model.forward(cache).unwrap().to_vec();
            let mut fresh = model.preallocate(batch).unwrap();
            fresh.set_inputs(&x).unwrap();
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(model.forward(&mut fresh).unwrap()), "{what}: not a new cache's bits");
            let mut spec = vec![0.0; plan.acts_len(batch).unwrap()];
            spec[..x.len()].copy_from_slice(&x);
            let mut buffers = model.buffers().unwrap().to_vec();
            crate::layers::spec::forward(&plan, &model.params, &mut spec, batch, batch, &mut buffers, DRAW, Mode::Infer);
            let out = region(&plan, plan.steps.last().unwrap().output_region, batch, batch);
            crate::testutil::assert_close(&got, &spec[out], 1e-5, 1e-5, what);
            got
        };
        let before = check(&model, &mut cache, "before");
        let mut grads = model.preallocate_grads(batch).unwrap();
        let mut opt = crate::Optimizer::new(&model, crate::Optim::sgd(0.05, 0.0)).unwrap();
        cache.set_labels(&[0, 1, 2, 1]).unwrap();
        for _ in 0..3 {
            opt.train_step(&mut model, &mut grads, &mut cache, crate::Loss::LogitCrossEntropy).unwrap();
        }
        let trained = check(&model, &mut cache, "after training");
        assert_ne!(trained, before);
        let bn = plan.steps[1].tensors[0].range.clone();
        model.parameters_mut().unwrap()[bn].iter_mut().for_each(|g| *g *= -2.0);
        assert_ne!(check(&model, &mut cache, "after a write of a batch norm's γ"), trained);
    }
}
