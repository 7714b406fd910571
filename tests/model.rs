//! What a user sees of a model as a value: its summary, a copy of it, and one model shared by
//! threads, each with its own cache.

use flatnn::prelude::*;
use flatnn::testutil::Rng;

fn small() -> Chain {
    Chain::new(Input::image(2, 8, 8))
        .conv_with(4, (3, 3), Relu, ConvOptions { stride: (1, 1), padding: (1, 1) })
        .max_pool_with((2, 2), (2, 1))
        .flatten()
        .dense(1000, LeakyRelu(0.1))
        .dense(3, Identity)
}

#[test]
fn the_summary_is_a_table_of_layers_with_totals_and_device() {
    let model = small().build().unwrap().with_threads(1).unwrap();
    let want = "\
#  layer                              output        parameters  activation
   input                              image(2×8×8)
0  Conv(2 → 4, 3×3, stride 1, pad 1)  image(4×8×8)          76  relu
1  MaxPool(2×2, stride 2×1)           image(4×4×7)           0
2  Flatten                            vector(112)            0
3  Dense(112 → 1000)                  vector(1000)     113,000  leaky_relu:0.1
4  Dense(1000 → 3)                    vector(3)          3,003  identity
116,079 parameters (453.4 KiB), on cpu (1 thread)";
    assert_eq!(model.to_string(), want);
    assert_eq!(model.plan().param_len, 116_079);
}

#[test]
fn a_clone_has_parameters_of_its_own() {
    let mut model = small().build().unwrap().init(Init::HeNormal, 3).with_threads(1).unwrap();
    let copy = model.clone();
    assert_eq!(copy.parameters().unwrap(), model.parameters().unwrap());
    model.parameters_mut().unwrap()[0] += 1.0;
    assert_ne!(copy.parameters().unwrap()[0], model.parameters().unwrap()[0]);
    // the same plan: the original's cache serves the copy
    let mut fwd = model.preallocate(2).unwrap();
    fwd.set_inputs(&Rng::new(1).uniform(2 * 128)).unwrap();
    assert_eq!(copy.forward(&mut fwd).unwrap().len(), 6);
}

/// `Model` is `Send + Sync`: four threads share one model, each with its own cache, and get
/// what one thread gets for their batches, bit for bit.
#[test]
fn threads_share_a_model_with_a_cache_each() {
    fn shared<T: Send + Sync>() {}
    shared::<Model>();
    let model = small().build().unwrap().init(Init::HeNormal, 3).with_threads(2).unwrap();
    let batches: Vec<Vec<f32>> = (0..4).map(|i| Rng::new(i).uniform(5 * 128)).collect();
    let run = |x: &[f32]| {
        let mut fwd = model.preallocate(5).unwrap();
        fwd.set_inputs(x).unwrap();
        model.forward(&mut fwd).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    let alone: Vec<_> = batches.iter().map(|x| run(x)).collect();
    let together: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = batches.iter().map(|x| s.spawn(|| run(x))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
}

/// On a GPU: the summary names the device, and `clone` refuses (a copy there could fail:
/// `Model::to` reports it) rather than copy to the host unasked.
#[cfg(feature = "cuda")]
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn on_a_gpu_the_summary_names_it_and_clone_refuses() {
    let device = flatnn::testutil::cuda_device();
    let model = small().build().unwrap().to(&device).unwrap();
    assert!(model.to_string().ends_with(&format!("on {device}")), "{model}");
    assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.clone())).is_err());
    assert_eq!(model.to(&device).unwrap().device(), device);
}
