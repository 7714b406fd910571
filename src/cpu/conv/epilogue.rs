//! What a convolution's forward does to its output values once their products are done, while
//! they are still in cache: the forward computes a sample's output a block of output rows at a
//! time ([`blocks`]) and runs its [`Epilogue`] on each block before the next, instead of a pass
//! of its own over the whole batch's output (which at 64 samples of 16 × 32 × 32 is 4 MB, out
//! of L2) for each of the bias, a batch norm, a residual sum and an activation.

use crate::activation::Activation;
use crate::cpu::gemm::OutPtr;
#[cfg(target_arch = "x86_64")]
use crate::cpu::isa::Isa;
use crate::cpu::SharedMut;
use std::ops::Range;

/// Per output channel oc and value v of its product:
///
///   z = v·scale[oc] + shift[oc]   (v + shift[oc] without a scale; v without either)
///   z = z + skip                  (where a skip is given: a tensor of the output's shape)
///   y = act(z)
///
/// in f32, each operation rounded (no fused multiply-add): the same bits on every instruction
/// set. The bias alone is the layer's `z + b` then `act`, bit for bit; a batch norm in
/// inference folds into scale and shift (`layers/conv_fast.rs`).
#[derive(Clone, Copy)]
pub(crate) struct Epilogue<'a> {
    pub scale: Option<&'a [f32]>,
    pub shift: Option<&'a [f32]>,
    /// Batch × OC·OH·OW values, sample-major (a residual block's input).
    pub skip: Option<&'a [f32]>,
    pub act: Activation,
}

impl Epilogue<'_> {
    /// The product alone.
    pub const NONE: Epilogue<'static> = Epilogue { scale: None, shift: None, skip: None, act: Activation::Identity };

    /// Panics unless scale and shift hold a value per channel and the skip one per output
    /// value of `batch` samples.
    pub(super) fn check(&self, channels: usize, out_len: usize, batch: usize) {
        let per_channel = |v: Option<&[f32]>| v.is_none_or(|v| v.len() == channels);
        assert!(per_channel(self.scale) && per_channel(self.shift), "conv epilogue: a scale or shift not of {channels} channels");
        assert!(self.skip.is_none_or(|s| s.len() >= batch * out_len), "conv epilogue: the skip is shorter than {batch} samples");
    }

    /// Positions `range` of every channel of one sample's outputs, whose planes hold `plane`
    /// values each.
    ///
    /// # Safety
    /// Positions `range` are the calling task's alone (see [`Outputs`]).
    pub(super) unsafe fn apply(&self, plane: usize, out: &Outputs, range: Range<usize>) {
        let channels = out.len / plane;
        for oc in 0..channels {
            let r = oc * plane + range.start..oc * plane + range.end;
            // SAFETY: positions `range` of channel oc are the calling task's (the contract).
            let (z, y) = unsafe { (out.z(r.clone()), out.y(r.clone())) };
            let (scale, shift) = (self.scale.map(|s| s[oc]), self.shift.map(|s| s[oc]));
            affine(z, scale, shift, out.skip.map(|s| &s[r]));
            match y {
                Some(y) => self.act.apply_slice(z, y),
                None => act_in_place(self.act, z),
            }
        }
    }
}

/// One sample's outputs as the forward writes them: z, and y = act(z) where given (else the
/// activation in place in z); and the sample's part of the epilogue's skip. The tasks of one
/// sample share its z and y, each writing the positions of its own output rows in every
/// channel (interleaved with the others' over the channels), so they are held by pointer and
/// each access covers the calling task's positions alone.
pub(super) struct Outputs<'a> {
    z: &'a SharedMut<'a, f32>,
    y: Option<&'a SharedMut<'a, f32>>,
    /// The sample's first value in z and y, and its number of values.
    at: usize,
    pub len: usize,
    pub skip: Option<&'a [f32]>,
}

