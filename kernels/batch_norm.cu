// Batch norm (src/layers/batch_norm.rs): `batch` samples of `channels × pixels` values; per
// channel c its n = batch·pixels values. Sums in f64, a block per channel, or, where that leaves
// the GPU idle (few channels over many values), a block per part of a channel's samples, the
// parts added by a second kernel in order of k: each thread's strided share in order, then
// block_sum_f64's fixed tree, so a result never depends on timing. The element-wise kernels
// evaluate the CPU's expressions in its order (--fmad=false), so where they read the same
// statistics they give its bits.

// The samples [*first, *end) that part k takes: k·chunk .. min(batch, (k + 1)·chunk) (the host
// makes every part hold a sample or more).
__device__ __forceinline__ void batch_norm_part(int k, int chunk, int batch, int* first, int* end) {
    *first = min(batch, k * chunk);
    *end = min(batch, *first + chunk);
}

// Block (c, k)'s two sums of part k of channel c into a[k·channels + c] and b[k·channels + c].
__device__ __forceinline__ void batch_norm_put_part(double* a, double* b, double va, double vb, int channels) {
    if (threadIdx.x == 0) {
        long long at = (long long)blockIdx.y * channels + blockIdx.x;
        a[at] = va;
        b[at] = vb;
    }
}

// A channel's values over samples [first, end) are `rows` = end − first rows of `pixels`, row r
// at (first + r)·channels·pixels + c·pixels. They are read as items of V (float, or float4 where
// pixels % 4 == 0 and every pointer read is 16-byte aligned, so that every row starts aligned):
// `width` = pixels / (floats a V) items a row. Thread t takes items t, t + 256, … of the rows
// laid end to end, walking (row, item) by the block's stride without a division per item.
struct BatchNormWalk {
    int row, item, rows, width, drow, ditem;
    long long stride;  // floats from a row to the next
};

__device__ __forceinline__ BatchNormWalk batch_norm_walk(int rows, int width, long long stride) {
    BatchNormWalk w;
    width = max(width, 1);
    w.row = threadIdx.x / width;
    w.item = threadIdx.x - w.row * width;
    w.drow = REDUCE_THREADS / width;
    w.ditem = REDUCE_THREADS - w.drow * width;
    w.rows = rows;
    w.width = width;
    w.stride = stride;
    return w;
}

// Offset in floats of the walk's item from the first row's start, then the walk moved on.
template <typename V>
__device__ __forceinline__ long long batch_norm_next(BatchNormWalk& w) {
    long long at = (long long)w.row * w.stride + (long long)w.item * (sizeof(V) / sizeof(float));
    w.item += w.ditem;
    w.row += w.drow;
    if (w.item >= w.width) {
        w.item -= w.width;
        w.row++;
    }
    return at;
}

__device__ __forceinline__ float batch_norm_load(const float* p, float) { return *p; }
__device__ __forceinline__ float4 batch_norm_load(const float* p, float4) { return *reinterpret_cast<const float4*>(p); }

// The lanes of a V in order: f(x) for a float, f(x.x), …, f(x.w) for a float4.
template <typename F> __device__ __forceinline__ void batch_norm_lanes(float v, F f) { f(v); }
template <typename F> __device__ __forceinline__ void batch_norm_lanes(float4 v, F f) {
    f(v.x);
    f(v.y);
    f(v.z);
    f(v.w);
}
template <typename F> __device__ __forceinline__ void batch_norm_lanes(float v, float u, F f) { f(v, u); }
template <typename F> __device__ __forceinline__ void batch_norm_lanes(float4 v, float4 u, F f) {
    f(v.x, u.x);
    f(v.y, u.y);
    f(v.z, u.z);
    f(v.w, u.w);
}

