//! A small dense model's inference answered by a kernel that stays on the GPU between calls
//! (kernels/serve.cu), for [`crate::Server`]: no launch per call, so a call costs less than the
//! driver's floor for a graph (`example launch_floor` times a doorbell answered by a resident
//! kernel against a graph of one kernel with a flag).
//!
//! Each block carries `rows` samples through every layer, with the weights copied into its
//! shared memory when the kernel starts. The host writes the call into page-locked memory and
//! rings a doorbell there; block 0 polls it and passes the call on to the others through device
//! memory; the last block to finish writes the call's number to a page-locked word the host
//! spins on. Every block polling the doorbell itself made a call many times slower than block 0
//! passing it on; the layer table in shared memory, and one answer (the last block's) instead
//! of one a block, each made it faster again.
//!
//! The kernel leaves when the server is dropped, and by itself after [`IDLE`] without a call;
//! a call that finds it has run [`LIFE`] ends it first. A call after that relaunches it (one
//! launch, and the weights copied again). So another thread's work that waits for the whole
//! device (a `cuMemFree` does) is held about [`IDLE`] after calls stop, or until the next call
//! past [`LIFE`] while they go on, and the SMs go back to other work when no calls come.

use super::buffer::DevBuf;
use super::context::{Gpu, Kernel};
use super::driver_error;
use super::launch::{int, kernel_args, launch, BLOCK};
use super::pinned::Pinned;
use super::state::{spin_until, DevModel};
use crate::chain::{Layer, Plan};
use crate::error::{Error, Result};
use crate::layers::dense;
use cudarc::driver::{sys, CudaStream};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The doorbell's stop word (SERVE_STOP in kernels/serve.cu); words 0 and 1 are the call.
const STOP: usize = 2;
/// Ints a layer in the kernel's table (SERVE_FIELDS), and the most layers it takes
/// (SERVE_MAX_LAYERS).
const FIELDS: usize = 6;
const MAX_LAYERS: usize = 32;

/// The kernel leaves after this long without a call (block 0 decides and tells the others). The
/// host, which sees time from its side, stops and relaunches it a little before ([`MARGIN`]),
/// so that a call does not meet a kernel on its way out; if one does anyway, it is relaunched.
pub(crate) const IDLE: Duration = Duration::from_millis(1);
/// The host ends and relaunches the kernel after it has run this long, between calls.
pub(crate) const LIFE: Duration = Duration::from_millis(20);
const MARGIN: Duration = Duration::from_micros(100);

/// Whether the resident kernel can serve `plan` at `capacity` (else `Server` runs
/// `Model::forward`): 1 to [`MAX_LAYERS`] dense layers (and flatten steps) and nothing else,
/// whose weights and a block's activations fit in the shared memory the kernel may have.
pub(crate) fn fits(gpu: &Gpu, plan: &Plan, capacity: usize) -> bool {
    let dense = dense::steps(plan).count();
    let others = plan.steps.iter().any(|s| !matches!(s.layer, Layer::Dense(_) | Layer::Flatten(_)));
    !others && (1..=MAX_LAYERS).contains(&dense) && Shape::of(gpu, plan, capacity).shared <= gpu.serve_shared_limit()
}

/// How the kernel runs a plan at a capacity.
struct Shape {
    /// Samples a block takes.
    rows: usize,
    blocks: usize,
    /// The widest layer's inputs or outputs.
    width: usize,
    /// Bytes of dynamic shared memory a block needs.
    shared: usize,
}

impl Shape {
    fn of(gpu: &Gpu, plan: &Plan, capacity: usize) -> Shape {
        let rows = capacity.div_ceil(gpu.multiprocessors() as usize).max(1);
        let weights: usize = dense::steps(plan).map(|s| s.output.len() * ((s.input.len() | 1) + 1)).sum();
        let width = dense::steps(plan).map(|s| s.output.len()).chain([plan.input.len()]).max().unwrap_or(0);
        // the activations start at a multiple of 4 values (kernels/serve.cu loads 4 at a time)
        let shared = 4 * (weights.next_multiple_of(4) + 2 * rows * width);
        Shape { rows, blocks: capacity.div_ceil(rows).max(1), width, shared }
    }
}

