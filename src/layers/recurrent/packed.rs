//! The weights in the packed layout that the fast passes read (see the parent module's docs),
//! and the plain loops' view of them in either layout.

use super::Dims;
#[cfg(test)]
use super::LANES;
use crate::cpu::recurrent::pack_panels;

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
pub(super) fn pack_rows(d: &Dims, params: &[f32], rows: &mut [f32]) {
    let (g, f, h, p) = (d.gates(), d.features, d.hidden, d.padded);
    let w_hh = &params[g * h * f..][..g * h * h];
    for (dst, src) in rows[..d.rows_len()].chunks_exact_mut(p).zip(w_hh.chunks_exact(h)) {
        dst[..h].copy_from_slice(src);
        dst[h..].fill(0.0);
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
    use crate::chain::Shape;
    use crate::layers::recurrent::{Cell, RnnOutput, Streaming};

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
}
