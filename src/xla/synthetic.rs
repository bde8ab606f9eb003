//! Synthetic XLA call frames: a fake API table that records the errors
//! handlers create, and frames whose every pointer points into an arena the
//! caller owns. For the call-frame tests (`tests.rs`), the frame fuzzer
//! (`crate::fuzzing`, `tests/frame_fuzz.rs`, `fuzz/`) and the soak test.

use std::ffi::{CStr, CString};
use std::ptr;

use super::{handle, sys, Frame};

// ---- a fake XLA ----------------------------------------------------------

/// What `XLA_FFI_Error_Create` of the fake API hands out.
struct FakeError {
    code: sys::XLA_FFI_Error_Code,
    message: CString,
}

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn fake_error_create(args: *mut sys::XLA_FFI_Error_Create_Args) -> *mut sys::XLA_FFI_Error {
    let (code, message) = unsafe { ((*args).errc, CStr::from_ptr((*args).message).to_owned()) };
    Box::into_raw(Box::new(FakeError { code, message })) as *mut sys::XLA_FFI_Error
}

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn fake_error_get_message(args: *mut sys::XLA_FFI_Error_GetMessage_Args) {
    unsafe {
        let err = (*args).error as *const FakeError;
        (*args).message = (*err).message.as_ptr();
    }
}

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn fake_error_destroy(args: *mut sys::XLA_FFI_Error_Destroy_Args) {
    drop(unsafe { Box::from_raw((*args).error as *mut FakeError) });
}

pub const DEVICE_ORDINAL: i32 = 2049;
pub const RUN_ID: i64 = 0x5eed;

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn fake_device_ordinal(
    args: *mut sys::XLA_FFI_DeviceOrdinal_Get_Args,
) -> *mut sys::XLA_FFI_Error {
    unsafe { (*args).device_ordinal = DEVICE_ORDINAL };
    ptr::null_mut()
}

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn fake_run_id(args: *mut sys::XLA_FFI_RunId_Get_Args) -> *mut sys::XLA_FFI_Error {
    unsafe { (*args).run_id = RUN_ID };
    ptr::null_mut()
}

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn failing_run_id(_: *mut sys::XLA_FFI_RunId_Get_Args) -> *mut sys::XLA_FFI_Error {
    let msg = c"no run id here";
    let mut args = sys::XLA_FFI_Error_Create_Args {
        struct_size: sys::XLA_FFI_Error_Create_Args_STRUCT_SIZE as usize,
        message: msg.as_ptr(),
        errc: sys::XLA_FFI_Error_Code_UNAVAILABLE,
        ..Default::default()
    };
    unsafe { fake_error_create(&mut args) }
}

/// What the fake GPU runtime hands out as XLA's stream.
pub const STREAM: usize = 0x5712_ea40;

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn fake_stream(args: *mut sys::XLA_FFI_Stream_Get_Args) -> *mut sys::XLA_FFI_Error {
    unsafe { (*args).stream = STREAM as *mut std::ffi::c_void };
    ptr::null_mut()
}

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn null_stream(args: *mut sys::XLA_FFI_Stream_Get_Args) -> *mut sys::XLA_FFI_Error {
    unsafe { (*args).stream = ptr::null_mut() };
    ptr::null_mut()
}

/// What XLA's CPU runtime does: `Stream_Get` is not supported there.
/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn cpu_stream(_: *mut sys::XLA_FFI_Stream_Get_Args) -> *mut sys::XLA_FFI_Error {
    let msg = c"XLA FFI GPU context is not available";
    let mut args = sys::XLA_FFI_Error_Create_Args {
        struct_size: sys::XLA_FFI_Error_Create_Args_STRUCT_SIZE as usize,
        message: msg.as_ptr(),
        errc: sys::XLA_FFI_Error_Code_UNIMPLEMENTED,
        ..Default::default()
    };
    unsafe { fake_error_create(&mut args) }
}

// Instance state as XLA keeps it: types registered by name, and each
// instance's states by type. A frame's `ctx` names its instance
// (`Call::instance`; 0, a call of no instance, keeps none); the fake never
// dereferences it.

type Deleter = unsafe extern "C" fn(*mut std::ffi::c_void);

struct FakeStates {
    types: Vec<(String, Option<Deleter>)>,
    /// (instance, type id) -> state.
    states: std::collections::BTreeMap<(usize, i64), usize>,
}

