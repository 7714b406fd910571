//! The direct route: the GEMM reads shifted windows of zero-padded planes in place.
//!
//! Forward. The input is copied into planes (sh·sw stride phases × C channels, each hpp × wpp,
//! hpp = ⌈(H + 2·ph) / sh⌉, wpp likewise): plane (a, b, c)[u, v] = in[c, u·sh + a − ph,
//! v·sw + b − pw] (zero outside the input). Then for output (y, x), q = y·wpp + x, and tap
//! (c, i, j), the input pixel is plane (i mod sh, j mod sw, c)[y + i / sh, x + j / sw]: the
//! value at offset(c, i, j) + q, offset = base of that plane + (i / sh)·wpp + j / sw. So
//! Z (OC × OH·OW) = W (OC × CKK) · B with row (c, i, j) of B the OH runs of OW values from
//! that offset, wpp apart, read by the GEMM in place and written straight into z where its
//! kernel loads whole vectors from one run (OW a multiple of half its panel, one output row,
//! or wpp = OW). Otherwise B's rows are the n = (OH − 1)·wpp + OW values from the offset, and
//! the product's columns x ≥ OW of each row are garbage, dropped when Z is copied out.
//!
//! Input gradient. dx[c, y', x'] = Σ_{oc,i,j} w[oc, c, i, j] · dz[oc, y, x] over
//! y·sh + i − ph = y': with the gradient planes G[oc, u, v] = dz[oc, (u − t) / sh,
//! (v − l) / sw] where those divide exactly (zero elsewhere), t = kh − 1 − ph, l = kw − 1 −
//! pw, of (H + kh − 1) × (W + kw − 1), it is the stride-1 product of the same kind:
//! dX (C × n') = W' (C × OC·kh·kw) · B' with row (oc, i, j) of B' at offset oc·|G| +
//! (kh − 1 − i)·wg + (kw − 1 − j), in runs of W, wg apart, as the forward's.
//!
//! Weight gradient. dW[oc, (c, i, j)] += Σ_q dZ[oc, q] · (row (c, i, j) of B)[q], with dZ laid
//! out in the forward's flat rows (zeros at x ≥ OW): dot products of rows, read in place.

use super::epilogue::{blocks, Epilogue, Outputs};
use super::lowered::{copy_rows, pad_rows_into};
use super::{ConvShape, Sample};
use crate::cpu::gemm::{sgemm_shifted_into, sgemm_shifted_on, shifted_runs_fit, shifted_slack, GemmScratch, MatMut};
use crate::cpu::isa::Isa;
use crate::cpu::rowdot::rowdot_at;
use crate::error::{Error, Result};
use std::ops::Range;

/// Sizes of the planes and flat rows, from the shape.
#[derive(Clone, Copy)]
struct Planes {
    /// Rows and columns of one stride phase of one channel.
    hpp: usize,
    wpp: usize,
    /// Values of all input planes.
    len: usize,
    /// Flat output positions computed: (OH − 1)·wpp + OW.
    n: usize,
    /// Rows, columns and values of the gradient planes; flat input positions (H − 1)·wg + W.
    hg: usize,
    wg: usize,
    grad_len: usize,
    ng: usize,
}

impl Planes {
    fn of(s: &ConvShape) -> Planes {
        let ((hp, wp), (sh, sw), (kh, kw)) = (s.padded(), s.stride, s.kernel);
        let (hpp, wpp) = (hp.div_ceil(sh), wp.div_ceil(sw));
        let (hg, wg) = (s.height + kh - 1, s.width + kw - 1);
        Planes {
            hpp,
            wpp,
            len: sh * sw * s.in_channels * hpp * wpp,
            n: (s.oh() - 1) * wpp + s.ow(),
            hg,
            wg,
            grad_len: s.out_channels * hg * wg,
            ng: (s.height - 1) * wg + s.width,
        }
    }
}

/// Scratch one thread needs (the backward's, which holds the forward's): the input planes and
/// the gradient planes (each with the slack of a panel past its end, which the GEMM reads and
/// drops), the flat output gradient and the flat input gradient.
pub(super) fn scratch_len(isa: Isa, s: &ConvShape) -> usize {
    let (p, slack) = (Planes::of(s), shifted_slack(isa));
    (p.len + slack) + (p.grad_len + slack) + s.out_channels * p.n + s.in_channels * p.ng
}

/// `offset(row)` for each row of a product, collected without aborting on a refused allocation.
fn offsets(rows: usize, offset: impl Fn(usize) -> usize) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    out.try_reserve_exact(rows).map_err(|_| Error::OutOfMemory { what: "convolution offsets".into(), bytes: rows.saturating_mul(8) })?;
    out.extend((0..rows).map(offset));
    Ok(out)
}

