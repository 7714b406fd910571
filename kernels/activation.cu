// Bias and activation (src/activation.rs, src/layers/mod.rs). Each activation `<name>` of the
// Rust enum has two device functions here, act_apply_<name>(p, z) and act_derivative_<name>(p, z,
// y) (p: its parameter, leaky ReLU's slope or ELU's alpha; y = act(z)); the prelude generated from the enum
// (src/cuda/context.rs) defines ACT_<NAME> as its id and ACT_APPLY_SWITCH / ACT_DERIVATIVE_SWITCH,
// which call them, so an activation with no functions here does not compile.

// Φ(z) = (1 + erf(z/√2)) / 2 by CUDA's erff (within 2 ulp), as PyTorch's GELU evaluates it. The
// CPU's spec (src/activation.rs) uses a rational fit of erf (|error| < 1.2e-7) and its fast path
// (src/cpu/vmath) a polynomial within a few ulp: the devices agree to about 1e-7·|z|, not to
// rounding. An IEEE division and an expf a value, as the fit takes, made the bias and GELU pass
// compute-bound.
__device__ __forceinline__ float normal_cdf(float z) {
    return 0.5f * (1.0f + erff(z * 0.70710678118654752f));
}

__device__ __forceinline__ float act_apply_identity(float p, float z) { return z; }
__device__ __forceinline__ float act_derivative_identity(float p, float z, float y) { return 1.0f; }

__device__ __forceinline__ float act_apply_relu(float p, float z) { return fmaxf(z, 0.0f); }
__device__ __forceinline__ float act_derivative_relu(float p, float z, float y) { return z > 0.0f ? 1.0f : 0.0f; }

__device__ __forceinline__ float act_apply_leaky_relu(float p, float z) { return z > 0.0f ? z : p * z; }
__device__ __forceinline__ float act_derivative_leaky_relu(float p, float z, float y) { return z > 0.0f ? 1.0f : p; }

__device__ __forceinline__ float act_apply_tanh(float p, float z) { return tanhf(z); }
__device__ __forceinline__ float act_derivative_tanh(float p, float z, float y) { return 1.0f - y * y; }

__device__ __forceinline__ float act_apply_sigmoid(float p, float z) { return 1.0f / (1.0f + expf(-z)); }
__device__ __forceinline__ float act_derivative_sigmoid(float p, float z, float y) { return y * (1.0f - y); }

// d/dz z·Φ(z) = Φ(z) + z·φ(z)
__device__ __forceinline__ float act_apply_gelu(float p, float z) { return z * normal_cdf(z); }
__device__ __forceinline__ float act_derivative_gelu(float p, float z, float y) {
    return normal_cdf(z) + z * 0.3989422804014327f * expf(-(z * z) * 0.5f);
}

// z·σ(z) = z / (1 + e^−z); d/dz = σ(z)·(1 + z·(1 − σ(z)))
__device__ __forceinline__ float act_apply_silu(float p, float z) { return z / (1.0f + expf(-z)); }
__device__ __forceinline__ float act_derivative_silu(float p, float z, float y) {
    float s = 1.0f / (1.0f + expf(-z));
    return s * (1.0f + z * (1.0f - s));
}

// p = alpha: z for z > 0, else alpha·(e^z − 1); d/dz = alpha·e^z there (not y + alpha, which
// cancels to 0 where e^z is below an ulp), as the CPU
__device__ __forceinline__ float act_apply_elu(float p, float z) { return z > 0.0f ? z : p * expm1f(z); }
__device__ __forceinline__ float act_derivative_elu(float p, float z, float y) { return z > 0.0f ? 1.0f : p * expf(z); }

// ln(1 + e^z), z itself above 20 (PyTorch's threshold, beta 1); d/dz = σ(z), 1 above 20
__device__ __forceinline__ float act_apply_softplus(float p, float z) { return z > 20.0f ? z : log1pf(expf(z)); }
__device__ __forceinline__ float act_derivative_softplus(float p, float z, float y) {
    return z > 20.0f ? 1.0f : 1.0f / (1.0f + expf(-z));
}

