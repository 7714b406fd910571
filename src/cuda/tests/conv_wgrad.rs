//! The implicit convolution weight gradient (`conv_wgrad_*` in kernels/conv.cu): a plain Rust
//! twin of the kernels' loops (the blocks, groups and threads as loops, the same tiles, shares,
//! steps, offsets and order of sums), checked against `conv::backward_spec` here, so that the
//! partition into tiles, shares and steps and the join are checked without a GPU; then the
//! kernels against the spec and the twin on a GPU.

use super::conv_lowering::{conv_geometries, conv_geometry};
use super::{check, download, same_bits, upload};
use crate::chain::Shape;
use crate::cuda::conv::{WgradSplit, WGRAD_R_TILE, WGRAD_STEP};
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::test_gpu;
use crate::layers::conv;
use crate::testutil::{poisoned, Rng};

/// Threads a block (REDUCE_THREADS).
const THREADS: usize = 256;
/// WGI_FAR: a row offset that puts every pixel outside the input.
const FAR: i64 = -(1 << 29);

/// dW (OC × CKK) as the kernels compute it with `split`, for `batch` samples of x and dZ:
/// out[q] per share by each tile's block (its groups' sums, each in ascending k, added in group
/// order), then, with several shares, their sum in share order.
fn implicit_twin(g: &conv::Geometry, batch: usize, split: WgradSplit, x: &[f32], dz: &[f32]) -> Vec<f32> {
    let (oc_n, ckk, ohw, hw) = (g.out_channels as i64, g.ckk(), g.ohw() as i64, (g.height * g.width) as i64);
    let (kh, kw) = (g.kernel.0 as i64, g.kernel.1 as i64);
    let (toc, tr_n) = (split.oc_tile, WGRAD_R_TILE);
    let (group, step) = (toc * tr_n / 16, WGRAD_STEP);
    let (ks, slice) = (THREADS / group, step / (THREADS / group));
    let w_len = oc_n as usize * ckk;
    let mut out = vec![f32::NAN; split.shares * w_len];
    for q in 0..split.shares {
        for tile in 0..split.oc_tiles * split.r_tiles {
            let (oc0, r0) = (tile / split.r_tiles * toc, tile % split.r_tiles * tr_n);
            let s_first = q * split.chunk;
            let s_end = (s_first + split.chunk).min(batch);
            let (k_first, k_end) = (s_first * ohw as usize, s_end * ohw as usize);
            // the r table: c·H·W, i·dh − ph, j·dw − pw (FAR past CKK)
            let r_table: Vec<(i64, i64, i64)> = (0..tr_n)
                .map(|t| {
                    let r = (r0 + t) as i64;
                    let (j, i, c) = (r % kw, (r / kw) % kh, r / (kw * kh));
                    match (r as usize) < ckk {
                        true => (c * hw, i * g.dilation.0 as i64 - g.padding.0 as i64, j * g.dilation.1 as i64 - g.padding.1 as i64),
                        false => (0, FAR, 0),
                    }
                })
                .collect();
            let mut acc = vec![[[0.0f32; 4]; 4]; THREADS];
            for k0 in (k_first..k_end).step_by(step) {
                // the k table: dZ[s, 0, p]'s offset (−1 past the share), s·C·H·W, oy·sh, ox·sw
                let k_table: Vec<(i64, i64, i64, i64)> = (0..step)
                    .map(|t| {
                        let k = (k0 + t) as i64;
                        let (s, p) = (k / ohw, k % ohw);
                        let (oy, ox) = (p / g.out_width as i64, p % g.out_width as i64);
                        match k0 + t < k_end {
                            true => (s * oc_n * ohw + p, s * g.in_len() as i64, oy * g.stride.0 as i64, ox * g.stride.1 as i64),
                            false => (-1, 0, FAR, 0),
                        }
                    })
                    .collect();
                let dz_s: Vec<Vec<f32>> = k_table
                    .iter()
                    .map(|&(at, ..)| {
                        let oc = |o: usize| (oc0 + o) as i64;
                        (0..toc).map(|o| if at >= 0 && oc(o) < oc_n { dz[(at + oc(o) * ohw) as usize] } else { 0.0 }).collect()
                    })
                    .collect();
                let x_s: Vec<Vec<f32>> = k_table
                    .iter()
                    .map(|&(_, xs, ky, kx)| {
                        let gather = |&(plane, ry, rx): &(i64, i64, i64)| {
                            let (iy, ix) = (ky + ry, kx + rx);
                            let inside = iy >= 0 && iy < g.height as i64 && ix >= 0 && ix < g.width as i64;
                            if inside {
                                x[(xs + plane + iy * g.width as i64 + ix) as usize]
                            } else {
                                0.0
                            }
                        };
                        r_table.iter().map(gather).collect()
                    })
                    .collect();
                for (thread, acc) in acc.iter_mut().enumerate() {
                    let (grp, t) = (thread / group, thread % group);
                    let (tc, tr) = (t / (tr_n / 4), t % (tr_n / 4));
                    for kk in grp * slice..(grp + 1) * slice {
                        for (a, row) in acc.iter_mut().enumerate() {
                            for (b, v) in row.iter_mut().enumerate() {
                                *v = dz_s[kk][tc * 4 + a].mul_add(x_s[kk][tr * 4 + b], *v);
                            }
                        }
                    }
                }
            }
            for t in 0..group {
                let mut sum = acc[t];
                for h in 1..ks {
                    for (a, row) in sum.iter_mut().enumerate() {
                        for (b, v) in row.iter_mut().enumerate() {
                            *v += acc[h * group + t][a][b];
                        }
                    }
                }
                let (tc, tr) = (t / (tr_n / 4), t % (tr_n / 4));
                for (a, row) in sum.iter().enumerate() {
                    for (b, &v) in row.iter().enumerate() {
                        let (oc, r) = (oc0 + tc * 4 + a, r0 + tr * 4 + b);
                        if (oc as i64) < oc_n && r < ckk {
                            out[q * w_len + oc * ckk + r] = v;
                        }
                    }
                }
            }
        }
    }
    // conv_wgrad_join: the shares added in order (one share: the blocks wrote dW itself)
    (0..w_len).map(|i| (1..split.shares).fold(out[i], |acc, q| acc + out[q * w_len + i])).collect()
}

