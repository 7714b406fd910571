//! What a program may ask about CUDA here: whether it works ([`is_functional`]), how many
//! devices there are ([`device_count`]), and which cuDNN, if any, loads ([`cudnn_version`]).
//! Nothing here needs CUDA at build time: cudarc loads libcuda, libnvrtc and libcublas when
//! first used, and these answer `false`, `0` or `None` on a machine without them and never
//! panic. Models reach a GPU through [`crate::Device`].

// Inside the crate: one compiled module of flatnn's kernels per device (`gpu(ordinal)`, NVRTC
// once), a zero-allocation kernel launch, typed wrappers per kernel, and cuBLAS SGEMM. Device
// memory is passed as `launch::View` / `launch::ViewMut`: a device pointer and a length,
// borrowed from a cudarc `CudaSlice`. Work on one stream is ordered by the stream; the
// context's event tracking is turned off (flatnn does its own ordering), so a `CudaSlice`
// allocated from a `Gpu`'s context carries no events.

mod bias_act;
mod blas;
mod blaslt;
mod buffer;
mod caches;
mod context;
pub(crate) mod conv;
pub(crate) mod conv_direct;
pub(crate) mod conv_mma;
pub(crate) mod conv_mma_wgrad;
mod cudnn;
pub(crate) mod data;
mod dense;
mod dense_pass;
mod dnn;
pub(crate) mod exec;
mod graph;
pub(crate) mod head;
mod kernel_cache;
mod launch;
pub(crate) mod layers;
pub(crate) mod nccl;
mod ops;
mod options;
pub(crate) mod pinned;
pub(crate) mod recurrent;
pub(crate) mod rendezvous;
mod rnn_cudnn;
mod rnn_dnn;
mod rnn_fused;
mod rnn_route;
mod routes;
mod saved;
pub(crate) mod serve;
pub(crate) mod state;
#[cfg(test)]
mod tests;
mod timing;
pub(crate) mod wgrad;

pub(crate) use context::Gpu;
// what a layer's room launches its own kernels with (`Gpu::run`)
pub(crate) use context::Kernel;
pub use cudnn::cudnn_version;
pub(crate) use launch::{blocks, int, kernel_args};
pub use nccl::nccl_version;
pub(crate) use ops::LOSS_SCRATCH;

use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaContext, DriverError};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// What a device is, as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeviceInfo {
    pub name: String,
    /// Bytes of device memory.
    pub total_memory: usize,
    /// Bytes free when asked.
    pub free_memory: usize,
    /// (major, minor), e.g. (9, 0) for an H100.
    pub compute_capability: (u32, u32),
}

/// True when CUDA can be used here: libcuda, libnvrtc and libcublas load, at least one device
/// exists, and a context can be made on device 0. Probed once per process; never panics.
pub fn is_functional() -> bool {
    static FUNCTIONAL: OnceLock<bool> = OnceLock::new();
    *FUNCTIONAL.get_or_init(|| {
        libraries_present().is_ok()
            && guarded(|| device_count_checked().and_then(|n| if n > 0 { CudaContext::new(0).map(|_| ()) } else { Err(no_device()) }))
                .is_ok()
    })
}

/// Number of CUDA devices; 0 where there is no driver or no device. Never panics.
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    guarded(device_count_checked).unwrap_or(0)
}

/// Name, memory and compute capability of device `ordinal`.
pub(crate) fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    check_ordinal(ordinal)?;
    guarded(|| {
        let ctx = CudaContext::new(ordinal)?;
        let (free_memory, total_memory) = ctx.mem_get_info()?;
        let (major, minor) = ctx.compute_capability()?;
        Ok(DeviceInfo { name: ctx.name()?, total_memory, free_memory, compute_capability: (major as u32, minor as u32) })
    })
    .map_err(|e| driver_error(&format!("querying device {ordinal}"), e))
}

