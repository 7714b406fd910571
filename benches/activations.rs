//! The element-wise activation passes on their own (a 4096-value block, resident in L1), and
//! the inference and backprop of two networks where they weigh: a tanh MLP 32-128-128-128-4 and
//! the GELU MLP 512-1024-1024-16, on one thread.
//!
//! The activation rows count values as elements, so criterion's `elem/s` reads as values per
//! second (ns per value = 1e9 / rate); the network rows count samples.
//! `cargo bench --bench activations [-- FILTER]`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flatnn::prelude::*;
use flatnn::testutil::Rng;
use std::time::Duration;

const ACTIVATIONS: [(&str, Activation); 8] = [
    ("relu", Relu),
    ("leaky_relu", LeakyRelu(0.01)),
    ("tanh", Tanh),
    ("sigmoid", Sigmoid),
    ("gelu", Gelu),
    ("silu", Silu),
    ("elu", Elu(1.0)),
    ("softplus", Softplus),
];

fn passes(c: &mut Criterion) {
    let n = 4096;
    let mut rng = Rng::new(1);
    // pre-activations in [−5, 5): both sides of every activation's bend
    let z: Vec<f32> = rng.uniform(n).iter().map(|v| 5.0 * v).collect();
    let dy = rng.uniform(n);
    let mut group = c.benchmark_group("act");
    group.sample_size(30).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    group.throughput(Throughput::Elements(n as u64));
    for (name, act) in ACTIVATIONS {
        let mut y = vec![0.0f32; n];
        act.apply_slice(&z, &mut y);
        let mut out = vec![0.0f32; n];
        group.bench_function(BenchmarkId::new(name, "apply"), |b| b.iter(|| act.apply_slice(&z, &mut out)));
        group.bench_function(BenchmarkId::new(name, "backward"), |b| b.iter(|| act.backward_slice(&z, &y, &dy, &mut out)));
    }
    group.finish();
}

fn networks() -> [(&'static str, Chain); 2] {
    [
        ("tanh_mlp", Chain::new(Input::vector(32)).dense(128, Tanh).dense(128, Tanh).dense(128, Tanh).dense(4, Identity)),
        ("gelu_mlp", Chain::new(Input::vector(512)).dense(1024, Gelu).dense(1024, Gelu).dense(16, Identity)),
    ]
}

fn setup(chain: Chain, batch: usize) -> (Model, Cache, Grads) {
    let model = chain.build().unwrap().init(Init::GlorotNormal, 1).with_threads(1).unwrap();
    let mut fwd = model.preallocate(batch).unwrap();
    let bwd = model.preallocate_grads(batch).unwrap();
    let mut rng = Rng::new(3);
    let classes = model.output_shape().len();
    fwd.set_inputs(&rng.uniform(batch * model.input_shape().len())).unwrap();
    fwd.set_labels(&(0..batch).map(|_| rng.below(classes) as u32).collect::<Vec<_>>()).unwrap();
    (model, fwd, bwd)
}

fn inference(c: &mut Criterion) {
    for (name, chain) in networks() {
        let mut group = c.benchmark_group(format!("forward/{name}"));
        group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        for batch in [1, 32, 256] {
            let (model, mut fwd, _) = setup(chain.clone(), batch);
            group.throughput(Throughput::Elements(batch as u64));
            group.bench_function(BenchmarkId::new("1t", batch), |b| b.iter(|| model.forward(&mut fwd).unwrap().len()));
        }
        group.finish();
    }
}

fn backprop(c: &mut Criterion) {
    for (name, chain) in networks() {
        let mut group = c.benchmark_group(format!("backprop/{name}"));
        group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        for batch in [32, 256] {
            let (model, mut fwd, mut bwd) = setup(chain.clone(), batch);
            group.throughput(Throughput::Elements(batch as u64));
            group.bench_function(BenchmarkId::new("1t", batch), |b| {
                b.iter(|| model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap())
            });
        }
        group.finish();
    }
}

criterion_group!(benches, passes, inference, backprop);
criterion_main!(benches);
