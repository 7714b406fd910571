//! Products whose B is read in place at shifted windows of its rows (a convolution's input
//! planes, no lowered copy), with A packed once ([`PackedA`]): the direct and Winograd
//! convolution routes' GEMM.

use super::{check_out, kernel, tile_shape, AOp, BOp, GemmScratch, MatMut, OutPtr, PackedA, Product};
use crate::cpu::isa::Isa;

/// C (m×n) ← α·A·B + β·C with A (m×k) packed once and B (k×n) read in place in `rows`, on
/// the calling thread: element (p, j) of B at `offsets[p] + (j / width)·pitch + j % width`
/// (a convolution's shifted input windows, its output pixels in rows of `width` that lie
/// `pitch` apart in the planes: no lowered copy, and C the output itself). The kernel reads
/// whole panels: each row must have [`shifted_slack`] readable values past the end of its
/// last run. The runs must be ones the kernel reads whole ([`shifted_runs_fit`]). Panics,
/// before writing anything, if `offsets` is not k long, the runs do not fit, a row is out of
/// `rows`, C is too short or its elements overlap.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm_shifted_on(
    scratch: &mut GemmScratch,
    n: usize,
    alpha: f32,
    a: &PackedA,
    rows: &[f32],
    offsets: &[usize],
    runs: (usize, usize),
    beta: f32,
    c: MatMut,
) {
    // SAFETY: C is borrowed exclusively for this call.
    unsafe { sgemm_shifted_into(scratch, n, alpha, a, rows, offsets, runs, beta, c.out()) }
}

/// [`sgemm_shifted_on`] into a C given by pointer.
///
/// # Safety
/// As [`super::sgemm_packed_a_into`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm_shifted_into(
    scratch: &mut GemmScratch,
    n: usize,
    alpha: f32,
    a: &PackedA,
    rows: &[f32],
    offsets: &[usize],
    (width, pitch): (usize, usize),
    beta: f32,
    c: OutPtr,
) {
    let (m, k) = (a.m(), a.k());
    assert_eq!(offsets.len(), k, "gemm: {k} rows of B need as many offsets");
    assert_eq!(a.isa(), scratch.isa, "A packed for another kernel than the scratch's");
    assert!(shifted_runs_fit(a.isa(), n, width, pitch), "gemm: runs of {width} every {pitch} over {n} columns split a vector");
    let runs = kernel::Runs { width, pitch, n };
    // the end of the last run, and the slack a whole panel reads past it
    let reach = n.checked_sub(1).map_or(0, |last| runs.at(last) + 1 + shifted_slack(a.isa()));
    let fits = |&o: &usize| o.checked_add(reach).is_some_and(|end| end <= rows.len());
    assert!(n == 0 || offsets.iter().all(fits), "gemm: a row of B reaches past its {} values", rows.len());
    check_out(m, n, &c).unwrap_or_else(|e| panic!("{e}"));
    let b = BOp::Shifted { base: rows.as_ptr(), offsets: offsets.as_ptr(), runs };
    // SAFETY: checked above: every row p < k holds its runs and the slack from its offset,
    // and each half panel lies in one run; A by its construction; C's elements are ours alone
    // (the contract).
    unsafe { Product::packed(a.isa(), m, n, k, alpha, AOp::Packed(a.view()), b, beta, c).run(scratch) }
}

/// Whether `isa`'s kernel reads n columns in runs of `width`, `pitch` apart, with whole
/// vectors: one run (`width` = `pitch` ≥ 1, or n ≤ `width`), or runs of whole half panels.
pub(crate) fn shifted_runs_fit(isa: Isa, n: usize, width: usize, pitch: usize) -> bool {
    width >= 1 && pitch >= width && (width == pitch || n <= width || width.is_multiple_of(tile_shape(isa).1 / 2))
}

/// Extra values a buffer of shifted rows needs past its last run (see [`sgemm_shifted_on`]).
pub(crate) fn shifted_slack(isa: Isa) -> usize {
    tile_shape(isa).1
}
