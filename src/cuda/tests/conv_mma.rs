//! The tensor-core convolutions (kernels/conv_mma.cu): how they cover layers, checked without a
//! GPU; then the kernels against the spec on a GPU, in both arithmetics, and a whole training
//! step forced onto them against the CPU.

use super::conv_lowering::{conv_geometries, conv_geometry};
use super::{check, download, same_bits, upload};
use crate::chain::Shape;
use crate::cuda::conv_direct::{band_bound, input_grad_geometry, DIRECT_SHARED};
use crate::cuda::conv_mma::{MmaForward, MMA_TILE};
use crate::cuda::dnn::{forced, Route};
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::test_gpu;
use crate::layers::conv;
use crate::testutil::{poisoned, Rng};

/// The geometries: VGG's four 3×3 layers (3→16, 16→16 at 32×32; 16→32, 32→32 at 16×16),
/// LeNet's two (1→6 5×5 pad 2 at 28×28, 6→16 5×5 at 14×14), stride 2 on an odd image, output
/// channels past one block's 32 and not a multiple of 8 (70, 20), 64 and 70 input channels
/// (several chunks, the last short), then the seven the convolution tests share (among them
/// a 1×1 input and two dilated 1-D layers).
pub(super) fn geometries() -> Vec<conv::Geometry> {
    let same = (1, 1);
    let mut all = vec![
        conv_geometry(Shape::image(3, 32, 32), 16, (3, 3), (1, 1), same, (1, 1)),
        conv_geometry(Shape::image(16, 32, 32), 16, (3, 3), (1, 1), same, (1, 1)),
        conv_geometry(Shape::image(16, 16, 16), 32, (3, 3), (1, 1), same, (1, 1)),
        conv_geometry(Shape::image(32, 16, 16), 32, (3, 3), (1, 1), same, (1, 1)),
        conv_geometry(Shape::image(1, 28, 28), 6, (5, 5), (1, 1), (2, 2), (1, 1)),
        conv_geometry(Shape::image(6, 14, 14), 16, (5, 5), (1, 1), (0, 0), (1, 1)),
        conv_geometry(Shape::image(3, 17, 15), 70, (3, 3), (2, 2), same, (1, 1)),
        conv_geometry(Shape::image(5, 11, 13), 20, (3, 3), (1, 1), same, (1, 1)),
        conv_geometry(Shape::image(64, 12, 12), 16, (3, 3), (1, 1), same, (1, 1)),
        conv_geometry(Shape::image(70, 5, 7), 6, (3, 3), (1, 1), same, (1, 1)),
    ];
    all.extend(conv_geometries());
    all
}

/// Every geometry fits, within the shared memory it may have; VGG's layers as the kernel's
/// comment says (16 and 32 channels a block, input channels by eights where they do not all
/// fit); chunks of 8 or more are multiples of 8 unless they hold every input channel; several
/// chunks where the input channels are many; the input gradient fits its stride-1 layers.
#[test]
fn the_tensor_core_forward_covers_every_geometry() {
    let all = geometries();
    let want = [(16, 1, 4, 3), (16, 1, 4, 8), (32, 1, 1, 8), (32, 1, 1, 8)];
    for (g, (channels, oc_tiles, pixel_tiles, chunk)) in all.iter().zip(want) {
        assert_eq!(MmaForward::of(g), Some(MmaForward { channels, oc_tiles, pixel_tiles, chunk }), "{g:?}");
    }
    let mut chunked = 0;
    for g in &all {
        let d = MmaForward::of(g).unwrap_or_else(|| panic!("{g:?}"));
        assert!(d.shared_bytes(g) <= DIRECT_SHARED, "{g:?} {d:?}");
        assert!(d.channels >= g.out_channels.min(32) && d.oc_tiles * d.channels >= g.out_channels, "{g:?} {d:?}");
        assert_eq!(d.pixel_tiles, g.ohw().div_ceil(MMA_TILE));
        assert!(d.chunk == g.in_channels || d.chunk.is_multiple_of(8), "{g:?} {d:?}");
        chunked += usize::from(d.chunk < g.in_channels);
        if input_grad_geometry(g).is_some() {
            assert!(MmaForward::input_grad(g).is_some(), "{g:?}");
        }
    }
    assert!(chunked >= 4, "{chunked}");
    assert_eq!(MmaForward::of(&all[6]).map(|d| (d.channels, d.oc_tiles)), Some((32, 3)));
    // the kernel's tile is the launcher's: 8 warps of 2 strips of 16 pixels
    let source = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/conv_mma.cu")).unwrap();
    assert!(source.contains("#define CMM_WM 2\n") && source.contains("#define CMM_TILE (CMM_WARPS * CMM_WM * 16)\n"));
    assert_eq!(MMA_TILE, 256 / 32 * 2 * 16);
}

