//! Convolution kernels: 2-D cross-correlation with zero padding, as PyTorch's `nn.Conv2d`,
//! over a batch of samples (C, H, W) → (OC, OH, OW):
//!
//!   z[oc, y, x] = Σ_{c,i,j} w[oc, c, i, j] · in[c, y·sh + i − ph, x·sw + j − pw]
//!
//! then, in the forward, an [`Epilogue`] on each block of output rows while it is in cache:
//! the bias, or a batch norm's scale and shift, a residual block's input added, the
//! activation.
//!
//! Three routes compute the same products, with one signature ([`forward`], [`backward`], each
//! taking a [`ConvRoute`]), so that those that compute a layer ([`ConvRoute::serves`]) can be
//! timed on its shape and the fastest kept ([`choice`]):
//!
//! - [`ConvRoute::Lowered`]: each sample lowered to a CKK × OHW matrix (im2col, CKK = C·kh·kw)
//!   and multiplied by the packed weights; k² copies of the input per sample.
//! - [`ConvRoute::Direct`]: no lowered copy. The input is copied once into zero-padded planes
//!   (split into stride phases when the stride is not 1), with rows `wpp` wide; then output
//!   position (y, x) is the flat index q = y·wpp + x, and row (c, i, j) of the lowered matrix
//!   is the window of the planes that starts at offset(c, i, j), read in place by the GEMM
//!   ([`sgemm_shifted_on`]), in runs of OW (one per output row) where the kernel's vectors
//!   fit them, else whole (the columns x ≥ OW of each output row computed and dropped).
//!   The input gradient is the same product on the output gradient, dilated by the stride
//!   and padded by k − 1 − p, against the weights with in and out channels swapped and the
//!   taps flipped; the weight gradient is dot products of the output gradient's rows with the
//!   same windows ([`rowdot_at`]).
//! - [`ConvRoute::Winograd`], forward only, kernels 3 wide at stride 1: each output row's
//!   columns in pairs by F(2, 3), four products of the direct route's kind (on transformed
//!   input rows, read in place) where it takes six, then sums (`winograd`).
//!
//! The weights are packed once ([`ConvWeights::pack`]) for the lowered and direct routes in
//! both directions, and for the Winograd route ([`ConvWeights::pack_winograd`]) where it runs,
//! and repacked only after they change. Routes sum in different orders: their results agree
//! to rounding, not in every bit. Each route gives the same bits on any number of threads.

#![deny(clippy::undocumented_unsafe_blocks)]

pub(crate) mod choice;
mod direct;
mod epilogue;
pub(crate) mod lowered;
pub(crate) mod split;
#[cfg(test)]
mod tests;
mod winograd;

use super::gemm::{GemmWorkspace, PackedA};
use super::isa::Isa;
use super::pool::Pool;
use super::{chunk_range, for_chunks, SharedMut};
use crate::error::{zeros, Error, Result};
pub(crate) use epilogue::Epilogue;
use epilogue::Outputs;
use std::time::Duration;

/// The geometry of one convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConvShape {
    pub in_channels: usize,
    pub height: usize,
    pub width: usize,
    pub out_channels: usize,
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
}

impl ConvShape {
    /// Output rows and columns: (H + 2·ph − kh) / sh + 1, likewise for the width; `Err` when
    /// the kernel is larger than the padded input or a size is 0.
    pub fn out_size(&self) -> Result<(usize, usize)> {
        let ((hp, wp), (kh, kw), (sh, sw)) = (self.padded(), self.kernel, self.stride);
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 || kh > hp || kw > wp || self.in_channels == 0 || self.out_channels == 0 {
            return Err(Error::Shape(format!("convolution {self:?}: no output")));
        }
        Ok(((hp - kh) / sh + 1, (wp - kw) / sw + 1))
    }

    fn oh(&self) -> usize {
        self.out_size().map_or(0, |s| s.0)
    }

    fn ow(&self) -> usize {
        self.out_size().map_or(0, |s| s.1)
    }

    /// C·kh·kw: rows of the lowered matrix, columns of the weight matrix.
    pub fn ckk(&self) -> usize {
        self.in_channels * self.kernel.0 * self.kernel.1
    }

    /// Values of a sample's input, C·H·W.
    pub fn in_len(&self) -> usize {
        self.in_channels * self.height * self.width
    }

    /// Values of a sample's output, OC·OH·OW.
    pub fn out_len(&self) -> usize {
        self.out_channels * self.oh() * self.ow()
    }

