//! The direct convolutions (kernels/conv_direct.cu): plain Rust twins of the kernels' loops (the
//! blocks, bands, staging, offsets, chunks, shares and order of sums; the forward's weights read
//! as stored or, for a stride-1 input gradient, flipped and transposed), checked against the spec
//! here, so that the tiling is checked without a GPU; then the kernels against the spec and their
//! twins on a GPU, and a whole training step forced onto them against the CPU.

use super::conv_lowering::{conv_geometries, conv_geometry};
use super::{check, download, same_bits, upload};
use crate::chain::Shape;
use crate::cuda::conv_direct::{
    band_bound, input_grad_geometry, DirectForward, DirectWgrad, FORWARD_CHANNELS, FORWARD_PIXELS, WGRAD_CHANNELS, WGRAD_PITCH, WGRAD_TAPS,
};
use crate::cuda::dnn::{forced, Route};
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::test_gpu;
use crate::layers::conv;
use crate::testutil::{poisoned, Rng};

/// Threads a block (REDUCE_THREADS).
const THREADS: usize = 256;

/// A tile's band (conv_direct_band): its first output row and column, its rows and columns, and
/// the input pixel of its first value.
struct Band {
    oy_first: usize,
    ox_lo: usize,
    rows: usize,
    cols: usize,
    row0: i64,
    col0: i64,
}

fn band(g: &conv::Geometry, p0: usize, p_end: usize) -> Band {
    let ow = g.out_width;
    let (oy_first, oy_last) = (p0 / ow, (p_end - 1) / ow);
    let one_row = oy_first == oy_last;
    let ox_lo = if one_row { p0 - oy_first * ow } else { 0 };
    let ox_hi = if one_row { p_end - 1 - oy_first * ow } else { ow - 1 };
    let rows = (oy_last - oy_first) * g.stride.0 + (g.kernel.0 - 1) * g.dilation.0 + 1;
    let cols = (ox_hi - ox_lo) * g.stride.1 + (g.kernel.1 - 1) * g.dilation.1 + 1;
    let bound = band_bound(g, p_end - p0);
    assert!(rows <= bound.0 && cols <= bound.1, "band {rows}×{cols} past its bound {bound:?} in {g:?}");
    let (row0, col0) = ((oy_first * g.stride.0) as i64 - g.padding.0 as i64, (ox_lo * g.stride.1) as i64 - g.padding.1 as i64);
    Band { oy_first, ox_lo, rows, cols, row0, col0 }
}

/// Channels c0..c0 + n of sample `xs` staged over `b` ([n][rows][cols], zero outside the image).
fn stage(g: &conv::Geometry, xs: &[f32], c0: usize, n: usize, b: &Band) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * b.rows * b.cols);
    for c in c0..c0 + n {
        for r in 0..b.rows {
            for col in 0..b.cols {
                let (iy, ix) = (b.row0 + r as i64, b.col0 + col as i64);
                let inside = iy >= 0 && ix >= 0 && (iy as usize) < g.height && (ix as usize) < g.width;
                out.push(if inside { xs[(c * g.height + iy as usize) * g.width + ix as usize] } else { 0.0 });
            }
        }
    }
    out
}

/// Output pixel p's offset in its band.
fn offset(g: &conv::Geometry, b: &Band, p: usize) -> usize {
    let (oy, ox) = (p / g.out_width, p % g.out_width);
    (oy - b.oy_first) * g.stride.0 * b.cols + (ox - b.ox_lo) * g.stride.1
}

/// The offset of tap (c, i, j) in a band of `b`'s size.
fn tap(g: &conv::Geometry, b: &Band, c: usize, i: usize, j: usize) -> usize {
    c * b.rows * b.cols + i * g.dilation.0 * b.cols + j * g.dilation.1
}

