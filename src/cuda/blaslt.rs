//! cuBLASLt's matmul as dense routes ([`LtRoute`], `Route::Lt` in src/cuda/dense.rs): for one
//! product, cuBLASLt's heuristic offers several algorithms ([`Blas::lt_routes`]); each is a route
//! that the dense routes' measuring times beside flatnn's kernels and cuBLAS's SGEMM, so the
//! algorithm that runs is the one measured fastest, not the heuristic's first guess. A forward
//! without activation adds its bias in cuBLASLt's epilogue (CUBLASLT_EPILOGUE_BIAS, exact: z =
//! c + b). The GELU epilogues are never used: they are the tanh approximation, flatnn's GELU is
//! the erf form.
//!
//! Descriptors (the matmul's and the three matrix layouts) are made when the routes are listed,
//! at measuring time, and kept for the process in [`PLANS`]; a product then only sets its bias
//! pointer and its batch's rows in them and runs on the handle's stream with the cuBLAS
//! workspace of its [`Blas`] (the same stream, so the two never use it at once): nothing is
//! allocated, nothing waits for the device, and a CUDA graph can capture it.
//!
//! libcublasLt is opened at run time; where it (or a function of it) is missing there are no
//! cuBLASLt routes, and everything else runs as before.

use super::blas::{operand, Blas, DevMat, DevMatMut, WORKSPACE_BYTES};
use super::guarded_result;
use super::launch::View;
use crate::error::{Error, Result};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::sys;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock, PoisonError};

/// Every cuBLASLt function flatnn calls: cudarc looks each up the first time it is called and
/// panics where it is missing, so their presence is checked before cuBLASLt is used at all.
const FUNCTIONS: [&str; 14] = [
    "cublasLtCreate",
    "cublasLtDestroy",
    "cublasLtMatmul",
    "cublasLtMatmulAlgoCheck",
    "cublasLtMatmulAlgoConfigGetAttribute",
    "cublasLtMatmulAlgoGetHeuristic",
    "cublasLtMatmulDescCreate",
    "cublasLtMatmulDescDestroy",
    "cublasLtMatmulDescSetAttribute",
    "cublasLtMatmulPreferenceCreate",
    "cublasLtMatmulPreferenceDestroy",
    "cublasLtMatmulPreferenceSetAttribute",
    "cublasLtMatrixLayoutCreate",
    "cublasLtMatrixLayoutSetAttribute",
];

/// Algorithms asked of the heuristic for one product: each one returned is a route to time.
const ALGOS: usize = 8;

/// Whether libcublasLt loads here with every function flatnn calls. Probed once per process;
/// never panics.
pub(crate) fn lt_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: only tries to open the library, then closes it (cudarc's loader would panic
        // where it is missing).
        if !unsafe { sys::is_culib_present() } {
            return false;
        }
        // SAFETY: the library is present (above); looking a symbol up runs nothing.
        let Ok(lib) = guarded_result(|| Ok(unsafe { sys::culib() })) else { return false };
        // SAFETY: as above; the symbols are only looked up, never called through this type.
        FUNCTIONS.iter().all(|f| unsafe { lib.get::<*const c_void>(f.as_bytes()) }.is_ok())
    })
}

fn lt_error(what: &str, status: sys::cublasStatus_t) -> Error {
    Error::Cuda { what: format!("cuBLASLt: {what}: {status:?}") }
}

/// A cuBLASLt handle (cuBLASLt takes the stream and the workspace with each call).
pub(super) struct LtHandle(sys::cublasLtHandle_t);

impl LtHandle {
    /// A handle, or None where libcublasLt is missing or will not make one (there are then no
    /// cuBLASLt routes). The caller holds `device_wide`.
    pub(super) fn new() -> Option<LtHandle> {
        if !lt_present() {
            return None;
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: writes a new handle into `handle`; every function was found (lt_present).
        let status = unsafe { sys::cublasLtCreate(&mut handle) };
        (status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(LtHandle(handle))
    }
}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; the owning `Blas` waited for its stream.
        let _ = unsafe { sys::cublasLtDestroy(self.0) };
    }
}

