//! The kernels of batch norm, layer norm, dropout and residual blocks against the CPU, where a
//! model-level comparison (tests/gpu_layers.rs) would blur what went wrong: batch norm's sums,
//! one block a channel and in parts; dropout's masks, which must be the CPU's bits, and the pass
//! counter that moves them on.

use super::{check, download, same_bits, upload};
use crate::activation::Activation;
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::layers::{batch_norm_parts, RowTiles};
use crate::cuda::test_gpu;
use crate::cuda::timing::time_calls;
use crate::layers::batch_norm::{inv_std, Geometry, EPS, MOMENTUM};
use crate::layers::dropout::Mask;
use crate::layers::Draw;
use crate::testutil::{poisoned, Rng};

/// (channels, pixels, batch) and the parts `batch_norm_parts` splits each channel's sums into:
/// 3 × 32 × 32 over 64 samples, 16 parts of 4; resnet_small's 16 × 32 × 32 at 8, 2 of 4; 10 of
/// 100 samples, the last of 91; 6 parts asked for of 2 samples each, 5 made (none empty); a
/// vector's features, 3 of 3000; 7 × 7 planes (read one value at a time), 6 parts of 84; then
/// shapes of one block a channel.
const BATCH_NORM_SHAPES: [(usize, usize, usize, usize); 9] = [
    (3, 1024, 64, 16),
    (16, 1024, 8, 2),
    (6, 41, 991, 10),
    (1, 2100, 10, 5),
    (1, 1, 9000, 3),
    (2, 49, 500, 6),
    (7, 13, 5, 1),
    (10, 1, 1000, 1),
    (4, 63, 32, 1),
];

/// Every part holds a sample or more, and the parts cover the batch: (parts − 1)·chunk < batch ≤
/// parts·chunk.
#[test]
fn batch_norm_parts_cover_the_batch_and_none_is_empty() {
    for (channels, pixels, batch, parts) in BATCH_NORM_SHAPES {
        assert_eq!(batch_norm_parts(&Geometry { channels, pixels, batch }).0, parts, "{channels}x{pixels}x{batch}");
    }
    for channels in [1, 2, 3, 5, 16, 64, 300] {
        for pixels in [1, 7, 100, 1024, 5000] {
            for batch in [1, 2, 3, 10, 37, 64, 257, 1000, 4099] {
                let (parts, chunk) = batch_norm_parts(&Geometry { channels, pixels, batch });
                assert!(
                    parts >= 1 && (parts - 1) * chunk < batch && batch <= parts * chunk,
                    "{channels}x{pixels}x{batch}: {parts} of {chunk}"
                );
            }
        }
    }
}

/// Batch norm's element-wise grid (`RowTiles`) takes every value of every row once, walked as
/// the kernels walk it (a block's threads in rows of lanes, items strided on by the grid's
/// second extent): rows of 1, of 49 and of 1023 values (one at a time), of 1024 and 4100 (in
/// fours, and one at a time where a pointer is not aligned), a row too long for one block per
/// 256 items under the grid's limit of 65,535; fours only where aligned and pixels % 4 == 0.
#[test]
fn batch_norm_row_tiles_take_every_value_once() {
    let long = 4 * 256 * 65_535 + 8;
    for (rows, pixels, aligned) in [
        (1, 1, true),
        (1000, 1, true),
        (7, 49, true),
        (5, 1023, true),
        (3, 1024, true),
        (3, 1024, false),
        (1024, 1024, true),
        (2, 4100, true),
        (1, long, true),
    ] {
        let t = RowTiles::of(rows, pixels, aligned);
        assert_eq!(t.fours, aligned && pixels % 4 == 0, "{rows}x{pixels}");
        assert!(t.grid.0 >= 1 && t.grid.1 >= 1 && t.grid.1 <= 65_535 && t.lanes_log2 <= 8, "{rows}x{pixels}: {t:?}");
        let (floats, lanes) = (if t.fours { 4 } else { 1 }, 1usize << t.lanes_log2);
        let width = pixels / floats;
        let mut taken = vec![0u8; rows * pixels];
        for bx in 0..t.grid.0 as usize {
            for by in 0..t.grid.1 as usize {
                for thread in 0..256 {
                    let row = bx * (256 >> t.lanes_log2) + (thread >> t.lanes_log2);
                    if row >= rows {
                        continue;
                    }
                    let mut item = by * lanes + (thread & (lanes - 1));
                    while item < width {
                        taken[row * pixels + item * floats..][..floats].iter_mut().for_each(|v| *v += 1);
                        item += t.grid.1 as usize * lanes;
                    }
                }
            }
        }
        assert!(taken.iter().all(|&v| v == 1), "{rows}x{pixels}: {t:?} takes a value other than once");
    }
}

