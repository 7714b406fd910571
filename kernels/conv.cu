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

// The weight gradient without a lowered matrix (src/cuda/conv.rs, conv_weight_grad_implicit):
//   dW[oc, r] = Σ_s Σ_p dZ[s, oc, p] · x[s, c, iy, ix],  r = (c, i, j), p = (oy, ox),
// (iy, ix) as in im2col (x read as 0 outside). It is a product OC × CKK over K = batch·OHW, k =
// s·OHW + p. Grid: x the output tiles, TOC oc × WGI_TR r (tile t: oc tile t / r_tiles, r tile
// t mod r_tiles); y the shares of the samples, `chunk` samples each (the last may have fewer).
// A block walks its share's k in steps of WGI_KC: it stages dZ[k][oc] and the gathered x[k][r]
// (0 past the share, past OC, past CKK) in shared memory, each k's and each r's offsets worked
// out once a step and once a block; then each thread adds products into a 4 × 4 tile of
// outputs with fmaf (--fmad=false would otherwise round them twice). TOC·WGI_TR/16 threads
// cover the block's tile: a group; the block's WGI_KS groups take the KC/KS consecutive k's of
// each step, group g the g-th slice, and at the end group 0 adds the other groups' sums to its
// own in group order. So out[q, oc, r] = Σ_g (Σ over group g's k, ascending), a fixed order.
// With one share `out` is dW; else it is the shares' partial sums, which conv_wgrad_join adds.
#define WGI_TR 64
#define WGI_KC 64
// the rows (oc or r) a block stages at a time, one k a thread
#define WGI_ROWS (REDUCE_THREADS / WGI_KC)
// an offset that puts a row outside the input whatever is added to it
#define WGI_FAR (-(1 << 29))

template <int TOC>
__device__ __forceinline__ void conv_wgrad_tile(const float* __restrict__ x, const float* __restrict__ dz, float* __restrict__ out,
                                                int channels, int height, int width, int kh, int kw, int sh, int sw, int ph, int pw,
                                                int dh, int dw, int out_channels, int out_w, int ohw, int batch, int chunk) {
    constexpr int GROUP = TOC * WGI_TR / 16, KS = REDUCE_THREADS / GROUP, SLICE = WGI_KC / KS;
    // rows of the staged tiles, padded so that a column's writes spread over the banks; each a
    // multiple of 4 floats so that a thread reads its 4 values as one float4
    constexpr int DZ_LD = TOC + 4, X_LD = WGI_TR + 4;
    constexpr int TILES = WGI_KC * (DZ_LD + X_LD), SUMS = (KS - 1) * 16 * GROUP;
    __shared__ __align__(16) float stage[TILES > SUMS ? TILES : SUMS];
    // per r of the tile: (c·H·W, i·dh − ph, j·dw − pw); per k of a step (two steps' worth):
    // (the offset of dZ[s, 0, p] or −1 past the share, s·C·H·W, oy·sh, ox·sw)
    __shared__ int4 r_tab[WGI_TR];
    __shared__ int4 k_tab[2][WGI_KC];
    float* dz_s = stage;
    float* x_s = stage + WGI_KC * DZ_LD;
    int ckk = channels * kh * kw, hw = height * width;
    int r_tiles = (ckk + WGI_TR - 1) / WGI_TR;
    int oc0 = blockIdx.x / r_tiles * TOC, r0 = blockIdx.x % r_tiles * WGI_TR;
    int s_first = blockIdx.y * chunk, s_end = min(s_first + chunk, batch);
    int k_first = s_first * ohw, k_end = s_end * ohw;
    for (int t = threadIdx.x; t < WGI_TR; t += blockDim.x) {
        int r = r0 + t;
        int j = r % kw, i = (r / kw) % kh, c = r / (kw * kh);
        r_tab[t] = r < ckk ? make_int4(c * hw, i * dh - ph, j * dw - pw, 0) : make_int4(0, WGI_FAR, 0, 0);
    }
    // the k table of the step from k0 into buffer `buf`
    auto k_table = [&](int buf, int k0) {
        for (int t = threadIdx.x; t < WGI_KC; t += blockDim.x) {
            int k = k0 + t;
            int s = k / ohw, p = k - s * ohw, oy = p / out_w, ox = p - oy * out_w;
            k_tab[buf][t] = k < k_end ? make_int4(s * out_channels * ohw + p, s * channels * hw, oy * sh, ox * sw) : make_int4(-1, 0, WGI_FAR, 0);
        }
    };
    k_table(0, k_first);
    __syncthreads();
    int g = threadIdx.x / GROUP, t = threadIdx.x % GROUP;
    // this thread's outputs: oc0 + tc·4 + a, r0 + tr·4 + b, a and b in 0..4
    int tc = t / (WGI_TR / 4), tr = t % (WGI_TR / 4);
    float acc[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) acc[a][b] = 0.0f;
    // A thread's share of a step's staging, loaded into registers one step ahead (so that the
    // gathers' latency overlaps the step before's products): dZ for every WGI_ROWS-th oc, x for
    // every WGI_ROWS-th r, at k = its k of the step (k fastest across the threads: consecutive
    // pixels, contiguous reads).
    constexpr int DZ_N = (TOC + WGI_ROWS - 1) / WGI_ROWS, X_N = WGI_TR / WGI_ROWS;
    float dz_r[DZ_N], x_r[X_N];
    int row = threadIdx.x / WGI_KC, col = threadIdx.x % WGI_KC;
    auto load = [&](int b) {
        int4 kt = k_tab[b][col];
#pragma unroll
        for (int n = 0; n < DZ_N; n++) {
            int o = row + n * WGI_ROWS;
            dz_r[n] = (o < TOC && kt.x >= 0 && oc0 + o < out_channels) ? dz[kt.x + (oc0 + o) * ohw] : 0.0f;
        }
#pragma unroll
        for (int n = 0; n < X_N; n++) {
            int4 rt = r_tab[row + n * WGI_ROWS];
            int iy = kt.z + rt.y, ix = kt.w + rt.z;
            bool in = iy >= 0 && iy < height && ix >= 0 && ix < width;
            x_r[n] = in ? x[kt.y + rt.x + iy * width + ix] : 0.0f;
        }
    };
    load(0);
    k_table(1, k_first + WGI_KC);
    int buf = 0;
    for (int k0 = k_first; k0 < k_end; k0 += WGI_KC, buf ^= 1) {
#pragma unroll
        for (int n = 0; n < DZ_N; n++)
            if (row + n * WGI_ROWS < TOC) dz_s[col * DZ_LD + row + n * WGI_ROWS] = dz_r[n];
#pragma unroll
        for (int n = 0; n < X_N; n++) x_s[col * X_LD + row + n * WGI_ROWS] = x_r[n];
        __syncthreads();
        // the next step's values into registers (its table was written before the barrier),
        // then the table of the step after it into this step's buffer, which no thread reads
        // any more (its loads came before the barrier)
        if (k0 + WGI_KC < k_end) {
            load(buf ^ 1);
            k_table(buf, k0 + 2 * WGI_KC);
        }
#pragma unroll 4
        for (int u = 0; u < SLICE; u++) {
            int kk = g * SLICE + u;
            float4 a4 = *reinterpret_cast<const float4*>(&dz_s[kk * DZ_LD + tc * 4]);
            float4 b4 = *reinterpret_cast<const float4*>(&x_s[kk * X_LD + tr * 4]);
            float av[4] = {a4.x, a4.y, a4.z, a4.w}, bv[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 4; b++) acc[a][b] = fmaf(av[a], bv[b], acc[a][b]);
        }
        __syncthreads();
    }
    // groups 1.. leave their sums in the tiles' place (free after the last barrier); group 0
    // adds them in group order
    if (g > 0) {
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) stage[((g - 1) * 16 + a * 4 + b) * GROUP + t] = acc[a][b];
    }
    __syncthreads();
    if (g > 0) return;
    for (int h = 1; h < KS; h++) {
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) acc[a][b] += stage[((h - 1) * 16 + a * 4 + b) * GROUP + t];
    }
    float* share = out + (long long)blockIdx.y * out_channels * ckk;
