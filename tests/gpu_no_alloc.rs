//! A GPU training step allocates nothing on the host and leaves the device's free memory as it
//! was, over 1,000 steps. Its own test binary: no other test allocates device memory while the
//! free memory is read. Prints `skipped: no CUDA device` and passes where CUDA is missing.
#![cfg(feature = "cuda")]

use flatnn::models::{lenet5, mlp};
use flatnn::prelude::*;
use flatnn::testutil::{allocations_in, cuda_or_skip, Counting, Rng};

#[global_allocator]
static COUNTING: Counting = Counting;

#[test]
fn a_gpu_step_allocates_nothing_and_device_memory_stays_put() {
    let Some(device) = cuda_or_skip() else { return };
    for (name, chain) in [("mlp", mlp()), ("lenet", lenet5())] {
        for graphs in [true, false] {
            let model = chain.clone().build().unwrap().init(Init::HeNormal, 1);
            let mut model = model.with_gpu_options(GpuOptions { graphs, tf32: false }).unwrap().to(&device).unwrap();
            let (mut fwd, mut bwd) = (model.preallocate(64).unwrap(), model.preallocate_grads(64).unwrap());
            let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
            let mut rng = Rng::new(1);
            let x = rng.uniform(64 * model.input_shape().len());
            let labels: Vec<u32> = (0..64).map(|i| i % 10).collect();
            let mut step = |n: usize| {
                fwd.set_inputs(&x[..n * model.input_shape().len()]).unwrap();
                fwd.set_labels(&labels[..n]).unwrap();
                model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                opt.update(&mut model, &bwd).unwrap();
            };
            // warm-up: both batch sizes, so both graphs are captured
            step(64);
            step(63);
            let free_before = device.memory().unwrap().0;
            let allocations = allocations_in(|| {
                for i in 0..1000 {
                    step(if i % 2 == 0 { 64 } else { 63 });
                }
            });
            let loss = bwd.last_loss().unwrap();
            // inference: set_inputs + forward at the capacity and at batch 1
            let mut infer = |n: usize| {
                fwd.set_inputs(&x[..n * model.input_shape().len()]).unwrap();
                model.forward(&mut fwd).unwrap()[0]
            };
            infer(64);
            infer(1);
            let inference_allocations = allocations_in(|| {
                for i in 0..1000 {
                    assert!(infer(if i % 2 == 0 { 64 } else { 1 }).is_finite());
                }
            });
            let free_after = device.memory().unwrap().0;
            println!(
                "{name} graphs={graphs}: 1000 steps, {allocations} host allocations+frees; 1000 forward calls, \
                 {inference_allocations}; free device memory {free_before} -> {free_after}, loss {loss}"
            );
            assert_eq!(allocations, 0, "{name} graphs={graphs}: host allocations in 1000 steps");
            assert_eq!(inference_allocations, 0, "{name} graphs={graphs}: host allocations in 1000 forward calls");
            assert_eq!(free_before, free_after, "{name} graphs={graphs}: device memory changed");
            assert!(loss.is_finite());
        }
    }
}