/// The CPU's statistics of channel c (as `layers::batch_norm`: f64 sums in sample order, the
/// variance about the mean): μ, r, and the running mean and variance moved from `running`.
fn batch_norm_stats_cpu(g: &Geometry, x: &[f32], c: usize, running: (f32, f32)) -> [f32; 4] {
    let values = || (0..g.batch).flat_map(move |s| &x[(s * g.channels + c) * g.pixels..][..g.pixels]).map(|&v| f64::from(v));
    let n = g.n() as f64;
    let mean = values().sum::<f64>() / n;
    let squares: f64 = values().map(|v| (v - mean).powi(2)).sum();
    let m = mean as f32;
    let rm = (1.0 - MOMENTUM) * running.0 + MOMENTUM * m;
    let rv = (1.0 - MOMENTUM) * running.1 + MOMENTUM * (squares / (n - 1.0)) as f32;
    [m, inv_std((squares / n) as f32), rm, rv]
}

/// Batch norm's statistics and parameter gradients on the GPU against the CPU's f64 sums, one
/// block a channel (no scratch) and in parts (with it) where the shape splits: values about
/// 1000 with a spread of 1 (a variance taken as E[x²] − μ² in f32 would be lost); the running
/// statistics and the count moved; nothing past the channels written; the parts' scratch
/// poisoned; two runs the same bits; where the shape does not split, scratch or not the same
/// bits; x and dy aligned and not.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn batch_norm_sums_in_parts_or_not_match_the_cpu() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(8);
    for (channels, pixels, batch, parts) in BATCH_NORM_SHAPES {
        let g = Geometry { channels, pixels, batch };
        let n = batch * channels * pixels;
        let x: Vec<f32> = rng.uniform(n).iter().map(|v| 1000.0 + v).collect();
        let (dy, running) = (rng.uniform(n), (rng.uniform(channels), rng.uniform(channels).iter().map(|v| 1.5 + v).collect::<Vec<_>>()));
        let want: Vec<[f32; 4]> = (0..channels).map(|c| batch_norm_stats_cpu(&g, &x, c, (running.0[c], running.1[c]))).collect();
        let column = |i: usize| want.iter().map(|w| w[i]).chain([f32::NAN]).collect::<Vec<f32>>();
        // dγ = Σ dy·x̂ and dβ = Σ dy over each channel, x̂ = (x − μ)·r in f32, summed in f64
        let (mean, inv) = (column(0), column(1));
        let mut grads = vec![(0.0f64, 0.0f64); channels];
        for (i, (&x, &dy)) in x.iter().zip(&dy).enumerate() {
            let c = (i / pixels) % channels;
            grads[c].0 += f64::from(dy) * f64::from((x - mean[c]) * inv[c]);
            grads[c].1 += f64::from(dy);
        }
        let want_grads =
            [0, 1].map(|i| grads.iter().map(|g| (if i == 0 { g.0 } else { g.1 }) as f32).chain([f32::NAN]).collect::<Vec<_>>());
        // x and dy at `offset` floats into their buffers: 1 puts them off 16-byte alignment, so
        // that planes of a multiple of 4 values are read one value at a time, not in fours
        let padded = |v: &[f32], offset: usize| upload(&stream, &[&vec![f32::NAN; offset][..], v].concat());
        let (meand, invd) = (upload(&stream, &mean), upload(&stream, &inv));
        for offset in [0, 1] {
            let (xb, dyb) = (padded(&x, offset), padded(&dy, offset));
            // SAFETY: views of the n values past `offset` of live buffers of n + offset
            let (xd, dyd) = unsafe {
                (
                    View::<f32>::from_raw(View::of(&xb).ptr() + 4 * offset as u64, n),
                    View::<f32>::from_raw(View::of(&dyb).ptr() + 4 * offset as u64, n),
                )
            };
            let scratch = || upload(&stream, &vec![f64::NAN; 2 * parts * channels]);
            let stats = |split: bool| -> Vec<Vec<f32>> {
                let (mut mean, mut inv) = (upload(&stream, &poisoned(channels + 1)), upload(&stream, &poisoned(channels + 1)));
                let with_nan = |v: &[f32]| v.iter().copied().chain([f32::NAN]).collect::<Vec<_>>();
                let (mut rm, mut rv) = (upload(&stream, &with_nan(&running.0)), upload(&stream, &with_nan(&running.1)));
                let mut count = upload(&stream, &[5.0f32, f32::NAN]);
                let mut partials = scratch();
                let stats = (ViewMut::of(&mut mean), ViewMut::of(&mut inv));
                let running = [ViewMut::of(&mut rm), ViewMut::of(&mut rv), ViewMut::of(&mut count)];
                gpu.batch_norm_stats(&stream, &g, xd, stats, running, split.then(|| ViewMut::of(&mut partials))).unwrap();
                [mean, inv, rm, rv, count].iter().map(|buf| download(&stream, buf)).collect()
            };
            let param_grads = |split: bool| -> Vec<Vec<f32>> {
                let (mut dgamma, mut dbeta) = (upload(&stream, &poisoned(channels + 1)), upload(&stream, &poisoned(channels + 1)));
                let mut partials = scratch();
                let (inputs, saved, out) =
                    ((xd, dyd), (View::of(&meand), View::of(&invd)), (ViewMut::of(&mut dgamma), ViewMut::of(&mut dbeta)));
                gpu.batch_norm_param_grads(&stream, &g, inputs, saved, out, split.then(|| ViewMut::of(&mut partials))).unwrap();
                vec![download(&stream, &dgamma), download(&stream, &dbeta)]
            };
            let names = ["mean", "inv", "running mean", "running var", "count", "dgamma", "dbeta"];
            let mut runs = Vec::new();
            for split in [false, true] {
                let got: Vec<Vec<f32>> = stats(split).into_iter().chain(param_grads(split)).collect();
                let wanted =
                    [column(0), column(1), column(2), column(3), vec![6.0, f32::NAN], want_grads[0].clone(), want_grads[1].clone()];
                for ((name, got), want) in names.iter().zip(&got).zip(&wanted) {
                    check(
                        &format!("batch norm {channels}x{pixels}x{batch}, {parts} parts, offset {offset}, scratch {split}: {name}"),
                        got,
                        want,
                        1e-6,
                        2e-7,
                    );
                }
                let again: Vec<Vec<f32>> = stats(split).into_iter().chain(param_grads(split)).collect();
                for ((name, a), b) in names.iter().zip(&got).zip(&again) {
                    same_bits(&format!("batch norm {channels}x{pixels}x{batch}, scratch {split}: {name}"), a, b);
                }
                runs.push(got);
            }
            if parts == 1 {
                for ((name, a), b) in names.iter().zip(&runs[0]).zip(&runs[1]) {
                    same_bits(&format!("batch norm {channels}x{pixels}x{batch}, one block a channel with scratch or not: {name}"), a, b);
                }
            }
        }
    }
}

