// Batch norm (src/layers/batch_norm.rs): `batch` samples of `channels × pixels` values; per
// channel c its n = batch·pixels values. Sums in f64, a block per channel, or, where that leaves
// the GPU idle (few channels over many values), a block per part of a channel's samples, the
// parts added by a second kernel in order of k: each thread's strided share in order, then
// block_sum_f64's fixed tree, so a result never depends on timing. The element-wise kernels
// evaluate the CPU's expressions in its order (--fmad=false), so where they read the same
// statistics they give its bits.

// Index of value j (0 ≤ j < n) of channel c: sample j / pixels, pixel j % pixels.
__device__ __forceinline__ long long batch_norm_at(int j, int c, int channels, int pixels) {
    int s = j / pixels, p = j - s * pixels;
    return ((long long)s * channels + c) * pixels + p;
}

// The values [first, end) of a channel that part k takes: samples k·chunk .. min(batch,
// (k + 1)·chunk) (the host makes every part hold a sample or more).
__device__ __forceinline__ void batch_norm_part(int k, int chunk, int batch, int pixels, int* first, int* end) {
    int s = min(batch, k * chunk);
    *first = s * pixels;
    *end = min(batch, s + chunk) * pixels;
}

// Block (c, k)'s two sums of part k of channel c into a[k·channels + c] and b[k·channels + c].
__device__ __forceinline__ void batch_norm_put_part(double* a, double* b, double va, double vb, int channels) {
    if (threadIdx.x == 0) {
        long long at = (long long)blockIdx.y * channels + blockIdx.x;
        a[at] = va;
        b[at] = vb;
    }
}

// Σx over values [first, end) of channel c into *sum, and Σ(x − m)² about their mean m into
// *squares (two passes, f64); the block's threads all get both.
__device__ __forceinline__ void batch_norm_moments(const float* x, int c, int channels, int pixels, int first, int end, double* buf,
                                                   double* sum, double* squares) {
    double s = 0.0;
    for (int j = first + threadIdx.x; j < end; j += REDUCE_THREADS) s += (double)x[batch_norm_at(j, c, channels, pixels)];
    s = block_sum_f64(s, buf);
    double m = end > first ? s / (double)(end - first) : 0.0;
    double q = 0.0;
    for (int j = first + threadIdx.x; j < end; j += REDUCE_THREADS) {
        double d = (double)x[batch_norm_at(j, c, channels, pixels)] - m;
        q += d * d;
    }
    *sum = s;
    *squares = block_sum_f64(q, buf);
}

// From channel c's μ and Σ(x − μ)² over its n values: mean[c] = μ and inv[c] = 1/√(σ² + eps)
// (σ² biased); the running mean and variance (unbiased: Σ(x − μ)²/(n − 1)) moved by `momentum`;
// count[0] += 1 (channel 0's).
__device__ __forceinline__ void batch_norm_finish(int c, double mu, double squares, int n, float* mean, float* inv, float* running_mean,
                                                  float* running_var, float* count, float momentum, float eps) {
    float m = (float)mu;
    float var = (float)(squares / (double)n);
    mean[c] = m;
    inv[c] = 1.0f / sqrtf(var + eps);
    running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * m;
    running_var[c] = (1.0f - momentum) * running_var[c] + momentum * (float)(squares / (double)(n - 1));
    if (c == 0) count[0] += 1.0f;
}

// μ and r of each channel and the running statistics (batch_norm_finish). Grid: one block per
// channel.
extern "C" __global__ void batch_norm_stats(const float* x, float* mean, float* inv, float* running_mean, float* running_var,
                                            float* count, int channels, int pixels, int batch, float momentum, float eps) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    int n = batch * pixels;
    double sum, squares;
    batch_norm_moments(x, c, channels, pixels, 0, n, buf, &sum, &squares);
    if (threadIdx.x == 0) batch_norm_finish(c, sum / (double)n, squares, n, mean, inv, running_mean, running_var, count, momentum, eps);
}

// Part k of channel c's statistics (batch_norm_part): sums[k·channels + c] = Σx and
// squares[k·channels + c] = Σ(x − m_k)² about the part's own mean m_k. Grid: (channels, parts).
extern "C" __global__ void batch_norm_stats_split(const float* x, double* sums, double* squares, int channels, int pixels, int batch,
                                                  int chunk) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x, first, end;
    batch_norm_part(blockIdx.y, chunk, batch, pixels, &first, &end);
    double sum, q;
    batch_norm_moments(x, c, channels, pixels, first, end, buf, &sum, &q);
    batch_norm_put_part(sums, squares, sum, q, channels);
}

