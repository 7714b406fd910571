//! What a cache keeps for the fast CPU passes beyond the flat buffers: the forward's scratch
//! and each step's packed weights and routes ([`Workspace`]), and the backward's
//! ([`GradWorkspace`]).

#![deny(clippy::undocumented_unsafe_blocks)]

use super::{conv, conv_fast, dense, recurrent, Layer, Mode};
use crate::chain::{batch_len, Plan, Step};
use crate::cpu::gemm::GemmWorkspace;
use crate::cpu::pool::Pool;
use crate::cpu::SharedMut;
use crate::error::{zeros, Error, Result};

/// Scratch a forward pass needs beyond the activations, allocated once per cache, and what each
/// step's fast path keeps between calls: its weights packed from the parameters of one
/// version (see `Model::version`).
///
/// A convolution's products read its weights packed (`cpu::conv`): they are repacked by the
/// first pass after the parameters change. A dense layer's product packs them as it goes on the
/// first pass of a version (a training step runs one: packing once more would not be repaid)
/// and from the second pass on reads them packed once, with the same bits (inference runs on
/// packed weights from its second call).
pub(crate) struct Workspace {
    pub gemm: GemmWorkspace,
    /// Lowered columns for `lowering::forward`, a sample of `col_len` a thread: for the dilated
    /// convolutions, which `cpu::conv` does not run (none: empty).
    pub cols: Vec<f32>,
    pub col_len: usize,
    /// Per step of the plan, in its order.
    pub steps: Vec<StepCache>,
    /// The parameter version the convolutions' packed weights come from; that of the pass
    /// before this one; that of this pass (0: none).
    conv_version: u64,
    last_version: u64,
    version: u64,
    /// The recurrent layers' weights as their fast passes read them (`recurrent::workspace_len`).
    pub rnn: Vec<f32>,
    /// The parameter version the recurrent layers' packed weights come from (0: none).
    rnn_version: u64,
    /// Samples an inference pass runs through every step at a time ([`Workspace::block`]).
    block: usize,
}

/// What a step's fast CPU path keeps in a cache.
// one a step, made once: the variants' sizes do not matter
#[allow(clippy::large_enum_variant)]
pub(crate) enum StepCache {
    None,
    Dense(dense::DenseCache),
    Conv(conv_fast::ConvCache),
}

impl Workspace {
    /// For batches of up to `capacity` samples on `threads` threads: packed weights' room, the
    /// convolutions' scratch and their forward routes (timed here where this process has not
    /// timed them yet: see `cpu::conv::choice`); an error, not an abort, when they cannot be had.
    pub fn new(plan: &Plan, capacity: usize, threads: usize) -> Result<Workspace> {
        let col_len = conv::max_col_len(plan);
        let cols = zeros(batch_len(threads, col_len, "convolution columns")?, || format!("the convolution columns of {threads} threads"))?;
        let rnn = zeros(recurrent::workspace_len(plan), || "the recurrent layers' weights".into())?;
        let gemm = GemmWorkspace::new(threads)?;
        let isa = gemm.isa();
        let mut steps = per_step(plan)?;
        for (index, step) in plan.steps.iter().enumerate() {
            steps.push(match step.layer {
                Layer::Dense(d) => StepCache::Dense(dense::DenseCache::new(isa, step.input.len(), d.out_features)?),
                _ if conv::is_conv(&step.layer) && conv::packed(&conv::geometry(step)) => {
                    StepCache::Conv(conv_fast::ConvCache::new(plan, index, isa, threads, capacity)?)
                }
                _ => StepCache::None,
            });
        }
        let block = inference_block(plan, threads);
        Ok(Workspace { gemm, cols, col_len, rnn, rnn_version: 0, steps, conv_version: 0, last_version: 0, version: 0, block })
    }

    /// No scratch: for a cache whose steps run on a GPU.
    pub fn none() -> Workspace {
        let (cols, steps) = (Vec::new(), Vec::new());
        let (conv_version, last_version, version, block) = (0, 0, 0, usize::MAX);
        Workspace {
            gemm: GemmWorkspace::none(),
            cols,
            col_len: 0,
            rnn: Vec::new(),
            rnn_version: 0,
            steps,
            conv_version,
            last_version,
            version,
            block,
        }
    }

