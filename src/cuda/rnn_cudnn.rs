//! The cuDNN RNN calls flatnn makes, over cudarc's raw bindings: one GRU or LSTM layer's
//! descriptors for a batch size and an algorithm, where its tensors lie in cuDNN's weight space,
//! the sizes of its work and reserve spaces, and the forward and backward calls. When to use them
//! (and which algorithm) is `rnn_dnn.rs`'s business.
//!
//! The layer is cuDNN's one-layer, one-direction `CUDNN_GRU` or `CUDNN_LSTM` with both biases
//! (`CUDNN_RNN_DOUBLE_BIAS`, so a GRU's n = tanh(W_in x + b_in + r ∘ (W_hn h + b_hn)), PyTorch's),
//! FP32 data, and its inputs and outputs sequence-major, as PyTorch gives them: x (steps, batch,
//! features), y (steps, batch, hidden); h and c packed (1, batch, hidden). Every sequence is
//! `steps` long, so cuDNN's packed and unpacked sequence-major layouts are the same memory; the
//! standard algorithm is given the packed one with padded I/O off, the persistent one the
//! unpacked one with padded I/O on (PyTorch's settings for each: the persistent algorithms take
//! no sequences of different lengths, which the packed layout is for). The batch-major layout,
//! flatnn's own, sent cuDNN down a path several times slower at small batches; the route
//! transposes instead. Its gates, in cuDNN's linear-layer order, are PyTorch's: a GRU's r, z, n,
//! an LSTM's i, f, g, o, and each gate's matrix is (hidden, inputs) row-major, as PyTorch's rows
//! of that gate.
//!
//! The algorithms ([`Algo`]; cuDNN's `cudnnRNNAlgo_t`): standard (a sequence of operations per
//! step), and the persistent one for small hidden sizes (up to 192 units in inference, 128 in
//! training for a GRU or LSTM, by PyTorch's rule), which keeps the recurrent weights on chip
//! across the steps (the one PyTorch picks for FP32). cuDNN's other persistent algorithms,
//! static and dynamic, were candidates too and never won: many times slower than the small
//! one in every layer the GPU tests measure (cuDNN 9.14), and the dynamic one, compiled by
//! cuDNN with NVRTC per batch, took seconds of a first call. Which algorithm cuDNN takes depends
//! on the device, the sizes and the math type; one it refuses is not used. Each algorithm's descriptor gives its own offsets in the weight space
//! (`Descs::weight_parts`), so the copies never assume the layouts agree; the sizes of the
//! spaces are checked against those the buffers were made for.

use super::cudnn::{cudnn_error, cudnn_version, Handle};
use super::guarded_result;
use super::options::RnnAlgos;
use crate::error::{Error, Result};
use crate::layers::recurrent::{Cell, Dims};
use cudarc::cudnn::result::CudnnError;
use cudarc::cudnn::sys;
use cudarc::driver::sys as driver_sys;
use std::ffi::c_void;
use std::sync::OnceLock;

/// The cuDNN functions the RNN route calls beyond those `cudnn.rs` checks: cudarc looks each up
/// the first time it is called and panics where it is missing.
const FUNCTIONS: [&str; 17] = [
    "cudnnCreateRNNDescriptor",
    "cudnnSetRNNDescriptor_v8",
    "cudnnDestroyRNNDescriptor",
    "cudnnCreateRNNDataDescriptor",
    "cudnnSetRNNDataDescriptor",
    "cudnnDestroyRNNDataDescriptor",
    "cudnnCreateDropoutDescriptor",
    "cudnnSetDropoutDescriptor",
    "cudnnDestroyDropoutDescriptor",
    "cudnnSetTensorNdDescriptor",
    "cudnnGetTensorNdDescriptor",
    "cudnnGetRNNWeightSpaceSize",
    "cudnnGetRNNWeightParams",
    "cudnnGetRNNTempSpaceSizes",
    "cudnnRNNForward",
    "cudnnRNNBackwardData_v8",
    "cudnnRNNBackwardWeights_v8",
];

/// `CUDNN_RNN_PADDED_IO_DISABLED` and `_ENABLED` (cudnn_adv.h, macros the bindings lack): the
/// packed layouts have no padding between sequences; the unpacked ones need padded I/O on.
const PADDED_IO_DISABLED: u32 = 0;
const PADDED_IO_ENABLED: u32 = 1;

/// A cuDNN RNN algorithm (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Algo {
    Standard,
    PersistStaticSmallH,
}

impl Algo {
    pub const ALL: [Algo; 2] = [Algo::Standard, Algo::PersistStaticSmallH];

