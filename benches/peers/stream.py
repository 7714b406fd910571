"""The peers of `cargo bench --bench stream`: one time step of a GRU or an LSTM layer at batch 1 on
one CPU thread, the state carried from call to call, in ONNX Runtime (an ONNX GRU / LSTM node
built with onnx.helper from flatnn's saved weights) and PyTorch (nn.GRUCell / nn.LSTMCell), where
they import.

    python3 stream.py CASES.json STEPS

CASES.json (written by the bench) lists, per point: name, cell, hidden, features, weights (a
safetensors file flatnn saved: 0.weight_ih_l0 ... in PyTorch's layout), and a check sequence
(inputs, and flatnn's outputs after each step). Each peer first runs the check sequence and
reports the largest difference from flatnn's outputs, then times STEPS steps one by one
(time.perf_counter_ns around each call). One line a result on stdout:

    @stream {"name", "peer", "ns": [p50, p99, p99.9, max], "max_abs_diff", "steps"}

Peers: "ort" (InferenceSession.run, numpy in and out), "ort-iobinding" (run_with_iobinding on
OrtValues bound once, the state ping-ponging between two), "torch" (a cell under inference_mode).
A peer that cannot run says why on stderr.
"""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zoo_onnx import IR_VERSION, read_safetensors  # noqa: E402

OPSET = 14


def percentiles(ns):
    ns = np.sort(np.asarray(ns, dtype=np.float64))
    at = lambda q: float(ns[int(round((len(ns) - 1) * q))])
    return [at(0.5), at(0.99), at(0.999), float(ns[-1])]


def report(case, peer, ns, diff, steps):
    print("@stream " + json.dumps({"name": case["name"], "peer": peer, "ns": ns, "max_abs_diff": diff, "steps": steps}), flush=True)


def onnx_model(case, weights):
    """A one-step ONNX GRU or LSTM: inputs x (1, 1, F), h (1, 1, H) (and c); outputs y_h (and y_c).
    PyTorch's gate blocks reordered to ONNX's: GRU r, z, n -> z, r, h (linear_before_reset = 1,
    PyTorch's formula); LSTM i, f, g, o -> i, o, f, c."""
    from onnx import TensorProto, helper, numpy_helper

    lstm, hidden, features = case["cell"] == "lstm", case["hidden"], case["features"]
    order = [0, 3, 1, 2] if lstm else [1, 0, 2]

    def blocks(a):
        return np.concatenate([a[g * hidden:(g + 1) * hidden] for g in order], axis=0)

    w = blocks(weights["0.weight_ih_l0"])[None]
    r = blocks(weights["0.weight_hh_l0"])[None]
    b = np.concatenate([blocks(weights["0.bias_ih_l0"]), blocks(weights["0.bias_hh_l0"])])[None]
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in (("W", w), ("R", r), ("B", b))]
    if lstm:
        node = helper.make_node("LSTM", ["x", "W", "R", "B", "", "h", "c"], ["", "y_h", "y_c"], hidden_size=hidden)
    else:
        node = helper.make_node("GRU", ["x", "W", "R", "B", "", "h"], ["", "y_h"], hidden_size=hidden, linear_before_reset=1)
    state = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, hidden])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, features]), state("h")] + ([state("c")] if lstm else [])
    outputs = [state("y_h")] + ([state("y_c")] if lstm else [])
    graph = helper.make_graph([node], case["name"], inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="flatnn-stream")
    model.ir_version = IR_VERSION
    return model.SerializeToString()


def check_inputs(case):
    f = case["features"]
    x = np.asarray(case["inputs"], dtype=np.float32).reshape(-1, f)
    want = np.asarray(case["outputs"], dtype=np.float32).reshape(len(x), -1)
    return x, want