#pragma unroll
    for (int a = 0; a < 4; a++) {
        int oc = oc0 + tc * 4 + a;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int r = r0 + tr * 4 + b;
            if (oc < out_channels && r < ckk) share[oc * ckk + r] = acc[a][b];
        }
    }
}

// conv_wgrad_tile for output tiles of 16, 32 and 64 output channels (4, 2 and 1 groups)
extern "C" __global__ __launch_bounds__(REDUCE_THREADS) void conv_wgrad_16(const float* x, const float* dz, float* out, int channels,
                                                                           int height, int width, int kh, int kw, int sh, int sw, int ph,
                                                                           int pw, int dh, int dw, int out_channels, int out_w,
                                                                           int ohw, int batch, int chunk) {
    after_prior();
    conv_wgrad_tile<16>(x, dz, out, channels, height, width, kh, kw, sh, sw, ph, pw, dh, dw, out_channels, out_w, ohw, batch, chunk);
}

extern "C" __global__ __launch_bounds__(REDUCE_THREADS) void conv_wgrad_32(const float* x, const float* dz, float* out, int channels,
                                                                           int height, int width, int kh, int kw, int sh, int sw, int ph,
                                                                           int pw, int dh, int dw, int out_channels, int out_w,
                                                                           int ohw, int batch, int chunk) {
    after_prior();
    conv_wgrad_tile<32>(x, dz, out, channels, height, width, kh, kw, sh, sw, ph, pw, dh, dw, out_channels, out_w, ohw, batch, chunk);
}

extern "C" __global__ __launch_bounds__(REDUCE_THREADS) void conv_wgrad_64(const float* x, const float* dz, float* out, int channels,
                                                                           int height, int width, int kh, int kw, int sh, int sw, int ph,
                                                                           int pw, int dh, int dw, int out_channels, int out_w,
                                                                           int ohw, int batch, int chunk) {
    after_prior();
    conv_wgrad_tile<64>(x, dz, out, channels, height, width, kh, kw, sh, sw, ph, pw, dh, dw, out_channels, out_w, ohw, batch, chunk);
}

// dw[i] = Σ_q partials[q, i] over the `shares` shares, in q order, overwritten; n = OC·CKK
extern "C" __global__ void conv_wgrad_join(const float* partials, float* dw, int n, int shares) {
    after_prior();
    GRID_STRIDE(i, n) {
        float acc = partials[i];
        for (int q = 1; q < shares; q++) acc += partials[(long long)q * n + i];
        dw[i] = acc;
    }
}
