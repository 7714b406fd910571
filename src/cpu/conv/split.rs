//! How many parts a convolution's forward cuts each sample's output rows into ([`super::forward`]),
//! so that a batch smaller than the pool still spreads over its threads: per batch size, the
//! faster of one part (a task a sample) and the split that fills the pool, timed on the first
//! call at that batch on the caller's own pool and buffers, as the routes are timed
//! (`choice`). A split pays where a sample's rows are work enough to repay the hand-off and
//! each task preparing the input its rows read (all of it on the lowered route and at a
//! stride); only a timing on this machine tells where.
//! The parts never change the bits (see [`super::forward`]), so neither does the choice.

use super::ConvShape;
use crate::cpu::pool::Pool;
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// Calls of each candidate timed at the first call of a batch, at least, after one warm-up
/// call each, the candidates taking turns, over at least [`SPAN`]; the fastest of each is
/// kept. A call of the split counts only where the pool's workers ran some of its tasks
/// ([`Pool::helped`]): while another process holds the cores, the caller runs them all, and
/// the call times one part with the split's overhead. So the timing goes on until it has
/// this many calls of the split that were spread, or for [`MAX_SPAN`] (then one part: the
/// workers never came).
const RUNS: usize = 10;
/// The least time the calls of a timing span: a scheduler's time slice or two.
const SPAN: Duration = Duration::from_millis(10);
/// The most.
const MAX_SPAN: Duration = Duration::from_millis(100);

/// The parts that fill a pool of `threads` with `batch` samples: ⌈threads / batch⌉, at most OH
/// (1 where the samples alone fill it).
pub(crate) fn filling(shape: &ConvShape, batch: usize, threads: usize) -> usize {
    threads.div_ceil(batch.max(1)).clamp(1, shape.oh().max(1))
}

/// A convolution's choice of parts for each batch size of a cache, made on first use.
pub(crate) struct Splits {
    /// Per batch size 0..=capacity: the split timed (0: none yet) and the parts chosen.
    chosen: Vec<(usize, usize)>,
}

impl Splits {
    /// Room for batches of up to `capacity` samples.
    pub fn new(capacity: usize) -> Result<Splits> {
        let len = capacity.saturating_add(1);
        let mut chosen = Vec::new();
        let bytes = len.saturating_mul(size_of::<(usize, usize)>());
        chosen.try_reserve_exact(len).map_err(|_| Error::OutOfMemory { what: "convolution splits".into(), bytes })?;
        chosen.resize(len, (0, 1));
        Ok(Splits { chosen })
    }

    /// Runs `forward(parts)` once with the parts chosen for `batch` samples on `pool` — the
    /// first time, after timing one part against [`filling`]'s split with calls of `forward`
    /// itself (which must write the same values on every call, on `pool`). Allocates nothing.
    /// Panics if `batch` is past the capacity.
    pub fn run(&mut self, shape: &ConvShape, batch: usize, pool: &Pool, mut forward: impl FnMut(usize)) {
        let wide = filling(shape, batch, pool.threads());
        let (timed, parts) = &mut self.chosen[batch];
        if wide == 1 {
            return forward(1);
        }
        if *timed != wide {
            let (mut best, mut spread, began) = ([Duration::MAX; 2], 0, Instant::now());
            for round in 0.. {
                for (candidate, best) in [1, wide].into_iter().zip(&mut best) {
                    let (helped, start) = (pool.helped(), Instant::now());
                    forward(candidate);
                    let elapsed = start.elapsed();
                    if round > 0 && (candidate == 1 || pool.helped() > helped) {
                        *best = (*best).min(elapsed);
                        spread += usize::from(candidate > 1);
                    }
                }
                let span = began.elapsed();
                if (round >= RUNS && spread >= RUNS && span >= SPAN) || span >= MAX_SPAN {
                    break;
                }
            }
            (*timed, *parts) = (wide, if best[1] < best[0] { wide } else { 1 });
            // the last call wrote the output (every candidate writes the same values)
            return;
        }
        forward(*parts)
    }

    /// The split timed against one part for `batch` samples and the parts chosen (None where
    /// no call at that batch has timed one).
    #[cfg(test)]
    pub fn chosen(&self, batch: usize) -> Option<(usize, usize)> {
        self.chosen.get(batch).copied().filter(|&(timed, _)| timed > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(height: usize) -> ConvShape {
        ConvShape { in_channels: 2, height, width: 6, out_channels: 3, kernel: (3, 3), stride: (1, 1), padding: (1, 1) }
    }

    /// The parts asked for, call by call, each call running that many tasks on a pool of
    /// `threads`.
    fn calls(splits: &mut Splits, shape: &ConvShape, batch: usize, threads: usize) -> Vec<usize> {
        let (pool, mut asked) = (Pool::new(threads).unwrap(), Vec::new());
        splits.run(shape, batch, &pool, |parts| {
            pool.run(parts, &|_, _| std::thread::sleep(Duration::from_micros(20)));
            asked.push(parts)
        });
        asked
    }

    #[test]
    fn the_split_that_fills_the_pool_is_timed_once_a_batch_against_one_part() {
        let (s, mut splits) = (shape(10), Splits::new(8).unwrap());
        assert_eq!((filling(&s, 1, 4), filling(&s, 3, 4), filling(&s, 4, 4), filling(&s, 1, 64)), (4, 2, 1, 10));
        // samples enough for the pool: one call, one part, nothing timed
        assert_eq!(calls(&mut splits, &s, 4, 4), [1]);
        assert_eq!(splits.chosen(4), None);
        // the first call at a batch times both, taking turns; later calls run the choice alone
        let first = calls(&mut splits, &s, 1, 4);
        assert!(first.len() >= 2 * (RUNS + 1) && first.chunks(2).all(|turn| turn == [1, 4]), "{first:?}");
        let (timed, parts) = splits.chosen(1).expect("a choice for batch 1");
        assert!(timed == 4 && [1, 4].contains(&parts), "{timed} {parts}");
        assert_eq!(calls(&mut splits, &s, 1, 4), [parts]);
        // another pool's split is timed anew; another batch has its own choice
        let again = calls(&mut splits, &s, 1, 2);
        assert!(again.len() >= 2 * (RUNS + 1) && again.chunks(2).all(|turn| turn == [1, 2]), "{again:?}");
        assert_eq!(splits.chosen(3), None);
    }
}
