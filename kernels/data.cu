// The data loader's gather: the data set lives on the device as f32, already normalised
// (samples × sample_len), its labels as u32; a batch is picked by an index list.

// out[b, k] = data[indices[b], k]; an index ≥ samples gives NaN (the host makes the indices).
extern "C" __global__ void gather_batch(const float* data, const unsigned int* indices, float* out, int sample_len, int batch, int samples) {
    after_prior();
    int n = batch * sample_len;
    GRID_STRIDE(i, n) {
        int b = i / sample_len, k = i - b * sample_len;
        unsigned int idx = indices[b];
        out[i] = idx < (unsigned int)samples ? data[(long long)idx * sample_len + k] : __int_as_float(0x7fc00000);
    }
}

// out[b] = labels[indices[b]]; an index ≥ samples gives 0xFFFFFFFF (never a valid class).
extern "C" __global__ void gather_labels(const unsigned int* labels, const unsigned int* indices, unsigned int* out, int batch, int samples) {
    after_prior();
    GRID_STRIDE(b, batch) {
        unsigned int idx = indices[b];
        out[b] = idx < (unsigned int)samples ? labels[idx] : 0xFFFFFFFFu;
    }
}

// Inputs from page-locked host memory (mapped into the device's address space) into device
// memory, by a kernel reading over the bus: in a graph, a copy node costs more than a kernel
// node (`example launch_floor`). n values; src and dst 16-byte aligned.
extern "C" __global__ void copy_from_host(const float* src, float* dst, int n) {
    after_prior();
    int n4 = n / 4;
    GRID_STRIDE(i, n4) reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(src)[i];
    GRID_STRIDE(i, n - n4 * 4) dst[n4 * 4 + i] = src[n4 * 4 + i];
}

// The end of a forward pass whose outputs are small: one block copies them into page-locked
// host memory (mapped into the device's address space), then sets the host's flag to the next
// value of the cache's counter, so the host, spinning on the flag, sees the outputs without
// waiting on the stream.
//
// Each store crosses the bus as a write of its own: 16-byte stores (where host_dst is 16-byte
// aligned, as the page-locked buffer's base is) move four values a write instead of one. Where
// src starts in the activations depends on the capacity and the widths, so each float4 is
// built from four loads of device memory, which cost little beside the bus; the last n % 4
// values go one at a time.
extern "C" __global__ void finish_outputs(const float* src, float* host_dst, int n, unsigned int* counter, unsigned int* host_flag) {
    after_prior();
    int n4 = (reinterpret_cast<unsigned long long>(host_dst) & 15) == 0 ? n / 4 : 0;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        const float* s = src + 4 * i;
        reinterpret_cast<float4*>(host_dst)[i] = make_float4(s[0], s[1], s[2], s[3]);
    }
    for (int i = n4 * 4 + threadIdx.x; i < n; i += blockDim.x) host_dst[i] = src[i];
    // The barrier orders every thread's copies before thread 0's fence, and the fence (which
    // is cumulative) orders them, for the whole system, before the flag.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        unsigned int next = *counter + 1;
        *counter = next;
        *(volatile unsigned int*)host_flag = next;
    }
}