    /// Its place in [`Algo::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// cuDNN's name for it, less `CUDNN_RNN_ALGO_`, in lower case (the report's, and
    /// `FLATNN_RNN_ALGO`'s: [`RnnAlgos::NAMES`], in [`Algo::ALL`]'s order).
    pub fn name(self) -> &'static str {
        RnnAlgos::NAMES[self.index()]
    }

    fn raw(self) -> sys::cudnnRNNAlgo_t {
        use sys::cudnnRNNAlgo_t::*;
        match self {
            Algo::Standard => CUDNN_RNN_ALGO_STANDARD,
            Algo::PersistStaticSmallH => CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H,
        }
    }

    /// The sequence-major layout and padded-I/O flag it is given (see the module docs).
    fn layout(self) -> (sys::cudnnRNNDataLayout_t, u32) {
        use sys::cudnnRNNDataLayout_t::*;
        match self {
            Algo::Standard => (CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_PACKED, PADDED_IO_DISABLED),
            Algo::PersistStaticSmallH => (CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED, PADDED_IO_ENABLED),
        }
    }
}

/// Whether cuDNN 9 loads here with every function the RNN route calls. Probed once per
/// process; never panics.
pub(super) fn rnn_functions_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        if cudnn_version().is_none() {
            return false;
        }
        // SAFETY: the library is present (cudnn_version opened it); looking a symbol up runs
        // nothing.
        let Ok(lib) = guarded_result(|| Ok(unsafe { sys::culib() })) else { return false };
        // SAFETY: as above; the symbols are only looked up, never called through this type.
        FUNCTIONS.iter().all(|f| unsafe { lib.get::<*const c_void>(f.as_bytes()) }.is_ok())
    })
}

/// The math type a layer runs with: FMA (plain FP32), or with `tf32` DEFAULT, which lets cuDNN
/// use TF32 tensor cores (as conv does: never the conversions to FP16 of
/// TENSOR_OP_MATH_ALLOW_CONVERSION, nor DEFAULT without `tf32`).
fn math_type(tf32: bool) -> sys::cudnnMathType_t {
    if tf32 {
        sys::cudnnMathType_t::CUDNN_DEFAULT_MATH
    } else {
        sys::cudnnMathType_t::CUDNN_FMA_MATH
    }
}

/// One recurrent layer's cuDNN descriptors for `batch` samples and an algorithm: the RNN (with a
/// dropout descriptor of no dropout, which it refers to), x and y, and h (which c shares).
pub(super) struct Descs {
    algo: Algo,
    rnn: sys::cudnnRNNDescriptor_t,
    dropout: sys::cudnnDropoutDescriptor_t,
    x: sys::cudnnRNNDataDescriptor_t,
    y: sys::cudnnRNNDataDescriptor_t,
    h: sys::cudnnTensorDescriptor_t,
}

/// A dimension as cuDNN's `int`.
fn dim(n: usize, what: &str) -> Result<i32, String> {
    i32::try_from(n).map_err(|_| format!("{what} {n} exceeds cuDNN's 32-bit integers"))
}

