//! A group's forward pass (see [`super::forward_group`]): every step's input products, then the
//! steps one after another, several samples at once (`cells`), and the outputs copied out.

use super::cells::{gru_step, lstm_step, LSTM_TILE};
use super::{Sample, PANEL};
use crate::cpu::vmath::lanes::Lanes;
use crate::layers::recurrent::{Cell, Dims, RnnOutput, Weights};

/// The forward pass of a group (see [`forward_group`]); `VPP` vectors of `V` make a panel.
#[inline(always)]
pub(super) fn forward<V: Lanes, const VPP: usize, const LSTM: bool>(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
    debug_assert_eq!(LSTM, d.cell == Cell::Lstm);
    debug_assert_eq!(VPP * V::LANES, PANEL);
    let (steps, f, p, row) = (d.steps, d.features, d.padded, d.row());
    let lstm = d.cell == Cell::Lstm;
    // steps whose input products are summed at once: a panel's accumulators for each (with
    // AVX-512, a vector of each gate: four LSTM steps make 16 chains of fused multiply-adds, not
    // the 4 that one step's F-long chains would leave the FMA units waiting on)
    let at_once = if VPP == 1 { 4 } else { 1 };
    for s in group.iter_mut() {
        // the input products of every step: W_ih·x_t + b_ih, G blocks of `padded`
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

/// Every step of `R` samples, one step after another, all of them through each.
#[inline(always)]
fn steps_of<V: Lanes, const VPP: usize, const R: usize, const LSTM: bool>(d: &Dims, w: &Weights, samples: &mut [Sample], keep: bool) {
    let (steps, h, p) = (d.steps, d.hidden, d.padded);
    let (h_final, _) = d.final_slots();
    for t in 0..steps {
        let mut them = samples.iter_mut();
        let mut rows: [Row; R] = std::array::from_fn(|_| row(d, them.next().expect("R samples"), t));
        if LSTM {
            lstm_step::<V, VPP, R>(d, w, &mut rows, keep);
        } else {
            gru_step::<V, VPP, R>(d, w, &mut rows, keep);
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
