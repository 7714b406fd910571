//! How many parts a convolution's forward cuts each sample's output rows into ([`super::forward`]),
//! so that a batch smaller than the pool still spreads over its threads: per batch size, the
//! faster of one part (a task a sample) and the split that fills the pool, timed on the first
//! call at that batch on the caller's own pool and buffers, as the routes are timed
//! (`choice`). A split pays where a sample's rows are work enough to repay the hand-off and
//! each task preparing the input its rows read (all of it on the lowered route and at a
//! stride); only a timing on this machine tells where.
//! The parts never change the bits (see [`super::forward`]), so neither does the choice.

use super::ConvShape;
use crate::cpu::turns::fastest_in_turns;
use crate::error::{Error, Result};
use std::time::Duration;

/// Calls of each candidate that must count when the first call of a batch times one part
/// against the split ([`fastest_in_turns`], a warm-up call each): a call of more than one task
/// (the split's; one part's at a batch of several) counts only where the pool's workers ran
/// some of them (as the call reports), which would otherwise favour one part against a split
/// or, at a batch of several, the split against one part; one part where neither counted (the
/// workers never came).
const RUNS: usize = 10;

/// The parts that fill a pool of `threads` with `batch` samples: ⌈threads / batch⌉, at most OH
/// (1 where the samples alone fill it).
pub(crate) fn filling(shape: &ConvShape, batch: usize, threads: usize) -> usize {
    threads.div_ceil(batch.max(1)).clamp(1, shape.oh().max(1))
}

/// The choice of parts for one batch size, and the timing that made it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Split {
    /// The split timed against one part ([`filling`]'s).
    pub wide: usize,
    /// The fastest call of one part and of the split that counted (None where none did).
    pub times: [Option<Duration>; 2],
    /// The parts kept: 1 or `wide`.
    pub parts: usize,
}

/// A convolution's choice of parts for each batch size of a cache below its thread count (the
/// batches that may split), made on first use.
pub(crate) struct Splits {
    /// Per batch size 0..=min(capacity, threads − 1), once a call at that batch timed a split.
    chosen: Vec<Option<Split>>,
}

impl Split {
    /// For reports: the parts kept and their time, then the other's.
    pub fn describe(&self) -> String {
        let parts = |n: usize| if n == 1 { "1 part".to_string() } else { format!("{n} parts") };
        let time = |t: Option<Duration>| t.map_or("no call counted".into(), |t| format!("{:.1} µs", t.as_secs_f64() * 1e6));
        let (kept, other) = if self.parts == 1 { (0, 1) } else { (1, 0) };
        let count = [1, self.wide];
        format!("{}, {} ({} {})", parts(count[kept]), time(self.times[kept]), parts(count[other]), time(self.times[other]))
    }
}

impl Splits {
    /// Room for batches of up to `capacity` samples on pools of up to `threads`.
    pub fn new(capacity: usize, threads: usize) -> Result<Splits> {
        let len = capacity.min(threads.saturating_sub(1)).saturating_add(1);
        let mut chosen = Vec::new();
        let bytes = len.saturating_mul(size_of::<Option<Split>>());
        chosen.try_reserve_exact(len).map_err(|_| Error::OutOfMemory { what: "convolution splits".into(), bytes })?;
        chosen.resize(len, None);
        Ok(Splits { chosen })
    }

    /// Runs `forward(parts)` once with the parts chosen for `batch` samples on a pool of
    /// `threads` — the first time, after timing one part against [`filling`]'s split with
    /// calls of `forward` itself, which must write the same values on every call and return
    /// how many of its tasks the pool's workers ran ([`crate::cpu::pool::Pool::run`]).
    /// Allocates nothing. Panics if `batch` is below `threads` and past the room made by
    /// [`Splits::new`].
    pub fn run(&mut self, shape: &ConvShape, batch: usize, threads: usize, mut forward: impl FnMut(usize) -> usize) {
        let wide = filling(shape, batch, threads);
        if wide == 1 {
            forward(1);
            return;
        }
        // (wide > 1: batch < threads)
        let chosen = &mut self.chosen[batch];
        match chosen {
            Some(split) if split.wide == wide => _ = forward(split.parts),
            _ => *chosen = Some(time(batch, wide, forward)),
        }
    }

    /// The batches whose split was timed, with its choice.
    pub fn timed(&self) -> impl Iterator<Item = (usize, &Split)> {
        self.chosen.iter().enumerate().filter_map(|(batch, split)| split.as_ref().map(|s| (batch, s)))
    }

    /// The split timed against one part for `batch` samples and the parts chosen (None where
    /// no call at that batch has timed one).
    #[cfg(test)]
    pub fn chosen(&self, batch: usize) -> Option<(usize, usize)> {
        self.chosen.get(batch).copied().flatten().map(|s| (s.wide, s.parts))
    }
}

