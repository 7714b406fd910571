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
//! then the gates in registers, where the products are.
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

/// The forward pass over one sample's steps, with the weights in the packed layout: the output
/// (and, with `keep`, every step's gates) and the final state.
pub(crate) fn forward_sample(d: &Dims, w: &Weights, s: Sample, keep: bool) {
    match Isa::best() {
        Isa::Portable => forward::<f32, 16>(d, w, s, keep),
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
        Isa::Portable => backward::<f32, 16>(d, rows, s),
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

/// The forward pass of one sample (see [`forward_sample`]); `VPP` vectors of `V` make a panel.
#[inline(always)]
fn forward<V: Lanes, const VPP: usize>(d: &Dims, w: &Weights, s: Sample, keep: bool) {
    debug_assert_eq!(VPP * V::LANES, PANEL);
    let (steps, f, h, p, row) = (d.steps, d.features, d.hidden, d.padded, d.row());
    let Sample { x, out, gates, hprev, state, cprev } = s;
    let lstm = d.cell == Cell::Lstm;
    // the input products of every step: W_ih·x_t + b_ih, G blocks of `padded`
    for t in 0..steps {
        let (x, g) = (&x[t * f..][..f], &mut gates[t * row..][..row]);
        if lstm {
            input_product::<V, VPP, 4>(d, w, x, g);
        } else {
            input_product::<V, VPP, 3>(d, w, x, g);
        }
    }
    copy::<V>(&state[..p], &mut hprev[..p]);
    if lstm {
        copy::<V>(&state[p..2 * p], &mut cprev[..p]);
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
        let step = Step { h: &h_done[t * p..][..p], g, keep, h_out };
        if lstm {
            let c_out = if last { &mut state_c[..p] } else { &mut c_next[..p] };
            lstm_step::<V, VPP>(d, w, step, &c_done[t * p..][..p], c_out);
        } else {
            gru_step::<V, VPP>(d, w, step);
        }
        if d.output == RnnOutput::Sequence {
            let h_t = if last { &state[h_final..][..h] } else { &hprev[(t + 1) * p..][..h] };
            copy::<V>(h_t, &mut out[t * h..][..h]);
        }
    }
    if d.output == RnnOutput::LastStep {
        copy::<V>(&state[h_final..][..h], &mut out[..h]);
    }
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

/// What a time step of one sample reads and writes: h_{t−1} and h_t (`padded` values each), the
/// step's kept gates (input products in, gates out where `keep`).
struct Step<'a> {
    h: &'a [f32],
    g: &'a mut [f32],
    keep: bool,
    h_out: &'a mut [f32],
}

/// The recurrent products of one vector of units (`v` of each panel) in `P` panels from panel
/// `q0`: a[gate][n] = b_hh + Σ_j h[j]·W_hh[gate·H + u, j], summed as two chains of fused
/// multiply-adds, one over the even j from b_hh, one over the odd j from 0, then added (halving the
/// chain a small layer waits on).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // gate and panel indices of the accumulators
fn recurrent_product<V: Lanes, const P: usize, const G: usize>(d: &Dims, w: &Weights, h: &[f32], q0: usize, v: usize) -> [[V; P]; G] {
    let (p, width) = (d.padded, G * PANEL);
    let (len, at) = (d.hidden * width, v * V::LANES);
    let (mut even, mut odd) = ([[V::splat(0.0); P]; G], [[V::splat(0.0); P]; G]);
    let mut panels = [&w.hh[..0]; P];
    for n in 0..P {
        panels[n] = &w.hh[(q0 + n) * len..][..len];
        for gate in 0..G {
            even[gate][n] = V::load(&w.b_hh[gate * p + (q0 + n) * PANEL + at..]);
        }
    }
    let pairs = d.hidden / 2;
    for (j, hj) in h[..2 * pairs].chunks_exact(2).enumerate() {
        let (h0, h1) = (V::splat(hj[0]), V::splat(hj[1]));
        for n in 0..P {
            let rows = &panels[n][2 * j * width..][..2 * width];
            for gate in 0..G {
                even[gate][n] = h0.mul_add(V::load(&rows[gate * PANEL + at..]), even[gate][n]);
                odd[gate][n] = h1.mul_add(V::load(&rows[width + gate * PANEL + at..]), odd[gate][n]);
            }
        }
    }
    if d.hidden % 2 == 1 {
        let hj = V::splat(h[d.hidden - 1]);
        for n in 0..P {
            let row = &panels[n][(d.hidden - 1) * width..][..width];
            for gate in 0..G {
                even[gate][n] = hj.mul_add(V::load(&row[gate * PANEL + at..]), even[gate][n]);
            }
        }
    }
    for gate in 0..G {
        for n in 0..P {
            even[gate][n] = even[gate][n] + odd[gate][n];
        }
    }
    even
}

/// Panels a step takes at a time: two where each panel is one vector (AVX-512: G·2·2 accumulators
/// of its 32 registers), else one, a vector of it at a time.
const fn panels_at_once(vpp: usize) -> usize {
    if vpp == 1 {
        2
    } else {
        1
    }
}

/// One GRU step: h_t from h_{t−1} and the step's input products (the first three blocks of `g`,
/// overwritten with r, z, n and a_n where `keep`).
#[inline(always)]
fn gru_step<V: Lanes, const VPP: usize>(d: &Dims, w: &Weights, mut s: Step) {
    let (panels, mut q) = (d.padded / PANEL, 0);
    if panels_at_once(VPP) == 2 {
        while q + 2 <= panels {
            gru_vector::<V, 2>(d, w, &mut s, q, 0);
            q += 2;
        }
    }
    for q in q..panels {
        for v in 0..VPP {
            gru_vector::<V, 1>(d, w, &mut s, q, v);
        }
    }
}

/// [`gru_step`] for vector `v` of the `P` panels from panel `q0`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // panel indices of the accumulators
fn gru_vector<V: Lanes, const P: usize>(d: &Dims, w: &Weights, s: &mut Step, q0: usize, v: usize) {
    let p = d.padded;
    let a = recurrent_product::<V, P, 3>(d, w, s.h, q0, v);
    let g = &mut *s.g;
    for n in 0..P {
        let c = (q0 + n) * PANEL + v * V::LANES;
        let r = sigmoid(V::load(&g[c..]) + a[0][n]);
        let z = sigmoid(V::load(&g[p + c..]) + a[1][n]);
        let nn = tanh(r.mul_add(a[2][n], V::load(&g[2 * p + c..])));
        z.mul_add(V::load(&s.h[c..]) - nn, nn).store(&mut s.h_out[c..]);
        if s.keep {
            r.store(&mut g[c..]);
            z.store(&mut g[p + c..]);
            nn.store(&mut g[2 * p + c..]);
            a[2][n].store(&mut g[3 * p + c..]);
        }
    }
}

/// One LSTM step: h_t and c_t (into `c_out`) from h_{t−1}, c_{t−1} (`c`) and the step's input
/// products (the four blocks of `g`, overwritten with i, f, g, o where `keep`).
#[inline(always)]
fn lstm_step<V: Lanes, const VPP: usize>(d: &Dims, w: &Weights, mut s: Step, c: &[f32], c_out: &mut [f32]) {
    let (panels, mut q) = (d.padded / PANEL, 0);
    if panels_at_once(VPP) == 2 {
        while q + 2 <= panels {
            lstm_vector::<V, 2>(d, w, &mut s, (c, &mut *c_out), q, 0);
            q += 2;
        }
    }
    for q in q..panels {
        for v in 0..VPP {
            lstm_vector::<V, 1>(d, w, &mut s, (c, &mut *c_out), q, v);
        }
    }
}

/// [`lstm_step`] for vector `v` of the `P` panels from panel `q0`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // panel indices of the accumulators
fn lstm_vector<V: Lanes, const P: usize>(d: &Dims, w: &Weights, s: &mut Step, (c, c_out): (&[f32], &mut [f32]), q0: usize, v: usize) {
    let p = d.padded;
    let a = recurrent_product::<V, P, 4>(d, w, s.h, q0, v);
    let g = &mut *s.g;
    for n in 0..P {
        let u = (q0 + n) * PANEL + v * V::LANES;
        let ig = sigmoid(V::load(&g[u..]) + a[0][n]);
        let fg = sigmoid(V::load(&g[p + u..]) + a[1][n]);
        let gg = tanh(V::load(&g[2 * p + u..]) + a[2][n]);
        let og = sigmoid(V::load(&g[3 * p + u..]) + a[3][n]);
        let ct = fg.mul_add(V::load(&c[u..]), ig * gg);
        ct.store(&mut c_out[u..]);
        (og * tanh(ct)).store(&mut s.h_out[u..]);
        if s.keep {
            ig.store(&mut g[u..]);
            fg.store(&mut g[p + u..]);
            gg.store(&mut g[2 * p + u..]);
            og.store(&mut g[3 * p + u..]);
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

/// The backward pass of one sample (see [`backward_sample`]). Step t's ∂L/∂h_t is what step t + 1
/// carried back into hprev's twin (row t + 1; none for the last step) plus the output's gradient;
/// it is summed in that row (for the last step, in the state twin's final slot). Then the gate
/// gradients, and ∂L/∂h_{t−1} = (GRU: ∂L/∂h_t·z) + Σ_g dg_g·W_hh,g into row t.
#[inline(always)]
fn backward<V: Lanes, const VPP: usize>(d: &Dims, rows: &[f32], s: BackSample) {
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
    ($name:ident, $lanes:ty, $vpp:literal, $features:literal) => {
        mod $name {
            use super::*;

            #[target_feature(enable = $features)]
            pub(super) fn forward(d: &Dims, w: &Weights, s: Sample, keep: bool) {
                super::forward::<$lanes, $vpp>(d, w, s, keep)
            }

            #[target_feature(enable = $features)]
            pub(super) fn backward(d: &Dims, rows: &[f32], s: BackSample) {
                super::backward::<$lanes, $vpp>(d, rows, s)
            }
        }
    };
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

    /// The outputs of one sample's forward and backward passes on one instruction set.
    fn run(isa: Isa, d: &Dims, packed: &[f32], rows: &[f32], x: &[f32], state: &[f32], dy: &[f32]) -> Vec<Vec<f32>> {
        let (t, p, row) = (d.steps, d.padded, d.row());
        let (mut out, mut gates, mut hprev, mut st, mut cprev) =
            (vec![f32::NAN; d.out_len()], vec![f32::NAN; t * row], vec![f32::NAN; t * p], state.to_vec(), vec![f32::NAN; t * p]);
        if d.cell == Cell::Gru {
            cprev.clear();
        }
        let (mut dgates, mut dhprev, mut dstate, mut dcprev) =
            (vec![f32::NAN; t * row], vec![f32::NAN; t * p], vec![f32::NAN; d.state_len()], vec![f32::NAN; cprev.len()]);
        let w = Weights::of(d, packed);
        let s = Sample { x, out: &mut out, gates: &mut gates, hprev: &mut hprev, state: &mut st, cprev: &mut cprev };
        match isa {
            Isa::Portable => forward::<f32, 16>(d, &w, s, true),
            // SAFETY: asked for only where this CPU has it (`Isa::available`).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::forward(d, &w, s, true) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::forward(d, &w, s, true) },
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => unreachable!(),
        }
        let b = BackSample {
            gates: &gates,
            hprev: &hprev,
            state: &st,
            cprev: &cprev,
            dy,
            dgates: &mut dgates,
            dhprev: &mut dhprev,
            dstate: &mut dstate,
            dcprev: &mut dcprev,
        };
        match isa {
            Isa::Portable => backward::<f32, 16>(d, rows, b),
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::backward(d, rows, b) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::backward(d, rows, b) },
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => unreachable!(),
        }
        // the units of each kept row (padding lanes hold what the lanes' arithmetic left there)
        let units = |v: &[f32], width: usize| -> Vec<f32> {
            v.chunks(width).flat_map(|r| r.chunks(p).flat_map(|b| b[..d.hidden].to_vec())).collect()
        };
        vec![out, units(&gates, row), units(&hprev, p), units(&st, p), units(&dgates, row), units(&dhprev, p), units(&dcprev, p)]
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
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
                    let (x, state, dy) = (rng.uniform(steps * features), rng.uniform(d.state_len()), rng.uniform(d.out_len()));
                    let want = run(isas[0], &d, &packed, &rows, &x, &state, &dy);
                    for &isa in &isas[1..] {
                        let got = run(isa, &d, &packed, &rows, &x, &state, &dy);
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            let same = a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
                            assert!(
                                same,
                                "{cell:?} {hidden}×{features}×{steps} {output:?}: {isa:?} differs from {:?} in part {i}",
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
