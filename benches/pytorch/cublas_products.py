"""The MLP's first-layer products above batch 128 through PyTorch's cuBLAS and cuBLASLt calls,
FP32 (TF32 off), each timed as 20 calls captured in a CUDA graph (median of 7 replays, µs per
call), to compare with `kernel_times_of_the_mlp_step`'s cuBLAS rows:

    python3 benches/pytorch/cublas_products.py

`mm` is cublasSgemm; `linear(bias)` and `addmm_relu` are cuBLASLt with its bias (and ReLU)
epilogue, the algorithm its heuristic ranks first; `dW mm + db sum` adds the bias gradient as
a separate reduction.
"""

import torch, torch.nn.functional as F
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = 'cuda'
def timed(fn, reps=20, rounds=7):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / reps)
    ts.sort(); return ts[len(ts)//2]
for B in [256, 512, 1024]:
    x = torch.randn(B, 784, device=dev); W = torch.randn(128, 784, device=dev); b = torch.randn(128, device=dev)
    Wt = W.t()
    dz = torch.randn(B, 128, device=dev)
    out = torch.empty(B, 128, device=dev)
    r = {}
    r['mm'] = timed(lambda: torch.mm(x, Wt, out=out))
    r['linear(bias)'] = timed(lambda: F.linear(x, W, b))
    r['addmm_relu'] = timed(lambda: torch._addmm_activation(b, x, Wt, use_gelu=False))
    dw = torch.empty(128, 784, device=dev)
    r['dW mm'] = timed(lambda: torch.mm(dz.t(), x, out=dw))
    r['dW mm + db sum'] = timed(lambda: (torch.mm(dz.t(), x, out=dw), dz.sum(0)))
    print(B, ' '.join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
