//! The data loaders' device side: a data set held in device memory and gathered batch by batch
//! into a cache ([`DevDataset`]), and page-locked host staging that copies batches on a copy
//! stream while the previous step runs ([`DevStaging`]).
//!
//! Both queue their work on the cache's bound stream (`DevCache::stream`) ahead of the step,
//! outside any graph, and order themselves against other streams with events: the host waits
//! only for an event (before it refills a page-locked buffer a copy may still read, or before
//! freeing), never for the whole device.

use super::buffer::DevBuf;
use super::context::Gpu;
use super::driver_error;
use super::pinned::{Event, Pinned};
use super::state::DevCache;
use crate::data::dataset::Targets;
use crate::device::Device;
use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaStream};
use std::sync::Arc;

/// Queues a copy of `src` (page-locked) into the device memory at `dst`, on `stream`.
///
/// # Safety
/// `dst` must hold `src.len()` values; `src` must stay unwritten and alive until the copy is
/// done (the caller records an event after it and waits for it before writing or freeing).
unsafe fn copy_pinned<T>(dst: sys::CUdeviceptr, src: &[T], stream: &CudaStream, what: &str) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }.map_err(|e| driver_error(what, e))
}

/// A data set in the memory of one GPU: samples (samples, sample_len) f32, already normalised;
/// labels u32 (checked by the caller before upload) or real-valued targets (samples, outputs);
/// and the loader's order for the current epoch, one index per sample, with its page-locked
/// host mirror.
pub(crate) struct DevDataset {
    gpu: Arc<Gpu>,
    samples: DevBuf<f32>,
    /// The labels, or the targets and how many a sample; the other buffer empty.
    labels: DevBuf<u32>,
    targets: DevBuf<f32>,
    outputs: Option<usize>,
    order: DevBuf<u32>,
    order_host: Pinned<u32>,
    /// The stream that used the buffers last, and the point it reached after its last use.
    stream: Arc<CudaStream>,
    used: Event,
    /// Reached when the last copy from `order_host` is done.
    order_copied: Event,
}

impl DevDataset {
    /// `samples` and their labels or targets copied to CUDA device `ordinal`; the host waits
    /// for the copies.
    pub fn on(ordinal: usize, samples: &[f32], targets: &Targets) -> Result<DevDataset> {
        let count = match targets {
            Targets::Labels(labels) => labels.len(),
            Targets::Values { values, outputs } => values.len() / outputs,
        };
        if count == 0 || !samples.len().is_multiple_of(count) {
            return Err(Error::Shape(format!("{} values are not a whole number of {count} samples", samples.len())));
        }
        let gpu = super::gpu(ordinal)?;
        let stream = gpu.new_stream()?;
        // the kind of targets the data set does not have: an empty buffer
        let (labels, values) = match targets {
            Targets::Labels(labels) => (DevBuf::from_host(&gpu, &stream, labels)?, DevBuf::zeros(&gpu, &stream, 0)?),
            Targets::Values { values, .. } => (DevBuf::zeros(&gpu, &stream, 0)?, DevBuf::from_host(&gpu, &stream, values)?),
        };
        let data = DevDataset {
            samples: DevBuf::from_host(&gpu, &stream, samples)?,
            labels,
            targets: values,
            outputs: targets.outputs(),
            order: DevBuf::zeros(&gpu, &stream, count)?,
            order_host: Pinned::zeros(&gpu, count)?,
            used: Event::new(&gpu)?,
            order_copied: Event::new(&gpu)?,
            stream,
            gpu,
        };
        // the first user's stream waits for the zeroing of `order`, queued on the upload stream
        data.used.record(&data.stream)?;
        Ok(data)
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.gpu.ordinal())
    }

    /// Makes `stream` the one that uses the buffers next: it waits (on the device) for the
    /// last use on another stream.
    fn bind_stream(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if !Arc::ptr_eq(&self.stream, stream) {
            self.used.wait_in(stream)?;
            self.stream = Arc::clone(stream);
        }
        Ok(())
    }
}

impl Drop for DevDataset {
    fn drop(&mut self) {
        // Every use recorded `used` on the stream that used the buffers last; an error (a
        // device already lost) leaves nothing better to do than to free anyway.
        let _ = self.used.wait();
        let _ = self.order_copied.wait();
    }
}

impl DevCache {
    /// Checks that `gpu` is this cache's device.
    fn check_gpu(&self, gpu: &Arc<Gpu>, what: &str) -> Result<()> {
        if !Arc::ptr_eq(self.acts.gpu(), gpu) {
            let ordinals = (self.acts.gpu().ordinal(), gpu.ordinal());
            return Err(Error::Mismatch(format!("cache on cuda:{}, {what} on cuda:{}", ordinals.0, ordinals.1)));
        }
        Ok(())
    }

