//! The backward pass's parameter gradients over all B·T steps at once, from every step's gate
//! gradients dg (m = B·T rows of 4·padded, gate block b of a row at b·padded):
//!
//!   dW (G·H × n) = Σ over the steps of dg_gᵀ·a,  db (G·H) = Σ over the steps of dg_g
//!
//! for a = X (n = F: W_ih, b_ih, the input blocks) and a = H_prev (n = H: W_hh, b_hh, the hidden
//! blocks). Each dW is first S (n × 4·padded) = aᵀ·dg, one product for each run of consecutive
//! gate blocks (all four of an LSTM's; a GRU's input side one, its hidden side two): `a` packed
//! once, and each step's gate gradients read as the contiguous row they are; then dW[g·H + u, j] =
//! S[j, blocks[g]·padded + u]. The products and the bias sums take the steps a chunk at a time,
//! so that the chunk's gate gradients, read from memory by the first product, are still in cache
//! for the second and for the sums (at 256 units and more they are megabytes of them, read three
//! times).

use super::Dims;
use crate::cpu::gemm::{sgemm, GemmWorkspace, Mat, MatMut, KC};
use crate::cpu::pool::Pool;
use crate::cpu::recurrent::transpose;

/// Steps a chunk takes: the GEMM's KC, so that a chunk ends where the GEMM ends a block of its
/// sums over k anyway (each block's sum is added to C): each element of S is then the chain it
/// would be in one product over all the steps, and its bits those of dg_gᵀ·a (the test below
/// checks it). 256 rows of dg: 512 KiB at 128 units, in L2.
const CHUNK: usize = KC;

/// One side's operands: aᵀ (n × m, column stride `ld`), its gate blocks, S's room (n × 4·padded)
/// and the gradients written (dW: G·H × n, db: G·H).
pub(super) struct Side<'a> {
    pub a: &'a [f32],
    pub ld: usize,
    pub n: usize,
    pub blocks: &'static [usize],
    pub s: &'a mut [f32],
    pub dw: &'a mut [f32],
    pub db: &'a mut [f32],
}

/// Both sides' dW and db from the m rows of `dg` (see the module docs).
pub(super) fn parameter_gradients(pool: &Pool, gemm: &mut GemmWorkspace, d: &Dims, dg: &[f32], m: usize, sides: &mut [Side]) {
    let row = d.row();
    for side in sides.iter_mut() {
        side.db.fill(0.0);
    }
    let mut first = 0;
    while first < m {
        // (a last chunk of under CHUNK steps is taken with the one before it: never a product of a
        // few steps, which the GEMM would take on another route, in another order)
        let steps = if m - first < 2 * CHUNK { m - first } else { CHUNK };
        for side in sides.iter_mut() {
            // a product of one row is one chain over all its k, which a split would change
            if side.n > 1 || first == 0 {
                let (k, at) = if side.n > 1 { (steps, first) } else { (m, 0) };
                let beta = if first == 0 { 0.0 } else { 1.0 };
                let a_t = Mat { data: &side.a[at * side.ld..], rs: 1, cs: side.ld };
                products(pool, gemm, d, a_t, side.n, side.blocks, &dg[at * row..], k, beta, side.s);
            }
            column_sums(d, side.blocks, &dg[first * row..][..steps * row], side.db);
        }
        first += steps;
    }
    for side in sides.iter_mut() {
        let (h, p, n) = (d.hidden, d.padded, side.n);
        for (dw, &block) in side.dw.chunks_exact_mut(h * n).zip(side.blocks) {
            transpose(n, h, &side.s[block * p..], row, dw, n);
        }
    }
}

/// S (n × 4·padded, each run of consecutive `blocks`' columns) ← aᵀ·dg + β·S over `k` steps.
/// S's columns of padding lanes are summed and never read.
#[allow(clippy::too_many_arguments)]
fn products(
    pool: &Pool,
    gemm: &mut GemmWorkspace,
    d: &Dims,
    a_t: Mat,
    n: usize,
    blocks: &[usize],
    dg: &[f32],
    k: usize,
    beta: f32,
    s: &mut [f32],
) {
    let (p, row) = (d.padded, d.row());
    let mut first = 0;
    while first < blocks.len() {
        let end = (first + 1..blocks.len()).find(|&i| blocks[i] != blocks[i - 1] + 1).unwrap_or(blocks.len());
        let (at, width) = (blocks[first] * p, (end - first) * p);
        let b = Mat { data: &dg[at..], rs: row, cs: 1 };
        sgemm(pool, gemm, n, width, k, 1.0, a_t, b, beta, MatMut { data: &mut s[at..n * row], rs: row, cs: 1 });
        first = end;
    }
}

