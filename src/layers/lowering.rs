//! Lowering a convolution's sample to a matrix and back, on the CPU: im2col (each output
//! pixel's receptive field as a column, CKK × OHW with CKK = C·kh·kw) and its transpose col2im,
//! in per-thread scratch, a kernel's taps spaced by its dilation. The convolution kinds share it
//! (a 1-D convolution is one of height 1).

#![deny(clippy::undocumented_unsafe_blocks)]

use super::conv::Geometry;
use crate::cpu::conv::lowered::{add_runs, copy_runs, Runs};
use crate::cpu::SharedMut;

/// The input as the lowering reads it, (C, hp, wp): `x` itself without padding, else `x`
/// copied inside a zero border in `padded`. Every lowered run is then a plain read.
fn padded_input<'a>(g: &Geometry, x: &'a [f32], padded: &'a mut [f32]) -> &'a [f32] {
    if g.padding == (0, 0) {
        return x;
    }
    let ((hp, wp), (ph, pw)) = (g.padded_size(), g.padding);
    let padded = &mut padded[..g.padded_len()];
    padded.fill(0.0);
    for (c, plane) in padded.chunks_exact_mut(hp * wp).enumerate() {
        for (iy, row) in x[c * g.height * g.width..][..g.height * g.width].chunks_exact(g.width).enumerate() {
            plane[(iy + ph) * wp + pw..][..g.width].copy_from_slice(row);
        }
    }
    padded
}

/// `scratch[..CKK·OHW]` (the lowered matrix col, CKK × OHW) ← sample `x` (C, H, W), padding
/// read as zero; the rest of `scratch` holds the padded input. Row (c, i, j), output row y is
/// the run of padded row y·sh + i·dh from column j·dw, step sw.
pub(crate) fn im2col(g: &Geometry, x: &[f32], scratch: &mut [f32]) {
    let (kh, kw, ohw, ow) = (g.kernel.0, g.kernel.1, g.ohw(), g.out_width);
    let ((hp, wp), (sh, sw), (dh, dw)) = (g.padded_size(), g.stride, g.dilation);
    let (col, padded) = scratch.split_at_mut(g.lowered_len());
    let src = padded_input(g, x, padded);
    let runs = Runs { oh: g.out_height, ow, wp: wp * sh };
    for c in 0..g.in_channels {
        let plane = &src[c * hp * wp..][..hp * wp];
        for i in 0..kh {
            for j in 0..kw {
                let row = &mut col[((c * kh + i) * kw + j) * ohw..][..ohw];
                if sw == 1 {
                    copy_runs(runs, row, plane, i * dh * wp + j * dw);
                    continue;
                }
                for (y, out) in row.chunks_exact_mut(ow).enumerate() {
                    let run = &plane[(y * sh + i * dh) * wp + j * dw..];
                    out.iter_mut().zip(run.iter().step_by(sw)).for_each(|(o, &v)| *o = v);
                }
            }
        }
    }
}

/// dx (C, H, W) ← col2im(dcol): each lowered entry of `scratch[..CKK·OHW]` added back to the
/// pixel it was read from (the transpose of [`im2col`], same runs), summed in the padded
/// layout in the rest of `scratch` when there is padding, and the inside copied out.
pub(crate) fn col2im(g: &Geometry, scratch: &mut [f32], dx: &mut [f32]) {
    let (kh, kw, ohw, ow) = (g.kernel.0, g.kernel.1, g.ohw(), g.out_width);
    let ((hp, wp), (sh, sw), (ph, pw), (dh, dw)) = (g.padded_size(), g.stride, g.padding, g.dilation);
    let (dcol, padded) = scratch.split_at_mut(g.lowered_len());
    let acc = if g.padding == (0, 0) { &mut *dx } else { &mut padded[..g.padded_len()] };
    acc.fill(0.0);
    let runs = Runs { oh: g.out_height, ow, wp: wp * sh };
    for c in 0..g.in_channels {
        let plane = &mut acc[c * hp * wp..][..hp * wp];
        for i in 0..kh {
            for j in 0..kw {
                let row = &dcol[((c * kh + i) * kw + j) * ohw..][..ohw];
                if sw == 1 {
                    add_runs(runs, plane, i * dh * wp + j * dw, row);
                    continue;
                }
                for (y, run) in row.chunks_exact(ow).enumerate() {
                    let dst = &mut plane[(y * sh + i * dh) * wp + j * dw..];
                    dst.iter_mut().step_by(sw).zip(run).for_each(|(d, &v)| *d += v);
                }
            }
        }
    }
    if g.padding != (0, 0) {
        for (c, plane) in padded.chunks_exact(hp * wp).take(g.in_channels).enumerate() {
            for (iy, row) in dx[c * g.height * g.width..][..g.height * g.width].chunks_exact_mut(g.width).enumerate() {
                row.copy_from_slice(&plane[(iy + ph) * wp + pw..][..g.width]);
            }
        }
    }
}

/// Per-thread scratch the fast path uses: `threads` lowered samples of `col_len` each.
pub(crate) struct Scratch<'a> {
    pub cols: SharedMut<'a, f32>,
    pub col_len: usize,
}

impl Scratch<'_> {
    /// # Safety
    /// `worker` must be the pool's worker index of the calling task (so no other thread uses it).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn col(&self, worker: usize, len: usize) -> &mut [f32] {
        // SAFETY: one range per worker index, used by one task at a time.
        unsafe { self.cols.slice(worker * self.col_len..worker * self.col_len + len) }
    }
}