/// Z as conv_direct_forward computes it, block by block: each channel tile and pixel tile of
/// each sample, the input channels in chunks of the band, each output an fma chain over (c, i, j);
/// with `transposed`, W'[oc][c][i][j] read as w[c][oc][kh − 1 − i][kw − 1 − j] (`g` the input
/// gradient's geometry, w the layer's weights).
fn forward_twin(g: &conv::Geometry, batch: usize, d: DirectForward, x: &[f32], w: &[f32], transposed: bool) -> Vec<f32> {
    let (oc_n, ohw, taps) = (g.out_channels, g.ohw(), g.kernel.0 * g.kernel.1);
    let oc_tile = d.groups * FORWARD_CHANNELS;
    assert_eq!(d.tile, THREADS / d.groups * FORWARD_PIXELS);
    let mut z = vec![f32::NAN; batch * g.out_len()];
    for s in 0..batch {
        let xs = &x[s * g.in_len()..];
        for pt in 0..d.pixel_tiles {
            let (p0, p_end) = (pt * d.tile, ((pt + 1) * d.tile).min(ohw));
            let b = band(g, p0, p_end);
            for ot in 0..d.oc_tiles {
                let mut acc = vec![0.0f32; (p_end - p0) * oc_tile];
                for c0 in (0..g.in_channels).step_by(d.chunk) {
                    let n = d.chunk.min(g.in_channels - c0);
                    let x_s = stage(g, xs, c0, n, &b);
                    for (k, acc) in acc.chunks_mut(oc_tile).enumerate() {
                        let off = offset(g, &b, p0 + k);
                        for (o, acc) in acc.iter_mut().enumerate() {
                            let oc = ot * oc_tile + o;
                            for c in 0..n {
                                for (i, j) in (0..g.kernel.0).flat_map(|i| (0..g.kernel.1).map(move |j| (i, j))) {
                                    let t = i * g.kernel.1 + j;
                                    let at = if transposed {
                                        ((c0 + c) * oc_n + oc) * taps + taps - 1 - t
                                    } else {
                                        oc * g.ckk() + (c0 + c) * taps + t
                                    };
                                    let wv = if oc < oc_n { w[at] } else { 0.0 };
                                    *acc = x_s[off + tap(g, &b, c, i, j)].mul_add(wv, *acc);
                                }
                            }
                        }
                    }
                }
                for (k, acc) in acc.chunks(oc_tile).enumerate() {
                    for (o, &v) in acc.iter().enumerate().filter(|(o, _)| ot * oc_tile + o < oc_n) {
                        z[(s * oc_n + ot * oc_tile + o) * ohw + p0 + k] = v;
                    }
                }
            }
        }
    }
    z
}

