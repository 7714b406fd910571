//! Lowering a convolution's sample to a matrix and back, on the CPU: im2col (each output
//! pixel's receptive field as a column, CKK × OHW with CKK = C·kh·kw) and its transpose col2im,
//! in per-thread scratch, a kernel's taps spaced by its dilation. The convolution kinds share it
//! (a 1-D convolution is one of height 1); and the forward and backward of the dilated
//! convolutions, which `cpu::conv` does not compute, through it: im2col and a GEMM per sample.

#![deny(clippy::undocumented_unsafe_blocks)]

use super::conv::Geometry;
use crate::cpu::conv::lowered::{add_runs, copy_runs, pad_into, Runs};
use crate::cpu::gemm::{sgemm_on, GemmWorkspace, Mat, MatMut};
use crate::cpu::pool::Pool;
use crate::cpu::rowdot::rowdot;
use crate::cpu::{chunk_range, for_chunks, SharedMut};

/// The input as the lowering reads it, (C, hp, wp): `x` itself without padding, else `x`
/// copied inside a zero border in `padded`. Every lowered run is then a plain read.
fn padded_input<'a>(g: &Geometry, x: &'a [f32], padded: &'a mut [f32]) -> &'a [f32] {
    if g.padding == (0, 0) {
        return x;
    }
    pad_into(x, g.in_channels, (g.height, g.width), g.padding, padded);
    &padded[..g.padded_len()]
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

/// Fast forward without the bias: Z_s ← W · im2col(X_s), samples spread over the pool.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(test), allow(dead_code))]
pub fn forward(pool: &Pool, ws: &mut GemmWorkspace, scratch: &Scratch, g: &Geometry, batch: usize, w: &[f32], x: &[f32], z: &mut [f32]) {
    let (ckk, ohw) = (g.ckk(), g.ohw());
    let z = SharedMut::new(&mut z[..batch * g.out_len()]);
    pool.run_with(batch, ws.workers(), &|s, worker, gemm| {
        // SAFETY: `worker` is this task's worker index in a run that alone uses `scratch`;
        // sample s owns z[s·out_len..][..out_len].
        let (col, zs) = unsafe { (scratch.col(worker, g.col_len()), z.slice(s * g.out_len()..(s + 1) * g.out_len())) };
        im2col(g, &x[s * g.in_len()..][..g.in_len()], col);
        let wm = Mat { data: w, rs: ckk, cs: 1 };
        sgemm_on(gemm, g.out_channels, ohw, ckk, 1.0, wm, Mat { data: col, rs: ohw, cs: 1 }, 0.0, MatMut { data: zs, rs: ohw, cs: 1 });
    });
}

/// The most blocks a batch's weight gradient is summed in (see [`backward`]).
const MAX_WGRAD_BLOCKS: usize = 16;

/// Blocks the weight gradient of `batch` samples is summed in: a function of the batch alone,
/// never of the thread count.
pub(crate) fn wgrad_blocks(batch: usize) -> usize {
    batch.clamp(1, MAX_WGRAD_BLOCKS)
}

/// Fast backward without the bias: dW ← Σ_s dZ_s·col_sᵀ; dX_s ← col2im(Wᵀ·dZ_s) when given.
///
/// The batch is cut into `wgrad_blocks(batch)` contiguous blocks of samples; block 0 sums its
/// samples, in order, into `dw`, block b > 0 into `partials[b−1]`, and the partials are then
/// added to `dw` in block order. The threads only decide who computes which block, so dW has
/// the same bits on any number of threads. `dcols` is a second per-thread scratch like
/// `scratch.cols`; `partials` holds `wgrad_blocks(batch) − 1` weight-sized buffers.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(test), allow(dead_code))]
pub fn backward(
    pool: &Pool,
    ws: &mut GemmWorkspace,
    scratch: &Scratch,
    dcols: &Scratch,
    partials: &mut [f32],
    g: &Geometry,
    batch: usize,
    w: &[f32],
    x: &[f32],
    dz: &[f32],
    dw: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    let (ckk, ohw, w_len) = (g.ckk(), g.ohw(), dw.len());
    let blocks = wgrad_blocks(batch);
    assert!(partials.len() >= (blocks - 1) * w_len, "conv partials too small");
    let dw_shared = SharedMut::new(&mut *dw);
    let partials_shared = SharedMut::new(&mut *partials);
    let dx = dx.map(|dx| SharedMut::new(&mut dx[..batch * g.in_len()]));
    pool.run_with(blocks, ws.workers(), &|block, worker, gemm| {
        // SAFETY: block b alone writes its dW buffer and the dX of its own samples; `worker`
        // is this task's worker index in a run that alone uses `scratch` and `dcols`.
        let acc = unsafe {
            if block == 0 {
                dw_shared.slice(0..w_len)
            } else {
                partials_shared.slice((block - 1) * w_len..block * w_len)
            }
        };
        // SAFETY: as above (`worker` names this task's lowered columns in each scratch).
        let (col, dcol) = unsafe { (scratch.col(worker, g.col_len()), dcols.col(worker, g.col_len())) };
        for (n, s) in chunk_range(batch, blocks, block).enumerate() {
            im2col(g, &x[s * g.in_len()..][..g.in_len()], col);
            let dzs = &dz[s * g.out_len()..][..g.out_len()];
            // dW (OC × CKK) += dZ_s (OC × OHW) · col_sᵀ: rows of both are contiguous
            rowdot(g.out_channels, ckk, ohw, dzs, ohw, col, ohw, acc, ckk, n > 0);
            if let Some(dx) = &dx {
                // dcol (CKK × OHW) = Wᵀ (CKK × OC) · dZ_s (OC × OHW)
                let w_t = Mat { data: w, rs: 1, cs: ckk };
                let dcol_m = MatMut { data: &mut dcol[..], rs: ohw, cs: 1 };
                sgemm_on(gemm, ckk, ohw, g.out_channels, 1.0, w_t, Mat { data: dzs, rs: ohw, cs: 1 }, 0.0, dcol_m);
                // SAFETY: sample s belongs to this block only.
                let dxs = unsafe { dx.slice(s * g.in_len()..(s + 1) * g.in_len()) };
                col2im(g, dcol, dxs);
            }
        }
    });
    // dW[e] = ((block 0 + block 1) + block 2) + …, each element in that order; the elements
    // are independent, so they may be spread over the threads.
    let partials = &partials[..(blocks - 1) * w_len];
    let dw = SharedMut::new(dw);
    for_chunks(pool, w_len, 16384, &|_, range| {
        // SAFETY: chunks are disjoint ranges of dW.
        let dw = unsafe { dw.slice(range.clone()) };
        for part in partials.chunks_exact(w_len) {
            dw.iter_mut().zip(&part[range.clone()]).for_each(|(d, p)| *d += *p);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Shape;
    use crate::layers::conv::{backward_spec, forward_spec};
    use crate::testutil::{assert_close, poisoned, Rng};

    #[test]
    fn fast_matches_spec_with_stride_padding_and_dilation() {
        let mut rng = Rng::new(11);
        // (input, out channels, kernel, stride, padding, dilation); the dilated ones are 1-D
        // convolutions as `Conv1d` runs them (height 1), one of them strided
        let cases = [
            (Shape::image(1, 5, 5), 2, (3, 3), (1, 1), (0, 0), (1, 1)),
            (Shape::image(3, 7, 6), 4, (3, 2), (2, 1), (1, 1), (1, 1)),
            (Shape::image(2, 9, 9), 3, (5, 5), (2, 2), (2, 2), (1, 1)),
            (Shape::image(2, 1, 1), 5, (1, 1), (1, 1), (0, 0), (1, 1)),
            (Shape::image(1, 28, 28), 6, (5, 5), (1, 1), (2, 2), (1, 1)),
            (Shape::image(2, 4, 5), 3, (2, 2), (3, 2), (2, 3), (1, 1)),
            (Shape::image(6, 14, 14), 16, (5, 5), (1, 1), (0, 0), (1, 1)),
            (Shape::image(2, 1, 19), 3, (1, 3), (1, 2), (0, 2), (1, 3)),
            (Shape::image(3, 1, 40), 4, (1, 5), (1, 1), (0, 4), (1, 2)),
            (Shape::image(1, 1, 12), 2, (1, 12), (1, 1), (0, 0), (1, 1)),
        ];
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            let mut ws = GemmWorkspace::new(threads).unwrap();
            for (input, oc, kernel, stride, padding, dilation) in cases {
                let Shape::Image { channels, height, width } = input else { unreachable!() };
                let span = |k: usize, d: usize| d * (k - 1) + 1;
                let oh = (height + 2 * padding.0 - span(kernel.0, dilation.0)) / stride.0 + 1;
                let ow = (width + 2 * padding.1 - span(kernel.1, dilation.1)) / stride.1 + 1;
                let g = Geometry::new(input, Shape::image(oc, oh, ow), kernel, stride, padding, dilation);
                for batch in [1, 2, 5] {
                    let w = rng.ints(oc * channels * kernel.0 * kernel.1);
                    let zero_b = vec![0.0; oc];
                    let x = rng.ints(batch * input.len());
                    let dz = rng.ints(batch * g.out_len());
                    let mut cols = poisoned(threads * g.col_len());
                    let mut dcols = poisoned(threads * g.col_len());
                    let scratch = Scratch { cols: SharedMut::new(&mut cols), col_len: g.col_len() };
                    let dscratch = Scratch { cols: SharedMut::new(&mut dcols), col_len: g.col_len() };

                    let mut z_spec = vec![0.0; batch * g.out_len()];
                    forward_spec(&g, batch, &w, &zero_b, &x, &mut z_spec);
                    let mut z = poisoned(batch * g.out_len() + 3);
                    forward(&pool, &mut ws, &scratch, &g, batch, &w, &x, &mut z);
                    assert_eq!(&z[..batch * g.out_len()], &z_spec[..], "forward {g:?}");
                    assert!(z[batch * g.out_len()..].iter().all(|v| v.is_nan()), "wrote past the batch");

                    let (mut dw_s, mut db_s, mut dx_s) = (vec![0.0; w.len()], vec![0.0; oc], vec![0.0; x.len()]);
                    backward_spec(&g, batch, &w, &x, &dz, &mut dw_s, &mut db_s, Some(&mut dx_s));
                    let (mut dw, mut dx, mut partials) =
                        (poisoned(w.len()), poisoned(x.len()), poisoned((wgrad_blocks(batch) - 1) * w.len()));
                    backward(&pool, &mut ws, &scratch, &dscratch, &mut partials, &g, batch, &w, &x, &dz, &mut dw, Some(&mut dx));
                    assert_close(&dw, &dw_s, 0.0, 0.0, "conv dW");
                    assert_close(&dx, &dx_s, 0.0, 0.0, "conv dX");
                }
            }
        }
    }
}
