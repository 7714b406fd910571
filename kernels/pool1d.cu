// MaxPool1d (src/layers/pool1d.rs): window o of a channel reads taps o·s + j·d − p, j < k, that
// fall inside the signal; the first of them is the maximum so far, and a later one replaces it
// where it is greater or NaN (PyTorch's rule). Samples (C, L), rows of `length`.

// Index in `row` of the maximum of window o.
__device__ __forceinline__ int pool1d_argmax(const float* row, int o, int length, int k, int s, int p, int d) {
    int best = -1;
    for (int j = 0; j < k; j++) {
        int at = o * s + j * d - p;
        if (at < 0) continue;
        if (at >= length) break;
        float v = row[at];
        if (best < 0 || v > row[best] || v != v) best = at;
    }
    return best;
}

// y[s, c, o] = the maximum of window o; one thread per output value.
extern "C" __global__ void maxpool1d_forward(const float* x, float* y, int channels, int length, int out_len, int k, int s, int p, int d,
                                             int batch) {
    after_prior();
    int n = batch * channels * out_len;
    GRID_STRIDE(i, n) {
        int o = i % out_len, row = i / out_len;
        const float* xs = x + (long long)row * length;
        y[i] = xs[pool1d_argmax(xs, o, length, k, s, p, d)];
    }
}

// The same dx where the windows tile the signal (stride = window, no padding or dilation,
// length = out_len·k): every input in exactly one window, so one thread per WINDOW finds its
// maximum once and writes its k values, 0 + dy at the maximum (as the gather's sum from 0
// rounds) and 0 elsewhere; the gather below recomputes each window's maximum for each input.
extern "C" __global__ void maxpool1d_backward_tiles(const float* x, const float* dy, float* dx, int length, int out_len, int k, int windows) {
    after_prior();
    GRID_STRIDE(i, windows) {
        int o = i % out_len, row = i / out_len;
        long long base = (long long)row * length;
        int best = pool1d_argmax(x + base, o, length, k, k, 0, 1);
        float g = 0.0f + dy[i];
        for (int j = 0; j < k; j++) dx[base + o * k + j] = o * k + j == best ? g : 0.0f;
    }
}

// dx[s, c, t] = Σ dy over the windows whose maximum is input t, overwritten. One thread per INPUT
// value gathers from the windows holding it (o·s = t + p − j·d), in the CPU's order (o
// ascending, so j descending), so overlapping windows add deterministically and bit-equal to it.
extern "C" __global__ void maxpool1d_backward(const float* x, const float* dy, float* dx, int channels, int length, int out_len, int k,
                                              int s, int p, int d, int batch) {
    after_prior();
    int n = batch * channels * length;
    GRID_STRIDE(i, n) {
        int t = i % length, row = i / length;
        const float* xs = x + (long long)row * length;
        const float* dys = dy + (long long)row * out_len;
        float acc = 0.0f;
        for (int j = k - 1; j >= 0; j--) {
            int start = t + p - j * d;
            if (start < 0 || start % s != 0 || start / s >= out_len) continue;
            int o = start / s;
            if (pool1d_argmax(xs, o, length, k, s, p, d) == t) acc += dys[o];
        }
        dx[i] = acc;
    }
}
