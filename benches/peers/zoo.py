"""The peers of `cargo bench --bench zoo`: PyTorch and ONNX Runtime on the same networks, tasks,
batches and timing method, in one process the bench starts and asks for one point at a time.

    python3 zoo.py --serve --config '{"timing": {...}, "threads": 16, ...}' [--compile]
        then one request a line on stdin:
        {"model": "mlp", "device": "cpu1", "batch": 64, "tasks": ["infer"], "cpu_clock": false}
    python3 zoo.py --check DIR     # outputs and losses of flatnn's saved models, recomputed here
    python3 zoo.py --prewarm [--jobs N] [--models a,b] [--devices gpu,gpu-tf32] [--tasks train,infer]
        [--batches 8,64,512] [--dry-run] [--cpu]   # the compiled peers into inductor's caches
        (see zoo_prewarm.py), before a run with --compile

Devices: cpu1 (one thread), cpu (config's thread count), gpu (FP32: TF32 off everywhere), gpu-tf32
(PyTorch's defaults, and TF32 on everywhere). Peers by device and task:
    cpu1, cpu   train: pt-eager (PyTorch, CPU)   infer, latency: ort (ONNX Runtime)
    gpu         pt-eager:fp32, pt-graph:fp32, with --compile pt-compile:fp32 (latency: no compile)
    gpu-tf32    pt-eager:default, pt-graph:default, pt-eager:tf32, pt-graph:tf32, pt-compile:tf32
Missing packages or devices are reported in the replies ("missing"), not fatal.
"""

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zoo_models  # noqa: E402
import zoo_prewarm  # noqa: E402
import zoo_timing  # noqa: E402

SEED = 11


def try_import(name):
    try:
        return importlib.import_module(name), None
    except Exception as e:  # ImportError, or a broken install raising anything
        return None, f"{name} not importable: {e}"


