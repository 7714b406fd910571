//! One [`Gpu`] per device per process: the driver context, flatnn's kernels compiled for the
//! device with NVRTC, and every kernel's handle looked up once.

use super::options::Tuning;
use super::{driver_error, kernel_cache};
use crate::activation::Activation;
use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};
use std::ffi::{c_char, CStr, CString};
use std::sync::Arc;

/// The kernel files ahead of the layers': common.cu first (it defines helpers), then what any
/// layer's kernels may call (activations) or share a pass with (losses).
const BEFORE_LAYERS: &[(&str, &str)] = &[
    ("common.cu", include_str!("../../kernels/common.cu")),
    ("activation.cu", include_str!("../../kernels/activation.cu")),
    ("loss.cu", include_str!("../../kernels/loss.cu")),
];

/// The kernel files after the layers': those built on the dense layer's (tensor-core tiles,
/// weight-gradient splits, the resident server, the head), the direct convolutions (and the
/// tensor-core ones, which use their bands; their weight gradient, after the forward, uses its
/// mma helpers), the optimisers and data movers. (kernels/rnn_fused.cu is compiled apart, on
/// first need: src/cuda/rnn_fused.rs.)
const AFTER_LAYERS: &[(&str, &str)] = &[
    ("dense_mma.cu", include_str!("../../kernels/dense_mma.cu")),
    ("conv_direct.cu", include_str!("../../kernels/conv_direct.cu")),
    ("conv_mma.cu", include_str!("../../kernels/conv_mma.cu")),
    ("conv_mma_wgrad.cu", include_str!("../../kernels/conv_mma_wgrad.cu")),
    ("wgrad.cu", include_str!("../../kernels/wgrad.cu")),
    ("optim.cu", include_str!("../../kernels/optim.cu")),
    ("data.cu", include_str!("../../kernels/data.cu")),
    ("serve.cu", include_str!("../../kernels/serve.cu")),
    ("head.cu", include_str!("../../kernels/head.cu")),
];

/// The main program's `kernels/*.cu` files (name, text), in the order NVRTC compiles them
/// concatenated: those ahead of the layers', each layer kind's in registry order
/// (`layers/mod.rs`), the rest. Every file but rnn_fused.cu.
pub(crate) fn source_files() -> Vec<(&'static str, &'static str)> {
    let layers = crate::layers::KERNEL_SOURCES.iter().flatten().copied();
    BEFORE_LAYERS.iter().copied().chain(layers).chain(AFTER_LAYERS.iter().copied()).collect()
}

/// The preferred shared-memory carveout of the kernels that stage through dynamic shared memory:
/// all of it (a percentage, as `cudaSharedmemCarveoutMaxShared`).
pub(crate) const CARVEOUT_MAX_SHARED: i32 = 100;

/// The kernels besides the tensor-core tiles (`ops::MMA_TILES`) that ask for
/// [`CARVEOUT_MAX_SHARED`], unless `Tuning::carveout` is off in the environment (read when the
/// device is set up: for measuring against the driver's choice). Left to the driver, an SM's
/// split between L1 and shared memory follows the kernels on it, and it must drain before the
/// split changes: a kernel launched early beside the one ahead of it (dependent launch) then
/// waits for that one to finish where their shared memory together needs a larger split.
/// Against the driver's choice (`FLATNN_CARVEOUT=0`), the most shared memory for these made the
/// MLP's step faster at 640 and 768 samples and left the other steps measured about even
/// (LeNet's inference from host memory, mostly the host's copy, varied either way from call to
/// call); with the deep head's shared memory padded by 50 KB, the driver's choice made the MLP's
/// step much slower, and the most for these gave back the unpadded time. The shallow head
/// (`dense_head`) is not among them: with it, the 100-200-1's step at 2048 was slower.
pub(crate) const SHARED_CARVEOUT_KERNELS: [Kernel; 4] =
    [Kernel::DenseHeadDeep, Kernel::DenseHeadDeep2, Kernel::WeightGradSplit, Kernel::ServeDense];

/// Declares the kernels: the `Kernel` enum indexes `KERNELS`, the names looked up in the module
/// (and checked against the sources by a CPU test).
macro_rules! kernels {
    ($($variant:ident = $name:literal,)*) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Kernel { $($variant,)* }
        pub(crate) const KERNELS: &[&str] = &[$($name,)*];
    };
}

