//! LSTM: PyTorch's `nn.LSTM` (one layer, one direction, `batch_first=True`) over a sequence
//! (steps, features), its tensors `weight_ih_l0` (4H, F), `weight_hh_l0` (4H, H), `bias_ih_l0`,
//! `bias_hh_l0` (4H), gates in PyTorch's order i, f, g, o:
//!
//!   i = σ(W_ii·x + b_ii + W_hi·h + b_hi),  f = σ(… f …),  g = tanh(… g …),  o = σ(… o …)
//!   c' = f ⊙ c + i ⊙ g,  h' = o ⊙ tanh(c')
//!
//! from the initial state (h₀, c₀: zeros, or set by the caller: [`crate::Cache::set_state`]).
//! Backward through time, with dh = ∂L/∂h' and dc the gradient carried into c':
//!
//!   dc += dh·o·(1 − tanh²c'),  da_i = dc·g·i(1 − i),  da_f = dc·c·f(1 − f),
//!   da_g = dc·i·(1 − g²),  da_o = dh·tanh(c')·o(1 − o),
//!   ∂L/∂c = dc·f,  ∂L/∂h = Σ_g W_hg ᵀ·da_g
//!
//! What it shares with the GRU (layout, fast path) is in `layers/recurrent.rs`; its GPU launches
//! in `cuda/recurrent.rs`, its kernels in `kernels/lstm.cu`.

use super::kind::{Kept, LayerKind, Mode, TensorSpec};
use super::recurrent::{self, Cell, Dims, RnnOutput, Streaming};
use super::{BackPass, Pass};
use crate::chain::{Chain, Shape, Step};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// An LSTM layer of `hidden` units over a sequence: outputs every step's hidden state, or the
/// last step's ([`RnnOutput`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lstm {
    pub hidden: usize,
    pub output: RnnOutput,
    /// What it does differently in the model of a [`crate::Stream`] (see `layers::recurrent`).
    pub(crate) streaming: Streaming,
}

impl Lstm {
    /// An LSTM of `hidden` units.
    pub fn new(hidden: usize, output: RnnOutput) -> Lstm {
        Lstm { hidden, output, streaming: Streaming::No }
    }

    pub(crate) fn dims(&self, input: Shape) -> Dims {
        Dims::new(Cell::Lstm, self.hidden, self.output, self.streaming, input)
    }
}

impl Chain {
    /// An LSTM layer of `hidden` units over a sequence input (PyTorch's `nn.LSTM` with
    /// `batch_first=True`): its output is the sequence of hidden states (steps, hidden), or the
    /// last one (a vector) with [`RnnOutput::LastStep`].
    pub fn lstm(self, hidden: usize, output: RnnOutput) -> Chain {
        self.layer(Lstm::new(hidden, output).into())
    }
}

