//! The crate's one error type, and the fallible allocation that reports into it.

use std::alloc::Layout;
use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong in flatnn, in terms a user can act on.
#[derive(Debug)]
pub enum Error {
    /// Shapes do not fit: a layer's input, an input buffer, a target buffer, a file's tensor.
    Shape(String),
    /// A batch larger than the cache was built for.
    Capacity { batch: usize, capacity: usize },
    /// Memory for a buffer could not be had (host or device): `what` names the buffer and
    /// `bytes` is the size asked for.
    OutOfMemory { what: String, bytes: usize },
    /// A class label outside `0..classes`.
    Label { index: usize, label: u32, classes: usize },
    /// A target or input value that is NaN or infinite.
    NonFinite { what: &'static str, index: usize },
    /// A cache, gradient buffer or optimiser used with a model it was not built for.
    Mismatch(String),
    /// An invalid setting (a learning rate, a thread count, a command-line option).
    Config(String),
    /// Reading or writing a file failed.
    Io { path: PathBuf, source: std::io::Error },
    /// A file's content is wrong; `what` says how.
    Format { path: PathBuf, what: String },
    /// CUDA could not be used; `what` names what is missing or failed.
    Cuda { what: String },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Shape(msg) => write!(f, "shape error: {msg}"),
            Error::Capacity { batch, capacity } => {
                write!(f, "batch of {batch} exceeds the cache capacity of {capacity}")
            }
            Error::OutOfMemory { what, bytes } => write!(f, "out of memory: {bytes} bytes for {what} could not be allocated"),
            Error::Label { index, label, classes } => {
                write!(f, "label {label} at position {index} is not in 0..{classes}")
            }
            Error::NonFinite { what, index } => write!(f, "{what}[{index}] is NaN or infinite"),
            Error::Mismatch(msg) => write!(f, "mismatch: {msg}"),
            Error::Config(msg) => write!(f, "invalid setting: {msg}"),
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Format { path, what } => write!(f, "{}: {what}", path.display()),
            Error::Cuda { what } => write!(f, "CUDA unavailable: {what}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A type for which all-zero bytes are a valid value (0 or 0.0).
///
/// # Safety
/// Only for types whose every value is plain data and for which the all-zero bit pattern is
/// a valid value: [`zeros`] hands out such memory as initialised values.
pub(crate) unsafe trait Zeroable: Copy {}
// SAFETY: all-zero bytes are 0.0.
unsafe impl Zeroable for f32 {}
// SAFETY: all-zero bytes are 0.0.
unsafe impl Zeroable for f64 {}
// SAFETY: all-zero bytes are 0.
unsafe impl Zeroable for u32 {}

/// `len` zeros, or an error instead of the abort of `vec![0; len]`: [`Error::OutOfMemory`] with
/// the bytes asked for when the allocator refuses them, [`Error::Shape`] when `len` values are
/// more than any allocation may hold (`isize::MAX` bytes). `what` names the buffer.
///
/// The memory comes zeroed from the allocator, as for `vec![0; len]`, so pages not yet used are
/// not touched here. Where the system overcommits memory, a request larger than what is free
/// may still be granted and fail only when used; a request larger than the address space
/// never is.
pub(crate) fn zeros<T: Zeroable>(len: usize, what: impl FnOnce() -> String) -> Result<Vec<T>> {
    let Ok(layout) = Layout::array::<T>(len) else {
        return Err(Error::Shape(format!("{}: {len} values are more than an allocation can hold", what())));
    };
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: `layout` has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return Err(Error::OutOfMemory { what: what(), bytes: layout.size() });
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of exactly `len` values of
    // T (so the alignment, the size and the capacity are what `from_raw_parts` requires, and the
    // size is at most isize::MAX), and its bytes are zero, a valid T (`Zeroable`), so all `len`
    // values are initialised. The Vec owns the allocation from here.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_are_zeros() {
        assert_eq!(zeros::<f32>(5, String::new).unwrap(), [0.0; 5]);
        assert_eq!(zeros::<u32>(3, String::new).unwrap(), [0; 3]);
        assert!(zeros::<f64>(0, String::new).unwrap().is_empty());
        // more than isize::MAX bytes: refused before the allocator is asked
        let err = zeros::<f32>(usize::MAX / 2, || "the test buffer".into()).unwrap_err();
        assert!(matches!(&err, Error::Shape(m) if m.starts_with("the test buffer:")), "{err}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri stops at an allocation it cannot make instead of refusing it")]
    fn a_refused_allocation_is_an_error() {
        // 2⁵⁰ bytes: more than a 47-bit address space, refused by the allocator on any system
        // (black_box: an allocation never used may be left out, as if it had succeeded)
        match std::hint::black_box(zeros::<f32>(1 << 48, || "the test buffer".into())) {
            Err(Error::OutOfMemory { what, bytes }) => assert_eq!((what.as_str(), bytes), ("the test buffer", 1 << 50)),
            other => panic!("expected OutOfMemory, got {:?}", other.map(|v| v.len())),
        }
    }
}