kernels! {
    BiasActForward = "bias_act_forward",
    ActBackward = "act_backward",
    BiasGrad = "bias_grad",
    BiasGradSplit = "bias_grad_split",
    BiasGradJoin = "bias_grad_join",
    ActBiasGrad = "act_bias_grad",
    SoftmaxXent = "softmax_xent",
    Mse = "mse",
    ElementwiseLoss = "elementwise_loss",
    LossSum = "loss_sum",
    MaxpoolForward = "maxpool_forward",
    MaxpoolBackwardTiles = "maxpool_backward_tiles",
    MaxpoolBackward = "maxpool_backward",
    AvgpoolForward = "avgpool_forward",
    AvgpoolBackward = "avgpool_backward",
    GlobalAvgpoolForward = "global_avgpool_forward",
    GlobalAvgpoolBackward = "global_avgpool_backward",
    Maxpool1dForward = "maxpool1d_forward",
    Maxpool1dBackwardTiles = "maxpool1d_backward_tiles",
    Maxpool1dBackward = "maxpool1d_backward",
    SoftmaxForward = "softmax_forward",
    SoftmaxBackward = "softmax_backward",
    DenseSkinny = "dense_skinny",
    DenseSkinny4 = "dense_skinny4",
    DenseSkinny8 = "dense_skinny8",
    DenseRow = "dense_row",
    DensePanel = "dense_panel",
    DenseMma16x16Kk = "dense_mma_16x16_kk",
    DenseMma32x16Kk = "dense_mma_32x16_kk",
    DenseMma32x32Kk = "dense_mma_32x32_kk",
    DenseMma16x16Mn = "dense_mma_16x16_mn",
    DenseMma32x16Mn = "dense_mma_32x16_mn",
    DenseMma16x32Mn = "dense_mma_16x32_mn",
    DenseMma32x32Mn = "dense_mma_32x32_mn",
    DenseMma32x32Mn2 = "dense_mma_32x32_mn2",
    DenseMma16x16KkTf32 = "dense_mma_16x16_kk_tf32",
    DenseMma32x16KkTf32 = "dense_mma_32x16_kk_tf32",
    DenseMma32x32KkTf32 = "dense_mma_32x32_kk_tf32",
    DenseMma16x16MnTf32 = "dense_mma_16x16_mn_tf32",
    DenseMma32x16MnTf32 = "dense_mma_32x16_mn_tf32",
    DenseMma16x32MnTf32 = "dense_mma_16x32_mn_tf32",
    DenseMma32x32MnTf32 = "dense_mma_32x32_mn_tf32",
    DenseMma32x32Mn2Tf32 = "dense_mma_32x32_mn2_tf32",
    Im2col = "im2col",
    Col2im = "col2im",
    ConvEpilogue = "conv_epilogue",
    ConvWgrad16 = "conv_wgrad_16",
    ConvWgrad32 = "conv_wgrad_32",
    ConvWgrad64 = "conv_wgrad_64",
    ConvWgradJoin = "conv_wgrad_join",
    ConvDirectForward = "conv_direct_forward",
    ConvDirectWgrad = "conv_direct_wgrad",
    ConvMma8Tf32 = "conv_mma_8_tf32",
    ConvMma16Tf32 = "conv_mma_16_tf32",
    ConvMma32Tf32 = "conv_mma_32_tf32",
    ConvMma8X3 = "conv_mma_8_x3",
    ConvMma16X3 = "conv_mma_16_x3",
    ConvMma32X3 = "conv_mma_32_x3",
    ConvMmaWgrad16Tf32 = "conv_mma_wgrad_16_tf32",
    ConvMmaWgrad32Tf32 = "conv_mma_wgrad_32_tf32",
    ConvMmaWgrad16X3 = "conv_mma_wgrad_16_x3",
    ConvMmaWgrad32X3 = "conv_mma_wgrad_32_x3",
    Sgd = "sgd",
    SgdMomentum = "sgd_momentum",
    Adam = "adam",
    RmsProp = "rmsprop",
    GradNorm = "grad_norm",
    GatherBatch = "gather_batch",
    GatherLabels = "gather_labels",
    FinishOutputs = "finish_outputs",
    CopyFromHost = "copy_from_host",
    ServeDense = "serve_dense",
    DenseHead = "dense_head",
    DenseHeadDeep = "dense_head_deep",
    DenseHeadDeep2 = "dense_head_deep2",
    WeightGradSplit = "weight_grad_split",
    BatchNormStats = "batch_norm_stats",
    BatchNormStatsSplit = "batch_norm_stats_split",
    BatchNormStatsJoin = "batch_norm_stats_join",
    BatchNormApply = "batch_norm_apply",
    BatchNormParamGrads = "batch_norm_param_grads",
    BatchNormParamGradsSplit = "batch_norm_param_grads_split",
    BatchNormParamGradsJoin = "batch_norm_param_grads_join",
    BatchNormInputGrad = "batch_norm_input_grad",
    BatchNormTrainForward = "batch_norm_train_forward",
    BatchNormTrainBackward = "batch_norm_train_backward",
    LayerNormForward = "layer_norm_forward",
    LayerNormParamGrads = "layer_norm_param_grads",
    LayerNormInputGrad = "layer_norm_input_grad",
    Dropout = "dropout",
    DropoutNextPass = "dropout_next_pass",
    ResidualAdd = "residual_add",
    ResidualGrad = "residual_grad",
    RnnBegin = "rnn_begin",
    GruStep = "gru_step",
    GruStepBackward = "gru_step_backward",
    RnnBiasGrad = "rnn_bias_grad",
    RnnBiasJoin = "rnn_bias_join",
    LstmStep = "lstm_step",
    LstmStepBackward = "lstm_step_backward",
    RnnStatesIn = "rnn_states_in",
    RnnStatesOut = "rnn_states_out",
    RnnTranspose = "rnn_transpose",
}

