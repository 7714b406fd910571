//! One replica of a data-parallel group: a model on one GPU with its cache, gradients,
//! optimiser and NCCL communicator, the step it runs, and the host's bounded waits for it.

use crate::cache::{Cache, Grads};
use crate::cuda::nccl::{grouped, Comm};
use crate::cuda::pinned::Event;
use crate::dev::DevModel;
use crate::error::{Error, Result};
use crate::loss::Loss;
use crate::model::Model;
use crate::optim::{Optim, Optimizer};
use std::time::{Duration, Instant};

/// Steps a replica's host may queue ahead of its device: before step k is queued, step
/// k − DEPTH must be done. A group whose peer died then stops within a timeout, instead of
/// queueing until the driver's queue is full and the host blocks in a launch.
pub(crate) const DEPTH: usize = 4;

/// Fields drop in this order: the graphs (in `grads`) before the communicator they use.
pub(crate) struct Replica {
    pub model: Model,
    pub cache: Cache,
    pub grads: Grads,
    pub opt: Optimizer,
    pub comm: Comm,
    /// `done[k % DEPTH]` marks the end of step k.
    done: [Event; DEPTH],
    /// Marks the end of the work queued when the host last waited for all of it.
    idle: Event,
}

impl Replica {
    /// `model`'s parameters on CUDA device `ordinal`, with a cache and gradients for batches
    /// of up to `capacity` and `optim`'s state; `comm` comes later ([`Replica::join`]).
    pub(crate) fn build(model: &Model, ordinal: usize, capacity: usize, optim: Optim) -> Result<(Model, Cache, Grads, Optimizer)> {
        let model = model.to(&crate::Device::Cuda(ordinal))?;
        let (cache, grads) = (model.preallocate(capacity)?, model.preallocate_grads(capacity)?);
        let opt = Optimizer::new(&model, optim)?;
        Ok((model, cache, grads, opt))
    }

    /// The replica of `parts` in the group of `comm`.
    pub(crate) fn join(parts: (Model, Cache, Grads, Optimizer), comm: Comm) -> Result<Replica> {
        let (mut model, cache, grads, opt) = parts;
        // each GPU's share of the batch draws dropout masks of its own (src/layers/dropout.rs)
        let (replica, seed, passes) = (comm.rank_in_group() as u32, model.seed, model.train_passes());
        model.dev.as_mut().expect("a replica lives on a GPU").set_replica(replica, seed, passes)?;
        let gpu = &dev(&model).gpu;
        let event = || -> Result<Event> {
            let event = Event::new(gpu)?;
            // the driver's entry point is looked up (allocating) on first use: here, not in a step
            event.done()?;
            Ok(event)
        };
        let (done, idle) = ([event()?, event()?, event()?, event()?], event()?);
        Ok(Replica { model, cache, grads, opt, comm, done, idle })
    }

    /// This replica's rank in the group.
    pub(crate) fn rank(&self) -> usize {
        self.comm.rank_in_group()
    }

    /// Queues one training step on this replica's batch, `share` samples of `global`, the
    /// `step`-th since the group formed; first waits (up to `timeout`) for step
    /// `step` − [`DEPTH`].
    pub(crate) fn step(&mut self, loss: Loss, global: usize, step: u64, timeout: Duration) -> Result<()> {
        let slot = (step % DEPTH as u64) as usize;
        if step >= DEPTH as u64 {
            self.wait(&self.done[slot], timeout)?;
        }
        let share = self.cache.batch();
        if !self.comm.has_reduce(share, global) {
            // a batch shape not seen yet: the step may measure convolutions for it, which
            // waits for this replica's stream without bound; wait for it here first, bounded
            self.synchronize(timeout)?;
        }
        let reduce = self.comm.reduce_for(share, global)?;
        self.opt.train_step_with(&mut self.model, &mut self.grads, &mut self.cache, loss, Some(reduce))?;
        self.done[slot].record(&dev(&self.model).stream)
    }

    /// Waits, up to `timeout`, until step `step` is done (for a step older than the last
    /// [`DEPTH`] queued, until a later one is).
    pub(crate) fn wait_for_step(&self, step: u64, timeout: Duration) -> Result<()> {
        self.wait(&self.done[(step % DEPTH as u64) as usize], timeout)
    }

