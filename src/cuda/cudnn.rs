//! The few cuDNN calls flatnn makes, over cudarc's raw bindings: finding the library, a handle,
//! a convolution's descriptors, finding, ranking and running its algorithms. When to use them
//! is `dnn.rs`'s business.
//!
//! Everything is plain FP32 NCHW cross-correlation with PyTorch's weight layout (OC, C, kh, kw);
//! α = 1 and β = 0, so outputs are overwritten. Nothing here allocates device memory: the
//! caller passes the workspace.

use super::buffer::DevBuf;
use super::context::Gpu;
use super::options::GpuOptions;
use super::{driver_error, guarded_result};
use crate::chain::Step;
use crate::error::{Error, Result};
use crate::layers::conv;
use cudarc::cudnn::result::{self as dnn, CudnnError};
use cudarc::cudnn::sys;
use cudarc::driver::{sys as driver_sys, CudaStream};
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// Every cuDNN function flatnn calls: cudarc looks each up the first time it is called and
/// panics where it is missing, so their presence is checked before cuDNN is used at all.
const FUNCTIONS: [&str; 21] = [
    "cudnnGetVersion",
    "cudnnCreate",
    "cudnnDestroy",
    "cudnnSetStream",
    "cudnnCreateTensorDescriptor",
    "cudnnSetTensor4dDescriptor",
    "cudnnDestroyTensorDescriptor",
    "cudnnCreateFilterDescriptor",
    "cudnnSetFilter4dDescriptor",
    "cudnnDestroyFilterDescriptor",
    "cudnnCreateConvolutionDescriptor",
    "cudnnSetConvolution2dDescriptor",
    "cudnnSetConvolutionMathType",
    "cudnnDestroyConvolutionDescriptor",
    "cudnnGetConvolution2dForwardOutputDim",
    "cudnnFindConvolutionForwardAlgorithmEx",
    "cudnnFindConvolutionBackwardFilterAlgorithmEx",
    "cudnnFindConvolutionBackwardDataAlgorithmEx",
    "cudnnConvolutionForward",
    "cudnnConvolutionBackwardFilter",
    "cudnnConvolutionBackwardData",
];

/// cuDNN's version (e.g. 90300 for 9.3.0) where a cuDNN 9 library with every function flatnn
/// calls loads here, else `None`. Probed once per process; never panics.
pub fn cudnn_version() -> Option<usize> {
    static VERSION: OnceLock<Option<usize>> = OnceLock::new();
    *VERSION.get_or_init(|| {
        // SAFETY: only tries to open the library, then closes it (cudarc's loader would panic
        // where it is missing).
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        // SAFETY: the library is present (above); looking a symbol up runs nothing.
        let lib = guarded_result(|| Ok(unsafe { sys::culib() })).ok()?;
        // SAFETY: as above; the symbols are only looked up, never called through this type.
        let missing = FUNCTIONS.iter().any(|f| unsafe { lib.get::<*const c_void>(f.as_bytes()) }.is_err());
        if missing {
            return None;
        }
        guarded_result(|| Ok(dnn::get_version())).ok().filter(|v| (90000..100000).contains(v))
    })
}

/// `Error::Cuda` for a cuDNN call that failed while doing `what`, naming cuDNN's status.
pub(super) fn cudnn_error(what: &str, e: CudnnError) -> Error {
    Error::Cuda { what: format!("cuDNN: {what}: {e:?}") }
}

/// The three products of a convolution. Pointers by direction (see [`Ptrs`]): forward reads x
/// and w, writes y (= z); weight gradient reads x and dy, writes dw; input gradient reads w and
/// dy, writes dx.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dir {
    Forward = 0,
    Weight = 1,
    Input = 2,
}

impl Dir {
    /// The direction's name in reports and errors: "forward", "weight grad", "input grad".
    pub fn name(self) -> &'static str {
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

    /// True for the algorithms that compute each output as a plain sum of products (GEMM-like,
    /// direct), not through FFTs or Winograd transforms.
    pub fn exact(self, algo: u32) -> bool {
        use sys::cudnnConvolutionBwdDataAlgo_t as D;
        use sys::cudnnConvolutionBwdFilterAlgo_t as W;
        use sys::cudnnConvolutionFwdAlgo_t as F;
        let exact: &[u32] = match self {
            Dir::Forward => &[
                F::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM as u32,
                F::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM as u32,
                F::CUDNN_CONVOLUTION_FWD_ALGO_GEMM as u32,
                F::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT as u32,
            ],
            Dir::Weight => &[
                W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 as u32,
                W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 as u32,
                W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3 as u32,
            ],
            Dir::Input => &[D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 as u32, D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1 as u32],
        };
        exact.contains(&algo)
    }

