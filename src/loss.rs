//! Losses: the value reported and exactly its gradient with respect to the model's output.

use crate::cpu::vmath;
use crate::float::Float;

/// A loss over a batch of model outputs. Each is PyTorch's loss of the same name with its
/// default `reduction='mean'`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Loss {
    /// Mean squared error, averaged over the batch and the outputs:
    /// L = Σ (y − t)² / (batch · outputs), with real-valued targets (`Cache::set_targets`).
    Mse,
    /// Softmax cross-entropy on raw scores (logits) with integer class labels, averaged over
    /// the batch: L = Σ_s (log Σ_j e^{y_sj} − y_s,label) / batch (`Cache::set_labels`).
    LogitCrossEntropy,
    /// Binary cross-entropy on logits (`nn.BCEWithLogitsLoss`), each output its own yes/no
    /// question with a target probability t (`Cache::set_targets`, usually 0 or 1), averaged
    /// over the batch and the outputs: L = Σ (max(y, 0) − y·t + ln(1 + e^−|y|)) / (batch ·
    /// outputs), which is −t·ln σ(y) − (1 − t)·ln(1 − σ(y)) without its overflow;
    /// dL/dy = (σ(y) − t) / (batch · outputs).
    BceWithLogits,
    /// Mean absolute error (`nn.L1Loss`): L = Σ |y − t| / (batch · outputs), real-valued
    /// targets; dL/dy = sign(y − t) / (batch · outputs), 0 where y = t.
    L1,
    /// Smooth L1 (`nn.SmoothL1Loss(beta)`), the Huber loss scaled by 1/β: per value, with
    /// d = y − t, ½d²/β where |d| < β, else |d| − ½β; averaged over the batch and the outputs,
    /// real-valued targets. β = 0 is L1. (PyTorch's `HuberLoss(delta)` is δ times this loss
    /// with β = δ.) β must be finite and at least 0.
    #[doc(alias = "Huber")]
    SmoothL1 { beta: f32 },
}

impl Loss {
    /// Whether its targets are class labels (`Cache::set_labels`: cross-entropy), rather than
    /// real values, one per output (`Cache::set_targets`: the others).
    pub fn takes_labels(self) -> bool {
        self == Loss::LogitCrossEntropy
    }

    /// L and dL/dy (overwriting `dy`) of `y` (batch × `outputs`) against `labels` (one per
    /// sample, for cross-entropy) or `targets` (as `y`, for the others): the plain loops.
    pub fn compute<F: Float>(self, y: &[F], labels: &[u32], targets: &[F], outputs: usize, dy: &mut [F]) -> f64 {
        match self {
            Loss::LogitCrossEntropy => logit_cross_entropy(y, labels, outputs, dy),
            Loss::Mse => mse(y, targets, dy),
            _ => self.elementwise(y, targets, Some(dy)),
        }
    }

    /// L alone, as [`Loss::compute`] reports it (the same operations, the same bits).
    pub fn value<F: Float>(self, y: &[F], labels: &[u32], targets: &[F], outputs: usize) -> f64 {
        match self {
            Loss::LogitCrossEntropy => logit_cross_entropy_value(y, labels, outputs),
            Loss::Mse => mse_value(y, targets),
            _ => self.elementwise(y, targets, None),
        }
    }

    /// [`Loss::compute`] on the CPU's fast path: cross-entropy vectorised
    /// ([`logit_cross_entropy_fast`]), the others as the plain loops.
    pub(crate) fn fast(self, y: &[f32], labels: &[u32], targets: &[f32], outputs: usize, dy: &mut [f32]) -> f64 {
        match self {
            Loss::LogitCrossEntropy => logit_cross_entropy_fast(y, labels, outputs, dy),
            _ => self.compute(y, labels, targets, outputs, dy),
        }
    }

    /// L alone, as [`Loss::fast`] reports it (the same bits).
    pub(crate) fn fast_value(self, y: &[f32], labels: &[u32], targets: &[f32], outputs: usize) -> f64 {
        match self {
            Loss::LogitCrossEntropy => logit_cross_entropy_fast_value(y, labels, outputs),
            _ => self.value(y, labels, targets, outputs),
        }
    }

    /// The losses that are a mean of one term per value: L = Σ_i ℓ(y_i, t_i) / n and, where `dy`
    /// is given, dL/dy_i = ℓ′(y_i, t_i) · (1/n) (the scale rounded to F), the sum in f64, in
    /// order.
    fn elementwise<F: Float>(self, y: &[F], t: &[F], mut dy: Option<&mut [F]>) -> f64 {
        let scale = 1.0 / y.len() as f64;
        let mut sum = 0.0f64;
        for i in 0..y.len() {
            let (value, grad) = self.term(y[i], t[i]);
            sum += value.f64();
            if let Some(dy) = dy.as_deref_mut() {
                dy[i] = grad * F::of(scale);
            }
        }
        sum * scale
    }

