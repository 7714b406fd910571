//! CPU execution: the engine's thread pool, its GEMM, and helpers to split work over threads.

#![deny(clippy::undocumented_unsafe_blocks)]

pub(crate) mod conv;
pub(crate) mod fp_mode;
pub(crate) mod gemm;
pub(crate) mod isa;
pub(crate) mod pool;
pub(crate) mod recurrent;
pub(crate) mod rowdot;
pub(crate) mod turns;
pub(crate) mod vmath;

use pool::Pool;
use std::marker::PhantomData;
use std::ops::Range;

/// True when this process uses AVX2 and FMA ([`isa::Isa::best`]: checked once; cheap after).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    isa::Isa::best() >= isa::Isa::Avx2
}

/// A mutable slice that pool tasks write in disjoint parts.
pub(crate) struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: tasks only ever take disjoint ranges (each caller documents why), so sharing the
// pointer between threads is sharing disjoint `&mut` borrows.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub fn new(slice: &'a mut [T]) -> Self {
        SharedMut { ptr: slice.as_mut_ptr(), len: slice.len(), _borrow: PhantomData }
    }

    /// Elements of the borrowed slice.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The address of element `at` (at most the length), for views that write through raw
    /// pointers (under the same rule as [`SharedMut::slice`]).
    pub fn ptr_at(&self, at: usize) -> *mut T {
        assert!(at <= self.len, "element {at} outside 0..={}", self.len);
        // SAFETY: at most one past the end of the borrowed slice.
        unsafe { self.ptr.add(at) }
    }

    /// The elements `range` to read.
    ///
    /// # Safety
    /// Nothing writes them while the result lives (no live result of [`SharedMut::slice`]
    /// overlaps them, and no write through [`SharedMut::ptr_at`]).
    pub unsafe fn shared(&self, range: Range<usize>) -> &'a [T] {
        assert!(range.start <= range.end && range.end <= self.len, "range {range:?} outside 0..{}", self.len);
        // SAFETY: in bounds (checked above); no writer is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.end - range.start) }
    }

    /// # Safety
    /// No two live results may overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, range: Range<usize>) -> &'a mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "range {range:?} outside 0..{}", self.len);
        // SAFETY: in bounds (checked above); disjointness is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start) }
    }
}

/// Splits `0..items` into at most `pool.threads()` contiguous chunks of at least `min_items`
/// (fewer chunks when there is little work) and runs `f(chunk_index, range)` on each.
/// The split depends only on `items`, `min_items` and the thread count, never on timing.
pub(crate) fn for_chunks(pool: &Pool, items: usize, min_items: usize, f: &(dyn Fn(usize, Range<usize>) + Sync)) {
    let chunks = chunk_count(pool.threads(), items, min_items);
    pool.run(chunks, &|chunk, _worker| f(chunk, chunk_range(items, chunks, chunk)));
}

/// How many chunks [`for_chunks`] uses.
pub(crate) fn chunk_count(threads: usize, items: usize, min_items: usize) -> usize {
    (items / min_items.max(1)).clamp(1, threads.max(1))
}

/// The `chunk`-th of `chunks` near-equal contiguous ranges of `0..items`.
pub(crate) fn chunk_range(items: usize, chunks: usize, chunk: usize) -> Range<usize> {
    let (base, extra) = (items / chunks, items % chunks);
    let start = chunk * base + chunk.min(extra);
    start..start + base + usize::from(chunk < extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_everything_once() {
        for items in [0, 1, 2, 7, 100] {
            for chunks in 1..5 {
                let ranges: Vec<_> = (0..chunks).map(|c| chunk_range(items, chunks, c)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[chunks - 1].end, items);
                assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
        assert_eq!(chunk_count(2, 10, 100), 1);
        assert_eq!(chunk_count(2, 1000, 100), 2);
    }
}
