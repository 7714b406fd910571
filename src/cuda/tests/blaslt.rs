//! cuBLASLt's algorithms (src/cuda/blaslt.rs) on the three products of a dense layer, laid out as
//! a step lays them out, against plain loops: every algorithm the heuristic offers, FP32 and
//! TF32, split-K reductions deterministic only and any, on odd sizes, one sample and over a
//! thousand; then each algorithm at smaller batches than the one it was offered for.

use super::{check, download, upload};
use crate::cuda::blas::{DevMat, DevMatMut};
use crate::cuda::blaslt::lt_present;
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::test_gpu;
use crate::testutil::{poisoned, Rng};

/// C (m × n) = A·B on the host, A element (i, p) at `a[i·ars + p·acs]`, B (p, j) at
/// `b[p·brs + j·bcs]`, plus `bias[j]` where given.
#[allow(clippy::too_many_arguments)]
fn product(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    (ars, acs): (usize, usize),
    b: &[f32],
    (brs, bcs): (usize, usize),
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * ars + p * acs] * b[p * brs + j * bcs]).sum::<f32>() + bias.map_or(0.0, |b| b[j]);
        }
    }
    c
}

/// Every cuBLASLt algorithm of each direction of dense layers of odd and round sizes, on small
/// integers (exact in TF32 too, and in any order of summation, so the check is `==`), the
/// output poisoned with NaN first: the forward with its bias in the epilogue, the input
/// gradient, the weight gradient. Then each at a smaller batch: computed right, or (where the
/// algorithm does not take it) refused with C untouched.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn every_cublaslt_algorithm_matches_plain_loops() {
    let gpu = test_gpu();
    if !lt_present() {
        println!("skipped: libcublasLt does not load here");
        return;
    }
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(17);
    let mut offered = 0;
    // (batch, in, out)
    for (batch, inp, out) in [(1, 37, 29), (13, 64, 32), (257, 33, 7), (1030, 256, 128)] {
        let (x, w, dz, bias) = (rng.ints(batch * inp), rng.ints(out * inp), rng.ints(batch * out), rng.ints(out));
        let (xd, wd, dzd, biasd) = (upload(&stream, &x), upload(&stream, &w), upload(&stream, &dz), upload(&stream, &bias));
        // (what, m, n, k, A, A's strides, B, B's strides, bias): Z = X·Wᵀ + b, dX = dZ·W, dW = dZᵀ·X
        let products = [
            ("forward", batch, out, inp, (&x, &xd), (inp, 1), (&w, &wd), (1, inp), true),
            ("input gradient", batch, inp, out, (&dz, &dzd), (out, 1), (&w, &wd), (inp, 1), false),
            ("weight gradient", out, inp, batch, (&dz, &dzd), (1, out), (&x, &xd), (inp, 1), false),
        ];
        for (what, m, n, k, (a, ad), a_strides, (b, bd), b_strides, with_bias) in products {
            for smaller in [batch, batch / 2, 1] {
                // the batch is m of the forward and input gradient, k of the weight gradient
                let (m_now, k_now) = if what == "weight gradient" { (m, smaller) } else { (smaller, k) };
                if m_now == 0 || k_now == 0 {
                    continue;
                }
                let want = product(m_now, n, k_now, a, a_strides, b, b_strides, with_bias.then_some(&bias[..]));
                for tf32 in [false, true] {
                    let blas = gpu.blas(&stream, tf32).unwrap();
                    for deterministic in [true, false] {
                        let am = DevMat { data: View::of(ad), rs: a_strides.0, cs: a_strides.1 };
                        let bm = DevMat { data: View::of(bd), rs: b_strides.0, cs: b_strides.1 };
                        let bias_view = with_bias.then(|| View::of(&biasd));
                        let mut c = upload(&stream, &poisoned(m * n));
                        let routes = {
                            let cm = DevMatMut { data: ViewMut::of(&mut c), rs: n, cs: 1 };
                            blas.lt_routes(m, n, k, &am, &bm, &cm, bias_view, deterministic).unwrap()
                        };
                        assert!(!routes.is_empty() || smaller != batch, "{what} {m}×{n}×{k}: no cuBLASLt algorithm");
                        offered += routes.len();
                        for route in routes {
                            let label = format!(
                                "{what} {m_now}×{n}×{k_now} (offered at {m}×{n}×{k}) {} tf32 {tf32} deterministic {deterministic}",
                                route.name()
                            );
                            let mut c = upload(&stream, &poisoned(m * n));
                            let ran = {
                                let cm = DevMatMut { data: ViewMut::of(&mut c), rs: n, cs: 1 };
                                blas.lt_matmul(route, m_now, n, k_now, am, bm, cm, bias_view).unwrap()
                            };
                            let got = download(&stream, &c);
                            if ran {
                                let mut want_all = poisoned(m * n);
                                want_all[..m_now * n].copy_from_slice(&want);
                                check(&label, &got, &want_all, 0.0, 0.0);
                            } else {
                                assert!(smaller != batch, "{label}: refused the product it was offered for");
                                assert!(got.iter().all(|v| v.is_nan()), "{label}: refused, yet wrote C");
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(offered > 0, "cuBLASLt offered no algorithm at all");
}
