//! A convolution's routes, chosen by measurement per layer, direction and batch size: flatnn's
//! lowered route (`own`: im2col and cuBLAS products, in `conv.rs`); for the weight gradient,
//! flatnn's implicit product too (`own-implicit`: x gathered as it is read, no lowered matrix,
//! the batch split into shares summed in a fixed order: `conv_weight_grad_implicit`); flatnn's
//! direct kernels where they fit (`own-direct`: `conv_direct.rs`; the forward, the weight
//! gradient, and a stride-1 layer's input gradient as a forward convolution of dZ); flatnn's
//! tensor-core kernels where they fit (`own-mma`: `conv_mma.rs`, `conv_mma_wgrad.rs`, sm_80 on;
//! the forward, the weight gradient and that input gradient, in 3xTF32, or in TF32 where the
//! model's TF32 is on); and cuDNN where it loads. The fastest is kept; flatnn's kernels run wherever cuDNN is missing,
//! so a machine without it still runs every model on the GPU.
//!
//! The model's `Tuning::convs` (`FLATNN_CUDNN`, read with the rest of the tuning): `0` flatnn's
//! kernels only (cuDNN is not loaded; the weight gradient's routes are still measured),
//! `1` cuDNN wherever it has an algorithm, `auto` (the default, and what a value not understood
//! means; the report says so) cuDNN where it was faster than flatnn's faster route.
//!
//! A cache with convolutions owns one cuDNN handle, bound to the stream of the model using the
//! cache (as its cuBLAS handle is), and one workspace of [`WORKSPACE`] bytes, allocated with the
//! cache, whatever its capacity. cuDNN never allocates during a step.
//!
//! A cuDNN tensor descriptor carries the batch N, and an algorithm (and how fast it is) depends on
//! N, so descriptors for the capacity cannot serve a smaller batch: they would run over the stale
//! samples behind it, and the weight gradient would sum them. So for each (batch, TF32,
//! determinism) that runs, the first time it does (when its graph is captured), a [`Setup`] is
//! made: per conv layer its descriptors, then per direction (forward; weight gradient and input
//! gradient at the first training step) cuDNN's best few algorithms by `cudnnFind*AlgorithmEx`
//! within the workspace, and these and flatnn's routes timed as steps run them (in a CUDA graph,
//! or eagerly where the model's graphs are off; see `timing.rs`); nothing is timed where
//! flatnn's lowered route is the only candidate. Where timing it fails (a capture refused), it
//! is chosen and the report says why. The choice is kept for that
//! batch size and reported by [`Dnn::report`]. The timing runs on the cache's live buffers: it
//! writes only what the step it precedes overwrites (a layer's z, weight gradient, input gradient,
//! scratch).
//!
//! Same inputs, same bits: only deterministic, product-based cuDNN algorithms are considered (no
//! atomics, FFT or Winograd; see `Perf::usable`) unless the model's `GpuOptions::deterministic` is
//! off (then atomics too, never FFT or Winograd, and the report marks each such algorithm chosen),
//! and a measurement is made once per process for a (device, layer shape, batch, TF32, determinism,
//! whether cuDNN is a candidate, direction) and reused by every later cache, so that models
//! trained side by side compute exactly as one trained alone. (Every cache has the same
//! workspace, so an algorithm found in one fits all.) Another process may measure otherwise and
//! take another route (results then differ in the last bits): `FLATNN_CUDNN=1` fixes the route
//! where cuDNN has an algorithm; flatnn's weight-gradient routes are always measured.
//!
//! Bias, activation and bias gradient stay flatnn's kernels on every route.

mod route;

