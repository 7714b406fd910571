# What the probes in this folder share (CuPy, on the GPU machine): the MLP's first-layer forward
# at batch 1024 (X 1024 x 784, W 128 x 784, b 128, from a fixed seed, and the product in float64)
# and the time one launch takes in a graph of launches queued back to back.
import cupy as cp, numpy as np

B, I, H = 1024, 784, 128


def forward_operands():
    """X, W and b on the device, and X . W^T + b in float64 on the host."""
    rng = np.random.default_rng(1)
    X = cp.asarray(rng.standard_normal((B, I), dtype=np.float32))
    W = cp.asarray(rng.standard_normal((H, I), dtype=np.float32) * 0.05)
    bias = cp.asarray(rng.standard_normal(H, dtype=np.float32))
    ref = X.get().astype(np.float64) @ W.get().T.astype(np.float64) + bias.get()
    return X, W, bias, ref


def time_launches(stream, fn, reps=20, rounds=5):
    """Microseconds a launch of `fn` (which launches on `stream`): `reps` launches captured in a
    graph, replayed 10 times a round; the median of `rounds` rounds."""
    stream.begin_capture()
    for _ in range(reps): fn()
    g = stream.end_capture()
    for _ in range(3): g.launch(stream=stream)
    ts = []
    for _ in range(rounds):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(10): g.launch(stream=stream)
        b.record(stream); b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1000 / (10 * reps))
    return np.median(ts)
