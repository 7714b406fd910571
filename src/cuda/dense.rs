//! The GPU dense product C (m × n) = A (m × k) · B (k × n) with a layer's element-wise work
//! fused in (kernels/dense.cu; the tensor-core tiles in kernels/dense_mma.cu), and the ways
//! ([`Route`]s) a dense layer's forward, input gradient and weight gradient can run: flatnn's
//! fused kernels (row-chunked, panels, tensor-core tiles), weight gradients split over the batch
//! in clusters (src/cuda/wgrad.rs), or cuBLAS with separate bias, activation and bias-gradient
//! kernels. Which routes fit a product is decided here ([`Gpu::dense_routes`]: launch limits,
//! alignment, the device); which one runs is measured (src/cuda/routes.rs).

use super::blas::DevMat;
use super::blaslt::LtRoute;
use super::context::{Gpu, Kernel, KERNELS};
use super::driver_error;
use super::launch::{int, kernel_args, View, ViewMut};
use super::ops::ints;
use super::options::Tuning;
use crate::activation::Activation;
use crate::error::Result;
use cudarc::driver::{result, CudaStream};

/// One direction of a dense layer's pass, each a product: forward Z (batch × out) = X · Wᵀ, input
/// gradient dX (batch × in) = dZ · W, weight gradient dW (out × in) = dZᵀ · X with db = Σ dZ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    Forward,
    InputGrad,
    WeightGrad,
}

impl Dir {
    pub(crate) const ALL: [Dir; 3] = [Dir::Forward, Dir::InputGrad, Dir::WeightGrad];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Dir::Forward => "forward",
            Dir::InputGrad => "input gradient",
            Dir::WeightGrad => "weight gradient",
        }
    }
}

/// One way to run a direction of a dense layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// One launch of a kernel of kernels/dense.cu or dense_mma.cu: the product and its epilogue.
    Fused(Kernel),
    /// A weight gradient split over the batch in clusters (`weight_grad_split`, src/cuda/wgrad.rs).
    Split,
    /// cuBLAS's SGEMM, then flatnn's bias and activation (forward) or bias-gradient kernel
    /// (weight gradient); an input gradient leaves the producer's activation to its own pass.
    Cublas,
    /// One of cuBLASLt's algorithms for the product (src/cuda/blaslt.rs), around it as on
    /// cuBLAS, but a forward without activation adds its bias in cuBLASLt's epilogue.
    Lt(LtRoute),
}

impl Route {
    /// What the route report calls it: the kernel's name, `weight_grad_split`, `cublas` or
    /// `cublaslt#` and the heuristic's rank of the algorithm.
    pub(crate) fn name(self) -> String {
        match self {
            Route::Fused(kernel) => KERNELS[kernel as usize].to_string(),
            Route::Split => "weight_grad_split".to_string(),
            Route::Cublas => "cublas".to_string(),
            Route::Lt(lt) => lt.name(),
        }
    }

    /// Whether an input gradient on this route leaves the producer's activation to the
    /// producer's own pass (cuBLAS and cuBLASLt; a fused route folds it in).
    pub(crate) fn leaves_producer(self) -> bool {
        matches!(self, Route::Cublas | Route::Lt(_))
    }

    /// Whether a weight gradient on this route adds into dW and db (which must then hold zeros
    /// first: see [`DenseEpilogue::WeightGrad`]).
    pub(crate) fn adds(self) -> bool {
        match self {
            Route::Fused(kernel) => MmaTile::of(kernel).is_some_and(|t| t.split(kernel) > 1),
            Route::Split | Route::Cublas | Route::Lt(_) => false,
        }
    }
}

/// Rows per block of the row-chunked kernels (SKINNY_ROWS in kernels/dense.cu), and the output
/// tile of the panel kernel (PANEL_M × PANEL_N).
const SKINNY_ROWS: usize = 8;
const PANEL_M: usize = 16;
const PANEL_N: usize = 32;

/// flatnn's kernels for any layout of A and B: one row a block (`dense_row`), a chunk of rows
/// and one, four or eight columns a block (`dense_skinny*`: the threads of a block split k),
/// and panels of 16 × 32 outputs (k staged through shared memory 128 at a time).
const ANY_LAYOUT: [Kernel; 5] = [Kernel::DenseRow, Kernel::DenseSkinny, Kernel::DenseSkinny4, Kernel::DenseSkinny8, Kernel::DensePanel];