/// Z as conv_mma_* computes it, lane by lane, on values whose products and sums are exact (small
/// integers): per block the taps' offsets (a lane's two of a k-step side by side), each chunk's
/// staged weights ([channels][kc8 + 4], zero past OC and the chunk's taps) and band (zero past
/// the chunk's channels and the image), each warp's m16n8k8 fragments gathered as the lanes
/// gather them (A: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4), lane (g, t)'s taps
/// read at k0 + 2t; B by ldmatrix: matrix q's row i from the address lane 8q + i gives, its
/// element (g, t) to lane 4g + t's register q, registers 2h, 2h + 1 the b0 (t, g), b1 (t + 4, g)
/// of fragment f0 + h), their product, and the sums stored where the lanes store d0..d3 ((g, 2t),
/// (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)); with `transposed`, W' read from the layer's w
/// flipped and transposed.
fn forward_twin(g: &conv::Geometry, batch: usize, d: MmaForward, x: &[f32], w: &[f32], transposed: bool) -> Vec<f32> {
    let (oc_n, ohw, taps, ckk, bn) = (g.out_channels, g.ohw(), g.kernel.0 * g.kernel.1, g.ckk(), d.channels);
    let (kc, ow) = (d.chunk * taps, g.out_width);
    let (kc8, pitch) = (kc.next_multiple_of(8), kc.next_multiple_of(8) + 4);
    let mut z = vec![f32::NAN; batch * g.out_len()];
    for (s, pt, ot) in (0..batch).flat_map(|s| (0..d.pixel_tiles).flat_map(move |pt| (0..d.oc_tiles).map(move |ot| (s, pt, ot)))) {
        let (p0, p_end, oc_base) = (pt * MMA_TILE, ((pt + 1) * MMA_TILE).min(ohw), ot * bn);
        // conv_direct_band
        let (oy_first, oy_last) = (p0 / ow, (p_end - 1) / ow);
        let ox_lo = if oy_first == oy_last { p0 - oy_first * ow } else { 0 };
        let ox_hi = if oy_first == oy_last { p_end - 1 - oy_first * ow } else { ow - 1 };
        let rows = (oy_last - oy_first) * g.stride.0 + (g.kernel.0 - 1) * g.dilation.0 + 1;
        let cols = (ox_hi - ox_lo) * g.stride.1 + (g.kernel.1 - 1) * g.dilation.1 + 1;
        let (row0, col0) = ((oy_first * g.stride.0) as i64 - g.padding.0 as i64, (ox_lo * g.stride.1) as i64 - g.padding.1 as i64);
        let plane = rows * cols;
        let bound = band_bound(g, MMA_TILE);
        assert!(rows <= bound.0 && cols <= bound.1, "band {rows}×{cols} past its bound {bound:?}");
        // tap[k0 + 2t + h] = tap(k0 + t + 4h)
        let tap: Vec<usize> = (0..kc8)
            .map(|e| {
                let r = e / 8 * 8 + e % 8 / 2 + e % 2 * 4;
                let (c, t) = (r / taps, r % taps);
                if r < kc {
                    c * plane + t / g.kernel.1 * g.dilation.0 * cols + t % g.kernel.1 * g.dilation.1
                } else {
                    0
                }
            })
            .collect();
        let off = |p: usize| if p < p_end { (p / ow - oy_first) * g.stride.0 * cols + (p % ow - ox_lo) * g.stride.1 } else { 0 };
        let mut total = vec![0.0f32; MMA_TILE * bn];
        for c0 in (0..g.in_channels).step_by(d.chunk) {
            let (n, mut w_s, mut x_s) = (d.chunk.min(g.in_channels - c0), vec![f32::NAN; bn * pitch], vec![0.0f32; d.chunk * plane]);
            for (o, r) in (0..bn).flat_map(|o| (0..kc8).map(move |r| (o, r))) {
                let oc = oc_base + o;
                let at = if transposed { ((c0 + r / taps) * oc_n + oc) * taps + taps - 1 - r % taps } else { oc * ckk + c0 * taps + r };
                w_s[o * pitch + r] = if oc < oc_n && r < n * taps { w[at] } else { 0.0 };
            }
            for (e, v) in x_s.iter_mut().enumerate().take(n * plane) {
                let (c, row, col) = (e / plane, e % plane / cols, e % cols);
                let (iy, ix) = (row0 + row as i64, col0 + col as i64);
                if iy >= 0 && ix >= 0 && (iy as usize) < g.height && (ix as usize) < g.width {
                    *v = x[((s * g.in_channels + c0 + c) * g.height + iy as usize) * g.width + ix as usize];
                }
            }
            for (warp, m, f) in (0..8).flat_map(|warp| (0..2).flat_map(move |m| (0..bn / 8).map(move |f| (warp, m, f)))) {
                let strip = p0 + warp * 32 + m * 16;
                let mut acc = [[0.0f32; 8]; 16];
                for k0 in (0..kc8).step_by(8) {
                    let (mut a, mut b) = ([[0.0f32; 8]; 16], [[0.0f32; 8]; 8]);
                    for (lg, lt) in (0..8).flat_map(|lg| (0..4).map(move |lt| (lg, lt))) {
                        let (t0, t1) = (tap[k0 + 2 * lt], tap[k0 + 2 * lt + 1]);
                        let (o0, o1) = (off(strip + lg), off(strip + lg + 8));
                        (a[lg][lt], a[lg + 8][lt], a[lg][lt + 4], a[lg + 8][lt + 4]) =
                            (x_s[o0 + t0], x_s[o1 + t0], x_s[o0 + t1], x_s[o1 + t1]);
                    }
                    // ldmatrix (x4 for fragments f0, f0 + 1; x2 at one fragment a block): the
                    // row of w_s whose address lane l gives, and lane (lg, lt)'s register q
                    let f0 = if bn == 8 { 0 } else { f / 2 * 2 };
                    let row_at = |l: usize| ((if bn > 8 { l / 16 * 8 } else { 0 }) + l % 8) * pitch + l / 8 % 2 * 4 + f0 * 8 * pitch + k0;
                    // a row of 16 bytes, 16-byte aligned as ldmatrix needs (w_s's start is)
                    let reg = |q: usize, lg: usize, lt: usize| {
                        assert_eq!(row_at(8 * q + lg) % 4, 0);
                        w_s[row_at(8 * q + lg) + lt]
                    };
                    for (lg, lt) in (0..8).flat_map(|lg| (0..4).map(move |lt| (lg, lt))) {
                        let h = f - f0;
                        (b[lt][lg], b[lt + 4][lg]) = (reg(2 * h, lg, lt), reg(2 * h + 1, lg, lt));
                    }
                    for (row, col) in (0..16).flat_map(|row| (0..8).map(move |col| (row, col))) {
                        acc[row][col] += (0..8).map(|k| a[row][k] * b[k][col]).sum::<f32>();
                    }
                }
                for (lg, lt, q) in (0..8).flat_map(|lg| (0..4).flat_map(move |lt| (0..4).map(move |q| (lg, lt, q)))) {
                    let (row, col) = (lg + q / 2 * 8, 2 * lt + q % 2);
                    total[(strip - p0 + row) * bn + f * 8 + col] += acc[row][col];
                }
            }
        }
        for (p, o) in (p0..p_end).flat_map(|p| (0..bn).map(move |o| (p, o))).filter(|&(_, o)| oc_base + o < oc_n) {
            z[(s * oc_n + oc_base + o) * ohw + p] = total[(p - p0) * bn + o];
        }
    }
    z
}

