//! A loader that writes each shuffled batch of a [`Dataset`] straight into a cache's
//! preallocated input and label (or target) buffers: no allocation per batch or per epoch.
//!
//! On a GPU a batch can come two other ways. [`DeviceDataset`] keeps the whole data set in
//! device memory and [`Loader::next_device_batch`] gathers each shuffled batch there with a
//! kernel (the host copies only the order, once per epoch). [`StreamingLoader`] copies each
//! batch from page-locked host memory on a copy stream of its own while the previous step
//! runs. Both queue their work on the cache's stream ahead of the step and never wait for it.

use super::dataset::{check_outputs, Dataset, DeviceDataset, Targets};
use super::DevStaging;
use crate::cache::Cache;
use crate::chain::Shape;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::init::Rng;
use std::sync::atomic::{AtomicU64, Ordering};

/// Hands out a data set in batches, shuffled per epoch from a seed.
pub struct Loader {
    order: Vec<u32>,
    batch: usize,
    drop_last: bool,
    next: usize,
    rng: Rng,
    /// Unique per loader, and counted up whenever `order` changes: which order a device data
    /// set holds.
    id: u64,
    epoch: u64,
}

/// Loaders made so far (their ids).
static LOADERS: AtomicU64 = AtomicU64::new(0);

impl Loader {
    /// A loader over `len` samples in batches of `batch`. With `drop_last`, a final partial
    /// batch is skipped; otherwise it runs as a smaller batch in the same buffers.
    pub fn new(len: usize, batch: usize, seed: u64, drop_last: bool) -> Result<Loader> {
        if batch == 0 || len == 0 {
            return Err(Error::Config(format!("a loader needs samples and a batch of at least 1 (got {len} samples, batch {batch})")));
        }
        let len = u32::try_from(len).map_err(|_| Error::Config(format!("{len} samples is more than a loader indexes")))?;
        let id = LOADERS.fetch_add(1, Ordering::Relaxed);
        Ok(Loader { order: (0..len).collect(), batch, drop_last, next: 0, rng: Rng::new(seed), id, epoch: 0 })
    }

    /// Starts an epoch in a new random order (in place: no allocation).
    pub fn shuffle(&mut self) {
        self.rng.shuffle(&mut self.order);
        (self.next, self.epoch) = (0, self.epoch + 1);
    }

    /// Starts an epoch in the data set's own order.
    pub fn rewind(&mut self) {
        self.order.iter_mut().enumerate().for_each(|(i, o)| *o = i as u32);
        (self.next, self.epoch) = (0, self.epoch + 1);
    }

    /// Batches per epoch.
    pub fn batches(&self) -> usize {
        if self.drop_last {
            self.order.len() / self.batch
        } else {
            self.order.len().div_ceil(self.batch)
        }
    }

    /// Writes the next batch's samples and labels (or targets) into `cache` and returns its
    /// size, or `None` at the end of the epoch. The data set must be the one the loader was
    /// made for.
    pub fn next_batch(&mut self, data: &Dataset, cache: &mut Cache) -> Result<Option<usize>> {
        self.check(data.len(), data.shape, cache)?;
        if let Some(per_sample) = data.targets.outputs() {
            check_outputs(per_sample, cache.plan.output().len())?;
        }
        let Some(size) = self.batch_at(self.next) else { return Ok(None) };
        let per_sample = data.shape.len();
        let picked = &self.order[self.next..self.next + size];
        let inputs = cache.inputs_mut(size)?;
        for (dst, &i) in inputs.chunks_exact_mut(per_sample).zip(picked) {
            dst.copy_from_slice(data.sample(i as usize).ok_or_else(|| out_of_order(i))?);
        }
        // from a data set, whose values were checked when it was made
        cache.inputs_finite = true;
        match &data.targets {
            Targets::Labels(labels) => {
                for (dst, &i) in cache.labels_mut(size)?.iter_mut().zip(picked) {
                    *dst = labels[i as usize];
                }
            }
            Targets::Values { values, outputs } => {
                for (dst, &i) in cache.targets_mut(size)?.chunks_exact_mut(*outputs).zip(picked) {
                    dst.copy_from_slice(&values[i as usize * outputs..][..*outputs]);
                }
            }
        }
        self.next += size;
        Ok(Some(size))
    }

