//! Convolutions through cuDNN where it loads and is measured faster than flatnn's own kernels
//! (im2col + cuBLAS, in `exec.rs`); flatnn's kernels everywhere else, so a machine without
//! cuDNN still runs every model on the GPU.
//!
//! `FLATNN_CUDNN`, read when a cache is made: `0` flatnn's kernels only (cuDNN is not loaded),
//! `1` cuDNN wherever it has an algorithm, `auto` (the default) cuDNN where it was faster.
//!
//! A cache with convolutions owns one cuDNN handle, bound to the stream of the model using the
//! cache (as its cuBLAS handle is), and one workspace, allocated with the cache: the most any
//! layer and direction needs at the cache's capacity by cuDNN's heuristics, up to
//! [`WORKSPACE_CAP`]. cuDNN never allocates during a step.
//!
//! A cuDNN tensor descriptor carries the batch N, and an algorithm (and how fast it is) depends
//! on N, so descriptors for the capacity cannot serve a smaller batch: they would run over the
//! stale samples behind it, and the weight gradient would sum them. So for each (batch, TF32)
//! that runs, the first time it does (when its graph is captured), a [`Setup`] is made: per
//! conv layer its descriptors, then per direction (forward; weight gradient and input gradient
//! at the first training step) cuDNN's best algorithm by `cudnnFind*AlgorithmEx` within the
//! workspace, and both paths timed, each captured `REPS` times in a CUDA graph (as steps run)
//! and replayed: median of `SAMPLES` replays. The choice is kept for that batch size and
//! reported by [`Dnn::report`]. The timing runs on the cache's live buffers: it writes only
//! what the step it precedes overwrites (a layer's z, weight gradient, input gradient, scratch).
//!
//! Bias, activation and bias gradient stay flatnn's kernels on both paths.

use super::blas::Blas;
use super::buffer::DevBuf;
use super::context::Gpu;
use super::exec::{self, Backward, Forward};
use super::graph::{self, Graphs};
use super::{driver_error, guarded_result};
use crate::chain::{Plan, Step};
use crate::error::{Error, Result};
use crate::layers::{conv_geometry, conv_steps, region};
use cudarc::cudnn::result::{self as dnn, CudnnError};
use cudarc::cudnn::sys;
use cudarc::driver::{result as driver, sys as driver_sys, CudaStream};
use std::ffi::c_void;
use std::fmt::Write;
use std::sync::{Arc, OnceLock};

/// The most workspace a cache gives cuDNN; algorithms needing more are not considered.
const WORKSPACE_CAP: usize = 64 << 20;
/// (batch, TF32) setups a cache keeps: more than the graphs it keeps (a forward and a training
/// graph per batch size), so that a replayed graph's batch size is never set up again.
const SLOTS: usize = 2 * Graphs::SLOTS;
/// Calls per captured graph, and replays timed, when comparing the two paths.
const REPS: usize = 10;
const SAMPLES: usize = 5;

/// cuDNN's version (e.g. 90300 for 9.3.0) where a cuDNN 9 library loads here, else `None`.
/// Probed once per process; never panics.
pub fn cudnn_version() -> Option<usize> {
    static VERSION: OnceLock<Option<usize>> = OnceLock::new();
    *VERSION.get_or_init(|| {
        // SAFETY: only tries to open the library, then closes it (cudarc would panic later
        // where it is missing).
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        guarded_result(|| Ok(dnn::get_version())).ok().filter(|v| (90000..100000).contains(v))
    })
}

/// What `FLATNN_CUDNN` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Own,
    Cudnn,
    Auto,
}

impl Mode {
    fn from_env() -> Mode {
        match std::env::var("FLATNN_CUDNN").as_deref().map(str::trim) {
            Ok("0") | Ok("off") | Ok("own") => Mode::Own,
            Ok("1") | Ok("on") | Ok("cudnn") => Mode::Cudnn,
            _ => Mode::Auto,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Own => "0",
            Mode::Cudnn => "1",
            Mode::Auto => "auto",
        }
    }
}

