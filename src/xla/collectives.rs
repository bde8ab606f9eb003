//! XLA's collectives extension: XLA's own communicator handed to a custom
//! call (`sys::collectives`, jaxlib 0.11.2 and later, GPU runtimes only).
//!
//! A call finds it through `XLA_FFI_InvokeContext_FindExtension` (FFI API 0.4
//! and later), which an older API table lacks. What it finds is checked
//! before any use: its type, major version 0, minor version at least 1, and
//! `struct_size` before every field a shorter struct may lack (the windows of
//! minor version 2 above all). Where there is no lookup or the lookup finds
//! nothing the call has none (`Ok(None)`); where the lookup fails or what it
//! finds is unusable, the error says why (UNIMPLEMENTED: the caller keeps
//! its own communicators).
//!
//! The communicator is asked for at the PREPARE stage
//! (`Collectives::request_communicator`) and handed out at INITIALIZE or
//! EXECUTE (`Collectives::communicator`), for groups of flattened ids.

use std::ffi::c_void;
use std::mem::{offset_of, size_of};
use std::ptr;

use super::{sys, Frame, Stage};
use crate::error::{Error, Result};
use sys::collectives as c;

/// The extension's type id.
pub const EXTENSION_TYPE: i64 = c::XLA_FFI_Extension_Collectives as i64;
/// The major version commfuse reads.
pub const MAJOR_VERSION: i32 = 0;
/// The first minor version with communicators (windows came with 2).
pub const MIN_MINOR_VERSION: i32 = 1;

/// The end of a field of XLA's collectives extension struct.
const fn end_of(offset: usize) -> usize {
    offset + size_of::<*const ()>()
}
/// Where the communicator calls end: what minor version 1 has.
const COMMUNICATOR_END: usize = end_of(offset_of!(c::XLA_FFI_Collectives_Extension, get_communicator));
/// Where the window calls end (minor version 2).
const WINDOW_END: usize = end_of(offset_of!(c::XLA_FFI_Collectives_Extension, get_window));

/// XLA's collectives extension as one call found it, checked.
pub struct Collectives<'f, 'a> {
    frame: &'f Frame<'a>,
    ext: *const c::XLA_FFI_Collectives_Extension,
    /// The extension's minor version (1: communicators; 2: windows too).
    pub minor_version: i32,
    /// Whether its symmetric-memory window calls are there (minor version 2
    /// or later, a struct long enough, both set).
    pub has_windows: bool,
}

fn unusable(why: String) -> Error {
    Error::Unimplemented(format!("XLA's collectives extension is unusable: {why}"))
}

impl<'a> Frame<'a> {
    /// XLA's collectives extension for this call: `None` where XLA's API has
    /// no extension lookup (FFI API before 0.4) or attaches none (CPU, jaxlib
    /// before 0.11.2); an error where the lookup fails or what it finds is
    /// unusable.
    pub fn collectives<'f>(&'f self) -> Result<Option<Collectives<'f, 'a>>> {
        // SAFETY: `api` is XLA's table, read only as far as its struct_size
        // says it goes; the lookup's arguments are fully initialised and
        // outlive the call; what it returns is read field by field, each only
        // after struct_size shows it is there.
        unsafe {
            let Some(find) = find_extension(self.api()) else { return Ok(None) };
            let mut args = c::XLA_FFI_InvokeContext_FindExtension_Args {
                struct_size: c::XLA_FFI_InvokeContext_FindExtension_Args_STRUCT_SIZE as usize,
                extension_start: ptr::null_mut(),
                ctx: self.ctx() as *mut c::XLA_FFI_InvokeContext,
                extension_type: EXTENSION_TYPE,
                extension: ptr::null(),
            };
            let err = find(&mut args) as *mut sys::XLA_FFI_Error;
            // A failed lookup is said (an incompatible XLA must not pass for one without the extension).
            if let Err(e) = self.check(err, "XLA_FFI_InvokeContext_FindExtension") {
                return Err(unusable(format!("looking it up failed: {e}")));
            }
            if args.extension.is_null() {
                return Ok(None);
            }
            let ext = args.extension as *const c::XLA_FFI_Collectives_Extension;
            if !ext.is_aligned() {
                return Err(unusable(format!("it is at a misaligned address {ext:p}")));
            }
            let size = (*ext).extension_base.struct_size;
            if size < c::XLA_FFI_Extension_STRUCT_SIZE as usize {
                let base = c::XLA_FFI_Extension_STRUCT_SIZE;
                return Err(unusable(format!("its struct_size {size} is shorter than an extension's header ({base})")));
            }
            let id = (*ext).extension_base.id;
            if id.extension_type != EXTENSION_TYPE {
                let t = id.extension_type;
                return Err(unusable(format!("the lookup of type {EXTENSION_TYPE} found one of type {t}")));
            }
            if id.major_version != MAJOR_VERSION {
                let v = id.major_version;
                return Err(unusable(format!("major version {v}; commfuse reads version {MAJOR_VERSION}")));
            }
            if id.minor_version < MIN_MINOR_VERSION {
                let v = id.minor_version;
                return Err(unusable(format!("minor version {v}; communicators need {MIN_MINOR_VERSION} or later")));
            }
            if size < COMMUNICATOR_END {
                return Err(unusable(format!(
                    "its struct_size {size} stops before the communicator calls (they end at {COMMUNICATOR_END})"
                )));
            }
            if (*ext).request_communicator.is_none() || (*ext).get_communicator.is_none() {
                return Err(unusable("request_communicator or get_communicator is not set".into()));
            }
            let has_windows = id.minor_version >= 2
                && size >= WINDOW_END
                && (*ext).request_window.is_some()
                && (*ext).get_window.is_some();
            Ok(Some(Collectives { frame: self, ext, minor_version: id.minor_version, has_windows }))
        }
    }
}

