//! What the GRU and LSTM rooms share: their sizes ([`Dims`]), tensors, kept regions and
//! model-file words; the weights' packed layout (`packed`); and the fast CPU passes over a batch
//! (`passes`; the per-sample time loops are in `cpu::recurrent`).
//!
//! # Layout
//!
//! A sample is a sequence (T steps, F features), step-major, as PyTorch's recurrent layers take
//! it with `batch_first=True`. The tensors are PyTorch's, in its order: `weight_ih_l0` (G·H, F),
//! `weight_hh_l0` (G·H, H), `bias_ih_l0` and `bias_hh_l0` (G·H), with G = 3 gates for a GRU
//! (r, z, n) and 4 for an LSTM (i, f, g, o), gate g's rows at g·H.
//!
//! The fast path pads each gate's block of H units to `padded` = H rounded up to [`LANES`] (the
//! widest vector), so that every gate of every step is whole vectors. It reads its weights in the
//! *packed layout*: W_ihᵀ and W_hhᵀ in panels of [`LANES`] units, panel q holding, for each of the
//! matrix's rows j (F or H), the G gates' units 16q … 16q + 15 (G·16 values, gate by gate), so that
//! a step of those units reads one contiguous run; then the biases, gate g's unit u at
//! g·padded + u; padding zero. A forward pass writes them into its workspace from the parameters;
//! the model of a [`crate::Stream`] on the CPU holds its parameters in that layout
//! ([`Streaming::Packed`]), so each of its calls reads them as they are.
//!
//! Kept regions per sample, each row `padded` values (a padding lane holds whatever the lanes'
//! arithmetic left there, and nothing reads it into a unit's value):
//!
//! - gates (T × 4·padded): the forward pass first writes each step's input products W_ih·x + b_ih
//!   into its first G blocks, then the step's gates over them (in training): a GRU's r, z, n and
//!   W_hn·h + b_hn (which its reset gate multiplies), an LSTM's i, f, g, o. The gradient buffer's
//!   twin holds the gates' pre-activation gradients (a GRU's: r, z, n input-side, then n's
//!   recurrent side).
//! - hprev (T × padded): h_{t−1} for each step t, the first the initial state; the products of the
//!   backward pass read it as one matrix of B·T rows. Its twin carries ∂L/∂h_{t−1}.
//! - state: the initial state (h₀; an LSTM's h₀ then c₀), set by the caller (zeros until then),
//!   then the final state (h_T; c_T), `padded` values each. A streaming model writes the final
//!   state over the initial one (it carries the state to its next call).
//! - cprev (LSTM, T × padded): c_{t−1} for each step, as hprev; its twin carries ∂L/∂c_{t−1}.

mod packed;
mod param_grads;
mod passes;

use super::kind::{Kept, TensorSpec};
use crate::chain::{fits, Fill, Plan, Shape, Step};
use crate::error::Result;
use crate::io::Words;
#[cfg(test)]
pub(crate) use packed::SpecWeights;
pub(crate) use packed::{pack, Weights};
pub(crate) use passes::{backward, forward};
use std::ops::Range;

/// Which time steps a recurrent layer outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RnnOutput {
    /// Every step's hidden state: a sequence (steps, hidden), PyTorch's `output`.
    Sequence,
    /// The last step's hidden state: a vector (hidden), PyTorch's `output[:, -1]` (= `h_n`).
    LastStep,
}

/// Units a gate's block is padded to: the lanes of the widest vector the fast path uses.
pub(crate) const LANES: usize = 16;

/// The kind of recurrent cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cell {
    Gru,
    Lstm,
}

impl Cell {
    /// Gates: 3 (r, z, n) or 4 (i, f, g, o).
    pub fn gates(self) -> usize {
        match self {
            Cell::Gru => 3,
            Cell::Lstm => 4,
        }
    }

    /// The blocks of a step's kept gates whose gradients are each gate's input-side
    /// pre-activation gradient (the rows of `weight_ih_l0` and `bias_ih_l0`, in gate order).
    pub fn input_blocks(self) -> &'static [usize] {
        match self {
            Cell::Gru => &[0, 1, 2],
            Cell::Lstm => &[0, 1, 2, 3],
        }
    }

    /// The same for the recurrent side (`weight_hh_l0`, `bias_hh_l0`): a GRU's n gate has its
    /// own, the gradient of W_hn·h + b_hn (block 3).
    pub fn hidden_blocks(self) -> &'static [usize] {
        match self {
            Cell::Gru => &[0, 1, 3],
            Cell::Lstm => &[0, 1, 2, 3],
        }
    }

    /// Its name in summaries and errors.
    pub fn name(self) -> &'static str {
        match self {
            Cell::Gru => "GRU",
            Cell::Lstm => "LSTM",
        }
    }
}

/// The kept regions, in order (indices past `Step::kept.start`).
pub(crate) const GATES: usize = 0;
pub(crate) const HPREV: usize = 1;
pub(crate) const STATE: usize = 2;
pub(crate) const CPREV: usize = 3;

