//! The engine's own fork-join pool: `threads - 1` persistent workers plus the calling thread.
//!
//! Why not rayon: entering a rayon pool from a user thread goes through its global injector,
//! which allocates a block every few dozen jobs, and a step must allocate nothing. This pool
//! hands a borrowed closure to its workers through one slot, so `run` never allocates; workers
//! spin briefly between runs (a step is many short parallel regions) and then sleep on a condvar.
//!
//! The caller never waits for a worker that has not started: workers enter a run through one
//! atomic word (a count plus a "closed" bit), and when the caller has run out of tasks it closes
//! the run and waits only for the workers inside. A worker that the OS has not scheduled (on a
//! busy machine) then costs nothing, instead of stalling every parallel region for a time slice.
//!
//! A run's tasks compute in the calling thread's floating-point mode ([`fp_mode`]), as OpenMP
//! runtimes hand theirs to their workers: a program that flushes subnormal values to zero on its
//! thread gets that in the workers too, and a result's bits do not depend on which thread
//! computed it.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::fp_mode;
use super::SharedMut;
use crate::error::{Error, Result};

/// How many spins a worker makes waiting for the next run before it sleeps (~tens of µs).
const SPINS_BEFORE_SLEEP: u32 = 1 << 15;

type Task<'a> = dyn Fn(usize, usize) + Sync + 'a;

struct Shared {
    /// The closure of the current run, erased to `'static`; valid while the run is open or a worker is inside.
    job: UnsafeCell<Option<*const Task<'static>>>,
    tasks: AtomicUsize,
    next_task: AtomicUsize,
    /// `CLOSED` bit | number of workers inside the current run. `job` may be read only by a
    /// worker whose increment found the run open, until its decrement.
    state: AtomicUsize,
    generation: AtomicUsize,
    /// The floating-point mode of the thread that opened the current run ([`fp_mode`]).
    fp_mode: AtomicU32,
    sleepers: AtomicUsize,
    /// How many times a worker has come back from sleeping (the tests read it).
    woken: AtomicUsize,
    /// Workers that have started (finished the thread's own start-up, which allocates).
    started: AtomicUsize,
    /// Tasks of the current run that the workers (not the caller) ran: each adds its count
    /// once, as it leaves the run.
    helped: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

const CLOSED: usize = 1 << (usize::BITS - 1);

// SAFETY: `job` is written only by the thread inside `Pool::run` while the run is closed and no
// worker is inside, and read by workers only while inside an open run (see `state`); the
// closure itself is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw job pointer is the only field that is not `Send` by itself.
unsafe impl Send for Shared {}

/// A fixed set of threads that runs `f(task, worker)` for `task in 0..tasks`.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Guards against two threads using the pool at once (the slot holds one job).
    busy: AtomicBool,
    /// Runs handed to the workers so far, and how many of those the workers took tasks of
    /// ([`Pool::handed`]).
    handed: AtomicUsize,
    helped_runs: AtomicUsize,
}

impl Pool {
    /// A pool of `threads` threads in all (the caller counts as one); `threads` ≥ 1. If a
    /// thread cannot be started, the ones already started are stopped and joined before the
    /// error returns.
    /// `threads` must be in 1..=[`max_threads`].
    pub fn new(threads: usize) -> Result<Pool> {
        let limit = max_threads();
        if threads == 0 || threads > limit {
            return Err(Error::Config(format!(
                "{threads} threads: the thread count must be from 1 to {limit} ({MAX_THREADS_PER_CPU} per logical CPU of this machine)"
            )));
        }
        Pool::start(threads, |worker| std::thread::Builder::new().name(format!("flatnn-{worker}")))
    }

