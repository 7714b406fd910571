//! CPU thread counts: a count that cannot be right (from `with_threads` or `FLATNN_THREADS`)
//! is an error that starts nothing.

use flatnn::models::mlp;
use flatnn::prelude::*;
use flatnn::testutil::{in_child, run_alone};

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
