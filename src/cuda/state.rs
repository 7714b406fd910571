//! The GPU half of a model and the steps that run on it (the halves of its caches, gradients
//! and optimiser are in src/cuda/caches.rs).
//!
//! A model on a GPU owns one stream; everything it runs (forward, backprop, the optimiser
//! update) is queued there, in order, so a training loop never waits for the device. (Inside a
//! backward pass, dense weight gradients, but the first layer's, fork to a second stream of the
//! model, and the loss of a step with a head (src/cuda/head.rs) is summed on a third; both join
//! back before the pass ends, so the order seen from outside is the same.) Caches,
//! gradient buffers and optimiser state are device memory that any model of the same plan on
//! the same device may use: the first use by another model waits for the previous one's stream.
//! The host waits only where a value comes back: `forward`'s outputs, the loss when asked for,
//! parameters when downloaded; and at the first call of a batch size bucket, whose routes are
//! measured then (src/cuda/routes.rs and dnn.rs).

use super::buffer::DevBuf;
pub(crate) use super::caches::{DevCache, DevGrads, DevOptim};
use super::context::Gpu;
use super::dnn::StepRun;
use super::driver_error;
use super::exec::{self, Backward, Forward, LossBuffers, Side};
use super::graph::Key;
use super::head::Head;
use super::launch::ViewMut;
use super::layers;
pub(crate) use super::nccl::Reduce;
use super::ops::{loss_key, optim_kernel, LaunchArgs, FINISH_MAX};
pub use super::options::{Convs, GpuOptions, RnnAlgos, Tuning};
use super::pinned::Pinned;
use super::routes::Routes;
use super::saved::Saved;
pub(crate) use super::serve::DevServer;
use super::timing::time_steps;
use crate::cache::{Cache, Grads};
use crate::chain::Plan;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::layers::{dropout, Draw, Mode};
use crate::loss::Loss;
use crate::optim::{Clip, Update};
use cudarc::driver::{result, sys, CudaStream};
use std::sync::Arc;

/// A model's parameters on a device, and the stream its work runs on.
pub(crate) struct DevModel {
    pub gpu: Arc<Gpu>,
    pub stream: Arc<CudaStream>,
    /// A second stream, on which the backward pass computes weight gradients (but the first
    /// layer's) while the input gradients go on (forked from and joined back into `stream`
    /// inside each step).
    side: Arc<CudaStream>,
    /// A third, on which a step with a head (src/cuda/head.rs) sums the loss's terms beside the
    /// weight gradients (forked after the head, joined back before the update).
    loss_side: Arc<CudaStream>,
    pub params: DevBuf<f32>,
    /// The model's buffers (running statistics and the like), where its plan has any.
    buffers: Option<DevBuf<f32>>,
    /// Where dropout draws its masks: the seed and the count of training passes, two words
    /// each, low first, then the replica's number ([`draw_words`]); a training step of a plan
    /// with dropout moves the count on, on the device (the host's count, `Model::passes`,
    /// follows as it queues the steps).
    draw: DevBuf<u32>,
    /// The replica's number dropout draws with: 0, or this GPU's rank in data-parallel training.
    replica: u32,
    pub options: GpuOptions,
}

/// Makes `bound` the model's stream, after the work queued on the one it held.
fn rebind(bound: &mut Arc<CudaStream>, stream: &Arc<CudaStream>) -> Result<()> {
    if !Arc::ptr_eq(bound, stream) {
        bound.synchronize().map_err(|e| driver_error("waiting for another model's stream", e))?;
        *bound = Arc::clone(stream);
    }
    Ok(())
}

impl DevModel {
    /// `params`, `buffers` and `draw` copied to device `gpu`, with new streams (no buffer
    /// allocated for a model without buffers).
    pub fn new(gpu: &Arc<Gpu>, params: &[f32], buffers: &[f32], draw: Draw, options: GpuOptions) -> Result<DevModel> {
        let (stream, side, loss_side) = (gpu.new_stream()?, gpu.new_stream()?, gpu.new_stream()?);
        let params = DevBuf::from_host(gpu, &stream, params)?;
        let buffers = (!buffers.is_empty()).then(|| DevBuf::from_host(gpu, &stream, buffers)).transpose()?;
        let draw = DevBuf::from_host(gpu, &stream, &draw_words(draw))?;
        Ok(DevModel { gpu: Arc::clone(gpu), stream, side, loss_side, params, buffers, draw, replica: 0, options })
    }

