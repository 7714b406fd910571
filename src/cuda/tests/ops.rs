//! Each kernel against its CPU twin, on seeded random inputs of odd sizes, outputs poisoned.

use super::{check, download, same_bits, upload};
use crate::activation::Activation::{self, Gelu, Identity, LeakyRelu, Relu, Tanh};
use crate::chain::{Chain, Input, Shape};
use crate::cuda::blas::{DevMat, DevMatMut};
use crate::cuda::context::Kernel;
use crate::cuda::dense::DenseEpilogue;
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::ops::{LOSS_SCRATCH, NORM_SCRATCH};
use crate::cuda::test_gpu;
use crate::init::Init;
use crate::layers::{conv, pool};
use crate::loss::{self, Loss};
use crate::optim::{Clip, Optim, Optimizer, Update};
use crate::testutil::allocations_in;
use crate::testutil::{poisoned, Rng};

/// Every activation, a parameter 0.1 where it takes one.
fn every_activation() -> Vec<Activation> {
    Activation::ALL.iter().map(|a| a.with_param(0.1)).collect()
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn bias_act_matches_the_cpu() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(1);
    // one at a time (7×13, 37×1, 1×1), fours of a channel's pixels (16×576, 8×4) and fours of a
    // dense row's channels (64×1, 12×1)
    for (channels, pixels, batch) in [(7, 13, 5), (37, 1, 3), (1, 1, 1), (16, 576, 33), (8, 4, 3), (64, 1, 9), (12, 1, 2)] {
        let n = batch * channels * pixels;
        let z0: Vec<f32> = rng.uniform(n).iter().map(|v| 4.0 * v).collect();
        let bias = rng.uniform(channels);
        let z_want: Vec<f32> = (0..n).map(|i| z0[i] + bias[(i / pixels) % channels]).collect();
        let b = upload(&stream, &bias);
        for act in every_activation() {
            let run = |keep_z| {
                let (mut z, mut y) = (upload(&stream, &z0), upload(&stream, &poisoned(n + 1)));
                let (zv, yv) = (ViewMut::of(&mut z), Some(ViewMut::of(&mut y)));
                gpu.bias_act(&stream, act, View::of(&b), channels, pixels, batch, zv, yv, keep_z).unwrap();
                (download(&stream, &z), download(&stream, &y))
            };
            let (z, y_kept) = run(true);
            let y_want: Vec<f32> = z_want.iter().map(|&v| act.apply(v)).chain([f32::NAN]).collect();
            check(&format!("bias_act z {act:?}"), &z, &z_want, 0.0, 0.0);
            check(&format!("bias_act y {act:?} {channels}x{pixels}x{batch}"), &y_kept, &y_want, 1e-6, 1e-5);
            // z not kept (inference): the same y, bit for bit, and z as it was
            let (z, y) = run(false);
            same_bits(&format!("bias_act y {act:?} {channels}x{pixels}x{batch}, z not kept"), &y, &y_kept);
            same_bits(&format!("bias_act z {act:?} {channels}x{pixels}x{batch}, not kept"), &z, &z0);
        }
        // no y: the bias alone, in place, whether z is to be kept or not (z is the output)
        for keep_z in [true, false] {
            let mut z = upload(&stream, &z0);
            gpu.bias_act(&stream, Relu, View::of(&b), channels, pixels, batch, ViewMut::of(&mut z), None, keep_z).unwrap();
            check(&format!("bias_act in place, keep_z {keep_z}"), &download(&stream, &z), &z_want, 0.0, 0.0);
        }
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn act_backward_matches_the_cpu() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(2);
    for n in [1, 1001, (1 << 24) + 3] {
        let acts = if n > 1 << 20 { vec![LeakyRelu(0.02)] } else { every_activation() };
        let z: Vec<f32> = rng.uniform(n).iter().map(|v| 4.0 * v).collect();
        let dy = rng.uniform(n);
        for &act in &acts {
            let y: Vec<f32> = z.iter().map(|&v| act.apply(v)).collect();
            let want: Vec<f32> = (0..n).map(|i| dy[i] * act.derivative(z[i], y[i])).chain([f32::NAN]).collect();
            let (zd, yd, dyd, mut dz) = (upload(&stream, &z), upload(&stream, &y), upload(&stream, &dy), upload(&stream, &poisoned(n + 1)));
            gpu.act_backward(&stream, act, n, View::of(&zd), View::of(&yd), View::of(&dyd), ViewMut::of(&mut dz)).unwrap();
            check(&format!("act_backward {act:?} n={n}"), &download(&stream, &dz), &want, 1e-6, 1e-5);
            if n > 1 << 20 {
                continue;
            }
            // the same values one float past 16-byte alignment (the kernel's scalar path): dz's
            // first value and the one past n stay poisoned
            let (zd, yd, dyd) = (
                upload(&stream, &[&[0.0], &z[..]].concat()),
                upload(&stream, &[&[0.0], &y[..]].concat()),
                upload(&stream, &[&[0.0], &dy[..]].concat()),
            );
            let mut dz = upload(&stream, &poisoned(n + 2));
            let views = (View::of(&zd).slice(1..n + 1), View::of(&yd).slice(1..n + 1), View::of(&dyd).slice(1..n + 1));
            gpu.act_backward(&stream, act, n, views.0, views.1, views.2, ViewMut::of(&mut dz).slice(1..n + 1)).unwrap();
            let want: Vec<f32> = [f32::NAN].into_iter().chain(want).collect();
            check(&format!("act_backward {act:?} n={n}, unaligned"), &download(&stream, &dz), &want, 1e-6, 1e-5);
        }
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn bias_grad_is_exact_on_integers_and_deterministic() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(3);
    // (the 4th to 6th split each channel's sum: 13 parts of 5 samples, the last of 4; 10 of
    // 100, the last of 91; 64 of 1; the last two read rows of one and three float4s, so that a
    // thread's share steps over many rows at a time)
    let sizes = [(7, 13, 5), (10, 1, 1000), (1, 1, 1), (3, 784, 64), (6, 41, 991), (16, 4096, 64), (5, 4, 300), (2, 12, 77)];
    for (channels, pixels, batch) in sizes {
        let splits = crate::cuda::bias_act::bias_grad_splits(channels, pixels, batch);
        let n = batch * channels * pixels;
        let dz = rng.ints(n);
        let mut want = vec![0.0f32; channels];
        for i in 0..n {
            want[(i / pixels) % channels] += dz[i];
        }
        // with no scratch (one block a channel), and with scratch (split where it is worth it)
        let run = |dz: &[f32], scratch: bool| {
            let (dzd, mut db) = (upload(&stream, dz), upload(&stream, &poisoned(channels + 1)));
            let mut partials = upload(&stream, &poisoned(splits * channels));
            let partials = scratch.then(|| ViewMut::of(&mut partials));
            gpu.bias_grad(&stream, channels, pixels, batch, View::of(&dzd), ViewMut::of(&mut db), partials).unwrap();
            download(&stream, &db)
        };
        want.push(f32::NAN);
        for scratch in [false, true] {
            let what = format!("bias_grad {channels}x{pixels}x{batch}, {splits} parts, scratch {scratch}");
            check(&what, &run(&dz, scratch), &want, 0.0, 0.0);
            let dz = rng.uniform(n);
            same_bits(&what, &run(&dz, scratch), &run(&dz, scratch));
        }
    }
    assert_eq!(crate::cuda::bias_act::bias_grad_splits(3, 784, 64), 13);
    assert_eq!(crate::cuda::bias_act::bias_grad_splits(6, 41, 991), 10);
    assert_eq!(crate::cuda::bias_act::bias_grad_splits(16, 4096, 64), 64);
    assert_eq!(crate::cuda::bias_act::bias_grad_splits(16, 250, 4096), 64);
    assert_eq!(crate::cuda::bias_act::bias_grad_splits(16, 1024, 64), 16);
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn softmax_xent_matches_the_cpu_and_is_deterministic() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(4);
    for (classes, batch) in [(10, 1), (13, 37), (10, 1000), (1000, 3)] {
        let y: Vec<f32> = rng.uniform(batch * classes).iter().map(|v| 8.0 * v).collect();
        let labels: Vec<u32> = (0..batch).map(|_| rng.below(classes) as u32).collect();
        let mut dy_want = vec![0.0f32; batch * classes];
        let loss_want = loss::logit_cross_entropy(&y, &labels, classes, &mut dy_want);
        let (yd, ld) = (upload(&stream, &y), upload(&stream, &labels));
        // one scratch for every run: the last block leaves its counter at zero for the next
        let mut scratch_buf = upload(&stream, &[0.0f64; LOSS_SCRATCH]);
        let mut run = || {
            let (mut dy, mut loss) = (upload(&stream, &poisoned(batch * classes)), upload(&stream, &[f64::NAN, 0.5, 2.0]));
            let (y, labels) = (View::of(&yd), View::of(&ld));
            let scratch = ViewMut::of(&mut scratch_buf);
            gpu.softmax_xent(&stream, classes, batch, y, labels, ViewMut::of(&mut dy), ViewMut::of(&mut loss), scratch).unwrap();
            loss_totals_follow(&download(&stream, &loss));
            (download(&stream, &dy), download(&stream, &loss)[0])
        };
        let (dy, loss) = run();
        let scale = 1.0 / batch as f32;
        check(&format!("softmax_xent dy {classes}x{batch}"), &dy, &dy_want, 1e-6 * scale, 1e-5);
        let rel = ((loss - loss_want) / loss_want).abs();
        println!("softmax_xent loss {classes}x{batch}: {loss} vs {loss_want}, rel err {rel:e}");
        assert!(rel <= 1e-5, "loss {loss} vs {loss_want}");
        let (dy2, loss2) = run();
        same_bits("softmax_xent dy", &dy, &dy2);
        assert_eq!(loss.to_bits(), loss2.to_bits(), "softmax_xent loss differs between runs");
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn mse_matches_the_cpu_and_is_deterministic() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(5);
    for n in [1, 7, 1000, 300_001] {
        let (y, t) = (rng.uniform(n), rng.uniform(n));
        let mut dy_want = vec![0.0f32; n];
        let loss_want = loss::mse(&y, &t, &mut dy_want);
        let (yd, td) = (upload(&stream, &y), upload(&stream, &t));
        let mut scratch_buf = upload(&stream, &[0.0f64; LOSS_SCRATCH]);
        let mut run = || {
            let (mut dy, mut loss) = (upload(&stream, &poisoned(n)), upload(&stream, &[f64::NAN, 0.5, 2.0]));
            let scratch = ViewMut::of(&mut scratch_buf);
            gpu.mse(&stream, n, View::of(&yd), View::of(&td), ViewMut::of(&mut dy), ViewMut::of(&mut loss), scratch).unwrap();
            loss_totals_follow(&download(&stream, &loss));
            (download(&stream, &dy), download(&stream, &loss)[0])
        };
        let (dy, loss) = run();
        check(&format!("mse dy n={n}"), &dy, &dy_want, 0.0, 0.0);
        let rel = ((loss - loss_want) / loss_want).abs();
        println!("mse loss n={n}: {loss} vs {loss_want}, rel err {rel:e}");
        assert!(rel <= 1e-5, "loss {loss} vs {loss_want}");
        let (dy2, loss2) = run();
        same_bits("mse dy", &dy, &dy2);
        assert_eq!(loss.to_bits(), loss2.to_bits(), "mse loss differs between runs");
    }
}

/// Binary cross-entropy on logits, L1 and smooth L1 (β 0.3 and 0) against `Loss::compute`: dy
/// within rounding (the GPU's e^ and ln1p against the CPU's), the value within 1e-5 (each term
/// in f32 on both, summed in f64 in other orders), the running totals, and the same bits on a
/// second run; one block and many.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn elementwise_losses_match_the_cpu_and_are_deterministic() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(6);
    for kind in [Loss::BceWithLogits, Loss::L1, Loss::SmoothL1 { beta: 0.3 }, Loss::SmoothL1 { beta: 0.0 }] {
        for n in [1, 7, 1000, 300_001] {
            // logits over [−8, 8), targets in [0, 1); L1's kink at 0 hit on every 7th value
            let y: Vec<f32> = rng.uniform(n).iter().map(|v| 8.0 * v).collect();
            let t: Vec<f32> = rng.uniform(n).iter().enumerate().map(|(i, v)| if i % 7 == 3 { y[i] } else { v.abs() }).collect();
            let mut dy_want = vec![0.0f32; n];
            let loss_want = kind.compute(&y, &[], &t, 1, &mut dy_want);
            let (yd, td) = (upload(&stream, &y), upload(&stream, &t));
            let mut scratch_buf = upload(&stream, &[0.0f64; LOSS_SCRATCH]);
            let mut run = || {
                let (mut dy, mut loss) = (upload(&stream, &poisoned(n)), upload(&stream, &[f64::NAN, 0.5, 2.0]));
                let (dyv, lossv, scratch) = (ViewMut::of(&mut dy), ViewMut::of(&mut loss), ViewMut::of(&mut scratch_buf));
                gpu.elementwise_loss(&stream, kind, n, View::of(&yd), View::of(&td), dyv, lossv, scratch).unwrap();
                loss_totals_follow(&download(&stream, &loss));
                (download(&stream, &dy), download(&stream, &loss)[0])
            };
            let (dy, loss) = run();
            // σ(y) − t cancels: an absolute bound of a few ulps of 1, over n
            check(&format!("{kind:?} dy n={n}"), &dy, &dy_want, 5e-7 / n as f32, 1e-6);
            let rel = ((loss - loss_want) / loss_want).abs();
            println!("{kind:?} loss n={n}: {loss} vs {loss_want}, rel err {rel:e}");
            assert!(rel <= 1e-5, "{kind:?}: loss {loss} vs {loss_want}");
            let (dy2, loss2) = run();
            same_bits(&format!("{kind:?} dy"), &dy, &dy2);
            assert_eq!(loss.to_bits(), loss2.to_bits(), "{kind:?}: loss differs between runs");
        }
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn maxpool_matches_the_spec_bit_for_bit() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(6);
    // (H, W, C, window, stride): disjoint, overlapping, stride 1, uneven, stride > window;
    // windows that tile the input (one thread a window), square and not
    let cases = [
        (8, 10, 3, (2, 2), (2, 2)),
        (6, 9, 2, (3, 3), (3, 3)),
        (4, 9, 2, (2, 3), (2, 3)),
        (7, 9, 3, (2, 2), (2, 2)),
        (9, 11, 2, (3, 3), (2, 2)),
        (5, 6, 1, (2, 2), (1, 1)),
        (6, 7, 4, (3, 2), (1, 2)),
        (8, 8, 2, (2, 2), (3, 3)),
    ];
    for (h, w, c, window, stride) in cases {
        let (oh, ow) = ((h - window.0) / stride.0 + 1, (w - window.1) / stride.1 + 1);
        let g = pool::Geometry::new(Shape::image(c, h, w), Shape::image(c, oh, ow), window, stride);
        for batch in [1, 3] {
            let (in_len, out_len) = (batch * c * h * w, batch * c * oh * ow);
            let mut x = rng.ints(in_len); // small integers: many ties
            x[in_len / 2] = f32::NAN; // a NaN wins its windows, as on the CPU
            let dy = rng.ints(out_len);
            let (mut y_want, mut dx_want) = (poisoned(out_len), poisoned(in_len));
            pool::forward_spec(&g, batch, &x, &mut y_want);
            pool::backward_spec(&g, batch, &x, &dy, &mut dx_want);
            let (xd, dyd, mut y, mut dx) = (
                upload(&stream, &x),
                upload(&stream, &dy),
                upload(&stream, &poisoned(out_len + 1)),
                upload(&stream, &poisoned(in_len + 1)),
            );
            gpu.maxpool_forward(&stream, &g, batch, View::of(&xd), ViewMut::of(&mut y)).unwrap();
            gpu.maxpool_backward(&stream, &g, batch, View::of(&xd), View::of(&dyd), ViewMut::of(&mut dx)).unwrap();
            y_want.push(f32::NAN);
            dx_want.push(f32::NAN);
            check(&format!("maxpool y {g:?} batch {batch}"), &download(&stream, &y), &y_want, 0.0, 0.0);
            check(&format!("maxpool dx {g:?} batch {batch}"), &download(&stream, &dx), &dx_want, 0.0, 0.0);
        }
    }
}

/// Each rule, with and without clipping (by norm, by value) and weight decay, against
/// `Optimizer::update` on the CPU over 3 steps of random gradients: parameters, and the norm.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn optimisers_match_the_cpu() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(8);
    let nesterov = Optim::Sgd { lr: 0.05, momentum: 0.9, nesterov: true, weight_decay: 0.0 };
    let configs = [Optim::sgd(0.1, 0.0), Optim::sgd(0.1, 0.9), nesterov, Optim::adam(0.01), Optim::adamw(0.01, 0.1), Optim::rmsprop(0.001)];
    // uniform gradients in [-1, 1) over 1,102 parameters: a norm near 19, so Norm(2.0) clips
    let extras = [(Clip::None, 0.0), (Clip::Norm(2.0), 0.0), (Clip::Value(0.3), 0.0), (Clip::Norm(2.0), 0.05), (Clip::None, 0.05)];
    for config in configs {
        for (clip, decay) in extras {
            let config = if decay > 0.0 { config.with_weight_decay(decay) } else { config };
            let name = format!("{config:?} {clip:?}");
            let mut model =
                Chain::new(Input::vector(37)).dense(29, Identity).build().unwrap().init(Init::GlorotNormal, 1).with_threads(1).unwrap();
            let mut grads = model.preallocate_grads(1).unwrap();
            let mut opt = Optimizer::new(&model, config).unwrap();
            opt.set_clip(clip).unwrap();
            let n = model.params.len();
            let (mut params, mut state) = (upload(&stream, &model.params), upload(&stream, &vec![0.0f32; 2 * n]));
            let mut norm = upload(&stream, &[0.0f64; NORM_SCRATCH]);
            for step in 1..=3 {
                let g = rng.uniform(n);
                grads.grads.copy_from_slice(&g);
                opt.update(&mut model, &grads).unwrap();
                let gd = upload(&stream, &g);
                if let Clip::Norm(_) = clip {
                    gpu.grad_norm(&stream, n, View::of(&gd), ViewMut::of(&mut norm)).unwrap();
                }
                let rule = Update { config, clip };
                let (p, s) = (ViewMut::of(&mut params), ViewMut::of(&mut state));
                gpu.optim_step(&stream, rule, step, n, p, View::of(&gd), s, View::of(&norm)).unwrap();
                if let Clip::Norm(_) = clip {
                    let norm = download(&stream, &norm)[0] as f32;
                    check(&format!("{name} norm at step {step}"), &[norm], &[opt.grad_norm().unwrap()], 0.0, 1e-6);
                }
            }
            check(&format!("{name} after 3 steps"), &download(&stream, &params), &model.params, 0.0, 1e-6);
        }
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn gather_picks_the_indexed_samples() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(9);
    let (samples, sample_len, batch) = (100, 37, 33);
    let data = rng.uniform(samples * sample_len);
    let labels: Vec<u32> = (0..samples).map(|_| rng.below(10) as u32).collect();
    let mut indices: Vec<u32> = (0..batch).map(|_| rng.below(samples) as u32).collect();
    indices[5] = indices[4]; // repeats are fine
    indices[7] = samples as u32; // out of range: NaN sample, label u32::MAX
    let x_want: Vec<f32> = indices
        .iter()
        .flat_map(
            |&i| if (i as usize) < samples { data[i as usize * sample_len..][..sample_len].to_vec() } else { vec![f32::NAN; sample_len] },
        )
        .collect();
    let y_want: Vec<u32> = indices.iter().map(|&i| labels.get(i as usize).copied().unwrap_or(u32::MAX)).collect();
    let (dd, ld, id) = (upload(&stream, &data), upload(&stream, &labels), upload(&stream, &indices));
    let (mut x, mut y) = (upload(&stream, &poisoned(batch * sample_len)), upload(&stream, &vec![7u32; batch]));
    gpu.gather_batch(&stream, sample_len, batch, View::of(&dd), View::of(&id), ViewMut::of(&mut x)).unwrap();
    gpu.gather_labels(&stream, batch, View::of(&ld), View::of(&id), ViewMut::of(&mut y)).unwrap();
    check("gather_batch", &download(&stream, &x), &x_want, 0.0, 0.0);
    assert_eq!(download(&stream, &y), y_want, "gather_labels");
}

/// After one warm-up call each, the wrappers and SGEMM allocate nothing on the host.
/// `act_bias_grad` against `act_backward` then `bias_grad` on the same views, bit for bit (dz,
/// db, and the poison around them): one part a channel and several, rows of fours and not, with
/// every pointer 16-byte aligned, all one float past, dz alone past (the sums one value at a
/// time), and z, y and dy alone past (the sums in fours of values loaded one at a time).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn act_bias_grad_is_act_backward_then_bias_grad_bit_for_bit() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(11);
    // not split: odd rows, rows of fours; split: rows of 196 fours, odd rows, ts_conv1d's second
    // convolution at 512 (rows of 31 fours), rows of one four
    let sizes = [(7, 13, 5), (8, 16, 9), (3, 784, 64), (6, 41, 991), (32, 124, 512), (5, 4, 3000)];
    for (channels, pixels, batch) in sizes {
        let (n, splits) = (batch * channels * pixels, crate::cuda::bias_act::bias_grad_splits(channels, pixels, batch));
        let z: Vec<f32> = rng.uniform(n).iter().map(|v| 4.0 * v).collect();
        let dy = rng.uniform(n);
        for act in [Relu, Tanh, LeakyRelu(0.1), Identity, Gelu] {
            let y: Vec<f32> = z.iter().map(|&v| act.apply(v)).collect();
            // (offset of z, y and dy; offset of dz), in floats
            for (off, dz_off) in [(0, 0), (1, 1), (0, 1), (1, 0)] {
                let pad = |v: &[f32]| upload(&stream, &[&vec![0.0; off][..], v].concat());
                let (zd, yd, dyd) = (pad(&z), pad(&y), pad(&dy));
                let inputs = || {
                    let v = |d| View::of(d).slice(off..off + n);
                    (v(&zd), v(&yd), v(&dyd))
                };
                let run = |fused: bool, scratch: bool| {
                    let (mut dz, mut db) = (upload(&stream, &poisoned(n + 2)), upload(&stream, &poisoned(channels + 1)));
                    let mut partials = upload(&stream, &poisoned(splits * channels));
                    let partials = scratch.then(|| ViewMut::of(&mut partials));
                    let (zv, yv, dyv) = inputs();
                    if fused {
                        let dzv = ViewMut::of(&mut dz).slice(dz_off..dz_off + n);
                        let layout = (channels, pixels, batch);
                        gpu.act_bias_grad(&stream, act, layout, zv, yv, dyv, dzv, ViewMut::of(&mut db), partials).unwrap();
                    } else {
                        gpu.act_backward(&stream, act, n, zv, yv, dyv, ViewMut::of(&mut dz).slice(dz_off..dz_off + n)).unwrap();
                        let dzv = View::of(&dz).slice(dz_off..dz_off + n);
                        gpu.bias_grad(&stream, channels, pixels, batch, dzv, ViewMut::of(&mut db), partials).unwrap();
                    }
                    (download(&stream, &dz), download(&stream, &db))
                };
                for scratch in [false, true] {
                    let what = format!(
                        "act_bias_grad {act:?} {channels}x{pixels}x{batch}, {splits} parts, scratch {scratch}, offsets {off} {dz_off}"
                    );
                    let ((dz, db), (dz_want, db_want)) = (run(true, scratch), run(false, scratch));
                    assert!(dz[dz_off..dz_off + n].iter().chain(&db[..channels]).all(|v| !v.is_nan()), "{what}: a value not written");
                    check(&format!("{what}: dz"), &dz, &dz_want, 0.0, 0.0);
                    same_bits(&format!("{what}: dz"), &dz, &dz_want);
                    check(&format!("{what}: db"), &db, &db_want, 0.0, 0.0);
                    same_bits(&format!("{what}: db"), &db, &db_want);
                }
            }
        }
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn launches_allocate_nothing() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let blas = gpu.blas(&stream, false).unwrap();
    let (channels, pixels, batch) = (8, 36, 4);
    let n = channels * pixels * batch;
    let mut rng = Rng::new(10);
    let (a, b, mut c, mut d) = (
        upload(&stream, &rng.uniform(n)),
        upload(&stream, &rng.uniform(n)),
        upload(&stream, &rng.uniform(n)),
        upload(&stream, &rng.uniform(n)),
    );
    let mut state = upload(&stream, &vec![0.0f32; 2 * n]);
    let mut norm = upload(&stream, &[0.0f64; NORM_SCRATCH]);
    let (mut loss, mut scratch) = (upload(&stream, &[0.0f64; 3]), upload(&stream, &[0.0f64; LOSS_SCRATCH]));
    let labels = upload(&stream, &vec![1u32; batch]);
    let mut labels_out = upload(&stream, &vec![0u32; batch]);
    let pool_g = pool::Geometry::new(Shape::image(channels, 6, 6), Shape::image(channels, 3, 3), (2, 2), (2, 2));
    let conv_g = conv::Geometry::new(Shape::image(2, 6, 6), Shape::image(3, 4, 4), (3, 3), (1, 1), (0, 0), (1, 1));
    let mut every_kernel = || {
        let (av, bv) = (View::of(&a), View::of(&b));
        gpu.bias_act(&stream, Gelu, av, channels, pixels, batch, ViewMut::of(&mut c), Some(ViewMut::of(&mut d)), true).unwrap();
        gpu.act_backward(&stream, Tanh, n, av, bv, av, ViewMut::of(&mut c)).unwrap();
        gpu.bias_grad(&stream, channels, pixels, batch, av, ViewMut::of(&mut c), None).unwrap();
        gpu.bias_grad(&stream, channels, pixels, batch, av, ViewMut::of(&mut c), Some(ViewMut::of(&mut d))).unwrap();
        gpu.act_bias_grad(&stream, Tanh, (channels, pixels, batch), av, bv, av, ViewMut::of(&mut c), ViewMut::of(&mut d), None).unwrap();
        gpu.softmax_xent(&stream, 10, batch, av, View::of(&labels), ViewMut::of(&mut c), ViewMut::of(&mut loss), ViewMut::of(&mut scratch))
            .unwrap();
        gpu.mse(&stream, n, av, bv, ViewMut::of(&mut c), ViewMut::of(&mut loss), ViewMut::of(&mut scratch)).unwrap();
        let (am, bm) = (DevMat { data: av, rs: 16, cs: 1 }, DevMat { data: bv, rs: 1, cs: 16 });
        let epilogue = DenseEpilogue::Forward { bias: bv, z: Some(ViewMut::of(&mut c)), y: Some(ViewMut::of(&mut d)), act: Gelu };
        gpu.dense_on(&stream, Kernel::DenseSkinny4, 12, 9, 16, am, bm, epilogue, true).unwrap();
        let epilogue = DenseEpilogue::InputGrad { dx: ViewMut::of(&mut c), prev: Some((av, bv, Tanh)) };
        gpu.dense_on(&stream, Kernel::DensePanel, 3, 9, 16, am, bm, epilogue, true).unwrap();
        gpu.maxpool_forward(&stream, &pool_g, batch, av, ViewMut::of(&mut c)).unwrap();
        gpu.maxpool_backward(&stream, &pool_g, batch, av, bv, ViewMut::of(&mut c)).unwrap();
        gpu.im2col(&stream, &conv_g, 2, av, ViewMut::of(&mut c)).unwrap();
        gpu.col2im(&stream, &conv_g, 2, av, ViewMut::of(&mut c)).unwrap();
        gpu.grad_norm(&stream, n, av, ViewMut::of(&mut norm)).unwrap();
        for config in [Optim::sgd(0.1, 0.0), Optim::sgd(0.1, 0.9), Optim::adamw(1e-3, 0.1), Optim::rmsprop(1e-3).with_weight_decay(0.1)] {
            let rule = Update { config, clip: Clip::Norm(1.0) };
            gpu.optim_step(&stream, rule, 3, n / 2, ViewMut::of(&mut c), av, ViewMut::of(&mut state), View::of(&norm)).unwrap();
        }
        gpu.gather_batch(&stream, 9, batch, av, View::of(&labels), ViewMut::of(&mut c)).unwrap();
        gpu.gather_labels(&stream, batch, View::of(&labels), View::of(&labels), ViewMut::of(&mut labels_out)).unwrap();
        let (ma, mb) = (DevMat { data: av, rs: 17, cs: 1 }, DevMat { data: bv, rs: 1, cs: 17 });
        blas.sgemm(13, 11, 17, 1.0, ma, mb, 0.5, DevMatMut { data: ViewMut::of(&mut c), rs: 11, cs: 1 }).unwrap();
        blas.sgemm_batched(3, 5, 7, 9, 1.0, (ma, 0), (mb, 100), 0.0, (DevMatMut { data: ViewMut::of(&mut c), rs: 7, cs: 1 }, 40)).unwrap();
    };
    every_kernel();
    stream.synchronize().unwrap();
    let count = allocations_in(&mut every_kernel);
    stream.synchronize().unwrap();
    println!("host allocations in one call of every wrapper after warm-up: {count}");
    assert_eq!(count, 0, "the launch path allocated");
}

/// The loss kernels add the value to running totals that started at (0.5, 2).
fn loss_totals_follow(loss: &[f64]) {
    assert_eq!(loss.len(), 3);
    assert_eq!(loss[1], 0.5 + loss[0], "running loss sum");
    assert_eq!(loss[2], 3.0, "running loss count");
}

/// Inputs from mapped page-locked memory: every length's vector part and tail, and nothing
/// past `n` written.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn copy_from_host_copies_exactly_n_values() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(31);
    for n in [1, 3, 4, 5, 1029, 100_003] {
        let values = rng.uniform(n);
        let mut host = crate::cuda::pinned::Pinned::<f32>::zeros(&gpu, n).unwrap();
        host.as_mut_slice().copy_from_slice(&values);
        let mut dst = upload(&stream, &poisoned(n + 3));
        gpu.copy_from_host(&stream, n, host.device_ptr(), ViewMut::of(&mut dst)).unwrap();
        let got = download(&stream, &dst);
        assert!(got[..n].iter().zip(&values).all(|(a, b)| a.to_bits() == b.to_bits()), "copy_from_host {n}: values differ");
        assert!(got[n..].iter().all(|v| v.is_nan()), "copy_from_host {n}: wrote past n");
    }
}

/// A forward pass's outputs to mapped page-locked memory and the flag after them: every value
/// exact, from outputs at any offset in the activations (0 to 3 values past a 16-byte
/// boundary) into the page-aligned buffer (and, one value in, unaligned), nothing past `n`
/// written, the flag and the counter the counter's next value.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn finish_outputs_copies_exactly_n_values_then_the_flag() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(32);
    let mut host = crate::cuda::pinned::Pinned::<f32>::zeros(&gpu, crate::cuda::ops::FINISH_MAX + 5).unwrap();
    let mut flag = crate::cuda::pinned::Pinned::<u32>::zeros(&gpu, 1).unwrap();
    for n in [0, 1, 3, 5, 17, 16_383, 16_384] {
        let acts = rng.uniform(n + 3);
        let acts_dev = upload(&stream, &acts);
        for (offset, host_offset) in [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (3, 1)] {
            let what = format!("finish_outputs n={n} src+{offset} host+{host_offset}");
            host.as_mut_slice().fill(f32::NAN);
            flag.as_mut_slice()[0] = 0;
            let count = (7 * n + 2 * offset + host_offset) as u32;
            let mut counter = upload(&stream, &[count]);
            let src = View::of(&acts_dev).slice(offset..offset + n);
            let host_dst = host.device_ptr() + (4 * host_offset) as u64;
            gpu.finish_outputs(&stream, n, src, host_dst, ViewMut::of(&mut counter), flag.device_ptr()).unwrap();
            assert_eq!(download(&stream, &counter), [count + 1], "{what}: counter");
            assert_eq!(flag.as_slice()[0], count + 1, "{what}: flag");
            let (got, want) = (&host.as_slice()[host_offset..host_offset + n], &acts[offset..offset + n]);
            let bad = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(bad.is_none(), "{what}: value {bad:?} differs");
            let untouched = |v: &f32| v.is_nan();
            assert!(host.as_slice()[..host_offset].iter().all(untouched), "{what}: wrote before the start");
            assert!(host.as_slice()[host_offset + n..].iter().all(untouched), "{what}: wrote past n");
        }
    }
}

/// Times a convolution's bias gradient, one block a channel against the sum in parts, at the
/// shapes of the zoo's convolutions (LeNet-5's two, vgg_small's first and third) at batches
/// 256 and 1024 (a timing print, not a test: run with --ignored --nocapture).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn bias_grad_times_at_the_zoos_convolutions() {
    use crate::cuda::timing::time_calls;
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let len = 1024 * 16 * 1024;
    let (dz, db, partials) =
        (upload(&stream, &Rng::new(5).uniform(len)), upload(&stream, &[0.0f32; 64]), upload(&stream, &vec![0.0f32; 65_536]));
    let (dzp, dbp, pp) = (View::of(&dz).ptr(), View::of(&db).ptr(), View::of(&partials).ptr());
    // SAFETY: views of live buffers that long, used only on this stream
    let vm = |p: u64, n: usize| unsafe { ViewMut::<f32>::from_raw(p, n) };
    for batch in [256, 1024] {
        for (channels, pixels, name) in [(6, 784, "lenet conv1"), (16, 100, "lenet conv2"), (16, 1024, "vgg conv1"), (32, 256, "vgg conv3")]
        {
            let splits = crate::cuda::bias_act::bias_grad_splits(channels, pixels, batch);
            let time = |scratch: bool| {
                let work = || {
                    // SAFETY: as vm's
                    let dz = unsafe { View::<f32>::from_raw(dzp, len) };
                    gpu.bias_grad(&stream, channels, pixels, batch, dz, vm(dbp, 64), scratch.then(|| vm(pp, 65_536)))
                };
                time_calls(&gpu, &stream, true, &work).unwrap()
            };
            let (one, parts) = (time(false), time(true));
            println!("bias_grad {name} {channels}x{pixels} batch {batch}: one block a channel {one:8.2} us, {splits} parts {parts:8.2} us");
        }
    }
}