// batch_norm_stats from the `parts` parts of batch_norm_stats_split: μ = Σ_k sums_k / n and
// Σ(x − μ)² = Σ_k (squares_k + n_k·(m_k − μ)²), m_k = sums_k / n_k (the sum of squares about μ
// is exactly that of the parts about their own means plus their means' about μ: every term ≥ 0,
// nothing cancels). Grid: one block per channel; thread t adds parts t, t + 256, … in order,
// then block_sum_f64's fixed tree, so a result never depends on timing.
extern "C" __global__ void batch_norm_stats_join(const double* sums, const double* squares, float* mean, float* inv, float* running_mean,
                                                 float* running_var, float* count, int channels, int pixels, int batch, int chunk,
                                                 int parts, float momentum, float eps) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    int n = batch * pixels;
    double total = 0.0;
    for (int k = threadIdx.x; k < parts; k += REDUCE_THREADS) total += sums[(long long)k * channels + c];
    double mu = block_sum_f64(total, buf) / (double)n;
    double q = 0.0;
    for (int k = threadIdx.x; k < parts; k += REDUCE_THREADS) {
        int first, end;
        batch_norm_part(k, chunk, batch, pixels, &first, &end);
        if (end == first) continue;
        double nk = (double)(end - first);
        double d = sums[(long long)k * channels + c] / nk - mu;
        q += squares[(long long)k * channels + c] + nk * d * d;
    }
    q = block_sum_f64(q, buf);
    if (threadIdx.x == 0) batch_norm_finish(c, mu, q, n, mean, inv, running_mean, running_var, count, momentum, eps);
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

// Σ dy into *sum and Σ dy·x̂ into *sum_xhat over values [first, end) of channel c, x̂ = (x − m)·r
// (f32, as on the CPU), in f64; the block's threads all get both.
__device__ __forceinline__ void batch_norm_grad_sums(const float* x, const float* dy, float m, float r, int c, int channels, int pixels,
                                                     int first, int end, double* buf, double* sum, double* sum_xhat) {
    double s = 0.0, sx = 0.0;
    for (int j = first + threadIdx.x; j < end; j += REDUCE_THREADS) {
        long long i = batch_norm_at(j, c, channels, pixels);
        double d = (double)dy[i];
        s += d;
        sx += d * (double)((x[i] - m) * r);
    }
    *sum = block_sum_f64(s, buf);
    *sum_xhat = block_sum_f64(sx, buf);
}

// dgamma[c] = Σ dy·x̂ and dbeta[c] = Σ dy over channel c, x̂ = (x − mean[c])·inv[c]; overwritten
// (dy: the gradient of z, the normalised values before an activation).
// Grid: one block per channel.
extern "C" __global__ void batch_norm_param_grads(const float* x, const float* dy, const float* mean, const float* inv, float* dgamma,
                                                  float* dbeta, int channels, int pixels, int batch) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    double sum, sum_xhat;
    batch_norm_grad_sums(x, dy, mean[c], inv[c], c, channels, pixels, 0, batch * pixels, buf, &sum, &sum_xhat);
    if (threadIdx.x == 0) {
        dgamma[c] = (float)sum_xhat;
        dbeta[c] = (float)sum;
    }
}

// Part k of channel c's parameter gradients (batch_norm_part): sums[k·channels + c] = Σ dy and
// sums_xhat[k·channels + c] = Σ dy·x̂. Grid: (channels, parts).
extern "C" __global__ void batch_norm_param_grads_split(const float* x, const float* dy, const float* mean, const float* inv, double* sums,
                                                        double* sums_xhat, int channels, int pixels, int batch, int chunk) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x, first, end;
    batch_norm_part(blockIdx.y, chunk, batch, pixels, &first, &end);
    double sum, sum_xhat;
    batch_norm_grad_sums(x, dy, mean[c], inv[c], c, channels, pixels, first, end, buf, &sum, &sum_xhat);
    batch_norm_put_part(sums, sums_xhat, sum, sum_xhat, channels);
}

// dgamma[c] = Σ_k sums_xhat[k·channels + c] and dbeta[c] = Σ_k sums[k·channels + c] over the
// `parts` parts of batch_norm_param_grads_split; overwritten. Grid: one block per channel,
// summing as batch_norm_stats_join does (a fixed order).
extern "C" __global__ void batch_norm_param_grads_join(const double* sums, const double* sums_xhat, float* dgamma, float* dbeta,
                                                       int channels, int parts) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    double sum = 0.0, sum_xhat = 0.0;
    for (int k = threadIdx.x; k < parts; k += REDUCE_THREADS) {
        sum += sums[(long long)k * channels + c];
        sum_xhat += sums_xhat[(long long)k * channels + c];
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