    /// The algorithm's name as cuDNN spells it, less the common prefix.
    pub fn algo_name(self, algo: u32) -> String {
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
    /// Succeeded, fits in `workspace` bytes, a product-based algorithm, of a math type flatnn
    /// accepts (see [`math_type`]), and deterministic where `deterministic`. With it, flatnn
    /// promises the same bits for the same inputs and choice (atomics would break it); either
    /// way FP32 accuracy (FFT and Winograd algorithms were measured to move 20 LeNet training
    /// steps ~1e-3 away from the CPU's, against ~1e-7).
    fn usable(&self, dir: Dir, workspace: usize, tf32: bool, deterministic: bool) -> bool {
        self.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS as u32
            && dir.exact(self.algo)
            && self.memory <= workspace
            && (!deterministic || self.is_deterministic())
            && math_type(self.math_type, tf32).is_some()
    }

    fn is_deterministic(&self) -> bool {
        self.determinism == sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC as u32
    }

    /// The result as the report names it where nothing was usable: the algorithm, and what
    /// of status, determinism, math type and workspace kept it out.
    fn describe(&self, dir: Dir, workspace: usize) -> String {
        let mut out = dir.algo_name(self.algo);
        if !dir.exact(self.algo) {
            out.push_str(" (not a product)");
        }
        if self.status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS as u32 {
            out.push_str(&format!(" status {}", self.status));
        }
        if !self.is_deterministic() {
            out.push_str(" atomic");
        }
        if self.math_type != sys::cudnnMathType_t::CUDNN_FMA_MATH as u32 {
            out.push_str(&format!(" math {}", self.math_type));
        }
        if self.memory > workspace {
            out.push_str(&format!(" {} KiB", self.memory.div_ceil(1024)));
        }
        out
    }
}

/// The math type a perf result reports, where flatnn runs it: FMA (plain FP32) always; with
/// `tf32`, also DEFAULT and TENSOR_OP (TF32 tensor cores). Never TENSOR_OP_MATH_ALLOW_CONVERSION
/// (it may convert FP32 operands to FP16), nor DEFAULT without `tf32`: cuDNN documents that
/// DEFAULT permits TF32 tensor cores on A100 and later devices.
fn math_type(value: u32, tf32: bool) -> Option<sys::cudnnMathType_t> {
    use sys::cudnnMathType_t::{CUDNN_DEFAULT_MATH as DEFAULT, CUDNN_FMA_MATH as FMA, CUDNN_TENSOR_OP_MATH as TENSOR_OP};
    match value {
        v if v == FMA as u32 => Some(FMA),
        v if tf32 && v == DEFAULT as u32 => Some(DEFAULT),
        v if tf32 && v == TENSOR_OP as u32 => Some(TENSOR_OP),
        _ => None,
    }
}

/// A cuDNN algorithm of one direction and the math type it was found (and timed) with, which
/// [`Handle::run`] sets on the convolution descriptor, so that the kernel run is the one timed;
/// and whether cuDNN reported it deterministic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Algo {
    pub id: u32,
    pub math: sys::cudnnMathType_t,
    pub deterministic: bool,
}

impl Algo {
    /// The algorithm's name (see [`Dir::algo_name`]), its math type where it is not FMA, and
    /// "(non-deterministic)" where it is not deterministic.
    pub fn name(self, dir: Dir) -> String {
        let mut name = dir.algo_name(self.id);
        if self.math != sys::cudnnMathType_t::CUDNN_FMA_MATH {
            name = format!("{name} ({})", format!("{:?}", self.math).trim_start_matches("CUDNN_"));
        }
        if !self.deterministic {
            name.push_str(" (non-deterministic)");
        }
        name
    }
}

/// Device addresses of one direction's three operands (see [`Dir`]).
#[derive(Clone, Copy)]
pub(super) struct Ptrs {
    pub x: driver_sys::CUdeviceptr,
    pub w: driver_sys::CUdeviceptr,
    pub y: driver_sys::CUdeviceptr,
}

