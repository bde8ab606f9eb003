//! Typed, checked access to one call's operands, results and attributes.
//!
//! Everything XLA hands over is checked before it becomes a Rust slice:
//! struct sizes, null pointers, ranks, negative or overflowing dimensions,
//! alignment. A [`Frame`] borrows the call frame for the duration of the call
//! only, so no slice it gives out can outlive the buffers XLA owns.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr;
use std::slice;

use super::deferred::{Deferred, RawBytes};

use super::sys;
use crate::dtype::{xla_type_name, DType};
use crate::error::{Error, Result};

/// An input operand: read-only bytes of `product(dims)` elements of `dtype`.
pub struct Buffer<'a> {
    pub dtype: DType,
    pub dims: &'a [i64],
    pub data: &'a [u8],
}

/// A result: writable bytes of `product(dims)` elements of `dtype`.
pub struct BufferMut<'a> {
    pub dtype: DType,
    pub dims: &'a [i64],
    pub data: &'a mut [u8],
}

/// An operand or result in device memory, for GPU handlers: never read or
/// written from the host, so no slice is formed; `addr` is only handed to
/// device APIs (cuBLAS, NCCL, kernel launches).
#[derive(Debug, Clone, Copy)]
pub struct DeviceBuffer<'a> {
    pub dtype: DType,
    pub dims: &'a [i64],
    /// The device address XLA passed (0 only when `bytes` is 0).
    pub addr: u64,
    /// `product(dims) * dtype.size()`.
    pub bytes: usize,
}

/// A raw operand or result in device memory of any whole-byte type (a
/// `uint8` workspace, an array a reshard moves as bytes), for GPU handlers.
#[derive(Debug, Clone, Copy)]
pub struct DeviceBytes<'a> {
    pub dims: &'a [i64],
    pub addr: u64,
    pub bytes: usize,
}

/// One call of a handler, as seen from Rust.
pub struct Frame<'a> {
    call_frame: *mut sys::XLA_FFI_CallFrame,
    stage: Stage,
    api: *const sys::XLA_FFI_Api,
    ctx: *mut sys::XLA_FFI_ExecutionContext,
    args: Slots,
    rets: Slots,
    attrs: Attrs,
    /// Which results were handed out: each at most once, so no two `&mut` alias.
    taken: Vec<bool>,
    /// Whether the handler runs an INSTANTIATE stage (`guard::Stages`): only
    /// then does it keep instance state for its calls to read.
    instance_stage: bool,
    _call: PhantomData<&'a mut sys::XLA_FFI_CallFrame>,
}

/// The execution stages a handler body runs in (the others never reach it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Once per compiled instance, from the attributes alone: no operands or
    /// results (see `state`).
    Instantiate,
    /// Before execution, where what XLA acquires for it is asked for (XLA's
    /// communicator: `collectives`).
    Prepare,
    Initialize,
    Execute,
}

/// An operand or result list of the call frame, checked once up front.
#[derive(Clone, Copy)]
struct Slots {
    len: usize,
    types: *const u32,
    ptrs: *const *mut c_void,
}

/// The attribute list of the call frame, checked once up front.
#[derive(Clone, Copy)]
struct Attrs {
    len: usize,
    types: *const sys::XLA_FFI_AttrType,
    names: *const *mut sys::XLA_FFI_ByteSpan,
    values: *const *mut c_void,
}

/// Operands and results are named differently in messages.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Operand,
    Result,
}

impl Side {
    fn word(self) -> &'static str {
        match self {
            Side::Operand => "operand",
            Side::Result => "result",
        }
    }
}

/// A decoded `XLA_FFI_Buffer` whose element type is not yet interpreted.
struct RawBuffer<'a> {
    dtype: sys::XLA_FFI_DataType,
    dims: &'a [i64],
    elems: usize,
    data: *mut u8,
}

impl RawBuffer<'_> {
    /// The size in bytes for elements of `elem_size` bytes, or `None` on overflow.
    fn byte_len(&self, elem_size: usize) -> Option<usize> {
        self.elems.checked_mul(elem_size)
    }
}

fn internal(msg: String) -> Error {
    Error::Internal(msg)
}

/// A readable name for an XLA type number, for messages.
fn type_desc(code: sys::XLA_FFI_DataType) -> String {
    match xla_type_name(code) {
        "an unsupported type" => format!("XLA type {code}"),
        name => name.to_string(),
    }
}

