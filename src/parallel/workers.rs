//! The host threads that queue the steps of a process's replicas, one a replica but the first
//! (which the caller's thread runs). A step's NCCL calls may wait, on the host, for the other
//! ranks' (NCCL says so of any rank driven without a group), and each step's graph is captured
//! on its replica's stream: so the replicas' steps run at the same time, on threads of their
//! own, rather than one after another on one thread.
//!
//! A worker spins for a while on its job counter, then parks until the next job; handing a job
//! over and back allocates nothing.

use super::replica::Replica;
use crate::error::{Error, Result};
use crate::loss::Loss;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// One step for one replica.
#[derive(Clone, Copy)]
struct Job {
    replica: *mut Replica,
    loss: Loss,
    global: usize,
    step: u64,
    timeout: Duration,
}

/// A job slot between the caller's thread and one worker. `job` is written by the caller
/// only while the worker is idle (`finished == posted`), then published by `posted`; `outcome`
/// is written by the worker only while it runs a job, then published by `finished`.
struct Slot {
    posted: AtomicU64,
    finished: AtomicU64,
    stop: AtomicBool,
    job: UnsafeCell<Option<Job>>,
    outcome: UnsafeCell<Result<()>>,
}

// SAFETY: the cells are accessed by one side at a time, as the counters hand them over
// (Release stores, Acquire loads), and the replica a job points to is used by the worker only
// between those two hand-overs, while the caller holds it through `&mut` and does not touch it.
unsafe impl Sync for Slot {}
unsafe impl Send for Slot {}

struct Worker {
    slot: Arc<Slot>,
    thread: Option<JoinHandle<()>>,
}

/// Threads for replicas 1.. of a process (none where it has one).
pub(crate) struct Workers {
    workers: Vec<Worker>,
}

impl Workers {
    /// `count` idle workers.
    pub(crate) fn new(count: usize) -> Result<Workers> {
        let mut workers = Vec::with_capacity(count);
        for i in 0..count {
            let slot = Arc::new(Slot {
                posted: AtomicU64::new(0),
                finished: AtomicU64::new(0),
                stop: AtomicBool::new(false),
                job: UnsafeCell::new(None),
                outcome: UnsafeCell::new(Ok(())),
            });
            let theirs = Arc::clone(&slot);
            let thread = std::thread::Builder::new()
                .name(format!("flatnn-replica-{}", i + 1))
                .spawn(move || work(&theirs))
                .map_err(|e| Error::Config(format!("cannot start a thread for replica {}: {e}", i + 1)))?;
            workers.push(Worker { slot, thread: Some(thread) });
        }
        Ok(Workers { workers })
    }

    /// Runs one step on every replica, replica 0 on this thread and replica i on worker i − 1,
    /// all at once; returns when all are queued, with every replica's outcome (the first error
    /// first, by rank).
    pub(crate) fn step(&mut self, replicas: &mut [Replica], loss: Loss, global: usize, step: u64, timeout: Duration) -> Result<()> {
        assert_eq!(replicas.len(), self.workers.len() + 1, "a worker a replica but the first");
        // idle already, unless a panic on this thread cut the last call short
        self.wait_idle();
        let (first, rest) = replicas.split_first_mut().expect("a replica");
        for (worker, replica) in self.workers.iter().zip(rest) {
            let slot = &worker.slot;
            let job = Job { replica, loss, global, step, timeout };
            let posted = slot.posted.load(Ordering::Relaxed) + 1;
            // SAFETY: the worker is idle (every job posted has finished: `step` waits for all
            // below), so nobody reads the cell now.
            unsafe { *slot.job.get() = Some(job) };
            slot.posted.store(posted, Ordering::Release);
            worker.thread.as_ref().expect("a running worker").thread().unpark();
        }
        let mut outcome = first.step(loss, global, step, timeout);
        if outcome.is_err() {
            // the others must not wait for it at the step's meeting until their timeout
            first.abandon();
        }
        self.wait_idle();
        for worker in &self.workers {
            // SAFETY: the job finished (`wait_idle`): the worker no longer touches the cell.
            let theirs = std::mem::replace(unsafe { &mut *worker.slot.outcome.get() }, Ok(()));
            outcome = outcome.and(theirs);
        }
        outcome
    }

    /// Waits until every worker has finished every job posted to it (each step's own waits
    /// are bounded by its timeout, so this one is too).
    fn wait_idle(&self) {
        for worker in &self.workers {
            let slot = &worker.slot;
            let posted = slot.posted.load(Ordering::Relaxed);
            let mut spins = 0u32;
            while slot.finished.load(Ordering::Acquire) != posted {
                spins = spins.saturating_add(1);
                if spins > 256 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Stops and joins every worker (each idle: `step` returns only when its jobs are done).
    pub(crate) fn stop(&mut self) {
        for worker in &self.workers {
            worker.slot.stop.store(true, Ordering::Release);
            if let Some(thread) = &worker.thread {
                thread.thread().unpark();
            }
        }
        for worker in &mut self.workers {
            if let Some(thread) = worker.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A worker's loop: waits for a job (spinning, then parked), runs it, publishes its outcome.
fn work(slot: &Slot) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        loop {
            let posted = slot.posted.load(Ordering::Acquire);
            if posted != seen {
                seen = posted;
                break;
            }
            if slot.stop.load(Ordering::Acquire) {
                return;
            }
            spins = spins.saturating_add(1);
            // about 50 µs of spinning covers the gap between back-to-back steps
            if spins < 2048 {
                std::hint::spin_loop();
            } else {
                std::thread::park_timeout(Duration::from_millis(10));
            }
        }
        // SAFETY: published by the Release store of `posted` seen above; the caller does not
        // write it again before this job's `finished`.
        let job = unsafe { (*slot.job.get()).expect("a job with its count") };
        // SAFETY: the replica outlives the job and nobody else uses it meanwhile (see Slot).
        let replica = unsafe { &mut *job.replica };
        let outcome = catch_unwind(AssertUnwindSafe(|| replica.step(job.loss, job.global, job.step, job.timeout)))
            .unwrap_or_else(|_| Err(Error::Cuda { what: format!("NCCL rank {}: the step panicked", replica.rank()) }));
        if outcome.is_err() {
            replica.abandon();
        }
        // SAFETY: the caller reads it only after the Release store below.
        unsafe { *slot.outcome.get() = outcome };
        slot.finished.store(seen, Ordering::Release);
    }
}
