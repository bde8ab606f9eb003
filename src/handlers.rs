//! The C ABI: XLA FFI handlers and the few plain functions Python calls
//! through ctypes. Every entry point catches panics; none crosses the ABI.

use crate::dtype::DType;
use crate::plan::{Dims, OpKind, Schedule};
use crate::xla::{self, sys};
use std::panic::catch_unwind;

/// # Safety
/// Called by XLA with its call frame.
#[no_mangle]
pub unsafe extern "C" fn commfuse_all_gather_matmul_cpu(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA passes a valid call frame for the duration of the call.
    unsafe { xla::handle_named("all_gather_matmul", frame, crate::ops::all_gather_matmul_cpu) }
}

/// # Safety
/// Called by XLA with its call frame.
#[no_mangle]
pub unsafe extern "C" fn commfuse_matmul_reduce_scatter_cpu(
    frame: *mut sys::XLA_FFI_CallFrame,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA passes a valid call frame for the duration of the call.
    unsafe { xla::handle_named("matmul_reduce_scatter", frame, crate::ops::matmul_reduce_scatter_cpu) }
}

/// Workspace bytes for one call, or -1 if an argument is out of range.
/// `op`: 0 all_gather_matmul, 1 matmul_reduce_scatter; `schedule`: as the
/// attribute; dtypes: XLA PrimitiveType numbers.
#[no_mangle]
pub extern "C" fn commfuse_workspace_bytes(
    op: i32,
    schedule: i32,
    ranks: i64,
    block_rows: i64,
    k: i64,
    n: i64,
    input_dtype: i32,
    output_dtype: i32,
) -> i64 {
    catch_unwind(|| {
        let op = match op {
            0 => OpKind::AllGatherMatmul,
            1 => OpKind::MatmulReduceScatter,
            _ => return None,
        };
        let schedule = Schedule::from_code(schedule.into())?;
        let size = |v: i64| usize::try_from(v).ok();
        let dtype = |code: i32| DType::from_xla(u32::try_from(code).ok()?);
        let dims = Dims {
            block_rows: size(block_rows)?,
            k: size(k)?,
            n: size(n)?,
            input: dtype(input_dtype)?,
            output: dtype(output_dtype)?,
        };
        let ranks = size(ranks).filter(|&r| r >= 1)?;
        i64::try_from(crate::ops::workspace_bytes(op, schedule, ranks, &dims)).ok()
    })
    .ok()
    .flatten()
    .unwrap_or(-1)
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