use super::blas::Blas;
use super::buffer::DevBuf;
use super::context::Gpu;
use super::conv::{conv_forward_own, conv_input_grad_own, conv_weight_grad_implicit, conv_weight_grad_own};
use super::conv_direct::{conv_forward_direct, conv_input_grad_direct, conv_weight_grad_direct};
use super::conv_mma::{conv_forward_mma, conv_input_grad_mma};
use super::conv_mma_wgrad::conv_weight_grad_mma;
use super::cudnn::{cudnn_error, cudnn_version, Algo, Descs, Dir, Handle, Ptrs};
use super::exec::{Backward, Forward};
use super::graph::Graphs;
use super::options::{Convs, GpuOptions, Tuning};
use super::rnn_dnn::RnnDnn;
use super::timing::{add_note, time_calls};
use super::{driver_error, guarded_result};
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::{conv, region};
use cudarc::driver::CudaStream;
#[cfg(test)]
pub(super) use route::forced;
pub(super) use route::Route;
use route::{describe, direct_fits, mma_fits, MeasureKey, Measured, Times, MEASURED};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The workspace of every cache with convolutions, whatever its capacity; Find considers only
/// algorithms that fit in it. The same for all caches, so that the algorithm measured for a
/// (device, layer shape, batch, TF32, determinism, direction) fits every cache that reuses it.
/// The deterministic product algorithms LeNet's layers take needed ~1 KiB on the H100.
const WORKSPACE: usize = 8 << 20;
/// (batch, TF32, determinism) setups a cache keeps: more than the graphs it keeps (a forward and
/// a training graph per batch size), so that a replayed graph's batch size is never set up again.
const SLOTS: usize = 2 * Graphs::SLOTS;
/// cuDNN algorithms timed per layer and direction (the fastest by cuDNN's own measure).
const CANDIDATES: usize = 3;

/// The operands of `dir` for `step`'s first `f.batch` samples, each checked to lie inside its
/// buffer (x: batch·C·H·W, y: batch·OC·OH·OW, w: OC·C·kh·kw values).
fn ptrs(dir: Dir, plan: &Plan, step: &Step, f: &Forward, b: Option<&Backward>) -> Ptrs {
    let x = region(plan, step.input_region, f.capacity, f.batch);
    let z = region(plan, step.z_region, f.capacity, f.batch);
    let (w, _) = step.weight_and_bias();
    debug_assert_eq!((x.len(), z.len()), (f.batch * step.input.len(), f.batch * step.output.len()));
    let backward = || b.expect("a backward direction has gradient buffers");
    match dir {
        Dir::Forward => Ptrs { x: f.acts.view(x).ptr(), w: f.params.view(w).ptr(), y: f.acts.view(z).ptr() },
        Dir::Weight => Ptrs { x: f.acts.view(x).ptr(), w: backward().grads.view(w).ptr(), y: backward().dacts.view(z).ptr() },
        Dir::Input => Ptrs { x: backward().dacts.view(x).ptr(), w: f.params.view(w).ptr(), y: backward().dacts.view(z).ptr() },
    }
}

/// One direction of one layer: which route runs it, and what was measured to decide.
#[derive(Clone, Copy, Debug)]
struct Choice {
    /// Measured (or found not needed); until then flatnn's lowered route would run it.
    decided: bool,
    /// False for the input gradient of a layer reading the model's inputs.
    needed: bool,
    /// The fastest cuDNN algorithm timed, if any fits.
    algo: Option<Algo>,
    route: Route,
    /// Per call (in a graph, or eager where the model's graphs are off), by route (NaN where not
    /// measured).
    us: Times,
    /// Whether flatnn's direct kernel fits this direction of the layer (then it was a candidate).
    direct: bool,
    /// Whether flatnn's tensor-core kernel fits it on this device (then it was a candidate).
    mma: bool,
}

impl Default for Choice {
    fn default() -> Self {
        Choice { decided: false, needed: true, algo: None, route: Route::Own, us: Times::NONE, direct: false, mma: false }
    }
}

/// A conv layer in one [`Setup`].
struct LayerSetup {
    /// Index in `plan.steps`.
    step: usize,
    label: String,
    /// None where cuDNN refused the layer (`note` says why).
    descs: Option<Descs>,
    choices: [Choice; 3],
    note: String,
}

/// The conv layers' descriptors and choices for one batch size, arithmetic and determinism
/// (whether non-deterministic algorithms were candidates).
struct Setup {
    batch: usize,
    tf32: bool,
    deterministic: bool,
    layers: Vec<LayerSetup>,
}

/// cuDNN's handle and workspace for one cache. Fields drop in order: handle, then workspace.
struct Library {
    handle: Handle,
    workspace: DevBuf<u8>,
}