/// A CUDA device ready for flatnn's kernels. Get it with [`super::gpu`]; share it by `Arc`.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    /// Indexed by `Kernel as usize`; each holds the module alive.
    functions: Vec<CudaFunction>,
    ordinal: usize,
    name: String,
    compute_capability: (u32, u32),
    multiprocessors: u32,
    /// Bytes of dynamic shared memory a block of `serve_dense` may have (set when the kernels
    /// are loaded: the device's opt-in limit less what the kernel declares itself).
    serve_shared_limit: usize,
    /// The same for `dense_head`, `dense_head_deep` and `dense_head_deep2` (src/cuda/head.rs),
    /// the smallest.
    head_shared_limit: usize,
    /// The device's opt-in limit of shared memory a block, in bytes.
    shared_optin: usize,
    /// Whether a module's kernels are loaded with it (`cuFuncLoad`, drivers of CUDA 12.4 on)
    /// rather than at their first launch.
    load_eagerly: bool,
    /// The fused recurrences' kernels, compiled on first need (src/cuda/rnn_fused.rs).
    pub(crate) rnn_fused: super::rnn_fused::Modules,
    /// Kernels are launched as programmatic dependents of the kernel ahead of them (sm_90 and
    /// later with a CUDA 12.3 or later driver, unless `Tuning::dependent_launch` is off in the
    /// environment); see [`super::launch::launch`].
    pub(crate) dependent_launch: bool,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({}: {}, sm_{}{})", self.ordinal, self.name, self.compute_capability.0, self.compute_capability.1)
    }
}

