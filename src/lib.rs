//! commfuse: fused, overlapped collective matmuls behind XLA FFI custom calls.
//!
//! Unsafe code lives at the edges only: `xla` (the call frame), `handlers`
//! (the C ABI) and the CPU GEMM wrapper. Planning, execution, transport and
//! numerics are safe code.
pub mod backend;
pub mod comm;
pub mod config;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod fuzzing;
pub mod handlers;
pub mod ops;
pub mod plan;
pub mod problem;
pub mod sim;
pub mod trace;
pub mod xla;
