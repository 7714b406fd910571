//! Data-parallel training over several GPUs, through NCCL.
//!
//! A [`DataParallel`] holds one replica of a model per GPU: its parameters, cache, gradients
//! and optimiser state. A step splits the global batch into contiguous shares, one a replica
//! (the first `batch % world` shares one sample larger than the rest), and each replica runs
//! its step as one CUDA graph: forward, loss and backward on its share, then one NCCL
//! all-reduce (inside the graph) that sums the replicas' gradients, each pre-multiplied by its
//! share of the batch, so that every replica holds the mean gradient over the global batch,
//! exactly as one GPU running the whole batch would (up to the order of the sums); then the
//! update. Every replica gets the same reduced bits and applies the same update to the same
//! parameters (rank 0's, broadcast when the group forms), so the replicas' parameters stay
//! bit-identical. The loss's totals are reduced the same way: [`DataParallel::last_loss`] is
//! the global batch's mean loss.
//!
//! Each replica's own, as in PyTorch's DistributedDataParallel without `SyncBatchNorm`:
//! - dropout's masks: each GPU draws its share's masks with its rank in the counter, so the
//!   masks of the shares are independent, and a run with dropout is not the one-GPU run's equal;
//! - batch norm: a training step normalises each share by that share's own mean and variance
//!   (so a batch-norm model's step is not one GPU's on the whole batch), and each replica's
//!   running statistics move with its own shares alone. Nothing reduces or broadcasts them: the
//!   replicas' parameters stay identical, their running statistics part.
//!   [`DataParallel::parameters`] holds no statistics; [`DataParallel::model`] (and so what one
//!   saves from it) is this process's first replica, with its statistics: in one process
//!   rank 0's, which moved with rank 0's shares alone. That is what DDP keeps on rank 0 by
//!   default (it broadcasts rank 0's buffers to the others before every forward, so rank 0's
//!   own move with its shares alone too). [`DataParallel::models`] gives every replica's; with
//!   a process a GPU, save from rank 0. tests/multi_gpu.rs checks this.
//!
//! ```no_run
//! use flatnn::prelude::*;
//! # let (images, labels) = (vec![0.0f32; 1024 * 784], vec![0u32; 1024]);
//! let model = flatnn::models::mlp().build()?.init(Init::HeNormal, 1);
//! // one process driving two GPUs: batches of up to 1024 samples, 512 a GPU
//! let mut dp = DataParallel::new(&model, &[Device::Cuda(0), Device::Cuda(1)], 1024, Optim::adam(1e-3))?;
//! dp.configure(|opt| opt.set_schedule(Schedule::cosine(100, 10_000)))?;
//! dp.set_inputs(&images)?;                       // the global batch, split over the GPUs
//! dp.set_labels(&labels)?;
//! dp.train_step(Loss::LogitCrossEntropy)?;       // queued; one graph a GPU
//! let loss = dp.last_loss()?;                    // the global batch's mean loss
//! dp.model().save("mlp.safetensors")?;           // every replica holds the same parameters
//! # Ok::<(), flatnn::Error>(())
//! ```
//!
//! One process a GPU, on one host or several: start the program once per GPU with `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` set (as `torchrun` sets them),
//! and make the group with [`DataParallel::from_env`]. Rank 0 makes NCCL's unique id and serves
//! it over TCP at `MASTER_ADDR:MASTER_PORT`; the others connect to it. Every process passes the
//! same global batch to `set_inputs` (each keeps its own share), or fills its replica's cache
//! itself ([`DataParallel::caches_mut`], e.g. with [`crate::data::Loader::next_device_batch`]
//! on that process's shard of the data).
//!
//! Feeding each replica's cache directly: in one process, the shares may differ (the weights
//! are the shares over their sum); across processes a rank knows only its own share, so the
//! shares must be equal there (each share's gradient then counts 1/world).
//!
//! Errors, not hangs: the host queues at most a few steps ahead of each GPU; every wait for a
//! GPU (before a step, before a batch is written, and in `last_loss`, `synchronize` and the
//! like) asks NCCL whether the group failed and gives up after [`Group::timeout`] (5 minutes
//! unless set). A failure or a timeout aborts the group's communicators (waiting at most a
//! few seconds for NCCL's abort) and is an [`Error::Cuda`] naming the rank; the group is then
//! unusable (every later call is an error). The group forming is bounded the
//! same way: a rank that never comes, or one with another `WORLD_SIZE`, is an error on every
//! rank that came.
//!
//! NCCL is loaded at run time (`libnccl.so.2`); without it a group is an [`Error::Cuda`]
//! saying so, and nothing else in flatnn changes. NVLink multicast is left as the machine sets
//! it (`NCCL_NVLS_ENABLE`).
//!
//! This type exists with the `cuda` feature (on by default).

