//! The CPU matrix product the layers run on, for programs that want one directly.
//!
//! C (m×n) ← α·A (m×k)·B (k×n) + β·C in single precision, each matrix given as a slice and a
//! row and a column stride (element (i, j) of A is `a.data[i * a.rs + j * a.cs]`), so a
//! transpose is a swap of strides. If β is zero, C need not be initialised: NaN in C is
//! overwritten, not propagated.
//!
//! ```
//! use flatnn::gemm::{Gemm, Mat, MatMut};
//!
//! let mut gemm = Gemm::new(1)?;
//! let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // 2×3, row-major
//! let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]; // 3×2, row-major
//! let mut c = [f32::NAN; 4];
//! let (am, bm) = (Mat { data: &a, rs: 3, cs: 1 }, Mat { data: &b, rs: 2, cs: 1 });
//! gemm.sgemm(2, 2, 3, 1.0, am, bm, 0.0, MatMut { data: &mut c, rs: 2, cs: 1 })?;
//! assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
//! # Ok::<(), flatnn::Error>(())
//! ```

use crate::cpu::gemm::{self, GemmWorkspace};
use crate::cpu::pool::Pool;
use crate::error::Result;

pub use crate::cpu::gemm::{Mat, MatMut};

/// A matrix product with its own threads and packing buffers, allocated once by [`Gemm::new`];
/// a product then allocates nothing.
///
/// Each element of C is summed over k in one order, whatever the thread count, so results have
/// the same bits on any number of threads.
///
/// [`Gemm::sgemm`] takes `&mut self`: threads cannot share one `Gemm` (its packing buffers)
/// without a lock, and each may have its own. This does not compile:
///
/// ```compile_fail
/// # use flatnn::gemm::{Gemm, Mat, MatMut};
/// let mut gemm = Gemm::new(2).unwrap();
/// std::thread::scope(|scope| {
///     for _ in 0..2 {
///         scope.spawn(|| {
///             let (a, mut c) = ([1.0f32], [0.0f32]);
///             let m = Mat { data: &a, rs: 1, cs: 1 };
///             gemm.sgemm(1, 1, 1, 1.0, m, m, 0.0, MatMut { data: &mut c, rs: 1, cs: 1 })
///         });
///     }
/// });
/// ```
pub struct Gemm {
    pool: Pool,
    ws: GemmWorkspace,
}

impl Gemm {
    /// A product on `threads` threads, the caller's included: from 1 to 4 per logical CPU of
    /// this machine (else [`crate::Error::Config`], as for a thread or buffer that cannot be had).
    pub fn new(threads: usize) -> Result<Gemm> {
        let pool = Pool::new(threads)?;
        Ok(Gemm { ws: GemmWorkspace::new(threads)?, pool })
    }

    /// Threads a product runs on, the caller's included.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The instruction set of the kernel: `avx512`, `avx2` or `portable`, the best this CPU
    /// has (capped by the environment variable `FLATNN_ISA`, read once per process). AVX2 and
    /// AVX-512 give the same bits; the portable kernel may differ from them in the last bits.
    pub fn isa(&self) -> &'static str {
        self.ws.isa().name()
    }

    /// B (k×n, any strides) packed once for this product's kernel, for products that reuse
    /// it ([`Gemm::sgemm_packed`]); [`crate::Error::Shape`] if `b`'s slice is too short for
    /// k×n with its strides, [`crate::Error::OutOfMemory`] if the k·n values cannot be had.
    pub fn pack(&self, k: usize, n: usize, b: Mat) -> Result<PackedB> {
        gemm::check_extent("B", b.data.len(), k, n, b.rs, b.cs)?;
        let mut packed = gemm::PackedB::new(self.ws.isa(), k, n)?;
        packed.pack(b);
        Ok(PackedB(packed))
    }

    /// C (m×n) ← α·A (m×k)·B (k×n) + β·C; if β is zero, C need not be initialised.
    ///
    /// Preconditions, checked before anything is written ([`crate::Error::Shape`] otherwise):
    /// each operand's slice holds every element its shape and strides reach (computed without
    /// overflow), and no two elements of C share a place (the dimension of C with the smaller
    /// stride must have stride ≥ 1 and the other must step past it, as in row- or column-major
    /// storage with any leading dimension). A and B may overlap each other and may use stride
    /// 0 (broadcast).
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm(&mut self, m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: MatMut) -> Result<()> {
        gemm::check_operands(m, n, k, &a, &b, &c)?;
        gemm::sgemm(&self.pool, &mut self.ws, m, n, k, alpha, a, b, beta, c);
        Ok(())
    }

    /// C (m×n) ← α·A (m×k)·B + β·C with B packed by [`Gemm::pack`] (its k and n); the same
    /// bits as [`Gemm::sgemm`] gives with B unpacked, except where that multiplies single
    /// rows without packing (one row of A or one column of B, or k ≤ 4). Preconditions as
    /// for [`Gemm::sgemm`], checked before anything is written.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_packed(&mut self, m: usize, alpha: f32, a: Mat, b: &PackedB, beta: f32, c: MatMut) -> Result<()> {
        let (k, n) = (b.0.k(), b.0.n());
        gemm::check_extent("A", a.data.len(), m, k, a.rs, a.cs)?;
        gemm::check_c(m, n, &c)?;
        gemm::sgemm_packed_b(&self.pool, &mut self.ws, m, alpha, a, &b.0, beta, c);
        Ok(())
    }
}

/// A k×n B operand packed once by [`Gemm::pack`], in the layout its kernel reads.
pub struct PackedB(gemm::PackedB);
