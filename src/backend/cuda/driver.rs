//! The safe layer over the CUDA driver (`api`'s driver table): owning
//! handles of what the backend creates (a retained primary context,
//! streams, events, the kernels' module, device memory), each released on
//! drop, and every driver call the backend makes on them, on XLA's stream of
//! a call ([`CallStream`]) and on the call's memory ([`CallMemory`]).
//!
//! The calls that touch device memory take the [`CallMemory`] they may
//! touch (XLA's buffers of the call, operands read only, or memory the
//! backend owns) and refuse, with INTERNAL, any range outside it: a planning
//! mistake fails the call instead of writing over memory that is not the
//! call's.
//!
//! What the range checks cannot see is *when* the device runs the work. The
//! calls that enqueue work on a call's memory are therefore visible to the
//! CUDA backend only (`pub(super)`), whose modules keep one rule: work on a
//! call's memory is enqueued on XLA's stream of the call, or on a lane forked
//! from it and joined back into it before the handler returns
//! (`stream_issue`), so XLA's buffers outlive it. The one exception is a
//! reshard's sends and offers (`reshard`): they read only the send program's
//! `staging`, which Python keeps until the receivers' result is ready.
//!
//! Release needs the object's context current for a module (`cuModuleUnload`
//! unloads from the current context); the owner of several handles
//! (`device::Device`) makes its context current before its fields drop, and
//! drops the context last.

use super::addresses::{grid, SumLaunch, BLOCK, MAX_TERMS};
use super::api::{self, check_cu};
use crate::error::{Error, Result};
use crate::reshard::device::Copy2d;
use crate::xla::Frame;
use cudarc::driver::sys as cu;
use std::ffi::{c_uint, c_void, CString};
use std::marker::PhantomData;
use std::ptr;

