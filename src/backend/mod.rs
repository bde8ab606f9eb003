//! Backends: what one step does on a device. The executor is shared.
pub mod cpu;
