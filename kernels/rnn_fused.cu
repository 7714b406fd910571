// The fused route of a GRU or an LSTM (src/cuda/rnn_fused.rs): every time step of the forward, or
// of the backward through time, in one launch, in place of the per-step route's loop
// (src/cuda/recurrent.rs). gru.cu and lstm.cu define the layout and the math; these kernels
// write exactly what that loop writes (to the rounding of a different summation order in the
// recurrent products), so either route's backward can follow either's forward.
//
// One block per slice of S samples (samples first·S ..), G·H threads (G = 3 for a GRU, 4 for an
// LSTM). Forward: thread i owns row i = g·H + u of W_hh; backward: the column j of gate block g
// (thread i = g·H + j, the values W_hh[g·H + u][j], u < H). A thread keeps its first R values in
// registers and the rest, up to `padded` (zeros past H, so every dot product runs over whole
// float4s), in shared memory as [k − R][thread]: a warp reads consecutive words. The state the
// steps carry stays on the SM (h_{t−1} in shared memory for the products; c, dh, dc in the
// registers of the thread that owns the (sample, unit)); a step is the products of its S samples,
// a barrier, the cell, a barrier (the backward: cell, barrier, products, barrier, sums).
//
// Dynamic shared memory, in floats (P = padded, rnn_fused.rs sizes it):
//   forward:  (P − R)·G·H weights, S·P h_{t−1}, S·G·H recurrent products
//   backward: (P − R)·G·H weights, S·4·P gate gradients (the recurrent side's G blocks; a GRU's
//             fourth holds the direct part of ∂L/∂h_{t−1}, dh·z), S·G·P partial sums

#define RNN_GRU 0
#define RNN_LSTM 1

// Not part of the main program: rnn_fused.rs compiles this file on a layer's first need, once per
// (cell, R) and device, after common.cu, with RNN_FUSED_CELL (RNN_GRU or RNN_LSTM) and
// RNN_FUSED_R (0, 32 or 64) defined, which select the 8 kernels (2 directions × 4 S) emitted
// below; with RNN_FUSED_CLUSTERS too (sm_90 and later) the cell's 3 forwards on a cluster of
// blocks (S = 1, 2, 4; rnn_cluster_forward, which a step's backward by the kernels above may
// follow like any forward).
#if !defined(RNN_FUSED_CELL) || !defined(RNN_FUSED_R)
#error "RNN_FUSED_CELL and RNN_FUSED_R select the kernels (src/cuda/rnn_fused.rs defines them)"
#endif

