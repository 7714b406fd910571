// Dropout (src/layers/dropout.rs): the mask is Philox4x32-10 of (value / 4, the training pass)
// under (the seed's low word, its high word + the layer's key), word value % 4 below `threshold`
// dropping the value, exactly as on the CPU. The seed, the pass number and the replica are read
// from `draw` (seed low, seed high, pass low, pass high, replica), device memory, so a captured
// training step draws a new mask on each replay: dropout_next_pass, the step's last kernel, moves
// the pass on. The counter's second word is the replica (value / 2^34 is 0 here: n < 2^31).

// Philox4x32-10 (Random123's constants): ten rounds of `c` under `k`, the key bumped between them.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k.x += 0x9E3779B9u;
            k.y += 0xBB67AE85u;
        }
        unsigned int hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        unsigned int hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// With `train`, out[i] = in[i]·m[i] over n values (m 0 where dropped, else `scale`): the forward
// pass (in = x) and the backward (in = dy), one thread a group of four values; else out = in.
extern "C" __global__ void dropout(const float* in, float* out, const unsigned int* draw, unsigned int layer, unsigned int threshold,
                                   float scale, int n, int train) {
    after_prior();
    if (!train) {
        GRID_STRIDE(i, n) out[i] = in[i];
        return;
    }
    uint2 key = make_uint2(draw[0], draw[1] + layer);
    unsigned int pass_lo = draw[2], pass_hi = draw[3];
    int groups = (n + 3) / 4;
    GRID_STRIDE(g, groups) {
        uint4 w = philox4x32_10(make_uint4((unsigned int)g, draw[4], pass_lo, pass_hi), key);
        unsigned int words[4] = {w.x, w.y, w.z, w.w};
        for (int j = 0; j < 4; j++) {
            int i = 4 * g + j;
            if (i < n) out[i] = in[i] * (words[j] < threshold ? 0.0f : scale);
        }
    }
}

// The pass number (draw[2], draw[3]) + 1: after a training step's last dropout.
extern "C" __global__ void dropout_next_pass(unsigned int* draw) {
    after_prior();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned int lo = draw[2] + 1u;
        draw[2] = lo;
        if (lo == 0u) draw[3] += 1u;
    }
}