mod replica;
mod workers;

pub use crate::cuda::rendezvous::Group;

use crate::cache::{check_finite, check_labels, Cache};
use crate::cuda::nccl::{self, Comm, UniqueId};
use crate::cuda::rendezvous;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::loss::Loss;
use crate::model::Model;
use crate::optim::{Optim, Optimizer};
use replica::Replica;
use std::ops::Range;
use std::time::{Duration, Instant};
use workers::Workers;

/// A model trained on several GPUs at once: a replica per GPU, the gradients averaged over
/// the global batch by NCCL inside each step's graph. See the [module](self) documentation.
pub struct DataParallel {
    /// This process's replicas, by rank.
    replicas: Vec<Replica>,
    workers: Workers,
    world: usize,
    /// Whether every rank is in this process.
    all_local: bool,
    /// The global batch last given to `set_inputs`; None once the caches were handed out.
    global: Option<usize>,
    /// The global batch capacity.
    capacity: usize,
    /// Steps queued since the group formed.
    steps: u64,
    timeout: Duration,
    /// Why the group failed, once it has.
    failed: Option<String>,
}

/// The contiguous share of a batch of `batch` samples that rank `rank` of `world` takes: the
/// first `batch % world` ranks one sample more than the others.
pub(crate) fn share(batch: usize, world: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (batch / world, batch % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

impl DataParallel {
    /// One replica of `model` on each of `devices` (distinct CUDA devices of this machine),
    /// all driven by this process, for global batches of up to `capacity` samples (each
    /// replica's cache holds its share, `capacity / devices` rounded up), each with an
    /// optimiser `optim` of its own. The model itself is left as it is (on any device).
    pub fn new(model: &Model, devices: &[Device], capacity: usize, optim: Optim) -> Result<DataParallel> {
        let mut ordinals = Vec::with_capacity(devices.len());
        for device in devices {
            match *device {
                Device::Cuda(o) if !ordinals.contains(&o) => ordinals.push(o),
                Device::Cuda(o) => return Err(Error::Config(format!("cuda:{o} is listed twice: a replica a GPU"))),
                Device::Cpu => return Err(Error::Config("data-parallel training runs on CUDA devices only".into())),
            }
        }
        let world = ordinals.len();
        check_capacity(capacity, world)?;
        nccl::nccl_version()?;
        let per_replica = capacity.div_ceil(world);
        let parts = ordinals.iter().map(|&o| Replica::build(model, o, per_replica, optim)).collect::<Result<Vec<_>>>()?;
        let timeout = Group::TIMEOUT;
        let comms = Comm::all(&ordinals, timeout)?;
        let replicas = parts.into_iter().zip(comms).map(|(parts, comm)| Replica::join(parts, comm)).collect::<Result<Vec<_>>>()?;
        DataParallel::start(replicas, world, capacity, timeout)
    }

    /// This process's replica in a group of processes, one a GPU, on one host or several, as
    /// the environment describes it ([`Group::from_env`]: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `MASTER_ADDR`, `MASTER_PORT`). `capacity` is the global batch's, as for
    /// [`DataParallel::new`]; every process passes the same model (rank 0's parameters are
    /// broadcast to the others) and the same `optim`.
    pub fn from_env(model: &Model, capacity: usize, optim: Optim) -> Result<DataParallel> {
        DataParallel::join(model, &Group::from_env()?, capacity, optim)
    }

    /// As [`DataParallel::from_env`], for a group described otherwise (or with another
    /// timeout): this process is `group.rank`, on CUDA device `group.local_rank`.
    pub fn join(model: &Model, group: &Group, capacity: usize, optim: Optim) -> Result<DataParallel> {
        if group.world == 0 || group.rank >= group.world {
            return Err(Error::Config(format!("rank {} is not a rank of a group of {}", group.rank, group.world)));
        }
        check_capacity(capacity, group.world)?;
        nccl::nccl_version()?;
        // an error naming what is missing, if the device cannot be used
        Device::cuda(group.local_rank)?;
        let parts = Replica::build(model, group.local_rank, capacity.div_ceil(group.world), optim)?;
        let gpu = std::sync::Arc::clone(&parts.0.dev.as_ref().expect("a replica lives on a GPU").gpu);
        // the replica is built first (kernels compiled, memory had), so the group's
        // initialisation waits on no rank's set-up
        let id = match group.rank {
            0 => {
                let id = nccl::unique_id()?;
                rendezvous::serve(group, &id.0)?;
                id
            }
            _ => UniqueId(rendezvous::fetch(group)?),
        };
        let comm = Comm::rank(&gpu, id, group.rank, group.world, group.timeout)?;
        DataParallel::start(vec![Replica::join(parts, comm)?], group.world, capacity, group.timeout)
    }

    /// The group, its replicas' parameters made rank 0's and NCCL's connections set up.
    fn start(replicas: Vec<Replica>, world: usize, capacity: usize, timeout: Duration) -> Result<DataParallel> {
        let workers = Workers::new(replicas.len() - 1)?;
        let all_local = replicas.len() == world;
        let mut dp = DataParallel { replicas, workers, world, all_local, global: None, capacity, steps: 0, timeout, failed: None };
        if let Err(e) = replica::start(&mut dp.replicas, capacity, world, timeout) {
            return Err(dp.fail(e));
        }
        Ok(dp)
    }

    /// GPUs (ranks) in the group, in every process.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The ranks of this process's replicas.
    pub fn ranks(&self) -> Range<usize> {
        let first = self.replicas[0].rank();
        first..first + self.replicas.len()
    }

    /// The largest global batch.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Copies a global batch of inputs (`batch × input length`, sample-major) into the
    /// replicas' caches, each its share; `batch` must be at least the world size. A NaN or
    /// infinite value is an [`Error::NonFinite`] (nothing is written).
    pub fn set_inputs(&mut self, inputs: &[f32]) -> Result<()> {
        self.usable()?;
        let per_sample = self.replicas[0].model.input_shape().len();
        let batch = self.batch_of(inputs.len(), per_sample, "input values")?;
        check_finite(inputs, "inputs")?;
        self.staging_free()?;
        for r in &mut self.replicas {
            let s = share(batch, self.world, r.rank());
            r.cache.inputs_mut(s.len())?.copy_from_slice(&inputs[s.start * per_sample..s.end * per_sample]);
            r.cache.inputs_finite = true;
        }
        self.global = Some(batch);
        Ok(())
    }

    /// Sets the global batch's class labels, each replica its share (as for `set_inputs`).
    pub fn set_labels(&mut self, labels: &[u32]) -> Result<()> {
        self.usable()?;
        let batch = self.batch_of(labels.len(), 1, "labels")?;
        check_labels(labels, self.replicas[0].model.output_shape().len())?;
        for r in &mut self.replicas {
            r.cache.set_labels(&labels[share(batch, self.world, r.rank())])?;
        }
        Ok(())
    }

    /// Sets the global batch's real-valued targets (`batch × outputs`), each replica its share.
    pub fn set_targets(&mut self, targets: &[f32]) -> Result<()> {
        self.usable()?;
        let outputs = self.replicas[0].model.output_shape().len();
        let batch = self.batch_of(targets.len(), outputs, "target values")?;
        check_finite(targets, "targets")?;
        for r in &mut self.replicas {
            let s = share(batch, self.world, r.rank());
            r.cache.set_targets(&targets[s.start * outputs..s.end * outputs])?;
        }
        Ok(())
    }

    /// This process's replicas' caches, by rank, to fill directly (a loader per replica):
    /// the next step trains on whatever batches they hold. See the module documentation on
    /// the shares. Waits (bounded) for the step before last, as `set_inputs` does.
    pub fn caches_mut(&mut self) -> Result<impl Iterator<Item = &mut Cache> + '_> {
        self.usable()?;
        self.staging_free()?;
        self.global = None;
        Ok(self.replicas.iter_mut().map(|r| &mut r.cache))
    }

    /// Waits, bounded, until every replica's step before last is done. A cache takes a batch
    /// from the host through two page-locked buffers in turn, and writing one waits (without
    /// bound, in the driver) for the step that last read it, the step before last at the
    /// latest: so that a peer gone never hangs the host there, that step is waited for here
    /// first, as every other wait for a GPU is (usually it ended long ago).
    fn staging_free(&mut self) -> Result<()> {
        let Some(step) = self.steps.checked_sub(2) else { return Ok(()) };
        let timeout = self.timeout;
        match self.replicas.iter().try_for_each(|r| r.wait_for_step(step, timeout)) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// One training step of every replica on its share, queued: forward, loss, backward, the
    /// gradients and the loss reduced over the group, the update; on each GPU one CUDA graph.
    /// The host goes on at once, unless it is [`DataParallel`]'s few steps ahead of a GPU.
    /// Allocates nothing (after the first step of each batch size).
    pub fn train_step(&mut self, loss: Loss) -> Result<()> {
        self.usable()?;
        for r in &self.replicas {
            r.model.check_backprop(&r.grads, &r.cache, loss)?;
        }
        let global = match self.global {
            Some(batch) => batch,
            None if self.all_local => self.replicas.iter().map(|r| r.cache.batch()).sum(),
            None => self.replicas[0].cache.batch() * self.world,
        };
        debug_assert!(self.global.is_none() || self.replicas.iter().all(|r| r.cache.batch() == share(global, self.world, r.rank()).len()));
        match self.workers.step(&mut self.replicas, loss, global, self.steps, self.timeout) {
            Ok(()) => {
                self.steps += 1;
                Ok(())
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Waits until every step queued on this process's replicas is done (bounded: see the
    /// module documentation).
    pub fn synchronize(&mut self) -> Result<()> {
        self.usable()?;
        let (replicas, timeout) = (&self.replicas, self.timeout);
        match replicas.iter().try_for_each(|r| r.synchronize(timeout)) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// The global batch's mean loss at the last step (NaN before the first); waits for it.
    pub fn last_loss(&mut self) -> Result<f32> {
        self.synchronize()?;
        self.replicas[0].grads.last_loss()
    }

    /// The mean of the steps' losses since the last call (as [`crate::Grads::mean_loss`]);
    /// waits for them.
    pub fn mean_loss(&mut self) -> Result<f32> {
        self.synchronize()?;
        let mean = self.replicas[0].grads.mean_loss()?;
        for r in &mut self.replicas[1..] {
            r.grads.mean_loss()?;
        }
        Ok(mean)
    }

    /// Whether a step's loss since the last `mean_loss` was NaN or infinite (as
    /// [`crate::Grads::diverged`]); waits for the steps.
    pub fn diverged(&mut self) -> Result<bool> {
        self.synchronize()?;
        self.replicas[0].grads.diverged()
    }

    /// The last step's gradients, averaged over the global batch by the reduction (before
    /// any clipping, which the update applies): every replica's, copied to the host after the
    /// queued steps.
    pub fn gradients(&mut self) -> Result<Vec<f32>> {
        self.synchronize()?;
        Ok(self.replicas[0].grads.gradients()?.into_owned())
    }

    /// The parameters (every replica's), copied to the host after the queued steps; no buffer
    /// (batch norm's running statistics are each replica's: [`DataParallel::models`]).
    pub fn parameters(&mut self) -> Result<Vec<f32>> {
        self.synchronize()?;
        Ok(self.replicas[0].model.parameters()?.into_owned())
    }

    /// This process's first replica's model, with that replica's batch norm running statistics
    /// (rank 0's where this process holds rank 0; see the module documentation): to save,
    /// evaluate or read. Its methods that wait for the GPU do so without the group's
    /// timeout: call [`DataParallel::synchronize`] first.
    pub fn model(&self) -> &Model {
        &self.replicas[0].model
    }

    /// Every replica's model in this process, by rank: the same parameters, each with its own
    /// running statistics.
    pub fn models(&self) -> impl Iterator<Item = &Model> + '_ {
        self.replicas.iter().map(|r| &r.model)
    }

    /// The first replica's optimiser (steps taken, learning rate, gradient norm).
    pub fn optimizer(&self) -> &Optimizer {
        &self.replicas[0].opt
    }

    /// Applies `change` to every replica's optimiser (a schedule, clipping, a learning rate,
    /// a checkpoint's state), so that they stay the same.
    pub fn configure(&mut self, mut change: impl FnMut(&mut Optimizer) -> Result<()>) -> Result<()> {
        self.replicas.iter_mut().try_for_each(|r| change(&mut r.opt))
    }

    /// Measures the group's reduction alone, `iterations` times back to back on every replica
    /// of this process (every process of a group must call it alike): the time of the step's
    /// reduction (the gradients and the loss, as a step of a global batch of the capacity
    /// runs it) and of a plain NCCL sum of the same gradients (as NCCL's `all_reduce_perf`
    /// times it), each per call. For benchmarks: it leaves the gradients and the loss totals
    /// meaningless until the next step.
    pub fn time_reduction(&mut self, iterations: usize) -> Result<(Duration, Duration)> {
        self.usable()?;
        let (capacity, world, timeout) = (self.capacity, self.world, self.timeout);
        let times = replica::time_reduction(&mut self.replicas, capacity, world, iterations, false, timeout)
            .and_then(|step| Ok((step, replica::time_reduction(&mut self.replicas, capacity, world, iterations, true, timeout)?)));
        times.map_err(|e| self.fail(e))
    }

    /// An error if the group failed earlier.
    fn usable(&self) -> Result<()> {
        match &self.failed {
            None => Ok(()),
            Some(why) => Err(Error::Cuda { what: format!("this data-parallel group failed earlier and is unusable: {why}") }),
        }
    }

    /// The global batch that `len` values of `per_sample` make, checked against the world size
    /// and the capacity.
    fn batch_of(&self, len: usize, per_sample: usize, what: &str) -> Result<usize> {
        if len == 0 || !len.is_multiple_of(per_sample) {
            return Err(Error::Shape(format!("{len} {what} is not a whole, non-zero number of samples of {per_sample}")));
        }
        let batch = len / per_sample;
        if batch > self.capacity {
            return Err(Error::Capacity { batch, capacity: self.capacity });
        }
        if batch < self.world {
            return Err(Error::Shape(format!("a global batch of {batch} cannot give each of {} GPUs a sample", self.world)));
        }
        Ok(batch)
    }

    /// Aborts the group after `e` (its communicators, so that no kernel waits for a peer
    /// forever) and remembers why; gives `e` back. The aborts are waited for up to
    /// [`ABORT_WAIT`] (or the group's timeout, if shorter); where one has not returned by then,
    /// `e`, if a CUDA error, says so.
    fn fail(&mut self, e: Error) -> Error {
        let aborts: Vec<_> = self.replicas.iter_mut().filter_map(|r| r.comm.abort()).collect();
        let wait = self.timeout.min(ABORT_WAIT);
        let deadline = Instant::now() + wait;
        let stuck = aborts.iter().filter(|a| !a.returned_by(deadline)).count();
        let e = match e {
            Error::Cuda { what } if stuck > 0 => Error::Cuda {
                what: format!(
                    "{what}; NCCL's abort of {stuck} communicator(s) did not return within {wait:?} (it may wait for a peer \
                     that is gone): it is left to NCCL, and this process should exit"
                ),
            },
            e => e,
        };
        self.failed.get_or_insert_with(|| e.to_string());
        e
    }
}

/// How long a failing group waits for NCCL's aborts of its communicators (at most its timeout).
const ABORT_WAIT: Duration = Duration::from_secs(5);

fn check_capacity(capacity: usize, world: usize) -> Result<()> {
    if world == 0 || capacity < world {
        return Err(Error::Config(format!("a global batch capacity of {capacity} cannot give each of {world} GPUs a sample")));
    }
    Ok(())
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        self.workers.stop();
        if self.failed.is_none() {
            let _ = self.synchronize();
        }
        if self.replicas.iter().any(|r| r.comm.aborted()) {
            // An aborted communicator is freed, and the graphs that used it would reach it when
            // destroyed: the replicas (their graphs, streams and memory) are left to the process.
            std::mem::forget(std::mem::take(&mut self.replicas));
        }
    }
}

/// A replica is used from the thread that runs its step.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Replica>();
    send::<DataParallel>();
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_batch_in_order_and_differ_by_at_most_one() {
        for world in 1..=9 {
            for batch in world..=60 {
                let shares: Vec<_> = (0..world).map(|r| share(batch, world, r)).collect();
                assert_eq!(shares[0].start, 0);
                assert_eq!(shares[world - 1].end, batch);
                for pair in shares.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start);
                    assert!(pair[0].len() >= pair[1].len(), "later shares are never larger");
                }
                let (min, max) = (shares.iter().map(Range::len).min().unwrap(), shares.iter().map(Range::len).max().unwrap());
                assert!(min >= 1 && max - min <= 1 && max == batch.div_ceil(world), "{batch} over {world}: {shares:?}");
            }
        }
    }

    #[test]
    fn a_group_needs_cuda_devices_each_once_and_a_sample_a_gpu() {
        let model = crate::Chain::new(crate::Input::vector(2)).dense(2, crate::Identity).build().unwrap();
        let err = |devices: &[Device], capacity| DataParallel::new(&model, devices, capacity, Optim::sgd(0.1, 0.0)).err().unwrap();
        assert!(matches!(err(&[Device::Cpu], 8), Error::Config(m) if m.contains("CUDA devices only")));
        assert!(matches!(err(&[Device::Cuda(0), Device::Cuda(0)], 8), Error::Config(m) if m.contains("listed twice")));
        assert!(matches!(err(&[], 8), Error::Config(m) if m.contains("0 GPUs")));
        assert!(matches!(err(&[Device::Cuda(0), Device::Cuda(1)], 1), Error::Config(m) if m.contains("capacity of 1")));
    }

    #[test]
    fn without_nccl_a_group_is_an_error_that_says_so() {
        if nccl::nccl_version().is_ok() {
            // NCCL loads here: the GPU tests (tests/multi_gpu.rs) cover the group
            return;
        }
        let model = crate::Chain::new(crate::Input::vector(2)).dense(2, crate::Identity).build().unwrap();
        let err = DataParallel::new(&model, &[Device::Cuda(0), Device::Cuda(1)], 8, Optim::sgd(0.1, 0.0)).err().unwrap();
        assert!(matches!(&err, Error::Cuda { what } if what.contains("libnccl not found") && what.contains("LD_LIBRARY_PATH")), "{err}");
    }
}
