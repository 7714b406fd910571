//! The floor under every GPU call on this machine: what the driver alone takes to launch work
//! and wait for it, with kernels that do nothing. A flatnn forward or training step can be no
//! faster than the row that matches its shape (one launch, or one graph of n kernels, + a wait).
//! Two ways under that floor are measured too: kernels launched as programmatic dependents of
//! the one before (sm_90 and later: the next kernel gets ready while the previous one runs), and
//! the host spinning on a flag that the graph's last kernel writes to page-locked memory
//! instead of waiting on the stream. And what it costs to hand work from block to block inside
//! one kernel instead of from kernel to kernel (on sm_90): through shared memory across a thread
//! block cluster, through global memory to the last block to arrive, or with every block reading
//! its inputs straight from mapped host memory. And no launch at all: a kernel that stays
//! resident and answers calls the host rings on a doorbell in page-locked memory.
//!
//!   cargo run --release --example launch_floor -- [--calls N]
//!
//! Prints the median and p90 of each, over N calls (default 20,000) after 1,000 warm-up calls.

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = floor::run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("launch_floor needs the `cuda` feature");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
mod floor {
    use cudarc::driver::{result, sys, CudaContext, CudaStream};
    use std::ptr::null_mut;
    use std::sync::Arc;
    use std::time::Instant;

    type Res<T> = Result<T, Box<dyn std::error::Error>>;