/// The grid of a kernel of [`ANY_LAYOUT`] for an `m × cols` product: (groups of columns, groups
/// of rows).
fn any_layout_grid(kernel: Kernel, m: usize, cols: usize) -> (usize, usize) {
    match kernel {
        Kernel::DenseRow => (cols, m),
        Kernel::DenseSkinny => (cols, m.div_ceil(SKINNY_ROWS)),
        Kernel::DenseSkinny4 => (cols.div_ceil(4), m.div_ceil(SKINNY_ROWS)),
        Kernel::DenseSkinny8 => (cols.div_ceil(8), m.div_ceil(SKINNY_ROWS)),
        Kernel::DensePanel => (cols.div_ceil(PANEL_N), m.div_ceil(PANEL_M)),
        _ => unreachable!("{kernel:?} is not a dense kernel of any layout"),
    }
}

/// The grid of dense kernel `kernel` for an `m × cols` product (`cols` counts a weight
/// gradient's column of ones), or None where it is past the launch limits (2^31 − 1 blocks
/// along x, 65,535 along y).
fn dense_grid(kernel: Kernel, m: usize, cols: usize) -> Option<(u32, u32)> {
    let (x, y) = match MmaTile::of(kernel) {
        Some(tile) => tile.grid(kernel, m, cols),
        None => any_layout_grid(kernel, m, cols),
    };
    (x >= 1 && y >= 1 && x <= i32::MAX as usize && y <= 65_535).then_some((x as u32, y as u32))
}

/// One shape of the tensor-core tiles (`dense_mma_*` in kernels/dense_mma.cu): BM × BN outputs a
/// block of 256 threads (MMA_THREADS there), a kernel for each of the two layouts they take,
/// and for the 32 × 32 tile the weight gradient's with a tile's slices split over two blocks
/// (SPLIT 2: each adds its half into dW and db). The 16 × 32 tile has no forward kernel: on
/// the zoo (FP32 and TF32, every model and batch on an H200) it never won a forward product.
/// Each shape comes twice: its kernels sum three TF32 products a fragment (3xTF32, FP32's
/// accuracy), or with `tf32` one (`_tf32`: a third of the tensor-core work, TF32's accuracy),
/// which only a model that allows TF32 may run ([`tile_kernels`]).
#[derive(Clone, Copy)]
pub(crate) struct MmaTile {
    pub forward: Option<Kernel>,
    pub weight_grad: Kernel,
    pub weight_grad_split: Option<Kernel>,
    pub rows: usize,
    pub cols: usize,
    pub tf32: bool,
}

pub(crate) const MMA_TILES: [MmaTile; 8] = {
    use Kernel::*;
    const fn tile(
        forward: Option<Kernel>,
        weight_grad: Kernel,
        weight_grad_split: Option<Kernel>,
        shape: (usize, usize),
        tf32: bool,
    ) -> MmaTile {
        MmaTile { forward, weight_grad, weight_grad_split, rows: shape.0, cols: shape.1, tf32 }
    }
    [
        tile(Some(DenseMma16x16Kk), DenseMma16x16Mn, None, (16, 16), false),
        tile(Some(DenseMma32x16Kk), DenseMma32x16Mn, None, (32, 16), false),
        tile(None, DenseMma16x32Mn, None, (16, 32), false),
        tile(Some(DenseMma32x32Kk), DenseMma32x32Mn, Some(DenseMma32x32Mn2), (32, 32), false),
        tile(Some(DenseMma16x16KkTf32), DenseMma16x16MnTf32, None, (16, 16), true),
        tile(Some(DenseMma32x16KkTf32), DenseMma32x16MnTf32, None, (32, 16), true),
        tile(None, DenseMma16x32MnTf32, None, (16, 32), true),
        tile(Some(DenseMma32x32KkTf32), DenseMma32x32MnTf32, Some(DenseMma32x32Mn2Tf32), (32, 32), true),
    ]
};

/// Values of k a slice of the tiles holds, and slices in flight (MMA_KC, MMA_STAGES).
const MMA_KC: usize = 64;
const MMA_STAGES: usize = 4;

impl MmaTile {
    /// The tile whose kernel `kernel` is, if it is one of theirs.
    pub(crate) fn of(kernel: Kernel) -> Option<MmaTile> {
        MMA_TILES.into_iter().find(|t| t.kernels().any(|k| k == kernel))
    }

