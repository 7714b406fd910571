//! Lowering a convolution's sample to a matrix and back, on the CPU: im2col (each output
//! pixel's receptive field as a column, CKK × OHW with CKK = C·kh·kw) and its transpose col2im,
//! in per-thread scratch, a kernel's taps spaced by its dilation. The convolution kinds share it
//! (a 1-D convolution is one of height 1).

#![deny(clippy::undocumented_unsafe_blocks)]

use super::conv::Geometry;
use crate::cpu::SharedMut;

/// The stride-1 runs of one lowered row: `col_row[y·ow + x]` ↔ `plane[start + y·wp + x]`
/// for y < oh, x < ow (LeNet: 28 runs of 28, or 10 of 10, per row).
#[derive(Clone, Copy)]
struct Runs {
    oh: usize,
    ow: usize,
    wp: usize,
    /// The CPU has AVX2 and FMA and the runs are at least 8 long: copied 8 lanes at a time
    /// (decided once per lowering, not once per row).
    #[cfg(target_arch = "x86_64")]
    lanes8: bool,
}

impl Runs {
    fn new(oh: usize, ow: usize, wp: usize) -> Runs {
        #[cfg(target_arch = "x86_64")]
        let lanes8 = ow >= 8 && crate::cpu::has_avx2_fma();
        Runs {
            oh,
            ow,
            wp,
            #[cfg(target_arch = "x86_64")]
            lanes8,
        }
    }

    /// Panics unless every run lies inside both slices.
    fn check(self, col_row: usize, plane: usize, start: usize) {
        assert!(col_row >= self.oh * self.ow, "lowered row too short");
        assert!(self.oh == 0 || start + (self.oh - 1) * self.wp + self.ow <= plane, "run past the plane");
    }
}

/// col_row ← the runs of `plane` from `start` (im2col).
fn copy_runs(r: Runs, col_row: &mut [f32], plane: &[f32], start: usize) {
    r.check(col_row.len(), plane.len(), start);
    #[cfg(target_arch = "x86_64")]
    if r.lanes8 {
        // SAFETY: extents checked above; AVX2 present (`lanes8`).
        return unsafe { avx2::copy_runs(r, col_row.as_mut_ptr(), plane[start..].as_ptr()) };
    }
    for (y, out) in col_row.chunks_exact_mut(r.ow).take(r.oh).enumerate() {
        out.copy_from_slice(&plane[start + y * r.wp..][..r.ow]);
    }
}

/// The runs of `plane` from `start` += col_row (col2im).
fn add_runs(r: Runs, plane: &mut [f32], start: usize, col_row: &[f32]) {
    r.check(col_row.len(), plane.len(), start);
    #[cfg(target_arch = "x86_64")]
    if r.lanes8 {
        // SAFETY: extents checked above; AVX2 present (`lanes8`).
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
    /// `dst` holds oh·ow values, `src` reaches (oh − 1)·wp + ow; ow ≥ 8; AVX2 present.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn copy_runs(r: Runs, dst: *mut f32, src: *const f32) {
        // SAFETY: run y < oh reads src[y·wp..][..ow] and writes dst[y·ow..][..ow] in blocks
        // of 8 (ow ≥ 8, the last block ending at ow): inside the contract's extents.
        unsafe {
            for y in 0..r.oh {
                let (d, s) = (dst.add(y * r.ow), src.add(y * r.wp));
                let mut x = 0;
                while x + 8 < r.ow {
                    _mm256_storeu_ps(d.add(x), _mm256_loadu_ps(s.add(x)));
                    x += 8;
                }
                // the last 8, overlapping the previous block: the same values again
                _mm256_storeu_ps(d.add(r.ow - 8), _mm256_loadu_ps(s.add(r.ow - 8)));
            }
        }
    }

    /// # Safety
    /// As [`copy_runs`], with `dst` the plane and `src` the lowered row.
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
    let runs = Runs::new(g.out_height, ow, wp * sh);
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
    let runs = Runs::new(g.out_height, ow, wp * sh);
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