// out[s·os] = Σ_{k<R} w_reg[k]·v[s·vs + k] + Σ_{R≤k<len} w_col[(k − R)·ld]·v[s·vs + k], s < S,
// in 4/S chains a sample (each float4's i-th product into chain i mod C), added as ((c0 + c1) +
// (c2 + c3)); past 4 samples, 4 at a time (fewer values live: no spills). v and vs keep every
// float4 16-byte aligned; R, len multiples of 4.
template <int R, int S>
__device__ __forceinline__ void rnn_fused_dot(const float* w_reg, const float* w_col, int ld, const float* v, int vs, int len,
                                              float* out, int os) {
    if constexpr (S > 4) {
        static_assert(S % 4 == 0, "samples past 4 go 4 at a time");
        for (int at = 0; at < S; at += 4) rnn_fused_dot<R, 4>(w_reg, w_col, ld, v + at * vs, vs, len, out + at * os, os);
        return;
    }
    constexpr int C = S >= 4 ? 1 : 4 / S;
    float acc[S][C];
#pragma unroll
    for (int s = 0; s < S; s++)
#pragma unroll
        for (int c = 0; c < C; c++) acc[s][c] = 0.0f;
#pragma unroll
    for (int k = 0; k < R; k += 4) {
#pragma unroll
        for (int s = 0; s < S; s++) {
            float4 h = *reinterpret_cast<const float4*>(v + s * vs + k);
            acc[s][0 % C] = fmaf(w_reg[k], h.x, acc[s][0 % C]);
            acc[s][1 % C] = fmaf(w_reg[k + 1], h.y, acc[s][1 % C]);
            acc[s][2 % C] = fmaf(w_reg[k + 2], h.z, acc[s][2 % C]);
            acc[s][3 % C] = fmaf(w_reg[k + 3], h.w, acc[s][3 % C]);
        }
    }
    // a few float4s in flight at small S (the loads' latency is a step's critical path), one at
    // larger S (registers)
#pragma unroll(S <= 2 ? 4 : 1)
    for (int k = R; k < len; k += 4) {
        const float* w = w_col + (k - R) * ld;
        float w0 = w[0], w1 = w[ld], w2 = w[2 * ld], w3 = w[3 * ld];
#pragma unroll
        for (int s = 0; s < S; s++) {
            float4 h = *reinterpret_cast<const float4*>(v + s * vs + k);
            acc[s][0 % C] = fmaf(w0, h.x, acc[s][0 % C]);
            acc[s][1 % C] = fmaf(w1, h.y, acc[s][1 % C]);
            acc[s][2 % C] = fmaf(w2, h.z, acc[s][2 % C]);
            acc[s][3 % C] = fmaf(w3, h.w, acc[s][3 % C]);
        }
    }
#pragma unroll
    for (int s = 0; s < S; s++) {
        if (C == 1) out[s * os] = acc[s][0];
        if (C == 2) out[s * os] = acc[s][0] + acc[s][1 % C];
        if (C == 4) out[s * os] = (acc[s][0] + acc[s][1 % C]) + (acc[s][2 % C] + acc[s][3 % C]);
    }
}

extern __shared__ __align__(16) float rnn_fused_shared[];

// gates, hprev, cprev (LSTM; else null), state: the layer's kept regions for the batch, as the
// per-step route has them after `rnn_begin` (h_0, c_0 in row 0 of hprev, cprev) and the input
// products (gates' blocks 0..G−1); w_hh (G·H × H), b_ih, b_hh (G·H): the layer's tensors; y: the
// output region, seq 1: every step's (y[s, t, u] at (s·steps + t)·hidden + u), 0: the last
// step's (y[s, u] at s·hidden + u); h_final, c_final: the final slots of a state row.
#define RNN_FUSED_FORWARD_PARAMS                                                                                                   \
    float *gates, float *hprev, float *cprev, float *state, const float *w_hh, const float *b_ih, const float *b_hh, float *y, \
        int seq, int batch, int steps, int hidden, int padded, int state_len, int h_final, int c_final
#define RNN_FUSED_FORWARD_ARGS gates, hprev, cprev, state, w_hh, b_ih, b_hh, y, seq, batch, steps, hidden, padded, state_len, h_final, c_final

// Where a forward's cell writes (the kernels' parameters of those names).
struct RnnFusedOut {
    float *gates, *hprev, *cprev, *state, *y;
    int seq, steps, hidden, padded, state_len, h_final, c_final;
};
#define RNN_FUSED_OUT_ARGS gates, hprev, cprev, state, y, seq, steps, hidden, padded, state_len, h_final, c_final

// Sample n's unit u's G input products at step t into pre (n = batch: none, nothing read; t past
// the steps: nothing read, pre left). The forwards load step t + 1's as step t begins, so that
// the loads have the whole step to arrive, not only its cell.
template <int CELL>
__device__ __forceinline__ void rnn_fused_inputs(const RnnFusedOut& o, int batch, int n, int u, int t, float* pre) {
    constexpr int G = CELL == RNN_GRU ? 3 : 4;
    if (n >= batch || t >= o.steps) return;
    const float* row = o.gates + ((long long)n * o.steps + t) * 4 * o.padded + u;
#pragma unroll
    for (int g = 0; g < G; g++) pre[g] = row[g * o.padded];
}

