//! Data on the GPU: a data set in device memory gathered per batch ([`DeviceDataset`] with
//! [`Loader::next_device_batch`]) and batches streamed from page-locked host memory
//! ([`StreamingLoader`]) give exactly the host loader's batches and training results, allocate
//! nothing per batch, and refuse bad labels and oversized batches. The GPU tests are
//! `#[ignore]`d: `cargo test -- --include-ignored` runs them where there is a GPU.

use flatnn::data::{Dataset, DeviceDataset, Loader, StreamingLoader};
use flatnn::prelude::*;
use flatnn::testutil::{allocations_in, cuda_device, rel_err, Counting, Rng};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The GPU tests of this file run one at a time: one of them reads the device's free memory,
/// which another test allocating beside it would change.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// CUDA device 0 and this file's turn on it.
fn gpu_device() -> (Device, MutexGuard<'static, ()>) {
    (cuda_device(), ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner))
}

/// `n` samples of `len` values in [−1, 1) (sample i's labels below `classes`).
fn dataset(n: usize, len: usize, classes: usize, seed: u64) -> Dataset {
    let mut rng = Rng::new(seed);
    let labels = (0..n).map(|_| rng.below(classes) as u32).collect();
    Dataset::new(rng.uniform(n * len), labels, Shape::vector(len)).unwrap()
}

/// y = x: a dense layer of `len` outputs with the identity matrix and zero bias (outputs are
/// the inputs exactly, in FP32).
fn identity(len: usize) -> Model {
    let mut model = Chain::new(Input::vector(len)).dense(len, Identity).build().unwrap().with_threads(1).unwrap();
    let mut params = vec![0.0; len * len + len];
    for i in 0..len {
        params[i * len + i] = 1.0;
    }
    model.set_parameters(&params).unwrap();
    model
}

fn mlp() -> Model {
    Chain::new(Input::vector(20)).dense(16, Relu).dense(10, Identity).build().unwrap().init(Init::HeNormal, 7).with_threads(1).unwrap()
}

/// Where batches come from: the host loader, a data set on the device, or page-locked
/// streaming (the last two boxed: a few hundred bytes of handles each).
enum Feed {
    Host(Loader),
    Device(Loader, Box<DeviceDataset>),
    Streaming(Box<StreamingLoader>),
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Host,
    Device,
    Streaming,
}

impl Feed {
    /// A feed of `kind` over `data` (labels below `classes`) in batches of `batch` (seed
    /// `seed`) into caches like `cache`.
    fn new(kind: Kind, data: &Dataset, classes: usize, batch: usize, seed: u64, cache: &Cache) -> Feed {
        let loader = Loader::new(data.len(), batch, seed, false).unwrap();
        match kind {
            Kind::Host => Feed::Host(loader),
            Kind::Device => Feed::Device(loader, Box::new(data.to_device(&cache.device(), classes).unwrap())),
            Kind::Streaming => Feed::Streaming(Box::new(StreamingLoader::new(loader, cache).unwrap())),
        }
    }

    fn shuffle(&mut self) {
        match self {
            Feed::Host(l) | Feed::Device(l, _) => l.shuffle(),
            Feed::Streaming(s) => s.shuffle(),
        }
    }

    fn rewind(&mut self) {
        match self {
            Feed::Host(l) | Feed::Device(l, _) => l.rewind(),
            Feed::Streaming(s) => s.rewind(),
        }
    }

    fn next(&mut self, data: &Dataset, cache: &mut Cache) -> flatnn::Result<Option<usize>> {
        match self {
            Feed::Host(l) => l.next_batch(data, cache),
            Feed::Device(l, d) => l.next_device_batch(d, cache),
            Feed::Streaming(s) => s.next_batch(data, cache),
        }
    }
}