/// A conv layer's cuDNN descriptors for one batch size: x (N, C, H, W), y (N, OC, OH, OW), w
/// (OC, C, kh, kw), all NCHW f32, and the convolution (cross-correlation, as PyTorch's).
pub(super) struct Descs {
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
}

impl Descs {
    /// The descriptors of conv layer `step` for `batch` samples (the math type is set per call:
    /// [`Handle::find`], [`Handle::run`]). An error (for the report) where a dimension exceeds
    /// cuDNN's i32, where cuDNN refuses a descriptor, or where cuDNN's output shape is not the
    /// plan's.
    pub fn new(step: &Step, batch: usize) -> Result<Descs, String> {
        use sys::cudnnDataType_t::CUDNN_DATA_FLOAT as F32;
        use sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW as NCHW;
        let g = conv::geometry(step);
        let dims = [
            batch,
            g.in_channels,
            g.height,
            g.width,
            g.out_channels,
            g.out_height,
            g.out_width,
            g.kernel.0,
            g.kernel.1,
            g.stride.0,
            g.stride.1,
            g.padding.0,
            g.padding.1,
            g.dilation.0,
            g.dilation.1,
        ];
        let mut int = [0i32; 15];
        for (to, &from) in int.iter_mut().zip(&dims) {
            *to = i32::try_from(from).map_err(|_| {
                format!(
                    "a dimension exceeds cuDNN's 32-bit integers: batch {batch}, {}×{}×{} → {}×{}×{}, kernel {}×{}",
                    g.in_channels, g.height, g.width, g.out_channels, g.out_height, g.out_width, g.kernel.0, g.kernel.1
                )
            })?;
        }
        let [n, c, h, w, oc, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw] = int;
        let refused = |e: CudnnError| format!("cuDNN refused the descriptors: {e:?}");
        // Owned from here, so that an error below destroys what was made.
        let mut d = Descs { x: std::ptr::null_mut(), y: std::ptr::null_mut(), w: std::ptr::null_mut(), conv: std::ptr::null_mut() };
        let mut out = [0i32; 4];
        // SAFETY: each descriptor is created before it is set, and owned by `d`.
        unsafe {
            d.x = dnn::create_tensor_descriptor().map_err(refused)?;
            dnn::set_tensor4d_descriptor(d.x, NCHW, F32, [n, c, h, w]).map_err(refused)?;
            d.y = dnn::create_tensor_descriptor().map_err(refused)?;
            dnn::set_tensor4d_descriptor(d.y, NCHW, F32, [n, oc, oh, ow]).map_err(refused)?;
            d.w = dnn::create_filter_descriptor().map_err(refused)?;
            dnn::set_filter4d_descriptor(d.w, F32, NCHW, [oc, c, kh, kw]).map_err(refused)?;
            d.conv = dnn::create_convolution_descriptor().map_err(refused)?;
            let mode = sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION;
            dnn::set_convolution2d_descriptor(d.conv, ph, pw, sh, sw, dh, dw, mode, F32).map_err(refused)?;
            dnn::set_convolution_math_type(d.conv, sys::cudnnMathType_t::CUDNN_FMA_MATH).map_err(refused)?;
            let [dn, dc, dh, dw] = &mut out;
            sys::cudnnGetConvolution2dForwardOutputDim(d.conv, d.x, d.w, dn, dc, dh, dw).result().map_err(refused)?;
        }
        // cuDNN must see the output shape the plan has.
        if out != [n, oc, oh, ow] {
            return Err(format!(
                "cuDNN computes an output of {}×{}×{}×{} (N×C×H×W) where the plan has {n}×{oc}×{oh}×{ow}",
                out[0], out[1], out[2], out[3]
            ));
        }
        Ok(d)
    }

    /// Sets the math type the next call with these descriptors runs with.
    fn set_math(&self, math: sys::cudnnMathType_t) -> Result<(), CudnnError> {
        // SAFETY: a live convolution descriptor (a host-side setting; nothing runs).
        unsafe { dnn::set_convolution_math_type(self.conv, math) }
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

/// A cuDNN handle bound to a stream; destroyed on drop (its owner first waits for the stream).
pub(super) struct Handle(sys::cudnnHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        let _exclusive = super::device_wide();
        // SAFETY: created in `new`, destroyed once, after the owner waited for its stream.
        let _ = unsafe { dnn::destroy_handle(self.0) };
    }
}

impl Handle {
    /// A handle whose work goes to `stream`; the caller has made the stream's context current.
    pub fn new(stream: &CudaStream) -> Result<Handle> {
        let handle = {
            let _exclusive = super::device_wide();
            Handle(dnn::create_handle().map_err(|e| cudnn_error("creating a handle", e))?)
        };
        handle.set_stream(stream)?;
        Ok(handle)
    }

