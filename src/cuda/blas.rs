//! cuBLAS SGEMM on row-major (or column-major) matrices, with the CPU GEMM's vocabulary: a
//! matrix is a view with a row stride `rs` and a column stride `cs`, one of them 1.

use super::blaslt::LtHandle;
use super::buffer::DevBuf;
use super::context::Gpu;
use super::driver_error;
use super::launch::{View, ViewMut};
use crate::error::{Error, Result};
use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// cuBLAS's workspace, given to it once so that no call (nor graph capture) allocates: 32 MiB,
/// NVIDIA's advice for Hopper.
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;

/// A read-only matrix in device memory: element (i, j) at `data[i·rs + j·cs]`.
#[derive(Clone, Copy, Debug)]
pub struct DevMat<'a> {
    pub data: View<'a, f32>,
    pub rs: usize,
    pub cs: usize,
}

/// A matrix written by a product.
#[derive(Debug)]
pub struct DevMatMut<'a> {
    pub data: ViewMut<'a, f32>,
    pub rs: usize,
    pub cs: usize,
}

/// A cuBLAS handle bound to one stream, with its own workspace. Use it from one thread at a
/// time (it is `Send`, not `Sync`).
pub struct Blas {
    handle: cublas_sys::cublasHandle_t,
    pub(super) stream: Arc<CudaStream>,
    pub(super) tf32: bool,
    /// Shared with cuBLASLt's products ([`LtHandle`]): both run on `stream`, one at a time.
    pub(super) workspace: DevBuf<u8>,
    pub(super) gpu: Arc<Gpu>,
    /// cuBLASLt, where its library loads (src/cuda/blaslt.rs).
    pub(super) lt: Option<LtHandle>,
}

// SAFETY: a cuBLAS handle may move between threads; `Blas` is not `Sync`, so one thread uses
// it at a time, which is what cuBLAS requires.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // Wait for the products queued with this handle before its workspace is freed.
        if self.gpu.bind().is_ok() && self.stream.synchronize().is_ok() {
            let _exclusive = super::device_wide();
            // SAFETY: created in `Gpu::blas`, destroyed once; nothing else holds it.
            let _ = unsafe { cublas::destroy_handle(self.handle) };
            drop(self.lt.take());
        }
    }
}

impl Gpu {
    /// A cuBLAS handle for `stream`: FP32 arithmetic, or TF32 tensor cores when `tf32` (faster,
    /// about 10 bits of mantissa in the products).
    pub fn blas(self: &Arc<Self>, stream: &Arc<CudaStream>, tf32: bool) -> Result<Blas> {
        assert_eq!(stream.context().cu_ctx(), self.ctx.cu_ctx(), "a stream of another device");
        self.bind()?;
        let err = |what: &'static str| move |e: cublas::CublasError| Error::Cuda { what: format!("cuBLAS: {what}: {e:?}") };
        let workspace = DevBuf::zeros(self, stream, WORKSPACE_BYTES)?;
        let (handle, lt) = {
            let _exclusive = super::device_wide();
            (cublas::create_handle().map_err(err("creating a handle"))?, LtHandle::new())
        };
        // Owned from here, so that an error below destroys it.
        let mut blas = Blas { handle, stream: Arc::clone(stream), tf32, workspace, gpu: Arc::clone(self), lt };
        blas.configure()?;
        Ok(blas)
    }
}

/// How cuBLAS (column-major) sees a stored matrix of `rows × cols`: transposed or not, and
/// its leading dimension. Panics on strides that are neither row- nor column-major.
pub(super) fn operand(rows: usize, cols: usize, rs: usize, cs: usize) -> (cublas_sys::cublasOperation_t, i32) {
    use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    // column-major: (i, j) at i + j·cs, needs cs ≥ rows; a single column may have any cs
    if rs == 1 && (cs >= rows || cols <= 1) {
        return (CUBLAS_OP_N, ld(cs.max(rows)));
    }
    // row-major: column-major storage of the transpose, leading dimension rs ≥ cols
    if cs == 1 && (rs >= cols || rows <= 1) {
        return (CUBLAS_OP_T, ld(rs.max(cols)));
    }
    panic!("sgemm: a {rows}×{cols} matrix with strides ({rs}, {cs}) is neither row- nor column-major");
}

fn ld(n: usize) -> i32 {
    i32::try_from(n.max(1)).expect("sgemm: leading dimension over 2^31")
}

/// Values a `rows × cols` matrix with strides (rs, cs) spans.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