/// `CU_STREAM_NON_BLOCKING`: no implicit synchronisation with the legacy default stream.
const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING`: the cheapest events (ordering only).
const EVENT_DISABLE_TIMING: c_uint = 2;
/// `CU_EVENT_DEFAULT`: an event that keeps the time it was reached.
const EVENT_TIMED: c_uint = 0;

/// A device's primary context, retained while this value lives.
pub struct Context {
    raw: cu::CUcontext,
    device: cu::CUdevice,
}

// SAFETY: a retained context may be made current on any thread.
unsafe impl Send for Context {}
// SAFETY: shared references only make it current.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of CUDA device `ordinal`.
    pub fn primary(ordinal: i32) -> Result<Context> {
        let device = api::device_get(ordinal)?;
        let mut raw: cu::CUcontext = ptr::null_mut();
        // SAFETY: a valid out-pointer; the driver checks the device.
        check_cu(unsafe { (api::driver()?.primary_ctx_retain)(&mut raw, device) }, "cuDevicePrimaryCtxRetain")?;
        Ok(Context { raw, device })
    }

    /// Whether `stream` belongs to this context.
    pub fn owns(&self, stream: &CallStream<'_>) -> bool {
        stream.context == self.raw
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

mod sealed {
    pub trait Sealed {}
}

/// A stream work is enqueued on: one the backend made ([`Stream`]) or XLA's
/// stream of the call ([`CallStream`]). Sealed: only those two are streams.
pub trait Queue: sealed::Sealed {
    fn raw(&self) -> cu::CUstream;
}

/// A non-blocking stream of the context current when it was made.
pub struct Stream(cu::CUstream);

// SAFETY: a stream handle may be used from any thread with its context current.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises work enqueued on one stream.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new() -> Result<Stream> {
        let mut s: cu::CUstream = ptr::null_mut();
        // SAFETY: a valid out-pointer; needs a current context, else the driver says so.
        check_cu(unsafe { (api::driver()?.stream_create)(&mut s, STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
        Ok(Stream(s))
    }

    /// Whether `other` is this stream.
    pub fn is(&self, other: &impl Queue) -> bool {
        self.0 == other.raw()
    }
}

impl sealed::Sealed for Stream {}
impl Queue for Stream {
    fn raw(&self) -> cu::CUstream {
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

/// XLA's stream of the call being handled, live while the call's frame is,
/// with its context made current on this thread ([`CallStream::of`]).
#[derive(Clone, Copy)]
pub struct CallStream<'a> {
    raw: cu::CUstream,
    context: cu::CUcontext,
    /// The CUDA ordinal of its device.
    pub ordinal: i32,
    _call: PhantomData<&'a ()>,
}

impl<'a> CallStream<'a> {
    /// XLA's stream of `frame`'s call (never null: `Frame::stream` refuses
    /// that), its context made current on this thread.
    pub fn of(frame: &Frame<'a>) -> Result<CallStream<'a>> {
        let raw = frame.stream()? as cu::CUstream;
        // SAFETY: XLA's stream is live for the call.
        let (context, device) = unsafe { api::bind_stream(raw) }?;
        Ok(CallStream { raw, context, ordinal: device, _call: PhantomData })
    }

    /// A stream the caller owns, playing XLA's: the device tests' and the
    /// one-rank mode's (`solo_device`), which run calls without XLA.
    pub fn playing_xla(stream: &'a Stream) -> Result<CallStream<'a>> {
        // SAFETY: `stream` is live while borrowed.
        let (context, device) = unsafe { api::bind_stream(stream.0) }?;
        Ok(CallStream { raw: stream.0, context, ordinal: device, _call: PhantomData })
    }
}

impl sealed::Sealed for CallStream<'_> {}
impl Queue for CallStream<'_> {
    fn raw(&self) -> cu::CUstream {
        self.raw
    }
}

/// An event without timing, of the context current when it was made.
pub struct Event(cu::CUevent);

// SAFETY: an event handle may be used from any thread with its context current.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// `what` names the event in the error if the driver refuses it.
    pub fn new(what: &str) -> Result<Event> {
        Event::with_flags(EVENT_DISABLE_TIMING, what)
    }

    fn with_flags(flags: c_uint, what: &str) -> Result<Event> {
        let mut e: cu::CUevent = ptr::null_mut();
        // SAFETY: a valid out-pointer; needs a current context, else the driver says so.
        check_cu(unsafe { (api::driver()?.event_create)(&mut e, flags) }, what)?;
        Ok(Event(e))
    }

    /// Records the event on `stream` (of the event's context).
    pub fn record(&self, stream: &impl Queue, what: &str) -> Result<()> {
        // SAFETY: both handles are live while borrowed.
        unsafe { api::event_record(self.0, stream.raw(), what) }
    }

    /// Makes `stream` wait until the event's last record has run.
    pub fn wait_on(&self, stream: &impl Queue) -> Result<()> {
        // SAFETY: both handles are live while borrowed.
        unsafe { api::stream_wait_event(stream.raw(), self.0) }
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

/// An event that times where its stream reached it (the one-rank mode's
/// device timeline): costlier to record than an [`Event`], so no call of
/// XLA's records one.
pub struct TimingEvent(Event);

impl TimingEvent {
    pub fn new(what: &str) -> Result<TimingEvent> {
        Event::with_flags(EVENT_TIMED, what).map(TimingEvent)
    }

    pub fn record(&self, stream: &impl Queue, what: &str) -> Result<()> {
        self.0.record(stream, what)
    }

    /// Milliseconds from `earlier`'s last record to this one's (both done;
    /// the driver's resolution is about half a microsecond).
    pub fn ms_since(&self, earlier: &TimingEvent) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: a valid out-pointer and two live events; an event not yet
        // recorded or done is an error code, not undefined behaviour.
        check_cu(
            unsafe { (api::driver()?.event_elapsed_time)(&mut ms, earlier.0 .0, (self.0).0) },
            "cuEventElapsedTime",
        )?;
        Ok(ms)
    }
}

/// An event kept for the life of the process with its device's primary
/// context retained as long (the watchdog's pool, whose events outlive every
/// call and are queried from the watchdog's thread). Copied freely.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeptEvent {
    context: cu::CUcontext,
    event: cu::CUevent,
}

// SAFETY: both handles live for the process and may be used from any thread
// with the context current (`done` makes it so).
unsafe impl Send for KeptEvent {}

impl KeptEvent {
    /// A new event of device `ordinal` (its context made current).
    pub fn new(ordinal: i32, what: &str) -> Result<KeptEvent> {
        let context = Context::primary(ordinal)?;
        context.make_current()?;
        let event = Event::new(what)?;
        // Both kept for the process from here on (released on failure above).
        let kept = KeptEvent { context: context.raw, event: event.0 };
        std::mem::forget(event);
        std::mem::forget(context);
        Ok(kept)
    }

    pub fn record(&self, stream: &impl Queue, what: &str) -> Result<()> {
        // SAFETY: both handles are live (the event for the process).
        unsafe { api::event_record(self.event, stream.raw(), what) }
    }

    /// Makes `stream` wait until the event's last record (so far) has run;
    /// the stream may be of another device.
    pub fn wait_on(&self, stream: &impl Queue) -> Result<()> {
        // SAFETY: both handles are live (the event for the process).
        unsafe { api::stream_wait_event(stream.raw(), self.event) }
    }

    /// Whether the work before the event's last record is done (a device
    /// error counts as done: XLA reports it from its own stream).
    pub fn done(&self) -> bool {
        // SAFETY: the context and the event are kept for the process.
        unsafe { api::set_current(self.context).is_err() || api::event_done(self.event) }
    }
}

/// A loaded module (CUBIN or PTX), unloaded on drop from the current context.
pub struct Module(cu::CUmodule);

// SAFETY: a module handle may be used from any thread with its context current.
unsafe impl Send for Module {}

impl Module {
    /// Loads `image` (a CUBIN, or NUL-terminated PTX, as `kernels` compiles
    /// them with NVRTC) into the current context.
    pub(super) fn load(image: &[u8]) -> Result<Module> {
        if image.is_empty() {
            return Err(Error::Internal("an empty module image".into()));
        }
        let mut module: cu::CUmodule = ptr::null_mut();
        // SAFETY: `image` is a whole CUBIN or NUL-terminated PTX alive for the call.
        check_cu(unsafe { (api::driver()?.module_load_data)(&mut module, image.as_ptr().cast()) }, "cuModuleLoadData")?;
        Ok(Module(module))
    }

    fn function(&self, name: &str) -> Result<cu::CUfunction> {
        let cname = CString::new(name).map_err(|_| Error::Internal(format!("kernel name {name:?}")))?;
        let mut f: cu::CUfunction = ptr::null_mut();
        // SAFETY: the module is loaded while `self` lives; `cname` is NUL-terminated.
        check_cu(
            unsafe { (api::driver()?.module_get_function)(&mut f, self.0, cname.as_ptr()) },
            "cuModuleGetFunction",
        )
        .map_err(|e| Error::Internal(format!("{} ({name})", e.message())))?;
        Ok(f)
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

/// The sum kernels of `kernels/elementwise.cu`, loaded from one module.
pub struct SumKernels {
    functions: [cu::CUfunction; 3],
    /// Keeps `functions` valid.
    _module: Module,
}

// SAFETY: kernel handles may be launched from any thread with their context current.
unsafe impl Send for SumKernels {}

impl SumKernels {
    /// The kernels `SumLaunch::kernel` names, in this order.
    pub const NAMES: [&'static str; 3] = ["sum_f32", "sum_to_bf16", "sum_to_f16"];

    /// Loads `image` (compiled from `kernels/elementwise.cu` by `kernels`,
    /// whose kernels take the parameters `launch` passes: checked against the
    /// PTX by `tests/cuda_install.rs`) into the current context.
    pub(super) fn load(image: &[u8]) -> Result<SumKernels> {
        let module = Module::load(image)?;
        let functions =
            [module.function(Self::NAMES[0])?, module.function(Self::NAMES[1])?, module.function(Self::NAMES[2])?];
        Ok(SumKernels { functions, _module: module })
    }

    /// Enqueues `launch` on `stream` with `multiprocessors` to spread over,
    /// after checking that its terms (f32) and its destination lie in `memory`.
    pub(super) fn launch(
        &self,
        stream: &impl Queue,
        launch: &SumLaunch,
        memory: &CallMemory<'_>,
        multiprocessors: u32,
    ) -> Result<()> {
        if launch.n == 0 {
            return Ok(());
        }
        let index = Self::NAMES.iter().position(|&k| k == launch.kernel);
        let index = index.ok_or_else(|| Error::Internal(format!("no kernel {}", launch.kernel)))?;
        let out_size = if index == 0 { 4 } else { 2 };
        let n = usize::try_from(launch.n).map_err(|_| Error::Internal(format!("a sum of {} elements", launch.n)))?;
        let k = usize::try_from(launch.k).ok().filter(|&k| (1..=MAX_TERMS).contains(&k));
        let k = k.ok_or_else(|| Error::Internal(format!("a sum of {} terms", launch.k)))?;
        let mut terms = launch.kernel_terms();
        for (t, term) in terms.iter().enumerate().take(k) {
            memory.check_read(*term, n * 4, &format!("term {t} of {}", launch.kernel))?;
        }
        terms[k..].fill(0);
        memory.check_write(launch.dst, n * out_size, launch.kernel)?;
        let (mut out, mut k, mut n) = (launch.dst, launch.k, launch.n);
        // The kernel's parameters: (T* dst, Terms terms, int k, u64 n),
        // `Terms` being eight pointers by value, laid out as `[u64; 8]`.
        let mut params: [*mut c_void; 4] = [
            (&mut out as *mut u64).cast(),
            (&mut terms as *mut [u64; MAX_TERMS]).cast(),
            (&mut k as *mut i32).cast(),
            (&mut n as *mut u64).cast(),
        ];
        let grid = grid(launch.n, multiprocessors);
        let launch_kernel = api::driver()?.launch_kernel;
        // SAFETY: the function is a kernel of this (loaded) module with
        // exactly these parameters, whose values live across the call (the
        // driver copies them); every address it touches was checked above.
        let launched = unsafe {
            launch_kernel(
                self.functions[index],
                grid,
                1,
                1,
                BLOCK,
                1,
                1,
                0,
                stream.raw(),
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        };
        check_cu(launched, "cuLaunchKernel")
    }
}

/// The one-rank mode's timer kernel (`kernels/pace.cu`), loaded in one
/// context: `commfuse_stamp`, one thread.
pub struct PaceKernels {
    stamp: cu::CUfunction,
    /// Keeps the function valid.
    _module: Module,
}

// SAFETY: kernel handles may be launched from any thread with their context current.
unsafe impl Send for PaceKernels {}

impl PaceKernels {
    /// Loads `image` (compiled from `kernels/pace.cu`, whose kernel takes the
    /// parameter the launch below passes: checked against the PTX by
    /// `tests/cuda_install.rs`) into the current context.
    pub(super) fn load(image: &[u8]) -> Result<PaceKernels> {
        let module = Module::load(image)?;
        Ok(PaceKernels { stamp: module.function("commfuse_stamp")?, _module: module })
    }

    /// Enqueues writing the GPU's global timer (ns) to the u64 at `at`.
    pub(super) fn stamp(&self, stream: &impl Queue, at: u64, memory: &CallMemory<'_>) -> Result<()> {
        memory.check_write(at, 8, "a timer stamp")?;
        let mut at = at;
        let mut params: [*mut c_void; 1] = [(&mut at as *mut u64).cast()];
        // SAFETY: the kernel takes one pointer, to 8 writable bytes of the
        // call's memory (checked); the parameter lives across the call.
        unsafe { launch_one_thread(self.stamp, stream, &mut params) }
    }
}

/// Work for the driver's host-callback thread: it runs when the stream
/// reaches it, and the stream's later work waits until it returns.
pub type HostWork = Box<dyn FnOnce() + Send>;

/// Enqueues `work` on `stream` (`cuLaunchHostFunc`): run on the driver's
/// thread once the stream's earlier work is done, holding the stream's later
/// work until it returns, without an SM. `work` must not call CUDA (the
/// driver forbids it there) and must return in bounded time: that thread
/// serves every host function of the process (XLA's too) in turn. The
/// driver skips host functions of a context in an error state (the box then
/// leaks; such a context is lost anyway).
pub(super) fn launch_host(stream: &impl Queue, work: HostWork) -> Result<()> {
    let data = Box::into_raw(Box::new(work));
    // SAFETY: `run_host_work` takes back the box it is given exactly once;
    // the stream is live while borrowed.
    let launched = unsafe { (api::driver()?.launch_host_func)(stream.raw(), Some(run_host_work), data.cast()) };
    if let Err(e) = check_cu(launched, "cuLaunchHostFunc") {
        // Not enqueued: the callback will never run, so the box is ours again.
        // SAFETY: made by `Box::into_raw` above and not handed to the driver.
        drop(unsafe { Box::from_raw(data) });
        return Err(e);
    }
    Ok(())
}

/// The driver's callback for [`launch_host`]: runs the boxed work once,
/// catching any panic (nothing unwinds into the driver).
unsafe extern "C" fn run_host_work(data: *mut c_void) {
    if data.is_null() {
        return;
    }
    // SAFETY: `launch_host` passed a `Box<HostWork>` it gave up; the driver
    // calls this once per launch.
    let work = unsafe { Box::from_raw(data.cast::<HostWork>()) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
}

/// Launches `function` as one block of one thread on `stream`.
///
/// # Safety
/// `function` must be a loaded kernel whose parameters are exactly those
/// `params` points to, and every address among them valid for the kernel.
unsafe fn launch_one_thread(function: cu::CUfunction, stream: &impl Queue, params: &mut [*mut c_void]) -> Result<()> {
    let launch_kernel = api::driver()?.launch_kernel;
    // SAFETY: the caller's contract; the driver copies the parameters.
    let launched =
        unsafe { launch_kernel(function, 1, 1, 1, 1, 1, 1, 0, stream.raw(), params.as_mut_ptr(), ptr::null_mut()) };
    check_cu(launched, "cuLaunchKernel")
}

/// Enqueues a copy of `bytes` bytes from `src` to `dst`, both within
/// `memory` (this call's own), on `stream`: a copy engine's work.
pub(super) fn copy(stream: &impl Queue, dst: u64, src: u64, bytes: usize, memory: &CallMemory<'_>) -> Result<()> {
    memory.check_read(src, bytes, "a copy's source")?;
    memory.check_write(dst, bytes, "a copy's destination")?;
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: both ranges lie in the call's memory (checked); the stream is live while borrowed.
    check_cu(unsafe { (api::driver()?.memcpy_dtod_async)(dst, src, bytes, stream.raw()) }, "cuMemcpyDtoDAsync")
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

/// The device memory one call's work may touch: XLA's operands (read only)
/// and results of the call, or memory the backend owns, as `(address,
/// bytes, writable)` regions.
pub struct CallMemory<'a> {
    regions: Vec<(u64, usize, bool)>,
    _owners: PhantomData<&'a ()>,
}

