// The convolution's weight gradient on the tensor cores (src/cuda/conv_mma_wgrad.rs), sm_80 and
// later: dW = dZ · A summed over the samples, on mma.sync m16n8k8 (TF32 inputs, FP32 sums). Layout
// as conv_direct.cu's (whose conv_direct_band and conv_direct_copy it uses), the tensor-core helpers
// of dense_mma.cu, and conv_mma.cu's ideas (PASSES 3, PASSES 1, chunked sums):
// x (batch, C, H, W), dZ (batch, OC, OH, OW), dW (OC, C, kh, kw).
//
// The product: dW (M × N) = dZ (M × K) · A (K × N), M the output channels, N the taps
// r = (c, i, j) (CKK = C·kh·kw of them), K the (sample, pixel) pairs of a share of the samples,
// A[p][r] = x at tap r of pixel p (zero outside the image). A block sums BM = 16·MF channels ×
// BN = 8·NF taps r0..r0 + BN over its share's samples, a tile of `tile` consecutive pixels of
// one sample at a time: it stages dZ's tile ([BM][tile + 4], contiguous per channel) and the
// band of the channels the taps r0.. belong to ([bands][rows][cols]: the band of conv_direct_band
// at the origin it gives, `rows` × `cols` the host's bound for every tile, so that a tap's offset
// is the same for every tile), and a warp gathers its B fragments from the band, pixel p's value
// of tap r at off(p) + tap(r), off(p) staged with the tile, tap(r) in registers.
//
// The block's 8 warps split K: warp w sums the k-steps 8w, 8w + 64, ... of each tile (`tile` a
// multiple of 64), each tile's products afresh, then adds them to its FP32 totals (a rounded
// addition: the tensor cores round their sums toward zero). At the end the warps' totals go to
// shared memory and are added in warp order. Every output is so summed in one fixed order: the
// same inputs give the same bits, run after run. PASSES 3 where the layer is FP32 (3xTF32, as
// conv_mma.cu), PASSES 1 where its TF32 is on.

#define CMW_WARPS (REDUCE_THREADS / 32)