    /// ℓ(y, t) and ∂ℓ/∂y of an element-wise loss.
    #[inline(always)]
    fn term<F: Float>(self, y: F, t: F) -> (F, F) {
        let abs = |v: F| if v < F::ZERO { -v } else { v };
        let sign = |v: F| {
            if v > F::ZERO {
                F::ONE
            } else if v < F::ZERO {
                -F::ONE
            } else {
                F::ZERO
            }
        };
        match self {
            Loss::BceWithLogits => {
                // ln σ(y) = min(y, 0) − ln(1 + e^−|y|), so −t·ln σ(y) − (1 − t)·ln σ(−y) is this
                let value = y.max(F::ZERO) - y * t + (-abs(y)).exp().ln_1p();
                (value, F::ONE / (F::ONE + (-y).exp()) - t)
            }
            Loss::L1 => (abs(y - t), sign(y - t)),
            Loss::SmoothL1 { beta } => {
                let (d, beta) = (y - t, F::of(beta as f64));
                if abs(d) < beta {
                    (F::of(0.5) * d * d / beta, d / beta)
                } else {
                    (abs(d) - F::of(0.5) * beta, sign(d))
                }
            }
            Loss::Mse | Loss::LogitCrossEntropy => unreachable!("{self:?} is not computed element by element"),
        }
    }
}

/// L and dL/dy for MSE; `y`, `t` and `dy` have the same length (batch · outputs).
pub fn mse<F: Float>(y: &[F], t: &[F], dy: &mut [F]) -> f64 {
    let scale = 1.0 / y.len() as f64;
    let mut sum = 0.0f64;
    for i in 0..y.len() {
        let d = y[i] - t[i];
        sum += d.f64() * d.f64();
        dy[i] = F::of(2.0 * scale) * d;
    }
    sum * scale
}

/// L and dL/dy for softmax cross-entropy; `y` and `dy` are (labels.len(), classes).
pub fn logit_cross_entropy<F: Float>(y: &[F], labels: &[u32], classes: usize, dy: &mut [F]) -> f64 {
    let scale = 1.0 / labels.len() as f64;
    let mut sum = 0.0f64;
    for (s, &label) in labels.iter().enumerate() {
        let (row, drow) = (&y[s * classes..][..classes], &mut dy[s * classes..][..classes]);
        let max = row.iter().fold(row[0], |m, &v| m.max(v));
        let mut denom = F::ZERO;
        for (d, &v) in drow.iter_mut().zip(row) {
            *d = (v - max).exp();
            denom += *d;
        }
        let label = label as usize;
        sum += (max + denom.ln() - row[label]).f64();
        let inv = F::ONE / denom;
        for d in drow.iter_mut() {
            *d = *d * inv * F::of(scale);
        }
        drow[label] = drow[label] - F::of(scale);
    }
    sum * scale
}

/// L alone for MSE: the value [`mse`] reports, by the same operations (the same bits).
pub fn mse_value<F: Float>(y: &[F], t: &[F]) -> f64 {
    let scale = 1.0 / y.len() as f64;
    let sum = y.iter().zip(t).fold(0.0f64, |sum, (&y, &t)| {
        let d = y - t;
        sum + d.f64() * d.f64()
    });
    sum * scale
}

/// L alone for softmax cross-entropy: the value [`logit_cross_entropy`] reports, by the same
/// operations (the same bits); `y` is (labels.len(), classes).
pub fn logit_cross_entropy_value<F: Float>(y: &[F], labels: &[u32], classes: usize) -> f64 {
    let scale = 1.0 / labels.len() as f64;
    let mut sum = 0.0f64;
    for (s, &label) in labels.iter().enumerate() {
        let row = &y[s * classes..][..classes];
        let max = row.iter().fold(row[0], |m, &v| m.max(v));
        let denom = row.iter().fold(F::ZERO, |d, &v| d + (v - max).exp());
        sum += (max + denom.ln() - row[label as usize]).f64();
    }
    sum * scale
}