/// `XLA_FFI_InvokeContext_FindExtension` of XLA's table, where the table is
/// long enough to have it (FFI API 0.4 and later) and sets it.
///
/// # Safety
/// `api` must be null or XLA's live table.
unsafe fn find_extension(api: *const sys::XLA_FFI_Api) -> c::XLA_FFI_InvokeContext_FindExtension {
    let api = api as *const c::XLA_FFI_Api;
    let end = end_of(offset_of!(c::XLA_FFI_Api, XLA_FFI_InvokeContext_FindExtension));
    // SAFETY: struct_size is the table's first field, in every version; the
    // lookup's field is read only where struct_size covers it.
    unsafe {
        if api.is_null() || (*api).struct_size < end {
            return None;
        }
        (*api).XLA_FFI_InvokeContext_FindExtension
    }
}

/// A group list as XLA takes it, borrowing `groups`.
fn replica_groups(groups: &[Vec<i64>]) -> Vec<c::XLA_FFI_ReplicaGroup> {
    groups.iter().map(|g| c::XLA_FFI_ReplicaGroup { ids: g.as_ptr(), size: g.len() }).collect()
}

impl Collectives<'_, '_> {
    /// Asks XLA for the communicator of `groups` (flattened ids: one list
    /// per group, this call's among them) so that its clique is acquired
    /// before execution. PREPARE stage only.
    pub fn request_communicator(&self, groups: &[Vec<i64>], communication_id: i64) -> Result<()> {
        if self.frame.stage() != Stage::Prepare {
            return Err(Error::Internal(format!(
                "a communicator is requested at the PREPARE stage, not at {:?}",
                self.frame.stage()
            )));
        }
        let list = replica_groups(groups);
        let mut args = c::XLA_FFI_Communicator_Request_Args {
            struct_size: c::XLA_FFI_Communicator_Request_Args_STRUCT_SIZE as usize,
            extension_start: ptr::null_mut(),
            group_mode: c::XLA_FFI_GROUP_FLATTENED_ID,
            groups: list.as_ptr(),
            num_groups: list.len(),
            communication_id,
        };
        // SAFETY: `ext` was checked by `Frame::collectives` (the call is set);
        // the arguments and the groups they point at outlive the call.
        unsafe {
            let request = (*self.ext).request_communicator.expect("checked when found");
            let err = request(self.ext, &mut args) as *mut sys::XLA_FFI_Error;
            self.frame.check(err, "the collectives extension's request_communicator")
        }
    }

    /// XLA's communicator of `groups` (as requested at PREPARE): on a GPU,
    /// an `ncclComm_t` XLA owns, valid for this call. INITIALIZE or EXECUTE.
    pub fn communicator(&self, groups: &[Vec<i64>], communication_id: i64) -> Result<*mut c_void> {
        if !matches!(self.frame.stage(), Stage::Initialize | Stage::Execute) {
            return Err(Error::Internal(format!(
                "XLA hands out its communicator at INITIALIZE or EXECUTE, not at {:?}",
                self.frame.stage()
            )));
        }
        let list = replica_groups(groups);
        let mut args = c::XLA_FFI_Communicator_Get_Args {
            struct_size: c::XLA_FFI_Communicator_Get_Args_STRUCT_SIZE as usize,
            extension_start: ptr::null_mut(),
            group_mode: c::XLA_FFI_GROUP_FLATTENED_ID,
            groups: list.as_ptr(),
            num_groups: list.len(),
            communication_id,
            communicator: ptr::null_mut(),
        };
        // SAFETY: as in `request_communicator`.
        let comm = unsafe {
            let get = (*self.ext).get_communicator.expect("checked when found");
            let err = get(self.ext, &mut args) as *mut sys::XLA_FFI_Error;
            self.frame.check(err, "the collectives extension's get_communicator")?;
            args.communicator
        };
        if comm.is_null() {
            return Err(Error::Internal("XLA's collectives extension handed out no communicator".into()));
        }
        Ok(comm as *mut c_void)
    }
}
