//! The device halves of a cache ([`DevCache`]), of gradient buffers ([`DevGrads`]) and of an
//! optimiser's state ([`DevOptim`]): device memory that any model of the same plan on the same
//! device may use (src/cuda/state.rs runs the steps on them).

use super::blas::Blas;
use super::buffer::DevBuf;
use super::context::Gpu;
use super::dnn::Dnn;
use super::driver_error;
use super::graph::Graphs;
use super::launch::ViewMut;
use super::nccl::Reduce;
use super::ops::NORM_SCRATCH;
use super::options::GpuOptions;
use super::pinned::{Event, Pinned};
use super::routes::Routes;
use super::state::DevModel;
use crate::chain::{batch_len, Plan};
use crate::device::Device;
use crate::error::{zeros, Result};
use crate::layers::conv;
use crate::optim::Clip;
use cudarc::driver::{result, sys, CudaStream};
use std::sync::Arc;

/// The device half of a [`Cache`]: activations, lowered columns, the batch's targets, a host
/// copy of the last outputs, and the captured forward passes.
pub(crate) struct DevCache {
    /// The stream of the model that used this cache last (work on the cache is queued there).
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: Blas,
    /// cuDNN for the convolutions it runs faster (see `dnn.rs`).
    pub(super) dnn: Dnn,
    /// The dense layers' routes, per batch size bucket (see `routes.rs`).
    pub(super) routes: Routes,
    /// Region 0 (the inputs) is written by copies from the host or by the data loader's gather.
    pub(super) acts: DevBuf<f32>,
    pub(super) cols: DevBuf<f32>,
    pub(super) labels: DevBuf<u32>,
    pub(super) targets: DevBuf<f32>,
    /// Two page-locked buffers the host writes batches of inputs into, in turn, so that the
    /// next batch is written while the copy of the last one may still be queued: `current` is
    /// the one holding the batch; `pending[b]` says a copy from buffer b may not have run yet,
    /// and `copied[b]` marks its end.
    pub(super) staging: [Pinned<f32>; 2],
    pub(super) current: usize,
    pub(super) pending: [bool; 2],
    pub(super) copied: [Event; 2],
    /// The outputs of the last `forward`, `capacity × outputs`, page-locked.
    pub(super) outputs: Pinned<f32>,
    /// How a forward pass with small outputs tells the host it is done (`finish_outputs` in
    /// kernels/data.cu): the device counts such passes in `counter` and writes each new count to
    /// the page-locked `done`; `signals` is the count the host expects there next.
    pub(super) done: Pinned<u32>,
    pub(super) counter: DevBuf<u32>,
    pub(super) signals: u32,
    pub(super) graphs: Graphs,
}

/// The device half of [`Grads`].
pub(crate) struct DevGrads {
    pub(super) stream: Arc<CudaStream>,
    /// cuBLAS on the model's side stream, the events that fork work to it and join it back, and
    /// the event that joins the loss's stream back.
    pub(super) side_blas: Blas,
    pub(super) fork: Event,
    pub(super) join: Event,
    pub(super) loss_join: Event,
    pub(super) grads: DevBuf<f32>,
    pub(super) dacts: DevBuf<f32>,
    pub(super) dcols: DevBuf<f32>,
    pub(super) partials: DevBuf<f32>,
    pub(super) ones: DevBuf<f32>,
    /// [last loss, sum since `mean_loss`, count since `mean_loss`].
    pub(super) loss: DevBuf<f64>,
    /// The loss kernels' counter and partial sums.
    pub(super) loss_scratch: DevBuf<f64>,
    pub(super) graphs: Graphs,
}

/// The device half of an optimiser: its flat state, and where clipping by norm puts the norm.
pub(crate) struct DevOptim {
    pub(super) stream: Arc<CudaStream>,
    pub state: DevBuf<f32>,
    /// ‖g‖₂ of the last update that clipped by norm (rounded to f32), then the scratch of its
    /// sum (`Gpu::grad_norm`).
    pub(super) norm: DevBuf<f64>,
}

/// The longest lowered sample (CKK × OHW) of any convolution: the GPU lowers a whole batch, one
/// such block per sample (the CPU's scratch, `conv::Geometry::col_len`, is laid out otherwise).
pub(super) fn max_lowered_len(plan: &Plan) -> usize {
    conv::steps(plan).map(|s| conv::geometry(s).lowered_len()).max().unwrap_or(0)
}