/// The three products of a convolution. Pointers by direction (see [`Ptrs`]): forward reads x
/// and w, writes y (= z); weight gradient reads x and dy, writes dw; input gradient reads w and
/// dy, writes dx.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Forward = 0,
    Weight = 1,
    Input = 2,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Forward => "forward",
            Dir::Weight => "weight grad",
            Dir::Input => "input grad",
        }
    }

    /// Number of cuDNN algorithms of this direction (their values are 0..count).
    fn count(self) -> u32 {
        match self {
            Dir::Forward => sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as u32,
            Dir::Weight => sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT as u32,
            Dir::Input => sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as u32,
        }
    }

    /// The algorithm's name as cuDNN spells it, less the common prefix.
    fn algo_name(self, algo: u32) -> String {
        let name = match self {
            Dir::Forward => format!("{:?}", fwd_algo(algo)),
            Dir::Weight => format!("{:?}", filter_algo(algo)),
            Dir::Input => format!("{:?}", data_algo(algo)),
        };
        name.trim_start_matches("CUDNN_CONVOLUTION_").to_string()
    }
}

// The algorithm enums are repr(u32) with every value in 0..COUNT; callers check the range.
fn fwd_algo(algo: u32) -> sys::cudnnConvolutionFwdAlgo_t {
    assert!(algo < Dir::Forward.count());
    // SAFETY: in range (above) of a repr(u32) enum with contiguous values from 0.
    unsafe { std::mem::transmute::<u32, sys::cudnnConvolutionFwdAlgo_t>(algo) }
}

fn filter_algo(algo: u32) -> sys::cudnnConvolutionBwdFilterAlgo_t {
    assert!(algo < Dir::Weight.count());
    // SAFETY: as above.
    unsafe { std::mem::transmute::<u32, sys::cudnnConvolutionBwdFilterAlgo_t>(algo) }
}

fn data_algo(algo: u32) -> sys::cudnnConvolutionBwdDataAlgo_t {
    assert!(algo < Dir::Input.count());
    // SAFETY: as above.
    unsafe { std::mem::transmute::<u32, sys::cudnnConvolutionBwdDataAlgo_t>(algo) }
}

/// cuDNN's three `cudnnConvolution*AlgoPerf_t` share this layout; read as plain integers so
/// that a status or math type newer than cudarc's enums is no undefined behaviour.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct Perf {
    algo: u32,
    status: u32,
    time: f32,
    memory: usize,
    determinism: u32,
    math_type: u32,
    reserved: [i32; 3],
}

const _: () = {
    use std::mem::{align_of, size_of};
    assert!(size_of::<Perf>() == size_of::<sys::cudnnConvolutionFwdAlgoPerf_t>());
    assert!(size_of::<Perf>() == size_of::<sys::cudnnConvolutionBwdFilterAlgoPerf_t>());
    assert!(size_of::<Perf>() == size_of::<sys::cudnnConvolutionBwdDataAlgoPerf_t>());
    assert!(align_of::<Perf>() == align_of::<sys::cudnnConvolutionFwdAlgoPerf_t>());
};

/// Room for every algorithm of any direction.
const PERFS: usize = 8;

impl Perf {
    /// Succeeded, fits in `workspace` bytes, and (unless `tf32`) plain FP32 arithmetic.
    fn usable(&self, dir: Dir, workspace: usize, tf32: bool) -> bool {
        self.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS as u32
            && self.algo < dir.count()
            && self.memory <= workspace
            && (tf32 || self.math_type == sys::cudnnMathType_t::CUDNN_FMA_MATH as u32)
    }
}

fn cudnn_error(what: &str, e: CudnnError) -> Error {
    Error::Cuda { what: format!("cuDNN: {what}: {e:?}") }
}

