//! Finishing a call on another thread, through XLA's FFI future.
//!
//! A handler that waits for other devices must not hold the thread XLA
//! called it on: XLA's CPU runtime orders its own collectives among
//! themselves only, so a device whose thread sits in a fused op waiting for
//! a peer, while that peer's thread sits in an XLA all-gather waiting for
//! it, deadlocks both. A deferred call returns to XLA at once with a future
//! (`call_frame->future`); the work runs elsewhere and completes the
//! future. XLA keeps the call's buffers alive, and runs nothing that reads
//! its results, until then.

use super::guard::create_error;
use super::sys;
use crate::error::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

/// One buffer of a deferred call: its address and length in bytes.
#[derive(Clone, Copy)]
pub(super) struct RawBytes {
    pub ptr: *mut u8,
    pub len: usize,
}

/// A call whose completion is XLA's future: holds the addresses of its
/// operands and results, and completes the future exactly once, with the
/// result of [`Deferred::finish`]'s work, or with an error if it is dropped
/// unfinished.
pub struct Deferred {
    api: *const sys::XLA_FFI_Api,
    future: *mut sys::XLA_FFI_Future,
    args: Vec<RawBytes>,
    rets: Vec<RawBytes>,
    name: &'static str,
    completed: bool,
}

// SAFETY: the API table is XLA's (static); the future may be completed from
// any thread; the buffers are XLA's memory for this call, alive until the
// future completes, and only `finish` turns them into slices (once).
unsafe impl Send for Deferred {}

impl Deferred {
    /// # Safety
    /// `api` is XLA's table with the future functions; `future` was created by
    /// it for this call and is returned to XLA through the call frame; each
    /// buffer is valid (results: writable and unaliased) until the future
    /// completes.
    pub(super) unsafe fn new(
        api: *const sys::XLA_FFI_Api,
        future: *mut sys::XLA_FFI_Future,
        args: Vec<RawBytes>,
        rets: Vec<RawBytes>,
        name: &'static str,
    ) -> Deferred {
        Deferred { api, future, args, rets, name, completed: false }
    }

    /// Runs `work` on the call's operand and result bytes (in the call's
    /// order), then completes XLA's future with its result; a panic in
    /// `work` completes it with an INTERNAL error.
    pub fn finish<F>(mut self, work: F)
    where
        F: FnOnce(&[&[u8]], &mut [&mut [u8]]) -> Result<()>,
    {
        let result = {
            // SAFETY: `new`'s contract: the memory stays valid until the future
            // completes, which happens below, after these slices are gone.
            let args: Vec<&[u8]> = self.args.iter().map(|b| unsafe { bytes(*b) }).collect();
            let mut rets: Vec<&mut [u8]> = self.rets.iter().map(|b| unsafe { bytes_mut(*b) }).collect();
            catch_unwind(AssertUnwindSafe(|| work(&args, &mut rets)))
                .unwrap_or_else(|_| Err(Error::Internal(format!("panic in {} (deferred)", self.name))))
        };
        self.complete(result);
    }

    fn complete(&mut self, result: Result<()>) {
        if std::mem::replace(&mut self.completed, true) {
            return;
        }
        // SAFETY: `new`'s contract: the table has both functions (checked by
        // `Frame::defer`) and the future is live until this, its only completion.
        unsafe {
            match result {
                Ok(()) => {
                    if let Some(set) = api_fn!(self.api, XLA_FFI_Future_SetAvailable) {
                        let mut args = sys::XLA_FFI_Future_SetAvailable_Args {
                            struct_size: sys::XLA_FFI_Future_SetAvailable_Args_STRUCT_SIZE as usize,
                            extension_start: ptr::null_mut(),
                            future: self.future,
                        };
                        drop_error(self.api, set(&mut args));
                    }
                }
                Err(e) => {
                    if let Some(set) = api_fn!(self.api, XLA_FFI_Future_SetError) {
                        let mut args = sys::XLA_FFI_Future_SetError_Args {
                            struct_size: sys::XLA_FFI_Future_SetError_Args_STRUCT_SIZE as usize,
                            extension_start: ptr::null_mut(),
                            future: self.future,
                            error: create_error(self.api, &e, self.name),
                        };
                        drop_error(self.api, set(&mut args));
                    }
                }
            }
        }
    }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        self.complete(Err(Error::Internal(format!("{}: the deferred call was dropped before it ran", self.name))));
    }
}

/// Destroys an error XLA returned from a future function (nowhere to report it).
///
/// # Safety
/// `api` is XLA's table; `error` null or an error it created.
unsafe fn drop_error(api: *const sys::XLA_FFI_Api, error: *mut sys::XLA_FFI_Error) {
    if error.is_null() {
        return;
    }
    // SAFETY: the caller's contract.
    unsafe {
        if let Some(destroy) = api_fn!(api, XLA_FFI_Error_Destroy) {
            let mut args = sys::XLA_FFI_Error_Destroy_Args {
                struct_size: sys::XLA_FFI_Error_Destroy_Args_STRUCT_SIZE as usize,
                extension_start: ptr::null_mut(),
                error,
            };
            destroy(&mut args);
        }
    }
}

/// # Safety
/// `b` is readable for `len` bytes while the slice lives (or `len == 0`).
unsafe fn bytes<'a>(b: RawBytes) -> &'a [u8] {
    if b.len == 0 {
        &[]
    } else {
        // SAFETY: the caller's contract; `Frame::defer` refused null data.
        unsafe { std::slice::from_raw_parts(b.ptr, b.len) }
    }
}

/// # Safety
/// `b` is writable and unaliased for `len` bytes while the slice lives (or `len == 0`).
unsafe fn bytes_mut<'a>(b: RawBytes) -> &'a mut [u8] {
    if b.len == 0 {
        Default::default()
    } else {
        // SAFETY: the caller's contract; `Frame::defer` refused null data.
        unsafe { std::slice::from_raw_parts_mut(b.ptr, b.len) }
    }
}
