// Tensor-core convolutions (src/cuda/conv_mma.rs), sm_80 and later: the forward as an implicit
// product on mma.sync m16n8k8 (TF32 inputs, FP32 sums). Layout and bands as conv_direct.cu's
// (whose conv_direct_band and conv_direct_copy it uses): x (batch, C, H, W), z (batch, OC, OH,
// OW), W (OC, C, kh, kw).
//
// The product of one sample: Z (M × N) = A (M × K) · B (K × N), M its output pixels, N the
// output channels, K = C·kh·kw, A[p][r] = x at tap r = (c, i, j) of pixel p (zero outside the
// image), B[r][oc] = W[oc][r]. A is never written out: a block stages the band of its tile of
// consecutive pixels (conv_direct_band) and a warp gathers its A fragments from it, pixel p's
// value of tap r at off(p) + tap(r), off(p) in registers, tap(r) in shared memory.
//
// PASSES 3 (FP32 layers): each value is split into its TF32 rounding and the rest (x = big +
// small, exactly), and small·big + big·small + big·big, in that order, recovers FP32's accuracy
// (small·small is below FP32's rounding), as the dense layers' tensor-core tiles do (dense.cu;
// their three helpers are repeated here as cm_split, cm_round and cm_mma, with the ideas, so
// that the two files can change apart). PASSES 1 (layers whose TF32 is on, alone): the values
// rounded to TF32, one product. The tensor cores round their sums toward zero, so each chunk's
// products are summed afresh and added to the thread's FP32 total with a rounded addition. An
// infinite input gives NaN outputs (its small part is NaN; a padded k multiplies it by zero)
// where the FP32 kernels would give ±inf. Every output is summed in one fixed order: the same
// inputs give the same bits, run after run.

// A block's warps, each 16·CMM_WM output pixels (consecutive) × all of the block's channels.
#define CMM_WARPS (REDUCE_THREADS / 32)
#define CMM_WM 2
#define CMM_TILE (CMM_WARPS * CMM_WM * 16)

// x = big + small: big its TF32 rounding (to nearest, ties away; as bits), small the rest,
// exactly, in FP32 (dense.cu's mma_split).
__device__ __forceinline__ void cm_split(float x, unsigned& big, unsigned& small) {
    big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(x - __uint_as_float(big));
}

// x's TF32 rounding (to nearest, ties away), as bits: the tensor cores would drop its low 13
// bits, rounding toward zero.
__device__ __forceinline__ unsigned cm_round(float x) {
    return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}

