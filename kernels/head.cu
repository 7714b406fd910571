// A model's last dense layer, the loss and that layer's input gradient in one launch (src/cuda/
// head.rs), for a last layer of at most 32 outputs (a classifier's or a regression's): run
// separately, those are three kernels on the step's critical path (the layer, the loss, the
// input gradient), each a kernel boundary and a round of loads. Where the dense layer before it
// fits in shared memory too (`k0` > 0, dense_head_deep), that layer's forward and input
// gradient run here as well: two kernels fewer. Each warp (dense_head_deep2: each unit of two
// warps) takes one sample at a time: lane j computes output j from the sample's inputs and row j of W
// (staged into shared memory while the kernel ahead still runs; with few outputs, lanes share
// one), the lanes exchange what the loss needs by shuffles, and then split the input gradient's
// values among them. No unit waits for another: each leaves the sum of its samples' loss terms
// in partials[block · units + unit], and loss_sum (loss.cu) adds them up in order, beside the
// rest of the step (so the same bits every run).
//
// It writes what the separate kernels write, in the plan's regions: the layer's z and y (y only
// with an activation), the loss gradient dy (only with an activation; else it is dz) and dz,
// and the input gradient, times the derivative of the activation that made the inputs when
// `prev_z` is given (as exec.rs folds it in: then `dx` is that layer's dz). With the layer
// before: its z (at prev_z, or at x without an activation) and y (at x), and its input
// gradient (at dx0), likewise times the derivative of the activation that made its inputs when
// `prev_z0` is given.
//
// Offsets are in floats: w, b, w0 and b0 in params; x, z, y, prev_z, x0 and prev_z0 (sample 0
// of the region) in acts, and z, y (for dz, dy), dx and dx0 (−1: no input gradient) in dacts,
// which has the same layout.

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

// Stages W (n rows of k, at wsm with stride head_stride(k)) and b (n, at bsm) from params
__device__ __forceinline__ void head_stage(float* wsm, float* bsm, const float* w, const float* b, int n, int k) {
    int ws = head_stride(k);
    for (int r = threadIdx.x / 32; r < n; r += HEAD_WARPS) {
        for (int c = threadIdx.x % 32; c < k; c += 32) head_copy(wsm + r * ws + c, w + (long long)r * k + c);
    }
    for (int j = threadIdx.x; j < n; j += REDUCE_THREADS) head_copy(bsm + j, b + j);
}

// k rounded up to a multiple of four (rows that the vector loops below read 16 bytes at a time)
__device__ __forceinline__ int head_pad4(int k) {
    return (k + 3) & ~3;
}

// rows 16-byte aligned, and 4 (mod 32) floats apart, so that the eight lanes of a quarter warp
// reading 16 bytes of eight consecutive rows hit all 32 banks
__device__ __forceinline__ int head_inner_stride(int k0) {
    return ((k0 + 31) & ~31) + 4;
}

// Stages the layer before's W0 (k rows of k0, at w0sm with stride head_inner_stride(k0)), its
// rows padded to head_pad4(k0) values and to head_pad4(k) rows with zeros (the vector loops below
// read the pads), and b0 (k, at b0sm)
__device__ __forceinline__ void head_stage_inner(float* w0sm, float* b0sm, const float* w0, const float* b0, int k, int k0) {
    int ws0 = head_inner_stride(k0), kp = head_pad4(k), k0p = head_pad4(k0);
    for (int r = threadIdx.x / 32; r < kp; r += HEAD_WARPS) {
        for (int c = threadIdx.x % 32; c < k0p; c += 32) {
            if (r < k && c < k0) {
                head_copy(w0sm + r * ws0 + c, w0 + (long long)r * k0 + c);
            } else {
                w0sm[r * ws0 + c] = 0.0f;
            }
        }
    }
    for (int j = threadIdx.x; j < k; j += REDUCE_THREADS) head_copy(b0sm + j, b0 + j);
}