    /// Values of the weights, OC·C·kh·kw.
    pub fn weights_len(&self) -> usize {
        self.out_channels * self.ckk()
    }

    /// (H + 2·ph, W + 2·pw).
    fn padded(&self) -> (usize, usize) {
        (self.height + 2 * self.padding.0, self.width + 2 * self.padding.1)
    }
}

/// Which kernel computes a convolution (see the module's documentation).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum ConvRoute {
    /// im2col, then the GEMM with the packed weights.
    Lowered,
    /// The GEMM reading shifted windows of the padded input in place.
    Direct,
    /// F(2, 3) along the rows (`winograd`): forward only, kernels 3 wide at stride 1.
    Winograd,
}

impl ConvRoute {
    pub const ALL: [ConvRoute; 3] = [ConvRoute::Lowered, ConvRoute::Direct, ConvRoute::Winograd];

    /// For reports: `lowered`, `direct` or `winograd`.
    pub fn name(self) -> &'static str {
        match self {
            ConvRoute::Lowered => "lowered",
            ConvRoute::Direct => "direct",
            ConvRoute::Winograd => "winograd",
        }
    }

    /// Whether it computes `shape` in `direction`: the Winograd route forward alone, where its
    /// kernel fits ([`winograd::fits`]); the others everything.
    pub fn serves(self, shape: &ConvShape, direction: choice::Direction) -> bool {
        match self {
            ConvRoute::Lowered | ConvRoute::Direct => true,
            ConvRoute::Winograd => direction == choice::Direction::Forward && winograd::fits(shape),
        }
    }

    /// Whether a training pass runs it forward: all but the Winograd route, whose transformed
    /// weights would be packed anew on every step (which, where they were, cost vgg_small's
    /// training step more than the route saved); inference packs them once a version.
    pub fn trains(self) -> bool {
        self != ConvRoute::Winograd
    }
}

/// The weights (OC, C, kh, kw) packed once in the forms the routes read.
pub(crate) struct ConvWeights {
    shape: ConvShape,
    /// W as OC × CKK (the lowered and direct forwards).
    w: PackedA,
    /// Wᵀ, CKK × OC (the lowered input gradient, dcol = Wᵀ·dZ).
    w_t: PackedA,
    /// C × OC·kh·kw, element (c, (oc, i, j)) = w[oc, c, i, j] (the direct input gradient).
    w_swapped: PackedA,
    /// The Winograd route's U_ξ, each OC × C·kh, where it serves the shape.
    winograd: Option<[PackedA; 4]>,
}

impl ConvWeights {
    /// Room for `shape`'s weights packed for `isa`'s kernel (`Err` if this CPU does not run it).
    pub fn new(isa: Isa, shape: &ConvShape) -> Result<ConvWeights> {
        let (oc, c, ckk) = (shape.out_channels, shape.in_channels, shape.ckk());
        let kk = shape.kernel.0 * shape.kernel.1;
        let u = || PackedA::new(isa, oc, c * shape.kernel.0);
        let winograd = if winograd::fits(shape) { Some([u()?, u()?, u()?, u()?]) } else { None };
        Ok(ConvWeights {
            shape: *shape,
            w: PackedA::new(isa, oc, ckk)?,
            w_t: PackedA::new(isa, ckk, oc)?,
            w_swapped: PackedA::new(isa, c, oc * kk)?,
            winograd,
        })
    }

    /// The instruction set of the kernel it was packed for.
    pub fn isa(&self) -> Isa {
        self.w.isa()
    }

    /// Every packed value set to NaN: a test that the kernels read what was packed last.
    #[cfg(test)]
    pub fn poison(&mut self) {
        for packed in [&mut self.w, &mut self.w_t, &mut self.w_swapped].into_iter().chain(self.winograd.iter_mut().flatten()) {
            packed.poison();
        }
    }

    /// Packs `w` ((OC, C, kh, kw), row-major) in for the lowered and direct routes; after every
    /// change of the weights. Panics if `w` is not `shape.weights_len()` long.
    pub fn pack(&mut self, w: &[f32]) {
        let s = self.shape;
        assert_eq!(w.len(), s.weights_len(), "conv weights of {s:?}");
        let (ckk, kk) = (s.ckk(), s.kernel.0 * s.kernel.1);
        self.w.pack(super::gemm::Mat { data: w, rs: ckk, cs: 1 });
        self.w_t.pack(super::gemm::Mat { data: w, rs: 1, cs: ckk });
        self.w_swapped.pack_with(|c, p| w[(p / kk) * ckk + c * kk + p % kk]);
    }

