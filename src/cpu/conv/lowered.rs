//! The lowered route: im2col into per-thread scratch, then the GEMM with the packed weights.
//!
//! Forward: Z_s (OC × OHW) = W (OC × CKK) · col_s (CKK × OHW). Backward: dW += dZ_s · col_sᵀ
//! (row dot products), dcol_s = Wᵀ · dZ_s, then col2im adds dcol_s into dX_s.

use super::epilogue::{blocks, Epilogue, Outputs};
use super::{ConvShape, Sample};
use crate::cpu::gemm::{sgemm_packed_a_into, sgemm_packed_a_on, GemmScratch, Mat, MatMut};
use crate::cpu::rowdot::rowdot;
use std::ops::Range;

/// Scratch one thread needs: a lowered sample, the padded input (or padded gradient sum),
/// and a lowered gradient.
pub(super) fn scratch_len(s: &ConvShape) -> usize {
    2 * lowered_len(s) + padded_len(s)
}

/// OHW: output pixels per channel.
fn ohw(s: &ConvShape) -> usize {
    s.oh() * s.ow()
}

/// CKK × OHW: a lowered sample.
fn lowered_len(s: &ConvShape) -> usize {
    s.ckk() * ohw(s)
}

/// C × (H + 2·ph) × (W + 2·pw), or 0 without padding (the input is read in place).
fn padded_len(s: &ConvShape) -> usize {
    let (hp, wp) = s.padded();
    if s.padding == (0, 0) {
        0
    } else {
        s.in_channels * hp * wp
    }
}

/// Output rows `rows` of z_s (OC × OHW) ← W · im2col(x_s), block by block of output rows
/// ([`blocks`]), each then through the epilogue.
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
    let s = p.shape;
    let (col, rest) = buf.split_at_mut(lowered_len(s));
    im2col(s, x, col, rest);
    let n = ohw(s);
    for block in blocks(s.out_channels, (s.oh(), s.ow()), rows) {
        out.prefetch(n, block.clone());
        // columns `block` of col (CKK × OHW) into the same columns of z (OC × OHW)
        let (b, z) = (Mat { data: &col[block.start..], rs: n, cs: 1 }, out.z_matrix(block.start, n));
        // SAFETY: the product and the epilogue write positions `block` of each channel, in
        // `rows`: the calling task's alone (the contract).
        unsafe {
            sgemm_packed_a_into(gemm, block.len(), 1.0, &p.weights.w, b, 0.0, z);
            e.apply(n, out, block);
        }
    }
}

/// dW (OC × CKK) ← dZ_s · col_sᵀ (+= when `accumulate`); dx_s ← col2im(Wᵀ · dZ_s) when given.
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
    let s = p.shape;
    let (n, ckk, oc) = (ohw(s), s.ckk(), s.out_channels);
    let (col, rest) = buf.split_at_mut(lowered_len(s));
    let (dcol, padded) = rest.split_at_mut(lowered_len(s));
    im2col(s, x, col, padded);
    // dW (OC × CKK) += dZ_s (OC × OHW) · col_sᵀ: rows of both are contiguous
    rowdot(oc, ckk, n, dz, n, col, n, dw, ckk, accumulate);
    if let Some(dx) = dx {
        // dcol (CKK × OHW) = Wᵀ (CKK × OC) · dZ_s (OC × OHW)
        sgemm_packed_a_on(gemm, n, 1.0, &p.weights.w_t, Mat { data: dz, rs: n, cs: 1 }, 0.0, MatMut { data: dcol, rs: n, cs: 1 });
        col2im(s, dcol, padded, dx);
    }
}

/// The stride-1 runs of one lowered row: `col_row[y·ow + x]` ↔ `plane[start + y·wp + x]`
/// for y < oh, x < ow (LeNet: 28 runs of 28, or 10 of 10, per row).
/// (Also the lowering of dilated convolutions, `layers::lowering`.)
#[derive(Clone, Copy)]
pub(crate) struct Runs {
    pub oh: usize,
    pub ow: usize,
    pub wp: usize,
}

impl Runs {
    /// Panics unless every run lies inside both slices.
    fn check(self, col_row: usize, plane: usize, start: usize) {
        assert!(col_row >= self.oh * self.ow, "lowered row too short");
        assert!(self.oh == 0 || start + (self.oh - 1) * self.wp + self.ow <= plane, "run past the plane");
    }
}

/// col_row ← the runs of `plane` from `start` (im2col).
pub(crate) fn copy_runs(r: Runs, col_row: &mut [f32], plane: &[f32], start: usize) {
    r.check(col_row.len(), plane.len(), start);
    copy_rows((r.oh, r.ow), &plane[start..], r.wp, col_row, r.ow);
}