/// The resident kernel of one model, and the page-locked memory calls go through.
pub(crate) struct DevServer {
    gpu: Arc<Gpu>,
    stream: Arc<CudaStream>,
    /// The model's parameters: valid while the model lives and unchanged, which `Server<'m>`
    /// (the only owner of a DevServer) ensures by borrowing the model.
    params: sys::CUdeviceptr,
    /// The layer table (FIELDS ints a dense layer).
    table: DevBuf<i32>,
    layers: i32,
    /// The inputs of the last call that brought new ones.
    dev_in: DevBuf<f32>,
    /// Block 0's word to the others (the doorbell's 64 bits), then the blocks' count of answers.
    go: DevBuf<u32>,
    bell: Pinned<u32>,
    /// The number of the last call answered (by the last block to finish it).
    done: Pinned<u32>,
    host_in: Pinned<f32>,
    host_out: Pinned<f32>,
    shape: Shape,
    output_len: usize,
    /// The number of the last call made.
    seq: u32,
    /// Since when the kernel runs, and when its last call was answered (None: not running).
    running: Option<(Instant, Instant)>,
    /// How long the kernel waits for a call before it leaves ([`IDLE`]; tests shorten it).
    kernel_idle: Duration,
}

impl DevServer {
    /// Buffers for calls of up to `capacity` samples of `plan` on `model`'s parameters (the
    /// kernel starts at the first call). The caller checked [`fits`].
    pub fn new(model: &DevModel, plan: &Plan, capacity: usize) -> Result<DevServer> {
        let gpu = Arc::clone(&model.gpu);
        let shape = Shape::of(&gpu, plan, capacity);
        int(shape.width)?;
        let mut table = Vec::new();
        for step in dense::steps(plan) {
            let (w, b) = step.weight_and_bias();
            let (act, slope) = step.layer.activation().gpu_code();
            table.extend([int(step.input.len())?, int(step.output.len())?, act, slope.to_bits() as i32, int(w.start)?, int(b.start)?]);
        }
        let (input_len, output_len) = (plan.input.len(), plan.output().len());
        int(capacity * input_len.max(output_len))?;
        let stream = gpu.new_stream()?;
        let table_buf = DevBuf::from_host(&gpu, &stream, &table)?;
        let dev_in = DevBuf::zeros(&gpu, &stream, capacity * input_len)?;
        let go = DevBuf::zeros(&gpu, &stream, 4)?;
        let server = DevServer {
            bell: Pinned::zeros(&gpu, 4)?,
            done: Pinned::zeros(&gpu, 1)?,
            host_in: Pinned::zeros(&gpu, capacity * input_len)?,
            host_out: Pinned::zeros(&gpu, capacity * output_len)?,
            params: model.params.ptr(),
            table: table_buf,
            layers: (table.len() / FIELDS) as i32,
            dev_in,
            go,
            shape,
            output_len,
            seq: 0,
            running: None,
            kernel_idle: IDLE,
            stream,
            gpu,
        };
        // the weights as the model's queued steps leave them
        model.stream.synchronize().map_err(|e| driver_error("waiting for the model's stream", e))?;
        server.stream.synchronize().map_err(|e| driver_error("preparing the server's buffers", e))?;
        Ok(server)
    }

    /// For tests: NaN in every output, so that a call that writes none is seen; and how long the
    /// kernel, from its next launch, waits for a call before leaving (the host still assumes
    /// [`IDLE`], so a shorter wait makes calls meet a kernel that has left).
    pub fn poison_for_test(&mut self, kernel_idle: Duration) {
        self.host_out.as_mut_slice().fill(f32::NAN);
        self.kernel_idle = kernel_idle;
    }

    /// The page-locked buffer the next fresh call's inputs go into.
    pub fn inputs_mut(&mut self, len: usize) -> &mut [f32] {
        &mut self.host_in.as_mut_slice()[..len]
    }

    /// One call on `samples` samples: their inputs are new in [`DevServer::inputs_mut`]
    /// (`fresh`), or those of the last fresh call. Returns the outputs once the kernel has
    /// answered (the last of its blocks to finish).
    pub fn forward(&mut self, samples: usize, fresh: bool) -> Result<&[f32]> {
        if let Some((since, answered)) = self.running {
            if since.elapsed() > LIFE || answered.elapsed() + MARGIN > IDLE {
                self.stop()?;
            }
        }
        if self.running.is_none() {
            self.start(self.seq)?;
        }
        // 0 is what `done` holds before any call, and u32::MAX the kernel's "leave"
        self.seq = if self.seq >= u32::MAX - 1 { 1 } else { self.seq + 1 };
        self.ring(samples as u32, fresh);
        let outcome = self.wait();
        if outcome.is_err() {
            // whatever happened to the kernel, the next call starts a new one
            let _ = self.stop();
        }
        outcome?;
        Ok(&self.host_out.as_slice()[..samples * self.output_len])
    }

