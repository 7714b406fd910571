//! Both routes, on every kernel this CPU runs, against the plain loops.

use super::choice::Direction;
use super::*;
use crate::activation::Activation;
use crate::testutil::{poisoned, Rng};

/// Input pixel of tap (c, i, j) at output (y, x), if not padding.
fn source(s: &ConvShape, c: usize, i: usize, j: usize, y: usize, x: usize) -> Option<usize> {
    let iy = (y * s.stride.0 + i).checked_sub(s.padding.0).filter(|&v| v < s.height)?;
    let ix = (x * s.stride.1 + j).checked_sub(s.padding.1).filter(|&v| v < s.width)?;
    Some((c * s.height + iy) * s.width + ix)
}

/// Every (output index, weight index, input index) the convolution multiplies, over the batch:
/// the plain loop the spec walks.
fn taps(s: &ConvShape, batch: usize, mut f: impl FnMut(usize, usize, usize)) {
    let (kh, kw) = s.kernel;
    for b in 0..batch {
        for oc in 0..s.out_channels {
            for y in 0..s.oh() {
                for x in 0..s.ow() {
                    let out = b * s.out_len() + (oc * s.oh() + y) * s.ow() + x;
                    for c in 0..s.in_channels {
                        for i in 0..kh {
                            for j in 0..kw {
                                if let Some(src) = source(s, c, i, j, y, x) {
                                    f(out, ((oc * s.in_channels + c) * kh + i) * kw + j, b * s.in_len() + src);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The spec: z = conv(x), dw = Σ dz ⋆ x, dx = the transpose of the forward applied to dz.
fn spec(s: &ConvShape, batch: usize, w: &[f32], x: &[f32], dz: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut z, mut dw, mut dx) = (vec![0.0; batch * s.out_len()], vec![0.0; w.len()], vec![0.0; batch * s.in_len()]);
    taps(s, batch, |out, wi, xi| {
        z[out] += w[wi] * x[xi];
        dw[wi] += dz[out] * x[xi];
        dx[xi] += dz[out] * w[wi];
    });
    (z, dw, dx)
}

/// `w` packed for every route that serves the shape.
fn packed(isa: Isa, s: &ConvShape, w: &[f32]) -> ConvWeights {
    let mut weights = ConvWeights::new(isa, s).unwrap();
    weights.pack(w);
    if weights.has_winograd() {
        weights.pack_winograd(w);
    }
    weights
}

fn shape(c: usize, h: usize, w: usize, oc: usize, kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize)) -> ConvShape {
    ConvShape { in_channels: c, height: h, width: w, out_channels: oc, kernel, stride, padding }
}

/// Odd shapes: stride, padding (also past the kernel), 1×1, 3×3, 5×5, 1-D (H = 1) with k of 5
/// to 7, channels 1 to 32, output rows of 8, 16 and 32 (read by the GEMM in runs), and the
/// zoo's layers.
fn odd_shapes() -> Vec<ConvShape> {
    vec![
        shape(1, 5, 5, 2, (3, 3), (1, 1), (0, 0)),
        shape(3, 7, 6, 4, (3, 2), (2, 1), (1, 1)),
        shape(2, 9, 9, 3, (5, 5), (2, 2), (2, 2)),
        shape(2, 1, 1, 5, (1, 1), (1, 1), (0, 0)),
        shape(1, 28, 28, 6, (5, 5), (1, 1), (2, 2)),
        shape(2, 4, 5, 3, (2, 2), (3, 2), (2, 3)),
        shape(6, 14, 14, 16, (5, 5), (1, 1), (0, 0)),
        shape(32, 8, 8, 32, (3, 3), (1, 1), (1, 1)),
        shape(16, 10, 12, 8, (1, 1), (1, 1), (0, 0)),
        shape(2, 3, 4, 3, (2, 2), (1, 1), (3, 2)),
        shape(32, 1, 50, 16, (1, 5), (1, 1), (0, 2)),
        shape(1, 1, 40, 8, (1, 7), (1, 1), (0, 0)),
        shape(4, 1, 33, 6, (1, 6), (1, 2), (0, 1)),
        shape(3, 32, 32, 16, (3, 3), (1, 1), (1, 1)),
        shape(5, 6, 16, 7, (3, 3), (2, 1), (1, 1)),
        // for the Winograd route (kernels 3 wide, stride 1): kernel rows 5 and 1, an odd output
        // row (5, and 15 of a signal), padding past the kernel
        shape(4, 5, 7, 3, (5, 3), (1, 1), (2, 0)),
        shape(2, 6, 9, 5, (1, 3), (1, 1), (0, 2)),
        shape(3, 1, 17, 4, (1, 3), (1, 1), (0, 0)),
    ]
}

/// Small integers make every sum exact (and the Winograd route's halves too), so the routes must
/// give the spec's values exactly; each route in the directions it computes.
#[test]
fn every_route_matches_the_plain_loops_on_odd_shapes() {
    let mut rng = Rng::new(31);
    for s in odd_shapes() {
        for batch in [1, 2, 5] {
            let (w, x, dz) = (rng.ints(s.weights_len()), rng.ints(batch * s.in_len()), rng.ints(batch * s.out_len()));
            let (z_want, dw_want, dx_want) = spec(&s, batch, &w, &x, &dz);
            for (isa, threads) in Isa::runnable().into_iter().flat_map(|isa| [(isa, 1), (isa, 3)]) {
                let pool = Pool::new(threads).unwrap();
                let mut gemm = GemmWorkspace::with_isa(threads, isa).unwrap();
                let mut ws = ConvWorkspace::new(isa, &s, threads, 5).unwrap();
                let weights = packed(isa, &s, &w);
                for route in ConvRoute::ALL.into_iter().filter(|r| r.serves(&s, Direction::Forward)) {
                    let what = format!("{route:?} {isa:?} {threads} threads, batch {batch}, {s:?}");
                    // each sample's rows whole, in 2 parts, and a part a row
                    for parts in [1, 2, s.oh()].into_iter().filter(|&p| p <= s.oh()) {
                        ws.scratch.fill(f32::NAN);
                        let mut z = poisoned(batch * s.out_len() + 3);
                        forward(route, &pool, &mut gemm, &mut ws, &weights, (batch, parts), &x, &Epilogue::NONE, &mut z, None);
                        assert_eq!(&z[..batch * s.out_len()], &z_want[..], "forward {what} in {parts} parts");
                        assert!(z[batch * s.out_len()..].iter().all(|v| v.is_nan()), "forward {what}: wrote past the batch");
                    }
                    if !route.serves(&s, Direction::Backward { input_grad: true }) {
                        continue;
                    }
                    let (mut dw, mut dx) = (poisoned(w.len()), poisoned(x.len() + 3));
                    backward(route, &pool, &mut gemm, &mut ws, &weights, batch, &x, &dz, &mut dw, Some(&mut dx));
                    assert_eq!(dw, dw_want, "dW {what}");
                    assert_eq!(&dx[..x.len()], &dx_want[..], "dX {what}");
                    assert!(dx[x.len()..].iter().all(|v| v.is_nan()), "dX {what}: wrote past the batch");
                    let mut dw_only = poisoned(w.len());
                    backward(route, &pool, &mut gemm, &mut ws, &weights, batch, &x, &dz, &mut dw_only, None);
                    assert_eq!(dw_only, dw_want, "dW alone {what}");
                }
            }
        }
    }
}

/// Every epilogue (a bias, a scale and shift, a skip; ReLU, tanh or none; y apart or the
/// activation in place) on every route against the spec's z and the formula, value by value:
/// small integers make the products, scales, shifts and sums exact, and the activation is
/// `apply_slice` of the spec's values, so `==` holds. The shapes add outputs of several blocks
/// (2-D, and a single row in parts) to the odd ones, on both of the direct route's paths, each
/// sample's rows whole and in parts; y past the batch is never written.
#[test]
fn the_epilogue_matches_the_formula_on_every_route() {
    let mut rng = Rng::new(34);
    let mut shapes = odd_shapes();
    // several blocks: rows of 48 (runs the GEMM reads in place), of 60 (flat, then copied), and
    // single rows of 1100 and 1099 (in parts; of an odd length)
    shapes.extend([shape(3, 48, 48, 8, (3, 3), (1, 1), (1, 1)), shape(2, 60, 60, 8, (3, 3), (1, 1), (1, 1))]);
    shapes.extend([shape(2, 1, 1100, 16, (1, 3), (1, 1), (0, 1)), shape(2, 1, 1099, 16, (1, 3), (1, 1), (0, 1))]);
    for s in shapes {
        let (isa, batch, oc, out_len) = (Isa::best(), 3, s.out_channels, s.out_len());
        let (w, x, skip) = (rng.ints(s.weights_len()), rng.ints(batch * s.in_len()), rng.ints(batch * out_len));
        let (scale, shift) = (rng.ints(oc), rng.ints(oc));
        let z_spec = spec(&s, batch, &w, &x, &vec![0.0; batch * out_len]).0;
        let threads = 2;
        let (pool, mut gemm) = (Pool::new(threads).unwrap(), GemmWorkspace::with_isa(threads, isa).unwrap());
        let mut ws = ConvWorkspace::new(isa, &s, threads, 0).unwrap();
        let weights = packed(isa, &s, &w);
        let plane = out_len / oc;
        let cases = [
            (None, Some(&shift[..]), None, Activation::Relu, true),
            (Some(&scale[..]), Some(&shift[..]), None, Activation::Relu, false),
            (Some(&scale[..]), Some(&shift[..]), Some(&skip[..]), Activation::Relu, false),
            (None, Some(&shift[..]), Some(&skip[..]), Activation::Identity, false),
            (Some(&scale[..]), None, None, Activation::Tanh, true),
            (None, Some(&shift[..]), Some(&skip[..]), Activation::Tanh, false),
        ];
        for (scale, shift, skip, act, apart) in cases {
            let want_z: Vec<f32> = (0..batch * out_len)
                .map(|i| {
                    let c = i % out_len / plane;
                    let v = match (scale, shift) {
                        (Some(sc), Some(sh)) => z_spec[i] * sc[c] + sh[c],
                        (Some(sc), None) => z_spec[i] * sc[c],
                        (None, Some(sh)) => z_spec[i] + sh[c],
                        (None, None) => z_spec[i],
                    };
                    skip.map_or(v, |k| v + k[i])
                })
                .collect();
            let mut want_y = vec![0.0; want_z.len()];
            act.apply_slice(&want_z, &mut want_y);
            let epilogue = Epilogue { scale, shift, skip, act };
            let routes = ConvRoute::ALL.into_iter().filter(|r| r.serves(&s, Direction::Forward));
            for (route, parts) in routes.flat_map(|r| [(r, 1), (r, 3.min(s.oh()))]) {
                let what = format!(
                    "{route:?} in {parts} parts, {act:?}, scale {}, skip {}, y apart {apart}, {s:?}",
                    scale.is_some(),
                    skip.is_some()
                );
                ws.scratch.fill(f32::NAN);
                let (mut z, mut y) = (poisoned(batch * out_len + 3), poisoned(batch * out_len + 3));
                let y_out = apart.then_some(&mut y[..]);
                forward(route, &pool, &mut gemm, &mut ws, &weights, (batch, parts), &x, &epilogue, &mut z, y_out);
                let (z, y) = if apart { (&z, &y) } else { (&y, &z) };
                if apart {
                    assert_eq!(&z[..batch * out_len], &want_z[..], "z of {what}");
                } else {
                    assert!(z.iter().all(|v| v.is_nan()), "{what}: y written with the activation in place");
                }
                assert_eq!(&y[..batch * out_len], &want_y[..], "y of {what}");
                assert!(y[batch * out_len..].iter().all(|v| v.is_nan()), "{what}: wrote past the batch");
            }
        }
    }
}

/// Real values: each route's bits are the same on 1 to 4 threads, with each sample's rows whole
/// or in parts (as many as fill the pool, and one a row).
#[test]
fn each_route_gives_the_same_bits_on_any_thread_count_and_split() {
    let mut rng = Rng::new(32);
    let shapes = [
        shape(6, 14, 14, 16, (5, 5), (1, 1), (0, 0)),
        shape(3, 9, 8, 5, (3, 3), (2, 2), (1, 1)),
        shape(4, 9, 8, 5, (3, 3), (1, 1), (1, 1)),
    ];
    for s in shapes {
        let batch = 7;
        let (w, x, dz) = (rng.uniform(s.weights_len()), rng.uniform(batch * s.in_len()), rng.uniform(batch * s.out_len()));
        for route in ConvRoute::ALL.into_iter().filter(|r| r.serves(&s, Direction::Forward)) {
            // the bits of the first run, at batches of 1 and 7 samples
            type Bits = (Vec<u32>, Vec<u32>, Vec<u32>);
            let mut first: [Option<Bits>; 2] = [None, None];
            for threads in 1..=4 {
                let (isa, pool) = (Isa::best(), Pool::new(threads).unwrap());
                let (mut gemm, mut ws) =
                    (GemmWorkspace::with_isa(threads, isa).unwrap(), ConvWorkspace::new(isa, &s, threads, batch).unwrap());
                let weights = packed(isa, &s, &w);
                let (mut dw, mut dx) = (poisoned(w.len()), poisoned(x.len()));
                if route.serves(&s, Direction::Backward { input_grad: true }) {
                    backward(route, &pool, &mut gemm, &mut ws, &weights, batch, &x, &dz, &mut dw, Some(&mut dx));
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for (samples, parts) in [1, 7].into_iter().flat_map(|b| [(b, 1), (b, split::filling(&s, b, threads)), (b, s.oh())]) {
                    let mut z = poisoned(batch * s.out_len());
                    forward(route, &pool, &mut gemm, &mut ws, &weights, (samples, parts), &x, &Epilogue::NONE, &mut z, None);
                    let got = (bits(&z[..samples * s.out_len()]), bits(&dw), bits(&dx));
                    let what = format!("{route:?} {s:?}, {samples} samples in {parts} parts");
                    assert!(z[..samples * s.out_len()].iter().all(|v| !v.is_nan()), "{what}: a value not written");
                    let first = first[usize::from(samples > 1)].get_or_insert_with(|| got.clone());
                    assert!(*first == got, "{what}: bits differ from 1 thread's, one part a sample, on {threads} threads");
                }
            }
        }
    }
}

#[test]
fn routes_agree_on_real_values() {
    let mut rng = Rng::new(33);
    let s = shape(16, 16, 16, 32, (3, 3), (1, 1), (1, 1));
    let batch = 3;
    let (w, x, dz) = (rng.uniform(s.weights_len()), rng.uniform(batch * s.in_len()), rng.uniform(batch * s.out_len()));
    let (isa, pool) = (Isa::best(), Pool::new(2).unwrap());
    let (mut gemm, mut ws) = (GemmWorkspace::with_isa(2, isa).unwrap(), ConvWorkspace::new(isa, &s, 2, batch).unwrap());
    let weights = packed(isa, &s, &w);
    let mut out = Vec::new();
    for route in [ConvRoute::Lowered, ConvRoute::Direct] {
        let (mut z, mut dw, mut dx) = (poisoned(batch * s.out_len()), poisoned(w.len()), poisoned(x.len()));
        forward(route, &pool, &mut gemm, &mut ws, &weights, (batch, 1), &x, &Epilogue::NONE, &mut z, None);
        backward(route, &pool, &mut gemm, &mut ws, &weights, batch, &x, &dz, &mut dw, Some(&mut dx));
        out.push((z, dw, dx));
    }
    let (a, b) = (&out[0], &out[1]);
    crate::testutil::assert_close(&a.0, &b.0, 1e-5, 1e-5, "z");
    crate::testutil::assert_close(&a.1, &b.1, 1e-4, 1e-5, "dW");
    crate::testutil::assert_close(&a.2, &b.2, 1e-5, 1e-5, "dX");
    let mut z = poisoned(batch * s.out_len());
    forward(ConvRoute::Winograd, &pool, &mut gemm, &mut ws, &weights, (batch, 1), &x, &Epilogue::NONE, &mut z, None);
    crate::testutil::assert_close(&z, &a.0, 1e-5, 1e-5, "Winograd z");
}

#[test]
fn weights_packed_for_another_kernel_are_refused() {
    let s = shape(1, 5, 5, 2, (3, 3), (1, 1), (0, 0));
    let Some(&other) = Isa::runnable().iter().find(|&&i| i != Isa::Portable) else { return };
    let (pool, mut gemm) = (Pool::new(1).unwrap(), GemmWorkspace::with_isa(1, Isa::Portable).unwrap());
    let mut ws = ConvWorkspace::new(Isa::Portable, &s, 1, 1).unwrap();
    let weights = ConvWeights::new(other, &s).unwrap();
    let (x, mut z) = (vec![0.0; s.in_len()], poisoned(s.out_len()));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        forward(ConvRoute::Direct, &pool, &mut gemm, &mut ws, &weights, (1, 1), &x, &Epilogue::NONE, &mut z, None)
    }));
    let msg = r.expect_err("a mismatch must panic").downcast::<String>().expect("a message");
    assert!(msg.contains("packed for another kernel"), "{msg}");
    assert!(z.iter().all(|v| v.is_nan()), "z written before the panic");
}

#[test]
fn a_kernel_larger_than_the_padded_input_is_an_error() {
    let r = ConvWorkspace::new(Isa::best(), &shape(1, 2, 2, 1, (4, 4), (1, 1), (0, 0)), 1, 1);
    assert!(matches!(r, Err(Error::Shape(_))), "{:?}", r.err());
}
