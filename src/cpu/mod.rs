//! CPU execution: the engine's thread pool and its GEMM.

pub mod gemm;
pub mod pool;
