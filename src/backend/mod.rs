//! Backends: what one step does on a device. The executor is shared.
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