// d += a·b for one 16 × 8 tile over 8 values of k (fragments as PTX's m16n8k8 .tf32 lays them
// out: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); b0 (t, g), b1 (t + 4, g);
// d0 (g, 2t), d1 (g, 2t + 1), d2 (g + 8, 2t), d3 (g + 8, 2t + 1); g = lane / 4, t = lane % 4)
__device__ __forceinline__ void cm_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Z (batch, OC, OH, OW) = conv(X, W) without the bias, overwritten; BN = 8·NF output channels a
// block. Block: 256 threads, CMM_TILE = 256 consecutive output pixels p0.. of one sample (warp
// w the pixels p0 + 32w.., its two 16-row strips) × the channels oc_base..oc_base + BN. Grid x:
// (sample, pixel tile, channel tile), channel tile fastest.
//
// The input channels go by in chunks of `chunk` (the last the rest), K of a chunk kc = chunk·kh·kw
// rounded up to kc8, a multiple of 8. Dynamic shared memory (the host's count, at most 48 KB):
// tap[kc8] (ints), then two stages, each w_s [BN][kc8 + 4] (W of the chunk's channels; the pitch
// ≡ 4 mod 8 puts a warp's B reads, 8 channels × 4 k, on 32 banks) and the chunk's band x_s
// [chunk][rows][cols]; zero past OC, past the chunk's channels and past kc. Chunk k + 1 is copied
// (cp.async) into one stage while chunk k is summed from the other. A padded k (kc ≤ k < kc8)
// reads the pixel's own first tap, times a zero weight.
//
// Registers: 4·NF sums of the chunk and 4·NF totals per strip (64 at NF = 4), 4 pixel offsets,
// A's fragments (8, 16 with PASSES 3), B's of one fragment at a time (2, 4), addresses and loop
// counters: about 110 at NF = 4, within the 128 that the launch bounds' two blocks an SM leave a
// thread (ptxas -v for sm_80 and sm_90: 127 at NF = 4 with PASSES 3, 117 with PASSES 1, 75 to
// 91 below; no spills). Two blocks of at most 48 KB share an SM's shared memory.
//
// With `transposed` it computes a stride-1 layer's input gradient dX = conv(dZ, W'), as
// conv_direct_forward does (x is dZ, z is dX, `channels` the layer's OC, `out_channels` its C):
// W'[oc][c][i][j] = W[c][oc][kh − 1 − i][kw − 1 − j] read so while staging.
template <int NF, int PASSES>
__device__ __forceinline__ void conv_mma_tile(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ z, int channels,
                                              int height, int width, int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw,
                                              int out_channels, int out_h, int out_w, int chunk, int pixel_tiles, int oc_tiles,
                                              int transposed) {
#if __CUDA_ARCH__ >= 800
    constexpr int BN = 8 * NF;
    static_assert(PASSES == 1 || PASSES == 3, "TF32 or 3xTF32");
    extern __shared__ __align__(16) float cm_smem[];
    int ohw = out_h * out_w, taps = kh * kw, ckk = channels * taps;
    int ot = blockIdx.x % oc_tiles, pt = blockIdx.x / oc_tiles % pixel_tiles, s = blockIdx.x / oc_tiles / pixel_tiles;
    int p0 = pt * CMM_TILE, p_end = min(p0 + CMM_TILE, ohw), oc_base = ot * BN;
    ConvBand b = conv_direct_band(p0, p_end, out_w, kh, kw, sh, sw, ph, pw, dh, dw);
    int plane = b.rows * b.cols;
    int kc = chunk * taps, kc8 = (kc + 7) / 8 * 8, pitch = kc8 + 4, stage_floats = BN * pitch + chunk * plane;
    int* tap_s = reinterpret_cast<int*>(cm_smem);
    float* stages = cm_smem + kc8;
    for (int r = threadIdx.x; r < kc8; r += blockDim.x) {
        int c = r / taps, t = r - c * taps, i = t / kw, j = t - i * kw;
        tap_s[r] = r < kc ? c * plane + i * dh * b.cols + j * dw : 0;
    }
    const float* xs = x + (long long)s * channels * height * width;
    // Issues chunk k's copies into stage k % 2: consecutive threads read consecutive taps of a
    // channel's weights, consecutive pixels of a band row.
    auto stage = [&](int k) {
        float* w_s = stages + (k & 1) * stage_floats;
        float* x_s = w_s + BN * pitch;
        int c0 = k * chunk, n = min(chunk, channels - c0), span = n * taps;
        for (int e = threadIdx.x; e < BN * kc8; e += blockDim.x) {
            int o = e / kc8, r = e - o * kc8, oc = oc_base + o;
            bool valid = oc < out_channels && r < span;
            long long at = transposed ? ((long long)(c0 + r / taps) * out_channels + oc) * taps + taps - 1 - r % taps
                                      : (long long)oc * ckk + c0 * taps + r;
            conv_direct_copy(w_s + o * pitch + r, w + (valid ? at : 0), valid);
        }
        for (int e = threadIdx.x; e < chunk * plane; e += blockDim.x) {
            int c = e / plane, rc = e - c * plane, row = rc / b.cols;
            int iy = b.row0 + row, ix = b.col0 + rc - row * b.cols;
            bool in = c < n && iy >= 0 && iy < height && ix >= 0 && ix < width;
            conv_direct_copy(x_s + e, xs + (in ? ((long long)(c0 + c) * height + iy) * width + ix : 0), in);
        }
    };
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // the band offsets of the lane's pixels: strip m's rows g and g + 8 (0 past the tile's end:
    // any value in the band, its sums never stored)
    int off[CMM_WM][2];
#pragma unroll
    for (int m = 0; m < CMM_WM; m++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int p = p0 + warp * CMM_WM * 16 + m * 16 + h * 8 + g, oy = p / out_w, ox = p - oy * out_w;
            off[m][h] = p < p_end ? (oy - b.oy_first) * sh * b.cols + (ox - b.ox_lo) * sw : 0;
        }
    }
    float total[CMM_WM][NF][4];
#pragma unroll
    for (int m = 0; m < CMM_WM; m++)