    /// Samples an inference pass runs through every step at a time (`layers::forward`): as
    /// many as keep what one step reads and writes of them within [`BLOCK_BYTES`] a thread,
    /// at least 2; no limit where a step keeps values between calls (a recurrent layer's state)
    /// or on a GPU.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Whether an inference pass runs step `index` in the epilogue of a convolution before it
    /// (`conv_fast::Fused`, at most two steps back), and so not on its own.
    pub fn taken_in(&self, index: usize) -> bool {
        let before = self.steps.get(index.saturating_sub(2)..index).unwrap_or_default();
        before.iter().any(|cache| matches!(cache, StepCache::Conv(conv) if conv.fused.takes(index)))
    }

    /// Readies a pass in `mode` on the parameters `params` of `version`: the convolutions' and
    /// the recurrent layers' weights packed unless they come from `version` (for the Winograd
    /// route, on an inference pass that runs it), and on a second pass of a version the dense
    /// layers' weights. The
    /// steps share the pool's threads. Allocates nothing; nothing is handed to the pool when nothing
    /// needs packing.
    pub(super) fn prepare(&mut self, plan: &Plan, params: &[f32], version: u64, pool: &Pool, mode: Mode) {
        let convs = self.conv_version != version;
        let dense = self.last_version == version;
        let winograd = |c: &conv_fast::ConvCache| mode == Mode::Infer && c.winograd_stale(version);
        let stale = |cache: &StepCache| match cache {
            StepCache::None => false,
            StepCache::Dense(d) => dense && d.stale(version),
            StepCache::Conv(c) => convs || winograd(c),
        };
        if self.steps.iter().any(stale) {
            let steps = SharedMut::new(&mut self.steps);
            pool.run(plan.steps.len(), &|index, _| {
                // SAFETY: each task is one step's entry.
                let cache = unsafe { &mut steps.slice(index..index + 1)[0] };
                if !stale(cache) {
                    return;
                }
                let w = &params[plan.steps[index].weight_and_bias().0];
                match cache {
                    StepCache::None => {}
                    StepCache::Dense(d) => d.pack(w, version),
                    StepCache::Conv(c) => {
                        if convs {
                            c.pack(w);
                        }
                        if winograd(c) {
                            c.pack_winograd(w, version);
                        }
                    }
                }
            });
        }
        if self.rnn_version != version {
            recurrent::pack_all(plan, params, &mut self.rnn);
            self.rnn_version = version;
        }
        (self.conv_version, self.last_version, self.version) = (version, version, version);
    }

    /// The recurrent layers' workspace set to NaN, their packed weights marked stale: a test
    /// that passes write what they read of it.
    #[cfg(test)]
    pub fn poison_rnn(&mut self) {
        self.rnn.fill(f32::NAN);
        self.rnn_version = 0;
    }

    /// Every packed weight set to NaN, the version kept: a test that passes read what was
    /// packed last.
    #[cfg(test)]
    pub fn poison_packed(&mut self) {
        for cache in &mut self.steps {
            match cache {
                StepCache::None => {}
                StepCache::Dense(cache) => cache.poison(),
                StepCache::Conv(conv) => conv.weights.poison(),
            }
        }
    }

    /// Step `index`'s dense cache, the GEMM's buffers, and the version of the pass.
    pub fn dense(&mut self, index: usize) -> (&mut GemmWorkspace, &dense::DenseCache, u64) {
        match &self.steps[index] {
            StepCache::Dense(cache) => (&mut self.gemm, cache, self.version),
            _ => unreachable!("step {index} is no dense layer"),
        }
    }

    /// Step `index`'s convolution cache, and the GEMM's buffers.
    pub fn conv(&mut self, index: usize) -> (&mut GemmWorkspace, &mut conv_fast::ConvCache) {
        match &mut self.steps[index] {
            StepCache::Conv(conv) => (&mut self.gemm, conv),
            _ => unreachable!("step {index} is no convolution"),
        }
    }

