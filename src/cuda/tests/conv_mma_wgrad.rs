//! The tensor-core weight gradient (kernels/conv_mma_wgrad.cu): how it covers layers and a
//! twin of its staging, fragments and order of sums, checked without a GPU; then the kernels
//! against the spec on a GPU, in both arithmetics.

use super::conv_mma::{check_scaled, geometries, FP32_TOL, TF32_TOL};
use super::{check, download, same_bits, upload};
use crate::cuda::conv_direct::band_bound;
use crate::cuda::conv_direct::DIRECT_SHARED;
use crate::cuda::conv_mma_wgrad::{MmaWgrad, WGRAD_MMA_WARPS};
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::test_gpu;
use crate::layers::conv;
use crate::testutil::{poisoned, Rng};

/// The batches the tests take: one sample, three, and 17 (several shares where the images are
/// large enough, the last share short).
const BATCHES: [usize; 3] = [1, 3, 17];

/// Every geometry fits at every batch, within the shared memory it may have, with tiles of 64,
/// 128 or 256 pixels (multiples of the warps' 64 pixels a round that divide the block's 256
/// threads), blocks that cover every output channel and tap, bands enough for the input
/// channels of every block's taps, and shares that cover the batch (several of them at 17
/// samples of VGG's 32×32 layers); the kernel's constants are the launcher's.
#[test]
fn the_tensor_core_weight_gradient_covers_every_geometry() {
    let mut several = 0;
    for g in geometries() {
        let taps = g.kernel.0 * g.kernel.1;
        for batch in BATCHES {
            let d = MmaWgrad::of(&g, batch).unwrap_or_else(|| panic!("{g:?} batch {batch}"));
            let what = format!("{g:?} batch {batch} {d:?}");
            assert!(d.shared_bytes() <= DIRECT_SHARED && 2 * d.stage_floats() * 4 <= d.shared_bytes(), "{what}");
            assert!([64, 128, 256].contains(&d.tile) && (d.rows, d.cols) == band_bound(&g, d.tile), "{what}");
            assert!(d.oc_tiles * d.channels >= g.out_channels && (d.oc_tiles - 1) * d.channels < g.out_channels, "{what}");
            assert!(d.r_tiles * d.taps() >= g.ckk() && (d.r_tiles - 1) * d.taps() < g.ckk() && d.channels * d.taps() == 1024, "{what}");
            for rt in 0..d.r_tiles {
                let (first, last) = (rt * d.taps() / taps, ((rt + 1) * d.taps()).min(g.ckk()) - 1);
                assert!(last / taps - first < d.bands, "{what}: r tile {rt}");
            }
            assert!(d.chunk * d.shares >= batch && d.chunk * (d.shares - 1) < batch, "{what}");
            several += usize::from(d.shares > 1);
        }
    }
    assert!(several >= 2, "{several}");
    // an empty batch is not a case
    assert_eq!(MmaWgrad::of(&geometries()[0], 0), None);
    let source = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/conv_mma_wgrad.cu")).unwrap();
    assert!(source.contains("#define CMW_WARPS (REDUCE_THREADS / 32)\n") && WGRAD_MMA_WARPS == 256 / 32);
    assert!(source.contains("conv_mma_wgrad_tile<1, 8, 1>") && source.contains("conv_mma_wgrad_tile<2, 4, 3>"));
}