// What sample n's unit u carries into the steps (none where n = batch): pre, step 0's G input
// products; bi, bh, its biases b_ih[g·H + u], b_hh[g·H + u]; c, an LSTM's c_0.
template <int CELL>
__device__ __forceinline__ void rnn_fused_cell_begin(const RnnFusedOut& o, const float* b_ih, const float* b_hh, int batch, int n,
                                                     int u, float* pre, float* bi, float* bh, float& c) {
    constexpr int G = CELL == RNN_GRU ? 3 : 4;
    const int P = o.padded, H = o.hidden;
    const long long at = (long long)n * o.steps;
    c = n < batch && CELL == RNN_LSTM ? o.cprev[at * P + u] : 0.0f;
#pragma unroll
    for (int g = 0; g < G; g++) {
        pre[g] = 0.0f;
        bi[g] = n < batch ? b_ih[g * H + u] : 0.0f;
        bh[g] = n < batch ? b_hh[g * H + u] : 0.0f;
    }
    rnn_fused_inputs<CELL>(o, batch, n, u, 0, pre);
}

// The cell of sample n's unit u at step t, its recurrent products computed: gru_step's or
// lstm_step's math and writes (the gates row, h_t to the next step's hprev row or the state's
// final slot, c_t likewise to cprev, y). in: the unit's G input products at step t; bi, bh: its
// biases b_ih[g·H + u], b_hh[g·H + u]; acc[g·stride]: gate g's recurrent product; hp: h_{t−1};
// c: an LSTM's c_{t−1}, c_t after. Returns h_t.
template <int CELL>
__device__ __forceinline__ float rnn_fused_cell(const RnnFusedOut& o, int n, int u, int t, const float* in, const float* bi,
                                                const float* bh, const float* acc, int stride, float hp, float& c) {
    const int P = o.padded, H = o.hidden;
    const long long at = (long long)n * o.steps + t;
    const bool last = t + 1 == o.steps;
    float* gr = o.gates + at * 4 * P;
    float h;
    if constexpr (CELL == RNN_GRU) {
        float r = rnn_sigmoid(in[0] + acc[0] + bi[0] + bh[0]);
        float z = rnn_sigmoid(in[1] + acc[stride] + bi[1] + bh[1]);
        float a_n = acc[2 * stride] + bh[2];
        float nn = tanhf(in[2] + bi[2] + r * a_n);
        h = nn + z * (hp - nn);
        gr[u] = r;
        gr[P + u] = z;
        gr[2 * P + u] = nn;
        gr[3 * P + u] = a_n;
    } else {
        float ig = rnn_sigmoid(in[0] + acc[0] + bi[0] + bh[0]);
        float fg = rnn_sigmoid(in[1] + acc[stride] + bi[1] + bh[1]);
        float gg = tanhf(in[2] + acc[2 * stride] + bi[2] + bh[2]);
        float og = rnn_sigmoid(in[3] + acc[3 * stride] + bi[3] + bh[3]);
        float cc = fg * c + ig * gg;
        h = og * tanhf(cc);
        c = cc;
        gr[u] = ig;
        gr[P + u] = fg;
        gr[2 * P + u] = gg;
        gr[3 * P + u] = og;
        if (last) o.state[(long long)n * o.state_len + o.c_final + u] = cc;
        else o.cprev[(at + 1) * P + u] = cc;
    }
    if (last) o.state[(long long)n * o.state_len + o.h_final + u] = h;
    else o.hprev[(at + 1) * P + u] = h;
    if (o.seq) o.y[at * H + u] = h;
    else if (last) o.y[(long long)n * H + u] = h;
    return h;
}

