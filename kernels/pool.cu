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

// The same dx where the windows tile the input (stride = window, H = OH·kh, W = OW·kw): every
// pixel in exactly one window, so one thread per WINDOW finds its first maximum once and writes
// the window's kh·kw values, 0 + dy at the maximum (as the gather's sum from 0 rounds, -0
// included) and 0 elsewhere; the gather below recomputes each window's maximum for each of its
// pixels, with six integer divisions a pixel.
extern "C" __global__ void maxpool_backward_tiles(const float* x, const float* dy, float* dx, int height, int width, int out_h,
                                                  int out_w, int kh, int kw, int windows) {
    after_prior();
    GRID_STRIDE(i, windows) {
        int ox = i % out_w, rest = i / out_w, oy = rest % out_h, plane = rest / out_h;
        long long base = (long long)plane * height * width;
        int best = pool_argmax(x + base, 0, oy, ox, height, width, kh, kw, kh, kw);
        float g = 0.0f + dy[i];
        float* dxp = dx + base;
        for (int a = 0; a < kh; a++) {
            int row = (oy * kh + a) * width + ox * kw;
            for (int b = 0; b < kw; b++) dxp[row + b] = row + b == best ? g : 0.0f;
        }
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