impl Gpu {
    /// Context on device `ordinal` (checked to exist), kernels compiled and looked up.
    pub(crate) fn new(ordinal: usize) -> Result<Gpu> {
        let err = |what: &str| {
            let what = format!("{what} on device {ordinal}");
            move |e| driver_error(&what, e)
        };
        let ctx = CudaContext::new(ordinal).map_err(err("creating a context"))?;
        // SAFETY: flatnn orders work by stream and frees nothing in use (see the module doc);
        // without tracking, a CudaSlice carries no events, so using one records none.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(err("reading the compute capability"))?;
        let multiprocessors =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(err("reading the SM count"))?;
        let shared_optin = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(err("reading the shared memory limit"))?;
        let name = ctx.name().map_err(err("reading the name"))?;
        let cubin = compile((major, minor))?;
        // cudarc resolves a driver symbol at its first call, allocating. Steps call every other
        // one in their first, unmeasured run; `cuStreamQuery` only now and then (when a wait
        // for a flag runs long), so resolve it with the device.
        // SAFETY: the legacy stream of the current context; the answer does not matter.
        let _ = unsafe { sys::cuStreamQuery(std::ptr::null_mut()) };
        // cuLaunchKernelEx and programmatic edges in captured graphs: drivers of CUDA 12.3 on
        let mut driver = 0;
        // SAFETY: writes one int.
        let driver_ok = unsafe { sys::cuDriverGetVersion(&mut driver) }.result().is_ok() && driver >= 12_030;
        let load_eagerly = driver >= 12_040;
        let functions = load_module(&ctx, cubin, KERNELS, load_eagerly)?;
        // the device's switches, from the environment (a model's tuning cannot change them)
        let tuning = Tuning::from_env();
        if tuning.carveout {
            // The kernels that stage through dynamic shared memory ask for the most an SM can
            // give (the rest of its unified L1 stays cache): see SHARED_CARVEOUT_KERNELS.
            let staged = SHARED_CARVEOUT_KERNELS.into_iter().chain(super::dense::MMA_TILES.iter().flat_map(|t| t.kernels()));
            for kernel in staged {
                // SAFETY: a function of the module loaded above; a percentage the driver takes.
                unsafe {
                    sys::cuFuncSetAttribute(
                        functions[kernel as usize].cu_function(),
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                        CARVEOUT_MAX_SHARED,
                    )
                }
                .result()
                .map_err(|e| driver_error("setting a kernel's shared memory carveout", e))?;
            }
        }
        let serve_shared_limit = allow_dynamic_shared(functions[Kernel::ServeDense as usize].cu_function(), shared_optin)?;
        let head_shared_limit = [Kernel::DenseHead, Kernel::DenseHeadDeep, Kernel::DenseHeadDeep2]
            .into_iter()
            .map(|kernel| allow_dynamic_shared(functions[kernel as usize].cu_function(), shared_optin))
            .try_fold(usize::MAX, |limit, l| l.map(|l| limit.min(l)))?;
        // the direct and tensor-core convolutions stage through up to 48 KB of dynamic shared
        // memory (src/cuda/conv_direct.rs, conv_mma.rs): let them have it whatever the kernel
        // reserves besides
        let mma = [
            Kernel::ConvMma8Tf32,
            Kernel::ConvMma16Tf32,
            Kernel::ConvMma32Tf32,
            Kernel::ConvMma8X3,
            Kernel::ConvMma16X3,
            Kernel::ConvMma32X3,
        ];
        for kernel in [Kernel::ConvDirectForward, Kernel::ConvDirectWgrad].into_iter().chain(mma) {
            allow_dynamic_shared(functions[kernel as usize].cu_function(), shared_optin)?;
        }
        if major >= 9 {
            // its staging buffers are dynamic shared memory (kernels/wgrad.cu)
            allow_dynamic_shared(functions[Kernel::WeightGradSplit as usize].cu_function(), shared_optin)?;
        }
        if major >= 8 {
            // the tensor-core tiles' slice buffers are dynamic shared memory (kernels/dense_mma.cu)
            for tile in super::dense::MMA_TILES {
                for kernel in tile.kernels() {
                    allow_dynamic_shared(functions[kernel as usize].cu_function(), shared_optin)?;
                }
            }
        }
        let dependent_launch = major >= 9 && driver_ok && tuning.dependent_launch;
        Ok(Gpu {
            ctx,
            functions,
            ordinal,
            name,
            compute_capability: (major as u32, minor as u32),
            multiprocessors: multiprocessors as u32,
            serve_shared_limit,
            head_shared_limit,
            shared_optin: shared_optin.max(0) as usize,
            load_eagerly,
            rnn_fused: Default::default(),
            dependent_launch,
        })
    }

    /// A new stream on this device (non-blocking with respect to the legacy default stream).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(|e| driver_error("creating a stream", e))
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// (major, minor); the kernels were compiled for exactly this.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// Whether the device runs clusters of blocks (sm_90 and later).
    pub(crate) fn has_clusters(&self) -> bool {
        self.compute_capability.0 >= 9
    }

    pub fn multiprocessors(&self) -> u32 {
        self.multiprocessors
    }

    /// Bytes of dynamic shared memory a block of the resident kernel (src/cuda/serve.rs) may
    /// have.
    pub(crate) fn serve_shared_limit(&self) -> usize {
        self.serve_shared_limit
    }

    /// Bytes of dynamic shared memory a block of any of the head kernels may have.
    pub(crate) fn head_shared_limit(&self) -> usize {
        self.head_shared_limit
    }

