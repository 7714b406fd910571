// Conv lowering (src/layers/conv.rs). Layout: per sample, as the CPU: col is (batch, CKK, OHW)
// with CKK = C·kh·kw rows r = (c, i, j) and OHW = OH·OW columns p = (oy, ox), so
// Z_s (OC × OHW) = W (OC × CKK) · col_s is one strided-batched GEMM with W shared.
// Input pixel of (c, i, j) at (oy, ox): (iy, ix) = (oy·sh + i·dh − ph, ox·sw + j·dw − pw), zero
// outside; the dilation (dh, dw) is 1 but for a 1-D convolution (height 1, src/layers/conv1d.rs).

// col[s, r, p] ← x[s, c, iy, ix] or 0 (padding). A row (s, r) of col is one tap (c, i, j) of one
// sample over every output pixel: blockIdx.y walks the samples, and a block's threads go in
// groups of `lanes` (the power of two ≥ OHW, at most the block), a group along one row at a
// time (grid-stride over the CKK taps), so that a row's channel and tap are worked out once
// (32-bit divisions), a pixel's coordinates with one division, and the writes are contiguous.
// (One thread per col value working out all six coordinates is bound by its integer divisions,
// far from the memory's rate.)
extern "C" __global__ void im2col(const float* x, float* col, int channels, int height, int width, int kh, int kw, int sh, int sw, int ph,
                                  int pw, int dh, int dw, int out_h, int out_w, int batch) {
    after_prior();
    int ohw = out_h * out_w, ckk = channels * kh * kw;
    int lanes = 1;
    while (lanes < ohw && lanes < (int)blockDim.x) lanes <<= 1;
    int groups = blockDim.x / lanes, lane = threadIdx.x % lanes;
    for (int s = blockIdx.y; s < batch; s += gridDim.y) {
        for (int r = blockIdx.x * groups + threadIdx.x / lanes; r < ckk; r += gridDim.x * groups) {
            int j = r % kw, i = (r / kw) % kh, c = r / (kw * kh);
            const float* plane = x + ((long long)s * channels + c) * height * width;
            float* out = col + ((long long)s * ckk + r) * ohw;
            int y0 = i * dh - ph, x0 = j * dw - pw;
            for (int p = lane; p < ohw; p += lanes) {
                int oy = p / out_w, ox = p - oy * out_w;
                int iy = oy * sh + y0, ix = ox * sw + x0;
                out[p] = (iy >= 0 && iy < height && ix >= 0 && ix < width) ? plane[iy * width + ix] : 0.0f;
            }
        }
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

// One value of a convolution's inference epilogue (conv_epilogue): v = z + b; with a batch norm,
// v = ((v − m)·r)·g + be (batch_norm_apply's expression, in its order); with a residual sum,
// v = v + s (residual_add's body output + block input); then act(v). Each operation rounds
// once (--fmad=false), so each step's value has the bits the separate kernels give it.
__device__ __forceinline__ float conv_epilogue_value(float v, float s, float b, bool bn, float m, float r, float g, float be, bool add,
                                                     int act, float slope) {
    v = v + b;
    if (bn) v = (v - m) * r * g + be;
    if (add) v = v + s;
    return act_apply(act, slope, v);
}

// A convolution's inference epilogue (src/cuda/conv.rs; the steps it takes in:
// src/layers/conv_fast/fused.rs), over z's batch·channels planes of `pixels` values (plane q is
// of channel c = q mod channels):
//   y = act(v),  v = z + bias[c], then with a batch norm (mean non-null)
//   v = ((v − mean[c])·r)·gamma[c] + beta[c], r = 1/√(var[c] + eps) (the running statistics),
//   then with a residual sum (skip non-null) v = v + skip.
// A plane is run by a row of `row` threads (a power of two dividing the block), which loads its
// channel's constants once: a block holds blockDim.x / row planes along x; y splits a plane's
// values into chunks of `row`, grid-strided. With `vec4` (pixels a multiple of 4; z, skip and y
// 16-byte aligned) a thread moves float4s, else single values.
extern "C" __global__ void conv_epilogue(const float* __restrict__ z, const float* __restrict__ bias, const float* __restrict__ mean,
                                         const float* __restrict__ var, const float* __restrict__ gamma, const float* __restrict__ beta,
                                         const float* __restrict__ skip, float* __restrict__ y, int act, float slope, int channels,
                                         int pixels, int planes, int row, int vec4, float eps) {
    after_prior();
    int plane = blockIdx.x * (blockDim.x / row) + threadIdx.x / row;
    if (plane >= planes) return;
    int lane = threadIdx.x % row, stride = gridDim.y * row, c = plane % channels;
    bool bn = mean != nullptr, add = skip != nullptr;
    float b = bias[c], m = 0.0f, r = 0.0f, g = 0.0f, be = 0.0f;
    if (bn) {
        m = mean[c];
        r = 1.0f / sqrtf(var[c] + eps);
        g = gamma[c];
        be = beta[c];
    }
    long long at = (long long)plane * pixels;
    if (vec4) {
        const float4* z4 = reinterpret_cast<const float4*>(z + at);
        const float4* s4 = add ? reinterpret_cast<const float4*>(skip + at) : nullptr;
        float4* y4 = reinterpret_cast<float4*>(y + at);
        for (int i = blockIdx.y * row + lane; i < pixels / 4; i += stride) {
            float4 v = z4[i], s = add ? s4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            v.x = conv_epilogue_value(v.x, s.x, b, bn, m, r, g, be, add, act, slope);
            v.y = conv_epilogue_value(v.y, s.y, b, bn, m, r, g, be, add, act, slope);
            v.z = conv_epilogue_value(v.z, s.z, b, bn, m, r, g, be, add, act, slope);
            v.w = conv_epilogue_value(v.w, s.w, b, bn, m, r, g, be, add, act, slope);
            y4[i] = v;
        }
    } else {
        for (int i = blockIdx.y * row + lane; i < pixels; i += stride) {
            float s = add ? skip[at + i] : 0.0f;
            y[at + i] = conv_epilogue_value(z[at + i], s, b, bn, m, r, g, be, add, act, slope);
        }
    }
}
