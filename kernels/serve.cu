// A resident forward pass (src/cuda/serve.rs): one launch answers many calls. Each block takes
// `rows` samples through every dense layer of a small model, with the model's weights (and the
// layer table) copied into its shared memory once at launch and the activations kept there, so
// a call costs the host's doorbell, block 0 passing it on, one round of loads of the inputs,
// arithmetic from shared memory, and the outputs written to the host: no launch, no kernel
// boundary, and no block waiting on another's results.
//
// The host rings `bell` (page-locked, mapped): its first 64 bits hold the call's number (low 32
// bits), its samples (bits 32-62) and whether its inputs are new (bit 63: in `host_in`; else
// those of the last call with new ones, kept in `dev_in`). Block 0 polls that word and passes it
// on in `go` (device memory), which the other blocks poll. Each block writes its samples'
// outputs to `host_out` and counts itself in `count`; the last one writes the call's number to
// `done`, which the host spins on. A nonzero bell word SERVE_STOP ends the kernel, and so does
// `idle_ns` without a call once every block has finished the last one (block 0 passes
// SERVE_LEAVE on, and every block leaves).
//
// The layer table holds SERVE_FIELDS ints a layer: inputs, outputs, activation, its slope's
// bits, the weights' offset in `params` (outputs × inputs, row-major) and the bias's. In shared
// memory each weight row is padded to an odd stride, so that threads reading one value of
// consecutive rows hit distinct banks.

#define SERVE_STOP 2
#define SERVE_FIELDS 6
// dense layers the kernel takes (its table lives in shared memory)
#define SERVE_MAX_LAYERS 32
// what block 0 passes on for "leave" (the host never numbers a call so)
#define SERVE_LEAVE 0xFFFFFFFFull

