// GlobalAvgPool (src/layers/globalpool.rs): the mean of each row of `pixels` values (a channel
// of an image or a signal), rows = batch·channels.

// y[row] = Σ_p x[row, p] / pixels. A warp a row: lane l sums p = l, l + 32, … in order, then the
// lanes are added in a fixed tree, so every run gives the same bits.
extern "C" __global__ void global_avgpool_forward(const float* x, float* y, int pixels, int rows) {
    after_prior();
    int lane = threadIdx.x & 31;
    int warps = (blockDim.x * gridDim.x) >> 5;
    // the row is the same for every lane of a warp, so whole warps take the loop and the
    // shuffles below
    for (int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps) {
        const float* xs = x + (long long)row * pixels;
        float acc = 0.0f;
        for (int p = lane; p < pixels; p += 32) acc += xs[p];
        for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
        if (lane == 0) y[row] = acc / (float)pixels;
    }
}

// dx[row, p] = dy[row] / pixels over n = rows·pixels values, overwritten (the CPU's operation).
extern "C" __global__ void global_avgpool_backward(const float* dy, float* dx, int pixels, int n) {
    after_prior();
    GRID_STRIDE(i, n) {
        dx[i] = dy[i / pixels] / (float)pixels;
    }
}