    /// As [`Loader::next_batch`], from a data set on the cache's GPU: queues, on the cache's
    /// stream, the gather of the next batch into the cache's inputs and labels (or targets),
    /// and returns its size (the host neither copies the batch nor waits). The first batch of
    /// an epoch first queues the copy of this epoch's order to the device. Nothing is changed
    /// on error. The batch is only on the device: [`Cache::inputs`] does not show it.
    pub fn next_device_batch(&mut self, data: &mut DeviceDataset, cache: &mut Cache) -> Result<Option<usize>> {
        self.check(data.len, data.shape, cache)?;
        check_device(data.device(), cache)?;
        let outputs = cache.plan.output().len();
        match data.targets {
            None if data.outputs > outputs => {
                return Err(Error::Mismatch(format!("the data set has {} classes, the model {outputs} outputs", data.outputs)))
            }
            Some(per_sample) => check_outputs(per_sample, outputs)?,
            None => {}
        }
        let Some(size) = self.batch_at(self.next) else { return Ok(None) };
        if size > cache.capacity {
            return Err(Error::Capacity { batch: size, capacity: cache.capacity });
        }
        let dev = cache.dev.as_mut().ok_or_else(|| Error::Mismatch("a device data set needs a cache on its GPU".into()))?;
        let order_of = Some((self.id, self.epoch));
        if data.order_of != order_of {
            data.order_of = None;
            dev.upload_order(&mut data.dev, &self.order)?;
            data.order_of = order_of;
        }
        dev.gather(&mut data.dev, self.next, size)?;
        mark_written_on_device(cache, size, data.targets.is_some());
        self.next += size;
        Ok(Some(size))
    }

    /// Size of the batch starting at position `start` of the order; `None` past the end.
    fn batch_at(&self, start: usize) -> Option<usize> {
        let size = (self.order.len() - start).min(self.batch);
        (size > 0 && !(self.drop_last && size < self.batch)).then_some(size)
    }

    /// Checks a data set of `len` samples of `shape` against this loader and `cache`.
    fn check(&self, len: usize, shape: Shape, cache: &Cache) -> Result<()> {
        if len != self.order.len() {
            return Err(Error::Mismatch(format!("loader made for {} samples, data set has {len}", self.order.len())));
        }
        if cache.plan.input.len() != shape.len() {
            return Err(Error::Shape(format!("data samples are {shape}, the model takes {}", cache.plan.input)));
        }
        Ok(())
    }
}

fn check_device(device: Device, cache: &Cache) -> Result<()> {
    if cache.device() != device {
        return Err(Error::Mismatch(format!("data on {device}, cache on {}", cache.device())));
    }
    Ok(())
}

/// A loader's order holds a sample the data set lacks: `check` makes that impossible (the order
/// is a permutation of the data set's indices), but an error is cheaper to reason about than a
/// panic.
fn out_of_order(i: u32) -> Error {
    Error::Mismatch(format!("the loader's order names sample {i}, which the data set lacks"))
}

/// Records in `cache` that a batch of `batch` inputs and labels (or, with `values`, targets)
/// was queued into its device buffers: nothing is copied from the host for them, and the
/// labels were checked (at upload, or on the host before staging) so `backprop` need not look
/// at them, as the targets were (finite, when the data set was made).
fn mark_written_on_device(cache: &mut Cache, batch: usize, values: bool) {
    (cache.batch, cache.inputs_dirty, cache.inputs_on_device, cache.inputs_finite) = (batch, false, true, true);
    if values {
        (cache.targets_set, cache.targets_dirty, cache.targets_on_device) = (batch, false, true);
    } else {
        (cache.labels_set, cache.labels_dirty, cache.labels_on_device) = (batch, false, true);
    }
}

