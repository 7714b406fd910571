// Dense layers (src/layers/dense.rs): products with their element-wise work fused in, so a layer
// is one launch forward and at most two backward, instead of a cuBLAS call (often two kernels)
// plus separate bias, activation and reduction kernels.
//
// C (M × N) = A (M × K) · B (K × N), A(i, k) = A[i·a_rs + k·a_cs], B(k, j) = B[k·b_rs + j·b_cs],
// then one of three epilogues (`mode`):
//   0 forward:  c += bias[j]; out0[i·ldc + j] = c (z) if out0; out1[i·ldc + j] = act(c) (y) if out1
//   1 input gradient: if z_prev: c *= act'(z_prev[i·ldc + j], y_prev[i·ldc + j]); out0[i·ldc + j] = c
//   2 weight gradient: B has a column of ones at j == N − 1 (no memory read): for j < N − 1
//     out0[i·ldc + j] = c (dW), for j == N − 1 out1[i] = c (db = Σ_k A(i, k))
// Each output is summed over k in one fixed order, so results never depend on timing. The
// tensor-core tiles, on the same modes and epilogues, are in dense_mma.cu.

#define DENSE_FORWARD 0
#define DENSE_INPUT_GRAD 1
#define DENSE_WEIGHT_GRAD 2

// What the epilogue of output (i, j) reads besides c, loaded before the product so that it is
// not a round trip of its own at the end: forward, the bias bias[j] (in x); input gradient, when
// z_prev is given, z and y of the layer that made the input at (i, j); weight gradient, nothing.
// Only loads: act' is computed at the end, so that the loads do not hold up the product's.
__device__ __forceinline__ float2 dense_epilogue_in(int mode, int i, int j, int M, int N, int ldc, const float* bias, const float* z_prev,
                                                    const float* y_prev) {
    float2 e = make_float2(0.0f, 0.0f);
    if (i >= M || j >= N) return e;
    long long at = (long long)i * ldc + j;
    if (mode == DENSE_FORWARD) e.x = bias[j];
    if (mode == DENSE_INPUT_GRAD && z_prev) e = make_float2(z_prev[at], y_prev[at]);
    return e;
}

// e: dense_epilogue_in's value for (i, j); has_prev: the input gradient has a z_prev; add: a
// weight gradient's c is added (atomically) into dW or db instead of stored (a split tile's)
__device__ __forceinline__ void dense_store(int mode, int i, int j, float c, float2 e, bool has_prev, int N, int ldc, float* out0,
                                            float* out1, int act, float slope, bool add = false) {
    long long at = (long long)i * ldc + j;
    if (mode == DENSE_FORWARD) {
        c += e.x;
        if (out0) out0[at] = c;
        if (out1) out1[at] = act_apply(act, slope, c);
    } else if (mode == DENSE_INPUT_GRAD) {
        if (has_prev) c *= act_derivative(act, slope, e.x, e.y);
        out0[at] = c;
    } else {
        float* to = j < N - 1 ? out0 + at : out1 + i;
        if (add) {
            atomicAdd(to, c);
        } else {
            *to = c;
        }
    }
}

__device__ __forceinline__ float dense_b(int mode, const float* B, int b_rs, int b_cs, int k, int j, int N) {
    if (mode == DENSE_WEIGHT_GRAD && j == N - 1) return 1.0f;
    return B[(long long)k * b_rs + (long long)j * b_cs];
}

#define SKINNY_ROWS 8
// Values of k per thread whose B the row-chunked kernels read in one go at the start: K ≤ 1024
#define SKINNY_EARLY 4

template <int COLS>
__device__ __forceinline__ void dense_skinny_load_b(float (&bk)[SKINNY_EARLY][COLS], int mode, const float* B, int b_rs, int b_cs,
                                                    int j0, int N, int K) {
#pragma unroll
    for (int s = 0; s < SKINNY_EARLY; s++) {
        int k = threadIdx.x + s * REDUCE_THREADS;
#pragma unroll
        for (int c = 0; c < COLS; c++) bk[s][c] = k < K && j0 + c < N ? dense_b(mode, B, b_rs, b_cs, k, j0 + c, N) : 0.0f;
    }
}