__device__ __forceinline__ unsigned long long serve_clock() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Orders this thread's memory operations before and after it for the whole system (the host
// included): with a write after it, the release of what came before; with a read before it, the
// acquire of what the writer released.
__device__ __forceinline__ void serve_fence() {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ __forceinline__ int serve_stride(int in) {
    return in | 1;
}

// out[r·n + j] = act(b[j] + Σ_k w[j·stride + k] · x[r·in + k]) for the block's `rows` rows, and
// the same into `host` when given. `lanes` threads share an output (a power of two up to 32, so
// that few outputs still use the block): each sums every lanes-th k, then the group adds its sums
// by shuffles, in a fixed order. Every thread goes through the same passes (shuffles need whole
// warps).
__device__ __forceinline__ void serve_layer(const float* w, const float* b, int stride, const float* x, int in, int n, int rows,
                                            int act, float slope, float* out, float* host) {
    int lanes = 1;
    while (lanes < 32 && rows * n * lanes * 2 <= REDUCE_THREADS && lanes * 8 < in) lanes *= 2;
    int per_pass = REDUCE_THREADS / lanes, lane = threadIdx.x % lanes;
    for (int base = 0; base < rows * n; base += per_pass) {
        int o = base + threadIdx.x / lanes;
        bool live = o < rows * n;
        int r = live ? o / n : 0, j = live ? o - r * n : 0;
        const float* wj = w + j * stride;
        const float* xr = x + r * in;
        // the lane's share of k
        float s = strided_dot(wj, xr, live ? lane : in, lanes, in);
        for (int d = lanes / 2; d > 0; d /= 2) s += __shfl_xor_sync(0xffffffffu, s, d, lanes);
        if (live && lane == 0) {
            float y = act_apply(act, slope, s + b[j]);
            out[o] = y;
            if (host != nullptr) host[o] = y;
        }
    }
}

// Launched alone on the server's stream, not as a dependent, so its after_prior() (which every
// kernel begins with) does nothing.
extern "C" __global__ __launch_bounds__(REDUCE_THREADS) void serve_dense(const float* params, const int* table, int layers, int rows,
                                                                         int width, const unsigned* bell, unsigned long long* go, unsigned* done,
                                                                         const float* host_in, float* dev_in, float* host_out,
                                                                         unsigned last, unsigned long long idle_ns, unsigned* count) {
    after_prior();
    extern __shared__ float smem[];
    __shared__ unsigned call[3];
    __shared__ int tab[SERVE_MAX_LAYERS * SERVE_FIELDS];
    for (int i = threadIdx.x; i < layers * SERVE_FIELDS; i += blockDim.x) tab[i] = table[i];
    __syncthreads();
    table = tab;
    // the weights, padded, then each layer's bias, then two buffers of rows × width activations
    float* at = smem;
    for (int l = 0; l < layers; l++) {
        const int* t = table + l * SERVE_FIELDS;
        int in = t[0], n = t[1], stride = serve_stride(in);
        for (int i = threadIdx.x; i < n * in; i += blockDim.x) at[(i / in) * stride + i % in] = params[t[4] + i];
        at += n * stride;
        for (int j = threadIdx.x; j < n; j += blockDim.x) at[j] = params[t[5] + j];
        at += n;
    }
    // aligned to 16 bytes for the loads of 4 inputs at a time
    at = smem + ((at - smem + 3) & ~3);
    float *even = at, *odd = at + rows * width;
    int in0 = table[0], outputs = table[(layers - 1) * SERVE_FIELDS + 1];
    int r0 = blockIdx.x * rows;
    unsigned long long since = serve_clock();
    // calls answered since the launch; `count` counts the blocks' answers
    unsigned calls = 0;
    for (;;) {
        // Block 0 polls the doorbell over the bus and passes each call on through device memory;
        // the others poll that. (Every block polling the host's memory made each call many times
        // slower.) Both words are 64 bits: the call's number, its samples
        // and whether its inputs are new, read in one go.
        if (threadIdx.x == 0) {
            unsigned long long d;
            if (blockIdx.x == 0) {
                for (unsigned spins = 0;; spins++) {
                    d = *(const volatile unsigned long long*)bell;
                    if ((unsigned)d != last) break;
                    // leave when told to, or when idle, but only once every block has
                    // finished the last call (one not yet on the GPU, behind other work, would
                    // otherwise miss it)
                    if (spins % 64 == 63 &&
                        (((const volatile unsigned*)bell)[SERVE_STOP] != 0 ||
                         (serve_clock() - since > idle_ns && *(const volatile unsigned*)count == calls * gridDim.x))) {
                        d = SERVE_LEAVE;
                        break;
                    }
                }
                // new inputs: this fence acquires what the host wrote before the doorbell and
                // releases it to the blocks that read `go` (their fence below acquires it)
                if (d >> 63) serve_fence();
                atomicExch(go, d);
            } else {
                do {
                    d = *(const volatile unsigned long long*)go;
                } while ((unsigned)d == last);
                if (d >> 63) serve_fence();
            }
            call[0] = (unsigned)d;
            call[1] = (unsigned)(d >> 32) & 0x7FFFFFFFu;
            call[2] = (unsigned)(d >> 63);
        }
        __syncthreads();
        unsigned seq = call[0];
        int samples = (int)call[1], fresh = (int)call[2];
        __syncthreads();
        if (seq == SERVE_LEAVE) return;
        int mine = min(rows, samples - r0);
        if (mine > 0) {
            // inputs: new ones from the host (read past the caches, which may hold the last
            // call's; 16 bytes a load where rows allow, as fewer requests cross the bus), kept
            // for the calls that reuse them
            long long at = (long long)r0 * in0;
            int values = mine * in0;
            if (fresh && in0 % 4 == 0) {
                for (int i = threadIdx.x; i < values / 4; i += blockDim.x) {
                    float4 v = __ldcv((const float4*)(host_in + at) + i);
                    ((float4*)(dev_in + at))[i] = v;
                    ((float4*)even)[i] = v;
                }
            } else {
                for (int i = threadIdx.x; i < values; i += blockDim.x) {
                    float v = fresh ? __ldcv(host_in + at + i) : dev_in[at + i];
                    if (fresh) dev_in[at + i] = v;
                    even[i] = v;
                }
            }
            __syncthreads();
            const float* w = smem;
            for (int l = 0; l < layers; l++) {
                const int* t = table + l * SERVE_FIELDS;
                int in = t[0], n = t[1], stride = serve_stride(in);
                bool top = l == layers - 1;
                serve_layer(w, w + n * stride, stride, l % 2 ? odd : even, in, n, mine, t[2], __int_as_float(t[3]), l % 2 ? even : odd,
                            top ? host_out + (long long)r0 * outputs : nullptr);
                w += n * stride + n;
                __syncthreads();
            }
        }
        // the barrier above ordered every thread's outputs before thread 0's fence, which (being
        // cumulative) orders them, for the whole system, before the answer
        calls++;
        if (threadIdx.x == 0) {
            serve_fence();
            if (atomicAdd(count, 1u) + 1 == calls * gridDim.x) {
                // the last block to finish this call: every other block's fence and count came
                // before its own, and this fence orders them before the answer
                serve_fence();
                *(volatile unsigned*)done = seq;
            }
        }
        last = seq;
        since = serve_clock();
    }
}
