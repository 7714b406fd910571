//! One step of a GRU or an LSTM for a few samples at once: the recurrent products of a vector
//! of units (two chains of fused multiply-adds) and the gates in registers, or an LSTM's
//! pre-activations a gate at a time for four samples or more, then its gates.

use super::sequence::StepRow;
use super::PANEL;
use crate::cpu::vmath::kernels::{gate_sigmoid, gate_tanh};
use crate::cpu::vmath::lanes::Lanes;
use crate::layers::recurrent::{Dims, Weights};
use std::ops::Range;

/// The recurrent products of one vector of units (`v` of each panel) in `P` panels from panel
/// `q0`, for `R` samples: a[gate][n][r] = b_hh + Σ_j h_r[j]·W_hh[gate·H + u, j], summed as two
/// chains of fused multiply-adds, one over the even j from b_hh, one over the odd j from 0, then
/// added (halving the chain a small layer waits on). Each weight vector is loaded once for the R
/// samples.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // gate, panel and sample indices of the accumulators
fn recurrent_product<V: Lanes, const P: usize, const R: usize, const G: usize>(
    d: &Dims,
    w: &Weights,
    h: [&[f32]; R],
    q0: usize,
    v: usize,
) -> [[[V; R]; P]; G] {
    let (p, width, hidden) = (d.padded, G * PANEL, d.hidden);
    let (len, at) = (hidden * width, v * V::LANES);
    let (mut even, mut odd) = ([[[V::splat(0.0); R]; P]; G], [[[V::splat(0.0); R]; P]; G]);
    let mut panels = [&w.hh[..0]; P];
    for n in 0..P {
        panels[n] = &w.hh[(q0 + n) * len..][..len];
        for gate in 0..G {
            let bias = V::load(&w.b_hh[gate * p + (q0 + n) * PANEL + at..]);
            even[gate][n] = [bias; R];
        }
    }
    let mut hs: [_; R] = std::array::from_fn(|r| h[r][..hidden].chunks_exact(2));
    for pair in 0..hidden / 2 {
        let (mut h0, mut h1) = ([V::splat(0.0); R], [V::splat(0.0); R]);
        for r in 0..R {
            // (hidden / 2 pairs in each)
            let h = hs[r].next().unwrap_or(&[0.0, 0.0]);
            (h0[r], h1[r]) = (V::splat(h[0]), V::splat(h[1]));
        }
        for n in 0..P {
            let both = &panels[n][2 * pair * width..][..2 * width];
            for gate in 0..G {
                let (w0, w1) = (V::load(&both[gate * PANEL + at..]), V::load(&both[width + gate * PANEL + at..]));
                for r in 0..R {
                    even[gate][n][r] = h0[r].mul_add(w0, even[gate][n][r]);
                    odd[gate][n][r] = h1[r].mul_add(w1, odd[gate][n][r]);
                }
            }
        }
    }
    if hidden % 2 == 1 {
        for n in 0..P {
            let last = &panels[n][(hidden - 1) * width..][..width];
            for gate in 0..G {
                let wj = V::load(&last[gate * PANEL + at..]);
                for r in 0..R {
                    even[gate][n][r] = V::splat(h[r][hidden - 1]).mul_add(wj, even[gate][n][r]);
                }
            }
        }
    }
    for gate in 0..G {
        for n in 0..P {
            for r in 0..R {
                even[gate][n][r] = even[gate][n][r] + odd[gate][n][r];
            }
        }
    }
    even
}

/// One GRU step of `R` samples for the units of `panels` (of the packed weights; all of them
/// unless the step's units are split among threads): h_t from h_{t−1} and the step's input
/// products (the first three blocks of `g`, overwritten with r, z, n and a_n where `keep`). A
/// single sample takes two panels at a time with AVX-512.
#[inline(always)]
pub(super) fn gru_step<V: Lanes, const VPP: usize, const R: usize, S: StepRow>(
    d: &Dims,
    w: &Weights,
    rows: &mut [S; R],
    keep: bool,
    panels: Range<usize>,
) {
    let (panels, mut q) = (panels.end, panels.start);
    if VPP == 1 && R == 1 {
        while q + 2 <= panels {
            gru_vector::<V, 2, R, S>(d, w, rows, keep, q, 0);
            q += 2;
        }
    }
    for q in q..panels {
        for v in 0..VPP {
            gru_vector::<V, 1, R, S>(d, w, rows, keep, q, v);
        }
    }
}