// The forward of every step: per step t, row i's products a[s] = Σ_k W_hh[i, k]·h_{t−1}[s, k],
// then gru_step's or lstm_step's math and writes (the gates row, h_t to the next step's hprev
// row or the state's final slot, c_t likewise to cprev, y), h_t into shared memory.
template <int CELL, int R, int S>
__device__ __forceinline__ void rnn_fused_forward(RNN_FUSED_FORWARD_PARAMS) {
    constexpr int G = CELL == RNN_GRU ? 3 : 4;
    // cell elements a thread: S·H (sample, unit) pairs over G·H threads
    constexpr int E = (S + G - 1) / G;
    const int H = hidden, P = padded, GH = G * hidden, tid = threadIdx.x, first = blockIdx.x * S;
    float* w_sh = rnn_fused_shared;
    float* h_sh = w_sh + (P - R) * GH;
    float* acc_sh = h_sh + S * P;
    float w_reg[R > 0 ? R : 1];
    // each thread reads its own row (a warp's stores to w_sh are then consecutive words); eight
    // values a pass, so that a 32-byte sector is used whole while it is in L1
#pragma unroll
    for (int k = 0; k < R; k++) w_reg[k] = k < H ? w_hh[(long long)tid * H + k] : 0.0f;
#pragma unroll 8
    for (int k = R; k < P; k++) w_sh[(k - R) * GH + tid] = k < H ? w_hh[(long long)tid * H + k] : 0.0f;
    for (int i = tid; i < S * P; i += GH) {
        int s = i / P, k = i - s * P;
        h_sh[i] = first + s < batch && k < H ? hprev[(long long)(first + s) * steps * P + k] : 0.0f;
    }
    // this thread's elements q: e = tid + q·G·H, sample n = first + e / H (batch where e is past
    // the S·H elements: none), unit e % H
    const RnnFusedOut out{RNN_FUSED_OUT_ARGS};
    int nn_[E], uu[E];
    float c[E], pre[E][G], bi[E][G], bh[E][G];
#pragma unroll
    for (int q = 0; q < E; q++) {
        int e = tid + q * GH, s = e / H;
        nn_[q] = e < S * H && first + s < batch ? first + s : batch;
        uu[q] = e - s * H;
        rnn_fused_cell_begin<CELL>(out, b_ih, b_hh, batch, nn_[q], uu[q], pre[q], bi[q], bh[q], c[q]);
    }
    __syncthreads();
    for (int t = 0; t < steps; t++) {
        float next[E][G];
#pragma unroll
        for (int q = 0; q < E; q++) rnn_fused_inputs<CELL>(out, batch, nn_[q], uu[q], t + 1, next[q]);
        rnn_fused_dot<R, S>(w_reg, w_sh + tid, GH, h_sh, P, P, acc_sh + tid, GH);
        __syncthreads();
#pragma unroll
        for (int q = 0; q < E; q++) {
            const int n = nn_[q], s = n - first, u = uu[q];
            if (n >= batch) continue;
            h_sh[s * P + u] = rnn_fused_cell<CELL>(out, n, u, t, pre[q], bi[q], bh[q], acc_sh + s * GH + u, H, h_sh[s * P + u], c[q]);
#pragma unroll
            for (int g = 0; g < G; g++) pre[q][g] = next[q][g];
        }
        __syncthreads();
    }
}

// gates, hprev, cprev (LSTM; else null), state: as the forward left them; w_hh: the layer's;
// dy: the output's gradient (seq as in the forward); dgates, dhprev, dcprev (LSTM; else null):
// the gradients' regions of gates, hprev, cprev; c_final: the final c's slot of a state row.
#define RNN_FUSED_BACKWARD_PARAMS                                                                                                 \
    const float *gates, const float *hprev, const float *cprev, const float *state, const float *w_hh, const float *dy, int seq, \
        float *dgates, float *dhprev, float *dcprev, int batch, int steps, int hidden, int padded, int state_len, int c_final
#define RNN_FUSED_BACKWARD_ARGS gates, hprev, cprev, state, w_hh, dy, seq, dgates, dhprev, dcprev, batch, steps, hidden, padded, state_len, c_final

