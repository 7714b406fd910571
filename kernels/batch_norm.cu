// Batch norm (src/layers/batch_norm.rs): `batch` samples of `channels × pixels` values; per
// channel c its n = batch·pixels values. Sums in f64, a block per channel: each thread's strided
// share in order, then block_sum_f64's fixed tree, so a result never depends on timing. The
// element-wise kernels evaluate the CPU's expressions in its order (--fmad=false), so where they
// read the same statistics they give its bits.

// Index of value j (0 ≤ j < n) of channel c: sample j / pixels, pixel j % pixels.
__device__ __forceinline__ long long batch_norm_at(int j, int c, int channels, int pixels) {
    int s = j / pixels, p = j - s * pixels;
    return ((long long)s * channels + c) * pixels + p;
}

// mean[c] = μ and inv[c] = 1/√(σ² + eps) of each channel (σ² biased); the running mean and
// variance (unbiased: Σ(x − μ)²/(n − 1)) moved by `momentum`; count[0] += 1 (channel 0's
// block). Grid: one block per channel.
extern "C" __global__ void batch_norm_stats(const float* x, float* mean, float* inv, float* running_mean, float* running_var,
                                            float* count, int channels, int pixels, int batch, float momentum, float eps) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    int n = batch * pixels;
    double sum = 0.0;
    for (int j = threadIdx.x; j < n; j += REDUCE_THREADS) sum += (double)x[batch_norm_at(j, c, channels, pixels)];
    double mu = block_sum_f64(sum, buf) / (double)n;
    double squares = 0.0;
    for (int j = threadIdx.x; j < n; j += REDUCE_THREADS) {
        double d = (double)x[batch_norm_at(j, c, channels, pixels)] - mu;
        squares += d * d;
    }
    squares = block_sum_f64(squares, buf);
    if (threadIdx.x == 0) {
        float m = (float)mu;
        float var = (float)(squares / (double)n);
        mean[c] = m;
        inv[c] = 1.0f / sqrtf(var + eps);
        running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * m;
        running_var[c] = (1.0f - momentum) * running_var[c] + momentum * (float)(squares / (double)(n - 1));
        if (c == 0) count[0] += 1.0f;
    }
}

// z = ((x − μ)·r)·γ + β over n = batch·channels·pixels values, (μ, r) = (mean[c], inv[c]); with
// `from_running`, `inv` holds the running variance and r = 1/√(inv[c] + eps). Then y = act(z)
// unless y is null (an identity, whose z is its y).
extern "C" __global__ void batch_norm_apply(const float* x, float* z, float* y, const float* mean, const float* inv, const float* gamma,
                                            const float* beta, int act, float slope, int channels, int pixels, int n, float eps,
                                            int from_running) {
    after_prior();
    GRID_STRIDE(i, n) {
        int c = (i / pixels) % channels;
        float r = from_running ? 1.0f / sqrtf(inv[c] + eps) : inv[c];
        float v = (x[i] - mean[c]) * r * gamma[c] + beta[c];
        z[i] = v;
        if (y != nullptr) y[i] = act_apply(act, slope, v);
    }
}

// dgamma[c] = Σ dy·x̂ and dbeta[c] = Σ dy over channel c, x̂ = (x − mean[c])·inv[c]; overwritten
// (dy: the gradient of z, the normalised values before an activation).
// Grid: one block per channel.
extern "C" __global__ void batch_norm_param_grads(const float* x, const float* dy, const float* mean, const float* inv, float* dgamma,
                                                  float* dbeta, int channels, int pixels, int batch) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    int n = batch * pixels;
    float m = mean[c], r = inv[c];
    double sum = 0.0, sum_xhat = 0.0;
    for (int j = threadIdx.x; j < n; j += REDUCE_THREADS) {
        long long i = batch_norm_at(j, c, channels, pixels);
        double d = (double)dy[i];
        sum += d;
        sum_xhat += d * (double)((x[i] - m) * r);
    }
    sum = block_sum_f64(sum, buf);
    sum_xhat = block_sum_f64(sum_xhat, buf);
    if (threadIdx.x == 0) {
        dgamma[c] = (float)sum_xhat;
        dbeta[c] = (float)sum;
    }
}

// dx = (γ·r)·(dy − (dβ + x̂·dγ)·(1/count)) over n values, overwritten; dγ and dβ from
// batch_norm_param_grads, `inv_count` = 1/(batch·pixels) rounded to f32.
extern "C" __global__ void batch_norm_input_grad(const float* x, const float* dy, float* dx, const float* mean, const float* inv,
                                                 const float* gamma, const float* dgamma, const float* dbeta, int channels, int pixels,
                                                 int n, float inv_count) {
    after_prior();
    GRID_STRIDE(i, n) {
        int c = (i / pixels) % channels;
        float r = inv[c];
        dx[i] = gamma[c] * r * (dy[i] - (dbeta[c] + (x[i] - mean[c]) * r * dgamma[c]) * inv_count);
    }
}
