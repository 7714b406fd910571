//! Which route runs a convolution: those that compute it (`ConvRoute::serves`) timed on the
//! layer's shape, the fastest kept, once per process for each (shape, kernel, direction, batch
//! bucket), as cuDNN's `Find` is used on the GPU.
//!
//! The routes sum in different orders, so their results differ in the last bits. A choice is
//! made the first time a cache (or gradient buffers) of this process needs it and reused by
//! every later one, whatever its thread count: in one process, the same inputs and parameters
//! give the same bits, on any number of threads, in every cache. Another process may measure
//! otherwise and take the other route, and so differ from this one in the last bits.
//!
//! The routes are timed on one thread with buffers of their own: each runs a sample (a block
//! of samples, backward) as one task, so one thread ranks them as the pool's threads would, and
//! a choice does not depend on which model's values were there.

use super::{backward, forward, ConvRoute, ConvShape, ConvWeights, ConvWorkspace, Epilogue};
use crate::cpu::gemm::GemmWorkspace;
use crate::cpu::isa::Isa;
use crate::cpu::pool::Pool;
use crate::error::{zeros, Result};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The calls a choice is for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Direction {
    Forward,
    /// The weight gradient, and the input gradient where the layer needs one (not on a
    /// network's first layer).
    Backward {
        input_grad: bool,
    },
}

/// Batch sizes that share a choice: one sample (latency, where nothing is shared between
/// samples), or more.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Bucket {
    One,
    Many,
}

/// The batch the routes are timed at for [`Bucket::Many`]: several samples, each costing what
/// it costs in a larger batch (a sample, or a block of them backward, is one task, and the
/// packed weights stay in cache between them).
pub(crate) const MANY_BATCH: usize = 8;

/// Calls of each route timed, after one warm-up call each, the routes taking turns.
const RUNS: usize = 5;

impl Bucket {
    /// The buckets a cache for batches of up to `capacity` samples runs.
    pub fn up_to(capacity: usize) -> &'static [Bucket] {
        if capacity > 1 {
            &[Bucket::One, Bucket::Many]
        } else {
            &[Bucket::One]
        }
    }

    /// The bucket of a batch of `batch` samples.
    pub fn of(batch: usize) -> Bucket {
        if batch > 1 {
            Bucket::Many
        } else {
            Bucket::One
        }
    }

    /// For reports: `1` or `2+`.
    pub fn label(self) -> &'static str {
        match self {
            Bucket::One => "1",
            Bucket::Many => "2+",
        }
    }

    fn timed_batch(self) -> usize {
        match self {
            Bucket::One => 1,
            Bucket::Many => MANY_BATCH,
        }
    }
}

/// A route chosen, with the time per call measured for each (in [`ConvRoute::ALL`]'s order;
/// None for a route that does not compute the convolution).
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) struct Choice {
    pub route: ConvRoute,
    pub times: [Option<Duration>; 3],
}

impl Choice {
    /// The fastest of the routes timed that `allowed` lets through (a route that serves every
    /// convolution, the direct, where it lets none through).
    pub fn fastest(&self, allowed: impl Fn(ConvRoute) -> bool) -> ConvRoute {
        let timed = ConvRoute::ALL.into_iter().zip(self.times).filter(|&(r, _)| allowed(r));
        timed.filter_map(|(r, t)| Some((t?, r))).min_by_key(|&(t, _)| t).map_or(ConvRoute::Direct, |(_, r)| r)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Key {
    isa: Isa,
    shape: ConvShape,
    direction: Direction,
    bucket: Bucket,
}

/// Every choice made in this process: the first of a key is what every cache uses.
static CHOSEN: Mutex<Vec<(Key, Choice)>> = Mutex::new(Vec::new());

/// The route for `shape` with `isa`'s kernels in `direction` for batches of `bucket`: the one
/// this process chose before, else those that compute it timed now (milliseconds on the
/// largest layers of the zoo) and the fastest kept. `Err` where the timing's buffers cannot be
/// had.
pub(crate) fn choose(isa: Isa, shape: &ConvShape, direction: Direction, bucket: Bucket) -> Result<Choice> {
    let key = Key { isa, shape: *shape, direction, bucket };
    // held while timing: a key is timed once, and two timings do not share the CPU
    let mut chosen = CHOSEN.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, choice)) = chosen.iter().find(|(k, _)| *k == key) {
        return Ok(*choice);
    }
    let mut trial = Trial::new(isa, shape, bucket.timed_batch(), 1)?;
    let times = trial.times(direction, RUNS);
    let mut choice = Choice { route: ConvRoute::Direct, times };
    choice.route = choice.fastest(|_| true);
    chosen.push((key, choice));
    Ok(choice)
}

/// The choice this process made for the key, if it made one (for reports).
pub(crate) fn chosen(isa: Isa, shape: &ConvShape, direction: Direction, bucket: Bucket) -> Option<Choice> {
    let key = Key { isa, shape: *shape, direction, bucket };
    CHOSEN.lock().unwrap_or_else(PoisonError::into_inner).iter().find(|(k, _)| *k == key).map(|(_, c)| *c)
}