/// Device addresses of one direction's three operands (see [`Dir`]).
#[derive(Clone, Copy)]
struct Ptrs {
    x: driver_sys::CUdeviceptr,
    w: driver_sys::CUdeviceptr,
    y: driver_sys::CUdeviceptr,
}

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

/// A conv layer's cuDNN descriptors for one batch size: x (N, C, H, W), y (N, OC, OH, OW), w
/// (OC, C, kh, kw), all NCHW f32, and the convolution (cross-correlation, as PyTorch's).
struct Descs {
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
}

impl Descs {
    fn new(step: &Step, batch: usize, tf32: bool) -> Result<Descs, CudnnError> {
        use sys::cudnnDataType_t::CUDNN_DATA_FLOAT as F32;
        use sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW as NCHW;
        let g = conv_geometry(step);
        let int = |v: usize| i32::try_from(v).map_err(|_| CudnnError(sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED));
        let (n, c, h, w) = (int(batch)?, int(g.in_channels)?, int(g.height)?, int(g.width)?);
        let (oc, oh, ow) = (int(g.out_channels)?, int(g.out_height)?, int(g.out_width)?);
        let (kh, kw, sh, sw, ph, pw) =
            (int(g.kernel.0)?, int(g.kernel.1)?, int(g.stride.0)?, int(g.stride.1)?, int(g.padding.0)?, int(g.padding.1)?);
        // Owned from here, so that an error below destroys what was made.
        let mut d = Descs { x: std::ptr::null_mut(), y: std::ptr::null_mut(), w: std::ptr::null_mut(), conv: std::ptr::null_mut() };
        let math = if tf32 { sys::cudnnMathType_t::CUDNN_DEFAULT_MATH } else { sys::cudnnMathType_t::CUDNN_FMA_MATH };
        // SAFETY: each descriptor is created before it is set, and owned by `d`.
        unsafe {
            d.x = dnn::create_tensor_descriptor()?;
            dnn::set_tensor4d_descriptor(d.x, NCHW, F32, [n, c, h, w])?;
            d.y = dnn::create_tensor_descriptor()?;
            dnn::set_tensor4d_descriptor(d.y, NCHW, F32, [n, oc, oh, ow])?;
            d.w = dnn::create_filter_descriptor()?;
            dnn::set_filter4d_descriptor(d.w, F32, NCHW, [oc, c, kh, kw])?;
            d.conv = dnn::create_convolution_descriptor()?;
            let mode = sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION;
            dnn::set_convolution2d_descriptor(d.conv, ph, pw, sh, sw, 1, 1, mode, F32)?;
            dnn::set_convolution_math_type(d.conv, math)?;
            // cuDNN must see the output shape the plan has.
            let mut dims = [0i32; 4];
            let [dn, dc, dh, dw] = &mut dims;
            sys::cudnnGetConvolution2dForwardOutputDim(d.conv, d.x, d.w, dn, dc, dh, dw).result()?;
            if dims != [n, oc, oh, ow] {
                return Err(CudnnError(sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED));
            }
        }
        Ok(d)
    }
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each made in `new` (or still null), destroyed once.
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.y.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.y);
            }
            if !self.w.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
        }
    }
}

/// One direction of one layer: which path runs it, and what was measured to decide.
#[derive(Clone, Copy, Debug)]
struct Choice {
    /// Measured (or found not needed); until then flatnn's kernels would run it.
    decided: bool,
    /// False for the input gradient of a layer reading the model's inputs.
    needed: bool,
    /// cuDNN's best algorithm that fits (by `cudnnFind*AlgorithmEx`), if any.
    algo: Option<u32>,
    use_cudnn: bool,
    /// Per call, in a graph: flatnn's kernels, cuDNN (NaN where not measured).
    own_us: f32,
    cudnn_us: f32,
}