// f on each of the walk's items of a (and of b at the same offset; b may be a), in order; two
// items' loads in flight at a time.
template <typename V, typename F>
__device__ __forceinline__ void batch_norm_each(BatchNormWalk w, const float* a, const float* b, F f) {
    while (w.row < w.rows) {
        long long i = batch_norm_next<V>(w);
        bool two = w.row < w.rows;
        long long j = two ? batch_norm_next<V>(w) : i;
        V ai = batch_norm_load(a + i, V()), bi = batch_norm_load(b + i, V());
        V aj = batch_norm_load(a + j, V()), bj = batch_norm_load(b + j, V());
        f(ai, bi);
        if (two) f(aj, bj);
    }
}

// Σx over a walk's values (f64); the block's threads all get it.
template <typename V>
__device__ __forceinline__ double batch_norm_sum_of(const float* x, BatchNormWalk w, double* buf) {
    double s = 0.0;
    batch_norm_each<V>(w, x, x, [&](V v, V) { batch_norm_lanes(v, [&](float e) { s += (double)e; }); });
    return block_sum_f64(s, buf);
}

// Σ(x − m)² over a walk's values (f64); the block's threads all get it.
template <typename V>
__device__ __forceinline__ double batch_norm_squares_of(const float* x, BatchNormWalk w, double m, double* buf) {
    double q = 0.0;
    batch_norm_each<V>(w, x, x, [&](V v, V) {
        batch_norm_lanes(v, [&](float e) {
            double d = (double)e - m;
            q += d * d;
        });
    });
    return block_sum_f64(q, buf);
}

// Σx over a part's values into *sum, and Σ(x − m)² about their mean m into *squares (two passes,
// f64; the second reads the part again, which its size keeps in L2); the block's threads all get
// both. `count`: the part's values.
template <typename V>
__device__ __forceinline__ void batch_norm_moments_of(const float* x, BatchNormWalk w, int count, double* buf, double* sum, double* squares) {
    double s = batch_norm_sum_of<V>(x, w, buf);
    double m = count > 0 ? s / (double)count : 0.0;
    *sum = s;
    *squares = batch_norm_squares_of<V>(x, w, m, buf);
}

// Whether a channel's rows may be read as float4 (see BatchNormWalk).
__device__ __forceinline__ bool batch_norm_fours(int pixels, const float* a, const float* b) {
    return (pixels & 3) == 0 && (((unsigned long long)a | (unsigned long long)b) & 15) == 0;
}

// batch_norm_moments_of over channel c's values of samples [first, end).
__device__ __forceinline__ void batch_norm_moments(const float* x, int c, int channels, int pixels, int first, int end, double* buf,
                                                   double* sum, double* squares) {
    long long stride = (long long)channels * pixels;
    const float* row = x + (long long)first * stride + (long long)c * pixels;
    int count = (end - first) * pixels;
    if (batch_norm_fours(pixels, x, x))
        batch_norm_moments_of<float4>(row, batch_norm_walk(end - first, pixels / 4, stride), count, buf, sum, squares);
    else
        batch_norm_moments_of<float>(row, batch_norm_walk(end - first, pixels, stride), count, buf, sum, squares);
}

// r = 1/√(σ² + eps) of a channel's Σ(x − μ)² over its n values (σ² biased), as every route
// rounds it.
__device__ __forceinline__ float batch_norm_inv(double squares, int n, float eps) {
    float var = (float)(squares / (double)n);
    return 1.0f / sqrtf(var + eps);
}

// From channel c's μ and Σ(x − μ)² over its n values: mean[c] = μ and inv[c] = 1/√(σ² + eps)
// (σ² biased); the running mean and variance (unbiased: Σ(x − μ)²/(n − 1)) moved by `momentum`;
// count[0] += 1 (channel 0's).
__device__ __forceinline__ void batch_norm_finish(int c, double mu, double squares, int n, float* mean, float* inv, float* running_mean,
                                                  float* running_var, float* count, float momentum, float eps) {
    mean[c] = (float)mu;
    inv[c] = batch_norm_inv(squares, n, eps);
    running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * (float)mu;
    running_var[c] = (1.0f - momentum) * running_var[c] + momentum * (float)(squares / (double)(n - 1));
    if (c == 0) count[0] += 1.0f;
}

