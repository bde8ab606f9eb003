//! Call frames for the exported CPU handlers of `commfuse.reshard` (see `commfuse::fuzzing::reshard_case`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| commfuse::fuzzing::reshard_frame_target(data));
