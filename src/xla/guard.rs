//! The wrapper every `extern "C"` handler goes through: answers XLA's metadata
//! probe, skips stages other than EXECUTE, catches panics and turns errors
//! into `XLA_FFI_Error`s. Nothing here may unwind into XLA.

use std::any::Any;
use std::ffi::CString;
use std::io::Write;
use std::mem::{offset_of, size_of};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use super::{error_code, sys, Frame};
use crate::error::{Error, Result};

/// Runs a handler body for one call, named after the closure's enclosing
/// function in panic messages. See [`handle_named`].
///
/// # Safety
/// As [`handle_named`].
pub unsafe fn handle<F>(call_frame: *mut sys::XLA_FFI_CallFrame, body: F) -> *mut sys::XLA_FFI_Error
where
    F: FnOnce(&mut Frame<'_>) -> Result<()>,
{
    // SAFETY: forwarded contract.
    unsafe { handle_named(handler_name::<F>(), call_frame, body) }
}

/// Which execution stages run a handler's body (the others return success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stages {
    Execute,
    /// INITIALIZE too: XLA calls it before running the executable's thunks,
    /// where per-device set-up (loading kernels) belongs.
    InitializeAndExecute,
    /// INSTANTIATE too: XLA calls it once per compiled instance, where the
    /// instance's state is made (`Frame::set_instance_state`).
    InstantiateAndExecute,
}

/// Runs `body` for one EXECUTE call of the handler `name`:
/// - the metadata probe (a Metadata extension in `extension_start`) is
///   answered with our API version and no traits, without running `body`;
/// - stages other than EXECUTE return success without running `body`;
/// - an `Err` or a panic from `body` becomes an `XLA_FFI_Error`.
///
/// # Safety
/// `call_frame` must be what XLA passed to the handler (or built like it).
pub unsafe fn handle_named<F>(name: &str, call_frame: *mut sys::XLA_FFI_CallFrame, body: F) -> *mut sys::XLA_FFI_Error
where
    F: FnOnce(&mut Frame<'_>) -> Result<()>,
{
    // SAFETY: forwarded contract.
    unsafe { handle_stages(name, call_frame, Stages::Execute, body) }
}

/// As [`handle_named`], running `body` in the given `stages` (it reads
/// [`Frame::stage`]).
///
/// # Safety
/// As [`handle_named`].
pub unsafe fn handle_stages<F>(
    name: &str,
    call_frame: *mut sys::XLA_FFI_CallFrame,
    stages: Stages,
    body: F,
) -> *mut sys::XLA_FFI_Error
where
    F: FnOnce(&mut Frame<'_>) -> Result<()>,
{
    // SAFETY: forwarded contract.
    let api = match unsafe { preflight(name, call_frame, stages) } {
        Preflight::Done(result) => return result,
        Preflight::Execute(api) => api,
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `preflight` checked this is a full call frame, which XLA
        // keeps alive for the call.
        let mut frame = unsafe { Frame::from_raw(call_frame) }?;
        frame.set_instance_stage(stages == Stages::InstantiateAndExecute);
        body(&mut frame)
    }));
    let err = match outcome {
        Ok(Ok(())) => return ptr::null_mut(),
        Ok(Err(e)) => e,
        Err(payload) => {
            let msg = format!("panic in {name}: {}", panic_message(payload.as_ref()));
            drop_quietly(payload);
            Error::Internal(msg)
        }
    };
    // SAFETY: `api` is the call frame's table, checked non-null.
    unsafe { create_error(api, &err, name) }
}

/// What to do with a call before any handler code runs.
enum Preflight {
    /// Answered already (probe, other stage, malformed frame): return this.
    Done(*mut sys::XLA_FFI_Error),
    /// A call of a stage that runs the body, with a full call frame and this API table.
    Execute(*const sys::XLA_FFI_Api),
}

/// Answers the metadata probe, skips the stages not in `stages` and checks
/// the call frame is complete.
///
/// # Safety
/// As [`handle_named`].
unsafe fn preflight(name: &str, cf: *mut sys::XLA_FFI_CallFrame, stages: Stages) -> Preflight {
    // A call frame that cannot even carry an error back: no error can be
    // returned, so it is said on stderr and by the next call (`unreportable`).
    if cf.is_null() {
        return Preflight::Done(unreportable(name, "null call frame"));
    }
    // SAFETY: `cf` is XLA's call frame; each field is read through the raw
    // pointer only after `struct_size` shows it is there (the struct XLA
    // passes stops before `future`, so no reference to the whole is formed).
    unsafe {
        let size = (*cf).struct_size;
        let has = |end: usize| size >= end;
        let api_end = offset_of!(sys::XLA_FFI_CallFrame, api) + size_of::<*const ()>();
        let api = if has(api_end) { (*cf).api } else { ptr::null() };

        let ext_end = offset_of!(sys::XLA_FFI_CallFrame, extension_start) + size_of::<*const ()>();
        if has(ext_end) {
            if let Some(ext) = find_metadata((*cf).extension_start) {
                return Preflight::Done(answer_probe(ext, api));
            }
        }

        if api.is_null() {
            return Preflight::Done(unreportable(name, "call frame without an API table"));
        }
        let full = sys::XLA_FFI_CallFrame_STRUCT_SIZE as usize;
        if !has(full) {
            let msg = format!("call frame has struct_size {size}, expected at least {full}");
            return Preflight::Done(create_error(api, &Error::Internal(msg), name));
        }
        let stage = (*cf).stage;
        let runs = stage == sys::XLA_FFI_ExecutionStage_EXECUTE
            || (stages == Stages::InitializeAndExecute && stage == sys::XLA_FFI_ExecutionStage_INITIALIZE)
            || (stages == Stages::InstantiateAndExecute && stage == sys::XLA_FFI_ExecutionStage_INSTANTIATE);
        if !runs {
            return Preflight::Done(ptr::null_mut());
        }
        // An earlier error no call could carry goes back with the next EXECUTE
        // (not with an INSTANTIATE, which would fail an unrelated compile).
        if stage == sys::XLA_FFI_ExecutionStage_EXECUTE {
            if let Some(earlier) = take_unreported() {
                return Preflight::Done(create_error(api, &earlier, name));
            }
        }
        Preflight::Execute(api)
    }
}