// μ and r of each channel and the running statistics (batch_norm_finish). Grid: one block per
// channel.
extern "C" __global__ void batch_norm_stats(const float* x, float* mean, float* inv, float* running_mean, float* running_var,
                                            float* count, int channels, int pixels, int batch, float momentum, float eps) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    int n = batch * pixels;
    double sum, squares;
    batch_norm_moments(x, c, channels, pixels, 0, batch, buf, &sum, &squares);
    if (threadIdx.x == 0) batch_norm_finish(c, sum / (double)n, squares, n, mean, inv, running_mean, running_var, count, momentum, eps);
}

// Part k of channel c's statistics (batch_norm_part): sums[k·channels + c] = Σx and
// squares[k·channels + c] = Σ(x − m_k)² about the part's own mean m_k. Grid: (channels, parts).
extern "C" __global__ void batch_norm_stats_split(const float* x, double* sums, double* squares, int channels, int pixels, int batch,
                                                  int chunk) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x, first, end;
    batch_norm_part(blockIdx.y, chunk, batch, &first, &end);
    double sum, q;
    batch_norm_moments(x, c, channels, pixels, first, end, buf, &sum, &q);
    batch_norm_put_part(sums, squares, sum, q, channels);
}

// batch_norm_stats from the `parts` parts of batch_norm_stats_split: μ = Σ_k sums_k / n and
// Σ(x − μ)² = Σ_k (squares_k + n_k·(m_k − μ)²), m_k = sums_k / n_k (the sum of squares about μ
// is exactly that of the parts about their own means plus their means' about μ: every term ≥ 0,
// nothing cancels). Grid: one block per channel; thread t adds parts t, t + 256, … in order,
// then block_sum_f64's fixed tree, so a result never depends on timing.
extern "C" __global__ void batch_norm_stats_join(const double* sums, const double* squares, float* mean, float* inv, float* running_mean,
                                                 float* running_var, float* count, int channels, int pixels, int batch, int chunk,
                                                 int parts, float momentum, float eps) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    int n = batch * pixels;
    double total = 0.0;
    for (int k = threadIdx.x; k < parts; k += REDUCE_THREADS) total += sums[(long long)k * channels + c];
    double mu = block_sum_f64(total, buf) / (double)n;
    double q = 0.0;
    for (int k = threadIdx.x; k < parts; k += REDUCE_THREADS) {
        int first, end;
        batch_norm_part(k, chunk, batch, &first, &end);
        if (end == first) continue;
        double nk = (double)(end - first) * (double)pixels;
        double d = sums[(long long)k * channels + c] / nk - mu;
        q += squares[(long long)k * channels + c] + nk * d * d;
    }
    q = block_sum_f64(q, buf);
    if (threadIdx.x == 0) batch_norm_finish(c, mu, q, n, mean, inv, running_mean, running_var, count, momentum, eps);
}

// The element-wise kernels' grid (RowTiles in src/cuda/layers.rs): `rows` = batch·channels rows
// of `pixels` values, read as items of V (float4 where `fours`: pixels % 4 == 0 and every
// pointer 16-byte aligned); a block's threads in 256 >> lanes_log2 rows of 1 << lanes_log2
// lanes; block (bx, by)'s row bx·(256 >> lanes_log2) + its thread's, its items by·lanes + lane,
// then on by gridDim.y·lanes. The row (−1 past the last) of the thread: its channel costs one
// division a thread, not one a value.
__device__ __forceinline__ int batch_norm_row(int rows, int lanes_log2) {
    int row = blockIdx.x * (REDUCE_THREADS >> lanes_log2) + (threadIdx.x >> lanes_log2);
    return row < rows ? row : -1;
}

