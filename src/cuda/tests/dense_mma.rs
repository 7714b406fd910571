//! The dense layer's tensor-core tiles on the GPU (kernels/dense_mma.cu): their accuracy in
//! 3xTF32 and in one TF32 product against f64 sums, and which models measure the one-product
//! kernels. Their exact results on every route and epilogue are checked in `dense`.

use super::{download, upload};
use crate::activation::Activation::Identity;
use crate::cuda::blas::DevMat;
use crate::cuda::context::Kernel;
use crate::cuda::dense::{DenseEpilogue, Route, MMA_TILES};
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::options::GpuOptions;
use crate::cuda::test_gpu;
use crate::init::Init;
use crate::testutil::{poisoned, Rng};

/// The tensor-core tiles against products in f64 on random values, every tile in the two
/// layouts they take (a forward's: A and B contiguous along k; a weight gradient's: A along m,
/// B along n, also split over two blocks on sm_90 and later), outputs poisoned. The 3xTF32
/// kernels: no output errs by more than twice the worst error of the same sums in FP32 one
/// after the other on the CPU, plus 1e-9 of Σ |a·b| (one TF32 product alone would err by about
/// 1e-4 of it, so dropping the small parts of the split would fail). The one-product (`_tf32`)
/// kernels: within 2e-3 of Σ |a·b| (each input rounded to TF32's 11 significant bits errs by at
/// most 2^-11 of itself, so each product by about 2^-10 of |a·b| and the sum by about 1e-3 of
/// Σ |a·b| at worst, plus FP32's rounding of the sums), and above the 3xTF32 bound (they do
/// take one product). The shapes have edges in rows, columns and k for some tile, and k of one
/// slice (the second block of a split tile has none) to 13.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn tensor_core_tiles_keep_fp32_or_tf32_accuracy() {
    let gpu = test_gpu();
    if gpu.compute_capability().0 < 8 {
        println!("skipped: no tensor cores with TF32 (sm_80) on this device");
        return;
    }
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(17);
    let splits = if gpu.compute_capability().0 >= 9 { 2 } else { 1 };
    for (m, n, k) in [(300, 132, 500), (1024, 128, 784), (128, 784, 512), (200, 128, 784), (48, 1408, 784), (40, 24, 60)] {
        let (a, b) = (rng.uniform(m * k), rng.uniform(k * n));
        let (mut want, mut scale, mut fp32) = (vec![0.0f64; m * n], vec![0.0f64; m * n], vec![0.0f32; m * n]);
        for i in 0..m {
            for p in 0..k {
                let av = a[i * k + p];
                for j in 0..n {
                    let ab = av as f64 * b[p * n + j] as f64;
                    want[i * n + j] += ab;
                    scale[i * n + j] += ab.abs();
                    fp32[i * n + j] += av * b[p * n + j];
                }
            }
        }
        let worst = |got: &[f32]| {
            // a NaN (an output never written) counts as the worst error
            let error = |l: usize| Some((got[l] as f64 - want[l]).abs() / scale[l]).filter(|e| !e.is_nan()).unwrap_or(f64::INFINITY);
            (0..m * n).map(error).fold(0.0f64, f64::max)
        };
        let fp32_bound = 2.0 * worst(&fp32) + 1e-9;
        let at: Vec<f32> = (0..k * m).map(|l| a[(l % m) * k + l / m]).collect();
        let bt: Vec<f32> = (0..n * k).map(|l| b[(l % k) * n + l / k]).collect();
        let (ad, atd, bd, btd) = (upload(&stream, &a), upload(&stream, &at), upload(&stream, &b), upload(&stream, &bt));
        let zero = upload(&stream, &vec![0.0f32; n]);
        let forward = (DevMat { data: View::of(&ad), rs: k, cs: 1 }, DevMat { data: View::of(&btd), rs: 1, cs: k });
        let weight_grad = (DevMat { data: View::of(&atd), rs: 1, cs: m }, DevMat { data: View::of(&bd), rs: n, cs: 1 });
        for (layout, (am, bm)) in [("forward", forward), ("weight gradient", weight_grad)] {
            let kernels = MMA_TILES.into_iter().flat_map(|tile| {
                let kernels: Vec<Kernel> = if layout == "forward" {
                    tile.forward.into_iter().collect()
                } else {
                    [tile.weight_grad].into_iter().chain(tile.weight_grad_split).collect()
                };
                kernels.into_iter().take(splits).map(move |kernel| (tile, kernel))
            });
            for (tile, kernel) in kernels {
                let got = if Some(kernel) != tile.forward {
                    // a weight gradient's layout takes only its epilogue (a split tile adds
                    // into dW): dW is the product, its db the column of ones' (not checked here)
                    let (mut dw, mut db) = (upload(&stream, &poisoned(m * n)), upload(&stream, &poisoned(m)));
                    let epilogue = DenseEpilogue::WeightGrad { dw: ViewMut::of(&mut dw), db: ViewMut::of(&mut db), cleared: false };
                    gpu.dense_on(&stream, kernel, m, n, k, am, bm, epilogue, false).unwrap();
                    worst(&download(&stream, &dw))
                } else {
                    let mut z = upload(&stream, &poisoned(m * n));
                    let epilogue = DenseEpilogue::Forward { bias: View::of(&zero), z: Some(ViewMut::of(&mut z)), y: None, act: Identity };
                    gpu.dense_on(&stream, kernel, m, n, k, am, bm, epilogue, false).unwrap();
                    worst(&download(&stream, &z))
                };
                println!("{kernel:?} {m}x{n}x{k}: worst error {got:e} of sum |a b| (FP32 in order: {:e})", (fp32_bound - 1e-9) / 2.0);
                let bound = if tile.tf32 { 2e-3 } else { fp32_bound };
                assert!(got <= bound, "{kernel:?} {m}x{n}x{k}: error {got:e} of sum |a b|, over {bound:e}");
                assert!(!tile.tf32 || got > fp32_bound, "{kernel:?} {m}x{n}x{k}: error {got:e}, within 3xTF32's {fp32_bound:e}");
            }
        }
    }
}

