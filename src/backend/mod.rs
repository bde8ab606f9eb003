//! Backends: what one step does on a device. The executor is shared.
pub mod cpu;
/// Its workspace layout builds without the `cuda` feature; the rest needs it.
pub mod cuda;