/// What a recurrent layer of a stream's model does differently (see `stream.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Streaming {
    /// Nothing: an ordinary layer.
    No,
    /// It writes its final state over its initial one (carries it to the next call).
    Carry,
    /// As `Carry`, with its parameters in the packed layout (a stream on the CPU).
    Packed,
}

/// The sizes of one recurrent step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub cell: Cell,
    pub steps: usize,
    pub features: usize,
    pub hidden: usize,
    /// `hidden` rounded up to [`LANES`].
    pub padded: usize,
    pub output: RnnOutput,
    /// The final state written over the initial one.
    pub carry: bool,
    /// Parameters in the packed layout.
    pub packed: bool,
}

impl Dims {
    /// The sizes on `input`, a sequence (the shape rule checked it, and that they fit).
    pub fn new(cell: Cell, hidden: usize, output: RnnOutput, streaming: Streaming, input: Shape) -> Dims {
        let Shape::Sequence { steps, features } = input else { unreachable!("the plan gives recurrent layers sequence inputs") };
        let (carry, packed) = (streaming != Streaming::No, streaming == Streaming::Packed);
        Dims { cell, steps, features, hidden, padded: hidden.next_multiple_of(LANES), output, carry, packed }
    }

    pub fn gates(&self) -> usize {
        self.cell.gates()
    }

    /// Columns of the transposed weights: G·padded.
    pub fn k(&self) -> usize {
        self.gates() * self.padded
    }

    /// A step's kept gate values: 4·padded.
    pub fn row(&self) -> usize {
        4 * self.padded
    }

    /// The state per sample: initial and final h (and c), `padded` values each.
    pub fn state_len(&self) -> usize {
        match self.cell {
            Cell::Gru => 2 * self.padded,
            Cell::Lstm => 4 * self.padded,
        }
    }

    /// Where the final h (and c) go in the state: over the initial ones when streaming.
    pub fn final_slots(&self) -> (usize, usize) {
        let (h0, c0) = (0, self.padded);
        match (self.carry, self.cell) {
            (true, _) => (h0, c0),
            (false, Cell::Gru) => (self.padded, 0),
            (false, Cell::Lstm) => (2 * self.padded, 3 * self.padded),
        }
    }

    /// Output values per sample.
    pub fn out_len(&self) -> usize {
        match self.output {
            RnnOutput::Sequence => self.steps * self.hidden,
            RnnOutput::LastStep => self.hidden,
        }
    }

    /// The four tensors in the packed layout: (F + H + 2)·K.
    pub fn packed_len(&self) -> usize {
        (self.features + self.hidden + 2) * self.k()
    }

    /// W_hh with its rows padded (G·H × padded), for the backward pass's products.
    pub fn rows_len(&self) -> usize {
        self.gates() * self.hidden * self.padded
    }

    /// Workspace values the backward pass takes: W_hh's padded rows ([`Dims::rows_len`]) while
    /// it runs through time, then the weight gradients' transposes ((F + H) × 4·padded).
    pub fn backward_room(&self) -> usize {
        self.rows_len().max((self.features + self.hidden) * self.row())
    }

    /// Values of the workspace this step's packed weights take: none where the parameters are
    /// in the packed layout already (a stream's model, which is not trained).
    pub fn packed_room(&self) -> usize {
        if self.packed {
            0
        } else {
            self.packed_len()
        }
    }
}

/// The shape rule: a sequence (steps, features) gives a sequence (steps, hidden) or, for the last
/// step alone, a vector (hidden). Checks that the sizes the layer derives fit.
pub(crate) fn output_shape(cell: Cell, hidden: usize, output: RnnOutput, input: Shape) -> std::result::Result<Shape, String> {
    let name = cell.name();
    let Shape::Sequence { steps, features } = input else {
        return Err(format!("a {name} layer needs a sequence input (steps, features)"));
    };
    if hidden == 0 {
        return Err(format!("a {name} layer needs at least one hidden unit"));
    }
    let g = cell.gates();
    let padded = hidden.checked_next_multiple_of(LANES);
    // its kept values a sample, its tensors in either layout and its workspace
    let sizes = padded.and_then(|p| {
        let row = steps.checked_mul(4)?.checked_mul(p)?;
        let k = g.checked_mul(p)?;
        let packed = features.checked_add(hidden)?.checked_add(2)?.checked_mul(k)?;
        let tensors = g.checked_mul(hidden)?.checked_mul(features.checked_add(hidden)?.checked_add(2)?)?;
        let transposes = features.checked_add(hidden)?.checked_mul(4)?.checked_mul(p)?;
        Some([row, packed, tensors, g.checked_mul(hidden)?.checked_mul(p)?, transposes])
    });
    if sizes.is_none_or(|s| s.iter().any(|&n| fits(Some(n)).is_none())) {
        return Err(format!("a {name} of {hidden} units over {input} needs more values than any buffer can hold"));
    }
    Ok(match output {
        RnnOutput::Sequence => Shape::Sequence { steps, features: hidden },
        RnnOutput::LastStep => Shape::Vector(hidden),
    })
}

