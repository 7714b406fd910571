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
// (small·small is below FP32's rounding), as the dense layers' tensor-core tiles do, with their
// helpers (dense_mma.cu: mma_split, mma_round, mma_16x8x8). PASSES 1 (layers whose TF32 is on,
// alone): the values rounded to TF32 (a NaN stays a NaN), one product. The tensor cores round their sums toward zero, so each chunk's
// products are summed afresh and added to the thread's FP32 total with a rounded addition. An
// infinite input gives NaN outputs (its small part is NaN; a padded k multiplies it by zero)
// where the FP32 kernels would give ±inf. Every output is summed in one fixed order: the same
// inputs give the same bits, run after run.

// A block's warps, each 16·CMM_WM output pixels (consecutive) × all of the block's channels.
#define CMM_WARPS (REDUCE_THREADS / 32)
#define CMM_WM 2
#define CMM_TILE (CMM_WARPS * CMM_WM * 16)

// The lane's B of m16n8k8 fragments (N = 4: b0, b1 of two; N = 2: of one) by ldmatrix, from
// the addresses (shared) the lanes give: it moves 8 × 8 matrices of 16-bit values, which for
// 32-bit values are 8 × 4 matrices, row i of matrix q (16 bytes: 4 consecutive k of one
// channel) from lane 8q + i's address, element (g, t) to lane 4g + t's register q. Matrix q's
// rows are a fragment's 8 channels at k0 + 4(q % 2).., so register q is b0 (t, g) for even q,
// b1 (t + 4, g) for odd q.
template <int N>
__device__ __forceinline__ void cm_ldmatrix(unsigned (&r)[N], unsigned at) {
    static_assert(N == 2 || N == 4, "x2 or x4");
#if __CUDA_ARCH__ >= 800
    if constexpr (N == 4)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(at));
#endif
}

