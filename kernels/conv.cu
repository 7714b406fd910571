// Conv lowering (src/layers/conv.rs). Layout: per sample, as the CPU: col is (batch, CKK, OHW)
// with CKK = C·kh·kw rows r = (c, i, j) and OHW = OH·OW columns p = (oy, ox), so
// Z_s (OC × OHW) = W (OC × CKK) · col_s is one strided-batched GEMM with W shared.
// Input pixel of (c, i, j) at (oy, ox): (iy, ix) = (oy·sh + i·dh − ph, ox·sw + j·dw − pw), zero
// outside; the dilation (dh, dw) is 1 but for a 1-D convolution (height 1, src/layers/conv1d.rs).

// col[s, r, p] ← x[s, c, iy, ix] or 0 (padding); one thread per col value.
extern "C" __global__ void im2col(const float* x, float* col, int channels, int height, int width, int kh, int kw, int sh, int sw, int ph,
                                  int pw, int dh, int dw, int out_h, int out_w, int batch) {
    after_prior();
    int ohw = out_h * out_w, ckk = channels * kh * kw;
    int n = batch * ckk * ohw;
    GRID_STRIDE(idx, n) {
        int p = idx % ohw, r = (idx / ohw) % ckk, s = idx / (ohw * ckk);
        int ox = p % out_w, oy = p / out_w;
        int j = r % kw, i = (r / kw) % kh, c = r / (kw * kh);
        int iy = oy * sh + i * dh - ph, ix = ox * sw + j * dw - pw;
        float v = 0.0f;
        if (iy >= 0 && iy < height && ix >= 0 && ix < width) v = x[((long long)s * channels + c) * height * width + iy * width + ix];
        col[idx] = v;
    }
}

// dx[s, c, iy, ix] = Σ over the (i, j) that read this pixel of dcol[s, (c, i, j), (oy, ox)],
// overwritten. One thread per input pixel gathers in the CPU's order ((i, j) ascending), so
// it is deterministic and bit-equal to the CPU's col2im for the same dcol.
extern "C" __global__ void col2im(const float* dcol, float* dx, int channels, int height, int width, int kh, int kw, int sh, int sw, int ph,
                                  int pw, int dh, int dw, int out_h, int out_w, int batch) {
    after_prior();
    int ohw = out_h * out_w, ckk = channels * kh * kw;
    int n = batch * channels * height * width;
    GRID_STRIDE(idx, n) {
        int ix = idx % width, iy = (idx / width) % height, c = (idx / (width * height)) % channels, s = idx / (width * height * channels);
        const float* dcols = dcol + (long long)s * ckk * ohw;
        float acc = 0.0f;
        for (int i = 0; i < kh; i++) {
            int ty = iy + ph - i * dh;
            if (ty < 0 || ty % sh != 0 || ty / sh >= out_h) continue;
            for (int j = 0; j < kw; j++) {
                int tx = ix + pw - j * dw;
                if (tx < 0 || tx % sw != 0 || tx / sw >= out_w) continue;
                acc += dcols[((c * kh + i) * kw + j) * ohw + (ty / sh) * out_w + tx / sw];
            }
        }
        dx[idx] = acc;
    }
}
