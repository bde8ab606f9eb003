//! The safe layer over `api`: owning handles of the CUDA objects the backend
//! creates (a retained primary context, streams, events, the kernels'
//! module, cuBLAS and cuBLASLt handles, device memory), each released on
//! drop. Every unsafe call that creates or releases one of them is here;
//! the rest of the backend holds these types and passes their raw handles
//! to the enqueueing calls.
//!
//! Release needs the object's context current for a module (`cuModuleUnload`
//! unloads from the current context); the owner of several handles
//! (`device::Device`) makes its context current before its fields drop, and
//! drops the context last.

use super::api::{self, check_blas, check_cu, check_lt};
use crate::error::{Error, Result};
use cudarc::cublas::sys as bsys;
use cudarc::cublaslt::sys as ltsys;
use cudarc::driver::sys as cu;
use std::ffi::{c_uint, CString};
use std::ptr;

/// `CU_STREAM_NON_BLOCKING`: no implicit synchronisation with the legacy default stream.
const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING`: the cheapest events (ordering only).
const EVENT_DISABLE_TIMING: c_uint = 2;

/// A device's primary context, retained while this value lives.
pub struct Context {
    raw: cu::CUcontext,
    device: cu::CUdevice,
}

impl Context {
    /// Retains the primary context of CUDA device `ordinal`.
    pub fn primary(ordinal: i32) -> Result<Context> {
        let device = api::device_get(ordinal)?;
        let mut raw: cu::CUcontext = ptr::null_mut();
        // SAFETY: a valid out-pointer; the driver checks the device.
        check_cu(unsafe { (api::driver()?.primary_ctx_retain)(&mut raw, device) }, "cuDevicePrimaryCtxRetain")?;
        Ok(Context { raw, device })
    }

    pub fn raw(&self) -> cu::CUcontext {
        self.raw
    }

    /// Makes this context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: the context is retained while `self` lives.
        unsafe { api::set_current(self.raw) }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Ok(d) = api::driver() {
            // SAFETY: balances the retain in `primary`, once.
            let _ = unsafe { (d.primary_ctx_release)(self.device) };
        }
    }
}

/// A non-blocking stream of the context current when it was made.
pub struct Stream(cu::CUstream);

impl Stream {
    pub fn new() -> Result<Stream> {
        let mut s: cu::CUstream = ptr::null_mut();
        // SAFETY: a valid out-pointer; needs a current context, else the driver says so.
        check_cu(unsafe { (api::driver()?.stream_create)(&mut s, STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
        Ok(Stream(s))
    }

    pub fn raw(&self) -> cu::CUstream {
        self.0
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(d) = api::driver() {
            // SAFETY: created in `new`, destroyed once; work still queued on
            // it completes first (the driver defers the release).
            let _ = unsafe { (d.stream_destroy)(self.0) };
        }
    }
}

/// An event without timing, of the context current when it was made.
pub struct Event(cu::CUevent);

impl Event {
    /// `what` names the event in the error if the driver refuses it.
    pub fn new(what: &str) -> Result<Event> {
        let mut e: cu::CUevent = ptr::null_mut();
        // SAFETY: a valid out-pointer; needs a current context, else the driver says so.
        check_cu(unsafe { (api::driver()?.event_create)(&mut e, EVENT_DISABLE_TIMING) }, what)?;
        Ok(Event(e))
    }

    pub fn raw(&self) -> cu::CUevent {
        self.0
    }

    /// Gives up ownership: the caller keeps the event for the life of the
    /// process (the watchdog's pool, whose events outlive every call).
    pub fn into_raw(self) -> cu::CUevent {
        std::mem::ManuallyDrop::new(self).0
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(d) = api::driver() {
            // SAFETY: created in `new`, destroyed once; a pending record
            // completes first (the driver defers the release).
            let _ = unsafe { (d.event_destroy)(self.0) };
        }
    }
}

/// A loaded module (CUBIN or PTX), unloaded on drop from the current context.
pub struct Module(cu::CUmodule);

/// A kernel of a [`Module`]; valid while its module is loaded.
#[derive(Clone, Copy)]
pub struct Function(pub cu::CUfunction);

impl Module {
    /// Loads `image` (a CUBIN, or NUL-terminated PTX) into the current context.
    pub fn load(image: &[u8]) -> Result<Module> {
        if image.is_empty() {
            return Err(Error::Internal("an empty module image".into()));
        }
        let mut module: cu::CUmodule = ptr::null_mut();
        // SAFETY: `image` is a whole CUBIN or NUL-terminated PTX alive for the call.
        check_cu(unsafe { (api::driver()?.module_load_data)(&mut module, image.as_ptr().cast()) }, "cuModuleLoadData")?;
        Ok(Module(module))
    }

    pub fn function(&self, name: &str) -> Result<Function> {
        let cname = CString::new(name).map_err(|_| Error::Internal(format!("kernel name {name:?}")))?;
        let mut f: cu::CUfunction = ptr::null_mut();
        // SAFETY: the module is loaded while `self` lives; `cname` is NUL-terminated.
        check_cu(
            unsafe { (api::driver()?.module_get_function)(&mut f, self.0, cname.as_ptr()) },
            "cuModuleGetFunction",
        )
        .map_err(|e| Error::Internal(format!("{} ({name})", e.message())))?;
        Ok(Function(f))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if let Ok(d) = api::driver() {
            // SAFETY: loaded in `load`, unloaded once; the owner made the
            // module's context current (see the module comment).
            let _ = unsafe { (d.module_unload)(self.0) };
        }
    }
}

/// A cuBLAS handle bound to one stream.
pub struct BlasHandle {
    raw: bsys::cublasHandle_t,
    stream: cu::CUstream,
}

impl BlasHandle {
    /// A handle in the current context whose GEMMs go to `stream`, a stream
    /// of that context that outlives the handle.
    pub fn new(stream: &Stream) -> Result<BlasHandle> {
        let blas = api::cublas()?;
        let mut raw: bsys::cublasHandle_t = ptr::null_mut();
        // SAFETY: a valid out-pointer, in the current context.
        check_blas(unsafe { (blas.create)(&mut raw) }, "cublasCreate")?;
        let handle = BlasHandle { raw, stream: stream.raw() };
        // SAFETY: the handle was just created; the stream is live.
        check_blas(unsafe { (blas.set_stream)(raw, stream.raw() as bsys::cudaStream_t) }, "cublasSetStream")?;
        Ok(handle)
    }

    pub fn raw(&self) -> bsys::cublasHandle_t {
        self.raw
    }

    /// The stream the handle's GEMMs go to.
    pub fn stream(&self) -> cu::CUstream {
        self.stream
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        if let Ok(blas) = api::cublas() {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { (blas.destroy)(self.raw) };
        }
    }
}

/// A cuBLASLt handle (not bound to a stream: each GEMM names its own).
pub struct LtHandle(ltsys::cublasLtHandle_t);

impl LtHandle {
    pub fn new() -> Result<LtHandle> {
        let mut raw: ltsys::cublasLtHandle_t = ptr::null_mut();
        // SAFETY: a valid out-pointer, in the current context.
        check_lt(unsafe { (api::cublaslt()?.create)(&mut raw) }, "cublasLtCreate")?;
        Ok(LtHandle(raw))
    }

    pub fn raw(&self) -> ltsys::cublasLtHandle_t {
        self.0
    }
}

impl Drop for LtHandle {
    fn drop(&mut self) {
        if let Ok(lt) = api::cublaslt() {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { (lt.destroy)(self.0) };
        }
    }
}

/// Device memory of the current context, freed on drop.
pub struct DeviceMemory {
    addr: u64,
    bytes: usize,
}

impl DeviceMemory {
    /// `bytes` (at least 1) bytes; `what` names the allocation in the error.
    pub fn new(bytes: usize, what: &str) -> Result<DeviceMemory> {
        let mut addr: cu::CUdeviceptr = 0;
        // SAFETY: a valid out-pointer.
        check_cu(unsafe { (api::driver()?.mem_alloc)(&mut addr, bytes.max(1)) }, what)?;
        Ok(DeviceMemory { addr, bytes: bytes.max(1) })
    }

    /// `data`'s bytes in new device memory (a synchronous copy).
    pub fn with(data: &[u8], what: &str) -> Result<DeviceMemory> {
        let memory = DeviceMemory::new(data.len(), what)?;
        if !data.is_empty() {
            // SAFETY: the allocation holds `data.len()` bytes; `data` is a live host slice.
            check_cu(
                unsafe { (api::driver()?.memcpy_htod)(memory.addr, data.as_ptr().cast(), data.len()) },
                "cuMemcpyHtoD",
            )?;
        }
        Ok(memory)
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The first `len` bytes, copied synchronously (after the work that
    /// writes them finished).
    pub fn read(&self, len: usize) -> Result<Vec<u8>> {
        if len > self.bytes {
            return Err(Error::Internal(format!("reading {len} bytes of a {}-byte allocation", self.bytes)));
        }
        let mut host = vec![0u8; len];
        // SAFETY: the allocation holds at least `len` bytes; `host` is a live host slice.
        check_cu(unsafe { (api::driver()?.memcpy_dtoh)(host.as_mut_ptr().cast(), self.addr, len) }, "cuMemcpyDtoH")?;
        Ok(host)
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if let Ok(d) = api::driver() {
            // SAFETY: allocated in `new`, freed once; the owner keeps it
            // until no queued work uses it.
            let _ = unsafe { (d.mem_free)(self.addr) };
        }
    }
}
