//! The boundary with XLA: the only code that reads an `XLA_FFI_CallFrame`.
//!
//! All `unsafe` of the crate that touches XLA lives in this module. Handlers
//! elsewhere see a [`Frame`] with typed, bounds-checked accessors whose slices
//! live only as long as the call, and report failures as [`Error`]s that
//! [`handle`] turns into XLA errors.
//!
//! A handler is written as:
//! ```text
//! pub unsafe extern "C" fn my_op(f: *mut xla::sys::XLA_FFI_CallFrame) -> *mut xla::sys::XLA_FFI_Error {
//!     xla::handle(f, |frame| my_op_body(frame))
//! }
//! ```

/// The function `$field` of XLA's API table, or `None` when the table is too
/// short to have it (an older XLA) or leaves it unset. Must be used inside
/// `unsafe`, with `$api` null or pointing at a live table.
macro_rules! api_fn {
    ($api:expr, $field:ident) => {{
        let api: *const $crate::xla::sys::XLA_FFI_Api = $api;
        let end = ::std::mem::offset_of!($crate::xla::sys::XLA_FFI_Api, $field) + ::std::mem::size_of::<*const ()>();
        if api.is_null() || (*api).struct_size < end {
            None
        } else {
            (*api).$field
        }
    }};
}

mod collectives;
mod deferred;
mod frame;
mod guard;
mod state;
#[cfg(any(test, feature = "testing"))]
pub mod synthetic;
#[cfg(test)]
mod tests;

pub use collectives::Collectives;
pub use deferred::Deferred;
pub use frame::{Buffer, BufferMut, DeviceBuffer, DeviceBytes, Frame, Stage};
pub use guard::{handle, handle_named, handle_stages, take_unreported, Stages};
pub use xla_ffi_sys as sys;

use crate::error::Error;

/// The XLA error code an [`Error`] is reported with.
pub fn error_code(e: &Error) -> sys::XLA_FFI_Error_Code {
    match e {
        Error::InvalidArgument(_) => sys::XLA_FFI_Error_Code_INVALID_ARGUMENT,
        Error::Unimplemented(_) => sys::XLA_FFI_Error_Code_UNIMPLEMENTED,
        Error::DeadlineExceeded(_) => sys::XLA_FFI_Error_Code_DEADLINE_EXCEEDED,
        Error::Interrupted(_) => sys::XLA_FFI_Error_Code_CANCELLED,
        Error::Internal(_) => sys::XLA_FFI_Error_Code_INTERNAL,
    }
}