/// [`logit_cross_entropy`] in f32, its exponentials vectorised: per row, with m the largest
/// logit, e_j = e^(y_j − m) (within 0.8 ulp, over the whole batch at once), L_s = m + ln Σ e_j −
/// y_label (the stable log-sum-exp, the sum and the logarithm in f64) and dL/dy_j =
/// (e_j / Σ e − [j = label]) / batch. Every label must be below `classes`.
pub(crate) fn logit_cross_entropy_fast(y: &[f32], labels: &[u32], classes: usize, dy: &mut [f32]) -> f64 {
    let len = labels.len() * classes;
    let (y, dy) = (&y[..len], &mut dy[..len]);
    let row_max = |row: &[f32]| row.iter().fold(row[0], |m, &v| m.max(v));
    for (row, drow) in y.chunks_exact(classes).zip(dy.chunks_exact_mut(classes)) {
        let max = row_max(row);
        drow.iter_mut().zip(row).for_each(|(d, &v)| *d = v - max);
    }
    vmath::exp_in_place(dy);
    let scale = 1.0 / labels.len() as f64;
    let mut sum = 0.0f64;
    for ((row, drow), &label) in y.chunks_exact(classes).zip(dy.chunks_exact_mut(classes)).zip(labels) {
        let denom: f64 = drow.iter().map(|&e| e as f64).sum();
        let label = label as usize;
        sum += row_max(row) as f64 + denom.ln() - row[label] as f64;
        let inv = (scale / denom) as f32;
        drow.iter_mut().for_each(|d| *d *= inv);
        drow[label] -= scale as f32;
    }
    sum * scale
}

