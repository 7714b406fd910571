//! Device memory as borrowed (pointer, length) views, and the one kernel launch everything goes
//! through: the driver's `cuLaunchKernel` with the argument pointers on the caller's stack, so a
//! launch allocates nothing on the host.

use crate::error::{Error, Result};
use cudarc::driver::sys;
#[cfg(test)]
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use std::ffi::c_void;
use std::marker::PhantomData;
#[cfg(test)]
use std::ops::Range;

/// `len` values of `T` in device memory, borrowed for reading.
#[derive(Clone, Copy, Debug)]
pub struct View<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    _borrow: PhantomData<&'a [T]>,
}

/// `len` values of `T` in device memory, borrowed for writing.
#[derive(Debug)]
pub struct ViewMut<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T> View<'a, T> {
    /// All of `slice`.
    #[cfg(test)]
    pub fn of(slice: &'a CudaSlice<T>) -> View<'a, T> {
        // The guard records a read event only where the context tracks events (flatnn's do not).
        let (ptr, _guard) = slice.device_ptr(slice.stream());
        View { ptr, len: slice.len(), _borrow: PhantomData }
    }

    /// A view of raw device memory.
    ///
    /// # Safety
    /// `ptr` must point to `len` initialised values of `T` in device memory of the context the
    /// view will be used with, not written by anyone while the view lives.
    pub unsafe fn from_raw(ptr: sys::CUdeviceptr, len: usize) -> View<'a, T> {
        View { ptr, len, _borrow: PhantomData }
    }

    /// Values `range` of this view; panics when out of bounds.
    #[cfg(test)]
    pub fn slice(self, range: Range<usize>) -> View<'a, T> {
        assert!(range.start <= range.end && range.end <= self.len, "device view {range:?} out of 0..{}", self.len);
        View { ptr: self.ptr + (range.start * size_of::<T>()) as u64, len: range.len(), _borrow: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The device address of the first value.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

impl<'a, T> ViewMut<'a, T> {
    /// All of `slice`.
    #[cfg(test)]
    pub fn of(slice: &'a mut CudaSlice<T>) -> ViewMut<'a, T> {
        let len = slice.len();
        let stream = std::sync::Arc::clone(slice.stream());
        let (ptr, _guard) = slice.device_ptr_mut(&stream);
        ViewMut { ptr, len, _borrow: PhantomData }
    }

    /// A view of raw device memory.
    ///
    /// # Safety
    /// `ptr` must point to `len` values of `T` in device memory of the context the view will be
    /// used with, used by no one else while the view lives.
    pub unsafe fn from_raw(ptr: sys::CUdeviceptr, len: usize) -> ViewMut<'a, T> {
        ViewMut { ptr, len, _borrow: PhantomData }
    }

    /// Values `range` of this view; panics when out of bounds.
    #[cfg(test)]
    pub fn slice(self, range: Range<usize>) -> ViewMut<'a, T> {
        assert!(range.start <= range.end && range.end <= self.len, "device view {range:?} out of 0..{}", self.len);
        ViewMut { ptr: self.ptr + (range.start * size_of::<T>()) as u64, len: range.len(), _borrow: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the first value.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

/// Launches `func` with `args` (one pointer to each kernel parameter's value, in order). With
/// `dependent`, the launch carries the programmatic-stream-serialisation attribute (sm_90 and
/// later): the kernel may begin launching while the kernel ahead of it in the stream still runs,
/// and waits for it inside (`after_prior()` in kernels/common.cu, which every kernel calls
/// first). Captured into a graph, the edge between the two becomes a programmatic one.
///
/// # Safety
/// `func` must be a kernel of the context current on this thread, `stream` a stream of that
/// context, and `args` must match the kernel's parameters in number, order and type, every
/// device pointer among them valid for all the accesses the kernel makes with these sizes.
/// With `dependent`, `func` must call `after_prior()` before touching memory.
pub unsafe fn launch(
    func: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    stream: sys::CUstream,
    dependent: bool,
    args: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { launch_in_clusters(func, grid, block, shared_bytes, stream, dependent, 1, args) }
}

/// [`launch`] with the grid's blocks in clusters of `cluster` along x (a launch attribute; 1: no
/// clusters).
///
/// # Safety
/// As [`launch`]'s; where `cluster` > 1 the device must be sm_90 or later, `grid.0` a multiple of
/// `cluster`, and `func` a kernel written for clusters of that size.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_in_clusters(
    func: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    stream: sys::CUstream,
    dependent: bool,
    cluster: u32,
    args: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: plain data; zero is a valid value for every field of the union.
    let mut attributes: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
    let mut count = 0;
    if dependent {
        attributes[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attributes[count].value.programmaticStreamSerializationAllowed = 1;
        count += 1;
    }
    if cluster > 1 {
        attributes[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attributes[count].value.clusterDim.x = cluster;
        attributes[count].value.clusterDim.y = 1;
        attributes[count].value.clusterDim.z = 1;
        count += 1;
    }
    // SAFETY (both calls): the caller's contract; the driver copies the argument values (and
    // the launch attributes) before returning.
    let status = if count > 0 {
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: shared_bytes,
            hStream: stream,
            attrs: attributes.as_mut_ptr(),
            numAttrs: count as u32,
        };
        unsafe { sys::cuLaunchKernelEx(&config, func, args.as_mut_ptr(), std::ptr::null_mut()) }
    } else {
        unsafe {
            sys::cuLaunchKernel(
                func,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared_bytes,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    };
    status.result().map_err(|e| super::driver_error("kernel launch", e))
}

/// `[*mut c_void; N]` pointing at each argument, for [`launch`]. The arguments must be places
/// (local variables) of exactly the kernel parameters' types and outlive the launch call.
macro_rules! kernel_args {
    ($($arg:expr),* $(,)?) => {
        [$(std::ptr::addr_of!($arg) as *mut std::ffi::c_void),*]
    };
}
pub(crate) use kernel_args;

/// Threads per block of every kernel (reductions rely on it: REDUCE_THREADS in common.cu).
pub(crate) const BLOCK: u32 = 256;

/// Largest length a kernel takes: sizes are `int` on the device, and grid-stride indices must
/// not overflow.
pub(crate) const MAX_LEN: usize = 1 << 30;

/// `n` as a kernel's `int`, or a Shape error past [`MAX_LEN`].
pub(crate) fn int(n: usize) -> Result<i32> {
    if n >= MAX_LEN {
        return Err(Error::Shape(format!("{n} values are too many for one CUDA kernel (limit 2^30)")));
    }
    Ok(n as i32)
}

/// Blocks for a grid-stride loop over `n` values (n > 0): one value per thread, capped.
pub(crate) fn blocks(n: usize) -> u32 {
    n.div_ceil(BLOCK as usize).clamp(1, 1 << 16) as u32
}

/// Whether every device address in `pointers` is 16-byte aligned, so a kernel may move float4s
/// through them (a null pointer, an absent operand, counts as aligned).
pub(crate) fn aligned16(pointers: &[u64]) -> bool {
    pointers.iter().all(|p| p.is_multiple_of(16))
}

#[cfg(test)]
mod tests {
    use super::aligned16;

    #[test]
    fn float4s_need_every_pointer_on_16_bytes() {
        assert!(aligned16(&[0, 16, 4096]));
        assert!(aligned16(&[]));
        assert!(!aligned16(&[16, 20]));
        assert!(!aligned16(&[8]));
    }
}