/// dW as conv_direct_wgrad computes it with `d`: per share, each thread's register tile summed
/// over its slice of each tile's pixels (samples, then tiles, ascending), the slices added in
/// order, then the shares added in order (conv_wgrad_join).
fn wgrad_twin(g: &conv::Geometry, batch: usize, d: DirectWgrad, x: &[f32], dz: &[f32]) -> Vec<f32> {
    let (oc_n, ohw, ckk, taps) = (g.out_channels, g.ohw(), g.ckk(), g.kernel.0 * g.kernel.1);
    let r_tiles = ckk.div_ceil(WGRAD_TAPS);
    let items = oc_n.div_ceil(WGRAD_CHANNELS) * r_tiles;
    let slices = THREADS / items;
    let w_len = oc_n * ckk;
    // two staging buffers, their dZ 16-byte aligned, within the block's shared memory
    let (oc8, buffer) = (oc_n.div_ceil(WGRAD_CHANNELS) * WGRAD_CHANNELS, d.buffer_floats(g));
    assert!(buffer % 4 == 0 && 2 * 4 * buffer <= d.shared_bytes(g), "{d:?}");
    let mut out = vec![f32::NAN; d.shares * w_len];
    for q in 0..d.shares {
        let mut acc = vec![[[0.0f32; WGRAD_TAPS]; WGRAD_CHANNELS]; items * slices];
        for s in q * d.chunk..((q + 1) * d.chunk).min(batch) {
            for p0 in (0..ohw).step_by(d.tile) {
                let p_end = (p0 + d.tile).min(ohw);
                let b = band(g, p0, p_end);
                let x_s = stage(g, &x[s * g.in_len()..], 0, g.in_channels, &b);
                assert!(d.tile * (oc8 + 1) + x_s.len() <= buffer, "step's dZ, offsets and band past its buffer: {d:?} {g:?}");
                for (thread, acc) in acc.iter_mut().enumerate() {
                    let (item, slice) = (thread / slices, thread % slices);
                    let (og, rt) = (item / r_tiles, item % r_tiles);
                    let tap_of = |c: usize| {
                        let r = rt * WGRAD_TAPS + c;
                        let (ch, t) = (r / taps, r % taps);
                        if r < ckk {
                            tap(g, &b, ch, t / g.kernel.1, t % g.kernel.1)
                        } else {
                            0
                        }
                    };
                    for p in (p0 + slice..p_end).step_by(slices) {
                        let off = offset(g, &b, p);
                        for (a, row) in acc.iter_mut().enumerate() {
                            let oc = og * WGRAD_CHANNELS + a;
                            let dv = if oc < oc_n { dz[(s * oc_n + oc) * ohw + p] } else { 0.0 };
                            for (c, v) in row.iter_mut().enumerate() {
                                *v = dv.mul_add(x_s[off + tap_of(c)], *v);
                            }
                        }
                    }
                }
            }
        }
        for (item, threads) in acc.chunks(slices).enumerate() {
            let (og, rt) = (item / r_tiles, item % r_tiles);
            for (a, c) in (0..WGRAD_CHANNELS).flat_map(|a| (0..WGRAD_TAPS).map(move |c| (a, c))) {
                let (oc, r) = (og * WGRAD_CHANNELS + a, rt * WGRAD_TAPS + c);
                let sum = threads[1..].iter().fold(threads[0][a][c], |sum, t| sum + t[a][c]);
                if oc < oc_n && r < ckk {
                    out[q * w_len + oc * ckk + r] = sum;
                }
            }
        }
    }
    (0..w_len).map(|i| (1..d.shares).fold(out[i], |acc, q| acc + out[q * w_len + i])).collect()
}

/// The geometries besides the seven: output channels not a multiple of a tile (6, 20, 70: one,
/// four and eight groups, two channel tiles), a 40×40 image (pixel tiles over two rows, a last
/// short one), 64 and 16 input channels (the forward's chunks), VGG's first layer.
fn more_geometries() -> Vec<conv::Geometry> {
    vec![
        conv_geometry(Shape::image(1, 40, 40), 20, (5, 5), (1, 1), (2, 2), (1, 1)),
        conv_geometry(Shape::image(3, 32, 32), 16, (3, 3), (1, 1), (1, 1), (1, 1)),
        conv_geometry(Shape::image(3, 11, 13), 70, (3, 3), (2, 2), (1, 1), (1, 1)),
        conv_geometry(Shape::image(64, 12, 12), 16, (3, 3), (1, 1), (1, 1), (1, 1)),
        conv_geometry(Shape::image(16, 32, 32), 16, (3, 3), (1, 1), (1, 1), (1, 1)),
        conv_geometry(Shape::image(2, 1, 300), 6, (1, 7), (1, 1), (0, 6), (1, 2)),
    ]
}

/// (geometry, batch): every geometry at 1 and 3 samples; those the weight gradient takes at
/// batches whose shares do not divide them (LeNet's first layer at 301: 101 shares of 3, the
/// last of 1).
fn cases() -> Vec<(conv::Geometry, usize)> {
    let all = conv_geometries().into_iter().chain(more_geometries());
    let mut cases: Vec<(conv::Geometry, usize)> = all.flat_map(|g| [1, 3].map(|batch| (g, batch))).collect();
    cases.push((conv_geometries()[4], 301));
    cases.push((more_geometries()[1], 37));
    cases
}