    /// The device's opt-in limit of shared memory a block, in bytes.
    pub(crate) fn shared_optin(&self) -> usize {
        self.shared_optin
    }

    /// The kernels `names` of `cubin` (machine code for this device), loaded into this device's
    /// context, their dynamic shared memory opted in to the device's limit; with the bytes a
    /// block of any of them may have. Takes `device_wide` (loading a module may wait for the
    /// whole device).
    pub(crate) fn load_kernels(&self, cubin: Vec<u8>, names: &[&str]) -> Result<(Vec<CudaFunction>, usize)> {
        let _exclusive = super::device_wide();
        self.bind()?;
        let functions = load_module(&self.ctx, cubin, names, self.load_eagerly)?;
        let optin = i32::try_from(self.shared_optin).unwrap_or(i32::MAX);
        let limit = functions
            .iter()
            .map(|f| allow_dynamic_shared(f.cu_function(), optin))
            .try_fold(usize::MAX, |limit, l| l.map(|l| limit.min(l)))?;
        Ok((functions, limit))
    }

    /// The handle of a kernel.
    pub(crate) fn function(&self, kernel: Kernel) -> sys::CUfunction {
        self.functions[kernel as usize].cu_function()
    }

    /// Makes this device's context current on the calling thread (a no-op when it is).
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| driver_error("binding the CUDA context", e))
    }
}

/// The kernels `names` of `cubin`, loaded into `ctx` (each holds the module alive); with
/// `eagerly`, each loaded now rather than at its first launch (CUDA's lazy loading, its default
/// since 12.2, would load it then, which can wait for the whole device, and so for a resident
/// kernel (src/cuda/serve.rs) that is serving calls).
fn load_module(ctx: &Arc<CudaContext>, cubin: Vec<u8>, names: &[&str], eagerly: bool) -> Result<Vec<CudaFunction>> {
    let module: Arc<CudaModule> = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| driver_error("loading the compiled kernels", e))?;
    let functions = names
        .iter()
        .map(|name| module.load_function(name).map_err(|e| driver_error(&format!("looking up kernel {name}"), e)))
        .collect::<Result<Vec<_>>>()?;
    if eagerly {
        for f in &functions {
            // SAFETY: a function of the module loaded above, in `ctx` (current: load_module
            // binds it).
            unsafe { sys::cuFuncLoad(f.cu_function()) }.result().map_err(|e| driver_error("loading a kernel", e))?;
        }
    }
    Ok(functions)
}

/// Lets `func` (of the current context) have as much dynamic shared memory a block as the
/// device allows it, `optin` less what it declares itself; returns that many bytes.
fn allow_dynamic_shared(func: sys::CUfunction, optin: i32) -> Result<usize> {
    let mut declared = 0;
    // SAFETY: writes one int; a kernel of the current context.
    unsafe { sys::cuFuncGetAttribute(&mut declared, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func) }
        .result()
        .map_err(|e| driver_error("reading a kernel's shared memory", e))?;
    let limit = optin.saturating_sub(declared).max(0);
    // SAFETY: a kernel of the current context; within the device's limit for it.
    unsafe { sys::cuFuncSetAttribute(func, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, limit) }
        .result()
        .map_err(|e| driver_error("letting a kernel use shared memory", e))?;
    Ok(limit as usize)
}

/// The source NVRTC reads ahead of `kernels/*.cu`, generated from [`Activation`]: each kind's id,
/// `#define ACT_<NAME> <id>`, and the bodies of `act_apply` and `act_derivative`
/// (kernels/activation.cu), a `switch` on the id whose cases call the kind's device functions
/// `act_apply_<name>` and `act_derivative_<name>`. The identity, id 0, is the `default`. A kind
/// without its device functions is an NVRTC compile error, not an identity.
pub(crate) fn activation_prelude() -> String {
    let mut defines = String::new();
    let (mut apply, mut derivative) = (String::new(), String::new());
    for act in Activation::ALL {
        let (name, id) = (act.kind_name(), act.gpu_id());
        let upper = name.to_uppercase();
        defines += &format!("#define ACT_{upper} {id}\n");
        let case = if *act == Activation::Identity { "default:".to_string() } else { format!("case ACT_{upper}:") };
        apply += &format!("        {case} return act_apply_{name}(slope, z); \\\n");
        derivative += &format!("        {case} return act_derivative_{name}(slope, z, y); \\\n");
    }
    let switch = |name: &str, args: &str, cases: &str| format!("#define {name}(act, {args}) \\\n    switch (act) {{ \\\n{cases}    }}\n");
    format!(
        "// ---- generated from src/activation.rs\n{defines}{}{}",
        switch("ACT_APPLY_SWITCH", "slope, z", &apply),
        switch("ACT_DERIVATIVE_SWITCH", "slope, z, y", &derivative)
    )
}

