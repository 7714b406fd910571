// Optimisers (src/optim.rs): one pass over the flat parameters, PyTorch's rules, the same
// arithmetic in the same order as the CPU loop (compiled with --fmad=false, so + − × ÷ √ round
// as on the CPU and the results agree bit for bit). Step-dependent scalars come from the host.
//
// With `early` (a training step's update, Optimizer::train_step: the kernels ahead of it write
// gradients and the norm, never parameters or optimiser state) a thread reads its first
// parameter and that parameter's state before waiting for the kernels ahead, so that those loads
// overlap them; without it (an update queued on its own, which may follow another update) only
// after.
//
// Every rule sees the gradient through optim_grad (src/clip.rs, Grad::of): clipped by the
// global norm (`norm[0]`, written by grad_norm ahead of the update; a null `norm`: not clipping
// by norm), then to ±clip (∞: none), then with the L2 term λ·p added (λ = 0: none).

// The thread's first index of the grid-stride loop, and whether it reads that one's values early
#define OPTIM_EARLY                                       \
    int first = blockIdx.x * blockDim.x + threadIdx.x; \
    bool pre = early && first < n

// x[i], or `value` where the thread read x[i] early
__device__ __forceinline__ float optim_read(const float* x, int i, bool early_i, float value) {
    return early_i ? value : x[i];
}

// How the gradient is clipped and decayed; read after after_prior() (the norm is written by the
// kernel ahead).
struct OptimGrad {
    float coef, clip, decay;
};

// coef = min(1, max_norm / (‖g‖ + 1e-6)) in f32 (clip_coef in src/clip.rs), or 1. norm[0] holds
// ‖g‖ rounded to f32, so the conversion is exact.
__device__ __forceinline__ OptimGrad optim_grad_args(const double* norm, float max_norm, float clip, float decay) {
    OptimGrad a;
    a.coef = norm ? fminf(1.0f, max_norm / ((float)norm[0] + 1e-6f)) : 1.0f;
    a.clip = clip;
    a.decay = decay;
    return a;
}

// g·coef, clamped to [−clip, clip] by comparisons (a NaN stays NaN), then g + λ·p where λ ≠ 0
__device__ __forceinline__ float optim_grad(OptimGrad a, float g, float p) {
    g = g * a.coef;
    if (g > a.clip) {
        g = a.clip;
    } else if (g < -a.clip) {
        g = -a.clip;
    }
    return a.decay != 0.0f ? g + a.decay * p : g;
}

// norm[0] = ‖g‖₂ over n values rounded to f32, for clipping by norm: Σ g² in f64 (each square
// exact), each block its grid-stride share then a fixed tree, the last block to finish the
// blocks' sums in block order, so the norm is the same bit for bit on every run (the grid is a
// function of n alone: loss_blocks in src/cuda/ops.rs). Then a counter (in the bits of norm[1],
// zero before the first launch; the last block resets it), then gridDim.x partial sums: one
// buffer, so that a graph holding this kernel is keyed by one address.
extern "C" __global__ void grad_norm(const float* g, int n, double* norm) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    __shared__ bool last;
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)g[i];
        acc += v * v;
    }
    double block = block_sum_f64(acc, buf);
    unsigned int* counter = (unsigned int*)(norm + 1);
    double* partials = norm + 2;
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = block;
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    double total = 0.0;
    for (int b = threadIdx.x; b < gridDim.x; b += REDUCE_THREADS) total += ((volatile double*)partials)[b];
    total = block_sum_f64(total, buf);
    if (threadIdx.x == 0) {
        norm[0] = (double)(float)__dsqrt_rn(total);
        *counter = 0u;
    }
}

// p ← p − lr·g
extern "C" __global__ void sgd(float* p, const float* g, const double* norm, float max_norm, float clip, float decay, float lr, int n,
                               int early) {
    OPTIM_EARLY;
    float p0 = pre ? p[first] : 0.0f;
    after_prior();
    OptimGrad a = optim_grad_args(norm, max_norm, clip, decay);
    GRID_STRIDE(i, n) {
        bool e = pre && i == first;
        float pi = optim_read(p, i, e, p0);
        p[i] = pi - lr * optim_grad(a, g[i], pi);
    }
}

// buf ← μ·buf + g;  p ← p − lr·(g + μ·buf) with Nesterov, else p ← p − lr·buf
extern "C" __global__ void sgd_momentum(float* p, const float* g, const double* norm, float max_norm, float clip, float decay, float* buf,
                                        float lr, float momentum, int nesterov, int n, int early) {
    OPTIM_EARLY;
    float p0 = pre ? p[first] : 0.0f, b0 = pre ? buf[first] : 0.0f;
    after_prior();
    OptimGrad a = optim_grad_args(norm, max_norm, clip, decay);
    GRID_STRIDE(i, n) {
        bool e = pre && i == first;
        float pi = optim_read(p, i, e, p0);
        float gi = optim_grad(a, g[i], pi);
        float b = momentum * optim_read(buf, i, e, b0) + gi;
        buf[i] = b;
        float d = nesterov ? gi + momentum * b : b;
        p[i] = pi - lr * d;
    }
}

// m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;  p ← p·shrink − step_size·m / (√v·inv_bias2 + ε)
// with step_size = lr/(1−β₁ᵗ), inv_bias2 = 1/√(1−β₂ᵗ), shrink = 1 − lr·λ (AdamW's decoupled
// decay; Adam: 1, its L2 term is in `decay`).
extern "C" __global__ void adam(float* p, const float* g, const double* norm, float max_norm, float clip, float decay, float* m, float* v,
                                float beta1, float beta2, float eps, float step_size, float inv_bias2, float shrink, int n, int early) {
    OPTIM_EARLY;
    float p0 = pre ? p[first] : 0.0f, m0 = pre ? m[first] : 0.0f, v0 = pre ? v[first] : 0.0f;
    after_prior();
    OptimGrad a = optim_grad_args(norm, max_norm, clip, decay);
    GRID_STRIDE(i, n) {
        bool e = pre && i == first;
        float pi = optim_read(p, i, e, p0);
        float gi = optim_grad(a, g[i], pi);
        float mi = beta1 * optim_read(m, i, e, m0) + (1.0f - beta1) * gi;
        float vi = beta2 * optim_read(v, i, e, v0) + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi * shrink - step_size * mi / (sqrtf(vi) * inv_bias2 + eps);
    }
}

// v ← αv + (1−α)g²;  p ← p − lr·g / (√v + ε)
extern "C" __global__ void rmsprop(float* p, const float* g, const double* norm, float max_norm, float clip, float decay, float* v, float lr,
                                   float alpha, float eps, int n, int early) {
    OPTIM_EARLY;
    float p0 = pre ? p[first] : 0.0f, v0 = pre ? v[first] : 0.0f;
    after_prior();
    OptimGrad a = optim_grad_args(norm, max_norm, clip, decay);
    GRID_STRIDE(i, n) {
        bool e = pre && i == first;
        float pi = optim_read(p, i, e, p0);
        float gi = optim_grad(a, g[i], pi);
        float vi = alpha * optim_read(v, i, e, v0) + (1.0f - alpha) * gi * gi;
        v[i] = vi;
        p[i] = pi - lr * gi / (sqrtf(vi) + eps);
    }
}