/// Its tensors: PyTorch's, or the packed layout's (same names).
pub(crate) fn params(d: &Dims) -> Vec<TensorSpec> {
    let (g, f, h, k) = (d.gates(), d.features, d.hidden, d.k());
    let (ih, hh, b) = if d.packed { (vec![f, k], vec![h, k], vec![k]) } else { (vec![g * h, f], vec![g * h, h], vec![g * h]) };
    vec![
        TensorSpec { name: "weight_ih_l0", shape: ih, fill: Fill::Fans { fan_in: f, fan_out: h } },
        TensorSpec { name: "weight_hh_l0", shape: hh, fill: Fill::Fans { fan_in: h, fan_out: h } },
        TensorSpec { name: "bias_ih_l0", shape: b.clone(), fill: Fill::Constant(0.0) },
        TensorSpec { name: "bias_hh_l0", shape: b, fill: Fill::Constant(0.0) },
    ]
}

/// Its kept regions per sample (see the module docs); None where a size overflows.
pub(crate) fn kept(d: &Dims) -> Option<Kept> {
    let per_step = |n: usize| fits(d.steps.checked_mul(n));
    let mut regions = vec![per_step(d.row())?, per_step(d.padded)?, d.state_len()];
    if d.cell == Cell::Lstm {
        regions.push(per_step(d.padded)?);
    }
    Some(Kept { regions, saved: 0 })
}

/// `WORD HIDDEN sequence|last`
pub(crate) fn describe(word: &str, hidden: usize, output: RnnOutput) -> String {
    let which = match output {
        RnnOutput::Sequence => "sequence",
        RnnOutput::LastStep => "last",
    };
    format!("{word} {hidden} {which}")
}

/// The hidden size and output of `WORD HIDDEN sequence|last`.
pub(crate) fn parse(words: &Words) -> Result<(usize, RnnOutput)> {
    let [hidden] = words.numbers()?;
    match words.last_word(2)? {
        "sequence" => Ok((hidden, RnnOutput::Sequence)),
        "last" => Ok((hidden, RnnOutput::LastStep)),
        _ => Err(words.unknown()),
    }
}

/// `GRU(8 → 64, last step)`
pub(crate) fn summary(cell: Cell, hidden: usize, output: RnnOutput, input: Shape) -> String {
    let features = match input {
        Shape::Sequence { features, .. } => features,
        _ => 0,
    };
    let which = match output {
        RnnOutput::Sequence => "every step",
        RnnOutput::LastStep => "last step",
    };
    format!("{}({features} → {hidden}, {which})", cell.name())
}

/// Workspace values the fast passes of `plan`'s recurrent steps need: each step's packed weights
/// ([`packed_at`]), kept between passes of one parameter version, then the backward pass's room
/// for any of them ([`rows_at`]: W_hh's padded rows, then the weight gradients' transposes).
/// (Saturating: a sum past memory fails the allocation.)
pub(crate) fn workspace_len(plan: &Plan) -> usize {
    let rows = plan.steps.iter().filter_map(dims).map(|d| d.backward_room()).max().unwrap_or(0);
    packed_end(plan, plan.steps.len()).saturating_add(rows)
}

/// Where in the workspace step `index`'s packed weights lie.
pub(crate) fn packed_at(plan: &Plan, index: usize) -> Range<usize> {
    let start = packed_end(plan, index);
    start..start + dims(&plan.steps[index]).map_or(0, |d| d.packed_room())
}

/// Where in the workspace step `index`'s backward pass has its room ([`Dims::backward_room`]).
pub(crate) fn rows_at(plan: &Plan, index: usize) -> Range<usize> {
    let start = packed_end(plan, plan.steps.len());
    start..start + dims(&plan.steps[index]).map_or(0, |d| d.backward_room())
}

/// The packed weights of the steps before `index`: where step `index`'s begin.
fn packed_end(plan: &Plan, index: usize) -> usize {
    plan.steps[..index].iter().filter_map(dims).fold(0, |sum, d| sum.saturating_add(d.packed_room()))
}

/// Every recurrent step's weights from `params` (the model's, in PyTorch's layout) in the packed
/// layout, into its place in `ws` (at least [`workspace_len`] values; a GPU cache's empty
/// workspace is left alone).
pub(crate) fn pack_all(plan: &Plan, params: &[f32], ws: &mut [f32]) {
    if ws.len() < workspace_len(plan) {
        return;
    }
    for (index, step) in plan.steps.iter().enumerate() {
        if let Some(d) = dims(step).filter(|d| !d.packed) {
            pack(&d, &params[step.params.clone()], &mut ws[packed_at(plan, index)]);
        }
    }
}

/// A recurrent step's sizes; None for other layers.
pub(crate) fn dims(step: &Step) -> Option<Dims> {
    match step.layer {
        super::Layer::Gru(l) => Some(l.dims(step.input)),
        super::Layer::Lstm(l) => Some(l.dims(step.input)),
        _ => None,
    }
}
