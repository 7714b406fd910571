# Probe, not part of the crate: the MLP's first-layer forward (1024 x 128 over 784) as 64 x 64
# tiles split over k into clusters of 4 blocks (128 blocks), 3xTF32 `wgmma` from shared memory
# (the conventions benches/probes/wgmma_tf32.py pinned down), raw slices by cp.async in 4
# stages, the big/small split done once a slice into double-buffered core-matrix buffers while
# the slice before is multiplied, and the four partial tiles added in rank order through
# distributed shared memory before bias and ReLU. Run on the GPU machine (CuPy):
#   python3 benches/probes/wgmma_tf32_cluster.py
# Measured on the H100 (without the switches below): right (relative error
# 1.3e-6, the products summed over each block's k in the accumulators) but 37.8 us a launch,
# against 10.2 for the mma.sync tiles: something serialises it. Not yet run: the switches
# NO_WGMMA, ONE_WGMMA, NO_SPLIT (which part takes the time; the loop below runs them), and the
# SASS (nvcc -arch=sm_90a -cubin, cuobjdump -sass: how the HGMMA instructions are fenced). Leads:
# the split pass's 16-byte stores 128 bytes apart (8-way bank conflicts), the no-swizzle layout.
import os, sys
import cupy as cp, numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import B, H, I, forward_operands, time_launches
src = r'''
#define BM 64
#define BN 64
#define KC 32
#define S 4
#define STAGES 4
#define THREADS 128
constexpr int RAW = (BM + BN) * KC * 4;            // one raw slice: A then B, row-major [r][KC]
constexpr int A_BYTES = BM * KC * 4, B_BYTES = BN * KC * 4;
constexpr int SPLIT = 2 * A_BYTES + 2 * B_BYTES;   // big A, small A, big B, small B
constexpr int SMEM = STAGES * RAW + 2 * SPLIT;
__device__ __forceinline__ int cm_off(int r, int k) { return ((r >> 3) * (KC / 4) + (k >> 2)) * 128 + (r & 7) * 16 + (k & 3) * 4; }
__device__ __forceinline__ unsigned long long make_desc(unsigned addr) {
    const unsigned lbo = 128, sbo = (KC / 4) * 128;
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) | ((unsigned long long)(sbo >> 4) << 32);
}
__device__ __forceinline__ void cp16(unsigned dst, const float* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void wgmma(float (&d)[32], unsigned long long a, unsigned long long b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(scale_d));
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float cluster_load(unsigned at, unsigned rank) {
    unsigned remote; float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(at), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
// grid (S, N / BN, M / BM); X M x K, W N x K (rows contiguous, K a multiple of 4)
extern "C" __global__ void __launch_bounds__(THREADS) __cluster_dims__(S, 1, 1)
wg_fwd(const float* X, const float* W, const float* bias, float* Z, float* Y, int M, int N, int K) {
    extern __shared__ __align__(128) char sm[];
    unsigned base = (unsigned)__cvta_generic_to_shared(sm);
    unsigned rank; asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    int n0 = blockIdx.y * BN, m0 = blockIdx.z * BM;
    int all = (K + KC - 1) / KC, per = (all + S - 1) / S;
    int first = min((int)rank * per, all), slices = min(per, all - first);
    // raw slice s (this block's s-th) into stage s % STAGES: thread's 16-byte chunks
    auto load = [&](int s) {
        unsigned dst = base + (s % STAGES) * RAW;
        int k0 = (first + s) * KC;
        for (int e = threadIdx.x; e < (BM + BN) * KC / 4; e += THREADS) {
            int r = e / (KC / 4), k = (e % (KC / 4)) * 4;
            bool a = r < BM;
            int row = a ? m0 + r : n0 + (r - BM), rows = a ? M : N;
            bool ok = row < rows && k0 + k < K;
            const float* src = ok ? (a ? X : W) + (long long)row * K + k0 + k : X;
            cp16(dst + 4 * (r * KC + k), src, ok ? 16 : 0);
        }
    };
    // the split of raw slice s into buffer s % 2
    auto split = [&](int s) {
#ifdef NO_SPLIT
        return;
#endif
        const float* raw = (const float*)(sm + (s % STAGES) * RAW);
        char* out = sm + STAGES * RAW + (s % 2) * SPLIT;
        for (int e = threadIdx.x; e < (BM + BN) * KC / 4; e += THREADS) {
            int r = e / (KC / 4), k = (e % (KC / 4)) * 4;
            float4 v = *(const float4*)(raw + r * KC + k);
            float x[4] = {v.x, v.y, v.z, v.w}, b[4], sm4[4];
            for (int i = 0; i < 4; i++) {
                unsigned u = (__float_as_uint(x[i]) + 0x1000u) & 0xffffe000u;
                b[i] = __uint_as_float(u); sm4[i] = x[i] - b[i];
            }
            bool a = r < BM;
            int rr = a ? r : r - BM;
            char* big = out + (a ? 0 : 2 * A_BYTES);
            char* small = big + (a ? A_BYTES : B_BYTES);
            *(float4*)(big + cm_off(rr, k)) = make_float4(b[0], b[1], b[2], b[3]);
            *(float4*)(small + cm_off(rr, k)) = make_float4(sm4[0], sm4[1], sm4[2], sm4[3]);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    };
    float acc[32];
    for (int i = 0; i < 32; i++) acc[i] = 0.0f;
    for (int s = 0; s < STAGES - 1; s++) { if (s < slices) load(s); cp_commit(); }
    if (slices > 0) { cp_wait<STAGES - 2>(); __syncthreads(); split(0); }
    __syncthreads();
    for (int c = 0; c < slices; c++) {
        unsigned sb = base + STAGES * RAW + (c % 2) * SPLIT;
        unsigned a_big = sb, a_small = sb + A_BYTES, b_big = sb + 2 * A_BYTES, b_small = b_big + B_BYTES;
        wg_fence();
        #pragma unroll
        for (int s = 0; s < KC / 8; s++) {
            unsigned off = s * 256;
#ifndef NO_WGMMA
            wgmma(acc, make_desc(a_small + off), make_desc(b_big + off), c > 0 || s > 0);
#ifndef ONE_WGMMA
            wgmma(acc, make_desc(a_big + off), make_desc(b_small + off), 1);
            wgmma(acc, make_desc(a_big + off), make_desc(b_big + off), 1);
#endif
#endif
        }
        wg_commit();
        if (c + STAGES - 1 < slices) load(c + STAGES - 1);
        cp_commit();
        if (c + 1 < slices) {
            cp_wait<STAGES - 2>();
            __syncthreads();
            wg_wait<1>();
            split(c + 1);
        }
        __syncthreads();
    }
    wg_wait<0>();
    __syncthreads();
    // this block's partial sums, [BM][BN + 1], over the raw stages
    float* part = (float*)sm;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (int j = 0; j < BN / 8; j++)
        for (int q = 0; q < 4; q++) part[(16 * warp + g + (q >= 2 ? 8 : 0)) * (BN + 1) + 8 * j + 2 * t + (q & 1)] = acc[4 * j + q];
    cluster_sync();
    for (int o = threadIdx.x; o < (BM / S) * BN; o += THREADS) {
        int r = rank * (BM / S) + o / BN, col = o % BN;
        unsigned at = base + 4 * (r * (BN + 1) + col);
        float v = cluster_load(at, 0);
        for (int q = 1; q < S; q++) v += cluster_load(at, q);
        if (m0 + r < M && n0 + col < N) {
            float z = v + bias[n0 + col];
            Z[(long long)(m0 + r) * N + n0 + col] = z;
            Y[(long long)(m0 + r) * N + n0 + col] = fmaxf(z, 0.0f);
        }
    }
    cluster_sync();
}
'''
X, W, bias, ref = forward_operands()
Z = cp.zeros((B, H), cp.float32); Y = cp.zeros((B, H), cp.float32)
stream = cp.cuda.Stream(non_blocking=True)
for defs in ((), ("-DNO_WGMMA",), ("-DNO_SPLIT",), ("-DONE_WGMMA",), ("-DNO_WGMMA", "-DNO_SPLIT")):
    mod = cp.RawModule(code=src, options=("--gpu-architecture=sm_90a", "--fmad=false", "--std=c++17") + defs)
    k = mod.get_function("wg_fwd")
    smem = 4 * (64 + 64) * 32 * 4 + 2 * (2 * 64 * 32 * 4 + 2 * 64 * 32 * 4)
    k.max_dynamic_shared_size_bytes = smem
    grid = (4, H // 64, B // 64)
    fn = lambda: k(grid, (128,), (X, W, bias, Z, Y, cp.int32(B), cp.int32(H), cp.int32(I)), shared_mem=smem, stream=stream)
    Z.fill(0); fn(); stream.synchronize()
    got = Z.get()
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    print(f"{' '.join(defs) or 'full'}: max rel err {err:.2e}, {time_launches(stream, fn):.2f} us a launch", flush=True)