/// The convolutions' routes for one cache, and cuDNN where it is used. Fields drop in order:
/// descriptors, then cuDNN's handle and workspace.
struct ConvRoutes {
    setups: Vec<Setup>,
    /// Next setup replaced when `SLOTS` are kept.
    next: usize,
    /// The setup the last `prepare` picked: the one the calls of the step being run use.
    current: Option<usize>,
    cudnn: Option<Library>,
    stream: Arc<CudaStream>,
    gpu: Arc<Gpu>,
}

impl Drop for ConvRoutes {
    fn drop(&mut self) {
        // cuDNN's handle and workspace may still be used by queued work.
        if self.cudnn.is_some() && self.gpu.bind().is_ok() {
            let _ = self.stream.synchronize();
        }
    }
}

/// A step about to run: what measuring its convolutions needs (the device, the cache's cuBLAS
/// handle, the model's stream, the plan, the step's buffers and the model's options).
#[derive(Clone, Copy)]
pub(crate) struct StepRun<'a> {
    pub gpu: &'a Gpu,
    pub blas: &'a Blas,
    pub stream: &'a CudaStream,
    pub plan: &'a Plan,
    pub f: &'a Forward<'a>,
    pub b: Option<&'a Backward<'a>>,
    pub options: GpuOptions,
}

/// A cache's convolutions: their routes, cuDNN where it is used, and what to report; and its
/// recurrent layers' routes (`rnn_dnn.rs`).
pub(crate) struct Dnn {
    /// None for a plan without convolutions.
    convs: Option<ConvRoutes>,
    rnn: RnnDnn,
    /// First line of the report: cuDNN's version, or why it is not used.
    header: String,
    /// A number no other cache of this process has (see [`Dnn::id`]).
    id: u64,
}

// SAFETY: a cuDNN handle and descriptors may be used from any thread, one at a time; `Dnn` is
// used through its cache (`&mut` to change it), which one thread runs at a time.
unsafe impl Send for Dnn {}

