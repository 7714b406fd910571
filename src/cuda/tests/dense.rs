//! The dense layer on the GPU: every route of every direction (src/cuda/dense.rs) against plain
//! loops, the fused kernels alone on odd shapes and layouts, the weight gradients split over the
//! batch, and the route report. The tensor-core tiles' accuracy is tested in `dense_mma`.

use super::{check, download, same_bits, upload};
use crate::activation::Activation::{Gelu, Identity, Relu, Tanh};
use crate::chain::{Chain, Input, Plan};
use crate::cuda::blas::DevMat;
use crate::cuda::blaslt::lt_present;
use crate::cuda::buffer::DevBuf;
use crate::cuda::context::Kernel;
use crate::cuda::dense::{DenseEpilogue, Dir, Route, MMA_TILES};
use crate::cuda::dense_pass::{
    dense_shape, forward_on, input_grad_on, lt_routes, operands, problem, producer, producer_activation, weight_grad_on, On,
};
use crate::cuda::exec::{Backward, Forward};
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::options::Tuning;
use crate::cuda::test_gpu;
use crate::init::Init;
use crate::layers::{region, Mode};
use crate::loss::Loss;
use crate::testutil::{poisoned, Rng};

/// Every route that fits each direction of each dense step of odd plans (`Gpu::dense_routes`:
/// so a new route is tested as soon as it is listed), run as a step runs it on a pass's
/// buffers, against plain loops: small integers, so every product is exact on every route
/// (activations and their derivatives within rounding); outputs poisoned with NaN first, and
/// nothing else in the buffers changed. An input gradient is checked where the producer's pass
/// reads it: its dz (the fused routes write it; after cuBLAS or cuBLASLt the producer's
/// activation pass does), and the input gradient itself, which cuBLAS and cuBLASLt write and the
/// fused routes leave alone. cuBLASLt's routes are its heuristic's algorithms for each product
/// (FP32, deterministic reductions), as the measuring lists them. The fused routes are a TF32
/// model's (those of an FP32 one and the one-product tiles), exact too on small integers.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn every_route_of_every_direction_matches_plain_loops() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let blas = gpu.blas(&stream, false).unwrap();
    let mut rng = Rng::new(41);
    let tuning = Tuning::default();
    // odd sizes; then sizes of multiples of four, which the tensor-core tiles and the split
    // weight gradient take (where the device has them)
    let plans = [
        (Chain::new(Input::vector(37)).dense(29, Tanh).dense(11, Relu).dense(5, Identity), [1, 13]),
        (Chain::new(Input::vector(64)).dense(32, Gelu).dense(16, Relu).dense(8, Identity), [200, 257]),
    ];
    let mut ran = Vec::new();
    for (chain, batches) in plans {
        let plan: Plan = chain.build().unwrap().plan().clone();
        for batch in batches {
            let capacity = batch + 3;
            let acts_len = plan.acts_len(capacity).unwrap();
            let (acts_h, dacts_h, params_h) = (rng.ints(acts_len), rng.ints(acts_len), rng.ints(plan.param_len));
            let grads_h = rng.ints(plan.param_len);
            let params = DevBuf::from_host(&gpu, &stream, &params_h).unwrap();
            let (mut acts, mut dacts) =
                (DevBuf::from_host(&gpu, &stream, &acts_h).unwrap(), DevBuf::from_host(&gpu, &stream, &dacts_h).unwrap());
            let mut grads = DevBuf::from_host(&gpu, &stream, &grads_h).unwrap();
            let (cols, draw) = (DevBuf::<f32>::zeros(&gpu, &stream, 1).unwrap(), DevBuf::<u32>::zeros(&gpu, &stream, 5).unwrap());
            let scratch = || DevBuf::<f32>::zeros(&gpu, &stream, capacity).unwrap();
            let (dcols, partials, ones) = (scratch(), scratch(), scratch());
            for (index, step) in plan.steps.iter().enumerate() {
                let Some((out, inp)) = dense_shape(step) else { continue };
                let r = |region_index| region(&plan, region_index, capacity, batch);
                let (x, z, y) = (r(step.input_region), r(step.z_region), r(step.output_region));
                let (w, b) = step.weight_and_bias();
                let act = step.layer.activation();
                // dZ·W (batch × in), dZ at the step's z in the gradients
                let dx: Vec<f32> = (0..batch * inp)
                    .map(|l| (0..out).map(|o| dacts_h[z.start + (l / inp) * out + o] * params_h[w.start + o * inp + l % inp]).sum())
                    .collect();
                for dir in Dir::ALL {
                    if dir == Dir::InputGrad && step.input_region == 0 {
                        continue;
                    }
                    // what each buffer must hold after the direction ran: the inputs as they
                    // were, the outputs as computed here (NaN where a route must not write)
                    let (mut acts_want, mut dacts_want, mut grads_want) = (acts_h.clone(), dacts_h.clone(), grads_h.clone());
                    // the ranges poisoned before each run, and the tolerance of activations
                    let mut poison: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
                    match dir {
                        Dir::Forward => {
                            for l in 0..batch * out {
                                let (s, o) = (l / out, l % out);
                                let zv: f32 =
                                    (0..inp).map(|i| acts_h[x.start + s * inp + i] * params_h[w.start + o * inp + i]).sum::<f32>()
                                        + params_h[b.start + o];
                                acts_want[z.start + l] = zv;
                                if z != y {
                                    acts_want[y.start + l] = act.apply(zv);
                                }
                            }
                            poison.push((0, z.clone()));
                            if z != y {
                                poison.push((0, y.clone()));
                            }
                        }
                        Dir::InputGrad => {
                            dacts_want[x.clone()].copy_from_slice(&dx);
                            poison.push((1, x.clone()));
                            if let Some(p) = producer(step) {
                                let ps = &plan.steps[p];
                                let pz = r(ps.z_region);
                                for l in 0..batch * inp {
                                    dacts_want[pz.start + l] =
                                        dx[l] * ps.layer.activation().derivative(acts_h[pz.start + l], acts_h[x.start + l]);
                                }
                                poison.push((1, pz));
                            }
                        }
                        Dir::WeightGrad => {
                            for l in 0..out * inp {
                                let (o, i) = (l / inp, l % inp);
                                grads_want[w.start + l] =
                                    (0..batch).map(|s| dacts_h[z.start + s * out + o] * acts_h[x.start + s * inp + i]).sum();
                            }
                            for o in 0..out {
                                grads_want[b.start + o] = (0..batch).map(|s| dacts_h[z.start + s * out + o]).sum();
                            }
                            poison.push((2, w.clone()));
                            poison.push((2, b.clone()));
                        }
                    }
                    let poisoned_copy = |base: &[f32], which: usize| {
                        let mut v = base.to_vec();
                        for (_, range) in poison.iter().filter(|(b, _)| *b == which) {
                            v[range.clone()].fill(f32::NAN);
                        }
                        v
                    };
                    let routes = {
                        let f = Forward {
                            params: &params,
                            acts: &acts,
                            cols: &cols,
                            capacity,
                            batch,
                            dnn: None,
                            routes: None,
                            buffers: None,
                            draw: &draw,
                        };
                        let bw = Backward { dacts: &dacts, grads: &grads, dcols: &dcols, partials: &partials, ones: &ones };
                        let (a, bm) = operands(dir, &plan, step, &f, Some(&bw));
                        // as a model whose TF32 is on: the fused routes of either setting
                        let mut routes = gpu.dense_routes(&tuning, true, dir, problem(dir, (out, inp), batch), &a, &bm);
                        let on = On { gpu: &gpu, blas: &blas, stream: &stream, plan: &plan, f: &f };
                        routes.extend(lt_routes(&on, Some(&bw), step, dir, true).unwrap());
                        routes
                    };
                    // a forward as a training pass runs it and as an inference pass does (z
                    // not kept: not checked)
                    let modes: &[Mode] = if dir == Dir::Forward { &[Mode::Train, Mode::Infer] } else { &[Mode::Train] };
                    for (route, &mode) in routes.into_iter().flat_map(|route| modes.iter().map(move |mode| (route, mode))) {
                        let what = format!("step {index} ({inp}→{out}) {} on {} at {batch}, {mode:?}", dir.name(), route.name());
                        acts.upload(&stream, &poisoned_copy(&acts_h, 0)).unwrap();
                        dacts.upload(&stream, &poisoned_copy(&dacts_h, 1)).unwrap();
                        grads.upload(&stream, &poisoned_copy(&grads_h, 2)).unwrap();
                        {
                            let f = Forward {
                                params: &params,
                                acts: &acts,
                                cols: &cols,
                                capacity,
                                batch,
                                dnn: None,
                                routes: None,
                                buffers: None,
                                draw: &draw,
                            };
                            let bw = Backward { dacts: &dacts, grads: &grads, dcols: &dcols, partials: &partials, ones: &ones };
                            let on = On { gpu: &gpu, blas: &blas, stream: &stream, plan: &plan, f: &f };
                            match dir {
                                Dir::Forward => forward_on(&on, step, route, false, mode).unwrap(),
                                Dir::InputGrad => {
                                    if input_grad_on(&on, &bw, step, route).unwrap().is_none() {
                                        producer_activation(&on, &bw, step).unwrap();
                                    }
                                }
                                Dir::WeightGrad => weight_grad_on(&on, &bw, step, route, false, true).unwrap(),
                            }
                        }
                        let mut dacts_route = dacts_want.clone();
                        if dir == Dir::InputGrad && producer(step).is_some() && !route.leaves_producer() {
                            // the fused routes write the producer's dz alone
                            dacts_route[x.clone()].fill(f32::NAN);
                        }
                        let mut got = vec![0.0f32; acts_len];
                        acts.download(&stream, &mut got).unwrap();
                        if mode == Mode::Infer && z != y {
                            // a fused route writes y alone in inference: z as it was poisoned
                            if matches!(route, Route::Fused(_)) {
                                assert!(got[z.clone()].iter().all(|v| v.is_nan()), "{what}: z written in inference");
                            }
                            got[z.clone()].copy_from_slice(&acts_want[z.clone()]);
                        }
                        check(&format!("{what}: activations"), &got, &acts_want, 1e-5, 1e-5);
                        dacts.download(&stream, &mut got).unwrap();
                        check(&format!("{what}: activation gradients"), &got, &dacts_route, 1e-3, 1e-5);
                        let mut got = vec![0.0f32; plan.param_len];
                        grads.download(&stream, &mut got).unwrap();
                        check(&format!("{what}: gradients"), &got, &grads_want, 0.0, 0.0);
                        ran.push((dir, route));
                    }
                }
            }
        }
    }
    // every direction ran on cuBLAS, on some kernel of flatnn's, and on cuBLASLt where it loads
    for dir in Dir::ALL {
        assert!(ran.contains(&(dir, Route::Cublas)), "{} never ran on cuBLAS", dir.name());
        assert!(ran.iter().any(|&(d, r)| d == dir && matches!(r, Route::Fused(_))), "{} never ran fused", dir.name());
        let lt = ran.iter().any(|&(d, r)| d == dir && matches!(r, Route::Lt(_)));
        assert_eq!(lt, lt_present(), "{} on cuBLASLt", dir.name());
    }
}