    /// Whether the shape has room for the Winograd route's weights ([`ConvRoute::Winograd`]
    /// serves it).
    #[cfg(test)]
    pub fn has_winograd(&self) -> bool {
        self.winograd.is_some()
    }

    /// Packs `w` in for the Winograd route: U_ξ[oc, (c, i)] from the kernel row w[oc, c, i, ·]
    /// (3 wide). Panics as [`ConvWeights::pack`], or where the route does not serve the shape.
    pub fn pack_winograd(&mut self, w: &[f32]) {
        let (s, ckk) = (self.shape, self.shape.ckk());
        assert_eq!(w.len(), s.weights_len(), "conv weights of {s:?}");
        let u = self.winograd.as_mut().expect("the Winograd route serves the shape");
        for (xi, u) in u.iter_mut().enumerate() {
            u.pack_with(|oc, row| {
                let at = oc * ckk + row * 3;
                winograd::transformed_weight(xi, [w[at], w[at + 1], w[at + 2]])
            });
        }
    }
}

/// The blocks of samples a batch's weight gradient is summed in, at most this many.
const MAX_WGRAD_BLOCKS: usize = 16;

/// Blocks the weight gradient of `batch` samples is summed in: a function of the batch alone,
/// never of the thread count.
pub(crate) fn wgrad_blocks(batch: usize) -> usize {
    batch.clamp(1, MAX_WGRAD_BLOCKS)
}

/// What a convolution's kernels need besides the GEMM's packing buffers, allocated once: each
/// thread's scratch (enough for either route), the direct route's window offsets, and the
/// partial weight gradients of a batch of up to `capacity` samples.
pub(crate) struct ConvWorkspace {
    isa: Isa,
    shape: ConvShape,
    scratch: Vec<f32>,
    per_thread: usize,
    /// Offset of lowered row (c, i, j) in the input planes (direct forward, weight gradient).
    offsets: Vec<usize>,
    /// Offset of row (oc, i, j) in the gradient planes (direct input gradient).
    grad_offsets: Vec<usize>,
    /// Offset of row (c, i) in a transformed input (the Winograd route), where it serves.
    winograd_offsets: Vec<usize>,
    partials: Vec<f32>,
}

impl ConvWorkspace {
    /// For `threads` threads and batches of up to `capacity` samples (`capacity` 0: forward
    /// only), for the kernels of `isa`. `Err` on a shape with no output, a kernel this CPU
    /// does not run, or an allocation that cannot be had.
    pub fn new(isa: Isa, shape: &ConvShape, threads: usize, capacity: usize) -> Result<ConvWorkspace> {
        isa.check()?;
        shape.out_size()?;
        let per_thread = lowered::scratch_len(shape).max(direct::scratch_len(isa, shape)).max(winograd::scratch_len(isa, shape));
        let scratch = zeros(threads.max(1).checked_mul(per_thread).ok_or_else(|| too_large(shape))?, || "convolution scratch".into())?;
        let partials_len = (wgrad_blocks(capacity) - 1).checked_mul(shape.weights_len()).ok_or_else(|| too_large(shape))?;
        let partials = if capacity == 0 { Vec::new() } else { zeros(partials_len, || "partial weight gradients".into())? };
        Ok(ConvWorkspace {
            isa,
            shape: *shape,
            scratch,
            per_thread,
            offsets: direct::input_offsets(shape)?,
            grad_offsets: direct::grad_offsets(shape)?,
            winograd_offsets: winograd::offsets(shape)?,
            partials,
        })
    }
}

impl ConvWorkspace {
    /// Every value of its scratch and partial weight gradients set to NaN: a test that the
    /// kernels write what they read.
    #[cfg(test)]
    pub fn poison(&mut self) {
        self.scratch.fill(f32::NAN);
        self.partials.fill(f32::NAN);
    }
}

fn too_large(shape: &ConvShape) -> Error {
    Error::Shape(format!("convolution {shape:?}: its buffers hold more values than memory can"))
}

/// One thread's view of the workspace during a run.
struct Sample<'a> {
    shape: &'a ConvShape,
    weights: &'a ConvWeights,
    offsets: &'a [usize],
    grad_offsets: &'a [usize],
    winograd_offsets: &'a [usize],
}

/// The scratch of worker `worker` in a run that alone uses `scratch`.
///
/// # Safety
/// `worker` is the calling task's worker index (so no other thread uses that part).
#[allow(clippy::mut_from_ref)]
unsafe fn worker_scratch<'a>(scratch: &SharedMut<'a, f32>, per_thread: usize, worker: usize) -> &'a mut [f32] {
    // SAFETY: one range per worker index, used by one task at a time (the contract).
    unsafe { scratch.slice(worker * per_thread..(worker + 1) * per_thread) }
}

