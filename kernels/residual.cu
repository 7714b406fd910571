// Residual blocks (src/layers/residual.rs): the Add step's sum and activation, and the copies
// and sums of gradients that the Add and the Fork make.

// z = a + b over n values; then y = act(z) unless y is null (an identity, whose z is its y).
extern "C" __global__ void residual_add(const float* a, const float* b, float* z, float* y, int act, float slope, int n) {
    after_prior();
    GRID_STRIDE(i, n) {
        float v = a[i] + b[i];
        z[i] = v;
        if (y != nullptr) y[i] = act_apply(act, slope, v);
    }
}

// dst = src over n values, or dst += src with `accumulate`.
extern "C" __global__ void residual_grad(const float* src, float* dst, int n, int accumulate) {
    after_prior();
    GRID_STRIDE(i, n) {
        dst[i] = accumulate ? dst[i] + src[i] : src[i];
    }
}