/// One cuBLASLt algorithm for one product: the product's descriptors (index `plan` in
/// [`PLANS`]), the algorithm's rank among the heuristic's results, and the algorithm itself (an
/// opaque value that cuBLASLt lets be copied and kept). Routes are equal only where they run
/// the same algorithm on the same descriptors, so the times the measuring keeps per route
/// (src/cuda/routes.rs) are each of one algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LtRoute {
    plan: u32,
    rank: u8,
    algo: [u64; 8],
}

impl LtRoute {
    /// What the route report calls it: `cublaslt#` and the heuristic's rank (0 its first).
    pub(crate) fn name(&self) -> String {
        format!("cublaslt#{}", self.rank)
    }
}

/// A stored matrix as cuBLASLt describes it (column-major): rows, columns, leading dimension.
type Layout = (u64, u64, i64);

/// C (m × n, row-major with rows of `ldc`) = A (m × k) · B (k × n) as column-major cuBLASLt
/// computes it: D = Cᵀ (n × m, leading dimension `ldc`) = Bᵀ·Aᵀ, each transpose the same storage
/// with strides swapped; so D's rows are C's columns and a bias of C's columns is D's rows'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Shape {
    /// Bᵀ (n × k): transposed (stored k × n column-major) or not, and its layout.
    a: (bool, Layout),
    /// Aᵀ (k × m), likewise.
    b: (bool, Layout),
    d: Layout,
}

impl Shape {
    fn of(m: usize, n: usize, k: usize, a: &DevMat, b: &DevMat, ldc: usize) -> Shape {
        let stored = |rows: usize, cols: usize, rs: usize, cs: usize| {
            let (op, ld) = operand(rows, cols, rs, cs);
            let t = op == cublasOperation_t::CUBLAS_OP_T;
            let (r, c) = if t { (cols, rows) } else { (rows, cols) };
            (t, (r as u64, c as u64, i64::from(ld)))
        };
        Shape { a: stored(n, k, b.cs, b.rs), b: stored(k, m, a.cs, a.rs), d: (n as u64, m as u64, ldc as i64) }
    }

    /// Whether `other` lays its matrices out as this one (same transposes and leading
    /// dimensions), whatever their sizes.
    fn same_layout(&self, other: &Shape) -> bool {
        let lay = |s: &Shape| (s.a.0, s.a.1 .2, s.b.0, s.b.1 .2, s.d.2);
        lay(self) == lay(other)
    }
}

/// What a plan's descriptors are for: the shape measured, whether the epilogue adds a bias,
/// TF32, and the alignment (bytes, up to 256) of A, B, D and the bias that the heuristic was
/// told of (an algorithm may need them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    shape: Shape,
    bias: bool,
    tf32: bool,
    align: [u32; 4],
}

/// A product's descriptors: the matmul's, and the layouts of Bᵀ, Aᵀ and D (C is D: β = 0).
struct Plan {
    key: Key,
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
}

// SAFETY: descriptors are host memory that cuBLASLt reads during a call; a plan is only used
// under the lock of `PLANS`, by one thread at a time.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was made by `Plan::new` and is destroyed once.
        unsafe {
            if !self.desc.is_null() {
                let _ = sys::cublasLtMatmulDescDestroy(self.desc);
            }
            for layout in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = sys::cublasLtMatrixLayoutDestroy(layout);
            }
        }
    }
}

/// Every plan made in this process, one per [`Key`]; never freed (a few hundred bytes per
/// distinct product), so that a route may name its plan by index.
static PLANS: Mutex<Vec<Plan>> = Mutex::new(Vec::new());

/// The heuristic's answer for each [`Offer`] asked in this process: the first is what every
/// later cache gets, so that the routes of two caches of one model compare equal and share their
/// times (src/cuda/routes.rs), and so take the same algorithms and compute the same bits. Asked
/// again, the heuristic may hand back the same algorithms as other bytes.
static OFFERED: Mutex<Vec<(Offer, Vec<LtRoute>)>> = Mutex::new(Vec::new());

/// What the heuristic was asked: the plan (index in [`PLANS`]), whether only deterministic
/// reductions were allowed, and the kind of device (compute capability, SM count): two cards
/// of one kind share answers, so that their caches compute the same bits; cards of another
/// kind ask again.
type Offer = (u32, bool, (u32, u32), u32);

