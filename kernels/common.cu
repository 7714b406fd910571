// Shared by every kernel file; the files are concatenated in the order of SOURCE in
// src/cuda/context.rs and compiled once per device with NVRTC (no headers: built-ins only).
//
// Conventions: f32 data; sizes are `int` (the host refuses lengths of 2^30 or more); flat
// element-wise kernels use grid-stride loops over 256-thread blocks; reductions use a
// fixed-order shared-memory tree in 256-thread blocks, so a result never depends on timing.

#define REDUCE_THREADS 256

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

#define GRID_STRIDE(i, n) for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += blockDim.x * gridDim.x)