/// Only a model that allows TF32 measures the one-product tensor-core tiles (`_tf32`): with
/// TF32 on, the MLP's first forward (X and W laid out and aligned for the tiles) lists them
/// among the routes it timed, beside the 3xTF32 tiles (sm_80 on); with it off, no route report
/// names one. Which route wins is measured, so their results are checked route by route (in
/// `dense`, every_route_of_every_direction_matches_plain_loops).
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn only_models_that_allow_tf32_measure_the_one_product_tiles() {
    let gpu = test_gpu();
    let device = crate::device::Device::Cuda(0);
    let mut rng = Rng::new(8);
    let tiles = gpu.compute_capability().0 >= 8;
    for tf32 in [false, true] {
        let options = GpuOptions { tf32, ..GpuOptions::default() };
        let model = crate::models::mlp().build().unwrap().init(Init::HeNormal, 3).with_gpu_options(options).unwrap();
        let model = model.to(&device).unwrap();
        let mut fwd = model.preallocate(100).unwrap();
        fwd.set_inputs(&crate::testutil::batch(&mut rng, &model, 100).0).unwrap();
        model.forward(&mut fwd).unwrap();
        let report = fwd.routes();
        println!("{report}");
        assert_eq!(report.contains("_tf32"), tf32 && tiles, "{report}");
        let first = report.lines().find(|l| l.contains("step 0 dense 784→128, forward: ")).unwrap_or_else(|| panic!("{report}"));
        for kernel in MMA_TILES.iter().filter(|t| tiles && (tf32 || !t.tf32)).filter_map(|t| t.forward) {
            assert!(first.contains(&format!("{} ", Route::Fused(kernel).name())), "{kernel:?} not measured: {first}");
        }
    }
}
