// Weight gradients of narrow layers over many samples (sm_90 and later): dW (out × in) = dZᵀ · X
// and db = Σ dZ over the batch, where too few outputs (say 64 × 128) cover too little of the GPU
// for a kernel that sums each one over all of the batch. One launch takes up to two layers
// (jobs), whose clusters run side by side. Each cluster of WG_SPLIT blocks takes WG_COLS columns
// of dW (and db with the first ones) over WG_ROWS rows: block q of the cluster sums the q-th
// share of the samples, staged through shared memory WG_CHUNK at a time (cp.async, WG_STAGES
// buffers); each thread sums a 2 × 4 patch in sample order. The blocks then put their sums in
// shared memory and, after the cluster's barrier, each adds one share of the outputs over the
// WG_SPLIT blocks in rank order, reading the others' through distributed shared memory: every
// output is summed in one fixed order. dZ is batch × out and X batch × in, rows contiguous.
// Grid: WG_SPLIT blocks for each (job, group of rows, group of columns), along x. Host side:
// src/cuda/wgrad.rs. Uses dense_mma.cu's asynchronous copies (mma_copy, mma_commit, mma_wait),
// so it comes after it in source_files().
#define WG_SPLIT 8
#define WG_CHUNK 32
#define WG_STAGES 4
#define WG_COLS 128
#define WG_ROWS (2 * MMA_THREADS / (WG_COLS / 4))

#if __CUDA_ARCH__ >= 900
#define WG_CLUSTER __cluster_dims__(WG_SPLIT, 1, 1)
#else
#define WG_CLUSTER
#endif

// One layer's weight gradient (src/cuda/wgrad.rs: Job)
struct WgJob {
    const float* dz;
    const float* x;
    float* dw;
    float* db;
    int out, in, clusters;
};

// Stages one chunk's samples first .. of M (rows of `width` floats) into shared memory at `buf`,
// [sample][W]: columns col0 .. col0 + W, zeros at columns past `width` and samples from `end`;
// `step` (1, or 4 where rows and M are 16-byte aligned) values a copy
template <int W>
__device__ __forceinline__ void wg_stage(unsigned buf, const float* m, int width, int col0, int first, int end, int step) {
    for (int e = step * threadIdx.x; e < WG_CHUNK * W; e += step * MMA_THREADS) {
        int s = first + e / W, j = col0 + e % W;
        bool valid = s < end && j < width;
        const float* src = valid ? m + (long long)s * width + j : m;
        if (step == 4) {
            mma_copy(buf + 4 * e, src, valid ? 16 : 0);
        } else {
#if __CUDA_ARCH__ >= 800
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(buf + 4 * e), "l"(src), "r"(valid ? 4 : 0) : "memory");
#endif
        }
    }
}