/// The layers the weight gradient is checked at besides the seven geometries: a 16→16 3×3
/// pad 1 on 32×32 (vgg_small's second) and LeNet's second (6→16 5×5 on 14×14).
fn large_geometries() -> [conv::Geometry; 2] {
    [
        conv_geometry(Shape::image(16, 32, 32), 16, (3, 3), (1, 1), (1, 1), (1, 1)),
        conv_geometry(Shape::image(6, 14, 14), 16, (5, 5), (1, 1), (0, 0), (1, 1)),
    ]
}

/// Output channels past one tile of 16 (the kernels of 32 and 64, their groups' sums, a second
/// channel tile) and taps past one tile of 64.
fn wide_geometries() -> [conv::Geometry; 3] {
    [
        conv_geometry(Shape::image(4, 6, 5), 70, (3, 3), (1, 1), (1, 1), (1, 1)),
        conv_geometry(Shape::image(20, 4, 4), 33, (2, 2), (1, 1), (1, 1), (1, 1)),
        conv_geometry(Shape::image(3, 5, 5), 24, (3, 3), (1, 1), (0, 0), (1, 1)),
    ]
}

/// (geometry, batch) of the checks: the seven geometries at 1, 2 and 5 samples, the large ones
/// at 64 and 300, the wide ones at 9 and 40.
fn cases() -> Vec<(conv::Geometry, usize)> {
    let small = conv_geometries().into_iter().flat_map(|g| [1, 2, 5].map(|batch| (g, batch)));
    let large = large_geometries().into_iter().flat_map(|g| [64, 300].map(|batch| (g, batch)));
    small.chain(large).chain(wide_geometries().into_iter().flat_map(|g| [9, 40].map(|batch| (g, batch)))).collect()
}

/// dW by the spec.
fn spec(g: &conv::Geometry, batch: usize, x: &[f32], dz: &[f32]) -> Vec<f32> {
    let (mut dw, mut db) = (vec![0.0; g.out_channels * g.ckk()], vec![0.0; g.out_channels]);
    conv::backward_spec(g, batch, &vec![0.0; dw.len()], x, dz, &mut dw, &mut db, None);
    dw
}

/// The twin of the kernels equals the spec exactly on small integers: at the splits the
/// launcher takes for the cases (one share and many, the last share short: LeNet's second layer
/// at 300 samples takes 14 shares of 22, the last of 14), and at splits made to be awkward
/// (every chunk size from 1 to the batch, for the seven geometries at 5 and 7 samples).
#[test]
fn the_implicit_weight_gradients_twin_matches_the_spec() {
    let mut rng = Rng::new(71);
    let [vgg, lenet] = large_geometries();
    assert_eq!(WgradSplit::of(&lenet, 300), WgradSplit { oc_tile: 16, oc_tiles: 1, r_tiles: 3, chunk: 22, shares: 14 });
    assert_eq!(WgradSplit::of(&vgg, 64).shares, 32);
    assert_eq!(WgradSplit::of(&conv_geometries()[0], 5).shares, 1);
    for (g, batch) in cases() {
        let (x, dz) = (rng.ints(batch * g.in_len()), rng.ints(batch * g.out_len()));
        let split = WgradSplit::of(&g, batch);
        assert!(split.shares <= batch && split.chunk * (split.shares - 1) < batch, "{split:?}");
        check(
            &format!("twin {g:?} batch {batch} {split:?}"),
            &implicit_twin(&g, batch, split, &x, &dz),
            &spec(&g, batch, &x, &dz),
            0.0,
            0.0,
        );
    }
    for g in conv_geometries() {
        for batch in [5, 7] {
            let (x, dz) = (rng.ints(batch * g.in_len()), rng.ints(batch * g.out_len()));
            let want = spec(&g, batch, &x, &dz);
            for chunk in 1..=batch {
                let split = WgradSplit { chunk, shares: batch.div_ceil(chunk), ..WgradSplit::of(&g, batch) };
                check(&format!("twin {g:?} batch {batch} {split:?}"), &implicit_twin(&g, batch, split, &x, &dz), &want, 0.0, 0.0);
            }
        }
    }
}

