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
// (cell, R) and device, after common.cu and gru.cu's rnn_sigmoid, with RNN_FUSED_CELL (RNN_GRU or
// RNN_LSTM) and RNN_FUSED_R (0, 32 or 64) defined, which select the 8 kernels (2 directions × 4 S)
// emitted below.
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
    int nn_[E], uu[E];
    // bi, bh: the unit's biases b_ih[g·H + u], b_hh[g·H + u], the same every step
    float c[E], pre[E][G], bi[E][G], bh[E][G];
#pragma unroll
    for (int q = 0; q < E; q++) {
        int e = tid + q * GH, s = e / H;
        nn_[q] = e < S * H && first + s < batch ? first + s : batch;
        uu[q] = e - s * H;
        const long long at = (long long)nn_[q] * steps;
        c[q] = nn_[q] < batch && CELL == RNN_LSTM ? cprev[at * P + uu[q]] : 0.0f;
#pragma unroll
        for (int g = 0; g < G; g++) {
            pre[q][g] = nn_[q] < batch ? gates[at * 4 * P + g * P + uu[q]] : 0.0f;
            bi[q][g] = nn_[q] < batch ? b_ih[g * H + uu[q]] : 0.0f;
            bh[q][g] = nn_[q] < batch ? b_hh[g * H + uu[q]] : 0.0f;
        }
    }
    __syncthreads();
    for (int t = 0; t < steps; t++) {
        rnn_fused_dot<R, S>(w_reg, w_sh + tid, GH, h_sh, P, P, acc_sh + tid, GH);
        __syncthreads();
        const bool last = t + 1 == steps;
#pragma unroll
        for (int q = 0; q < E; q++) {
            const int n = nn_[q], s = n - first, u = uu[q];
            if (n >= batch) continue;
            const long long at = (long long)n * steps + t;
            float in[G];
#pragma unroll
            for (int g = 0; g < G; g++) in[g] = pre[q][g];
            // the next step's input products, loaded while this step's cell and products run
            if (!last) {
#pragma unroll
                for (int g = 0; g < G; g++) pre[q][g] = gates[(at + 1) * 4 * P + g * P + u];
            }
            float* gr = gates + at * 4 * P;
            const float* acc = acc_sh + s * GH;
            float h;
            if (CELL == RNN_GRU) {
                float r = rnn_sigmoid(in[0] + acc[u] + bi[q][0] + bh[q][0]);
                float z = rnn_sigmoid(in[1] + acc[H + u] + bi[q][1] + bh[q][1]);
                float a_n = acc[2 * H + u] + bh[q][2];
                float nn = tanhf(in[2] + bi[q][2] + r * a_n);
                float hp = h_sh[s * P + u];
                h = nn + z * (hp - nn);
                gr[u] = r;
                gr[P + u] = z;
                gr[2 * P + u] = nn;
                gr[3 * P + u] = a_n;
            } else {
                float ig = rnn_sigmoid(in[0] + acc[u] + bi[q][0] + bh[q][0]);
                float fg = rnn_sigmoid(in[1] + acc[H + u] + bi[q][1] + bh[q][1]);
                float gg = tanhf(in[2] + acc[2 * H + u] + bi[q][2] + bh[q][2]);
                float og = rnn_sigmoid(in[3 % G] + acc[3 * H + u] + bi[q][3 % G] + bh[q][3 % G]);
                float cc = fg * c[q] + ig * gg;
                h = og * tanhf(cc);
                c[q] = cc;
                gr[u] = ig;
                gr[P + u] = fg;
                gr[2 * P + u] = gg;
                gr[3 * P + u] = og;
                if (last) state[(long long)n * state_len + c_final + u] = cc;
                else cprev[(at + 1) * P + u] = cc;
            }
            if (last) state[(long long)n * state_len + h_final + u] = h;
            else hprev[(at + 1) * P + u] = h;
            if (seq) y[at * H + u] = h;
            else if (last) y[(long long)n * H + u] = h;
            h_sh[s * P + u] = h;
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

// The kernels: rnn_fused_<cell>_<forward|backward>_r<R>_s<S>, each bounded to the threads its R
// register weights leave room for (255 registers a thread at 256 threads for R = 64; for R = 0 and
// 32, 170 at 384 threads for a GRU, 128 at 512 for an LSTM; rnn_fused.rs offers a variant only
// where G·H is within the bound). The bounds lose nothing for R = 0: a layer of more threads has
// more weights than shared memory holds; for R = 32 they leave out GRUs of 129 to ~150 units.
#if RNN_FUSED_CELL == RNN_GRU && RNN_FUSED_R == 0
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_forward_r0_s1(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 0, 1>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_forward_r0_s2(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 0, 2>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_forward_r0_s4(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 0, 4>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_forward_r0_s8(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 0, 8>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_backward_r0_s1(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 0, 1>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_backward_r0_s2(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 0, 2>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_backward_r0_s4(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 0, 4>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_backward_r0_s8(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 0, 8>(RNN_FUSED_BACKWARD_ARGS);
}
#endif
#if RNN_FUSED_CELL == RNN_GRU && RNN_FUSED_R == 32
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_forward_r32_s1(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 32, 1>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_forward_r32_s2(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 32, 2>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_forward_r32_s4(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 32, 4>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_forward_r32_s8(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 32, 8>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_backward_r32_s1(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 32, 1>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_backward_r32_s2(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 32, 2>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_backward_r32_s4(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 32, 4>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(384, 1) void rnn_fused_gru_backward_r32_s8(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 32, 8>(RNN_FUSED_BACKWARD_ARGS);
}
#endif
#if RNN_FUSED_CELL == RNN_GRU && RNN_FUSED_R == 64
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_gru_forward_r64_s1(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 64, 1>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_gru_forward_r64_s2(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 64, 2>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_gru_forward_r64_s4(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 64, 4>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_gru_forward_r64_s8(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_GRU, 64, 8>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_gru_backward_r64_s1(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 64, 1>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_gru_backward_r64_s2(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 64, 2>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_gru_backward_r64_s4(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 64, 4>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_gru_backward_r64_s8(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_GRU, 64, 8>(RNN_FUSED_BACKWARD_ARGS);
}
#endif
#if RNN_FUSED_CELL == RNN_LSTM && RNN_FUSED_R == 0
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_forward_r0_s1(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 0, 1>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_forward_r0_s2(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 0, 2>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_forward_r0_s4(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 0, 4>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_forward_r0_s8(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 0, 8>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_backward_r0_s1(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 0, 1>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_backward_r0_s2(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 0, 2>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_backward_r0_s4(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 0, 4>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_backward_r0_s8(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 0, 8>(RNN_FUSED_BACKWARD_ARGS);
}
#endif
#if RNN_FUSED_CELL == RNN_LSTM && RNN_FUSED_R == 32
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_forward_r32_s1(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 32, 1>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_forward_r32_s2(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 32, 2>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_forward_r32_s4(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 32, 4>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_forward_r32_s8(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 32, 8>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_backward_r32_s1(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 32, 1>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_backward_r32_s2(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 32, 2>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_backward_r32_s4(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 32, 4>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(512, 1) void rnn_fused_lstm_backward_r32_s8(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 32, 8>(RNN_FUSED_BACKWARD_ARGS);
}
#endif
#if RNN_FUSED_CELL == RNN_LSTM && RNN_FUSED_R == 64
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_lstm_forward_r64_s1(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 64, 1>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_lstm_forward_r64_s2(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 64, 2>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_lstm_forward_r64_s4(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 64, 4>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_lstm_forward_r64_s8(RNN_FUSED_FORWARD_PARAMS) {
    after_prior();
    rnn_fused_forward<RNN_LSTM, 64, 8>(RNN_FUSED_FORWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_lstm_backward_r64_s1(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 64, 1>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_lstm_backward_r64_s2(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 64, 2>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_lstm_backward_r64_s4(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 64, 4>(RNN_FUSED_BACKWARD_ARGS);
}
extern "C" __global__ __launch_bounds__(256, 1) void rnn_fused_lstm_backward_r64_s8(RNN_FUSED_BACKWARD_PARAMS) {
    after_prior();
    rnn_fused_backward<RNN_LSTM, 64, 8>(RNN_FUSED_BACKWARD_ARGS);
}
#endif
