// Optimisers (src/optim.rs): one pass over the flat parameters, PyTorch's rules, the same
// arithmetic in the same order as the CPU loop (compiled with --fmad=false, so + − × ÷ √ round
// as on the CPU and the results agree bit for bit). Step-dependent scalars come from the host.
//
// With `early` (a training step's update, Optimizer::train_step: the kernels ahead of it write
// gradients, never parameters or optimiser state) a thread reads its first parameter and that
// parameter's state before waiting for the kernels ahead, so that those loads overlap them;
// without it (an update queued on its own, which may follow another update) only after.

// The thread's first index of the grid-stride loop, and whether it reads that one's values early
#define OPTIM_EARLY                                       \
    int first = blockIdx.x * blockDim.x + threadIdx.x; \
    bool pre = early && first < n

// x[i], or `value` where the thread read x[i] early
__device__ __forceinline__ float optim_read(const float* x, int i, bool early_i, float value) {
    return early_i ? value : x[i];
}

// p ← p − lr·g
extern "C" __global__ void sgd(float* p, const float* g, float lr, int n, int early) {
    OPTIM_EARLY;
    float p0 = pre ? p[first] : 0.0f;
    after_prior();
    GRID_STRIDE(i, n) {
        bool e = pre && i == first;
        p[i] = optim_read(p, i, e, p0) - lr * g[i];
    }
}

// buf ← μ·buf + g;  p ← p − lr·(g + μ·buf) with Nesterov, else p ← p − lr·buf
extern "C" __global__ void sgd_momentum(float* p, const float* g, float* buf, float lr, float momentum, int nesterov, int n, int early) {
    OPTIM_EARLY;
    float p0 = pre ? p[first] : 0.0f, b0 = pre ? buf[first] : 0.0f;
    after_prior();
    GRID_STRIDE(i, n) {
        bool e = pre && i == first;
        float gi = g[i];
        float b = momentum * optim_read(buf, i, e, b0) + gi;
        buf[i] = b;
        float d = nesterov ? gi + momentum * b : b;
        p[i] = optim_read(p, i, e, p0) - lr * d;
    }
}

// m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;  p ← p·shrink − step_size·m / (√v·inv_bias2 + ε)
// with step_size = lr/(1−β₁ᵗ), inv_bias2 = 1/√(1−β₂ᵗ), shrink = 1 − lr·λ (λ = 0: Adam).
extern "C" __global__ void adam(float* p, const float* g, float* m, float* v, float beta1, float beta2, float eps, float step_size,
                                float inv_bias2, float shrink, int n, int early) {
    OPTIM_EARLY;
    float p0 = pre ? p[first] : 0.0f, m0 = pre ? m[first] : 0.0f, v0 = pre ? v[first] : 0.0f;
    after_prior();
    GRID_STRIDE(i, n) {
        bool e = pre && i == first;
        float gi = g[i];
        float mi = beta1 * optim_read(m, i, e, m0) + (1.0f - beta1) * gi;
        float vi = beta2 * optim_read(v, i, e, v0) + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = optim_read(p, i, e, p0) * shrink - step_size * mi / (sqrtf(vi) * inv_bias2 + eps);
    }
}

// v ← αv + (1−α)g²;  p ← p − lr·g / (√v + ε)
extern "C" __global__ void rmsprop(float* p, const float* g, float* v, float lr, float alpha, float eps, int n, int early) {
    OPTIM_EARLY;
    float p0 = pre ? p[first] : 0.0f, v0 = pre ? v[first] : 0.0f;
    after_prior();
    GRID_STRIDE(i, n) {
        bool e = pre && i == first;
        float gi = g[i];
        float vi = alpha * optim_read(v, i, e, v0) + (1.0f - alpha) * gi * gi;
        v[i] = vi;
        p[i] = optim_read(p, i, e, p0) - lr * gi / (sqrtf(vi) + eps);
    }
}