/// `Cache::routes` of a GPU cache names every dense layer and direction of each batch size
/// bucket run, with the route chosen and its time: the forward alone after `forward`, all three
/// after a training step (the first layer's input gradient not needed); buckets by powers of
/// two, up to the capacity. A model with convolutions adds `conv_backends`' lines.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn routes_name_every_dense_layer_and_direction() {
    let _gpu = test_gpu();
    let device = crate::device::Device::Cuda(0);
    let model = crate::models::mlp().build().unwrap().init(Init::HeNormal, 3).to(&device).unwrap();
    let mut rng = Rng::new(5);
    let (mut fwd, mut bwd) = (model.preallocate(100).unwrap(), model.preallocate_grads(100).unwrap());
    for (batch, train) in [(1, false), (100, true), (70, false)] {
        let (x, labels) = crate::testutil::batch(&mut rng, &model, batch);
        fwd.set_inputs(&x).unwrap();
        fwd.set_labels(&labels).unwrap();
        if train {
            model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        }
        model.forward(&mut fwd).unwrap();
    }
    let report = fwd.routes();
    println!("{report}");
    let lines: Vec<&str> = report.lines().collect();
    // batch 1: the forwards measured; 65–100 (the bucket of 70 and 100): everything; a line
    // for each bucket with the time its measuring took
    assert_eq!(lines.len(), 2 * (1 + 3 * 3), "{report}");
    for (bucket, measured) in [("batch 1 FP32", [true, false, false]), ("batch 65–100 FP32", [true, true, true])] {
        assert!(lines.iter().any(|l| l.starts_with(&format!("{bucket}: dense routes measured in "))), "{report}");
        for (step, (inp, out)) in [(784, 128), (128, 64), (64, 10)].into_iter().enumerate() {
            for (dir, measured) in Dir::ALL.into_iter().zip(measured) {
                let head = format!("{bucket}, step {step} dense {inp}→{out}, {}: ", dir.name());
                let line = lines.iter().find(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("no line {head:?} in\n{report}"));
                let rest = &line[head.len()..];
                if !measured {
                    assert_eq!(rest, "not measured yet", "{line}");
                } else if dir == Dir::InputGrad && step == 0 {
                    assert_eq!(rest, "not needed", "{line}");
                } else {
                    assert!(rest.contains(" µs") && !rest.contains("NaN"), "{line}");
                }
            }
        }
    }
    // a model with convolutions: the dense lines, then the convolutions'
    let lenet = crate::models::lenet5().build().unwrap().init(Init::HeNormal, 3).to(&device).unwrap();
    let (mut fwd, mut bwd) = (lenet.preallocate(8).unwrap(), lenet.preallocate_grads(8).unwrap());
    let (x, labels) = crate::testutil::batch(&mut rng, &lenet, 8);
    fwd.set_inputs(&x).unwrap();
    fwd.set_labels(&labels).unwrap();
    lenet.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
    let report = fwd.routes();
    println!("{report}");
    assert!(report.ends_with(&fwd.conv_backends()) && report.contains("dense 84→10, weight gradient: "), "{report}");
}

