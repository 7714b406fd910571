// Shared by every kernel file; the files are concatenated in the order of SOURCE in
// src/cuda/context.rs and compiled once per device with NVRTC (no headers: built-ins only).
//
// Conventions: f32 data; sizes are `int` (the host refuses lengths of 2^30 or more); flat
// element-wise kernels use grid-stride loops over 256-thread blocks; reductions use a
// fixed-order shared-memory tree in 256-thread blocks, so a result never depends on timing.

#define REDUCE_THREADS 256

// Programmatic dependent launch (sm_90 and later): the host launches every kernel allowed to
// start before the one ahead of it in its stream has finished, so each kernel's first statement
// is after_prior() (the dense products may first read what the kernel ahead does not write,
// such as a layer's weights: b_early in dense.cu). It waits until the kernels it depends on have
// finished and their writes are visible (they did the same, so all earlier work is done too),
// then lets the next kernel start launching: its blocks get ready while this one runs, instead
// of after it. Before sm_90 (and for kernels launched without the attribute) the stream already
// orders them; both are no-ops.
//
// With `launch_next` false the kernel lets the next one start launching later, itself
// (next_may_launch), where the next kernel's blocks, resident early, would take the room its own
// later blocks need.
__device__ __forceinline__ void next_may_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void after_prior(bool launch_next = true) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (launch_next) next_may_launch();
}

// Clusters of blocks (sm_90 and later; launched with a cluster size, or declared with
// __cluster_dims__). Before sm_90 a block is its own cluster: rank 0 of 1, the barrier the
// block's, and a remote load a load of the block's own shared memory.
__device__ __forceinline__ int cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return (int)r;
}

__device__ __forceinline__ int cluster_blocks() {
    unsigned n = 1;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return (int)n;
}

// The cluster's barrier: every block's shared memory writes before it are visible to every
// block after it. cluster_arrive and cluster_wait are its two halves: a block that has read the
// others' shared memory for the last time arrives, goes on with work of its own, and waits
// before it exits (a block's shared memory must outlive the others' reads of it).
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The shared-memory address `at` of this block's in block `rank` of the cluster (before sm_90,
// `at` itself: the block is its cluster).
__device__ __forceinline__ unsigned cluster_map(unsigned at, unsigned rank) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(at) : "r"(at), "r"(rank));
#endif
    return at;
}

// The float at this block's shared address `at` in block `rank` of the cluster
__device__ __forceinline__ float cluster_load(unsigned at, unsigned rank) {
    float v;
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_map(at, rank)) : "memory");
#else
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(at) : "memory");
#endif
    return v;
}

// The double at `local` (this block's shared memory) in block `rank` of the cluster
__device__ __forceinline__ double cluster_load_f64(const double* local, unsigned rank) {
#if __CUDA_ARCH__ >= 900
    double v;
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(cluster_map((unsigned)__cvta_generic_to_shared(local), rank)) : "memory");
    return v;
#else
    return *local;
#endif
}

// Sets the float at `local` (this block's shared memory) in block `rank` of the cluster to v.
__device__ __forceinline__ void cluster_store(float* local, unsigned rank, float v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(cluster_map((unsigned)__cvta_generic_to_shared(local), rank)), "f"(v) : "memory");
#else
    *local = v;
#endif
}

// 1 / (1 + e^−v) on the SFU's exp2 and reciprocal, the recurrent cells' gates (gru.cu, lstm.cu,
// rnn_fused.cu): the bits of __fdividef(1, 1 + __expf(−v)) (the exp within 2 + ⌊1.17·|v|⌋ ulp, the
// reciprocal 2 ulp; 0 past a denominator of 2^126, where the sigmoid is below 1.2e-38), without
// the checks those make for subnormals, which sit on a cell's critical path: an exp below 2^−126
// adds nothing to 1, and the denominator is never below 1.
__device__ __forceinline__ float rnn_sigmoid(float v) {
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * -1.44269504f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
    return r;
}

// Σ of v over the block, in a fixed order; every thread gets the sum. buf: REDUCE_THREADS slots.
__device__ __forceinline__ float block_sum_f32(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int half = REDUCE_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) buf[threadIdx.x] += buf[threadIdx.x + half];
        __syncthreads();
    }
    float sum = buf[0];
    __syncthreads();
    return sum;
}

__device__ __forceinline__ double block_sum_f64(double v, double* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int half = REDUCE_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) buf[threadIdx.x] += buf[threadIdx.x + half];
        __syncthreads();
    }
    double sum = buf[0];
    __syncthreads();
    return sum;
}

// Σ a[i]·b[i] over i = first, first + step, … < len, in four sums that take turns (so that the
// adds do not wait on one another), added as (s0 + s1) + (s2 + s3): a fixed order. A `first` of
// len or more gives 0.
__device__ __forceinline__ float strided_dot(const float* a, const float* b, int first, int step, int len) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int i = first;
    for (; i + 3 * step < len; i += 4 * step) {
        s0 = fmaf(a[i], b[i], s0);
        s1 = fmaf(a[i + step], b[i + step], s1);
        s2 = fmaf(a[i + 2 * step], b[i + 2 * step], s2);
        s3 = fmaf(a[i + 3 * step], b[i + 3 * step], s3);
    }
    for (; i < len; i += step) s0 = fmaf(a[i], b[i], s0);
    return (s0 + s1) + (s2 + s3);
}

#define GRID_STRIDE(i, n) for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += blockDim.x * gridDim.x)