/// Batch norm's element-wise kernels (normalisation by the batch's statistics with an
/// activation, by the running ones without; the input gradient) and the residual sum and
/// gradient copies give the CPU's expressions' bits, in fours (aligned, pixels % 4 == 0) and
/// one at a time (7 × 7 pixels, 13, a vector's 1, or every pointer one float past alignment);
/// one sample, a row longer than a block; nothing before or past the outputs written.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn batch_norm_and_residual_element_wise_kernels_give_the_cpus_bits() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(12);
    let act = Activation::Relu;
    for (channels, pixels, batch) in [(3, 49, 5), (16, 1024, 2), (5, 1, 37), (2, 4100, 1), (4, 13, 3)] {
        let g = Geometry { channels, pixels, batch };
        let n = batch * channels * pixels;
        let (x, dy) = (rng.uniform(n), rng.uniform(n));
        let [mean, inv, gamma, beta, dgamma, dbeta] = [0, 1, 2, 3, 4, 5].map(|i| {
            let v = rng.uniform(channels);
            if i == 1 {
                v.iter().map(|v| 1.5 + v).collect::<Vec<f32>>()
            } else {
                v
            }
        });
        let channel = |i: usize| (i / pixels) % channels;
        let norm = |i: usize, r: f32| (x[i] - mean[channel(i)]) * r * gamma[channel(i)] + beta[channel(i)];
        let want_z: Vec<f32> = (0..n).map(|i| norm(i, inv[channel(i)])).collect();
        let want_y: Vec<f32> = want_z.iter().map(|&z| act.apply(z)).collect();
        let want_running: Vec<f32> = (0..n).map(|i| norm(i, 1.0 / (inv[channel(i)] + EPS).sqrt())).collect();
        let inv_count = (1.0 / g.n() as f64) as f32;
        let want_dx: Vec<f32> = (0..n)
            .map(|i| {
                let (c, r) = (channel(i), inv[channel(i)]);
                gamma[c] * r * (dy[i] - (dbeta[c] + (x[i] - mean[c]) * r * dgamma[c]) * inv_count)
            })
            .collect();
        let want_add: Vec<f32> = x.iter().zip(&dy).map(|(a, b)| act.apply(a + b)).collect();
        let want_acc: Vec<f32> = x.iter().zip(&dy).map(|(d, s)| d + s).collect();
        let stats = [&mean, &inv, &gamma, &beta, &dgamma, &dbeta].map(|v| upload(&stream, v));
        let [md, id, gd, bd, dgd, dbd] = stats.each_ref().map(View::of);
        for offset in [0, 1] {
            let what = format!("{channels}x{pixels}x{batch}, offset {offset}");
            // a buffer of NaN around `v` at `offset` floats in, and views of its n values there
            let padded = |v: Option<&[f32]>| {
                let mut p = poisoned(n + 2);
                if let Some(v) = v {
                    p[offset..offset + n].copy_from_slice(v);
                }
                upload(&stream, &p)
            };
            let inner = |v: &[f32]| v[offset..offset + n].to_vec();
            let edges = |what: &str, v: &[f32]| {
                let outside = v.iter().enumerate().filter(|(i, _)| *i < offset || *i >= offset + n);
                assert!(outside.into_iter().all(|(_, v)| v.is_nan()), "{what}: wrote outside its values");
            };
            // SAFETY: views of n values `offset` floats into live buffers of n + 2
            let view = |b: &cudarc::driver::CudaSlice<f32>| unsafe { View::<f32>::from_raw(View::of(b).ptr() + 4 * offset as u64, n) };
            // SAFETY: as view's; each test's outputs are distinct buffers
            let view_mut =
                |b: &cudarc::driver::CudaSlice<f32>| unsafe { ViewMut::<f32>::from_raw(View::of(b).ptr() + 4 * offset as u64, n) };
            let (xd, dyd) = (padded(Some(&x)), padded(Some(&dy)));
            let (z, y) = (padded(None), padded(None));
            gpu.batch_norm_apply(&stream, &g, view(&xd), (view_mut(&z), Some((view_mut(&y), act))), (md, id), (gd, bd), false).unwrap();
            let (z, y) = (download(&stream, &z), download(&stream, &y));
            let running = padded(None);
            gpu.batch_norm_apply(&stream, &g, view(&xd), (view_mut(&running), None), (md, id), (gd, bd), true).unwrap();
            let running = download(&stream, &running);
            let dx = padded(None);
            gpu.batch_norm_input_grad(&stream, &g, view(&xd), view(&dyd), view_mut(&dx), (md, id), gd, (dgd, dbd)).unwrap();
            let dx = download(&stream, &dx);
            let (sz, sy) = (padded(None), padded(None));
            gpu.residual_add(&stream, act, view(&xd), view(&dyd), view_mut(&sz), Some(view_mut(&sy))).unwrap();
            let sy = download(&stream, &sy);
            let (copy, acc) = (padded(None), padded(Some(&x)));
            gpu.residual_grad(&stream, view(&dyd), view_mut(&copy), false).unwrap();
            gpu.residual_grad(&stream, view(&dyd), view_mut(&acc), true).unwrap();
            let (copy, acc) = (download(&stream, &copy), download(&stream, &acc));
            let outputs = [
                ("z", &z, &want_z),
                ("y", &y, &want_y),
                ("z by running statistics", &running, &want_running),
                ("dx", &dx, &want_dx),
                ("residual y", &sy, &want_add),
                ("residual copy", &copy, &dy),
                ("residual sum", &acc, &want_acc),
            ];
            for (name, got, want) in outputs {
                let what = format!("{what}: {name}");
                edges(&what, got);
                same_bits(&what, &inner(got), want);
            }
        }
    }
}