/// C = A·B on the host, A (m × k) and B (k × n) row-major.
fn product(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    c
}

/// The fused kernels of each route of every direction (`Gpu::dense_routes`: row-chunked,
/// panels, the tensor-core tiles where the layout and alignment let them) against plain loops,
/// on small integers (so the products are exact) for every epilogue, with A and B each stored
/// either way, outputs poisoned. The routes are a TF32 model's, so the one-product tiles run
/// too, and must be exact as well: integers to ±4 are exact in TF32. Every tensor-core kernel
/// the device has runs on some shape.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn dense_products_and_their_epilogues_match_plain_loops() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(11);
    let tuning = Tuning::default();
    let shapes = [
        (1, 1, 1),
        (1, 128, 784),
        (3, 7, 5),
        (8, 33, 17),
        (9, 10, 1),
        (37, 65, 130),
        (128, 64, 128),
        (300, 10, 64),
        (200, 33, 300),
        (65, 16, 1),
        (150, 200, 100),
        (5, 9, 1500),
        // on the tensor-core tiles where A and B are laid out and aligned for them (asserted in
        // tensor_core_tiles_keep_fp32_accuracy), edges everywhere; the second, whose rows are
        // not 16-byte aligned, on the other kernels
        (300, 132, 500),
        (128, 784, 256),
        (256, 128, 256),
        (257, 67, 1001),
        (128, 128, 784),
    ];
    // the fused kernels of `dir`'s routes for these operands (each shape runs every kernel of
    // any layout, so each is tested)
    let kernels = |dir, (m, n, k), am: &DevMat, bm: &DevMat| -> Vec<Kernel> {
        let routes = gpu.dense_routes(&tuning, true, dir, (m, n, k), am, bm);
        routes.into_iter().filter_map(|r| if let Route::Fused(kernel) = r { Some(kernel) } else { None }).collect()
    };
    let mut ran = Vec::new();
    for (m, n, k) in shapes {
        let (a, b, bias) = (rng.ints(m * k), rng.ints(k * n), rng.ints(n));
        let c = product(m, n, k, &a, &b);
        let (ad, bd, biasd) = (upload(&stream, &a), upload(&stream, &b), upload(&stream, &bias));
        // A stored transposed: (k × m) row-major
        let at: Vec<f32> = (0..k * m).map(|l| a[(l % m) * k + l / m]).collect();
        let atd = upload(&stream, &at);
        // B stored transposed too (n × k row-major), as a dense layer's forward reads W
        let bt: Vec<f32> = (0..n * k).map(|l| b[(l % k) * n + l / k]).collect();
        let btd = upload(&stream, &bt);
        // A as stored, B as stored; A transposed, B as stored; A as stored, B transposed
        for (a_transposed, b_transposed) in [(false, false), (true, false), (false, true)] {
            let am =
                if a_transposed { DevMat { data: View::of(&atd), rs: 1, cs: m } } else { DevMat { data: View::of(&ad), rs: k, cs: 1 } };
            let bm =
                if b_transposed { DevMat { data: View::of(&btd), rs: 1, cs: k } } else { DevMat { data: View::of(&bd), rs: n, cs: 1 } };
            for kernel in kernels(Dir::Forward, (m, n, k), &am, &bm) {
                ran.push(kernel);
                let what = format!("dense {m}x{n}x{k} {kernel:?} A transposed {a_transposed}, B transposed {b_transposed}");
                // B and the epilogue's inputs read before the wait (as a layer's weights are) or after
                for (act, b_early) in [Identity, Relu, Tanh, Gelu].into_iter().flat_map(|act| [(act, false), (act, true)]) {
                    let what = format!("{what} b_early {b_early}");
                    let (mut z, mut y) = (upload(&stream, &poisoned(m * n)), upload(&stream, &poisoned(m * n)));
                    let epilogue =
                        DenseEpilogue::Forward { bias: View::of(&biasd), z: Some(ViewMut::of(&mut z)), y: Some(ViewMut::of(&mut y)), act };
                    gpu.dense_on(&stream, kernel, m, n, k, am, bm, epilogue, b_early).unwrap();
                    let z_want: Vec<f32> = c.iter().enumerate().map(|(l, v)| v + bias[l % n]).collect();
                    let y_want: Vec<f32> = z_want.iter().map(|&v| act.apply(v)).collect();
                    check(&format!("{what} forward z {act:?}"), &download(&stream, &z), &z_want, 0.0, 0.0);
                    let y_kept = download(&stream, &y);
                    check(&format!("{what} forward y {act:?}"), &y_kept, &y_want, 1e-6, 1e-6);
                    // without z (inference): the same y, bit for bit
                    let mut y = upload(&stream, &poisoned(m * n));
                    let epilogue = DenseEpilogue::Forward { bias: View::of(&biasd), z: None, y: Some(ViewMut::of(&mut y)), act };
                    gpu.dense_on(&stream, kernel, m, n, k, am, bm, epilogue, b_early).unwrap();
                    same_bits(&format!("{what} forward y {act:?} without z"), &download(&stream, &y), &y_kept);
                }
            }
            for kernel in kernels(Dir::InputGrad, (m, n, k), &am, &bm) {
                let what = format!("dense {m}x{n}x{k} {kernel:?} A transposed {a_transposed}, B transposed {b_transposed}");
                for (act, b_early) in [Identity, Relu, Tanh, Gelu].into_iter().flat_map(|act| [(act, false), (act, true)]) {
                    let what = format!("{what} b_early {b_early}");
                    // input gradient through the producer's activation, at its z and y
                    let zp: Vec<f32> = rng.uniform(m * n).iter().map(|v| 3.0 * v).collect();
                    let yp: Vec<f32> = zp.iter().map(|&v| act.apply(v)).collect();
                    let (zpd, ypd, mut dx) = (upload(&stream, &zp), upload(&stream, &yp), upload(&stream, &poisoned(m * n)));
                    let epilogue = DenseEpilogue::InputGrad { dx: ViewMut::of(&mut dx), prev: Some((View::of(&zpd), View::of(&ypd), act)) };
                    gpu.dense_on(&stream, kernel, m, n, k, am, bm, epilogue, b_early).unwrap();
                    let dx_want: Vec<f32> = (0..m * n).map(|l| c[l] * act.derivative(zp[l], yp[l])).collect();
                    // act' on the device and on the host differ by an ulp or two (expf; GELU's erf ~1e-7), so
                    // the products differ by as much relative to them
                    check(&format!("{what} input grad {act:?}"), &download(&stream, &dx), &dx_want, 1e-4, 1e-5);
                }
            }
            // weight gradient: dW = C, db = row sums of A; B read before the wait or after it
            let db_want: Vec<f32> = (0..m).map(|i| a[i * k..(i + 1) * k].iter().sum()).collect();
            for kernel in kernels(Dir::WeightGrad, (m, n, k), &am, &bm) {
                ran.push(kernel);
                let what = format!("dense {m}x{n}x{k} {kernel:?} A transposed {a_transposed}, B transposed {b_transposed}");
                for b_early in [false, true] {
                    let (mut dw, mut db) = (upload(&stream, &poisoned(m * n)), upload(&stream, &poisoned(m)));
                    let epilogue = DenseEpilogue::WeightGrad { dw: ViewMut::of(&mut dw), db: ViewMut::of(&mut db), cleared: false };
                    gpu.dense_on(&stream, kernel, m, n, k, am, bm, epilogue, b_early).unwrap();
                    check(&format!("{what} dW b_early {b_early}"), &download(&stream, &dw), &c, 0.0, 0.0);
                    check(&format!("{what} db b_early {b_early}"), &download(&stream, &db), &db_want, 0.0, 0.0);
                }
            }
        }
    }
    // the tiles from sm_80 on, those split over two blocks from sm_90 on
    let cc = gpu.compute_capability().0;
    for kernel in MMA_TILES.iter().flat_map(|t| t.kernels()).filter(|&k| cc >= 8 && (cc >= 9 || !Route::Fused(k).adds())) {
        assert!(ran.contains(&kernel), "{kernel:?} never ran");
    }
}