impl Dnn {
    /// For a cache of `plan` (of any capacity), on `stream`, for models whose convolutions and
    /// recurrent layers take the routes `tuning` allows. Never fails: where cuDNN is missing,
    /// refused by `tuning.convs`, or fails to set up, every convolution runs on flatnn's kernels
    /// (the fastest of its weight-gradient routes) and the report says why.
    pub fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>, plan: &Plan, tuning: Tuning) -> Dnn {
        let convs = tuning.convs;
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let not_understood = Tuning::cudnn_not_understood().filter(|_| convs == Convs::Measured);
        let setting = match not_understood {
            Some(value) => format!("FLATNN_CUDNN={value:?} not understood, taken as auto"),
            None => format!("FLATNN_CUDNN={}", convs.setting()),
        };
        let off = |why: &str| {
            let header = match not_understood {
                Some(_) => format!("cuDNN not used ({why}; {setting}): flatnn's kernels"),
                None => format!("cuDNN not used ({why}): flatnn's kernels"),
            };
            Dnn { convs: Some(ConvRoutes::new(gpu, stream, None)), header, id, rnn: RnnDnn::new(gpu, stream, plan, tuning) }
        };
        if conv::steps(plan).next().is_none() {
            return Dnn { convs: None, header: String::new(), id, rnn: RnnDnn::new(gpu, stream, plan, tuning) };
        }
        if convs == Convs::Own {
            return off(&setting);
        }
        let Some(version) = cudnn_version() else { return off("no cuDNN 9 library found") };
        match guarded_result(|| Library::new(gpu, stream)) {
            Ok(cudnn) => {
                let (major, minor, patch) = (version / 10000, version / 100 % 100, version % 100);
                let kib = cudnn.workspace.len() / 1024;
                let header = format!("cuDNN {major}.{minor}.{patch}, {setting}, workspace {kib} KiB");
                let convs = Some(ConvRoutes::new(gpu, stream, Some(cudnn)));
                Dnn { convs, header, id, rnn: RnnDnn::new(gpu, stream, plan, tuning) }
            }
            Err(e) => off(&format!("setting it up failed: {e}")),
        }
    }

    /// A number no other cache of this process has had: a graph captured with this cache also
    /// uses its cuDNN handle and workspace, its cuBLAS handle and its lowered columns, and a new
    /// cache may get a freed one's addresses, so graph keys carry this rather than addresses.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Moves the handle to `stream` (after the work queued on its old one); a no-op when it is
    /// there.
    pub fn rebind(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.rnn.rebind(stream)?;
        let Some(c) = &mut self.convs else { return Ok(()) };
        match &mut c.cudnn {
            Some(lib) => lib.handle.move_to(&c.gpu, &mut c.stream, stream),
            None => {
                c.stream = Arc::clone(stream);
                Ok(())
            }
        }
    }

    /// Readies the convolutions of a step on `f.batch` samples (and their backward with `b`):
    /// the first time a batch size (or TF32 or determinism setting) runs, makes its descriptors
    /// and measures both paths (in graphs where `options.graphs`, else eagerly); later, only picks that
    /// setup. Call it before the step is run or captured, on the model's stream (after
    /// [`Dnn::rebind`]); it may wait for the device.
    pub fn prepare(&mut self, s: &StepRun) -> Result<()> {
        self.rnn.prepare(s)?;
        let StepRun { plan, f, b, options, .. } = *s;
        let (tf32, deterministic) = (options.tf32, options.deterministic);
        let Some(c) = &mut self.convs else { return Ok(()) };
        let index = match c.setups.iter().position(|s| s.batch == f.batch && s.tf32 == tf32 && s.deterministic == deterministic) {
            Some(index) => index,
            None => c.add_setup(plan, f.batch, tf32, deterministic),
        };
        c.current = Some(index);
        let pending = |s: &Setup, dir: Dir| s.layers.iter().any(|l| !l.choices[dir as usize].decided);
        let setup = &c.setups[index];
        if !pending(setup, Dir::Forward) && (b.is_none() || !pending(setup, Dir::Weight) && !pending(setup, Dir::Input)) {
            return Ok(());
        }
        let mut layers = std::mem::take(&mut c.setups[index].layers);
        let outcome = (|| {
            for layer in &mut layers {
                let step = &plan.steps[layer.step];
                let dirs: &[Dir] = if b.is_some() { &[Dir::Forward, Dir::Weight, Dir::Input] } else { &[Dir::Forward] };
                for &dir in dirs {
                    if layer.choices[dir as usize].decided {
                        continue;
                    }
                    if dir == Dir::Input && step.input_region == 0 {
                        layer.choices[dir as usize] = Choice { decided: true, needed: false, ..Choice::default() };
                        continue;
                    }
                    c.decide(layer, dir, s)?;
                }
            }
            Ok(())
        })();
        c.setups[index].layers = layers;
        outcome
    }

    /// The recurrent layers' routes.
    pub fn rnn(&self) -> &RnnDnn {
        &self.rnn
    }

    /// The forward product of step `index` (z without bias) through cuDNN, if chosen for the
    /// batch prepared last: true when queued, false when flatnn's kernels must run it.
    pub fn forward(&self, index: usize, plan: &Plan, f: &Forward) -> Result<bool> {
        self.run_chosen(Dir::Forward, index, plan, f, None)
    }

    /// dW of step `index` (overwritten) through cuDNN, if chosen; as [`Dnn::forward`].
    pub fn weight_grad(&self, index: usize, plan: &Plan, f: &Forward, b: &Backward) -> Result<bool> {
        self.run_chosen(Dir::Weight, index, plan, f, Some(b))
    }

    /// dX of step `index` (overwritten) through cuDNN, if chosen; as [`Dnn::forward`].
    pub fn input_grad(&self, index: usize, plan: &Plan, f: &Forward, b: &Backward) -> Result<bool> {
        self.run_chosen(Dir::Input, index, plan, f, Some(b))
    }

    /// The route chosen for `dir` of step `index` at `batch` (prepared last): flatnn's lowered
    /// one until measured.
    pub(super) fn route(&self, dir: Dir, index: usize, batch: usize) -> Route {
        self.chosen(dir, index, batch).map_or(Route::Own, |(_, choice)| choice.route)
    }

    /// Whether the setup prepared last is for TF32 (then the tensor-core route runs one product
    /// of TF32 roundings; else, and where nothing was prepared, 3xTF32).
    pub(super) fn tf32(&self) -> bool {
        let Some(c) = &self.convs else { return false };
        c.current.and_then(|i| c.setups.get(i)).is_some_and(|s| s.tf32)
    }

    /// The layer set up for step `index` in the setup prepared last, and its choice for `dir`,
    /// where that setup is for `batch`.
    fn chosen(&self, dir: Dir, index: usize, batch: usize) -> Option<(&LayerSetup, Choice)> {
        let c = self.convs.as_ref()?;
        let setup = c.current.and_then(|i| c.setups.get(i))?;
        // descriptors made for another batch must never run on this one
        debug_assert_eq!(setup.batch, batch, "Dnn::prepare was not called for this batch");
        if setup.batch != batch {
            return None;
        }
        let layer = setup.layers.iter().find(|l| l.step == index)?;
        Some((layer, layer.choices[dir as usize]))
    }

    fn run_chosen(&self, dir: Dir, index: usize, plan: &Plan, f: &Forward, b: Option<&Backward>) -> Result<bool> {
        let (Some(c), Some((layer, choice))) = (&self.convs, self.chosen(dir, index, f.batch)) else { return Ok(false) };
        let (Some(algo), Route::Cudnn, Some(descs), Some(lib)) = (choice.algo, choice.route, &layer.descs, &c.cudnn) else {
            return Ok(false);
        };
        c.gpu.bind()?;
        let p = ptrs(dir, plan, &plan.steps[index], f, b);
        // SAFETY: descriptors of this layer and batch; the operands lie inside their buffers
        // (checked by `ptrs`) and the workspace is the one the algorithm was found within.
        unsafe { lib.handle.run(dir, descs, algo, p, &lib.workspace) }
            .map_err(|e| cudnn_error(&format!("{} of step {index}", dir.name()), e))?;
        Ok(true)
    }

    /// What runs each convolution: cuDNN's version (or why it is not used), then one line per
    /// conv layer and batch size set up, with each direction's path and the times measured; then
    /// the recurrent layers' lines ([`RnnDnn::report`]).
    pub fn report(&self) -> String {
        let mut out = self.conv_report();
        for line in self.rnn.report().lines() {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(line);
        }
        out
    }

    fn conv_report(&self) -> String {
        let mut out = self.header.clone();
        let Some(c) = &self.convs else { return out };
        for setup in &c.setups {
            for layer in &setup.layers {
                let arith = super::options::arithmetic(setup.tf32, setup.deterministic);
                let _ = write!(out, "\nbatch {} {arith}, {}:", setup.batch, layer.label);
                for dir in [Dir::Forward, Dir::Weight, Dir::Input] {
                    let cudnn = c.cudnn.is_some() && layer.descs.is_some();
                    let _ = write!(out, " {} {};", dir.name(), describe(dir, layer.choices[dir as usize], cudnn));
                }
                if !layer.note.is_empty() {
                    let _ = write!(out, " note: {}", layer.note);
                }
            }
        }
        out
    }
}