    /// Copies `order` (one index per sample of `data`) into the data set's order buffer, in
    /// this cache stream's order (after the gathers that read the previous order). The host
    /// waits only for the previous order copy to have left the page-locked mirror.
    pub(crate) fn upload_order(&mut self, data: &mut DevDataset, order: &[u32]) -> Result<()> {
        self.check_gpu(&data.gpu, "data set")?;
        if order.len() != data.order.len() {
            return Err(Error::Mismatch(format!("an order of {} indices for a data set of {}", order.len(), data.order.len())));
        }
        data.gpu.bind()?;
        data.bind_stream(&self.stream)?;
        data.order_copied.wait()?;
        data.order_host.as_mut_slice().copy_from_slice(order);
        // SAFETY: `order` on the device holds as many indices as the mirror; the mirror is not
        // written again before `order_copied` (recorded next) is reached, nor freed before.
        unsafe { copy_pinned(data.order.ptr(), data.order_host.as_slice(), &self.stream, "copying a loader's order to the device")? };
        data.order_copied.record(&self.stream)?;
        data.used.record(&self.stream)
    }

    /// Queues the gather of the samples `order[start..start + batch]` of `data` into this
    /// cache's inputs (the front `batch × sample_len` activations) and labels or targets, on
    /// the cache's stream. `batch` must be within the cache's capacity (checked: an
    /// `Error::Capacity`), and targets as many a sample as the cache's model has outputs.
    pub(crate) fn gather(&mut self, data: &mut DevDataset, start: usize, batch: usize) -> Result<()> {
        self.check_gpu(&data.gpu, "data set")?;
        let samples = data.order.len();
        let sample_len = data.samples.len() / samples;
        if start > samples || batch > samples - start {
            return Err(Error::Shape(format!("samples {start}..{} of a data set of {samples}", start + batch)));
        }
        if batch > self.labels.len() || batch * sample_len > self.acts.len() {
            return Err(Error::Capacity { batch, capacity: self.labels.len() });
        }
        if data.outputs.is_some_and(|outputs| batch * outputs > self.targets.len()) {
            return Err(Error::Capacity { batch, capacity: self.labels.len() });
        }
        data.gpu.bind()?;
        data.bind_stream(&self.stream)?;
        let gpu = Arc::clone(&data.gpu);
        let indices = data.order.view(start..start + batch);
        gpu.gather_batch(&self.stream, sample_len, batch, data.samples.all(), indices, self.acts.view_mut(0..batch * sample_len))?;
        match data.outputs {
            None => gpu.gather_labels(&self.stream, batch, data.labels.all(), indices, self.labels.view_mut(0..batch))?,
            Some(outputs) => {
                let targets = self.targets.view_mut(0..batch * outputs);
                gpu.gather_batch(&self.stream, outputs, batch, data.targets.all(), indices, targets)?
            }
        }
        data.used.record(&self.stream)
    }
}

/// One of [`DevStaging`]'s two buffers: a batch (inputs, and labels or targets) in page-locked
/// host memory and its copy on the device, with the events that keep the host, the copy stream
/// and the step apart.
struct Slot {
    host_inputs: Pinned<f32>,
    host_labels: Pinned<u32>,
    host_targets: Pinned<f32>,
    inputs: DevBuf<f32>,
    labels: DevBuf<u32>,
    targets: DevBuf<f32>,
    /// Reached when the last host→device copy of this slot is done: the host may refill the
    /// page-locked buffers, and a step may read the device copy.
    copied: Event,
    /// Reached when the last delivery of this slot into a cache is done: the copy stream may
    /// overwrite the device copy.
    delivered: Event,
}

/// Double-buffered staging of batches from page-locked host memory on a copy stream of its
/// own, for up to `capacity` samples of `sample_len` values, each with a label or `outputs`
/// targets.
pub(crate) struct DevStaging {
    gpu: Arc<Gpu>,
    copy_stream: Arc<CudaStream>,
    sample_len: usize,
    outputs: usize,
    capacity: usize,
    slots: [Slot; 2],
}

