"""The kernels of PyTorch's compiled training step or inference, as the zoo's `pt-compile` peer
builds them (torch.compile, mode max-autotune-no-cudagraphs; fused Adam), run outside a CUDA graph under
torch.profiler: per kernel its device time per step and launches per step, largest first. Where
the zoo's flatnn side is slower than `pt-compile`, this and `ncu` on
`cargo run --release --example step_time -- --device cuda --model M --task train|forward-resident --batch B --profile 1`
show which kernels differ. On a GPU machine, from the checkout root (inductor's on-disk caches
of a pre-warm are reused):

    python3 benches/peers/compile_prof.py MODEL BATCH fp32|tf32 [train|infer] [STEPS]
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo_prewarm  # noqa: E402

zoo_prewarm.share_compile_caches()
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import zoo_torch  # noqa: E402


def main():
    name, batch, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    task = sys.argv[4] if len(sys.argv) > 4 else "train"
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    zoo_torch.set_mode(mode)
    model, x, target, loss_fn = zoo_torch.data(name, batch, torch.device("cuda"), 1)
    if task == "train":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True, capturable=True)
        forward_loss = zoo_torch.compile_fresh(lambda inputs, targets: loss_fn(model(inputs), targets))

        def step():
            opt.zero_grad(set_to_none=True)
            forward_loss(x, target).backward()
            opt.step()
    else:
        model.eval()
        forward = zoo_torch.compile_fresh(model)

        def step():
            with torch.inference_mode():
                forward(x)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total, count = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name[:90]] += event.device_time_total
            count[event.name[:90]] += 1
    print(f"== torch.compile {name} {task} {batch} {mode}: {sum(total.values()) / steps:.1f} µs of kernels a step, "
          f"{sum(count.values()) // steps} kernels")
    for kernel, us in total.most_common():
        print(f"  {us / steps:8.1f}  x{count[kernel] // steps:<3} {kernel}")


if __name__ == "__main__":
    main()
