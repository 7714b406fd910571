"""PyTorch's side of the zoo: the twin of each network, its training step and its inference, eager,
captured in a CUDA graph, or compiled (torch.compile, mode max-autotune-no-cudagraphs) and then
captured by hand.

Every maker returns `call(end)`; `end` marks the last call of a timing sample, after which the
host waits for the device (training steps and eager work are queued; inference copies its
outputs to a page-locked host tensor, which waits by itself, as flatnn's `forward` does).

- train: forward, loss, backward, Adam (lr 1e-3) on a batch already on the device. Eager uses
  PyTorch's default Adam; the graph and compiled steps use Adam(fused=True, capturable=True)
  and capture the whole step (forward, loss, backward, update) as one CUDA graph.
- infer: forward without autograd (eager: inference mode) on inputs already on the device,
  outputs copied to a page-locked host tensor.
- latency: a host (pageable) batch copied in, forward, outputs copied to the host.

Precision modes: "fp32" (TF32 off in cuBLAS and cuDNN), "default" (PyTorch's defaults, as found
at import: TF32 allowed in cuDNN convolutions, not in matmuls), "tf32" (TF32 on in both).
cudnn.benchmark is on: PyTorch times cuDNN's algorithms per shape, as flatnn measures its routes.

On the CPU (the pre-warm's --cpu check) the graph makers run the step as it is, without a graph.
"""

import gc
import time

import torch
import torch._inductor.config
import torch.nn as nn

import zoo_models

DEFAULTS = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
WARMUP_STEPS = 3
# the tuned launch configurations of generated kernels, on disk beside the FX graph cache (see
# zoo_prewarm.share_compile_caches)
torch._inductor.config.autotune_local_cache = True


def set_mode(mode):
    matmul, cudnn = {"fp32": (False, False), "default": DEFAULTS, "tf32": (True, True)}[mode]
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn
    torch.backends.cudnn.benchmark = True


def release():
    """Frees what the last point held (graphs, their pools, compiled code) before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def data(name, batch, device, seed):
    """(model, inputs, targets, loss function) on `device`: inputs and MSE targets uniform in
    [-1, 1), labels uniform in 0..classes, as the Rust side draws them."""
    torch.manual_seed(seed)
    model = zoo_models.torch_twin(name).to(device)
    x = torch.rand((batch, *zoo_models.input_shape(name)), device=device) * 2 - 1
    outputs = zoo_models.output_len(name)
    if zoo_models.loss_kind(name) == "xent":
        target, loss_fn = torch.randint(0, outputs, (batch,), device=device), nn.CrossEntropyLoss()
    else:
        target, loss_fn = torch.rand((batch, outputs), device=device) * 2 - 1, nn.MSELoss()
    return model, x, target, loss_fn


def syncer(device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def compile_fresh(fn):
    """torch.compile with a clean slate: Dynamo keys its cache on the code object, which every
    point shares (Sequential.forward, forward_loss), and after 8 recompiles of one code object it
    silently runs it eagerly; a reset per point keeps every point compiled."""
    torch._dynamo.reset()
    return torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)


def fx_cache_counts():
    """{"hit", "miss", "bypass"}: inductor's FX graph cache lookups in this process so far (each
    compiled graph is one: a training step's forward and backward are two)."""
    from torch._dynamo.utils import counters

    return {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}


def train_eager(name, batch, device, seed):
    model, x, target, loss_fn = data(name, batch, device, seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sync = syncer(device)

    def call(end):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), target).backward()
        opt.step()
        if end:
            sync()

    return call


def on_side_stream(work):
    """Runs `work` (warm-up before a capture) on a side stream, as PyTorch's graph guide does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)


def train_graph(name, batch, device, seed, compiled):
    """The whole step as one CUDA graph; with `compiled`, forward and loss through torch.compile.
    Returns (call, seconds spent compiling and capturing; on the CPU, compiling and warming up)."""
    start = time.perf_counter()
    model, x, target, loss_fn = data(name, batch, device, seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True, capturable=True)

    def forward_loss(inputs, targets):
        return loss_fn(model(inputs), targets)

    if compiled:
        forward_loss = compile_fresh(forward_loss)

    def step():
        opt.zero_grad(set_to_none=True)
        forward_loss(x, target).backward()
        opt.step()

    if device.type != "cuda":
        for _ in range(WARMUP_STEPS):
            step()
        return (lambda _end: step()), time.perf_counter() - start

    def steps():
        for _ in range(WARMUP_STEPS):
            step()

    on_side_stream(steps)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        forward_loss(x, target).backward()
        opt.step()
    torch.cuda.synchronize()

    def call(end):
        graph.replay()
        if end:
            torch.cuda.synchronize()

    call.keep = (model, opt, x, target)
    return call, time.perf_counter() - start


def infer_eager(name, batch, device, seed):
    model, x, _, _ = data(name, batch, device, seed)
    model.eval()
    out = torch.empty((batch, zoo_models.output_len(name)), pin_memory=device.type == "cuda")

    def call(_end):
        with torch.inference_mode():
            out.copy_(model(x))

    return call


def infer_graph(name, batch, device, seed, compiled):
    """Forward as a CUDA graph, outputs copied to a page-locked host tensor after each replay.
    Returns (call, seconds spent compiling and capturing; on the CPU, compiling and warming up)."""
    start = time.perf_counter()
    model, x, _, _ = data(name, batch, device, seed)
    model.eval()
    forward = compile_fresh(model) if compiled else model
    out = torch.empty((batch, zoo_models.output_len(name)), pin_memory=device.type == "cuda")
    if device.type != "cuda":

        def call(_end):
            with torch.no_grad():
                out.copy_(forward(x))

        for _ in range(WARMUP_STEPS):
            call(True)
        return call, time.perf_counter() - start
    graph = torch.cuda.CUDAGraph()
    # no_grad rather than inference_mode: the captured output stays an ordinary tensor, which
    # the host copy after each replay may read outside any mode
    with torch.no_grad():

        def steps():
            for _ in range(WARMUP_STEPS):
                forward(x)

        on_side_stream(steps)
        with torch.cuda.graph(graph):
            y = forward(x)
    torch.cuda.synchronize()

    def call(_end):
        graph.replay()
        out.copy_(y)

    call.keep = (model, x)
    return call, time.perf_counter() - start


def latency_eager(name, batch, device, seed):
    model, _, _, _ = data(name, batch, device, seed)
    model.eval()
    host_x = torch.rand((batch, *zoo_models.input_shape(name))) * 2 - 1
    out = torch.empty((batch, zoo_models.output_len(name)), pin_memory=True)

    def call(_end):
        with torch.inference_mode():
            out.copy_(model(host_x.to(device)))

    return call


def latency_graph(name, batch, device, seed):
    infer, _ = infer_graph(name, batch, device, seed, compiled=False)
    static_x = infer.keep[1]
    host_x = torch.rand((batch, *zoo_models.input_shape(name))) * 2 - 1

    def call(end):
        static_x.copy_(host_x)
        infer(end)

    call.keep = infer
    return call


def forward_cpu(name, weights, x):
    """The twin with `weights` ({state_dict name: array}) on the CPU, its outputs for `x` (numpy)
    as numpy, and the twin itself (for export)."""
    model = zoo_models.torch_twin(name)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=True)
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy(), model


def loss_cpu(name, y, labels, targets):
    y = torch.from_numpy(y)
    if zoo_models.loss_kind(name) == "xent":
        return nn.CrossEntropyLoss()(y, torch.from_numpy(labels).long()).item()
    return nn.MSELoss()(y, torch.from_numpy(targets)).item()
