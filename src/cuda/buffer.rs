//! [`DevBuf`]: device memory owned by flatnn, tied to a device rather than to a stream.
//!
//! A model's parameters, a cache's activations or an optimiser's moments are used on the stream
//! of whichever model runs them, so their memory cannot be freed in one stream's order (as a
//! cudarc `CudaSlice` is). A `DevBuf` is allocated with `cuMemAlloc` and freed with `cuMemFree`;
//! whoever owns one waits for the stream that last used it before dropping it (see
//! `state.rs`). Nothing here waits for the whole device: another thread may be capturing a
//! graph on its own stream, and a device-wide wait would break its capture.

use super::context::Gpu;
use super::driver_error;
use super::launch::{View, ViewMut};
use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaStream, DeviceRepr, DriverError};
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

/// `len` values of `T` in the memory of one device, zero when allocated.
pub(crate) struct DevBuf<T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    gpu: Arc<Gpu>,
    _values: PhantomData<T>,
}

// SAFETY: the buffer is plain device memory; the driver calls on it may come from any thread
// once the context is bound (each method binds it).
unsafe impl<T: Send> Send for DevBuf<T> {}
unsafe impl<T: Sync> Sync for DevBuf<T> {}

impl<T: DeviceRepr> DevBuf<T> {
    /// `len` zero values on `gpu`, zeroed in `stream`'s order (at least one byte is allocated,
    /// so the pointer is real). Memory the device does not have is an [`Error::OutOfMemory`]
    /// with the bytes asked for.
    pub fn zeros(gpu: &Arc<Gpu>, stream: &CudaStream, len: usize) -> Result<DevBuf<T>> {
        gpu.bind()?;
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or_else(|| Error::Shape(format!("{len} values are more than device memory can hold")))?
            .max(1);
        let what = |what: &str| format!("{what} {bytes} bytes on device {}", gpu.ordinal());
        let exclusive = super::device_wide();
        // SAFETY: the context is current; the memory is zeroed before anyone reads it.
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| allocation_error(e, bytes, || format!("device memory on cuda:{}", gpu.ordinal())))?;
        drop(exclusive);
        let buf = DevBuf { ptr, len, gpu: Arc::clone(gpu), _values: PhantomData };
        // SAFETY: `ptr` holds `bytes` bytes (freed by `buf` on error).
        unsafe { result::memset_d8_async(ptr, 0, bytes, stream.cu_stream()) }.map_err(|e| driver_error(&what("zeroing"), e))?;
        Ok(buf)
    }

    /// A new buffer holding `values` (the host waits for the copy).
    pub fn from_host(gpu: &Arc<Gpu>, stream: &CudaStream, values: &[T]) -> Result<DevBuf<T>> {
        let mut buf = DevBuf::zeros(gpu, stream, values.len())?;
        buf.upload(stream, values)?;
        Ok(buf)
    }

    /// Copies `values` into the front of the buffer after the work queued on `stream`, and
    /// waits for the copy.
    pub fn upload(&mut self, stream: &CudaStream, values: &[T]) -> Result<()> {
        assert!(values.len() <= self.len, "upload of {} values into a buffer of {}", values.len(), self.len);
        self.gpu.bind()?;
        // SAFETY: the destination holds at least `values.len()` values; the host waits below,
        // so `values` outlives the copy.
        unsafe { result::memcpy_htod_async(self.ptr, values, stream.cu_stream()) }.map_err(|e| driver_error("copying to the device", e))?;
        stream.synchronize().map_err(|e| driver_error("waiting for a copy to the device", e))
    }

    /// Copies the front `out.len()` values to the host, after the work queued on `stream`.
    pub fn download(&self, stream: &CudaStream, out: &mut [T]) -> Result<()> {
        assert!(out.len() <= self.len, "download of {} values from a buffer of {}", out.len(), self.len);
        self.gpu.bind()?;
        // SAFETY: the source holds at least `out.len()` values; the host waits below.
        unsafe { result::memcpy_dtoh_async(out, self.ptr, stream.cu_stream()) }.map_err(|e| driver_error("copying from the device", e))?;
        stream.synchronize().map_err(|e| driver_error("waiting for a copy from the device", e))
    }

    /// The device this buffer lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl<T> DevBuf<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    /// The device address of value 0.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Values `range`, for reading.
    pub fn view(&self, range: Range<usize>) -> View<'_, T> {
        assert!(range.start <= range.end && range.end <= self.len, "device buffer {range:?} out of 0..{}", self.len);
        // SAFETY: inside this buffer, which the view borrows.
        unsafe { View::from_raw(self.ptr + (range.start * size_of::<T>()) as u64, range.len()) }
    }

    /// Values `range`, for writing.
    pub fn view_mut(&mut self, range: Range<usize>) -> ViewMut<'_, T> {
        assert!(range.start <= range.end && range.end <= self.len, "device buffer {range:?} out of 0..{}", self.len);
        // SAFETY: inside this buffer, which the view borrows mutably.
        unsafe { ViewMut::from_raw(self.ptr + (range.start * size_of::<T>()) as u64, range.len()) }
    }

    /// All values, for reading.
    pub fn all(&self) -> View<'_, T> {
        self.view(0..self.len)
    }

    /// All values, for writing.
    pub fn all_mut(&mut self) -> ViewMut<'_, T> {
        self.view_mut(0..self.len)
    }
}

/// A failed allocation of `bytes`: [`Error::OutOfMemory`] naming `what` where the driver says
/// there is not enough memory, else the driver's error.
pub(super) fn allocation_error(e: DriverError, bytes: usize, what: impl FnOnce() -> String) -> Error {
    match e.0 {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory { what: what(), bytes },
        _ => driver_error(&format!("allocating {bytes} bytes of {}", what()), e),
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        // The owner waited for the stream that used the buffer last. An error here (a device
        // already lost) leaves nothing to do but leak.
        if self.gpu.bind().is_ok() {
            let _exclusive = super::device_wide();
            // SAFETY: allocated in `zeros`, freed once, no queued work uses it.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}