impl Default for Choice {
    fn default() -> Self {
        Choice { decided: false, needed: true, algo: None, use_cudnn: false, own_us: f32::NAN, cudnn_us: f32::NAN }
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

/// The conv layers' descriptors and choices for one batch size and arithmetic.
struct Setup {
    batch: usize,
    tf32: bool,
    layers: Vec<LayerSetup>,
}

/// A cuDNN handle, destroyed with its owner.
struct Handle(sys::cudnnHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        let _exclusive = super::device_wide();
        // SAFETY: created in `Cudnn::new`, destroyed once, after the owner waited for its stream.
        let _ = unsafe { dnn::destroy_handle(self.0) };
    }
}

/// cuDNN for one cache. Fields drop in order: descriptors, handle, then workspace.
struct Cudnn {
    setups: Vec<Setup>,
    /// Next setup replaced when `SLOTS` are kept.
    next: usize,
    /// The setup the last `prepare` picked: the one the calls of the step being run use.
    current: Option<usize>,
    handle: Handle,
    workspace: DevBuf<u8>,
    stream: Arc<CudaStream>,
    gpu: Arc<Gpu>,
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        // The handle and workspace may still be used by queued work.
        if self.gpu.bind().is_ok() {
            let _ = self.stream.synchronize();
        }
    }
}

/// A cache's convolutions: cuDNN where it is used, and what to report.
pub(crate) struct Dnn {
    cudnn: Option<Cudnn>,
    mode: Mode,
    /// First line of the report: cuDNN's version, or why it is not used.
    header: String,
}

// SAFETY: a cuDNN handle and descriptors may be used from any thread, one at a time; `Dnn` is
// used through its cache (`&mut` to change it), which one thread runs at a time.
unsafe impl Send for Dnn {}