impl DevStaging {
    pub fn on(ordinal: usize, capacity: usize, sample_len: usize, outputs: usize) -> Result<DevStaging> {
        let sized = |per: usize| capacity.checked_mul(per).ok_or_else(|| Error::Shape(format!("{capacity} samples of {per} overflow")));
        let (len, targets_len) = (sized(sample_len)?, sized(outputs)?);
        let gpu = super::gpu(ordinal)?;
        let copy_stream = gpu.new_stream()?;
        let slot = || -> Result<Slot> {
            Ok(Slot {
                host_inputs: Pinned::zeros(&gpu, len)?,
                host_labels: Pinned::zeros(&gpu, capacity)?,
                host_targets: Pinned::zeros(&gpu, targets_len)?,
                inputs: DevBuf::zeros(&gpu, &copy_stream, len)?,
                labels: DevBuf::zeros(&gpu, &copy_stream, capacity)?,
                targets: DevBuf::zeros(&gpu, &copy_stream, targets_len)?,
                copied: Event::new(&gpu)?,
                delivered: Event::new(&gpu)?,
            })
        };
        let slots = [slot()?, slot()?];
        // the zeroing above is ordered before every later copy on the copy stream, and a
        // delivery waits for `copied`, recorded on it after its copy
        Ok(DevStaging { gpu, copy_stream, sample_len, outputs, capacity, slots })
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.gpu.ordinal())
    }

    /// Slot `slot`'s page-locked inputs (`capacity × sample_len`), labels (`capacity`) and
    /// targets (`capacity × outputs`), to be filled: the host first waits for the copy that
    /// last read them.
    #[allow(clippy::type_complexity)]
    pub fn host_slot(&mut self, slot: usize) -> Result<(&mut [f32], &mut [u32], &mut [f32])> {
        let s = &mut self.slots[slot];
        s.copied.wait()?;
        Ok((s.host_inputs.as_mut_slice(), s.host_labels.as_mut_slice(), s.host_targets.as_mut_slice()))
    }

    /// Queues the copy of slot `slot`'s first `batch` samples and labels (with `values`, their
    /// targets) to the device on the copy stream, after the last delivery of the slot's
    /// previous contents.
    pub fn send(&mut self, slot: usize, batch: usize, values: bool) -> Result<()> {
        if batch > self.capacity {
            return Err(Error::Capacity { batch, capacity: self.capacity });
        }
        self.gpu.bind()?;
        let (s, stream) = (&self.slots[slot], &*self.copy_stream);
        s.delivered.wait_in(stream)?;
        let inputs = &s.host_inputs.as_slice()[..batch * self.sample_len];
        // SAFETY: the device buffers hold `capacity` samples and labels; the host buffers are
        // not written before `copied` (recorded next) is reached (`host_slot` waits for it) nor
        // freed before (`Drop` waits for it).
        unsafe {
            copy_pinned(s.inputs.ptr(), inputs, stream, "copying a batch to the device")?;
            if values {
                let targets = &s.host_targets.as_slice()[..batch * self.outputs];
                copy_pinned(s.targets.ptr(), targets, stream, "copying targets to the device")?;
            } else {
                copy_pinned(s.labels.ptr(), &s.host_labels.as_slice()[..batch], stream, "copying labels to the device")?;
            }
        }
        s.copied.record(stream)
    }
}

impl Drop for DevStaging {
    fn drop(&mut self) {
        // Each slot's last copy recorded `copied` and its last delivery `delivered`; an error
        // (a device already lost) leaves nothing better to do than to free anyway.
        for s in &self.slots {
            let _ = s.copied.wait();
            let _ = s.delivered.wait();
        }
        let _ = self.copy_stream.synchronize();
    }
}

impl DevCache {
    /// Queues, on this cache's stream, the delivery of staging slot `slot`'s first `batch`
    /// samples and labels (with `values`, targets), sent before, into the cache's inputs and
    /// labels (targets): the stream waits for the slot's copy, then copies device to device.
    pub(crate) fn receive(&mut self, staging: &mut DevStaging, slot: usize, batch: usize, values: bool) -> Result<()> {
        self.check_gpu(&staging.gpu, "staging buffers")?;
        let (len, targets_len) = (batch * staging.sample_len, batch * staging.outputs);
        if batch > staging.capacity || batch > self.labels.len() || len > self.acts.len() || targets_len > self.targets.len() {
            return Err(Error::Capacity { batch, capacity: self.labels.len().min(staging.capacity) });
        }
        staging.gpu.bind()?;
        let (s, stream) = (&staging.slots[slot], self.stream.cu_stream());
        s.copied.wait_in(&self.stream)?;
        let copy = |dst: sys::CUdeviceptr, src: sys::CUdeviceptr, bytes: usize| {
            // SAFETY: both buffers hold at least `bytes` (checked above); the source is not
            // overwritten before `delivered` (recorded next) is reached.
            unsafe { result::memcpy_dtod_async(dst, src, bytes, stream) }.map_err(|e| driver_error("copying a staged batch", e))
        };
        copy(self.acts.ptr(), s.inputs.ptr(), len * size_of::<f32>())?;
        if values {
            copy(self.targets.ptr(), s.targets.ptr(), targets_len * size_of::<f32>())?;
        } else {
            copy(self.labels.ptr(), s.labels.ptr(), batch * size_of::<u32>())?;
        }
        s.delivered.record(&self.stream)
    }
}