/// Narrow layers' weight gradients split over the batch in clusters (src/cuda/wgrad.rs) against
/// plain loops, one layer a launch and two: exact on small integers (every partial sum is an
/// integer below 2^24), with edges in rows, columns and samples, outputs poisoned; and on random
/// values within FP32's rounding of the f64 sums, the same bits in two runs. Shapes whose
/// blocks do not fit on this GPU at once are skipped, but some must run.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn split_weight_grads_match_plain_loops() {
    use crate::cuda::wgrad::Job;
    let gpu = test_gpu();
    let tuning = Tuning::from_env();
    if gpu.compute_capability().0 < 9 || !tuning.split_weight_grads {
        println!("skipped: needs sm_90 (clusters), or FLATNN_SPLIT=0");
        return;
    }
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(12);
    // (layers (out, in), batch): the MLP's last two layers together and alone; the fewest outputs;
    // two column groups; 130 and 7 columns together, over shares of 125 samples (not whole
    // chunks); shares of 512 samples but the last of 509; the 100-200-1's first layer (13 row
    // groups); rows of X of odd length (4-byte copies)
    let cases: [(&[(usize, usize)], usize); 8] = [
        (&[(10, 64), (64, 128)], 512),
        (&[(64, 128)], 1024),
        (&[(8, 200)], 257),
        (&[(16, 256)], 300),
        (&[(33, 130), (9, 7)], 1000),
        (&[(8, 5)], 4093),
        (&[(200, 100)], 1024),
        (&[(12, 63), (20, 129)], 2048),
    ];
    let mut ran = 0;
    for (layers, batch) in cases {
        if !gpu.weight_grad_split_fits(layers, &tuning) {
            println!("{layers:?} over {batch}: not on this GPU");
            continue;
        }
        ran += 1;
        // dZ and X of each layer, filled by `fill`; dW and db of each, from the GPU
        let run = |inputs: &[(Vec<f32>, Vec<f32>)]| {
            let data: Vec<_> = inputs.iter().map(|(dz, x)| (upload(&stream, dz), upload(&stream, x))).collect();
            let mut outs: Vec<_> =
                layers.iter().map(|&(out, inp)| (upload(&stream, &poisoned(out * inp)), upload(&stream, &poisoned(out)))).collect();
            let jobs: Vec<Job> = layers
                .iter()
                .zip(&data)
                .zip(&mut outs)
                .map(|((&(out, inp), (dz, x)), (dw, db))| Job {
                    out,
                    inp,
                    dz: View::of(dz),
                    x: View::of(x),
                    dw: ViewMut::of(dw),
                    db: ViewMut::of(db),
                })
                .collect();
            gpu.weight_grad_split(&stream, batch, &jobs).unwrap();
            drop(jobs);
            outs.iter().map(|(dw, db)| (download(&stream, dw), download(&stream, db))).collect::<Vec<_>>()
        };
        for integers in [true, false] {
            let mut fill = |n: usize| if integers { rng.ints(n) } else { rng.uniform(n) };
            let inputs: Vec<_> = layers.iter().map(|&(out, inp)| (fill(batch * out), fill(batch * inp))).collect();
            let (got, again) = (run(&inputs), run(&inputs));
            for ((&(out, inp), (dz, x)), ((dw, db), (dw2, db2))) in layers.iter().zip(&inputs).zip(got.iter().zip(&again)) {
                let what = format!("split dW {out}x{inp} over {batch} of {layers:?}, integers {integers}");
                same_bits(&format!("{what} dW"), dw, dw2);
                same_bits(&format!("{what} db"), db, db2);
                // dW[o][j] = Σ_s dZ[s][o]·X[s][j], db[o] = Σ_s dZ[s][o], in f64
                let dw_want: Vec<f32> = (0..out * inp)
                    .map(|l| (0..batch).map(|s| dz[s * out + l / inp] as f64 * x[s * inp + l % inp] as f64).sum::<f64>() as f32)
                    .collect();
                let db_want: Vec<f32> = (0..out).map(|o| (0..batch).map(|s| dz[s * out + o] as f64).sum::<f64>() as f32).collect();
                // integers: exact; random values: within FP32 rounding of batch-long sums
                let bound = if integers { 0.0 } else { 1e-6 * batch as f32 };
                check(&format!("{what} dW"), dw, &dw_want, bound, 0.0);
                check(&format!("{what} db"), db, &db_want, bound, 0.0);
            }
        }
    }
    assert!(ran > 0, "no shape ran split");
}

