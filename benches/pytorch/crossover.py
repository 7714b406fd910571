"""PyTorch's side of `cargo bench --bench crossover`: the same three models, tasks, batches and
timing method, so that the two tables can be read side by side.

    python3 benches/pytorch/crossover.py [--quick] [--out DIR]

Inference = copy a host batch in, forward, copy the outputs back to the host (what
`set_inputs` + `forward` do). Training step = forward + loss + backward + Adam on a batch
already on the device; the host waits for the device at the end of each timing sample. Each
measurement repeats the call until a sample lasts >= 2 ms and reports the median per call over
11 samples (5 with --quick); a configuration whose single call takes over 0.5 s is skipped.
PyTorch runs eagerly here (its usual mode); `torch.compile` and CUDA graphs are not used.
"""

import argparse
import csv
import os
import time

import torch
import torch.nn as nn

BATCHES = [1, 4, 16, 64, 128, 256, 1024, 4096, 16384]
TOO_SLOW = 0.5


def models():
    return [
        ("simplenn-100-200-1", lambda: nn.Sequential(nn.Linear(100, 200), nn.ReLU(), nn.Linear(200, 1)), (100,), "mse"),
        (
            "mlp-784-128-64-10",
            lambda: nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)),
            (784,),
            "xent",
        ),
        (
            "lenet5",
            lambda: nn.Sequential(
                nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
            ),
            (1, 28, 28),
            "xent",
        ),
    ]


def median_time(call, quick):
    call(True)
    start = time.perf_counter()
    call(True)
    once = time.perf_counter() - start
    if once > TOO_SLOW:
        return None
    per_sample = max(1, int(2e-3 / max(once, 1e-9)) + 1)
    times = []
    for _ in range(5 if quick else 11):
        start = time.perf_counter()
        for i in range(per_sample):
            call(i + 1 == per_sample)
        times.append((time.perf_counter() - start) / per_sample)
    times.sort()
    return times[len(times) // 2]


def measure(make, shape, loss_kind, device, task, batch, quick):
    torch.manual_seed(1)
    model = make().to(device)
    host_x = torch.rand((batch, *shape))
    x = host_x.to(device)
    if loss_kind == "mse":
        target = torch.rand((batch, 1), device=device)
        loss_fn = nn.MSELoss()
    else:
        target = (torch.arange(batch) % 10).to(device)
        loss_fn = nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if task == "forward":
        model.eval()

        def call(_last):
            with torch.no_grad():
                out = model(host_x.to(device, non_blocking=False))
                out.cpu()
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def call(last):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), target)
            loss.backward()
            opt.step()
            if last:
                sync()
    return median_time(call, quick)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="target/flatnn-bench")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    places = [("torch-cpu-1t", torch.device("cpu"), 1), (f"torch-cpu-all", torch.device("cpu"), cores)]
    if torch.cuda.is_available():
        places.append(("torch-gpu", torch.device("cuda"), cores))
        print("GPU:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    rows = []
    for name, make, shape, loss_kind in models():
        for task in ["forward", "train"]:
            print(f"\n{name}, {task} (median per call)")
            print(f"{'batch':>7}" + "".join(f" {p[0]:>14}" for p in places))
            table = {}
            for label, device, threads in places:
                torch.set_num_threads(threads)
                too_slow = False
                for batch in BATCHES:
                    t = None if too_slow else measure(make, shape, loss_kind, device, task, batch, args.quick)
                    too_slow = too_slow or t is None
                    table[(label, batch)] = t
                    if t is not None:
                        rows.append((name, task, label, batch, t, t / batch))
            for batch in BATCHES:
                cells = []
                for label, _, _ in places:
                    t = table[(label, batch)]
                    cells.append("skipped" if t is None else (f"{t * 1e6:.1f} µs" if t < 1e-3 else f"{t * 1e3:.2f} ms"))
                print(f"{batch:>7}" + "".join(f" {c:>14}" for c in cells))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pytorch-crossover.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "task", "place", "batch", "seconds_per_call", "seconds_per_sample"])
        w.writerows(rows)
    print("wrote", path)


if __name__ == "__main__":
    main()