/// L alone for softmax cross-entropy, as [`logit_cross_entropy_fast`] reports it (the same
/// operations, so the same bits: the exponentials are element-wise and taken a stack block at
/// a time, the sums in the same order); allocates nothing.
pub(crate) fn logit_cross_entropy_fast_value(y: &[f32], labels: &[u32], classes: usize) -> f64 {
    const BLOCK: usize = 64;
    let scale = 1.0 / labels.len() as f64;
    let mut sum = 0.0f64;
    for (row, &label) in y.chunks_exact(classes).zip(labels) {
        let max = row.iter().fold(row[0], |m, &v| m.max(v));
        let mut denom = 0.0f64;
        for chunk in row.chunks(BLOCK) {
            let mut e = [0.0f32; BLOCK];
            let e = &mut e[..chunk.len()];
            e.iter_mut().zip(chunk).for_each(|(e, &v)| *e = v - max);
            vmath::exp_in_place(e);
            denom = e.iter().fold(denom, |d, &e| d + e as f64);
        }
        sum += max as f64 + denom.ln() - row[label as usize] as f64;
    }
    sum * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_gradient(f: impl Fn(&[f64], &mut [f64]) -> f64, y: &[f64]) {
        let mut dy = vec![f64::NAN; y.len()];
        f(y, &mut dy);
        let mut scratch = vec![0.0; y.len()];
        for i in 0..y.len() {
            let h = 1e-6;
            let (mut plus, mut minus) = (y.to_vec(), y.to_vec());
            plus[i] += h;
            minus[i] -= h;
            let numeric = (f(&plus, &mut scratch) - f(&minus, &mut scratch)) / (2.0 * h);
            assert!((numeric - dy[i]).abs() <= 1e-7 + 1e-6 * numeric.abs(), "d/dy[{i}]: {numeric} vs {}", dy[i]);
        }
    }

    #[test]
    fn gradients_are_the_derivative_of_the_value() {
        let y = [0.3, -1.2, 2.5, 0.0, 0.7, -0.4];
        let t = [1.0, 0.0, 2.0, -1.0, 0.5, 0.5];
        check_gradient(|y, dy| mse(y, &t, dy), &y);
        check_gradient(|y, dy| logit_cross_entropy(y, &[2, 0], 3, dy), &y);
        // d = y − t is −0.7, −1.2, 0.5, 1, 0.2, −0.9: away from L1's kink at 0 and from β
        let probabilities = [1.0, 0.0, 0.3, 1.0, 0.5, 0.0];
        for (loss, t) in
            [(Loss::BceWithLogits, &probabilities), (Loss::L1, &t), (Loss::SmoothL1 { beta: 0.6 }, &t), (Loss::SmoothL1 { beta: 0.0 }, &t)]
        {
            check_gradient(|y, dy| loss.compute(y, &[], t, 3, dy), &y);
        }
    }

    #[test]
    fn values_alone_are_the_same_bits() {
        let y: Vec<f32> = (0..21).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7).collect();
        let t: Vec<f32> = (0..21).map(|i| (i % 4) as f32 * 0.3).collect();
        let mut dy = vec![0.0f32; 21];
        assert_eq!(mse_value(&y, &t).to_bits(), mse(&y, &t, &mut dy).to_bits());
        let labels = [2, 0, 6];
        assert_eq!(logit_cross_entropy_value(&y, &labels, 7).to_bits(), logit_cross_entropy(&y, &labels, 7, &mut dy).to_bits());
        for loss in [Loss::Mse, Loss::LogitCrossEntropy, Loss::BceWithLogits, Loss::L1, Loss::SmoothL1 { beta: 0.5 }] {
            let value = loss.compute(&y, &labels, &t, 7, &mut dy);
            assert_eq!(loss.value(&y, &labels, &t, 7).to_bits(), value.to_bits(), "{loss:?}");
            let fast = loss.fast(&y, &labels, &t, 7, &mut dy);
            assert_eq!(loss.fast_value(&y, &labels, &t, 7).to_bits(), fast.to_bits(), "{loss:?}");
        }
        // the fast path's value alone, over rows longer than its stack block too
        let wide: Vec<f32> = (0..2 * 150).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.3).collect();
        for (y, classes, labels) in [(&y[..], 7, &labels[..]), (&wide[..], 150, &[149, 3][..])] {
            let mut dy = vec![0.0f32; y.len()];
            let fast = logit_cross_entropy_fast(y, labels, classes, &mut dy);
            assert_eq!(logit_cross_entropy_fast_value(y, labels, classes).to_bits(), fast.to_bits());
        }
    }

    #[test]
    fn known_values() {
        let mut dy = [0.0f64; 4];
        assert!((mse(&[1.0, 2.0, 3.0, 4.0], &[1.0, 0.0, 3.0, 0.0], &mut dy) - 5.0).abs() < 1e-12);
        // uniform logits over 4 classes: ln 4, large logits do not overflow
        assert!((logit_cross_entropy(&[1000.0f64; 4], &[3], 4, &mut dy) - 4f64.ln()).abs() < 1e-12);
        // a logit of 0 is ln 2 whatever the target; ±100 wrong by 100 (no overflow), and its
        // gradient (σ(y) − t)/n
        let bce = Loss::BceWithLogits.compute(&[0.0f64, 100.0, -100.0, 0.0], &[], &[1.0, 0.0, 1.0, 0.3], 1, &mut dy);
        assert!((bce - (2.0 * 2f64.ln() + 200.0) / 4.0).abs() < 1e-12, "{bce}");
        assert_eq!(dy, [-0.125, 0.25, -0.25, 0.05]);
        assert_eq!(Loss::L1.compute(&[1.0f64, 2.0, 3.0, 3.0], &[], &[0.0, 0.0, 4.0, 3.0], 1, &mut dy), 1.0);
        assert_eq!(dy, [0.25, 0.25, -0.25, 0.0]);
        // β = 1: ½·0.5² and 2 − ½, and the gradients d/β and sign(d), over 4 values
        let smooth = Loss::SmoothL1 { beta: 1.0 }.compute(&[0.5f64, 2.0, 0.0, 0.0], &[], &[0.0, 0.0, 0.0, 0.0], 1, &mut dy);
        assert_eq!(smooth, (0.125 + 1.5) / 4.0);
        assert_eq!(dy, [0.125, 0.25, 0.0, 0.0]);
    }

    /// The vectorised f32 loss against the f64 spec: odd class counts and batches, logits from
    /// ±0 to ±1000 apart, the gradient poisoned with NaN and a guard past it.
    #[test]
    fn fast_cross_entropy_matches_the_spec() {
        let mut rng = crate::testutil::Rng::new(11);
        for classes in [1, 2, 3, 7, 10, 33, 1000] {
            for batch in [1, 5, 17] {
                for spread in [0.0, 1.0, 30.0, 1000.0] {
                    let y: Vec<f32> = rng.uniform(batch * classes).iter().map(|v| spread * v).collect();
                    let labels: Vec<u32> = (0..batch).map(|_| rng.below(classes) as u32).collect();
                    let mut dy = vec![f32::NAN; batch * classes + 1];
                    let value = logit_cross_entropy_fast(&y, &labels, classes, &mut dy);
                    let y64: Vec<f64> = y.iter().map(|&v| v as f64).collect();
                    let mut want = vec![f64::NAN; batch * classes];
                    let want_value = logit_cross_entropy(&y64, &labels, classes, &mut want);
                    let what = format!("{batch}×{classes}, spread {spread}");
                    // the error is ln Σe's: the sum's relative error, a few 1e-8
                    assert!((value - want_value).abs() <= 1e-7, "{what}: loss {value} vs {want_value}");
                    assert!(dy[batch * classes].is_nan(), "{what}: wrote past the gradient");
                    let scale = 1.0 / batch as f64;
                    for (i, (&got, &want)) in dy.iter().zip(&want).enumerate() {
                        let tol = 1e-7 * scale + 4e-7 * want.abs();
                        assert!((got as f64 - want).abs() <= tol, "{what}: dy[{i}] {got} vs {want}");
                    }
                }
            }
        }
    }
}