impl<'a> CallMemory<'a> {
    /// Every operand and result of `frame`'s call.
    pub(super) fn of_frame(frame: &Frame<'a>) -> Result<CallMemory<'a>> {
        Ok(CallMemory { regions: frame.device_memory()?, _owners: PhantomData })
    }

    /// Allocations the caller owns, borrowed while the memory is.
    pub(super) fn of_owned(memory: &[&'a DeviceMemory]) -> CallMemory<'a> {
        CallMemory { regions: memory.iter().map(|m| (m.addr, m.bytes, true)).collect(), _owners: PhantomData }
    }

    /// Lends `bytes` bytes at `addr` (within this memory) to another rank's
    /// copies: into it (`writable`, `copy_to_peer`) or out of it
    /// (`copy_from_peer`). The lender keeps the memory until those copies ran
    /// (its stream waits for them, or its owner keeps it: see `copies`).
    pub(super) fn lend(&self, addr: u64, bytes: usize, writable: bool) -> Result<PeerRegion> {
        let what = "a region lent to a peer's copy";
        if writable {
            self.check_write(addr, bytes, what)?;
        } else {
            self.check_read(addr, bytes, what)?;
        }
        Ok(PeerRegion { addr, bytes, writable })
    }

    /// Ok when `bytes` bytes from `addr` lie within one region (an empty
    /// range anywhere); else INTERNAL naming `what`.
    pub fn check_read(&self, addr: u64, bytes: usize, what: &str) -> Result<()> {
        self.check(addr, bytes, false, what)
    }

    /// As [`CallMemory::check_read`], within a writable region (a result
    /// or owned memory, never an operand).
    pub fn check_write(&self, addr: u64, bytes: usize, what: &str) -> Result<()> {
        self.check(addr, bytes, true, what)
    }

    fn check(&self, addr: u64, bytes: usize, write: bool, what: &str) -> Result<()> {
        let end = addr.checked_add(bytes as u64);
        let inside = |&(start, len, writable): &(u64, usize, bool)| {
            (writable || !write) && end.is_some_and(|end| addr >= start && end <= start.saturating_add(len as u64))
        };
        if bytes == 0 || self.regions.iter().any(inside) {
            return Ok(());
        }
        let kind = if write { "writable " } else { "" };
        Err(Error::Internal(format!(
            "{what}: {bytes} bytes at {addr:#x} lie outside the call's {kind}memory {:x?}",
            self.regions
        )))
    }
}

/// Device memory of another rank's call that it lent to this rank's copies
/// ([`CallMemory::lend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRegion {
    addr: u64,
    bytes: usize,
    writable: bool,
}

/// Enqueues a copy of `bytes` bytes from `src` (within `memory`, this
/// rank's) into `dst` (a peer's) on `stream`: a copy engine's work, peer to
/// peer across devices where peer access is enabled (`enable_peer_access`).
pub(super) fn copy_to_peer(
    stream: &impl Queue,
    dst: PeerRegion,
    src: u64,
    bytes: usize,
    memory: &CallMemory<'_>,
) -> Result<()> {
    memory.check_read(src, bytes, "a copy to a peer's source")?;
    if !dst.writable {
        return Err(Error::Internal("a copy into a peer's region lent for reading".into()));
    }
    if bytes > dst.bytes {
        return Err(Error::Internal(format!("a copy of {bytes} bytes into a peer's region of {}", dst.bytes)));
    }
    if bytes == 0 {
        return Ok(());
    }
    let d = api::driver()?;
    // SAFETY: the source lies in this call's memory (checked), the
    // destination in the memory a peer lent (`CallMemory::lend`) and keeps
    // until its stream passed this copy; the stream is live while borrowed.
    check_cu(unsafe { (d.memcpy_dtod_async)(dst.addr, src, bytes, stream.raw()) }, "cuMemcpyDtoDAsync (to a peer)")
}

/// Enqueues a copy of `bytes` bytes from `src` (a peer's, lent) into `dst`
/// (within `memory`, this rank's) on `stream`.
pub(super) fn copy_from_peer(
    stream: &impl Queue,
    dst: u64,
    src: PeerRegion,
    bytes: usize,
    memory: &CallMemory<'_>,
) -> Result<()> {
    memory.check_write(dst, bytes, "a copy from a peer's destination")?;
    if bytes > src.bytes {
        return Err(Error::Internal(format!("a copy of {bytes} bytes out of a peer's region of {}", src.bytes)));
    }
    if bytes == 0 {
        return Ok(());
    }
    let d = api::driver()?;
    // SAFETY: the destination lies in this call's memory (checked), the
    // source in memory a peer lent and keeps until this copy ran; the stream
    // is live while borrowed.
    check_cu(unsafe { (d.memcpy_dtod_async)(dst, src.addr, bytes, stream.raw()) }, "cuMemcpyDtoDAsync (from a peer)")
}

/// Whether device `from` can reach device `to`'s memory directly (the same
/// device always can).
pub fn can_access_peer(from: i32, to: i32) -> Result<bool> {
    if from == to {
        return Ok(true);
    }
    let (a, b) = (api::device_get(from)?, api::device_get(to)?);
    let mut can = 0;
    // SAFETY: a valid out-pointer; the driver checks the devices.
    check_cu(unsafe { (api::driver()?.device_can_access_peer)(&mut can, a, b) }, "cuDeviceCanAccessPeer")?;
    Ok(can != 0)
}

/// Lets `context` (current) reach device `to`'s memory directly; done once
/// per pair (already enabled is fine).
pub fn enable_peer_access(context: &Context, to: &Context) -> Result<()> {
    if context.raw == to.raw {
        return Ok(());
    }
    context.make_current()?;
    // SAFETY: both contexts are retained while borrowed; flags must be 0.
    let status = unsafe { (api::driver()?.ctx_enable_peer_access)(to.raw, 0) };
    match status {
        cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        other => check_cu(other, "cuCtxEnablePeerAccess"),
    }
}

/// Enqueues zeroing `bytes` bytes at `addr` (within `memory`) on `stream`.
pub(super) fn zero(stream: &impl Queue, addr: u64, bytes: usize, memory: &CallMemory<'_>) -> Result<()> {
    memory.check_write(addr, bytes, "zeroing")?;
    // SAFETY: the range lies in the call's memory (checked); the stream is live while borrowed.
    unsafe { api::zero_async(addr, bytes, stream.raw()) }
}

/// Enqueues one device-to-device 2-D copy on `stream` (a copy engine's
/// work), after checking that every row of both sides lies in `memory`.
pub(super) fn copy_2d(stream: &impl Queue, copy: &Copy2d, memory: &CallMemory<'_>) -> Result<()> {
    if copy.width == 0 || copy.height == 0 {
        return Ok(());
    }
    let Some((src, dst)) = copy.spans() else {
        return Err(Error::Internal(format!("a copy too large to address: {copy:?}")));
    };
    memory.check_read(copy.src, src, "a copy's source")?;
    memory.check_write(copy.dst, dst, "a copy's destination")?;
    // SAFETY: both sides lie in the call's memory (checked); the stream is live while borrowed.
    unsafe { api::copy_2d_async(copy, stream.raw()) }
}

/// Waits on the host until `stream` has run all its work: the tests and
/// the one-rank mode (`solo_device`); no handler synchronises.
pub fn synchronize(stream: &impl Queue) -> Result<()> {
    // SAFETY: the stream is live while borrowed.
    unsafe { api::stream_synchronize(stream.raw()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_memory_takes_only_ranges_inside_one_region() {
        // An operand (read only) and a result.
        let memory = CallMemory { regions: vec![(0x1000, 0x100, false), (0x1100, 0x10, true)], _owners: PhantomData };
        assert!(memory.check_read(0x1000, 0x100, "x").is_ok());
        assert!(memory.check_read(0x10f0, 0x10, "x").is_ok());
        assert!(memory.check_read(0x1100, 0x10, "x").is_ok());
        assert!(memory.check_write(0x1100, 0x10, "out").is_ok());
        assert!(memory.check_read(0x9999, 0, "empty").is_ok());
        let e = memory.check_write(0x1000, 4, "a GEMM's C").unwrap_err();
        assert!(matches!(&e, Error::Internal(m) if m.contains("writable")), "{e}");
        // Across two regions, past the end, before the start, wrapping around.
        for (addr, bytes) in [(0x10f0, 0x20), (0x1100, 0x11), (0xfff, 2), (u64::MAX - 1, 4)] {
            let e = memory.check_read(addr, bytes, "a GEMM's C").unwrap_err();
            assert!(matches!(&e, Error::Internal(m) if m.contains("a GEMM's C")), "{e}");
        }
    }
}