impl LayerKind for Lstm {
    const WORD: &'static str = "lstm";

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        recurrent::output_shape(Cell::Lstm, self.hidden, self.output, input)
    }

    fn params(&self, input: Shape, _output: Shape) -> Vec<TensorSpec> {
        recurrent::params(&self.dims(input))
    }

    fn kept(&self, input: Shape, _output: Shape) -> Option<Kept> {
        recurrent::kept(&self.dims(input))
    }

    /// `lstm HIDDEN sequence|last`
    fn describe(&self) -> String {
        recurrent::describe(Self::WORD, self.hidden, self.output)
    }

    fn parse(words: &Words) -> Result<Lstm> {
        let (hidden, output) = recurrent::parse(words)?;
        Ok(Lstm::new(hidden, output))
    }

    fn summary(&self, input: Shape) -> String {
        recurrent::summary(Cell::Lstm, self.hidden, self.output, input)
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
    let (gates, hprev, state, cprev) =
        (region(recurrent::GATES), region(recurrent::HPREV), region(recurrent::STATE), region(recurrent::CPREV));
    let (x, out) = (pass.region(step.input_region), pass.region(step.output_region));
    let w = recurrent::SpecWeights { d: *d, p: &pass.params[step.params.clone()] };
    let acts = &mut *pass.acts;
    let (h_final, c_final) = d.final_slots();
    for s in 0..pass.batch {
        let st = state.start + s * d.state_len();
        let mut h: Vec<F> = acts[st..st + h_len].to_vec();
        let mut c: Vec<F> = acts[st + p..st + p + h_len].to_vec();
        for t in 0..t_len {
            let xt: Vec<F> = acts[x.start + (s * t_len + t) * f_len..][..f_len].to_vec();
            acts[hprev.start + (s * t_len + t) * p..][..h_len].copy_from_slice(&h);
            acts[cprev.start + (s * t_len + t) * p..][..h_len].copy_from_slice(&c);
            let g0 = gates.start + (s * t_len + t) * d.row();
            let (mut h_next, mut c_next) = (vec![F::ZERO; h_len], vec![F::ZERO; h_len]);
            for u in 0..h_len {
                let a = |g: usize| {
                    let x_part = (0..f_len).fold(w.bias(0, g, u), |acc, j| acc + w.ih(g, u, j) * xt[j]);
                    (0..h_len).fold(x_part + w.bias(1, g, u), |acc, j| acc + w.hh(g, u, j) * h[j])
                };
                let (i, f, g, o) = (sigmoid(a(0)), sigmoid(a(1)), a(2).tanh(), sigmoid(a(3)));
                c_next[u] = f * c[u] + i * g;
                h_next[u] = o * c_next[u].tanh();
                for (block, v) in [i, f, g, o].into_iter().enumerate() {
                    acts[g0 + block * p + u] = v;
                }
            }
            (h, c) = (h_next, c_next);
            if d.output == RnnOutput::Sequence {
                acts[out.start + (s * t_len + t) * h_len..][..h_len].copy_from_slice(&h);
            }
        }
        acts[st + h_final..][..h_len].copy_from_slice(&h);
        acts[st + c_final..][..h_len].copy_from_slice(&c);
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
    let (gates, state, cprev) = (region(recurrent::GATES), region(recurrent::STATE), region(recurrent::CPREV));
    let hprev = region(recurrent::HPREV);
    let (x, out) = (pass.region(step.input_region), pass.region(step.output_region));
    let need_dx = pass.needs_dx(step);
    let w = recurrent::SpecWeights { d: *d, p: &pass.params[step.params.clone()] };
    let (acts, dacts) = (pass.acts, &mut *pass.dacts);
    let mut grads = vec![F::ZERO; step.params.len()];
    let (w_hh, b_ih) = (g_len * h_len * f_len, g_len * h_len * (f_len + h_len));
    let b_hh = b_ih + g_len * h_len;
    let (_, c_final) = d.final_slots();
    for s in 0..pass.batch {
        let (mut carried_h, mut carried_c) = (vec![F::ZERO; h_len], vec![F::ZERO; h_len]);
        for t in (0..t_len).rev() {
            let dy = |u: usize| match d.output {
                RnnOutput::Sequence => dacts[out.start + (s * t_len + t) * h_len + u],
                RnnOutput::LastStep if t + 1 == t_len => dacts[out.start + s * h_len + u],
                RnnOutput::LastStep => F::ZERO,
            };
            let dh: Vec<F> = (0..h_len).map(|u| carried_h[u] + dy(u)).collect();
            let g0 = gates.start + (s * t_len + t) * d.row();
            let xt = &acts[x.start + (s * t_len + t) * f_len..][..f_len];
            let hp = &acts[hprev.start + (s * t_len + t) * p..][..h_len];
            let c_prev = &acts[cprev.start + (s * t_len + t) * p..][..h_len];
            let c_now = if t + 1 == t_len {
                &acts[state.start + s * d.state_len() + c_final..][..h_len]
            } else {
                &acts[cprev.start + (s * t_len + t + 1) * p..][..h_len]
            };
            // pre-activation gradients of i, f, g, o (the same on both sides)
            let mut da = vec![vec![F::ZERO; h_len]; 4];
            for u in 0..h_len {
                let (i, f, g, o) = (acts[g0 + u], acts[g0 + p + u], acts[g0 + 2 * p + u], acts[g0 + 3 * p + u]);
                let tc = c_now[u].tanh();
                let dc = carried_c[u] + dh[u] * o * (F::ONE - tc * tc);
                da[0][u] = dc * g * i * (F::ONE - i);
                da[1][u] = dc * c_prev[u] * f * (F::ONE - f);
                da[2][u] = dc * i * (F::ONE - g * g);
                da[3][u] = dh[u] * tc * o * (F::ONE - o);
                carried_c[u] = dc * f;
            }
            for g in 0..g_len {
                for u in 0..h_len {
                    let row = g * h_len + u;
                    grads[b_ih + row] += da[g][u];
                    grads[b_hh + row] += da[g][u];
                    for j in 0..f_len {
                        grads[row * f_len + j] += da[g][u] * xt[j];
                    }
                    for j in 0..h_len {
                        grads[w_hh + row * h_len + j] += da[g][u] * hp[j];
                    }
                }
            }
            let each = || (0..g_len).flat_map(|g| (0..h_len).map(move |u| (g, u)));
            if need_dx {
                for j in 0..f_len {
                    dacts[x.start + (s * t_len + t) * f_len + j] = each().fold(F::ZERO, |acc, (g, u)| acc + da[g][u] * w.ih(g, u, j));
                }
            }
            for j in 0..h_len {
                carried_h[j] = each().fold(F::ZERO, |acc, (g, u)| acc + da[g][u] * w.hh(g, u, j));
            }
        }
    }
    pass.grads[step.params.clone()].copy_from_slice(&grads);
}