/// Times batch norm's statistics and parameter gradients, one block a channel against the sums
/// in parts, and its normalisation (with a ReLU's y) and input gradient, at resnet_small's shape
/// (16 × 32 × 32) at batches 8, 64, 256 and 512 and at 3 × 32 × 32, with the rate at which each
/// moves the bytes it must (statistics: x once; parameter gradients: x and dy; normalisation:
/// x in, z and y out; input gradient: x and dy in, dx out). A timing print, not a test: run
/// with --ignored --nocapture.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn batch_norm_times_in_parts_and_not() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(6);
    let len = 512 * 16 * 1024;
    let (x, dy) = (upload(&stream, &rng.uniform(len)), upload(&stream, &rng.uniform(len)));
    let (z, y) = (upload(&stream, &vec![0.0f32; len]), upload(&stream, &vec![0.0f32; len]));
    let (stats, partials) = (upload(&stream, &[1.0f32; 7 * 16]), upload(&stream, &[0.0f64; 4096]));
    let (xp, dyp, sp, pp) = (View::of(&x).ptr(), View::of(&dy).ptr(), View::of(&stats).ptr(), View::of(&partials).ptr());
    let (zp, yp) = (View::of(&z).ptr(), View::of(&y).ptr());
    // SAFETY: views of live buffers that long, used only on this stream
    let (v, vm) = (|p: u64, n: usize| unsafe { View::<f32>::from_raw(p, n) }, |p: u64, n: usize| unsafe { ViewMut::<f32>::from_raw(p, n) });
    // the per-channel vectors of `stats`: μ, r, running mean, running variance, dγ, dβ, then the count
    let at = |i: u64| sp + i * 16 * 4;
    for (channels, batch) in [(16, 8), (16, 64), (16, 256), (16, 512), (3, 64)] {
        let g = Geometry { channels, pixels: 1024, batch };
        let n = batch * channels * 1024;
        let scratch = |split: bool| {
            // SAFETY: as v's
            split.then(|| unsafe { ViewMut::<f64>::from_raw(pp, 4096) })
        };
        let time = |split: bool| {
            let forward = || {
                let running = [vm(at(2), 16), vm(at(3), 16), vm(at(6), 1)];
                gpu.batch_norm_stats(&stream, &g, v(xp, n), (vm(at(0), 16), vm(at(1), 16)), running, scratch(split))
            };
            let backward = || {
                let (inputs, saved, out) = ((v(xp, n), v(dyp, n)), (v(at(0), 16), v(at(1), 16)), (vm(at(4), 16), vm(at(5), 16)));
                gpu.batch_norm_param_grads(&stream, &g, inputs, saved, out, scratch(split))
            };
            [time_calls(&gpu, &stream, true, &forward).unwrap(), time_calls(&gpu, &stream, true, &backward).unwrap()]
        };
        let ([one_stats, one_grads], [parts_stats, parts_grads]) = (time(false), time(true));
        let apply = || {
            let (saved, affine) = ((v(at(0), 16), v(at(1), 16)), (v(at(2), 16), v(at(3), 16)));
            gpu.batch_norm_apply(&stream, &g, v(xp, n), (vm(zp, n), Some((vm(yp, n), Activation::Relu))), saved, affine, false)
        };
        let input_grad = || {
            let (saved, param_grads) = ((v(at(0), 16), v(at(1), 16)), (v(at(4), 16), v(at(5), 16)));
            gpu.batch_norm_input_grad(&stream, &g, v(xp, n), v(dyp, n), vm(zp, n), saved, v(at(2), 16), param_grads)
        };
        let (apply, input_grad) = (time_calls(&gpu, &stream, true, &apply).unwrap(), time_calls(&gpu, &stream, true, &input_grad).unwrap());
        let parts = batch_norm_parts(&g).0;
        // GB/s of `passes` passes of n floats in `us`
        let rate = |passes: usize, us: f32| (passes * n * 4) as f32 / us / 1e3;
        println!(
            "batch norm {channels}x32x32 batch {batch}: statistics {one_stats:8.2} us one block a channel, {parts_stats:8.2} us in \
             {parts} parts ({:6.0} GB/s); parameter gradients {one_grads:8.2} / {parts_grads:8.2} us ({:6.0} GB/s); \
             normalisation {apply:8.2} us ({:6.0} GB/s); input gradient {input_grad:8.2} us ({:6.0} GB/s)",
            rate(1, parts_stats.min(one_stats)),
            rate(2, parts_grads.min(one_grads)),
            rate(3, apply),
            rate(3, input_grad)
        );
    }
}