// Z (batch, OC, OH, OW) = conv(X, W) without the bias, overwritten; BN = 8·NF output channels a
// block. Block: 256 threads, CMM_TILE = 256 consecutive output pixels p0.. of one sample (warp
// w the pixels p0 + 32w.., its two 16-row strips) × the channels oc_base..oc_base + BN. Grid x:
// (sample, pixel tile, channel tile), channel tile fastest.
//
// The input channels go by in chunks of `chunk` (the last the rest), K of a chunk kc = chunk·kh·kw
// rounded up to kc8, a multiple of 8. Dynamic shared memory (the host's count, at most 48 KB):
// the taps' byte offsets tap_s[kc8] (ints, a lane's two of a k-step side by side: one 8-byte
// read), then two stages of a multiple of 4 floats (16-byte aligned, as ldmatrix's rows must
// be), each w_s [BN][kc8 + 4] (W of the chunk's channels; the pitch ≡ 4 mod 8 puts an ldmatrix
// phase, 8 rows of 4 k, on 32 banks) and the chunk's band x_s [chunk][rows][cols]; zero past OC,
// past the chunk's channels and past kc (the pitch's last 4 too). Chunk k + 1 is copied (cp.async) into one stage while
// chunk k is summed from the other; with PASSES 1 each thread rounds its own copies of chunk k
// to TF32 in place once they land, before the barrier, so that a value gathered by several
// lanes and taps is rounded once. A padded k (kc ≤ k < kc8) reads the pixel's own first tap,
// times a zero weight.
//
// A k-step (8 of K) of a warp: one 8-byte read of its lanes' taps, 4 gathered A values a strip
// (scalar reads, one add of offsets each), and B of two fragments by one ldmatrix.x4 (x2 at
// NF = 1), for CMM_WM·NF products (×3 with PASSES 3): at NF = 2, 11 shared-memory reads for 4
// products, where a scalar read of each B value took 14 (and 12 roundings).
//
// Registers: 4·NF sums of the chunk and 4·NF totals per strip (64 at NF = 4), 4 pixel offsets,
// A's fragments (8, 16 with PASSES 3), B's of two fragments at a time (4, 8 split), addresses
// and loop counters, within the 128 that the launch bounds' two blocks an SM leave a thread
// (ptxas -v for sm_90 on NVRTC's PTX: 128 at NF = 4 with PASSES 3 and 1, 97 and 100 at NF = 2,
// 85 and 94 at NF = 1; no spills). Two blocks of at most 48 KB share an SM's shared memory.
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
    static_assert(NF == 1 || NF % 2 == 0, "B by pairs of fragments, or one");
    // ldmatrix.x4 moves two fragments' B, x2 one
    constexpr int PER_LOAD = NF == 1 ? 1 : 2;
    extern __shared__ __align__(16) float cm_smem[];
    int ohw = out_h * out_w, taps = kh * kw, ckk = channels * taps;
    int ot = blockIdx.x % oc_tiles, pt = blockIdx.x / oc_tiles % pixel_tiles, s = blockIdx.x / oc_tiles / pixel_tiles;
    int p0 = pt * CMM_TILE, p_end = min(p0 + CMM_TILE, ohw), oc_base = ot * BN;
    ConvBand b = conv_direct_band(p0, p_end, out_w, kh, kw, sh, sw, ph, pw, dh, dw);
    int plane = b.rows * b.cols;
    int kc = chunk * taps, kc8 = (kc + 7) / 8 * 8, pitch = kc8 + 4, stage_floats = (BN * pitch + chunk * plane + 3) / 4 * 4;
    int* tap_s = reinterpret_cast<int*>(cm_smem);
    float* stages = cm_smem + kc8;
    // tap_s[k0 + 2t + h] = 4·tap(k0 + t + 4h): lane (g, t)'s taps of k-step k0 at k0 + 2t
    for (int e = threadIdx.x; e < kc8; e += blockDim.x) {
        int r = e / 8 * 8 + e % 8 / 2 + e % 2 * 4, c = r / taps, tp = r - c * taps, i = tp / kw, j = tp - i * kw;
        tap_s[e] = r < kc ? 4 * (c * plane + i * dh * b.cols + j * dw) : 0;
    }
    const float* xs = x + (long long)s * channels * height * width;
    // Issues this thread's copies of chunk k into stage k % 2 (cp.async): w_s[o][r] (the pitch's
    // last 4 too, zero), then x_s[c][row][col], the elements e = threadIdx.x, + blockDim.x, ...
    // of each; consecutive threads take consecutive taps of a channel's weights, consecutive
    // pixels of a band row. The indices are e's digits, stepped: no division an element (but W'
    // of `transposed`, whose tap r is r / taps, r % taps).
    auto stage = [&](int k) {
        float* w_s = stages + (k & 1) * stage_floats;
        float* x_s = w_s + BN * pitch;
        int c0 = k * chunk, n = min(chunk, channels - c0), span = n * taps, step = blockDim.x;
        int so = step / pitch, sr = step - so * pitch;
        int o = threadIdx.x / pitch, r = threadIdx.x - o * pitch;
        for (float* dst = w_s + threadIdx.x; o < BN; dst += step) {
            int oc = oc_base + o;
            bool valid = oc < out_channels && r < span;
            long long at = (long long)oc * ckk + c0 * taps + r;
            if (transposed) at = ((long long)(c0 + r / taps) * out_channels + oc) * taps + taps - 1 - r % taps;
            conv_direct_copy(dst, w + (valid ? at : 0), valid);
            o += so, r += sr;
            if (r >= pitch) r -= pitch, o++;
        }
        int sc = step / plane, srow = (step - sc * plane) / b.cols, scol = step - sc * plane - srow * b.cols;
        int c = threadIdx.x / plane, row = (threadIdx.x - c * plane) / b.cols, col = threadIdx.x - c * plane - row * b.cols;
        for (float* dst = x_s + threadIdx.x; c < chunk; dst += step) {
            int iy = b.row0 + row, ix = b.col0 + col;
            bool in = c < n && iy >= 0 && iy < height && ix >= 0 && ix < width;
            conv_direct_copy(dst, xs + (in ? ((long long)(c0 + c) * height + iy) * width + ix : 0), in);
            c += sc, row += srow, col += scol;
            if (col >= b.cols) col -= b.cols, row++;
            if (row >= b.rows) row -= b.rows, c++;
        }
    };
    // Rounds this thread's copies of chunk k, landed, to TF32 in place (the same elements e).
    auto round_staged = [&](int k) {
        float* w_s = stages + (k & 1) * stage_floats;
        for (int e = threadIdx.x; e < BN * pitch; e += blockDim.x) w_s[e] = __uint_as_float(mma_round(w_s[e]));
        float* x_s = w_s + BN * pitch;
        for (int e = threadIdx.x; e < chunk * plane; e += blockDim.x) x_s[e] = __uint_as_float(mma_round(x_s[e]));
    };
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // the byte offsets (from cm_smem) of the lane's pixels in stage 0's band: strip m's rows g
    // and g + 8 (the band's start past the tile's end: any value in it, its sums never stored)
    int at[CMM_WM][2];