// f(item) for each of the thread's items of its row (width: items a row).
template <typename F> __device__ __forceinline__ void batch_norm_items(int width, int lanes_log2, F f) {
    int lanes = 1 << lanes_log2;
    for (int item = blockIdx.y * lanes + (threadIdx.x & (lanes - 1)); item < width; item += gridDim.y * lanes) f(item);
}

// f lane by lane: f(a) for a float, (f(a.x), …, f(a.w)) for a float4, and with a second
// operand f(a, b) the same way.
template <typename F> __device__ __forceinline__ float batch_norm_map(float a, F f) { return f(a); }
template <typename F> __device__ __forceinline__ float4 batch_norm_map(float4 a, F f) { return make_float4(f(a.x), f(a.y), f(a.z), f(a.w)); }
template <typename F> __device__ __forceinline__ float batch_norm_map(float a, float b, F f) { return f(a, b); }
template <typename F> __device__ __forceinline__ float4 batch_norm_map(float4 a, float4 b, F f) {
    return make_float4(f(a.x, b.x), f(a.y, b.y), f(a.z, b.z), f(a.w, b.w));
}

template <typename V> __device__ __forceinline__ void batch_norm_store(float* p, V v) { *reinterpret_cast<V*>(p) = v; }

// z = ((x − μ)·r)·γ + β at offset i, an item of V, and y = act(z) there unless y is null: the
// values of batch_norm_apply and of the fused forward's last pass.
template <typename V>
__device__ __forceinline__ void batch_norm_apply_at(const float* x, float* z, float* y, long long i, float m, float r, float g, float b,
                                                    int act, float slope) {
    V v = batch_norm_map(batch_norm_load(x + i, V()), [&](float e) { return (e - m) * r * g + b; });
    batch_norm_store(z + i, v);
    if (y != nullptr) batch_norm_store(y + i, batch_norm_map(v, [&](float e) { return act_apply(act, slope, e); }));
}

// dx = (γ·r)·(dy − (dβ + x̂·dγ)·(1/count)) at offset i, an item of V: the values of
// batch_norm_input_grad and of the fused backward's last pass.
template <typename V>
__device__ __forceinline__ void batch_norm_input_grad_at(const float* x, const float* dy, float* dx, long long i, float m, float r, float g,
                                                         float dg, float db, float inv_count) {
    V xv = batch_norm_load(x + i, V()), d = batch_norm_load(dy + i, V());
    batch_norm_store(dx + i, batch_norm_map(xv, d, [&](float xe, float de) { return g * r * (de - (db + (xe - m) * r * dg) * inv_count); }));
}

// batch_norm_apply's values of the thread's row (at `at` floats in) as items of V.
template <typename V>
__device__ __forceinline__ void batch_norm_apply_row(const float* x, float* z, float* y, long long at, int width, int lanes_log2, float m,
                                                     float r, float g, float b, int act, float slope) {
    const int floats = sizeof(V) / sizeof(float);
    batch_norm_items(width, lanes_log2, [&](int item) { batch_norm_apply_at<V>(x, z, y, at + (long long)item * floats, m, r, g, b, act, slope); });
}

// z = ((x − μ)·r)·γ + β over `rows` rows of `pixels` values, row s·channels + c of channel c,
// (μ, r) = (mean[c], inv[c]); with `from_running`, `inv` holds the running variance and r =
// 1/√(inv[c] + eps). Then y = act(z) unless y is null (an identity, whose z is its y). Grid:
// see batch_norm_row.
extern "C" __global__ void batch_norm_apply(const float* x, float* z, float* y, const float* mean, const float* inv, const float* gamma,
                                            const float* beta, int act, float slope, int channels, int pixels, int rows, int fours,
                                            int lanes_log2, float eps, int from_running) {
    after_prior();
    int row = batch_norm_row(rows, lanes_log2);
    if (row < 0) return;
    int c = row % channels;
    float r = from_running ? 1.0f / sqrtf(inv[c] + eps) : inv[c];
    float m = mean[c], g = gamma[c], b = beta[c];
    long long at = (long long)row * pixels;
    if (fours)
        batch_norm_apply_row<float4>(x, z, y, at, pixels / 4, lanes_log2, m, r, g, b, act, slope);
    else
        batch_norm_apply_row<float>(x, z, y, at, pixels, lanes_log2, m, r, g, b, act, slope);
}