impl Dnn {
    /// For a cache of `capacity` samples of `plan`, on `stream`. Never fails: where cuDNN is
    /// missing, refused by `FLATNN_CUDNN`, or fails to set up, every convolution runs on
    /// flatnn's kernels and the report says why.
    pub fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>, tf32: bool, plan: &Plan, capacity: usize) -> Dnn {
        let mode = Mode::from_env();
        let off = |why: String| Dnn { cudnn: None, mode, header: format!("cuDNN not used ({why}): flatnn's kernels") };
        if conv_steps(plan).next().is_none() {
            return Dnn { cudnn: None, mode, header: String::new() };
        }
        if mode == Mode::Own {
            return off("FLATNN_CUDNN=0".into());
        }
        let Some(version) = cudnn_version() else { return off("no cuDNN 9 library found".into()) };
        match guarded_result(|| Cudnn::new(gpu, stream, tf32, plan, capacity)) {
            Ok(cudnn) => {
                let (major, minor, patch) = (version / 10000, version / 100 % 100, version % 100);
                let header = format!(
                    "cuDNN {major}.{minor}.{patch}, FLATNN_CUDNN={}, workspace {} KiB",
                    mode.name(),
                    cudnn.workspace.len().div_ceil(1024)
                );
                Dnn { cudnn: Some(cudnn), mode, header }
            }
            Err(e) => off(format!("setting it up failed: {e}")),
        }
    }

    /// Moves the handle to `stream` (after the work queued on its old one); a no-op when it is
    /// there.
    pub fn rebind(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        match &mut self.cudnn {
            Some(c) if !Arc::ptr_eq(&c.stream, stream) => {
                c.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
                c.gpu.bind()?;
                // SAFETY: a live handle and a live stream of its context.
                unsafe { dnn::set_stream(c.handle.0, stream.cu_stream() as _) }.map_err(|e| cudnn_error("binding the stream", e))?;
                c.stream = Arc::clone(stream);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Readies the convolutions of a step on `f.batch` samples (and their backward with `b`):
    /// the first time a batch size (or TF32 setting) runs, makes its descriptors and measures
    /// both paths; later, only picks that setup. Call it before the step is run or captured,
    /// on the model's stream (after [`Dnn::rebind`]); it may wait for the device.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare(
        &mut self,
        gpu: &Gpu,
        blas: &Blas,
        stream: &CudaStream,
        plan: &Plan,
        f: &Forward,
        b: Option<&Backward>,
        tf32: bool,
    ) -> Result<()> {
        let mode = self.mode;
        let Some(c) = &mut self.cudnn else { return Ok(()) };
        let index = match c.setups.iter().position(|s| s.batch == f.batch && s.tf32 == tf32) {
            Some(index) => index,
            None => c.add_setup(plan, f.batch, tf32),
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
                    c.decide(mode, layer, dir, gpu, blas, stream, plan, f, b, tf32)?;
                }
            }
            Ok(())
        })();
        c.setups[index].layers = layers;
        outcome
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

    fn run_chosen(&self, dir: Dir, index: usize, plan: &Plan, f: &Forward, b: Option<&Backward>) -> Result<bool> {
        let Some(c) = &self.cudnn else { return Ok(false) };
        let Some(setup) = c.current.and_then(|i| c.setups.get(i)) else { return Ok(false) };
        // descriptors made for another batch must never run on this one
        debug_assert_eq!(setup.batch, f.batch, "Dnn::prepare was not called for this batch");
        if setup.batch != f.batch {
            return Ok(false);
        }
        let Some(layer) = setup.layers.iter().find(|l| l.step == index) else { return Ok(false) };
        let choice = layer.choices[dir as usize];
        let (Some(algo), true, Some(descs)) = (choice.algo, choice.use_cudnn, &layer.descs) else { return Ok(false) };
        c.gpu.bind()?;
        let p = ptrs(dir, plan, &plan.steps[index], f, b);
        // SAFETY: descriptors of this layer and batch; the operands lie inside their buffers
        // (checked by `ptrs`) and the workspace is the handle's own.
        unsafe { c.run(dir, descs, algo, p) }.map_err(|e| cudnn_error(&format!("{} of step {index}", dir.name()), e))?;
        Ok(true)
    }

    /// What runs each convolution: cuDNN's version (or why it is not used), then one line per
    /// conv layer and batch size set up, with each direction's path and the times measured.
    pub fn report(&self) -> String {
        let mut out = self.header.clone();
        let Some(c) = &self.cudnn else { return out };
        for setup in &c.setups {
            for layer in &setup.layers {
                let arith = if setup.tf32 { "TF32" } else { "FP32" };
                let _ = write!(out, "\nbatch {} {arith}, {}:", setup.batch, layer.label);
                for dir in [Dir::Forward, Dir::Weight, Dir::Input] {
                    let ch = layer.choices[dir as usize];
                    let _ = write!(out, " {} ", dir.name());
                    let cudnn = |algo: Option<u32>| algo.map_or("cudnn -".to_string(), |a| format!("cudnn {}", dir.algo_name(a)));
                    if !ch.decided {
                        out.push_str("not measured yet;");
                    } else if !ch.needed {
                        out.push_str("not needed;");
                    } else if ch.use_cudnn {
                        let _ = write!(out, "{} {:.1} µs (own {:.1} µs);", cudnn(ch.algo), ch.cudnn_us, ch.own_us);
                    } else {
                        let _ = write!(out, "own {:.1} µs ({} {:.1} µs);", ch.own_us, cudnn(ch.algo), ch.cudnn_us);
                    }
                }
                if !layer.note.is_empty() {
                    let _ = write!(out, " note: {}", layer.note);
                }
            }
        }
        out
    }
}