static FAKE_STATES: std::sync::Mutex<FakeStates> =
    std::sync::Mutex::new(FakeStates { types: Vec::new(), states: std::collections::BTreeMap::new() });

fn fake_error(message: &str) -> *mut sys::XLA_FFI_Error {
    let message = CString::new(message).expect("no NUL");
    Box::into_raw(Box::new(FakeError { code: sys::XLA_FFI_Error_Code_INTERNAL, message })) as *mut sys::XLA_FFI_Error
}

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn fake_type_register(args: *mut sys::XLA_FFI_Type_Register_Args) -> *mut sys::XLA_FFI_Error {
    let (name, deleter) = unsafe {
        let name = std::slice::from_raw_parts((*args).name.ptr as *const u8, (*args).name.len);
        (String::from_utf8_lossy(name).into_owned(), (*(*args).type_info).deleter)
    };
    let mut fake = FAKE_STATES.lock().unwrap_or_else(|e| e.into_inner());
    if fake.types.iter().any(|(n, _)| *n == name) {
        return fake_error(&format!("Type name {name} already registered"));
    }
    fake.types.push((name, deleter));
    unsafe { (*(*args).type_id).type_id = fake.types.len() as i64 };
    ptr::null_mut()
}

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn fake_state_set(args: *mut sys::XLA_FFI_State_Set_Args) -> *mut sys::XLA_FFI_Error {
    let (instance, type_id, state) = unsafe { ((*args).ctx as usize, (*(*args).type_id).type_id, (*args).state) };
    if instance == 0 {
        return fake_error("this call has no instance to keep state with");
    }
    let mut fake = FAKE_STATES.lock().unwrap_or_else(|e| e.into_inner());
    if fake.states.contains_key(&(instance, type_id)) {
        return fake_error("state is already set");
    }
    fake.states.insert((instance, type_id), state as usize);
    ptr::null_mut()
}

/// # Safety
/// `args` points at the argument struct of this API function, as XLA's caller passes it.
pub unsafe extern "C" fn fake_state_get(args: *mut sys::XLA_FFI_State_Get_Args) -> *mut sys::XLA_FFI_Error {
    let (instance, type_id) = unsafe { ((*args).ctx as usize, (*(*args).type_id).type_id) };
    let fake = FAKE_STATES.lock().unwrap_or_else(|e| e.into_inner());
    match fake.states.get(&(instance, type_id)) {
        Some(&state) => {
            unsafe { (*args).state = state as *mut std::ffi::c_void };
            ptr::null_mut()
        }
        None => fake_error("state not found"),
    }
}

/// Drops instance `instance` as XLA drops an executable: each of its
/// states through its type's deleter. How many were dropped.
pub fn drop_fake_instance(instance: usize) -> usize {
    let dropped: Vec<(usize, Option<Deleter>)> = {
        let mut fake = FAKE_STATES.lock().unwrap_or_else(|e| e.into_inner());
        let keys: Vec<_> = fake.states.keys().filter(|(i, _)| *i == instance).copied().collect();
        keys.into_iter()
            .map(|key| {
                let state = fake.states.remove(&key).expect("listed");
                (state, fake.types[key.1 as usize - 1].1)
            })
            .collect()
    };
    for (state, deleter) in &dropped {
        if let Some(delete) = deleter {
            unsafe { delete(*state as *mut std::ffi::c_void) };
        }
    }
    dropped.len()
}

pub fn fake_api() -> sys::XLA_FFI_Api {
    sys::XLA_FFI_Api {
        struct_size: sys::XLA_FFI_Api_STRUCT_SIZE as usize,
        api_version: sys::XLA_FFI_Api_Version {
            struct_size: sys::XLA_FFI_Api_Version_STRUCT_SIZE as usize,
            extension_start: ptr::null_mut(),
            major_version: sys::XLA_FFI_API_MAJOR as i32,
            minor_version: sys::XLA_FFI_API_MINOR as i32,
        },
        XLA_FFI_Error_Create: Some(fake_error_create),
        XLA_FFI_Error_GetMessage: Some(fake_error_get_message),
        XLA_FFI_Error_Destroy: Some(fake_error_destroy),
        XLA_FFI_DeviceOrdinal_Get: Some(fake_device_ordinal),
        XLA_FFI_RunId_Get: Some(fake_run_id),
        XLA_FFI_Type_Register: Some(fake_type_register),
        XLA_FFI_State_Set: Some(fake_state_set),
        XLA_FFI_State_Get: Some(fake_state_get),
        ..Default::default()
    }
}

