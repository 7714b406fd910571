//! Data: IDX files and a zero-allocation loader.

pub mod idx;
pub mod loader;

pub use loader::{Dataset, Loader, Split};