impl<'a> Outputs<'a> {
    /// Values `at..at + len` of z and y (a sample), with the sample's skip. Panics unless z and
    /// y hold them: the products write through pointers up to `at + len` ([`Outputs::z_matrix`]).
    pub fn new(z: &'a SharedMut<'a, f32>, y: Option<&'a SharedMut<'a, f32>>, (at, len): (usize, usize), skip: Option<&'a [f32]>) -> Self {
        let end = at.checked_add(len);
        let holds = |v: &SharedMut<f32>| end.is_some_and(|end| end <= v.len());
        assert!(holds(z) && y.is_none_or(holds), "conv outputs: values {at}.. ({len}) outside z or y");
        Outputs { z, y, at, len, skip }
    }

    /// Whether y is written apart from z.
    pub fn has_y(&self) -> bool {
        self.y.is_some()
    }

    /// Values `range` of the sample's z.
    ///
    /// # Safety
    /// `range` lies in the calling task's positions, and no other live slice from these
    /// outputs overlaps it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn z(&self, range: Range<usize>) -> &mut [f32] {
        assert!(range.end <= self.len, "conv outputs: {range:?} outside a sample of {}", self.len);
        // SAFETY: inside the sample (checked); the rest is the contract.
        unsafe { self.z.slice(self.at + range.start..self.at + range.end) }
    }

    /// Values `range` of the sample's y, where it has one.
    ///
    /// # Safety
    /// As [`Outputs::z`].
    #[allow(clippy::mut_from_ref)]
    unsafe fn y(&self, range: Range<usize>) -> Option<&mut [f32]> {
        assert!(range.end <= self.len, "conv outputs: {range:?} outside a sample of {}", self.len);
        // SAFETY: inside the sample (checked); the rest is the contract.
        self.y.map(|y| unsafe { y.slice(self.at + range.start..self.at + range.end) })
    }

    /// z from position `start` of channel 0 as a matrix by pointer: a row per channel, `plane`
    /// values apart, for a product that writes the calling task's positions alone.
    pub fn z_matrix(&self, start: usize, plane: usize) -> OutPtr {
        assert!(start <= self.len, "conv outputs: position {start} outside a sample of {}", self.len);
        OutPtr { ptr: self.z.ptr_at(self.at + start), len: self.len - start, rs: plane, cs: 1 }
    }

    /// Asks for the skip values of positions `range` of each channel (planes of `plane` values)
    /// to be brought into L2 before the block's product is computed, so that they arrive
    /// meanwhile: in a batch larger than L2 the skip was written several layers before and is
    /// read cold.
    pub fn prefetch(&self, plane: usize, range: Range<usize>) {
        if let Some(skip) = self.skip {
            for oc in 0..skip.len() / plane {
                prefetch_l2(&skip[oc * plane + range.start..oc * plane + range.end]);
            }
        }
    }
}

/// Asks for the cache lines of `values` to be brought into L2 (a hint: nothing happens where
/// the CPU has no such instruction).
fn prefetch_l2(values: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in values.chunks(16) {
        // SAFETY: a prefetch of an address inside the slice; it reads nothing and never faults.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = values;
}

/// Output values (of all channels) a block holds at most where one output row holds fewer: a
/// block, its skip and its y within L1.
const BLOCK_VALUES: usize = 16384;

/// The blocks of output positions p = y·OW + x (of each channel) that output rows `rows` of a
/// sample are computed in, in order: whole rows, as many as hold at most [`BLOCK_VALUES`] (one
/// at least); a single row (OH = 1, a 1-D convolution, `rows` = 0..1) in parts of a multiple of
/// 64 columns.
pub(super) fn blocks(channels: usize, (oh, ow): (usize, usize), rows: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    debug_assert!(rows.end <= oh);
    let (start, end) = (rows.start * ow, rows.end * ow);
    let step = if oh == 1 { (BLOCK_VALUES / channels / 64).max(1) * 64 } else { (BLOCK_VALUES / (channels * ow)).max(1) * ow };
    (start..end).step_by(step.max(1)).map(move |p| p..(p + step).min(end))
}

/// z ← z·scale + shift (or z + shift), then + skip, as [`Epilogue`] says; on the widest vectors
/// this CPU has (the same bits: every operation is rounded alike).
fn affine(z: &mut [f32], scale: Option<f32>, shift: Option<f32>, skip: Option<&[f32]>) {
    #[cfg(target_arch = "x86_64")]
    match Isa::best() {
        // SAFETY: the instruction set is present.
        Isa::Avx512 => return unsafe { affine_avx512(z, scale, shift, skip) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { affine_avx2(z, scale, shift, skip) },
        Isa::Portable => {}
    }
    affine_loops(z, scale, shift, skip)
}

/// # Safety
/// AVX-512F present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn affine_avx512(z: &mut [f32], scale: Option<f32>, shift: Option<f32>, skip: Option<&[f32]>) {
    affine_loops(z, scale, shift, skip)
}

/// # Safety
/// AVX2 present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn affine_avx2(z: &mut [f32], scale: Option<f32>, shift: Option<f32>, skip: Option<&[f32]>) {
    affine_loops(z, scale, shift, skip)
}