/// The twin (the kernel's staging, offsets, fragments and stores, lane by lane) equals the spec
/// exactly on small integers at every geometry, forward and (stride 1) input gradient, at one
/// and three samples: the tiling and the fragments' layout checked without a GPU.
#[test]
fn the_tensor_core_twin_matches_the_spec() {
    let mut rng = Rng::new(94);
    for g in geometries() {
        for batch in [1, 3] {
            let d = MmaForward::of(&g).unwrap();
            let (x, w) = (rng.ints(batch * g.in_len()), rng.ints(g.out_channels * g.ckk()));
            check(
                &format!("mma twin {g:?} batch {batch} {d:?}"),
                &forward_twin(&g, batch, d, &x, &w, false),
                &spec_forward(&g, batch, &x, &w),
                0.0,
                0.0,
            );
            let Some(t) = input_grad_geometry(&g) else { continue };
            let d = MmaForward::input_grad(&g).unwrap();
            let dz = rng.ints(batch * g.out_len());
            let what = format!("mma dX twin {g:?} batch {batch} {d:?}");
            check(&what, &forward_twin(&t, batch, d, &dz, &w, true), &spec_input_grad(&g, batch, &w, &dz), 0.0, 0.0);
        }
    }
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

/// Asserts |got − want| ≤ rel·scale everywhere (NaN fails), scale = Σ|x·w| of each output.
pub(super) fn check_scaled(what: &str, got: &[f32], want: &[f32], scale: &[f32], rel: f32) {
    assert_eq!((got.len(), want.len()), (scale.len(), scale.len()), "{what}: lengths");
    let mut worst = 0.0f32;
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let err = (g - w).abs();
        assert!(err <= rel * s, "{what}: [{i}] {g} vs {w} (Σ|x·w| {s})");
        if s > 0.0 {
            worst = worst.max(err / s);
        }
    }
    println!("{what}: {} values, max |err| / Σ|x·w| {worst:e}", got.len());
}