fn spec_forward(g: &conv::Geometry, batch: usize, x: &[f32], w: &[f32]) -> Vec<f32> {
    let mut z = vec![0.0; batch * g.out_len()];
    conv::forward_spec(g, batch, w, &vec![0.0; g.out_channels], x, &mut z);
    z
}

/// dX of the spec's backward (dW and db thrown away).
fn spec_input_grad(g: &conv::Geometry, batch: usize, w: &[f32], dz: &[f32]) -> Vec<f32> {
    let (mut dw, mut db, mut dx) = (vec![0.0; w.len()], vec![0.0; g.out_channels], poisoned(batch * g.in_len()));
    conv::backward_spec(g, batch, w, &vec![0.0; batch * g.in_len()], dz, &mut dw, &mut db, Some(&mut dx));
    dx
}

/// (layer geometry, batch) for the input gradient: every case of stride 1 and padding at most
/// (k − 1)·d, then at 1 and 3 samples: a 3×3 kernel padded 2 (p' = 0) on 7×9, an unpadded 5×5
/// on 13×11 (p' = 4), a 3×3 dilated 2 padded 1 (p' = 3), 1×1 kernels from 40 channels to 33,
/// 70 channels to 6 (the transposed forward's two channel tiles), 8 to 96 (its input channels in
/// chunks).
fn input_grad_cases() -> Vec<(conv::Geometry, usize)> {
    let more = [
        conv_geometry(Shape::image(5, 7, 9), 3, (3, 3), (1, 1), (2, 2), (1, 1)),
        conv_geometry(Shape::image(7, 13, 11), 9, (5, 5), (1, 1), (0, 0), (1, 1)),
        conv_geometry(Shape::image(4, 9, 10), 5, (3, 3), (1, 1), (1, 1), (2, 2)),
        conv_geometry(Shape::image(40, 6, 7), 33, (1, 1), (1, 1), (0, 0), (1, 1)),
        conv_geometry(Shape::image(70, 5, 7), 6, (3, 3), (1, 1), (1, 1), (1, 1)),
        conv_geometry(Shape::image(8, 12, 12), 96, (3, 3), (1, 1), (1, 1), (1, 1)),
    ];
    let mut cases: Vec<(conv::Geometry, usize)> = cases().into_iter().filter(|(g, _)| input_grad_geometry(g).is_some()).collect();
    cases.extend(more.into_iter().flat_map(|g| [1, 3].map(|batch| (g, batch))));
    cases
}

fn spec_wgrad(g: &conv::Geometry, batch: usize, x: &[f32], dz: &[f32]) -> Vec<f32> {
    let (mut dw, mut db) = (vec![0.0; g.out_channels * g.ckk()], vec![0.0; g.out_channels]);
    conv::backward_spec(g, batch, &vec![0.0; dw.len()], x, dz, &mut dw, &mut db, None);
    dw
}