    /// Dropout's seed and count of training passes replaced, after every queued step.
    pub fn set_draw(&mut self, seed: u64, passes: u64) -> Result<()> {
        self.draw.upload(&self.stream, &draw_words(Draw { seed, pass: passes, replica: self.replica }))
    }

    /// Dropout's masks drawn as replica `replica`'s (data-parallel training: each GPU's share
    /// of the batch draws its own), after every queued step; `seed` and `passes` as
    /// [`DevModel::set_draw`].
    pub fn set_replica(&mut self, replica: u32, seed: u64, passes: u64) -> Result<()> {
        self.replica = replica;
        self.set_draw(seed, passes)
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.gpu.ordinal())
    }

    /// The parameters, copied to the host after every queued step.
    pub fn download(&self, out: &mut [f32]) -> Result<()> {
        self.params.download(&self.stream, out)
    }

    /// The parameters replaced by `values`, after every queued step.
    pub fn upload(&mut self, values: &[f32]) -> Result<()> {
        self.params.upload(&self.stream, values)
    }

    /// The buffers, copied to the host after every queued step.
    pub fn download_buffers(&self, out: &mut [f32]) -> Result<()> {
        match &self.buffers {
            Some(buffers) => buffers.download(&self.stream, out),
            None => {
                debug_assert!(out.is_empty());
                Ok(())
            }
        }
    }

    /// The buffers replaced by `values`, after every queued step.
    pub fn upload_buffers(&mut self, values: &[f32]) -> Result<()> {
        match &mut self.buffers {
            Some(buffers) => buffers.upload(&self.stream, values),
            None => {
                debug_assert!(values.is_empty());
                Ok(())
            }
        }
    }

    /// `params`, `buffers` and `draw` on CUDA device `ordinal`.
    pub fn on(ordinal: usize, params: &[f32], buffers: &[f32], draw: Draw, options: GpuOptions) -> Result<DevModel> {
        DevModel::new(&super::gpu(ordinal)?, params, buffers, draw, options)
    }

    /// The model's buffers and draw, as a graph that reads or writes them bakes them in.
    fn state_ptrs(&self) -> [sys::CUdeviceptr; 2] {
        [self.buffers.as_ref().map_or(0, DevBuf::ptr), self.draw.ptr()]
    }

    /// The resident kernel's buffers for calls of up to `capacity` samples, or None where this
    /// model cannot be served that way.
    pub fn server(&self, plan: &Plan, capacity: usize) -> Result<Option<DevServer>> {
        super::serve::fits(&self.gpu, plan, capacity).then(|| DevServer::new(self, plan, capacity)).transpose()
    }

    /// The device half of a cache for `capacity` samples.
    pub fn new_cache(&self, plan: &Plan, capacity: usize) -> Result<DevCache> {
        DevCache::new(&self.gpu, &self.stream, self.options, plan, capacity)
    }

    /// The device half of gradient buffers for `capacity` samples.
    pub fn new_grads(&self, plan: &Plan, capacity: usize) -> Result<DevGrads> {
        DevGrads::new(&self.gpu, &self.stream, &self.side, self.options.tf32, plan, capacity)
    }

    /// The device half of an optimiser's state, `values` copied.
    pub fn new_optim(&self, values: &[f32]) -> Result<DevOptim> {
        DevOptim::new(&self.gpu, &self.stream, values)
    }

    /// Queues the copies of the labels or targets the host changed in the cache since the last
    /// step (new inputs are copied inside the step's graph: see `forward` and `backprop`).
    fn upload_batch(&self, plan: &Plan, cache: &mut Cache) -> Result<()> {
        let dev = cache.dev.as_mut().expect("a GPU cache");
        rebind(&mut dev.stream, &self.stream)?;
        dev.blas.rebind(&self.stream, self.options.tf32)?;
        dev.dnn.rebind(&self.stream)?;
        let stream = self.stream.cu_stream();
        let copy = |dst: u64, src: &[u8]| -> Result<()> {
            // SAFETY: `dst` holds at least `src.len()` bytes (each buffer is sized for the
            // capacity); a copy from pageable memory (labels, targets: a few bytes a sample) is
            // staged before this returns, so the host buffer may change right after.
            unsafe { result::memcpy_htod_async(dst, src, stream) }.map_err(|e| driver_error("copying a batch to the device", e))
        };
        if std::mem::take(&mut cache.labels_dirty) {
            copy(dev.labels.ptr(), as_bytes(&cache.labels[..cache.labels_set]))?;
        }
        if std::mem::take(&mut cache.targets_dirty) {
            copy(dev.targets.ptr(), as_bytes(&cache.targets[..cache.targets_set * plan.output().len()]))?;
        }
        Ok(())
    }

    /// Forward on the cache's batch, then the outputs copied back (the host waits for them).
    /// The copy of new inputs from the page-locked staging buffer (by a kernel reading it over
    /// the bus: in a graph a copy node costs more than a kernel node), the layers and the copy of
    /// the outputs to page-locked memory are one graph: one launch and one wait per call.
    /// Outputs of at most [`FINISH_MAX`] values are written to the host by a kernel that then
    /// sets a page-locked flag, which the host spins on (it sees them sooner than a stream wait
    /// does: `example launch_floor`); larger ones by the copy engine and a stream wait.
    pub fn forward<'c>(&self, plan: &Plan, cache: &'c mut Cache) -> Result<&'c [f32]> {
        // cleared once the copy is queued: after an error the next call copies the inputs again
        let copy_in = cache.inputs_dirty;
        self.upload_batch(plan, cache)?;
        let (capacity, batch) = (cache.capacity, cache.batch);
        let last = plan.steps.last().expect("a plan has steps").output_region;
        let out = crate::layers::region(plan, last, capacity, batch);
        let DevCache { graphs, outputs, staging, acts, cols, blas, dnn, routes, current, done, counter, signals, .. } =
            cache.dev.as_mut().expect("a GPU cache");
        let inputs = copy_in.then(|| &staging[*current].as_slice()[..batch * plan.input.len()]);
        let from = inputs.map_or(0, |s| s.as_ptr() as u64);
        let key = Key {
            kind: if copy_in { 3 } else { 0 },
            loss_param: 0,
            capacity,
            batch,
            tf32: self.options.tf32,
            deterministic: self.options.deterministic,
            cache: dnn.id(),
            buffers: [self.params.ptr(), acts.ptr(), cols.ptr(), from],
            model: self.state_ptrs(),
            update: None,
            reduce: 0,
        };
        let (buffers, draw) = (self.buffers.as_ref(), &self.draw);
        let f = Forward { params: &self.params, acts, cols, capacity, batch, dnn: None, routes: None, buffers, draw };
        let (gpu, stream) = (&self.gpu, &self.stream);
        let run = StepRun { gpu, blas, stream, plan, f: &f, b: None, options: self.options };
        dnn.prepare(&run)?;
        routes.prepare(&run)?;
        let f = Forward { dnn: Some(dnn), routes: Some(routes), ..f };
        let signal = out.len() <= FINISH_MAX;
        let (host_out_device, flag) = (outputs.device_ptr(), done.device_ptr());
        let host_out = &mut outputs.as_mut_slice()[..out.len()];
        let inputs_device = staging[*current].device_ptr();
        let outcome = graphs.run(self.options.graphs, stream, key, || {
            if let Some(inputs) = inputs {
                // the host does not write the staging buffer before the wait below
                copy_inputs_in(gpu, stream, f.acts, inputs.len(), inputs_device)?;
            }
            exec::forward(gpu, blas, stream, plan, &f, inputs.is_some(), plan.steps.len(), Mode::Infer)?;
            let outputs = f.acts.view(out.clone());
            if signal {
                return gpu.finish_outputs(stream, out.len(), outputs, host_out_device, counter.all_mut(), flag);
            }
            // SAFETY: the region lies inside `acts`; page-locked memory the host reads only
            // after the wait below.
            unsafe { result::memcpy_dtoh_async(&mut host_out[..], outputs.ptr(), stream.cu_stream()) }
                .map_err(|e| driver_error("copying the outputs to the host", e))
        });
        outcome?;
        cache.inputs_dirty = false;
        if signal {
            *signals = signals.wrapping_add(1);
            wait_for_flag(&self.stream, done, *signals)?;
        } else {
            self.stream.synchronize().map_err(|e| driver_error("waiting for the forward pass", e))?;
        }
        Ok(&outputs.as_slice()[..out.len()])
    }

    /// Forward, loss and backward on the cache's batch, queued (the host does not wait).
    /// New inputs are copied in by the step's graph, as in [`DevModel::forward`]; the staging
    /// buffer they come from is marked in use until the step has run.
    pub fn backprop(&self, plan: &Plan, grads: &mut Grads, cache: &mut Cache, loss: Loss) -> Result<()> {
        self.step(plan, grads, cache, loss, None, None)
    }

    /// [`DevModel::backprop`] and then [`DevModel::update`] as one call, queued: with graphs,
    /// one graph whose last kernel is the update (after the norm's, when clipping by norm), its
    /// arguments (step number, learning rate, clipping) set before each replay. `steps` (the
    /// steps taken) counts this one once its update is queued, even if something after that
    /// fails. With `reduce` (a replica of a data-parallel group), the gradients and the loss
    /// are reduced over the group between the backward pass and the update, in the graph.
    #[allow(clippy::too_many_arguments)]
    pub fn train_step(
        &mut self,
        plan: &Plan,
        grads: &mut Grads,
        cache: &mut Cache,
        loss: Loss,
        update: Update,
        steps: &mut u64,
        opt: &mut DevOptim,
        reduce: Option<&Reduce>,
    ) -> Result<()> {
        rebind(&mut opt.stream, &self.stream)?;
        self.step(plan, grads, cache, loss, Some((update, steps, opt)), reduce)
    }

    /// Backprop, then `reduce` when given, and then the update `(update, steps, optimiser)`
    /// when given (step `*steps + 1`, counted once queued).
    fn step(
        &self,
        plan: &Plan,
        grads: &mut Grads,
        cache: &mut Cache,
        loss: Loss,
        update: Option<(Update, &mut u64, &DevOptim)>,
        reduce: Option<&Reduce>,
    ) -> Result<()> {
        let (update, steps) = match update {
            Some((rule, steps, opt)) => (Some((rule, *steps + 1, opt)), Some(steps)),
            None => (None, None),
        };
        // a model without parameters has nothing to update (and its graph no update kernel)
        let update = update.filter(|_| self.params.len() > 0);
        // cleared once the step is queued: after an error the next step copies the inputs again
        let copy_in = cache.inputs_dirty;
        self.upload_batch(plan, cache)?;
        let (capacity, batch) = (cache.capacity, cache.batch);
        let inputs_len = batch * plan.input.len();
        let (dev, dg) = (cache.dev.as_mut().expect("a GPU cache"), grads.dev.as_mut().expect("GPU gradients"));
        rebind(&mut dg.stream, &self.stream)?;
        // the side stream's last work was joined into the old main stream, waited for above
        dg.side_blas.rebind(&self.side, self.options.tf32)?;
        // which loss (an id below 8), and whether (and from which staging buffer) the inputs are
        // copied in; from 8 up, apart from the forward pass's kinds (0 and 3)
        let (loss_id, loss_param) = loss_key(loss);
        let kind = 8 * (1 + if copy_in { 1 + dev.current as u8 } else { 0 }) + loss_id;
        let (current, inputs_device) = (dev.current, dev.staging[dev.current].device_ptr());
        let key = Key {
            kind,
            loss_param,
            capacity,
            batch,
            tf32: self.options.tf32,
            deterministic: self.options.deterministic,
            cache: dev.dnn.id(),
            buffers: [self.params.ptr(), dev.acts.ptr(), dg.grads.ptr(), dg.dacts.ptr()],
            model: self.state_ptrs(),
            update: update.map(|(rule, _, opt)| (optim_kernel(rule.config), opt.state.ptr(), opt.norm_ptr(rule.clip))),
            reduce: reduce.map_or(0, Reduce::id),
        };
        let (buffers, draw) = (self.buffers.as_ref(), &self.draw);
        let f = Forward { params: &self.params, acts: &dev.acts, cols: &dev.cols, capacity, batch, dnn: None, routes: None, buffers, draw };
        let b = Backward { dacts: &dg.dacts, grads: &dg.grads, dcols: &dg.dcols, partials: &dg.partials, ones: &dg.ones };
        let run = StepRun { gpu: &self.gpu, blas: &dev.blas, stream: &self.stream, plan, f: &f, b: Some(&b), options: self.options };
        dev.dnn.prepare(&run)?;
        dev.routes.prepare(&run)?;
        let f = Forward { dnn: Some(&dev.dnn), ..f };
        let run = StepRun { f: &f, ..run };
        let l = LossBuffers { labels: &dev.labels, targets: &dev.targets, loss: &dg.loss, scratch: &dg.loss_scratch };
        let (gpu, stream) = (&self.gpu, &self.stream);
        let side = Side {
            blas: &dg.side_blas,
            stream: &self.side,
            fork: &dg.fork,
            join: &dg.join,
            loss_stream: &self.loss_side,
            loss_join: &dg.loss_join,
        };
        let (n, params_ptr) = (self.params.len(), self.params.ptr());
        let update_args = |rule: Update, step: u64, opt: &DevOptim, call: &mut LaunchArgs| {
            // SAFETY: the model's parameters and the optimiser's state, whole, for one launch
            // (or one setting of its arguments) queued on the model's stream after everything
            // in the step that reads them; nothing else writes them meanwhile (`&mut` model
            // and optimiser in `Optimizer::train_step`).
            let (p, s) = unsafe { (ViewMut::from_raw(params_ptr, n), ViewMut::from_raw(opt.state.ptr(), opt.state.len())) };
            // the kernels ahead of it in the step write only gradients and the norm: it reads
            // the parameters and its state early
            gpu.optim_call(rule, step, n, p, dg.grads.all(), s, opt.norm.all(), true, |kernel, grid, args| call(kernel, grid, args))
        };
        let function = update.map(|(rule, _, _)| gpu.function(optim_kernel(rule.config)));
        let step_on = |routes: &Routes, copy_in: bool| {
            if copy_in {
                // the host does not write the staging buffer until `copied[current]` has passed
                copy_inputs_in(gpu, stream, f.acts, inputs_len, inputs_device)?;
            }
            let f = Forward { routes: Some(routes), ..f };
            let run = StepRun { f: &f, ..run };
            backprop_pass(&run, &b, &l, &side, loss, copy_in)
        };
        let queue_update = || match update {
            Some((rule, step, opt)) => {
                if let Clip::Norm(_) = rule.clip {
                    opt.queue_norm(gpu, stream, n, &dg.grads)?;
                }
                update_args(rule, step, opt, &mut |kernel, grid, args| gpu.launch_args(stream, kernel, (grid, 1), 0, args))
            }
            None => Ok(()),
        };
        if dev.routes.unchecked() {
            // before the step's first capture, as measuring the routes was
            let head = Head::of(gpu, plan, capacity, batch, loss, &self.options.tuning);
            let in_head = |step: usize| head.as_ref().is_some_and(|h| h.runs(step));
            let (graphs, ordinal) = (self.options.graphs, gpu.ordinal());
            // The steps it times move what outlives a step, put back after them: the running
            // statistics in the buffers, the losses' sum and count, and, where they time the
            // update (as the step runs it: the kernels after the backward pass decide what of
            // its tail overlaps the next step), the parameters, the optimiser's state and the
            // norm. Copies only where a step will be timed; and the update is timed only where
            // its copies (as much memory again as the parameters and the state) can be had and
            // its first timing goes through, so that a step that fits the device does not fail
            // for want of memory for its check (nor does a check that cannot time any step:
            // `check_in_steps` then keeps the routes fastest alone).
            let timing = dev.routes.will_time(plan, loss, graphs, ordinal, &in_head);
            let saved = match timing {
                true => Some(Saved::take(gpu, stream, &Vec::from_iter(&self.buffers), &[&dg.loss])?),
                false => None,
            };
            let saved_update = match (timing, update) {
                (true, Some((_, _, opt))) => Saved::take(gpu, stream, &[&self.params, &opt.state], &[&opt.norm]).ok(),
                _ => None,
            };
            let with_update = std::cell::Cell::new(saved_update.is_some());
            let timed = std::cell::Cell::new(false);
            let time_with = |routes: &Routes, update: bool| {
                time_steps(gpu, stream, graphs, &|| {
                    step_on(routes, false)?;
                    if update {
                        queue_update()
                    } else {
                        Ok(())
                    }
                })
            };
            let time = |routes: &Routes| match saved {
                Some(_) => {
                    let first = !timed.replace(true);
                    match time_with(routes, with_update.get()) {
                        // the first step with the update failed (its graph may find no memory
                        // beside the copies): every step of the check is timed without it
                        Err(_) if first && with_update.get() => {
                            with_update.set(false);
                            time_with(routes, false)
                        }
                        timing => timing,
                    }
                }
                // will_time said that nothing would be timed, and nothing was saved
                None => Err(Error::Cuda { what: "the whole-step check timed a step it had not saved the state of".into() }),
            };
            let checked = dev.routes.check_in_steps(plan, loss, graphs, ordinal, &in_head, &|| with_update.get(), &time);
            let wait = |s: &CudaStream| s.synchronize().map_err(|e| driver_error("waiting for the whole-step check", e));
            // a failed timing may leave work on the side streams that never joined back (the
            // loss's sum writes the losses): done before the losses are put back
            let sides = wait(&self.side).and(wait(&self.loss_side));
            let restored = [&saved, &saved_update].into_iter().flatten().map(|s| s.restore(stream)).fold(Ok(()), Result::and);
            // the copies are done before their sources are freed, whatever failed
            let waited = wait(stream);
            checked?;
            sides?;
            restored?;
            waited?;
        }
        let work = || {
            step_on(&dev.routes, copy_in)?;
            if dropout::any(plan) {
                // the next step draws new masks
                layers::next_pass(gpu, stream, &self.draw)?;
            }
            if let Some(reduce) = reduce {
                // the gradients and the loss summed over the group, each replica's weighted
                // by its share of the batch, before the norm and the update read them
                reduce.queue(stream, &dg.grads, &dg.loss)?;
            }
            queue_update()
        };
        if let Some(reduce) = reduce {
            // the group's replicas capture (or launch) their steps together
            reduce.meet()?;
        }
        let outcome = dg.graphs.run_updating(self.options.graphs, stream, key, function, work, |set| match update {
            Some((rule, step, opt)) => update_args(rule, step, opt, &mut |_, _, args| set(args)),
            None => Ok(()),
        });
        if let Some(steps) = steps.filter(|_| outcome.is_ok()) {
            // the update is queued (a model without parameters takes its steps too)
            *steps += 1;
        }
        if copy_in {
            // Whether or not the step went through, part of it (eager launches) may have been
            // queued and may still read the staging buffer: mark it in use either way.
            dev.pending[current] = true;
            let recorded = dev.copied[current].record(&self.stream);
            outcome?;
            recorded?;
        } else {
            outcome?;
        }
        cache.inputs_dirty = false;
        Ok(())
    }

    /// One optimiser step, queued (after the norm's kernel when clipping by norm): `step` is
    /// the 1-based step number.
    pub fn update(&mut self, update: Update, step: u64, opt: &mut DevOptim, grads: &Grads) -> Result<()> {
        let dg = grads.dev.as_ref().expect("GPU gradients");
        rebind(&mut opt.stream, &self.stream)?;
        if !Arc::ptr_eq(&dg.stream, &self.stream) {
            dg.stream.synchronize().map_err(|e| driver_error("waiting for another model's stream", e))?;
        }
        let n = self.params.len();
        if let Clip::Norm(_) = update.clip {
            opt.queue_norm(&self.gpu, &self.stream, n, &dg.grads)?;
        }
        let DevOptim { state, norm, .. } = opt;
        self.gpu.optim_step(&self.stream, update, step, n, self.params.all_mut(), dg.grads.all(), state.all_mut(), norm.all())
    }
}

