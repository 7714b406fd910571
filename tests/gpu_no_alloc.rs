//! A GPU training step allocates nothing on the host and leaves the device's free memory as it
//! was, over 1,000 steps. Its own test binary: no other test allocates device memory while the
//! free memory is read. Prints `skipped: no CUDA device` and passes where CUDA is missing.
#![cfg(feature = "cuda")]

use flatnn::cuda;
use flatnn::models::{lenet5, mlp};
use flatnn::prelude::*;
use flatnn::testutil::Rng;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

fn gpu_device() -> Option<Device> {
    match Device::cuda(0) {
        Ok(device) => Some(device),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

/// Counts the calling thread's heap allocations and deallocations.
struct Counting;

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

#[test]
fn a_gpu_step_allocates_nothing_and_device_memory_stays_put() {
    let Some(device) = gpu_device() else { return };
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
            let free_before = cuda::device_info(0).unwrap().free_memory;
            let before = ALLOCATIONS.with(Cell::get);
            for i in 0..1000 {
                step(if i % 2 == 0 { 64 } else { 63 });
            }
            let allocations = ALLOCATIONS.with(Cell::get) - before;
            let loss = bwd.last_loss().unwrap();
            let free_after = cuda::device_info(0).unwrap().free_memory;
            println!("{name} graphs={graphs}: 1000 steps, {allocations} host allocations+frees, free device memory {free_before} -> {free_after}, loss {loss}");
            assert_eq!(allocations, 0, "{name} graphs={graphs}: host allocations in 1000 steps");
            assert_eq!(free_before, free_after, "{name} graphs={graphs}: device memory changed");
            assert!(loss.is_finite());
        }
    }
}