def environment(torch):
    env = {"python": platform.python_version()}
    for name in ("numpy", "onnx", "onnxruntime"):
        module, _ = try_import(name)
        env[name] = getattr(module, "__version__", None) if module else None
    env["torch"] = torch.__version__ if torch else None
    if torch and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
        env["torch_tf32_defaults"] = {
            "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        }
    return env


class Peers:
    def __init__(self, args, config):
        self.args, self.config = args, config
        self.np, _ = try_import("numpy")
        self.ort, self.ort_error = try_import("onnxruntime") if self.np else (None, "numpy not importable")
        if self.ort:
            import zoo_ort

            self.zoo_ort = zoo_ort
        self.torch, self.torch_error = try_import("torch")
        if self.torch:
            import zoo_torch

            self.zoo_torch = zoo_torch
        # flush-to-zero and denormals-are-zero, as flatnn's side runs with them (--flush-subnormals):
        # PyTorch on this thread, ONNX Runtime on its sessions' threads
        self.flush_subnormals = bool(config.get("flush_subnormals"))
        if self.flush_subnormals and self.torch:
            self.torch.set_flush_denormal(True)
        self.missing, self.onnx_files, self.onnx_source = [], {}, {}
        self.model, self.sessions, self.series = None, {}, {}

    def threads(self, device):
        return 1 if device == "cpu1" else self.config["threads"]

    def variants(self, device, task, batch):
        """(peer name, maker) for the peers of one point; makers return call(end) or raise."""
        out = []
        if device in ("cpu1", "cpu"):
            if task == "train":
                if self.torch:
                    out.append(("pt-eager", lambda n, b: self.torch_cpu_train(n, b, device)))
                else:
                    self.note_missing(device, task, "pt-eager", self.torch_error)
            elif self.ort:
                out.append(("ort", lambda n, b: self.ort_call(n, b, device, task)))
            else:
                self.note_missing(device, task, "ort", self.ort_error)
            return out
        if not self.torch or not self.torch.cuda.is_available():
            why = self.torch_error or "torch sees no CUDA device"
            self.note_missing(device, task, "pt-*", why)
            return out
        zt, gpu = self.zoo_torch, self.torch.device("cuda")
        modes = ["fp32"] if device == "gpu" else ["default", "tf32"]
        for mode in modes:
            if task == "train":
                out.append((f"pt-eager:{mode}", self.moded(mode, lambda n, b: zt.train_eager(n, b, gpu, SEED))))
                out.append((f"pt-graph:{mode}", self.moded(mode, lambda n, b: self.timed_build(zt.train_graph(n, b, gpu, SEED, False)))))
            elif task == "infer":
                out.append((f"pt-eager:{mode}", self.moded(mode, lambda n, b: zt.infer_eager(n, b, gpu, SEED))))
                out.append((f"pt-graph:{mode}", self.moded(mode, lambda n, b: self.timed_build(zt.infer_graph(n, b, gpu, SEED, False)))))
            else:
                out.append((f"pt-eager:{mode}", self.moded(mode, lambda n, b: zt.latency_eager(n, b, gpu, SEED))))
                out.append((f"pt-graph:{mode}", self.moded(mode, lambda n, b: zt.latency_graph(n, b, gpu, SEED))))
        if self.args.compile and task != "latency" and batch in self.config["compile_batches"]:
            mode = zoo_prewarm.COMPILE_MODES[device]
            make = zt.train_graph if task == "train" else zt.infer_graph
            out.append((f"pt-compile:{mode}", self.moded(mode, lambda n, b: self.timed_build(make(n, b, gpu, SEED, True)))))
        return out

    def moded(self, mode, maker):
        def make(name, batch):
            self.zoo_torch.set_mode(mode)
            return maker(name, batch)

        return make

    def timed_build(self, built):
        call, seconds = built
        call.build_s = seconds
        return call

    def note_missing(self, device, task, peer, why):
        entry = {"device": device, "task": task, "peer": peer, "why": why}
        if entry not in self.missing:
            self.missing.append(entry)

    def torch_cpu_train(self, name, batch, device):
        self.torch.set_num_threads(self.threads(device))
        return self.zoo_torch.train_eager(name, batch, self.torch.device("cpu"), SEED)

    def onnx_bytes(self, name):
        """The network as ONNX: PyTorch's export of its twin where torch imports, else onnx.helper."""
        if name not in self.onnx_files:
            import zoo_onnx

            self.onnx_files[name], self.onnx_source[name] = zoo_onnx.model_bytes(name, SEED, self.torch)
        return self.onnx_files[name]

    def ort_call(self, name, batch, device, task):
        key = (name, self.threads(device))
        if key not in self.sessions:
            self.sessions = {key: self.zoo_ort.session(self.onnx_bytes(name), self.threads(device), flush_subnormals=self.flush_subnormals)}
        sess = self.sessions[key]
        rng = self.np.random.default_rng(SEED)
        x = rng.uniform(-1, 1, size=(batch, *zoo_models.input_shape(name))).astype(self.np.float32)
        if task == "infer":
            return self.zoo_ort.infer_call(sess, x, zoo_models.output_len(name))
        return self.zoo_ort.latency_call(sess, x)

    def measure(self, name, device, task, batch, peer, make, timing):
        entry = {"model": name, "device": device, "task": task, "batch": batch, "peer": peer,
                 "seconds": None, "p99": None, "calls": 0, "note": None}
        compiled = peer.startswith("pt-compile")
        try:
            before = self.zoo_torch.fx_cache_counts() if compiled else None
            call = make(name, batch)
            if compiled:
                entry["build_s"] = round(call.build_s, 2)
                after = self.zoo_torch.fx_cache_counts()
                hits, graphs = after["hit"] - before["hit"], sum(after.values()) - sum(before.values())
                entry["cached"] = f"{hits} of {graphs} graphs from inductor's cache"
            if task == "latency":
                entry["seconds"], entry["p99"], entry["calls"] = zoo_timing.single(timing, call)
            else:
                entry["seconds"], entry["calls"] = zoo_timing.repeated(timing, call)
        except zoo_timing.OverLimit as e:
            entry["note"] = f"over the limit: {e}"
        except Exception as e:
            oom = self.torch and isinstance(e, getattr(self.torch.cuda, "OutOfMemoryError", ()))
            entry["note"] = f"does not fit memory: {e}" if oom or isinstance(e, MemoryError) else f"error: {type(e).__name__}: {e}"
            if not oom:
                traceback.print_exc(file=sys.stderr)
        finally:
            call = None
            if self.torch:
                self.zoo_torch.release()
        return entry

    def point(self, name, device, batch, tasks, cpu_clock):
        """Every peer's entry for `tasks` of model `name` at `batch` on `device`, timed by the
        process's CPU time where `cpu_clock`."""
        if self.model != name:
            self.model, self.sessions = name, {}
        timing = dict(self.config["timing"], cpu_clock=cpu_clock)
        out = []
        for task in tasks:
            if task == "latency" and batch > self.config["latency_max_batch"]:
                continue
            for peer, make in self.variants(device, task, batch):
                series = self.series.setdefault((name, device, task, peer), zoo_timing.Series())
                why = series.skip(batch, timing)
                if why:
                    entry = {"model": name, "device": device, "task": task, "batch": batch, "peer": peer,
                             "seconds": None, "p99": None, "calls": 0, "note": why}
                else:
                    entry = self.measure(name, device, task, batch, peer, make, timing)
                    series.record(batch, entry)
                out.append(entry)
                shown = f"{entry['seconds'] * 1e6:.1f} us" if entry["seconds"] else entry["note"]
                if "build_s" in entry:
                    shown += f" (compile and capture {entry['build_s']:.1f} s, {entry['cached']})"
                print(f"peers: {name} {device} {task} {batch} {peer}: {shown}", file=sys.stderr, flush=True)
        return out


def serve(args):
    """Answers the bench's requests, one JSON line each, until its input ends (see
    benches/zoo/peers.rs for the protocol)."""
    protocol = sys.stdout
    sys.stdout = sys.stderr  # anything else printed goes to stderr
    if args.compile:
        # the pre-warm compiles; what it left out compiles here in this process alone, rather
        # than in a pool of compile workers that would start beside the timings
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

    def send(value):
        protocol.write("@zoo " + json.dumps(value) + "\n")
        protocol.flush()

    peers = Peers(args, json.loads(args.config))
    send({
        "env": environment(peers.torch),
        "not_importable": "; ".join(e for e in (peers.ort_error, peers.torch_error) if e),
        "params": {m: zoo_models.param_count(m) for m in zoo_models.MODELS},
    })
    for line in sys.stdin:
        if not line.strip():
            continue
        r = json.loads(line)
        results = peers.point(r["model"], r["device"], r["batch"], r["tasks"], r.get("cpu_clock", False))
        send({"results": results, "missing": peers.missing, "onnx_source": peers.onnx_source})


def check(directory):
    """Recomputes, for each model flatnn saved in `directory` (manifest.json), its outputs and loss
    with ONNX Runtime on an onnx.helper graph of the same weights, and with the PyTorch twin and
    its ONNX export where torch imports. Prints one line per model and way; False on a mismatch."""
    import numpy as np
    import zoo_onnx

    ort, ort_error = try_import("onnxruntime")
    torch, torch_error = try_import("torch")
    if torch:
        import zoo_torch
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    ok = True
    for m in manifest["models"]:
        name, batch = m["name"], m["batch"]
        if name not in zoo_models.MODELS:
            print(f"check {name}: FAIL: no such model in zoo_models.py")
            ok = False
            continue
        weights, _ = zoo_onnx.read_safetensors(os.path.join(directory, m["weights"]))
        expected = {k: tuple(s) for k, s in zoo_models.tensors(name)}
        got = {k: tuple(v.shape) for k, v in weights.items()}
        if got != expected:
            print(f"check {name}: FAIL: tensors differ: flatnn {sorted(got.items())}, peer {sorted(expected.items())}")
            ok = False
            continue
        shape = (batch, *zoo_models.input_shape(name))
        x = np.fromfile(os.path.join(directory, m["inputs"]), dtype="<f4").reshape(shape)
        want = np.fromfile(os.path.join(directory, m["outputs"]), dtype="<f4").reshape(batch, -1)
        labels = np.array(m.get("labels", []), dtype=np.int64)
        targets = np.fromfile(os.path.join(directory, m["targets"]), dtype="<f4").reshape(want.shape) if "targets" in m else None
        ways = []
        if ort:
            sess = zoo_ort_session(zoo_onnx.build(name, weights).SerializeToString())
            ways.append(("onnx.helper + onnxruntime", sess.run(["y"], {"x": x})[0]))
        if torch:
            torch_y, twin = zoo_torch.forward_cpu(name, weights, x)
            ways.append(("pytorch twin", torch_y))
            if ort:
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "m.onnx")
                    try:
                        how = zoo_onnx.export_torch(twin, name, path)
                        with open(path, "rb") as f:
                            ways.append((f"{how} + onnxruntime", zoo_ort_session(f.read()).run(["y"], {"x": x})[0]))
                    except Exception as e:
                        print(f"check {name}: torch export failed ({e}); the bench uses onnx.helper there")
        if not ways:
            print(f"check {name}: FAIL: nothing to check with ({ort_error}; {torch_error})")
            ok = False
        for way, y in ways:
            err = np.abs(y - want)
            bad = err > 1e-5 + 1e-4 * np.abs(want)
            loss = numpy_loss(np, name, y, labels, targets)
            loss_ok = abs(loss - m["loss"]) <= 1e-5 + 1e-4 * abs(m["loss"])
            verdict = "ok" if not bad.any() and loss_ok else "FAIL"
            ok &= verdict == "ok"
            print(f"check {name} (batch {batch}, {zoo_models.param_count(name)} parameters) {way}: {verdict}: "
                  f"outputs max |diff| {err.max():.2e} (max |y| {np.abs(want).max():.2e}), "
                  f"loss {loss:.7g} against flatnn's {m['loss']:.7g}")
            if bad.any():
                first = np.argwhere(bad)[:3].tolist()
                print(f"  first bad indices {first}")
        if torch:
            loss = zoo_torch.loss_cpu(name, torch_y, labels, targets)
            verdict = "ok" if abs(loss - m["loss"]) <= 1e-5 + 1e-4 * abs(m["loss"]) else "FAIL"
            ok &= verdict == "ok"
            print(f"check {name} pytorch loss function: {verdict}: {loss:.7g} against flatnn's {m['loss']:.7g}")
    return ok


