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
use super::{ConvShape, Sample};
use crate::activation::Activation;
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
    /// Values of one V_ξ: C × rows × pairs.
    len: usize,
}

impl Tiles {
    fn of(s: &ConvShape) -> Tiles {
        let (pairs, rows) = (s.ow().div_ceil(2), s.height + 2 * s.padding.0);
        Tiles { pairs, rows, len: s.in_channels * rows * pairs }
    }
}

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

/// Scratch one thread needs: the four V_ξ (each with the GEMM's slack past its end) and the
/// four M_ξ of the largest block.
pub(super) fn scratch_len(isa: Isa, s: &ConvShape) -> usize {
    if !fits(s) || s.out_size().is_err() {
        return 0;
    }
    let t = Tiles::of(s);
    let most = blocks(s.out_channels, (s.oh(), s.ow()), 0..s.oh()).map(|b| pairs(s, &t, &b).len()).max().unwrap_or(0);
    4 * (t.len + shifted_slack(isa)) + 4 * s.out_channels * most
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

/// Output rows `rows` of z_s (OC × OH·OW) ← conv(x_s) (see the module's documentation), block
/// by block of output rows ([`blocks`]), each then through the epilogue: on AVX-512, an
/// epilogue with no y apart and no activation or a ReLU runs in the sums' loop, each value
/// stored once.
///
/// # Safety
/// The calling task alone writes output rows `rows` of `out` during the call.
pub(super) unsafe fn forward(
    gemm: &mut GemmScratch,
    buf: &mut [f32],
    p: &Sample,
    x: &[f32],
    e: &Epilogue,
    out: &Outputs,
    rows: Range<usize>,
) {
    let (s, t) = (p.shape, Tiles::of(p.shape));
    let u = p.weights.winograd.as_ref().expect("weights packed for the Winograd route");
    let slack = shifted_slack(u[0].isa());
    let (v, m) = buf.split_at_mut(4 * (t.len + slack));
    // output rows y read the padded rows y..y + kh − 1 alone (and, past each run's end, values
    // of the product's dropped columns)
    transform_input(s, &t, x, rows.start..rows.end - 1 + s.kernel.0, v);
    let (oc, ohw) = (s.out_channels, s.oh() * s.ow());
    let in_sums = Isa::best() == Isa::Avx512 && !out.has_y() && matches!(e.act, Activation::Identity | Activation::Relu);
    for block in blocks(oc, (s.oh(), s.ow()), rows) {
        out.prefetch(ohw, block.clone());
        let cols = pairs(s, &t, &block);
        let n = cols.len();
        for (xi, (u, v)) in u.iter().zip(v.chunks_exact(t.len + slack)).enumerate() {
            let m = MatMut { data: &mut m[xi * oc * n..][..oc * n], rs: n, cs: 1 };
            sgemm_shifted_on(gemm, n, 1.0, u, &v[cols.start..], p.winograd_offsets, (n, n), 0.0, m);
        }
        let epilogue = if in_sums { e } else { &Epilogue::NONE };
        // SAFETY: positions `block` of each channel, in `rows` (the contract).
        unsafe { transform_output(s, &t, &m[..4 * oc * n], &cols, block.clone(), epilogue, out) };
        if !in_sums {
            // SAFETY: as above.
            unsafe { e.apply(ohw, out, block) };
        }
    }
}

/// v (the four V_ξ, each `t.len` values then the slack) ← the transform of padded rows `rows`
/// of the sample x (the other rows untouched): the pairs' d0 − d2, d1 + d2, d2 − d1 and d1 −
/// d3, zero where the row is padding.
fn transform_input(s: &ConvShape, t: &Tiles, x: &[f32], rows: Range<usize>, v: &mut [f32]) {
    let ((h, w), n, stride) = ((s.height, s.width), t.pairs, v.len() / 4);
    assert!(x.len() >= s.in_len() && stride >= t.len, "winograd: transform buffers too short");
    let (v0, rest) = v.split_at_mut(stride);
    let (v1, rest) = rest.split_at_mut(stride);
    let (v2, v3) = rest.split_at_mut(stride);
    assert!(rows.start <= rows.end && rows.end <= t.rows, "winograd: padded rows {rows:?} of {}", t.rows);
    let (plane, ph) = (t.rows * n, s.padding.0);
    // padded row r is input row r − ph: the rows from `rows.start` are those of the input from
    // row rows.start − ph (padding above it where that is negative)
    let (skip, ph) = (rows.start.saturating_sub(ph).min(h), ph.saturating_sub(rows.start));
    for c in 0..s.in_channels {
        let at = c * plane + rows.start * n..c * plane + rows.end * n;
        let v = [&mut v0[at.clone()], &mut v1[at.clone()], &mut v2[at.clone()], &mut v3[at]];
        transform_plane(&x[(c * h + skip) * w..(c + 1) * h * w], (h - skip, w), (ph, s.padding.1), n, v);
    }
}

/// The four V_ξ of one channel (each its padded rows × n pairs) from its input plane x (h × w)
/// placed at (ph, pw) (q[r, u] = x[r − ph, u − pw], zero outside): for each pair k of a row,
/// with d_j = q[r, 2k + j], v0 = d0 − d2, v1 = d1 + d2, v2 = d2 − d1, v3 = d1 − d3.
fn transform_plane(x: &[f32], (h, w): (usize, usize), (ph, pw): (usize, usize), n: usize, v: [&mut [f32]; 4]) {
    let len = v[0].len();
    assert!(x.len() == h * w && len.is_multiple_of(n) && v.iter().all(|v| v.len() == len), "winograd: planes of V do not match");
    #[cfg(target_arch = "x86_64")]
    if Isa::best() == Isa::Avx512 {
        // SAFETY: the kernel reads x's values alone (masked loads), writes the len values of
        // each V_ξ (checked above); AVX-512F present.
        return unsafe { avx512::transform_plane(x.as_ptr(), (h, w), (ph, pw), n, len / n, v.map(|v| v.as_mut_ptr())) };
    }
    let [v0, v1, v2, v3] = v;
    for r in 0..len / n {
        let row = r.checked_sub(ph).filter(|&iy| iy < h).map(|iy| &x[iy * w..][..w]);
        let q = |u: usize| row.and_then(|x| u.checked_sub(pw).and_then(|i| x.get(i))).copied().unwrap_or(0.0);
        for k in 0..n {
            let d = [q(2 * k), q(2 * k + 1), q(2 * k + 2), q(2 * k + 3)];
            let i = r * n + k;
            (v0[i], v1[i], v2[i], v3[i]) = (d[0] - d[2], d[1] + d[2], d[2] - d[1], d[1] - d[3]);
        }
    }
}

/// Output positions `block` of every channel of the sample's z (OC planes of OH·OW) from the
/// four M_ξ of its pairs `cols` (each OC × cols.len()): z[2t] = m0 + m1 + m2, z[2t + 1] = m1 −
/// m2 − m3, then `e` where it is not [`Epilogue::NONE`] (on AVX-512 only, with no y and no
/// activation or a ReLU: [`forward`] says which).
///
/// # Safety
/// Positions `block` of `out` are the calling task's alone.
unsafe fn transform_output(s: &ConvShape, t: &Tiles, m: &[f32], cols: &Range<usize>, block: Range<usize>, e: &Epilogue, out: &Outputs) {
    let (oc, ow, ohw, n) = (s.out_channels, s.ow(), s.oh() * s.ow(), cols.len());
    let (m0, rest) = m.split_at(oc * n);
    let (m1, rest) = rest.split_at(oc * n);
    let (m2, m3) = rest.split_at(oc * n);
    // the block's rows: whole rows of OW, T pairs apart in M; or (OH = 1) its part of the single
    // row, whose pairs start at the even column block.start
    let rows =
        if s.oh() == 1 { Rows { count: 1, len: block.len(), pitch: 0 } } else { Rows { count: block.len() / ow, len: ow, pitch: t.pairs } };
    for c in 0..oc {
        let r = c * n..(c + 1) * n;
        let m = [&m0[r.clone()], &m1[r.clone()], &m2[r.clone()], &m3[r]];
        let tail = Tail { scale: e.scale.map(|v| v[c]), shift: e.shift.map(|v| v[c]), relu: e.act == Activation::Relu };
        // (the sample's skip where the epilogue adds it)
        let at = c * ohw + block.start..c * ohw + block.end;
        // SAFETY: positions `block` of channel oc (the contract).
        pair_out(m, rows, unsafe { out.z(at.clone()) }, e.skip.and(out.skip).map(|k| &k[at]), &tail);
    }
}

/// Rows of output values, `len` each, one after another in z; their pairs `pitch` apart in M.
#[derive(Clone, Copy)]
struct Rows {
    count: usize,
    len: usize,
    pitch: usize,
}

/// The end of an epilogue as the sums' loop runs it on one output channel: z·scale + shift (z +
/// shift, z·scale, or z), then + skip, then max(z, 0) where `relu`, each operation rounded as
/// [`Epilogue`]'s.
struct Tail {
    scale: Option<f32>,
    shift: Option<f32>,
    relu: bool,
}

/// Each row i of `rows` in out: out[2k] = m0 + m1 + m2 and, where the row reaches, out[2k + 1]
/// = m1 − m2 − m3 (pair k of the row at i·pitch + k in each m), then the tail (with `skip`,
/// out's values of the skip, where given).
fn pair_out(m: [&[f32]; 4], rows: Rows, out: &mut [f32], skip: Option<&[f32]>, tail: &Tail) {
    let pairs = rows.count.checked_sub(1).map_or(0, |last| last * rows.pitch + rows.len.div_ceil(2));
    let fits = m.iter().all(|m| m.len() >= pairs) && out.len() == rows.count * rows.len && skip.is_none_or(|k| k.len() == out.len());
    assert!(fits, "winograd: sums, output or skip of other lengths than the rows'");
    #[cfg(target_arch = "x86_64")]
    if Isa::best() == Isa::Avx512 {
        let skip = skip.map_or(std::ptr::null(), |k| k.as_ptr());
        // SAFETY: each m holds the rows' pairs, out and the skip (where not null) their values
        // (checked above); AVX-512F present.
        return unsafe { avx512::pair_out(m.map(|m| m.as_ptr()), rows, out.as_mut_ptr(), skip, tail) };
    }
    for (i, v) in out.iter_mut().enumerate() {
        let (row, x) = (i / rows.len, i % rows.len);
        let k = row * rows.pitch + x / 2;
        let sum = if x % 2 == 0 { m[0][k] + m[1][k] + m[2][k] } else { m[1][k] - m[2][k] - m[3][k] };
        let sum = match (tail.scale, tail.shift) {
            (Some(s), Some(t)) => sum * s + t,
            (Some(s), None) => sum * s,
            (None, Some(t)) => sum + t,
            (None, None) => sum,
        };
        let sum = skip.map_or(sum, |k| sum + k[i]);
        *v = if tail.relu { Activation::Relu.apply(sum) } else { sum };
    }
}

/// The transforms on 16 lanes, pairs split from and merged into rows by permutes.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Rows, Tail};
    use std::arch::x86_64::*;

    /// The lanes of a vector of 16 from `at` that lie below `len`.
    #[inline(always)]
    fn below(len: usize, at: usize) -> __mmask16 {
        match len.saturating_sub(at) {
            n if n >= 16 => 0xFFFF,
            n => (1u16 << n) - 1,
        }
    }

    /// The 16 values q[u..u + 16] of the padded row q[u] = x[u − pw] (zero outside the w
    /// values of x), by a masked load: lanes outside x are neither read nor faulted on.
    ///
    /// # Safety
    /// x holds w values; AVX-512F present.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn padded(x: *const f32, w: usize, pw: usize, u: usize) -> __m512 {
        // lanes l with pw ≤ u + l < pw + w
        let (lo, hi) = (pw.saturating_sub(u).min(16), (pw + w).saturating_sub(u).min(16));
        let mask = if hi > lo { (((1u32 << hi) - 1) ^ ((1u32 << lo) - 1)) as __mmask16 } else { 0 };
        // SAFETY: the unmasked lanes are x[u + l − pw] for 0 ≤ u + l − pw < w (the contract);
        // the pointer is only formed, never read, outside them.
        unsafe { _mm512_maskz_loadu_ps(mask, x.wrapping_add(u).wrapping_sub(pw)) }
    }

    /// The four V_ξ of one channel, `rows` padded rows of n pairs each, from its input plane x
    /// (h × w) placed at (ph, pw) (see [`padded`]): d0 − d2, d1 + d2, d2 − d1, d1 − d3 of each
    /// pair.
    ///
    /// # Safety
    /// x holds h·w values, each v rows·n; AVX-512F present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transform_plane(
        x: *const f32,
        (h, w): (usize, usize),
        (ph, pw): (usize, usize),
        n: usize,
        rows: usize,
        v: [*mut f32; 4],
    ) {
        let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        let [v0, v1, v2, v3] = v;
        // SAFETY: the loads are of x's row iy alone (`padded` over its w values), the stores of
        // the lanes k0 + l < n of row r of each V_ξ (the contract).
        unsafe {
            for r in 0..rows {
                let at = r * n;
                let Some(iy) = r.checked_sub(ph).filter(|&iy| iy < h) else {
                    for k0 in (0..n).step_by(16) {
                        let mask = below(n, k0);
                        for v in [v0, v1, v2, v3] {
                            _mm512_mask_storeu_ps(v.add(at + k0), mask, _mm512_setzero_ps());
                        }
                    }
                    continue;
                };
                let x = x.add(iy * w);
                for k0 in (0..n).step_by(16) {
                    let u = 2 * k0;
                    let (a, b) = (padded(x, w, pw, u), padded(x, w, pw, u + 16));
                    let (a2, b2) = (padded(x, w, pw, u + 2), padded(x, w, pw, u + 18));
                    // d0 = q[2k], d1 = q[2k + 1], d2 = q[2k + 2], d3 = q[2k + 3]
                    let (d0, d1) = (_mm512_permutex2var_ps(a, evens, b), _mm512_permutex2var_ps(a, odds, b));
                    let (d2, d3) = (_mm512_permutex2var_ps(a2, evens, b2), _mm512_permutex2var_ps(a2, odds, b2));
                    let (mask, at) = (below(n, k0), at + k0);
                    _mm512_mask_storeu_ps(v0.add(at), mask, _mm512_sub_ps(d0, d2));
                    _mm512_mask_storeu_ps(v1.add(at), mask, _mm512_add_ps(d1, d2));
                    _mm512_mask_storeu_ps(v2.add(at), mask, _mm512_sub_ps(d2, d1));
                    _mm512_mask_storeu_ps(v3.add(at), mask, _mm512_sub_ps(d1, d3));
                }
            }
        }
    }

    /// Each row of `rows` in out: out[2k] = m0 + m1 + m2, out[2k + 1] = m1 − m2 − m3, then the
    /// tail (with the skip where not null).
    ///
    /// # Safety
    /// Each m holds the rows' pairs ((count − 1)·pitch + ⌈len / 2⌉), out and the skip (where
    /// not null) count·len values; AVX-512F present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pair_out(m: [*const f32; 4], rows: Rows, out: *mut f32, skip: *const f32, tail: &Tail) {
        let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        let (scale, shift) = (tail.scale.map(|s| _mm512_set1_ps(s)), tail.shift.map(|t| _mm512_set1_ps(t)));
        let (len, pairs, has_skip) = (rows.len, rows.len.div_ceil(2), !skip.is_null());
        // SAFETY: the loads are of the lanes k0 + l < pairs of row i's pairs in each m and of row
        // i's values below len of the skip, the stores of its values below len (the contract).
        unsafe {
            for i in 0..rows.count {
                let [m0, m1, m2, m3] = m.map(|m| m.add(i * rows.pitch));
                let (out, skip) = (out.add(i * len), skip.wrapping_add(i * len));
                for k0 in (0..pairs).step_by(16) {
                    let mask = below(pairs, k0);
                    // (no closure: it would not inherit the target features)
                    let (a0, a1) = (_mm512_maskz_loadu_ps(mask, m0.add(k0)), _mm512_maskz_loadu_ps(mask, m1.add(k0)));
                    let (a2, a3) = (_mm512_maskz_loadu_ps(mask, m2.add(k0)), _mm512_maskz_loadu_ps(mask, m3.add(k0)));
                    let even = _mm512_add_ps(_mm512_add_ps(a0, a1), a2);
                    let odd = _mm512_sub_ps(_mm512_sub_ps(a1, a2), a3);
                    for (half, idx) in [(0, low), (16, high)] {
                        let at = 2 * k0 + half;
                        let keep = below(len, at);
                        let mut v = _mm512_permutex2var_ps(even, idx, odd);
                        if let Some(s) = scale {
                            v = _mm512_mul_ps(v, s);
                        }
                        if let Some(t) = shift {
                            v = _mm512_add_ps(v, t);
                        }
                        if has_skip {
                            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, skip.add(at)));
                        }
                        if tail.relu {
                            // max(v, 0) as f32::max: 0 where v is NaN (the second operand wins)
                            v = _mm512_max_ps(v, _mm512_setzero_ps());
                        }
                        _mm512_mask_storeu_ps(out.add(at), keep, v);
                    }
                }
            }
        }
    }
}
