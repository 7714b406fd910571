//! A counting global allocator proves that a step allocates nothing: after one warm-up step,
//! 100 steps of set_inputs + set_labels (or set_targets) + backprop + update (and forward, and
//! predict) make 0 allocations and 0 deallocations, for an MLP, a CNN and a network of batch
//! norm, layer norm, dropout and residual blocks, on 1 thread and on 2, with each optimiser,
//! each kind of clipping, weight decay and a learning-rate schedule; for a net of every
//! pooling, 1-D and softmax layer with each loss; and so does a whole epoch of the
//! MNIST loader (shuffle, batches written into the cache, a final partial batch) and training
//! steps, after a warm-up epoch; and so do 100 training steps of a GRU and an LSTM, and 100,000
//! steps of a stream of them.
//!
//! One #[test] only: the counter is global, so tests running beside it would be counted.

use flatnn::data::{Dataset, Loader, Split};
use flatnn::models::{mlp, simplenns_cnn};
use flatnn::prelude::*;
use flatnn::testutil::{pooling_net, signal_net, Rng};
use flatnn::ConvOptions;
use flatnn::RnnOutput;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static DEALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, only counting calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        DEALLOCS.fetch_add(1, Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        DEALLOCS.fetch_add(1, Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Batch norm (over channels and features, with and without an activation), layer norm,
/// dropout and residual blocks, nested; convolutions whose inference takes in a batch norm and
/// a residual sum.
fn norm() -> Chain {
    let same = ConvOptions { stride: (1, 1), padding: (1, 1) };
    let body = |c: Chain| {
        let c = c.conv_with(4, (3, 3), Identity, same).batch_norm_with(Relu).residual(|c| c.dropout(0.2)).batch_norm();
        c.conv_with(4, (3, 3), Identity, same).batch_norm()
    };
    Chain::new(Input::image(3, 8, 8))
        .conv_with(4, (3, 3), Identity, same)
        .batch_norm_with(Relu)
        .residual_with(Relu, body)
        .flatten()
        .dense(32, Relu)
        .layer_norm()
        .dropout(0.3)
        .batch_norm()
        .dense(10, Identity)
}

/// Allocations and deallocations over 100 steps with `loss` after one warm-up step.
fn count(chain: Chain, threads: usize, batch: usize, optim: Optim, clip: Clip, loss: Loss) -> (usize, usize) {
    let mut model = chain.build().unwrap().init(Init::GlorotNormal, 1).with_threads(threads).unwrap();
    let mut fwd = model.preallocate(batch).unwrap();
    let mut bwd = model.preallocate_grads(batch).unwrap();
    let mut opt = Optimizer::new(&model, optim).unwrap();
    opt.set_clip(clip).unwrap();
    opt.set_schedule(Schedule::cosine(10, 50)).unwrap();
    let mut rng = Rng::new(2);
    let inputs = model.input_shape().len();
    let x = rng.uniform(batch * inputs);
    let labels: Vec<u32> = (0..batch).map(|_| rng.below(10) as u32).collect();
    let targets = rng.uniform(batch * 10);
    let mut classes = [0u32; 64];
    let mut step = |fwd: &mut Cache| {
        // a smaller batch every other step: same buffers
        let b = if fwd.batch() == batch { batch - 1 } else { batch };
        fwd.set_inputs(&x[..b * inputs]).unwrap();
        if loss.takes_labels() {
            fwd.set_labels(&labels[..b]).unwrap();
        } else {
            fwd.set_targets(&targets[..b * 10]).unwrap();
        }
        model.backprop(&mut bwd, fwd, loss).unwrap();
        assert!(bwd.last_loss().unwrap().is_finite());
        opt.update(&mut model, &bwd).unwrap();
        model.predict(fwd, &mut classes).unwrap();
    };
    step(&mut fwd);
    let (a0, d0) = (ALLOCS.load(Relaxed), DEALLOCS.load(Relaxed));
    for _ in 0..100 {
        step(&mut fwd);
    }
    (ALLOCS.load(Relaxed) - a0, DEALLOCS.load(Relaxed) - d0)
}

/// Allocations and deallocations over one epoch of loader + step on real MNIST images (1,000 of
/// them in batches of 128: 7 full batches and one of 104), after a warm-up epoch.
fn count_epoch(threads: usize) -> (usize, usize) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist");
    let data = Dataset::mnist(&dir, Split::Train).unwrap().take(1000);
    let mut model = mlp().build().unwrap().init(Init::HeNormal, 1).with_threads(threads).unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(128).unwrap(), model.preallocate_grads(128).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let mut loader = Loader::new(data.len(), 128, 3, false).unwrap();
    let mut epoch = || {
        loader.shuffle();
        let mut batches = 0;
        while loader.next_batch(&data, &mut fwd).unwrap().is_some() {
            model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
            opt.update(&mut model, &bwd).unwrap();
            batches += 1;
        }
        assert_eq!(batches, 8);
        bwd.mean_loss().unwrap()
    };
    epoch();
    let (a0, d0) = (ALLOCS.load(Relaxed), DEALLOCS.load(Relaxed));
    let loss = epoch();
    let counts = (ALLOCS.load(Relaxed) - a0, DEALLOCS.load(Relaxed) - d0);
    assert!(loss.is_finite());
    counts
}

/// Allocations and deallocations over 100 training steps (and forward calls) of an LSTM and a
/// GRU over sequences, from set initial states, after one warm-up step; then over 100,000 steps of
/// a stream of the model, batch 1 and 2 in turn, with a reset every 1,000.
fn count_recurrent(threads: usize) -> ((usize, usize), (usize, usize)) {
    let chain = Chain::new(Shape::sequence(12, 3)).lstm(20, RnnOutput::Sequence).gru(16, RnnOutput::LastStep).dense(10, Identity);
    let mut model = chain.build().unwrap().init(Init::GlorotUniform, 1).with_threads(threads).unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(8).unwrap(), model.preallocate_grads(8).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let mut rng = Rng::new(4);
    let (x, h0) = (rng.uniform(8 * 36), rng.uniform(8 * 16));
    let labels: Vec<u32> = (0..8).map(|i| i % 10).collect();
    let mut step = |fwd: &mut Cache| {
        let b = if fwd.batch() == 8 { 7 } else { 8 };
        fwd.set_state(1, &h0[..b * 16]).unwrap();
        fwd.set_inputs(&x[..b * 36]).unwrap();
        fwd.set_labels(&labels[..b]).unwrap();
        opt.train_step(&mut model, &mut bwd, fwd, Loss::LogitCrossEntropy).unwrap();
        assert!(bwd.last_loss().unwrap().is_finite());
        model.forward(fwd).unwrap();
    };
    step(&mut fwd);
    let (a0, d0) = (ALLOCS.load(Relaxed), DEALLOCS.load(Relaxed));
    for _ in 0..100 {
        step(&mut fwd);
    }
    let training = (ALLOCS.load(Relaxed) - a0, DEALLOCS.load(Relaxed) - d0);
    let mut stream = model.stream(2).unwrap();
    let mut call = |i: usize| {
        if i.is_multiple_of(1000) {
            stream.reset_state().unwrap();
        }
        let n = 1 + i % 2;
        assert!(stream.step(&x[i % 30..][..n * 3]).unwrap()[0].is_finite());
    };
    call(0);
    let (a0, d0) = (ALLOCS.load(Relaxed), DEALLOCS.load(Relaxed));
    for i in 1..100_001 {
        call(i);
    }
    (training, (ALLOCS.load(Relaxed) - a0, DEALLOCS.load(Relaxed) - d0))
}

/// Allocations and deallocations over 100 inference calls of one sample through an LSTM of 128
/// units on `threads` threads, after one warm-up call: on several, each step's units are split
/// among them (`cpu::recurrent::forward_split`) where the batch-1 timing puts the pass on the pool.
fn count_split_inference(threads: usize) -> (usize, usize) {
    let model = Chain::new(Shape::sequence(16, 4)).lstm(128, RnnOutput::LastStep).dense(3, Identity).build().unwrap();
    let model = model.init(Init::GlorotUniform, 2).with_threads(threads).unwrap();
    let mut cache = model.preallocate(1).unwrap();
    cache.set_inputs(&Rng::new(5).uniform(64)).unwrap();
    model.forward(&mut cache).unwrap();
    let (a0, d0) = (ALLOCS.load(Relaxed), DEALLOCS.load(Relaxed));
    for _ in 0..100 {
        assert!(model.forward(&mut cache).unwrap()[0].is_finite());
    }
    (ALLOCS.load(Relaxed) - a0, DEALLOCS.load(Relaxed) - d0)
}

#[test]
fn a_step_allocates_nothing() {
    // the counter sees what it should: one Vec is one allocation and one deallocation
    let (a0, d0) = (ALLOCS.load(Relaxed), DEALLOCS.load(Relaxed));
    drop(std::hint::black_box(vec![1u8; 16]));
    assert_eq!((ALLOCS.load(Relaxed) - a0, DEALLOCS.load(Relaxed) - d0), (1, 1));

    let optims = [
        (Optim::adam(1e-3), Clip::None),
        (Optim::sgd(0.01, 0.9).with_weight_decay(1e-4), Clip::Norm(1.0)),
        (Optim::adamw(1e-3, 0.01), Clip::Value(0.1)),
        (Optim::rmsprop(1e-3).with_weight_decay(1e-4), Clip::Norm(0.5)),
    ];
    let mut report = Vec::new();
    let xent = Loss::LogitCrossEntropy;
    for threads in [1, 2] {
        // ("cnn" at batch 2 runs batch 1 every other step and in the warm-up step: on 2 threads
        // batch 1 is below the thread count, so each convolution times a sample's rows in parts
        // against one part at its first call at batch 1 (inference in `preallocate`, training
        // in the warm-up step) and runs the faster in the steps counted; batch 2 fills 2 threads)
        for (name, chain, batch) in [("mlp", mlp(), 32), ("cnn", simplenns_cnn(), 8), ("cnn", simplenns_cnn(), 2), ("norm", norm(), 8)] {
            for (optim, clip) in optims {
                let counts = count(chain.clone(), threads, batch, optim, clip, xent);
                report.push((name, threads, optim, clip, xent, counts));
            }
        }
        // every pooling, 1-D and softmax layer, new activation and new loss
        let losses = [xent, Loss::BceWithLogits, Loss::L1, Loss::SmoothL1 { beta: 0.5 }];
        for (name, chain) in [("pooling", pooling_net()), ("signal", signal_net())] {
            for (loss, (optim, clip)) in losses.into_iter().zip(optims) {
                report.push((name, threads, optim, clip, loss, count(chain.clone(), threads, 8, optim, clip, loss)));
            }
        }
    }
    for (name, threads, optim, clip, loss, (allocs, deallocs)) in &report {
        println!("{name} threads={threads} {optim:?} {clip:?} {loss:?}: {allocs} allocations, {deallocs} deallocations in 100 steps");
    }
    assert!(report.iter().all(|r| r.5 == (0, 0)), "a step allocated");
    for threads in [1, 2] {
        let (training, streaming) = count_recurrent(threads);
        println!(
            "lstm + gru threads={threads}: {training:?} allocations, deallocations in 100 steps; {streaming:?} in 100,000 stream steps"
        );
        assert_eq!((training, streaming), ((0, 0), (0, 0)), "a recurrent training step or a stream step allocated");
        let split = count_split_inference(threads);
        println!("lstm 128 batch 1 inference threads={threads}: {split:?} allocations, deallocations in 100 calls");
        assert_eq!(split, (0, 0), "an inference of one sample through an LSTM allocated");
    }
    for threads in [1, 2] {
        let (allocs, deallocs) = count_epoch(threads);
        println!("mnist epoch, loader + step, threads={threads}: {allocs} allocations, {deallocs} deallocations");
        assert_eq!((allocs, deallocs), (0, 0), "an epoch of loading and training allocated");
    }
}
