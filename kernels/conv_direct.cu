// Direct convolutions (src/cuda/conv_direct.rs): no lowered matrix, no product routine; built
// for layers whose reduction C·kh·kw is small (first layers), where the lowered and implicit
// products are far from the memory floor. Layout as the CPU's: x (batch, C, H, W), z and dZ
// (batch, OC, OH, OW), W (OC, C, kh, kw); input pixel of tap (c, i, j) at output (oy, ox):
// (iy, ix) = (oy·sh + i·dh − ph, ox·sw + j·dw − pw), zero outside.
//
// Both kernels stage a band of one sample's input in shared memory: a tile of consecutive output
// pixels p0..p_end (p = oy·OW + ox) covers output rows oy_first..oy_last; the band is the input
// rows and columns those read, rows = (oy_last − oy_first)·sh + (kh − 1)·dh + 1 from row
// oy_first·sh − ph, and all the columns a row reads, cols = (ox_hi − ox_lo)·sw + (kw − 1)·dw + 1
// from ox_lo·sw − pw (ox_lo..ox_hi the tile's columns where it lies in one row, else 0..OW − 1),
// zero where outside the image. Output pixel p then reads tap (c, i, j) at
// off(p) + c·rows·cols + i·dh·cols + j·dw, off(p) = (oy − oy_first)·sh·cols + (ox − ox_lo)·sw:
// one offset a pixel, one a tap, the same for every thread. conv_direct_band works the band out.
//
// Sums are fmaf chains in a fixed order (--fmad=false would otherwise round a·b + c twice): the
// same inputs give the same bits, run after run.

// Output pixels a thread of the forward holds (strided by the threads of its group, so that a
// warp reads consecutive staged values and writes consecutive z), and output channels (read as
// two float4 broadcasts of the staged weights).
#define CDF_PX 4
#define CDF_OC 8
// The weight gradient's register tile: 8 output channels × 4 consecutive taps r = (c, i, j).
#define CDW_OC 8
#define CDW_R 4
// Pitch of the weight gradient's final sums (one column a thread): 257 ≡ 1 mod 32 banks.
#define CDW_PITCH (REDUCE_THREADS + 1)

struct ConvBand {
    int oy_first, ox_lo, rows, cols, row0, col0;
};

__device__ __forceinline__ ConvBand conv_direct_band(int p0, int p_end, int out_w, int kh, int kw, int sh, int sw, int ph, int pw, int dh,
                                                     int dw) {
    ConvBand b;
    b.oy_first = p0 / out_w;
    int oy_last = (p_end - 1) / out_w;
    bool one_row = b.oy_first == oy_last;
    b.ox_lo = one_row ? p0 - b.oy_first * out_w : 0;
    int ox_hi = one_row ? p_end - 1 - b.oy_first * out_w : out_w - 1;
    b.rows = (oy_last - b.oy_first) * sh + (kh - 1) * dh + 1;
    b.cols = (ox_hi - b.ox_lo) * sw + (kw - 1) * dw + 1;
    b.row0 = b.oy_first * sh - ph;
    b.col0 = b.ox_lo * sw - pw;
    return b;
}

// Copies *src to *dst (shared memory), or zero where !valid (then src is only an address: nothing
// is read), asynchronously: cp.async with source size 0 or 4 (sm_80 on; before, a plain store).
// The thread's copies are complete after conv_direct_copied(), and visible to the block after a
// barrier that follows it.
__device__ __forceinline__ void conv_direct_copy(float* dst, const float* src, bool valid) {
#if __CUDA_ARCH__ >= 800
    unsigned to = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(to), "l"(src), "r"(valid ? 4 : 0) : "memory");
#else
    *dst = valid ? *src : 0.0f;
#endif
}

__device__ __forceinline__ void conv_direct_copied() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Stages channels c0..c0 + n of sample plane `xs` (C, H, W) over band `b` into `to`
// ([n][rows][cols]), zero outside the image; with ASYNC by conv_direct_copy.
template <bool ASYNC>
__device__ __forceinline__ void conv_direct_stage(const float* __restrict__ xs, float* to, int n, int height, int width, ConvBand b) {
    int plane = b.rows * b.cols;
    for (int e = threadIdx.x; e < n * plane; e += blockDim.x) {
        int c = e / plane, rc = e - c * plane, r = rc / b.cols;
        int iy = b.row0 + r, ix = b.col0 + rc - r * b.cols;
        bool in = iy >= 0 && iy < height && ix >= 0 && ix < width;
        long long at = in ? ((long long)c * height + iy) * width + ix : 0;
        if (ASYNC)
            conv_direct_copy(to + e, xs + at, in);
        else
            to[e] = in ? xs[at] : 0.0f;
    }
}