/// Queues the copy of `len` input values from the page-locked staging buffer at `from` (its
/// device address) into region 0 of `acts`, by a kernel (see [`Gpu::copy_from_host`]). The
/// caller keeps the staging buffer unwritten until the copy has run.
fn copy_inputs_in(gpu: &Gpu, stream: &CudaStream, acts: &DevBuf<f32>, len: usize, from: sys::CUdeviceptr) -> Result<()> {
    assert!(len <= acts.len(), "more inputs than the activation buffer holds");
    // SAFETY: region 0 of `acts` (its first values) holds the capacity's inputs; nothing else
    // touches it while the copy runs in this stream's order.
    let dst = unsafe { ViewMut::from_raw(acts.ptr(), len) };
    gpu.copy_from_host(stream, len, from, dst)
}

/// Spins until the page-locked `flag` holds `want` (written by the device after the data the
/// caller reads next), asking the stream every so often whether it failed or finished without
/// writing it, so that a fault is an error rather than a hang.
fn wait_for_flag(stream: &CudaStream, flag: &Pinned<u32>, want: u32) -> Result<()> {
    let flag = flag.as_ptr();
    // SAFETY: a live, aligned u32 of page-locked memory, only ever accessed atomically or by
    // the device; the acquire load orders the reads of the outputs after it.
    let holds = || unsafe { std::sync::atomic::AtomicU32::from_ptr(flag.cast_mut()) }.load(std::sync::atomic::Ordering::Acquire);
    spin_until(
        stream,
        "waiting for the forward pass",
        || holds() == want,
        || Err(Error::Cuda { what: format!("the forward pass finished but its flag holds {} instead of {want}", holds()) }),
    )
}

