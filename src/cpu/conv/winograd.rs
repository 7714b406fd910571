//! The Winograd route, forward only, for kernels 3 wide at stride 1: each output row's columns
//! in pairs by F(2, 3), four products where the direct route takes six.
//!
//! For a pair of outputs (2t, 2t + 1) of row y and a kernel row i of channel c, with d_k =
//! in[c, y + i − ph, 2t + k − pw] (zero outside the input) and g = w[oc, c, i, ·]:
//!
//!   m0 = (d0 − d2)·g0            m1 = (d1 + d2)·(g0 + g1 + g2)/2
//!   m2 = (d2 − d1)·(g0 − g1 + g2)/2   m3 = (d1 − d3)·g2
//!   z[2t] = m0 + m1 + m2 = d0·g0 + d1·g1 + d2·g2,   z[2t + 1] = m1 − m2 − m3 = d1·g0 + d2·g1 + d3·g2
//!
//! Summed over (c, i), each m is a product of the direct route's kind: M_ξ (OC × OH·T, T =
//! ⌈OW / 2⌉ pairs a row) = U_ξ (OC × C·kh, the weights transformed once, at packing) · B_ξ,
//! where row (c, i) of B_ξ is the transformed input V_ξ of channel c from padded row i on:
//! V_ξ (C × (H + 2·ph) × T) holds each padded row's T values d0 − d2, d1 + d2, d2 − d1 or
//! d1 − d3, and the GEMM reads its rows in place at offsets (as [`sgemm_shifted_on`] reads the
//! direct route's planes), the runs of consecutive output rows adjoining. Then z from the four
//! M by the sums above, block by block of output rows, each through the epilogue.
//!
//! The products take 2/3 of the direct route's multiply-adds (3·C·kh·OC per pair against 6·…);
//! the transforms add a pass over the input and one over the output. The values are those of
//! the convolution up to rounding: the transforms add and halve, exactly on small integers.

use super::epilogue::{blocks, Epilogue, Outputs};
use super::lowered::pad_to;
use super::{ConvShape, Sample};
use crate::cpu::gemm::{sgemm_shifted_on, shifted_slack, GemmScratch, MatMut};
use crate::cpu::isa::Isa;
use crate::error::{Error, Result};
use std::ops::Range;

/// Whether the route computes `s`: a kernel 3 wide, stride 1.
pub(crate) fn fits(s: &ConvShape) -> bool {
    s.kernel.1 == 3 && s.stride == (1, 1)
}

/// U_ξ[oc, (c, i)] from the kernel row g = w[oc, c, i, ·] (see the module's documentation).
pub(super) fn transformed_weight(xi: usize, g: [f32; 3]) -> f32 {
    match xi {
        0 => g[0],
        1 => (g[0] + g[1] + g[2]) * 0.5,
        2 => (g[0] - g[1] + g[2]) * 0.5,
        _ => g[2],
    }
}

/// Sizes of the transformed input, from the shape.
#[derive(Clone, Copy)]
struct Tiles {
    /// Pairs of output columns a row: ⌈OW / 2⌉.
    pairs: usize,
    /// Padded rows: H + 2·ph.
    rows: usize,
    /// Values of a padded row as the transform reads it: 2·pairs + 2 (≥ W + 2·pw: one more
    /// where OW is odd).
    width: usize,
    /// Values of one V_ξ: C × rows × pairs.
    len: usize,
}

impl Tiles {
    fn of(s: &ConvShape) -> Tiles {
        let (pairs, rows) = (s.ow().div_ceil(2), s.height + 2 * s.padding.0);
        Tiles { pairs, rows, width: 2 * pairs + 2, len: s.in_channels * rows * pairs }
    }

    /// Values of the padded input: C planes of rows × width.
    fn padded(&self, s: &ConvShape) -> usize {
        s.in_channels * self.rows * self.width
    }
}

/// Values the transform of a row reads past its end (a vector's worth of the next row, or
/// slack past the last).
const OVERREAD: usize = 32;

/// The pairs (columns of each M_ξ, counted from the first of the sample) that output positions
/// `block` (p = y·OW + x) need: whole rows, or for a single row (OH = 1) the pairs of its part,
/// which starts at an even column (`blocks` cuts it in multiples of 64).
fn pairs(s: &ConvShape, t: &Tiles, block: &Range<usize>) -> Range<usize> {
    let ow = s.ow();
    if s.oh() == 1 {
        block.start / 2..block.end.div_ceil(2)
    } else {
        block.start / ow * t.pairs..block.end / ow * t.pairs
    }
}

/// Scratch one thread needs: the padded input (and the slack its transform reads past it), the
/// four V_ξ (each with the GEMM's slack past its end) and the four M_ξ of the largest block.
pub(super) fn scratch_len(isa: Isa, s: &ConvShape) -> usize {
    if !fits(s) || s.out_size().is_err() {
        return 0;
    }
    let t = Tiles::of(s);
    let most = blocks(s.out_channels, (s.oh(), s.ow())).map(|b| pairs(s, &t, &b).len()).max().unwrap_or(0);
    t.padded(s) + OVERREAD + 4 * (t.len + shifted_slack(isa)) + 4 * s.out_channels * most
}