// Σ dy into *sum and Σ dy·x̂ into *sum_xhat over channel c's values of samples [first, end), x̂
// = (x − m)·r (f32, as on the CPU), in f64; the block's threads all get both.
__device__ __forceinline__ void batch_norm_grad_sums(const float* x, const float* dy, float m, float r, int c, int channels, int pixels,
                                                     int first, int end, double* buf, double* sum, double* sum_xhat) {
    long long stride = (long long)channels * pixels, at = (long long)first * stride + (long long)c * pixels;
    double s = 0.0, sx = 0.0;
    auto add = [&](float xv, float d) {
        s += (double)d;
        sx += (double)d * (double)((xv - m) * r);
    };
    if (batch_norm_fours(pixels, x, dy))
        batch_norm_each<float4>(batch_norm_walk(end - first, pixels / 4, stride), x + at, dy + at,
                                [&](float4 xv, float4 d) { batch_norm_lanes(xv, d, add); });
    else
        batch_norm_each<float>(batch_norm_walk(end - first, pixels, stride), x + at, dy + at, [&](float xv, float d) { add(xv, d); });
    *sum = block_sum_f64(s, buf);
    *sum_xhat = block_sum_f64(sx, buf);
}

// dgamma[c] = Σ dy·x̂ and dbeta[c] = Σ dy over channel c, x̂ = (x − mean[c])·inv[c]; overwritten
// (dy: the gradient of z, the normalised values before an activation).
// Grid: one block per channel.
extern "C" __global__ void batch_norm_param_grads(const float* x, const float* dy, const float* mean, const float* inv, float* dgamma,
                                                  float* dbeta, int channels, int pixels, int batch) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    double sum, sum_xhat;
    batch_norm_grad_sums(x, dy, mean[c], inv[c], c, channels, pixels, 0, batch, buf, &sum, &sum_xhat);
    if (threadIdx.x == 0) {
        dgamma[c] = (float)sum_xhat;
        dbeta[c] = (float)sum;
    }
}

// Part k of channel c's parameter gradients (batch_norm_part): sums[k·channels + c] = Σ dy and
// sums_xhat[k·channels + c] = Σ dy·x̂. Grid: (channels, parts).
extern "C" __global__ void batch_norm_param_grads_split(const float* x, const float* dy, const float* mean, const float* inv, double* sums,
                                                        double* sums_xhat, int channels, int pixels, int batch, int chunk) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x, first, end;
    batch_norm_part(blockIdx.y, chunk, batch, &first, &end);
    double sum, sum_xhat;
    batch_norm_grad_sums(x, dy, mean[c], inv[c], c, channels, pixels, first, end, buf, &sum, &sum_xhat);
    batch_norm_put_part(sums, sums_xhat, sum, sum_xhat, channels);
}

// dgamma[c] = Σ_k sums_xhat[k·channels + c] and dbeta[c] = Σ_k sums[k·channels + c] over the
// `parts` parts of batch_norm_param_grads_split; overwritten. Grid: one block per channel,
// summing as batch_norm_stats_join does (a fixed order).
extern "C" __global__ void batch_norm_param_grads_join(const double* sums, const double* sums_xhat, float* dgamma, float* dbeta,
                                                       int channels, int parts) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    int c = blockIdx.x;
    double sum = 0.0, sum_xhat = 0.0;
    for (int k = threadIdx.x; k < parts; k += REDUCE_THREADS) {
        sum += sums[(long long)k * channels + c];
        sum_xhat += sums_xhat[(long long)k * channels + c];
    }
    sum = block_sum_f64(sum, buf);
    sum_xhat = block_sum_f64(sum_xhat, buf);
    if (threadIdx.x == 0) {
        dgamma[c] = (float)sum_xhat;
        dbeta[c] = (float)sum;
    }
}

