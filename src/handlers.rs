//! The C ABI: the XLA FFI handler and the few plain functions Python calls
//! through ctypes. Every entry point catches panics; none crosses the ABI.

use crate::ops::CallShapes;
use crate::xla::{self, sys};
use std::panic::catch_unwind;

/// # Safety
/// Called by XLA with its call frame.
#[no_mangle]
pub unsafe extern "C" fn commfuse_collective_matmul_cpu(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA passes a valid call frame for the duration of the call.
    unsafe { xla::handle_named("commfuse collective matmul", frame, crate::ops::collective_matmul_cpu) }
}

/// The CUDA handler: the same op on a GPU (see `backend::cuda`).
///
/// # Safety
/// Called by XLA with its call frame.
#[cfg(feature = "cuda")]
#[no_mangle]
pub unsafe extern "C" fn commfuse_collective_matmul_cuda(
    frame: *mut sys::XLA_FFI_CallFrame,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA passes a valid call frame for the duration of the call.
    unsafe { xla::handle_named("commfuse collective matmul (CUDA)", frame, crate::backend::cuda::collective_matmul) }
}

/// Workspace bytes for one call (see `ops::CallShapes`), or -1 with the reason
/// written, NUL-terminated and truncated, to `error[..error_len]`.
///
/// # Safety
/// Each `(pointer, len)` pair must be a readable array of that many i64s (or
/// len 0), and `error` a writable buffer of `error_len` bytes (or null).
#[no_mangle]
pub unsafe extern "C" fn commfuse_workspace_bytes(
    kind: i64,
    schedule: i64,
    ranks: i64,
    dimension: i64,
    x: *const i64,
    x_rank: usize,
    w: *const i64,
    w_rank: usize,
    out: *const i64,
    out_rank: usize,
    input_dtype: u32,
    output_dtype: u32,
    error: *mut u8,
    error_len: usize,
) -> i64 {
    // SAFETY: the caller guarantees the arrays; null or empty gives an empty slice.
    let dims = |p: *const i64, len: usize| {
        if p.is_null() || len == 0 {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(p, len) }
        }
    };
    let (x, w, out) = (dims(x, x_rank), dims(w, w_rank), dims(out, out_rank));
    let call = CallShapes { kind, schedule, ranks, dimension, x, w, out, input: input_dtype, output: output_dtype };
    let result = catch_unwind(|| crate::ops::workspace_bytes(&call));
    let message = match result {
        Ok(Ok(bytes)) => return i64::try_from(bytes).unwrap_or(-1),
        Ok(Err(e)) => e.to_string(),
        Err(_) => "panic while sizing the workspace".to_string(),
    };
    if !error.is_null() && error_len > 0 {
        let n = message.len().min(error_len - 1);
        // SAFETY: the caller guarantees `error_len` writable bytes at `error`.
        let buffer = unsafe { std::slice::from_raw_parts_mut(error, error_len) };
        buffer[..n].copy_from_slice(&message.as_bytes()[..n]);
        buffer[n] = 0;
    }
    -1
}

/// Sets the deadline of cross-device waits in milliseconds; 0 returns to
/// `COMMFUSE_TIMEOUT_S` (or the default).
#[no_mangle]
pub extern "C" fn commfuse_set_timeout_ms(ms: u64) {
    let timeout = (ms > 0).then(|| std::time::Duration::from_millis(ms));
    let _ = catch_unwind(|| crate::config::set_timeout(timeout));
}

/// 1 if the library was built with the CUDA backend, else 0.
#[no_mangle]
pub extern "C" fn commfuse_cuda_built() -> i32 {
    i32::from(cfg!(feature = "cuda"))
}
