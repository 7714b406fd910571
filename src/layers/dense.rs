//! Dense: z = W·x + b per sample, W (out_features, in_features) row-major, then b (out_features),
//! the layout of PyTorch's `nn.Linear`. The fast path here computes the matrix products, the
//! forward's with the weights packed once per parameter version in the cache ([`DenseCache`],
//! and `layers::Workspace` for when), and the bias and activation in the product's epilogue, on
//! each column of tiles of z while it is in L1 (`cpu::gemm::sgemm_bias_act`); an inference pass
//! keeps no z (the sums go to y and are activated there). A training pass of a few samples, or
//! of a layer of one output, takes the shared pass of `layers/mod.rs` after its product
//! instead. On the GPU the products, bias and activation run fused (`kernels/dense.cu`, launched
//! through `cuda::exec`).
//!
//! Batched, with X (batch, in) and Z (batch, out) row-major:
//!   forward  Z  = X·Wᵀ + b
//!   backward dW = dZᵀ·X (out, in),  db = Σ_batch dZ,  dX = dZ·W (batch, in)

use super::kind::{LayerKind, Mode, TensorSpec};
use super::{split2, BackPass, Pass};
use crate::activation::Activation;
use crate::chain::{Chain, Fill, Shape, Step};
use crate::cpu::gemm::{sgemm, sgemm_bias_act, BiasAct, GemmWorkspace, Mat, MatMut, PackedB, Weights};
use crate::cpu::isa::Isa;
use crate::cpu::pool::Pool;
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// A fully connected layer: y = act(W·x + b) with W (out_features, in_features), on a vector.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dense {
    pub out_features: usize,
    pub activation: Activation,
}

impl Chain {
    /// Dense layer with `out_features` outputs.
    pub fn dense(self, out_features: usize, activation: Activation) -> Chain {
        self.layer(Dense { out_features, activation }.into())
    }
}

impl LayerKind for Dense {
    const WORD: &'static str = "dense";