/// Code and message of an error a handler returned (and frees it); `None` for success.
pub fn take_error(e: *mut sys::XLA_FFI_Error) -> Option<(sys::XLA_FFI_Error_Code, String)> {
    if e.is_null() {
        return None;
    }
    let err = unsafe { Box::from_raw(e as *mut FakeError) };
    Some((err.code, err.message.to_string_lossy().into_owned()))
}

// ---- synthetic call frames -------------------------------------------------

/// Owns heap allocations by raw pointer, so the pointers stored in a call
/// frame stay valid (and unaliased by any `Box`) until the arena is dropped.
#[derive(Default)]
pub struct Arena {
    drops: Vec<Box<dyn FnOnce()>>,
}

impl Arena {
    pub fn alloc<T: 'static>(&mut self, value: T) -> *mut T {
        let p = Box::into_raw(Box::new(value));
        self.drops.push(Box::new(move || drop(unsafe { Box::from_raw(p) })));
        p
    }

    /// A vector's elements, owned by the arena: (pointer, length).
    pub fn slice<T: 'static>(&mut self, v: Vec<T>) -> (*mut T, usize) {
        let len = v.len();
        let v = self.alloc(v);
        (unsafe { (*v).as_mut_ptr() }, len)
    }

    /// A byte span naming `s` (arena-owned copy, not NUL-terminated).
    pub fn span(&mut self, s: &str) -> *mut sys::XLA_FFI_ByteSpan {
        let (ptr, len) = self.slice(s.as_bytes().to_vec());
        self.alloc(sys::XLA_FFI_ByteSpan { ptr: ptr as *const _, len })
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        while let Some(d) = self.drops.pop() {
            d();
        }
    }
}