/// Spins until `ready()`, asking `stream` every 1,024 spins whether it failed (an error that
/// says `what` the host was doing) or has nothing left to run while `ready()` is still false:
/// then `finished()` decides (an error, or work queued again and the spin goes on). Past 200 µs
/// the spin lets other threads have the core between spins.
pub(super) fn spin_until(
    stream: &CudaStream,
    what: &str,
    mut ready: impl FnMut() -> bool,
    mut finished: impl FnMut() -> Result<()>,
) -> Result<()> {
    let (mut spins, start, mut long) = (0u32, std::time::Instant::now(), false);
    while !ready() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) {
            long = start.elapsed() > std::time::Duration::from_micros(200);
            // SAFETY: a live stream of the current context.
            match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                sys::CUresult::CUDA_SUCCESS if ready() => break,
                sys::CUresult::CUDA_SUCCESS => finished()?,
                e => return Err(driver_error(what, cudarc::driver::DriverError(e))),
            }
        }
        if long {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    Ok(())
}

/// `draw` as the kernels read it: seed low, seed high, pass low, pass high, replica.
pub(crate) fn draw_words(draw: Draw) -> [u32; 5] {
    [draw.seed as u32, (draw.seed >> 32) as u32, draw.pass as u32, (draw.pass >> 32) as u32, draw.replica]
}

