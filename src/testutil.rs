//! Helpers for the crate's tests (public so integration tests and benches can share them;
//! not part of the supported API).

/// A seeded generator for test data.
pub struct Rng(crate::init::Rng);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(crate::init::Rng::new(seed))
    }

    /// Small integers in −4..=4, so sums and products stay exact in f32.
    pub fn ints(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.0.below(9) as f32 - 4.0).collect()
    }

    /// Uniform values in [−1, 1).
    pub fn uniform(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (2.0 * self.0.uniform() - 1.0) as f32).collect()
    }

    /// Integers in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0.below(n)
    }
}

/// A buffer of NaN, so unwritten outputs show.
pub fn poisoned(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

/// Asserts |a − b| ≤ atol + rtol·|b| everywhere (NaN never passes); prints the first bad
/// indices.
pub fn assert_close(a: &[f32], b: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let bad: Vec<String> = (0..a.len())
        .filter(|&i| (a[i] - b[i]).abs().partial_cmp(&(atol + rtol * b[i].abs())).is_none_or(|o| o.is_gt()))
        .take(5)
        .map(|i| format!("[{i}] {} vs {}", a[i], b[i]))
        .collect();
    assert!(bad.is_empty(), "{what}: {}", bad.join(", "));
}

thread_local! {
    static ALLOCATIONS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A global allocator that counts the calling thread's allocations, reallocations and frees,
/// so that a test sees its own calls even while other tests run beside it. Install it in a test
/// binary with `#[global_allocator] static A: flatnn::testutil::Counting = flatnn::testutil::Counting;`.
pub struct Counting;

// SAFETY: forwards every call to the system allocator; only counts.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

/// Allocations, reallocations and frees this thread made during `f` (under [`Counting`]).
pub fn allocations_in(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.with(|n| n.get());
    f();
    ALLOCATIONS.with(|n| n.get()) - before
}

/// CUDA device 0, or `None` after printing `skipped: no CUDA device` (the first line of every
/// GPU test).
pub fn cuda_or_skip() -> Option<crate::Device> {
    match crate::Device::cuda(0) {
        Ok(device) => Some(device),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}