/// Checks every entry makes before it touches memory (the buffers' lengths are checked where
/// they are sliced).
fn check(gemm: &GemmWorkspace, ws: &ConvWorkspace, weights: &ConvWeights, pool: &Pool) {
    assert!(ws.shape == weights.shape, "conv workspace for {:?}, weights for {:?}", ws.shape, weights.shape);
    let enough = gemm.threads() >= pool.threads() && ws.scratch.len() >= pool.threads() * ws.per_thread;
    assert!(enough, "conv workspaces for fewer threads than the pool's");
    let isa = weights.w.isa();
    assert!(
        gemm.isa() == isa && ws.isa == isa,
        "conv weights packed for another kernel ({isa:?}) than the workspaces' ({:?}, {:?})",
        gemm.isa(),
        ws.isa
    );
}

/// z (batch × OC·OH·OW) ← conv(x (batch × C·H·W)) and the epilogue ([`Epilogue`]), y ← act(z)
/// where `y` is given (else the activation in place in z), spread over the pool as `batch ×
/// parts` tasks: each sample's output rows cut into `parts` near-equal ranges (at most OH;
/// [`split::Splits`] chooses it), each task preparing the input its rows read for itself (at
/// stride 1 on the direct and Winograd routes, the padded rows they reach; else all of the
/// sample's). Each range is computed a block of rows at a time, its epilogue run on each block
/// while it is in cache. Every output value is the same chain of multiply-adds whatever the
/// parts, so the bits do not depend on them. Returns how many of the tasks the pool's workers
/// ran ([`Pool::run`]). Panics if a buffer is too short for `batch` samples, `parts` is 0 or
/// above OH, or the workspaces or the epilogue do not match the shape.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    route: ConvRoute,
    pool: &Pool,
    gemm: &mut GemmWorkspace,
    ws: &mut ConvWorkspace,
    weights: &ConvWeights,
    (batch, parts): (usize, usize),
    x: &[f32],
    epilogue: &Epilogue,
    z: &mut [f32],
    y: Option<&mut [f32]>,
) -> usize {
    check(gemm, ws, weights, pool);
    let shape = ws.shape;
    assert!(route.serves(&shape, choice::Direction::Forward), "conv forward: {route:?} does not compute {shape:?}");
    let (in_len, out_len) = (shape.in_len(), shape.out_len());
    epilogue.check(shape.out_channels, out_len, batch);
    let (x, z) = (&x[..batch * in_len], SharedMut::new(&mut z[..batch * out_len]));
    let y = y.map(|y| SharedMut::new(&mut y[..batch * out_len]));
    let per_thread = ws.per_thread;
    let scratch = SharedMut::new(&mut ws.scratch);
    let sample =
        Sample { shape: &shape, weights, offsets: &ws.offsets, grad_offsets: &ws.grad_offsets, winograd_offsets: &ws.winograd_offsets };
    let oh = shape.oh();
    assert!((1..=oh).contains(&parts), "conv forward: {parts} parts of {oh} output rows");
    pool.run_with(batch * parts, gemm.workers(), &|task, worker, gemm| {
        let (s, rows) = (task / parts, chunk_range(oh, parts, task % parts));
        // SAFETY: `worker` is this task's worker index in a run that alone uses `scratch`.
        let buf = unsafe { worker_scratch(&scratch, per_thread, worker) };
        let out = Outputs::new(&z, y.as_ref(), (s * out_len, out_len), epilogue.skip.map(|k| &k[s * out_len..][..out_len]));
        let xs = &x[s * in_len..][..in_len];
        // SAFETY: this task alone writes output rows `rows` of sample s (the tasks of a sample
        // take disjoint ranges of rows, and every task one sample).
        unsafe {
            match route {
                ConvRoute::Lowered => lowered::forward(gemm, buf, &sample, xs, epilogue, &out, rows),
                ConvRoute::Direct => direct::forward(gemm, buf, &sample, xs, epilogue, &out, rows),
                ConvRoute::Winograd => winograd::forward(gemm, buf, &sample, xs, epilogue, &out, rows),
            }
        }
    })
}