impl DevCache {
    pub(super) fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>, options: GpuOptions, plan: &Plan, capacity: usize) -> Result<DevCache> {
        // every size checked before the first allocation
        let acts = plan.acts_len(capacity)?;
        let cols = batch_len(capacity, max_lowered_len(plan), "lowered convolution inputs")?;
        let (inputs, outputs) = (batch_len(capacity, plan.input.len(), "inputs")?, batch_len(capacity, plan.output().len(), "outputs")?);
        Ok(DevCache {
            stream: Arc::clone(stream),
            blas: gpu.blas(stream, options.tf32)?,
            dnn: Dnn::new(gpu, stream, plan, options.tuning),
            routes: Routes::new(),
            acts: DevBuf::zeros(gpu, stream, acts)?,
            cols: DevBuf::zeros(gpu, stream, cols)?,
            labels: DevBuf::zeros(gpu, stream, capacity)?,
            targets: DevBuf::zeros(gpu, stream, outputs)?,
            staging: [Pinned::zeros(gpu, inputs)?, Pinned::zeros(gpu, inputs)?],
            current: 0,
            pending: [false; 2],
            copied: [Event::new(gpu)?, Event::new(gpu)?],
            outputs: Pinned::zeros(gpu, outputs)?,
            done: Pinned::zeros(gpu, 1)?,
            counter: DevBuf::zeros(gpu, stream, 1)?,
            signals: 0,
            graphs: Graphs::new(),
        })
    }

    /// The staging buffer for the next batch's inputs, its first `len` values: the current
    /// one if no copy from it is queued, else the other, after waiting (if need be) for the
    /// copy queued from that one, which normally finished a step ago.
    pub fn inputs_host_mut(&mut self, len: usize) -> Result<&mut [f32]> {
        if self.pending[self.current] {
            self.current ^= 1;
            if self.pending[self.current] {
                self.copied[self.current].wait()?;
                self.pending[self.current] = false;
            }
        }
        Ok(&mut self.staging[self.current].as_mut_slice()[..len])
    }

    /// The current batch's inputs as the host wrote them, the first `len` values.
    pub fn inputs_host(&self, len: usize) -> &[f32] {
        &self.staging[self.current].as_slice()[..len]
    }

    /// On CUDA device `ordinal`, not yet bound to a model's stream.
    pub fn on(ordinal: usize, plan: &Plan, capacity: usize) -> Result<DevCache> {
        let gpu = super::gpu(ordinal)?;
        DevCache::new(&gpu, &gpu.new_stream()?, GpuOptions::default(), plan, capacity)
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.acts.gpu().ordinal())
    }

    /// How the convolutions run: see `Cache::conv_backends`.
    pub fn conv_report(&self) -> String {
        self.dnn.report()
    }

    /// How the dense layers and the convolutions of `plan` run: see `Cache::routes`.
    pub fn routes_report(&self, plan: &Plan) -> String {
        let parts = [self.routes.report(), self.dnn.report(), super::conv::epilogue_report(plan)];
        parts.into_iter().filter(|part| !part.is_empty()).collect::<Vec<_>>().join("\n")
    }

    /// The first `len` outputs the last forward copied back.
    pub fn outputs(&self, len: usize) -> &[f32] {
        &self.outputs.as_slice()[..len]
    }

    /// The first `out.len()` labels on the device, after the work queued on the cache's stream.
    pub fn download_labels(&self, out: &mut [u32]) -> Result<()> {
        self.labels.download(&self.stream, out)
    }

    /// The first `out.len()` targets on the device, after the work queued on the cache's stream.
    pub fn download_targets(&self, out: &mut [f32]) -> Result<()> {
        self.targets.download(&self.stream, out)
    }
}

impl DevGrads {
    pub(super) fn new(
        gpu: &Arc<Gpu>,
        stream: &Arc<CudaStream>,
        side: &Arc<CudaStream>,
        tf32: bool,
        plan: &Plan,
        capacity: usize,
    ) -> Result<DevGrads> {
        let conv_w = conv::steps(plan).map(|s| s.weight_len()).max().unwrap_or(0);
        // every size checked before the first allocation
        let dacts = plan.acts_len(capacity)?;
        let dcols = batch_len(capacity, max_lowered_len(plan), "lowered convolution gradients")?;
        let partials = batch_len(capacity, conv_w, "partial weight gradients")?.max(super::recurrent::bias_partials_len(plan, capacity));
        let ones = || -> Result<Vec<f32>> {
            let mut ones = zeros(capacity, || format!("a host vector of {capacity} ones"))?;
            ones.fill(1.0);
            Ok(ones)
        };
        Ok(DevGrads {
            stream: Arc::clone(stream),
            side_blas: gpu.blas(side, tf32)?,
            fork: Event::new(gpu)?,
            join: Event::new(gpu)?,
            loss_join: Event::new(gpu)?,
            grads: DevBuf::zeros(gpu, stream, plan.param_len)?,
            dacts: DevBuf::zeros(gpu, stream, dacts)?,
            dcols: DevBuf::zeros(gpu, stream, dcols)?,
            partials: DevBuf::zeros(gpu, stream, partials)?,
            // made (and written) only once the device has held `dacts`, at least 2 values a
            // sample: no larger than memory just granted
            ones: DevBuf::from_host(gpu, stream, &ones()?)?,
            loss: DevBuf::from_host(gpu, stream, &[f64::NAN, 0.0, 0.0])?,
            loss_scratch: DevBuf::zeros(gpu, stream, super::LOSS_SCRATCH)?,
            graphs: Graphs::new(),
        })
    }