// The backward through time, t = steps − 1 down to 0: gru_step_backward's or
// lstm_step_backward's math and writes (the dgates row, an LSTM's dcprev row), then ∂L/∂h_{t−1}
// = (GRU: dh·z) + Σ_g W_hh,gᵀ·da_g (da_g the gate's recurrent-side gradient: a GRU's blocks 0, 1,
// 3, an LSTM's 0..3) into the dhprev row, carried to step t − 1 in registers, as dc is.
template <int CELL, int R, int S>
__device__ __forceinline__ void rnn_fused_backward(RNN_FUSED_BACKWARD_PARAMS) {
    constexpr int G = CELL == RNN_GRU ? 3 : 4;
    constexpr int E = (S + G - 1) / G;
    const int H = hidden, P = padded, GH = G * hidden, GP = G * padded, tid = threadIdx.x, first = blockIdx.x * S;
    float* w_sh = rnn_fused_shared;
    float* da_sh = w_sh + (P - R) * GH;
    float* part_sh = da_sh + S * 4 * P;
    // thread tid = g·H + j: W_hh[g·H + k][j], k < P
    const int gate = tid / H, j = tid - gate * H;
    const float* col = w_hh + (long long)gate * H * H + j;
    float w_reg[R > 0 ? R : 1];
#pragma unroll
    for (int k = 0; k < R; k++) w_reg[k] = k < H ? col[(long long)k * H] : 0.0f;
    for (int k = R; k < P; k++) w_sh[(k - R) * GH + tid] = k < H ? col[(long long)k * H] : 0.0f;
    for (int i = tid; i < S * 4 * P; i += GH) da_sh[i] = 0.0f;
    int nn_[E], uu[E];
    // carried from step t + 1: ∂L/∂h_t, an LSTM's ∂L/∂c_t (dc·f) and c_t itself
    float dh[E], dc[E], c_now[E];
    // step t's loads, made a step ahead: the gates row, h_{t−1} (GRU) or c_{t−1} (LSTM), dy
    float pre[E][6];
    auto load = [&](int q, int t) {
        const long long at = (long long)nn_[q] * steps + t;
        const float* gr = gates + at * 4 * P;
#pragma unroll
        for (int g = 0; g < 4; g++) pre[q][g] = gr[g * P + uu[q]];
        pre[q][4] = CELL == RNN_GRU ? hprev[at * P + uu[q]] : cprev[at * P + uu[q]];
        pre[q][5] = seq ? dy[at * H + uu[q]] : t + 1 == steps ? dy[(long long)nn_[q] * H + uu[q]] : 0.0f;
    };
#pragma unroll
    for (int q = 0; q < E; q++) {
        int e = tid + q * GH, s = e / H;
        nn_[q] = e < S * H && first + s < batch ? first + s : batch;
        uu[q] = e - s * H;
        dh[q] = 0.0f;
        dc[q] = 0.0f;
        c_now[q] = nn_[q] < batch && CELL == RNN_LSTM ? state[(long long)nn_[q] * state_len + c_final + uu[q]] : 0.0f;
        if (nn_[q] < batch) load(q, steps - 1);
    }
    __syncthreads();
    for (int t = steps - 1; t >= 0; t--) {
#pragma unroll
        for (int q = 0; q < E; q++) {
            const int n = nn_[q], s = n - first, u = uu[q];
            if (n >= batch) continue;
            float in[6];
#pragma unroll
            for (int k = 0; k < 6; k++) in[k] = pre[q][k];
            if (t > 0) load(q, t - 1);
            const long long at = (long long)n * steps + t;
            float* dg = dgates + at * 4 * P;
            float* da = da_sh + s * 4 * P;
            float d_h = dh[q] + in[5];
            if (CELL == RNN_GRU) {
                float r = in[0], z = in[1], nn = in[2], a_n = in[3];
                float dn = d_h * (1.0f - z);
                float dz = d_h * (in[4] - nn);
                float da_in = dn * (1.0f - nn * nn);
                float da_r = da_in * a_n * r * (1.0f - r);
                float da_z = dz * z * (1.0f - z);
                float da_hn = da_in * r;
                dg[u] = da_r;
                dg[P + u] = da_z;
                dg[2 * P + u] = da_in;
                dg[3 * P + u] = da_hn;
                da[u] = da_r;
                da[P + u] = da_z;
                da[2 * P + u] = da_hn;
                da[3 * P + u] = d_h * z;
            } else {
                float ig = in[0], fg = in[1], gg = in[2], og = in[3];
                float tc = tanhf(c_now[q]);
                float d_c = dc[q] + d_h * og * (1.0f - tc * tc);
                float da_i = d_c * gg * ig * (1.0f - ig);
                float da_f = d_c * in[4] * fg * (1.0f - fg);
                float da_g = d_c * ig * (1.0f - gg * gg);
                float da_o = d_h * tc * og * (1.0f - og);
                dg[u] = da_i;
                dg[P + u] = da_f;
                dg[2 * P + u] = da_g;
                dg[3 * P + u] = da_o;
                da[u] = da_i;
                da[P + u] = da_f;
                da[2 * P + u] = da_g;
                da[(3 % G) * P + u] = da_o;
                dc[q] = d_c * fg;
                dcprev[at * P + u] = dc[q];
                c_now[q] = in[4];
            }
        }
        __syncthreads();
        rnn_fused_dot<R, S>(w_reg, w_sh + tid, GH, da_sh + gate * P, 4 * P, P, part_sh + gate * P + j, GP);
        __syncthreads();
#pragma unroll
        for (int q = 0; q < E; q++) {
            const int n = nn_[q], s = n - first, u = uu[q];
            if (n >= batch) continue;
            float v = CELL == RNN_GRU ? da_sh[s * 4 * P + 3 * P + u] : 0.0f;
#pragma unroll
            for (int g = 0; g < G; g++) v += part_sh[s * GP + g * P + u];
            dh[q] = v;
            dhprev[((long long)n * steps + t) * P + u] = v;
        }
    }
}

