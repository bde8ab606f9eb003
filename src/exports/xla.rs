//! The XLA FFI handlers: the symbols Python registers with
//! `jax.ffi.register_ffi_target`. Each goes through `xla::handle_*`, which
//! catches panics and turns errors into XLA errors.

use crate::xla::{self, sys};

/// # Safety
/// Called by XLA with its call frame.
#[no_mangle]
pub unsafe extern "C" fn commfuse_collective_matmul_cpu(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA passes a valid call frame for the duration of the call.
    unsafe { xla::handle_named("commfuse collective matmul", frame, crate::backend::cpu::handler::collective_matmul) }
}

/// The send program of `commfuse.reshard` on CPU devices (see `backend::cpu::reshard`).
///
/// # Safety
/// Called by XLA with its call frame.
#[no_mangle]
pub unsafe extern "C" fn commfuse_reshard_send_cpu(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA passes a valid call frame for the duration of the call.
    unsafe { xla::handle_named("commfuse reshard send", frame, crate::backend::cpu::reshard::send_handler) }
}

/// The receive program of `commfuse.reshard` on CPU devices.
///
/// # Safety
/// Called by XLA with its call frame.
#[no_mangle]
pub unsafe extern "C" fn commfuse_reshard_receive_cpu(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA passes a valid call frame for the duration of the call.
    unsafe { xla::handle_named("commfuse reshard receive", frame, crate::backend::cpu::reshard::receive_handler) }
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
    unsafe {
        xla::handle_stages(
            "commfuse collective matmul (CUDA)",
            frame,
            xla::Stages::InitializeAndExecute,
            crate::backend::cuda::handler::handler,
        )
    }
}