// batch_norm_input_grad's values of the thread's row (at `at` floats in) as items of V.
template <typename V>
__device__ __forceinline__ void batch_norm_input_grad_row(const float* x, const float* dy, float* dx, long long at, int width, int lanes_log2,
                                                          float m, float r, float g, float dg, float db, float inv_count) {
    const int floats = sizeof(V) / sizeof(float);
    batch_norm_items(width, lanes_log2,
                     [&](int item) { batch_norm_input_grad_at<V>(x, dy, dx, at + (long long)item * floats, m, r, g, dg, db, inv_count); });
}

// dx = (γ·r)·(dy − (dβ + x̂·dγ)·(1/count)) over `rows` rows of `pixels` values (as
// batch_norm_apply's), overwritten; dγ and dβ from batch_norm_param_grads, `inv_count` =
// 1/(batch·pixels) rounded to f32. Grid: see batch_norm_row.
extern "C" __global__ void batch_norm_input_grad(const float* x, const float* dy, float* dx, const float* mean, const float* inv,
                                                 const float* gamma, const float* dgamma, const float* dbeta, int channels, int pixels,
                                                 int rows, int fours, int lanes_log2, float inv_count) {
    after_prior();
    int row = batch_norm_row(rows, lanes_log2);
    if (row < 0) return;
    int c = row % channels;
    float m = mean[c], r = inv[c], g = gamma[c], dg = dgamma[c], db = dbeta[c];
    long long at = (long long)row * pixels;
    if (fours)
        batch_norm_input_grad_row<float4>(x, dy, dx, at, pixels / 4, lanes_log2, m, r, g, dg, db, inv_count);
    else
        batch_norm_input_grad_row<float>(x, dy, dx, at, pixels, lanes_log2, m, r, g, dg, db, inv_count);
}

// ---- The fused route (src/cuda/routes/norm.rs): a training pass's forward, or its backward, in one
// launch. A cluster of P blocks a channel (grid.x = channels·P in clusters of P along x; P = 1
// launches no cluster, as before sm_90): block k of channel c's cluster takes part k of the
// samples (batch_norm_part with `chunk`). Each block's sums go to its shared memory; after the
// cluster's barrier every block adds the P parts in rank order (the same totals in each, never
// depending on timing) and goes on over its own part: the forward's z and y, the backward's dx.
// The sums of squares are taken about the channel's mean (known to every block by then), not a
// part's own. With P = 1 every value is the bits of the split route with one part (where the
// same pointers are 16-byte aligned, so that both read float4s): the same walks, sums and
// expressions.

// Σ over the cluster's blocks, in rank order, of the `mine` each block put in its `slot`; every
// thread of the block gets it (`total`: one shared slot to hand it round).
__device__ __forceinline__ double batch_norm_cluster_total(double mine, double* slot, double* total) {
    if (threadIdx.x == 0) *slot = mine;
    cluster_sync();
    if (threadIdx.x == 0) {
        double t = cluster_load_f64(slot, 0);
        for (int r = 1; r < cluster_blocks(); r++) t += cluster_load_f64(slot, r);
        *total = t;
    }
    __syncthreads();
    return *total;
}

// The forward's last pass over a part: z = ((x − μ)·r)·γ + β, y = act(z) unless y is null.
template <typename V>
__device__ __forceinline__ void batch_norm_train_apply(BatchNormWalk w, const float* x, float* z, float* y, float m, float r, float g, float b,
                                                       int act, float slope) {
    while (w.row < w.rows) batch_norm_apply_at<V>(x, z, y, batch_norm_next<V>(w), m, r, g, b, act, slope);
}