#pragma unroll
    for (int m = 0; m < CMM_WM; m++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int p = p0 + warp * CMM_WM * 16 + m * 16 + h * 8 + g, oy = p / out_w, ox = p - oy * out_w;
            int off = p < p_end ? (oy - b.oy_first) * sh * b.cols + (ox - b.ox_lo) * sw : 0;
            at[m][h] = 4 * (kc8 + BN * pitch + off);
        }
    }
    // the row of stage 0's w_s whose address the lane gives ldmatrix: matrix q = lane / 8 is
    // fragment q / 2 of the pair (its channels 8(q / 2)..), k 4(q % 2).. of the k-step, row
    // lane % 8; at NF = 1 lanes 16.. repeat lanes 0..15 (x2 reads no address of theirs)
    unsigned w_at = (unsigned)__cvta_generic_to_shared(stages + ((NF > 1 ? lane / 16 * 8 : 0) + lane % 8) * pitch + lane / 8 % 2 * 4);
    float total[CMM_WM][NF][4];
#pragma unroll
    for (int m = 0; m < CMM_WM; m++)
#pragma unroll
        for (int f = 0; f < NF; f++) total[m][f][0] = total[m][f][1] = total[m][f][2] = total[m][f][3] = 0.0f;
    int chunks = (channels + chunk - 1) / chunk;
    stage(0);
    const char* sm = reinterpret_cast<const char*>(cm_smem);
    const int2* tap2 = reinterpret_cast<const int2*>(cm_smem) + t;
    for (int k = 0; k < chunks; k++) {
        // this thread's copies of chunk k are complete (and, with PASSES 1, rounded), and past
        // the barrier every thread's (and the taps) are visible; every warp has summed chunk
        // k − 1, so its stage is free
        conv_direct_copied();
        if (PASSES == 1) round_staged(k);
        __syncthreads();
        if (k + 1 < chunks) stage(k + 1);
        float acc[CMM_WM][NF][4];
#pragma unroll
        for (int m = 0; m < CMM_WM; m++)
#pragma unroll
            for (int f = 0; f < NF; f++) acc[m][f][0] = acc[m][f][1] = acc[m][f][2] = acc[m][f][3] = 0.0f;
        for (int k0 = 0; k0 < kc8; k0 += 8) {
            int2 tp = tap2[k0 / 2];
            unsigned ab[CMM_WM][4], al[CMM_WM][4];
#pragma unroll
            for (int m = 0; m < CMM_WM; m++) {
                int a0 = at[m][0], a1 = at[m][1];
                float v[4] = {*reinterpret_cast<const float*>(sm + a0 + tp.x), *reinterpret_cast<const float*>(sm + a1 + tp.x),
                              *reinterpret_cast<const float*>(sm + a0 + tp.y), *reinterpret_cast<const float*>(sm + a1 + tp.y)};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if constexpr (PASSES == 3)
                        mma_split<false>(v[q], ab[m][q], al[m][q]);
                    else
                        ab[m][q] = __float_as_uint(v[q]);
                }
            }
#pragma unroll
            for (int f0 = 0; f0 < NF; f0 += PER_LOAD) {
                // B[k0 + t][oc] and B[k0 + t + 4][oc] of fragments f0.., oc = oc_base + 8f + g
                unsigned bw[2 * PER_LOAD];
                cm_ldmatrix(bw, w_at + 4 * (f0 * 8 * pitch + k0));
#pragma unroll
                for (int h = 0; h < PER_LOAD; h++) {
                    int f = f0 + h;
                    if constexpr (PASSES == 3) {
                        unsigned bb0, bl0, bb1, bl1;
                        mma_split<false>(__uint_as_float(bw[2 * h]), bb0, bl0);
                        mma_split<false>(__uint_as_float(bw[2 * h + 1]), bb1, bl1);
#pragma unroll
                        for (int m = 0; m < CMM_WM; m++) {
                            mma_16x8x8(acc[m][f], al[m], bb0, bb1);
                            mma_16x8x8(acc[m][f], ab[m], bl0, bl1);
                            mma_16x8x8(acc[m][f], ab[m], bb0, bb1);
                        }
                    } else {
#pragma unroll
                        for (int m = 0; m < CMM_WM; m++) mma_16x8x8(acc[m][f], ab[m], bw[2 * h], bw[2 * h + 1]);
                    }
                }
            }
        }
#pragma unroll
        for (int m = 0; m < CMM_WM; m++)
#pragma unroll
            for (int f = 0; f < NF; f++)
#pragma unroll
                for (int q = 0; q < 4; q++) total[m][f][q] += acc[m][f][q];
        // the next chunk's stage
        int shift = k & 1 ? -4 * stage_floats : 4 * stage_floats;
#pragma unroll
        for (int m = 0; m < CMM_WM; m++) at[m][0] += shift, at[m][1] += shift;
        w_at += shift;
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