/// The twins equal the spec exactly on small integers at every case the kernels fit (all do but
/// the 64-channel layer's weight gradient, whose 2 × 144 register tiles are more than a block's
/// threads), and at weight-gradient shares made to be awkward (every chunk from 1 to the batch).
/// The forward takes chunks of input channels where they do not all fit (64 and 16 channels).
#[test]
fn the_direct_convolutions_twins_match_the_spec() {
    let mut rng = Rng::new(91);
    let (lenet, vgg16) = (conv_geometries()[4], more_geometries()[4]);
    assert_eq!(DirectForward::of(&lenet), Some(DirectForward { groups: 1, oc_tiles: 1, tile: 1024, pixel_tiles: 1, chunk: 1 }));
    assert!(DirectForward::of(&vgg16).is_some_and(|d| d.chunk < 16) && DirectForward::of(&more_geometries()[3]).unwrap().chunk < 64);
    // two buffers of a tile: LeNet's first layer in two tiles (784 pixels), VGG's 16 → 16 in eight
    assert_eq!(DirectWgrad::of(&lenet, 301), Some(DirectWgrad { tile: 512, chunk: 3, shares: 101 }));
    assert_eq!(DirectWgrad::of(&vgg16, 1024).map(|d| d.tile), Some(128));
    assert_eq!(DirectWgrad::of(&more_geometries()[3], 3), None);
    for (g, batch) in cases() {
        let d = DirectForward::of(&g).unwrap_or_else(|| panic!("{g:?}"));
        assert!(d.shared_bytes(&g) <= crate::cuda::conv_direct::DIRECT_SHARED, "{d:?}");
        let (x, w, dz) = (rng.ints(batch * g.in_len()), rng.ints(g.out_channels * g.ckk()), rng.ints(batch * g.out_len()));
        check(
            &format!("forward twin {g:?} batch {batch} {d:?}"),
            &forward_twin(&g, batch, d, &x, &w, false),
            &spec_forward(&g, batch, &x, &w),
            0.0,
            0.0,
        );
        let Some(d) = DirectWgrad::of(&g, batch) else {
            assert_eq!(g.in_channels, 64, "only the 64-channel layer's weight gradient does not fit, not {g:?}");
            continue;
        };
        assert!(d.shared_bytes(&g) <= crate::cuda::conv_direct::DIRECT_SHARED && d.shares <= batch, "{d:?}");
        assert!(d.chunk * (d.shares - 1) < batch && d.chunk * d.shares >= batch, "{d:?}");
        let want = spec_wgrad(&g, batch, &x, &dz);
        check(&format!("wgrad twin {g:?} batch {batch} {d:?}"), &wgrad_twin(&g, batch, d, &x, &dz), &want, 0.0, 0.0);
        if batch == 3 {
            for chunk in 1..=batch {
                let d = DirectWgrad { chunk, shares: batch.div_ceil(chunk), ..d };
                check(&format!("wgrad twin {g:?} batch {batch} {d:?}"), &wgrad_twin(&g, batch, d, &x, &dz), &want, 0.0, 0.0);
            }
        }
    }
    // the kernels' sizes are the launcher's and the twins'
    let source = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/conv_direct.cu")).unwrap();
    for (name, value) in [("CDF_PX", FORWARD_PIXELS), ("CDF_OC", FORWARD_CHANNELS), ("CDW_OC", WGRAD_CHANNELS), ("CDW_R", WGRAD_TAPS)] {
        assert!(source.contains(&format!("#define {name} {value}\n")), "{name} is not {value}");
    }
    assert_eq!(WGRAD_PITCH, THREADS + 1);
    assert!(source.contains("#define CDW_PITCH (REDUCE_THREADS + 1)\n"));
}

/// The forward twin reading W flipped and transposed, on the input gradient's geometry (dZ its
/// input, dX its output), equals the spec's dX exactly on small integers at every input-gradient
/// case: paddings 0 to 6, kernels 1, 3, 5 and 7, OC ≠ C both ways, the dilated 1-D layers, odd
/// sizes, the transposed forward in chunks and in two channel tiles.
#[test]
fn the_direct_input_gradient_twin_matches_the_spec() {
    let mut rng = Rng::new(93);
    let cases = input_grad_cases();
    // the nine unstrided geometries of `cases` at 1 and 3 samples, its two larger batches, the six
    assert_eq!(cases.len(), 2 * 9 + 2 + 2 * 6, "{cases:?}");
    let (mut chunked, mut tiled) = (false, false);
    for (g, batch) in cases {
        let t = input_grad_geometry(&g).unwrap();
        let d = DirectForward::input_grad(&g).unwrap_or_else(|| panic!("{g:?}"));
        assert_eq!(DirectForward::of(&t), Some(d));
        assert!(d.shared_bytes(&t) <= crate::cuda::conv_direct::DIRECT_SHARED, "{d:?}");
        (chunked, tiled) = (chunked || d.chunk < t.in_channels, tiled || d.oc_tiles > 1);
        let (w, dz) = (rng.ints(g.out_channels * g.ckk()), rng.ints(batch * g.out_len()));
        let what = format!("input grad twin {g:?} batch {batch} {d:?}");
        check(&what, &forward_twin(&t, batch, d, &dz, &w, true), &spec_input_grad(&g, batch, &w, &dz), 0.0, 0.0);
    }
    assert!(chunked && tiled);
}