// out[q][oc][r] = Σ over share q's samples s (q·chunk .. min((q + 1)·chunk, batch), blockIdx.y = q)
// and pixels p of dZ[s][oc][p] · A_s[p][r], for oc in oc_base.. (BM of them, blockIdx.x % oc_tiles)
// and r in r0 = (blockIdx.x / oc_tiles)·BN ..; out is dW itself with one share, else the partials
// (shares × OC·CKK) that conv_wgrad_join adds in share order.
//
// Steps: step k is the share's sample k / pixel_tiles (ascending) and its tile k % pixel_tiles.
// Dynamic shared memory (the host's count, at most 48 KB): two stages `stage_floats` apart, each
// dz_s [BM][tile + 4] (zero past OC and past the sample's pixels; the pitch ≡ 4 mod 32 puts a
// warp's A reads, 8 channels × 4 pixels, on 32 banks), off_s [tile] (ints; 0 past the pixels)
// and x_s [bands][rows][cols] (channels c_lo.. of the band, zero outside the image and past C);
// step k + 1 is copied (cp.async) into one stage while step k is summed from the other. At the
// end the warps' totals, [CMW_WARPS][BM][BN], reuse it. A column past the block's taps reads the
// pixel's first staged value; its sums are never stored.
//
// Registers: 4·MF·NF sums of the tile and as many totals (64 at MF·NF = 8), NF tap offsets,
// A's fragments (4·MF, twice with PASSES 3), B's of one fragment at a time: within the 128 that
// the launch bounds' two blocks an SM leave a thread (ptxas -v for sm_80 and sm_90: 114 to 126,
// no spills). Two blocks of at most 48 KB share an SM's shared memory.
template <int MF, int NF, int PASSES>
__device__ __forceinline__ void conv_mma_wgrad_tile(const float* __restrict__ x, const float* __restrict__ dz, float* __restrict__ out,
                                                    int channels, int height, int width, int kh, int kw, int sh, int sw, int ph, int pw,
                                                    int dh, int dw, int out_channels, int out_h, int out_w, int batch, int chunk,
                                                    int tile, int rows, int cols, int bands, int oc_tiles) {
#if __CUDA_ARCH__ >= 800
    constexpr int BM = 16 * MF, BN = 8 * NF;
    static_assert(PASSES == 1 || PASSES == 3, "TF32 or 3xTF32");
    extern __shared__ __align__(16) float cw_smem[];
    int ohw = out_h * out_w, taps = kh * kw, ckk = channels * taps, plane = rows * cols;
    int oc_base = blockIdx.x % oc_tiles * BM, r0 = blockIdx.x / oc_tiles * BN, c_lo = r0 / taps;
    int pitch = tile + 4, stage_floats = BM * pitch + tile + bands * plane;
    int s_first = blockIdx.y * chunk, s_end = min(s_first + chunk, batch);
    int pixel_tiles = (ohw + tile - 1) / tile, steps = (s_end - s_first) * pixel_tiles;
    // Issues step k's copies into stage k % 2 (dZ and the band asynchronously; the offsets, worked
    // out, stored): consecutive threads read consecutive pixels of a channel.
    auto stage = [&](int k) {
        int s = s_first + k / pixel_tiles, p0 = k % pixel_tiles * tile, n = min(tile, ohw - p0);
        ConvBand b = conv_direct_band(p0, p0 + n, out_w, kh, kw, sh, sw, ph, pw, dh, dw);
        float* dz_s = cw_smem + (k & 1) * stage_floats;
        int* off_s = reinterpret_cast<int*>(dz_s + BM * pitch);
        float* x_s = dz_s + BM * pitch + tile;
        // tile divides the block's threads: each thread copies one pixel of every few channels
        const float* dzs = dz + (long long)s * out_channels * ohw + p0;
        int p = threadIdx.x % tile;
        for (int o = threadIdx.x / tile; o < BM; o += blockDim.x / tile) {
            bool valid = oc_base + o < out_channels && p < n;
            conv_direct_copy(dz_s + o * pitch + p, dzs + (valid ? (long long)(oc_base + o) * ohw + p : 0), valid);
        }
        if (threadIdx.x < tile) {
            int oy = (p0 + p) / out_w, ox = p0 + p - oy * out_w;
            off_s[p] = p < n ? (oy - b.oy_first) * sh * cols + (ox - b.ox_lo) * sw : 0;
        }
        const float* xs = x + (long long)s * channels * height * width;
        for (int e = threadIdx.x; e < bands * plane; e += blockDim.x) {
            int c = e / plane, rc = e - c * plane, row = rc / cols;
            int iy = b.row0 + row, ix = b.col0 + rc - row * cols;
            bool in = c_lo + c < channels && iy >= 0 && iy < height && ix >= 0 && ix < width;
            conv_direct_copy(x_s + e, xs + (in ? ((long long)(c_lo + c) * height + iy) * width + ix : 0), in);
        }
    };
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // the band offset of the lane's tap column g of fragment f: r = r0 + 8f + g
    int tap[NF];
#pragma unroll
    for (int f = 0; f < NF; f++) {
        int r = r0 + 8 * f + g, c = r / taps, ti = r - c * taps, i = ti / kw, j = ti - i * kw;
        tap[f] = r < ckk ? (c - c_lo) * plane + i * dh * cols + j * dw : 0;
    }
    float total[MF][NF][4];
#pragma unroll
    for (int m = 0; m < MF; m++)
#pragma unroll
        for (int f = 0; f < NF; f++) total[m][f][0] = total[m][f][1] = total[m][f][2] = total[m][f][3] = 0.0f;
    if (steps > 0) stage(0);
    for (int k = 0; k < steps; k++) {
        // this thread's copies of step k are complete, and past the barrier every thread's (and
        // the offsets) are visible; every warp has summed step k − 1, so its stage is free
        conv_direct_copied();
        __syncthreads();
        if (k + 1 < steps) stage(k + 1);
        int n = min(tile, ohw - k % pixel_tiles * tile);
        const float* dz_s = cw_smem + (k & 1) * stage_floats;
        const int* off_s = reinterpret_cast<const int*>(dz_s + BM * pitch);
        const float* x_s = dz_s + BM * pitch + tile;
        float acc[MF][NF][4];
#pragma unroll
        for (int m = 0; m < MF; m++)
#pragma unroll
            for (int f = 0; f < NF; f++) acc[m][f][0] = acc[m][f][1] = acc[m][f][2] = acc[m][f][3] = 0.0f;
        // k-steps wholly past the sample's pixels add nothing (their dZ is zero): skipped
        for (int k0 = 8 * warp; k0 < n; k0 += 8 * CMW_WARPS) {
            // A[oc][p] = dZ: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
            unsigned ab[MF][4], al[MF][4];
#pragma unroll
            for (int m = 0; m < MF; m++) {
                const float* d = dz_s + (16 * m + g) * pitch + k0 + t;
                float v[4] = {d[0], d[8 * pitch], d[4], d[8 * pitch + 4]};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if constexpr (PASSES == 3)
                        mma_split<false>(v[q], ab[m][q], al[m][q]);
                    else
                        ab[m][q] = mma_round(v[q]);
                }
            }
            int o0 = off_s[k0 + t], o1 = off_s[k0 + t + 4];
#pragma unroll
            for (int f = 0; f < NF; f++) {
                // B[p][r] = A_s: b0 (pixel k0 + t, tap column g), b1 (pixel k0 + t + 4, g)
                float b0 = x_s[o0 + tap[f]], b1 = x_s[o1 + tap[f]];
                if constexpr (PASSES == 3) {
                    unsigned bb0, bl0, bb1, bl1;
                    mma_split<false>(b0, bb0, bl0);
                    mma_split<false>(b1, bb1, bl1);
#pragma unroll
                    for (int m = 0; m < MF; m++) {
                        mma_16x8x8(acc[m][f], al[m], bb0, bb1);
                        mma_16x8x8(acc[m][f], ab[m], bl0, bl1);
                        mma_16x8x8(acc[m][f], ab[m], bb0, bb1);
                    }
                } else {
                    unsigned bb0 = mma_round(b0), bb1 = mma_round(b1);
#pragma unroll
                    for (int m = 0; m < MF; m++) mma_16x8x8(acc[m][f], ab[m], bb0, bb1);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < MF; m++)
#pragma unroll
            for (int f = 0; f < NF; f++)
#pragma unroll
                for (int q = 0; q < 4; q++) total[m][f][q] += acc[m][f][q];
    }
    // every warp is done with the stages: the totals take their place, [warp][BM][BN], d0..d3
    // of fragment (m, f) at rows (g, g + 8) of strip m, columns (2t, 2t + 1) of fragment f
    __syncthreads();
    float* red = cw_smem;
#pragma unroll
    for (int m = 0; m < MF; m++)
#pragma unroll
        for (int f = 0; f < NF; f++)
#pragma unroll
            for (int q = 0; q < 4; q++) red[(warp * BM + 16 * m + (q / 2) * 8 + g) * BN + 8 * f + 2 * t + q % 2] = total[m][f][q];
    __syncthreads();
    float* outq = out + (long long)blockIdx.y * out_channels * ckk;
    for (int e = threadIdx.x; e < BM * BN; e += blockDim.x) {
        int oc = oc_base + e / BN, r = r0 + e % BN;
        float sum = red[e];
        for (int w = 1; w < CMW_WARPS; w++) sum += red[w * BM * BN + e];
        if (oc < out_channels && r < ckk) outq[(long long)oc * ckk + r] = sum;
    }
#else
    __trap();
#endif
}

#define CONV_MMA_WGRAD_PARAMS                                                                                                             \
    const float *__restrict__ x, const float *__restrict__ dz, float *__restrict__ out, int channels, int height, int width, int kh,   \
        int kw, int sh, int sw, int ph, int pw, int dh, int dw, int out_channels, int out_h, int out_w, int batch, int chunk, int tile, \
        int rows, int cols, int bands, int oc_tiles
#define CONV_MMA_WGRAD_ARGS \
    x, dz, out, channels, height, width, kh, kw, sh, sw, ph, pw, dh, dw, out_channels, out_h, out_w, batch, chunk, tile, rows, cols, bands, oc_tiles

// conv_mma_wgrad_<BM>_<arithmetic>: BM output channels × 1024 / BM taps a block (16 × 64,
// 32 × 32); tf32 one product of TF32 roundings, x3 the three of 3xTF32 (FP32's accuracy)
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_wgrad_16_tf32(CONV_MMA_WGRAD_PARAMS) {
    after_prior();
    conv_mma_wgrad_tile<1, 8, 1>(CONV_MMA_WGRAD_ARGS);
}
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_wgrad_32_tf32(CONV_MMA_WGRAD_PARAMS) {
    after_prior();
    conv_mma_wgrad_tile<2, 4, 1>(CONV_MMA_WGRAD_ARGS);
}
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_wgrad_16_x3(CONV_MMA_WGRAD_PARAMS) {
    after_prior();
    conv_mma_wgrad_tile<1, 8, 3>(CONV_MMA_WGRAD_ARGS);
}
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_wgrad_32_x3(CONV_MMA_WGRAD_PARAMS) {
    after_prior();
    conv_mma_wgrad_tile<2, 4, 3>(CONV_MMA_WGRAD_ARGS);
}