/// dst[y·dst_pitch..][..width] ← src[y·src_pitch..][..width] for y < rows, with 8-lane loads
/// and stores where AVX2 is present and the rows are 8 or longer: a row is a few
/// instructions, not a memcpy call. Panics unless every row lies inside both slices.
pub(super) fn copy_rows((rows, width): (usize, usize), src: &[f32], src_pitch: usize, dst: &mut [f32], dst_pitch: usize) {
    let reach = |pitch: usize| rows.checked_sub(1).map_or(0, |last| last * pitch + width);
    assert!(reach(src_pitch) <= src.len() && reach(dst_pitch) <= dst.len(), "a row past its slice");
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx2_fma() && width >= 8 {
        // SAFETY: extents checked above; AVX2 present.
        return unsafe { avx2::copy_rows((rows, width), src.as_ptr(), src_pitch, dst.as_mut_ptr(), dst_pitch) };
    }
    for y in 0..rows {
        dst[y * dst_pitch..][..width].copy_from_slice(&src[y * src_pitch..][..width]);
    }
}

/// out[..C·(H + 2·ph)·(W + 2·pw)] ← x (C × H × W) inside a zero border: the input as the
/// lowering and the direct route read it.
pub(crate) fn pad_into(x: &[f32], channels: usize, (h, w): (usize, usize), (ph, pw): (usize, usize), out: &mut [f32]) {
    pad_rows_into(x, channels, (h, w), (ph, pw), 0..h + 2 * ph, out)
}

/// Rows `rows` (of the H + 2·ph) of each channel's plane in out[..C·(H + 2·ph)·(W + 2·pw)] as
/// [`pad_into`] writes them; the other rows untouched.
pub(crate) fn pad_rows_into(
    x: &[f32],
    channels: usize,
    (h, w): (usize, usize),
    (ph, pw): (usize, usize),
    rows: Range<usize>,
    out: &mut [f32],
) {
    let (hp, wp) = (h + 2 * ph, w + 2 * pw);
    assert!(rows.start <= rows.end && rows.end <= hp, "padded rows {rows:?} of {hp}");
    for (plane, xc) in out[..channels * hp * wp].chunks_exact_mut(hp * wp).zip(x[..channels * h * w].chunks_exact(h * w)) {
        plane[rows.start * wp..rows.end * wp].fill(0.0);
        // the padded rows that hold input rows (padded row r is input row r − ph)
        let (first, end) = (rows.start.max(ph), rows.end.min(ph + h));
        if first < end {
            copy_rows((end - first, w), &xc[(first - ph) * w..], w, &mut plane[first * wp + pw..], wp);
        }
    }
}

/// The runs of `plane` from `start` += col_row (col2im).
pub(crate) fn add_runs(r: Runs, plane: &mut [f32], start: usize, col_row: &[f32]) {
    r.check(col_row.len(), plane.len(), start);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx2_fma() && r.ow >= 8 {
        // SAFETY: extents checked above; AVX2 present.
        return unsafe { avx2::add_runs(r, plane[start..].as_mut_ptr(), col_row.as_ptr()) };
    }
    for (y, run) in col_row.chunks_exact(r.ow).take(r.oh).enumerate() {
        plane[start + y * r.wp..][..r.ow].iter_mut().zip(run).for_each(|(d, &v)| *d += v);
    }
}

/// The runs with 8-lane loads and stores: a run is a few instructions, not a memcpy call.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Runs;
    use std::arch::x86_64::*;

    /// # Safety
    /// `src` reaches (rows − 1)·src_pitch + width values, `dst` (rows − 1)·dst_pitch + width;
    /// width ≥ 8; AVX2 present.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn copy_rows((rows, width): (usize, usize), src: *const f32, src_pitch: usize, dst: *mut f32, dst_pitch: usize) {
        // SAFETY: row y < rows reads src[y·src_pitch..][..width] and writes
        // dst[y·dst_pitch..][..width] in blocks of 8 (width ≥ 8, the last block ending at
        // width): inside the contract's extents.
        unsafe {
            for y in 0..rows {
                let (d, s) = (dst.add(y * dst_pitch), src.add(y * src_pitch));
                let mut x = 0;
                while x + 8 < width {
                    _mm256_storeu_ps(d.add(x), _mm256_loadu_ps(s.add(x)));
                    x += 8;
                }
                // the last 8, overlapping the previous block: the same values again
                _mm256_storeu_ps(d.add(width - 8), _mm256_loadu_ps(s.add(width - 8)));
            }
        }
    }

    /// # Safety
    /// `dst` (the plane) reaches (oh − 1)·wp + ow values, `src` (the lowered row) oh·ow;
    /// ow ≥ 8; AVX2 present.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn add_runs(r: Runs, dst: *mut f32, src: *const f32) {
        // SAFETY: run y < oh touches dst[y·wp..][..ow] and src[y·ow..][..ow], 8 at a time
        // while 8 fit, then one by one: inside the contract's extents.
        unsafe {
            for y in 0..r.oh {
                let (d, s) = (dst.add(y * r.wp), src.add(y * r.ow));
                let mut x = 0;
                while x + 8 <= r.ow {
                    _mm256_storeu_ps(d.add(x), _mm256_add_ps(_mm256_loadu_ps(d.add(x)), _mm256_loadu_ps(s.add(x))));
                    x += 8;
                }
                for t in x..r.ow {
                    *d.add(t) += *s.add(t);
                }
            }
        }
    }
}