impl Cudnn {
    fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>, tf32: bool, plan: &Plan, capacity: usize) -> Result<Cudnn> {
        gpu.bind()?;
        let handle = {
            let _exclusive = super::device_wide();
            Handle(dnn::create_handle().map_err(|e| cudnn_error("creating a handle", e))?)
        };
        // SAFETY: a live handle and a live stream of the current context.
        unsafe { dnn::set_stream(handle.0, stream.cu_stream() as _) }.map_err(|e| cudnn_error("binding the stream", e))?;
        // The workspace: the most any layer and direction needs at the capacity, over the
        // algorithms cuDNN's heuristics offer within the cap.
        let mut bytes = 0;
        for step in conv_steps(plan) {
            let Ok(descs) = Descs::new(step, capacity, tf32) else { continue };
            for dir in [Dir::Forward, Dir::Weight, Dir::Input] {
                let mut perf = [Perf::default(); PERFS];
                // SAFETY: a live handle and descriptors; `perf` holds PERFS results.
                let Ok(n) = (unsafe { heuristics(handle.0, dir, &descs, &mut perf) }) else { continue };
                let fits = perf[..n].iter().filter(|p| p.usable(dir, WORKSPACE_CAP, tf32));
                bytes = fits.map(|p| p.memory).fold(bytes, usize::max);
            }
        }
        let workspace = DevBuf::zeros(gpu, stream, bytes)?;
        Ok(Cudnn {
            setups: Vec::with_capacity(SLOTS),
            next: 0,
            current: None,
            handle,
            workspace,
            stream: Arc::clone(stream),
            gpu: Arc::clone(gpu),
        })
    }

    /// A new setup for (batch, tf32), nothing measured yet; its index.
    fn add_setup(&mut self, plan: &Plan, batch: usize, tf32: bool) -> usize {
        let layers = plan
            .steps
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s.layer, crate::chain::Layer::Conv { .. }))
            .map(|(index, step)| {
                let g = conv_geometry(step);
                let label = format!(
                    "step {index} conv {}→{} {}×{} stride {}×{} pad {}×{} on {}×{}",
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
                let (descs, note) = match Descs::new(step, batch, tf32) {
                    Ok(d) => (Some(d), String::new()),
                    Err(e) => (None, format!("cuDNN refused the descriptors: {e:?}")),
                };
                LayerSetup { step: index, label, descs, choices: [Choice::default(); 3], note }
            })
            .collect();
        let setup = Setup { batch, tf32, layers };
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

    /// Finds cuDNN's best algorithm for `dir` of `layer`, times it and flatnn's kernels, and
    /// records the choice. A cuDNN failure leaves flatnn's kernels chosen (with a note); a
    /// failure of flatnn's kernels is an error.
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &self,
        mode: Mode,
        layer: &mut LayerSetup,
        dir: Dir,
        gpu: &Gpu,
        blas: &Blas,
        stream: &CudaStream,
        plan: &Plan,
        f: &Forward,
        b: Option<&Backward>,
        tf32: bool,
    ) -> Result<()> {
        let step = &plan.steps[layer.step];
        let own = || match dir {
            Dir::Forward => exec::conv_forward_own(gpu, blas, stream, plan, step, f),
            Dir::Weight => exec::conv_weight_grad_own(gpu, blas, stream, plan, step, f, b.expect("gradients")),
            Dir::Input => exec::conv_input_grad_own(gpu, blas, stream, plan, step, f, b.expect("gradients")),
        };
        let mut choice = Choice { decided: true, own_us: time_in_graph(gpu, stream, &own)?, ..Choice::default() };
        if let Some(descs) = &layer.descs {
            let p = ptrs(dir, plan, step, f, b);
            gpu.bind()?;
            // SAFETY: descriptors of this layer and batch; operands inside their buffers.
            match unsafe { self.find(dir, descs, p, tf32) } {
                Ok(Some(algo)) => {
                    // SAFETY: as above, with an algorithm cuDNN found for them.
                    let run = || unsafe { self.run(dir, descs, algo, p) }.map_err(|e| cudnn_error(dir.name(), e));
                    match time_in_graph(gpu, stream, &run) {
                        Ok(us) => {
                            choice.algo = Some(algo);
                            choice.cudnn_us = us;
                            choice.use_cudnn = mode == Mode::Cudnn || us < choice.own_us;
                        }
                        Err(e) => note(&mut layer.note, dir, &format!("{} failed: {e}", dir.algo_name(algo))),
                    }
                }
                Ok(None) => note(&mut layer.note, dir, "no algorithm fits"),
                Err(e) => note(&mut layer.note, dir, &format!("finding an algorithm failed: {e:?}")),
            }
        }
        layer.choices[dir as usize] = choice;
        Ok(())
    }

    /// cuDNN's fastest usable algorithm for `dir`, measured by cuDNN on the operands (which
    /// it overwrites: y, dw or dx).
    ///
    /// # Safety
    /// `d` live and made for the operands' shapes; `p` inside live buffers.
    unsafe fn find(&self, dir: Dir, d: &Descs, p: Ptrs, tf32: bool) -> Result<Option<u32>, CudnnError> {
        let (h, ws, ws_len) = (self.handle.0, self.workspace.ptr() as *mut c_void, self.workspace.len());
        let (x, w, y) = (p.x as *mut c_void, p.w as *mut c_void, p.y as *mut c_void);
        let mut perf = [Perf::default(); PERFS];
        let mut n = 0i32;
        let out = perf.as_mut_ptr();
        let requested = PERFS as i32;
        // Find* runs every algorithm and waits for the device.
        let _exclusive = super::device_wide();
        // SAFETY: the caller's contract; `perf` has room for `requested` results of this
        // layout (checked above), and the workspace holds `ws_len` bytes.
        unsafe {
            match dir {
                Dir::Forward => sys::cudnnFindConvolutionForwardAlgorithmEx(
                    h,
                    d.x,
                    x,
                    d.w,
                    w,
                    d.conv,
                    d.y,
                    y,
                    requested,
                    &mut n,
                    out.cast(),
                    ws,
                    ws_len,
                ),
                Dir::Weight => sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                    h,
                    d.x,
                    x,
                    d.y,
                    y,
                    d.conv,
                    d.w,
                    w,
                    requested,
                    &mut n,
                    out.cast(),
                    ws,
                    ws_len,
                ),
                Dir::Input => sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                    h,
                    d.w,
                    w,
                    d.y,
                    y,
                    d.conv,
                    d.x,
                    x,
                    requested,
                    &mut n,
                    out.cast(),
                    ws,
                    ws_len,
                ),
            }
            .result()?;
        }
        let n = (n.max(0) as usize).min(PERFS);
        // sorted fastest first
        Ok(perf[..n].iter().find(|r| r.usable(dir, ws_len, tf32)).map(|r| r.algo))
    }

    /// Queues `dir` with `algo` on the handle's stream: α = 1, β = 0 (the output overwritten).
    ///
    /// # Safety
    /// As [`Cudnn::find`], with an algorithm found for these descriptors.
    unsafe fn run(&self, dir: Dir, d: &Descs, algo: u32, p: Ptrs) -> Result<(), CudnnError> {
        let (h, ws, ws_len) = (self.handle.0, self.workspace.ptr() as *mut c_void, self.workspace.len());
        let (one, zero) = (1.0f32, 0.0f32);
        let (alpha, beta) = (&one as *const f32 as *const c_void, &zero as *const f32 as *const c_void);
        // SAFETY: the caller's contract; α and β are host values read during the call.
        unsafe {
            match dir {
                Dir::Forward => dnn::convolution_forward(
                    h,
                    alpha,
                    d.x,
                    p.x as *const c_void,
                    d.w,
                    p.w as *const c_void,
                    d.conv,
                    fwd_algo(algo),
                    ws,
                    ws_len,
                    beta,
                    d.y,
                    p.y as *mut c_void,
                ),
                Dir::Weight => dnn::convolution_backward_filter(
                    h,
                    alpha,
                    d.x,
                    p.x as *const c_void,
                    d.y,
                    p.y as *const c_void,
                    d.conv,
                    filter_algo(algo),
                    ws,
                    ws_len,
                    beta,
                    d.w,
                    p.w as *mut c_void,
                ),
                Dir::Input => dnn::convolution_backward_data(
                    h,
                    alpha,
                    d.w,
                    p.w as *const c_void,
                    d.y,
                    p.y as *const c_void,
                    d.conv,
                    data_algo(algo),
                    ws,
                    ws_len,
                    beta,
                    d.x,
                    p.x as *mut c_void,
                ),
            }
        }
    }
}