/// A loader that streams batches to a GPU from page-locked host memory: [`next_batch`] hands
/// the cache batch k (copied while the previous step ran) and queues the copy of batch k+1
/// on a copy stream of its own, so that copy overlaps step k. The step's stream waits for its
/// batch on the device; the host waits only before refilling a page-locked buffer whose copy
/// is still pending (two buffers, used in turn).
///
/// Simpler than a [`DeviceDataset`] (nothing but a batch on the device) and slower: it moves
/// every batch over PCIe. For data sets too large for device memory.
///
/// [`next_batch`]: StreamingLoader::next_batch
pub struct StreamingLoader {
    loader: Loader,
    staging: DevStaging,
    sample_len: usize,
    /// The batch already staged for the next call, if any.
    ahead: Option<Staged>,
    /// The staging slot the next batch is written to.
    slot: usize,
}

/// A batch sent to the device ahead of its call: which slot, and what it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Staged {
    slot: usize,
    start: usize,
    size: usize,
    epoch: u64,
    /// The data set's samples (their address and length).
    data: (usize, usize),
}

impl StreamingLoader {
    /// Streams `loader`'s batches into caches like `cache` (same model, same GPU): staging
    /// buffers for the loader's batch (inputs, and labels or targets) are allocated here,
    /// page-locked on the host and on the device. A loader batch over the cache's capacity is
    /// an [`Error::Capacity`].
    pub fn new(loader: Loader, cache: &Cache) -> Result<StreamingLoader> {
        let Device::Cuda(ordinal) = cache.device() else {
            return Err(Error::Config("streaming to a GPU needs a cache on a GPU; on the CPU use Loader::next_batch".into()));
        };
        if loader.batch > cache.capacity {
            return Err(Error::Capacity { batch: loader.batch, capacity: cache.capacity });
        }
        let sample_len = cache.plan.input.len();
        let staging = DevStaging::on(ordinal, loader.batch, sample_len, cache.plan.output().len())?;
        Ok(StreamingLoader { loader, staging, sample_len, ahead: None, slot: 0 })
    }

    /// Starts an epoch in a new random order (as [`Loader::shuffle`]).
    pub fn shuffle(&mut self) {
        self.loader.shuffle();
        self.ahead = None;
    }

    /// Starts an epoch in the data set's own order.
    pub fn rewind(&mut self) {
        self.loader.rewind();
        self.ahead = None;
    }

    /// Batches per epoch.
    pub fn batches(&self) -> usize {
        self.loader.batches()
    }

    /// As [`Loader::next_batch`]: queues the delivery of the next batch of `data` into the
    /// cache's inputs and labels or targets (on the cache's stream, after its copy) and returns
    /// its size, or `None` at the end of the epoch; then stages the batch after it. Labels are
    /// checked on the host against the model's outputs. Nothing is changed by a mismatch,
    /// capacity or label error. The batch is only on the device: [`Cache::inputs`] does not
    /// show it.
    pub fn next_batch(&mut self, data: &Dataset, cache: &mut Cache) -> Result<Option<usize>> {
        self.loader.check(data.len(), data.shape, cache)?;
        check_device(self.staging.device(), cache)?;
        if self.sample_len != data.shape.len() {
            return Err(Error::Shape(format!("data samples are {}, this loader streams samples of {}", data.shape, self.sample_len)));
        }
        let start = self.loader.next;
        let Some(size) = self.loader.batch_at(start) else { return Ok(None) };
        if size > cache.capacity {
            return Err(Error::Capacity { batch: size, capacity: cache.capacity });
        }
        let classes = cache.plan.output().len();
        match &data.targets {
            Targets::Labels(labels) => {
                for (index, &i) in self.loader.order[start..start + size].iter().enumerate() {
                    let label = labels[i as usize];
                    if label as usize >= classes {
                        return Err(Error::Label { index, label, classes });
                    }
                }
            }
            Targets::Values { outputs, .. } => check_outputs(*outputs, classes)?,
        }
        let values = data.targets.outputs().is_some();
        let dev = cache.dev.as_mut().ok_or_else(|| Error::Mismatch("streaming needs a cache on the GPU".into()))?;
        let want = self.staged(data, self.slot, start, size);
        let slot = match self.ahead.take() {
            Some(ahead) if ahead == Staged { slot: ahead.slot, ..want } => ahead.slot,
            _ => self.stage(data, start, size)?,
        };
        dev.receive(&mut self.staging, slot, size, values)?;
        mark_written_on_device(cache, size, values);
        self.loader.next += size;
        let next = self.loader.next;
        if let Some(next_size) = self.loader.batch_at(next) {
            let slot = self.stage(data, next, next_size)?;
            self.ahead = Some(self.staged(data, slot, next, next_size));
        }
        Ok(Some(size))
    }