    /// Which kernel runs each step with weights, one line each (see `Cache::routes`).
    pub fn report(&self, plan: &Plan, capacity: usize) -> String {
        let threads = self.gemm.threads();
        let mut out = format!(
            "CPU, {} kernels, {threads} thread{}, batches up to {capacity}; convolution routes timed on one thread at batch 1 and {}",
            self.gemm.isa().name(),
            if threads == 1 { "" } else { "s" },
            crate::cpu::conv::choice::MANY_BATCH
        );
        for (index, (step, cache)) in plan.steps.iter().zip(&self.steps).enumerate() {
            match cache {
                StepCache::None if conv::is_conv(&step.layer) => {
                    out.push_str(&format!("\nstep {index} {}: lowered, dilated (not on cpu::conv)", step.layer.summary(step.input)))
                }
                StepCache::None => continue,
                StepCache::Dense(d) => out.push_str(&format!("\nstep {index} {}: {}", step.layer.summary(step.input), d.report())),
                StepCache::Conv(conv) => {
                    out.push_str(&format!("\nstep {index} {}: {}", step.layer.summary(step.input), conv.report(step, capacity)))
                }
            }
        }
        out
    }
}

/// What a block of an inference pass may read and write in one step, a thread: half of a
/// 1 MiB L2 (Zen 4; 2 MiB on recent Xeon cores), the rest left to the weights and the
/// convolutions' scratch. A blocking size, as the GEMM's KC, MC and NC are: on the zoo's
/// 64-sample inference (one thread), blocks of 2 samples of resnet_small (192 KB of activations
/// a step) and of 4 of vgg_small (128 KB) ran faster than the whole batch at once, and blocks of
/// 8 or more left the dense models about even.
const BLOCK_BYTES: usize = 512 * 1024;

/// [`Workspace::block`] for `plan` on `threads` threads.
fn inference_block(plan: &Plan, threads: usize) -> usize {
    if plan.steps.iter().any(|s| !s.kept.is_empty()) {
        return usize::MAX;
    }
    // values a step reads and writes per sample: its input, its output, a residual block's input
    let per_sample = plan.steps.iter().filter(|s| !s.layer.is_view()).map(|s| {
        let skip = s.skip.filter(|_| matches!(s.layer, Layer::Add(_))).map_or(0, |r| plan.regions[r]);
        plan.regions[s.input_region] + plan.regions[s.output_region] + skip
    });
    let bytes = per_sample.max().unwrap_or(0).saturating_mul(size_of::<f32>()).max(1);
    (BLOCK_BYTES / bytes).max(2).saturating_mul(threads.max(1))
}

/// Room for one value per step of `plan`.
fn per_step<T>(plan: &Plan) -> Result<Vec<T>> {
    let mut steps = Vec::new();
    let bytes = plan.steps.len().saturating_mul(size_of::<T>());
    steps.try_reserve_exact(plan.steps.len()).map_err(|_| Error::OutOfMemory { what: "the steps' caches".into(), bytes })?;
    Ok(steps)
}

/// Scratch a backward pass needs beyond the gradients, and what each step's fast path keeps
/// in gradient buffers (a convolution's backward scratch, partial weight gradients and routes).
pub(crate) struct GradWorkspace {
    /// The lowered gradient's columns and partial weight gradients of `lowering::backward`: for the
    /// dilated convolutions, as [`Workspace::cols`].
    pub dcols: Vec<f32>,
    pub partials: Vec<f32>,
    /// Per step of the plan, in its order: a convolution's, else None.
    pub steps: Vec<Option<conv_fast::ConvGrads>>,
}

impl GradWorkspace {
    /// As [`Workspace::new`], for the backward pass: a lowered gradient's columns a thread, the
    /// partial conv weight gradients of the sample blocks after the first
    /// ([`super::lowering::wgrad_blocks`], fixed by the capacity, not the thread count), and each
    /// convolution's backward scratch and routes.
    pub fn new(plan: &Plan, capacity: usize, threads: usize) -> Result<GradWorkspace> {
        let w_len = conv::lowered_steps(plan).map(Step::weight_len).max().unwrap_or(0);
        let dcols = batch_len(threads, conv::max_col_len(plan), "convolution gradient columns")?;
        let partials = batch_len(super::lowering::wgrad_blocks(capacity) - 1, w_len, "partial weight gradients")?;
        let isa = crate::cpu::isa::Isa::best();
        let mut steps = per_step(plan)?;
        for step in &plan.steps {
            steps.push(match step.layer {
                _ if conv::is_conv(&step.layer) && conv::packed(&conv::geometry(step)) => {
                    Some(conv_fast::ConvGrads::new(step, isa, threads, capacity)?)
                }
                _ => None,
            });
        }
        Ok(GradWorkspace {
            dcols: zeros(dcols, || format!("the convolution gradient columns of {threads} threads"))?,
            partials: zeros(partials, || "the partial conv weight gradients".into())?,
            steps,
        })
    }