/// Every output-channel count up to 70 takes a tile there is a kernel for, holding all of them
/// up to 64; the tiles cover the outputs; shares are never empty and never more than the
/// samples.
#[test]
fn the_implicit_weight_gradients_split_covers_every_output_and_sample() {
    for oc in 1..=70 {
        for (channels, batch) in [(1, 1), (3, 7), (16, 300), (64, 4096)] {
            let g = conv_geometry(Shape::image(channels, 8, 8), oc, (3, 3), (1, 1), (1, 1), (1, 1));
            let split = WgradSplit::of(&g, batch);
            assert!(WgradSplit::OC_TILES.contains(&split.oc_tile), "{split:?}");
            assert!(oc > 64 || split.oc_tiles == 1, "{oc}: {split:?}");
            assert!(split.oc_tiles * split.oc_tile >= oc && split.r_tiles * WGRAD_R_TILE >= g.ckk(), "{split:?}");
            assert!(split.shares >= 1 && split.shares <= batch && split.chunk * (split.shares - 1) < batch, "{split:?}");
            assert!(split.chunk * split.shares >= batch, "{split:?}");
        }
    }
    // the kernels' sizes are the launcher's and the twin's
    let source = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/conv.cu")).unwrap();
    assert!(source.contains(&format!("#define WGI_TR {WGRAD_R_TILE}\n")), "WGI_TR is not WGRAD_R_TILE");
    assert!(source.contains(&format!("#define WGI_KC {WGRAD_STEP}\n")), "WGI_KC is not WGRAD_STEP");
    for tile in WgradSplit::OC_TILES {
        assert!(source.contains(&format!("void conv_wgrad_{tile}(")), "no kernel for tiles of {tile}");
        assert!(source.contains(&format!("conv_wgrad_tile<{tile}>(")), "conv_wgrad_{tile} is not conv_wgrad_tile<{tile}>");
    }
}

/// The kernels equal the spec exactly on small integers at every case (one share and several,
/// the last short); on uniform values they give the twin's bits (the same products, fused, in
/// the same order), and the same bits on a second run; nothing outside dW is written (dW sits
/// inside a poisoned buffer, the partials poisoned too).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_implicit_weight_gradient_matches_the_spec_and_its_twin() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(72);
    for (g, batch) in cases() {
        let w_len = g.out_channels * g.ckk();
        let split = WgradSplit::of(&g, batch);
        let run = |x: &[f32], dz: &[f32]| {
            let (xd, dzd) = (upload(&stream, x), upload(&stream, dz));
            // dW at values 3.. of a poisoned buffer
            let (mut dw, mut partials) = (upload(&stream, &poisoned(w_len + 5)), upload(&stream, &poisoned(batch * w_len)));
            let dwm = ViewMut::of(&mut dw);
            // SAFETY: values 3..3 + w_len of `dw`, used by this launch alone.
            let at = unsafe { ViewMut::from_raw(dwm.ptr() + 12, w_len) };
            gpu.conv_weight_grad_implicit(&stream, &g, batch, View::of(&xd), View::of(&dzd), ViewMut::of(&mut partials), at).unwrap();
            download(&stream, &dw)
        };
        let around = |dw: &[f32]| [poisoned(3), dw.to_vec(), poisoned(2)].concat();
        let what = format!("implicit dW {g:?} batch {batch} {split:?}");
        let (x, dz) = (rng.ints(batch * g.in_len()), rng.ints(batch * g.out_len()));
        check(&format!("{what}, integers"), &run(&x, &dz), &around(&spec(&g, batch, &x, &dz)), 0.0, 0.0);
        let (x, dz) = (rng.uniform(batch * g.in_len()), rng.uniform(batch * g.out_len()));
        let got = run(&x, &dz);
        same_bits(&format!("{what}, the twin's bits"), &got, &around(&implicit_twin(&g, batch, split, &x, &dz)));
        same_bits(&format!("{what}, a second run"), &got, &run(&x, &dz));
    }
}
