// Losses (src/loss.rs): gradients written in place and the value reduced on the device in one
// launch. Each block sums its grid-stride share in f64 (each thread in a fixed order, then a
// fixed shared-memory tree) into partials[block]; the last block to finish (a counter, reset by
// that block) sums the partials in block order. A launch of one block writes its sum directly.
// The grid size is a function of the size alone (loss_blocks in src/cuda/ops.rs), so the loss
// is the same bit for bit on every run.
// loss[0] = the value; the running totals since the host last reset them: loss[1] += loss[0],
// loss[2] += 1. `scratch`: the counter (in the bits of its first double, zero before the first
// launch), then gridDim.x partials.

// The running totals, loss[1] and loss[2], read by thread 0 when the launch starts (only the
// launch itself writes them), so that their read is not one more wait at its end.
struct LossTotals {
    double sum, count;
};

__device__ __forceinline__ LossTotals loss_totals(const double* loss) {
    LossTotals t = {0.0, 0.0};
    if (threadIdx.x == 0) {
        t.sum = loss[1];
        t.count = loss[2];
    }
    return t;
}

// Thread 0 stores the loss's value, total·scale, and adds it to the running totals.
__device__ __forceinline__ void store_loss(double total, double scale, double* loss, LossTotals totals) {
    if (threadIdx.x == 0) {
        double value = total * scale;
        loss[0] = value;
        loss[1] = totals.sum + value;
        loss[2] = totals.count + 1.0;
    }
}

__device__ void finish_loss(double block_sum, double* scratch, double scale, double* loss, LossTotals totals, double* buf) {
    __shared__ bool last;
    unsigned int* counter = (unsigned int*)scratch;
    double* partials = scratch + 1;
    if (gridDim.x == 1) {
        // one block (up to 256 samples or values): its sum is the total, exactly what the last
        // block would compute from one partial, without the fences and the counter
        store_loss(block_sum, scale, loss, totals);
        return;
    }
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = block_sum;
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    double acc = 0.0;
    for (int b = threadIdx.x; b < gridDim.x; b += REDUCE_THREADS) acc += ((volatile double*)partials)[b];
    store_loss(block_sum_f64(acc, buf), scale, loss, totals);
    if (threadIdx.x == 0) *counter = 0u;
}

// The loss of a launch that left `count` partial sums (the heads in head.cu, a unit of warps'
// each):
// one block sums them (each thread every REDUCE_THREADS-th in order, then a fixed tree), so the
// launch that made them pays no fence, counter or last block, and this one can run beside the
// rest of the step.
extern "C" __global__ void loss_sum(const double* partials, int count, double scale, double* loss) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    LossTotals totals = loss_totals(loss);
    double acc = 0.0;
    for (int i = threadIdx.x; i < count; i += REDUCE_THREADS) acc += partials[i];
    store_loss(block_sum_f64(acc, buf), scale, loss, totals);
}

// Softmax cross-entropy on logits y (batch, classes) with labels: dy = (softmax(y) − onehot)·scale
// with scale = 1/batch, value = mean over the batch of log Σ_j e^{y_sj} − y_s,label (each term in
// f32, as the CPU computes it). A label outside 0..classes makes the value NaN (the host checks
// labels before they reach the device).
extern "C" __global__ void softmax_xent(const float* y, const unsigned int* labels, float* dy, double* loss, double* scratch, int classes,
                                        int batch, float scale, double mean_scale) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    LossTotals totals = loss_totals(loss);
    double acc = 0.0;
    GRID_STRIDE(s, batch) {
        const float* row = y + (long long)s * classes;
        float* drow = dy + (long long)s * classes;
        float max = row[0];
        for (int j = 1; j < classes; j++) max = fmaxf(max, row[j]);
        float denom = 0.0f;
        for (int j = 0; j < classes; j++) denom += expf(row[j] - max);
        unsigned int label = labels[s];
        float inv = 1.0f / denom;
        // each e^{y − max} again, the same bits, rather than written and read back: a store and
        // a load of the same global value cost a round trip to memory
        for (int j = 0; j < classes; j++) drow[j] = expf(row[j] - max) * inv * scale;
        if (label < (unsigned int)classes) {
            acc += (double)(max + logf(denom) - row[label]);
            drow[label] = drow[label] - scale;
        } else {
            acc += __longlong_as_double(0x7ff8000000000000LL);
        }
    }
    finish_loss(block_sum_f64(acc, buf), scratch, mean_scale, loss, totals, buf);
}

// Mean squared error over n values: dy = grad_scale·(y − t) with grad_scale = 2/n, value =
// Σ (y − t)² · mean_scale with mean_scale = 1/n, summed in f64.
extern "C" __global__ void mse(const float* y, const float* t, float* dy, double* loss, double* scratch, int n, float grad_scale,
                               double mean_scale) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    LossTotals totals = loss_totals(loss);
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        float d = y[i] - t[i];
        acc += (double)d * (double)d;
        dy[i] = grad_scale * d;
    }
    finish_loss(block_sum_f64(acc, buf), scratch, mean_scale, loss, totals, buf);
}

// The losses of one term per value (src/loss.rs, `Loss::term`) over n values, `kind` saying
// which (`ops::elementwise_loss_kind`): 0 binary cross-entropy on logits, ℓ = max(y, 0) − y·t +
// ln(1 + e^−|y|), ℓ′ = σ(y) − t; 1 L1, ℓ = |d|, ℓ′ = sign(d) (0 at 0); 2 smooth L1 with
// `beta`, ℓ = ½d²/β where |d| < β, else |d| − ½β, ℓ′ = d/β or sign(d); d = y − t. dy =
// ℓ′·grad_scale with grad_scale = 1/n in f32, value = Σ ℓ (each in f32, summed in f64) ·
// mean_scale with mean_scale = 1/n: the CPU's operations in its order.
__device__ __forceinline__ float loss_sign(float v) { return v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f); }

extern "C" __global__ void elementwise_loss(const float* y, const float* t, float* dy, double* loss, double* scratch, int n, int kind,
                                            float beta, float grad_scale, double mean_scale) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    LossTotals totals = loss_totals(loss);
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        float v = y[i], target = t[i], value, grad;
        if (kind == 0) {
            value = fmaxf(v, 0.0f) - v * target + log1pf(expf(-fabsf(v)));
            grad = 1.0f / (1.0f + expf(-v)) - target;
        } else {
            float d = v - target, a = fabsf(d);
            if (kind == 2 && a < beta) {
                value = 0.5f * d * d / beta;
                grad = d / beta;
            } else {
                value = kind == 2 ? a - 0.5f * beta : a;
                grad = loss_sign(d);
            }
        }
        acc += (double)value;
        dy[i] = grad * grad_scale;
    }
    finish_loss(block_sum_f64(acc, buf), scratch, mean_scale, loss, totals, buf);
}