/// A convolution's buffers for timing its routes on `batch` samples and `threads` threads,
/// uniform values in each.
pub(crate) struct Trial {
    pool: Pool,
    gemm: GemmWorkspace,
    ws: ConvWorkspace,
    weights: ConvWeights,
    batch: usize,
    x: Vec<f32>,
    z: Vec<f32>,
    dw: Vec<f32>,
    dx: Vec<f32>,
}

impl Trial {
    pub fn new(isa: Isa, shape: &ConvShape, batch: usize, threads: usize) -> Result<Trial> {
        let values = |len: usize| -> Result<Vec<f32>> {
            let mut v = zeros(len, || "convolution timing buffers".into())?;
            v.iter_mut().enumerate().for_each(|(i, x)| *x = (i % 17) as f32 / 8.0 - 1.0);
            Ok(v)
        };
        let mut weights = ConvWeights::new(isa, shape)?;
        let w = values(shape.weights_len())?;
        weights.pack(&w);
        if ConvRoute::Winograd.serves(shape, Direction::Forward) {
            weights.pack_winograd(&w);
        }
        let (in_len, out_len) = (batch * shape.in_len(), batch * shape.out_len());
        Ok(Trial {
            pool: Pool::new(threads)?,
            gemm: GemmWorkspace::with_isa(threads, isa)?,
            ws: ConvWorkspace::new(isa, shape, threads, batch)?,
            weights,
            batch,
            x: values(in_len)?,
            z: values(out_len)?,
            dw: values(shape.weights_len())?,
            dx: values(in_len)?,
        })
    }

    /// Each route's time per call in `direction` (None where it does not compute the
    /// convolution): the fastest of `runs` calls after one warm-up call, the routes taking
    /// turns so that a burst of other work hits them alike (noise only ever adds time).
    pub fn times(&mut self, direction: Direction, runs: usize) -> [Option<Duration>; 3] {
        let mut best = [None; 3];
        for round in 0..=runs.max(1) {
            for (route, best) in ConvRoute::ALL.into_iter().zip(&mut best) {
                if !route.serves(&self.ws.shape, direction) {
                    continue;
                }
                let start = Instant::now();
                self.run(route, direction);
                if round > 0 {
                    *best = Some(best.map_or(start.elapsed(), |b: Duration| b.min(start.elapsed())));
                }
            }
        }
        best
    }

    fn run(&mut self, route: ConvRoute, direction: Direction) {
        let Trial { pool, gemm, ws, weights, batch, x, z, dw, dx } = self;
        match direction {
            Direction::Forward => _ = forward(route, pool, gemm, ws, weights, (*batch, 1), x, &Epilogue::NONE, z, None),
            Direction::Backward { input_grad } => {
                // z holds the output gradient: its values are the forward's output length
                let dx = input_grad.then_some(&mut dx[..]);
                backward(route, pool, gemm, ws, weights, *batch, x, z, dw, dx)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A choice is the faster route of its timing, made once: asked again, for any bucket
    /// and direction, the process answers what it chose first.
    #[test]
    fn a_choice_is_the_faster_route_and_is_made_once() {
        let strided = ConvShape { in_channels: 3, height: 11, width: 9, out_channels: 5, kernel: (3, 3), stride: (1, 2), padding: (1, 1) };
        // the Winograd route serves the second forward only
        for (shape, direction) in [strided, ConvShape { stride: (1, 1), ..strided }].into_iter().flat_map(|shape| {
            [Direction::Forward, Direction::Backward { input_grad: true }, Direction::Backward { input_grad: false }].map(|d| (shape, d))
        }) {
            for bucket in [Bucket::One, Bucket::Many] {
                let first = choose(Isa::best(), &shape, direction, bucket).unwrap();
                let faster =
                    ConvRoute::ALL.into_iter().zip(first.times).filter_map(|(r, t)| Some((t?, r))).min_by_key(|&(t, _)| t).unwrap().1;
                let served = ConvRoute::ALL.map(|r| r.serves(&shape, direction));
                assert_eq!(first.times.map(|t| t.is_some()), served, "{direction:?} {bucket:?}: timed what it serves");
                assert_eq!(first.route, faster, "{direction:?} {bucket:?}: {first:?}");
                assert_eq!(choose(Isa::best(), &shape, direction, bucket).unwrap(), first);
                assert_eq!(chosen(Isa::best(), &shape, direction, bucket), Some(first));
            }
        }
        assert_eq!(chosen(Isa::best(), &ConvShape { out_channels: 6, ..strided }, Direction::Forward, Bucket::One), None);
        assert_eq!((Bucket::of(1), Bucket::of(2), Bucket::of(64)), (Bucket::One, Bucket::Many, Bucket::Many));
        assert_eq!((Bucket::up_to(1), Bucket::up_to(2)), (&[Bucket::One][..], &[Bucket::One, Bucket::Many][..]));
    }
}
