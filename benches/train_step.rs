//! Train step (forward + backprop + Adam) and batch-1 inference on the CPU, 1 and 2 threads;
//! the train step on the GPU too where one is usable (else a `skipped: no CUDA device` line).
//!
//! Throughput is reported in "elements" that are FLOPs: 2·MAC of the forward, of dW and of the
//! dX actually needed (not the model input's), so criterion's `elem/s` reads as FLOP/s.
//! `cargo bench --bench train_step [-- FILTER]`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flatnn::models::{mlp, simplenns_cnn};
use flatnn::prelude::*;
use flatnn::testutil::Rng;
use flatnn::Layer;
use std::time::{Duration, Instant};

/// Multiply-accumulates per sample of the forward pass, and of the dX that backprop needs.
fn macs(model: &Model) -> (u64, u64) {
    let (mut forward, mut dx) = (0u64, 0u64);
    for (i, step) in model.plan().steps.iter().enumerate() {
        let m = match step.layer {
            Layer::Dense(_) => step.weight_len() as u64,
            Layer::Conv(conv) => (step.weight_len() / conv.out_channels * step.output.len()) as u64,
            Layer::Conv1d(conv) => (step.weight_len() / conv.out_channels * step.output.len()) as u64,
            // every step's products W_ih·x_t and W_hh·h_{t−1}
            Layer::Gru(_) | Layer::Lstm(_) => match step.input {
                Shape::Sequence { steps, .. } => (steps * (step.tensors[0].range.len() + step.tensors[1].range.len())) as u64,
                _ => unreachable!("a recurrent layer takes a sequence"),
            },
            // pools, flatten, softmax: no products
            _ => 0,
        };
        forward += m;
        if i > 0 && m > 0 {
            dx += m;
        }
    }
    (forward, dx)
}

fn setup(chain: Chain, threads: usize, batch: usize) -> (Model, Cache, Grads, Optimizer) {
    let model = chain.build().unwrap().init(Init::GlorotNormal, 1).with_threads(threads).unwrap();
    let mut fwd = model.preallocate(batch).unwrap();
    let bwd = model.preallocate_grads(batch).unwrap();
    let opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let mut rng = Rng::new(3);
    fwd.set_inputs(&rng.uniform(batch * model.input_shape().len())).unwrap();
    fwd.set_labels(&(0..batch).map(|_| rng.below(10) as u32).collect::<Vec<_>>()).unwrap();
    (model, fwd, bwd, opt)
}

fn train_step(c: &mut Criterion) {
    for (name, chain, batches) in
        [("mlp", mlp as fn() -> Chain, &[1usize, 32, 128, 1024, 4096][..]), ("cnn", simplenns_cnn, &[1, 32, 128, 1024, 4096])]
    {
        let mut group = c.benchmark_group(format!("train_step/{name}"));
        group.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
        for threads in [1, 2] {
            for &batch in batches {
                let (mut model, mut fwd, mut bwd, mut opt) = setup(chain(), threads, batch);
                let (forward, dx) = macs(&model);
                group.throughput(Throughput::Elements(2 * batch as u64 * (2 * forward + dx)));
                group.bench_function(BenchmarkId::new(format!("{threads}t"), batch), |b| {
                    b.iter(|| {
                        opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                    })
                });
            }
        }
        group.finish();
    }
}

/// The same steps on CUDA device 0, graphs on. A training loop never waits for the device per
/// step, so a sample queues its steps back to back and waits once at the end: the time per step
/// is what a loop sustains.
fn train_step_gpu(c: &mut Criterion) {
    let Ok(device) = Device::cuda(0) else {
        println!("train_step_gpu: skipped: no CUDA device");
        return;
    };
    for (name, chain, batches) in
        [("mlp", mlp as fn() -> Chain, &[1usize, 32, 128, 1024, 4096, 16384][..]), ("cnn", simplenns_cnn, &[1, 32, 128, 1024, 4096])]
    {
        let mut group = c.benchmark_group(format!("train_step_gpu/{name}"));
        group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        for &batch in batches {
            let model = chain().build().unwrap().init(Init::GlorotNormal, 1);
            let mut model = model.to(&device).unwrap();
            let (mut fwd, mut bwd) = (model.preallocate(batch).unwrap(), model.preallocate_grads(batch).unwrap());
            let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
            let mut rng = Rng::new(3);
            fwd.set_inputs(&rng.uniform(batch * model.input_shape().len())).unwrap();
            fwd.set_labels(&(0..batch).map(|_| rng.below(10) as u32).collect::<Vec<_>>()).unwrap();
            let (forward, dx) = macs(&model);
            group.throughput(Throughput::Elements(2 * batch as u64 * (2 * forward + dx)));
            group.bench_function(BenchmarkId::new("graphs", batch), |b| {
                b.iter_custom(|steps| {
                    let start = Instant::now();
                    for _ in 0..steps {
                        opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                    }
                    bwd.last_loss().unwrap();
                    start.elapsed()
                })
            });
        }
        group.finish();
    }
}

fn inference(c: &mut Criterion) {
    let mut group = c.benchmark_group("forward");
    group.sample_size(50).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for (name, chain) in [("mlp", mlp as fn() -> Chain), ("cnn", simplenns_cnn)] {
        for threads in [1, 2] {
            for batch in [1, 128] {
                let (model, mut fwd, _, _) = setup(chain(), threads, batch);
                group.throughput(Throughput::Elements(2 * batch as u64 * macs(&model).0));
                group.bench_function(BenchmarkId::new(format!("{name}/{threads}t"), batch), |b| {
                    b.iter(|| model.forward(&mut fwd).unwrap().len())
                });
            }
        }
    }
    group.finish();
}

/// One optimiser update over the MLP's 109,386 parameters: a memory-bound pass.
fn update(c: &mut Criterion) {
    let mut group = c.benchmark_group("update/mlp");
    group.sample_size(50).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    for threads in [1, 2] {
        for (name, optim) in [("adam", Optim::adam(1e-3)), ("sgd_momentum", Optim::sgd(1e-2, 0.9))] {
            let (mut model, mut fwd, mut bwd, _) = setup(mlp(), threads, 1);
            model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
            let mut opt = Optimizer::new(&model, optim).unwrap();
            group.throughput(Throughput::Elements(model.plan().param_len as u64));
            group.bench_function(BenchmarkId::new(name, format!("{threads}t")), |b| b.iter(|| opt.update(&mut model, &bwd).unwrap()));
        }
    }
    group.finish();
}

criterion_group!(benches, train_step, train_step_gpu, inference, update);
criterion_main!(benches);
