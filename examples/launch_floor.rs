//! The floor under every GPU call on this machine: what the driver alone takes to launch work
//! and wait for it, with kernels that do nothing. A flatnn forward or training step can be no
//! faster than the row that matches its shape (one launch, or one graph of n kernels, + a wait).
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
        let ptx = cudarc::nvrtc::compile_ptx("extern \"C\" __global__ void empty() {}")?;
        let module = ctx.load_module(ptx)?;
        let empty = module.load_function("empty")?.cu_function();
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
        let device_ptr = {
            use cudarc::driver::DevicePtr;
            let (ptr, _guard) = device.device_ptr(&stream);
            ptr
        };
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
