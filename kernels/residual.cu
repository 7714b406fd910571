// Residual blocks (src/layers/residual.rs): the Add step's sum and activation, and the copies
// and sums of gradients that the Add and the Fork make. The first `quads` fours of values go as
// float4 (the host passes 0 unless every pointer is 16-byte aligned), the rest one at a time.

// z = a + b over n values; then y = act(z) unless y is null (an identity, whose z is its y).
extern "C" __global__ void residual_add(const float* a, const float* b, float* z, float* y, int act, float slope, int quads, int n) {
    after_prior();
    GRID_STRIDE(q, quads) {
        float4 u = reinterpret_cast<const float4*>(a)[q], w = reinterpret_cast<const float4*>(b)[q];
        float4 v = make_float4(u.x + w.x, u.y + w.y, u.z + w.z, u.w + w.w);
        reinterpret_cast<float4*>(z)[q] = v;
        if (y != nullptr)
            reinterpret_cast<float4*>(y)[q] =
                make_float4(act_apply(act, slope, v.x), act_apply(act, slope, v.y), act_apply(act, slope, v.z), act_apply(act, slope, v.w));
    }
    GRID_STRIDE(t, n - 4 * quads) {
        int i = 4 * quads + t;
        float v = a[i] + b[i];
        z[i] = v;
        if (y != nullptr) y[i] = act_apply(act, slope, v);
    }
}

// dst = src over n values, or dst += src with `accumulate`.
extern "C" __global__ void residual_grad(const float* src, float* dst, int quads, int n, int accumulate) {
    after_prior();
    GRID_STRIDE(q, quads) {
        float4 s = reinterpret_cast<const float4*>(src)[q];
        if (accumulate) {
            float4 d = reinterpret_cast<const float4*>(dst)[q];
            s = make_float4(d.x + s.x, d.y + s.y, d.z + s.z, d.w + s.w);
        }
        reinterpret_cast<float4*>(dst)[q] = s;
    }
    GRID_STRIDE(t, n - 4 * quads) {
        int i = 4 * quads + t;
        dst[i] = accumulate ? dst[i] + src[i] : src[i];
    }
}
