//! A group's forward pass (see [`super::forward_group`]): every step's input products, then the
//! steps one after another, several samples at once (`cells`), and the outputs copied out; and
//! the parts of one sample's steps whose units are split among threads ([`split_part`], for
//! [`super::forward_split`]), each step's row then reached through [`PanelRow`].

use super::cells::{gru_step, lstm_step, LSTM_TILE};
use super::{Sample, PANEL};
use crate::cpu::vmath::lanes::Lanes;
use crate::cpu::SharedMut;
use crate::layers::recurrent::{Cell, Dims, RnnOutput, Weights};

/// The forward pass of a group (see [`forward_group`]); `VPP` vectors of `V` make a panel.
#[inline(always)]
pub(super) fn forward<V: Lanes, const VPP: usize, const LSTM: bool>(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
    debug_assert_eq!(LSTM, d.cell == Cell::Lstm);
    debug_assert_eq!(VPP * V::LANES, PANEL);
    for s in group.iter_mut() {
        inputs::<V, VPP>(d, w, s);
    }
    // samples a step takes at once: a GRU's accumulators (3 gates, two chains each: 24) and
    // weights within AVX-512's 32 registers, one elsewhere; an LSTM's, see LSTM_TILE
    let rows = match (VPP, LSTM) {
        (1, false) => 4,
        (1, true) => LSTM_TILE,
        (_, true) => LSTM_TILE / 2,
        _ => 1,
    };
    for samples in group.chunks_mut(rows) {
        match samples.len() {
            8 if LSTM => steps_of::<V, VPP, 8, LSTM>(d, w, samples, keep),
            7 if LSTM => steps_of::<V, VPP, 7, LSTM>(d, w, samples, keep),
            6 if LSTM => steps_of::<V, VPP, 6, LSTM>(d, w, samples, keep),
            5 if LSTM => steps_of::<V, VPP, 5, LSTM>(d, w, samples, keep),
            4 => steps_of::<V, VPP, 4, LSTM>(d, w, samples, keep),
            3 => steps_of::<V, VPP, 3, LSTM>(d, w, samples, keep),
            2 => steps_of::<V, VPP, 2, LSTM>(d, w, samples, keep),
            _ => steps_of::<V, VPP, 1, LSTM>(d, w, samples, keep),
        }
    }
}

/// A sample's input products of every step (W_ih·x_t + b_ih, G blocks of `padded`), and h_0
/// (c_0) into the first row of hprev (cprev).
#[inline(always)]
pub(super) fn inputs<V: Lanes, const VPP: usize>(d: &Dims, w: &Weights, s: &mut Sample) {
    let (steps, f, p, row, lstm) = (d.steps, d.features, d.padded, d.row(), d.cell == Cell::Lstm);
    // steps whose input products are summed at once: a panel's accumulators for each (with
    // AVX-512, a vector of each gate: four LSTM steps make 16 chains of fused multiply-adds, not
    // the 4 that one step's F-long chains would leave the FMA units waiting on)
    let at_once = if VPP == 1 { 4 } else { 1 };
    let mut t = 0;
    while t < steps {
        let n = if t + at_once <= steps { at_once } else { 1 };
        let (x, g) = (&s.x[t * f..][..n * f], &mut s.gates[t * row..][..n * row]);
        match (lstm, n) {
            (true, 4) => input_products::<V, VPP, 4, 4>(d, w, x, g),
            (true, _) => input_products::<V, VPP, 4, 1>(d, w, x, g),
            (false, 4) => input_products::<V, VPP, 3, 4>(d, w, x, g),
            (false, _) => input_products::<V, VPP, 3, 1>(d, w, x, g),
        }
        t += n;
    }
    copy::<V>(&s.state[..p], &mut s.hprev[..p]);
    if lstm {
        copy::<V>(&s.state[p..2 * p], &mut s.cprev[..p]);
    }
}

/// A sample's outputs once its steps are done: every step's h_t (a sequence's) or the last.
#[inline(always)]
pub(super) fn outputs<V: Lanes>(d: &Dims, s: &mut Sample) {
    let (steps, h, p) = (d.steps, d.hidden, d.padded);
    let (h_final, _) = d.final_slots();
    match d.output {
        RnnOutput::Sequence => {
            for t in 0..steps {
                let h_t = if t + 1 == steps { &s.state[h_final..][..h] } else { &s.hprev[(t + 1) * p..][..h] };
                copy::<V>(h_t, &mut s.out[t * h..][..h]);
            }
        }
        RnnOutput::LastStep => copy::<V>(&s.state[h_final..][..h], &mut s.out[..h]),
    }
}