/// cuDNN's heuristic ranking for `dir` (nothing is run); the number of results in `perf`.
///
/// # Safety
/// A live handle and descriptors.
unsafe fn heuristics(h: sys::cudnnHandle_t, dir: Dir, d: &Descs, perf: &mut [Perf; PERFS]) -> Result<usize, CudnnError> {
    let mut n = 0i32;
    let (out, requested) = (perf.as_mut_ptr(), PERFS as i32);
    // SAFETY: the caller's contract; `perf` has room for `requested` results of this layout.
    unsafe {
        match dir {
            Dir::Forward => sys::cudnnGetConvolutionForwardAlgorithm_v7(h, d.x, d.w, d.conv, d.y, requested, &mut n, out.cast()),
            Dir::Weight => sys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, d.x, d.y, d.conv, d.w, requested, &mut n, out.cast()),
            Dir::Input => sys::cudnnGetConvolutionBackwardDataAlgorithm_v7(h, d.w, d.y, d.conv, d.x, requested, &mut n, out.cast()),
        }
        .result()?;
    }
    Ok((n.max(0) as usize).min(PERFS))
}

fn note(notes: &mut String, dir: Dir, what: &str) {
    if !notes.is_empty() {
        notes.push_str("; ");
    }
    let _ = write!(notes, "{}: {what}", dir.name());
}