/// Tolerances, per output, as a share of Σ|x·w|. 3xTF32: each product's dropped small·small
/// term and its small parts read as TF32 are within 2^-21 of |x·w|; the tensor cores' sums,
/// rounded toward zero, lose less than 2^-23 of the running sum an mma (three a k-step: at most
/// 3·45 = 135 in a chunk here, 70 input channels' chunk of 40 × 9 taps; 1.6e-5 of Σ|x·w| only if
/// every running sum were as large as Σ|x·w|, far less with sums of mixed signs); the spec's own
/// fma chain rounds too. 1e-5 is two hundred times below TF32's bound. TF32: x and w each rounded to nearest TF32 (10 bits
/// kept: within 2^-11 each), so each product within 2^-10 ≈ 1e-3 of |x·w|, the sums as above:
/// 2e-3.
pub(super) const FP32_TOL: f32 = 1e-5;
pub(super) const TF32_TOL: f32 = 2e-3;

/// The kernel against the spec at every geometry and batches 1, 3 and 17, in both arithmetics,
/// and the input gradient at every stride-1 geometry: exactly on small integers (TF32 holds
/// them, their products and sums exactly), within the tolerances on uniform values, the same
/// bits on a second run; nothing outside z or dX written (each inside a poisoned buffer).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_tensor_core_convolutions_match_the_spec() {
    let gpu = test_gpu();
    if gpu.compute_capability().0 < 8 {
        println!("skipped: the tensor-core kernels need sm_80 or later");
        return;
    }
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(95);
    // `len` values written at 3.. of a poisoned buffer by `launch`, then the whole buffer
    let inside = |len: usize, launch: &dyn Fn(ViewMut<f32>)| {
        let mut buf = upload(&stream, &poisoned(len + 5));
        let m = ViewMut::of(&mut buf);
        // SAFETY: values 3..3 + len of `buf`, used by this launch alone.
        launch(unsafe { ViewMut::from_raw(m.ptr() + 12, len) });
        download(&stream, &buf)
    };
    let around = |v: &[f32]| [poisoned(3), v.to_vec(), poisoned(2)].concat();
    let inner = |v: &[f32]| v[3..v.len() - 2].to_vec();
    let abs = |v: &[f32]| v.iter().map(|v| v.abs()).collect::<Vec<f32>>();
    for g in geometries() {
        for batch in [1, 3, 17] {
            let w_len = g.out_channels * g.ckk();
            for tf32 in [false, true] {
                let tol = if tf32 { TF32_TOL } else { FP32_TOL };
                let forward = |x: &[f32], w: &[f32]| {
                    let (xd, wd) = (upload(&stream, x), upload(&stream, w));
                    inside(batch * g.out_len(), &|z| {
                        gpu.conv_mma_forward(&stream, &g, batch, View::of(&xd), View::of(&wd), z, tf32).unwrap()
                    })
                };
                let what = format!("mma forward tf32={tf32} {g:?} batch {batch} {:?}", MmaForward::of(&g));
                let (x, w) = (rng.ints(batch * g.in_len()), rng.ints(w_len));
                check(&format!("{what}, integers"), &forward(&x, &w), &around(&spec_forward(&g, batch, &x, &w)), 0.0, 0.0);
                let (x, w) = (rng.uniform(batch * g.in_len()), rng.uniform(w_len));
                let got = forward(&x, &w);
                let (want, scale) = (spec_forward(&g, batch, &x, &w), spec_forward(&g, batch, &abs(&x), &abs(&w)));
                assert!(got[..3].iter().chain(&got[got.len() - 2..]).all(|v| v.is_nan()), "{what}: written outside z");
                check_scaled(&what, &inner(&got), &want, &scale, tol);
                same_bits(&format!("{what}, a second run"), &got, &forward(&x, &w));
                if input_grad_geometry(&g).is_none() {
                    continue;
                }
                let input_grad = |w: &[f32], dz: &[f32]| {
                    let (wd, dzd) = (upload(&stream, w), upload(&stream, dz));
                    inside(batch * g.in_len(), &|dx| {
                        gpu.conv_mma_input_grad(&stream, &g, batch, View::of(&dzd), View::of(&wd), dx, tf32).unwrap()
                    })
                };
                let what = format!("mma dX tf32={tf32} {g:?} batch {batch} {:?}", MmaForward::input_grad(&g));
                let (w, dz) = (rng.ints(w_len), rng.ints(batch * g.out_len()));
                check(&format!("{what}, integers"), &input_grad(&w, &dz), &around(&spec_input_grad(&g, batch, &w, &dz)), 0.0, 0.0);
                let (w, dz) = (rng.uniform(w_len), rng.uniform(batch * g.out_len()));
                let got = input_grad(&w, &dz);
                let (want, scale) = (spec_input_grad(&g, batch, &w, &dz), spec_input_grad(&g, batch, &abs(&w), &abs(&dz)));
                assert!(got[..3].iter().chain(&got[got.len() - 2..]).all(|v| v.is_nan()), "{what}: written outside dX");
                check_scaled(&what, &inner(&got), &want, &scale, tol);
                same_bits(&format!("{what}, a second run"), &got, &input_grad(&w, &dz));
            }
        }
    }
}