/// dW as conv_mma_wgrad_* computes it with `d`, lane by lane, on values whose products and sums
/// are exact (small integers): per share and block its taps' offsets, each step's staged dZ
/// ([channels][tile + 4], zero past OC and the pixels), offsets (0 past the pixels) and band
/// (zero outside the image and past C), each warp's k-steps 8w, 8w + 64, ... below the step's
/// pixels with their m16n8k8 fragments gathered as the lanes gather them (A: a0 (g, t),
/// a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); B: b0 (t, g), b1 (t + 4, g)), each step's
/// sums added to the warp's totals, the totals stored as the lanes store d0..d3 ((g, 2t),
/// (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)) and added in warp order, then the shares in order.
fn wgrad_twin(g: &conv::Geometry, batch: usize, d: MmaWgrad, x: &[f32], dz: &[f32]) -> Vec<f32> {
    let (oc_n, ohw, ckk, taps, ow) = (g.out_channels, g.ohw(), g.ckk(), g.kernel.0 * g.kernel.1, g.out_width);
    let (bm, bn, tile, cols, plane, pitch) = (d.channels, d.taps(), d.tile, d.cols, d.rows * d.cols, d.tile + 4);
    let w_len = oc_n * ckk;
    let mut out = vec![f32::NAN; d.shares * w_len];
    let blocks = (0..d.shares).flat_map(|q| (0..d.r_tiles).flat_map(move |rt| (0..d.oc_tiles).map(move |ot| (q, rt, ot))));
    for (q, rt, ot) in blocks {
        let (oc_base, r0) = (ot * bm, rt * bn);
        let c_lo = r0 / taps;
        let tap = |r: usize| {
            let (c, ti) = (r / taps, r % taps);
            if r < ckk {
                (c - c_lo) * plane + ti / g.kernel.1 * g.dilation.0 * cols + ti % g.kernel.1 * g.dilation.1
            } else {
                0
            }
        };
        // the warps' totals, [warp][bm][bn]
        let mut red = vec![0.0f32; WGRAD_MMA_WARPS * bm * bn];
        for (s, p0) in (q * d.chunk..((q + 1) * d.chunk).min(batch)).flat_map(|s| (0..ohw).step_by(tile).map(move |p0| (s, p0))) {
            let n = tile.min(ohw - p0);
            // conv_direct_band
            let (oy_first, oy_last) = (p0 / ow, (p0 + n - 1) / ow);
            let ox_lo = if oy_first == oy_last { p0 - oy_first * ow } else { 0 };
            let ox_hi = if oy_first == oy_last { p0 + n - 1 - oy_first * ow } else { ow - 1 };
            let rows = (oy_last - oy_first) * g.stride.0 + (g.kernel.0 - 1) * g.dilation.0 + 1;
            let band_cols = (ox_hi - ox_lo) * g.stride.1 + (g.kernel.1 - 1) * g.dilation.1 + 1;
            assert!(rows <= d.rows && band_cols <= cols, "band {rows}×{band_cols} past its bound {d:?}");
            let (row0, col0) = ((oy_first * g.stride.0) as i64 - g.padding.0 as i64, (ox_lo * g.stride.1) as i64 - g.padding.1 as i64);
            let mut dz_s = vec![f32::NAN; bm * pitch];
            for (o, p) in (0..bm).flat_map(|o| (0..tile).map(move |p| (o, p))) {
                let valid = oc_base + o < oc_n && p < n;
                dz_s[o * pitch + p] = if valid { dz[(s * oc_n + oc_base + o) * ohw + p0 + p] } else { 0.0 };
            }
            let off_s: Vec<usize> = (0..tile)
                .map(|p| if p < n { ((p0 + p) / ow - oy_first) * g.stride.0 * cols + ((p0 + p) % ow - ox_lo) * g.stride.1 } else { 0 })
                .collect();
            let mut x_s = vec![0.0f32; d.bands * plane];
            for (e, v) in x_s.iter_mut().enumerate() {
                let (c, row, col) = (c_lo + e / plane, e % plane / cols, e % cols);
                let (iy, ix) = (row0 + row as i64, col0 + col as i64);
                if c < g.in_channels && iy >= 0 && ix >= 0 && (iy as usize) < g.height && (ix as usize) < g.width {
                    *v = x[((s * g.in_channels + c) * g.height + iy as usize) * g.width + ix as usize];
                }
            }
            for warp in 0..WGRAD_MMA_WARPS {
                let mut acc = vec![0.0f32; bm * bn];
                for k0 in (8 * warp..n).step_by(8 * WGRAD_MMA_WARPS) {
                    let (mut a, mut b) = (vec![[0.0f32; 8]; bm], vec![[0.0f32; 8]; bn]);
                    for (lg, lt) in (0..8).flat_map(|lg| (0..4).map(move |lt| (lg, lt))) {
                        for m in 0..bm / 16 {
                            let at = (16 * m + lg) * pitch + k0 + lt;
                            (a[16 * m + lg][lt], a[16 * m + lg + 8][lt], a[16 * m + lg][lt + 4], a[16 * m + lg + 8][lt + 4]) =
                                (dz_s[at], dz_s[at + 8 * pitch], dz_s[at + 4], dz_s[at + 8 * pitch + 4]);
                        }
                        let (o0, o1) = (off_s[k0 + lt], off_s[k0 + lt + 4]);
                        for f in 0..bn / 8 {
                            let t = tap(r0 + 8 * f + lg);
                            (b[8 * f + lg][lt], b[8 * f + lg][lt + 4]) = (x_s[o0 + t], x_s[o1 + t]);
                        }
                    }
                    for (row, col) in (0..bm).flat_map(|row| (0..bn).map(move |col| (row, col))) {
                        acc[row * bn + col] += (0..8).map(|k| a[row][k] * b[col][k]).sum::<f32>();
                    }
                }
                // the lanes' d0..d3 of fragment (m, f) into [warp][bm][bn]
                for (m, f, lg, lt, q) in (0..bm / 16).flat_map(|m| {
                    (0..bn / 8)
                        .flat_map(move |f| (0..8).flat_map(move |lg| (0..4).flat_map(move |lt| (0..4).map(move |q| (m, f, lg, lt, q)))))
                }) {
                    let (row, col) = (16 * m + lg + q / 2 * 8, 8 * f + 2 * lt + q % 2);
                    red[(warp * bm + row) * bn + col] += acc[row * bn + col];
                }
            }
        }
        for e in 0..bm * bn {
            let (oc, r) = (oc_base + e / bn, r0 + e % bn);
            let sum = (1..WGRAD_MMA_WARPS).fold(red[e], |sum, w| sum + red[w * bm * bn + e]);
            if oc < oc_n && r < ckk {
                out[q * w_len + oc * ckk + r] = sum;
            }
        }
    }
    (0..w_len).map(|i| (1..d.shares).fold(out[i], |acc, q| acc + out[q * w_len + i])).collect()
}