// batch_norm_stats then batch_norm_apply (not from the running statistics) in one launch: μ, r
// into mean, inv; the running statistics and count moved (by rank 0 of each cluster); z, and y
// = act(z) unless y is null. Grid: see above.
extern "C" __global__ void batch_norm_train_forward(const float* x, float* z, float* y, float* mean, float* inv, float* running_mean,
                                                    float* running_var, float* count, const float* gamma, const float* beta, int act,
                                                    float slope, int channels, int pixels, int batch, int chunk, float momentum,
                                                    float eps) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    __shared__ double slots[3];
    const int k = cluster_rank(), c = blockIdx.x / cluster_blocks(), n = batch * pixels;
    int first, end;
    batch_norm_part(k, chunk, batch, &first, &end);
    const long long stride = (long long)channels * pixels, at = (long long)first * stride + (long long)c * pixels;
    // the sums read x as batch_norm_stats does; the last pass writes z and y too
    const bool sum4 = batch_norm_fours(pixels, x, x);
    const bool apply4 = batch_norm_fours(pixels, x, z) && batch_norm_fours(pixels, z, y == nullptr ? z : y);
    BatchNormWalk ws = batch_norm_walk(end - first, sum4 ? pixels / 4 : pixels, stride);
    double s = sum4 ? batch_norm_sum_of<float4>(x + at, ws, buf) : batch_norm_sum_of<float>(x + at, ws, buf);
    double mu = batch_norm_cluster_total(s, &slots[0], &slots[2]) / (double)n;
    double q = sum4 ? batch_norm_squares_of<float4>(x + at, ws, mu, buf) : batch_norm_squares_of<float>(x + at, ws, mu, buf);
    double squares = batch_norm_cluster_total(q, &slots[1], &slots[2]);
    cluster_arrive();
    if (k == 0 && threadIdx.x == 0) batch_norm_finish(c, mu, squares, n, mean, inv, running_mean, running_var, count, momentum, eps);
    float m = (float)mu, r = batch_norm_inv(squares, n, eps), g = gamma[c], b = beta[c];
    float* yp = y == nullptr ? nullptr : y + at;
    if (apply4)
        batch_norm_train_apply<float4>(batch_norm_walk(end - first, pixels / 4, stride), x + at, z + at, yp, m, r, g, b, act, slope);
    else
        batch_norm_train_apply<float>(batch_norm_walk(end - first, pixels, stride), x + at, z + at, yp, m, r, g, b, act, slope);
    cluster_wait();
}

// The gradient of z at offset i of a part: dz[i] as stored where dy is null, else dy ⊙ act'(z)
// (act_backward's expression, reading z and y as `rz`, `ry` say), stored to dz[i].
struct BatchNormDz {
    const float *z, *y, *dy;
    float* dz;
    int act;
    float slope;
    bool rz, ry;
    __device__ __forceinline__ float get(long long i, float) const {
        if (dy == nullptr) return dz[i];
        float v = act_grad1(act, slope, rz, ry, z, y, dy, i);
        dz[i] = v;
        return v;
    }
    __device__ __forceinline__ float4 get(long long i, float4) const {
        if (dy == nullptr) return *reinterpret_cast<const float4*>(dz + i);
        float4 v = act_grad4(act, slope, *reinterpret_cast<const float4*>(dy + i), act_load4(z + i, 0, rz), act_load4(y + i, 0, ry));
        *reinterpret_cast<float4*>(dz + i) = v;
        return v;
    }
};