extern "C" __global__ __launch_bounds__(MMA_THREADS) void WG_CLUSTER weight_grad_split(WgJob first, WgJob second, int batch) {
    after_prior();
#if __CUDA_ARCH__ >= 900
    constexpr int R = WG_ROWS, C = WG_COLS, QUADS = C / 4, STAGE = WG_CHUNK * (R + C);
    static_assert(QUADS * (R / 2) == MMA_THREADS, "a 2 × 4 patch a thread");
    extern __shared__ __align__(16) float smem[];
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < 4u * (WG_STAGES * STAGE + R * (C + 1))) __trap();  // less than the layout needs
    unsigned rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    int cluster = blockIdx.x / WG_SPLIT;
    // (field by field: a reference to either parameter would copy both to the stack)
    bool one = cluster < first.clusters;
    const float *dz = one ? first.dz : second.dz, *x = one ? first.x : second.x;
    float *dw = one ? first.dw : second.dw, *db = one ? first.db : second.db;
    int out = one ? first.out : second.out, in = one ? first.in : second.in;
    if (!one) cluster -= first.clusters;
    int col_groups = (in + C - 1) / C;
    int r0 = (cluster / col_groups) * R, c0 = (cluster % col_groups) * C;
    int per = (batch + WG_SPLIT - 1) / WG_SPLIT, s0 = min((int)rank * per, batch), s1 = min(s0 + per, batch);
    int chunks = (s1 - s0 + WG_CHUNK - 1) / WG_CHUNK;
    // X in 16-byte copies where its rows allow
    bool x16 = in % 4 == 0 && ((unsigned long long)x & 15) == 0;
    unsigned base = (unsigned)__cvta_generic_to_shared(smem);
    // chunk c into buffer c % WG_STAGES: [sample][R] of dZ, then [sample][C] of X
    auto load = [&](int c) {
        unsigned buf = base + 4 * (c % WG_STAGES) * STAGE;
        int first_sample = s0 + c * WG_CHUNK;
        wg_stage<R>(buf, dz, out, r0, first_sample, s1, 1);
        wg_stage<C>(buf + 4 * WG_CHUNK * R, x, in, c0, first_sample, s1, x16 ? 4 : 1);
    };
    for (int c = 0; c < WG_STAGES - 1; c++) {
        if (c < chunks) load(c);
        mma_commit();
    }
    int quad = threadIdx.x % QUADS, pair = threadIdx.x / QUADS;
    // the bias (db) is the column of ones: the first column group's quad-0 threads sum dZ too
    bool bias = c0 == 0 && quad == 0;
    float acc[2][4] = {}, bsum[2] = {};
    for (int c = 0; c < chunks; c++) {
        mma_wait<WG_STAGES - 2>();
        __syncthreads();
        if (c + WG_STAGES - 1 < chunks) load(c + WG_STAGES - 1);
        mma_commit();
        const float* dzs = smem + (c % WG_STAGES) * STAGE;
        const float* xs = dzs + WG_CHUNK * R;
#pragma unroll 4
        for (int s = 0; s < WG_CHUNK; s++) {
            float2 d = *(const float2*)(dzs + s * R + 2 * pair);
            float4 v = *(const float4*)(xs + s * C + 4 * quad);
            acc[0][0] = fmaf(d.x, v.x, acc[0][0]);
            acc[0][1] = fmaf(d.x, v.y, acc[0][1]);
            acc[0][2] = fmaf(d.x, v.z, acc[0][2]);
            acc[0][3] = fmaf(d.x, v.w, acc[0][3]);
            acc[1][0] = fmaf(d.y, v.x, acc[1][0]);
            acc[1][1] = fmaf(d.y, v.y, acc[1][1]);
            acc[1][2] = fmaf(d.y, v.z, acc[1][2]);
            acc[1][3] = fmaf(d.y, v.w, acc[1][3]);
            if (bias) {
                bsum[0] += d.x;
                bsum[1] += d.y;
            }
        }
    }
    mma_wait<0>();
    // this block's sums, [R][C + 1] (column C: db), after the staging buffers
    float* sums = smem + WG_STAGES * STAGE;
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int j = 0; j < 4; j++) sums[(2 * pair + i) * (C + 1) + 4 * quad + j] = acc[i][j];
        if (bias) sums[(2 * pair + i) * (C + 1) + C] = bsum[i];
    }
    cluster_sync();
    unsigned sums_at = base + 4 * WG_STAGES * STAGE;
    for (int o = rank * MMA_THREADS + threadIdx.x; o < R * (C + 1); o += WG_SPLIT * MMA_THREADS) {
        float v = cluster_load(sums_at + 4 * o, 0);
#pragma unroll
        for (int q = 1; q < WG_SPLIT; q++) v += cluster_load(sums_at + 4 * o, q);
        int r = r0 + o / (C + 1), j = o % (C + 1);
        if (r < out && j < C && c0 + j < in) dw[(long long)r * in + c0 + j] = v;
        if (r < out && j == C && c0 == 0) db[r] = v;
    }
    // no block leaves while another may still read its sums
    cluster_sync();
#else
    __trap();
#endif
}
