//! Call frames for the exported CPU handler (see `commfuse::fuzzing`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| commfuse::fuzzing::frame_target(data));