/// Bytes per element of an XLA type, for types whose elements are whole bytes.
/// `None` for sub-byte (packed) types, tokens and unknown numbers.
fn xla_type_size(code: sys::XLA_FFI_DataType) -> Option<usize> {
    match code {
        sys::XLA_FFI_DataType_PRED | sys::XLA_FFI_DataType_S8 | sys::XLA_FFI_DataType_U8 => Some(1),
        sys::XLA_FFI_DataType_F8E5M2
        | sys::XLA_FFI_DataType_F8E3M4
        | sys::XLA_FFI_DataType_F8E4M3
        | sys::XLA_FFI_DataType_F8E4M3FN
        | sys::XLA_FFI_DataType_F8E4M3B11FNUZ
        | sys::XLA_FFI_DataType_F8E5M2FNUZ
        | sys::XLA_FFI_DataType_F8E4M3FNUZ
        | sys::XLA_FFI_DataType_F8E8M0FNU => Some(1),
        sys::XLA_FFI_DataType_S16 | sys::XLA_FFI_DataType_U16 => Some(2),
        sys::XLA_FFI_DataType_F16 | sys::XLA_FFI_DataType_BF16 => Some(2),
        sys::XLA_FFI_DataType_S32 | sys::XLA_FFI_DataType_U32 | sys::XLA_FFI_DataType_F32 => Some(4),
        sys::XLA_FFI_DataType_S64 | sys::XLA_FFI_DataType_U64 | sys::XLA_FFI_DataType_F64 => Some(8),
        sys::XLA_FFI_DataType_C64 => Some(8),
        sys::XLA_FFI_DataType_C128 => Some(16),
        _ => None,
    }
}

/// `len` elements at `ptr` as a slice; an empty slice for `len == 0` whatever
/// `ptr` is (XLA may pass null or dangling pointers for empty lists).
///
/// # Safety
/// For `len > 0`, `ptr` must point at `len` initialised `T`s alive for `'a`.
unsafe fn list<'a, T>(ptr: *const T, len: usize, what: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() || !ptr.is_aligned() {
        return Err(internal(format!("{what}: bad pointer {ptr:p} for {len} entries")));
    }
    // SAFETY: non-null and aligned, and the caller vouches for the contents.
    Ok(unsafe { slice::from_raw_parts(ptr, len) })
}

/// Checks one of the call frame's operand/result lists.
///
/// # Safety
/// The pointers must be those XLA put in the call frame.
unsafe fn slots(struct_size: usize, size: i64, types: *mut u32, ptrs: *mut *mut c_void, what: &str) -> Result<Slots> {
    // `XLA_FFI_Args` and `XLA_FFI_Rets` have the same layout and size.
    if struct_size < sys::XLA_FFI_Args_STRUCT_SIZE as usize {
        return Err(internal(format!("{what} list has struct_size {struct_size}")));
    }
    let len = usize::try_from(size).map_err(|_| internal(format!("{what} list has negative size {size}")))?;
    // SAFETY: XLA promises `len` entries in both arrays; `list` checks the pointers.
    unsafe {
        list(types, len, what)?;
        list(ptrs, len, what)?;
    }
    Ok(Slots { len, types, ptrs })
}