/// Offset in the input planes of lowered row (c, i, j), in that order (the weights' columns).
pub(super) fn input_offsets(s: &ConvShape) -> Result<Vec<usize>> {
    let (p, (kh, kw), (sh, sw)) = (Planes::of(s), s.kernel, s.stride);
    offsets(s.ckk(), |row| {
        let (c, i, j) = (row / (kh * kw), row / kw % kh, row % kw);
        let plane = ((i % sh) * sw + j % sw) * s.in_channels + c;
        plane * p.hpp * p.wpp + (i / sh) * p.wpp + j / sw
    })
}

/// Offset in the gradient planes of row (oc, i, j) of the input gradient's product.
pub(super) fn grad_offsets(s: &ConvShape) -> Result<Vec<usize>> {
    let (p, (kh, kw)) = (Planes::of(s), s.kernel);
    offsets(s.out_channels * kh * kw, |row| {
        let (oc, i, j) = (row / (kh * kw), row / kw % kh, row % kw);
        oc * p.hg * p.wg + (kh - 1 - i) * p.wg + (kw - 1 - j)
    })
}

/// Output rows `rows` of z_s (OC × OH·OW) ← W · B (see the module's documentation), block by
/// block of output rows ([`blocks`]), each then through the epilogue.
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
    let (s, g, isa) = (p.shape, Planes::of(p.shape), p.weights.w.isa());
    let (planes, rest) = buf.split_at_mut(g.len + shifted_slack(isa));
    // at stride 1, output rows y read the planes' rows y..y + kh − 1 alone (and, past each
    // run's end, values of the product's dropped columns)
    let needed = if s.stride == (1, 1) { rows.start..rows.end - 1 + s.kernel.0 } else { 0..g.hpp };
    input_planes(s, &g, x, needed, &mut planes[..g.len]);
    let (oc, oh, ow) = (s.out_channels, s.oh(), s.ow());
    let ohw = oh * ow;
    // (the runs of a block fit where those of the whole output do: the same widths and pitch)
    let runs_fit = shifted_runs_fit(isa, ohw, ow, g.wpp);
    for block in blocks(oc, (oh, ow), rows) {
        out.prefetch(ohw, block.clone());
        // B's columns from output (y0, x0): x0 > 0 only in a part of a single row
        let base = block.start / ow * g.wpp + block.start % ow;
        if runs_fit {
            let z = out.z_matrix(block.start, ohw);
            // SAFETY: the product writes positions `block` of each channel, in `rows`: the
            // calling task's alone (the contract).
            unsafe { sgemm_shifted_into(gemm, block.len(), 1.0, &p.weights.w, &planes[base..], p.offsets, (ow, g.wpp), 0.0, z) };
        } else {
            // whole rows (a single row's runs always fit): the flat columns from the block's
            // first row to the end of its last, those x ≥ OW of each row dropped
            let rows = block.len() / ow;
            let n = (rows - 1) * g.wpp + ow;
            let flat = &mut rest[..oc * n];
            let flat_z = MatMut { data: &mut *flat, rs: n, cs: 1 };
            sgemm_shifted_on(gemm, n, 1.0, &p.weights.w, &planes[base..], p.offsets, (n, n), 0.0, flat_z);
            for (c, src) in flat.chunks_exact(n).enumerate() {
                // SAFETY: positions `block` of channel c, in `rows` (the contract).
                copy_rows((rows, ow), src, g.wpp, unsafe { out.z(c * ohw + block.start..c * ohw + block.end) }, ow);
            }
        }
        // SAFETY: as above.
        unsafe { e.apply(ohw, out, block) };
    }
}

/// dW (OC × CKK) ← dZ_s ⋆ X_s (+= when `accumulate`); dx_s ← the input gradient when given.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    gemm: &mut GemmScratch,
    buf: &mut [f32],
    p: &Sample,
    x: &[f32],
    dz: &[f32],
    dw: &mut [f32],
    accumulate: bool,
    dx: Option<&mut [f32]>,
) {
    let (s, g, slack) = (p.shape, Planes::of(p.shape), shifted_slack(p.weights.w.isa()));
    let (oc, oh, ow, c) = (s.out_channels, s.oh(), s.ow(), s.in_channels);
    let (planes, rest) = buf.split_at_mut(g.len + slack);
    let (grad_planes, rest) = rest.split_at_mut(g.grad_len + slack);
    let (dz_flat, flat_dx) = rest.split_at_mut(oc * g.n);
    input_planes(s, &g, x, 0..g.hpp, &mut planes[..g.len]);
    let dz_rows: &[f32] = if g.wpp == ow {
        &dz[..oc * g.n]
    } else {
        to_flat(dz, (oh, ow), g.wpp, g.n, dz_flat);
        dz_flat
    };
    rowdot_at(oc, g.n, dz_rows, g.n, &planes[..g.len], p.offsets, dw, s.ckk(), accumulate);
    let Some(dx) = dx else { return };
    gradient_planes(s, &g, dz, &mut grad_planes[..g.grad_len]);
    let (hw, w_swapped) = (s.height * s.width, &p.weights.w_swapped);
    if shifted_runs_fit(p.weights.w.isa(), hw, s.width, g.wg) {
        let dx = MatMut { data: &mut dx[..c * hw], rs: hw, cs: 1 };
        return sgemm_shifted_on(gemm, hw, 1.0, w_swapped, grad_planes, p.grad_offsets, (s.width, g.wg), 0.0, dx);
    }
    let flat = &mut flat_dx[..c * g.ng];
    let flat_dx = MatMut { data: flat, rs: g.ng, cs: 1 };
    sgemm_shifted_on(gemm, g.ng, 1.0, w_swapped, grad_planes, p.grad_offsets, (g.ng, g.ng), 0.0, flat_dx);
    to_rows(flat, g.ng, g.wg, (s.height, s.width), dx);
}

