//! Candidates timed taking turns, where only a timing on this machine tells which is faster: a
//! convolution's split of a sample's rows over the pool (`conv/split.rs`) and a pass of one
//! sample on the pool or on the calling thread alone (`Cache::time_batch_one`).

use std::time::{Duration, Instant};

/// The least time the calls of a timing span: a scheduler's time slice or two.
pub(crate) const SPAN: Duration = Duration::from_millis(10);
/// The most.
pub(crate) const MAX_SPAN: Duration = Duration::from_millis(100);

/// The fastest call of each of `N` candidates that counted (None where none did). `call(i)`
/// runs candidate i once and says whether the call counts: a call that handed work to the
/// pool's workers counts only where they ran some of it, since while another process holds the
/// cores the caller runs everything and the call times one thread, not the pool. The
/// candidates take turns, so that a burst of other work hits them alike (noise only ever adds
/// time). A candidate's first `warm_up` calls are not timed, unless one alone took a [`SPAN`] (a
/// call that long is its own warm-up). The calls go on until each candidate has `runs` calls
/// that count, over at least [`SPAN`], or, once each has had a timed call, for [`MAX_SPAN`].
pub(crate) fn fastest_in_turns<const N: usize>(runs: usize, warm_up: usize, mut call: impl FnMut(usize) -> bool) -> [Option<Duration>; N] {
    let (mut best, mut counted, mut tried, began) = ([None::<Duration>; N], [0; N], [false; N], Instant::now());
    for round in 0.. {
        for i in 0..N {
            let start = Instant::now();
            let counts = call(i);
            let elapsed = start.elapsed();
            if round >= warm_up || elapsed >= SPAN {
                tried[i] = true;
                if counts {
                    best[i] = Some(best[i].map_or(elapsed, |b| b.min(elapsed)));
                    counted[i] += 1;
                }
            }
        }
        let span = began.elapsed();
        if (counted.iter().all(|&n| n >= runs) && span >= SPAN) || (tried.iter().all(|&t| t) && span >= MAX_SPAN) {
            break;
        }
    }
    best
}
