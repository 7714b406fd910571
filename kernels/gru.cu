// GRU (src/layers/gru.rs; launched from src/cuda/recurrent.rs), and what the LSTM's kernels
// (lstm.cu, compiled after this file) share with it: rnn_begin and rnn_bias_grad (rnn_sigmoid is
// common.cu's).
//
// Layout per sample (src/layers/recurrent.rs): rows of `padded` values, gate g's unit u at
// g·padded + u; gates (steps × 4·padded), hprev (steps × padded: h_{t−1} of each step), state
// (h0 and its final slot; an LSTM's h0, c0, then theirs), cprev (LSTM, as hprev). The products
// (cuBLAS) leave in a step's gates row the input products plus the recurrent products (without
// biases): a GRU's blocks 0 and 1 W_i·x + W_h·h for r and z, block 2 W_in·x, block 3 W_hn·h. The
// step kernels add the biases and take the gates from there, one thread a (sample, unit).
//
// Weights and biases in PyTorch's layout (gate g's unit u at b[g·hidden + u]). Row strides and
// offsets in floats; every index below is under the host's 2^30.

// hprev[s, 0, u] = h0[s, u] and, where cprev is not null, cprev[s, 0, u] = c0[s, u] (state
// offset `padded`), for the batch's samples and units u < hidden.
extern "C" __global__ void rnn_begin(const float* state, float* hprev, float* cprev, int batch, int steps, int hidden, int padded,
                                     int state_len) {
    after_prior();
    int n = batch * hidden;
    GRID_STRIDE(i, n) {
        int s = i / hidden, u = i - s * hidden;
        long long row = (long long)s * steps * padded;
        const float* st = state + (long long)s * state_len;
        hprev[row + u] = st[u];
        if (cprev != nullptr) cprev[row + u] = st[padded + u];
    }
}

// GRU step t: r, z, n and a_n = W_hn·h_{t−1} + b_hn over the step's gates row; h_t to h_out[s·
// h_stride + u], and to y[s·y_stride + u] where y is not null (the layer's output).
//   r = σ(g0 + b_ir + b_hr), z = σ(g1 + b_iz + b_hz), a_n = g3 + b_hn, n = tanh(g2 + b_in + r·a_n),
//   h_t = n + z·(h_{t−1} − n)
extern "C" __global__ void gru_step(float* gates, const float* hprev, const float* b_ih, const float* b_hh, float* h_out, int h_stride,
                                    float* y, int y_stride, int batch, int steps, int t, int hidden, int padded) {
    after_prior();
    int n = batch * hidden;
    GRID_STRIDE(i, n) {
        int s = i / hidden, u = i - s * hidden;
        long long at = (long long)s * steps + t;
        float* g = gates + at * 4 * padded;
        float r = rnn_sigmoid(g[u] + b_ih[u] + b_hh[u]);
        float z = rnn_sigmoid(g[padded + u] + b_ih[hidden + u] + b_hh[hidden + u]);
        float a_n = g[3 * padded + u] + b_hh[2 * hidden + u];
        float nn = tanhf(g[2 * padded + u] + b_ih[2 * hidden + u] + r * a_n);
        float hp = hprev[at * padded + u];
        float h = nn + z * (hp - nn);
        g[u] = r;
        g[padded + u] = z;
        g[2 * padded + u] = nn;
        g[3 * padded + u] = a_n;
        h_out[(long long)s * h_stride + u] = h;
        if (y != nullptr) y[(long long)s * y_stride + u] = h;
    }
}

// GRU step t backward: dh = ∂L/∂h_t = (t + 1 < steps: dhprev[s, t + 1, u], what step t + 1 carried
// back) + (dy not null: dy[s·dy_stride + u]); the step's pre-activation gradients into dgates'
// row [da_r, da_z, da_in, da_hn], and dhprev[s, t, u] = dh·z, the direct part of ∂L/∂h_{t−1}
// (the products add Σ_g W_hgᵀ·da_hg after).
extern "C" __global__ void gru_step_backward(const float* gates, const float* hprev, const float* dy, int dy_stride, float* dgates,
                                             float* dhprev, int batch, int steps, int t, int hidden, int padded) {
    after_prior();
    int n = batch * hidden;
    GRID_STRIDE(i, n) {
        int s = i / hidden, u = i - s * hidden;
        long long at = (long long)s * steps + t;
        const float* g = gates + at * 4 * padded;
        float* dg = dgates + at * 4 * padded;
        float dh = t + 1 < steps ? dhprev[(at + 1) * padded + u] : 0.0f;
        if (dy != nullptr) dh += dy[(long long)s * dy_stride + u];
        float r = g[u], z = g[padded + u], nn = g[2 * padded + u], a_n = g[3 * padded + u];
        float dn = dh * (1.0f - z);
        float dz = dh * (hprev[at * padded + u] - nn);
        float da_in = dn * (1.0f - nn * nn);
        dg[u] = da_in * a_n * r * (1.0f - r);
        dg[padded + u] = dz * z * (1.0f - z);
        dg[2 * padded + u] = da_in;
        dg[3 * padded + u] = da_in * r;
        dhprev[at * padded + u] = dh * z;
    }
}