    /// The raw handle, for the calls of `rnn_cudnn.rs`.
    pub fn raw(&self) -> sys::cudnnHandle_t {
        self.0
    }

    /// Sends the handle's later work to `stream` (of its context, made current by the caller).
    pub fn set_stream(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: a live handle and a live stream.
        unsafe { dnn::set_stream(self.0, stream.cu_stream() as _) }.map_err(|e| cudnn_error("binding the stream", e))
    }

    /// Moves the handle, bound to `*bound` of `gpu`, to `stream` after the work queued on
    /// `*bound`, and makes `stream` its `*bound`; a no-op when it is there already.
    pub fn move_to(&self, gpu: &Gpu, bound: &mut Arc<CudaStream>, stream: &Arc<CudaStream>) -> Result<()> {
        if Arc::ptr_eq(bound, stream) {
            return Ok(());
        }
        bound.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
        gpu.bind()?;
        self.set_stream(stream)?;
        *bound = Arc::clone(stream);
        Ok(())
    }

    /// cuDNN's `count` fastest usable algorithms for `dir` and what the report says of the
    /// others ([`choose`]), as measured by cuDNN on the operands (which it overwrites: y, dw or
    /// dx), within `workspace`. Waits for the device.
    ///
    /// With TF32, Find searches twice, with DEFAULT math (TF32 tensor cores permitted) and with
    /// FMA: a DEFAULT search may offer no deterministic product algorithm for a direction that
    /// FP32 has one for (cuDNN 9.14: every weight and input gradient of vgg_small and
    /// resnet_small), which TF32 would then run on flatnn's kernels, slower than FP32.
    ///
    /// # Safety
    /// `d` live and made for the operands' shapes; `p` inside live buffers of the handle's
    /// device, not written by other work meanwhile.
    pub unsafe fn find(
        &self,
        dir: Dir,
        d: &Descs,
        p: Ptrs,
        workspace: &DevBuf<u8>,
        options: &GpuOptions,
        count: usize,
    ) -> Result<(Vec<Algo>, String), CudnnError> {
        use sys::cudnnMathType_t::{CUDNN_DEFAULT_MATH as DEFAULT, CUDNN_FMA_MATH as FMA};
        let mut found: Vec<Perf> = Vec::new();
        let mut failed = None;
        for math in if options.tf32 { &[DEFAULT, FMA][..] } else { &[FMA][..] } {
            // SAFETY: the caller's contract.
            match unsafe { self.find_with(dir, d, p, workspace, *math) } {
                Ok(results) => found.extend(results),
                // one search failing leaves the other's results
                Err(e) => failed = Some(e),
            }
        }
        if let (true, Some(e)) = (found.is_empty(), failed) {
            return Err(e);
        }
        Ok(choose(found, dir, workspace.len(), options, count))
    }

    /// One Find search for `dir` with `math` set on the convolution: cuDNN's results, fastest
    /// first.
    ///
    /// # Safety
    /// As [`Handle::find`].
    unsafe fn find_with(
        &self,
        dir: Dir,
        d: &Descs,
        p: Ptrs,
        workspace: &DevBuf<u8>,
        math: sys::cudnnMathType_t,
    ) -> Result<Vec<Perf>, CudnnError> {
        let (h, ws, ws_len) = (self.0, workspace.ptr() as *mut c_void, workspace.len());
        let (x, w, y) = (p.x as *mut c_void, p.w as *mut c_void, p.y as *mut c_void);
        let mut perf = [Perf::default(); PERFS];
        let mut n = 0i32;
        let (out, requested) = (perf.as_mut_ptr(), PERFS as i32);
        d.set_math(math)?;
        // Find* runs every algorithm and waits for the device.
        let _exclusive = super::device_wide();
        // SAFETY: the caller's contract; `perf` has room for `requested` results of this
        // layout (checked above), and the workspace holds `ws_len` bytes.
        unsafe {
            use sys::{
                cudnnFindConvolutionBackwardDataAlgorithmEx as data, cudnnFindConvolutionBackwardFilterAlgorithmEx as filter,
                cudnnFindConvolutionForwardAlgorithmEx as forward,
            };
            match dir {
                Dir::Forward => forward(h, d.x, x, d.w, w, d.conv, d.y, y, requested, &mut n, out.cast(), ws, ws_len),
                Dir::Weight => filter(h, d.x, x, d.y, y, d.conv, d.w, w, requested, &mut n, out.cast(), ws, ws_len),
                Dir::Input => data(h, d.w, w, d.y, y, d.conv, d.x, x, requested, &mut n, out.cast(), ws, ws_len),
            }
            .result()?;
        }
        let n = (n.max(0) as usize).min(PERFS);
        Ok(perf[..n].to_vec())
    }

