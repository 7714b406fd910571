//! CPU thread counts: training gives the same bits on any number of threads, and a count that
//! cannot be right (from `with_threads` or `FLATNN_THREADS`) is an error that starts nothing.

use flatnn::models::{lenet5, mlp, simplenns_cnn};
use flatnn::prelude::*;
use flatnn::testutil::{batch, in_child, run_alone, Rng};

/// The parameters after `steps` Adam steps of `chain` on `threads` threads, from one seed and
/// one batch of `samples`.
fn trained(chain: fn() -> Chain, threads: usize, samples: usize, steps: usize) -> Vec<f32> {
    let mut model = chain().build().unwrap().init(Init::HeNormal, 3).with_threads(threads).unwrap();
    let mut fwd = model.preallocate(samples).unwrap();
    let mut bwd = model.preallocate_grads(samples).unwrap();
    let mut opt = Optimizer::new(&model, Optim::adam(1e-3)).unwrap();
    let (x, labels) = batch(&mut Rng::new(4), &model, samples);
    fwd.set_inputs(&x).unwrap();
    fwd.set_labels(&labels).unwrap();
    for _ in 0..steps {
        opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
    }
    model.parameters().unwrap().into_owned()
}

#[test]
fn training_gives_the_same_bits_on_1_2_and_3_threads() {
    for (name, chain) in [("lenet5", lenet5 as fn() -> Chain), ("simplenns_cnn", simplenns_cnn), ("mlp", mlp)] {
        // 37 samples: 1, 2 and 3 threads would each cut the batch in their own places
        let one = trained(chain, 1, 37, 3);
        for threads in [2, 3] {
            let other = trained(chain, threads, 37, 3);
            let differ = one.iter().zip(&other).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differ, 0, "{name}: {differ} of {} parameters differ between 1 and {threads} threads", one.len());
        }
    }
}

/// Threads of this process, from /proc/self/status (Linux).
fn process_threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("Threads:")).expect("a Threads: line");
    line["Threads:".len()..].trim().parse().expect("a thread count")
}

#[test]
#[cfg(target_os = "linux")]
fn a_refused_thread_count_leaves_no_thread_running() {
    if !in_child() {
        // alone in a child process, where no other test starts threads meanwhile; the model's
        // own pool has no worker (FLATNN_THREADS=1)
        run_alone("a_refused_thread_count_leaves_no_thread_running", &[("FLATNN_THREADS", "1")]);
        return;
    }
    for threads in [30_000, 100_000] {
        let model = mlp().build().unwrap();
        let before = process_threads();
        match model.with_threads(threads) {
            Err(Error::Config(msg)) => assert!(msg.contains(&format!("{threads} threads")), "{msg}"),
            other => panic!("{threads} threads: expected a Config error, got {other:?}"),
        }
        assert_eq!(process_threads(), before, "threads left running after with_threads({threads}) failed");
    }
}

#[test]
fn a_malformed_flatnn_threads_is_an_error_naming_it() {
    if !in_child() {
        for value in ["garbage", "0", "100000"] {
            run_alone("a_malformed_flatnn_threads_is_an_error_naming_it", &[("FLATNN_THREADS", value)]);
        }
        return;
    }
    let value = std::env::var("FLATNN_THREADS").expect("set by the parent");
    match mlp().build() {
        Err(Error::Config(msg)) => assert!(msg.contains(&format!("FLATNN_THREADS={value:?}")), "{msg}"),
        other => panic!("FLATNN_THREADS={value:?}: expected a Config error, got {other:?}"),
    }
}