// The bias gradients, in two launches. rnn_bias_grad sums the gates rows' columns in parts: block
// (t, k) of a (⌈4·padded / 32⌉, parts) grid takes columns 32·t .. 32·t + 32 of rows k·chunk ..
// min(rows, (k + 1)·chunk) (the B·T steps'), thread i four columns (4·(i % 8) ..) of rows i / 8,
// i / 8 + 32, … in order, a warp reading four rows' 128 bytes each; then the block's 32 row lanes
// of a column go into partials[k·4·padded + column] by a fixed tree. rnn_bias_join adds each
// column's parts in order of k and writes db_ih[g·hidden + u] (block g's column u, g < gates) and
// db_hh[g·hidden + u] (the recurrent side's block: a GRU's n is block 3, its block 2 has none).
// Fixed orders throughout: deterministic. The host (src/cuda/recurrent.rs) sizes the grid.
#define RNN_BIAS_COLS 32
#define RNN_BIAS_LANES (REDUCE_THREADS / (RNN_BIAS_COLS / 4))
extern "C" __global__ void rnn_bias_grad(const float* dgates, float* partials, int rows, int padded, int chunk) {
    after_prior();
    __shared__ float4 buf[REDUCE_THREADS];
    const int quad = threadIdx.x % (RNN_BIAS_COLS / 4), lane = threadIdx.x / (RNN_BIAS_COLS / 4), row = 4 * padded;
    const int col = blockIdx.x * RNN_BIAS_COLS + 4 * quad, k = blockIdx.y;
    const int first = k * chunk, end = min(rows, first + chunk);
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (col < row) {
        const float* at = dgates + col;
        if ((reinterpret_cast<unsigned long long>(dgates) & 15) == 0) {
#pragma unroll 4
            for (int r = first + lane; r < end; r += RNN_BIAS_LANES) {
                float4 v = *reinterpret_cast<const float4*>(at + (long long)r * row);
                acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
            }
        } else {
#pragma unroll 4
            for (int r = first + lane; r < end; r += RNN_BIAS_LANES) {
                const float* v = at + (long long)r * row;
                acc.x += v[0], acc.y += v[1], acc.z += v[2], acc.w += v[3];
            }
        }
    }
    buf[threadIdx.x] = acc;
    __syncthreads();
    for (int half = RNN_BIAS_LANES / 2; half > 0; half /= 2) {
        if (lane < half) {
            float4 o = buf[threadIdx.x + half * (RNN_BIAS_COLS / 4)];
            float4& m = buf[threadIdx.x];
            m.x += o.x, m.y += o.y, m.z += o.z, m.w += o.w;
        }
        __syncthreads();
    }
    if (lane == 0 && col < row) {
        float4 v = buf[quad];
        float* out = partials + (long long)k * row + col;
        out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
    }
}

extern "C" __global__ void rnn_bias_join(const float* partials, float* db_ih, float* db_hh, int parts, int gates, int hidden, int padded) {
    after_prior();
    const int row = 4 * padded;
    GRID_STRIDE(col, row) {
        int block = col / padded, u = col - block * padded;
        if (u >= hidden) continue;
        float sum = 0.0f;
        for (int k = 0; k < parts; k++) sum += partials[(long long)k * row + col];
        if (block < gates) db_ih[block * hidden + u] = sum;
        if (gates == 4) db_hh[block * hidden + u] = sum;
        else if (block != 2) db_hh[(block == 3 ? 2 : block) * hidden + u] = sum;
    }
}

// The cuDNN route's states (src/cuda/rnn_dnn.rs): cuDNN takes and gives h and c packed, (batch,
// hidden); flatnn keeps them in each sample's state row (`state_len` values a sample: h0, then an
// LSTM's c0 at `padded`, and the final slots).
//
// hx[s, u] = state[s, u] and, where cx is not null, cx[s, u] = state[s, padded + u].
extern "C" __global__ void rnn_states_in(const float* state, float* hx, float* cx, int batch, int hidden, int padded, int state_len) {
    after_prior();
    int n = batch * hidden;
    GRID_STRIDE(i, n) {
        int s = i / hidden, u = i - s * hidden;
        const float* st = state + (long long)s * state_len;
        hx[i] = st[u];
        if (cx != nullptr) cx[i] = st[padded + u];
    }
}

// state[s, h_at + u] = h[s·h_stride + u] (the last step's h, read from the layer's output) and,
// where cy is not null, state[s, c_at + u] = cy[s, u].
extern "C" __global__ void rnn_states_out(const float* h, int h_stride, const float* cy, float* state, int batch, int hidden, int h_at,
                                          int c_at, int state_len) {
    after_prior();
    int n = batch * hidden;
    GRID_STRIDE(i, n) {
        int s = i / hidden, u = i - s * hidden;
        float* st = state + (long long)s * state_len;
        st[h_at + u] = h[(long long)s * h_stride + u];
        if (cy != nullptr) st[c_at + u] = cy[i];
    }
}

// dst[j, i, c] = src[i, j, c] for src (a, b, k) and dst (b, a, k), row-major: the cuDNN route's
// move between flatnn's batch-first sequences and cuDNN's sequence-major ones. One thread a
// value of dst (writes coalesced; reads in runs of k).
extern "C" __global__ void rnn_transpose(const float* src, float* dst, int a, int b, int k) {
    after_prior();
    int n = a * b * k;
    GRID_STRIDE(at, n) {
        int row = at / k, c = at - row * k;
        int j = row / a, i = row - j * a;
        dst[at] = src[((long long)i * b + j) * k + c];
    }
}