impl Descs {
    /// The descriptors of layer `d` for `batch` samples and `algo` (see the module docs), TF32
    /// tensor cores permitted where `tf32`. An error (for the report) where a dimension exceeds
    /// cuDNN's `int` or cuDNN refuses a descriptor.
    pub fn new(handle: &Handle, d: &Dims, batch: usize, tf32: bool, algo: Algo) -> Result<Descs, String> {
        use sys::cudnnDataType_t::CUDNN_DATA_FLOAT as F32;
        let (n, steps, features, hidden) =
            (dim(batch, "batch")?, dim(d.steps, "steps")?, dim(d.features, "features")?, dim(d.hidden, "hidden")?);
        dim(batch * d.hidden, "batch × hidden")?;
        let cell = match d.cell {
            Cell::Gru => sys::cudnnRNNMode_t::CUDNN_GRU,
            Cell::Lstm => sys::cudnnRNNMode_t::CUDNN_LSTM,
        };
        let refused = |call: &str, e: CudnnError| format!("cuDNN refused the RNN descriptors ({call}: {e:?})");
        let mut descs = Descs {
            algo,
            rnn: std::ptr::null_mut(),
            dropout: std::ptr::null_mut(),
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            h: std::ptr::null_mut(),
        };
        let lengths = vec![steps; batch];
        let (layout, padded_io) = algo.layout();
        // Each descriptor is created before it is set, and owned by `descs` from then on (an
        // error below destroys what was made).
        // SAFETY: live descriptors of this process; the host arrays outlive the calls that read them.
        unsafe {
            sys::cudnnCreateDropoutDescriptor(&mut descs.dropout).result().map_err(|e| refused("cudnnCreateDropoutDescriptor", e))?;
            // no dropout: no states, no random numbers drawn
            sys::cudnnSetDropoutDescriptor(descs.dropout, handle.raw(), 0.0, std::ptr::null_mut(), 0, 0)
                .result()
                .map_err(|e| refused("cudnnSetDropoutDescriptor", e))?;
            sys::cudnnCreateRNNDescriptor(&mut descs.rnn).result().map_err(|e| refused("cudnnCreateRNNDescriptor", e))?;
            sys::cudnnSetRNNDescriptor_v8(
                descs.rnn,
                algo.raw(),
                cell,
                sys::cudnnRNNBiasMode_t::CUDNN_RNN_DOUBLE_BIAS,
                sys::cudnnDirectionMode_t::CUDNN_UNIDIRECTIONAL,
                sys::cudnnRNNInputMode_t::CUDNN_LINEAR_INPUT,
                F32,
                F32,
                math_type(tf32),
                features,
                hidden,
                hidden,
                1,
                descs.dropout,
                padded_io,
            )
            .result()
            .map_err(|e| refused("cudnnSetRNNDescriptor_v8", e))?;
            for (desc, width) in [(&mut descs.x, features), (&mut descs.y, hidden)] {
                sys::cudnnCreateRNNDataDescriptor(desc).result().map_err(|e| refused("cudnnCreateRNNDataDescriptor", e))?;
                sys::cudnnSetRNNDataDescriptor(*desc, F32, layout, steps, n, width, lengths.as_ptr(), std::ptr::null_mut())
                    .result()
                    .map_err(|e| refused("cudnnSetRNNDataDescriptor", e))?;
            }
            sys::cudnnCreateTensorDescriptor(&mut descs.h).result().map_err(|e| refused("cudnnCreateTensorDescriptor", e))?;
            // (layers, batch, hidden), packed
            let (dims, strides) = ([1, n, hidden], [n * hidden, hidden, 1]);
            sys::cudnnSetTensorNdDescriptor(descs.h, F32, 3, dims.as_ptr(), strides.as_ptr())
                .result()
                .map_err(|e| refused("cudnnSetTensorNdDescriptor", e))?;
        }
        Ok(descs)
    }

    /// The algorithm the descriptors were made for.
    pub fn algo(&self) -> Algo {
        self.algo
    }

    /// Bytes of the weight space of the layer.
    pub fn weight_space(&self, handle: &Handle) -> Result<usize> {
        let mut bytes = 0usize;
        // SAFETY: a live handle and descriptor; writes one size.
        unsafe { sys::cudnnGetRNNWeightSpaceSize(handle.raw(), self.rnn, &mut bytes) }
            .result()
            .map_err(|e| cudnn_error("cudnnGetRNNWeightSpaceSize", e))?;
        Ok(bytes)
    }

    /// Bytes of the work space and of the reserve space a forward pass of these descriptors
    /// needs (in training; the backward calls need no more), or in inference (no reserve).
    pub fn temp_spaces(&self, handle: &Handle, training: bool) -> Result<(usize, usize)> {
        let mode = fwd_mode(training);
        let (mut work, mut reserve) = (0usize, 0usize);
        // SAFETY: a live handle and descriptors; writes two sizes.
        unsafe { sys::cudnnGetRNNTempSpaceSizes(handle.raw(), self.rnn, mode, self.x, &mut work, &mut reserve) }
            .result()
            .map_err(|e| cudnn_error("cudnnGetRNNTempSpaceSizes", e))?;
        Ok((work, if training { reserve } else { 0 }))
    }

