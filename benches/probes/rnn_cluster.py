# Probe, not part of the crate: how long a recurrent step takes when a layer's W_hh is spread over
# the registers of a cluster of C blocks (one per SM) instead of one block's registers and shared
# memory (kernels/rnn_fused.cu, where an LSTM of 128 units keeps 96 of each row's 128 weights in
# shared memory: ~196 KB read from it a step). The LSTM forward, one sample, T steps:
# block c of the cluster owns units c·U .. (c+1)·U (U = H/C) and the 4·U rows of W_hh that make
# their gates, each row's weights in the registers of SPLIT threads; a step is the products
# (h_{t−1} from shared memory), a block barrier, the cell of the block's units, h_t's slice written
# into every block's shared memory (st.shared::cluster, double-buffered), a cluster barrier.
# SPLIT threads a row (64 weights each at 2, 128 at 1). Clusters of 16 need the non-portable size
# allowed (an attribute set at launch, not set here): expect that one not to run. Checked against
# float64 numpy. Run on the GPU machine (CuPy):
#   python3 benches/probes/rnn_cluster.py [C,SPLIT,PREFETCH ...]
# PREFETCH=1 loads a step's input products a step ahead (as kernels/rnn_fused.cu does), 0 in the
# cell, after the barrier.
# It prints, per C, the maximum error and µs a step ((time at T = 512 − time at T = 64) / 448).
# Measured on an H200 (two calls): right to 1.1e-7 everywhere; with the input products loaded in
# the cell 1.26–1.59 µs a step (C = 2 … 8), loaded a step ahead 0.85 (C = 8, SPLIT = 2), 0.90
# (C = 4, SPLIT = 1), 1.24 (C = 2); clusters of 16 refused. flatnn's fused route and cuDNN's
# persistent kernel take ~2.4 µs a step for this layer (lstm_seq's inference at batch 1: 160 µs
# for 64 steps with the input products and the dense head).
import sys
import cupy as cp, numpy as np

H, G = 128, 4

SRC = r"""
#define H 128
#define U (H / C)
#define ROWS (4 * U)
#define THREADS (ROWS * SPLIT)
#define KW (H / SPLIT)

__device__ __forceinline__ float sigm(float v) { return 1.0f / (1.0f + expf(-v)); }

__device__ __forceinline__ void cluster_sync() {
#if C > 1
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

__device__ __forceinline__ void store_remote(float* local, unsigned rank, float v) {
#if C > 1
    unsigned at = (unsigned)__cvta_generic_to_shared(local), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(at), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
#else
    *local = v;
#endif
}

// xg: T x 4H input products with both biases added (gate g's unit u at g*H + u); w: 4H x H;
// h0, c0: H; y: T x H.
extern "C" __global__ void __launch_bounds__(THREADS) CLUSTER_ATTR
lstm_cluster(const float* xg, const float* w, const float* h0, const float* c0, float* y, int T) {
    __shared__ __align__(16) float hbuf[2][H];
    __shared__ float acc[ROWS];
    unsigned rank = 0;
#if C > 1
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
    const int tid = threadIdx.x, lrow = tid / SPLIT, part = tid % SPLIT;
    // local row lrow = g*U + j: W_hh row g*H + rank*U + j
    const int g = lrow / U, j = lrow - g * U, row = g * H + rank * U + j;
    float wr[KW];
#pragma unroll
    for (int k = 0; k < KW; k++) wr[k] = w[(long long)row * H + part * KW + k];
    for (int i = tid; i < H; i += THREADS) hbuf[0][i] = h0[i];
    float cst = tid < U ? c0[rank * U + tid] : 0.0f;
    // the unit's input products, loaded a step ahead (PREFETCH) or in the cell
    float xv[4] = {0.f, 0.f, 0.f, 0.f};
    if (PREFETCH && tid < U)
        for (int q = 0; q < 4; q++) xv[q] = xg[q * H + rank * U + tid];
    cluster_sync();
    for (int t = 0; t < T; t++) {
        float xc[4];
        for (int q = 0; q < 4; q++) xc[q] = xv[q];
        if (PREFETCH && tid < U && t + 1 < T)
            for (int q = 0; q < 4; q++) xv[q] = xg[(long long)(t + 1) * 4 * H + q * H + rank * U + tid];
        const float* hp = hbuf[t & 1] + part * KW;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
        for (int k = 0; k < KW; k += 4) {
            float4 hv = *reinterpret_cast<const float4*>(hp + k);
            a0 = fmaf(wr[k], hv.x, a0); a1 = fmaf(wr[k + 1], hv.y, a1);
            a2 = fmaf(wr[k + 2], hv.z, a2); a3 = fmaf(wr[k + 3], hv.w, a3);
        }
        float a = (a0 + a1) + (a2 + a3);
#pragma unroll
        for (int m = 1; m < SPLIT; m *= 2) a += __shfl_xor_sync(0xffffffffu, a, m);
        if (part == 0) acc[lrow] = a;
        __syncthreads();
        if (tid < U) {
            const int u = rank * U + tid;
            if (!PREFETCH) {
                const float* x = xg + (long long)t * 4 * H;
                for (int q = 0; q < 4; q++) xc[q] = x[q * H + u];
            }
            float ig = sigm(xc[0] + acc[tid]);
            float fg = sigm(xc[1] + acc[U + tid]);
            float gg = tanhf(xc[2] + acc[2 * U + tid]);
            float og = sigm(xc[3] + acc[3 * U + tid]);
            cst = fg * cst + ig * gg;
            float h = og * tanhf(cst);
            y[(long long)t * H + u] = h;
            float* dst = &hbuf[(t + 1) & 1][u];
#pragma unroll
            for (int r = 0; r < C; r++) store_remote(dst, r, h);
        }
        cluster_sync();
    }
}
"""


