# Probe, not part of the crate: a warpgroup-MMA (wgmma, sm_90a) 3xTF32 product for the MLP's
# first-layer forward (C 1024 x 128 = X 1024 x 784 . W^T + b, X and W both K-major), to pin down
# the shared-memory descriptor conventions before the tiles in kernels/dense.cu use it. Operands
# are split into TF32 big + small parts while staged into shared memory (core matrices of 8 rows
# x 16 bytes, no swizzle); three wgmma a k8 step; one slice of k prefetched into registers.
# Run on the GPU machine (CuPy): python3 benches/probes/wgmma_tf32.py. It prints, for each tile
# width and each reading of the descriptor's two byte offsets, the error against float64 and,
# where it is right, the time a launch (graphs of 20 launches). On the H100 it was right to
# 2.5e-7 (relative) and took 30.8-38.7 us a launch with this naive pipeline.
import os, sys
import cupy as cp, numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import B, H, I, forward_operands, time_launches
src = r'''
#ifndef BN
#define BN 32
#endif
#define BM 64
#define KC 32
#define THREADS 128
__device__ __forceinline__ void split4(float4 v, float4& big, float4& small) {
    float x[4] = {v.x, v.y, v.z, v.w}, b[4], s[4];
    for (int i = 0; i < 4; i++) {
        unsigned u = (__float_as_uint(x[i]) + 0x1000u) & 0xffffe000u;
        b[i] = __uint_as_float(u); s[i] = x[i] - b[i];
    }
    big = make_float4(b[0], b[1], b[2], b[3]); small = make_float4(s[0], s[1], s[2], s[3]);
}
// byte offset of (r, k) in a K-major tile of KC values of k: core matrices of 8 rows x 4 k (128 B)
__device__ __forceinline__ int cm_off(int r, int k) { return ((r >> 3) * (KC / 4) + (k >> 2)) * 128 + (r & 7) * 16 + (k & 3) * 4; }
__device__ __forceinline__ unsigned long long make_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16)
         | ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
#if BN == 32
__device__ __forceinline__ void wgmma(float (&d)[16], unsigned long long a, unsigned long long b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(scale_d));
}
#else
__device__ __forceinline__ void wgmma(float (&d)[8], unsigned long long a, unsigned long long b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(a), "l"(b), "r"(scale_d));
}
#endif
constexpr int A_BYTES = BM * KC * 4, B_BYTES = BN * KC * 4, BUF = 2 * A_BYTES + 2 * B_BYTES;
constexpr int AV = BM * KC / 4 / THREADS, BV = BN * KC / 4 / THREADS;
// grid (N / BN, M / BM); mode 0: lbo = K-direction core-matrix stride, sbo = M/N-direction; 1: swapped
extern "C" __global__ void __launch_bounds__(THREADS) wg_fwd(const float* X, const float* W, const float* bias, float* Z, int M, int N, int K, int mode) {
    __shared__ __align__(128) char sm[2 * BUF];
    int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    unsigned base = (unsigned)__cvta_generic_to_shared(sm);
    float4 ra[AV], rb[BV];
    auto fetch = [&](int c) {
        int k0 = c * KC;
        for (int v = 0; v < AV; v++) {
            int e = threadIdx.x + v * THREADS, r = e / (KC / 4), k = (e % (KC / 4)) * 4;
            ra[v] = (m0 + r < M && k0 + k < K) ? *(const float4*)(X + (long long)(m0 + r) * K + k0 + k) : make_float4(0, 0, 0, 0);
        }
        for (int v = 0; v < BV; v++) {
            int e = threadIdx.x + v * THREADS, r = e / (KC / 4), k = (e % (KC / 4)) * 4;
            rb[v] = (n0 + r < N && k0 + k < K) ? *(const float4*)(W + (long long)(n0 + r) * K + k0 + k) : make_float4(0, 0, 0, 0);
        }
    };
    auto store = [&](int buf) {
        char* s = sm + buf * BUF;
        for (int v = 0; v < AV; v++) {
            int e = threadIdx.x + v * THREADS, r = e / (KC / 4), k = (e % (KC / 4)) * 4;
            float4 big, small; split4(ra[v], big, small);
            *(float4*)(s + cm_off(r, k)) = big; *(float4*)(s + A_BYTES + cm_off(r, k)) = small;
        }
        for (int v = 0; v < BV; v++) {
            int e = threadIdx.x + v * THREADS, r = e / (KC / 4), k = (e % (KC / 4)) * 4;
            float4 big, small; split4(rb[v], big, small);
            *(float4*)(s + 2 * A_BYTES + cm_off(r, k)) = big; *(float4*)(s + 2 * A_BYTES + B_BYTES + cm_off(r, k)) = small;
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    };
    unsigned kstride = 128, mstride = (KC / 4) * 128;
    unsigned lbo = mode == 0 ? kstride : mstride, sbo = mode == 0 ? mstride : kstride;
    float total[BN / 2], acc[BN / 2];
    for (int i = 0; i < BN / 2; i++) total[i] = 0.0f;
    int slices = (K + KC - 1) / KC;
    fetch(0); store(0); __syncthreads();
    for (int c = 0; c < slices; c++) {
        if (c + 1 < slices) fetch(c + 1);
        unsigned b0 = base + (c % 2) * BUF;
        unsigned a_big = b0, a_small = b0 + A_BYTES, b_big = b0 + 2 * A_BYTES, b_small = b0 + 2 * A_BYTES + B_BYTES;
        wg_fence();
        #pragma unroll
        for (int s = 0; s < KC / 8; s++) {
            unsigned off = s * 256;  // two core matrices along k per k8 step
            wgmma(acc, make_desc(a_small + off, lbo, sbo), make_desc(b_big + off, lbo, sbo), s > 0);
            wgmma(acc, make_desc(a_big + off, lbo, sbo), make_desc(b_small + off, lbo, sbo), 1);
            wgmma(acc, make_desc(a_big + off, lbo, sbo), make_desc(b_big + off, lbo, sbo), 1);
        }
        wg_commit();
        if (c + 1 < slices) store((c + 1) % 2);
        wg_wait0();
        for (int i = 0; i < BN / 2; i++) total[i] += acc[i];
        __syncthreads();
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (int j = 0; j < BN / 8; j++) {
        for (int q = 0; q < 4; q++) {
            int r = m0 + 16 * warp + g + (q >= 2 ? 8 : 0), col = n0 + 8 * j + 2 * t + (q & 1);
            if (r < M && col < N) Z[(long long)r * N + col] = total[4 * j + q] + bias[col];
        }
    }
}
'''
X, W, bias, ref = forward_operands()
Z = cp.zeros((B, H), cp.float32)
stream = cp.cuda.Stream(non_blocking=True)
for bn in (32, 16):
    try:
        mod = cp.RawModule(code=src, options=("--gpu-architecture=sm_90a", "--fmad=false", "--std=c++17", f"-DBN={bn}"))
        k = mod.get_function("wg_fwd")
    except Exception as e:
        print(f"BN {bn}: compile failed: {str(e)[:2000]}"); continue
    for mode in (0, 1):
        Z.fill(0)
        grid = (H // bn, B // 64)
        fn = lambda: k(grid, (128,), (X, W, bias, Z, cp.int32(B), cp.int32(H), cp.int32(I), cp.int32(mode)), stream=stream)
        try:
            fn(); stream.synchronize()
            got = Z.get()
            err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            line = f"BN {bn} mode {mode}: max rel err {err:.2e}"
            if err < 1e-5:
                line += f", {time_launches(stream, fn):.2f} us a launch ({grid[0] * grid[1]} blocks)"
            else:
                # where it goes wrong: the first few mismatches
                bad = np.argwhere(np.abs(got - ref) > 1e-3 * np.max(np.abs(ref)))[:4]
                line += " first bad " + str([(int(r), int(c), float(got[r, c]), float(ref[r, c])) for r, c in bad])
            print(line, flush=True)
        except Exception as e:
            print(f"BN {bn} mode {mode}: failed {str(e)[:300]}", flush=True)
            sys.exit(1)