impl<'a> Frame<'a> {
    /// Reads the call frame's lists and checks them.
    ///
    /// # Safety
    /// `call_frame` must be a call frame from XLA (or built like one), with
    /// `struct_size >= XLA_FFI_CallFrame_STRUCT_SIZE`, alive and unchanged for
    /// `'a`. Only fields up to `attrs` are read: XLA passes a struct that stops
    /// there, so no reference to the whole `XLA_FFI_CallFrame` is ever formed.
    pub(super) unsafe fn from_raw(call_frame: *mut sys::XLA_FFI_CallFrame) -> Result<Frame<'a>> {
        if call_frame.is_null() {
            return Err(internal("null call frame".into()));
        }
        // SAFETY: the caller guarantees the frame and its fields up to `attrs`;
        // every field is read through the raw pointer, one at a time.
        unsafe {
            let size = (*call_frame).struct_size;
            if size < sys::XLA_FFI_CallFrame_STRUCT_SIZE as usize {
                return Err(internal(format!("call frame has struct_size {size}")));
            }
            let args = (*call_frame).args;
            let rets = (*call_frame).rets;
            let attrs = (*call_frame).attrs;
            let args = slots(args.struct_size, args.size, args.types, args.args, "operand")?;
            let rets = slots(rets.struct_size, rets.size, rets.types, rets.rets, "result")?;

            if attrs.struct_size < sys::XLA_FFI_Attrs_STRUCT_SIZE as usize {
                let n = attrs.struct_size;
                return Err(internal(format!("attribute list has struct_size {n}")));
            }
            let n = attrs.size;
            let len = usize::try_from(n).map_err(|_| internal(format!("attribute list has negative size {n}")))?;
            list(attrs.types, len, "attribute types")?;
            list(attrs.names, len, "attribute names")?;
            list(attrs.attrs, len, "attribute values")?;
            let attrs = Attrs { len, types: attrs.types, names: attrs.names, values: attrs.attrs };

            let stage = match (*call_frame).stage {
                sys::XLA_FFI_ExecutionStage_INSTANTIATE => Stage::Instantiate,
                sys::XLA_FFI_ExecutionStage_PREPARE => Stage::Prepare,
                sys::XLA_FFI_ExecutionStage_INITIALIZE => Stage::Initialize,
                _ => Stage::Execute,
            };
            Ok(Frame {
                call_frame,
                stage,
                api: (*call_frame).api,
                ctx: (*call_frame).ctx,
                args,
                rets,
                attrs,
                taken: vec![false; rets.len],
                instance_stage: false,
                _call: PhantomData,
            })
        }
    }

    /// The execution stage of this call (see `guard::Stages`).
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Whether the handler runs an INSTANTIATE stage (see `state`).
    pub(super) fn instance_stage(&self) -> bool {
        self.instance_stage
    }

    pub(super) fn set_instance_stage(&mut self, on: bool) {
        self.instance_stage = on;
    }

    /// XLA's API table and execution context of this call (for `state`).
    pub(super) fn api(&self) -> *const sys::XLA_FFI_Api {
        self.api
    }

    pub(super) fn ctx(&self) -> *mut sys::XLA_FFI_ExecutionContext {
        self.ctx
    }

    pub fn num_args(&self) -> usize {
        self.args.len
    }

    pub fn num_rets(&self) -> usize {
        self.rets.len
    }

    /// Operand `i` (called `name` in messages) as a typed buffer.
    pub fn arg(&self, i: usize, name: &str) -> Result<Buffer<'a>> {
        let raw = self.raw_buffer(Side::Operand, i, name)?;
        let dtype = typed(&raw, Side::Operand, name)?;
        let data = self.bytes(&raw, dtype.size(), Side::Operand, name)?;
        // SAFETY: `bytes` checked pointer and length; operands are read-only
        // and, as `take_ret` checks, share no memory with any result.
        let data = unsafe { slice_of(data) };
        Ok(Buffer { dtype, dims: raw.dims, data })
    }

    /// Raw bytes of operand `i`, of any whole-byte type (typically a `uint8` blob).
    pub fn arg_bytes(&self, i: usize, name: &str) -> Result<&'a [u8]> {
        let raw = self.raw_buffer(Side::Operand, i, name)?;
        let size = whole_bytes(&raw, Side::Operand, name)?;
        let data = self.bytes(&raw, size, Side::Operand, name)?;
        // SAFETY: as in `arg`.
        Ok(unsafe { slice_of(data) })
    }

    /// Result `i` as a typed, writable buffer. Each result can be taken once.
    pub fn take_ret(&mut self, i: usize, name: &str) -> Result<BufferMut<'a>> {
        let raw = self.raw_buffer(Side::Result, i, name)?;
        let dtype = typed(&raw, Side::Result, name)?;
        let (ptr, len) = self.bytes(&raw, dtype.size(), Side::Result, name)?;
        self.claim(i, name, ptr, len)?;
        // SAFETY: `claim` made this the only `&mut` to these bytes.
        let data = unsafe { slice_of_mut((ptr, len)) };
        Ok(BufferMut { dtype, dims: raw.dims, data })
    }

    /// Raw bytes of result `i`, of any whole-byte type (typically a `uint8`
    /// workspace). Each result can be taken once, by this or `take_ret`.
    pub fn ret_bytes(&mut self, i: usize, name: &str) -> Result<&'a mut [u8]> {
        let raw = self.raw_buffer(Side::Result, i, name)?;
        let size = whole_bytes(&raw, Side::Result, name)?;
        let (ptr, len) = self.bytes(&raw, size, Side::Result, name)?;
        self.claim(i, name, ptr, len)?;
        // SAFETY: as in `take_ret`.
        Ok(unsafe { slice_of_mut((ptr, len)) })
    }

    /// The type and dims of result `i`, without handing it out.
    pub fn ret_type(&self, i: usize, name: &str) -> Result<(DType, &'a [i64])> {
        let raw = self.raw_buffer(Side::Result, i, name)?;
        Ok((typed(&raw, Side::Result, name)?, raw.dims))
    }

    /// Hands the rest of the call to another thread: creates XLA's future
    /// for it, returns it to XLA through the call frame, and gives back a
    /// [`Deferred`] holding every operand and result, to be finished
    /// elsewhere (XLA keeps them alive until then). The handler then returns
    /// success at once. `None` when this XLA has no FFI futures (the caller
    /// runs the call in place). No result may have been handed out before.
    pub fn defer(&mut self, name: &'static str) -> Result<Option<Deferred>> {
        // SAFETY: `api` is XLA's table (checked by the guard); `api_fn!`
        // checks each field is there. A table with the future functions
        // belongs to an XLA whose call frame has the `future` field (its
        // struct_size stops before it: XLA writes it whatever the size).
        let (create, available, error) = unsafe {
            (
                api_fn!(self.api, XLA_FFI_Future_Create),
                api_fn!(self.api, XLA_FFI_Future_SetAvailable),
                api_fn!(self.api, XLA_FFI_Future_SetError),
            )
        };
        let (Some(create), Some(_), Some(_)) = (create, available, error) else {
            return Ok(None);
        };
        if self.taken.iter().any(|&t| t) {
            return Err(internal("a result was handed out before the call was deferred".into()));
        }
        let (num_args, num_rets) = (self.args.len, self.rets.len);
        let mut buffers = |side: Side, count: usize| -> Result<Vec<RawBytes>> {
            (0..count)
                .map(|i| {
                    let raw = self.raw_buffer(side, i, side.word())?;
                    let size = whole_bytes(&raw, side, side.word())?;
                    let (ptr, len) = self.bytes(&raw, size, side, side.word())?;
                    if side == Side::Result {
                        self.claim(i, side.word(), ptr, len)?;
                    }
                    Ok(RawBytes { ptr, len })
                })
                .collect()
        };
        let args = buffers(Side::Operand, num_args)?;
        let rets = buffers(Side::Result, num_rets)?;
        let mut made = sys::XLA_FFI_Future_Create_Args {
            struct_size: sys::XLA_FFI_Future_Create_Args_STRUCT_SIZE as usize,
            extension_start: ptr::null_mut(),
            future: ptr::null_mut(),
        };
        // SAFETY: `made` is complete; XLA fills in `future`. The call frame
        // is XLA's, alive for this call; `future` is its last field.
        unsafe {
            self.check(create(&mut made), "XLA_FFI_Future_Create")?;
            if made.future.is_null() {
                return Err(internal("XLA_FFI_Future_Create returned no future".into()));
            }
            (*self.call_frame).future = made.future;
            Ok(Some(Deferred::new(self.api, made.future, args, rets, name)))
        }
    }

    /// Whether the call has an attribute called `name`.
    pub fn has_attr(&self, name: &str) -> bool {
        matches!(self.find_attr(name), Ok(Some(_)))
    }

    /// An integer scalar attribute (a Python `int` arrives as int64).
    pub fn attr_i64(&self, name: &str) -> Result<i64> {
        let (ty, value) = self.attr(name)?;
        if ty == sys::XLA_FFI_AttrType_SCALAR {
            // SAFETY: a SCALAR attribute points at an `XLA_FFI_Scalar` whose
            // `value` holds one element of its dtype; reads are unaligned-safe.
            unsafe {
                let scalar = value as *const sys::XLA_FFI_Scalar;
                let (dtype, v) = ((*scalar).dtype, (*scalar).value);
                if !v.is_null() {
                    match dtype {
                        sys::XLA_FFI_DataType_S64 => return Ok((v as *const i64).read_unaligned()),
                        sys::XLA_FFI_DataType_S32 => return Ok((v as *const i32).read_unaligned().into()),
                        _ => {}
                    }
                }
            }
        }
        Err(wrong_attr(name, self.attr_desc(ty, value), "an integer scalar"))
    }

    /// An array-of-int64 attribute (a numpy `int64` array).
    pub fn attr_i64_array(&self, name: &str) -> Result<&'a [i64]> {
        let (ty, value) = self.attr(name)?;
        if ty == sys::XLA_FFI_AttrType_ARRAY {
            // SAFETY: an ARRAY attribute points at an `XLA_FFI_Array` of `size`
            // elements of its dtype, alive for the call; `list` checks the pointer.
            unsafe {
                let array = value as *const sys::XLA_FFI_Array;
                if (*array).dtype == sys::XLA_FFI_DataType_S64 {
                    let what = format!("attribute `{name}`");
                    return list((*array).data as *const i64, (*array).size, &what);
                }
            }
        }
        Err(wrong_attr(name, self.attr_desc(ty, value), "an array of int64"))
    }

    /// A string attribute (UTF-8; XLA passes pointer and length, no NUL).
    pub fn attr_str(&self, name: &str) -> Result<&'a str> {
        let (ty, value) = self.attr(name)?;
        if ty != sys::XLA_FFI_AttrType_STRING {
            return Err(wrong_attr(name, self.attr_desc(ty, value), "a string"));
        }
        // SAFETY: a STRING attribute points at an `XLA_FFI_ByteSpan` alive for the call.
        let bytes = unsafe {
            let span = value as *const sys::XLA_FFI_ByteSpan;
            list((*span).ptr as *const u8, (*span).len, &format!("attribute `{name}`"))?
        };
        std::str::from_utf8(bytes).map_err(|_| Error::InvalidArgument(format!("attribute `{name}` is not valid UTF-8")))
    }

    /// The global id of the device this call runs for (`XLA_FFI_DeviceOrdinal_Get`).
    pub fn device_ordinal(&self) -> Result<i32> {
        // SAFETY: `api` is XLA's table (checked by `api_fn!`); the arguments
        // struct is fully initialised and outlives the call.
        unsafe {
            let get = api_fn!(self.api, XLA_FFI_DeviceOrdinal_Get)
                .ok_or_else(|| Error::Unimplemented("this XLA has no XLA_FFI_DeviceOrdinal_Get".into()))?;
            let mut args = sys::XLA_FFI_DeviceOrdinal_Get_Args {
                struct_size: sys::XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE as usize,
                ctx: self.ctx,
                ..Default::default()
            };
            self.check(get(&mut args), "XLA_FFI_DeviceOrdinal_Get")?;
            Ok(args.device_ordinal)
        }
    }

    /// The id of this logical execution, the same on every device (`XLA_FFI_RunId_Get`).
    pub fn run_id(&self) -> Result<i64> {
        // SAFETY: as in `device_ordinal`.
        unsafe {
            let get = api_fn!(self.api, XLA_FFI_RunId_Get)
                .ok_or_else(|| Error::Unimplemented("this XLA has no XLA_FFI_RunId_Get".into()))?;
            let mut args = sys::XLA_FFI_RunId_Get_Args {
                struct_size: sys::XLA_FFI_RunId_Get_Args_STRUCT_SIZE as usize,
                ctx: self.ctx,
                ..Default::default()
            };
            self.check(get(&mut args), "XLA_FFI_RunId_Get")?;
            Ok(args.run_id)
        }
    }

    /// XLA's stream for this call (`XLA_FFI_Stream_Get`): a `CUstream` on
    /// CUDA, owned by XLA and valid for the call only. An error on CPU, where
    /// XLA does not support it, and when XLA hands back no stream (the legacy
    /// default stream is never used).
    pub fn stream(&self) -> Result<*mut c_void> {
        // SAFETY: as in `device_ordinal`.
        let stream = unsafe {
            let get = api_fn!(self.api, XLA_FFI_Stream_Get)
                .ok_or_else(|| Error::Unimplemented("this XLA has no XLA_FFI_Stream_Get".into()))?;
            let mut args = sys::XLA_FFI_Stream_Get_Args {
                struct_size: sys::XLA_FFI_Stream_Get_Args_STRUCT_SIZE as usize,
                ctx: self.ctx,
                ..Default::default()
            };
            self.check(get(&mut args), "XLA_FFI_Stream_Get")?;
            args.stream
        };
        if stream.is_null() {
            return Err(internal("XLA_FFI_Stream_Get returned no stream".into()));
        }
        Ok(stream)
    }

    /// Operand `i` in device memory: type, shape, address and byte length,
    /// checked as `arg` checks them, without forming a host slice.
    pub fn device_arg(&self, i: usize, name: &str) -> Result<DeviceBuffer<'a>> {
        let raw = self.raw_buffer(Side::Operand, i, name)?;
        let dtype = typed(&raw, Side::Operand, name)?;
        let (ptr, bytes) = self.bytes(&raw, dtype.size(), Side::Operand, name)?;
        Ok(DeviceBuffer { dtype, dims: raw.dims, addr: ptr as u64, bytes })
    }

    /// Result `i` in device memory (see `device_arg`). Each result is handed
    /// out once, by this or any other result accessor, and must share no
    /// memory with an operand or another result.
    pub fn device_ret(&mut self, i: usize, name: &str) -> Result<DeviceBuffer<'a>> {
        let raw = self.raw_buffer(Side::Result, i, name)?;
        let dtype = typed(&raw, Side::Result, name)?;
        let (ptr, bytes) = self.bytes(&raw, dtype.size(), Side::Result, name)?;
        self.claim(i, name, ptr, bytes)?;
        Ok(DeviceBuffer { dtype, dims: raw.dims, addr: ptr as u64, bytes })
    }

    /// Operand `i` in device memory as raw bytes of any whole-byte type.
    pub fn device_arg_bytes(&self, i: usize, name: &str) -> Result<DeviceBytes<'a>> {
        let raw = self.raw_buffer(Side::Operand, i, name)?;
        let size = whole_bytes(&raw, Side::Operand, name)?;
        let (ptr, bytes) = self.bytes(&raw, size, Side::Operand, name)?;
        Ok(DeviceBytes { dims: raw.dims, addr: ptr as u64, bytes })
    }

    /// Result `i` in device memory as raw bytes of any whole-byte type
    /// (typically a `uint8` workspace); handed out once, as `device_ret`.
    pub fn device_ret_bytes(&mut self, i: usize, name: &str) -> Result<DeviceBytes<'a>> {
        let raw = self.raw_buffer(Side::Result, i, name)?;
        let size = whole_bytes(&raw, Side::Result, name)?;
        let (ptr, bytes) = self.bytes(&raw, size, Side::Result, name)?;
        self.claim(i, name, ptr, bytes)?;
        Ok(DeviceBytes { dims: raw.dims, addr: ptr as u64, bytes })
    }

    /// The device memory of every operand and result of this call, as
    /// `(address, bytes, writable)` (results are writable, operands not):
    /// all that a GPU handler's work may touch
    /// (`backend::cuda::driver::CallMemory`). Hands out no result.
    pub fn device_memory(&self) -> Result<Vec<(u64, usize, bool)>> {
        let sides = (0..self.args.len).map(|i| (Side::Operand, i)).chain((0..self.rets.len).map(|i| (Side::Result, i)));
        let mut regions = Vec::with_capacity(self.args.len + self.rets.len);
        for (side, i) in sides {
            let raw = self.raw_buffer(side, i, "")?;
            let size = whole_bytes(&raw, side, "")?;
            let (ptr, bytes) = self.bytes(&raw, size, side, "")?;
            regions.push((ptr as u64, bytes, side == Side::Result));
        }
        Ok(regions)
    }

    // ---- internals -------------------------------------------------------

    /// Entry `i` of the operand or result list, decoded but not typed.
    fn raw_buffer(&self, side: Side, i: usize, name: &str) -> Result<RawBuffer<'a>> {
        let slots = match side {
            Side::Operand => self.args,
            Side::Result => self.rets,
        };
        let word = side.word();
        if i >= slots.len {
            return Err(Error::InvalidArgument(format!(
                "{word} `{name}` (index {i}) is missing: the call has {} {word}s",
                slots.len
            )));
        }
        // SAFETY: `i < len`, and `from_raw` checked both arrays for `len` entries.
        let (ty, ptr) = unsafe { (*slots.types.add(i), *slots.ptrs.add(i)) };
        // ArgType_BUFFER and RetType_BUFFER are both 1: the only kind XLA passes today.
        if ty != sys::XLA_FFI_ArgType_BUFFER || ptr.is_null() {
            return Err(internal(format!("{word} `{name}` is not a buffer (kind {ty})")));
        }
        // SAFETY: a BUFFER entry points at an `XLA_FFI_Buffer` alive for the call.
        unsafe { read_buffer(ptr as *const sys::XLA_FFI_Buffer, side, name) }
    }

    /// Pointer and byte length of a buffer whose elements are `elem_size` bytes.
    fn bytes(&self, raw: &RawBuffer<'_>, elem_size: usize, side: Side, name: &str) -> Result<(*mut u8, usize)> {
        let word = side.word();
        let len = raw
            .byte_len(elem_size)
            .ok_or_else(|| Error::InvalidArgument(format!("{word} `{name}` is too large: {:?}", raw.dims)))?;
        if len > 0 && raw.data.is_null() {
            return Err(internal(format!("{word} `{name}` has no data")));
        }
        Ok((raw.data, len))
    }

    /// Marks result `i` as handed out, after checking it was not already and
    /// that its bytes overlap no operand or other result (XLA gives every
    /// result its own memory unless input/output aliasing was asked for,
    /// which these handlers do not support: it would alias `&` and `&mut`).
    fn claim(&mut self, i: usize, name: &str, ptr: *mut u8, len: usize) -> Result<()> {
        if self.taken[i] {
            return Err(internal(format!("result `{name}` (index {i}) was taken twice")));
        }
        let mine = ptr as usize..(ptr as usize).saturating_add(len);
        let others = (0..self.args.len)
            .map(|j| (Side::Operand, j))
            .chain((0..self.rets.len).filter(|&k| k != i).map(|k| (Side::Result, k)));
        for (side, j) in others {
            let Ok(other) = self.raw_buffer(side, j, "") else {
                continue;
            };
            let Some(olen) = xla_type_size(other.dtype).and_then(|s| other.byte_len(s)) else {
                continue;
            };
            let theirs = other.data as usize..(other.data as usize).saturating_add(olen);
            if len > 0 && olen > 0 && mine.start < theirs.end && theirs.start < mine.end {
                return Err(internal(format!(
                    "result `{name}` shares memory with {} {j}: input/output aliasing is not supported",
                    side.word()
                )));
            }
        }
        self.taken[i] = true;
        Ok(())
    }

    /// Type and value pointer of the attribute `name`, if present.
    fn find_attr(&self, name: &str) -> Result<Option<(sys::XLA_FFI_AttrType, *mut c_void)>> {
        let a = self.attrs;
        for i in 0..a.len {
            // SAFETY: `i < len`, and `from_raw` checked the three arrays for
            // `len` entries; each name is a `ByteSpan` alive for the call.
            unsafe {
                let span = *a.names.add(i);
                if span.is_null() {
                    return Err(internal(format!("attribute {i} has no name")));
                }
                let key = list((*span).ptr as *const u8, (*span).len, "attribute name")?;
                if key == name.as_bytes() {
                    let value = *a.values.add(i);
                    if value.is_null() {
                        return Err(internal(format!("attribute `{name}` has no value")));
                    }
                    return Ok(Some((*a.types.add(i), value)));
                }
            }
        }
        Ok(None)
    }

    fn attr(&self, name: &str) -> Result<(sys::XLA_FFI_AttrType, *mut c_void)> {
        self.find_attr(name)?.ok_or_else(|| Error::InvalidArgument(format!("missing attribute `{name}`")))
    }

    /// What an attribute is, for "expected ..." messages.
    fn attr_desc(&self, ty: sys::XLA_FFI_AttrType, value: *mut c_void) -> String {
        match ty {
            sys::XLA_FFI_AttrType_SCALAR => {
                // SAFETY: as in `attr_i64`.
                let dtype = unsafe { (*(value as *const sys::XLA_FFI_Scalar)).dtype };
                format!("a {} scalar", type_desc(dtype))
            }
            sys::XLA_FFI_AttrType_ARRAY => {
                // SAFETY: as in `attr_i64_array`.
                let dtype = unsafe { (*(value as *const sys::XLA_FFI_Array)).dtype };
                format!("an array of {}", type_desc(dtype))
            }
            sys::XLA_FFI_AttrType_STRING => "a string".into(),
            sys::XLA_FFI_AttrType_DICTIONARY => "a dictionary".into(),
            other => format!("of unknown attribute kind {other}"),
        }
    }

    /// Turns an error returned by an XLA API call into an `Internal` error,
    /// taking its message and destroying it (we own errors the API returns).
    ///
    /// # Safety
    /// `err` must be null or an error just returned by this frame's API.
    pub(super) unsafe fn check(&self, err: *mut sys::XLA_FFI_Error, call: &str) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        let mut message = String::from("(no message)");
        // SAFETY: the table is XLA's; the message is a C string owned by `err`
        // and copied before `err` is destroyed.
        unsafe {
            if let Some(get) = api_fn!(self.api, XLA_FFI_Error_GetMessage) {
                let mut args = sys::XLA_FFI_Error_GetMessage_Args {
                    struct_size: sys::XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE as usize,
                    error: err,
                    ..Default::default()
                };
                get(&mut args);
                if !args.message.is_null() {
                    message = std::ffi::CStr::from_ptr(args.message).to_string_lossy().into_owned();
                }
            }
            if let Some(destroy) = api_fn!(self.api, XLA_FFI_Error_Destroy) {
                let mut args = sys::XLA_FFI_Error_Destroy_Args {
                    struct_size: sys::XLA_FFI_Error_Destroy_Args_STRUCT_SIZE as usize,
                    error: err,
                    ..Default::default()
                };
                destroy(&mut args);
            }
        }
        Err(internal(format!("{call} failed: {message}")))
    }
}