#[derive(Debug, Clone)]
pub enum Attr {
    I64(i64),
    I32(i32),
    F32(f32),
    I64s(Vec<i64>),
    Str(&'static str),
}

pub fn elem_size(dtype: u32) -> usize {
    match dtype {
        sys::XLA_FFI_DataType_F64 | sys::XLA_FFI_DataType_S64 => 8,
        sys::XLA_FFI_DataType_F32 | sys::XLA_FFI_DataType_S32 => 4,
        sys::XLA_FFI_DataType_F16 | sys::XLA_FFI_DataType_BF16 => 2,
        _ => 1,
    }
}

/// The largest buffer a synthetic frame allocates; a buffer whose dims ask
/// for more (or overflow) gets a null data pointer, as no real call has it.
pub const MAX_BUFFER_BYTES: usize = 64 << 20;

/// A call to build: operands and results as (XLA dtype, dims), attributes.
#[derive(Debug, Clone)]
pub struct Call {
    pub args: Vec<(u32, Vec<i64>)>,
    pub rets: Vec<(u32, Vec<i64>)>,
    pub attrs: Vec<(&'static str, Attr)>,
    pub stage: sys::XLA_FFI_ExecutionStage,
    /// Which instance the call belongs to, as its execution context (the
    /// fake API keeps instance state by it; 0: none).
    pub instance: usize,
}

impl Default for Call {
    fn default() -> Self {
        Call { args: vec![], rets: vec![], attrs: vec![], stage: sys::XLA_FFI_ExecutionStage_EXECUTE, instance: 0 }
    }
}

/// A built frame: every pointer in it points into `_arena`.
pub struct Built {
    pub frame: *mut sys::XLA_FFI_CallFrame,
    pub api: *mut sys::XLA_FFI_Api,
    pub arg_bufs: Vec<*mut sys::XLA_FFI_Buffer>,
    pub ret_bufs: Vec<*mut sys::XLA_FFI_Buffer>,
    /// Byte lengths of the buffers' data (`None`: not allocated, data null).
    arg_lens: Vec<Option<usize>>,
    ret_lens: Vec<Option<usize>>,
    _arena: Arena,
}

/// A structural fault to put into a built frame: what a broken or hostile
/// caller could pass without lying about the sizes of the arrays it points
/// at (a lie no callee can detect).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Corruption {
    FrameStructSize(usize),
    ApiStructSize(usize),
    ArgsStructSize(usize),
    RetsStructSize(usize),
    AttrsStructSize(usize),
    BufferStructSize {
        result: bool,
        index: usize,
        size: usize,
    },
    /// A negative count of operands, results or attributes.
    NegativeCount {
        list: usize,
    },
    /// A null array where the count says there are entries.
    NullArray {
        list: usize,
        which: usize,
    },
    ArgType {
        index: usize,
        code: u32,
    },
    RetType {
        index: usize,
        code: u32,
    },
    NegativeRank {
        result: bool,
        index: usize,
    },
    NullDims {
        result: bool,
        index: usize,
    },
    AttrType {
        index: usize,
        code: u32,
    },
    NullAttrValue {
        index: usize,
    },
    NullAttrName {
        index: usize,
    },
    NullApi,
    Stage(u32),
}

impl Call {
    pub fn build(mut self) -> Built {
        let mut arena = Arena::default();
        let api = arena.alloc(fake_api());

        let mut buffers = |list: &[(u32, Vec<i64>)]| {
            let (mut bufs, mut lens) = (vec![], vec![]);
            for (n, (dtype, dims)) in list.iter().enumerate() {
                let len = dims
                    .iter()
                    .try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
                    .and_then(|elems| elems.checked_mul(elem_size(*dtype)))
                    .filter(|&len| len <= MAX_BUFFER_BYTES);
                let data = match len {
                    Some(len) => {
                        // A recognisable pattern, different for every buffer,
                        // in words: XLA's buffers are aligned.
                        let mut words = vec![0u64; len.div_ceil(8)];
                        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
                        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 7 + n * 13) as u8);
                        arena.slice(words).0 as *mut std::ffi::c_void
                    }
                    None => ptr::null_mut(),
                };
                let (dims, rank) = arena.slice(dims.clone());
                bufs.push(arena.alloc(sys::XLA_FFI_Buffer {
                    struct_size: sys::XLA_FFI_Buffer_STRUCT_SIZE as usize,
                    extension_start: ptr::null_mut(),
                    dtype: *dtype,
                    data,
                    rank: rank as i64,
                    dims,
                }));
                lens.push(len);
            }
            (bufs, lens)
        };
        let (arg_bufs, arg_lens) = buffers(&self.args);
        let (ret_bufs, ret_lens) = buffers(&self.rets);

        let args = {
            let (types, n) = arena.slice(vec![sys::XLA_FFI_ArgType_BUFFER; arg_bufs.len()]);
            let ptrs = arg_bufs.iter().map(|&b| b as *mut std::ffi::c_void).collect();
            let (ptrs, _) = arena.slice::<*mut std::ffi::c_void>(ptrs);
            let struct_size = sys::XLA_FFI_Args_STRUCT_SIZE as usize;
            sys::XLA_FFI_Args { struct_size, size: n as i64, types, args: ptrs, ..Default::default() }
        };
        let rets = {
            let (types, n) = arena.slice(vec![sys::XLA_FFI_RetType_BUFFER; ret_bufs.len()]);
            let ptrs = ret_bufs.iter().map(|&b| b as *mut std::ffi::c_void).collect();
            let (ptrs, _) = arena.slice::<*mut std::ffi::c_void>(ptrs);
            let struct_size = sys::XLA_FFI_Rets_STRUCT_SIZE as usize;
            sys::XLA_FFI_Rets { struct_size, size: n as i64, types, rets: ptrs, ..Default::default() }
        };