    fn activation(&self) -> Option<Activation> {
        Some(self.activation)
    }

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        match input {
            Shape::Vector(_) if self.out_features == 0 => Err("a Dense layer needs at least one output".into()),
            Shape::Vector(_) => Ok(Shape::Vector(self.out_features)),
            Shape::Image { .. } | Shape::Sequence { .. } | Shape::Signal { .. } => {
                Err("a Dense layer needs a vector input: add .flatten() before it".into())
            }
        }
    }

    /// `weight` (out, in), drawn with fan-in `in` and fan-out `out`; `bias` (out), zero.
    fn params(&self, input: Shape, _output: Shape) -> Vec<TensorSpec> {
        let (out, inp) = (self.out_features, input.len());
        vec![
            TensorSpec { name: "weight", shape: vec![out, inp], fill: Fill::Fans { fan_in: inp, fan_out: out } },
            TensorSpec { name: "bias", shape: vec![out], fill: Fill::Constant(0.0) },
        ]
    }

    /// `dense OUT ACTIVATION`
    fn describe(&self) -> String {
        format!("dense {} {}", self.out_features, self.activation.name())
    }

    fn parse(words: &Words) -> Result<Dense> {
        let [out_features] = words.numbers()?;
        Ok(Dense { out_features, activation: words.activation(2)? })
    }

    fn summary(&self, input: Shape) -> String {
        format!("Dense({} → {})", input.len(), self.out_features)
    }

    fn forward(&self, step: &Step, pass: &mut Pass, mode: Mode) {
        let (x, z, y) = (pass.region(step.input_region), pass.region(step.z_region), pass.region(step.output_region));
        let (w, b) = step.weight_and_bias();
        let (gemm, cache, version) = pass.ws.dense(pass.index);
        // a training pass's weights are new every step: packing them would cost more than a
        // product of so few rows, which reads them in place (as one of a single output does)
        if mode == Mode::Train && (pass.batch <= TRAIN_UNPACKED_ROWS || !cache.fuses()) {
            let (xs, zs) = split2(pass.acts, x, z);
            cache.forward_unpacked(pass.pool, gemm, pass.batch, &pass.params[w], xs, zs);
            return pass.bias_act(step, self.activation, b, (self.out_features, 1));
        }
        let (before, rest) = pass.acts.split_at_mut(z.start);
        let (xs, (zs, ys)) =
            (&before[x], if z == y { (&mut rest[..z.len()], None) } else { split_zy(rest, z.len(), y.start - z.start, y.len()) });
        let post = BiasAct { bias: &pass.params[b], act: self.activation, y: None };
        match ys {
            // nothing reads z after an inference pass: the sums go to y, activated in place
            Some(ys) if mode == Mode::Infer => cache.forward(pass.pool, gemm, pass.batch, version, &pass.params[w], xs, post, ys),
            ys => cache.forward(pass.pool, gemm, pass.batch, version, &pass.params[w], xs, BiasAct { y: ys, ..post }, zs),
        }
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        let (in_f, out_f) = (step.input.len(), self.out_features);
        let g = pass.weighted(step, self.activation, (out_f, 1));
        backward(g.pool, &mut g.ws.gemm, g.batch, in_f, out_f, g.w, g.x, g.dz, g.dw, g.dx);
    }

    /// An inference pass leaves z unwritten (where the step has a y of its own).
    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, mode: Mode) {
        let (x, z, y) = (pass.region(step.input_region), pass.region(step.z_region), pass.region(step.output_region));
        let (w, b) = step.weight_and_bias();
        let (in_f, out_f, act) = (step.input.len(), self.out_features, self.activation);
        if mode == Mode::Infer && z != y {
            let (xs, ys) = split2(pass.acts, x, y);
            forward_spec(pass.batch, in_f, out_f, &pass.params[w], &pass.params[b], xs, ys);
            return ys.iter_mut().for_each(|v| *v = act.apply(*v));
        }
        let (xs, zs) = split2(pass.acts, x, z);
        forward_spec(pass.batch, in_f, out_f, &pass.params[w], &pass.params[b], xs, zs);
        pass.activate(step, act);
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        let (batch, in_f, out_f) = (pass.batch, step.input.len(), self.out_features);
        pass.weighted(step, self.activation, |w, x, dz, dw, db, dx| backward_spec(batch, in_f, out_f, w, x, dz, dw, db, dx));
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, mode: Mode) -> Result<()> {
        crate::cuda::exec::dense_forward(pass, step, self.out_features, self.activation, mode)
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        crate::cuda::exec::dense_backward(pass, step, self.activation)
    }
}

/// z (`z_len` values from the start of `rest`) and y (`y_len` values from `y_at`, past z).
fn split_zy(rest: &mut [f32], z_len: usize, y_at: usize, y_len: usize) -> (&mut [f32], Option<&mut [f32]>) {
    let (zs, ys) = rest[..y_at + y_len].split_at_mut(y_at);
    (&mut zs[..z_len], Some(ys))
}

/// The plan's dense steps.
#[cfg(feature = "cuda")]
pub(crate) fn steps(plan: &crate::chain::Plan) -> impl Iterator<Item = &Step> {
    plan.steps.iter().filter(|s| matches!(s.layer, super::Layer::Dense(_)))
}

#[cfg(test)]
/// Plain-loop forward (the spec): z[s,o] = b[o] + Σ_i w[o,i]·x[s,i].
pub fn forward_spec<F: Float>(batch: usize, in_f: usize, out_f: usize, w: &[F], b: &[F], x: &[F], z: &mut [F]) {
    for s in 0..batch {
        for o in 0..out_f {
            let mut acc = b[o];
            for i in 0..in_f {
                acc += w[o * in_f + i] * x[s * in_f + i];
            }
            z[s * out_f + o] = acc;
        }
    }
}

