//! Problems and plans from arbitrary shapes and schedules (see `commfuse::fuzzing`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| commfuse::fuzzing::planner_target(data));