// Rows in chunks of ROWS (8, or 1 for a product of one row), batches up to a few hundred
// samples: one block of 256 threads per chunk of rows and group of COLS output columns (1, 4 or
// 8: each row of A read then serves that many); the threads split k (coalesced reads of A's rows
// and of B's columns, fused multiply-adds), then each warp adds its 32 lanes in order and the
// block its 8 warps in order, through shared memory, so each value is summed in the same order
// whatever ROWS and COLS are. Grid: (ceil(N / COLS), ceil(M / ROWS)).
template <int ROWS, int COLS>
__device__ __forceinline__ void dense_skinny_cols(const float* A, int a_rs, int a_cs, const float* B, int b_rs, int b_cs, int M, int N,
                                                  int K, int mode, int ldc, const float* bias, float* out0, float* out1,
                                                  const float* z_prev, const float* y_prev, int act, float slope,
                                                  bool b_early) {
    // the lanes' sums go through shared memory up to 32 at a time (see below)
    constexpr int SUMS = ROWS * COLS, CHUNK = SUMS < 32 ? SUMS : 32;
    __shared__ float lanes[8][CHUNK][33];
    __shared__ float part[8][SUMS];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j0 = blockIdx.x * COLS, r0 = blockIdx.y * ROWS;
    int rows = min(ROWS, M - r0);
    A += (long long)r0 * a_rs;
    float acc[ROWS][COLS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int c = 0; c < COLS; c++) acc[r][c] = 0.0f;
    }
    // B for the thread's first SKINNY_EARLY values of k, and the epilogue's inputs of the
    // output it stores (the first ROWS × COLS threads store one each): with b_early, read
    // before waiting for the kernel ahead (they are then a layer's weights and bias, or
    // activations of the forward pass, which that kernel does not write: Gpu::dense in
    // src/cuda/ops.rs), so that their loads overlap it. Rows past M and columns past N read
    // nothing and add 0 to sums that are never stored.
    float bk[SKINNY_EARLY][COLS];
    float2 e = make_float2(0.0f, 0.0f);
    int er = threadIdx.x / COLS, ec = threadIdx.x % COLS;
    bool stores = threadIdx.x < ROWS * COLS;
    if (b_early) {
        dense_skinny_load_b<COLS>(bk, mode, B, b_rs, b_cs, j0, N, K);
        if (stores) e = dense_epilogue_in(mode, r0 + er, j0 + ec, M, N, ldc, bias, z_prev, y_prev);
    }
    after_prior();
    if (!b_early) {
        dense_skinny_load_b<COLS>(bk, mode, B, b_rs, b_cs, j0, N, K);
        if (stores) e = dense_epilogue_in(mode, r0 + er, j0 + ec, M, N, ldc, bias, z_prev, y_prev);
    }
#pragma unroll
    for (int s = 0; s < SKINNY_EARLY; s++) {
        int k = threadIdx.x + s * REDUCE_THREADS;
        if (k < K) {
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                float a = r < rows ? A[(long long)r * a_rs + (long long)k * a_cs] : 0.0f;
#pragma unroll
                for (int c = 0; c < COLS; c++) acc[r][c] = fmaf(a, bk[s][c], acc[r][c]);
            }
        }
    }
    for (int k = threadIdx.x + SKINNY_EARLY * REDUCE_THREADS; k < K; k += REDUCE_THREADS) {
        float b[COLS];
#pragma unroll
        for (int c = 0; c < COLS; c++) b[c] = j0 + c < N ? dense_b(mode, B, b_rs, b_cs, k, j0 + c, N) : 0.0f;
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float a = r < rows ? A[(long long)r * a_rs + (long long)k * a_cs] : 0.0f;
#pragma unroll
            for (int c = 0; c < COLS; c++) acc[r][c] = fmaf(a, b[c], acc[r][c]);
        }
    }
    // each warp adds its lanes' sums lane by lane: the sums go through shared memory (lane l's
    // at column l of each row), then lane v adds row v in order. A shuffle tree over every sum
    // took 320 instructions a warp at four columns against ~100 here, and the kernel is bound
    // by issuing them (`ncu`: 0.57 instructions a cycle a scheduler); rows padded to 33, so
    // neither the stores nor the loads conflict on banks. More than 32 sums go in chunks of 32.
#pragma unroll
    for (int c0 = 0; c0 < SUMS; c0 += CHUNK) {
#pragma unroll
        for (int q = 0; q < CHUNK; q++) lanes[warp][q][lane] = acc[(c0 + q) / COLS][(c0 + q) % COLS];
        __syncwarp();
        if (lane < CHUNK) {
            float v = lanes[warp][lane][0];
#pragma unroll
            for (int l = 1; l < 32; l++) v += lanes[warp][lane][l];
            part[warp][c0 + lane] = v;
        }
        __syncwarp();
    }
    __syncthreads();
    if (stores && er < rows && j0 + ec < N) {
        float v = 0.0f;
        for (int w = 0; w < 8; w++) v += part[w][er * COLS + ec];
        dense_store(mode, r0 + er, j0 + ec, v, e, z_prev, N, ldc, out0, out1, act, slope);
    }
}

