"""The zoo's timing method, the same as benches/zoo/timing.rs (whose constants arrive as JSON).

`repeated`: warm-up (at least two calls and `warmup_s`), then samples of back-to-back calls, each
sample at least `min_sample_s` long (the last call of a sample gets end=True and must wait for
the device), between `min_samples` and `max_samples` samples within about `point_s`; the median
time per call. `single`: warm-up, then `latency_s` worth of single calls (between `min_calls` and
`max_calls`), each timed alone; p50 and p99 by nearest rank. A call over `limit_s` (the first
call: `prediction_slack` limits) ends the point ("over the limit"). With `cpu_clock`, time is
the process's CPU time (time.process_time), which leaves out the time other jobs on a shared
host hold the core: the call's time only where one thread computes (cpu1).
"""

import math
import time


class OverLimit(Exception):
    def __init__(self, seconds):
        super().__init__(f"one call took {seconds:.2f} s")
        self.seconds = seconds


def clock(t):
    return time.process_time if t.get("cpu_clock") else time.perf_counter


def warm_up(t, call):
    """Runs the warm-up; returns the time of its last call."""
    now = clock(t)
    start, calls = now(), 0
    while True:
        s = now()
        call(True)
        last = now() - s
        calls += 1
        # the first call may carry one-time costs (first touch, capture, algorithm search)
        limit = t["limit_s"] * (t["prediction_slack"] if calls == 1 else 1)
        if last > limit:
            raise OverLimit(last)
        if calls >= 2 and now() - start >= t["warmup_s"]:
            return max(last, 1e-9)


def repeated(t, call):
    """(median seconds per call, calls timed)."""
    once, now = warm_up(t, call), clock(t)
    per_sample = max(1, math.ceil(t["min_sample_s"] / once))
    samples = min(t["max_samples"], max(t["min_samples"], int(t["point_s"] / (per_sample * once))))
    times = []
    for _ in range(samples):
        start = now()
        for i in range(per_sample):
            call(i + 1 == per_sample)
        times.append((now() - start) / per_sample)
    times.sort()
    return times[len(times) // 2], samples * per_sample


def nearest_rank(sorted_times, q):
    return sorted_times[max(0, math.ceil(q * len(sorted_times)) - 1)]


def single(t, call):
    """(p50, p99, calls timed), each call timed alone."""
    once, now = warm_up(t, call), clock(t)
    calls = min(t["max_calls"], max(t["min_calls"], int(t["latency_s"] / once)))
    times = []
    for _ in range(calls):
        start = now()
        call(True)
        times.append(now() - start)
    times.sort()
    return nearest_rank(times, 0.5), nearest_rank(times, 0.99), calls


class Series:
    """One series of points (a peer, model, device and task, batches ascending): skips the batches
    after one that went over the limit, and any predicted (from the batch before, scaled by the
    batch) to take over `prediction_slack` limits."""

    def __init__(self):
        self.over, self.last = None, None

    def skip(self, batch, t):
        if self.over is not None:
            return f"over the limit at batch {self.over}"
        if self.last is None:
            return None
        b0, t0 = self.last
        predicted = t0 * batch / b0
        if predicted > t["prediction_slack"] * t["limit_s"]:
            self.over = batch
            return f"predicted over the limit ({predicted:.2f} s from batch {b0})"
        return None

    def record(self, batch, entry):
        if entry["seconds"] is not None:
            self.last = (batch, entry["seconds"])
        elif (entry["note"] or "").startswith("over the limit"):
            self.over = batch
