// AvgPool (src/layers/avgpool.rs): windows kh×kw moved by (sh, sw), no padding, (C, H, W)
// samples. A window's values are summed in row-major order and the sum divided by kh·kw; the
// backward pass adds dy/(kh·kw) of every window holding a pixel, in output order: the CPU's
// operations in its order, so both give the same bits.

// y[s, c, oy, ox] = mean of its window; one thread per output value.
extern "C" __global__ void avgpool_forward(const float* x, float* y, int channels, int height, int width, int out_h, int out_w, int kh,
                                           int kw, int sh, int sw, int batch) {
    after_prior();
    int n = batch * channels * out_h * out_w;
    float count = (float)(kh * kw);
    GRID_STRIDE(i, n) {
        int ox = i % out_w, oy = (i / out_w) % out_h, c = (i / (out_w * out_h)) % channels, s = i / (out_w * out_h * channels);
        const float* top = x + ((long long)s * channels + c) * height * width + oy * sh * width + ox * sw;
        float acc = 0.0f;
        for (int a = 0; a < kh; a++) {
            for (int b = 0; b < kw; b++) acc += top[a * width + b];
        }
        y[i] = acc / count;
    }
}

// dx[s, c, iy, ix] = Σ dy/(kh·kw) over the windows holding this pixel, overwritten. One thread per
// INPUT value gathers from those windows in the CPU's order (oy, then ox, ascending).
extern "C" __global__ void avgpool_backward(const float* dy, float* dx, int channels, int height, int width, int out_h, int out_w, int kh,
                                            int kw, int sh, int sw, int batch) {
    after_prior();
    int n = batch * channels * height * width;
    float count = (float)(kh * kw);
    GRID_STRIDE(i, n) {
        int ix = i % width, iy = (i / width) % height, c = (i / (width * height)) % channels, s = i / (width * height * channels);
        const float* dys = dy + ((long long)s * channels + c) * out_h * out_w;
        // windows oy with oy·sh ≤ iy < oy·sh + kh
        int oy_lo = iy < kh ? 0 : (iy - kh) / sh + 1, oy_hi = min(iy / sh, out_h - 1);
        int ox_lo = ix < kw ? 0 : (ix - kw) / sw + 1, ox_hi = min(ix / sw, out_w - 1);
        float acc = 0.0f;
        for (int oy = oy_lo; oy <= oy_hi; oy++) {
            for (int ox = ox_lo; ox <= ox_hi; ox++) acc += dys[oy * out_w + ox] / count;
        }
        dx[i] = acc;
    }
}