// The forward on a cluster of C blocks (sm_90 and later; rnn_fused.rs launches it with C, 2 to 8,
// as a launch attribute), which spreads W_hh over the registers of C SMs where the kernels above
// keep most of it in one SM's shared memory. Cluster k runs samples k·S ..; its block of rank c
// the units c·U .. c·U + U − 1 (U = ⌈H / C⌉) and the G·U rows of W_hh that make their gates, each
// row over `split` threads of RNN_CLUSTER_KW register weights (split·KW = L ≥ padded, zeros past
// H). A step: the block's products with h_{t−1} (shared memory), a block barrier, the cell of
// its units (rnn_fused_cell), h_t's values stored into every block's shared memory
// (st.shared::cluster), a cluster barrier. h_{t−1} and h_t are two buffers, so that one barrier a
// step keeps a block from overwriting what another still reads. The block's threads, G·U·split
// rounded up to whole warps, are rnn_fused.rs's to set; the threads past G·U·split compute zeros.
//
// Dynamic shared memory, in floats: 2·S·L h (two steps' buffers), S·G·U recurrent products.
#define RNN_CLUSTER_KW 64

template <int CELL, int S>
__device__ __forceinline__ void rnn_cluster_forward(RNN_FUSED_FORWARD_PARAMS) {
    constexpr int G = CELL == RNN_GRU ? 3 : 4, KW = RNN_CLUSTER_KW;
    // cell elements a thread: S·U (sample, unit) pairs over at least G·U threads
    constexpr int E = (S + G - 1) / G;
    const int H = hidden, P = padded, tid = threadIdx.x, threads = blockDim.x;
    const int C = cluster_blocks(), rank = cluster_rank(), U = (H + C - 1) / C, GU = G * U;
    int split = 1;
    while (split * KW < P) split *= 2;
    const int L = split * KW, first = blockIdx.x / C * S;
    float* h_sh = rnn_fused_shared;
    float* acc_sh = h_sh + 2 * S * L;
    // thread tid: part `part` of local row lrow = g·U + j, W_hh's row g·H + rank·U + j
    const int lrow = tid / split, part = tid - lrow * split, gate = lrow / U, j = lrow - gate * U;
    const bool row = lrow < GU && rank * U + j < H;
    const float* w = w_hh + (long long)(gate * H + rank * U + j) * H + part * KW;
    float w_reg[KW];
#pragma unroll
    for (int k = 0; k < KW; k++) w_reg[k] = row && part * KW + k < H ? w[k] : 0.0f;
    for (int i = tid; i < 2 * S * L; i += threads) {
        const int b = i / (S * L), s = (i - b * S * L) / L, k = i - b * S * L - s * L;
        h_sh[i] = b == 0 && first + s < batch && k < H ? hprev[(long long)(first + s) * steps * P + k] : 0.0f;
    }
    const RnnFusedOut out{RNN_FUSED_OUT_ARGS};
    // this thread's elements q: e = tid + q·threads, sample n = first + e / U (batch where there
    // is none), local unit e % U
    int nn_[E], jj[E];
    float c[E], pre[E][G], bi[E][G], bh[E][G];
#pragma unroll
    for (int q = 0; q < E; q++) {
        const int e = tid + q * threads, s = e / U;
        jj[q] = e - s * U;
        nn_[q] = e < S * U && first + s < batch && rank * U + jj[q] < H ? first + s : batch;
        rnn_fused_cell_begin<CELL>(out, b_ih, b_hh, batch, nn_[q], rank * U + jj[q], pre[q], bi[q], bh[q], c[q]);
    }
    // every block of the cluster running, its buffers set, before any block stores into them
    cluster_sync();
    for (int t = 0; t < steps; t++) {
        const float* h_now = h_sh + (t & 1) * S * L;
        float* h_next = h_sh + ((t + 1) & 1) * S * L;
        float next[E][G];
#pragma unroll
        for (int q = 0; q < E; q++) rnn_fused_inputs<CELL>(out, batch, nn_[q], rank * U + jj[q], t + 1, next[q]);
        float acc[S][4];
#pragma unroll
        for (int s = 0; s < S; s++) acc[s][0] = acc[s][1] = acc[s][2] = acc[s][3] = 0.0f;
#pragma unroll
        for (int k = 0; k < KW; k += 4) {
#pragma unroll
            for (int s = 0; s < S; s++) {
                float4 h = *reinterpret_cast<const float4*>(h_now + s * L + part * KW + k);
                acc[s][0] = fmaf(w_reg[k], h.x, acc[s][0]);
                acc[s][1] = fmaf(w_reg[k + 1], h.y, acc[s][1]);
                acc[s][2] = fmaf(w_reg[k + 2], h.z, acc[s][2]);
                acc[s][3] = fmaf(w_reg[k + 3], h.w, acc[s][3]);
            }
        }
#pragma unroll
        for (int s = 0; s < S; s++) {
            float a = (acc[s][0] + acc[s][1]) + (acc[s][2] + acc[s][3]);
            for (int m = 1; m < split; m *= 2) a += __shfl_xor_sync(0xffffffffu, a, m);
            if (part == 0 && lrow < GU) acc_sh[s * GU + lrow] = a;
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < E; q++) {
            const int n = nn_[q], s = n - first, u = rank * U + jj[q];
            if (n >= batch) continue;
            const float h = rnn_fused_cell<CELL>(out, n, u, t, pre[q], bi[q], bh[q], acc_sh + s * GU + jj[q], U, h_now[s * L + u], c[q]);
            for (int r = 0; r < C; r++) cluster_store(h_next + s * L + u, r, h);
#pragma unroll
            for (int g = 0; g < G; g++) pre[q][g] = next[q][g];
        }
        cluster_sync();
    }
}