#pragma unroll
        for (int f = 0; f < NF; f++) total[m][f][0] = total[m][f][1] = total[m][f][2] = total[m][f][3] = 0.0f;
    int chunks = (channels + chunk - 1) / chunk;
    stage(0);
    for (int k = 0; k < chunks; k++) {
        // this thread's copies of chunk k are complete, and past the barrier every thread's (and
        // the taps) are visible; every warp has summed chunk k − 1, so its stage is free
        conv_direct_copied();
        __syncthreads();
        if (k + 1 < chunks) stage(k + 1);
        const float* w_s = stages + (k & 1) * stage_floats + g * pitch + t;
        const float* x_s = stages + (k & 1) * stage_floats + BN * pitch;
        float acc[CMM_WM][NF][4];
#pragma unroll
        for (int m = 0; m < CMM_WM; m++)
#pragma unroll
            for (int f = 0; f < NF; f++) acc[m][f][0] = acc[m][f][1] = acc[m][f][2] = acc[m][f][3] = 0.0f;
        for (int k0 = 0; k0 < kc8; k0 += 8) {
            int t0 = tap_s[k0 + t], t1 = tap_s[k0 + t + 4];
            unsigned ab[CMM_WM][4], al[CMM_WM][4];
#pragma unroll
            for (int m = 0; m < CMM_WM; m++) {
                float v[4] = {x_s[off[m][0] + t0], x_s[off[m][1] + t0], x_s[off[m][0] + t1], x_s[off[m][1] + t1]};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if constexpr (PASSES == 3)
                        cm_split(v[q], ab[m][q], al[m][q]);
                    else
                        ab[m][q] = cm_round(v[q]);
                }
            }
#pragma unroll
            for (int f = 0; f < NF; f++) {
                // B[k0 + t][oc] and B[k0 + t + 4][oc], oc = oc_base + 8f + g
                float b0 = w_s[f * 8 * pitch + k0], b1 = w_s[f * 8 * pitch + k0 + 4];
                if constexpr (PASSES == 3) {
                    unsigned bb0, bl0, bb1, bl1;
                    cm_split(b0, bb0, bl0);
                    cm_split(b1, bb1, bl1);
#pragma unroll
                    for (int m = 0; m < CMM_WM; m++) {
                        cm_mma(acc[m][f], al[m], bb0, bb1);
                        cm_mma(acc[m][f], ab[m], bl0, bl1);
                        cm_mma(acc[m][f], ab[m], bb0, bb1);
                    }
                } else {
                    unsigned bb0 = cm_round(b0), bb1 = cm_round(b1);
#pragma unroll
                    for (int m = 0; m < CMM_WM; m++) cm_mma(acc[m][f], ab[m], bb0, bb1);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < CMM_WM; m++)
#pragma unroll
            for (int f = 0; f < NF; f++)
#pragma unroll
                for (int q = 0; q < 4; q++) total[m][f][q] += acc[m][f][q];
    }
    // d0..d3 of strip m, fragment f: pixels (g, g + 8), channels (2t, 2t + 1) of the fragment
    float* zs = z + (long long)s * out_channels * ohw;
#pragma unroll
    for (int m = 0; m < CMM_WM; m++) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            int p = p0 + warp * CMM_WM * 16 + m * 16 + (q / 2) * 8 + g;
            if (p >= p_end) continue;
#pragma unroll
            for (int f = 0; f < NF; f++) {
                int oc = oc_base + f * 8 + 2 * t + q % 2;
                if (oc < out_channels) zs[(long long)oc * ohw + p] = total[m][f][q];
            }
        }
    }
#else
    __trap();
#endif
}

#define CONV_MMA_PARAMS                                                                                                                 \
    const float *__restrict__ x, const float *__restrict__ w, float *__restrict__ z, int channels, int height, int width, int kh, int kw, \
        int sh, int sw, int ph, int pw, int dh, int dw, int out_channels, int out_h, int out_w, int chunk, int pixel_tiles,           \
        int oc_tiles, int transposed
#define CONV_MMA_ARGS \
    x, w, z, channels, height, width, kh, kw, sh, sw, ph, pw, dh, dw, out_channels, out_h, out_w, chunk, pixel_tiles, oc_tiles, transposed

// conv_mma_<BN>_<arithmetic>: BN channels a block; tf32 one product of TF32 roundings, x3 the
// three of 3xTF32 (FP32's accuracy)
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_8_tf32(CONV_MMA_PARAMS) {
    after_prior();
    conv_mma_tile<1, 1>(CONV_MMA_ARGS);
}
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_16_tf32(CONV_MMA_PARAMS) {
    after_prior();
    conv_mma_tile<2, 1>(CONV_MMA_ARGS);
}
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_32_tf32(CONV_MMA_PARAMS) {
    after_prior();
    conv_mma_tile<4, 1>(CONV_MMA_ARGS);
}
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_8_x3(CONV_MMA_PARAMS) {
    after_prior();
    conv_mma_tile<1, 3>(CONV_MMA_ARGS);
}
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_16_x3(CONV_MMA_PARAMS) {
    after_prior();
    conv_mma_tile<2, 3>(CONV_MMA_ARGS);
}
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void conv_mma_32_x3(CONV_MMA_PARAMS) {
    after_prior();
    conv_mma_tile<4, 3>(CONV_MMA_ARGS);
}
