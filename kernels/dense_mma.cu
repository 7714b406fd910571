// Dense layers' tensor-core tiles: the products of dense.cu on mma.sync, with its operands, modes
// and epilogues (DENSE_*, dense_epilogue_in, dense_store), so this file comes after dense.cu in
// source_files() (src/cuda/context.rs), and ahead of wgrad.cu, which uses its asynchronous copies.
// Host side: MmaTile in src/cuda/dense.rs.
//
// Tensor-core tiles (sm_80 and later): large products, such as a first layer's forward over
// k = 784 and its weight gradient over a batch of hundreds. A block of MMA_THREADS computes a
// BM × BN tile of C over all of k, streaming A's and B's slices of MMA_KC values of k through
// MMA_STAGES buffers in (dynamic) shared memory with 16-byte asynchronous copies, so that
// several slices are in flight while one is summed. Two layouts, chosen on the host, each
// with its epilogue: forward (A and B contiguous along k: X and a layer's W) and weight gradient
// (A contiguous along m, B along n: dZᵀ and X); the host also checks that the operands are
// 16-byte aligned.
//
// Each warp sums a 16-row strip of the tile over every WK-th group of eight values of k of a
// slice with mma.sync (m16n8k8, TF32 inputs, FP32 sums) in three products, the 3xTF32 scheme:
// each value is split into its TF32 rounding and what that leaves out, and small·big +
// big·small + big·big recovers FP32's accuracy (small·small is below FP32's rounding; the
// tensor cores read a register as TF32 by ignoring its low 13 bits, so the small part is
// passed as it is). The `_tf32` kernels, for models that allow TF32 (src/cuda/dense.rs offers
// them only there), take big·big alone, one product as cuBLAS's TF32 GEMMs: a third of the
// tensor-core work, each product within about 2^-10 of |a·b| (both inputs rounded to 11
// significant bits). The tensor cores round their sums toward zero, so each slice's products are
// summed afresh and added to the warp's FP32 total with an ordinary (rounded) addition. The
// warps' totals are then added in order through shared memory: each output is summed in one
// fixed order. Grid: (ceil(N / BN), SPLIT · ceil(M / BM)).
//
// SPLIT 2 (a weight gradient's epilogue only): a tile's slices are shared by two blocks (along
// y), the first half of them (rounded up) to the block of rank 0, so that each block's chain of
// slices is half as long and the GPU holds twice the blocks; each block adds its sums into dW
// and db with atomic adds, which the host has cleared (src/cuda/head.rs, DenseEpilogue): two
// addends to a zero give the same bits in either order, so the result does not depend on which
// block lands first. (Exchanging the halves through a cluster's shared memory instead, a pull
// after cluster barriers, was slower: the barriers cost each block time at its end.)
#define MMA_THREADS 256  // the host's BLOCK
#define MMA_KC 64
#define MMA_STAGES 4