    pub fn run() -> Res<()> {
        let mut calls = 20_000usize;
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            match (flag.as_str(), args.next()) {
                ("--calls", Some(v)) => calls = v.parse().map_err(|_| format!("--calls: {v:?} is not a whole number"))?,
                _ => return Err(format!("unknown or incomplete option {flag:?}").into()),
            }
        }
        if !flatnn::cuda::is_functional() {
            println!("skipped: no CUDA device");
            return Ok(());
        }
        let ctx = CudaContext::new(0)?;
        let hopper = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? >= 9;
        let options = cudarc::nvrtc::CompileOptions { arch: Some(if hopper { "sm_90" } else { "sm_70" }), ..Default::default() };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, options)?;
        let module = ctx.load_module(ptx)?;
        let empty = module.load_function("empty")?.cu_function();
        let chained = module.load_function("chained")?.cu_function();
        let signal = module.load_function("signal")?.cu_function();
        let stream = ctx.new_stream()?;
        let launch = |stream: &CudaStream| -> Res<()> {
            // SAFETY: a kernel without parameters, of this context, on one of its streams.
            unsafe { sys::cuLaunchKernel(empty, 1, 1, 1, 32, 1, 1, 0, stream.cu_stream(), null_mut(), null_mut()) }.result()?;
            Ok(())
        };
        let graph = |kernels: usize| -> Res<cudarc::driver::CudaGraph> {
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            for _ in 0..kernels {
                launch(&stream)?;
            }
            Ok(stream.end_capture(sys::CUgraphInstantiate_flags(0))?.ok_or("an empty capture")?)
        };
        let (one, three, twenty) = (graph(1)?, graph(3)?, graph(20)?);
        // Programmatic dependent launch (sm_90): each kernel after the first may start while the
        // one before it runs and waits for it inside (`griddepcontrol.wait`).
        let launch_chained = |stream: &CudaStream| -> Res<()> {
            let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attribute.value.programmaticStreamSerializationAllowed = 1;
            // SAFETY: a kernel without parameters, of this context, on one of its streams.
            unsafe { launch_ex(chained, 1, 32, stream, attribute, &mut []) }
        };
        let graph_chained = |kernels: usize| -> Res<cudarc::driver::CudaGraph> {
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            launch(&stream)?;
            for _ in 1..kernels {
                launch_chained(&stream)?;
            }
            Ok(stream.end_capture(sys::CUgraphInstantiate_flags(0))?.ok_or("an empty capture")?)
        };
        // A flag in mapped page-locked memory that the last kernel of a graph sets; the host
        // spins on it instead of waiting on the stream.
        let (flag_host, flag_device) = mapped(8)?;
        let flag_host = flag_host as *mut u32;
        // Ends a capture begun by the caller with the kernel that sets the flag to `value`.
        let end_with_signal = |value: u32| -> Res<cudarc::driver::CudaGraph> {
            let (mut ptr, mut v) = (flag_device, value);
            let mut args = [std::ptr::addr_of_mut!(ptr).cast::<std::ffi::c_void>(), std::ptr::addr_of_mut!(v).cast()];
            // SAFETY: signal(unsigned*, unsigned) with a mapped 4-byte flag.
            unsafe { sys::cuLaunchKernel(signal, 1, 1, 1, 1, 1, 1, 0, stream.cu_stream(), args.as_mut_ptr(), null_mut()) }.result()?;
            Ok(stream.end_capture(sys::CUgraphInstantiate_flags(0))?.ok_or("an empty capture")?)
        };
        // Two graphs that set the flag to 1 and 2, alternated, so that each call waits for its own.
        let time_spinning = |what: &str, graphs: [cudarc::driver::CudaGraph; 2]| -> Res<()> {
            let mut turn = 0usize;
            time_flag(what, calls, &stream, || {
                turn ^= 1;
                graphs[turn].launch()?;
                let want = turn as u32 + 1;
                // SAFETY: the mapped flag, written by the device.
                while unsafe { flag_host.read_volatile() } != want {
                    std::hint::spin_loop();
                }
                Ok(())
            })
        };
        let graph_signal = |kernels: usize, chain: bool, value: u32| -> Res<cudarc::driver::CudaGraph> {
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            for i in 0..kernels {
                if chain && i > 0 {
                    launch_chained(&stream)?
                } else {
                    launch(&stream)?
                }
            }
            end_with_signal(value)
        };
        let device = stream.clone_htod(&vec![0f32; 1024])?;
        // SAFETY: written (zeroed) below before any read.
        let mut pinned = unsafe { ctx.alloc_pinned::<f32>(1024)? };
        pinned.as_mut_slice()?.fill(0.0);
        println!("{} on {}, {calls} calls each (µs)", env!("CARGO_PKG_NAME"), ctx.name()?);
        time("wait on an idle stream", calls, &stream, || Ok(()))?;
        time("1 kernel launch + wait", calls, &stream, || launch(&stream))?;
        time("graph of 1 kernel + wait", calls, &stream, || Ok(one.launch()?))?;
        time("graph of 3 kernels + wait", calls, &stream, || Ok(three.launch()?))?;
        time("graph of 20 kernels + wait", calls, &stream, || Ok(twenty.launch()?))?;
        time_launch_only("graph of 1 kernel: the launch call alone", calls, &stream, || Ok(one.launch()?))?;
        time_launch_only("graph of 20 kernels: the launch call alone", calls, &stream, || Ok(twenty.launch()?))?;
        if hopper {
            let (three_c, twenty_c) = (graph_chained(3)?, graph_chained(20)?);
            time("graph of 3 kernels, dependent launch + wait", calls, &stream, || Ok(three_c.launch()?))?;
            time("graph of 20 kernels, dependent launch + wait", calls, &stream, || Ok(twenty_c.launch()?))?;
        }
        for (kernels, chain) in [(0, false), (2, false), (19, false), (2, true), (19, true)] {
            if chain && !hopper {
                continue;
            }
            let what = format!("graph of {} kernels{}, host spins on a flag", kernels + 1, if chain { ", dependent launch" } else { "" });
            time_spinning(&what, [graph_signal(kernels, chain, 1)?, graph_signal(kernels, chain, 2)?])?;
        }
        let device_ptr = {
            use cudarc::driver::DevicePtr;
            let (ptr, _guard) = device.device_ptr(&stream);
            ptr
        };
        // 4 KiB of inputs into device memory ahead of a kernel: by the copy engine, or by a
        // one-block kernel reading mapped page-locked memory.
        let stage = module.load_function("stage")?.cu_function();
        let (staged, staged_device) = mapped(4096)?;
        let graph_in = |by_kernel: bool, value: u32| -> Res<cudarc::driver::CudaGraph> {
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            if by_kernel {
                let (mut src, mut dst) = (staged_device, device_ptr);
                let mut args = [std::ptr::addr_of_mut!(src).cast::<std::ffi::c_void>(), std::ptr::addr_of_mut!(dst).cast()];
                // SAFETY: stage(const float4*, float4*): 256 threads copy 4 KiB, both sides that large.
                unsafe { sys::cuLaunchKernel(stage, 1, 1, 1, 256, 1, 1, 0, stream.cu_stream(), args.as_mut_ptr(), null_mut()) }.result()?;
            } else {
                // SAFETY: 4 KiB of page-locked memory into a 4 KiB device buffer.
                unsafe {
                    result::memcpy_htod_async(device_ptr, std::slice::from_raw_parts(staged.cast::<u8>(), 4096), stream.cu_stream())
                }?;
            }
            if hopper {
                launch_chained(&stream)?
            } else {
                launch(&stream)?
            }
            end_with_signal(value)
        };
        for (by_kernel, what) in [
            (false, "graph: copy 4 KiB in, kernel, flag; host spins"),
            (true, "graph: kernel reads 4 KiB mapped, kernel, flag; host spins"),
        ] {
            time_spinning(what, [graph_in(by_kernel, 1)?, graph_in(by_kernel, 2)?])?;
        }
        if hopper {
            // One kernel of 16 blocks that exchange values through each other's shared memory
            // (a thread block cluster, sm_90) between cluster barriers, against the same blocks
            // handing off through global memory (fence, counter: the last block goes on).
            let exchange = module.load_function("exchange")?.cu_function();
            let handoff = module.load_function("handoff")?.cu_function();
            // SAFETY: an attribute of a kernel of this context.
            unsafe { sys::cuFuncSetAttribute(exchange, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1) }
                .result()?;
            let scratch = stream.alloc_zeros::<f32>(64 * 256 + 16)?;
            let scratch_ptr = {
                use cudarc::driver::DevicePtr;
                let (ptr, _guard) = scratch.device_ptr(&stream);
                ptr
            };
            let graph_exchange = |cluster: u32, rounds: i32, read_host: bool, value: u32| -> Res<cudarc::driver::CudaGraph> {
                stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
                let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
                attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                attribute.value.clusterDim.x = cluster;
                attribute.value.clusterDim.y = 1;
                attribute.value.clusterDim.z = 1;
                let (mut flag, mut v, mut r, mut src) = (flag_device, value, rounds, if read_host { staged_device } else { 0 });
                let mut args = [
                    std::ptr::addr_of_mut!(flag).cast::<std::ffi::c_void>(),
                    std::ptr::addr_of_mut!(v).cast(),
                    std::ptr::addr_of_mut!(r).cast(),
                    std::ptr::addr_of_mut!(src).cast(),
                ];
                // SAFETY: exchange(unsigned*, unsigned, int, const float*) as defined below.
                unsafe { launch_ex(exchange, cluster, 256, &stream, attribute, &mut args) }?;
                Ok(stream.end_capture(sys::CUgraphInstantiate_flags(0))?.ok_or("an empty capture")?)
            };
            for (cluster, rounds, read_host) in [(1, 0, false), (16, 0, false), (8, 3, false), (16, 3, false), (16, 0, true), (16, 3, true)]
            {
                let what = format!(
                    "1 kernel, cluster of {cluster}, {rounds} exchanges{}, flag",
                    if read_host { ", reads 3 KiB mapped" } else { "" }
                );
                time_spinning(&what, [graph_exchange(cluster, rounds, read_host, 1)?, graph_exchange(cluster, rounds, read_host, 2)?])?;
            }
            let graph_handoff = |blocks: u32, value: u32| -> Res<cudarc::driver::CudaGraph> {
                stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
                let (mut flag, mut v, mut s) = (flag_device, value, scratch_ptr);
                let mut args = [
                    std::ptr::addr_of_mut!(flag).cast::<std::ffi::c_void>(),
                    std::ptr::addr_of_mut!(v).cast(),
                    std::ptr::addr_of_mut!(s).cast(),
                ];
                // SAFETY: handoff(unsigned*, unsigned, float*) with 64 × 256 + 16 floats of scratch, at most 64 blocks.
                unsafe { sys::cuLaunchKernel(handoff, blocks, 1, 1, 256, 1, 1, 0, stream.cu_stream(), args.as_mut_ptr(), null_mut()) }
                    .result()?;
                Ok(stream.end_capture(sys::CUgraphInstantiate_flags(0))?.ok_or("an empty capture")?)
            };
            for blocks in [16, 64] {
                let what = format!("1 kernel, {blocks} blocks, global hand-off to the last, flag");
                time_spinning(&what, [graph_handoff(blocks, 1)?, graph_handoff(blocks, 2)?])?;
            }
        }
        // No launch per call: one kernel of a block per SM stays resident, and each call is the
        // host ringing a doorbell in page-locked memory, block 0 (polling it over the bus)
        // copying the inputs in and passing the call on through device memory, `barriers`
        // grid-wide barriers (what a layer after the first costs), and the flag.
        let persistent = module.load_function("persistent")?.cu_function();
        let resident = ctx.new_stream()?;
        let (doorbell, doorbell_device) = mapped(64)?;
        let doorbell = doorbell as *mut u32;
        let mut sync = stream.alloc_zeros::<u32>(4)?;
        let sync_ptr = {
            use cudarc::driver::DevicePtr;
            let (ptr, _guard) = sync.device_ptr(&stream);
            ptr
        };
        let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        for (barriers, inputs) in [(0i32, 0i32), (2, 0), (2, 784), (3, 784)] {
            stream.memset_zeros(&mut sync)?;
            stream.synchronize()?;
            // SAFETY: mapped page-locked words that only the host writes here.
            unsafe { doorbell.write_volatile(0) };
            unsafe { flag_host.write_volatile(0) };
            let (mut bell, mut fl, mut sy, mut b, mut src, mut dst, mut n) =
                (doorbell_device, flag_device, sync_ptr, barriers, staged_device, device_ptr, inputs);
            let mut args = [
                std::ptr::addr_of_mut!(bell).cast::<std::ffi::c_void>(),
                std::ptr::addr_of_mut!(fl).cast(),
                std::ptr::addr_of_mut!(sy).cast(),
                std::ptr::addr_of_mut!(b).cast(),
                std::ptr::addr_of_mut!(src).cast(),
                std::ptr::addr_of_mut!(dst).cast(),
                std::ptr::addr_of_mut!(n).cast(),
            ];
            // SAFETY: persistent(const unsigned*, unsigned*, unsigned*, int, const float*, float*,
            // int) with mapped words, 4 words of device memory, at most 1024 floats each side; one
            // block an SM, nothing else running, so every block is resident.
            unsafe { sys::cuLaunchKernel(persistent, sms, 1, 1, 256, 1, 1, 0, resident.cu_stream(), args.as_mut_ptr(), null_mut()) }
                .result()?;
            let mut call = 0u32;
            let what = format!("resident kernel: doorbell, {inputs} inputs, {barriers} grid barriers, flag");
            time_flag(&what, calls, &stream, || {
                call += 1;
                // SAFETY: as above; the device only reads the doorbell and writes the flag.
                unsafe { doorbell.write_volatile(call) };
                while unsafe { flag_host.read_volatile() } != call {
                    std::hint::spin_loop();
                }
                Ok(())
            })?;
            // SAFETY: as above; this call number ends the kernel.
            unsafe { doorbell.write_volatile(u32::MAX) };
            resident.synchronize()?;
        }
        let pinned_slice = pinned.as_mut_slice()?;
        let copy_ptr = pinned_slice.as_mut_ptr();
        time("copy 4 KiB in + kernel + copy 4 KiB out + wait (pinned)", calls, &stream, || {
            // SAFETY: 1024 floats on both sides; the host waits before the buffers are reused.
            unsafe {
                result::memcpy_htod_async(device_ptr, std::slice::from_raw_parts(copy_ptr, 1024), stream.cu_stream())?;
                launch(&stream)?;
                result::memcpy_dtoh_async(std::slice::from_raw_parts_mut(copy_ptr, 1024), device_ptr, stream.cu_stream())?;
            }
            Ok(())
        })?;
        Ok(())
    }

    const KERNELS: &str = r#"
