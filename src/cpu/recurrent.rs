//! The recurrent layers' time loops over one sample (the fast CPU path of `layers::recurrent`),
//! written once over [`Lanes`] and compiled for AVX-512, for AVX2+FMA and portably, chosen at run
//! time as the activations' kernels are. Every product is summed in an order fixed by the layer's
//! sizes alone (fused multiply-adds) and the gates use the activations' kernels, so the three give
//! the same bits; and one step of a batch of sequences is exactly one step of a stream (a stream's
//! model runs this same code one step at a time), which the tests check.
//!
//! A GRU or LSTM step of one sample runs a vector of hidden units at a time (two panels of 16
//! units at once with AVX-512), reading the packed weights (`layers::recurrent`): for each gate the
//! recurrent product of those units, two chains of fused multiply-adds (h_{t−1}[j]·W_hhᵀ[j, ·] for
//! the even j from b_hh, for the odd j from 0, then added: half the chain a small layer waits on),
//! then the gates in registers, where the products are. An LSTM step of four samples or more
//! computes one gate's vector of units for all of them at once (each weight vector loaded once for
//! them), leaves the pre-activations in the kept gates, then computes the gates: the same sums in
//! the same order, so the same bits. The backward pass likewise takes several samples at once
//! through its product with W_hh.
//!
//! GRU (PyTorch's formula, the reset gate on the recurrent product and its bias):
//!   r = σ(x_r + a_r), z = σ(x_z + a_z), n = tanh(r·a_n + x_n), h_t = n + z·(h_{t−1} − n)
//! LSTM:
//!   i = σ(x_i + a_i), f = σ(x_f + a_f), g = tanh(x_g + a_g), o = σ(x_o + a_o),
//!   c_t = f·c_{t−1} + i·g (one rounding for the sum, fused), h_t = o·tanh(c_t)
//! with x = W_ih·x_t + b_ih (the step's input products) and a = W_hh·h_{t−1} + b_hh.

#![deny(clippy::undocumented_unsafe_blocks)]

use super::vmath::kernels::{sigmoid, tanh};
use super::vmath::lanes::Lanes;
#[cfg(target_arch = "x86_64")]
use super::vmath::lanes::{Avx2, Avx512};
use super::vmath::Isa;
use crate::layers::recurrent::{Cell, Dims, RnnOutput, Weights, LANES};

/// One sample's part of a recurrent step's regions (see `layers::recurrent`): `x` (T × F) is
/// read, the rest written (`state`'s initial values read first).
pub(crate) struct Sample<'a> {
    pub x: &'a [f32],
    pub out: &'a mut [f32],
    pub gates: &'a mut [f32],
    pub hprev: &'a mut [f32],
    pub state: &'a mut [f32],
    /// Empty for a GRU.
    pub cprev: &'a mut [f32],
}

impl Sample<'_> {
    /// A sample of no values, which fills a group's unused places.
    pub fn none() -> Self {
        Sample { x: &[], out: &mut [], gates: &mut [], hprev: &mut [], state: &mut [], cprev: &mut [] }
    }
}

/// One sample's values for the backward pass: what the forward pass kept, the gradient of the
/// output, and the kept regions' twins in the gradient buffer, written.
pub(crate) struct BackSample<'a> {
    pub gates: &'a [f32],
    pub hprev: &'a [f32],
    pub state: &'a [f32],
    pub cprev: &'a [f32],
    pub dy: &'a [f32],
    pub dgates: &'a mut [f32],
    pub dhprev: &'a mut [f32],
    pub dstate: &'a mut [f32],
    pub dcprev: &'a mut [f32],
}

impl BackSample<'_> {
    /// A sample of no values, which fills a group's unused places.
    pub fn none() -> Self {
        BackSample {
            gates: &[],
            hprev: &[],
            state: &[],
            cprev: &[],
            dy: &[],
            dgates: &mut [],
            dhprev: &mut [],
            dstate: &mut [],
            dcprev: &mut [],
        }
    }
}

/// Most samples [`forward_group`] takes.
pub(crate) const GROUP: usize = 12;