/// Bytes a device address is aligned to, up to 256 (cuBLASLt's largest requirement).
fn alignment(ptr: u64) -> u32 {
    1 << ptr.trailing_zeros().min(8)
}

/// Whether algorithms with split-K reduction scheme `scheme` (CUBLASLT_ALGO_CONFIG_REDUCTION_
/// SCHEME) are offered. Deterministic: no split (NONE), or the out-of-place reductions
/// (COMPUTE_TYPE, OUTPUT_TYPE), where each k-slice's partial sums go to the workspace and a
/// separate pass adds them in a fixed order. Not INPLACE, where the slices add into the output
/// one after another in an order kept by counters in the workspace: cuBLASLt documents that order
/// as sequential, but it is set at run time, and where determinism is asked for flatnn offers
/// only schemes whose order is fixed by their structure. Otherwise any scheme.
fn reduction_allowed(scheme: u32, deterministic: bool) -> bool {
    scheme & !reduction_mask(deterministic) == 0
}

/// The schemes [`reduction_allowed`] allows, as CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK
/// takes them (NONE, 0, is always allowed).
fn reduction_mask(deterministic: bool) -> u32 {
    use sys::cublasLtReductionScheme_t::*;
    match deterministic {
        true => CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32 | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE as u32,
        false => CUBLASLT_REDUCTION_SCHEME_MASK as u32,
    }
}

impl Plan {
    /// The descriptors of `key`, its bias pointer unset.
    fn new(key: Key) -> Result<Plan> {
        use sys::cublasLtMatmulDescAttributes_t::*;
        let compute =
            if key.tf32 { sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32 } else { sys::cublasComputeType_t::CUBLAS_COMPUTE_32F };
        let mut plan = Plan { key, desc: std::ptr::null_mut(), layouts: [std::ptr::null_mut(); 3] };
        let f32_type = sys::cudaDataType::CUDA_R_32F;
        // SAFETY: each call writes a new descriptor into the plan (destroyed by its Drop, also
        // on an early return) or sets an attribute of one from a value of the attribute's type
        // and size.
        unsafe {
            sys::cublasLtMatmulDescCreate(&mut plan.desc, compute, f32_type).result().map_err(|e| lt_error("a matmul descriptor", e.0))?;
            let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T as i32 } else { cublasOperation_t::CUBLAS_OP_N as i32 };
            let epilogue =
                if key.bias { sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS } else { sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT }
                    as u32;
            for (attr, value) in [
                (CUBLASLT_MATMUL_DESC_TRANSA, op(key.shape.a.0) as u32),
                (CUBLASLT_MATMUL_DESC_TRANSB, op(key.shape.b.0) as u32),
                (CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue),
            ] {
                set(plan.desc, attr, &value)?;
            }
            for (slot, (rows, cols, ld)) in plan.layouts.iter_mut().zip([key.shape.a.1, key.shape.b.1, key.shape.d]) {
                sys::cublasLtMatrixLayoutCreate(slot, f32_type, rows, cols, ld).result().map_err(|e| lt_error("a matrix layout", e.0))?;
            }
        }
        Ok(plan)
    }

    /// Sets the bias pointer (where the epilogue adds one) and the sizes of `shape` (laid out as
    /// the plan's) in the descriptors.
    fn set_call(&self, shape: &Shape, bias: u64) -> Result<()> {
        use sys::cublasLtMatrixLayoutAttribute_t::{CUBLASLT_MATRIX_LAYOUT_COLS, CUBLASLT_MATRIX_LAYOUT_ROWS};
        debug_assert!(self.key.shape.same_layout(shape));
        // SAFETY: live descriptors of this plan (used under the lock of PLANS), attributes set
        // from values of their types and sizes.
        unsafe {
            if self.key.bias {
                set(self.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
            }
            for (layout, (rows, cols, _)) in self.layouts.into_iter().zip([shape.a.1, shape.b.1, shape.d]) {
                for (attr, value) in [(CUBLASLT_MATRIX_LAYOUT_ROWS, rows), (CUBLASLT_MATRIX_LAYOUT_COLS, cols)] {
                    let ptr = &value as *const u64 as *const c_void;
                    sys::cublasLtMatrixLayoutSetAttribute(layout, attr, ptr, 8).result().map_err(|e| lt_error("a layout's size", e.0))?;
                }
            }
        }
        Ok(())
    }
}