    /// [`Pool::new`] with the builder of each worker thread given (tests make one fail).
    fn start(threads: usize, builder: impl Fn(usize) -> std::thread::Builder) -> Result<Pool> {
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            state: AtomicUsize::new(CLOSED),
            generation: AtomicUsize::new(0),
            fp_mode: AtomicU32::new(fp_mode::current()),
            sleepers: AtomicUsize::new(0),
            woken: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
            helped: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        // Workers join the pool as they start, so that an early return drops it, and its
        // `Drop` stops and joins every worker started so far.
        let mut pool = Pool {
            shared: Arc::clone(&shared),
            workers: Vec::new(),
            busy: AtomicBool::new(false),
            handed: AtomicUsize::new(0),
            helped_runs: AtomicUsize::new(0),
        };
        let cannot = |what: String| Error::Config(format!("cannot start {threads} threads: {what}"));
        pool.workers.try_reserve_exact(threads - 1).map_err(|e| cannot(e.to_string()))?;
        for worker in 1..threads {
            let shared = Arc::clone(&shared);
            let handle = builder(worker).spawn(move || worker_loop(&shared, worker));
            pool.workers.push(handle.map_err(|e| cannot(format!("thread {worker}: {e}")))?);
        }
        // A run does not wait for workers that have not started, so wait here: a thread's
        // start-up allocates, and must not land inside a step that promised not to.
        while shared.started.load(Acquire) < threads - 1 {
            std::thread::yield_now();
        }
        Ok(pool)
    }

    /// Number of threads, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// (Runs handed to the workers, runs of which they ran a task), counted since the pool
    /// began: a timing of work on the pool that handed runs out and got no help timed the
    /// caller alone (another process held the cores), not the pool.
    pub(crate) fn handed(&self) -> (usize, usize) {
        (self.handed.load(Relaxed), self.helped_runs.load(Relaxed))
    }

    /// Wakes the workers that sleep between runs, without a run: they spin for the next one as
    /// after a run of their own (and sleep again if none comes). Returns at once. A timing that
    /// alternates work on the pool with longer work elsewhere calls it before the pool's turn,
    /// so that the turn finds the workers as back-to-back calls would.
    pub(crate) fn wake(&self) {
        let s = &*self.shared;
        // a worker that sees the generation move enters the current run if one is open (a run
        // of another caller: it takes tasks as usual), else finds it closed and leaves
        s.generation.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
    }

    /// Runs `f(task, worker)` for every `task in 0..tasks` and returns when all have finished.
    /// `worker` is in `0..threads()`, and no two tasks of this run that run at the same time
    /// share one; a run started while another is in progress (from another thread, or from
    /// inside a task) runs its tasks one after another on its caller, all as worker 0. So a
    /// worker index names scratch only for buffers borrowed by this run alone: see
    /// [`Pool::run_with`]. Tasks are handed out dynamically: results must not depend on which
    /// worker ran a task. Allocates nothing. A panic in a task is re-raised here.
    ///
    /// Returns how many of the tasks the workers ran (not the caller): 0 where the run went
    /// serial, or where the workers never came (busy elsewhere, or descheduled by the OS), so
    /// that timing such a run says nothing about spreading work over the pool.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) -> usize {
        if tasks == 0 {
            return 0;
        }
        if self.workers.is_empty() || tasks == 1 || self.busy.swap(true, Acquire) {
            // Serial: one thread, a single task, or a nested/concurrent call.
            for task in 0..tasks {
                f(task, 0);
            }
            return 0;
        }
        let s = &*self.shared;
        // SAFETY: the erased lifetime is never observed past this call: we close the run and
        // wait below until no worker is inside, after which none reads `job` again.
        let erased: *const Task<'static> = unsafe { std::mem::transmute(f as *const Task<'_>) };
        // SAFETY: the run is closed and empty since the last run ended, so nobody reads `job`.
        unsafe { *s.job.get() = Some(erased) };
        s.tasks.store(tasks, Relaxed);
        s.next_task.store(0, Relaxed);
        s.helped.store(0, Relaxed);
        s.fp_mode.store(fp_mode::current(), Relaxed);
        // open (fetch_and, not store: a worker backing off a closed run may hold a count)
        s.state.fetch_and(!CLOSED, Release);
        s.generation.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| take_tasks(s, f, 0)));
        // Every task is taken; wait only for the workers running one.
        s.state.fetch_or(CLOSED, AcqRel);
        let mut spins = 0u32;
        while s.state.load(Acquire) != CLOSED {
            spins += 1;
            if spins.is_multiple_of(1 << 12) {
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
        // (every worker's count was added before it left: the Acquire above sees it)
        let helped = s.helped.load(Relaxed);
        self.handed.fetch_add(1, Relaxed);
        if helped > 0 {
            self.helped_runs.fetch_add(1, Relaxed);
        }
        self.busy.store(false, Release);
        if mine.is_err() || s.panicked.swap(false, AcqRel) {
            panic!("a flatnn pool task panicked");
        }
        helped
    }

    /// [`Pool::run`] with one value per worker: `f(task, worker, &mut per_worker[worker])`.
    /// The values are borrowed for this run alone, so a task has its worker's value to itself.
    /// Panics, before any task runs, if there are fewer values than threads. Returns what
    /// [`Pool::run`] does.
    pub fn run_with<T: Send>(&self, tasks: usize, per_worker: &mut [T], f: &(dyn Fn(usize, usize, &mut T) + Sync)) -> usize {
        assert!(per_worker.len() >= self.threads(), "{} per-worker values for {} threads", per_worker.len(), self.threads());
        let values = SharedMut::new(per_worker);
        self.run(tasks, &|task, worker| {
            // SAFETY: `per_worker` is borrowed exclusively by this call, and the tasks of one
            // run that are live at the same time have distinct worker indices (see `run`), so
            // no two live `&mut` reach the same value.
            let value = unsafe { &mut values.slice(worker..worker + 1)[0] };
            f(task, worker, value);
        })
    }
}