/// db[g·H + u] += Σ over the rows of dg (4·padded each) of row[blocks[g]·padded + u], in order.
fn column_sums(d: &Dims, blocks: &[usize], dg: &[f32], db: &mut [f32]) {
    let (h, p) = (d.hidden, d.padded);
    for row in dg.chunks_exact(d.row()) {
        for (db, &block) in db.chunks_exact_mut(h).zip(blocks) {
            db.iter_mut().zip(&row[block * p..][..h]).for_each(|(s, &v)| *s += v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Shape;
    use crate::layers::recurrent::{Cell, RnnOutput, Streaming};
    use crate::testutil::Rng;

    /// dW has the bits of one product per gate over all the steps, dg_gᵀ·a, and db those of the
    /// in-order sum, with the steps in several chunks (the last one longer) and in one, on one and
    /// two threads, for both cells and a side of one row (F = 1); every value written (from NaN).
    #[test]
    fn chunks_give_the_bits_of_one_product_per_gate() {
        for (cell, hidden, features, m) in
            [(Cell::Lstm, 20, 3, 3 * CHUNK + 37), (Cell::Gru, 17, 1, 2 * CHUNK + 5), (Cell::Lstm, 5, 9, 7), (Cell::Gru, 33, 2, 2 * CHUNK)]
        {
            let d = Dims::new(cell, hidden, RnnOutput::Sequence, Streaming::No, Shape::sequence(1, features));
            let (g, f, h, p, row) = (d.gates(), features, hidden, d.padded, d.row());
            let mut rng = Rng::new(7);
            let (dg, x, hprev) = (rng.uniform(m * row), rng.uniform(m * f), rng.uniform(m * p));
            for threads in [1, 2] {
                let (pool, mut gemm) = (Pool::new(threads).unwrap(), GemmWorkspace::new(threads).unwrap());
                let mut room = vec![f32::NAN; d.backward_room()];
                let (mut dw_ih, mut dw_hh, mut db_ih, mut db_hh) =
                    (vec![f32::NAN; g * h * f], vec![f32::NAN; g * h * h], vec![f32::NAN; g * h], vec![f32::NAN; g * h]);
                let (s_ih, s_hh) = room[..(f + h) * row].split_at_mut(f * row);
                let mut sides = [
                    Side { a: &x, ld: f, n: f, blocks: cell.input_blocks(), s: s_ih, dw: &mut dw_ih, db: &mut db_ih },
                    Side { a: &hprev, ld: p, n: h, blocks: cell.hidden_blocks(), s: s_hh, dw: &mut dw_hh, db: &mut db_hh },
                ];
                parameter_gradients(&pool, &mut gemm, &d, &dg, m, &mut sides);
                for (a, ld, n, blocks, dw, db) in
                    [(&x, f, f, cell.input_blocks(), &dw_ih, &db_ih), (&hprev, p, h, cell.hidden_blocks(), &dw_hh, &db_hh)]
                {
                    let (mut want_w, mut want_b) = (vec![f32::NAN; g * h * n], vec![0.0f32; g * h]);
                    for (gate, &block) in blocks.iter().enumerate() {
                        let (dg_t, a) = (Mat { data: &dg[block * p..], rs: 1, cs: row }, Mat { data: a, rs: ld, cs: 1 });
                        let c = MatMut { data: &mut want_w[gate * h * n..][..h * n], rs: n, cs: 1 };
                        sgemm(&pool, &mut gemm, h, n, m, 1.0, dg_t, a, 0.0, c);
                        for step in 0..m {
                            for u in 0..h {
                                want_b[gate * h + u] += dg[step * row + block * p + u];
                            }
                        }
                    }
                    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same(dw, &want_w), "{cell:?} {h}×{n}, {m} steps, {threads} threads: dW differs");
                    assert!(same(db, &want_b), "{cell:?} {h}×{n}, {m} steps, {threads} threads: db differs");
                }
            }
        }
    }
}