/// Panels of the packed weights a part of a split step takes: two, as a single sample's step
/// takes them at once with AVX-512.
const PART_PANELS: usize = 2;

/// How many parts a step of `d` splits into among threads ([`split_part`]).
pub(super) fn split_parts(d: &Dims) -> usize {
    (d.padded / PANEL).div_ceil(PART_PANELS)
}

/// How many of a pool's `threads` split the steps of one sample of `d` ([`super::forward_split`]):
/// one for each two parts of a step, so that a thread's share of a step is worth its hand-off to
/// the next (with one part a thread, gru_seq's GRU of 64 units took 3 % longer on two threads than
/// on one; lstm_seq's LSTM of 128, four parts, 0.69 of the time); 1: none to split.
pub(crate) fn split_threads(d: &Dims, threads: usize) -> usize {
    threads.min(split_parts(d) / 2).max(1)
}

/// Part `part` of step t of the sample `s` (its units in panels `part·PART_PANELS ..`): the
/// same values, bit for bit, as the whole step computes for those units.
///
/// # Safety
/// Step t − 1 is done (all its parts), no part of another step runs meanwhile, and no other
/// thread runs this same part (see [`PanelRow::of`]).
#[inline(always)]
pub(super) unsafe fn split_part<V: Lanes, const VPP: usize, const LSTM: bool>(
    d: &Dims,
    w: &Weights,
    s: &SharedSample,
    t: usize,
    part: usize,
) {
    let panels = d.padded / PANEL;
    let mine = part * PART_PANELS..((part + 1) * PART_PANELS).min(panels);
    // SAFETY: the caller's contract is PanelRow::of's.
    let mut rows = [unsafe { PanelRow::of(d, s, t) }];
    if LSTM {
        lstm_step::<V, VPP, 1, PanelRow>(d, w, &mut rows, false, mine);
    } else {
        gru_step::<V, VPP, 1, PanelRow>(d, w, &mut rows, false, mine);
    }
}

/// Every step of `R` samples, one step after another, all of them through each.
#[inline(always)]
fn steps_of<V: Lanes, const VPP: usize, const R: usize, const LSTM: bool>(d: &Dims, w: &Weights, samples: &mut [Sample], keep: bool) {
    let (steps, h, p) = (d.steps, d.hidden, d.padded);
    let (h_final, _) = d.final_slots();
    for t in 0..steps {
        let mut them = samples.iter_mut();
        let mut rows: [Row; R] = std::array::from_fn(|_| row(d, them.next().expect("R samples"), t));
        if LSTM {
            lstm_step::<V, VPP, R, Row>(d, w, &mut rows, keep, 0..d.padded / PANEL);
        } else {
            gru_step::<V, VPP, R, Row>(d, w, &mut rows, keep, 0..d.padded / PANEL);
        }
        if d.output == RnnOutput::Sequence {
            for s in samples.iter_mut() {
                let h_t = if t + 1 == steps { &s.state[h_final..][..h] } else { &s.hprev[(t + 1) * p..][..h] };
                copy::<V>(h_t, &mut s.out[t * h..][..h]);
            }
        }
    }
    if d.output == RnnOutput::LastStep {
        for s in samples.iter_mut() {
            copy::<V>(&s.state[h_final..][..h], &mut s.out[..h]);
        }
    }
}

/// One sample's part of step t: h_{t−1} and where h_t goes (the next step's row, or the state's
/// final slot), the step's kept gates (input products in, gates out where kept), and an LSTM's
/// c_{t−1} and where c_t goes (empty for a GRU); `padded` values each but the gates' 4·padded.
pub(super) struct Row<'a> {
    pub(super) h: &'a [f32],
    pub(super) g: &'a mut [f32],
    pub(super) h_out: &'a mut [f32],
    pub(super) c: &'a [f32],
    pub(super) c_out: &'a mut [f32],
}