/// dW of the spec's backward (db and dX not asked for).
fn spec_wgrad(g: &conv::Geometry, batch: usize, x: &[f32], dz: &[f32]) -> Vec<f32> {
    let w_len = g.out_channels * g.ckk();
    let (mut dw, mut db) = (poisoned(w_len), vec![0.0; g.out_channels]);
    conv::backward_spec(g, batch, &vec![0.0; w_len], x, dz, &mut dw, &mut db, None);
    dw
}

/// dW of the spec's backward in f64, rounded to f32 at the end: a reference whose own rounding
/// (sums of up to 17 × 1024 products) does not count against the kernel's.
fn spec_wgrad_f64(g: &conv::Geometry, batch: usize, x: &[f32], dz: &[f32]) -> Vec<f32> {
    let w_len = g.out_channels * g.ckk();
    let wide = |v: &[f32]| v.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
    let (mut dw, mut db) = (vec![f64::NAN; w_len], vec![0.0; g.out_channels]);
    conv::backward_spec(g, batch, &vec![0.0; w_len], &wide(x), &wide(dz), &mut dw, &mut db, None);
    dw.into_iter().map(|v| v as f32).collect()
}

/// The twin (the kernel's staging, offsets, fragments and order of sums, lane by lane) equals
/// the spec exactly on small integers at every geometry and batch: the tiling, the shares and
/// the fragments' layout checked without a GPU.
#[test]
fn the_tensor_core_weight_gradient_twin_matches_the_spec() {
    let mut rng = Rng::new(97);
    for g in geometries() {
        for batch in BATCHES {
            let d = MmaWgrad::of(&g, batch).unwrap();
            let (x, dz) = (rng.ints(batch * g.in_len()), rng.ints(batch * g.out_len()));
            let what = format!("mma dW twin {g:?} batch {batch} {d:?}");
            check(&what, &wgrad_twin(&g, batch, d, &x, &dz), &spec_wgrad(&g, batch, &x, &dz), 0.0, 0.0);
        }
    }
}

/// The kernel against the spec at every geometry and batches 1, 3 and 17, in both arithmetics:
/// exactly on small integers (TF32 holds them, their products and sums exactly), within the
/// tolerances of the forward's test (a share of Σ|dz·x| each output, against the spec in f64:
/// the kernel's products and sums by steps of at most four k-steps, then FP32 sums of at most
/// a few dozen steps, warps and shares, well within) on uniform values, the same
/// bits on a second run; nothing outside dW written (inside a poisoned buffer), the partials
/// poisoned before each run.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_tensor_core_weight_gradient_matches_the_spec() {
    let gpu = test_gpu();
    if gpu.compute_capability().0 < 8 {
        println!("skipped: the tensor-core kernels need sm_80 or later");
        return;
    }
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(98);
    let abs = |v: &[f32]| v.iter().map(|v| v.abs()).collect::<Vec<f32>>();
    let around = |v: &[f32]| [poisoned(3), v.to_vec(), poisoned(2)].concat();
    for g in geometries() {
        for batch in BATCHES {
            let d = MmaWgrad::of(&g, batch).unwrap();
            let w_len = g.out_channels * g.ckk();
            for tf32 in [false, true] {
                let tol = if tf32 { TF32_TOL } else { FP32_TOL };
                // dW at 3.. of a poisoned buffer, then the whole buffer
                let wgrad = |x: &[f32], dz: &[f32]| {
                    let (xd, dzd) = (upload(&stream, x), upload(&stream, dz));
                    let (mut partials, mut dw) = (upload(&stream, &poisoned(d.shares * w_len)), upload(&stream, &poisoned(w_len + 5)));
                    let m = ViewMut::of(&mut dw);
                    // SAFETY: values 3..3 + w_len of `dw`, used by this launch alone.
                    let inner = unsafe { ViewMut::from_raw(m.ptr() + 12, w_len) };
                    gpu.conv_mma_wgrad(&stream, &g, batch, View::of(&xd), View::of(&dzd), ViewMut::of(&mut partials), inner, tf32).unwrap();
                    download(&stream, &dw)
                };
                let what = format!("mma dW tf32={tf32} {g:?} batch {batch} {d:?}");
                let (x, dz) = (rng.ints(batch * g.in_len()), rng.ints(batch * g.out_len()));
                check(&format!("{what}, integers"), &wgrad(&x, &dz), &around(&spec_wgrad(&g, batch, &x, &dz)), 0.0, 0.0);
                let (x, dz) = (rng.uniform(batch * g.in_len()), rng.uniform(batch * g.out_len()));
                let got = wgrad(&x, &dz);
                let (want, scale) = (spec_wgrad_f64(&g, batch, &x, &dz), spec_wgrad(&g, batch, &abs(&x), &abs(&dz)));
                assert!(got[..3].iter().chain(&got[got.len() - 2..]).all(|v| v.is_nan()), "{what}: written outside dW");
                check_scaled(&what, &got[3..got.len() - 2], &want, &scale, tol);
                same_bits(&format!("{what}, a second run"), &got, &wgrad(&x, &dz));
            }
        }
    }
}