/// The forward pass over a group of up to [`GROUP`] samples (independent sequences), with the
/// weights in the packed layout: the outputs (and, with `keep`, every step's gates) and the final
/// states. A step takes several samples at once where the registers allow (with AVX-512, four of
/// a GRU's, three of an LSTM's), each weight vector loaded once for all of them; each sample's
/// values are summed in the same order whatever the group.
pub(crate) fn forward_group(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
    debug_assert!(group.len() <= GROUP);
    match Isa::best() {
        Isa::Portable => portable::forward(d, w, group, keep),
        // SAFETY: this CPU has the instruction set (`Isa::best` checked).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::forward(d, w, group, keep) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::forward(d, w, group, keep) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

/// The backward pass through a group of up to [`GROUP`] samples' steps, from the last to the
/// first: every step's gate gradients, and ∂L/∂h_{t−1} (∂L/∂c_{t−1}) for each. `rows`: W_hh with
/// rows padded (G·H × padded). Each sample's values are summed in the same order whatever the
/// group.
pub(crate) fn backward_group(d: &Dims, rows: &[f32], group: &mut [BackSample]) {
    debug_assert!(group.len() <= GROUP);
    match Isa::best() {
        Isa::Portable => backward::<f32, 16>(d, rows, group),
        // SAFETY: this CPU has the instruction set (`Isa::best` checked).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::backward(d, rows, group) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::backward(d, rows, group) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

// Everything below is `#[inline(always)]` down to the lanes' intrinsics and uses no closures,
// so that it is compiled inside the `#[target_feature]` entry points (see `vmath`).

/// y_r[o] += Σ_b Σ_j xs_r[b][j]·bs[b][j·n + o] for o < n (a multiple of [`Lanes::LANES`]) and
/// each of the `R` samples r: each y_r[o] one chain of fused multiply-adds, from its value, in the
/// order of b and j, whatever R (each weight vector is loaded once for the R samples).
#[inline(always)]
fn accumulate<V: Lanes, const R: usize>(xs: &[[&[f32]; 4]; R], bs: &[&[f32]], n: usize, ys: &mut [&mut [f32]; R]) {
    let l = V::LANES;
    let mut c = 0;
    while c + 4 * l <= n {
        accumulate_block::<V, 4, R>(xs, bs, n, ys, c);
        c += 4 * l;
    }
    if c + 2 * l <= n {
        accumulate_block::<V, 2, R>(xs, bs, n, ys, c);
        c += 2 * l;
    }
    if c < n {
        accumulate_block::<V, 1, R>(xs, bs, n, ys, c);
    }
}

/// [`accumulate`] over the `N` vectors of each y_r from `c`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // sample and vector indices of the accumulators
fn accumulate_block<V: Lanes, const N: usize, const R: usize>(
    xs: &[[&[f32]; 4]; R],
    bs: &[&[f32]],
    n: usize,
    ys: &mut [&mut [f32]; R],
    c: usize,
) {
    let l = V::LANES;
    let mut acc = [[V::splat(0.0); N]; R];
    for r in 0..R {
        for i in 0..N {
            acc[r][i] = V::load(&ys[r][c + i * l..]);
        }
    }
    for (b, gate) in bs.iter().zip(0..) {
        let len = xs[0][gate].len();
        let x: [&[f32]; R] = std::array::from_fn(|r| &xs[r][gate][..len]);
        for j in 0..len {
            let row = &b[j * n + c..][..N * l];
            let w: [V; N] = std::array::from_fn(|i| V::load(&row[i * l..]));
            for r in 0..R {
                let xj = V::splat(x[r][j]);
                for i in 0..N {
                    acc[r][i] = xj.mul_add(w[i], acc[r][i]);
                }
            }
        }
    }
    for r in 0..R {
        for i in 0..N {
            acc[r][i].store(&mut ys[r][c + i * l..]);
        }
    }
}

/// The forward pass of a group (see [`forward_group`]); `VPP` vectors of `V` make a panel.
#[inline(always)]
fn forward<V: Lanes, const VPP: usize, const LSTM: bool>(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
    debug_assert_eq!(LSTM, d.cell == Cell::Lstm);
    debug_assert_eq!(VPP * V::LANES, PANEL);
    let (steps, f, p, row) = (d.steps, d.features, d.padded, d.row());
    let lstm = d.cell == Cell::Lstm;
    for s in group.iter_mut() {
        // the input products of every step: W_ih·x_t + b_ih, G blocks of `padded`
        for t in 0..steps {
            let (x, g) = (&s.x[t * f..][..f], &mut s.gates[t * row..][..row]);
            if lstm {
                input_product::<V, VPP, 4>(d, w, x, g);
            } else {
                input_product::<V, VPP, 3>(d, w, x, g);
            }
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
struct Row<'a> {
    h: &'a [f32],
    g: &'a mut [f32],
    h_out: &'a mut [f32],
    c: &'a [f32],
    c_out: &'a mut [f32],
}

#[inline(always)]
fn row<'a>(d: &Dims, s: &'a mut Sample, t: usize) -> Row<'a> {
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

/// Units a panel of the packed weights holds.
const PANEL: usize = LANES;

/// g[gate·p + u] = b_ih[gate·p + u] + Σ_j x[j]·W_ih[gate·H + u, j] for every unit (the `G` gates'
/// blocks of `g`), a panel at a time.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // gate and vector indices of the accumulators
fn input_product<V: Lanes, const VPP: usize, const G: usize>(d: &Dims, w: &Weights, x: &[f32], g: &mut [f32]) {
    let (p, l, width) = (d.padded, V::LANES, G * PANEL);
    for q in 0..p / PANEL {
        let panel = &w.ih[q * x.len() * width..][..x.len() * width];
        let mut acc = [[V::splat(0.0); VPP]; G];
        for gate in 0..G {
            for v in 0..VPP {
                acc[gate][v] = V::load(&w.b_ih[gate * p + q * PANEL + v * l..]);
            }
        }
        for (&xj, row) in x.iter().zip(panel.chunks_exact(width)) {
            let xj = V::splat(xj);
            for gate in 0..G {
                for v in 0..VPP {
                    acc[gate][v] = xj.mul_add(V::load(&row[gate * PANEL + v * l..]), acc[gate][v]);
                }
            }
        }
        for gate in 0..G {
            for v in 0..VPP {
                acc[gate][v].store(&mut g[gate * p + q * PANEL + v * l..]);
            }
        }
    }
}

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
    rows: &[Row; R],
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
    let mut hs: [_; R] = std::array::from_fn(|r| rows[r].h[..hidden].chunks_exact(2));
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
                    even[gate][n][r] = V::splat(rows[r].h[hidden - 1]).mul_add(wj, even[gate][n][r]);
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

/// One GRU step of `R` samples: h_t from h_{t−1} and the step's input products (the first three
/// blocks of `g`, overwritten with r, z, n and a_n where `keep`). A single sample takes two panels
/// at a time with AVX-512.
#[inline(always)]
fn gru_step<V: Lanes, const VPP: usize, const R: usize>(d: &Dims, w: &Weights, rows: &mut [Row; R], keep: bool) {
    let (panels, mut q) = (d.padded / PANEL, 0);
    if VPP == 1 && R == 1 {
        while q + 2 <= panels {
            gru_vector::<V, 2, R>(d, w, rows, keep, q, 0);
            q += 2;
        }
    }
    for q in q..panels {
        for v in 0..VPP {
            gru_vector::<V, 1, R>(d, w, rows, keep, q, v);
        }
    }
}

/// [`gru_step`] for vector `v` of the `P` panels from panel `q0`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // panel indices of the accumulators
fn gru_vector<V: Lanes, const P: usize, const R: usize>(d: &Dims, w: &Weights, rows: &mut [Row; R], keep: bool, q0: usize, v: usize) {
    let p = d.padded;
    let a = recurrent_product::<V, P, R, 3>(d, w, rows, q0, v);
    for (r, s) in rows.iter_mut().enumerate() {
        for n in 0..P {
            let c = (q0 + n) * PANEL + v * V::LANES;
            let g = &mut *s.g;
            let rg = sigmoid(V::load(&g[c..]) + a[0][n][r]);
            let z = sigmoid(V::load(&g[p + c..]) + a[1][n][r]);
            let nn = tanh(rg.mul_add(a[2][n][r], V::load(&g[2 * p + c..])));
            z.mul_add(V::load(&s.h[c..]) - nn, nn).store(&mut s.h_out[c..]);
            if keep {
                rg.store(&mut g[c..]);
                z.store(&mut g[p + c..]);
                nn.store(&mut g[2 * p + c..]);
                a[2][n][r].store(&mut g[3 * p + c..]);
            }
        }
    }
}

/// One LSTM step of `R` samples: h_t and c_t from h_{t−1}, c_{t−1} and the step's input products
/// (the four blocks of `g`, overwritten with i, f, g, o where `keep`).
#[inline(always)]
fn lstm_step<V: Lanes, const VPP: usize, const R: usize>(d: &Dims, w: &Weights, rows: &mut [Row; R], keep: bool) {
    let (panels, mut q) = (d.padded / PANEL, 0);
    if R >= 4 {
        for q in 0..panels {
            for v in 0..VPP {
                for gate in 0..4 {
                    preactivation_tile::<V, R>(d, w, rows, q, v, gate);
                }
            }
        }
        for s in rows.iter_mut() {
            lstm_gates::<V>(d, s, keep);
        }
        return;
    }
    if VPP == 1 && R == 1 {
        while q + 2 <= panels {
            lstm_vector::<V, 2, R>(d, w, rows, keep, q, 0);
            q += 2;
        }
    }
    for q in q..panels {
        for v in 0..VPP {
            lstm_vector::<V, 1, R>(d, w, rows, keep, q, v);
        }
    }
}

/// Most samples an LSTM step takes at once with AVX-512 (half that elsewhere): from four on, a
/// step runs as [`preactivation_tile`]s, one gate's vector of units for all of them, then the
/// gates; below, as [`lstm_vector`]s, every gate of a vector in registers.
const LSTM_TILE: usize = 8;

/// g_r[gate·p + u] += a_r for vector `v` of panel `q` (units u …) of one gate and the `R`
/// samples, where a_r = b_hh + Σ_j h_r[j]·W_hh[gate·H + u, j] is summed as in
/// [`recurrent_product`] (two chains, the even j from b_hh and the odd j from 0, then added), so
/// that g_r holds x + a, the gate's pre-activation, with the bits [`lstm_vector`] gives it. Each
/// weight vector is loaded once for the R samples (two chains of R accumulators).
#[inline(always)]
fn preactivation_tile<V: Lanes, const R: usize>(d: &Dims, w: &Weights, rows: &mut [Row; R], q: usize, v: usize, gate: usize) {
    let (p, width, hidden) = (d.padded, 4 * PANEL, d.hidden);
    let panel = &w.hh[q * hidden * width..][..hidden * width];
    let (at, u) = (gate * PANEL + v * V::LANES, gate * p + q * PANEL + v * V::LANES);
    let mut even = [V::load(&w.b_hh[u..]); R];
    let mut odd = [V::splat(0.0); R];
    let hs: [&[f32]; R] = std::array::from_fn(|r| &rows[r].h[..hidden]);
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
            even[r] = V::splat(rows[r].h[hidden - 1]).mul_add(wj, even[r]);
        }
    }
    for (s, (e, o)) in rows.iter_mut().zip(even.into_iter().zip(odd)) {
        (V::load(&s.g[u..]) + (e + o)).store(&mut s.g[u..]);
    }
}

/// The gates of one sample's LSTM step from their pre-activations (the four blocks of `g`, made
/// by [`preactivation_tile`]), as [`lstm_vector`] computes them: c_t, h_t, and the gates over
/// their pre-activations where `keep`.
#[inline(always)]
fn lstm_gates<V: Lanes>(d: &Dims, s: &mut Row, keep: bool) {
    let p = d.padded;
    for u in (0..p).step_by(V::LANES) {
        let g = &mut *s.g;
        let ig = sigmoid(V::load(&g[u..]));
        let fg = sigmoid(V::load(&g[p + u..]));
        let gg = tanh(V::load(&g[2 * p + u..]));
        let og = sigmoid(V::load(&g[3 * p + u..]));
        let ct = fg.mul_add(V::load(&s.c[u..]), ig * gg);
        ct.store(&mut s.c_out[u..]);
        (og * tanh(ct)).store(&mut s.h_out[u..]);
        if keep {
            ig.store(&mut g[u..]);
            fg.store(&mut g[p + u..]);
            gg.store(&mut g[2 * p + u..]);
            og.store(&mut g[3 * p + u..]);
        }
    }
}

/// [`lstm_step`] for vector `v` of the `P` panels from panel `q0`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // panel indices of the accumulators
fn lstm_vector<V: Lanes, const P: usize, const R: usize>(d: &Dims, w: &Weights, rows: &mut [Row; R], keep: bool, q0: usize, v: usize) {
    let p = d.padded;
    let a = recurrent_product::<V, P, R, 4>(d, w, rows, q0, v);
    for (r, s) in rows.iter_mut().enumerate() {
        for n in 0..P {
            let u = (q0 + n) * PANEL + v * V::LANES;
            let g = &mut *s.g;
            let ig = sigmoid(V::load(&g[u..]) + a[0][n][r]);
            let fg = sigmoid(V::load(&g[p + u..]) + a[1][n][r]);
            let gg = tanh(V::load(&g[2 * p + u..]) + a[2][n][r]);
            let og = sigmoid(V::load(&g[3 * p + u..]) + a[3][n][r]);
            let ct = fg.mul_add(V::load(&s.c[u..]), ig * gg);
            ct.store(&mut s.c_out[u..]);
            (og * tanh(ct)).store(&mut s.h_out[u..]);
            if keep {
                ig.store(&mut g[u..]);
                fg.store(&mut g[p + u..]);
                gg.store(&mut g[2 * p + u..]);
                og.store(&mut g[3 * p + u..]);
            }
        }
    }
}

/// `w` (gates·hidden × rows, PyTorch's layout) into `panels` in the packed layout
/// (`layers::recurrent::panel_at`: for each panel of 16 units, each row j and each gate, the 16
/// units' values, 0 past `hidden`). Blocks of 8 units by 8 rows are transposed in registers (AVX)
/// where the CPU has it; the rest one value at a time.
pub(crate) fn pack_panels(gates: usize, hidden: usize, rows: usize, w: &[f32], panels: &mut [f32]) {
    assert!(
        w.len() >= gates * hidden * rows && panels.len() >= hidden.div_ceil(PANEL) * rows * gates * PANEL,
        "pack_panels: short buffers"
    );
    #[cfg(target_arch = "x86_64")]
    let avx = super::has_avx2_fma();
    for q in 0..hidden.div_ceil(PANEL) {
        for gate in 0..gates {
            // W[gate·H + 16q + lane, j] goes to panels[((q·rows + j)·gates + gate)·16 + lane]
            let src = (gate * hidden + q * PANEL) * rows;
            let dst = (q * rows * gates + gate) * PANEL;
            for lane0 in (0..PANEL).step_by(8) {
                for j0 in (0..rows).step_by(8) {
                    let whole = q * PANEL + lane0 + 8 <= hidden && j0 + 8 <= rows;
                    #[cfg(target_arch = "x86_64")]
                    if whole && avx {
                        // SAFETY: the CPU has AVX (checked above); the 8×8 block lies inside `w`
                        // (rows gate·H + 16q + lane0 … + 7 < gates·H, columns j0 … j0 + 7 < rows)
                        // and inside `panels` (asserted sizes above).
                        unsafe {
                            transpose8(
                                w.as_ptr().add(src + lane0 * rows + j0),
                                rows,
                                panels.as_mut_ptr().add(dst + j0 * gates * PANEL + lane0),
                                gates * PANEL,
                            )
                        };
                        continue;
                    }
                    for lane in lane0..lane0 + 8 {
                        let unit = q * PANEL + lane;
                        for j in j0..(j0 + 8).min(rows) {
                            panels[dst + j * gates * PANEL + lane] = if unit < hidden { w[src + lane * rows + j] } else { 0.0 };
                        }
                    }
                }
            }
        }
    }
}

/// dst[c·ld_dst + r] = src[r·ld_src + c] for r, c < 8: an 8×8 block transposed in registers.
///
/// # Safety
/// The CPU has AVX; `src` points to 8 rows of 8 readable values `ld_src` apart, `dst` to 8 rows of
/// 8 writable values `ld_dst` apart, not overlapping them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose8(src: *const f32, ld_src: usize, dst: *mut f32, ld_dst: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract: every load reads a row of 8 values of `src`, every store
    // writes a row of 8 of `dst`; this function enables the AVX that transpose8x8 needs.
    unsafe {
        let row = |i: usize| src.add(i * ld_src);
        let r = [
            _mm256_loadu_ps(row(0)),
            _mm256_loadu_ps(row(1)),
            _mm256_loadu_ps(row(2)),
            _mm256_loadu_ps(row(3)),
            _mm256_loadu_ps(row(4)),
            _mm256_loadu_ps(row(5)),
            _mm256_loadu_ps(row(6)),
            _mm256_loadu_ps(row(7)),
        ];
        let c = crate::cpu::gemm::transpose8x8(r);
        for (i, &v) in c.iter().enumerate() {
            _mm256_storeu_ps(dst.add(i * ld_dst), v);
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

/// The backward pass of a group (see [`backward_group`]), its samples in lockstep from the last
/// step to the first. Step t's ∂L/∂h_t is what step t + 1 carried back into hprev's twin (row
/// t + 1; none for the last step) plus the output's gradient; it is summed in that row (for the
/// last step, in the state twin's final slot). Then the gate gradients, and ∂L/∂h_{t−1} = (GRU:
/// ∂L/∂h_t·z) + Σ_g dg_g·W_hh,g into row t, for several samples at once (each weight vector
/// loaded once for them: four with AVX-512, two elsewhere; the sum's order is a sample's own).
#[inline(always)]
fn backward<V: Lanes, const VPP: usize>(d: &Dims, rows: &[f32], group: &mut [BackSample]) {
    let samples_at_once = if VPP == 1 { 4 } else { 2 };
    for t in (0..d.steps).rev() {
        for s in group.iter_mut() {
            gate_gradients::<V>(d, t, s);
        }
        for samples in group.chunks_mut(samples_at_once) {
            match samples.len() {
                4 => hidden_gradient::<V, 4>(d, rows, t, samples),
                3 => hidden_gradient::<V, 3>(d, rows, t, samples),
                2 => hidden_gradient::<V, 2>(d, rows, t, samples),
                _ => hidden_gradient::<V, 1>(d, rows, t, samples),
            }
        }
    }
}

/// Step t of one sample's backward pass up to the product with W_hh: ∂L/∂h_t summed (its padding
/// lanes zero), the step's gate gradients, an LSTM's ∂L/∂c_{t−1}, and row t of hprev's twin set
/// to what ∂L/∂h_{t−1} holds before the product (GRU: ∂L/∂h_t·z; LSTM: 0), padding lanes zero.
/// A vector of units at a time; padding lanes past the last unit's vector are left alone.
#[inline(always)]
fn gate_gradients<V: Lanes>(d: &Dims, t: usize, s: &mut BackSample) {
    let (steps, h, p, row, l) = (d.steps, d.hidden, d.padded, d.row(), V::LANES);
    let BackSample { gates, hprev, state, cprev, dy, dgates, dhprev, dstate, dcprev } = s;
    let (h_final, c_final) = d.final_slots();
    let last = t + 1 == steps;
    let (dh_done, dh_next) = dhprev.split_at_mut((t + 1) * p);
    let dh = if last { &mut dstate[h_final..][..p] } else { &mut dh_next[..p] };
    let dy_t = match d.output {
        RnnOutput::Sequence => Some(&dy[t * h..][..h]),
        RnnOutput::LastStep => last.then(|| &dy[..h]),
    };
    for u in 0..h {
        let carried = if last { 0.0 } else { dh[u] };
        dh[u] = carried + dy_t.map_or(0.0, |dy| dy[u]);
    }
    dh[h..].fill(0.0);
    let dh = &*dh;
    let dh_prev = &mut dh_done[t * p..];
    let (g, dg) = (&gates[t * row..][..row], &mut dgates[t * row..][..row]);
    let one = V::splat(1.0);
    if d.cell == Cell::Lstm {
        let c = if last { &state[c_final..][..p] } else { &cprev[(t + 1) * p..][..p] };
        let c_prev = &cprev[t * p..][..p];
        let (dc_done, dc_next) = dcprev.split_at_mut((t + 1) * p);
        for u in (0..h).step_by(l) {
            let (i, f, gg, o) = (V::load(&g[u..]), V::load(&g[p + u..]), V::load(&g[2 * p + u..]), V::load(&g[3 * p + u..]));
            let tc = tanh(V::load(&c[u..]));
            let carried = if last { V::splat(0.0) } else { V::load(&dc_next[u..]) };
            let dh_u = V::load(&dh[u..]);
            let dc = carried + dh_u * o * (one - tc * tc);
            (dc * gg * i * (one - i)).store(&mut dg[u..]);
            (dc * V::load(&c_prev[u..]) * f * (one - f)).store(&mut dg[p + u..]);
            (dc * i * (one - gg * gg)).store(&mut dg[2 * p + u..]);
            (dh_u * tc * o * (one - o)).store(&mut dg[3 * p + u..]);
            (dc * f).store(&mut dc_done[t * p + u..]);
            V::splat(0.0).store(&mut dh_prev[u..]);
        }
    } else {
        let hp = &hprev[t * p..][..p];
        for u in (0..h).step_by(l) {
            let (r, z, n, an) = (V::load(&g[u..]), V::load(&g[p + u..]), V::load(&g[2 * p + u..]), V::load(&g[3 * p + u..]));
            let dh_u = V::load(&dh[u..]);
            let dn = dh_u * (one - z);
            let dz = dh_u * (V::load(&hp[u..]) - n);
            let dan = dn * (one - n * n);
            (dan * an * r * (one - r)).store(&mut dg[u..]);
            (dz * z * (one - z)).store(&mut dg[p + u..]);
            dan.store(&mut dg[2 * p + u..]);
            (dan * r).store(&mut dg[3 * p + u..]);
            (dh_u * z).store(&mut dh_prev[u..]);
        }
    }
    // the padding lanes of ∂L/∂h_{t−1}: read by the vectors of the product, never by a unit
    dh_prev[h..p].fill(0.0);
}

/// Row t of hprev's twin += Σ_g dg_g·W_hh,g for the `R` samples (`rows`: W_hh with rows padded).
#[inline(always)]
fn hidden_gradient<V: Lanes, const R: usize>(d: &Dims, rows: &[f32], t: usize, samples: &mut [BackSample]) {
    let (h, p, row) = (d.hidden, d.padded, d.row());
    let blocks = d.cell.hidden_blocks();
    let mut bs: [&[f32]; 4] = [&[]; 4];
    for (gate, b) in bs.iter_mut().enumerate().take(blocks.len()) {
        *b = &rows[gate * h * p..][..h * p];
    }
    let mut them = samples.iter_mut();
    let mut xs: [[&[f32]; 4]; R] = [[&[]; 4]; R];
    let mut ys: [&mut [f32]; R] = std::array::from_fn(|_| &mut [][..]);
    for (x, y) in xs.iter_mut().zip(&mut ys) {
        let s = them.next().expect("R samples");
        let dg = &s.dgates[t * row..][..row];
        for (x, &block) in x.iter_mut().zip(blocks) {
            *x = &dg[block * p..][..h];
        }
        *y = &mut s.dhprev[t * p..][..p];
    }
    accumulate::<V, R>(&xs, &bs[..blocks.len()], p, &mut ys);
}

/// The loops compiled for one instruction set.
macro_rules! instantiate {
    ($name:ident, $lanes:ty, $vpp:literal, $features:literal) => {
        mod $name {
            use super::*;

            #[target_feature(enable = $features)]
            pub(super) fn forward(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
                if d.cell == Cell::Lstm {
                    lstm(d, w, group, keep)
                } else {
                    gru(d, w, group, keep)
                }
            }

            // (each cell's loops a function of their own, so that the LSTM's tiles do not shape
            // the code of the GRU's loops, which was slower when compiled beside them)
            #[target_feature(enable = $features)]
            #[inline(never)]
            fn lstm(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
                super::forward::<$lanes, $vpp, true>(d, w, group, keep)
            }

            #[target_feature(enable = $features)]
            #[inline(never)]
            fn gru(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
                super::forward::<$lanes, $vpp, false>(d, w, group, keep)
            }

            #[target_feature(enable = $features)]
            pub(super) fn backward(d: &Dims, rows: &[f32], group: &mut [BackSample]) {
                super::backward::<$lanes, $vpp>(d, rows, group)
            }
        }
    };
}

/// The loops compiled portably.
mod portable {
    use super::*;

    pub(super) fn forward(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
        if d.cell == Cell::Lstm {
            super::forward::<f32, 16, true>(d, w, group, keep)
        } else {
            super::forward::<f32, 16, false>(d, w, group, keep)
        }
    }
}

#[cfg(target_arch = "x86_64")]
instantiate!(avx2, Avx2, 2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
instantiate!(avx512, Avx512, 1, "avx512f");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Shape;
    use crate::layers::recurrent::{pack, Streaming};
    use crate::testutil::Rng;

    /// One sample's inputs: x, the initial state, the output's gradient.
    type Inputs = (Vec<f32>, Vec<f32>, Vec<f32>);

    /// The outputs of the forward and backward passes of the samples in groups of `group`, on one
    /// instruction set.
    fn run(isa: Isa, group: usize, d: &Dims, packed: &[f32], rows: &[f32], inputs: &[Inputs]) -> Vec<Vec<f32>> {
        let (t, p, row) = (d.steps, d.padded, d.row());
        let lstm = d.cell == Cell::Lstm;
        let mut kept: Vec<[Vec<f32>; 4]> = inputs
            .iter()
            .map(|(_, state, _)| [vec![f32::NAN; d.out_len()], vec![f32::NAN; t * row], vec![f32::NAN; t * p], state.clone()])
            .collect();
        let mut cprevs: Vec<Vec<f32>> = inputs.iter().map(|_| vec![f32::NAN; if lstm { t * p } else { 0 }]).collect();
        let w = Weights::of(d, packed);
        let mut samples: Vec<Sample> = kept
            .iter_mut()
            .zip(&mut cprevs)
            .zip(inputs)
            .map(|(([out, gates, hprev, state], cprev), (x, _, _))| Sample { x, out, gates, hprev, state, cprev })
            .collect();
        for group in samples.chunks_mut(group) {
            match isa {
                Isa::Portable => portable::forward(d, &w, group, true),
                // SAFETY: asked for only where this CPU has it (`Isa::available`).
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2::forward(d, &w, group, true) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { avx512::forward(d, &w, group, true) },
                #[cfg(not(target_arch = "x86_64"))]
                Isa::Avx2 | Isa::Avx512 => unreachable!(),
            }
        }
        drop(samples);
        let mut grads: Vec<[Vec<f32>; 4]> = cprevs
            .iter()
            .map(|cprev| [vec![f32::NAN; t * row], vec![f32::NAN; t * p], vec![f32::NAN; d.state_len()], vec![f32::NAN; cprev.len()]])
            .collect();
        let mut samples: Vec<BackSample> = kept
            .iter()
            .zip(&cprevs)
            .zip(inputs)
            .zip(&mut grads)
            .map(|((([_, gates, hprev, state], cprev), (_, _, dy)), [dgates, dhprev, dstate, dcprev])| BackSample {
                gates,
                hprev,
                state,
                cprev,
                dy,
                dgates,
                dhprev,
                dstate,
                dcprev,
            })
            .collect();
        for group in samples.chunks_mut(group) {
            match isa {
                Isa::Portable => backward::<f32, 16>(d, rows, group),
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2::backward(d, rows, group) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { avx512::backward(d, rows, group) },
                #[cfg(not(target_arch = "x86_64"))]
                Isa::Avx2 | Isa::Avx512 => unreachable!(),
            }
        }
        drop(samples);
        // the units of each kept row (padding lanes hold what the lanes' arithmetic left there)
        let units = |v: &[f32], width: usize| -> Vec<f32> {
            v.chunks(width).flat_map(|r| r.chunks(p).flat_map(|b| b[..d.hidden].to_vec())).collect()
        };
        let mut parts = Vec::new();
        for (([out, gates, hprev, state], [dgates, dhprev, _, dcprev]), cprev) in kept.iter().zip(&grads).zip(&cprevs) {
            parts.extend([
                out.clone(),
                units(gates, row),
                units(hprev, p),
                units(state, p),
                units(cprev, p),
                units(dgates, row),
                units(dhprev, p),
                units(dcprev, p),
            ]);
        }
        parts
    }

    #[test]
    fn every_instruction_set_and_group_gives_the_same_bits() {
        let isas: Vec<Isa> = [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|isa| isa.available()).collect();
        let mut rng = Rng::new(6);
        for cell in [Cell::Gru, Cell::Lstm] {
            for (hidden, features, steps) in [(1, 1, 1), (16, 3, 4), (17, 2, 3), (40, 5, 2), (64, 1, 2)] {
                for output in [RnnOutput::Sequence, RnnOutput::LastStep] {
                    let d = Dims::new(cell, hidden, output, Streaming::No, Shape::sequence(steps, features));
                    let g = d.gates();
                    let params = rng.uniform(g * hidden * (features + hidden + 2));
                    let mut packed = vec![0.0; d.packed_len()];
                    pack(&d, &params, &mut packed);
                    let mut rows = vec![0.0; d.rows_len()];
                    for (dst, src) in rows.chunks_exact_mut(d.padded).zip(params[g * hidden * features..].chunks_exact(hidden)) {
                        dst[..hidden].copy_from_slice(src);
                    }
                    // a group of five (the forward pass with AVX-512 takes a GRU's four and one, an
                    // LSTM's three and two; the backward four and one), and each sample alone
                    let inputs: Vec<Inputs> =
                        (0..5).map(|_| (rng.uniform(steps * features), rng.uniform(d.state_len()), rng.uniform(d.out_len()))).collect();
                    let want = run(isas[0], 1, &d, &packed, &rows, &inputs);
                    for (isa, group) in isas.iter().flat_map(|&isa| [(isa, 1), (isa, 5)]).skip(1) {
                        let got = run(isa, group, &d, &packed, &rows, &inputs);
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            let same = a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
                            assert!(
                                same,
                                "{cell:?} {hidden}×{features}×{steps} {output:?}: {isa:?} in groups of {group} differs from {:?} \
                                 alone in part {i}",
                                isas[0]
                            );
                        }
                    }
                }
            }
        }
        println!("compared {:?}", isas);
    }
}