/// Microseconds per call of `work` as a step runs it: `work` run twice eagerly (so that any
/// lazy set-up happens outside a capture), captured `REPS` times into a graph, and the median
/// of `SAMPLES` replays after one more. `work` must only enqueue on `stream`.
fn time_in_graph(gpu: &Gpu, stream: &CudaStream, work: &dyn Fn() -> Result<()>) -> Result<f32> {
    work()?;
    work()?;
    stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
    let exec = graph::capture(stream.cu_stream(), || (0..REPS).try_for_each(|_| work()))?;
    exec.launch(stream)?;
    gpu.bind()?;
    let (start, end) = (TimingEvent::new()?, TimingEvent::new()?);
    let mut samples = [0f32; SAMPLES];
    for sample in &mut samples {
        start.record(stream)?;
        exec.launch(stream)?;
        end.record(stream)?;
        // SAFETY: live events, both recorded on `stream`; the host waits for the second.
        let ms = unsafe { driver::event::synchronize(end.0).and_then(|()| driver::event::elapsed(start.0, end.0)) }
            .map_err(|e| driver_error("timing a convolution", e))?;
        *sample = ms * 1000.0 / REPS as f32;
    }
    samples.sort_by(f32::total_cmp);
    Ok(samples[SAMPLES / 2])
}

/// An event that records time (flatnn's other events do not).
struct TimingEvent(driver_sys::CUevent);

impl TimingEvent {
    fn new() -> Result<TimingEvent> {
        let event = driver::event::create(driver_sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| driver_error("creating an event", e))?;
        Ok(TimingEvent(event))
    }

    fn record(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: a live event and stream of the current context.
        unsafe { driver::event::record(self.0, stream.cu_stream()) }.map_err(|e| driver_error("recording an event", e))
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once (the driver waits for a pending record).
        let _ = unsafe { driver::event::destroy(self.0) };
    }
}
