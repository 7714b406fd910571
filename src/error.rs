//! The crate's one error type.

use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong in flatnn, in terms a user can act on.
#[derive(Debug)]
pub enum Error {
    /// Shapes do not fit: a layer's input, an input buffer, a target buffer, a file's tensor.
    Shape(String),
    /// A batch larger than the cache was built for.
    Capacity { batch: usize, capacity: usize },
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
