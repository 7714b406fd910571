//! Page-locked host memory and events: what makes a copy between host and device truly
//! asynchronous, and what tells the host when such a copy has finished with its buffer.

use super::buffer::allocation_error;
use super::context::Gpu;
use super::driver_error;
use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaStream};
use std::sync::Arc;

/// `len` values of `T` in page-locked host memory, zero when allocated. The device reads and
/// writes it by DMA, so a copy from it returns at once and runs in its stream's order: whoever
/// writes it must know that no queued copy still reads it (see [`Event`]).
pub(crate) struct Pinned<T> {
    ptr: *mut T,
    /// The same memory's address on the device (mapped; kernels may read and write it).
    device: sys::CUdeviceptr,
    len: usize,
    gpu: Arc<Gpu>,
}

// SAFETY: plain host memory, owned; access goes through `&` / `&mut` as for a Vec.
unsafe impl<T: Send> Send for Pinned<T> {}
unsafe impl<T: Sync> Sync for Pinned<T> {}

impl<T: Copy + Default> Pinned<T> {
    /// `len` zeros in page-locked host memory, mapped into `gpu`: an [`Error::OutOfMemory`] with
    /// the bytes asked for where the driver cannot lock that much.
    pub fn zeros(gpu: &Arc<Gpu>, len: usize) -> Result<Pinned<T>> {
        gpu.bind()?;
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| Error::Shape(format!("{len} values overflow a host buffer")))?.max(1);
        let ptr = {
            let _exclusive = super::device_wide();
            // SAFETY: the context is current; the memory is initialised below before use.
            unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
                .map_err(|e| allocation_error(e, bytes, || "page-locked host memory".into()))?
        } as *mut T;
        if ptr.is_null() || !ptr.is_aligned() {
            return Err(Error::Cuda { what: "cuMemHostAlloc gave a null or misaligned pointer".into() });
        }
        let mut device = 0;
        // SAFETY: memory just allocated with DEVICEMAP in the current context.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, ptr.cast(), 0) }.result();
        let mut pinned = Pinned { ptr, device, len, gpu: Arc::clone(gpu) };
        mapped.map_err(|e| driver_error("mapping pinned host memory into the device", e))?;
        pinned.as_mut_slice().fill(T::default());
        Ok(pinned)
    }
}

impl<T> Pinned<T> {
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `len` values allocated and initialised in `zeros`, borrowed with `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The first value's address as the device sees it.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.device
    }

    /// The first value's address on the host, for reads of what the device writes.
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, borrowed mutably with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T> Drop for Pinned<T> {
    fn drop(&mut self) {
        // The owner waited for the copies that used this memory. An error (a device already
        // lost) leaves nothing to do but leak.
        if self.gpu.bind().is_ok() {
            let _exclusive = super::device_wide();
            // SAFETY: allocated in `zeros`, freed once.
            let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
        }
    }
}

/// A CUDA event, for the host to wait until the work queued before it on a stream is done.
pub(crate) struct Event {
    event: sys::CUevent,
    gpu: Arc<Gpu>,
}

// SAFETY: an event handle may be recorded and waited for from any thread of the process.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn new(gpu: &Arc<Gpu>) -> Result<Event> {
        gpu.bind()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| driver_error("creating an event", e))?;
        let event = Event { event, gpu: Arc::clone(gpu) };
        // cudarc looks a driver function up (allocating its name) the first time it is called:
        // call the wait here, where allocating is fine, not first in some step
        event.wait()?;
        Ok(event)
    }

    /// Marks the point in `stream` after the work queued so far.
    pub fn record(&self, stream: &CudaStream) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: a live event and stream of the same context.
        unsafe { result::event::record(self.event, stream.cu_stream()) }.map_err(|e| driver_error("recording an event", e))
    }

    /// The host waits until the work before the last `record` is done (at once if never
    /// recorded).
    pub fn wait(&self) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: a live event.
        unsafe { result::event::synchronize(self.event) }.map_err(|e| driver_error("waiting for an event", e))
    }

    /// Whether the work before the last `record` is done (true if never recorded); the host
    /// does not wait.
    pub fn done(&self) -> Result<bool> {
        self.gpu.bind()?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver_error("asking whether an event passed", cudarc::driver::DriverError(e))),
        }
    }

    /// Makes `stream` wait, on the device, for the last recorded point (a no-op before any).
    pub fn wait_in(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: a live event and a live stream of the same context.
        unsafe { result::stream::wait_event(stream.cu_stream(), self.event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| driver_error("making a stream wait for an event", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once; the driver waits for a pending record.
            let _ = unsafe { result::event::destroy(self.event) };
        }
    }
}