// y = act(z), act an ACT_ id and slope its parameter
__device__ __forceinline__ float act_apply(int act, float slope, float z) {
    ACT_APPLY_SWITCH(act, slope, z)
}

// d act / dz at z, given y = act(z)
__device__ __forceinline__ float act_derivative(int act, float slope, float z, float y) {
    ACT_DERIVATIVE_SWITCH(act, slope, z, y)
}

// z[s, c, p] += bias[c] over n = batch·channels·pixels values; then y = act(z) unless y is
// null (an identity layer, whose z is its output). With keep_z 0 and a y, z + b goes to y alone
// and z is only read (an inference pass, after which no step reads a z). The first `quads`
// fours of values go as float4 (the host passes 0 unless every pointer is 16-byte aligned and a
// four shares its row: pixels a multiple of 4, whose four share one bias, or pixels 1 and
// channels a multiple of 4, whose four take four consecutive biases), the rest one at a time. A
// value's channel costs integer divisions, which bound this kernel where each value paid them: a
// four pays them once.
__device__ __forceinline__ float4 bias_act4(float4 v, float4 b, float* y, int q, int act, float slope) {
    v = make_float4(v.x + b.x, v.y + b.y, v.z + b.z, v.w + b.w);
    if (y != nullptr)
        reinterpret_cast<float4*>(y)[q] =
            make_float4(act_apply(act, slope, v.x), act_apply(act, slope, v.y), act_apply(act, slope, v.z), act_apply(act, slope, v.w));
    return v;
}

extern "C" __global__ void bias_act_forward(float* z, float* y, const float* bias, int act, float slope, int channels, int pixels,
                                            int quads, int n, int keep_z) {
    after_prior();
    bool store_z = keep_z != 0 || y == nullptr;
    if (pixels == 1) {
        // a row of `channels` values a sample: four consecutive biases
        int row4 = channels / 4;
        GRID_STRIDE(q, quads) {
            float4 b = reinterpret_cast<const float4*>(bias)[q % row4];
            float4 v = bias_act4(reinterpret_cast<const float4*>(z)[q], b, y, q, act, slope);
            if (store_z) reinterpret_cast<float4*>(z)[q] = v;
        }
    } else {
        // rows of `pixels` values a channel: one bias a four
        int pixels4 = pixels / 4;
        GRID_STRIDE(q, quads) {
            float c = bias[(q / pixels4) % channels];
            float4 v = bias_act4(reinterpret_cast<const float4*>(z)[q], make_float4(c, c, c, c), y, q, act, slope);
            if (store_z) reinterpret_cast<float4*>(z)[q] = v;
        }
    }
    GRID_STRIDE(t, n - 4 * quads) {
        int i = 4 * quads + t;
        float v = z[i] + bias[(i / pixels) % channels];
        if (store_z) z[i] = v;
        if (y != nullptr) y[i] = act_apply(act, slope, v);
    }
}

