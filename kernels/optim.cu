// Optimisers (src/optim.rs): one pass over the flat parameters, PyTorch's rules, the same
// arithmetic in the same order as the CPU loop (compiled with --fmad=false, so + − × ÷ √ round
// as on the CPU and the results agree bit for bit). Step-dependent scalars come from the host.

// p ← p − lr·g
extern "C" __global__ void sgd(float* p, const float* g, float lr, int n) {
    after_prior();
    GRID_STRIDE(i, n) { p[i] -= lr * g[i]; }
}

// buf ← μ·buf + g;  p ← p − lr·(g + μ·buf) with Nesterov, else p ← p − lr·buf
extern "C" __global__ void sgd_momentum(float* p, const float* g, float* buf, float lr, float momentum, int nesterov, int n) {
    after_prior();
    GRID_STRIDE(i, n) {
        float b = momentum * buf[i] + g[i];
        buf[i] = b;
        float d = nesterov ? g[i] + momentum * b : b;
        p[i] -= lr * d;
    }
}

// m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;  p ← p·shrink − step_size·m / (√v·inv_bias2 + ε)
// with step_size = lr/(1−β₁ᵗ), inv_bias2 = 1/√(1−β₂ᵗ), shrink = 1 − lr·λ (λ = 0: Adam).
extern "C" __global__ void adam(float* p, const float* g, float* m, float* v, float beta1, float beta2, float eps, float step_size,
                                float inv_bias2, float shrink, int n) {
    after_prior();
    GRID_STRIDE(i, n) {
        float gi = g[i];
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * shrink - step_size * mi / (sqrtf(vi) * inv_bias2 + eps);
    }
}

// v ← αv + (1−α)g²;  p ← p − lr·g / (√v + ε)
extern "C" __global__ void rmsprop(float* p, const float* g, float* v, float lr, float alpha, float eps, int n) {
    after_prior();
    GRID_STRIDE(i, n) {
        float gi = g[i];
        float vi = alpha * v[i] + (1.0f - alpha) * gi * gi;
        v[i] = vi;
        p[i] -= lr * gi / (sqrtf(vi) + eps);
    }
}