/// The element type of a buffer, or the error naming the buffer.
fn typed(raw: &RawBuffer<'_>, side: Side, name: &str) -> Result<DType> {
    crate::abi::dtype(raw.dtype).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{} `{name}` has dtype {}; expected float32, float64, bfloat16 or float16",
            side.word(),
            type_desc(raw.dtype)
        ))
    })
}

/// Bytes per element for raw access, or the error naming the buffer.
fn whole_bytes(raw: &RawBuffer<'_>, side: Side, name: &str) -> Result<usize> {
    xla_type_size(raw.dtype).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{} `{name}` has dtype {}, whose elements are not whole bytes",
            side.word(),
            type_desc(raw.dtype)
        ))
    })
}

fn wrong_attr(name: &str, found: String, expected: &str) -> Error {
    Error::InvalidArgument(format!("attribute `{name}` is {found}; expected {expected}"))
}

/// Decodes an `XLA_FFI_Buffer`: checks its size, rank and dimensions.
///
/// # Safety
/// `b` must point at a buffer description alive for `'a`.
unsafe fn read_buffer<'a>(b: *const sys::XLA_FFI_Buffer, side: Side, name: &str) -> Result<RawBuffer<'a>> {
    let word = side.word();
    // SAFETY: the caller vouches for `b`; fields are read only once
    // `struct_size` says they are there.
    unsafe {
        let size = (*b).struct_size;
        if size < sys::XLA_FFI_Buffer_STRUCT_SIZE as usize {
            return Err(internal(format!("{word} `{name}` has struct_size {size}")));
        }
        let rank = (*b).rank;
        let rank = usize::try_from(rank).map_err(|_| internal(format!("{word} `{name}` has rank {rank}")))?;
        let dims: &'a [i64] = list((*b).dims, rank, &format!("dims of {word} `{name}`"))?;
        let mut elems: usize = 1;
        for &d in dims {
            elems = usize::try_from(d)
                .ok()
                .and_then(|d| elems.checked_mul(d))
                .ok_or_else(|| Error::InvalidArgument(format!("{word} `{name}` has bad shape {dims:?}")))?;
        }
        Ok(RawBuffer { dtype: (*b).dtype, dims, elems, data: (*b).data as *mut u8 })
    }
}

/// # Safety
/// `ptr` must be valid for reads of `len` bytes for `'a` (or `len == 0`).
unsafe fn slice_of<'a>((ptr, len): (*mut u8, usize)) -> &'a [u8] {
    if len == 0 {
        &[]
    } else {
        // SAFETY: per the contract; `bytes` checked `ptr` is non-null.
        unsafe { slice::from_raw_parts(ptr, len) }
    }
}

/// # Safety
/// `ptr` must be valid for writes of `len` bytes for `'a`, unaliased (or `len == 0`).
unsafe fn slice_of_mut<'a>((ptr, len): (*mut u8, usize)) -> &'a mut [u8] {
    if len == 0 {
        Default::default()
    } else {
        // SAFETY: per the contract; `bytes` checked `ptr` is non-null.
        unsafe { slice::from_raw_parts_mut(ptr, len) }
    }
}
