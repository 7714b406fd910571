// A model's last dense layer, the loss and that layer's input gradient in one launch (src/cuda/
// head.rs), for a last layer of at most 32 outputs (a classifier's or a regression's): run
// separately, those are three kernels on the step's critical path (the layer, the loss, the
// input gradient), each a kernel boundary and a round of loads. Each warp takes one sample at a
// time: lane j computes output j from the sample's inputs and row j of W (staged into shared
// memory while the kernel ahead still runs; with few outputs, lanes share one), the lanes
// exchange what the loss needs by shuffles, and then split the input gradient's values among
// them. No warp waits for another: each leaves the sum of its samples' loss terms in
// partials[block · HEAD_WARPS + warp], and loss_sum (loss.cu) adds them up in order, beside the
// rest of the step (so the same bits every run).
//
// It writes what the separate kernels write, in the plan's regions: the layer's z and y (y only
// with an activation), the loss gradient dy (only with an activation; else it is dz) and dz,
// and the input gradient, times the derivative of the activation that made the inputs when
// `prev_z` is given (as exec.rs folds it in: then `dx` is that layer's dz).
//
// Offsets are in floats: w and b in params; x, z, y and prev_z (sample 0 of the region) in
// acts, and z, y (for dz, dy) and dx (−1: no input gradient) in dacts, which has the same
// layout.

#define HEAD_MAX_OUTPUTS 32
// samples a block takes at a time: a warp each
#define HEAD_WARPS (REDUCE_THREADS / 32)

// Copies 4 bytes from global into shared memory asynchronously (cp.async, sm_80 on; before, a
// plain copy), so that a thread's copies are all in flight at once; head_copied waits for them.
__device__ __forceinline__ void head_copy(float* dst, const float* src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
#else
    *dst = *src;
#endif
}

__device__ __forceinline__ void head_copied() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// W's row stride in shared memory: odd, so that the lanes reading one value of consecutive rows
// hit distinct banks
__device__ __forceinline__ int head_stride(int k) {
    return k | 1;
}

// `weights_early`: the kernel ahead in the stream writes no weights (it is a layer's forward, or
// the copy of the inputs), so W and b are staged before waiting for it.
extern "C" __global__ __launch_bounds__(REDUCE_THREADS) void dense_head(const float* params, float* acts, float* dacts, int k, int n,
                                                                        int act, float slope, int w, int b, int x, int z, int y, int dx,
                                                                        int prev_z, int prev_act, float prev_slope,
                                                                        int xent, const unsigned* labels, const float* targets,
                                                                        double* partials, float grad_scale, int batch,
                                                                        int weights_early) {
    extern __shared__ float head_smem[];
    __shared__ float dzs[HEAD_WARPS][HEAD_MAX_OUTPUTS];
    if (!weights_early) after_prior();
    // W (n rows of `ws`) and b, then a row of inputs a warp (and of the producer's z)
    int ws = head_stride(k);
    float *wsm = head_smem, *bsm = head_smem + n * ws;
    if (threadIdx.x == 0) {
        unsigned have;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
        // src/cuda/head.rs sizes the launch: a mismatch is a bug
        if (4u * (unsigned)(n * ws + n + (prev_z >= 0 ? 2 : 1) * HEAD_WARPS * k) > have) asm volatile("trap;");
    }
    for (int i = threadIdx.x; i < n * k; i += REDUCE_THREADS) head_copy(wsm + (i / k) * ws + i % k, params + w + i);
    for (int j = threadIdx.x; j < n; j += REDUCE_THREADS) head_copy(bsm + j, params + b + j);
    if (weights_early) after_prior();
    head_copied();
    __syncthreads();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // `parts` lanes share an output (32 over n rounded up to a power of two): each sums every
    // parts-th value of k, then the group adds its sums by shuffles, so every lane of the group
    // ends with the same bits; lane j·parts + part
    int parts = 32;
    while (parts > 1 && parts * n > 32) parts /= 2;
    int jl = lane / parts, part = lane % parts;
    bool out = jl < n, leader = out && part == 0;
    const float* wj = wsm + (out ? jl : 0) * ws;
    // a row of inputs a warp, and of the producer's z when its derivative is folded in
    float* xs = bsm + n + warp * k;
    float* zs = prev_z >= 0 ? bsm + n + (HEAD_WARPS + warp) * k : nullptr;
    double acc = 0.0;
    for (int s = blockIdx.x * HEAD_WARPS + warp; s < batch; s += gridDim.x * HEAD_WARPS) {
        for (int c = lane; c < k; c += 32) {
            head_copy(xs + c, acts + x + (long long)s * k + c);
            if (zs) head_copy(zs + c, acts + prev_z + (long long)s * k + c);
        }
        head_copied();
        __syncwarp();
        // z_j = Σ_c x_c · W[j][c] + b_j: the lane's share of c, then its group's
        float sum = strided_dot(xs, wj, out ? part : k, parts, k);
        for (int d = parts / 2; d > 0; d /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);
        float zj = sum + bsm[out ? jl : 0];
        float yj = act != 0 ? act_apply(act, slope, zj) : zj;
        long long o = (long long)s * n + jl;
        if (leader) {
            acts[z + o] = zj;
            if (act != 0) acts[y + o] = yj;
        }
        // the loss gradient dy_j, and the loss's term (lane 0 for cross-entropy: one a sample)
        float dyj;
        if (xent) {
            // as softmax_xent in loss.cu, the sums over classes by shuffles (lanes past n count
            // as −∞ in the max, and only a group's first lane in the sum)
            float max = out ? yj : __int_as_float(0xff800000);
            for (int d = 16; d > 0; d /= 2) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, d));
            float e = out ? expf(yj - max) : 0.0f, denom = leader ? e : 0.0f;
            for (int d = 16; d > 0; d /= 2) denom += __shfl_xor_sync(0xffffffffu, denom, d);
            unsigned label = labels[s];
            float picked = __shfl_sync(0xffffffffu, yj, label < (unsigned)n ? label * parts : 0);
            dyj = e * (1.0f / denom) * grad_scale;
            if (jl == (int)label) dyj = dyj - grad_scale;
            if (lane == 0) acc += label < (unsigned)n ? (double)(max + logf(denom) - picked) : __longlong_as_double(0x7ff8000000000000LL);
        } else {
            // as mse in loss.cu
            float d = leader ? yj - targets[o] : 0.0f;
            acc += (double)d * (double)d;
            dyj = grad_scale * d;
        }
        float dzj = act != 0 ? dyj * act_derivative(act, slope, zj, yj) : dyj;
        if (leader) {
            if (act != 0) dacts[y + o] = dyj;
            dacts[z + o] = dzj;
            dzs[warp][jl] = dzj;
        }
        __syncwarp();
        // the input gradient: dx_c = Σ_j dz_j · W[j][c], times the producer's act'
        if (dx >= 0) {
            for (int c = lane; c < k; c += 32) {
                float v = 0.0f;
                for (int j = 0; j < n; j++) v = fmaf(dzs[warp][j], wsm[j * ws + c], v);
                if (zs) v *= act_derivative(prev_act, prev_slope, zs[c], xs[c]);
                dacts[dx + (long long)s * k + c] = v;
            }
        }
        // the next sample's inputs overwrite xs and zs, and its dz dzs
        __syncwarp();
    }
    // the warp's loss terms (lane 0's for cross-entropy, the leaders' for MSE), by shuffles in
    // a fixed order; lane 0's sum is the warp's partial
    for (int d = 16; d > 0; d /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, d);
    if (lane == 0) partials[blockIdx.x * HEAD_WARPS + warp] = acc;
}