extern "C" __global__ void dense_skinny(const float* A, int a_rs, int a_cs, const float* B, int b_rs, int b_cs, int M, int N, int K,
                                        int mode, int ldc, const float* bias, float* out0, float* out1, const float* z_prev,
                                        const float* y_prev, int act, float slope, int b_early) {
    dense_skinny_cols<SKINNY_ROWS, 1>(A, a_rs, a_cs, B, b_rs, b_cs, M, N, K, mode, ldc, bias, out0, out1, z_prev, y_prev, act, slope,
                                      b_early);
}

extern "C" __global__ void dense_skinny4(const float* A, int a_rs, int a_cs, const float* B, int b_rs, int b_cs, int M, int N, int K,
                                         int mode, int ldc, const float* bias, float* out0, float* out1, const float* z_prev,
                                         const float* y_prev, int act, float slope, int b_early) {
    dense_skinny_cols<SKINNY_ROWS, 4>(A, a_rs, a_cs, B, b_rs, b_cs, M, N, K, mode, ldc, bias, out0, out1, z_prev, y_prev, act, slope,
                                      b_early);
}

// Eight columns a block (wide products: each row of A read serves eight), at most 128 registers
// a thread so that two blocks fit on an SM.
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void dense_skinny8(const float* A, int a_rs, int a_cs, const float* B, int b_rs,
                                                                              int b_cs, int M, int N, int K, int mode, int ldc,
                                                                              const float* bias, float* out0, float* out1,
                                                                              const float* z_prev, const float* y_prev, int act,
                                                                              float slope, int b_early) {
    dense_skinny_cols<SKINNY_ROWS, 8>(A, a_rs, a_cs, B, b_rs, b_cs, M, N, K, mode, ldc, bias, out0, out1, z_prev, y_prev, act, slope,
                                      b_early);
}

extern "C" __global__ void dense_row(const float* A, int a_rs, int a_cs, const float* B, int b_rs, int b_cs, int M, int N, int K, int mode,
                                     int ldc, const float* bias, float* out0, float* out1, const float* z_prev, const float* y_prev,
                                     int act, float slope, int b_early) {
    dense_skinny_cols<1, 1>(A, a_rs, a_cs, B, b_rs, b_cs, M, N, K, mode, ldc, bias, out0, out1, z_prev, y_prev, act, slope, b_early);
}

#define PANEL_M 16
#define PANEL_N 32
#define PANEL_K 128

// A panel's values of B for one step of k (see dense_panel); the weight gradient's column of
// ones is never read
__device__ __forceinline__ void dense_panel_load_b(float (&rb)[PANEL_N * PANEL_K / REDUCE_THREADS], int mode, const float* b0,
                                                   long long b_step, int bj, int bdj, int bk, int bdk, int col0, int N, int kn) {
#pragma unroll
    for (int t = 0; t < PANEL_N * PANEL_K / REDUCE_THREADS; t++) {
        int j = bj + t * bdj, k = bk + t * bdk;
        bool ones = mode == DENSE_WEIGHT_GRAD && col0 + j == N - 1;
        rb[t] = (col0 + j < N && k < kn) ? (ones ? 1.0f : b0[t * b_step]) : 0.0f;
    }
}