    /// The tile's kernels: forward layout, weight-gradient layout, the latter split.
    pub(crate) fn kernels(&self) -> impl Iterator<Item = Kernel> {
        self.forward.into_iter().chain([self.weight_grad]).chain(self.weight_grad_split)
    }

    /// Blocks a tile of `kernel` (one of this tile's) runs on: two for the split kernel.
    pub(crate) fn split(&self, kernel: Kernel) -> usize {
        if Some(kernel) == self.weight_grad_split {
            2
        } else {
            1
        }
    }

    /// The grid of `kernel` (one of this tile's) for an `m × cols` product.
    fn grid(&self, kernel: Kernel, m: usize, cols: usize) -> (usize, usize) {
        (cols.div_ceil(self.cols), self.split(kernel) * m.div_ceil(self.rows))
    }

    /// Whether `kernel` (this tile's `forward` or a weight gradient's) takes A and B as laid
    /// out: forward's layout, A and B contiguous along k; weight gradient's, along m and n;
    /// either 16-byte aligned with rows of a multiple of four values (its copies are 16 bytes).
    fn takes(&self, kernel: Kernel, a: &DevMat, b: &DevMat) -> bool {
        let aligned = |d: &DevMat, stride: usize| d.data.ptr().is_multiple_of(16) && stride.is_multiple_of(4);
        if Some(kernel) == self.forward {
            a.cs == 1 && b.rs == 1 && aligned(a, a.rs) && aligned(b, b.cs)
        } else {
            self.kernels().any(|k| k == kernel) && a.rs == 1 && b.cs == 1 && aligned(a, a.cs) && aligned(b, b.rs)
        }
    }

    /// Bytes of shared memory a block needs: MMA_STAGES slice buffers of A and B, as
    /// `mma_buf` in kernels/dense_mma.cu lays them out (along k, rows padded to MMA_KC + 8; else
    /// rows of k padded to the tile's side + 8).
    fn shared_bytes(&self, kernel: Kernel) -> u32 {
        let along_k = Some(kernel) == self.forward;
        let buf = |side: usize| if along_k { side * (MMA_KC + 8) } else { MMA_KC * (side + 8) };
        (4 * MMA_STAGES * (buf(self.rows) + buf(self.cols))) as u32
    }
}

/// What the fused dense product does with each value c of C = A·B.
pub enum DenseEpilogue<'a> {
    /// `z = c + bias[j]`, and `y = act(z)` when `y` is given (a layer's forward); z is not
    /// written where it is not given (an inference pass, which reads no z again), y then is.
    Forward { bias: View<'a, f32>, z: Option<ViewMut<'a, f32>>, y: Option<ViewMut<'a, f32>>, act: Activation },
    /// dx = c, times act'(z, y) of the layer that produced x when `prev` is given (so dx is
    /// that layer's dz).
    InputGrad { dx: ViewMut<'a, f32>, prev: Option<(View<'a, f32>, View<'a, f32>, Activation)> },
    /// `dW = C` (m × n), and `db[i] = Σ_k A(i, k)` (B gets a column of ones). A tile split
    /// over two blocks ([`Route::adds`]) adds each block's half into dW and db, so they must
    /// hold zeros first: with `cleared` the caller has seen to it (in a training step the head
    /// kernel clears them, beside the forward pass); otherwise [`Gpu::dense_on`] clears them on
    /// the stream before the product.
    WeightGrad { dw: ViewMut<'a, f32>, db: ViewMut<'a, f32>, cleared: bool },
}

impl DenseEpilogue<'_> {
    fn dir(&self) -> Dir {
        match self {
            DenseEpilogue::Forward { .. } => Dir::Forward,
            DenseEpilogue::InputGrad { .. } => Dir::InputGrad,
            DenseEpilogue::WeightGrad { .. } => Dir::WeightGrad,
        }
    }
}

/// Values a `rows × cols` matrix with strides (rs, cs) spans.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// The tensor-core kernels that may run direction `dir` on a device of compute capability `cc`
/// with `tuning`, where the model's TF32 is `tf32`, before layout, alignment and launch limits
/// ([`MmaTile::takes`], [`dense_grid`]): none before sm_80 nor for an input gradient; a
/// forward's and a weight gradient's of each tile, the split weight gradient sm_90 on (and
/// with `Tuning::split_tiles`); the one-product tiles only with `tf32`, the 3xTF32 ones either
/// way (measurement picks).
fn tile_kernels(cc: (u32, u32), tuning: &Tuning, tf32: bool, dir: Dir) -> impl Iterator<Item = (MmaTile, Kernel)> + '_ {
    MMA_TILES.into_iter().filter(move |tile| cc.0 >= 8 && (tf32 || !tile.tf32)).flat_map(move |tile| {
        let kernels = match dir {
            Dir::Forward => [tile.forward, None],
            Dir::InputGrad => [None, None],
            Dir::WeightGrad => [Some(tile.weight_grad), tile.weight_grad_split.filter(|_| tuning.split_tiles && cc.0 >= 9)],
        };
        kernels.into_iter().flatten().map(move |kernel| (tile, kernel))
    })
}