#[test]
fn device_loaders_move_between_threads() {
    fn send<T: Send>() {}
    send::<DeviceDataset>();
    send::<StreamingLoader>();
    send::<(Model, Cache, Grads, Optimizer)>();
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn gathered_and_streamed_batches_are_the_host_loaders() {
    let (device, _turn) = gpu_device();
    let (len, n, batch) = (7, 50, 8);
    let data = dataset(n, len, len, 1);
    let cpu = identity(len);
    let gpu = cpu.to(&device).unwrap();
    let (mut cpu_fwd, mut cpu_bwd) = (cpu.preallocate(batch).unwrap(), cpu.preallocate_grads(batch).unwrap());
    for kind in [Kind::Device, Kind::Streaming] {
        let (mut gpu_fwd, mut gpu_bwd) = (gpu.preallocate(batch).unwrap(), gpu.preallocate_grads(batch).unwrap());
        let mut host = Feed::new(Kind::Host, &data, len, batch, 5, &cpu_fwd);
        let mut feed = Feed::new(kind, &data, len, batch, 5, &gpu_fwd);
        let mut batches = 0;
        // epochs: shuffled, shuffled again after two batches (an order changed mid-epoch, a
        // staged batch dropped), rewound, shuffled
        for epoch in 0..4 {
            if epoch == 2 {
                host.rewind();
                feed.rewind();
            } else {
                host.shuffle();
                feed.shuffle();
            }
            for b in 0.. {
                if epoch == 1 && b == 2 {
                    host.shuffle();
                    feed.shuffle();
                }
                let want = host.next(&data, &mut cpu_fwd).unwrap();
                let got = feed.next(&data, &mut gpu_fwd).unwrap();
                assert_eq!(got, want, "{kind:?} epoch {epoch} batch {b}: sizes");
                if want.is_none() {
                    break;
                }
                let want_inputs = cpu_fwd.inputs().to_vec();
                let outputs = gpu.forward(&mut gpu_fwd).unwrap();
                assert!(outputs == want_inputs, "{kind:?} epoch {epoch} batch {b}: inputs {outputs:?} vs {want_inputs:?}");
                // the labels: the cross-entropy of the same logits against them
                cpu.backprop(&mut cpu_bwd, &mut cpu_fwd, Loss::LogitCrossEntropy).unwrap();
                gpu.backprop(&mut gpu_bwd, &mut gpu_fwd, Loss::LogitCrossEntropy).unwrap();
                let (want_loss, got_loss) = (cpu_bwd.last_loss().unwrap(), gpu_bwd.last_loss().unwrap());
                assert!(
                    (got_loss - want_loss).abs() <= 1e-6 + 1e-5 * want_loss.abs(),
                    "{kind:?} epoch {epoch} batch {b}: loss {got_loss} vs {want_loss}"
                );
                batches += 1;
            }
        }
        println!("{kind:?}: {batches} batches equal to the host loader's");
    }
}

/// Real-valued targets through each loader give the host loader's MSE, and `Model::loss`
/// (computed on the host from the outputs, with the labels or targets a loader gathered on the
/// device copied back) gives the host's value bit for bit on the identity model (whose outputs
/// are its inputs exactly) and the GPU's own backprop value within rounding.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn regression_targets_and_validation_losses_through_every_loader() {
    let (device, _turn) = gpu_device();
    let (len, n, batch) = (7, 50, 8);
    let mut rng = Rng::new(12);
    let regression = Dataset::regression(rng.uniform(n * len), rng.uniform(n * len), Shape::vector(len), len).unwrap();
    let labelled = dataset(n, len, len, 1);
    let cpu = identity(len);
    let gpu = cpu.to(&device).unwrap();
    let (mut cpu_fwd, mut cpu_bwd) = (cpu.preallocate(batch).unwrap(), cpu.preallocate_grads(batch).unwrap());
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-6 + 1e-5 * b.abs();
    for (data, loss) in [(&regression, Loss::Mse), (&labelled, Loss::LogitCrossEntropy)] {
        for kind in [Kind::Device, Kind::Streaming] {
            let (mut gpu_fwd, mut gpu_bwd) = (gpu.preallocate(batch).unwrap(), gpu.preallocate_grads(batch).unwrap());
            let mut host = Feed::new(Kind::Host, data, len, batch, 5, &cpu_fwd);
            let mut feed = Feed::new(kind, data, len, batch, 5, &gpu_fwd);
            host.shuffle();
            feed.shuffle();
            let mut batches = 0;
            while let Some(size) = host.next(data, &mut cpu_fwd).unwrap() {
                assert_eq!(feed.next(data, &mut gpu_fwd).unwrap(), Some(size), "{kind:?} {loss:?} batch {batches}");
                let (want, got) = (cpu.loss(&mut cpu_fwd, loss).unwrap(), gpu.loss(&mut gpu_fwd, loss).unwrap());
                assert_eq!(got.to_bits(), want.to_bits(), "{kind:?} {loss:?} batch {batches}: Model::loss {got} vs {want}");
                cpu.backprop(&mut cpu_bwd, &mut cpu_fwd, loss).unwrap();
                gpu.backprop(&mut gpu_bwd, &mut gpu_fwd, loss).unwrap();
                let (cpu_loss, gpu_loss) = (cpu_bwd.last_loss().unwrap(), gpu_bwd.last_loss().unwrap());
                assert!(
                    close(gpu_loss, cpu_loss) && close(got, gpu_loss),
                    "{kind:?} {loss:?} batch {batches}: {gpu_loss} {cpu_loss} {got}"
                );
                batches += 1;
            }
            assert_eq!((batches, feed.next(data, &mut gpu_fwd).unwrap()), (7, None));
        }
    }
    // targets of the wrong width for the model are refused by each loader
    let narrow = Dataset::regression(rng.uniform(n * len), rng.uniform(n * 2), Shape::vector(len), 2).unwrap();
    assert!(matches!(narrow.to_device(&device, len), Err(Error::Shape(_))));
    let mut fwd = gpu.preallocate(batch).unwrap();
    let mut streaming = StreamingLoader::new(Loader::new(n, batch, 0, false).unwrap(), &fwd).unwrap();
    assert!(matches!(streaming.next_batch(&narrow, &mut fwd), Err(Error::Shape(_))));
}