/// [`gru_step`] for vector `v` of the `P` panels from panel `q0`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // panel indices of the accumulators
fn gru_vector<V: Lanes, const P: usize, const R: usize, S: StepRow>(
    d: &Dims,
    w: &Weights,
    rows: &mut [S; R],
    keep: bool,
    q0: usize,
    v: usize,
) {
    let p = d.padded;
    let a = recurrent_product::<V, P, R, 3>(d, w, std::array::from_fn(|r| rows[r].h()), q0, v);
    for r in 0..R {
        let s = &mut rows[r];
        for n in 0..P {
            let c = (q0 + n) * PANEL + v * V::LANES;
            let rg = gate_sigmoid(s.load_g::<V>(c) + a[0][n][r]);
            let z = gate_sigmoid(s.load_g::<V>(p + c) + a[1][n][r]);
            let nn = gate_tanh(rg.mul_add(a[2][n][r], s.load_g::<V>(2 * p + c)));
            let h_t = z.mul_add(V::load(&s.h()[c..]) - nn, nn);
            s.store_h(c, h_t);
            if keep {
                s.store_g(c, rg);
                s.store_g(p + c, z);
                s.store_g(2 * p + c, nn);
                s.store_g(3 * p + c, a[2][n][r]);
            }
        }
    }
}

/// One LSTM step of `R` samples for the units of `panels` (as [`gru_step`]'s): h_t and c_t from
/// h_{t−1}, c_{t−1} and the step's input products (the four blocks of `g`, overwritten with i, f,
/// g, o where `keep`). Four samples or more take all the units (`panels` whole).
#[inline(always)]
pub(super) fn lstm_step<V: Lanes, const VPP: usize, const R: usize, S: StepRow>(
    d: &Dims,
    w: &Weights,
    rows: &mut [S; R],
    keep: bool,
    panels: Range<usize>,
) {
    if R >= 4 {
        debug_assert_eq!(panels, 0..d.padded / PANEL);
        for q in panels {
            for v in 0..VPP {
                for gate in 0..4 {
                    preactivation_tile::<V, R, S>(d, w, rows, q, v, gate);
                }
            }
        }
        for s in rows.iter_mut() {
            lstm_gates::<V, S>(d, s, keep);
        }
        return;
    }
    let (panels, mut q) = (panels.end, panels.start);
    if VPP == 1 && R == 1 {
        while q + 2 <= panels {
            lstm_vector::<V, 2, R, S>(d, w, rows, keep, q, 0);
            q += 2;
        }
    }
    for q in q..panels {
        for v in 0..VPP {
            lstm_vector::<V, 1, R, S>(d, w, rows, keep, q, v);
        }
    }
}

/// Most samples an LSTM step takes at once with AVX-512 (half that elsewhere): from four on, a
/// step runs as [`preactivation_tile`]s, one gate's vector of units for all of them, then the
/// gates; below, as [`lstm_vector`]s, every gate of a vector in registers.
pub(super) const LSTM_TILE: usize = 8;