/// Offset in a V_ξ of row (c, i) of B_ξ: channel c's padded row i.
pub(super) fn offsets(s: &ConvShape) -> Result<Vec<usize>> {
    if !fits(s) {
        return Ok(Vec::new());
    }
    let (t, kh) = (Tiles::of(s), s.kernel.0);
    let rows = s.in_channels * kh;
    let mut out = Vec::new();
    out.try_reserve_exact(rows).map_err(|_| Error::OutOfMemory { what: "convolution offsets".into(), bytes: rows.saturating_mul(8) })?;
    out.extend((0..rows).map(|row| (row / kh * t.rows + row % kh) * t.pairs));
    Ok(out)
}

/// z_s (OC × OH·OW) ← conv(x_s) (see the module's documentation), block by block of output
/// rows ([`blocks`]), each then through the epilogue.
pub(super) fn forward(gemm: &mut GemmScratch, buf: &mut [f32], p: &Sample, x: &[f32], e: &Epilogue, out: &mut Outputs) {
    let (s, t) = (p.shape, Tiles::of(p.shape));
    let u = p.weights.winograd.as_ref().expect("weights packed for the Winograd route");
    let slack = shifted_slack(u[0].isa());
    let (padded, rest) = buf.split_at_mut(t.padded(s) + OVERREAD);
    let (v, m) = rest.split_at_mut(4 * (t.len + slack));
    pad_to(x, s.in_channels, (s.height, s.width), s.padding, (t.rows, t.width), padded);
    transform_input(&t, padded, v);
    let (oc, ohw) = (s.out_channels, s.oh() * s.ow());
    for block in blocks(oc, (s.oh(), s.ow())) {
        out.prefetch(ohw, block.clone());
        let cols = pairs(s, &t, &block);
        let n = cols.len();
        for (xi, (u, v)) in u.iter().zip(v.chunks_exact(t.len + slack)).enumerate() {
            let m = MatMut { data: &mut m[xi * oc * n..][..oc * n], rs: n, cs: 1 };
            sgemm_shifted_on(gemm, n, 1.0, u, &v[cols.start..], p.winograd_offsets, (n, n), 0.0, m);
        }
        transform_output(s, &t, &m[..4 * oc * n], &cols, block.clone(), out.z);
        e.apply(ohw, out, block);
    }
}

/// v (the four V_ξ, each `t.len` values then the slack) ← the transform of each padded row
/// (`padded`: C·rows rows of `t.width` values, then [`OVERREAD`] more): the pairs' d0 − d2,
/// d1 + d2, d2 − d1 and d1 − d3.
fn transform_input(t: &Tiles, padded: &[f32], v: &mut [f32]) {
    let (n, stride) = (t.pairs, v.len() / 4);
    let rows = t.len / n;
    assert!(padded.len() >= rows * t.width + OVERREAD && stride >= t.len, "winograd: transform buffers too short");
    let (v0, rest) = v.split_at_mut(stride);
    let (v1, rest) = rest.split_at_mut(stride);
    let (v2, v3) = rest.split_at_mut(stride);
    #[cfg(target_arch = "x86_64")]
    if Isa::best() == Isa::Avx512 {
        for r in 0..rows {
            let (q, at) = (padded[r * t.width..].as_ptr(), r * n);
            let out = [&mut v0[at..], &mut v1[at..], &mut v2[at..], &mut v3[at..]].map(|v| v.as_mut_ptr());
            // SAFETY: the row's reads end within 2n + 32 values of its start, inside `padded`
            // (its width is 2n + 2, OVERREAD past the last); each V_ξ has n values from `at`
            // (checked above); AVX-512F present.
            unsafe { avx512::transform_row(q, n, out) };
        }
        return;
    }
    for r in 0..rows {
        let (q, at) = (&padded[r * t.width..][..t.width], r * n);
        for k in 0..n {
            let d = &q[2 * k..2 * k + 4];
            (v0[at + k], v1[at + k], v2[at + k], v3[at + k]) = (d[0] - d[2], d[1] + d[2], d[2] - d[1], d[1] - d[3]);
        }
    }
}

/// Output positions `block` of every channel of z (OC planes of OH·OW) from the four M_ξ of its
/// pairs `cols` (each OC × cols.len()): z[2t] = m0 + m1 + m2, z[2t + 1] = m1 − m2 − m3.
fn transform_output(s: &ConvShape, t: &Tiles, m: &[f32], cols: &Range<usize>, block: Range<usize>, z: &mut [f32]) {
    let (oc, ow, ohw, n) = (s.out_channels, s.ow(), s.oh() * s.ow(), cols.len());
    let (m0, rest) = m.split_at(oc * n);
    let (m1, rest) = rest.split_at(oc * n);
    let (m2, m3) = rest.split_at(oc * n);
    for c in 0..oc {
        let r = c * n..(c + 1) * n;
        let m = [&m0[r.clone()], &m1[r.clone()], &m2[r.clone()], &m3[r]];
        let plane = &mut z[c * ohw..][..ohw];
        if s.oh() == 1 {
            // a part of the single row: pairs from the even column block.start
            pair_out(m, &mut plane[block.clone()]);
            continue;
        }
        for (k, y) in (block.start / ow..block.end / ow).enumerate() {
            let at = k * t.pairs..(k + 1) * t.pairs;
            pair_out(m.map(|m| &m[at.clone()]), &mut plane[y * ow..][..ow]);
        }
    }
}