    /// On CUDA device `ordinal`, not yet bound to a model's stream.
    pub fn on(ordinal: usize, plan: &Plan, capacity: usize) -> Result<DevGrads> {
        let gpu = super::gpu(ordinal)?;
        DevGrads::new(&gpu, &gpu.new_stream()?, &gpu.new_stream()?, false, plan, capacity)
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.grads.gpu().ordinal())
    }

    /// [last, sum, count] of the losses, after the queued steps.
    fn totals(&self) -> Result<[f64; 3]> {
        let mut out = [0.0f64; 3];
        self.loss.download(&self.stream, &mut out)?;
        Ok(out)
    }

    /// The loss of the last step (waits for it).
    pub fn last_loss(&self) -> Result<f32> {
        Ok(self.totals()?[0] as f32)
    }

    /// The sum of the losses since the last `mean_loss` (waits for the queued steps).
    pub fn loss_sum(&self) -> Result<f64> {
        Ok(self.totals()?[1])
    }

    /// The mean loss since the last call (waits for the queued steps), and a new count.
    pub fn mean_loss(&mut self) -> Result<f32> {
        let [_, sum, count] = self.totals()?;
        // SAFETY: the two totals (bytes 8..24) lie inside `loss`; queued in the stream's order.
        unsafe { result::memset_d8_async(self.loss.ptr() + 8, 0, 16, self.stream.cu_stream()) }
            .map_err(|e| driver_error("resetting the loss totals", e))?;
        Ok((sum / count) as f32)
    }

    /// The parameter gradients, after the queued steps.
    pub fn download(&self, out: &mut [f32]) -> Result<()> {
        self.grads.download(&self.stream, out)
    }

    /// Queues `reduce` on the gradients and the loss totals, outside a step (to set up the
    /// group's connections before the first step's capture).
    pub(crate) fn queue_reduce(&self, reduce: &Reduce) -> Result<()> {
        reduce.queue(&self.stream, &self.grads, &self.loss)
    }

    /// Queues a plain sum of the gradients over `comm`'s group (for measurements: the
    /// gradients are left meaningless).
    pub(crate) fn queue_sum(&self, comm: &super::nccl::Comm) -> Result<()> {
        comm.sum(&self.stream, &self.grads)
    }
}

impl DevOptim {
    /// `values` copied to `gpu`, on `stream`; the norm NaN until a step clips by it.
    pub(super) fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>, values: &[f32]) -> Result<DevOptim> {
        let mut norm = [0.0; NORM_SCRATCH];
        norm[0] = f64::NAN;
        Ok(DevOptim {
            stream: Arc::clone(stream),
            state: DevBuf::from_host(gpu, stream, values)?,
            norm: DevBuf::from_host(gpu, stream, &norm)?,
        })
    }

    /// `values` on CUDA device `ordinal`, not yet bound to a model's stream.
    pub fn on(ordinal: usize, values: &[f32]) -> Result<DevOptim> {
        let gpu = super::gpu(ordinal)?;
        DevOptim::new(&gpu, &gpu.new_stream()?, values)
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.state.gpu().ordinal())
    }

    /// The state, copied to the host after every queued step.
    pub fn download(&self, out: &mut [f32]) -> Result<()> {
        self.state.download(&self.stream, out)
    }

    /// The state replaced by `values`, after every queued step.
    pub fn upload(&mut self, values: &[f32]) -> Result<()> {
        self.state.upload(&self.stream, values)
    }

    /// The norm the last update that clipped by norm computed (waits for it).
    pub fn norm(&self) -> Result<f32> {
        let mut out = [0.0f64];
        self.norm.download(&self.stream, &mut out)?;
        Ok(out[0] as f32)
    }

    /// The norm's address where `clip` clips by norm (the step's graph then holds the norm's
    /// kernel), else 0: part of a step graph's key.
    pub(super) fn norm_ptr(&self, clip: Clip) -> sys::CUdeviceptr {
        match clip {
            Clip::Norm(_) => self.norm.ptr(),
            _ => 0,
        }
    }

    /// Queues, on `stream`, ‖g‖₂ of the first `n` gradients of `grads` into `norm`, for the
    /// update queued next.
    pub(super) fn queue_norm(&self, gpu: &Gpu, stream: &CudaStream, n: usize, grads: &DevBuf<f32>) -> Result<()> {
        // SAFETY: the norm and its scratch are this optimiser's, written only by its updates,
        // which are queued in one stream's order (the model's; `&mut` optimiser in its callers).
        let norm = unsafe { ViewMut::from_raw(self.norm.ptr(), self.norm.len()) };
        gpu.grad_norm(stream, n, grads.all(), norm)
    }
}

/// Waits for the stream that used an owner's buffers last, so that they can be freed. An error
/// (a device already lost) leaves nothing better to do than to free anyway.
macro_rules! wait_before_free {
    ($($owner:ty),*) => {$(
        impl Drop for $owner {
            fn drop(&mut self) {
                let _ = self.stream.synchronize();
            }
        }
    )*};
}
wait_before_free!(DevModel, DevCache, DevGrads, DevOptim);
