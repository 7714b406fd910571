//! Dropout, as PyTorch's `nn.Dropout(p)`: in training y = x·m, dx = dy·m, with m = 0 for a
//! value dropped (probability p) and 1/(1 − p) for one kept; in inference y = x (a copy: the
//! plan is one for both modes, so the step has a region of its own). Any shape; no tensors.
//!
//! The mask is a counter-based draw, so nothing is stored and the backward pass draws it again:
//! value i of the step's output for the batch (sample-major) is dropped when word i mod 4 of
//! Philox4x32-10 (Salmon, Moraes, Dror and Shaw, SC 2011; Random123's constants) of the counter
//! (i div 4 as two words, the high one plus the replica's number, and the training pass's number
//! as two) under the key (the seed's low word, its high word + the step's output region ×
//! 0x9E3779B9) is below ⌊p·2³²⌋. The same bits on the CPU and the GPU; every value, pass and
//! dropout step drawn with its own counter or key. The replica's number is 0 but in
//! data-parallel training ([`crate::DataParallel`]), where each GPU's share of the batch draws
//! masks of its own (the GPU's rank; a batch's values number below 2³⁴ on a GPU, so the word
//! i div 2³⁴ is 0 there and ranks never share a counter), independent of the others'. The
//! pass number is the model's count of training passes ([`crate::Model::train_passes`]), which
//! a checkpoint keeps, so a resumed run draws the masks the uninterrupted one would have.

use super::kind::{LayerKind, Mode};
use super::{split2, BackPass, Pass};
use crate::chain::{Chain, Shape, Step};
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// Dropout with probability `p` (in [0, 1)) in training; the identity in inference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    pub p: f32,
}

impl Chain {
    /// Dropout with probability `p` of zeroing each value in training (PyTorch's
    /// `nn.Dropout(p)`), the kept ones scaled by 1/(1 − p); the identity in inference.
    pub fn dropout(self, p: f32) -> Chain {
        self.layer(Dropout { p }.into())
    }
}

/// Where a training pass draws dropout's masks: the model's seed, the number of training
/// passes before this one, and the replica (0, or a GPU's rank in data-parallel training).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Draw {
    pub seed: u64,
    pub pass: u64,
    pub replica: u32,
}

/// Random123's Philox4x32 constants: the round multipliers and the key's Weyl increments.
const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Philox4x32-10: ten rounds of `counter` under `key`, the key bumped between rounds.
pub(crate) fn philox(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(PHILOX_W[0]), k[1].wrapping_add(PHILOX_W[1])];
        }
        let p0 = u64::from(PHILOX_M[0]) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M[1]) * u64::from(c[2]);
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// A dropout step's key addition: its output region × 0x9E3779B9 (odd, so distinct regions
/// get distinct keys), added to the seed's high word.
pub(crate) fn layer_key(output_region: usize) -> u32 {
    (output_region as u32).wrapping_mul(PHILOX_W[0])
}

/// ⌊p·2³²⌋: a value whose word is below it is dropped (p < 1, so it fits).
pub(crate) fn threshold(p: f32) -> u32 {
    (f64::from(p) * 4_294_967_296.0) as u32
}

/// The kept values' factor, 1/(1 − p) rounded to f32.
pub(crate) fn scale(p: f32) -> f32 {
    (1.0 / (1.0 - f64::from(p))) as f32
}

/// The mask of one dropout step in one training pass.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mask {
    key: [u32; 2],
    pass: [u32; 2],
    replica: u32,
    threshold: u32,
    scale: f32,
}

impl Mask {
    pub fn new(p: f32, output_region: usize, draw: Draw) -> Mask {
        let key = [draw.seed as u32, ((draw.seed >> 32) as u32).wrapping_add(layer_key(output_region))];
        let pass = [draw.pass as u32, (draw.pass >> 32) as u32];
        Mask { key, pass, replica: draw.replica, threshold: threshold(p), scale: scale(p) }
    }

    /// The factors of values 4g .. 4g + 3: 0 (dropped) or the scale.
    #[inline]
    pub fn group(&self, g: usize) -> [f32; 4] {
        let g = g as u64;
        let high = ((g >> 32) as u32).wrapping_add(self.replica);
        let words = philox([g as u32, high, self.pass[0], self.pass[1]], self.key);
        words.map(|w| if w < self.threshold { 0.0 } else { self.scale })
    }