// Panels (more than a few rows, and every weight gradient): a block computes a 16 × 32 tile of
// C. It stages the tile's rows of A and columns of B for 128 values of k at a time in shared
// memory (one wave of independent loads), then each thread sums its two outputs over those k in
// order, so a block waits out memory latency once per 128 values of k. At most 128 registers a
// thread, so that two blocks fit on an SM: with 190, one did, and the MLP's first weight
// gradient (200 blocks) ran in two waves on the H100's 132 SMs. Grid: (ceil(N/32), ceil(M/16)).
extern "C" __global__ __launch_bounds__(REDUCE_THREADS, 2) void dense_panel(const float* A, int a_rs, int a_cs, const float* B,
                                                                            int b_rs, int b_cs, int M, int N, int K, int mode,
                                                                            int ldc, const float* bias, float* out0, float* out1,
                                                                            const float* z_prev, const float* y_prev, int act,
                                                                            float slope, int b_early) {
    // rows padded to 18: each thread reads its two values of A as one aligned float2
    __shared__ __align__(8) float As[PANEL_K][PANEL_M + 2];
    __shared__ float Bs[PANEL_K][PANEL_N + 1];
    int col = threadIdx.x % PANEL_N, pair = threadIdx.x / PANEL_N;
    int row0 = blockIdx.y * PANEL_M, col0 = blockIdx.x * PANEL_N;
    float acc0 = 0.0f, acc1 = 0.0f;
    // the loads of a step: thread t's v-th value of A is row ai + v·adi, k ak + v·adk of the
    // step, at a0[v·a_step] (and likewise for B), so consecutive threads walk the stride-1
    // dimension of each
    int ai = a_cs == 1 ? threadIdx.x / PANEL_K : threadIdx.x % PANEL_M, ak = a_cs == 1 ? threadIdx.x % PANEL_K : threadIdx.x / PANEL_M;
    int adi = a_cs == 1 ? REDUCE_THREADS / PANEL_K : 0, adk = a_cs == 1 ? 0 : REDUCE_THREADS / PANEL_M;
    int bj = b_cs == 1 ? threadIdx.x % PANEL_N : threadIdx.x / PANEL_K, bk = b_cs == 1 ? threadIdx.x / PANEL_N : threadIdx.x % PANEL_K;
    int bdj = b_cs == 1 ? 0 : REDUCE_THREADS / PANEL_K, bdk = b_cs == 1 ? REDUCE_THREADS / PANEL_N : 0;
    long long a_step = (long long)adi * a_rs + (long long)adk * a_cs, b_step = (long long)bdk * b_rs + (long long)bdj * b_cs;
    const float* a0 = A + (long long)(row0 + ai) * a_rs + (long long)ak * a_cs;
    const float* b0 = B + (long long)bk * b_rs + (long long)(col0 + bj) * b_cs;
    // every load of a step is issued before any is stored, so the block waits out memory
    // latency once a step; with b_early the first step's B and the epilogue's inputs (as in
    // dense_skinny_cols) are read before waiting for the kernel ahead
    float ra[PANEL_M * PANEL_K / REDUCE_THREADS], rb[PANEL_N * PANEL_K / REDUCE_THREADS];
    int i = row0 + 2 * pair, j = col0 + col;
    float2 e0 = make_float2(0.0f, 0.0f), e1 = e0;
    if (b_early) {
        dense_panel_load_b(rb, mode, b0, b_step, bj, bdj, bk, bdk, col0, N, min(PANEL_K, K));
        e0 = dense_epilogue_in(mode, i, j, M, N, ldc, bias, z_prev, y_prev);
        e1 = dense_epilogue_in(mode, i + 1, j, M, N, ldc, bias, z_prev, y_prev);
    }
    after_prior();
    if (!b_early) {
        e0 = dense_epilogue_in(mode, i, j, M, N, ldc, bias, z_prev, y_prev);
        e1 = dense_epilogue_in(mode, i + 1, j, M, N, ldc, bias, z_prev, y_prev);
    }
    for (int k0 = 0; k0 < K; k0 += PANEL_K) {
        int kn = min(PANEL_K, K - k0);
#pragma unroll
        for (int t = 0; t < PANEL_M * PANEL_K / REDUCE_THREADS; t++) {
            int i = ai + t * adi, k = ak + t * adk;
            ra[t] = (row0 + i < M && k < kn) ? a0[t * a_step] : 0.0f;
        }
        if (k0 > 0 || !b_early) dense_panel_load_b(rb, mode, b0, b_step, bj, bdj, bk, bdk, col0, N, kn);
#pragma unroll
        for (int t = 0; t < PANEL_M * PANEL_K / REDUCE_THREADS; t++) As[ak + t * adk][ai + t * adi] = ra[t];
#pragma unroll
        for (int t = 0; t < PANEL_N * PANEL_K / REDUCE_THREADS; t++) Bs[bk + t * bdk][bj + t * bdj] = rb[t];
        a0 += (long long)PANEL_K * a_cs;
        b0 += (long long)PANEL_K * b_rs;
        __syncthreads();
        for (int k = 0; k < kn; k++) {
            float b = Bs[k][col];
            float2 a = *reinterpret_cast<const float2*>(&As[k][2 * pair]);
            acc0 += a.x * b;
            acc1 += a.y * b;
        }
        __syncthreads();
    }
    if (j < N) {
        if (i < M) dense_store(mode, i, j, acc0, e0, z_prev, N, ldc, out0, out1, act, slope);
        if (i + 1 < M) dense_store(mode, i + 1, j, acc1, e1, z_prev, N, ldc, out0, out1, act, slope);
    }
}
