"""Where ONNX Runtime's CPU inference time goes: each node of its optimised graph of a zoo model,
timed by its profiler; the twin of `cargo run --release --example layer_times`.

    python3 ort_profile.py NAME BATCH THREADS [--no-torch] [--seconds S] [--min-calls N]

The model's ONNX file is made as the zoo makes it (zoo_onnx.model_bytes: PyTorch's export of its
twin where torch imports, else onnx.helper's graph; --no-torch takes onnx.helper's even where torch
imports), and run as the zoo's `infer` task runs it (zoo_ort: THREADS intra-op threads, one
inter-op, sequential, every graph optimisation; inputs and outputs bound once), with profiling on,
on BATCH samples uniform in [-1, 1). After a warm-up (at least 10 calls and 0.2 s), it makes at
least N calls (200) and runs on until S seconds (1) have passed, at most 5,000 calls. From the
profile it prints, per node of the graph ONNX Runtime ran (its name and op type as ONNX Runtime
has them, its fusions such as FusedConv and FusedGemm included, and its output shape), the
median over the measured calls of the node's kernel time and that median's share of the whole
run's median ("model_run", which adds what lies between the nodes); then the wall clock and the
process's CPU time per call of the loop (flatnn's tool times by the CPU time on one thread,
which leaves out a shared machine's waits for a core). The profiler's times are wall-clock
microseconds, whole ones: a node under 2 µs is coarse. Profiling adds its own cost to each node.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import zoo_models  # noqa: E402
import zoo_onnx  # noqa: E402
import zoo_ort  # noqa: E402

SEED = 11
MAX_CALLS = 5000


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=sorted(zoo_models.MODELS))
    p.add_argument("batch", type=int)
    p.add_argument("threads", type=int)
    p.add_argument("--no-torch", action="store_true", help="onnx.helper's graph even where torch imports")
    p.add_argument("--seconds", type=float, default=1.0, help="measure at least this long (1)")
    p.add_argument("--min-calls", type=int, default=200, help="measure at least this many calls (200)")
    args = p.parse_args()
    if args.batch < 1 or args.threads < 1:
        p.error("BATCH and THREADS must be at least 1")
    return args


def import_torch(no_torch):
    """torch, or None where --no-torch or it does not import (and why)."""
    if no_torch:
        return None, "--no-torch"
    try:
        import torch

        return torch, None
    except Exception as e:  # ImportError, or a broken install raising anything
        return None, f"torch not importable: {e}"


def run_calls(call, warmup_s, min_calls, seconds):
    """Warm-up calls, then the measured ones: (warm-up calls, measured calls, wall seconds and
    process CPU seconds of those)."""
    warm, start = 0, time.perf_counter()
    while warm < 10 or time.perf_counter() - start < warmup_s:
        call(False)
        warm += 1
    calls, start, cpu = 0, time.perf_counter(), time.process_time()
    while calls < MAX_CALLS and (calls < min_calls or time.perf_counter() - start < seconds):
        call(False)
        calls += 1
    return warm, calls, time.perf_counter() - start, time.process_time() - cpu


def per_node(events, skip):
    """{node name: (op type, output shape, [µs per measured call])} in the order the nodes first
    ran, from the profile's kernel-time events, the first `skip` runs of each node left out; and
    the model_run durations (µs) after the first `skip`."""
    nodes, runs = {}, []
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            runs.append(e["dur"])
        elif e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            name = e["name"][: -len("_kernel_time")]
            args = e.get("args", {})
            shape = [list(s.values())[0] for s in args.get("output_type_shape", [])]
            nodes.setdefault(name, (args.get("op_name", "?"), shape, []))[2].append(e["dur"])
    return {k: (op, shape, durs[skip:]) for k, (op, shape, durs) in nodes.items()}, runs[skip:]


def main():
    args = parse_args()
    torch, no_torch_why = import_torch(args.no_torch)
    model_bytes, source = zoo_onnx.model_bytes(args.name, SEED, torch)
    rng = np.random.default_rng(SEED)
    x = rng.uniform(-1, 1, size=(args.batch, *zoo_models.input_shape(args.name))).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        sess = zoo_ort.session(model_bytes, args.threads, profile_prefix=os.path.join(tmp, "ort"))
        call = zoo_ort.infer_call(sess, x, zoo_models.output_len(args.name))
        warm, calls, wall, cpu = run_calls(call, 0.2, args.min_calls, args.seconds)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    nodes, runs = per_node(events, warm)
    short = [k for k, (_, _, durs) in nodes.items() if len(durs) != calls]
    if short or len(runs) != calls:
        raise SystemExit(f"the profile has {len(runs)} runs for {calls} calls (nodes short of them: {short}): events lost?")
    medians = {k: statistics.median(durs) for k, (_, _, durs) in nodes.items()}
    run_median = statistics.median(runs)
    print(f"onnxruntime {zoo_ort.ort.__version__}, {args.name}, batch {args.batch}, {args.threads} thread"
          f"{'' if args.threads == 1 else 's'}; ONNX from {source}" + (f" ({no_torch_why})" if no_torch_why else ""))
    print(f"{calls} calls profiled after {warm} of warm-up; medians per call of the profiler's wall-clock µs\n")
    print("| node | op | output | µs | share of model_run |")
    print("|---|---|---|---|---|")
    for k, (op, shape, _) in nodes.items():
        shapes = ", ".join("×".join(str(d) for d in s) for s in shape)
        print(f"| {k} | {op} | {shapes} | {medians[k]:.1f} | {100 * medians[k] / run_median:.1f} % |")
    total = sum(medians.values())
    print(f"\nnodes: {total:.1f} µs ({100 * total / run_median:.1f} % of model_run); model_run: {run_median:.1f} µs; "
          f"per call of the loop, profiling on: wall clock {1e6 * wall / calls:.1f} µs, process CPU time {1e6 * cpu / calls:.1f} µs")


if __name__ == "__main__":
    main()