    fn staged(&self, data: &Dataset, slot: usize, start: usize, size: usize) -> Staged {
        Staged { slot, start, size, epoch: self.loader.epoch, data: (data.samples.as_ptr() as usize, data.samples.len()) }
    }

    /// Writes the samples at `start..start + size` of the order into the next slot's
    /// page-locked buffers (after their last copy) and queues their copy; returns the slot.
    fn stage(&mut self, data: &Dataset, start: usize, size: usize) -> Result<usize> {
        let slot = self.slot;
        let picked = &self.loader.order[start..start + size];
        let (inputs, labels, targets) = self.staging.host_slot(slot)?;
        for (dst, &i) in inputs.chunks_exact_mut(self.sample_len).zip(picked) {
            dst.copy_from_slice(data.sample(i as usize).ok_or_else(|| out_of_order(i))?);
        }
        match &data.targets {
            Targets::Labels(all) => labels.iter_mut().zip(picked).for_each(|(dst, &i)| *dst = all[i as usize]),
            Targets::Values { values, outputs } => {
                for (dst, &i) in targets.chunks_exact_mut(*outputs).zip(picked) {
                    dst.copy_from_slice(&values[i as usize * outputs..][..*outputs]);
                }
            }
        }
        self.staging.send(slot, size, data.targets.outputs().is_some())?;
        self.slot ^= 1;
        Ok(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Chain, Identity};

    #[test]
    fn epochs_cover_every_sample_once_in_a_new_order() {
        let n = 10;
        let data = Dataset::new((0..n * 2).map(|v| v as f32).collect(), (0..n as u32).collect(), Shape::vector(2)).unwrap();
        let model = Chain::new(Shape::vector(2)).dense(10, Identity).build().unwrap();
        let mut cache = model.preallocate(4).unwrap();
        let mut loader = Loader::new(n, 4, 1, false).unwrap();
        let mut orders = Vec::new();
        for _ in 0..2 {
            loader.shuffle();
            let mut seen = Vec::new();
            let mut sizes = Vec::new();
            while let Some(b) = loader.next_batch(&data, &mut cache).unwrap() {
                sizes.push(b);
                for (x, &label) in cache.inputs().chunks(2).zip(&cache.labels[..b]) {
                    assert_eq!(x, [2.0 * label as f32, 2.0 * label as f32 + 1.0], "sample and label travel together");
                    seen.push(label);
                }
            }
            assert_eq!(sizes, [4, 4, 2]);
            orders.push(seen.clone());
            seen.sort();
            assert_eq!(seen, (0..n as u32).collect::<Vec<_>>());
        }
        assert_ne!(orders[0], orders[1]);
        let mut dropping = Loader::new(n, 4, 1, true).unwrap();
        dropping.shuffle();
        let mut count = 0;
        while dropping.next_batch(&data, &mut cache).unwrap().is_some() {
            count += 1;
        }
        assert_eq!((count, dropping.batches(), loader.batches()), (2, 2, 3));
    }

    /// Real-valued targets travel with their samples into the cache's targets, a final partial
    /// batch included; a model of another width, non-finite targets and ragged lengths are
    /// refused.
    #[test]
    fn regression_batches_carry_their_targets() {
        let n = 5;
        let xs: Vec<f32> = (0..n * 3).map(|v| v as f32).collect();
        let ys: Vec<f32> = (0..n * 2).map(|v| -(v as f32)).collect();
        let data = Dataset::from_targets(&xs, &ys, Shape::vector(3), 2).unwrap();
        assert_eq!((data.len(), data.labels(), data.targets()), (5, &[][..], &ys[..]));
        let model = Chain::new(Shape::vector(3)).dense(2, Identity).build().unwrap();
        let mut cache = model.preallocate(4).unwrap();
        let mut loader = Loader::new(n, 4, 3, false).unwrap();
        loader.shuffle();
        let mut seen = Vec::new();
        while let Some(b) = loader.next_batch(&data, &mut cache).unwrap() {
            assert_eq!(cache.targets_set, b);
            for (x, t) in cache.inputs().chunks(3).zip(cache.targets[..2 * b].chunks(2)) {
                let i = x[0] as usize / 3;
                assert_eq!(t, [-(2.0 * i as f32), -(2.0 * i as f32 + 1.0)], "sample {i}'s targets");
                seen.push(i);
            }
        }
        seen.sort();
        assert_eq!(seen, [0, 1, 2, 3, 4]);
        assert_eq!(data.clone().take(2).targets(), &ys[..4]);
        let wide = Chain::new(Shape::vector(3)).dense(3, Identity).build().unwrap();
        let mut wide_cache = wide.preallocate(4).unwrap();
        loader.rewind();
        assert!(matches!(loader.next_batch(&data, &mut wide_cache), Err(Error::Shape(_))));
        assert!(matches!(Dataset::from_targets(&xs, &[1.0, f32::NAN], Shape::vector(3), 2), Err(Error::NonFinite { index: 1, .. })));
        assert!(matches!(Dataset::from_targets(&xs, &ys[..9], Shape::vector(3), 2), Err(Error::Shape(_))));
        assert!(matches!(Dataset::from_targets(&xs, &ys, Shape::vector(3), 0), Err(Error::Shape(_))));
        assert!(matches!(Dataset::from_labels(&xs, &[0, 1], Shape::vector(3)), Err(Error::Shape(_))));
        assert!(matches!(data.to_device(&Device::Cuda(0), 3), Err(Error::Shape(_))), "the model's width is checked first");
    }

    #[test]
    fn mismatches_are_errors() {
        let data = Dataset::new(vec![0.0; 6], vec![0, 1], Shape::vector(3)).unwrap();
        let model = Chain::new(Shape::vector(2)).dense(2, Identity).build().unwrap();
        let mut cache = model.preallocate(2).unwrap();
        assert!(matches!(Loader::new(2, 2, 0, false).unwrap().next_batch(&data, &mut cache), Err(Error::Shape(_))));
        assert!(matches!(Loader::new(3, 2, 0, false).unwrap().next_batch(&data, &mut cache), Err(Error::Mismatch(_))));
        assert!(Dataset::new(vec![0.0; 5], vec![0, 1], Shape::vector(3)).is_err());
        assert!(Loader::new(0, 1, 0, false).is_err());
    }

    #[test]
    fn device_data_needs_a_gpu_and_labels_below_the_classes() {
        let data = Dataset::new(vec![0.0; 6], vec![0, 3], Shape::vector(3)).unwrap();
        assert!(matches!(data.to_device(&Device::Cuda(0), 3), Err(Error::Label { index: 1, label: 3, classes: 3 })));
        assert!(matches!(data.to_device(&Device::Cpu, 4), Err(Error::Config(_))));
        let empty = Dataset::new(Vec::new(), Vec::new(), Shape::vector(3)).unwrap();
        assert!(matches!(empty.to_device(&Device::Cuda(0), 4), Err(Error::Config(_))));
        let model = Chain::new(Shape::vector(3)).dense(4, Identity).build().unwrap();
        let cache = model.preallocate(2).unwrap();
        let streaming = StreamingLoader::new(Loader::new(2, 2, 0, false).unwrap(), &cache);
        assert!(matches!(streaming, Err(Error::Config(_))), "a CPU cache cannot be streamed to");
    }
}
