// LSTM (src/layers/lstm.rs; launched from src/cuda/recurrent.rs). The layout, rnn_begin and
// rnn_bias_grad are gru.cu's, rnn_sigmoid common.cu's. The products (cuBLAS) leave in a step's
// gates row the input products plus the recurrent products of i, f, g, o (without biases); one
// thread a (sample, unit).

// LSTM step t: i, f, g, o over the step's gates row; c_t to c_out[s·c_stride + u], h_t to
// h_out[s·h_stride + u] and to y[s·y_stride + u] where y is not null (the layer's output).
// c_{t−1} = cprev[s, t, u].
//   i = σ(g0 + b_i), f = σ(g1 + b_f), g = tanh(g2 + b_g), o = σ(g3 + b_o) (b = b_ih + b_hh),
//   c_t = f·c_{t−1} + i·g, h_t = o·tanh(c_t)
extern "C" __global__ void lstm_step(float* gates, const float* cprev, const float* b_ih, const float* b_hh, float* h_out, int h_stride,
                                     float* c_out, int c_stride, float* y, int y_stride, int batch, int steps, int t, int hidden,
                                     int padded) {
    after_prior();
    int n = batch * hidden;
    GRID_STRIDE(i, n) {
        int s = i / hidden, u = i - s * hidden;
        long long at = (long long)s * steps + t;
        float* g = gates + at * 4 * padded;
        float ig = rnn_sigmoid(g[u] + b_ih[u] + b_hh[u]);
        float fg = rnn_sigmoid(g[padded + u] + b_ih[hidden + u] + b_hh[hidden + u]);
        float gg = tanhf(g[2 * padded + u] + b_ih[2 * hidden + u] + b_hh[2 * hidden + u]);
        float og = rnn_sigmoid(g[3 * padded + u] + b_ih[3 * hidden + u] + b_hh[3 * hidden + u]);
        float c = fg * cprev[at * padded + u] + ig * gg;
        float h = og * tanhf(c);
        g[u] = ig;
        g[padded + u] = fg;
        g[2 * padded + u] = gg;
        g[3 * padded + u] = og;
        c_out[(long long)s * c_stride + u] = c;
        h_out[(long long)s * h_stride + u] = h;
        if (y != nullptr) y[(long long)s * y_stride + u] = h;
    }
}

// LSTM step t backward: dh = (t + 1 < steps: dhprev[s, t + 1, u]) + (dy not null: dy[s·dy_stride
// + u]); dc = (t + 1 < steps: dcprev[s, t + 1, u]) + dh·o·(1 − tanh²c_t), c_t = c_now[s·c_stride
// + u]; the pre-activation gradients into dgates' row [da_i, da_f, da_g, da_o]; dcprev[s, t, u] =
// dc·f, ∂L/∂c_{t−1}; dhprev[s, t, u] = 0, to which the products add Σ_g W_hgᵀ·da_g.
extern "C" __global__ void lstm_step_backward(const float* gates, const float* cprev, const float* c_now, int c_stride, const float* dy,
                                              int dy_stride, float* dgates, float* dhprev, float* dcprev, int batch, int steps, int t,
                                              int hidden, int padded) {
    after_prior();
    int n = batch * hidden;
    GRID_STRIDE(i, n) {
        int s = i / hidden, u = i - s * hidden;
        long long at = (long long)s * steps + t;
        const float* g = gates + at * 4 * padded;
        float* dg = dgates + at * 4 * padded;
        bool carried = t + 1 < steps;
        float dh = carried ? dhprev[(at + 1) * padded + u] : 0.0f;
        if (dy != nullptr) dh += dy[(long long)s * dy_stride + u];
        float ig = g[u], fg = g[padded + u], gg = g[2 * padded + u], og = g[3 * padded + u];
        float tc = tanhf(c_now[(long long)s * c_stride + u]);
        float dc = (carried ? dcprev[(at + 1) * padded + u] : 0.0f) + dh * og * (1.0f - tc * tc);
        dg[u] = dc * gg * ig * (1.0f - ig);
        dg[padded + u] = dc * cprev[at * padded + u] * fg * (1.0f - fg);
        dg[2 * padded + u] = dc * ig * (1.0f - gg * gg);
        dg[3 * padded + u] = dh * tc * og * (1.0f - og);
        dcprev[at * padded + u] = dc * fg;
        dhprev[at * padded + u] = 0.0f;
    }
}