extern "C" __global__ void empty() {}
extern "C" __global__ void chained() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
extern "C" __global__ void stage(const float4* src, float4* dst) {
    dst[threadIdx.x] = src[threadIdx.x];
}
// Blocks of a cluster: `rounds` times, every thread writes one value into each other block's
// shared memory, then the cluster waits at its barrier; block 0 then sets the flag. With `src`,
// each block first reads 3 KiB of mapped host memory.
extern "C" __global__ void exchange(unsigned* flag, unsigned value, int rounds, const float* src) {
#if __CUDA_ARCH__ >= 900
    __shared__ float inbox[16][256];
    __shared__ float staged[768];
    unsigned rank, size;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
    float v = threadIdx.x;
    // another block's shared memory may be written only once the whole cluster has started
    if (rounds > 0) asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (src) {
        for (int i = threadIdx.x; i < 768; i += 256) staged[i] = src[i];
        __syncthreads();
        v = staged[threadIdx.x];
    }
    for (int r = 0; r < rounds; r++) {
        for (unsigned to = 0; to < size; to++) {
            unsigned local, remote;
            asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(local) : "l"(&inbox[rank][threadIdx.x]));
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(to));
            asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
        }
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
        v += inbox[(rank + 1) % size][threadIdx.x];
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    }
    if (rank == 0 && threadIdx.x == 0) {
        if (v == -1.0f) flag[1] = 0;
        __threadfence_system();
        *(volatile unsigned*)flag = value;
    }
