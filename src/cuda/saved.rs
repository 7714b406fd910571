//! Copies of the device buffers that the whole-step check's timed steps move (parameters,
//! optimiser state, running statistics, losses), taken before them and put back after, so that
//! a first training call that times its routes leaves no trace of it.

use super::buffer::DevBuf;
use super::context::Gpu;
use super::driver_error;
use crate::error::Result;
use cudarc::driver::{result, CudaStream, DeviceRepr};
use std::sync::Arc;

/// A new device buffer holding what `from` holds once the copy queued on `stream` has run.
fn copy_of<T: DeviceRepr>(gpu: &Arc<Gpu>, stream: &CudaStream, from: &DevBuf<T>) -> Result<DevBuf<T>> {
    let to = DevBuf::zeros(gpu, stream, from.len())?;
    copy(stream, from, &to)?;
    Ok(to)
}

/// Copies of buffers that timed steps move, to put them back after ([`Saved::restore`]):
/// (buffer, copy).
pub(super) struct Saved<'a> {
    f32s: Vec<(&'a DevBuf<f32>, DevBuf<f32>)>,
    f64s: Vec<(&'a DevBuf<f64>, DevBuf<f64>)>,
}

impl<'a> Saved<'a> {
    /// Copies of `f32s` and `f64s`, queued on `stream`; after an error, none, once the copies
    /// queued are done.
    pub(super) fn take(gpu: &Arc<Gpu>, stream: &CudaStream, f32s: &[&'a DevBuf<f32>], f64s: &[&'a DevBuf<f64>]) -> Result<Saved<'a>> {
        fn push<'a, T: DeviceRepr>(
            gpu: &Arc<Gpu>,
            stream: &CudaStream,
            from: &[&'a DevBuf<T>],
            to: &mut Vec<(&'a DevBuf<T>, DevBuf<T>)>,
        ) -> Result<()> {
            for &buf in from {
                to.push((buf, copy_of(gpu, stream, buf)?));
            }
            Ok(())
        }
        let mut saved = Saved { f32s: Vec::new(), f64s: Vec::new() };
        match push(gpu, stream, f32s, &mut saved.f32s).and_then(|()| push(gpu, stream, f64s, &mut saved.f64s)) {
            Ok(()) => Ok(saved),
            Err(e) => {
                // the copies made are done before they are freed
                let _ = stream.synchronize();
                Err(e)
            }
        }
    }

    /// Queues, on `stream`, the copy of each buffer's saved values back into it: every one,
    /// where one fails too (the first error).
    pub(super) fn restore(&self, stream: &CudaStream) -> Result<()> {
        let f32s = self.f32s.iter().map(|(to, from)| copy(stream, from, to));
        let f64s = self.f64s.iter().map(|(to, from)| copy(stream, from, to));
        f32s.chain(f64s).fold(Ok(()), Result::and)
    }
}

/// Queues a copy of `from` into `to` (of the same length) on `stream`.
fn copy<T>(stream: &CudaStream, from: &DevBuf<T>, to: &DevBuf<T>) -> Result<()> {
    assert_eq!(from.len(), to.len(), "copies between buffers of one length");
    let bytes = from.len() * std::mem::size_of::<T>();
    // SAFETY: two live allocations of `bytes` bytes each, of the current context; the copy is
    // ordered on `stream` with every kernel that reads or writes them in a step.
    unsafe { result::memcpy_dtod_async(to.ptr(), from.ptr(), bytes, stream.cu_stream()) }.map_err(|e| driver_error("copying buffers", e))
}