/// The process's one [`Gpu`] for device `ordinal`, made (context, kernels compiled and looked
/// up) on first use. A failure is not cached: a later call tries again.
pub(crate) fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    static GPUS: Mutex<Vec<Option<Arc<Gpu>>>> = Mutex::new(Vec::new());
    libraries_present()?;
    let count = check_ordinal(ordinal)?;
    // A panic while the lock was held leaves only a missing entry behind: safe to go on.
    let mut gpus = GPUS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if gpus.len() < count {
        gpus.resize(count, None);
    }
    if let Some(gpu) = &gpus[ordinal] {
        return Ok(Arc::clone(gpu));
    }
    let gpu = Arc::new(guarded_result(|| {
        let _exclusive = device_wide();
        Gpu::new(ordinal)
    })?);
    gpus[ordinal] = Some(Arc::clone(&gpu));
    Ok(gpu)
}

/// Graph captures (shared) against the driver calls that may wait for the whole device
/// (exclusive): allocating and freeing device memory, making and destroying cuBLAS handles,
/// loading modules. Such a wait on one thread would invalidate a capture running on another
/// (each model captures on its own stream, from whatever thread trains it).
static DEVICE_WIDE: RwLock<()> = RwLock::new(());

/// Held while a graph is captured.
pub(crate) fn capturing() -> RwLockReadGuard<'static, ()> {
    DEVICE_WIDE.read().unwrap_or_else(PoisonError::into_inner)
}

/// Held around a call that may wait for the whole device.
pub(crate) fn device_wide() -> RwLockWriteGuard<'static, ()> {
    DEVICE_WIDE.write().unwrap_or_else(PoisonError::into_inner)
}

/// `Error::Cuda` for a driver call that failed.
pub(crate) fn driver_error(what: &str, e: DriverError) -> Error {
    Error::Cuda { what: format!("{what}: {e}") }
}

fn no_device() -> DriverError {
    DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)
}

fn driver_present() -> bool {
    // SAFETY: only tries to open the library, then closes it.
    unsafe { sys::is_culib_present() }
}

/// Ok when the three libraries cudarc loads lazily can be opened (else cudarc would panic).
fn libraries_present() -> Result<()> {
    let missing =
        |lib: &str| Err(Error::Cuda { what: format!("{lib} not found (is the NVIDIA driver / CUDA toolkit on LD_LIBRARY_PATH?)") });
    if !driver_present() {
        return missing("libcuda");
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return missing("libnvrtc");
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return missing("libcublas");
    }
    Ok(())
}

fn device_count_checked() -> Result<usize, DriverError> {
    result::init()?;
    Ok(result::device::get_count()?.max(0) as usize)
}

/// The device count, or an error naming why device `ordinal` cannot be used.
fn check_ordinal(ordinal: usize) -> Result<usize> {
    if !driver_present() {
        return Err(Error::Cuda { what: "libcuda not found (no NVIDIA driver here)".into() });
    }
    let count = guarded(device_count_checked).map_err(|e| driver_error("initialising the CUDA driver", e))?;
    if ordinal >= count {
        return Err(Error::Cuda { what: format!("no CUDA device {ordinal} ({count} present)") });
    }
    Ok(count)
}

/// Runs a driver call, turning a panic inside cudarc (a symbol missing from an old driver) into
/// an error instead of unwinding into the caller.
fn guarded<T>(f: impl FnOnce() -> Result<T, DriverError>) -> Result<T, DriverError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED)))
}

fn guarded_result<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(Error::Cuda { what: "a CUDA library lacks a function flatnn needs (driver or toolkit too old?)".into() }))
}

/// The first line of every GPU test (each `#[ignore]`d, see `testutil::cuda_device`): the
/// device-0 [`Gpu`]; without one, the test fails saying so.
#[cfg(test)]
pub(crate) fn test_gpu() -> Arc<Gpu> {
    assert!(is_functional(), "this test needs a CUDA device, and there is none usable");
    gpu(0).expect("device 0 works (is_functional said so)")
}