/// [`affine`]'s loops, one per case so that each vectorises.
#[inline(always)]
fn affine_loops(z: &mut [f32], scale: Option<f32>, shift: Option<f32>, skip: Option<&[f32]>) {
    match (scale, shift) {
        (Some(s), Some(t)) => z.iter_mut().for_each(|v| *v = *v * s + t),
        (Some(s), None) => z.iter_mut().for_each(|v| *v *= s),
        (None, Some(t)) => z.iter_mut().for_each(|v| *v += t),
        (None, None) => {}
    }
    if let Some(skip) = skip {
        z.iter_mut().zip(skip).for_each(|(v, &k)| *v += k);
    }
}

/// z ← act(z), with the values [`Activation::apply_slice`] gives.
fn act_in_place(act: Activation, z: &mut [f32]) {
    match act {
        Activation::Identity => {}
        Activation::Relu => relu(z),
        _ => {
            // apply_slice reads one slice and writes another: a copy on the stack, a part at a time
            let mut part = [0.0f32; 256];
            for chunk in z.chunks_mut(part.len()) {
                let part = &mut part[..chunk.len()];
                part.copy_from_slice(chunk);
                act.apply_slice(part, chunk);
            }
        }
    }
}

/// z ← max(z, 0), as `Relu.apply`, on the widest vectors this CPU has.
fn relu(z: &mut [f32]) {
    #[inline(always)]
    fn loops(z: &mut [f32]) {
        z.iter_mut().for_each(|v| *v = Activation::Relu.apply(*v));
    }
    /// # Safety
    /// AVX-512F present.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn avx512(z: &mut [f32]) {
        loops(z)
    }
    /// # Safety
    /// AVX2 present.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn avx2(z: &mut [f32]) {
        loops(z)
    }
    #[cfg(target_arch = "x86_64")]
    match Isa::best() {
        // SAFETY: the instruction set is present.
        Isa::Avx512 => return unsafe { avx512(z) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { avx2(z) },
        Isa::Portable => {}
    }
    loops(z)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// A sample's outputs past the end of z or y, or whose end overflows, are refused.
    #[test]
    fn outputs_must_lie_in_z_and_y() {
        let (mut z, mut y) = (vec![0.0; 12], vec![0.0; 8]);
        let (z, y) = (SharedMut::new(&mut z), SharedMut::new(&mut y));
        let _ = Outputs::new(&z, Some(&y), (4, 4), None);
        for (at, len, y) in [(8, 5, None), (4, 5, Some(&y)), (1, usize::MAX, None)] {
            let made = catch_unwind(AssertUnwindSafe(|| _ = Outputs::new(&z, y, (at, len), None)));
            assert!(made.is_err(), "values {at}.. ({len}) of z (12) and y (8): {}", y.is_some());
        }
    }
}