#[cfg(test)]
/// Plain-loop backward (the spec): dW, db overwritten; dX overwritten when given.
#[allow(clippy::too_many_arguments)]
pub fn backward_spec<F: Float>(
    batch: usize,
    in_f: usize,
    out_f: usize,
    w: &[F],
    x: &[F],
    dz: &[F],
    dw: &mut [F],
    db: &mut [F],
    dx: Option<&mut [F]>,
) {
    for o in 0..out_f {
        let mut acc_b = F::ZERO;
        for s in 0..batch {
            acc_b += dz[s * out_f + o];
        }
        db[o] = acc_b;
        for i in 0..in_f {
            let mut acc = F::ZERO;
            for s in 0..batch {
                acc += dz[s * out_f + o] * x[s * in_f + i];
            }
            dw[o * in_f + i] = acc;
        }
    }
    if let Some(dx) = dx {
        for s in 0..batch {
            for i in 0..in_f {
                let mut acc = F::ZERO;
                for o in 0..out_f {
                    acc += dz[s * out_f + o] * w[o * in_f + i];
                }
                dx[s * in_f + i] = acc;
            }
        }
    }
}

/// Up to this many samples, a training pass's forward reads the weights in place (the product's
/// dot-product route) instead of packing them: the weights change every step, so they would be
/// packed every step, for a product that reads them once. Its bits may differ from an inference
/// pass's (packed weights) in the last place; each is the same call after call.
const TRAIN_UNPACKED_ROWS: usize = 4;

/// What a dense layer keeps in a cache: Wᵀ (in × out), the B of Z = X·Wᵀ, packed once, with
/// the parameter version it was packed from (0: none yet); nothing for a layer of one output,
/// whose products are dot products of W's one row with each sample, read in place.
pub(crate) struct DenseCache {
    in_f: usize,
    out_f: usize,
    w_t: Option<(PackedB, u64)>,
}

impl DenseCache {
    /// Room for Wᵀ packed for `isa`'s kernel, unless the layer has one output.
    pub fn new(isa: Isa, in_f: usize, out_f: usize) -> Result<DenseCache> {
        let w_t = if out_f > 1 { Some((PackedB::new(isa, in_f, out_f)?, 0)) } else { None };
        Ok(DenseCache { in_f, out_f, w_t })
    }

    /// Whether its packed weights come from another version than `version`.
    pub fn stale(&self, version: u64) -> bool {
        self.w_t.as_ref().is_some_and(|(_, v)| *v != version)
    }

    /// Packs `w` (out × in, of `version`) in.
    pub fn pack(&mut self, w: &[f32], version: u64) {
        if let Some((w_t, v)) = &mut self.w_t {
            // B = Wᵀ (in × out): element (i, o) = w[o·in + i]
            w_t.pack(Mat { data: w, rs: 1, cs: self.in_f });
            *v = version;
        }
    }

    /// Whether its forward runs the bias and activation in the product's epilogue
    /// ([`DenseCache::forward`]): unless the layer has one output.
    pub fn fuses(&self) -> bool {
        self.w_t.is_some()
    }

    /// Z (batch × out) ← X·Wᵀ + b, then act into `post.y` where given, else in place in Z
    /// ([`BiasAct`]), in the product's epilogue: from the weights packed if they hold
    /// `version`, else from `w` as it is, packed by the product as it goes, with the same bits
    /// (each output one chain of FMAs over the inputs in order, then the bias and activation of
    /// the shared pass). For a layer of one output, dot products of `w` with each sample (the
    /// same for every batch), then the bias and activation.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        pool: &Pool,
        gemm: &mut GemmWorkspace,
        batch: usize,
        version: u64,
        w: &[f32],
        x: &[f32],
        post: BiasAct,
        z: &mut [f32],
    ) {
        let (in_f, out_f) = (self.in_f, self.out_f);
        let (x, z) = (Mat { data: x, rs: in_f, cs: 1 }, MatMut { data: z, rs: out_f, cs: 1 });
        let w = match &self.w_t {
            None => return one_output(pool, gemm, batch, in_f, w, x, post, z),
            Some((w_t, v)) if *v == version => Weights::Packed(w_t),
            Some(_) => Weights::Plain { b: Mat { data: w, rs: 1, cs: in_f }, k: in_f, n: out_f },
        };
        sgemm_bias_act(pool, gemm, batch, x, w, z, post)
    }

    /// Z (batch × out) ← X·Wᵀ, without the bias, from `w` read in place (no packing).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_unpacked(&self, pool: &Pool, gemm: &mut GemmWorkspace, batch: usize, w: &[f32], x: &[f32], z: &mut [f32]) {
        let (in_f, out_f) = (self.in_f, self.out_f);
        let (x, w, z) = (Mat { data: x, rs: in_f, cs: 1 }, Mat { data: w, rs: 1, cs: in_f }, MatMut { data: z, rs: out_f, cs: 1 });
        sgemm(pool, gemm, batch, out_f, in_f, 1.0, x, w, 0.0, z)
    }

    /// For `Cache::routes`.
    pub fn report(&self) -> &'static str {
        match self.w_t {
            Some(_) => "Z = X·Wᵀ, Wᵀ packed once (training passes of up to 4 samples: W read in place)",
            None => "one output: a dot product a sample, W read in place",
        }
    }

    /// Every packed value set to NaN, the version kept (tests).
    #[cfg(test)]
    pub fn poison(&mut self) {
        self.w_t.iter_mut().for_each(|(p, _)| p.poison());
    }
}