def reference(xg, w, h0, c0):
    T = xg.shape[0]
    h, c = h0.astype(np.float64), c0.astype(np.float64)
    ys = np.zeros((T, H))
    sig = lambda v: 1 / (1 + np.exp(-v))
    for t in range(T):
        a = xg[t].astype(np.float64) + w.astype(np.float64) @ h
        i, f, g, o = sig(a[:H]), sig(a[H:2 * H]), np.tanh(a[2 * H:3 * H]), sig(a[3 * H:])
        c = f * c + i * g
        h = o * np.tanh(c)
        ys[t] = h
    return ys


def main():
    rng = np.random.default_rng(3)
    T_MAX = 512
    xg = rng.standard_normal((T_MAX, G * H)).astype(np.float32) * 0.5
    w = (rng.standard_normal((G * H, H)) / np.sqrt(H)).astype(np.float32)
    h0 = rng.standard_normal(H).astype(np.float32) * 0.5
    c0 = rng.standard_normal(H).astype(np.float32) * 0.5
    ref = reference(xg, w, h0, c0)
    d = {k: cp.asarray(v) for k, v in dict(xg=xg, w=w, h0=h0, c0=c0).items()}
    y = cp.zeros((T_MAX, H), dtype=cp.float32)
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    only = sys.argv[1:]  # e.g. "8,1,1": C, SPLIT, PREFETCH
    configs = [(C, S, P) for P in (0, 1) for C, S in [(2, 2), (4, 2), (4, 1), (8, 2), (8, 1), (16, 1)]]
    for C, SPLIT, PREFETCH in configs:
        if only and f"{C},{SPLIT},{PREFETCH}" not in only:
            continue
        attr = f"__cluster_dims__({C}, 1, 1)" if C > 1 else ""
        opts = ("--gpu-architecture=sm_90a", "--std=c++17", f"-DC={C}", f"-DSPLIT={SPLIT}", f"-DPREFETCH={PREFETCH}",
                f"-DCLUSTER_ATTR={attr}")
        try:
            mod = cp.RawModule(code=SRC, options=opts)
            k = mod.get_function("lstm_cluster")
        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
            print(f"C={C} SPLIT={SPLIT} PREFETCH={PREFETCH}: did not build: {e}", flush=True)
            continue
        threads = 4 * (H // C) * SPLIT
        run = lambda T: k((C,), (threads,), (d["xg"], d["w"], d["h0"], d["c0"], y, np.int32(T)))
        try:
            run(T_MAX)
            cp.cuda.runtime.deviceSynchronize()
        except Exception as e:  # noqa: BLE001
            print(f"C={C} SPLIT={SPLIT} PREFETCH={PREFETCH}: did not run: {e}", flush=True)
            continue
        err = np.abs(y.get().astype(np.float64) - ref).max()
        times = {}
        for T in (64, T_MAX):
            for _ in range(3):
                run(T)
            ev = [cp.cuda.Event() for _ in range(2)]
            reps = 50
            ev[0].record()
            for _ in range(reps):
                run(T)
            ev[1].record()
            ev[1].synchronize()
            times[T] = cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1000 / reps
        step = (times[T_MAX] - times[64]) / (T_MAX - 64)
        print(f"C={C:2} SPLIT={SPLIT} PREFETCH={PREFETCH} threads {threads:4}: max abs err {err:.2e}; T=64 {times[64]:.1f} us, "
              f"T=512 {times[T_MAX]:.1f} us; {step:.3f} us a step", flush=True)


if __name__ == "__main__":
    sys.exit(main())