/// The input as the lowering reads it, (C, hp, wp): `x` itself without padding, else `x`
/// copied inside a zero border in `padded`. Every lowered run is then a plain read.
fn padded_input<'a>(s: &ConvShape, x: &'a [f32], padded: &'a mut [f32]) -> &'a [f32] {
    if s.padding == (0, 0) {
        return x;
    }
    pad_into(x, s.in_channels, (s.height, s.width), s.padding, padded);
    &padded[..padded_len(s)]
}

/// col (CKK × OHW) ← sample `x` (C, H, W), padding read as zero (`padded` holds the padded
/// copy). Row (c, i, j), output row y is the run of padded row y·sh + i from column j, step sw.
fn im2col(s: &ConvShape, x: &[f32], col: &mut [f32], padded: &mut [f32]) {
    let (kh, kw, n, ow) = (s.kernel.0, s.kernel.1, ohw(s), s.ow());
    let ((hp, wp), (sh, sw)) = (s.padded(), s.stride);
    let src = padded_input(s, x, padded);
    for c in 0..s.in_channels {
        let plane = &src[c * hp * wp..][..hp * wp];
        for i in 0..kh {
            for j in 0..kw {
                let row = &mut col[((c * kh + i) * kw + j) * n..][..n];
                if sw == 1 {
                    copy_runs(Runs { oh: s.oh(), ow, wp: wp * sh }, row, plane, i * wp + j);
                    continue;
                }
                for (y, out) in row.chunks_exact_mut(ow).enumerate() {
                    let run = &plane[(y * sh + i) * wp + j..];
                    out.iter_mut().zip(run.iter().step_by(sw)).for_each(|(o, &v)| *o = v);
                }
            }
        }
    }
}

/// dx (C, H, W) ← col2im(dcol): each lowered entry added back to the pixel it was read from
/// (the transpose of [`im2col`], same runs), summed in the padded layout in `padded` when
/// there is padding, and the inside copied out.
fn col2im(s: &ConvShape, dcol: &[f32], padded: &mut [f32], dx: &mut [f32]) {
    let (kh, kw, n, ow) = (s.kernel.0, s.kernel.1, ohw(s), s.ow());
    let ((hp, wp), (sh, sw), (ph, pw)) = (s.padded(), s.stride, s.padding);
    let acc = if s.padding == (0, 0) { &mut dx[..s.in_len()] } else { &mut padded[..padded_len(s)] };
    acc.fill(0.0);
    for c in 0..s.in_channels {
        let plane = &mut acc[c * hp * wp..][..hp * wp];
        for i in 0..kh {
            for j in 0..kw {
                let row = &dcol[((c * kh + i) * kw + j) * n..][..n];
                if sw == 1 {
                    add_runs(Runs { oh: s.oh(), ow, wp: wp * sh }, plane, i * wp + j, row);
                    continue;
                }
                for (y, run) in row.chunks_exact(ow).enumerate() {
                    let dst = &mut plane[(y * sh + i) * wp + j..];
                    dst.iter_mut().step_by(sw).zip(run).for_each(|(d, &v)| *d += v);
                }
            }
        }
    }
    if s.padding != (0, 0) {
        for (c, plane) in padded.chunks_exact(hp * wp).take(s.in_channels).enumerate() {
            for (iy, row) in dx[c * s.height * s.width..][..s.height * s.width].chunks_exact_mut(s.width).enumerate() {
                row.copy_from_slice(&plane[(iy + ph) * wp + pw..][..s.width]);
            }
        }
    }
}