    /// Queues `dir` with `algo` (and its math type) on the handle's stream: α = 1, β = 0 (the
    /// output overwritten). Capturable in a CUDA graph once it has run eagerly.
    ///
    /// # Safety
    /// As [`Handle::find`], with an algorithm found for these descriptors within `workspace`.
    pub unsafe fn run(&self, dir: Dir, d: &Descs, algo: Algo, p: Ptrs, workspace: &DevBuf<u8>) -> Result<(), CudnnError> {
        d.set_math(algo.math)?;
        let (h, ws, ws_len, algo) = (self.0, workspace.ptr() as *mut c_void, workspace.len(), algo.id);
        let (one, zero) = (1.0f32, 0.0f32);
        let (alpha, beta) = (&one as *const f32 as *const c_void, &zero as *const f32 as *const c_void);
        let (x, w, y) = (p.x as *mut c_void, p.w as *mut c_void, p.y as *mut c_void);
        // SAFETY: the caller's contract; α and β are host values read during the call.
        unsafe {
            match dir {
                Dir::Forward => dnn::convolution_forward(h, alpha, d.x, x, d.w, w, d.conv, fwd_algo(algo), ws, ws_len, beta, d.y, y),
                Dir::Weight => {
                    dnn::convolution_backward_filter(h, alpha, d.x, x, d.y, y, d.conv, filter_algo(algo), ws, ws_len, beta, d.w, w)
                }
                Dir::Input => dnn::convolution_backward_data(h, alpha, d.w, w, d.y, y, d.conv, data_algo(algo), ws, ws_len, beta, d.x, x),
            }
        }
    }
}

/// Of the results of cuDNN's searches (`found`), the `count` fastest usable ones (see
/// [`Perf::usable`]), fastest first, an algorithm offered by both searches under one math type
/// once; and, for the report, what cuDNN offered where none is usable, else the fastest result
/// it timed faster than every usable one (an atomic or FFT algorithm, one needing more
/// workspace), if any.
fn choose(mut found: Vec<Perf>, dir: Dir, ws_len: usize, options: &GpuOptions, count: usize) -> (Vec<Algo>, String) {
    let (tf32, deterministic) = (options.tf32, options.deterministic);
    // fastest first; an algorithm offered by both searches under the same math type once
    found.sort_by(|a, b| a.time.total_cmp(&b.time));
    let mut algos: Vec<Algo> = Vec::new();
    for r in found.iter().filter(|r| r.usable(dir, ws_len, tf32, deterministic)) {
        let Some(math) = math_type(r.math_type, tf32) else { continue };
        let algo = Algo { id: r.algo, math, deterministic: r.is_deterministic() };
        if !algos.iter().any(|a| a.id == algo.id && a.math == algo.math) {
            algos.push(algo);
        }
    }
    algos.truncate(count);
    let usable = |r: &Perf| r.usable(dir, ws_len, tf32, deterministic);
    let offered = match algos.is_empty() {
        true => found.iter().map(|r| r.describe(dir, ws_len)).collect::<Vec<_>>().join(", "),
        // the fastest result that ran but is not taken, where cuDNN timed it faster than
        // every usable one (what the rules cost here: a report that says why a cell is red)
        false => {
            let best = found.iter().find(|r| usable(r)).map_or(f32::INFINITY, |r| r.time);
            let success = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS as u32;
            match found.iter().find(|r| r.status == success && !usable(r) && r.time < best) {
                Some(r) => {
                    format!("{} {:.1} µs in cuDNN's search, the fastest taken {:.1}", r.describe(dir, ws_len), r.time * 1e3, best * 1e3)
                }
                None => String::new(),
            }
        }
    };
    (algos, offered)
}

#[cfg(test)]
mod tests;
