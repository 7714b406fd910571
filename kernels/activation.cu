// Bias and activation (src/activation.rs, src/layers/mod.rs). Activation ids, as
// act_code() in src/cuda/ops.rs: 0 identity, 1 relu, 2 leaky_relu(slope), 3 tanh, 4 sigmoid,
// 5 gelu. GELU uses the same erf fit as the CPU (Numerical Recipes, |error| < 1.2e-7), so the
// two agree to rounding rather than to the fit's error.

__device__ __forceinline__ float nr_erf(float x) {
    float z = x < 0.0f ? -x : x;
    float t = 1.0f / (1.0f + 0.5f * z);
    float poly = -1.26551223f
        + t * (1.00002368f
        + t * (0.37409196f
        + t * (0.09678418f
        + t * (-0.18628806f
        + t * (0.27886807f
        + t * (-1.13520398f
        + t * (1.48851587f
        + t * (-0.82215223f
        + t * 0.17087277f))))))));
    float erfc = t * expf(-(z * z) + poly);
    float r = 1.0f - erfc;
    return x < 0.0f ? -r : r;
}

// Φ(z) = (1 + erf(z/√2)) / 2
__device__ __forceinline__ float normal_cdf(float z) {
    return 0.5f * (1.0f + nr_erf(z * 0.70710678118654752f));
}

__device__ __forceinline__ float act_apply(int act, float slope, float z) {
    switch (act) {
        case 1: return fmaxf(z, 0.0f);
        case 2: return z > 0.0f ? z : slope * z;
        case 3: return tanhf(z);
        case 4: return 1.0f / (1.0f + expf(-z));
        case 5: return z * normal_cdf(z);
        default: return z;
    }
}

// d act / dz at z, given y = act(z)
__device__ __forceinline__ float act_derivative(int act, float slope, float z, float y) {
    switch (act) {
        case 1: return z > 0.0f ? 1.0f : 0.0f;
        case 2: return z > 0.0f ? 1.0f : slope;
        case 3: return 1.0f - y * y;
        case 4: return y * (1.0f - y);
        case 5: return normal_cdf(z) + z * 0.3989422804014327f * expf(-(z * z) * 0.5f);
        default: return 1.0f;
    }
}

// z[s, c, p] += bias[c] over n = batch·channels·pixels values; then y = act(z) unless y is
// null (an identity layer, whose z is its output).
extern "C" __global__ void bias_act_forward(float* z, float* y, const float* bias, int act, float slope, int channels, int pixels,
                                            int n) {
    after_prior();
    GRID_STRIDE(i, n) {
        float v = z[i] + bias[(i / pixels) % channels];
        z[i] = v;
        if (y != nullptr) y[i] = act_apply(act, slope, v);
    }
}

// dz = dy ⊙ act'(z), element-wise over n values.
extern "C" __global__ void act_backward(const float* z, const float* y, const float* dy, float* dz, int act, float slope, int n) {
    after_prior();
    GRID_STRIDE(i, n) {
        dz[i] = dy[i] * act_derivative(act, slope, z[i], y[i]);
    }
}

// db[c] = Σ_{s,p} dz[s, c, p]. One block per channel (grid = channels, REDUCE_THREADS
// threads); thread t sums its strided share in order, then a fixed tree: deterministic.
extern "C" __global__ void bias_grad(const float* dz, float* db, int channels, int pixels, int batch) {
    after_prior();
    __shared__ float buf[REDUCE_THREADS];
    int c = blockIdx.x;
    int per_channel = batch * pixels;
    float acc = 0.0f;
    for (int j = threadIdx.x; j < per_channel; j += REDUCE_THREADS) {
        int s = j / pixels, p = j - s * pixels;
        acc += dz[(s * channels + c) * pixels + p];
    }
    float sum = block_sum_f32(acc, buf);
    if (threadIdx.x == 0) db[c] = sum;
}
