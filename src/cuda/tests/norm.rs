//! Batch norm's fused route (each training pass in one launch, a cluster of P blocks a channel:
//! src/cuda/routes/norm.rs) against its split route, which tests/layers.rs checks against the
//! CPU.

use super::{check, download, same_bits, upload};
use crate::activation::Activation;
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::layers::batch_norm_parts;
use crate::cuda::test_gpu;
use crate::layers::batch_norm::Geometry;
use crate::testutil::{poisoned, Rng};
use cudarc::driver::CudaSlice;

/// What a training forward and backward give, in this order (each with the NaN past its end:
/// nothing written there).
const OUTPUTS: [&str; 11] = ["mean", "inv", "running mean", "running var", "count", "z", "y", "dz", "dgamma", "dbeta", "dx"];

/// The fused route with P = 1, 2, 4, 8 blocks a channel (up to the batch; past 1 where the
/// device has clusters) against the split route: the statistics, running statistics and
/// count, z and y = ReLU(z), then dz = dy ⊙ ReLU'(z), dγ, dβ and dx; values about 1000 with a
/// spread of 1. P = 1 gives the split route's bits where that route sums in one part; every
/// other P is within the sums' rounding. Shapes: resnet_small's 16 × 32 × 32 at 1 and at 8 (the
/// split route sums that in two parts), 7 × 7 planes (one value at a time), a vector's
/// features, 9 samples over 8 blocks (the last parts empty); each with every pointer aligned
/// and one float past alignment. Two runs give the same bits, and so does a backward that
/// reads dz as stored instead of computing it.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn fused_batch_norm_matches_the_split_route() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(21);
    let act = Activation::Relu;
    for (channels, pixels, batch) in [(16, 1024, 1), (16, 1024, 8), (3, 49, 5), (10, 1, 37), (2, 64, 9)] {
        let g = Geometry { channels, pixels, batch };
        let n = batch * channels * pixels;
        let x: Vec<f32> = rng.uniform(n).iter().map(|v| 1000.0 + v).collect();
        let (dy, gamma, beta) = (rng.uniform(n), rng.uniform(channels), rng.uniform(channels));
        let running_mean = rng.uniform(channels);
        let running_var: Vec<f32> = rng.uniform(channels).iter().map(|v| 1.5 + v).collect();
        let split_parts = batch_norm_parts(&g).0;
        for offset in [0, 1] {
            // `v` at `offset` floats into a buffer with a NaN past it
            let padded = |v: &[f32]| upload(&stream, &[&vec![f32::NAN; offset][..], v, &[f32::NAN]].concat());
            let fresh = |len: usize| upload(&stream, &poisoned(offset + len + 1));
            // SAFETY (both): views of `len` values `offset` floats into live buffers longer than that
            let view = |b: &CudaSlice<f32>, len: usize| unsafe { View::<f32>::from_raw(View::of(b).ptr() + 4 * offset as u64, len) };
            let view_mut = |b: &CudaSlice<f32>, len: usize| unsafe { ViewMut::<f32>::from_raw(View::of(b).ptr() + 4 * offset as u64, len) };
            let (xd, dyd, gd, bd) = (padded(&x), padded(&dy), padded(&gamma), padded(&beta));
            // one route's outputs (`parts`: None, split; Some(P), fused); `dz_stored`: the
            // backward reads these as dz instead of computing it (fused only)
            let run = |parts: Option<usize>, dz_stored: Option<&[f32]>| -> Vec<Vec<f32>> {
                let (mean, inv, rm, rv, count) =
                    (fresh(channels), fresh(channels), padded(&running_mean), padded(&running_var), padded(&[5.0]));
                let (z, y, dx, dgamma, dbeta) = (fresh(n), fresh(n), fresh(n), fresh(channels), fresh(channels));
                let dz = dz_stored.map_or_else(|| fresh(n), padded);
                let mut partials = upload(&stream, &vec![f64::NAN; 2 * split_parts * channels]);
                let running = [view_mut(&rm, channels), view_mut(&rv, channels), view_mut(&count, 1)];
                let (stats, saved) = ((view_mut(&mean, channels), view_mut(&inv, channels)), (view(&mean, channels), view(&inv, channels)));
                let out = (view_mut(&z, n), Some((view_mut(&y, n), act)));
                let affine = (view(&gd, channels), view(&bd, channels));
                let param_grads = (view_mut(&dgamma, channels), view_mut(&dbeta, channels));
                let from_dy = dz_stored.is_none().then(|| (view(&z, n), view(&y, n), view(&dyd, n), act));
                match parts {
                    None => {
                        gpu.batch_norm_stats(&stream, &g, view(&xd, n), stats, running, Some(ViewMut::of(&mut partials))).unwrap();
                        gpu.batch_norm_apply(&stream, &g, view(&xd, n), out, saved, affine, false).unwrap();
                        let (zv, yv, dyv, act) = from_dy.expect("the split route computes dz");
                        gpu.act_backward(&stream, act, n, zv, yv, dyv, view_mut(&dz, n)).unwrap();
                        let inputs = (view(&xd, n), view(&dz, n));
                        gpu.batch_norm_param_grads(&stream, &g, inputs, saved, param_grads, Some(ViewMut::of(&mut partials))).unwrap();
                        let sums = (view(&dgamma, channels), view(&dbeta, channels));
                        gpu.batch_norm_input_grad(&stream, &g, view(&xd, n), view(&dz, n), view_mut(&dx, n), saved, affine.0, sums)
                            .unwrap();
                    }
                    Some(p) => {
                        gpu.batch_norm_train_forward(&stream, &g, p, view(&xd, n), out, stats, running, affine).unwrap();
                        let dz = (from_dy, view_mut(&dz, n));
                        gpu.batch_norm_train_backward(
                            &stream,
                            &g,
                            p,
                            view(&xd, n),
                            dz,
                            Some(view_mut(&dx, n)),
                            saved,
                            affine.0,
                            param_grads,
                        )
                        .unwrap();
                    }
                }
                [&mean, &inv, &rm, &rv, &count, &z, &y, &dz, &dgamma, &dbeta, &dx].map(|b| download(&stream, b)[offset..].to_vec()).to_vec()
            };
            let split = run(None, None);
            for got in &split {
                assert!(got.last().is_some_and(|v| v.is_nan()), "the split route wrote past its values");
            }
            for p in [1, 2, 4, 8].into_iter().filter(|&p| p <= batch && (p == 1 || gpu.has_clusters())) {
                let what = format!("batch norm {channels}x{pixels}x{batch}, offset {offset}, fused{p}");
                let fused = run(Some(p), None);
                for ((name, got), want) in OUTPUTS.iter().zip(&fused).zip(&split) {
                    let what = format!("{what}: {name}");
                    assert!(got.last().is_some_and(|v| v.is_nan()), "{what}: wrote past its values");
                    if p == 1 && split_parts == 1 {
                        same_bits(&what, got, want);
                    } else {
                        // a statistic a ulp apart moves z, y and dx by as much times r (≈ 3.5)
                        check(&what, got, want, 5e-4, 2e-6);
                    }
                }
                let again = run(Some(p), None);
                let stored = run(Some(p), Some(&fused[7][..n]));
                for (i, name) in OUTPUTS.iter().enumerate() {
                    same_bits(&format!("{what}, run twice: {name}"), &again[i], &fused[i]);
                    if i >= 8 {
                        same_bits(&format!("{what}, dz read as stored: {name}"), &stored[i], &fused[i]);
                    }
                }
            }
        }
    }
}
