//! What the GRU and LSTM rooms share: their sizes ([`Dims`]), tensors, kept regions and
//! model-file words, the weights' streaming layout, and the fast CPU passes (the per-sample time
//! loops are in `cpu::recurrent`).
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

use super::kind::{Kept, Mode, TensorSpec};
use super::{BackPass, Pass};
use crate::chain::{fits, Fill, Plan, Shape, Step};
use crate::cpu::gemm::{sgemm, Mat, MatMut};
use crate::cpu::recurrent::{backward_group, forward_group, pack_panels, BackSample, Sample, GROUP};
use crate::cpu::{for_chunks, SharedMut};
use crate::error::Result;
use crate::io::Words;
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

    /// Workspace values the fast passes need: the packed weights, then W_hh's padded rows for the
    /// backward pass (a stream's model reads its parameters as they are, and is not trained).
    pub fn workspace_len(&self) -> usize {
        if self.packed {
            0
        } else {
            self.packed_len().max(self.rows_len())
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
        Some([row, packed, tensors, g.checked_mul(hidden)?.checked_mul(p)?])
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

/// The four tensors in the packed layout, as slices of `packed` (`Dims::packed_len` values).
pub(crate) struct Weights<'a> {
    /// W_ihᵀ in panels: panel q is F rows of G·16 values (`Dims::k` × F in all)
    pub ih: &'a [f32],
    /// W_hhᵀ in panels: panel q is H rows of G·16 values
    pub hh: &'a [f32],
    pub b_ih: &'a [f32],
    pub b_hh: &'a [f32],
}

impl<'a> Weights<'a> {
    pub fn of(d: &Dims, packed: &'a [f32]) -> Weights<'a> {
        let k = d.k();
        let (ih, rest) = packed[..d.packed_len()].split_at(d.features * k);
        let (hh, rest) = rest.split_at(d.hidden * k);
        let (b_ih, b_hh) = rest.split_at(k);
        Weights { ih, hh, b_ih, b_hh }
    }
}

/// Writes `params` (the step's tensors in PyTorch's layout) in the packed layout into `packed`
/// (`Dims::packed_len` values): W_ihᵀ and W_hhᵀ in panels (see the module docs), the biases with
/// gate g's unit u at g·padded + u, padding zero.
pub(crate) fn pack(d: &Dims, params: &[f32], packed: &mut [f32]) {
    let (g, f, h, p, k) = (d.gates(), d.features, d.hidden, d.padded, d.k());
    let (w_ih, rest) = params.split_at(g * h * f);
    let (w_hh, rest) = rest.split_at(g * h * h);
    let (b_ih, b_hh) = rest.split_at(g * h);
    let packed = &mut packed[..d.packed_len()];
    let (ih, rest) = packed.split_at_mut(f * k);
    let (hh, rest) = rest.split_at_mut(h * k);
    pack_panels(g, h, f, w_ih, ih);
    pack_panels(g, h, h, w_hh, hh);
    let (pb_ih, pb_hh) = rest.split_at_mut(k);
    for (src, dst) in [(b_ih, pb_ih), (b_hh, pb_hh)] {
        for (block, dst) in src.chunks_exact(h).zip(dst.chunks_exact_mut(p)) {
            dst[..h].copy_from_slice(block);
            dst[h..].fill(0.0);
        }
    }
}

/// Where the packed layout keeps W[gate·H + u, j] of a matrix of `rows` rows (F or H): in panel
/// u / 16, row j, gate's 16 values, lane u mod 16 (the definition `pack` is tested against).
#[cfg(test)]
pub(crate) fn panel_at(gates: usize, rows: usize, gate: usize, u: usize, j: usize) -> usize {
    ((u / LANES * rows + j) * gates + gate) * LANES + u % LANES
}

/// W_hh (G·H × H, in `params`' PyTorch layout) with each row padded to `padded` values, into
/// `rows` (`Dims::rows_len`): the backward pass's ∂L/∂h_{t−1} = Σ_g dg_gᵀ·W_hh,g.
fn pack_rows(d: &Dims, params: &[f32], rows: &mut [f32]) {
    let (g, f, h, p) = (d.gates(), d.features, d.hidden, d.padded);
    let w_hh = &params[g * h * f..][..g * h * h];
    for (dst, src) in rows[..d.rows_len()].chunks_exact_mut(p).zip(w_hh.chunks_exact(h)) {
        dst[..h].copy_from_slice(src);
        dst[h..].fill(0.0);
    }
}

/// Workspace values the fast passes of `plan`'s recurrent steps need (the largest).
pub(crate) fn workspace_len(plan: &Plan) -> usize {
    plan.steps.iter().filter_map(dims).map(|d| d.workspace_len()).max().unwrap_or(0)
}

/// A recurrent step's sizes; None for other layers.
pub(crate) fn dims(step: &Step) -> Option<Dims> {
    match step.layer {
        super::Layer::Gru(l) => Some(l.dims(step.input)),
        super::Layer::Lstm(l) => Some(l.dims(step.input)),
        _ => None,
    }
}

/// The regions of a recurrent step for a batch: (x, out, gates, hprev, state, cprev; an empty
/// range for a GRU's cprev).
struct Regions {
    x: Range<usize>,
    out: Range<usize>,
    gates: Range<usize>,
    hprev: Range<usize>,
    state: Range<usize>,
    cprev: Range<usize>,
}

impl Regions {
    fn of(d: &Dims, step: &Step, region: impl Fn(usize) -> Range<usize>) -> Regions {
        let kept = |i: usize| region(step.kept.start + i);
        let cprev = if d.cell == Cell::Lstm { kept(CPREV) } else { 0..0 };
        Regions {
            x: region(step.input_region),
            out: region(step.output_region),
            gates: kept(GATES),
            hprev: kept(HPREV),
            state: kept(STATE),
            cprev,
        }
    }
}

/// Sample `s`'s part of `range`, `len` values a sample.
fn part(range: &Range<usize>, s: usize, len: usize) -> Range<usize> {
    let start = range.start + s * len;
    start..start + len
}

/// The fast forward: the samples' sequences on the threads of the pool (they are independent),
/// a group of them at a time: the input products of all their steps first, then one step after
/// another (`cpu::recurrent`).
pub(crate) fn forward(d: &Dims, step: &Step, pass: &mut Pass, mode: Mode) {
    let r = Regions::of(d, step, |i| pass.region(i));
    let params = &pass.params[step.params.clone()];
    let weights = if d.packed {
        Weights::of(d, params)
    } else {
        let packed = &mut pass.ws.rnn[..d.packed_len()];
        pack(d, params, packed);
        Weights::of(d, packed)
    };
    let (t, f, p) = (d.steps, d.features, d.padded);
    let keep = mode == Mode::Train;
    let acts = SharedMut::new(&mut *pass.acts);
    let sample = |s: usize| {
        // SAFETY: the step's regions are distinct, and sample s's part of each is its own (each
        // sample is taken once, by the one task whose chunk holds it).
        unsafe {
            Sample {
                x: acts.slice(part(&r.x, s, t * f)),
                out: acts.slice(part(&r.out, s, d.out_len())),
                gates: acts.slice(part(&r.gates, s, t * d.row())),
                hprev: acts.slice(part(&r.hprev, s, t * p)),
                state: acts.slice(part(&r.state, s, d.state_len())),
                cprev: acts.slice(part(&r.cprev, s, if r.cprev.is_empty() { 0 } else { t * p })),
            }
        }
    };
    for_chunks(pass.pool, pass.batch, 1, &|_, samples| {
        for first in samples.clone().step_by(GROUP) {
            let n = GROUP.min(samples.end - first);
            if n == 1 {
                // (a stream's usual call: no group to fill)
                forward_group(d, &weights, &mut [sample(first)], keep);
                continue;
            }
            let mut group: [Sample; GROUP] = std::array::from_fn(|i| if i < n { sample(first + i) } else { Sample::none() });
            forward_group(d, &weights, &mut group[..n], keep);
        }
    });
}

/// The fast backward (through time): the samples' steps from the last to the first on the threads
/// of the pool, a group of them in lockstep at a time (`cpu::recurrent`), which leaves every
/// step's gate gradients in the gates' twin; then the weight gradients, the bias gradients and
/// (with `need_dx`) the input gradient over all B·T steps at once, as products.
pub(crate) fn backward(d: &Dims, step: &Step, pass: &mut BackPass, need_dx: bool) {
    let r = Regions::of(d, step, |i| pass.region(i));
    let params = &pass.params[step.params.clone()];
    let rows = &mut pass.ws.rnn[..d.rows_len()];
    pack_rows(d, params, rows);
    let rows = &*rows;
    let (t, p) = (d.steps, d.padded);
    let (acts, dacts) = (pass.acts, SharedMut::new(&mut *pass.dacts));
    let sample = |s: usize| BackSample {
        gates: &acts[part(&r.gates, s, t * d.row())],
        hprev: &acts[part(&r.hprev, s, t * p)],
        state: &acts[part(&r.state, s, d.state_len())],
        cprev: &acts[part(&r.cprev, s, if r.cprev.is_empty() { 0 } else { t * p })],
        // SAFETY: the output's gradient is read, the kept regions' twins written: distinct
        // regions, and sample s's part of each is its own (each sample is taken once, by the one
        // task whose chunk holds it).
        dy: unsafe { dacts.slice(part(&r.out, s, d.out_len())) },
        // SAFETY: as above.
        dgates: unsafe { dacts.slice(part(&r.gates, s, t * d.row())) },
        // SAFETY: as above.
        dhprev: unsafe { dacts.slice(part(&r.hprev, s, t * p)) },
        // SAFETY: as above.
        dstate: unsafe { dacts.slice(part(&r.state, s, d.state_len())) },
        // SAFETY: as above.
        dcprev: unsafe { dacts.slice(part(&r.cprev, s, if r.cprev.is_empty() { 0 } else { t * p })) },
    };
    for_chunks(pass.pool, pass.batch, 1, &|_, samples| {
        for first in samples.clone().step_by(GROUP) {
            let n = GROUP.min(samples.end - first);
            let mut group: [BackSample; GROUP] = std::array::from_fn(|i| if i < n { sample(first + i) } else { BackSample::none() });
            backward_group(d, rows, &mut group[..n]);
        }
    });
    let (acts, dacts) = (pass.acts, &mut *pass.dacts);
    let (dx_all, rest) = dacts.split_at_mut(r.gates.start);
    let dg = &rest[..r.gates.len()];
    let m = pass.batch * t;
    let (g, f, h, row) = (d.gates(), d.features, d.hidden, d.row());
    let grads = &mut pass.grads[step.params.clone()];
    let (dw_ih, rest) = grads.split_at_mut(g * h * f);
    let (dw_hh, rest) = rest.split_at_mut(g * h * h);
    let (db_ih, db_hh) = rest.split_at_mut(g * h);
    let (x, hprev) = (&acts[r.x.clone()], &acts[r.hprev.clone()]);
    let gemm = &mut pass.ws.gemm;
    // a gate's gradients over the B·T steps: H × m, element (u, row) at dg[row·4p + block·p + u]
    let dg_t = |block: usize| Mat { data: &dg[block * p..], rs: 1, cs: row };
    for (gate, &block) in d.cell.input_blocks().iter().enumerate() {
        // dW_ih,g (H × F) = dg_gᵀ · X (m × F)
        let dw = MatMut { data: &mut dw_ih[gate * h * f..][..h * f], rs: f, cs: 1 };
        sgemm(pass.pool, gemm, h, f, m, 1.0, dg_t(block), Mat { data: x, rs: f, cs: 1 }, 0.0, dw);
    }
    for (gate, &block) in d.cell.hidden_blocks().iter().enumerate() {
        // dW_hh,g (H × H) = dg_gᵀ · H_prev (m × H, rows of `padded`)
        let dw = MatMut { data: &mut dw_hh[gate * h * h..][..h * h], rs: h, cs: 1 };
        sgemm(pass.pool, gemm, h, h, m, 1.0, dg_t(block), Mat { data: hprev, rs: p, cs: 1 }, 0.0, dw);
    }
    column_sums(d, d.cell.input_blocks(), dg, m, db_ih);
    column_sums(d, d.cell.hidden_blocks(), dg, m, db_hh);
    if need_dx {
        // dX (m × F) = Σ_g dg_g (m × H) · W_ih,g (H × F)
        let w_ih = &params[..g * h * f];
        let dx = &mut dx_all[r.x.clone()];
        for (gate, &block) in d.cell.input_blocks().iter().enumerate() {
            let a = Mat { data: &dg[block * p..], rs: row, cs: 1 };
            let b = Mat { data: &w_ih[gate * h * f..], rs: f, cs: 1 };
            let beta = if gate == 0 { 0.0 } else { 1.0 };
            sgemm(pass.pool, gemm, m, f, h, 1.0, a, b, beta, MatMut { data: &mut dx[..], rs: f, cs: 1 });
        }
    }
}

/// db[g·H + u] = Σ over the m steps of dg[row·4p + blocks[g]·p + u], row by row in order.
fn column_sums(d: &Dims, blocks: &[usize], dg: &[f32], m: usize, db: &mut [f32]) {
    let (h, p) = (d.hidden, d.padded);
    db.fill(0.0);
    for row in dg[..m * d.row()].chunks_exact(d.row()) {
        for (db, &block) in db.chunks_exact_mut(h).zip(blocks) {
            db.iter_mut().zip(&row[block * p..][..h]).for_each(|(s, &v)| *s += v);
        }
    }
}

/// The plain loops' view of a step's weights in either layout: gate g's unit u.
#[cfg(test)]
pub(crate) struct SpecWeights<'a, F> {
    pub d: Dims,
    pub p: &'a [F],
}

#[cfg(test)]
impl<F: crate::float::Float> SpecWeights<'_, F> {
    /// W_ih[g·H + u, j]
    pub fn ih(&self, g: usize, u: usize, j: usize) -> F {
        let d = &self.d;
        if d.packed {
            self.p[panel_at(d.gates(), d.features, g, u, j)]
        } else {
            self.p[(g * d.hidden + u) * d.features + j]
        }
    }

    /// W_hh[g·H + u, j]
    pub fn hh(&self, g: usize, u: usize, j: usize) -> F {
        let d = &self.d;
        if d.packed {
            self.p[d.features * d.k() + panel_at(d.gates(), d.hidden, g, u, j)]
        } else {
            self.p[d.gates() * d.hidden * d.features + (g * d.hidden + u) * d.hidden + j]
        }
    }

    /// b_ih[g·H + u] (`which` 0) or b_hh[g·H + u] (1)
    pub fn bias(&self, which: usize, g: usize, u: usize) -> F {
        let d = &self.d;
        if d.packed {
            self.p[(d.features + d.hidden + which) * d.k() + g * d.padded + u]
        } else {
            self.p[d.gates() * d.hidden * (d.features + d.hidden + which) + g * d.hidden + u]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Chain;
    use crate::loss::Loss;
    use crate::testutil::rel_err;
    use safetensors::SafeTensors;

    fn values(file: &SafeTensors, name: &str) -> Vec<f32> {
        let view = file.tensor(name).unwrap_or_else(|e| panic!("the fixture has no tensor {name}: {e}"));
        view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    /// The input's gradient of PyTorch's model in tests/fixtures/recurrent_{kind}.safetensors (see
    /// tests/parity_recurrent.rs, which checks the rest through the public API): the model's
    /// backward pass, then its first layer's again with the input's gradient asked for.
    fn input_gradient_matches_pytorch(kind: &str, chain: Chain) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/recurrent_{kind}.safetensors"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!("{}: {e}: make it with `python3 tests/fixtures/make_recurrent.py` (torch and safetensors)", path.display())
        });
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let mut model = chain.build().unwrap().with_threads(1).unwrap();
        let plan = model.plan.clone();
        for step in &plan.steps {
            for t in &step.tensors {
                model.params[t.range.clone()].copy_from_slice(&values(&file, &format!("{}.{}", step.module, t.name)));
            }
        }
        let (mut fwd, mut bwd) = (model.preallocate(2).unwrap(), model.preallocate_grads(2).unwrap());
        for layer in 0..2 {
            let (h, c) = (
                values(&file, &format!("h0.{layer}")),
                file.tensor(&format!("c0.{layer}")).ok().map(|_| values(&file, &format!("c0.{layer}"))),
            );
            let n = h.len() / 2;
            let state: Vec<f32> = (0..2)
                .flat_map(|s| h[s * n..][..n].iter().chain(c.as_deref().map_or(&[][..], |c| &c[s * n..][..n])).copied().collect::<Vec<_>>())
                .collect();
            fwd.set_state(layer, &state).unwrap();
        }
        fwd.set_inputs(&values(&file, "x")).unwrap();
        fwd.set_targets(&values(&file, "target")).unwrap();
        model.backprop(&mut bwd, &mut fwd, Loss::Mse).unwrap();
        let step = &plan.steps[0];
        let mut pass = BackPass {
            plan: &plan,
            index: 0,
            params: &model.params,
            acts: &fwd.acts,
            dacts: &mut bwd.dacts,
            grads: &mut bwd.grads,
            capacity: 2,
            batch: 2,
            pool: &model.pool,
            ws: &mut fwd.ws,
            gws: &mut bwd.gws,
            // (no dropout here)
            draw: crate::layers::Draw { seed: 0, pass: 0, replica: 0 },
        };
        backward(&dims(step).unwrap(), step, &mut pass, true);
        let dx = &bwd.dacts[crate::layers::region(&plan, 0, 2, 2)];
        let err = rel_err(dx, &values(&file, "grad.x"));
        println!("{kind}: d loss / d x rel err {err:.1e}");
        assert!(err <= 1e-5, "{kind}: d loss / d x differs from PyTorch's by {err:e}");
    }

    /// The packed layout as [`panel_at`] and the module docs define it, on sizes that leave
    /// ragged blocks (the transposes take whole 8 × 8 blocks, the rest goes one value at a time);
    /// padding is zero.
    #[test]
    fn packing_puts_each_weight_where_the_layout_says() {
        for (cell, hidden, features) in [(Cell::Gru, 1, 1), (Cell::Lstm, 17, 3), (Cell::Gru, 40, 9), (Cell::Lstm, 64, 16)] {
            let d = Dims::new(cell, hidden, RnnOutput::Sequence, Streaming::No, Shape::sequence(2, features));
            let (g, f, h, p, k) = (d.gates(), features, hidden, d.padded, d.k());
            let params: Vec<f32> = (0..g * h * (f + h + 2)).map(|i| i as f32 + 1.0).collect();
            let mut packed = vec![f32::NAN; d.packed_len()];
            pack(&d, &params, &mut packed);
            let mut want = vec![0.0; d.packed_len()];
            for gate in 0..g {
                for u in 0..h {
                    let row = gate * h + u;
                    for j in 0..f {
                        want[panel_at(g, f, gate, u, j)] = params[row * f + j];
                    }
                    for j in 0..h {
                        want[f * k + panel_at(g, h, gate, u, j)] = params[g * h * f + row * h + j];
                    }
                    want[(f + h) * k + gate * p + u] = params[g * h * (f + h) + row];
                    want[(f + h + 1) * k + gate * p + u] = params[g * h * (f + h + 1) + row];
                }
            }
            assert_eq!(packed, want, "{cell:?} {hidden}×{features}");
        }
    }

    #[test]
    fn gru_input_gradient_matches_pytorch() {
        let chain = Chain::new(Shape::sequence(4, 3)).gru(5, RnnOutput::Sequence).gru(4, RnnOutput::LastStep).dense(3, crate::Identity);
        input_gradient_matches_pytorch("gru", chain);
    }

    #[test]
    fn lstm_input_gradient_matches_pytorch() {
        let chain = Chain::new(Shape::sequence(4, 3)).lstm(5, RnnOutput::Sequence).lstm(4, RnnOutput::LastStep).dense(3, crate::Identity);
        input_gradient_matches_pytorch("lstm", chain);
    }
}