/// One part against `wide` parts for `batch` samples, timed as [`RUNS`] says with calls of
/// `forward` (see [`Splits::run`]); the last call wrote the output (every call writes the same
/// values).
fn time(batch: usize, wide: usize, mut forward: impl FnMut(usize) -> usize) -> Split {
    let candidates = [1, wide];
    let times = fastest_in_turns::<2>(RUNS, 1, |i| {
        let helped = forward(candidates[i]);
        batch * candidates[i] == 1 || helped > 0
    });
    let time = |t: Option<Duration>| t.unwrap_or(Duration::MAX);
    Split { wide, times, parts: if time(times[1]) < time(times[0]) { wide } else { 1 } }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::pool::Pool;
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

    fn shape(height: usize) -> ConvShape {
        ConvShape { in_channels: 2, height, width: 6, out_channels: 3, kernel: (3, 3), stride: (1, 1), padding: (1, 1) }
    }

    /// The parts asked for, call by call, each call running `batch × parts` tasks on a pool of
    /// `threads`, each task sleeping `sleep(parts)`; where there are several, the caller's first
    /// waits for a worker to take one, so that every call is spread over the pool (a worker
    /// woken late on a busy machine would otherwise leave the caller all the tasks, and the call
    /// would not count).
    fn calls(splits: &mut Splits, shape: &ConvShape, (batch, threads): (usize, usize), sleep: fn(usize) -> Duration) -> Vec<usize> {
        let (pool, mut asked) = (Pool::new(threads).unwrap(), Vec::new());
        splits.run(shape, batch, threads, |parts| {
            let helped = AtomicBool::new(false);
            asked.push(parts);
            pool.run(batch * parts, &|_, worker| {
                if worker > 0 {
                    helped.store(true, Relaxed);
                }
                while worker == 0 && batch * parts > 1 && !helped.load(Relaxed) {
                    std::thread::yield_now();
                }
                std::thread::sleep(sleep(parts))
            })
        });
        asked
    }

    /// One part sleeps 4 ms, the split 200 µs a task: a margin that keeps the split faster on a
    /// busy machine, where most of its call is waiting for a sleeping worker to wake.
    fn split_fast(parts: usize) -> Duration {
        Duration::from_micros(if parts == 1 { 4000 } else { 200 })
    }

    #[test]
    fn the_split_that_fills_the_pool_is_timed_once_a_batch_against_one_part() {
        let (s, mut splits) = (shape(10), Splits::new(8, 4).unwrap());
        assert_eq!((filling(&s, 1, 4), filling(&s, 3, 4), filling(&s, 4, 4), filling(&s, 1, 64)), (4, 2, 1, 10));
        // room for the batches below the thread count alone (and batch 0)
        assert_eq!([(8, 4), (1, 4), (8, 1), (0, 4)].map(|(c, t)| Splits::new(c, t).unwrap().chosen.len()), [4, 2, 1, 1]);
        // samples enough for the pool: one call, one part, nothing timed
        assert_eq!(calls(&mut splits, &s, (4, 4), split_fast), [1]);
        assert_eq!(calls(&mut splits, &s, (7, 4), split_fast), [1]);
        assert_eq!(splits.chosen(4), None);
        // the first call at a batch times both, taking turns, a warm-up call each and RUNS
        // more at least; later calls run the faster alone
        let first = calls(&mut splits, &s, (1, 4), split_fast);
        assert!(first.len() >= 2 * (RUNS + 1) && first.chunks(2).all(|turn| turn == [1, 4]), "{first:?}");
        assert_eq!(splits.chosen(1), Some((4, 4)));
        assert_eq!(calls(&mut splits, &s, (1, 4), split_fast), [4]);
        // another pool's split is timed anew; another batch has its own choice
        let again = calls(&mut splits, &s, (1, 2), split_fast);
        assert!(again.len() >= 2 * (RUNS + 1) && again.chunks(2).all(|turn| turn == [1, 2]), "{again:?}");
        assert_eq!(splits.chosen(1), Some((2, 2)));
        assert_eq!(splits.chosen(3), None);
    }

    /// A split whose tasks the workers never ran (each call reporting none) is never kept,
    /// however fast it timed: after `turns::MAX_SPAN`, one part.
    #[test]
    fn a_split_the_workers_never_ran_is_not_kept() {
        let mut splits = Splits::new(1, 4).unwrap();
        splits.run(&shape(10), 1, 4, |parts| {
            std::thread::sleep(split_fast(parts));
            0
        });
        assert_eq!(splits.chosen(1), Some((4, 1)));
    }

    /// At a batch of several, one part's calls count only where the workers ran some of its
    /// tasks too: one part, faster but never spread, loses to a split that was.
    #[test]
    fn one_part_of_several_samples_counts_only_where_the_workers_helped() {
        let mut splits = Splits::new(2, 4).unwrap();
        splits.run(&shape(10), 2, 4, |parts| {
            std::thread::sleep(Duration::from_micros(if parts == 1 { 200 } else { 4000 }));
            usize::from(parts > 1)
        });
        assert_eq!(splits.chosen(2), Some((2, 2)));
    }

    /// Calls past `turns::MAX_SPAN` on their own are timed, not spent on warming up: the faster
    /// candidate is kept, one call of each after its first at most.
    #[test]
    fn a_slow_call_is_timed_on_its_own() {
        let s = shape(10);
        let one_slow = |parts: usize| Duration::from_micros(if parts == 1 { 120_000 } else { 10_000 });
        let split_slow = |parts: usize| Duration::from_micros(if parts == 1 { 20 } else { 120_000 });
        for (sleep, chosen) in [(one_slow as fn(usize) -> Duration, 4), (split_slow, 1)] {
            let mut splits = Splits::new(1, 4).unwrap();
            let asked = calls(&mut splits, &s, (1, 4), sleep);
            assert_eq!(splits.chosen(1), Some((4, chosen)), "{asked:?}");
            assert!(asked.len() <= 4, "{asked:?}");
        }
    }
}