#endif
}
// Every block (at most 64) stores 256 values, then the last block to arrive (a counter after
// the values) reads the first 16 blocks' values and sets the flag.
extern "C" __global__ void handoff(unsigned* flag, unsigned value, float* scratch) {
    __shared__ bool last;
    unsigned* arrivals = (unsigned*)(scratch + 64 * 256);
    scratch[blockIdx.x * 256 + threadIdx.x] = threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(arrivals, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    float s = 0.0f;
    for (int b = 0; b < 16; b++) s += ((volatile float*)scratch)[b * 256 + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        *arrivals = 0;
        if (s == -1.0f) flag[1] = 0;
        __threadfence_system();
        *(volatile unsigned*)flag = value;
    }
}
// Stays resident and serves calls (see `persistent` in run): block 0 polls the doorbell for the
// next call number, copies n inputs (a multiple of 4) from src (mapped) to dst, and publishes
// the number in sync[0]; the other blocks poll that. Then `barriers` grid-wide barriers (a
// counter in sync[1]), then block 0 sets the flag to the call number. A doorbell of 0xFFFFFFFF
// ends it.
extern "C" __global__ void persistent(const volatile unsigned* doorbell, volatile unsigned* flag, unsigned* sync, int barriers,
                                      const float* src, float* dst, int n) {
    __shared__ unsigned go;
    unsigned seq = 0, arrivals = 0;
    for (;;) {
        if (blockIdx.x == 0) {
            if (threadIdx.x == 0) {
                unsigned d;
                do { d = *doorbell; } while (d == seq);
                go = d;
            }
            __syncthreads();
            // not cached: the host rewrites them between calls, and this kernel never restarts
            if (go != 0xFFFFFFFFu)
                for (int i = threadIdx.x; i < n / 4; i += blockDim.x) ((float4*)dst)[i] = __ldcv((const float4*)src + i);
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                atomicExch(&sync[0], go);
            }
        } else if (threadIdx.x == 0) {
            unsigned d;
            do { d = ((volatile unsigned*)sync)[0]; } while (d == seq);
            __threadfence();
            go = d;
        }
        __syncthreads();
        seq = go;
        __syncthreads();
        if (seq == 0xFFFFFFFFu) return;
        for (int b = 0; b < barriers; b++) {
            arrivals += gridDim.x;
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                atomicAdd(&sync[1], 1u);
                while (((volatile unsigned*)sync)[1] < arrivals) {}
                __threadfence();
            }
            __syncthreads();
        }
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            __threadfence_system();
            *flag = seq;
        }
    }
}
extern "C" __global__ void signal(unsigned* flag, unsigned value) {
    __threadfence_system();
    *(volatile unsigned*)flag = value;
}
"#;

    /// Launches `func` on `grid` one-dimensional blocks of `block` threads with one launch
    /// attribute.
    ///
    /// # Safety
    /// `args` must hold `func`'s parameters in order, each pointing to a value of its C type.
    unsafe fn launch_ex(
        func: sys::CUfunction,
        grid: u32,
        block: u32,
        stream: &CudaStream,
        mut attribute: sys::CUlaunchAttribute,
        args: &mut [*mut std::ffi::c_void],
    ) -> Res<()> {
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: 1,
        };
        let params = if args.is_empty() { null_mut() } else { args.as_mut_ptr() };
        // SAFETY: the caller's.
        unsafe { sys::cuLaunchKernelEx(&config, func, params, null_mut()) }.result()?;
        Ok(())
    }

    /// `bytes` of zeroed page-locked memory mapped into the device's address space: the host's
    /// pointer and the device's. Never freed (a short example).
    fn mapped(bytes: usize) -> Res<(*mut std::ffi::c_void, sys::CUdeviceptr)> {
        let mut host: *mut std::ffi::c_void = null_mut();
        // SAFETY: a plain allocation in the current context.
        unsafe { sys::cuMemHostAlloc(&mut host, bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE) }.result()?;
        // SAFETY: just allocated, `bytes` long.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, bytes) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: a mapped allocation of this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }.result()?;
        Ok((host, device))
    }

    /// Host time of `queue()` alone; the wait after it is outside the timed region.
    fn time_launch_only(what: &str, calls: usize, stream: &Arc<CudaStream>, mut queue: impl FnMut() -> Res<()>) -> Res<()> {
        let mut samples = Vec::with_capacity(calls);
        for i in 0..calls + 1000 {
            let start = Instant::now();
            queue()?;
            let took = start.elapsed().as_secs_f64() * 1e6;
            stream.synchronize()?;
            if i >= 1000 {
                samples.push(took);
            }
        }
        report(what, samples);
        Ok(())
    }

    /// `call()` returns once its work is done (it waits itself); the stream is drained at the end.
    fn time_flag(what: &str, calls: usize, stream: &Arc<CudaStream>, mut call: impl FnMut() -> Res<()>) -> Res<()> {
        let mut samples = Vec::with_capacity(calls);
        for i in 0..calls + 1000 {
            let start = Instant::now();
            call()?;
            if i >= 1000 {
                samples.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        stream.synchronize()?;
        report(what, samples);
        Ok(())
    }

    fn report(what: &str, mut samples: Vec<f64>) {
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
        println!("  {what:<58} p50 {:6.2}   p90 {:6.2}", at(0.5), at(0.9));
    }

    fn time(what: &str, calls: usize, stream: &Arc<CudaStream>, mut queue: impl FnMut() -> Res<()>) -> Res<()> {
        let mut samples = Vec::with_capacity(calls);
        for i in 0..calls + 1000 {
            let start = Instant::now();
            queue()?;
            stream.synchronize()?;
            if i >= 1000 {
                samples.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
        println!("  {what:<58} p50 {:6.2}   p90 {:6.2}", at(0.5), at(0.9));
        Ok(())
    }
}