impl Gpu {
    /// The routes that fit direction `dir` of an `m × n` product over `k` of these operands
    /// (a weight gradient's B gets its column of ones on the fused routes), on this device with
    /// `tuning`, for a model whose TF32 is `tf32`: every fused kernel whose grid is within the
    /// launch limits; the tensor-core tiles where they take the layout and alignment (those
    /// [`tile_kernels`] lists: a forward's and a weight gradient's only, sm_80 on, the
    /// one-product ones only with `tf32`); the weight gradient split over the batch
    /// (src/cuda/wgrad.rs) where it fits; and cuBLAS.
    pub(crate) fn dense_routes(
        &self,
        tuning: &Tuning,
        tf32: bool,
        dir: Dir,
        (m, n, k): (usize, usize, usize),
        a: &DevMat,
        b: &DevMat,
    ) -> Vec<Route> {
        let cols = n + usize::from(dir == Dir::WeightGrad);
        // the kernels' sizes and indices are ints
        let ints = [m, cols, k, m * cols].into_iter().all(|v| int(v).is_ok());
        let tiles = tile_kernels(self.compute_capability(), tuning, tf32, dir).filter(|(tile, kernel)| tile.takes(*kernel, a, b));
        let fused =
            ANY_LAYOUT.into_iter().chain(tiles.map(|(_, kernel)| kernel)).filter(|&kernel| ints && dense_grid(kernel, m, cols).is_some());
        let mut routes: Vec<Route> = fused.map(Route::Fused).collect();
        if dir == Dir::WeightGrad && ints && self.weight_grad_split_fits(&[(m, n)], tuning) {
            routes.push(Route::Split);
        }
        routes.push(Route::Cublas);
        routes
    }

