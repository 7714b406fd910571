// Losses (src/loss.rs): gradients written in place, the value reduced on the device into one
// double, through per-sample (cross-entropy) or per-block (MSE) f64 partials and a single-block
// fixed-order sum. No atomics, so the loss is the same bit for bit on every run.

// Softmax cross-entropy on logits y (batch, classes) with labels: dy = (softmax(y) − onehot)·scale,
// partials[s] = log Σ_j e^{y_sj} − y_s,label (as the CPU computes it, in f32). scale = 1/batch.
// A label outside 0..classes gives a NaN partial (the host checks labels before upload).
extern "C" __global__ void softmax_xent(const float* y, const unsigned int* labels, float* dy, double* partials, int classes, int batch,
                                        float scale) {
    GRID_STRIDE(s, batch) {
        const float* row = y + (long long)s * classes;
        float* drow = dy + (long long)s * classes;
        float max = row[0];
        for (int j = 1; j < classes; j++) max = fmaxf(max, row[j]);
        float denom = 0.0f;
        for (int j = 0; j < classes; j++) {
            float e = expf(row[j] - max);
            drow[j] = e;
            denom += e;
        }
        unsigned int label = labels[s];
        float inv = 1.0f / denom;
        for (int j = 0; j < classes; j++) drow[j] = drow[j] * inv * scale;
        if (label < (unsigned int)classes) {
            partials[s] = (double)(max + logf(denom) - row[label]);
            drow[label] = drow[label] - scale;
        } else {
            partials[s] = __longlong_as_double(0x7ff8000000000000LL);
        }
    }
}

// Mean squared error over n values: dy = grad_scale·(y − t) with grad_scale = 2/n;
// partials[block] = Σ (y − t)² over the block's grid-stride share, in f64. The grid size must
// be mse_blocks(n) (src/cuda/ops.rs), a function of n alone, so the sum order is fixed.
extern "C" __global__ void mse(const float* y, const float* t, float* dy, double* partials, int n, float grad_scale) {
    __shared__ double buf[REDUCE_THREADS];
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        float d = y[i] - t[i];
        acc += (double)d * (double)d;
        dy[i] = grad_scale * d;
    }
    double sum = block_sum_f64(acc, buf);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// out[0] = scale · Σ partials[0..n], one block of REDUCE_THREADS threads, fixed order; and the
// running totals since the host last reset them: out[1] += out[0], out[2] += 1.
extern "C" __global__ void sum_partials(const double* partials, double* out, int n, double scale) {
    __shared__ double buf[REDUCE_THREADS];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += REDUCE_THREADS) acc += partials[i];
    double sum = block_sum_f64(acc, buf);
    if (threadIdx.x == 0) {
        out[0] = sum * scale;
        out[1] += sum * scale;
        out[2] += 1.0;
    }
}