/// z (batch) ← X·wᵀ + b for a layer of one output, by dot products of `w` with each sample, then
/// act as `post` says: the bias pass of `layers` and [`Activation::apply_slice`], in place
/// through a copy on the stack (a value a sample: the GEMM's epilogue would cost more than it
/// saves).
#[allow(clippy::too_many_arguments)]
fn one_output(pool: &Pool, gemm: &mut GemmWorkspace, batch: usize, in_f: usize, w: &[f32], x: Mat, post: BiasAct, z: MatMut) {
    let z = z.data;
    sgemm(pool, gemm, batch, 1, in_f, 1.0, x, Mat { data: w, rs: 1, cs: in_f }, 0.0, MatMut { data: &mut *z, rs: 1, cs: 1 });
    let z = &mut z[..batch];
    z.iter_mut().for_each(|v| *v += post.bias[0]);
    match post.y {
        Some(y) => post.act.apply_slice(z, &mut y[..batch]),
        None if post.act == Activation::Identity => {}
        None => {
            let mut part = [0.0f32; 64];
            for chunk in z.chunks_mut(part.len()) {
                let part = &mut part[..chunk.len()];
                part.copy_from_slice(chunk);
                post.act.apply_slice(part, chunk);
            }
        }
    }
}

/// Fast backward without the bias: dW ← dZᵀ·X; dX ← dZ·W when given.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    pool: &Pool,
    ws: &mut GemmWorkspace,
    batch: usize,
    in_f: usize,
    out_f: usize,
    w: &[f32],
    x: &[f32],
    dz: &[f32],
    dw: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    let dz_t = Mat { data: dz, rs: 1, cs: out_f };
    sgemm(pool, ws, out_f, in_f, batch, 1.0, dz_t, Mat { data: x, rs: in_f, cs: 1 }, 0.0, MatMut { data: dw, rs: in_f, cs: 1 });
    if let Some(dx) = dx {
        let dz = Mat { data: dz, rs: out_f, cs: 1 };
        sgemm(pool, ws, batch, in_f, out_f, 1.0, dz, Mat { data: w, rs: in_f, cs: 1 }, 0.0, MatMut { data: dx, rs: in_f, cs: 1 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::{Elu, Gelu, Identity, LeakyRelu, Relu, Sigmoid, Silu, Softplus, Tanh};
    use crate::cpu::gemm::sgemm_packed_b;
    use crate::testutil::{assert_close, poisoned, Rng};

    /// Z through the cache, with a zero bias and no activation: the weights unpacked (version 1
    /// not packed yet), then packed.
    fn both_ways(
        pool: &Pool,
        ws: &mut GemmWorkspace,
        cache: &mut DenseCache,
        batch: usize,
        w: &[f32],
        x: &[f32],
        extra: usize,
    ) -> [Vec<f32>; 2] {
        let out_f = cache.out_f;
        let zero = vec![0.0; out_f];
        let mut run = |cache: &DenseCache| {
            let mut z = poisoned(batch * out_f + extra);
            cache.forward(pool, ws, batch, 1, w, x, BiasAct { bias: &zero, act: Identity, y: None }, &mut z);
            assert!(z[batch * out_f..].iter().all(|v| v.is_nan()), "wrote past the batch");
            z.truncate(batch * out_f);
            z
        };
        assert_eq!(cache.stale(1), out_f > 1);
        let unpacked = run(cache);
        cache.pack(w, 1);
        assert!(!cache.stale(1));
        [unpacked, run(cache)]
    }

    #[test]
    fn fast_matches_spec_on_odd_shapes() {
        let mut rng = Rng::new(7);
        for threads in [1, 2] {
            let pool = Pool::new(threads).unwrap();
            let mut ws = GemmWorkspace::new(threads).unwrap();
            let shapes =
                [(1, 1, 1), (3, 5, 7), (4, 300, 33), (17, 33, 9), (64, 130, 65), (2, 784, 10), (1, 784, 128), (64, 200, 1), (32, 300, 10)];
            for (batch, in_f, out_f) in shapes {
                let w = rng.ints(out_f * in_f);
                let b = vec![0.0; out_f];
                let x = rng.ints(batch * in_f);
                let dz = rng.ints(batch * out_f);
                let mut z_spec = vec![0.0; batch * out_f];
                forward_spec(batch, in_f, out_f, &w, &b, &x, &mut z_spec);
                let mut cache = DenseCache::new(ws.isa(), in_f, out_f).unwrap();
                for (z, how) in both_ways(&pool, &mut ws, &mut cache, batch, &w, &x, 3).iter().zip(["unpacked", "packed"]) {
                    assert_eq!(*z, z_spec, "forward {batch}×{in_f}×{out_f}, {how}");
                }

                let (mut dw_s, mut db_s, mut dx_s) = (vec![0.0; out_f * in_f], vec![0.0; out_f], vec![0.0; batch * in_f]);
                backward_spec(batch, in_f, out_f, &w, &x, &dz, &mut dw_s, &mut db_s, Some(&mut dx_s));
                let (mut dw, mut dx) = (poisoned(out_f * in_f), poisoned(batch * in_f));
                backward(&pool, &mut ws, batch, in_f, out_f, &w, &x, &dz, &mut dw, Some(&mut dx));
                assert_close(&dw, &dw_s, 0.0, 0.0, "dW");
                assert_close(&dx, &dx_s, 0.0, 0.0, "dX");
            }
        }
    }

    /// Real values (rounding in every sum): a sample's outputs have the same bits whether it
    /// runs alone, in a batch of 2 to 5 or 33 or in one of 64, with the weights packed or not,
    /// on 1 or 2 threads; so with one output, which is never packed.
    #[test]
    fn a_sample_has_the_same_bits_in_any_batch() {
        let mut rng = Rng::new(8);
        for out_f in [1, 10, 70] {
            let (in_f, batch) = (300, 64);
            let (w, x) = (rng.uniform(out_f * in_f), rng.uniform(batch * in_f));
            let bits = |z: &[f32]| z.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let mut want = None;
            for threads in [1, 2] {
                let (pool, mut ws) = (Pool::new(threads).unwrap(), GemmWorkspace::new(threads).unwrap());
                for rows in [batch, 1, 2, 3, 4, 5, 33] {
                    let mut cache = DenseCache::new(ws.isa(), in_f, out_f).unwrap();
                    for z in both_ways(&pool, &mut ws, &mut cache, rows, &w, &x[..rows * in_f], 0) {
                        let want = want.get_or_insert_with(|| bits(&z));
                        assert_eq!(bits(&z), want[..rows * out_f], "{out_f} outputs, a batch of {rows}, {threads} threads");
                    }
                }
            }
        }
    }

    /// The bias and activation in the product's epilogue against the product, then the shared
    /// pass of `layers` (the spec), bit for bit: every activation, on real values (rounding in
    /// every sum, both sides of every bend), odd shapes (batches and outputs that are no
    /// multiple of the tiles, more inputs than a block of k, more rows and outputs than a block
    /// of either, one input, one output), the weights packed and
    /// unpacked, 1 and 2 threads; a training pass's z and y, an inference pass's y alone (the
    /// sums activated in place); every output poisoned first, nothing past the batch written.
    #[test]
    fn the_epilogue_gives_the_product_then_the_bias_and_activation_pass() {
        let acts = [Identity, Relu, LeakyRelu(0.1), Tanh, Sigmoid, Gelu, Silu, Elu(0.7), Softplus];
        // (batch, in, out); the last six reach a thread's part of more rows than a block of rows
        // (300, 150, 200: past the GEMM's MC), more outputs than a block of columns (1,100: past
        // NC), and one input (B read in place)
        let shapes = [
            (1, 5, 3),
            (13, 40, 70),
            (29, 300, 65),
            (37, 260, 17),
            (64, 64, 256),
            (7, 33, 1),
            (130, 9, 40),
            (300, 70, 1100),
            (150, 1, 20),
            (100, 1, 40),
            (200, 600, 40),
            (5, 1, 1100),
            (3, 1, 200),
        ];
        let mut rng = Rng::new(9);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for threads in [1, 2] {
            let (pool, mut ws) = (Pool::new(threads).unwrap(), GemmWorkspace::new(threads).unwrap());
            for (batch, in_f, out_f) in shapes {
                // pre-activations of a few units either side of 0
                let (w, x, b) = (rng.uniform(out_f * in_f), rng.uniform(batch * in_f), rng.uniform(out_f));
                let x: Vec<f32> = x.iter().map(|v| 6.0 * v).collect();
                let mut cache = DenseCache::new(ws.isa(), in_f, out_f).unwrap();
                let mut product = vec![0.0; batch * out_f];
                if out_f == 1 {
                    cache.forward_unpacked(&pool, &mut ws, batch, &w, &x, &mut product);
                } else {
                    let mut w_t = PackedB::new(ws.isa(), in_f, out_f).unwrap();
                    w_t.pack(Mat { data: &w, rs: 1, cs: in_f });
                    let (a, c) = (Mat { data: &x, rs: in_f, cs: 1 }, MatMut { data: &mut product, rs: out_f, cs: 1 });
                    sgemm_packed_b(&pool, &mut ws, batch, 1.0, a, &w_t, 0.0, c);
                }
                for act in acts {
                    let (mut z_want, mut y_want) = (product.clone(), poisoned(batch * out_f));
                    crate::layers::bias_act(&pool, act, &b, out_f, 1, batch, &mut z_want, Some(&mut y_want));
                    let what = |how: &str| format!("{act:?}, {batch}×{in_f}×{out_f}, {threads} threads, {how}");
                    for (version, how) in [(1, "unpacked"), (2, "packed")] {
                        if version == 2 {
                            cache.pack(&w, 2);
                        }
                        let (mut z, mut y) = (poisoned(batch * out_f + 3), poisoned(batch * out_f + 3));
                        let post = BiasAct { bias: &b, act, y: Some(&mut y[..batch * out_f]) };
                        cache.forward(&pool, &mut ws, batch, version, &w, &x, post, &mut z[..batch * out_f]);
                        assert!(z[batch * out_f..].iter().chain(&y[batch * out_f..]).all(|v| v.is_nan()), "{}", what(how));
                        assert_eq!(bits(&z[..batch * out_f]), bits(&z_want), "{}: z", what(how));
                        assert_eq!(bits(&y[..batch * out_f]), bits(&y_want), "{}: y", what(how));
                        let mut y = poisoned(batch * out_f + 3);
                        let post = BiasAct { bias: &b, act, y: None };
                        cache.forward(&pool, &mut ws, batch, version, &w, &x, post, &mut y[..batch * out_f]);
                        assert!(y[batch * out_f..].iter().all(|v| v.is_nan()), "{}", what(how));
                        assert_eq!(bits(&y[..batch * out_f]), bits(&y_want), "{}: y in place", what(how));
                    }
                    cache = DenseCache::new(ws.isa(), in_f, out_f).unwrap();
                }
            }
        }
    }
}