    /// No scratch: for gradients computed on a GPU.
    pub fn none() -> GradWorkspace {
        GradWorkspace { dcols: Vec::new(), partials: Vec::new(), steps: Vec::new() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::Activation::{Identity, Relu, Tanh};
    use crate::chain::{Chain, Shape};
    use crate::layers::{forward, region, Buffers, Draw};
    use crate::testutil::{poisoned, Rng};

    /// An inference pass run in blocks (of 2 and of 3 samples, a last block of one joined to
    /// the one before) gives every sample's outputs the bits of a pass over the whole batch at
    /// once, and writes nothing of the output past the batch, on 1 and 2 threads, through
    /// convolutions with the steps they take in, a residual block, pooling, flatten, dense
    /// layers, layer norm, dropout and softmax. A plan with a recurrent layer is never blocked;
    /// resnet_small's blocks are 2 samples a thread, vgg_small's 4.
    #[test]
    fn inference_in_blocks_gives_the_whole_batchs_bits() {
        let same = crate::ConvOptions { stride: (1, 1), padding: (1, 1) };
        let chain = Chain::new(Shape::image(3, 9, 9))
            .conv_with(4, (3, 3), Identity, same)
            .batch_norm_with(Relu)
            .residual_with(Relu, |c| c.conv_with(4, (3, 3), Identity, same).batch_norm())
            .max_pool((2, 2))
            .flatten()
            .dense(16, Tanh)
            .layer_norm()
            .dropout(0.3)
            .dense(5, Identity)
            .softmax();
        let plan = chain.build().unwrap().plan.clone();
        let mut rng = Rng::new(80);
        let params = rng.uniform(plan.param_len);
        let mut buffers = vec![0.0; plan.buffer_len];
        crate::init::fill_buffers(&plan, &mut buffers);
        let (capacity, draw) = (9, Draw { seed: 0, pass: 0, replica: 0 });
        let out = plan.steps.last().unwrap().output_region;
        for threads in [1, 2] {
            let pool = Pool::new(threads).unwrap();
            for batch in [4, 7, 9] {
                let x = rng.uniform(batch * plan.input.len());
                let run = |block: usize| {
                    let mut ws = Workspace::new(&plan, capacity, threads).unwrap();
                    ws.block = block;
                    let mut acts = poisoned(plan.acts_len(capacity).unwrap());
                    acts[..x.len()].copy_from_slice(&x);
                    let version = crate::model::new_version();
                    forward(
                        &plan,
                        (&params, version),
                        &mut acts,
                        capacity,
                        batch,
                        &pool,
                        &mut ws,
                        Buffers::Read(&buffers),
                        draw,
                        Mode::Infer,
                    );
                    acts[region(&plan, out, capacity, capacity)].iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
                };
                let whole = run(usize::MAX);
                let written = batch * plan.regions[out];
                assert!(
                    whole[..written].iter().all(|&v| !f32::from_bits(v).is_nan())
                        && whole[written..].iter().all(|&v| f32::from_bits(v).is_nan())
                );
                for block in [2, 3] {
                    assert!(run(block) == whole, "{threads} threads, {batch} samples in blocks of {block}");
                }
            }
        }
        let recurrent = Chain::new(Shape::sequence(4, 3)).gru(5, crate::RnnOutput::LastStep).dense(2, Identity).build().unwrap();
        assert_eq!(Workspace::new(&recurrent.plan, 64, 1).unwrap().block(), usize::MAX);
        let block = |chain: Chain, threads| Workspace::new(&chain.build().unwrap().plan, 64, threads).unwrap().block();
        assert_eq!((block(crate::models::resnet_small(), 1), block(crate::models::vgg_small(), 1)), (2, 4));
        assert_eq!(block(crate::models::resnet_small(), 2), 4);
    }
}
