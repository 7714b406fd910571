//! A group's backward pass through time (see [`super::backward_group`]): each step's gate
//! gradients, then ∂L/∂h_{t−1}'s product with W_hh for several samples at once.

use super::BackSample;
use crate::cpu::vmath::kernels::gate_tanh;
use crate::cpu::vmath::lanes::Lanes;
use crate::layers::recurrent::{Cell, Dims, RnnOutput};

/// The backward pass of a group (see [`backward_group`]), its samples in lockstep from the last
/// step to the first. Step t's ∂L/∂h_t is what step t + 1 carried back into hprev's twin (row
/// t + 1; none for the last step) plus the output's gradient; it is summed in that row (for the
/// last step, in the state twin's final slot). Then the gate gradients, and ∂L/∂h_{t−1} = (GRU:
/// ∂L/∂h_t·z) + Σ_g dg_g·W_hh,g into row t, for several samples at once (each weight vector
/// loaded once for them: four with AVX-512, two elsewhere; the sum's order is a sample's own).
#[inline(always)]
pub(super) fn backward<V: Lanes, const VPP: usize>(d: &Dims, rows: &[f32], group: &mut [BackSample]) {
    let samples_at_once = if VPP == 1 { 4 } else { 2 };
    for t in (0..d.steps).rev() {
        for s in group.iter_mut() {
            if t > 0 {
                prefetch_step(d, t - 1, s);
            }
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
            let tc = gate_tanh(V::load(&c[u..]));
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

/// Asks for sample `s`'s rows of step t in L2: those its backward step reads or writes, but the
/// one the step after it carried back (in cache). A call of its own: inlined, it changed how
/// the loops above were compiled, 3 % slower at batch 8 (where the rows are in cache anyway).
#[inline(never)]
fn prefetch_step(d: &Dims, t: usize, s: &BackSample) {
    let (p, row) = (d.padded, d.row());
    for rows in [&s.gates[t * row..][..row], &s.dgates[t * row..][..row], &s.dhprev[t * p..][..p]] {
        prefetch_l2(rows);
    }
    if d.cell == Cell::Lstm {
        prefetch_l2(&s.cprev[t * p..][..p]);
        prefetch_l2(&s.dcprev[t * p..][..p]);
    } else {
        prefetch_l2(&s.hprev[t * p..][..p]);
    }
}

/// Asks for the cache lines of `values` in L2 (a hint: a prefetch never faults). The backward
/// pass walks each sample's rows from the last step to the first, a group's samples in lockstep,
/// and the forward pass wrote them long before: where the batch's have left the caches, each
/// step waited on them (training steps from batch 32 on up to 16 % slower, see the commit).
#[inline(always)]
fn prefetch_l2(values: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in values.chunks(16) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        // SAFETY: SSE is part of x86_64; a prefetch reads nothing and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = values;
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