    /// Where layer `d`'s tensors lie in a weight space of `space_len` bytes at `space`: for each
    /// of the `2·gates` linear layers (input side then recurrent side, gates in order), (bytes
    /// from `space` to its matrix, its values; to its bias, its values), each checked to be the
    /// size of PyTorch's part of that gate (hidden × inputs; hidden).
    pub fn weight_parts(&self, handle: &Handle, d: &Dims, space: driver_sys::CUdeviceptr, space_len: usize) -> Result<Vec<[usize; 4]>> {
        let mut parts = Vec::with_capacity(2 * d.gates());
        let (mut m_desc, mut b_desc) = (std::ptr::null_mut(), std::ptr::null_mut());
        let outcome = (|| {
            // SAFETY: created here, destroyed below.
            unsafe {
                sys::cudnnCreateTensorDescriptor(&mut m_desc).result().map_err(|e| cudnn_error("cudnnCreateTensorDescriptor", e))?;
                sys::cudnnCreateTensorDescriptor(&mut b_desc).result().map_err(|e| cudnn_error("cudnnCreateTensorDescriptor", e))?;
            }
            for id in 0..2 * d.gates() {
                let inputs = if id < d.gates() { d.features } else { d.hidden };
                let (mut m_addr, mut b_addr): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
                // SAFETY: live handle and descriptors; cuDNN computes addresses inside the space
                // (it does not touch the device memory) and describes them in the two
                // descriptors.
                unsafe {
                    sys::cudnnGetRNNWeightParams(
                        handle.raw(),
                        self.rnn,
                        0,
                        space_len,
                        space as *const c_void,
                        id as i32,
                        m_desc,
                        &mut m_addr,
                        b_desc,
                        &mut b_addr,
                    )
                }
                .result()
                .map_err(|e| cudnn_error("cudnnGetRNNWeightParams", e))?;
                let (m_len, b_len) = (values_of(m_desc)?, values_of(b_desc)?);
                let offset = |addr: *mut c_void, len: usize| -> Result<usize> {
                    let at = (addr as u64).checked_sub(space).map(|b| b as usize);
                    match at {
                        Some(at) if at % size_of::<f32>() == 0 && at + len * size_of::<f32>() <= space_len => Ok(at),
                        _ => Err(Error::Cuda { what: format!("cuDNN: linear layer {id} lies outside its weight space") }),
                    }
                };
                if m_len != d.hidden * inputs || b_len != d.hidden {
                    return Err(Error::Cuda {
                        what: format!(
                            "cuDNN: linear layer {id} holds {m_len} weights and {b_len} biases where PyTorch's gate has {} and {}",
                            d.hidden * inputs,
                            d.hidden
                        ),
                    });
                }
                parts.push([offset(m_addr, m_len)?, m_len, offset(b_addr, b_len)?, b_len]);
            }
            Ok(())
        })();
        // SAFETY: made above (or still null), destroyed once.
        unsafe {
            if !m_desc.is_null() {
                let _ = sys::cudnnDestroyTensorDescriptor(m_desc);
            }
            if !b_desc.is_null() {
                let _ = sys::cudnnDestroyTensorDescriptor(b_desc);
            }
        }
        outcome.map(|()| parts)
    }
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each made in `new` (or still null), destroyed once; the RNN descriptor before
        // the dropout descriptor it refers to.
        unsafe {
            if !self.rnn.is_null() {
                let _ = sys::cudnnDestroyRNNDescriptor(self.rnn);
            }
            if !self.dropout.is_null() {
                let _ = sys::cudnnDestroyDropoutDescriptor(self.dropout);
            }
            for desc in [self.x, self.y] {
                if !desc.is_null() {
                    let _ = sys::cudnnDestroyRNNDataDescriptor(desc);
                }
            }
            if !self.h.is_null() {
                let _ = sys::cudnnDestroyTensorDescriptor(self.h);
            }
        }
    }
}

/// The values a tensor descriptor cuDNN filled describes (the product of its dimensions).
fn values_of(desc: sys::cudnnTensorDescriptor_t) -> Result<usize> {
    let (mut dtype, mut nb) = (sys::cudnnDataType_t::CUDNN_DATA_FLOAT, 0i32);
    let (mut dims, mut strides) = ([0i32; 8], [0i32; 8]);
    // SAFETY: a live descriptor; cuDNN writes at most the 8 dimensions asked for.
    unsafe { sys::cudnnGetTensorNdDescriptor(desc, 8, &mut dtype, &mut nb, dims.as_mut_ptr(), strides.as_mut_ptr()) }
        .result()
        .map_err(|e| cudnn_error("cudnnGetTensorNdDescriptor", e))?;
    let nb = (nb.max(0) as usize).min(dims.len());
    Ok(dims[..nb].iter().map(|&n| n.max(0) as usize).product())
}

fn fwd_mode(training: bool) -> sys::cudnnForwardMode_t {
    if training {
        sys::cudnnForwardMode_t::CUDNN_FWD_MODE_TRAINING
    } else {
        sys::cudnnForwardMode_t::CUDNN_FWD_MODE_INFERENCE
    }
}

/// Device memory a call works in: (address, bytes).
pub(super) type Space = (driver_sys::CUdeviceptr, usize);