// The kernels: rnn_fused_<cell>_<forward|backward>_r<R>_s<S>, each bounded to the threads its R
// register weights leave room for (255 registers a thread at 256 threads for R = 64; for R = 0 and
// 32, 170 at 384 threads for a GRU, 128 at 512 for an LSTM; rnn_fused.rs offers a variant only
// where G·H is within the bound). The bounds lose nothing for R = 0: a layer of more threads has
// more weights than shared memory holds; for R = 32 they leave out GRUs of 129 to ~150 units.
// One kernel of (CELL, R): rnn_fused_<cell>_<dir>_r<R>_s<S>, bounded to BOUND threads.
#define RNN_FUSED_KERNEL(cell, CELL, dir, DIR, R, S, BOUND)                                            \
    extern "C" __global__ __launch_bounds__(BOUND, 1) void rnn_fused_##cell##_##dir##_r##R##_s##S( \
        RNN_FUSED_##DIR##_PARAMS) { after_prior(); rnn_fused_##dir<CELL, R, S>(RNN_FUSED_##DIR##_ARGS); }
// The 8 kernels of (CELL, R), in the order rnn_fused.rs looks them up: forward, then backward,
// each with S = 1, 2, 4, 8.
#define RNN_FUSED_KERNELS(cell, CELL, R, BOUND)                       \
    RNN_FUSED_KERNEL(cell, CELL, forward, FORWARD, R, 1, BOUND)       \
    RNN_FUSED_KERNEL(cell, CELL, forward, FORWARD, R, 2, BOUND)       \
    RNN_FUSED_KERNEL(cell, CELL, forward, FORWARD, R, 4, BOUND)       \
    RNN_FUSED_KERNEL(cell, CELL, forward, FORWARD, R, 8, BOUND)       \
    RNN_FUSED_KERNEL(cell, CELL, backward, BACKWARD, R, 1, BOUND)     \
    RNN_FUSED_KERNEL(cell, CELL, backward, BACKWARD, R, 2, BOUND)     \
    RNN_FUSED_KERNEL(cell, CELL, backward, BACKWARD, R, 4, BOUND)     \
    RNN_FUSED_KERNEL(cell, CELL, backward, BACKWARD, R, 8, BOUND)