fn as_bytes<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: f32 and u32 have no padding and any byte view of them is valid to read.
    unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) }
}

/// The forward pass, the loss (or the head) and the backward pass of a training step on `r`'s
/// buffers and routes, queued on `r.stream` (the inputs copied in already, `copied_in` says
/// whether by this step: the forward pass then reads them without waiting).
fn backprop_pass(r: &StepRun, b: &Backward, l: &LossBuffers, side: &Side, loss: Loss, copied_in: bool) -> Result<()> {
    let StepRun { gpu, blas, stream, plan, f, options, .. } = *r;
    // the last dense layer, the loss and that layer's input gradient in one kernel where it
    // takes them (src/cuda/head.rs)
    let head = Head::of(gpu, plan, f.capacity, f.batch, loss, &options.tuning);
    let upto = head.map_or(plan.steps.len(), |h| h.first());
    let weights_early = exec::forward(gpu, blas, stream, plan, f, copied_in, upto, Mode::Train)?;
    // the head clears the gradients that split weight gradients add into
    let cleared = head.as_ref().and_then(|_| exec::split_weight_grads(plan, f));
    match &head {
        Some(h) => exec::head(gpu, stream, f, b, l, loss, h, weights_early, cleared.clone())?,
        None => exec::loss(gpu, stream, plan, f, b, l, loss)?,
    }
    exec::backward(gpu, blas, stream, plan, f, b, side, head.as_ref().map(|h| (h, l, loss)), cleared)
}