def zoo_ort_session(model_bytes):
    import zoo_ort

    return zoo_ort.session(model_bytes, 1)


def numpy_loss(np, name, y, labels, targets):
    """The zoo's losses in float64: mean softmax cross-entropy over the batch, or MSE over all values."""
    y = y.astype(np.float64)
    if zoo_models.loss_kind(name) == "xent":
        shifted = y - y.max(axis=1, keepdims=True)
        log_z = np.log(np.exp(shifted).sum(axis=1))
        return float(np.mean(log_z - shifted[np.arange(len(labels)), labels]))
    return float(np.mean((y - targets.astype(np.float64)) ** 2))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="answer the bench's requests on stdin")
    parser.add_argument("--config", help="JSON: timing, threads, latency_max_batch, compile_batches, flush_subnormals")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--check", metavar="DIR")
    parser.add_argument("--prewarm", action="store_true", help="build the compiled peers into inductor's caches, then exit")
    parser.add_argument("--jobs", type=int, help="pre-warm jobs at a time (default: CPUs - 2)")
    parser.add_argument("--models", default=",".join(zoo_models.MODELS), help="pre-warm: models (default: all)")
    parser.add_argument("--devices", default=",".join(zoo_prewarm.COMPILE_MODES), help="pre-warm: gpu, gpu-tf32")
    parser.add_argument("--tasks", default=",".join(zoo_prewarm.TASKS), help="pre-warm: train, infer")
    parser.add_argument("--batches", default=",".join(map(str, zoo_prewarm.COMPILE_BATCHES)), help="pre-warm: batches")
    parser.add_argument("--dry-run", action="store_true", help="pre-warm: list the jobs, build nothing")
    parser.add_argument("--cpu", action="store_true", help="pre-warm: compile on the CPU (a check of the harness)")
    parser.add_argument("--prewarm-job", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    zoo_prewarm.share_compile_caches()
    if args.jobs is not None and args.jobs < 1:
        parser.error("--jobs: at least 1")
    if args.prewarm_job:
        zoo_prewarm.run_job(json.loads(args.prewarm_job), SEED, args.cpu)
    elif args.prewarm:
        sys.exit(0 if zoo_prewarm.main(args, parser, os.path.abspath(__file__)) else 1)
    elif args.check:
        sys.exit(0 if check(args.check) else 1)
    elif args.serve and args.config:
        serve(args)
    else:
        parser.error("give --serve --config JSON, --check DIR or --prewarm")


if __name__ == "__main__":
    main()