// x = big + small: big its TF32 rounding (to nearest, ties away; as bits), small the rest,
// exactly, in FP32. Infinities (and values within a TF32 step of overflow) give a NaN small
// part, so such inputs make NaN outputs where the FP32 kernels would give ±inf. With TF32 (one
// product), big alone (small is not written), rounded so that a NaN stays a NaN: the integer
// rounding makes the GPU's NaN, 0x7fffffff, −0, which only the small part makes up for.
__device__ __forceinline__ unsigned mma_round(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

template <bool TF32>
__device__ __forceinline__ void mma_split(float x, unsigned& big, unsigned& small) {
    if constexpr (TF32) {
        big = mma_round(x);
    } else {
        big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
        small = __float_as_uint(x - __uint_as_float(big));
    }
}

// d += a·b for one 16 × 8 tile over 8 values of k (fragments as PTX's m16n8k8 .tf32 lays them out)
__device__ __forceinline__ void mma_16x8x8(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Copies `bytes` (0 to 16) bytes from global into shared memory and zero-fills the rest of the
// 16, asynchronously (cp.async, one group a slice: mma_commit, mma_wait)
__device__ __forceinline__ void mma_copy(unsigned dst, const float* src, int bytes) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void mma_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most N of this thread's groups of copies are still in flight
template <int N>
__device__ __forceinline__ void mma_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Floats of one operand's slice buffer: [r][k] (rows padded to MMA_KC + 8) when the operand is
// contiguous along k (KM), else [k][r] (rows padded to TR + 8); both paddings keep a warp's
// fragment loads free of bank conflicts (along k they are 8 bytes: see dense_mma_tile).
// MmaTile::shared_bytes in src/cuda/dense.rs mirrors this.
template <int TR, bool KM>
__device__ __forceinline__ constexpr int mma_at(int r, int k) {
    return KM ? r * (MMA_KC + 8) + k : k * (TR + 8) + r;
}

template <int TR, bool KM>
__device__ __forceinline__ constexpr int mma_buf() {
    return KM ? mma_at<TR, KM>(TR, 0) : mma_at<TR, KM>(0, MMA_KC);
}

// One operand's share of a thread in every slice: V runs of four values, each a 16-byte copy.
// (r, k) of the operand is X[r·rs + k·cs]; rows r0 .. r0 + TR of R, k up to K; what lies outside
// is zero-filled. Along k (KM) a run is four values of k of one row; else four rows at one k.
template <int TR, bool KM>
struct MmaOperand {
    static constexpr int V = TR * MMA_KC / 4 / MMA_THREADS;
    const float* src[V];  // the run at slice 0
    int at[V];            // where it lands in a slice buffer
    int k[V];             // its k within a slice
    int bytes[V];         // KM: 16 if its row is inside R, else 0; else the bytes of its rows inside R
    long long step;       // the offset from one slice to the next

    __device__ __forceinline__ MmaOperand(const float* X, int rs, int cs, int R, int r0) {
        step = (long long)MMA_KC * (KM ? 1 : cs);
#pragma unroll
        for (int v = 0; v < V; v++) {
            int e = threadIdx.x + v * MMA_THREADS;
            int r = KM ? e / (MMA_KC / 4) : (e % (TR / 4)) * 4;
            k[v] = KM ? (e % (MMA_KC / 4)) * 4 : e / (TR / 4);
            at[v] = mma_at<TR, KM>(r, k[v]);
            bytes[v] = KM ? (r0 + r < R ? 16 : 0) : 4 * min(max(R - (r0 + r), 0), 4);
            src[v] = bytes[v] > 0 ? X + (long long)(r0 + r) * rs + (long long)k[v] * cs : X;
        }
    }

    // the copies of slice s into the buffer at shared address buf
    __device__ __forceinline__ void load(unsigned buf, int s, int K) const {
        int k0 = s * MMA_KC;
#pragma unroll
        for (int v = 0; v < V; v++) {
            int left = K - (k0 + k[v]);
            int n = KM ? min(max(left, 0), 4) * (bytes[v] / 4) : (left > 0 ? bytes[v] : 0);
            mma_copy(buf + 4 * at[v], n > 0 ? src[v] + s * step : src[v], n);
        }
    }
};

// TF32: one product a fragment (the `_tf32` kernels), else three (see above)
template <int BM, int BN, bool AK, bool BK, int SPLIT, bool TF32>
__device__ __forceinline__ void dense_mma_tile(const float* A, int a_rs, int a_cs, const float* B, int b_rs, int b_cs, int M, int N, int K,
                                               int, int ldc, const float* bias, float* out0, float* out1, const float* z_prev,
                                               const float* y_prev, int act, float slope, bool b_early) {
#if __CUDA_ARCH__ >= 800
    constexpr int WM = BM / 16, WK = (MMA_THREADS / 32) / WM, FRAGS = BN / 8, OUTS = BM * BN / MMA_THREADS;
    constexpr int A_SIZE = mma_buf<BM, AK>(), STAGE = A_SIZE + mma_buf<BN, BK>();
    static_assert(WM * WK * 32 == MMA_THREADS && (MMA_KC / 8) % WK == 0 && BN % 8 == 0 && BM * BN % MMA_THREADS == 0, "tile shape");
    static_assert(WK * BM * (BN + 1) <= MMA_STAGES * STAGE, "the warps' sums fit in the buffers");
    static_assert(SPLIT == 1 || SPLIT == 2, "one block or two a tile");
    // The epilogue follows from the layout (the host checks), known when compiled, not read
    // from `mode`: so the MLP's step was faster at every batch measured (with the mode read at
    // run time, merely storing the split tile's sums through the general call was slower; with
    // it known, that one call for every tile costs what the two did).
    constexpr int mode = AK ? DENSE_FORWARD : DENSE_WEIGHT_GRAD;
    extern __shared__ __align__(16) float smem[];
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < 4u * MMA_STAGES * STAGE) __trap();  // the host gave less shared memory than the tile needs
    unsigned base = (unsigned)__cvta_generic_to_shared(smem);
    int m0 = (blockIdx.y / SPLIT) * BM, n0 = blockIdx.x * BN, rank = blockIdx.y % SPLIT;
    // the weight gradient's column of ones (j == N − 1) is not in B: it is written into the
    // slices of the block that holds it once they have landed
    int ones = mode == DENSE_WEIGHT_GRAD && N - 1 >= n0 && N - 1 < n0 + BN ? N - 1 - n0 : -1;
    MmaOperand<BM, AK> a_in(A, a_rs, a_cs, M, m0);
    MmaOperand<BN, BK> b_in(B, b_cs, b_rs, mode == DENSE_WEIGHT_GRAD ? N - 1 : N, n0);
    // this block's slices: first, first + 1, …, first + slices − 1
    int all = (K + MMA_KC - 1) / MMA_KC, per = (all + SPLIT - 1) / SPLIT;
    int first = SPLIT > 1 ? min(rank * per, all) : 0, slices = SPLIT > 1 ? min(per, all - first) : all;
    float2 e[OUTS];
    auto epilogue_in = [&]() {
#pragma unroll
        for (int q = 0; q < OUTS; q++) {
            int o = threadIdx.x + q * MMA_THREADS;
            e[q] = dense_epilogue_in(mode, m0 + o / BN, n0 + o % BN, M, N, ldc, bias, z_prev, y_prev);
        }
    };
    // the first slices' B (and the epilogue's inputs) before the wait with b_early (see
    // dense_skinny_cols in dense.cu); each slice's copies are one group, A's joining B's
    if (b_early) {
        for (int s = 0; s < MMA_STAGES - 1 && s < slices; s++) b_in.load(base + 4 * (s * STAGE + A_SIZE), first + s, K);
        epilogue_in();
    }
    after_prior(SPLIT == 1);
    if (!b_early) epilogue_in();
    for (int s = 0; s < MMA_STAGES - 1; s++) {
        if (s < slices) {
            if (!b_early) b_in.load(base + 4 * (s * STAGE + A_SIZE), first + s, K);
            a_in.load(base + 4 * s * STAGE, first + s, K);
        }
        mma_commit();
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int wm = warp % WM, wk = warp / WM;
    // The lane's first fragment values in a slice (its steps to the others are constants).
    // Along k (forward layout) the fragments' k t and t + 4 of a group of eight are taken from
    // k 2t and 2t + 1 of A and of B alike (the same products, summed in another order), so that
    // each pair is one 8-byte load.
    //
    // In the weight gradient's layout (A along m, B along n) the pairs are along m and n
    // instead: the fragment's rows g and g + 8 are the strip's rows 2g and 2g + 1, and column
    // g of fragments 2h and 2h + 1 is the tile's columns 16h + 2g and 16h + 2g + 1 (which
    // outputs a fragment's sums are is the tile's choice), so that again each pair is one
    // 8-byte load.
    constexpr bool PAIRS = AK && BK, MN_PAIRS = !AK && !BK;
    static_assert(PAIRS || MN_PAIRS, "the forward's layout or the weight gradient's");
    static_assert(!MN_PAIRS || FRAGS % 2 == 0, "fragments in pairs");
    int kt = PAIRS ? 2 * t : t;
    int a0 = mma_at<BM, AK>(wm * 16 + (MN_PAIRS ? 2 * g : g), wk * 8 + kt), b0 = A_SIZE + mma_at<BN, BK>(MN_PAIRS ? 2 * g : g, wk * 8 + kt);
    float total[FRAGS][4];
#pragma unroll
    for (int f = 0; f < FRAGS; f++) total[f][0] = total[f][1] = total[f][2] = total[f][3] = 0.0f;
    for (int c = 0; c < slices; c++) {
        mma_wait<MMA_STAGES - 2>();
        __syncthreads();
        float* buf = smem + (c % MMA_STAGES) * STAGE;
        if (ones >= 0) {
            for (int k = threadIdx.x; k < MMA_KC; k += MMA_THREADS) buf[A_SIZE + mma_at<BN, BK>(ones, k)] = (first + c) * MMA_KC + k < K ? 1.0f : 0.0f;
            __syncthreads();
        }
        // the slice MMA_STAGES − 1 ahead, into the buffer every warp has finished with
        int next = c + MMA_STAGES - 1;
        if (next < slices) {
            unsigned nb = base + 4 * (next % MMA_STAGES) * STAGE;
            b_in.load(nb + 4 * A_SIZE, first + next, K);
            a_in.load(nb, first + next, K);
        }
        mma_commit();
        float acc[FRAGS][4];
#pragma unroll
        for (int f = 0; f < FRAGS; f++) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.0f;
#pragma unroll
        for (int s = 0; s < MMA_KC / 8 / WK; s++) {
            const float* as = buf + a0 + mma_at<BM, AK>(0, s * WK * 8);
            const float* bs = buf + b0 + mma_at<BN, BK>(0, s * WK * 8);
            unsigned ab[4], al[4], bb[FRAGS][2], bl[FRAGS][2];
            if constexpr (PAIRS) {
                float2 a_lo = *(const float2*)as, a_hi = *(const float2*)(as + mma_at<BM, AK>(8, 0));
                mma_split<TF32>(a_lo.x, ab[0], al[0]);
                mma_split<TF32>(a_hi.x, ab[1], al[1]);
                mma_split<TF32>(a_lo.y, ab[2], al[2]);
                mma_split<TF32>(a_hi.y, ab[3], al[3]);
            } else {
                float2 a_t = *(const float2*)as, a_t4 = *(const float2*)(as + mma_at<BM, AK>(0, 4));
                mma_split<TF32>(a_t.x, ab[0], al[0]);
                mma_split<TF32>(a_t.y, ab[1], al[1]);
                mma_split<TF32>(a_t4.x, ab[2], al[2]);
                mma_split<TF32>(a_t4.y, ab[3], al[3]);
            }
            if constexpr (PAIRS) {
#pragma unroll
                for (int f = 0; f < FRAGS; f++) {
                    float2 b = *(const float2*)(bs + mma_at<BN, BK>(8 * f, 0));
                    mma_split<TF32>(b.x, bb[f][0], bl[f][0]);
                    mma_split<TF32>(b.y, bb[f][1], bl[f][1]);
                }
            } else {
#pragma unroll
                for (int f = 0; f < FRAGS; f += 2) {
                    float2 b_t = *(const float2*)(bs + mma_at<BN, BK>(8 * f, 0)), b_t4 = *(const float2*)(bs + mma_at<BN, BK>(8 * f, 4));
                    mma_split<TF32>(b_t.x, bb[f][0], bl[f][0]);
                    mma_split<TF32>(b_t4.x, bb[f][1], bl[f][1]);
                    mma_split<TF32>(b_t.y, bb[f + 1][0], bl[f + 1][0]);
                    mma_split<TF32>(b_t4.y, bb[f + 1][1], bl[f + 1][1]);
                }
            }
            // the three products of each fragment apart, so that consecutive ones add into
            // different sums and need not wait for each other; with TF32 the last alone
            if constexpr (!TF32) {
#pragma unroll
                for (int f = 0; f < FRAGS; f++) mma_16x8x8(acc[f], al, bb[f][0], bb[f][1]);
#pragma unroll
                for (int f = 0; f < FRAGS; f++) mma_16x8x8(acc[f], ab, bl[f][0], bl[f][1]);
            }
#pragma unroll
            for (int f = 0; f < FRAGS; f++) mma_16x8x8(acc[f], ab, bb[f][0], bb[f][1]);
        }
#pragma unroll
        for (int f = 0; f < FRAGS; f++) {
#pragma unroll
            for (int q = 0; q < 4; q++) total[f][q] += acc[f][q];
        }
    }
    // a split tile's grid holds two blocks an SM: the next kernel's blocks may be resident
    // only once each block has done its products
    if (SPLIT > 1) next_may_launch();
    mma_wait<0>();
    __syncthreads();
    // the warps' totals through shared memory, added in the order of their groups of k
    float* sums = smem;
#pragma unroll
    for (int f = 0; f < FRAGS; f++) {
        // the tile's row of the fragment's row g, and the next one's (g + 8); its column of the
        // fragment's column 2t, and the next one's (2t + 1)
        int r = wk * BM + wm * 16 + (MN_PAIRS ? 2 * g : g), r_next = MN_PAIRS ? 1 : 8;
        int col = MN_PAIRS ? (f / 2) * 16 + 4 * t + f % 2 : f * 8 + 2 * t, col_next = MN_PAIRS ? 2 : 1;
        sums[r * (BN + 1) + col] = total[f][0];
        sums[r * (BN + 1) + col + col_next] = total[f][1];
        sums[(r + r_next) * (BN + 1) + col] = total[f][2];
        sums[(r + r_next) * (BN + 1) + col + col_next] = total[f][3];
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < OUTS; q++) {
        int o = threadIdx.x + q * MMA_THREADS, r = o / BN, col = o % BN;
        float v = sums[r * (BN + 1) + col];
#pragma unroll
        for (int w = 1; w < WK; w++) v += sums[(w * BM + r) * (BN + 1) + col];
        // a split tile's half (a weight gradient's: the host checks) added into dW or db,
        // cleared by the host, as the other block's is
        if (m0 + r < M && n0 + col < N) dense_store(mode, m0 + r, n0 + col, v, e[q], z_prev, N, ldc, out0, out1, act, slope, SPLIT > 1);
    }
#else
    __trap();
#endif
}

// dense_mma_BMxBN_kk: A and B contiguous along k (forward); _mn: A along m, B along n (weight
// gradient); dense_mma_32x32_mn2: the latter, a tile's slices split over two blocks (a candidate
// like the others, src/cuda/dense.rs, MmaTile). Each in two kernels: 3xTF32, and with `_tf32` one TF32 product (models that allow TF32).
#define DENSE_MMA_ENTRY(BM, BN, NAME, AK, SPLIT, TF32, SUFFIX)                                                                    \
    extern "C" __global__ __launch_bounds__(MMA_THREADS) void dense_mma_##BM##x##BN##_##NAME##SUFFIX(                             \
        const float* A, int a_rs, int a_cs, const float* B, int b_rs, int b_cs, int M, int N, int K, int mode, int ldc,          \
        const float* bias, float* out0, float* out1, const float* z_prev, const float* y_prev, int act, float slope, int b_early) { \
        dense_mma_tile<BM, BN, AK, AK, SPLIT, TF32>(A, a_rs, a_cs, B, b_rs, b_cs, M, N, K, mode, ldc, bias, out0, out1, z_prev,     \
                                                    y_prev, act, slope, b_early);                                                 \
    }
#define DENSE_MMA_KERNEL(BM, BN, NAME, AK, SPLIT)         \
    DENSE_MMA_ENTRY(BM, BN, NAME, AK, SPLIT, false, ) \
    DENSE_MMA_ENTRY(BM, BN, NAME, AK, SPLIT, true, _tf32)
#define DENSE_MMA(BM, BN)               \
    DENSE_MMA_KERNEL(BM, BN, kk, true, 1) \
    DENSE_MMA_KERNEL(BM, BN, mn, false, 1)
DENSE_MMA(16, 16)
DENSE_MMA(32, 16)
DENSE_MMA_KERNEL(16, 32, mn, false, 1)
DENSE_MMA(32, 32)
DENSE_MMA_KERNEL(32, 32, mn2, false, 2)