// The backward's first pass over a part: Σ dz and Σ dz·x̂ (batch_norm_grad_sums' order), dz
// computed and stored on the way where `d` computes it.
template <typename V>
__device__ __forceinline__ void batch_norm_train_grad_sums(BatchNormWalk w, const float* x, const BatchNormDz& d, float m, float r,
                                                           double* buf, double* sum, double* sum_xhat) {
    double s = 0.0, sx = 0.0;
    auto add = [&](float xv, float de) {
        s += (double)de;
        sx += (double)de * (double)((xv - m) * r);
    };
    while (w.row < w.rows) {
        long long i = batch_norm_next<V>(w);
        batch_norm_lanes(batch_norm_load(x + i, V()), d.get(i, V()), add);
    }
    *sum = block_sum_f64(s, buf);
    *sum_xhat = block_sum_f64(sx, buf);
}

// The backward's last pass over a part: dx from dz as the first pass left it.
template <typename V>
__device__ __forceinline__ void batch_norm_train_input_grad(BatchNormWalk w, const float* x, const float* dz, float* dx, float m, float r,
                                                            float g, float dg, float db, float inv_count) {
    while (w.row < w.rows) batch_norm_input_grad_at<V>(x, dz, dx, batch_norm_next<V>(w), m, r, g, dg, db, inv_count);
}

// act_backward (where dy is given; else dz holds the gradient of z already), then
// batch_norm_param_grads (dgamma, dbeta overwritten, by rank 0 of each cluster), then
// batch_norm_input_grad into dx unless dx is null, in one launch. `reads`: act_backward's.
// Grid: see above.
extern "C" __global__ void batch_norm_train_backward(const float* x, const float* z, const float* y, const float* dy, float* dz, float* dx,
                                                     const float* mean, const float* inv, const float* gamma, float* dgamma, float* dbeta,
                                                     int act, float slope, int reads, int channels, int pixels, int batch, int chunk,
                                                     float inv_count) {
    after_prior();
    __shared__ double buf[REDUCE_THREADS];
    __shared__ double slots[3];
    const int k = cluster_rank(), c = blockIdx.x / cluster_blocks();
    int first, end;
    batch_norm_part(k, chunk, batch, &first, &end);
    const long long stride = (long long)channels * pixels, at = (long long)first * stride + (long long)c * pixels;
    const bool rz = (reads & 1) != 0, ry = (reads & 2) != 0;
    // z, y and dy may be null (dz given, or act' reading neither): no offset from a null
    auto part = [&](const float* p) { return p == nullptr ? nullptr : p + at; };
    const BatchNormDz d{part(z), part(y), part(dy), dz + at, act, slope, rz, ry};
    bool fours = batch_norm_fours(pixels, x, dz) && (dx == nullptr || batch_norm_fours(pixels, dx, dx));
    if (dy != nullptr) fours = fours && batch_norm_fours(pixels, dy, rz ? z : dy) && batch_norm_fours(pixels, ry ? y : dy, dy);
    const float m = mean[c], r = inv[c];
    const int width = fours ? pixels / 4 : pixels;
    double s, sx;
    if (fours)
        batch_norm_train_grad_sums<float4>(batch_norm_walk(end - first, width, stride), x + at, d, m, r, buf, &s, &sx);
    else
        batch_norm_train_grad_sums<float>(batch_norm_walk(end - first, width, stride), x + at, d, m, r, buf, &s, &sx);
    double sum = batch_norm_cluster_total(s, &slots[0], &slots[2]);
    double sum_xhat = batch_norm_cluster_total(sx, &slots[1], &slots[2]);
    cluster_arrive();
    if (k == 0 && threadIdx.x == 0) {
        dgamma[c] = (float)sum_xhat;
        dbeta[c] = (float)sum;
    }
    if (dx != nullptr) {
        float g = gamma[c], dg = (float)sum_xhat, db = (float)sum;
        BatchNormWalk w = batch_norm_walk(end - first, width, stride);
        if (fours)
            batch_norm_train_input_grad<float4>(w, x + at, dz + at, dx + at, m, r, g, dg, db, inv_count);
        else
            batch_norm_train_input_grad<float>(w, x + at, dz + at, dx + at, m, r, g, dg, db, inv_count);
    }
    cluster_wait();
}