    /// C (m × n) = A (m × k) · B (k × n) on dense kernel `kernel` (a fused route that
    /// [`Gpu::dense_routes`] gave for these operands), then `epilogue` on each value of C (see
    /// [`DenseEpilogue`] and kernels/dense.cu): one launch (two where a split tile's dW and db
    /// are cleared first). Outputs are row-major with rows of `n`. Each value is summed in a
    /// fixed order.
    ///
    /// `b_early`: the kernel ahead of this one in `stream` writes nothing in B nor in the
    /// epilogue's inputs (the forward's bias, the input gradient's `prev`): B is a layer's
    /// weights and that kernel is not an optimiser's, or B is a weight gradient's X and `prev`
    /// is from the forward pass while that kernel is the backward pass's. The kernel then reads
    /// them before it waits for that kernel, so those loads overlap it (with dependent launch;
    /// otherwise the stream orders them anyway).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dense_on(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        m: usize,
        n: usize,
        k: usize,
        a: DevMat,
        b: DevMat,
        epilogue: DenseEpilogue,
        b_early: bool,
    ) -> Result<()> {
        assert!(a.data.len() >= extent(m, k, a.rs, a.cs) && b.data.len() >= extent(k, n, b.rs, b.cs), "dense: A or B is short");
        if m == 0 || n == 0 {
            return Ok(());
        }
        let tile = MmaTile::of(kernel);
        assert!(ANY_LAYOUT.contains(&kernel) || tile.is_some(), "dense: {kernel:?} is not a dense kernel");
        assert!(tile.is_none_or(|t| t.takes(kernel, &a, &b)), "dense: {kernel:?} does not take A and B as laid out");
        // a tile's epilogue follows from its layout (kernels/dense_mma.cu): the forward's, or a
        // weight gradient's
        let dir = epilogue.dir();
        assert!(
            tile.is_none_or(|t| dir == if Some(kernel) == t.forward { Dir::Forward } else { Dir::WeightGrad }),
            "dense: {kernel:?} takes another epilogue"
        );
        let null = 0u64;
        let mut cleared = false;
        let (mode, cols, bias, out0, out1, z_prev, y_prev, act) = match epilogue {
            DenseEpilogue::Forward { bias, z, y, act } => {
                assert!(z.is_some() || y.is_some(), "dense forward: no output");
                let short = |v: &Option<ViewMut<f32>>| v.as_ref().is_some_and(|v| v.len() < m * n);
                assert!(bias.len() >= n && !short(&z) && !short(&y), "dense forward: short output");
                (0, n, bias.ptr(), z.map_or(null, |z| z.ptr()), y.map_or(null, |y| y.ptr()), null, null, act)
            }
            DenseEpilogue::InputGrad { dx, prev } => {
                assert!(dx.len() >= m * n && prev.as_ref().is_none_or(|p| p.0.len() >= m * n && p.1.len() >= m * n), "dense dx: short");
                let (z, y, act) = prev.map_or((null, null, Activation::Identity), |(z, y, act)| (z.ptr(), y.ptr(), act));
                (1, n, null, dx.ptr(), null, z, y, act)
            }
            DenseEpilogue::WeightGrad { dw, db, cleared: c } => {
                assert!(dw.len() >= m * n && db.len() >= m, "dense dw: short dW or db");
                cleared = c;
                (2, n + 1, null, dw.ptr(), db.ptr(), null, null, Activation::Identity)
            }
        };
        let grid = dense_grid(kernel, m, cols).unwrap_or_else(|| panic!("dense: {m} × {cols} is past {kernel:?}'s launch limits"));
        let (code, slope) = act.gpu_code();
        let (ap, bp) = (a.data.ptr(), b.data.ptr());
        let [a_rs, a_cs, b_rs, b_cs, mi, ni, ki, ldc] = ints([a.rs, a.cs, b.rs, b.cs, m, cols, k, n])?;
        let _ = int(m * cols)?;
        let early = i32::from(b_early);
        let args =
            kernel_args![ap, a_rs, a_cs, bp, b_rs, b_cs, mi, ni, ki, mode, ldc, bias, out0, out1, z_prev, y_prev, code, slope, early];
        if Route::Fused(kernel).adds() && !cleared {
            // SAFETY: the weight gradient's dW and db, checked above to hold m·n and m values
            unsafe {
                let zero = |ptr: u64, len: usize| result::memset_d8_async(ptr, 0, 4 * len, stream.cu_stream());
                zero(out0, m * n).and_then(|_| zero(out1, m)).map_err(|e| driver_error("clearing a weight gradient", e))?;
            }
        }
        self.run_blocks(stream, kernel, grid, tile.map_or(0, |t| t.shared_bytes(kernel)), args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TF32 never runs where the model's TF32 is off: with it off no tensor-core kernel offered
    /// is a one-product one, on any device, direction or tuning; with it on, a forward and a
    /// weight gradient are offered the one-product tiles beside the 3xTF32 ones (sm_80 on).
    /// The one-product tiles are the `_tf32` kernels, and only those.
    #[test]
    fn one_product_tiles_only_where_the_model_allows_tf32() {
        for tile in MMA_TILES {
            for kernel in tile.kernels() {
                assert_eq!(KERNELS[kernel as usize].ends_with("_tf32"), tile.tf32, "{kernel:?}");
            }
        }
        let tunings = [Tuning::default(), Tuning { split_tiles: false, ..Tuning::default() }];
        for cc in [(7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0)] {
            for tuning in &tunings {
                for dir in Dir::ALL {
                    let offered = |tf32| tile_kernels(cc, tuning, tf32, dir).collect::<Vec<_>>();
                    let (fp32, tf32) = (offered(false), offered(true));
                    assert!(fp32.iter().all(|(tile, _)| !tile.tf32), "{cc:?} {dir:?}: TF32 offered to an FP32 model");
                    // with TF32 on: the same 3xTF32 kernels, and as many one-product ones
                    let three: Vec<Kernel> = tf32.iter().filter(|(tile, _)| !tile.tf32).map(|t| t.1).collect();
                    assert_eq!(three, fp32.iter().map(|t| t.1).collect::<Vec<_>>(), "{cc:?} {dir:?}");
                    assert_eq!(tf32.len(), 2 * fp32.len(), "{cc:?} {dir:?}");
                    let some = cc.0 >= 8 && dir != Dir::InputGrad;
                    assert_eq!(!fp32.is_empty(), some, "{cc:?} {dir:?}");
                }
            }
        }
    }
}