/// out[2t] = m0 + m1 + m2 and, where out reaches, out[2t + 1] = m1 − m2 − m3; each m holds
/// ⌈out.len() / 2⌉ values at least.
fn pair_out(m: [&[f32]; 4], out: &mut [f32]) {
    let pairs = out.len().div_ceil(2);
    assert!(m.iter().all(|m| m.len() >= pairs), "winograd: M shorter than the output's pairs");
    #[cfg(target_arch = "x86_64")]
    if Isa::best() == Isa::Avx512 {
        // SAFETY: each m holds the pairs (checked above), out its values; AVX-512F present.
        return unsafe { avx512::pair_out(m.map(|m| m.as_ptr()), out.as_mut_ptr(), out.len()) };
    }
    for (k, pair) in out.chunks_mut(2).enumerate() {
        pair[0] = m[0][k] + m[1][k] + m[2][k];
        if let Some(second) = pair.get_mut(1) {
            *second = m[1][k] - m[2][k] - m[3][k];
        }
    }
}

/// The transforms on 16 lanes, pairs split from and merged into rows by permutes.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// The lanes of a vector of 16 from `at` that lie below `len`.
    #[inline(always)]
    fn below(len: usize, at: usize) -> __mmask16 {
        match len.saturating_sub(at) {
            n if n >= 16 => 0xFFFF,
            n => (1u16 << n) - 1,
        }
    }

    /// v_ξ[k] for k < n from the padded row q: d0 − d2, d1 + d2, d2 − d1, d1 − d3 of pair k.
    ///
    /// # Safety
    /// q reaches 2·n + 32 values (the last group's loads, some of them dropped); each v holds n;
    /// AVX-512F present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transform_row(q: *const f32, n: usize, [v0, v1, v2, v3]: [*mut f32; 4]) {
        let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        // SAFETY: group k0 loads q[2·k0..2·k0 + 34), within the contract's reach; the stores are
        // of the lanes k0 + l < n.
        unsafe {
            for k0 in (0..n).step_by(16) {
                let q = q.add(2 * k0);
                let (a, b) = (_mm512_loadu_ps(q), _mm512_loadu_ps(q.add(16)));
                let (a2, b2) = (_mm512_loadu_ps(q.add(2)), _mm512_loadu_ps(q.add(18)));
                // d0 = q[2k], d1 = q[2k + 1], d2 = q[2k + 2], d3 = q[2k + 3]
                let (d0, d1) = (_mm512_permutex2var_ps(a, evens, b), _mm512_permutex2var_ps(a, odds, b));
                let (d2, d3) = (_mm512_permutex2var_ps(a2, evens, b2), _mm512_permutex2var_ps(a2, odds, b2));
                let mask = below(n, k0);
                _mm512_mask_storeu_ps(v0.add(k0), mask, _mm512_sub_ps(d0, d2));
                _mm512_mask_storeu_ps(v1.add(k0), mask, _mm512_add_ps(d1, d2));
                _mm512_mask_storeu_ps(v2.add(k0), mask, _mm512_sub_ps(d2, d1));
                _mm512_mask_storeu_ps(v3.add(k0), mask, _mm512_sub_ps(d1, d3));
            }
        }
    }

    /// out[2k] = m0 + m1 + m2, out[2k + 1] = m1 − m2 − m3, for the len values of out.
    ///
    /// # Safety
    /// Each m holds ⌈len / 2⌉ values, out len; AVX-512F present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pair_out([m0, m1, m2, m3]: [*const f32; 4], out: *mut f32, len: usize) {
        let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        let pairs = len.div_ceil(2);
        // SAFETY: the loads are of the lanes k0 + l < pairs, the stores of out's values below
        // len (the contract).
        unsafe {
            for k0 in (0..pairs).step_by(16) {
                let mask = below(pairs, k0);
                // (no closure: it would not inherit the target features)
                let (a0, a1) = (_mm512_maskz_loadu_ps(mask, m0.add(k0)), _mm512_maskz_loadu_ps(mask, m1.add(k0)));
                let (a2, a3) = (_mm512_maskz_loadu_ps(mask, m2.add(k0)), _mm512_maskz_loadu_ps(mask, m3.add(k0)));
                let even = _mm512_add_ps(_mm512_add_ps(a0, a1), a2);
                let odd = _mm512_sub_ps(_mm512_sub_ps(a1, a2), a3);
                let at = 2 * k0;
                _mm512_mask_storeu_ps(out.add(at), below(len, at), _mm512_permutex2var_ps(even, low, odd));
                _mm512_mask_storeu_ps(out.add(at + 16), below(len, at + 16), _mm512_permutex2var_ps(even, high, odd));
            }
        }
    }
}