/// With the tensor-core route forced (measuring still runs), a small VGG, LeNet, a strided
/// model and a dilated 1-D one train 12 Adam steps at batches of 32 and 17 (graphs on) as the
/// CPU does, in FP32 (within 1e-4) and with TF32 on (within 5e-3, as cuDNN's TF32 is held to),
/// and the report says every layer's forward and weight gradient ran on it, and the input
/// gradient of every layer after the first of stride 1.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn training_forced_onto_the_tensor_core_convolutions_matches_the_cpu() {
    use super::conv_direct::{assert_forced_report, forced_route_models, train_twelve_steps};
    use crate::prelude::*;
    use crate::testutil::{cuda_device, rel_err};
    let device = cuda_device();
    let same = ConvOptions { stride: (1, 1), padding: (1, 1) };
    let vgg = Chain::new(Input::image(3, 16, 16))
        .conv_with(16, (3, 3), Relu, same)
        .conv_with(16, (3, 3), Relu, same)
        .max_pool((2, 2))
        .conv_with(32, (3, 3), Relu, same)
        .conv_with(32, (3, 3), Relu, same)
        .flatten()
        .dense(10, Identity);
    forced::set(Some(Route::Mma));
    for (name, chain) in [vec![("vgg", vgg), ("lenet", crate::models::lenet5())], forced_route_models()].concat() {
        let cpu = chain.build().unwrap().init(Init::HeNormal, 5).with_threads(1).unwrap();
        let (cpu_losses, cpu_params, _) = train_twelve_steps(&cpu);
        for (tf32, tol) in [(false, 1e-4), (true, 5e-3)] {
            let options = GpuOptions { tf32, ..GpuOptions::default() };
            let gpu = cpu.to(&Device::Cpu).unwrap().with_gpu_options(options).unwrap().to(&device).unwrap();
            let (losses, params, report) = train_twelve_steps(&gpu);
            println!("{name}, tensor-core route forced, tf32={tf32}:\n{report}");
            assert_forced_report(&report, "own-mma");
            let arithmetic = if tf32 { " TF32, " } else { " FP32, " };
            assert!(report.lines().filter(|l| l.starts_with("batch ")).all(|l| l.contains(arithmetic)), "{report}");
            let (loss_err, params_err) = (rel_err(&losses, &cpu_losses), rel_err(&params, &cpu_params));
            println!("{name} tf32={tf32}: 12 steps on the tensor-core kernels: losses rel err {loss_err:.2e}, parameters {params_err:.2e}");
            assert!(loss_err <= tol && params_err <= tol, "{name} tf32={tf32}");
        }
    }
    forced::set(None);
}

