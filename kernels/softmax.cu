// Softmax over rows of n values (src/layers/softmax.rs), a warp a row (rows = the batch): each
// lane takes the values l, l + 32, … in order, and the lanes' results are combined in a fixed
// tree, so every run gives the same bits.

// The maximum of v over the warp, in every lane.
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// The sum of v over the warp, in every lane (a butterfly: the same tree in every lane).
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// y = e^(x − max) / Σ e^(x − max), row by row.
extern "C" __global__ void softmax_forward(const float* x, float* y, int n, int rows) {
    after_prior();
    int lane = threadIdx.x & 31;
    int warps = (blockDim.x * gridDim.x) >> 5;
    // the row is the same for every lane of a warp, so whole warps take the loop and shuffles
    for (int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps) {
        const float* xs = x + (long long)row * n;
        float* ys = y + (long long)row * n;
        float max = xs[0];
        for (int j = lane; j < n; j += 32) max = fmaxf(max, xs[j]);
        max = warp_max(max);
        float sum = 0.0f;
        for (int j = lane; j < n; j += 32) {
            float e = expf(xs[j] - max);
            ys[j] = e;
            sum += e;
        }
        float inv = 1.0f / warp_sum(sum);
        // each lane scales the values it wrote
        for (int j = lane; j < n; j += 32) ys[j] *= inv;
    }
}

// dx = y ⊙ (dy − Σ dy·y), row by row, overwritten.
extern "C" __global__ void softmax_backward(const float* y, const float* dy, float* dx, int n, int rows) {
    after_prior();
    int lane = threadIdx.x & 31;
    int warps = (blockDim.x * gridDim.x) >> 5;
    for (int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps) {
        const float* ys = y + (long long)row * n;
        const float* dys = dy + (long long)row * n;
        float dot = 0.0f;
        for (int j = lane; j < n; j += 32) dot += dys[j] * ys[j];
        dot = warp_sum(dot);
        for (int j = lane; j < n; j += 32) dx[(long long)row * n + j] = ys[j] * (dys[j] - dot);
    }
}