/// A product of many rows on each row-chunked kernel (one, four or eight columns per block)
/// gives, row by row, the bits of the same product one row at a time (`dense_row`): the kernels
/// sum every value in one order. Random values, so another order would show in the last bits.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn four_and_eight_columns_per_block_sum_in_the_order_of_one() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(14);
    for (m, n, k) in [(9, 10, 1300), (37, 65, 130), (64, 7, 300), (128, 33, 784), (128, 128, 784)] {
        let (a, w, bias) = (rng.uniform(m * k), rng.uniform(n * k), rng.uniform(n));
        let (ad, wd, bd) = (upload(&stream, &a), upload(&stream, &w), upload(&stream, &bias));
        // W stored n × k, as a dense layer's forward reads it
        let wm = DevMat { data: View::of(&wd), rs: 1, cs: k };
        let rows: Vec<Vec<f32>> = (0..m)
            .map(|i| {
                let row = upload(&stream, &a[i * k..(i + 1) * k]);
                let mut one = upload(&stream, &poisoned(n));
                let epilogue = DenseEpilogue::Forward { bias: View::of(&bd), z: Some(ViewMut::of(&mut one)), y: None, act: Identity };
                // B read before the wait here, after it below: the same sums
                gpu.dense_on(&stream, Kernel::DenseRow, 1, n, k, DevMat { data: View::of(&row), rs: k, cs: 1 }, wm, epilogue, true)
                    .unwrap();
                download(&stream, &one)
            })
            .collect();
        for kernel in [Kernel::DenseSkinny, Kernel::DenseSkinny4, Kernel::DenseSkinny8] {
            let mut all = upload(&stream, &poisoned(m * n));
            let epilogue = DenseEpilogue::Forward { bias: View::of(&bd), z: Some(ViewMut::of(&mut all)), y: None, act: Identity };
            gpu.dense_on(&stream, kernel, m, n, k, DevMat { data: View::of(&ad), rs: k, cs: 1 }, wm, epilogue, false).unwrap();
            let all = download(&stream, &all);
            for (i, row) in rows.iter().enumerate() {
                same_bits(&format!("{kernel:?} {m}x{n}x{k} row {i}"), row, &all[i * n..(i + 1) * n]);
            }
        }
    }
}