        // XLA sorts attributes by name.
        self.attrs.sort_by_key(|(name, _)| *name);
        let (mut types, mut names, mut values) = (vec![], vec![], vec![]);
        for (name, attr) in self.attrs {
            names.push(arena.span(name));
            let scalar = |arena: &mut Arena, dtype, value: *mut std::ffi::c_void| {
                arena.alloc(sys::XLA_FFI_Scalar { dtype, value }) as *mut std::ffi::c_void
            };
            let (ty, value) = match attr {
                Attr::I64(v) => {
                    let v = arena.alloc(v) as *mut _;
                    (sys::XLA_FFI_AttrType_SCALAR, scalar(&mut arena, sys::XLA_FFI_DataType_S64, v))
                }
                Attr::I32(v) => {
                    let v = arena.alloc(v) as *mut _;
                    (sys::XLA_FFI_AttrType_SCALAR, scalar(&mut arena, sys::XLA_FFI_DataType_S32, v))
                }
                Attr::F32(v) => {
                    let v = arena.alloc(v) as *mut _;
                    (sys::XLA_FFI_AttrType_SCALAR, scalar(&mut arena, sys::XLA_FFI_DataType_F32, v))
                }
                Attr::I64s(v) => {
                    let (data, size) = arena.slice(v);
                    let dtype = sys::XLA_FFI_DataType_S64;
                    let array = arena.alloc(sys::XLA_FFI_Array { dtype, size, data: data as *mut _ });
                    (sys::XLA_FFI_AttrType_ARRAY, array as *mut _)
                }
                Attr::Str(s) => (sys::XLA_FFI_AttrType_STRING, arena.span(s) as *mut _),
            };
            types.push(ty);
            values.push(value);
        }
        let (types, n) = arena.slice(types);
        let (names, _) = arena.slice(names);
        let (values, _) = arena.slice(values);
        let attrs = sys::XLA_FFI_Attrs {
            struct_size: sys::XLA_FFI_Attrs_STRUCT_SIZE as usize,
            size: n as i64,
            types,
            names,
            attrs: values,
            ..Default::default()
        };

        let frame = arena.alloc(sys::XLA_FFI_CallFrame {
            // What XLA 0.10.2 passes: the struct up to `attrs`, without `future`.
            struct_size: sys::XLA_FFI_CallFrame_STRUCT_SIZE as usize,
            extension_start: ptr::null_mut(),
            api,
            ctx: self.instance as *mut sys::XLA_FFI_ExecutionContext,
            stage: self.stage,
            args,
            rets,
            attrs,
            future: ptr::null_mut(),
        });
        Built { frame, api, arg_bufs, ret_bufs, arg_lens, ret_lens, _arena: arena }
    }
}

/// The attribute type codes XLA defines.
const ATTR_TYPES: [u32; 4] = [
    sys::XLA_FFI_AttrType_ARRAY,
    sys::XLA_FFI_AttrType_DICTIONARY,
    sys::XLA_FFI_AttrType_SCALAR,
    sys::XLA_FFI_AttrType_STRING,
];