// Z (batch, OC, OH, OW) = conv(X, W) without the bias, overwritten.
// Block: 256 threads in `groups` groups (1, 2, 4 or 8) of tpg = 256 / groups; the block computes
// oc_tile = 8·groups output channels × tile = 4·tpg output pixels of one sample, group g the
// channels 8g..8g + 7 of the tile, thread t of a group the pixels p0 + t + q·tpg (q < 4).
// Grid x: (sample, pixel tile, channel tile), channel tile fastest. Dynamic shared memory (the
// launcher's count, at most 48 KB): the weights of `chunk` input channels ([chunk·kh·kw][oc_tile],
// zero past OC) then their band ([chunk][rows][cols]); the input channels go by in chunks, so
// out[p][oc] = Σ_c Σ_i Σ_j, in that order. Registers: 32 sums, 4 offsets, 8 weights.
// With `transposed` it computes a stride-1 layer's input gradient dX = conv(dZ, W'): x is dZ,
// z is dX, `channels` the layer's OC, `out_channels` its C, padding (k − 1)·d − p, and w the
// layer's weights W (C', OC', kh, kw) = (out_channels, channels, kh, kw) read as
// W'[oc][c][i][j] = W[c][oc][kh − 1 − i][kw − 1 − j] while staging; nothing else changes.
extern "C" __global__ __launch_bounds__(REDUCE_THREADS) void conv_direct_forward(const float* __restrict__ x, const float* __restrict__ w,
                                                                                 float* __restrict__ z, int channels, int height,
                                                                                 int width, int kh, int kw, int sh, int sw, int ph,
                                                                                 int pw, int dh, int dw, int out_channels, int out_h,
                                                                                 int out_w, int groups, int chunk, int pixel_tiles,
                                                                                 int oc_tiles, int transposed) {
    after_prior();
    extern __shared__ __align__(16) float cd_smem[];
    int ohw = out_h * out_w, taps = kh * kw, ckk = channels * taps;
    int tpg = blockDim.x / groups, tile = tpg * CDF_PX, oc_tile = groups * CDF_OC;
    int ot = blockIdx.x % oc_tiles, pt = blockIdx.x / oc_tiles % pixel_tiles, s = blockIdx.x / oc_tiles / pixel_tiles;
    int p0 = pt * tile, p_end = min(p0 + tile, ohw);
    ConvBand b = conv_direct_band(p0, p_end, out_w, kh, kw, sh, sw, ph, pw, dh, dw);
    int plane = b.rows * b.cols;
    float* w_s = cd_smem;
    float* x_s = cd_smem + chunk * taps * oc_tile;
    int group = threadIdx.x / tpg, lane = threadIdx.x % tpg;
    int oc_base = ot * oc_tile;
    int off[CDF_PX];
#pragma unroll
    for (int q = 0; q < CDF_PX; q++) {
        int p = p0 + lane + q * tpg, oy = p / out_w, ox = p - oy * out_w;
        off[q] = p < p_end ? (oy - b.oy_first) * sh * b.cols + (ox - b.ox_lo) * sw : 0;
    }
    float acc[CDF_PX][CDF_OC];
#pragma unroll
    for (int q = 0; q < CDF_PX; q++)
#pragma unroll
        for (int o = 0; o < CDF_OC; o++) acc[q][o] = 0.0f;
    const float* xs = x + (long long)s * channels * height * width;
    for (int c0 = 0; c0 < channels; c0 += chunk) {
        int n = min(chunk, channels - c0), span = n * taps;
        // w_s[rt][o] = W[oc_base + o, c0·taps + rt] (transposed: W[c0 + rt / taps, oc_base + o,
        // taps − 1 − rt % taps]): consecutive threads read consecutive taps
        for (int e = threadIdx.x; e < span * oc_tile; e += blockDim.x) {
            int o = e / span, rt = e - o * span, oc = oc_base + o;
            long long at = transposed ? ((long long)(c0 + rt / taps) * out_channels + oc) * taps + taps - 1 - rt % taps
                                      : (long long)oc * ckk + c0 * taps + rt;
            w_s[rt * oc_tile + o] = oc < out_channels ? w[at] : 0.0f;
        }
        conv_direct_stage<false>(xs + (long long)c0 * height * width, x_s, n, height, width, b);
        __syncthreads();
        for (int c = 0; c < n; c++) {
            for (int i = 0; i < kh; i++) {
                for (int j = 0; j < kw; j++) {
                    int tap = c * plane + i * dh * b.cols + j * dw;
                    const float4* wv = reinterpret_cast<const float4*>(w_s + ((c * kh + i) * kw + j) * oc_tile + group * CDF_OC);
                    float4 wa = wv[0], wb = wv[1];
                    float wr[CDF_OC] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
                    for (int q = 0; q < CDF_PX; q++) {
                        float v = x_s[off[q] + tap];
#pragma unroll
                        for (int o = 0; o < CDF_OC; o++) acc[q][o] = fmaf(v, wr[o], acc[q][o]);
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int q = 0; q < CDF_PX; q++) {
        int p = p0 + lane + q * tpg;
        if (p >= p_end) continue;
#pragma unroll
        for (int o = 0; o < CDF_OC; o++) {
            int oc = oc_base + group * CDF_OC + o;
            if (oc < out_channels) z[((long long)s * out_channels + oc) * ohw + p] = acc[q][o];
        }
    }
}

// dW[oc, r] = Σ_s Σ_p dZ[s, oc, p] · x[s, c, iy, ix], r = (c, i, j), over share q = blockIdx.x's
// samples q·chunk..min((q + 1)·chunk, batch), into out[q] (OC × CKK; dW itself with one share, else
// the partials conv_wgrad_join adds in share order).
// The block holds every output: items = ⌈OC/8⌉ × ⌈CKK/4⌉ register tiles of 8 channels × 4 taps
// (the launcher takes the route only where items ≤ 256), each summed by `slices` = 256 / items
// threads (thread = item·slices + slice; the rest idle), slice l over the tile's pixels
// l, l + slices, ... It goes by steps, step k the share's sample k / pixel_tiles (ascending) and
// its tile k % pixel_tiles of `tile` pixels: the band of all C channels, dZ ([tile][OC8], OC8 =
// OC rounded up to 8, zero past OC and past the sample's pixels) and each pixel's band offset are
// staged into buffer k % 2, step k + 1's copies issued (asynchronously) before step k is summed,
// so that their latency overlaps its products. At the end slice sums go to shared memory (one
// column a thread, pitch CDW_PITCH) and are added in slice order. Dynamic shared memory (at most
// 48 KB): two buffers `buffer` floats apart (a multiple of 4: float4 reads of dZ), each dZ,
// offsets, band; the sums reuse it. Registers: 32 sums, 4 tap offsets; at most 64 a thread (the
// launch bounds' 4 blocks an SM), so that registers do not hold fewer blocks on an SM than its
// shared memory does (4 of 48 KB on sm_90).
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 4) void conv_direct_wgrad(const float* __restrict__ x, const float* __restrict__ dz,
                                                                                  float* __restrict__ out, int channels, int height,
                                                                                  int width, int kh, int kw, int sh, int sw, int ph, int pw,
                                                                                  int dh, int dw, int out_channels, int out_h, int out_w,
                                                                                  int batch, int chunk, int tile, int buffer) {
    after_prior();
    extern __shared__ __align__(16) float cd_smem[];
    int ohw = out_h * out_w, taps = kh * kw, ckk = channels * taps;
    int oc8 = (out_channels + CDW_OC - 1) / CDW_OC * CDW_OC;
    int r_tiles = (ckk + CDW_R - 1) / CDW_R, items = oc8 / CDW_OC * r_tiles;
    int slices = blockDim.x / items;
    int item = threadIdx.x / slices, slice = threadIdx.x % slices;
    bool active = item < items;
    int og = active ? item / r_tiles : 0, rt = active ? item % r_tiles : 0;
    float acc[CDW_OC][CDW_R];
#pragma unroll
    for (int a = 0; a < CDW_OC; a++)
#pragma unroll
        for (int c = 0; c < CDW_R; c++) acc[a][c] = 0.0f;
    int s_first = blockIdx.x * chunk, s_end = min(s_first + chunk, batch);
    int pixel_tiles = (ohw + tile - 1) / tile, steps = (s_end - s_first) * pixel_tiles;
    // step k's buffer: dz_s [tile][OC8], then off_s [tile], then x_s the band [C][rows][cols]
    auto dz_at = [&](int k) { return cd_smem + (k & 1) * buffer; };
    // Issues step k's copies into its buffer (dZ and the band asynchronously; the offsets, worked
    // out, stored): consecutive threads read consecutive pixels of a channel.
    auto stage = [&](int k) {
        int s = s_first + k / pixel_tiles, p0 = k % pixel_tiles * tile, n = min(tile, ohw - p0);
        ConvBand b = conv_direct_band(p0, p0 + n, out_w, kh, kw, sh, sw, ph, pw, dh, dw);
        float* dz_s = dz_at(k);
        int* off_s = reinterpret_cast<int*>(dz_s + tile * oc8);
        conv_direct_stage<true>(x + (long long)s * channels * height * width, dz_s + tile * oc8 + tile, channels, height, width, b);
        const float* dzs = dz + (long long)s * out_channels * ohw + p0;
        for (int e = threadIdx.x; e < oc8 * tile; e += blockDim.x) {
            int o = e / tile, p = e - o * tile;
            bool valid = o < out_channels && p < n;
            conv_direct_copy(dz_s + p * oc8 + o, dzs + (valid ? (long long)o * ohw + p : 0), valid);
        }
        for (int p = threadIdx.x; p < n; p += blockDim.x) {
            int oy = (p0 + p) / out_w, ox = p0 + p - oy * out_w;
            off_s[p] = (oy - b.oy_first) * sh * b.cols + (ox - b.ox_lo) * sw;
        }
    };
    if (steps > 0) stage(0);
    for (int k = 0; k < steps; k++) {
        // This thread's copies of step k are complete, and past the barrier every thread's are
        // visible; every thread has also summed step k − 1, so its buffer, step k + 1's, is free.
        conv_direct_copied();
        __syncthreads();
        if (k + 1 < steps) stage(k + 1);
        if (!active) continue;
        int p0 = k % pixel_tiles * tile, n = min(tile, ohw - p0);
        ConvBand b = conv_direct_band(p0, p0 + n, out_w, kh, kw, sh, sw, ph, pw, dh, dw);
        int plane = b.rows * b.cols;
        const float* dz_s = dz_at(k);
        const int* off_s = reinterpret_cast<const int*>(dz_s + tile * oc8);
        const float* x_s = dz_s + tile * oc8 + tile;
        int tap[CDW_R];
#pragma unroll
        for (int c = 0; c < CDW_R; c++) {
            int r = rt * CDW_R + c, ch = r / taps, t = r - ch * taps, i = t / kw, j = t - i * kw;
            // a tap past CKK reads the band's first value; its sums are never written
            tap[c] = r < ckk ? ch * plane + i * dh * b.cols + j * dw : 0;
        }
        for (int p = slice; p < n; p += slices) {
            const float4* dv = reinterpret_cast<const float4*>(dz_s + p * oc8 + og * CDW_OC);
            float4 da = dv[0], db = dv[1];
            float d[CDW_OC] = {da.x, da.y, da.z, da.w, db.x, db.y, db.z, db.w};
            int o = off_s[p];
            float v[CDW_R];
#pragma unroll
            for (int c = 0; c < CDW_R; c++) v[c] = x_s[o + tap[c]];
#pragma unroll
            for (int a = 0; a < CDW_OC; a++)
#pragma unroll
                for (int c = 0; c < CDW_R; c++) acc[a][c] = fmaf(d[a], v[c], acc[a][c]);
        }
    }
    // every thread's last products are done before the buffers turn into the slices' sums (the
    // last step issued no copies)
    __syncthreads();
    // the slices' sums, added in slice order: sums[k][thread], k = a·4 + c
    float* sums = cd_smem;
#pragma unroll
    for (int a = 0; a < CDW_OC; a++)
#pragma unroll
        for (int c = 0; c < CDW_R; c++) sums[(a * CDW_R + c) * CDW_PITCH + threadIdx.x] = acc[a][c];
    __syncthreads();
    long long base = (long long)blockIdx.x * out_channels * ckk;
    for (int e = threadIdx.x; e < items * CDW_OC * CDW_R; e += blockDim.x) {
        int it = e / (CDW_OC * CDW_R), k = e - it * (CDW_OC * CDW_R), a = k / CDW_R, c = k - a * CDW_R;
        int oc = it / r_tiles * CDW_OC + a, r = it % r_tiles * CDW_R + c;
        const float* col = sums + k * CDW_PITCH + it * slices;
        float sum = col[0];
        for (int l = 1; l < slices; l++) sum += col[l];
        if (oc < out_channels && r < ckk) out[base + (long long)oc * ckk + r] = sum;
    }
}