/// The function a closure was written in, from its type name
/// (`crate::ops::ag_matmul::{{closure}}` -> `crate::ops::ag_matmul`).
fn handler_name<F>() -> &'static str {
    let mut name = std::any::type_name::<F>();
    while let Some(outer) = name.strip_suffix("::{{closure}}") {
        name = outer;
    }
    name
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(non-string panic payload)"
    }
}

/// Drops a panic payload; a payload whose destructor panics again is leaked
/// rather than let unwind into XLA.
fn drop_quietly(payload: Box<dyn Any + Send>) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}

/// The Metadata extension in the chain starting at `ext`, if any.
///
/// # Safety
/// `ext` must be null or the head of a chain of live extensions.
unsafe fn find_metadata(mut ext: *mut sys::XLA_FFI_Extension_Base) -> Option<*mut sys::XLA_FFI_Extension_Base> {
    // The bound only guards against a corrupted (cyclic) chain.
    for _ in 0..64 {
        if ext.is_null() {
            return None;
        }
        // SAFETY: a live extension, per the contract.
        unsafe {
            if (*ext).type_ == sys::XLA_FFI_Extension_Metadata {
                return Some(ext);
            }
            ext = (*ext).next;
        }
    }
    None
}

/// Fills in the metadata XLA asks for when the backend starts: the API
/// version we were built against, and no traits (in particular we do not
/// claim command-buffer compatibility: our calls block and synchronise).
///
/// # Safety
/// `ext` must be a live Metadata extension; `api` null or XLA's table.
unsafe fn answer_probe(ext: *mut sys::XLA_FFI_Extension_Base, api: *const sys::XLA_FFI_Api) -> *mut sys::XLA_FFI_Error {
    // SAFETY: sizes are checked before each struct is read or written.
    unsafe {
        let ext = ext as *mut sys::XLA_FFI_Metadata_Extension;
        let md = if (*ext).extension_base.struct_size >= sys::XLA_FFI_Metadata_Extension_STRUCT_SIZE as usize {
            (*ext).metadata
        } else {
            ptr::null_mut()
        };
        if md.is_null() || (*md).struct_size < sys::XLA_FFI_Metadata_STRUCT_SIZE as usize {
            // XLA's probe passes no API table, so there is usually no way to
            // report this; XLA then rejects the unfilled metadata itself.
            if api.is_null() {
                return ptr::null_mut();
            }
            let err = Error::Internal("malformed metadata extension".into());
            return create_error(api, &err, "metadata probe");
        }
        (*md).api_version = sys::XLA_FFI_Api_Version {
            struct_size: sys::XLA_FFI_Api_Version_STRUCT_SIZE as usize,
            extension_start: ptr::null_mut(),
            major_version: sys::XLA_FFI_API_MAJOR as i32,
            minor_version: sys::XLA_FFI_API_MINOR as i32,
        };
        (*md).traits = 0;
    }
    ptr::null_mut()
}

/// Builds the `XLA_FFI_Error` for `err` (XLA copies the message and owns the
/// returned error).
///
/// # Safety
/// `api` must be XLA's API table.
pub(super) unsafe fn create_error(api: *const sys::XLA_FFI_Api, err: &Error, name: &str) -> *mut sys::XLA_FFI_Error {
    // SAFETY: `api_fn!` checks the table has the field.
    let Some(create) = (unsafe { api_fn!(api, XLA_FFI_Error_Create) }) else {
        return unreportable(name, &format!("cannot report an error (no XLA_FFI_Error_Create): {err}"));
    };
    // An interior NUL would cut the C string short: replace it.
    let message = CString::new(err.to_string().replace('\0', "\u{fffd}")).unwrap_or_default();
    let mut args = sys::XLA_FFI_Error_Create_Args {
        struct_size: sys::XLA_FFI_Error_Create_Args_STRUCT_SIZE as usize,
        extension_start: ptr::null_mut(),
        message: message.as_ptr(),
        errc: error_code(err),
    };
    // SAFETY: `args` is complete and outlives the call; XLA copies `message`.
    unsafe { create(&mut args) }
}

/// A call whose frame cannot carry an error back (no frame, no API table,
/// no way to create an error): nothing at the C ABI may abort the process,
/// and returning an error is impossible, so the call returns success with
/// its results unwritten. Said at once on stderr, and kept for the next call
/// that can report it (see `take_unreported`), so the failure is not lost.
fn unreportable(name: &str, msg: &str) -> *mut sys::XLA_FFI_Error {
    // Ignore write errors: there is nowhere left to report them.
    let _ = writeln!(std::io::stderr(), "commfuse: handler {name} cannot report an error: {msg}");
    let mut pending = crate::sync::lock(&UNREPORTED);
    if pending.is_none() {
        *pending = Some(format!(
            "an earlier call of {name} could not report its error ({msg}), so its results were not written"
        ));
    }
    ptr::null_mut()
}

/// The first failure `unreportable` kept, once (the next call that can
/// report an error returns it; tests take it to check it is there).
static UNREPORTED: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

pub fn take_unreported() -> Option<Error> {
    crate::sync::lock(&UNREPORTED).take().map(Error::Internal)
}