// The layer before's z_j = Σ_c x_c · W0[j][c] + b_j for outputs j, j + 32, … (Q of them; rows
// past k read row k − 1, and the caller drops them), four values of c at a time from 16-byte
// loads of the padded rows (x: the sample's inputs, k0p values padded with zeros); each output
// summed in four sums (c mod 4), added as (s0 + s1) + (s2 + s3).
template <int Q>
__device__ __forceinline__ void head_inner_forward(const float* xs0, const float* w0sm, const float* b0sm, int k, int k0, int j,
                                                   float (&out)[Q]) {
    int ws0 = head_inner_stride(k0), k0p = head_pad4(k0);
    const float4* x = reinterpret_cast<const float4*>(xs0);
    const float4* row[Q];
    float4 acc[Q];
#pragma unroll
    for (int q = 0; q < Q; q++) {
        row[q] = reinterpret_cast<const float4*>(w0sm + min(j + 32 * q, k - 1) * ws0);
        acc[q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll 4
    for (int c = 0; c < k0p / 4; c++) {
        float4 xv = x[c];
#pragma unroll
        for (int q = 0; q < Q; q++) {
            float4 w = row[q][c];
            acc[q].x = fmaf(xv.x, w.x, acc[q].x);
            acc[q].y = fmaf(xv.y, w.y, acc[q].y);
            acc[q].z = fmaf(xv.z, w.z, acc[q].z);
            acc[q].w = fmaf(xv.w, w.w, acc[q].w);
        }
    }
#pragma unroll
    for (int q = 0; q < Q; q++) out[q] = ((acc[q].x + acc[q].y) + (acc[q].z + acc[q].w)) + b0sm[min(j + 32 * q, k - 1)];
}

// V consecutive floats at p (8- or 16-byte aligned) in one load
template <int V>
__device__ __forceinline__ void head_load(const float* p, float (&v)[V]) {
    if constexpr (V == 4) {
        float4 t = *reinterpret_cast<const float4*>(p);
        v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
    } else {
        static_assert(V == 2, "two or four floats");
        float2 t = *reinterpret_cast<const float2*>(p);
        v[0] = t.x, v[1] = t.y;
    }
}

// The layer before's input gradient dx_c = Σ_j d_j · W0[j][c] (d: its dz, the sample's row of
// kp values padded with zeros), times act'(zs0[c], xs0[c]) of the layer that made its inputs
// when zs0 is given, into dx (the sample's row): V consecutive columns from c0 (V-float loads),
// then from c0 + step, …; each summed over even and odd j apart, then added.
template <int V>
__device__ __forceinline__ void head_inner_back(const float* d, const float* w0sm, int k, int k0, const float* zs0, const float* xs0,
                                                int act, float slope, float* dx, int c0, int step) {
    int ws0 = head_inner_stride(k0), kp = head_pad4(k);
    const float4* dv = reinterpret_cast<const float4*>(d);
    for (; c0 < k0; c0 += step) {
        const float* col = w0sm + c0;
        float even[V], odd[V];
#pragma unroll
        for (int u = 0; u < V; u++) even[u] = odd[u] = 0.0f;
#pragma unroll 2
        for (int j = 0; j < kp / 4; j++) {
            float4 dj = dv[j];
            float w0[V], w1[V], w2[V], w3[V];
            head_load<V>(col + (4 * j) * ws0, w0);
            head_load<V>(col + (4 * j + 1) * ws0, w1);
            head_load<V>(col + (4 * j + 2) * ws0, w2);
            head_load<V>(col + (4 * j + 3) * ws0, w3);
#pragma unroll
            for (int u = 0; u < V; u++) {
                even[u] = fmaf(dj.x, w0[u], even[u]);
                odd[u] = fmaf(dj.y, w1[u], odd[u]);
                even[u] = fmaf(dj.z, w2[u], even[u]);
                odd[u] = fmaf(dj.w, w3[u], odd[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < V; u++) {
            int c = c0 + u;
            if (c >= k0) break;
            float v = even[u] + odd[u];
            dx[c] = zs0 ? v * act_derivative(act, slope, zs0[c], xs0[c]) : v;
        }
    }
}

// The input gradient for columns c < k of W (n rows of stride ws in shared memory) from the
// sample's dz (d, n values): dx_c = Σ_j d_j · W[j][c], times act'(zs[c], xs[c]) of the layer that
// made the inputs when zs is given, into dx (the sample's row) and, when keep is given, into
// keep; two columns at a time (c0 and c0 + cs), then c0 + step and c0 + step + cs, …; each summed
// over even and odd j apart, then added: four sums that do not wait on one another.
__device__ __forceinline__ void head_back(const float* d, const float* wsm, int ws, int n, int k, const float* zs, const float* xs,
                                          int act, float slope, float* dx, float* keep, int c0, int cs, int step) {
    for (; c0 < k; c0 += step) {
        int c[2] = {c0, min(c0 + cs, k - 1)};
        float even[2] = {0.0f, 0.0f}, odd[2] = {0.0f, 0.0f};
        int j = 0;
#pragma unroll 4
        for (; j + 1 < n; j += 2) {
            float d0 = d[j], d1 = d[j + 1];
#pragma unroll
            for (int q = 0; q < 2; q++) {
                even[q] = fmaf(d0, wsm[j * ws + c[q]], even[q]);
                odd[q] = fmaf(d1, wsm[(j + 1) * ws + c[q]], odd[q]);
            }
        }
#pragma unroll
        for (int q = 0; q < 2; q++) {
            if (c0 + cs * q >= k) break;
            float v = (j < n ? fmaf(d[j], wsm[j * ws + c[q]], even[q]) : even[q]) + odd[q];
            if (zs) v *= act_derivative(act, slope, zs[c[q]], xs[c[q]]);
            dx[c[q]] = v;
            if (keep) keep[c[q]] = v;
        }
    }
}

// A lane's share of the last layer: `parts` lanes share an output (32 over n rounded up to a
// power of two); each sums every parts-th value of k, then the group adds its sums by shuffles,
// so every lane of the group ends with the same bits; lane jl·parts + part, its output jl (out:
// jl < n; leader: the group's first lane), wj its row of W. The same for every sample.
struct HeadLane {
    int parts, jl, part;
    bool out, leader;
    const float* wj;
};

__device__ __forceinline__ HeadLane head_lane(const float* wsm, int ws, int n, int lane) {
    HeadLane l;
    l.parts = 32;
    while (l.parts > 1 && l.parts * n > 32) l.parts /= 2;
    l.jl = lane / l.parts, l.part = lane % l.parts;
    l.out = l.jl < n, l.leader = l.out && l.part == 0;
    l.wj = wsm + (l.out ? l.jl : 0) * ws;
    return l;
}

// The last layer and the loss for sample s from its inputs xs (the lane's share `l`): z_j =
// Σ_c x_c · W[j][c] + b_j, y_j, the loss gradient and dz_j into dz_row; with `writes`, z, y, dy
// and dz into the plan's regions. Returns the lane's share of the sample's loss term (lane 0's
// for cross-entropy, the group leaders' for MSE).
__device__ __forceinline__ double head_last(const HeadLane& l, const float* xs, const float* bsm, int k, int n, int act, float slope,
                                            int xent, const unsigned* labels, const float* targets, float grad_scale, float* acts,
                                            float* dacts, int z, int y, int s, float* dz_row, bool writes, int lane) {
    int parts = l.parts, jl = l.jl, part = l.part;
    bool out = l.out, leader = l.leader;
    const float* wj = l.wj;
    float sum = strided_dot(xs, wj, out ? part : k, parts, k);
    for (int d = parts / 2; d > 0; d /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);
    float zj = sum + bsm[out ? jl : 0];
    float yj = act != ACT_IDENTITY ? act_apply(act, slope, zj) : zj;
    long long o = (long long)s * n + jl;
    if (leader && writes) {
        acts[z + o] = zj;
        if (act != ACT_IDENTITY) acts[y + o] = yj;
    }
    // the loss gradient dy_j, and the loss's term (lane 0 for cross-entropy: one a sample)
    float dyj;
    double term = 0.0;
    if (xent) {
        // as softmax_xent in loss.cu, the sums over classes by shuffles (lanes past n count as −∞
        // in the max, and only a group's first lane in the sum)
        float max = out ? yj : __int_as_float(0xff800000);
        for (int d = 16; d > 0; d /= 2) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, d));
        float e = out ? expf(yj - max) : 0.0f, denom = leader ? e : 0.0f;
        for (int d = 16; d > 0; d /= 2) denom += __shfl_xor_sync(0xffffffffu, denom, d);
        unsigned label = labels[s];
        float picked = __shfl_sync(0xffffffffu, yj, label < (unsigned)n ? label * parts : 0);
        dyj = e * (1.0f / denom) * grad_scale;
        if (jl == (int)label) dyj = dyj - grad_scale;
        if (lane == 0) term = label < (unsigned)n ? (double)(max + logf(denom) - picked) : __longlong_as_double(0x7ff8000000000000LL);
    } else {
        // as mse in loss.cu
        float d = leader ? yj - targets[o] : 0.0f;
        term = (double)d * (double)d;
        dyj = grad_scale * d;
    }
    float dzj = act != ACT_IDENTITY ? dyj * act_derivative(act, slope, zj, yj) : dyj;
    if (leader) {
        if (writes) {
            if (act != ACT_IDENTITY) dacts[y + o] = dyj;
            dacts[z + o] = dzj;
        }
        dz_row[jl] = dzj;
    }
    return term;
}

// A unit's barrier: a warp's (U = 1), or a named barrier (1 + the unit) of its U = 2 warps
template <int U>
__device__ __forceinline__ void head_unit_sync(int unit) {
    if constexpr (U == 1) {
        __syncwarp();
    } else {
        asm volatile("bar.sync %0, %1;" ::"r"(1 + unit), "n"(32 * U) : "memory");
    }
}

// `weights_early`: the kernel ahead in the stream writes no weights (it is a layer's forward, or
// the copy of the inputs), so W and b (and W0, b0) are staged before waiting for it. `clear`:
// clear_len gradients set to zero (see src/cuda/head.rs). DEEP: the kernel runs the layer
// before too (dense_head_deep and dense_head_deep2; dense_head is compiled without that code,
// and its k0 is 0). U: warps a sample (a unit); with two (dense_head_deep2),
// twice the warps hide each other's latencies where a batch leaves the GPU's schedulers a warp
// or less each: each computes half the layer before's outputs and half of each input gradient;
// both compute the last layer and the loss (the first alone writes them), between the unit's
// barriers.
#define HEAD_PARAMS                                                                                                              \
    const float *params, float *acts, float *dacts, int k, int n, int act, float slope, int w, int b, int x, int z, int y, int dx, \
        int prev_z, int prev_act, float prev_slope, int k0, int act0, float slope0, int w0, int b0, int x0, int dx0, int prev_z0,  \
        int prev_act0, float prev_slope0, int xent, const unsigned *labels, const float *targets, double *partials,              \
        float grad_scale, int batch, float *clear, int clear_len, int weights_early
#define HEAD_ARGS                                                                                                                  \
    params, acts, dacts, k, n, act, slope, w, b, x, z, y, dx, prev_z, prev_act, prev_slope, k0, act0, slope0, w0, b0, x0, dx0, prev_z0, \
        prev_act0, prev_slope0, xent, labels, targets, partials, grad_scale, batch, clear, clear_len, weights_early
template <bool DEEP, int U>
__device__ __forceinline__ void dense_head_impl(HEAD_PARAMS) {
    extern __shared__ __align__(16) float head_smem[];
    __shared__ float dzs[HEAD_WARPS][HEAD_MAX_OUTPUTS];
    if (!weights_early) after_prior();
    // with the layer before: W0 (head_stage_inner) and b0 (kp), then W (n rows of `ws`) and b,
    // then the units' rows (see `row` below), every region 16-byte aligned
    constexpr bool deep = DEEP;
    static_assert(U == 1 || (DEEP && U == 2), "a warp a sample, or two with the layer before");
    constexpr int UNITS = HEAD_WARPS / U;
    int ws = head_stride(k), kp = head_pad4(k), k0p = head_pad4(k0);
    float* w0sm = head_smem;
    float* b0sm = w0sm + (deep ? kp * head_inner_stride(k0) : 0);
    float* wsm = b0sm + (deep ? kp : 0);
    float* bsm = wsm + n * ws;
    float* rows = bsm + head_pad4(n * ws + n) - n * ws;
    int row = kp * (1 + (prev_z >= 0) + deep) + (deep ? k0p * (1 + (prev_z0 >= 0)) : 0);
    if (threadIdx.x == 0) {
        unsigned have;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
        // src/cuda/head.rs sizes the launch, and gives a deep head the layer before's z (prev_z)
        // when it has an activation: a mismatch is a bug
        if (4u * (unsigned)(rows - head_smem + UNITS * row) > have || (deep && act0 != ACT_IDENTITY && prev_z < 0)) asm volatile("trap;");
    }
    head_stage(wsm, bsm, params + w, params + b, n, k);
    if (deep) head_stage_inner(w0sm, b0sm, params + w0, params + b0, k, k0);
    // gradients that weight gradients split over two blocks add into, cleared (nothing before
    // this kernel in the step touches them)
    GRID_STRIDE(i, clear_len) clear[i] = 0.0f;
    if (weights_early) after_prior();
    // warp h of unit `unit`; t: the thread's place in its unit
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, unit = warp / U, h = warp % U, t = h * 32 + lane;
    // the unit's rows: the layer's inputs, the producer's z when its derivative is folded in,
    // and with the layer before: the input gradient (that layer's dz), that layer's inputs and
    // the z of the layer that made them when its derivative is folded in; rows of kp and k0p
    // values, whose pads (read by the vector loops) are zero
    float* xs = rows + unit * row;
    float* zs = prev_z >= 0 ? xs + kp : nullptr;
    float* ds = deep ? xs + kp * (1 + (prev_z >= 0)) : nullptr;
    float* xs0 = deep ? ds + kp : nullptr;
    float* zs0 = deep && prev_z0 >= 0 ? xs0 + k0p : nullptr;
    if (deep) {
        for (int c = k + t; c < kp; c += 32 * U) ds[c] = 0.0f;
        for (int c = k0 + t; c < k0p; c += 32 * U) xs0[c] = 0.0f;
    }
    head_copied();
    __syncthreads();
    double acc = 0.0;
    HeadLane hl = head_lane(wsm, ws, n, lane);
    // samples b + G·u, b + G·(u + UNITS), … for unit u of block b of G (deep), else b·UNITS + u, …
    int first = deep ? blockIdx.x + gridDim.x * unit : blockIdx.x * UNITS + unit;
    for (int s = first; s < batch; s += gridDim.x * UNITS) {
        if (deep) {
            for (int c = t; c < k0; c += 32 * U) {
                head_copy(xs0 + c, acts + x0 + (long long)s * k0 + c);
                if (zs0) head_copy(zs0 + c, acts + prev_z0 + (long long)s * k0 + c);
            }
        } else {
            for (int c = lane; c < k; c += 32) {
                head_copy(xs + c, acts + x + (long long)s * k + c);
                if (zs) head_copy(zs + c, acts + prev_z + (long long)s * k + c);
            }
        }
        head_copied();
        head_unit_sync<U>(unit);
        if (deep) {
            // the layer before: its z_j and y_j, 64 outputs a unit at a time (two a lane of a
            // warp, j and j + 32; one a thread of two warps), into the layer's inputs (and the
            // producer's z)
            constexpr int Q = 2 / U;
            for (int j0 = t; j0 - t < k; j0 += 64) {
                float z0[Q];
                head_inner_forward<Q>(xs0, w0sm, b0sm, k, k0, j0, z0);
#pragma unroll
                for (int q = 0; q < Q; q++) {
                    int j = j0 + 32 * q;
                    if (j >= k) continue;
                    float zj = z0[q], yj = zs ? act_apply(act0, slope0, zj) : zj;
                    long long o = (long long)s * k + j;
                    if (zs) {
                        acts[prev_z + o] = zj;
                        zs[j] = zj;
                    }
                    acts[x + o] = yj;
                    xs[j] = yj;
                }
            }
            head_unit_sync<U>(unit);
        }
        // the last layer and the loss, by every warp of the unit (the first writes them)
        double term = head_last(hl, xs, bsm, k, n, act, slope, xent, labels, targets, grad_scale, acts, dacts, z, y, s, dzs[warp], h == 0,
                                lane);
        if (h == 0) acc += term;
        __syncwarp();
        // the input gradient: dx_c = Σ_j dz_j · W[j][c], times the producer's act' (kept for
        // the layer before's input gradient), the unit's threads taking its columns in turn
        if (dx >= 0) {
            head_back(dzs[warp], wsm, ws, n, k, zs, xs, prev_act, prev_slope, dacts + dx + (long long)s * k, ds, t, 32 * U, 64 * U);
        }
        if (deep && dx0 >= 0) {
            head_unit_sync<U>(unit);
            // 128 columns a unit at a time: four consecutive a lane of a warp, two a thread of two
            constexpr int V = 4 / U;
            head_inner_back<V>(ds, w0sm, k, k0, zs0, xs0, prev_act0, prev_slope0, dacts + dx0 + (long long)s * k0, V * t, 128);
        }
        // the next sample's inputs overwrite the rows, and its dz dzs
        head_unit_sync<U>(unit);
    }
    // the unit's loss terms (lane 0's of its first warp for cross-entropy, the leaders' for
    // MSE), by shuffles in a fixed order; lane 0's sum is the unit's partial
    for (int d = 16; d > 0; d /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, d);
    if (lane == 0 && h == 0) partials[blockIdx.x * UNITS + unit] = acc;
}

extern "C" __global__ __launch_bounds__(REDUCE_THREADS) void dense_head(HEAD_PARAMS) {
    dense_head_impl<false, 1>(HEAD_ARGS);
}

// (a bound of one block an SM: without it ptxas kept dense_head_deep to 80 registers and spilled)
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 1) void dense_head_deep(HEAD_PARAMS) {
    dense_head_impl<true, 1>(HEAD_ARGS);
}

extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 1) void dense_head_deep2(HEAD_PARAMS) {
    dense_head_impl<true, 2>(HEAD_ARGS);
}
