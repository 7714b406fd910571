//! GRU: PyTorch's `nn.GRU` (one layer, one direction, `batch_first=True`) over a sequence
//! (steps, features), its tensors `weight_ih_l0` (3H, F), `weight_hh_l0` (3H, H), `bias_ih_l0`,
//! `bias_hh_l0` (3H), gates in PyTorch's order r, z, n:
//!
//!   r = σ(W_ir·x + b_ir + W_hr·h + b_hr)
//!   z = σ(W_iz·x + b_iz + W_hz·h + b_hz)
//!   n = tanh(W_in·x + b_in + r ⊙ (W_hn·h + b_hn))
//!   h' = (1 − z) ⊙ n + z ⊙ h
//!
//! from the initial state (zeros, or set by the caller: [`crate::Cache::set_state`]). Backward
//! through time, with a_n = W_hn·h + b_hn and dh = ∂L/∂h':
//!
//!   dn = dh·(1 − z), dz = dh·(h − n), da_in = dn·(1 − n²) (n's input side),
//!   da_hn = da_in·r (n's recurrent side), da_r = da_in·a_n·r(1 − r), da_z = dz·z(1 − z),
//!   ∂L/∂h = dh·z + Σ_g W_hg ᵀ·da_hg
//!
//! What it shares with the LSTM (layout, fast path) is in `layers/recurrent.rs`; its GPU launches
//! in `cuda/recurrent.rs`, its kernels in `kernels/gru.cu`.

use super::kind::{Kept, LayerKind, Mode, TensorSpec};
use super::recurrent::{self, Cell, Dims, RnnOutput, Streaming};
use super::{BackPass, Pass};
use crate::chain::{Chain, Shape, Step};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// A GRU layer of `hidden` units over a sequence: outputs every step's hidden state, or the
/// last step's ([`RnnOutput`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gru {
    pub hidden: usize,
    pub output: RnnOutput,
    /// What it does differently in the model of a [`crate::Stream`] (see `layers::recurrent`).
    pub(crate) streaming: Streaming,
}

impl Gru {
    /// A GRU of `hidden` units.
    pub fn new(hidden: usize, output: RnnOutput) -> Gru {
        Gru { hidden, output, streaming: Streaming::No }
    }

    pub(crate) fn dims(&self, input: Shape) -> Dims {
        Dims::new(Cell::Gru, self.hidden, self.output, self.streaming, input)
    }
}

impl Chain {
    /// A GRU layer of `hidden` units over a sequence input (PyTorch's `nn.GRU` with
    /// `batch_first=True`): its output is the sequence of hidden states (steps, hidden), or the
    /// last one (a vector) with [`RnnOutput::LastStep`].
    pub fn gru(self, hidden: usize, output: RnnOutput) -> Chain {
        self.layer(Gru::new(hidden, output).into())
    }
}

impl LayerKind for Gru {
    const WORD: &'static str = "gru";

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        recurrent::output_shape(Cell::Gru, self.hidden, self.output, input)
    }

    fn params(&self, input: Shape, _output: Shape) -> Vec<TensorSpec> {
        recurrent::params(&self.dims(input))
    }

    fn kept(&self, input: Shape, _output: Shape) -> Option<Kept> {
        recurrent::kept(&self.dims(input))
    }

    /// `gru HIDDEN sequence|last`
    fn describe(&self) -> String {
        recurrent::describe(Self::WORD, self.hidden, self.output)
    }

    fn parse(words: &Words) -> Result<Gru> {
        let (hidden, output) = recurrent::parse(words)?;
        Ok(Gru::new(hidden, output))
    }

    fn summary(&self, input: Shape) -> String {
        recurrent::summary(Cell::Gru, self.hidden, self.output, input)
    }

    fn forward(&self, step: &Step, pass: &mut Pass, mode: Mode) {
        recurrent::forward(&self.dims(step.input), step, pass, mode);
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        let need_dx = pass.needs_dx(step);
        recurrent::backward(&self.dims(step.input), step, pass, need_dx);
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        forward_spec(&self.dims(step.input), step, pass);
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        backward_spec(&self.dims(step.input), step, pass);
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, mode: Mode) -> Result<()> {
        crate::cuda::recurrent::forward(pass, step, &self.dims(step.input), mode)
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        crate::cuda::recurrent::backward(pass, step, &self.dims(step.input))
    }
}

/// σ(v) = 1 / (1 + e^−v)
#[cfg(test)]
fn sigmoid<F: Float>(v: F) -> F {
    F::ONE / (F::ONE + (-v).exp())
}