    /// The factor of value i.
    #[cfg(test)]
    pub fn factor(&self, i: usize) -> f32 {
        self.group(i / 4)[i % 4]
    }
}

impl LayerKind for Dropout {
    const WORD: &'static str = "dropout";

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        if !(0.0..1.0).contains(&self.p) {
            return Err(format!("the dropout probability {} is not in [0, 1)", self.p));
        }
        Ok(input)
    }

    /// `dropout P`
    fn describe(&self) -> String {
        format!("dropout {}", self.p)
    }

    fn parse(words: &Words) -> Result<Dropout> {
        if words.len() != 2 {
            return Err(words.unknown());
        }
        Ok(Dropout { p: words.real(1)? })
    }

    fn summary(&self, _input: Shape) -> String {
        format!("Dropout(p = {})", self.p)
    }

    fn forward(&self, step: &Step, pass: &mut Pass, mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (xs, ys) = split2(pass.acts, x, y);
        match mode {
            Mode::Train => apply(pass.pool, &Mask::new(self.p, step.output_region, pass.draw), xs, ys),
            Mode::Infer => copy(pass.pool, xs, ys),
        }
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (dxs, dys) = pass.dacts.split_at_mut(y.start);
        apply(pass.pool, &Mask::new(self.p, step.output_region, pass.draw), &dys[..y.len()], &mut dxs[x]);
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (xs, ys) = split2(pass.acts, x, y);
        let mask = Mask::new(self.p, step.output_region, pass.draw);
        for (i, (y, &x)) in ys.iter_mut().zip(xs).enumerate() {
            *y = match mode {
                Mode::Train => x * F::of(f64::from(mask.factor(i))),
                Mode::Infer => x,
            };
        }
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let mask = Mask::new(self.p, step.output_region, pass.draw);
        let dys = pass.dacts[y].to_vec();
        for (i, (dx, &dy)) in pass.dacts[x].iter_mut().zip(&dys).enumerate() {
            *dx = dy * F::of(f64::from(mask.factor(i)));
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, mode: Mode) -> Result<()> {
        crate::cuda::layers::dropout_forward(pass, step, self.p, mode)
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        crate::cuda::layers::dropout_backward(pass, step, self.p)
    }
}

/// Whether the plan has a dropout step (its training passes then move the GPU's pass count).
#[cfg(feature = "cuda")]
pub(crate) fn any(plan: &crate::chain::Plan) -> bool {
    plan.steps.iter().any(|s| matches!(s.layer, super::Layer::Dropout(_)))
}

/// Values per group of four a thread takes at least.
const MIN_GROUPS: usize = 2048;

/// out = x·m over `x.len()` values (the first `x.len()` of `out`), groups of four spread over
/// the pool.
fn apply(pool: &Pool, mask: &Mask, x: &[f32], out: &mut [f32]) {
    let n = x.len();
    let out = SharedMut::new(&mut out[..n]);
    for_chunks(pool, n.div_ceil(4), MIN_GROUPS, &|_, groups| {
        let values = 4 * groups.start..(4 * groups.end).min(n);
        // SAFETY: chunks are disjoint ranges of groups, so of values.
        let out = unsafe { out.slice(values.clone()) };
        for ((g, out), x) in groups.zip(out.chunks_mut(4)).zip(x[values].chunks(4)) {
            let m = mask.group(g);
            out.iter_mut().zip(x).zip(m).for_each(|((o, &x), m)| *o = x * m);
        }
    });
}