    /// Rings the doorbell: the call's number, samples (below 2^31) and whether its inputs
    /// are new, in one 64-bit word (read by the device in one go).
    fn ring(&mut self, samples: u32, fresh: bool) {
        let word = u64::from(self.seq) | u64::from(samples) << 32 | u64::from(fresh) << 63;
        let bell = self.bell.as_mut_slice().as_mut_ptr().cast::<u64>();
        // SAFETY: the first two words of page-locked memory (page-aligned, so the u64 is),
        // which the device only reads; the release store orders the inputs before it.
        unsafe { AtomicU64::from_ptr(bell) }.store(word, Ordering::Release);
    }

    /// Spins until the last call is answered. A kernel that left without answering (it went
    /// idle as the call came) is relaunched, once; a fault is an error.
    fn wait(&mut self) -> Result<()> {
        let (done, seq, stream) = (self.done.as_ptr(), self.seq, Arc::clone(&self.stream));
        // SAFETY: a live, aligned word of page-locked memory that the device writes; the
        // acquire load orders the reads of the outputs after it.
        let answered = || unsafe { AtomicU32::from_ptr(done.cast_mut()) }.load(Ordering::Acquire) == seq;
        let mut relaunched = false;
        spin_until(&stream, "waiting for the resident kernel", answered, || {
            if relaunched {
                return Err(Error::Cuda { what: "the resident kernel left without answering a call".into() });
            }
            relaunched = true;
            self.start(seq - 1)
        })?;
        if let Some((_, answered)) = &mut self.running {
            *answered = Instant::now();
        }
        Ok(())
    }

    /// Launches the kernel, which answers calls numbered other than `last`.
    fn start(&mut self, last: u32) -> Result<()> {
        self.bell.as_mut_slice()[STOP] = 0;
        let (rows, width) = (self.shape.rows as i32, self.shape.width as i32);
        let (params, table, layers) = (self.params, self.table.ptr(), self.layers);
        let (bell, go, done) = (self.bell.device_ptr(), self.go.ptr(), self.done.device_ptr());
        let (host_in, dev_in, host_out) = (self.host_in.device_ptr(), self.dev_in.ptr(), self.host_out.device_ptr());
        let idle_ns = self.kernel_idle.as_nanos() as u64;
        let count = go + 8;
        let mut args = kernel_args![params, table, layers, rows, width, bell, go, done, host_in, dev_in, host_out, last, idle_ns, count];
        self.gpu.bind()?;
        // SAFETY: go's first word and the count, on the stream the kernel runs on, which no
        // kernel uses now
        unsafe {
            sys::cuMemsetD32Async(go, last, 1, self.stream.cu_stream())
                .result()
                .and_then(|()| sys::cuMemsetD32Async(count, 0, 1, self.stream.cu_stream()).result())
        }
        .map_err(|e| driver_error("resetting the resident kernel's words", e))?;
        // SAFETY: serve_dense's parameters in order and type; every buffer lives as long as the
        // server, which waits for the kernel to leave before freeing them (`stop`), and the
        // parameters as long as the model the server borrows. Blocks read only their rows.
        unsafe {
            launch(
                self.gpu.function(Kernel::ServeDense),
                (self.shape.blocks as u32, 1, 1),
                (BLOCK, 1, 1),
                self.shape.shared as u32,
                self.stream.cu_stream(),
                false,
                &mut args,
            )
        }?;
        let now = Instant::now();
        self.running = Some((now, now));
        Ok(())
    }

    /// Tells the kernel to leave and waits until it has.
    fn stop(&mut self) -> Result<()> {
        self.running = None;
        let bell = self.bell.as_mut_slice();
        // SAFETY: as in `ring`.
        unsafe { AtomicU32::from_ptr(&mut bell[STOP]) }.store(1, Ordering::Release);
        self.gpu.bind()?;
        self.stream.synchronize().map_err(|e| driver_error("stopping the resident kernel", e))
    }
}

impl Drop for DevServer {
    fn drop(&mut self) {
        // an error (a device already lost) leaves nothing to do but free
        let _ = self.stop();
    }
}
