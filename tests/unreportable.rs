//! A call frame that cannot carry an error back (no API table) does not
//! abort the process: the call returns, the failure is written to stderr,
//! and the next call that can report an error reports it. A test binary of
//! its own: the pending failure is process-wide.

use commfuse::xla::synthetic::{f32_arg, Call, Corruption};
use commfuse::xla::sys;

#[test]
fn a_frame_without_an_api_table_is_reported_by_the_next_call() {
    let handler = commfuse::exports::xla::commfuse_collective_matmul_cpu;
    let mut broken = Call { args: vec![f32_arg(&[2, 2])], ..Default::default() }.build();
    assert!(broken.corrupt(Corruption::NullApi));
    assert_eq!(broken.call(handler), None, "no way to return an error: the call returns");

    let next = Call { args: vec![f32_arg(&[2, 2])], ..Default::default() }.build();
    let (code, message) = next.call(handler).expect("the next call reports the earlier failure");
    assert_eq!(code, sys::XLA_FFI_Error_Code_INTERNAL);
    assert!(message.contains("could not report its error (call frame without an API table)"), "{message}");
    assert!(message.contains("results were not written"), "{message}");
    // Reported once: the call after that fails only for its own reasons.
    let (_, own) = next.call(handler).expect("an incomplete call");
    assert!(!own.contains("earlier call"), "{own}");
}
