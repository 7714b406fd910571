// Layer norm (src/layers/layer_norm.rs): `rows` rows of `features` values. The row kernels take a
// block per row (the grid strides over rows), the parameter gradients a block per feature (the
// grid strides over features); sums in f64, each thread's strided share in order, then
// block_sum_f64's fixed tree. Element-wise expressions are the CPU's, in its order.

// mean[row] = μ, inv[row] = r = 1/√(σ² + eps) (σ² biased), y = ((x − μ)·r)·γ + β.
extern "C" __global__ void layer_norm_forward(const float* x, float* y, float* mean, float* inv, const float* gamma, const float* beta,
                                              int rows, int features, float eps) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        long long at = (long long)row * features;
        double sum = 0.0;
        for (int f = threadIdx.x; f < features; f += REDUCE_THREADS) sum += (double)x[at + f];
        double mu = block_sum_f64(sum, buf) / (double)features;
        double squares = 0.0;
        for (int f = threadIdx.x; f < features; f += REDUCE_THREADS) {
            double d = (double)x[at + f] - mu;
            squares += d * d;
        }
        squares = block_sum_f64(squares, buf);
        float m = (float)mu;
        float r = 1.0f / sqrtf((float)(squares / (double)features) + eps);
        for (int f = threadIdx.x; f < features; f += REDUCE_THREADS) y[at + f] = (x[at + f] - m) * r * gamma[f] + beta[f];
        if (threadIdx.x == 0) {
            mean[row] = m;
            inv[row] = r;
        }
    }
}

// dgamma[f] = Σ_rows dy·x̂ and dbeta[f] = Σ_rows dy, x̂ = (x − mean[row])·inv[row]; overwritten.
extern "C" __global__ void layer_norm_param_grads(const float* x, const float* dy, const float* mean, const float* inv, float* dgamma,
                                                  float* dbeta, int rows, int features) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    for (int f = blockIdx.x; f < features; f += gridDim.x) {
        double dg = 0.0, db = 0.0;
        for (int row = threadIdx.x; row < rows; row += REDUCE_THREADS) {
            long long i = (long long)row * features + f;
            double d = (double)dy[i];
            dg += d * (double)((x[i] - mean[row]) * inv[row]);
            db += d;
        }
        dg = block_sum_f64(dg, buf);
        db = block_sum_f64(db, buf);
        if (threadIdx.x == 0) {
            dgamma[f] = (float)dg;
            dbeta[f] = (float)db;
        }
    }
}

// dx = r·(g − (Σg + x̂·Σg·x̂)·inv_features) per row, g = dy·γ; overwritten.
extern "C" __global__ void layer_norm_input_grad(const float* x, const float* dy, float* dx, const float* mean, const float* inv,
                                                 const float* gamma, int rows, int features, float inv_features) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        long long at = (long long)row * features;
        float m = mean[row], r = inv[row];
        double sum = 0.0, sum_xhat = 0.0;
        for (int f = threadIdx.x; f < features; f += REDUCE_THREADS) {
            float g = dy[at + f] * gamma[f];
            sum += (double)g;
            sum_xhat += (double)g * (double)((x[at + f] - m) * r);
        }
        float s = (float)block_sum_f64(sum, buf);
        float sx = (float)block_sum_f64(sum_xhat, buf);
        for (int f = threadIdx.x; f < features; f += REDUCE_THREADS) {
            dx[at + f] = r * (dy[at + f] * gamma[f] - (s + (x[at + f] - m) * r * sx) * inv_features);
        }
    }
}