/// The mask the kernel draws is the CPU's, bit for bit, forward and backward (in = dy), for
/// several seeds, passes (past 2³² too), layers and probabilities, on odd lengths; inference
/// copies; nothing past the length is written.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn dropout_draws_the_cpus_bits() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(4);
    for (n, p, region, seed, pass, replica) in [
        (1, 0.5, 1, 0, 0, 0),
        (7, 0.1, 3, 42, 9, 1),
        (4097, 0.5, 2, u64::MAX - 3, (1 << 32) + 5, 0),
        ((1 << 20) + 3, 0.3, 17, 0x1234_5678_9abc_def0, 123_456, 0),
        ((1 << 20) + 3, 0.3, 17, 0x1234_5678_9abc_def0, 123_456, 3),
    ] {
        let x = rng.uniform(n);
        let draw = Draw { seed, pass, replica };
        let draw_dev = upload(&stream, &crate::cuda::state::draw_words(draw));
        let mask = Mask::new(p, region, draw);
        let want: Vec<f32> = (0..n).map(|i| x[i] * mask.factor(i)).chain([f32::NAN]).collect();
        let xd = upload(&stream, &x);
        for train in [true, false] {
            let mut y = upload(&stream, &poisoned(n + 1));
            gpu.dropout(&stream, n, View::of(&xd), ViewMut::of(&mut y), (View::of(&draw_dev), region, p), train).unwrap();
            let got = download(&stream, &y);
            let want: Vec<f32> = if train { want.clone() } else { x.iter().copied().chain([f32::NAN]).collect() };
            let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differ, 0, "dropout n={n} p={p} replica={replica} train={train}: {differ} values differ from the CPU's");
        }
    }
}

/// `dropout_next_pass` adds one to the pass count, carrying into the high word, and leaves the
/// seed and the replica alone.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_pass_count_moves_on_by_one_with_a_carry() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    for (pass, next) in [(0u64, 1u64), (41, 42), (u32::MAX as u64, 1 << 32), ((7 << 32) + 3, (7 << 32) + 4)] {
        let seed = 0xdead_beef_0bad_f00d_u64;
        let words = |pass: u64| crate::cuda::state::draw_words(Draw { seed, pass, replica: 5 }).to_vec();
        let draw = crate::cuda::buffer::DevBuf::from_host(&gpu, &stream, &words(pass)).unwrap();
        crate::cuda::layers::next_pass(&gpu, &stream, &draw).unwrap();
        let mut got = vec![0u32; 5];
        draw.download(&stream, &mut got).unwrap();
        assert_eq!(got, words(next), "pass {pass}");
    }
}
