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