/// `steps` Adam steps of `model` on batches of 32 from `data` through a feed of `kind`,
/// shuffled each epoch (the loss read only at each epoch's end); the parameters and the
/// epochs' mean losses.
fn train(model: &Model, kind: Kind, data: &Dataset, steps: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut model = model.to(&model.device()).unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let mut feed = Feed::new(kind, data, 10, 32, seed, &fwd);
    let mut losses = Vec::new();
    feed.shuffle();
    let mut step = 0;
    while step < steps {
        if feed.next(data, &mut fwd).unwrap().is_none() {
            losses.push(bwd.mean_loss().unwrap());
            feed.shuffle();
            continue;
        }
        model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        opt.update(&mut model, &bwd).unwrap();
        step += 1;
    }
    losses.push(bwd.mean_loss().unwrap());
    (model.parameters().unwrap().into_owned(), losses)
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn training_from_device_data_matches_the_host_loader() {
    let (device, _turn) = gpu_device();
    // 200 samples in batches of 32: six full batches and one of 8 per epoch; 30 steps cross
    // four epochs, so the order is copied to the device four times
    let data = dataset(200, 20, 10, 2);
    let (cpu_params, cpu_losses) = train(&mlp(), Kind::Host, &data, 30, 3);
    for graphs in [true, false] {
        let model = mlp().with_gpu_options(GpuOptions { graphs, tf32: false, ..GpuOptions::default() }).unwrap().to(&device).unwrap();
        let (want, want_losses) = train(&model, Kind::Host, &data, 30, 3);
        let err = rel_err(&want, &cpu_params);
        println!("graphs={graphs}: host loader on the GPU vs the CPU: parameters rel err {err:.2e}");
        assert!(err <= 1e-4, "the GPU drifted from the CPU: {err:e}");
        assert!(rel_err(&want_losses, &cpu_losses) <= 1e-4, "losses {want_losses:?} vs {cpu_losses:?}");
        for kind in [Kind::Device, Kind::Streaming] {
            let (got, got_losses) = train(&model, kind, &data, 30, 3);
            let err = rel_err(&got, &want);
            println!("graphs={graphs} {kind:?}: 30 steps, parameters rel err {err:.2e} against the host loader, losses {got_losses:?}");
            assert!(err <= 1e-6, "{kind:?} graphs={graphs}: parameters differ by {err:e}");
            assert!(rel_err(&got_losses, &want_losses) <= 1e-6, "{kind:?}: losses {got_losses:?} vs {want_losses:?}");
        }
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn one_device_data_set_feeds_two_models_on_their_own_streams() {
    let (device, _turn) = gpu_device();
    let data = dataset(200, 20, 10, 4);
    let models: Vec<Model> = [5, 6].iter().map(|&seed| mlp().init(Init::HeNormal, seed).to(&device).unwrap()).collect();
    let alone: Vec<Vec<f32>> = models.iter().zip([7, 8]).map(|(m, seed)| train(m, Kind::Host, &data, 20, seed).0).collect();
    // both models take turns, each with its own loader over one data set on the device: the
    // order is copied again at every turn, after the other model's gather (events, no host wait)
    let mut shared = data.to_device(&device, 10).unwrap();
    let mut sets: Vec<_> = models
        .iter()
        .zip([7, 8])
        .map(|(m, seed)| {
            let model = m.to(&device).unwrap();
            let (fwd, bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
            let opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
            let mut loader = Loader::new(data.len(), 32, seed, false).unwrap();
            loader.shuffle();
            (model, fwd, bwd, opt, loader, 0)
        })
        .collect();
    while sets.iter().any(|s| s.5 < 20) {
        for (model, fwd, bwd, opt, loader, steps) in sets.iter_mut().filter(|s| s.5 < 20) {
            if loader.next_device_batch(&mut shared, fwd).unwrap().is_none() {
                loader.shuffle();
                continue;
            }
            model.backprop(bwd, fwd, Loss::LogitCrossEntropy).unwrap();
            opt.update(model, bwd).unwrap();
            *steps += 1;
        }
    }
    for (i, (set, want)) in sets.iter().zip(&alone).enumerate() {
        let err = rel_err(&set.0.parameters().unwrap(), want);
        println!("model {i}: taking turns on one device data set vs alone: parameters rel err {err:.2e}");
        assert!(err <= 1e-6, "model {i}: {err:e}");
    }
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn labels_and_capacity_are_checked() {
    let (device, _turn) = gpu_device();
    let mut data = dataset(40, 20, 10, 5);
    // a label at or past the classes is refused at upload, naming it
    let mut labels = data.labels().to_vec();
    labels[17] = 10;
    let samples: Vec<f32> = (0..data.len()).flat_map(|i| data.sample(i).unwrap().to_vec()).collect();
    let bad = Dataset::new(samples, labels, data.shape()).unwrap();
    match bad.to_device(&device, 10) {
        Err(Error::Label { index: 17, label: 10, classes: 10 }) => {}
        Err(e) => panic!("a label of 10 for 10 classes gave {e}"),
        Ok(_) => panic!("a label of 10 for 10 classes was uploaded"),
    }
    // ... and by the streaming loader before the batch holding it is delivered (sample 17 is
    // the second of the second batch); the batch staged from `bad` is not handed out for `data`
    let model = mlp().to(&device).unwrap();
    let mut fwd = model.preallocate(16).unwrap();
    let mut streaming = StreamingLoader::new(Loader::new(40, 16, 0, false).unwrap(), &fwd).unwrap();
    assert!(matches!(streaming.next_batch(&bad, &mut fwd), Ok(Some(16))));
    assert!(matches!(streaming.next_batch(&bad, &mut fwd), Err(Error::Label { index: 1, label: 10, classes: 10 })));
    assert!(matches!(streaming.next_batch(&data, &mut fwd), Ok(Some(16))), "the loader did not move on the error");
    let mut bwd = model.preallocate_grads(16).unwrap();
    model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
    assert!(bwd.last_loss().unwrap().is_finite(), "the batch was restaged from the good data");

    // more classes than the model has outputs
    let mut wide = data.to_device(&device, 12).unwrap();
    let mut loader = Loader::new(40, 16, 0, false).unwrap();
    assert!(matches!(loader.next_device_batch(&mut wide, &mut fwd), Err(Error::Mismatch(_))));

    // a batch over the cache's capacity, then the same batch into a cache that holds it
    let mut device_data = data.to_device(&device, 10).unwrap();
    let mut small = model.preallocate(8).unwrap();
    match loader.next_device_batch(&mut device_data, &mut small) {
        Err(Error::Capacity { batch: 16, capacity: 8 }) => {}
        other => panic!("a batch of 16 into a cache of 8 gave {other:?}"),
    }
    assert!(matches!(
        StreamingLoader::new(Loader::new(40, 16, 0, false).unwrap(), &small),
        Err(Error::Capacity { batch: 16, capacity: 8 })
    ));
    let sizes: Vec<usize> = std::iter::from_fn(|| loader.next_device_batch(&mut device_data, &mut fwd).unwrap()).collect();
    assert_eq!(sizes, [16, 16, 8], "nothing moved on the errors");

    // data, loader and cache must fit together
    let cpu_model = mlp();
    let mut cpu_fwd = cpu_model.preallocate(16).unwrap();
    loader.rewind();
    assert!(matches!(loader.next_device_batch(&mut device_data, &mut cpu_fwd), Err(Error::Mismatch(_))));
    assert!(matches!(Loader::new(41, 16, 0, false).unwrap().next_device_batch(&mut device_data, &mut fwd), Err(Error::Mismatch(_))));
    data = data.take(30);
    assert!(matches!(streaming.next_batch(&data, &mut fwd), Err(Error::Mismatch(_))));
}

/// Free memory on device 0, in bytes.
fn free_device_memory() -> usize {
    Device::Cuda(0).memory().unwrap().0
}

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn a_batch_gathered_on_the_device_does_not_move_with_its_cache() {
    let (device, _turn) = gpu_device();
    let data = dataset(40, 20, 10, 8);
    let model = mlp().to(&device).unwrap();
    let mut fwd = model.preallocate(16).unwrap();
    let mut device_data = data.to_device(&device, 10).unwrap();
    let mut loader = Loader::new(data.len(), 16, 0, false).unwrap();
    assert_eq!(loader.next_device_batch(&mut device_data, &mut fwd).unwrap(), Some(16));
    // the gathered batch is on the device only: a moved cache starts with no batch
    let moved = fwd.to_device(&Device::Cpu).unwrap();
    assert_eq!(moved.batch(), 0);
    let mut moved = moved;
    let cpu_model = model.to(&Device::Cpu).unwrap();
    assert!(matches!(cpu_model.forward(&mut moved), Err(Error::Shape(_))), "no inputs set after the move");
}

#[global_allocator]
static COUNTING: Counting = Counting;

#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn device_batches_allocate_nothing() {
    let (device, _turn) = gpu_device();
    let data = dataset(200, 20, 10, 6);
    for kind in [Kind::Device, Kind::Streaming] {
        let mut model = mlp().to(&device).unwrap();
        let (mut fwd, mut bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
        let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
        let mut feed = Feed::new(kind, &data, 10, 32, 1, &fwd);
        let mut epoch = |feed: &mut Feed| {
            feed.shuffle();
            while feed.next(&data, &mut fwd).unwrap().is_some() {
                model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                opt.update(&mut model, &bwd).unwrap();
            }
        };
        // warm-up: one epoch captures the graphs of both batch sizes
        epoch(&mut feed);
        let free_before = free_device_memory();
        let allocations = allocations_in(|| {
            for _ in 0..20 {
                epoch(&mut feed);
            }
        });
        let loss = bwd.last_loss().unwrap();
        let free_after = free_device_memory();
        println!("{kind:?}: 20 epochs of 7 batches, {allocations} host allocations+frees, free device memory {free_before} -> {free_after}, loss {loss}");
        assert_eq!(allocations, 0, "{kind:?}: host allocations in 20 epochs");
        assert_eq!(free_before, free_after, "{kind:?}: device memory changed");
        assert!(loss.is_finite());
    }
}