/// What a step reads and writes of one sample's row: h_{t−1} and c_{t−1} (empty for a GRU),
/// read whole; the step's kept gates (a vector at offset `at`, read and written); h_t and c_t (a
/// vector at offset `at`, written). [`Row`] holds them as slices; [`PanelRow`] through pointers,
/// for a step whose units are split among threads.
pub(super) trait StepRow {
    /// h_{t−1} and c_{t−1}.
    fn prev(&self) -> (&[f32], &[f32]);
    #[inline(always)]
    fn h(&self) -> &[f32] {
        self.prev().0
    }
    #[inline(always)]
    fn c(&self) -> &[f32] {
        self.prev().1
    }
    fn load_g<V: Lanes>(&self, at: usize) -> V;
    fn store_g<V: Lanes>(&mut self, at: usize, v: V);
    fn store_h<V: Lanes>(&mut self, at: usize, v: V);
    fn store_c<V: Lanes>(&mut self, at: usize, v: V);
}

impl StepRow for Row<'_> {
    #[inline(always)]
    fn prev(&self) -> (&[f32], &[f32]) {
        (self.h, self.c)
    }
    #[inline(always)]
    fn load_g<V: Lanes>(&self, at: usize) -> V {
        V::load(&self.g[at..])
    }
    #[inline(always)]
    fn store_g<V: Lanes>(&mut self, at: usize, v: V) {
        v.store(&mut self.g[at..])
    }
    #[inline(always)]
    fn store_h<V: Lanes>(&mut self, at: usize, v: V) {
        v.store(&mut self.h_out[at..])
    }
    #[inline(always)]
    fn store_c<V: Lanes>(&mut self, at: usize, v: V) {
        v.store(&mut self.c_out[at..])
    }
}

/// One sample's row of step t as [`Row`] has it, with the written parts (the kept gates, h_t, c_t)
/// as pointers: the threads that split a step's units each hold one and write only their own
/// units' values through it (each access a vector's own slice), while h_{t−1} and c_{t−1}, written
/// by the step before, are read whole.
pub(super) struct PanelRow<'a> {
    h: &'a [f32],
    c: &'a [f32],
    g: (*mut f32, usize),
    h_out: (*mut f32, usize),
    c_out: (*mut f32, usize),
}

impl<'a> PanelRow<'a> {
    /// Step t's row of the sample whose regions `s` borrows (see [`row`]).
    ///
    /// # Safety
    /// Until the row is dropped, nothing writes h_{t−1} or c_{t−1}, and nothing else reads or
    /// writes the values of the units this row's holder writes (its panels' units in the kept
    /// gates, h_t and c_t).
    pub(super) unsafe fn of(d: &Dims, s: &SharedSample<'a>, t: usize) -> PanelRow<'a> {
        let (p, last, lstm) = (d.padded, t + 1 == d.steps, d.cell == Cell::Lstm);
        let (h_final, c_final) = d.final_slots();
        // SAFETY: rows t of hprev and cprev are written only by step t − 1 (the caller's contract).
        let (h, c) = unsafe { (s.hprev.shared(t * p..(t + 1) * p), if lstm { s.cprev.shared(t * p..(t + 1) * p) } else { &[][..] }) };
        let h_out = if last { s.state.ptr_at(h_final) } else { s.hprev.ptr_at((t + 1) * p) };
        let c_out = match (lstm, last) {
            (false, _) => s.state.ptr_at(0),
            (true, false) => s.cprev.ptr_at((t + 1) * p),
            (true, true) => s.state.ptr_at(c_final),
        };
        PanelRow { h, c, g: (s.gates.ptr_at(t * d.row()), d.row()), h_out: (h_out, p), c_out: (c_out, if lstm { p } else { 0 }) }
    }
}

/// A vector of lanes at `at` in `to` (a pointer and the length it may reach).
#[inline(always)]
fn lanes_at<'b, V: Lanes>(to: (*mut f32, usize), at: usize) -> &'b mut [f32] {
    assert!(at + V::LANES <= to.1, "vector at {at} outside 0..{}", to.1);
    // SAFETY: in bounds (checked above) of a region the row's holder may write at these units
    // ([`PanelRow::of`]'s contract); the slice lives for one load or store.
    unsafe { std::slice::from_raw_parts_mut(to.0.add(at), V::LANES) }
}

impl StepRow for PanelRow<'_> {
    #[inline(always)]
    fn prev(&self) -> (&[f32], &[f32]) {
        (self.h, self.c)
    }
    #[inline(always)]
    fn load_g<V: Lanes>(&self, at: usize) -> V {
        V::load(lanes_at::<V>(self.g, at))
    }
    #[inline(always)]
    fn store_g<V: Lanes>(&mut self, at: usize, v: V) {
        v.store(lanes_at::<V>(self.g, at))
    }
    #[inline(always)]
    fn store_h<V: Lanes>(&mut self, at: usize, v: V) {
        v.store(lanes_at::<V>(self.h_out, at))
    }
    #[inline(always)]
    fn store_c<V: Lanes>(&mut self, at: usize, v: V) {
        v.store(lanes_at::<V>(self.c_out, at))
    }
}