/// A NaN as the GPU makes it (0x7fffffff, which an integer TF32 rounding would turn into −0) in
/// x reaches every output whose window holds it, in both arithmetics; an output whose window
/// does not stays finite.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_nan_input_gives_nan_outputs_on_the_tensor_cores() {
    let gpu = test_gpu();
    if gpu.compute_capability().0 < 8 {
        println!("skipped: the tensor-core kernels need sm_80 or later");
        return;
    }
    let stream = gpu.new_stream().unwrap();
    let g = conv_geometry(Shape::image(16, 8, 8), 16, (3, 3), (1, 1), (1, 1), (1, 1));
    let mut x = vec![1.0f32; g.in_len()];
    x[5 * 64 + 3 * 8 + 3] = f32::from_bits(0x7fff_ffff);
    let (xd, wd) = (upload(&stream, &x), upload(&stream, &vec![0.5f32; g.out_channels * g.ckk()]));
    for tf32 in [false, true] {
        let mut z = upload(&stream, &poisoned(g.out_len()));
        gpu.conv_mma_forward(&stream, &g, 1, View::of(&xd), View::of(&wd), ViewMut::of(&mut z), tf32).unwrap();
        let z = download(&stream, &z);
        for oc in 0..g.out_channels {
            assert!(z[oc * 64 + 3 * 8 + 3].is_nan(), "tf32={tf32}, channel {oc}: the NaN's own pixel is {}", z[oc * 64 + 27]);
            assert!(z[oc * 64 + 7 * 8 + 7].is_finite(), "tf32={tf32}, channel {oc}: a far pixel is {}", z[oc * 64 + 63]);
        }
    }
}