/// Plain-loop forward (the spec), one sample, one step and one unit at a time. Writes the kept
/// values in the fast path's layout, so that [`backward_spec`] reads them there.
#[cfg(test)]
fn forward_spec<F: Float>(d: &Dims, step: &Step, pass: &mut super::spec::Pass<F>) {
    let (t_len, f_len, h_len, p) = (d.steps, d.features, d.hidden, d.padded);
    let region = |i: usize| pass.region(step.kept.start + i);
    let (gates, hprev, state) = (region(recurrent::GATES), region(recurrent::HPREV), region(recurrent::STATE));
    let (x, out) = (pass.region(step.input_region), pass.region(step.output_region));
    let w = recurrent::SpecWeights { d: *d, p: &pass.params[step.params.clone()] };
    let acts = &mut *pass.acts;
    let (h_final, _) = d.final_slots();
    for s in 0..pass.batch {
        let st = state.start + s * d.state_len();
        let mut h: Vec<F> = acts[st..st + h_len].to_vec();
        for t in 0..t_len {
            let xt: Vec<F> = acts[x.start + (s * t_len + t) * f_len..][..f_len].to_vec();
            acts[hprev.start + (s * t_len + t) * p..][..h_len].copy_from_slice(&h);
            let g0 = gates.start + (s * t_len + t) * d.row();
            let mut next = vec![F::ZERO; h_len];
            for u in 0..h_len {
                let gx = |g: usize| (0..f_len).fold(w.bias(0, g, u), |acc, j| acc + w.ih(g, u, j) * xt[j]);
                let gh = |g: usize| (0..h_len).fold(w.bias(1, g, u), |acc, j| acc + w.hh(g, u, j) * h[j]);
                let (r, z, a_n) = (sigmoid(gx(0) + gh(0)), sigmoid(gx(1) + gh(1)), gh(2));
                let n = (gx(2) + r * a_n).tanh();
                next[u] = (F::ONE - z) * n + z * h[u];
                for (block, v) in [r, z, n, a_n].into_iter().enumerate() {
                    acts[g0 + block * p + u] = v;
                }
            }
            h = next;
            if d.output == RnnOutput::Sequence {
                acts[out.start + (s * t_len + t) * h_len..][..h_len].copy_from_slice(&h);
            }
        }
        acts[st + h_final..][..h_len].copy_from_slice(&h);
        if d.output == RnnOutput::LastStep {
            acts[out.start + s * h_len..][..h_len].copy_from_slice(&h);
        }
    }
}

/// Plain-loop backward through time (the spec): the parameters' gradients (overwritten) and,
/// where the pass needs it, the input's, from the output's.
#[cfg(test)]
#[allow(clippy::needless_range_loop)] // the formulas' indices
fn backward_spec<F: Float>(d: &Dims, step: &Step, pass: &mut super::spec::BackPass<F>) {
    assert!(!d.carry, "a stream's model is not trained");
    let (t_len, f_len, h_len, p, g_len) = (d.steps, d.features, d.hidden, d.padded, d.gates());
    let region = |i: usize| pass.region(step.kept.start + i);
    let (gates, hprev) = (region(recurrent::GATES), region(recurrent::HPREV));
    let (x, out) = (pass.region(step.input_region), pass.region(step.output_region));
    let need_dx = pass.needs_dx(step);
    let w = recurrent::SpecWeights { d: *d, p: &pass.params[step.params.clone()] };
    let (acts, dacts) = (pass.acts, &mut *pass.dacts);
    let mut grads = vec![F::ZERO; step.params.len()];
    let (w_ih, w_hh, b_ih) = (0, g_len * h_len * f_len, g_len * h_len * (f_len + h_len));
    let b_hh = b_ih + g_len * h_len;
    for s in 0..pass.batch {
        let mut carried = vec![F::ZERO; h_len];
        for t in (0..t_len).rev() {
            let dy = |u: usize| match d.output {
                RnnOutput::Sequence => dacts[out.start + (s * t_len + t) * h_len + u],
                RnnOutput::LastStep if t + 1 == t_len => dacts[out.start + s * h_len + u],
                RnnOutput::LastStep => F::ZERO,
            };
            let dh: Vec<F> = (0..h_len).map(|u| carried[u] + dy(u)).collect();
            let g0 = gates.start + (s * t_len + t) * d.row();
            let xt = &acts[x.start + (s * t_len + t) * f_len..][..f_len];
            let hp = &acts[hprev.start + (s * t_len + t) * p..][..h_len];
            // pre-activation gradients, input side (r, z, n) and recurrent side (r, z, n)
            let (mut dgx, mut dgh) = (vec![vec![F::ZERO; h_len]; 3], vec![vec![F::ZERO; h_len]; 3]);
            for u in 0..h_len {
                let (r, z, n, a_n) = (acts[g0 + u], acts[g0 + p + u], acts[g0 + 2 * p + u], acts[g0 + 3 * p + u]);
                let dn = dh[u] * (F::ONE - z);
                let dz = dh[u] * (hp[u] - n);
                let da_in = dn * (F::ONE - n * n);
                let da_r = da_in * a_n * r * (F::ONE - r);
                let da_z = dz * z * (F::ONE - z);
                (dgx[0][u], dgx[1][u], dgx[2][u]) = (da_r, da_z, da_in);
                (dgh[0][u], dgh[1][u], dgh[2][u]) = (da_r, da_z, da_in * r);
            }
            for g in 0..g_len {
                for u in 0..h_len {
                    let row = g * h_len + u;
                    grads[b_ih + row] += dgx[g][u];
                    grads[b_hh + row] += dgh[g][u];
                    for j in 0..f_len {
                        grads[w_ih + row * f_len + j] += dgx[g][u] * xt[j];
                    }
                    for j in 0..h_len {
                        grads[w_hh + row * h_len + j] += dgh[g][u] * hp[j];
                    }
                }
            }
            if need_dx {
                for j in 0..f_len {
                    let sum = (0..g_len)
                        .flat_map(|g| (0..h_len).map(move |u| (g, u)))
                        .fold(F::ZERO, |acc, (g, u)| acc + dgx[g][u] * w.ih(g, u, j));
                    dacts[x.start + (s * t_len + t) * f_len + j] = sum;
                }
            }
            for j in 0..h_len {
                let back =
                    (0..g_len).flat_map(|g| (0..h_len).map(move |u| (g, u))).fold(F::ZERO, |acc, (g, u)| acc + dgh[g][u] * w.hh(g, u, j));
                let z = acts[g0 + p + j];
                carried[j] = dh[j] * z + back;
            }
        }
    }
    pass.grads[step.params.clone()].copy_from_slice(&grads);
}