    /// Fails the other replicas' waits for this one at the step's meeting (this one failed).
    pub(crate) fn abandon(&self) {
        self.comm.abandon_meeting();
    }

    /// Waits, up to `timeout`, until everything queued on this replica is done.
    pub(crate) fn synchronize(&self, timeout: Duration) -> Result<()> {
        self.idle.record(&dev(&self.model).stream)?;
        self.wait(&self.idle, timeout)
    }

    /// Waits until `event` has passed, asking NCCL meanwhile whether the communicator failed:
    /// an error naming the rank on failure or past `timeout` (the caller then aborts).
    fn wait(&self, event: &Event, timeout: Duration) -> Result<()> {
        let (start, mut polls) = (Instant::now(), 0u32);
        // a fault of the device (a peer's memory gone, say) comes back from the event
        let done = || event.done().map_err(|e| Error::Cuda { what: format!("NCCL rank {}: {e}", self.rank()) });
        while !done()? {
            self.comm.check_async()?;
            if start.elapsed() > timeout {
                return Err(Error::Cuda {
                    what: format!("NCCL rank {}: a step did not finish within {timeout:?} (a peer gone or stuck?)", self.rank()),
                });
            }
            polls = polls.saturating_add(1);
            // spin briefly (a step normally ends within microseconds of the wait), then let
            // the core go
            match polls {
                0..=64 => std::hint::spin_loop(),
                65..=1024 => std::thread::yield_now(),
                _ => std::thread::sleep(Duration::from_micros(50)),
            }
        }
        self.comm.check_async()
    }
}

/// The device half of a replica's model (a replica is always on a GPU).
fn dev(model: &Model) -> &DevModel {
    model.dev.as_ref().expect("a replica lives on a GPU")
}

/// Makes the replicas' parameters rank 0's (a broadcast) and runs one reduction on their
/// (zero) gradients, which sets up NCCL's connections before any step graph is captured;
/// then waits for both, up to `timeout`. `replicas` are this process's ranks, driven from this
/// thread as one NCCL group; `global` is the batch whose shares set up the reduction.
pub(crate) fn start(replicas: &mut [Replica], global: usize, world: usize, timeout: Duration) -> Result<()> {
    grouped(|| {
        for r in replicas.iter_mut() {
            let rank = r.rank();
            let share = crate::parallel::share(global, world, rank).len();
            let d = dev(&r.model);
            d.gpu.bind()?;
            r.comm.broadcast(&d.stream, &d.params)?;
            let reduce = r.comm.reduce_for(share, global)?;
            r.grads.dev.as_ref().expect("GPU gradients").queue_reduce(reduce)?;
        }
        Ok(())
    })?;
    replicas.iter().try_for_each(|r| r.synchronize(timeout))
}

/// The time one reduction takes on `replicas` (this process's ranks, driven from this thread
/// as one NCCL group), over `iterations` back to back: the step's (`plain` false: gradients
/// and loss, pre-multiplied by the shares of `global`) or a plain sum of the gradients alone
/// (`plain` true, as NCCL's `all_reduce_perf` times it; the gradients are left meaningless).
pub(crate) fn time_reduction(
    replicas: &mut [Replica],
    global: usize,
    world: usize,
    iterations: usize,
    plain: bool,
    timeout: Duration,
) -> Result<Duration> {
    let queue = |replicas: &mut [Replica]| {
        grouped(|| {
            for r in replicas.iter_mut() {
                let share = crate::parallel::share(global, world, r.rank()).len();
                dev(&r.model).gpu.bind()?;
                let grads = r.grads.dev.as_ref().expect("GPU gradients");
                if plain {
                    grads.queue_sum(&r.comm)?;
                } else {
                    grads.queue_reduce(r.comm.reduce_for(share, global)?)?;
                }
            }
            Ok(())
        })
    };
    // once untimed: NCCL's set-up for this call
    queue(replicas)?;
    replicas.iter().try_for_each(|r| r.synchronize(timeout))?;
    let start = Instant::now();
    for _ in 0..iterations {
        queue(replicas)?;
    }
    replicas.iter().try_for_each(|r| r.synchronize(timeout))?;
    Ok(start.elapsed() / iterations.max(1) as u32)
}