impl Blas {
    /// C (m × n) ← α·A (m × k)·B (k × n) + β·C, on this handle's stream. Strides as the CPU
    /// `sgemm` (each matrix row- or column-major; a transpose is a swap of strides); if β is 0, C
    /// need not be initialised. Allocates nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm(&self, m: usize, n: usize, k: usize, alpha: f32, a: DevMat, b: DevMat, beta: f32, c: DevMatMut) -> Result<()> {
        self.sgemm_batched(1, m, n, k, alpha, (a, 0), (b, 0), beta, (c, 0))
    }

    /// `count` products C_i ← α·A_i·B_i + β·C_i, where X_i starts `stride` values after X_{i−1}
    /// (a stride of 0 shares one matrix among all, e.g. a conv's weights). One cuBLAS call.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_batched(
        &self,
        count: usize,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        (a, stride_a): (DevMat, usize),
        (b, stride_b): (DevMat, usize),
        beta: f32,
        (c, stride_c): (DevMatMut, usize),
    ) -> Result<()> {
        let spans = |x: usize, stride: usize| if count == 0 || x == 0 { 0 } else { (count - 1) * stride + x };
        assert!(a.data.len() >= spans(extent(m, k, a.rs, a.cs), stride_a), "sgemm: A is shorter than its shape");
        assert!(b.data.len() >= spans(extent(k, n, b.rs, b.cs), stride_b), "sgemm: B is shorter than its shape");
        assert!(c.data.len() >= spans(extent(m, n, c.rs, c.cs), stride_c), "sgemm: C is shorter than its shape");
        if count == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        // cuBLAS is column-major. A column-major C is used as is; a row-major C is computed as
        // Cᵀ (n × m) = Bᵀ·Aᵀ, each transpose being the same storage with strides swapped.
        let c_col_major = c.rs == 1 && (c.cs >= m || n <= 1) && !(c.cs == 1 && m > 1);
        let ((m, n), (a, b), (sa, sb)) =
            if c_col_major { ((m, n), (a, b), (stride_a, stride_b)) } else { ((n, m), (swap(b), swap(a)), (stride_b, stride_a)) };
        let (c_rs, c_cs) = if c_col_major { (c.rs, c.cs) } else { (c.cs, c.rs) };
        let (op_a, lda) = operand(m, k, a.rs, a.cs);
        let (op_b, ldb) = operand(k, n, b.rs, b.cs);
        let (op_c, ldc) = operand(m, n, c_rs, c_cs);
        debug_assert_eq!(op_c, cublas_sys::cublasOperation_t::CUBLAS_OP_N);
        let int = |v: usize| i32::try_from(v).map_err(|_| Error::Shape(format!("sgemm: {v} is over 2^31")));
        let (mi, ni, ki, count) = (int(m)?, int(n)?, int(k)?, int(count)?);
        let (pa, pb, pc) = (a.data.ptr() as *const f32, b.data.ptr() as *const f32, c.data.ptr() as *mut f32);
        self.gpu.bind()?;
        // SAFETY: the handle is live and bound to a stream of this context; every matrix was
        // checked above to lie inside its view, and α, β are host values read during the call.
        let status = unsafe {
            if count == 1 {
                cublas_sys::cublasSgemm_v2(self.handle, op_a, op_b, mi, ni, ki, &alpha, pa, lda, pb, ldb, &beta, pc, ldc)
            } else {
                let (sa, sb, sc) = (sa as i64, sb as i64, stride_c as i64);
                cublas_sys::cublasSgemmStridedBatched(
                    self.handle,
                    op_a,
                    op_b,
                    mi,
                    ni,
                    ki,
                    &alpha,
                    pa,
                    lda,
                    sa,
                    pb,
                    ldb,
                    sb,
                    &beta,
                    pc,
                    ldc,
                    sc,
                    count,
                )
            }
        };
        status.result().map_err(|e| Error::Cuda { what: format!("cuBLAS sgemm ({m}×{n}×{k}, {count} times): {e:?}") })
    }

    /// Moves the handle to `stream` (after the work queued on its old one) and sets FP32 or
    /// TF32 arithmetic; a no-op when both are as they are.
    pub fn rebind(&mut self, stream: &Arc<CudaStream>, tf32: bool) -> Result<()> {
        if Arc::ptr_eq(&self.stream, stream) && self.tf32 == tf32 {
            return Ok(());
        }
        if !Arc::ptr_eq(&self.stream, stream) {
            self.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
        }
        (self.stream, self.tf32) = (Arc::clone(stream), tf32);
        self.configure()
    }

    /// Applies `stream`, the workspace and `tf32` to the handle. The workspace comes after the
    /// stream: `cublasSetStream` puts the handle back on cuBLAS's own workspace pool, which
    /// allocates stream-ordered, so a captured step got allocation and free nodes (2 of each at
    /// batch 128, 6 at 1024 in the MLP's training graph, before this was found).
    fn configure(&mut self) -> Result<()> {
        let err = |what: &'static str| move |e: cublas::CublasError| Error::Cuda { what: format!("cuBLAS: {what}: {e:?}") };
        let mode =
            if self.tf32 { cublas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH } else { cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH };
        self.gpu.bind()?;
        let workspace = self.workspace.ptr() as *mut std::ffi::c_void;
        // SAFETY: a live handle, a stream of its context and a workspace of its context, all
        // held by `self` (so they outlive every use of the handle).
        unsafe {
            cublas::set_stream(self.handle, self.stream.cu_stream() as _).map_err(err("binding the stream"))?;
            cublas_sys::cublasSetWorkspace_v2(self.handle, workspace, WORKSPACE_BYTES).result().map_err(err("setting the workspace"))?;
            cublas_sys::cublasSetMathMode(self.handle, mode).result().map_err(err("setting the math mode"))?;
        }
        Ok(())
    }
}

/// The transpose: same storage, strides swapped.
fn swap(x: DevMat) -> DevMat {
    DevMat { data: x.data, rs: x.cs, cs: x.rs }
}