impl Library {
    fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>) -> Result<Library> {
        gpu.bind()?;
        let handle = Handle::new(stream)?;
        let workspace = DevBuf::zeros(gpu, stream, WORKSPACE)?;
        Ok(Library { handle, workspace })
    }
}

impl ConvRoutes {
    fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>, cudnn: Option<Library>) -> ConvRoutes {
        let (stream, gpu) = (Arc::clone(stream), Arc::clone(gpu));
        ConvRoutes { setups: Vec::with_capacity(SLOTS), next: 0, current: None, cudnn, stream, gpu }
    }

    /// A new setup for (batch, tf32, deterministic), nothing measured yet; its index.
    fn add_setup(&mut self, plan: &Plan, batch: usize, tf32: bool, deterministic: bool) -> usize {
        let layers = plan
            .steps
            .iter()
            .enumerate()
            .filter(|(_, s)| conv::is_conv(&s.layer))
            .map(|(index, step)| {
                let g = conv::geometry(step);
                let dilated = if g.dilation == (1, 1) { String::new() } else { format!(" dilation {}×{}", g.dilation.0, g.dilation.1) };
                let label = format!(
                    "step {index} conv {}→{} {}×{} stride {}×{} pad {}×{}{dilated} on {}×{}",
                    g.in_channels,
                    g.out_channels,
                    g.kernel.0,
                    g.kernel.1,
                    g.stride.0,
                    g.stride.1,
                    g.padding.0,
                    g.padding.1,
                    g.height,
                    g.width
                );
                let (descs, note) = match self.cudnn.as_ref().map(|_| Descs::new(step, batch)) {
                    Some(Ok(d)) => (Some(d), String::new()),
                    Some(Err(why)) => (None, why),
                    None => (None, String::new()),
                };
                LayerSetup { step: index, label, descs, choices: [Choice::default(); 3], note }
            })
            .collect();
        let setup = Setup { batch, tf32, deterministic, layers };
        if self.setups.len() < SLOTS {
            self.setups.push(setup);
            self.setups.len() - 1
        } else {
            let index = self.next;
            self.setups[index] = setup;
            self.next = (self.next + 1) % SLOTS;
            index
        }
    }

    /// Records the route for `dir` of `layer`: as measured before in this process for the same
    /// device, shape, batch, arithmetic, determinism and candidates (so that every model of a
    /// process computes alike), else measured now; the fastest of flatnn's routes unless cuDNN
    /// was faster (or `FLATNN_CUDNN=1` and it has an algorithm). A failure of cuDNN, or of
    /// timing a route, leaves flatnn's lowered route chosen (with a note).
    fn decide(&self, layer: &mut LayerSetup, dir: Dir, s: &StepRun) -> Result<()> {
        let StepRun { gpu, stream, plan, f, b, options, .. } = *s;
        let step = &plan.steps[layer.step];
        let g = conv::geometry(step);
        let (kernel, stride, pad, dilation) = (g.kernel, g.stride, g.padding, g.dilation);
        let shape = [
            g.in_channels,
            g.height,
            g.width,
            g.out_channels,
            kernel.0,
            kernel.1,
            stride.0,
            stride.1,
            pad.0,
            pad.1,
            dilation.0,
            dilation.1,
        ];
        let (tf32, deterministic) = (options.tf32, options.deterministic);
        let cudnn = self.cudnn.is_some();
        let key = MeasureKey { ordinal: gpu.ordinal(), shape, batch: f.batch, tf32, deterministic, cudnn, dir };
        let m = match MEASURED.get(&key) {
            Some(m) => m,
            None => MEASURED.keep(key, self.measure(layer, dir, s)?),
        };
        // flatnn's fastest route (a time not measured is NaN, never faster), unless cuDNN's is
        let (direct, mma) = (direct_fits(dir, &g, f.batch), mma_fits(dir, &g, f.batch, gpu.compute_capability()));
        let own = m.us.fastest(Route::candidates(dir, false, direct, mma));
        let cudnn_wins = options.tuning.convs == Convs::Cudnn || m.us.of(Route::Cudnn) < m.us.of(own);
        let mut route = if m.algo.is_some() && layer.descs.is_some() && cudnn_wins { Route::Cudnn } else { own };
        #[cfg(test)]
        if let Some(forced) = forced::route().filter(|&r| Route::candidates(dir, layer.descs.is_some(), direct, mma).any(|c| c == r)) {
            route = if forced == Route::Cudnn && m.algo.is_none() { own } else { forced };
        }
        if let (Some(algo), Some(descs), Some(lib), Route::Cudnn) = (m.algo, &layer.descs, &self.cudnn, route) {
            // Run it eagerly before any capture (measuring did, in the cache that measured):
            // a new handle's first call may load modules or allocate, which would break a
            // capture running on another thread.
            let p = ptrs(dir, plan, step, f, b);
            gpu.bind()?;
            let _exclusive = super::device_wide();
            // SAFETY: descriptors of this layer and batch, operands inside their buffers, an
            // algorithm cuDNN found for them within this size of workspace (every cache's).
            if let Err(e) = unsafe { lib.handle.run(dir, descs, algo, p, &lib.workspace) } {
                note(&mut layer.note, dir, &format!("{} failed: {e:?}", algo.name(dir)));
                route = own;
            }
            stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
        }
        layer.choices[dir as usize] = Choice { decided: true, needed: true, algo: m.algo, route, us: m.us, direct, mma };
        if !m.note.is_empty() {
            note(&mut layer.note, dir, &m.note);
        }
        Ok(())
    }

    /// Times flatnn's routes for `dir` of `layer` (the lowered one; for the weight gradient the
    /// implicit one too; the direct and tensor-core ones where they fit, the latter in the
    /// setup's arithmetic) and cuDNN's best few algorithms (by
    /// `cudnnFind*AlgorithmEx`), as a step runs them (see [`time_calls`]); nothing where
    /// flatnn's lowered route is the only candidate. Where that route cannot be timed, no other
    /// is tried: it is what a step then runs.
    fn measure(&self, layer: &LayerSetup, dir: Dir, s: &StepRun) -> Result<Measured> {
        let StepRun { gpu, blas, stream, plan, f, b, options } = *s;
        let step = &plan.steps[layer.step];
        let own = || match dir {
            Dir::Forward => conv_forward_own(gpu, blas, stream, plan, step, f),
            Dir::Weight => conv_weight_grad_own(gpu, blas, stream, plan, step, f, b.expect("gradients")),
            Dir::Input => conv_input_grad_own(gpu, blas, stream, plan, step, f, b.expect("gradients")),
        };
        let mut m = Measured { algo: None, us: Times::NONE, note: String::new() };
        let cudnn = layer.descs.as_ref().zip(self.cudnn.as_ref());
        let g = conv::geometry(step);
        let (direct, mma) = (direct_fits(dir, &g, f.batch), mma_fits(dir, &g, f.batch, gpu.compute_capability()));
        let others: Vec<Route> = Route::candidates(dir, false, direct, mma).skip(1).collect();
        if others.is_empty() && cudnn.is_none() {
            return Ok(m);
        }
        match time_calls(gpu, stream, options.graphs, &own) {
            Ok(us) => m.us.set(Route::Own, us),
            Err(e) => {
                m.note = format!("timing flatnn's kernels failed ({e}): flatnn's kernels chosen");
                return Ok(m);
            }
        }
        for route in others {
            let run = || match (route, dir) {
                (Route::Implicit, _) => conv_weight_grad_implicit(gpu, stream, plan, step, f, b.expect("gradients")),
                (Route::Mma, Dir::Input) => conv_input_grad_mma(gpu, stream, plan, step, f, b.expect("gradients"), options.tf32),
                (Route::Mma, Dir::Weight) => conv_weight_grad_mma(gpu, stream, plan, step, f, b.expect("gradients"), options.tf32),
                (Route::Mma, _) => conv_forward_mma(gpu, stream, plan, step, f, options.tf32),
                (_, Dir::Forward) => conv_forward_direct(gpu, stream, plan, step, f),
                (_, Dir::Weight) => conv_weight_grad_direct(gpu, stream, plan, step, f, b.expect("gradients")),
                (_, Dir::Input) => conv_input_grad_direct(gpu, stream, plan, step, f, b.expect("gradients")),
            };
            match time_calls(gpu, stream, options.graphs, &run) {
                Ok(us) => m.us.set(route, us),
                Err(e) => add_note(&mut m.note, "timing failed", &format!("{} ({e})", route.name())),
            }
        }
        let Some((descs, lib)) = cudnn else { return Ok(m) };
        let p = ptrs(dir, plan, step, f, b);
        gpu.bind()?;
        // SAFETY: descriptors of this layer and batch; operands inside their buffers.
        match unsafe { lib.handle.find(dir, descs, p, &lib.workspace, &options, CANDIDATES) } {
            Ok((algos, offered)) if algos.is_empty() => {
                let which = if options.deterministic { "deterministic product" } else { "product" };
                add_note(&mut m.note, &format!("no {which} algorithm fits"), &format!("cuDNN offered {offered}"));
            }
            Ok((algos, refused)) => {
                if !refused.is_empty() {
                    add_note(&mut m.note, "refused", &refused);
                }
                for algo in algos {
                    // SAFETY: as above, with an algorithm cuDNN found for them.
                    let run = || unsafe { lib.handle.run(dir, descs, algo, p, &lib.workspace) }.map_err(|e| cudnn_error(dir.name(), e));
                    match time_calls(gpu, stream, options.graphs, &run) {
                        Ok(us) if m.algo.is_none() || us < m.us.of(Route::Cudnn) => {
                            m.algo = Some(algo);
                            m.us.set(Route::Cudnn, us);
                        }
                        Ok(_) => {}
                        Err(e) => add_note(&mut m.note, &format!("{} failed", algo.name(dir)), &e.to_string()),
                    }
                }
            }
            Err(e) => add_note(&mut m.note, "finding an algorithm failed", &format!("{e:?}")),
        }
        Ok(m)
    }
}

fn note(notes: &mut String, dir: Dir, what: &str) {
    add_note(notes, dir.name(), what);
}