#if RNN_FUSED_CELL == RNN_GRU && RNN_FUSED_R == 0
RNN_FUSED_KERNELS(gru, RNN_GRU, 0, 384)
#endif
#if RNN_FUSED_CELL == RNN_GRU && RNN_FUSED_R == 32
RNN_FUSED_KERNELS(gru, RNN_GRU, 32, 384)
#endif
#if RNN_FUSED_CELL == RNN_GRU && RNN_FUSED_R == 64
RNN_FUSED_KERNELS(gru, RNN_GRU, 64, 256)
#endif
#if RNN_FUSED_CELL == RNN_LSTM && RNN_FUSED_R == 0
RNN_FUSED_KERNELS(lstm, RNN_LSTM, 0, 512)
#endif
#if RNN_FUSED_CELL == RNN_LSTM && RNN_FUSED_R == 32
RNN_FUSED_KERNELS(lstm, RNN_LSTM, 32, 512)
#endif
#if RNN_FUSED_CELL == RNN_LSTM && RNN_FUSED_R == 64
RNN_FUSED_KERNELS(lstm, RNN_LSTM, 64, 256)
#endif

// The cluster forwards, rnn_fused_<cell>_cluster_s<S> (RNN_FUSED_CLUSTERS: compiled for sm_90 and
// later), bounded to 512 threads (128 registers a thread: the 64 weights and the step's values).
#if defined(RNN_FUSED_CLUSTERS) && RNN_FUSED_CELL == RNN_GRU
extern "C" __global__ __launch_bounds__(512) void rnn_fused_gru_cluster_s1(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_cluster_forward<RNN_GRU, 1>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512) void rnn_fused_gru_cluster_s2(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_cluster_forward<RNN_GRU, 2>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512) void rnn_fused_gru_cluster_s4(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_cluster_forward<RNN_GRU, 4>(RNN_FUSED_FORWARD_ARGS);
}
#endif
#if defined(RNN_FUSED_CLUSTERS) && RNN_FUSED_CELL == RNN_LSTM
extern "C" __global__ __launch_bounds__(512) void rnn_fused_lstm_cluster_s1(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_cluster_forward<RNN_LSTM, 1>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512) void rnn_fused_lstm_cluster_s2(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_cluster_forward<RNN_LSTM, 2>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512) void rnn_fused_lstm_cluster_s4(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_cluster_forward<RNN_LSTM, 4>(RNN_FUSED_FORWARD_ARGS);
}
#endif