/// Sets matmul descriptor attribute `attr` to `value`.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
unsafe fn set<T>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, value: &T) -> Result<()> {
    let ptr = value as *const T as *const c_void;
    sys::cublasLtMatmulDescSetAttribute(desc, attr, ptr, size_of::<T>()).result().map_err(|e| lt_error("a matmul attribute", e.0))
}

/// The index in [`PLANS`] of the plan of `key`, made where there is none yet.
fn plan_of(key: Key) -> Result<u32> {
    let mut plans = PLANS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(index) = plans.iter().position(|p| p.key == key) {
        return Ok(index as u32);
    }
    plans.push(Plan::new(key)?);
    Ok((plans.len() - 1) as u32)
}

impl Blas {
    /// The cuBLASLt algorithms the heuristic offers (up to [`ALGOS`]) for C (m × n, row-major)
    /// = A (m × k) · B (k × n), plus `bias` (n values: c + bias[j]) in the epilogue where given,
    /// in this handle's arithmetic (TF32 or FP32), with only deterministic split-K reductions
    /// where `deterministic` ([`reduction_allowed`]). None where cuBLASLt is missing here or
    /// the product is empty. At measuring time: makes the product's descriptors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lt_routes(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: &DevMat,
        b: &DevMat,
        c: &DevMatMut,
        bias: Option<View<f32>>,
        deterministic: bool,
    ) -> Result<Vec<LtRoute>> {
        let Some(lt) = &self.lt else { return Ok(Vec::new()) };
        if m == 0 || n == 0 || k == 0 || c.cs != 1 {
            return Ok(Vec::new());
        }
        let shape = Shape::of(m, n, k, a, b, c.rs);
        let bias_ptr = bias.map_or(0, |b| b.ptr());
        let align = [b.data.ptr(), a.data.ptr(), c.data.ptr(), bias_ptr].map(alignment);
        let key = Key { shape, bias: bias.is_some(), tf32: self.tf32, align };
        let index = plan_of(key)?;
        let offer = (index, deterministic, self.gpu.compute_capability(), self.gpu.multiprocessors());
        let mut offered = OFFERED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, routes)) = offered.iter().find(|(k, _)| *k == offer) {
            return Ok(routes.clone());
        }
        let plans = PLANS.lock().unwrap_or_else(PoisonError::into_inner);
        let plan = &plans[index as usize];
        plan.set_call(&shape, bias_ptr)?;
        // zeroed: bytes of an algorithm the heuristic leaves unwritten are then equal in every
        // answer, not what the stack held
        let mut results = [std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::zeroed(); ALGOS];
        let mut returned = 0i32;
        self.gpu.bind()?;
        // SAFETY: a preference made and destroyed here, its attributes set from values of their
        // types; the heuristic writes at most ALGOS results (`returned` of them) into `results`.
        unsafe {
            use sys::cublasLtMatmulPreferenceAttributes_t::*;
            let mut pref = std::ptr::null_mut();
            sys::cublasLtMatmulPreferenceCreate(&mut pref).result().map_err(|e| lt_error("a preference", e.0))?;
            let mask = reduction_mask(deterministic);
            let workspace = WORKSPACE_BYTES as u64;
            let sets = [
                (CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace as *const u64 as *const c_void, 8),
                (CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask as *const u32 as *const c_void, 4),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0] as *const u32 as *const c_void, 4),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1] as *const u32 as *const c_void, 4),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2] as *const u32 as *const c_void, 4),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[2] as *const u32 as *const c_void, 4),
            ];
            let mut status = sets
                .iter()
                .map(|&(attr, ptr, size)| sys::cublasLtMatmulPreferenceSetAttribute(pref, attr, ptr, size))
                .find(|s| *s != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
            if status.is_none() {
                let [la, lb, ld] = plan.layouts;
                let s = sys::cublasLtMatmulAlgoGetHeuristic(
                    lt.0,
                    plan.desc,
                    la,
                    lb,
                    ld,
                    ld,
                    pref,
                    ALGOS as i32,
                    results.as_mut_ptr().cast(),
                    &mut returned,
                );
                status = (s != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(s);
            }
            let _ = sys::cublasLtMatmulPreferenceDestroy(pref);
            match status {
                // no algorithm for this product: no cuBLASLt route
                Some(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED) => return Ok(Vec::new()),
                Some(s) => return Err(lt_error("the heuristic", s)),
                None => {}
            }
        }
        let returned = (returned.max(0) as usize).min(ALGOS);
        let mut routes = Vec::new();
        for (rank, result) in results[..returned].iter().enumerate() {
            // SAFETY: the heuristic wrote the first `returned` results
            let result = unsafe { result.assume_init() };
            if result.state != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || result.workspaceSize > WORKSPACE_BYTES {
                continue;
            }
            let mut scheme = 0u32;
            let mut written = 0usize;
            // SAFETY: reads one u32 attribute of an algorithm the heuristic returned
            let read = unsafe {
                sys::cublasLtMatmulAlgoConfigGetAttribute(
                    &result.algo,
                    sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                    &mut scheme as *mut u32 as *mut c_void,
                    4,
                    &mut written,
                )
            };
            if read == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && reduction_allowed(scheme, deterministic) {
                routes.push(LtRoute { plan: index, rank: rank as u8, algo: result.algo.data });
            }
        }
        offered.push((offer, routes.clone()));
        Ok(routes)
    }

    /// C (m × n, row-major) = A (m × k) · B (k × n), plus `bias` where given (the route's
    /// product must have one; see [`Blas::lt_routes`]), on cuBLASLt algorithm `route` and this
    /// handle's stream; allocates nothing. Ok(false), with nothing queued, where the algorithm
    /// does not take this product: A, B or C laid out otherwise than when it was offered, less
    /// aligned, or (a batch smaller than the one measured) sizes it does not support. The
    /// caller then runs the product another way.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lt_matmul(
        &self,
        route: LtRoute,
        m: usize,
        n: usize,
        k: usize,
        a: DevMat,
        b: DevMat,
        c: DevMatMut,
        bias: Option<View<f32>>,
    ) -> Result<bool> {
        let extent =
            |rows: usize, cols: usize, rs: usize, cs: usize| if rows == 0 || cols == 0 { 0 } else { (rows - 1) * rs + (cols - 1) * cs + 1 };
        assert!(a.data.len() >= extent(m, k, a.rs, a.cs) && b.data.len() >= extent(k, n, b.rs, b.cs), "lt_matmul: A or B is short");
        assert!(c.cs == 1 && c.rs >= n && c.data.len() >= extent(m, n, c.rs, 1), "lt_matmul: C is short or not row-major");
        assert!(bias.is_none_or(|b| b.len() >= n), "lt_matmul: the bias is short");
        let Some(lt) = &self.lt else { return Ok(false) };
        if m == 0 || n == 0 || k == 0 {
            return Ok(false);
        }
        let shape = Shape::of(m, n, k, &a, &b, c.rs);
        let bias_ptr = bias.map_or(0, |b| b.ptr());
        let align = [b.data.ptr(), a.data.ptr(), c.data.ptr(), bias_ptr].map(alignment);
        let plans = PLANS.lock().unwrap_or_else(PoisonError::into_inner);
        let plan = &plans[route.plan as usize];
        let aligned = align.iter().zip(plan.key.align).all(|(&now, then)| now >= then);
        if !plan.key.shape.same_layout(&shape) || plan.key.bias != bias.is_some() || !aligned {
            return Ok(false);
        }
        plan.set_call(&shape, bias_ptr)?;
        let [la, lb, ld] = plan.layouts;
        let algo = sys::cublasLtMatmulAlgo_t { data: route.algo };
        if shape != plan.key.shape {
            let mut check = std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit();
            // SAFETY: live descriptors (under the lock); the check writes one result
            let status = unsafe { sys::cublasLtMatmulAlgoCheck(lt.0, plan.desc, la, lb, ld, ld, &algo, check.as_mut_ptr()) };
            // SAFETY: written where the check succeeded
            if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || unsafe { check.assume_init() }.workspaceSize > WORKSPACE_BYTES {
                return Ok(false);
            }
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (pa, pb, pc) = (b.data.ptr() as *const c_void, a.data.ptr() as *const c_void, c.data.ptr() as *mut c_void);
        self.gpu.bind()?;
        // SAFETY: live descriptors (under the lock) describing A, B and C as checked above to lie
        // in their views; α and β are host values read during the call; the workspace is this
        // handle's, used on its stream only.
        let status = unsafe {
            sys::cublasLtMatmul(
                lt.0,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                pa,
                la,
                pb,
                lb,
                &beta as *const f32 as *const c_void,
                pc,
                ld,
                pc,
                ld,
                &algo,
                self.workspace.ptr() as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as _,
            )
        };
        status.result().map_err(|e| lt_error(&format!("matmul ({m}×{n}×{k})"), e.0))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Routes are named by the heuristic's rank.
    #[test]
    fn a_route_is_named_by_its_rank() {
        assert_eq!(LtRoute { plan: 7, rank: 3, algo: [0; 8] }.name(), "cublaslt#3");
    }

    /// Deterministic: no split or an out-of-place reduction; otherwise any scheme.
    #[test]
    fn only_ordered_reductions_where_determinism_is_asked() {
        use sys::cublasLtReductionScheme_t::*;
        let none = CUBLASLT_REDUCTION_SCHEME_NONE as u32;
        let in_place = CUBLASLT_REDUCTION_SCHEME_INPLACE as u32;
        let compute = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
        let output = CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE as u32;
        for (scheme, deterministic) in [(none, true), (compute, true), (output, true), (in_place, false)] {
            assert!(reduction_allowed(scheme, deterministic) && reduction_allowed(scheme, false), "{scheme}");
            assert_eq!(reduction_allowed(scheme, true), deterministic, "{scheme}");
        }
    }

    /// The three products of a dense layer as cuBLASLt computes them (D = Cᵀ = Bᵀ·Aᵀ, column-
    /// major): forward Z (batch × out) = X · Wᵀ, input gradient dX (batch × in) = dZ · W, weight
    /// gradient dW (out × in) = dZᵀ · X; D's rows are C's columns (a forward's bias is D's rows').
    #[test]
    fn dense_products_are_laid_out_as_column_major_transposes() {
        // SAFETY: an empty view, never used on a device
        let view = unsafe { View::<f32>::from_raw(0, 0) };
        let (batch, out, inp) = (5usize, 3usize, 7usize);
        let mat = |rs, cs| DevMat { data: view, rs, cs };
        // forward: X row-major (rs in), Wᵀ = W (out × in) row-major seen with strides swapped
        let forward = Shape::of(batch, out, inp, &mat(inp, 1), &mat(1, inp), out);
        // Bᵀ = W (out × in) is in × out column-major, stored so: transposed, ld in
        assert_eq!(forward.a, (true, (inp as u64, out as u64, inp as i64)));
        // Aᵀ = Xᵀ (in × batch): X's storage column-major, not transposed, ld in
        assert_eq!(forward.b, (false, (inp as u64, batch as u64, inp as i64)));
        assert_eq!(forward.d, (out as u64, batch as u64, out as i64));
        // input gradient: dZ (batch × out) row-major, W (out × in) row-major
        let input = Shape::of(batch, inp, out, &mat(out, 1), &mat(inp, 1), inp);
        assert_eq!(input.a, (false, (inp as u64, out as u64, inp as i64)));
        assert_eq!(input.b, (false, (out as u64, batch as u64, out as i64)));
        assert_eq!(input.d, (inp as u64, batch as u64, inp as i64));
        // weight gradient: dZᵀ (out × batch, strides (1, out)), X (batch × in) row-major
        let weight = Shape::of(out, inp, batch, &mat(1, out), &mat(inp, 1), inp);
        assert_eq!(weight.a, (false, (inp as u64, batch as u64, inp as i64)));
        assert_eq!(weight.b, (true, (out as u64, batch as u64, out as i64)));
        assert_eq!(weight.d, (inp as u64, out as u64, inp as i64));
        // a smaller batch lays the forward out alike
        assert!(forward.same_layout(&Shape::of(2, out, inp, &mat(inp, 1), &mat(1, inp), out)));
        assert!(!forward.same_layout(&input));
    }
}