/// Runs tasks of the current run until none is left; returns how many it ran.
fn take_tasks(s: &Shared, f: &Task<'_>, worker: usize) -> usize {
    let (tasks, mut ran) = (s.tasks.load(Relaxed), 0);
    loop {
        let task = s.next_task.fetch_add(1, Relaxed);
        if task >= tasks {
            return ran;
        }
        f(task, worker);
        ran += 1;
    }
}

fn worker_loop(s: &Shared, worker: usize) {
    s.started.fetch_add(1, Release);
    let (mut seen, mut mode) = (0usize, fp_mode::current());
    loop {
        let mut spins = 0u32;
        while s.generation.load(Acquire) == seen && !s.shutdown.load(Relaxed) {
            if spins < SPINS_BEFORE_SLEEP {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, SeqCst);
            let mut guard = guard;
            while s.generation.load(SeqCst) == seen && !s.shutdown.load(SeqCst) {
                guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, SeqCst);
            s.woken.fetch_add(1, SeqCst);
        }
        if s.shutdown.load(Acquire) {
            return;
        }
        seen = s.generation.load(Acquire);
        // Enter; if the run (this one or a later one) is still open, `job` is valid until we
        // leave. If it is closed, its tasks are all done: leave without reading `job`.
        if s.state.fetch_add(1, Acquire) & CLOSED == 0 {
            // the caller's floating-point mode, stored before the Release that opened the run
            let callers = s.fp_mode.load(Relaxed);
            if callers != mode {
                fp_mode::set(callers);
                mode = callers;
            }
            // SAFETY: entered an open run, published by the Release that opened it.
            let job = unsafe { (*s.job.get()).expect("job set before the run opens") };
            // SAFETY: see above; the pointee lives on the stack of the thread inside `run`,
            // which waits for us to leave.
            let f = unsafe { &*job };
            match catch_unwind(AssertUnwindSafe(|| take_tasks(s, f, worker))) {
                Ok(ran) => _ = s.helped.fetch_add(ran, Relaxed),
                Err(_) => s.panicked.store(true, Release),
            }
        }
        s.state.fetch_sub(1, Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        {
            let _guard = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

/// Threads a pool may run per logical CPU: more only time-slice one another, and a count far
/// past this is a mistake (a stray digit) that would start thousands of threads.
const MAX_THREADS_PER_CPU: usize = 4;

/// The most threads a pool may run on this machine.
pub fn max_threads() -> usize {
    MAX_THREADS_PER_CPU * std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Physical cores of this machine (logical CPUs when that cannot be read).
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
        return logical;
    };
    let mut cores = std::collections::BTreeSet::new();
    let (mut physical, mut core) = (None, None);
    for line in cpuinfo.lines() {
        let value = line.split(':').nth(1).map(str::trim);
        if line.starts_with("physical id") {
            physical = value.and_then(|v| v.parse::<usize>().ok());
        } else if line.starts_with("core id") {
            core = value.and_then(|v| v.parse::<usize>().ok());
        } else if line.trim().is_empty() {
            if let (Some(p), Some(c)) = (physical, core) {
                cores.insert((p, c));
            }
            (physical, core) = (None, None);
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::time::Duration;

    /// `handed` counts the runs handed to the workers (not serial ones: one task, one thread)
    /// and those of them the workers took tasks of: of 100 runs of tasks that sleep, some.
    #[test]
    fn handed_counts_runs_given_out_and_those_helped() {
        let pool = Pool::new(2).unwrap();
        pool.run(1, &|_, _| {});
        Pool::new(1).unwrap().run(8, &|_, _| {});
        assert_eq!(pool.handed(), (0, 0), "serial runs are not handed out");
        let mut helped = 0;
        for _ in 0..100 {
            helped += usize::from(pool.run(16, &|_, _| std::thread::sleep(Duration::from_micros(50))) > 0);
        }
        assert_eq!(pool.handed(), (100, helped));
        assert!(helped > 0, "the worker never took a task in 100 runs");
    }

    #[test]
    fn runs_every_task_once() {
        for threads in 1..=3 {
            let pool = Pool::new(threads).unwrap();
            for tasks in [0, 1, 2, 7, 100] {
                let hits: Vec<AtomicU64> = (0..tasks).map(|_| AtomicU64::new(0)).collect();
                for _ in 0..50 {
                    pool.run(tasks, &|task, worker| {
                        assert!(worker < threads);
                        hits[task].fetch_add(1, Relaxed);
                    });
                }
                assert!(hits.iter().all(|h| h.load(Relaxed) == 50));
            }
        }
    }

    /// Waking the workers without a run, before, between and during runs (from another thread,
    /// while a run is open), leaves every run's tasks run once; and it wakes workers asleep.
    #[test]
    fn waking_without_a_run_leaves_runs_whole_and_wakes_the_sleepers() {
        let pool = Pool::new(3).unwrap();
        let hits: Vec<AtomicU64> = (0..7).map(|_| AtomicU64::new(0)).collect();
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !stop.load(Relaxed) {
                    pool.wake();
                    std::thread::yield_now();
                }
            });
            for _ in 0..200 {
                pool.wake();
                pool.run(7, &|task, _| _ = hits[task].fetch_add(1, Relaxed));
            }
            stop.store(true, Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Relaxed) == 200));
        let sleepers = || pool.shared.sleepers.load(SeqCst);
        let within = |secs: u64, done: &dyn Fn() -> bool| {
            let start = std::time::Instant::now();
            while !done() && start.elapsed() < std::time::Duration::from_secs(secs) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            done()
        };
        assert!(within(10, &|| sleepers() == 2), "the idle workers never slept");
        // a woken worker spins a while and sleeps again, too soon on some hosts for a poll of
        // `sleepers` to see: count its coming back instead
        let woken = pool.shared.woken.load(SeqCst);
        pool.wake();
        assert!(within(10, &|| pool.shared.woken.load(SeqCst) > woken), "no sleeping worker woke");
    }

    /// A run's tasks compute in the caller's floating-point mode: with flush-to-zero and
    /// denormals-are-zero set on the calling thread, a product of two values whose exact result
    /// is subnormal is 0 on every thread that ran a task, workers included; back in the default
    /// mode it is the subnormal again on every thread.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn tasks_compute_in_the_callers_floating_point_mode() {
        const FTZ_DAZ: u32 = 0x8040;
        struct Restore(u32);
        impl Drop for Restore {
            fn drop(&mut self) {
                fp_mode::set(self.0)
            }
        }
        let default = fp_mode::current();
        let _restore = Restore(default);
        let pool = Pool::new(3).unwrap();
        // the products of runs in `mode`, until a worker has run some of them
        let products = |mode: u32| {
            let (mut products, mut by_workers) = (Vec::new(), 0);
            for _ in 0..50 {
                fp_mode::set(mode);
                let results: Vec<AtomicU32> = (0..16).map(|_| AtomicU32::new(0)).collect();
                let workers = AtomicUsize::new(0);
                pool.run(16, &|task, worker| {
                    std::thread::sleep(Duration::from_micros(100));
                    let product = std::hint::black_box(1e-20f32) * std::hint::black_box(1e-20f32);
                    results[task].store(product.to_bits(), Relaxed);
                    workers.fetch_add(usize::from(worker > 0), Relaxed);
                });
                fp_mode::set(default);
                products.extend(results.iter().map(|r| f32::from_bits(r.load(Relaxed))));
                by_workers += workers.load(Relaxed);
                if by_workers > 0 {
                    break;
                }
            }
            assert!(by_workers > 0, "no worker ran a task in 50 runs");
            products
        };
        let subnormal = |p: &f32| *p > 0.0 && *p < f32::MIN_POSITIVE;
        assert!(products(default).iter().all(subnormal), "the default mode keeps subnormal values");
        assert!(products(default | FTZ_DAZ).iter().all(|&p| p == 0.0), "flush-to-zero on the caller, not on every thread");
        assert!(products(default).iter().all(subnormal), "the workers kept flushing after the caller stopped");
    }

    /// A run reports the tasks its workers ran: none on one thread or nested in a task, and on
    /// more threads some in at least one of 50 runs (each task sleeps, so the workers have
    /// time to come), never more than the run's tasks.
    #[test]
    fn a_run_reports_the_tasks_its_workers_ran() {
        for threads in 1..=3 {
            let pool = Pool::new(threads).unwrap();
            let helped: Vec<usize> = (0..50).map(|_| pool.run(110, &|_, _| std::thread::sleep(Duration::from_micros(10)))).collect();
            assert!(helped.iter().all(|&h| h <= 110), "{threads} threads: {helped:?}");
            assert_eq!(helped.iter().any(|&h| h > 0), threads > 1, "{threads} threads: {helped:?}");
            let nested = AtomicUsize::new(usize::MAX);
            pool.run(2, &|task, _| {
                if task == 0 {
                    nested.store(pool.run(110, &|_, _| {}), Relaxed);
                }
            });
            assert_eq!(nested.load(Relaxed), 0, "{threads} threads: a nested run goes serial");
        }
    }

    #[test]
    fn panic_in_task_reaches_caller_and_pool_survives() {
        let pool = Pool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|task, _| assert!(task != 5, "boom"));
        }));
        assert!(r.is_err());
        let count = AtomicU64::new(0);
        pool.run(8, &|_, _| {
            count.fetch_add(1, Relaxed);
        });
        assert_eq!(count.load(Relaxed), 8);
    }

    #[test]
    fn run_with_gives_each_live_task_its_own_value() {
        for threads in 1..=3 {
            let pool = Pool::new(threads).unwrap();
            // each task writes its number into its worker's value, yields, and reads it back:
            // a value shared by two live tasks would show the other's number
            let mut values = vec![usize::MAX; threads];
            let clashes = AtomicU64::new(0);
            pool.run_with(64, &mut values, &|task, _, value| {
                *value = task;
                std::thread::yield_now();
                if *value != task {
                    clashes.fetch_add(1, Relaxed);
                }
            });
            assert_eq!(clashes.load(Relaxed), 0);
        }
    }

    #[test]
    #[should_panic(expected = "1 per-worker values for 2 threads")]
    fn run_with_needs_a_value_per_thread() {
        Pool::new(2).unwrap().run_with(4, &mut [0u8], &|_, _, _| {});
    }

    /// Threads of this process whose name starts with `prefix`.
    #[cfg(target_os = "linux")]
    fn threads_named(prefix: &str) -> usize {
        let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
        let named = |t: &std::fs::DirEntry| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(prefix));
        tasks.filter_map(|t| t.ok()).filter(named).count()
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_failed_start_stops_and_joins_the_threads_it_started() {
        // worker 3 asks for a stack no machine has, so its spawn fails after 1 and 2 started
        let builder = |worker: usize| {
            let b = std::thread::Builder::new().name(format!("failstart-{worker}"));
            if worker == 3 {
                b.stack_size(1 << 60)
            } else {
                b
            }
        };
        match Pool::start(6, builder) {
            Err(Error::Config(msg)) => assert!(msg.contains("cannot start 6 threads: thread 3"), "{msg}"),
            other => panic!("expected a Config error, got {:?}", other.map(|p| p.threads())),
        }
        // a joined thread may linger in /proc a moment after its join returns (the kernel wakes
        // the joiner before it reaps the task): give it a second, no more
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while threads_named("failstart-") > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(threads_named("failstart-"), 0, "threads left running after the failed start");
    }

    #[test]
    fn physical_cores_is_positive() {
        assert!(physical_cores() >= 1);
    }

    #[test]
    fn thread_counts_past_the_limit_are_refused_before_any_start() {
        let limit = max_threads();
        assert!(limit >= MAX_THREADS_PER_CPU && physical_cores() <= limit);
        for threads in [0, limit + 1, 30_000, usize::MAX] {
            match Pool::new(threads) {
                Err(Error::Config(msg)) => {
                    assert!(msg.contains(&format!("{threads} threads")) && msg.contains(&limit.to_string()), "{msg}")
                }
                other => panic!("{threads} threads: expected a Config error, got {:?}", other.map(|p| p.threads())),
            }
        }
    }
}