/// The input gradient is a forward convolution, and the direct route a candidate for it, only at
/// stride 1 with padding at most (k − 1)·d in both dimensions: refused at stride 2 (either
/// dimension, 2-D and 1-D) and where p' = (k − 1)·d − p would be negative (2-D, a 1×1 kernel
/// padded, 1-D dilated); p' = 0 is taken, and its geometry is dZ → dX.
#[test]
fn the_direct_input_gradient_is_refused_at_stride_2_and_negative_padding() {
    let (lowering, more) = (conv_geometries(), more_geometries());
    let refused = [
        lowering[1],
        lowering[2],
        lowering[5],
        more[2],
        conv_geometry(Shape::image(1, 5, 5), 2, (3, 3), (1, 1), (2, 3), (1, 1)),
        conv_geometry(Shape::image(2, 4, 4), 3, (1, 1), (1, 1), (1, 0), (1, 1)),
        conv_geometry(Shape::image(2, 1, 19), 3, (1, 3), (1, 1), (0, 5), (1, 2)),
    ];
    for g in refused {
        assert!(input_grad_geometry(&g).is_none() && DirectForward::input_grad(&g).is_none(), "{g:?}");
        // the forward still fits them
        assert!(DirectForward::of(&g).is_some(), "{g:?}");
    }
    let shape = |t: conv::Geometry| {
        ((t.in_channels, t.height, t.width), (t.out_channels, t.out_height, t.out_width), t.kernel, t.stride, t.padding, t.dilation)
    };
    let g = conv_geometry(Shape::image(1, 5, 5), 2, (3, 3), (1, 1), (2, 2), (1, 1));
    assert_eq!(input_grad_geometry(&g).map(shape), Some(((2, 7, 7), (1, 5, 5), (3, 3), (1, 1), (0, 0), (1, 1))));
    assert!(DirectForward::input_grad(&g).is_some());
    let g = lowering[6];
    assert_eq!(input_grad_geometry(&g).map(shape), Some(((4, 1, 40), (3, 1, 40), (1, 5), (1, 1), (0, 4), (1, 2))));
}

