// MaxPool (src/layers/pool.rs): windows kh×kw moved by (sh, sw), no padding, (C, H, W) samples.
// The argmax is the first maximum in row-major order, a NaN winning, exactly as the CPU.

// Index within the sample of the first maximum of window (c, oy, ox).
__device__ __forceinline__ int pool_argmax(const float* xs, int c, int oy, int ox, int height, int width, int kh, int kw, int sh,
                                           int sw) {
    int y0 = oy * sh, x0 = ox * sw;
    int best = (c * height + y0) * width + x0;
    for (int i = 0; i < kh; i++) {
        int row = (c * height + y0 + i) * width + x0;
        for (int j = 0; j < kw; j++) {
            // !(v <= best): greater, or either is NaN (Rust's partial_cmp gives Greater or None)
            if (!(xs[row + j] <= xs[best])) best = row + j;
        }
    }
    return best;
}

// y[s, c, oy, ox] = max of its window; one thread per output value.
extern "C" __global__ void maxpool_forward(const float* x, float* y, int channels, int height, int width, int out_h, int out_w, int kh,
                                           int kw, int sh, int sw, int batch) {
    after_prior();
    int n = batch * channels * out_h * out_w;
    GRID_STRIDE(i, n) {
        int ox = i % out_w, oy = (i / out_w) % out_h, c = (i / (out_w * out_h)) % channels, s = i / (out_w * out_h * channels);
        const float* xs = x + (long long)s * channels * height * width;
        y[i] = xs[pool_argmax(xs, c, oy, ox, height, width, kh, kw, sh, sw)];
    }
}

// dx[s, c, iy, ix] = Σ dy over the windows whose first maximum is this pixel, overwritten.
// One thread per INPUT value gathers from the windows containing it, in the CPU's order
// (oy, then ox, ascending), so overlapping windows add deterministically and bit-equal to it.
extern "C" __global__ void maxpool_backward(const float* x, const float* dy, float* dx, int channels, int height, int width, int out_h,
                                            int out_w, int kh, int kw, int sh, int sw, int batch) {
    after_prior();
    int n = batch * channels * height * width;
    GRID_STRIDE(i, n) {
        int ix = i % width, iy = (i / width) % height, c = (i / (width * height)) % channels, s = i / (width * height * channels);
        const float* xs = x + (long long)s * channels * height * width;
        const float* dys = dy + (long long)s * channels * out_h * out_w;
        int me = (c * height + iy) * width + ix;
        // windows oy with oy·sh ≤ iy < oy·sh + kh
        int oy_lo = iy < kh ? 0 : (iy - kh) / sh + 1, oy_hi = min(iy / sh, out_h - 1);
        int ox_lo = ix < kw ? 0 : (ix - kw) / sw + 1, ox_hi = min(ix / sw, out_w - 1);
        float acc = 0.0f;
        for (int oy = oy_lo; oy <= oy_hi; oy++) {
            for (int ox = ox_lo; ox <= ox_hi; ox++) {
                if (pool_argmax(xs, c, oy, ox, height, width, kh, kw, sh, sw) == me) acc += dys[(c * out_h + oy) * out_w + ox];
            }
        }
        dx[i] = acc;
    }
}