def run_ort(case, weights, steps, signal):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(onnx_model(case, weights), so, providers=["CPUExecutionProvider"])
    lstm, hidden, features = case["cell"] == "lstm", case["hidden"], case["features"]
    names = ["y_h", "y_c"] if lstm else ["y_h"]
    zero = lambda: np.zeros((1, 1, hidden), np.float32)

    def fresh():
        return {"h": zero(), "c": zero()} if lstm else {"h": zero()}

    # the check sequence
    x, want = check_inputs(case)
    feed, got = fresh(), []
    for t in range(len(x)):
        feed["x"] = x[t].reshape(1, 1, features)
        outs = sess.run(names, feed)
        feed["h"] = outs[0]
        if lstm:
            feed["c"] = outs[1]
        got.append(outs[0].reshape(-1))
    report_diff = float(np.max(np.abs(np.stack(got) - want)))
    xs = [signal[t].reshape(1, 1, features) for t in range(len(signal))]
    # run
    feed, ns = fresh(), np.empty(steps, np.int64)
    for t in range(steps + 1000):
        feed["x"] = xs[t % len(xs)]
        t0 = time.perf_counter_ns()
        outs = sess.run(names, feed)
        t1 = time.perf_counter_ns()
        feed["h"] = outs[0]
        if lstm:
            feed["c"] = outs[1]
        if t >= 1000:
            ns[t - 1000] = t1 - t0
    report(case, "ort", percentiles(ns), report_diff, steps)
    # run_with_iobinding: x updated in place, the state ping-ponging between two OrtValues a name
    binding = sess.io_binding()
    x_value = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, features), np.float32))
    states = {n: [ort.OrtValue.ortvalue_from_numpy(zero()) for _ in range(2)] for n in (["h", "c"] if lstm else ["h"])}
    binding.bind_ortvalue_input("x", x_value)
    ns = np.empty(steps, np.int64)
    for t in range(steps + 1000):
        k = t % 2
        for n, pair in states.items():
            binding.bind_ortvalue_input(n, pair[k])
            binding.bind_ortvalue_output("y_" + n, pair[1 - k])
        x_value.update_inplace(xs[t % len(xs)])
        t0 = time.perf_counter_ns()
        sess.run_with_iobinding(binding)
        t1 = time.perf_counter_ns()
        if t >= 1000:
            ns[t - 1000] = t1 - t0
    report(case, "ort-iobinding", percentiles(ns), None, steps)


def run_torch(case, weights, steps, signal):
    import torch

    torch.set_num_threads(1)
    lstm, hidden, features = case["cell"] == "lstm", case["hidden"], case["features"]
    cell = (torch.nn.LSTMCell if lstm else torch.nn.GRUCell)(features, hidden)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(cell, name).copy_(torch.from_numpy(weights[f"0.{name}_l0"]))
    zero = lambda: torch.zeros((1, hidden))
    with torch.inference_mode():
        x, want = check_inputs(case)
        state, got = ((zero(), zero()) if lstm else zero()), []
        for t in range(len(x)):
            state = cell(torch.from_numpy(x[t]).reshape(1, features), state)
            got.append((state[0] if lstm else state).numpy().reshape(-1).copy())
        diff = float(np.max(np.abs(np.stack(got) - want)))
        xs = [torch.from_numpy(signal[t]).reshape(1, features) for t in range(len(signal))]
        state, ns = ((zero(), zero()) if lstm else zero()), np.empty(steps, np.int64)
        for t in range(steps + 1000):
            x_t = xs[t % len(xs)]
            t0 = time.perf_counter_ns()
            state = cell(x_t, state)
            t1 = time.perf_counter_ns()
            if t >= 1000:
                ns[t - 1000] = t1 - t0
    report(case, "torch", percentiles(ns), diff, steps)


def main():
    cases = json.load(open(sys.argv[1]))
    steps = int(sys.argv[2])
    for case in cases:
        weights, _ = read_safetensors(case["weights"])
        rng = np.random.default_rng(5)
        signal = rng.uniform(-1, 1, (4096, case["features"])).astype(np.float32)
        for run in (run_ort, run_torch):
            try:
                run(case, weights, steps, signal)
            except ImportError as e:
                print(f"{case['name']}: {run.__name__[4:]} not importable: {e}", file=sys.stderr)
            except Exception as e:  # a peer that fails is reported, not fatal
                print(f"{case['name']}: {run.__name__[4:]} failed: {type(e).__name__}: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