/// An exported handler, as XLA calls it.
pub type Handler = unsafe extern "C" fn(*mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error;

impl Built {
    pub fn frame(&self) -> Frame<'_> {
        // SAFETY: the frame and all it points at live in the arena.
        unsafe { Frame::from_raw(self.frame) }.expect("valid synthetic frame")
    }

    /// Runs `body` through `handle`, as an `extern "C"` handler would.
    pub fn handle(&self, body: impl FnOnce(&mut Frame<'_>) -> crate::error::Result<()>) -> Option<(u32, String)> {
        // SAFETY: as in `frame`.
        take_error(unsafe { handle(self.frame, body) })
    }

    /// Calls `handler` on the frame: its error's code and message, `None` for success.
    pub fn call(&self, handler: Handler) -> Option<(u32, String)> {
        // SAFETY: the frame is built to XLA's layout, every pointer valid
        // (or null) and every array as long as its count says; the fake API
        // creates the errors `take_error` frees.
        take_error(unsafe { handler(self.frame) })
    }

    /// Whether every buffer got its memory (none has null data).
    pub fn allocated(&self) -> bool {
        self.arg_lens.iter().chain(&self.ret_lens).all(Option::is_some)
    }

    /// The data of operand `i`, to fill with values; `None` if not allocated.
    pub fn arg_data_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        let len = (*self.arg_lens.get(i)?)?;
        // SAFETY: the arena allocated `len` bytes for this buffer, and
        // `&mut self` keeps any handler from running meanwhile.
        Some(unsafe { std::slice::from_raw_parts_mut((*self.arg_bufs[i]).data as *mut u8, len) })
    }

    /// The data of result `i` as the handler left it; `None` if not allocated.
    pub fn ret_data(&self, i: usize) -> Option<&[u8]> {
        let len = (*self.ret_lens.get(i)?)?;
        // SAFETY: as in `arg_data_mut`; no handler runs while `self` is borrowed.
        Some(unsafe { std::slice::from_raw_parts((*self.ret_bufs[i]).data as *const u8, len) })
    }

    /// Puts `fault` into the frame. A fault that names an entry the frame
    /// does not have changes nothing and returns false.
    pub fn corrupt(&mut self, fault: Corruption) -> bool {
        // SAFETY: every pointer written through points into the arena; the
        // values written only change counts, codes and sizes the callee must
        // check, or null out pointers.
        unsafe {
            let frame = &mut *self.frame;
            let buffer = |result: bool, index: usize| {
                if result { self.ret_bufs.get(index) } else { self.arg_bufs.get(index) }.copied()
            };
            match fault {
                Corruption::FrameStructSize(size) => frame.struct_size = size,
                Corruption::ApiStructSize(size) => (*self.api).struct_size = size,
                Corruption::ArgsStructSize(size) => frame.args.struct_size = size,
                Corruption::RetsStructSize(size) => frame.rets.struct_size = size,
                Corruption::AttrsStructSize(size) => frame.attrs.struct_size = size,
                Corruption::BufferStructSize { result, index, size } => match buffer(result, index) {
                    Some(b) => (*b).struct_size = size,
                    None => return false,
                },
                Corruption::NegativeCount { list } => match list % 3 {
                    0 => frame.args.size = -1 - frame.args.size,
                    1 => frame.rets.size = -1 - frame.rets.size,
                    _ => frame.attrs.size = -1 - frame.attrs.size,
                },
                Corruption::NullArray { list, which } => {
                    let sizes = [frame.args.size, frame.rets.size, frame.attrs.size];
                    if sizes[list % 3] <= 0 {
                        return false;
                    }
                    match (list % 3, which % 3) {
                        (0, 0) => frame.args.types = ptr::null_mut(),
                        (0, _) => frame.args.args = ptr::null_mut(),
                        (1, 0) => frame.rets.types = ptr::null_mut(),
                        (1, _) => frame.rets.rets = ptr::null_mut(),
                        (_, 0) => frame.attrs.types = ptr::null_mut(),
                        (_, 1) => frame.attrs.names = ptr::null_mut(),
                        (_, _) => frame.attrs.attrs = ptr::null_mut(),
                    }
                }
                // Each write below goes through an array an earlier fault may have nulled.
                Corruption::ArgType { index, code } => match usize::try_from(frame.args.size) {
                    Ok(n) if index < n && !frame.args.types.is_null() => *frame.args.types.add(index) = code,
                    _ => return false,
                },
                Corruption::RetType { index, code } => match usize::try_from(frame.rets.size) {
                    Ok(n) if index < n && !frame.rets.types.is_null() => *frame.rets.types.add(index) = code,
                    _ => return false,
                },
                Corruption::NegativeRank { result, index } => match buffer(result, index) {
                    Some(b) => (*b).rank = -1 - (*b).rank,
                    None => return false,
                },
                Corruption::NullDims { result, index } => match buffer(result, index) {
                    Some(b) if (*b).rank > 0 => (*b).dims = ptr::null_mut(),
                    _ => return false,
                },
                // Only codes of no attribute type: another type's code would
                // make the value's struct a different one, a lie about memory.
                Corruption::AttrType { index, code } => match usize::try_from(frame.attrs.size) {
                    Ok(n) if index < n && !frame.attrs.types.is_null() && !ATTR_TYPES.contains(&code) => {
                        *frame.attrs.types.add(index) = code
                    }
                    _ => return false,
                },
                Corruption::NullAttrValue { index } => match usize::try_from(frame.attrs.size) {
                    Ok(n) if index < n && !frame.attrs.attrs.is_null() => {
                        *frame.attrs.attrs.add(index) = ptr::null_mut()
                    }
                    _ => return false,
                },
                Corruption::NullAttrName { index } => match usize::try_from(frame.attrs.size) {
                    Ok(n) if index < n && !frame.attrs.names.is_null() => {
                        *frame.attrs.names.add(index) = ptr::null_mut()
                    }
                    _ => return false,
                },
                Corruption::NullApi => frame.api = ptr::null_mut(),
                Corruption::Stage(stage) => frame.stage = stage,
            }
        }
        true
    }
}

pub fn f32_arg(dims: &[i64]) -> (u32, Vec<i64>) {
    (sys::XLA_FFI_DataType_F32, dims.to_vec())
}