// dz = dy ⊙ act'(z), element-wise over n values.
// `reads` says which of z (1) and y (2) the derivative reads (src/activation.rs,
// Activation::derivative_reads): the other is not loaded (a quarter of ReLU's gradient's
// traffic). The first `quads` fours of values go as float4 (the host passes 0 unless every
// pointer is 16-byte aligned), the rest one at a time.
__device__ __forceinline__ float4 act_load4(const float* p, int q, bool read) {
    return read ? reinterpret_cast<const float4*>(p)[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// dy ⊙ act'(z) of a value and of a four: the expressions act_backward and act_bias_grad share,
// so that their dz are the same bits.
__device__ __forceinline__ float act_grad1(int act, float slope, bool rz, bool ry, const float* z, const float* y, const float* dy,
                                           long long i) {
    return dy[i] * act_derivative(act, slope, rz ? z[i] : 0.0f, ry ? y[i] : 0.0f);
}

__device__ __forceinline__ float4 act_grad4(int act, float slope, float4 d, float4 zv, float4 yv) {
    return make_float4(d.x * act_derivative(act, slope, zv.x, yv.x), d.y * act_derivative(act, slope, zv.y, yv.y),
                       d.z * act_derivative(act, slope, zv.z, yv.z), d.w * act_derivative(act, slope, zv.w, yv.w));
}

extern "C" __global__ void act_backward(const float* z, const float* y, const float* dy, float* dz, int act, float slope, int reads,
                                        int quads, int n) {
    after_prior();
    bool rz = (reads & 1) != 0, ry = (reads & 2) != 0;
    GRID_STRIDE(q, quads) {
        float4 d = reinterpret_cast<const float4*>(dy)[q];
        reinterpret_cast<float4*>(dz)[q] = act_grad4(act, slope, d, act_load4(z, q, rz), act_load4(y, q, ry));
    }
    GRID_STRIDE(t, n - 4 * quads) dz[4 * quads + t] = act_grad1(act, slope, rz, ry, z, y, dy, 4 * quads + t);
}

// The values a bias gradient sums: dz as stored (bias_grad), or dz = dy ⊙ act'(z) computed and
// stored as it is read (act_bias_grad). one(i): value i; four(i): values i .. i + 3, i a
// multiple of 4 and dz + i 16-byte aligned.
struct StoredGrad {
    const float* __restrict__ dz;
    __device__ __forceinline__ float one(long long i) const { return __ldg(dz + i); }
    __device__ __forceinline__ float4 four(long long i) const { return __ldg(reinterpret_cast<const float4*>(dz + i)); }
};

// loads4: z, y and dy are 16-byte aligned too, so a four moves as float4 (else one value at a
// time: the same values, the same bits)
struct ActGrad {
    const float* z;
    const float* y;
    const float* dy;
    float* dz;
    int act;
    float slope;
    bool rz, ry, loads4;
    __device__ __forceinline__ float one(long long i) const {
        float v = act_grad1(act, slope, rz, ry, z, y, dy, i);
        dz[i] = v;
        return v;
    }
    __device__ __forceinline__ float4 four(long long i) const {
        float4 v;
        if (loads4) {
            v = act_grad4(act, slope, *reinterpret_cast<const float4*>(dy + i), act_load4(z + i, 0, rz), act_load4(y + i, 0, ry));
            *reinterpret_cast<float4*>(dz + i) = v;
        } else {
            v = make_float4(one(i), one(i + 1), one(i + 2), one(i + 3));
        }
        return v;
    }
};

// This thread's share of Σ dz[s, c, p] over samples first..end − 1 and every pixel p: the
// values of channel c's rows, (s, c) a row of `pixels` values, taken as one sequence j = 0, 1, …
// (row by row) of which thread t sums j = t, t + REDUCE_THREADS, … in order. With `vec` (pixels a
// multiple of 4, dz 16-byte aligned) an element of the sequence is a float4 of a row, summed
// x, y, z, w. The row and the place in it advance by adding a stride's rows and remainder (no
// division a value: a division a value bound the kernel by its integer work, far from the
// memory's rate). Every value of the rows is read once, by one thread.
template <typename Values>
__device__ __forceinline__ float channel_share_of(const Values& dz, int c, int channels, int pixels, int first, int end, bool vec) {
    int width = vec ? pixels / 4 : pixels;
    if (width == 0 || end <= first) return 0.0f;
    int s = first + threadIdx.x / width, p = threadIdx.x % width;
    int rows_step = REDUCE_THREADS / width, p_step = REDUCE_THREADS % width;
    float acc = 0.0f;
    while (s < end) {
        long long row = ((long long)s * channels + c) * pixels;
        if (vec) {
            float4 v = dz.four(row + 4 * p);
            acc += v.x;
            acc += v.y;
            acc += v.z;
            acc += v.w;
        } else {
            acc += dz.one(row + p);
        }
        s += rows_step;
        p += p_step;
        if (p >= width) {
            p -= width;
            s++;
        }
    }
    return acc;
}

// channel_share_of the values stored in dz
__device__ __forceinline__ float channel_share(const float* __restrict__ dz, int c, int channels, int pixels, int first, int end, bool vec) {
    return channel_share_of(StoredGrad{dz}, c, channels, pixels, first, end, vec);
}

__device__ __forceinline__ bool channel_vec(const float* dz, int pixels) {
    return (pixels & 3) == 0 && (reinterpret_cast<unsigned long long>(dz) & 15) == 0;
}

// db[c] = Σ_{s,p} dz[s, c, p]. One block per channel (grid = channels, REDUCE_THREADS
// threads); thread t sums its share in order (channel_share), then a fixed tree: deterministic.
extern "C" __global__ void bias_grad(const float* dz, float* db, int channels, int pixels, int batch) {
    after_prior();
    __shared__ float buf[REDUCE_THREADS];
    int c = blockIdx.x;
    float sum = block_sum_f32(channel_share(dz, c, channels, pixels, 0, batch, channel_vec(dz, pixels)), buf);
    if (threadIdx.x == 0) db[c] = sum;
}

// A channel's sum in `splits` parts, where one block a channel would leave most of the GPU idle
// (a convolution's few channels over a large batch): block (c, k) of a (channels, splits) grid
// sums samples k·chunk .. min(batch, (k+1)·chunk) of channel c into partials[k·channels + c], as
// bias_grad sums a channel; then bias_grad_join adds each channel's parts in order of k. Fixed
// orders throughout: deterministic.
extern "C" __global__ void bias_grad_split(const float* dz, float* partials, int channels, int pixels, int batch, int chunk) {
    after_prior();
    __shared__ float buf[REDUCE_THREADS];
    int c = blockIdx.x, k = blockIdx.y;
    long long first = (long long)k * chunk, end = min((long long)batch, first + chunk);
    float share = first < end ? channel_share(dz, c, channels, pixels, (int)first, (int)end, channel_vec(dz, pixels)) : 0.0f;
    float sum = block_sum_f32(share, buf);
    if (threadIdx.x == 0) partials[(long long)k * channels + c] = sum;
}

// db[c] = Σ_k partials[k·channels + c], k = 0 .. splits in order (see bias_grad_split).
extern "C" __global__ void bias_grad_join(const float* partials, float* db, int channels, int splits) {
    after_prior();
    GRID_STRIDE(c, channels) {
        float acc = 0.0f;
        for (int k = 0; k < splits; k++) acc += partials[(long long)k * channels + c];
        db[c] = acc;
    }
}

// A bias gradient and the activation gradient it sums, in one pass: block (c, k) of a
// (channels, splits) grid writes dz = dy ⊙ act'(z) over samples k·chunk .. min(batch, (k+1)·chunk)
// of channel c and sums the values it wrote into out[k·channels + c], in bias_grad_split's order
// (with one part, chunk = batch and out = db: bias_grad's). dz and the sums are the bits of
// act_backward followed by bias_grad(_split) on the same pointers: the same expression a value
// (act_grad1, act_grad4), the same values summed in the same order, the same block tree; the
// sums' order follows dz's alignment as bias_grad's does, whatever z, y and dy's. `reads` as
// act_backward's.
extern "C" __global__ void act_bias_grad(const float* z, const float* y, const float* dy, float* dz, float* out, int act, float slope,
                                         int reads, int channels, int pixels, int batch, int chunk) {
    after_prior();
    __shared__ float buf[REDUCE_THREADS];
    int c = blockIdx.x, k = blockIdx.y;
    bool vec = channel_vec(dz, pixels);
    bool loads4 = ((reinterpret_cast<unsigned long long>(z) | reinterpret_cast<unsigned long long>(y) |
                    reinterpret_cast<unsigned long long>(dy)) & 15) == 0;
    ActGrad values{z, y, dy, dz, act, slope, (reads & 1) != 0, (reads & 2) != 0, loads4};
    long long first = (long long)k * chunk, end = min((long long)batch, first + chunk);
    float share = first < end ? channel_share_of(values, c, channels, pixels, (int)first, (int)end, vec) : 0.0f;
    float sum = block_sum_f32(share, buf);
    if (threadIdx.x == 0) out[(long long)k * channels + c] = sum;
}