/// out (all input planes, `g.len` values) ← the stride phases of x inside a zero border: at
/// stride 1 rows `rows` of each plane alone, else every row (`rows` all of them).
fn input_planes(s: &ConvShape, g: &Planes, x: &[f32], rows: Range<usize>, out: &mut [f32]) {
    let ((h, w), (sh, sw), (ph, pw), channels) = ((s.height, s.width), s.stride, s.padding, s.in_channels);
    if (sh, sw) == (1, 1) {
        // one phase, (H + 2·ph) × (W + 2·pw)
        return pad_rows_into(x, channels, (h, w), (ph, pw), rows, out);
    }
    debug_assert!(rows == (0..g.hpp));
    out.fill(0.0);
    // plane (a, b, c)[u, v] = x[c, u·sh + a − ph, v·sw + b − pw]
    let planes = out.chunks_exact_mut(g.hpp * g.wpp);
    let phases = (0..sh).flat_map(|a| (0..sw).flat_map(move |b| (0..channels).map(move |c| (a, b, c))));
    for (plane, (a, b, c)) in planes.zip(phases) {
        for (u, row) in plane.chunks_exact_mut(g.wpp).enumerate() {
            let Some(iy) = (u * sh + a).checked_sub(ph).filter(|&iy| iy < h) else { continue };
            for (v, out) in row.iter_mut().enumerate() {
                if let Some(ix) = (v * sw + b).checked_sub(pw).filter(|&ix| ix < w) {
                    *out = x[(c * h + iy) * w + ix];
                }
            }
        }
    }
}

/// out (OC × hg × wg) ← dz dilated by the stride and placed at (t, l) = (kh − 1 − ph,
/// kw − 1 − pw) (which may be negative: rows before 0 or past the planes touch no input).
fn gradient_planes(s: &ConvShape, g: &Planes, dz: &[f32], out: &mut [f32]) {
    let ((oh, ow), (sh, sw)) = ((s.oh(), s.ow()), s.stride);
    let (t, l) = (s.kernel.0 as isize - 1 - s.padding.0 as isize, s.kernel.1 as isize - 1 - s.padding.1 as isize);
    out.fill(0.0);
    if (sh, sw) == (1, 1) && t >= 0 && l >= 0 {
        // each row whole, at (y + t, l): inside the plane, as p ≤ k − 1 makes OH + t ≤ hg
        let (t, l) = (t as usize, l as usize);
        for (plane, dzc) in out.chunks_exact_mut(g.hg * g.wg).zip(dz.chunks_exact(oh * ow)) {
            copy_rows((oh, ow), dzc, ow, &mut plane[t * g.wg + l..], g.wg);
        }
        return;
    }
    let inside = |at: isize, len: usize| usize::try_from(at).ok().filter(|&at| at < len);
    for (plane, dzc) in out.chunks_exact_mut(g.hg * g.wg).zip(dz.chunks_exact(oh * ow)) {
        for (y, row) in dzc.chunks_exact(ow).enumerate() {
            let Some(u) = inside((y * sh) as isize + t, g.hg) else { continue };
            for (x, &v) in row.iter().enumerate() {
                if let Some(col) = inside((x * sw) as isize + l, g.wg) {
                    plane[u * g.wg + col] = v;
                }
            }
        }
    }
}

/// out (channels × rows × cols) ← the first `cols` values of each `pitch`-wide row of the flat
/// channels (each n values) in `flat`.
fn to_rows(flat: &[f32], n: usize, pitch: usize, (rows, cols): (usize, usize), out: &mut [f32]) {
    for (src, dst) in flat.chunks_exact(n).zip(out.chunks_exact_mut(rows * cols)) {
        copy_rows((rows, cols), src, pitch, dst, cols);
    }
}

/// flat (channels × n) ← `src` (channels × rows × cols) in `pitch`-wide rows, zeros between.
fn to_flat(src: &[f32], (rows, cols): (usize, usize), pitch: usize, n: usize, flat: &mut [f32]) {
    for (dst, src) in flat.chunks_exact_mut(n).zip(src.chunks_exact(rows * cols)) {
        for (y, row) in src.chunks_exact(cols).enumerate() {
            dst[y * pitch..][..cols].copy_from_slice(row);
            if y + 1 < rows {
                dst[y * pitch + cols..(y + 1) * pitch].fill(0.0);
            }
        }
    }
}