/// dW ← Σ_s dZ_s ⋆ X_s (the weight gradient, overwritten) and, when `dx` is given, dX ← the
/// input gradient (overwritten), from x and dz of `batch` samples (batch ≤ the workspace's
/// capacity).
///
/// The batch is cut into `wgrad_blocks(batch)` contiguous blocks of samples; block 0 sums its
/// samples, in order, into `dw`, block b > 0 into its own partial buffer, and the partials are
/// then added to `dw` in block order. The threads only decide who computes which block, so dW
/// has the same bits on any number of threads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    route: ConvRoute,
    pool: &Pool,
    gemm: &mut GemmWorkspace,
    ws: &mut ConvWorkspace,
    weights: &ConvWeights,
    batch: usize,
    x: &[f32],
    dz: &[f32],
    dw: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    check(gemm, ws, weights, pool);
    let shape = ws.shape;
    let direction = choice::Direction::Backward { input_grad: dx.is_some() };
    assert!(route.serves(&shape, direction), "conv backward: {route:?} does not compute {shape:?}");
    let (in_len, out_len, w_len) = (shape.in_len(), shape.out_len(), shape.weights_len());
    let blocks = wgrad_blocks(batch);
    assert!(
        dw.len() == w_len && ws.partials.len() >= (blocks - 1) * w_len,
        "conv backward: dW or the partials too small for {batch} samples"
    );
    let (x, dz) = (&x[..batch * in_len], &dz[..batch * out_len]);
    let dx = dx.map(|dx| SharedMut::new(&mut dx[..batch * in_len]));
    let per_thread = ws.per_thread;
    let scratch = SharedMut::new(&mut ws.scratch);
    let (dw_shared, partials) = (SharedMut::new(&mut *dw), SharedMut::new(&mut ws.partials));
    let sample =
        Sample { shape: &shape, weights, offsets: &ws.offsets, grad_offsets: &ws.grad_offsets, winograd_offsets: &ws.winograd_offsets };
    pool.run_with(blocks, gemm.workers(), &|block, worker, gemm| {
        // SAFETY: block b alone writes its dW buffer and the dX of its own samples; `worker`
        // is this task's worker index in a run that alone uses `scratch`.
        let (acc, buf) = unsafe {
            let acc = if block == 0 { dw_shared.slice(0..w_len) } else { partials.slice((block - 1) * w_len..block * w_len) };
            (acc, worker_scratch(&scratch, per_thread, worker))
        };
        for (n, s) in chunk_range(batch, blocks, block).enumerate() {
            // SAFETY: sample s belongs to this block only.
            let dxs = dx.as_ref().map(|dx| unsafe { dx.slice(s * in_len..(s + 1) * in_len) });
            let (xs, dzs) = (&x[s * in_len..][..in_len], &dz[s * out_len..][..out_len]);
            match route {
                ConvRoute::Lowered => lowered::backward(gemm, buf, &sample, xs, dzs, acc, n > 0, dxs),
                ConvRoute::Direct => direct::backward(gemm, buf, &sample, xs, dzs, acc, n > 0, dxs),
                ConvRoute::Winograd => unreachable!("the Winograd route computes forwards alone"),
            }
        }
    });
    // dW[e] = ((block 0 + block 1) + block 2) + …, each element in that order; the elements
    // are independent, so they may be spread over the threads.
    let partials = &ws.partials[..(blocks - 1) * w_len];
    let dw = SharedMut::new(dw);
    for_chunks(pool, w_len, 16384, &|_, range| {
        // SAFETY: chunks are disjoint ranges of dW.
        let dw = unsafe { dw.slice(range.clone()) };
        for part in partials.chunks_exact(w_len) {
            dw.iter_mut().zip(&part[range.clone()]).for_each(|(d, p)| *d += *p);
        }
    });
}

/// Each route's forward and backward (with the input gradient when `input_grad`) on `shape`,
/// timed on `threads` threads with buffers of its own (uniform values): the fastest of `runs`
/// calls each, the routes taking turns; None where the route does not compute it. For benches;
/// layers choose through [`choice`].
#[allow(clippy::type_complexity)]
pub(crate) fn route_times(
    shape: &ConvShape,
    batch: usize,
    threads: usize,
    runs: usize,
    input_grad: bool,
) -> Result<Vec<(ConvRoute, Option<Duration>, Option<Duration>)>> {
    let mut trial = choice::Trial::new(Isa::best(), shape, batch, threads)?;
    let forward = trial.times(choice::Direction::Forward, runs);
    let backward = trial.times(choice::Direction::Backward { input_grad }, runs);
    Ok((0..ConvRoute::ALL.len()).map(|r| (ConvRoute::ALL[r], forward[r], backward[r])).collect())
}