/// The kernels equal the spec exactly on small integers at every case (the input gradient at
/// every input-gradient case); on uniform values they give their twins' bits (the same products,
/// fused, in the same order), and the same bits on a second run; nothing outside z, dW or dX is
/// written (each sits inside a poisoned buffer, the partials poisoned too).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_direct_convolutions_match_the_spec_and_their_twins() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(92);
    // `len` values written at 3.. of a poisoned buffer by `launch`, then the whole buffer
    let inside = |len: usize, launch: &dyn Fn(ViewMut<f32>)| {
        let mut buf = upload(&stream, &poisoned(len + 5));
        let m = ViewMut::of(&mut buf);
        // SAFETY: values 3..3 + len of `buf`, used by this launch alone.
        launch(unsafe { ViewMut::from_raw(m.ptr() + 12, len) });
        download(&stream, &buf)
    };
    let around = |v: &[f32]| [poisoned(3), v.to_vec(), poisoned(2)].concat();
    for (g, batch) in cases() {
        let w_len = g.out_channels * g.ckk();
        let forward = |x: &[f32], w: &[f32]| {
            let (xd, wd) = (upload(&stream, x), upload(&stream, w));
            inside(batch * g.out_len(), &|z| gpu.conv_direct_forward(&stream, &g, batch, View::of(&xd), View::of(&wd), z).unwrap())
        };
        let wgrad = |x: &[f32], dz: &[f32]| {
            let (xd, dzd) = (upload(&stream, x), upload(&stream, dz));
            let mut partials = upload(&stream, &poisoned(batch * w_len));
            let (at, len) = (ViewMut::of(&mut partials).ptr(), batch * w_len);
            inside(w_len, &|dw| {
                // SAFETY: all of `partials`, alive and used by this launch alone.
                let partials = unsafe { ViewMut::from_raw(at, len) };
                gpu.conv_direct_wgrad(&stream, &g, batch, View::of(&xd), View::of(&dzd), partials, dw).unwrap()
            })
        };
        let d = DirectForward::of(&g).unwrap();
        let what = format!("direct forward {g:?} batch {batch} {d:?}");
        let (x, w) = (rng.ints(batch * g.in_len()), rng.ints(w_len));
        check(&format!("{what}, integers"), &forward(&x, &w), &around(&spec_forward(&g, batch, &x, &w)), 0.0, 0.0);
        let (x, w) = (rng.uniform(batch * g.in_len()), rng.uniform(w_len));
        let got = forward(&x, &w);
        same_bits(&format!("{what}, the twin's bits"), &got, &around(&forward_twin(&g, batch, d, &x, &w, false)));
        same_bits(&format!("{what}, a second run"), &got, &forward(&x, &w));
        let Some(d) = DirectWgrad::of(&g, batch) else { continue };
        let what = format!("direct dW {g:?} batch {batch} {d:?}");
        let (x, dz) = (rng.ints(batch * g.in_len()), rng.ints(batch * g.out_len()));
        check(&format!("{what}, integers"), &wgrad(&x, &dz), &around(&spec_wgrad(&g, batch, &x, &dz)), 0.0, 0.0);
        let (x, dz) = (rng.uniform(batch * g.in_len()), rng.uniform(batch * g.out_len()));
        let got = wgrad(&x, &dz);
        same_bits(&format!("{what}, the twin's bits"), &got, &around(&wgrad_twin(&g, batch, d, &x, &dz)));
        same_bits(&format!("{what}, a second run"), &got, &wgrad(&x, &dz));
    }
    for (g, batch) in input_grad_cases() {
        let (t, d) = (input_grad_geometry(&g).unwrap(), DirectForward::input_grad(&g).unwrap());
        let input_grad = |w: &[f32], dz: &[f32]| {
            let (wd, dzd) = (upload(&stream, w), upload(&stream, dz));
            inside(batch * g.in_len(), &|dx| gpu.conv_direct_input_grad(&stream, &g, batch, View::of(&dzd), View::of(&wd), dx).unwrap())
        };
        let what = format!("direct dX {g:?} batch {batch} {d:?}");
        let (w, dz) = (rng.ints(g.out_channels * g.ckk()), rng.ints(batch * g.out_len()));
        check(&format!("{what}, integers"), &input_grad(&w, &dz), &around(&spec_input_grad(&g, batch, &w, &dz)), 0.0, 0.0);
        let (w, dz) = (rng.uniform(g.out_channels * g.ckk()), rng.uniform(batch * g.out_len()));
        let got = input_grad(&w, &dz);
        same_bits(&format!("{what}, the twin's bits"), &got, &around(&forward_twin(&t, batch, d, &dz, &w, true)));
        same_bits(&format!("{what}, a second run"), &got, &input_grad(&w, &dz));
    }
}

