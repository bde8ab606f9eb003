//! The XLA FFI handlers: the symbols Python registers with
//! `jax.ffi.register_ffi_target`. Each goes through `xla::handle_*`, which
//! catches panics and turns errors into XLA errors.

use crate::xla::{self, sys};

/// # Safety
/// Called by XLA with its call frame.
#[no_mangle]
pub unsafe extern "C" fn commfuse_collective_matmul_cpu(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA passes a valid call frame for the duration of the call.
    unsafe {
        xla::handle_stages(
            "commfuse collective matmul",
            frame,
            xla::Stages::InstantiateAndExecute,
            crate::backend::cpu::handler::collective_matmul,
        )
    }
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

/// The CUDA handlers of `commfuse.reshard`'s three programs (see `backend::cuda::reshard`).
macro_rules! reshard_cuda_export {
    ($(#[$doc:meta])* $name:ident, $label:literal, $handler:path) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// Called by XLA with its call frame.
        #[cfg(feature = "cuda")]
        #[no_mangle]
        pub unsafe extern "C" fn $name(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
            // SAFETY: XLA passes a valid call frame for the duration of the call.
            unsafe { xla::handle_stages($label, frame, xla::Stages::InitializeAndExecute, $handler) }
        }
    };
}

reshard_cuda_export!(
    /// Connects the union's communicator (once per pair of meshes).
    commfuse_reshard_connect_cuda,
    "commfuse reshard connect (CUDA)",
    crate::backend::cuda::reshard::connect_handler
);
reshard_cuda_export!(
    /// The send program on the source mesh's GPUs.
    commfuse_reshard_send_cuda,
    "commfuse reshard send (CUDA)",
    crate::backend::cuda::reshard::send_handler
);
reshard_cuda_export!(
    /// The receive program on the destination mesh's GPUs.
    commfuse_reshard_receive_cuda,
    "commfuse reshard receive (CUDA)",
    crate::backend::cuda::reshard::receive_handler
);
