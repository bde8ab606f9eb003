//! The C ABI, by caller: the XLA FFI handlers (`xla`) and the plain
//! functions Python calls through ctypes (`python`). The only modules of
//! the crate besides `xla` (the call frame) and the CPU GEMM wrapper that
//! may use `unsafe`.
pub mod python;
pub mod xla;