/// With the direct route forced (measuring still runs), LeNet, a strided 3-channel model and a
/// dilated 1-D one train 12 Adam steps at batches of 32 and 17 (graphs on) as the CPU does, and
/// the report says every layer's forward and weight gradient ran on it where it fits (all of
/// these layers), and the input gradient of every layer after the first of stride 1 (the others'
/// is not a forward convolution: not a candidate).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn training_forced_onto_the_direct_convolutions_matches_the_cpu() {
    use crate::prelude::*;
    use crate::testutil::{cuda_device, rel_err};
    let device = cuda_device();
    forced::set(Some(Route::Direct));
    for (name, chain) in [vec![("lenet", crate::models::lenet5())], forced_route_models()].concat() {
        let cpu = chain.build().unwrap().init(Init::HeNormal, 5).with_threads(1).unwrap();
        let (cpu_losses, cpu_params, _) = train_twelve_steps(&cpu);
        let (losses, params, report) = train_twelve_steps(&cpu.to(&device).unwrap());
        println!("{name}, direct forced:\n{report}");
        assert_forced_report(&report, "own-direct");
        let (loss_err, params_err) = (rel_err(&losses, &cpu_losses), rel_err(&params, &cpu_params));
        println!("{name}: 12 steps on the direct kernels: losses rel err {loss_err:.2e}, parameters {params_err:.2e}");
        assert!(loss_err <= 1e-4 && params_err <= 1e-4, "{name}");
    }
    forced::set(None);
}

/// The models a forced-route training test trains besides its own: a strided 2-D one and a
/// dilated 1-D one (its last layer of stride 2).
pub(super) fn forced_route_models() -> Vec<(&'static str, crate::prelude::Chain)> {
    use crate::prelude::*;
    let strided = Chain::new(Input::image(3, 16, 15))
        .conv_with(8, (3, 3), Relu, ConvOptions { stride: (2, 2), padding: (1, 1) })
        .conv_with(6, (3, 3), Tanh, ConvOptions { stride: (1, 1), padding: (1, 1) })
        .flatten()
        .dense(10, Identity);
    let dilated = Chain::new(Input::signal(2, 61))
        .conv1d_with(5, 7, Relu, Conv1dOptions { stride: 1, padding: 6, dilation: 2 })
        .conv1d_with(4, 3, Tanh, Conv1dOptions { stride: 1, padding: 2, dilation: 2 })
        .conv1d_with(3, 3, Relu, Conv1dOptions { stride: 2, padding: 1, dilation: 1 })
        .flatten()
        .dense(10, Identity);
    vec![("strided", strided), ("dilated", dilated)]
}

/// A copy of `model` trained 12 Adam steps (1e-3) at batches of 32 and 17 from one generator:
/// its losses, its parameters after, and its convolutions' route report.
pub(super) fn train_twelve_steps(model: &crate::prelude::Model) -> (Vec<f32>, Vec<f32>, String) {
    use crate::prelude::*;
    use crate::testutil::batch;
    let mut model = model.to(&model.device()).unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let (mut rng, mut losses) = (Rng::new(6), Vec::new());
    for step in 0..12 {
        let (x, labels) = batch(&mut rng, &model, [32, 17][step % 2]);
        fwd.set_inputs(&x).unwrap();
        fwd.set_labels(&labels).unwrap();
        model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        losses.push(bwd.last_loss().unwrap());
        opt.update(&mut model, &bwd).unwrap();
    }
    (losses, model.parameters().unwrap().into_owned(), fwd.conv_backends())
}

/// Every layer of a forced-route report ran its forward and weight gradient on `route`, and its
/// input gradient too where it has one of stride 1 (none for the first layer; another route for
/// the others).
pub(super) fn assert_forced_report(report: &str, route: &str) {
    let lines: Vec<&str> = report.lines().filter(|l| l.starts_with("batch ")).collect();
    assert!(!lines.is_empty(), "{report}");
    for line in lines {
        assert!(line.contains(&format!("forward {route}")) && line.contains(&format!("weight grad {route}")), "{line}");
        let input = line.split(';').find(|part| part.trim_start().starts_with("input grad")).unwrap_or_else(|| panic!("{line}"));
        let want = match (line.contains(", step 0 conv"), line.contains(" stride 1×1 ")) {
            (true, _) => "input grad not needed".to_string(),
            (false, true) => format!("input grad {route} "),
            (false, false) => "input grad ".to_string(),
        };
        assert!(input.trim_start().starts_with(&want), "{line}");
        assert!(line.contains(" stride 1×1 ") || !input.contains(route), "{line}");
    }
}