/// The main program, [`source_files`], compiled by [`compile_source`] for compute capability
/// `cc` after the [`activation_prelude`].
fn compile(cc: (i32, i32)) -> Result<Vec<u8>> {
    let files = source_files().iter().map(|(name, text)| format!("// ---- kernels/{name}\n{text}\n")).collect::<String>();
    compile_source(c"flatnn_kernels.cu", activation_prelude() + &files, cc, &[])
}

/// `source` (called `name` in NVRTC's log) compiled by NVRTC to machine code for compute
/// capability `cc` (a cubin, so no PTX is left to the driver's JIT and a newer NVRTC than the
/// driver still works), with flatnn's options and `extra` ones (such as `-D` defines); read
/// from the kernel cache where an earlier process compiled the same ([`kernel_cache`]).
pub(crate) fn compile_source(name: &CStr, source: String, cc: (i32, i32), extra: &[&str]) -> Result<Vec<u8>> {
    let what = name.to_string_lossy();
    let arch = format!("--gpu-architecture=sm_{}{}", cc.0, cc.1);
    // --fmad=false: a·b + c rounds twice, as on the CPU, so element-wise kernels match it exactly.
    let options: Vec<&str> = [arch.as_str(), "--fmad=false", "--std=c++17"].into_iter().chain(extra.iter().copied()).collect();
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Cuda { what: format!("NVRTC could not tell its version: {e:?}") })?;
    let key = kernel_cache::Key {
        name: what.into_owned(),
        cc,
        options: options.iter().map(|o| o.to_string()).collect(),
        nvrtc: (major, minor),
        source,
    };
    kernel_cache::cached(kernel_cache::directory_from_env().as_deref(), &key, || nvrtc_compile(name, &key.source, cc, &options))
}

/// `source` compiled by NVRTC with `options` for compute capability `cc` (`name`: the program's
/// name in NVRTC's log).
fn nvrtc_compile(name: &CStr, source: &str, cc: (i32, i32), options: &[&str]) -> Result<Vec<u8>> {
    let what = name.to_string_lossy();
    let source = CString::new(source).map_err(|_| Error::Cuda { what: format!("{what} contains a NUL byte") })?;
    let nvrtc_err = |what: &str, e: nvrtc::NvrtcError| Error::Cuda { what: format!("NVRTC {what}: {e:?}") };
    let program = nvrtc::create_program(&source, Some(name)).map_err(|e| nvrtc_err("could not create a program", e))?;
    // SAFETY: `program` is live until destroyed below; buffers are sized by NVRTC's own answers.
    let compiled = unsafe {
        match nvrtc::compile_program(program, options) {
            Ok(()) => cubin(program),
            Err(e) => {
                let log = nvrtc::get_program_log(program).map(|log| CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned());
                Err(Error::Cuda {
                    what: format!("NVRTC could not compile {what} for sm_{}{} ({e:?}):\n{}", cc.0, cc.1, log.unwrap_or_default()),
                })
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(program) };
    compiled
}

/// The compiled machine code of a program NVRTC compiled successfully.
///
/// # Safety
/// `program` must be live and compiled for a real architecture (sm_XY).
unsafe fn cubin(program: nvrtc_sys::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    let mut code = Vec::new();
    // SAFETY: the caller's contract; `code` holds `size` bytes.
    let status = unsafe {
        let status = nvrtc_sys::nvrtcGetCUBINSize(program, &mut size);
        if status == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
            code.resize(size, 0u8);
            nvrtc_sys::nvrtcGetCUBIN(program, code.as_mut_ptr() as *mut c_char)
        } else {
            status
        }
    };
    status.result().map_err(|e| Error::Cuda { what: format!("NVRTC gave no cubin: {e:?}") })?;
    Ok(code)
}