/// The device addresses of one layer's operands in one pass (0: none; see each call).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Operands {
    /// The batch's sequence lengths, `batch` ints of `steps`, in device memory.
    pub lengths: driver_sys::CUdeviceptr,
    pub x: driver_sys::CUdeviceptr,
    pub y: driver_sys::CUdeviceptr,
    pub hx: driver_sys::CUdeviceptr,
    pub hy: driver_sys::CUdeviceptr,
    pub cx: driver_sys::CUdeviceptr,
    pub cy: driver_sys::CUdeviceptr,
    /// Gradients: of x (written), of y and of the final h (read; 0: zeros).
    pub dx: driver_sys::CUdeviceptr,
    pub dy: driver_sys::CUdeviceptr,
    pub dhy: driver_sys::CUdeviceptr,
}

fn ptr(p: driver_sys::CUdeviceptr) -> *mut c_void {
    p as *mut c_void
}

/// Queues the forward pass on the handle's stream: y, and hy and cy where given (non-zero),
/// from x, hx and cx (cx 0 for a GRU) and the weights; in training the reserve space is
/// written for the backward calls.
///
/// # Safety
/// `descs` made for this layer and the batch of the operands; every operand, the weight space
/// and the spaces live device memory of the handle's device holding what the descriptors say
/// (the work and reserve spaces at least the sizes [`Descs::temp_spaces`] gives), not used by
/// other work meanwhile.
pub(super) unsafe fn forward(
    handle: &Handle,
    descs: &Descs,
    training: bool,
    o: &Operands,
    weights: Space,
    work: Space,
    reserve: Space,
) -> Result<(), CudnnError> {
    let lengths = o.lengths as *const i32;
    // SAFETY: the caller's contract.
    unsafe {
        sys::cudnnRNNForward(
            handle.raw(),
            descs.rnn,
            fwd_mode(training),
            lengths,
            descs.x,
            ptr(o.x),
            descs.y,
            ptr(o.y),
            descs.h,
            ptr(o.hx),
            ptr(o.hy),
            descs.h,
            ptr(o.cx),
            ptr(o.cy),
            weights.1,
            ptr(weights.0),
            work.1,
            ptr(work.0),
            reserve.1,
            ptr(reserve.0),
        )
    }
    .result()
}

/// Queues the backward pass through the data on the handle's stream: dx from dy and dhy (the
/// final c's gradient zero; the initial states' gradients not computed), after a training
/// [`forward`] of the same operands, whose reserve space it reads and updates.
///
/// # Safety
/// As [`forward`].
pub(super) unsafe fn backward_data(
    handle: &Handle,
    descs: &Descs,
    o: &Operands,
    weights: Space,
    work: Space,
    reserve: Space,
) -> Result<(), CudnnError> {
    let null = std::ptr::null_mut();
    // SAFETY: the caller's contract; null dhy / dcy are zeros, null dhx / dcx not written.
    unsafe {
        sys::cudnnRNNBackwardData_v8(
            handle.raw(),
            descs.rnn,
            o.lengths as *const i32,
            descs.y,
            ptr(o.y),
            ptr(o.dy),
            descs.x,
            ptr(o.dx),
            descs.h,
            ptr(o.hx),
            ptr(o.dhy),
            null,
            descs.h,
            ptr(o.cx),
            null,
            null,
            weights.1,
            ptr(weights.0),
            work.1,
            ptr(work.0),
            reserve.1,
            ptr(reserve.0),
        )
    }
    .result()
}

/// Queues the weight gradients on the handle's stream, added into `dweights` (the only mode
/// cuDNN has), after [`backward_data`].
///
/// # Safety
/// As [`forward`]; `dweights` the size of the weight space.
pub(super) unsafe fn backward_weights(
    handle: &Handle,
    descs: &Descs,
    o: &Operands,
    dweights: Space,
    work: Space,
    reserve: Space,
) -> Result<(), CudnnError> {
    // SAFETY: the caller's contract.
    unsafe {
        sys::cudnnRNNBackwardWeights_v8(
            handle.raw(),
            descs.rnn,
            sys::cudnnWgradMode_t::CUDNN_WGRAD_MODE_ADD,
            o.lengths as *const i32,
            descs.x,
            ptr(o.x),
            descs.h,
            ptr(o.hx),
            descs.y,
            ptr(o.y),
            dweights.1,
            ptr(dweights.0),
            work.1,
            ptr(work.0),
            reserve.1,
            ptr(reserve.0),
        )
    }
    .result()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithms_are_named_as_the_setting() {
        let names: Vec<&str> = Algo::ALL.iter().map(|a| a.name()).collect();
        assert_eq!(names, ["standard", "persist_static_small_h"]);
        for algo in Algo::ALL {
            assert_eq!(Algo::ALL[algo.index()], algo);
            let named = RnnAlgos::named(algo.name()).map(|set| Algo::ALL.map(|a| set.allows(a.index())));
            assert_eq!(named, Some(Algo::ALL.map(|a| a == algo)));
        }
    }
}