/// One sample's regions (see [`Sample`]) shared by the threads that split its steps' units.
pub(super) struct SharedSample<'a> {
    pub(super) gates: SharedMut<'a, f32>,
    pub(super) hprev: SharedMut<'a, f32>,
    pub(super) state: SharedMut<'a, f32>,
    pub(super) cprev: SharedMut<'a, f32>,
}

#[inline(always)]
pub(super) fn row<'a>(d: &Dims, s: &'a mut Sample, t: usize) -> Row<'a> {
    let (p, last, lstm) = (d.padded, t + 1 == d.steps, d.cell == Cell::Lstm);
    let (h_final, c_final) = d.final_slots();
    let Sample { gates, hprev, state, cprev, .. } = s;
    let (h_done, h_next) = hprev.split_at_mut((t + 1) * p);
    let (c_done, c_next) = cprev.split_at_mut(if lstm { (t + 1) * p } else { 0 });
    // (the final c's slot lies after the final h's)
    let (state_h, state_c) = state.split_at_mut(if lstm { c_final } else { state.len() });
    let h_out = if last { &mut state_h[h_final..][..p] } else { &mut h_next[..p] };
    let (c, c_out) = match (lstm, last) {
        (false, _) => (&c_done[..0], &mut c_next[..0]),
        (true, false) => (&c_done[t * p..][..p], &mut c_next[..p]),
        (true, true) => (&c_done[t * p..][..p], &mut state_c[..p]),
    };
    Row { h: &h_done[t * p..][..p], g: &mut gates[t * d.row()..][..d.row()], h_out, c, c_out }
}

/// g_s[gate·p + u] = b_ih[gate·p + u] + Σ_j x_s[j]·W_ih[gate·H + u, j] for every unit (the `G`
/// gates' blocks of `g_s`) of each of `S` steps s (x: S rows of F, g: S rows of `Dims::row`), a
/// panel at a time: each step's sums in the order of one step alone, each weight vector loaded
/// once for the S steps.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // step, gate and vector indices of the accumulators
fn input_products<V: Lanes, const VPP: usize, const G: usize, const S: usize>(d: &Dims, w: &Weights, x: &[f32], g: &mut [f32]) {
    let (p, l, width, f, row) = (d.padded, V::LANES, G * PANEL, d.features, d.row());
    debug_assert!(x.len() == S * f && g.len() == S * row);
    let xs: [&[f32]; S] = std::array::from_fn(|s| &x[s * f..][..f]);
    for q in 0..p / PANEL {
        let panel = &w.ih[q * f * width..][..f * width];
        let mut acc = [[[V::splat(0.0); VPP]; G]; S];
        for gate in 0..G {
            for v in 0..VPP {
                acc[0][gate][v] = V::load(&w.b_ih[gate * p + q * PANEL + v * l..]);
            }
        }
        for s in 1..S {
            acc[s] = acc[0];
        }
        for (j, wrow) in panel.chunks_exact(width).enumerate() {
            let xj: [V; S] = std::array::from_fn(|s| V::splat(xs[s][j]));
            for gate in 0..G {
                for v in 0..VPP {
                    let wv = V::load(&wrow[gate * PANEL + v * l..]);
                    for s in 0..S {
                        acc[s][gate][v] = xj[s].mul_add(wv, acc[s][gate][v]);
                    }
                }
            }
        }
        for s in 0..S {
            for gate in 0..G {
                for v in 0..VPP {
                    acc[s][gate][v].store(&mut g[s * row + gate * p + q * PANEL + v * l..]);
                }
            }
        }
    }
}

/// dst = src (as long), in vectors and then one value at a time: a call to `memmove` costs more
/// than such a copy of a few vectors.
#[inline(always)]
fn copy<V: Lanes>(src: &[f32], dst: &mut [f32]) {
    let (mut s, mut d) = (src.chunks_exact(V::LANES), dst.chunks_exact_mut(V::LANES));
    for (s, d) in (&mut s).zip(&mut d) {
        V::load(s).store(d);
    }
    for (s, d) in s.remainder().iter().zip(d.into_remainder()) {
        *d = *s;
    }
}