/// out = x, spread over the pool.
fn copy(pool: &Pool, x: &[f32], out: &mut [f32]) {
    let n = x.len();
    let out = SharedMut::new(&mut out[..n]);
    for_chunks(pool, n, 4 * MIN_GROUPS, &|_, r| {
        // SAFETY: chunks are disjoint ranges.
        unsafe { out.slice(r.clone()) }.copy_from_slice(&x[r]);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{poisoned, Rng};

    /// Random123's known answers for Philox4x32-10 (its tests/kat_vectors).
    #[test]
    fn philox_gives_random123s_known_answers() {
        let cases = [
            ([0; 4], [0; 2], [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]),
            ([u32::MAX; 4], [u32::MAX; 2], [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (counter, key, want) in cases {
            assert_eq!(philox(counter, key), want, "counter {counter:x?} key {key:x?}");
        }
    }

    /// Over 2²⁰ values the share dropped is p within 5 standard deviations, for several p; the
    /// masks of two passes, of two layers, of two seeds and of two replicas agree where independent ones would
    /// (p² of the values dropped in both, within 5 standard deviations); the kept values are
    /// scaled by 1/(1 − p); p = 0 keeps everything.
    #[test]
    fn masks_drop_a_share_p_independently_of_pass_layer_seed_and_replica() {
        let n = 1 << 20;
        let dropped = |mask: &Mask| -> Vec<bool> { (0..n).map(|i| mask.factor(i) == 0.0).collect() };
        let within = |share: f64, want: f64, what: &str| {
            let sigma = (want * (1.0 - want) / n as f64).sqrt();
            assert!((share - want).abs() <= 5.0 * sigma + 1e-12, "{what}: {share} against {want} (σ {sigma:e})");
        };
        for p in [0.1f32, 0.3, 0.5, 0.9] {
            let draw = Draw { seed: 7, pass: 3, replica: 0 };
            let base = Mask::new(p, 4, draw);
            let a = dropped(&base);
            let share = a.iter().filter(|&&d| d).count() as f64 / n as f64;
            within(share, f64::from(p), &format!("p = {p}"));
            let kept = (0..n).find(|&i| !a[i]).unwrap();
            let scaled = f64::from(base.factor(kept)) * (1.0 - f64::from(p));
            assert!((scaled - 1.0).abs() < 1e-6, "p = {p}: the kept values are scaled by {}", base.factor(kept));
            let others = [
                ("next pass", Mask::new(p, 4, Draw { pass: 4, ..draw })),
                ("pass 2³²", Mask::new(p, 4, Draw { pass: 3 + (1 << 32), ..draw })),
                ("another layer", Mask::new(p, 6, draw)),
                ("another seed", Mask::new(p, 4, Draw { seed: 8, ..draw })),
                ("seed 2³²", Mask::new(p, 4, Draw { seed: 7 + (1 << 32), ..draw })),
                ("another replica", Mask::new(p, 4, Draw { replica: 1, ..draw })),
            ];
            for (what, other) in others {
                let b = dropped(&other);
                let both = a.iter().zip(&b).filter(|(x, y)| **x && **y).count() as f64 / n as f64;
                within(both, f64::from(p) * f64::from(p), &format!("p = {p}, {what}"));
            }
        }
        let none = Mask::new(0.0, 1, Draw { seed: 1, pass: 0, replica: 0 });
        assert!((0..4096).all(|i| none.factor(i) == 1.0), "p = 0 keeps every value");
    }

    /// In a model: the training pass, its backward and inference against the plain loop.
    #[test]
    fn fast_matches_spec_in_a_model() {
        use crate::chain::Shape;
        super::super::gradcheck::fast_matches_spec_f32(Chain::new(Shape::sequence(3, 5)).dropout(0.0).dropout(0.35), 4, 3, (0.0, 0.0));
    }

    #[test]
    fn fast_matches_spec_and_backward_reuses_the_mask() {
        let mut rng = Rng::new(3);
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            for n in [1, 3, 4, 5, 4097, 3 * 4 * MIN_GROUPS + 7] {
                let mask = Mask::new(0.4, 2, Draw { seed: 11, pass: 5, replica: 0 });
                let x = rng.uniform(n);
                let want: Vec<f32> = (0..n).map(|i| x[i] * mask.factor(i)).collect();
                let mut y = poisoned(n + 2);
                apply(&pool, &mask, &x, &mut y);
                assert!(y[..n].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{n} values, {threads} threads");
                assert!(y[n..].iter().all(|v| v.is_nan()), "wrote past the values");
                let mut c = poisoned(n + 1);
                copy(&pool, &x, &mut c);
                assert_eq!(&c[..n], &x[..]);
                assert!(c[n].is_nan());
            }
        }
    }
}
