//! XLA's per-instance state: a value a handler makes when XLA instantiates
//! one of its call sites (once per compiled instance, from the attributes
//! alone: no buffers exist yet), which XLA keeps with that instance and
//! hands back to every later call of it, and drops with the executable.
//!
//! The crate registers one FFI type, `InstanceState`, holding any
//! `Any + Send + Sync`: a handler downcasts what it made.
//!
//! XLA dereferences the instance's state store without a check, and a
//! runtime that never instantiates its custom calls may have none. So the
//! state is asked for only once XLA has run an INSTANTIATE stage of a
//! commfuse handler in this process (`INSTANTIATED`): the runtimes that do
//! (XLA's CPU thunks, see `docs/how-it-works.md`) hand the same store to
//! the instance's calls.

use std::any::Any;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use super::{sys, Frame, Stage};
use crate::error::{Error, Result};

/// What one instance keeps: whatever its handler made at INSTANTIATE.
pub struct InstanceState(Box<dyn Any + Send + Sync>);

/// The FFI type name of `InstanceState` (one per process: XLA refuses a
/// name registered twice).
const TYPE_NAME: &str = "commfuse::InstanceState";

/// XLA's id of `InstanceState`, registered on the first INSTANTIATE.
static TYPE_ID: OnceLock<i64> = OnceLock::new();
static REGISTERING: Mutex<()> = Mutex::new(());

/// Whether XLA has run an INSTANTIATE stage of a handler in this process.
static INSTANTIATED: AtomicBool = AtomicBool::new(false);

/// XLA's deleter of an `InstanceState` (`XLA_FFI_TypeInfo`): runs when XLA
/// drops the instance. Nothing may unwind into XLA.
unsafe extern "C" fn drop_instance_state(state: *mut c_void) {
    if state.is_null() {
        return;
    }
    // SAFETY: XLA hands back the pointer `set_instance_state` gave it, once.
    let boxed = unsafe { Box::from_raw(state as *mut InstanceState) };
    let _ = catch_unwind(AssertUnwindSafe(move || drop(boxed)));
}

impl Frame<'_> {
    /// Whether this call's API has the state calls of version 0.3 (with a stage).
    fn state_api(&self) -> bool {
        // SAFETY: `api` is XLA's table, non-null (checked before any handler
        // body runs); `api_version` is among its first fields.
        let version = unsafe { (*self.api()).api_version };
        (version.major_version, version.minor_version) >= (0, 3)
    }

    /// XLA's id of `InstanceState`, registered through this call's API table
    /// on first use.
    fn instance_type_id(&self) -> Result<i64> {
        if let Some(id) = TYPE_ID.get() {
            return Ok(*id);
        }
        let _one_at_a_time = crate::sync::lock(&REGISTERING);
        if let Some(id) = TYPE_ID.get() {
            return Ok(*id);
        }
        // SAFETY: `api` is XLA's table (checked by `api_fn!`); the arguments
        // and the name and type info they point at outlive the call.
        let id = unsafe {
            let register = api_fn!(self.api(), XLA_FFI_Type_Register)
                .ok_or_else(|| Error::Unimplemented("this XLA has no XLA_FFI_Type_Register".into()))?;
            let mut id = sys::XLA_FFI_TypeId { type_id: 0 }; // 0: XLA assigns one
                                                             // XLA copies the deleter out of it.
            let info = sys::XLA_FFI_TypeInfo {
                struct_size: sys::XLA_FFI_TypeInfo_STRUCT_SIZE as usize,
                extension_start: std::ptr::null_mut(),
                deleter: Some(drop_instance_state),
            };
            let mut args = sys::XLA_FFI_Type_Register_Args {
                struct_size: std::mem::size_of::<sys::XLA_FFI_Type_Register_Args>(),
                extension_start: std::ptr::null_mut(),
                name: sys::XLA_FFI_ByteSpan { ptr: TYPE_NAME.as_ptr().cast(), len: TYPE_NAME.len() },
                type_id: &mut id,
                type_info: &info,
            };
            self.check(register(&mut args), "XLA_FFI_Type_Register")?;
            id.type_id
        };
        Ok(*TYPE_ID.get_or_init(|| id))
    }

    /// Keeps `value` as this instance's state. INSTANTIATE stage only.
    pub fn set_instance_state(&self, value: Box<dyn Any + Send + Sync>) -> Result<()> {
        if self.stage() != Stage::Instantiate {
            return Err(Error::Internal("instance state is set at the instantiate stage only".into()));
        }
        if !self.state_api() {
            return Err(Error::Unimplemented("this XLA's FFI API predates per-stage state (0.3)".into()));
        }
        let mut type_id = sys::XLA_FFI_TypeId { type_id: self.instance_type_id()? };
        let state = Box::into_raw(Box::new(InstanceState(value)));
        // SAFETY: as in `instance_type_id`; on success XLA owns `state` and
        // frees it with `drop_instance_state`.
        let result = unsafe {
            match api_fn!(self.api(), XLA_FFI_State_Set) {
                None => Err(Error::Unimplemented("this XLA has no XLA_FFI_State_Set".into())),
                Some(set) => {
                    let mut args = sys::XLA_FFI_State_Set_Args {
                        struct_size: sys::XLA_FFI_State_Set_Args_STRUCT_SIZE as usize,
                        extension_start: std::ptr::null_mut(),
                        ctx: self.ctx(),
                        stage: sys::XLA_FFI_ExecutionStage_INSTANTIATE,
                        type_id: &mut type_id,
                        state: state.cast(),
                    };
                    self.check(set(&mut args), "XLA_FFI_State_Set")
                }
            }
        };
        match result {
            // XLA keeps state for instances: its runtime hands the store to their calls.
            Ok(()) => INSTANTIATED.store(true, Ordering::Release),
            // SAFETY: XLA did not take it.
            Err(_) => drop(unsafe { Box::from_raw(state) }),
        }
        result
    }

    /// This instance's state as its INSTANTIATE stage made it, if XLA keeps
    /// one: None where no instantiate stage ever ran in this process, where
    /// this instance made none, or where this XLA has no state API.
    pub fn instance_state(&self) -> Option<&(dyn Any + Send + Sync)> {
        let asks = self.instance_stage() && self.stage() != Stage::Instantiate && self.state_api();
        if !asks || !INSTANTIATED.load(Ordering::Acquire) {
            return None;
        }
        let mut type_id = sys::XLA_FFI_TypeId { type_id: *TYPE_ID.get()? };
        // SAFETY: as in `instance_type_id`; the state XLA returns is the
        // `InstanceState` this instance set, alive as long as the instance,
        // so longer than this call's frame.
        unsafe {
            let get = api_fn!(self.api(), XLA_FFI_State_Get)?;
            let mut args = sys::XLA_FFI_State_Get_Args {
                struct_size: sys::XLA_FFI_State_Get_Args_STRUCT_SIZE as usize,
                extension_start: std::ptr::null_mut(),
                ctx: self.ctx(),
                stage: sys::XLA_FFI_ExecutionStage_INSTANTIATE,
                type_id: &mut type_id,
                state: std::ptr::null_mut(),
            };
            // An instance without state answers NotFound: not an error here.
            self.check(get(&mut args), "XLA_FFI_State_Get").ok()?;
            let state = args.state as *const InstanceState;
            state.as_ref().map(|s| &*s.0)
        }
    }
}
