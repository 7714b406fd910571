//! The recurrent layers' time loops over one sample (the fast CPU path of `layers::recurrent`),
//! written once over [`Lanes`] and compiled for AVX-512, for AVX2+FMA and portably, chosen at run
//! time as the activations' kernels are. Every product is a chain of fused multiply-adds in the
//! order of its terms and the gates use the activations' kernels, so the three give the same
//! bits; and one step of a batch of sequences is exactly one step of a stream (a stream's model
//! runs this same code one step at a time), which the tests check.
//!
//! A GRU or LSTM step of one sample runs in vectors of hidden units, two vectors at a time: the
//! recurrent product of those units for each gate (G accumulators a vector, started at b_hh, then
//! h_{t−1}[j]·W_hhᵀ[j, ·] added for j = 0, 1, … H − 1), then the gates in registers, where the
//! accumulators are.
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
use crate::layers::recurrent::{Cell, Dims, RnnOutput, Weights};

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

/// The forward pass over one sample's steps, with the weights in the streaming layout: the
/// output (and, with `keep`, every step's gates) and the final state.
pub(crate) fn forward_sample(d: &Dims, w: &Weights, s: Sample, keep: bool) {
    match Isa::best() {
        Isa::Portable => forward::<f32>(d, w, s, keep),
        // SAFETY: this CPU has the instruction set (`Isa::best` checked).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::forward(d, w, s, keep) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::forward(d, w, s, keep) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

/// The backward pass through one sample's steps, from the last to the first: every step's gate
/// gradients, and ∂L/∂h_{t−1} (∂L/∂c_{t−1}) for each. `rows`: W_hh with rows padded
/// (G·H × padded).
pub(crate) fn backward_sample(d: &Dims, rows: &[f32], s: BackSample) {
    match Isa::best() {
        Isa::Portable => backward::<f32>(d, rows, s),
        // SAFETY: this CPU has the instruction set (`Isa::best` checked).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::backward(d, rows, s) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::backward(d, rows, s) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

// Everything below is `#[inline(always)]` down to the lanes' intrinsics and uses no closures,
// so that it is compiled inside the `#[target_feature]` entry points (see `vmath`).

/// y[o] += Σ_b Σ_j xs[b][j]·bs[b][j·n + o] for o < n (a multiple of [`Lanes::LANES`]): each
/// y[o] one chain of fused multiply-adds, from its value, in the order of b and j.
#[inline(always)]
fn accumulate<V: Lanes>(xs: &[&[f32]], bs: &[&[f32]], n: usize, y: &mut [f32]) {
    let l = V::LANES;
    let mut c = 0;
    while c + 4 * l <= n {
        accumulate_block::<V, 4>(xs, bs, n, y, c);
        c += 4 * l;
    }
    if c + 2 * l <= n {
        accumulate_block::<V, 2>(xs, bs, n, y, c);
        c += 2 * l;
    }
    if c < n {
        accumulate_block::<V, 1>(xs, bs, n, y, c);
    }
}

/// [`accumulate`] over the `N` vectors of y from `c`.
#[inline(always)]
fn accumulate_block<V: Lanes, const N: usize>(xs: &[&[f32]], bs: &[&[f32]], n: usize, y: &mut [f32], c: usize) {
    let l = V::LANES;
    let mut acc = [V::splat(0.0); N];
    for i in 0..N {
        acc[i] = V::load(&y[c + i * l..]);
    }
    for (x, b) in xs.iter().zip(bs) {
        for (j, &xj) in x.iter().enumerate() {
            let (xj, row) = (V::splat(xj), &b[j * n + c..]);
            for i in 0..N {
                acc[i] = xj.mul_add(V::load(&row[i * l..]), acc[i]);
            }
        }
    }
    for i in 0..N {
        acc[i].store(&mut y[c + i * l..]);
    }
}

/// The forward pass of one sample (see [`forward_sample`]).
#[inline(always)]
fn forward<V: Lanes>(d: &Dims, w: &Weights, s: Sample, keep: bool) {
    let (steps, f, h, p, k, row) = (d.steps, d.features, d.hidden, d.padded, d.k(), d.row());
    let Sample { x, out, gates, hprev, state, cprev } = s;
    let lstm = d.cell == Cell::Lstm;
    // the input products of every step: x_t = W_ih·x_t + b_ih, G blocks of `padded`
    for t in 0..steps {
        let g = &mut gates[t * row..][..k];
        g.copy_from_slice(w.b_ih);
        accumulate::<V>(&[&x[t * f..][..f]], &[w.ih], k, g);
    }
    hprev[..p].copy_from_slice(&state[..p]);
    if lstm {
        cprev[..p].copy_from_slice(&state[p..2 * p]);
    }
    let (h_final, c_final) = d.final_slots();
    for t in 0..steps {
        let last = t + 1 == steps;
        // h_{t−1}, and where h_t goes: the next step's row, or the state's final slot
        let (h_done, h_next) = hprev.split_at_mut((t + 1) * p);
        let (c_done, c_next) = cprev.split_at_mut(if lstm { (t + 1) * p } else { 0 });
        // (the final c's slot lies after the final h's)
        let (state_h, state_c) = state.split_at_mut(if lstm { c_final } else { state.len() });
        let h_out = if last { &mut state_h[h_final..][..p] } else { &mut h_next[..p] };
        let g = &mut gates[t * row..][..row];
        if lstm {
            let c_out = if last { &mut state_c[..p] } else { &mut c_next[..p] };
            lstm_step::<V>(d, w, &h_done[t * p..], &c_done[t * p..], g, keep, h_out, c_out);
        } else {
            gru_step::<V>(d, w, &h_done[t * p..], g, keep, h_out);
        }
        if d.output == RnnOutput::Sequence {
            out[t * h..][..h].copy_from_slice(&h_out[..h]);
        }
    }
    if d.output == RnnOutput::LastStep {
        out[..h].copy_from_slice(&state[h_final..][..h]);
    }
}

/// One GRU step: h_t (`padded` values) from h_{t−1} and the step's input products (the first
/// three blocks of `g`, overwritten with r, z, n and a_n where `keep`).
#[inline(always)]
fn gru_step<V: Lanes>(d: &Dims, w: &Weights, h: &[f32], g: &mut [f32], keep: bool, h_out: &mut [f32]) {
    let (p, l) = (d.padded, V::LANES);
    let mut c = 0;
    while c + 2 * l <= p {
        gru_units::<V, 2>(d, w, h, g, keep, h_out, c);
        c += 2 * l;
    }
    if c < p {
        gru_units::<V, 1>(d, w, h, g, keep, h_out, c);
    }
}

/// [`gru_step`] for the `N` vectors of units from `c0`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // vector i of each gate's accumulators
fn gru_units<V: Lanes, const N: usize>(d: &Dims, w: &Weights, h: &[f32], g: &mut [f32], keep: bool, h_out: &mut [f32], c0: usize) {
    let (p, k, l) = (d.padded, d.k(), V::LANES);
    // a[gate][i]: gate's recurrent product (and bias) for vector i
    let mut a = [[V::splat(0.0); N]; 3];
    for (gate, a) in a.iter_mut().enumerate() {
        for (i, a) in a.iter_mut().enumerate() {
            *a = V::load(&w.b_hh[gate * p + c0 + i * l..]);
        }
    }
    for (j, &hj) in h[..d.hidden].iter().enumerate() {
        let (hj, row) = (V::splat(hj), &w.hh[j * k..]);
        for (gate, a) in a.iter_mut().enumerate() {
            for (i, a) in a.iter_mut().enumerate() {
                *a = hj.mul_add(V::load(&row[gate * p + c0 + i * l..]), *a);
            }
        }
    }
    for i in 0..N {
        let c = c0 + i * l;
        let r = sigmoid(V::load(&g[c..]) + a[0][i]);
        let z = sigmoid(V::load(&g[p + c..]) + a[1][i]);
        let n = tanh(r.mul_add(a[2][i], V::load(&g[2 * p + c..])));
        z.mul_add(V::load(&h[c..]) - n, n).store(&mut h_out[c..]);
        if keep {
            r.store(&mut g[c..]);
            z.store(&mut g[p + c..]);
            n.store(&mut g[2 * p + c..]);
            a[2][i].store(&mut g[3 * p + c..]);
        }
    }
}

/// One LSTM step: h_t and c_t from h_{t−1}, c_{t−1} and the step's input products (the four
/// blocks of `g`, overwritten with i, f, g, o where `keep`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn lstm_step<V: Lanes>(d: &Dims, w: &Weights, h: &[f32], c: &[f32], g: &mut [f32], keep: bool, h_out: &mut [f32], c_out: &mut [f32]) {
    let (p, l) = (d.padded, V::LANES);
    let mut c0 = 0;
    while c0 + 2 * l <= p {
        lstm_units::<V, 2>(d, w, (h, c), g, keep, (&mut *h_out, &mut *c_out), c0);
        c0 += 2 * l;
    }
    if c0 < p {
        lstm_units::<V, 1>(d, w, (h, c), g, keep, (h_out, c_out), c0);
    }
}

/// [`lstm_step`] for the `N` vectors of units from `c0`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // vector i of each gate's accumulators
fn lstm_units<V: Lanes, const N: usize>(
    d: &Dims,
    w: &Weights,
    (h, c): (&[f32], &[f32]),
    g: &mut [f32],
    keep: bool,
    (h_out, c_out): (&mut [f32], &mut [f32]),
    c0: usize,
) {
    let (p, k, l) = (d.padded, d.k(), V::LANES);
    let mut a = [[V::splat(0.0); N]; 4];
    for (gate, a) in a.iter_mut().enumerate() {
        for (i, a) in a.iter_mut().enumerate() {
            *a = V::load(&w.b_hh[gate * p + c0 + i * l..]);
        }
    }
    for (j, &hj) in h[..d.hidden].iter().enumerate() {
        let (hj, row) = (V::splat(hj), &w.hh[j * k..]);
        for (gate, a) in a.iter_mut().enumerate() {
            for (i, a) in a.iter_mut().enumerate() {
                *a = hj.mul_add(V::load(&row[gate * p + c0 + i * l..]), *a);
            }
        }
    }
    for i in 0..N {
        let u = c0 + i * l;
        let ig = sigmoid(V::load(&g[u..]) + a[0][i]);
        let fg = sigmoid(V::load(&g[p + u..]) + a[1][i]);
        let gg = tanh(V::load(&g[2 * p + u..]) + a[2][i]);
        let og = sigmoid(V::load(&g[3 * p + u..]) + a[3][i]);
        let ct = fg.mul_add(V::load(&c[u..]), ig * gg);
        ct.store(&mut c_out[u..]);
        (og * tanh(ct)).store(&mut h_out[u..]);
        if keep {
            ig.store(&mut g[u..]);
            fg.store(&mut g[p + u..]);
            gg.store(&mut g[2 * p + u..]);
            og.store(&mut g[3 * p + u..]);
        }
    }
}

/// The backward pass of one sample (see [`backward_sample`]). Step t's ∂L/∂h_t is what step t + 1
/// carried back into hprev's twin (row t + 1; none for the last step) plus the output's gradient;
/// it is summed in that row (for the last step, in the state twin's final slot). Then the gate
/// gradients, and ∂L/∂h_{t−1} = (GRU: ∂L/∂h_t·z) + Σ_g dg_g·W_hh,g into row t.
#[inline(always)]
fn backward<V: Lanes>(d: &Dims, rows: &[f32], s: BackSample) {
    let (steps, h, p, row) = (d.steps, d.hidden, d.padded, d.row());
    let BackSample { gates, hprev, state, cprev, dy, dgates, dhprev, dstate, dcprev } = s;
    let lstm = d.cell == Cell::Lstm;
    let (h_final, c_final) = d.final_slots();
    let blocks = d.cell.hidden_blocks();
    for t in (0..steps).rev() {
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
        let dh_prev = &mut dh_done[t * p..];
        let (g, dg) = (&gates[t * row..][..row], &mut dgates[t * row..][..row]);
        if lstm {
            let c = if last { &state[c_final..][..p] } else { &cprev[(t + 1) * p..][..p] };
            let c_prev = &cprev[t * p..][..p];
            let (dc_done, dc_next) = dcprev.split_at_mut((t + 1) * p);
            for u in 0..h {
                let (i, f, gg, o) = (g[u], g[p + u], g[2 * p + u], g[3 * p + u]);
                let tc = c[u].tanh();
                let carried = if last { 0.0 } else { dc_next[u] };
                let dc = carried + dh[u] * o * (1.0 - tc * tc);
                dg[u] = dc * gg * i * (1.0 - i);
                dg[p + u] = dc * c_prev[u] * f * (1.0 - f);
                dg[2 * p + u] = dc * i * (1.0 - gg * gg);
                dg[3 * p + u] = dh[u] * tc * o * (1.0 - o);
                dc_done[t * p + u] = dc * f;
                dh_prev[u] = 0.0;
            }
        } else {
            let hp = &hprev[t * p..][..p];
            for u in 0..h {
                let (r, z, n, an) = (g[u], g[p + u], g[2 * p + u], g[3 * p + u]);
                let dn = dh[u] * (1.0 - z);
                let dz = dh[u] * (hp[u] - n);
                let dan = dn * (1.0 - n * n);
                dg[u] = dan * an * r * (1.0 - r);
                dg[p + u] = dz * z * (1.0 - z);
                dg[2 * p + u] = dan;
                dg[3 * p + u] = dan * r;
                dh_prev[u] = dh[u] * z;
            }
        }
        // the padding lanes of ∂L/∂h_{t−1}: read by the vectors below, never by a unit
        dh_prev[h..p].fill(0.0);
        let mut xs: [&[f32]; 4] = [&[]; 4];
        let mut bs: [&[f32]; 4] = [&[]; 4];
        for (gate, &block) in blocks.iter().enumerate() {
            xs[gate] = &dg[block * p..][..h];
            bs[gate] = &rows[gate * h * p..][..h * p];
        }
        accumulate::<V>(&xs[..blocks.len()], &bs[..blocks.len()], p, &mut dh_prev[..p]);
    }
}

/// The loops compiled for one instruction set.
macro_rules! instantiate {
    ($name:ident, $lanes:ty, $features:literal) => {
        mod $name {
            use super::*;

            #[target_feature(enable = $features)]
            pub(super) fn forward(d: &Dims, w: &Weights, s: Sample, keep: bool) {
                super::forward::<$lanes>(d, w, s, keep)
            }

            #[target_feature(enable = $features)]
            pub(super) fn backward(d: &Dims, rows: &[f32], s: BackSample) {
                super::backward::<$lanes>(d, rows, s)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
instantiate!(avx2, Avx2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
instantiate!(avx512, Avx512, "avx512f");
