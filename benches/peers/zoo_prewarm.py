"""The pre-warm of the zoo's compiled peers (`pt-compile`): builds each one as the bench's peers
server does (zoo_torch.train_graph / infer_graph with compiled=True), several at once, so that
inductor's on-disk caches hold every compiled graph, with its autotuning choices, before the
bench runs; the server's compiles are then cache hits.

    python3 zoo.py --prewarm [--jobs N] [--models a,b] [--devices gpu,gpu-tf32]
        [--tasks train,infer] [--batches 8,64,512] [--dry-run] [--cpu]

Each job runs in its own process (`zoo.py --prewarm-job JSON`): torch.compile is not
thread-safe, and a job that dies takes only itself down. Both the jobs and the server read the
caches set up by `share_compile_caches`. With `--cpu` the jobs compile on the CPU (inductor's C++
kernels, no CUDA graph): a check of this harness on a machine without a GPU, not a pre-warm.

Several processes share the GPU while they autotune, so a timing that picks a kernel can be
disturbed by another process's work; fewer jobs trade time for quieter autotuning.
"""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import zoo_models

# as COMPILE_BATCHES in benches/zoo/main.rs
COMPILE_BATCHES = (8, 64, 512)
# the precision mode of the compiled peer on each GPU device (zoo.py's pt-compile:<mode>)
COMPILE_MODES = {"gpu": "fp32", "gpu-tf32": "tf32"}
TASKS = ("train", "infer")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_MARK = "@prewarm "


def share_compile_caches():
    """Points every process of the zoo's peers at the same on-disk caches (call before torch is
    imported; variables already set win). The FX graph cache keeps inductor's compiled graphs,
    keyed on the graph, input shapes, inductor's settings and the matmul precision; the
    AOTAutograd cache, in front of it, keeps the forward and backward graphs of a training step;
    with Triton's kernels bundled into the FX graph entries, a hit replays the graph with the
    kernels autotuning chose, without compiling or autotuning again (PyTorch's "Compile Time
    Caching Configuration" recipe). The local autotune cache (inductor's default, set again in
    zoo_torch) keeps the tuned launch configurations of generated kernels."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(ROOT, "target", "torchinductor"))
    for name in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE"):
        os.environ.setdefault(name, "1")


def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def layer_count(name):
    """Layers of model `name`, residual bodies included: a rough guess of its compile time."""

    def count(layers):
        return sum(1 + (count(layer[1]) if layer[0] == "residual" else 0) for layer in layers)

    return count(zoo_models.MODELS[name][1])


def jobs(models, devices, tasks, batches):
    """Every (model, device, task, batch) to build, the likely longest first (training steps, then
    the models with the most layers), so that the last to finish are short ones."""
    out = [{"model": m, "device": d, "task": t, "batch": b} for m in models for d in devices for t in tasks for b in batches]
    return sorted(out, key=lambda j: (j["task"] != "train", -layer_count(j["model"])))


def describe(job):
    return f"{job['model']} {job['device']} {job['task']} {job['batch']}"


def run_job(job, seed, cpu):
    """One job, in this process: builds the compiled peer and prints its figures as one JSON line."""
    import torch
    import zoo_torch

    zoo_torch.set_mode(COMPILE_MODES[job["device"]])
    make = zoo_torch.train_graph if job["task"] == "train" else zoo_torch.infer_graph
    before = zoo_torch.fx_cache_counts()
    call, seconds = make(job["model"], job["batch"], torch.device("cpu" if cpu else "cuda"), seed, True)
    call(True)
    after = zoo_torch.fx_cache_counts()
    counts = {k: after[k] - before[k] for k in after}
    print(JOB_MARK + json.dumps({"build_s": seconds, "cache": counts}), flush=True)


def run_all(todo, workers, script, cpu):
    """Runs `todo` in `workers` processes at a time; prints a line per job as it ends. True if
    every job succeeded."""
    # inductor compiles a graph's kernels in a pool of compile_threads processes (by default one
    # per core); N jobs with a pool each would start N × cores processes, each importing torch
    threads = max(1, cpu_count() // workers)
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))

    def one(job):
        start = time.perf_counter()
        command = [sys.executable, script, "--prewarm-job", json.dumps(job)] + (["--cpu"] if cpu else [])
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        marked = [line for line in done.stdout.splitlines() if line.startswith(JOB_MARK)]
        if done.returncode != 0 or not marked:
            tail = done.stderr.strip().splitlines()[-15:]
            return False, f"FAILED (exit {done.returncode}):\n    " + "\n    ".join(tail)
        result = json.loads(marked[-1][len(JOB_MARK):])
        c = result["cache"]
        graphs = c["hit"] + c["miss"] + c["bypass"]
        return True, (f"compile and capture {result['build_s']:.1f} s, {c['hit']} of {graphs} graphs from the cache"
                      f"{', ' + str(c['bypass']) + ' not cacheable' if c['bypass'] else ''} (process {time.perf_counter() - start:.1f} s)")

    print(f"prewarm: {len(todo)} jobs, {workers} at a time, compile threads per job: {env['TORCHINDUCTOR_COMPILE_THREADS']}, "
          f"cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}", flush=True)
    start, failed = time.perf_counter(), 0
    with ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(one, job): job for job in todo}
        for future in as_completed(futures):
            ok, text = future.result()
            failed += not ok
            print(f"prewarm: {describe(futures[future])}: {text}", flush=True)
    print(f"prewarm: {len(todo)} jobs in {time.perf_counter() - start:.0f} s, {failed} failed", flush=True)
    return failed == 0


def names(text, known, what, parser):
    chosen = [s for s in text.split(",") if s]
    unknown = [s for s in chosen if s not in known]
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)} (known: {', '.join(map(str, known))})")
    return chosen


def main(args, parser, script):
    """`zoo.py --prewarm`: the jobs the arguments select, listed (--dry-run) or run."""
    models = names(args.models, list(zoo_models.MODELS), "model", parser)
    devices = names(args.devices, list(COMPILE_MODES), "device", parser)
    tasks = names(args.tasks, TASKS, "task", parser)
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        parser.error(f"--batches {args.batches!r}: expected numbers separated by commas")
    if not batches or min(batches) < 1:
        parser.error("--batches: at least one batch, each at least 1")
    workers = args.jobs or max(1, cpu_count() - 2)
    todo = jobs(models, devices, tasks, batches)
    if args.dry_run:
        for i, job in enumerate(todo, 1):
            print(f"{i:3} {describe(job)} (pt-compile:{COMPILE_MODES[job['device']]})")
        print(f"{len(todo)} jobs, {workers} at a time")
        return True
    return run_all(todo, workers, script, args.cpu)
