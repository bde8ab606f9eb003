//! commfuse: fused, overlapped collective matmuls behind XLA FFI custom calls.
//!
//! Unsafe code is denied crate-wide and allowed only at the edges: `xla`
//! (the call frame), `exports` (the C ABI), the CPU GEMM wrapper
//! (`backend::cpu::gemm`), a thread's priority (`thread_priority`) and the
//! CUDA backend's driver layer (see `backend::cuda`). Planning, execution, transport, numerics and the cost
//! model are safe code, most of them `#![forbid(unsafe_code)]`.
#![deny(unsafe_code)]

pub mod abi;
pub mod activity;
pub mod backend;
pub mod call;
pub mod config;
pub mod dtype;
pub mod error;
pub mod exec;
#[allow(unsafe_code)]
pub mod exports;
#[cfg(feature = "testing")]
pub mod fuzzing;
pub mod group;
pub mod plan;
pub mod prepare;
pub mod problem;
pub mod reshard;
pub mod sim;
pub mod sync;
#[allow(unsafe_code)]
pub(crate) mod thread_priority;
pub mod trace;
#[allow(unsafe_code)]
pub mod xla;