/// g_r[gate·p + u] += a_r for vector `v` of panel `q` (units u …) of one gate and the `R`
/// samples, where a_r = b_hh + Σ_j h_r[j]·W_hh[gate·H + u, j] is summed as in
/// [`recurrent_product`] (two chains, the even j from b_hh and the odd j from 0, then added), so
/// that g_r holds x + a, the gate's pre-activation, with the bits [`lstm_vector`] gives it. Each
/// weight vector is loaded once for the R samples (two chains of R accumulators).
#[inline(always)]
fn preactivation_tile<V: Lanes, const R: usize, S: StepRow>(d: &Dims, w: &Weights, rows: &mut [S; R], q: usize, v: usize, gate: usize) {
    let (p, width, hidden) = (d.padded, 4 * PANEL, d.hidden);
    let panel = &w.hh[q * hidden * width..][..hidden * width];
    let (at, u) = (gate * PANEL + v * V::LANES, gate * p + q * PANEL + v * V::LANES);
    let mut even = [V::load(&w.b_hh[u..]); R];
    let mut odd = [V::splat(0.0); R];
    let hs: [&[f32]; R] = std::array::from_fn(|r| &rows[r].h()[..hidden]);
    for (pair, both) in panel.chunks_exact(2 * width).enumerate() {
        let (w0, w1) = (V::load(&both[at..]), V::load(&both[width + at..]));
        for r in 0..R {
            // SAFETY: 2·pair + 1 < hidden (hidden / 2 pairs), the length of each hs[r]. (The
            // checks of R indices a pair, not hoisted, cost as much as the pair's products.)
            let (h0, h1) = unsafe { (*hs[r].get_unchecked(2 * pair), *hs[r].get_unchecked(2 * pair + 1)) };
            even[r] = V::splat(h0).mul_add(w0, even[r]);
            odd[r] = V::splat(h1).mul_add(w1, odd[r]);
        }
    }
    if hidden % 2 == 1 {
        let wj = V::load(&panel[(hidden - 1) * width + at..]);
        for r in 0..R {
            even[r] = V::splat(rows[r].h()[hidden - 1]).mul_add(wj, even[r]);
        }
    }
    for r in 0..R {
        let pre = rows[r].load_g::<V>(u) + (even[r] + odd[r]);
        rows[r].store_g(u, pre);
    }
}

/// The gates of one sample's LSTM step from their pre-activations (the four blocks of `g`, made
/// by [`preactivation_tile`]), as [`lstm_vector`] computes them: c_t, h_t, and the gates over
/// their pre-activations where `keep`.
#[inline(always)]
fn lstm_gates<V: Lanes, S: StepRow>(d: &Dims, s: &mut S, keep: bool) {
    let p = d.padded;
    for u in (0..p).step_by(V::LANES) {
        let ig = gate_sigmoid(s.load_g::<V>(u));
        let fg = gate_sigmoid(s.load_g::<V>(p + u));
        let gg = gate_tanh(s.load_g::<V>(2 * p + u));
        let og = gate_sigmoid(s.load_g::<V>(3 * p + u));
        let ct = fg.mul_add(V::load(&s.c()[u..]), ig * gg);
        s.store_c(u, ct);
        s.store_h(u, og * gate_tanh(ct));
        if keep {
            s.store_g(u, ig);
            s.store_g(p + u, fg);
            s.store_g(2 * p + u, gg);
            s.store_g(3 * p + u, og);
        }
    }
}

/// [`lstm_step`] for vector `v` of the `P` panels from panel `q0`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // panel indices of the accumulators
fn lstm_vector<V: Lanes, const P: usize, const R: usize, S: StepRow>(
    d: &Dims,
    w: &Weights,
    rows: &mut [S; R],
    keep: bool,
    q0: usize,
    v: usize,
) {
    let p = d.padded;
    let a = recurrent_product::<V, P, R, 4>(d, w, std::array::from_fn(|r| rows[r].h()), q0, v);
    for r in 0..R {
        let s = &mut rows[r];
        for n in 0..P {
            let u = (q0 + n) * PANEL + v * V::LANES;
            let ig = gate_sigmoid(s.load_g::<V>(u) + a[0][n][r]);
            let fg = gate_sigmoid(s.load_g::<V>(p + u) + a[1][n][r]);
            let gg = gate_tanh(s.load_g::<V>(2 * p + u) + a[2][n][r]);
            let og = gate_sigmoid(s.load_g::<V>(3 * p + u) + a[3][n][r]);
            let ct = fg.mul_add(V::load(&s.c()[u..]), ig * gg);
            s.store_c(u, ct);
            s.store_h(u, og * gate_tanh(ct));
            if keep {
                s.store_g(u, ig);
                s.store_g(p + u, fg);
                s.store_g(2 * p + u, gg);
                s.store_g(3 * p + u, og);
            }
        }
    }
}
