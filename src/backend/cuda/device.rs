//! The device cache: per CUDA device (cached for the process, [`bind`]) the
//! context of XLA's stream (the device's primary context, retained), one
//! compute and one communication stream (non-blocking: no implicit sync with
//! the legacy default stream, which is never used), a pool of events (grown
//! only when a call needs more than any before it), one cuBLAS handle per
//! internal stream, a cuBLASLt handle, and the `kernels/` module (compiled
//! with NVRTC once per architecture, loaded once per device). XLA's stream
//! is borrowed for the call, never created, synchronised or destroyed here.
//!
//! Everything is held by the owning handles of `handles`; the cache never
//! drops a device, so they live for the process, and a device whose set-up
//! fails half way releases what it made.
//!
//! The hot path (a call after the first on its device) allocates no device
//! memory and never synchronises the host with the device.

use super::api;
use super::handles::{BlasHandle, Context, DeviceMemory, Event, Function, LtHandle, Module, Stream};
use super::kernels::{self, ImageCache, Target, SOURCES};
use crate::error::{Error, Result};
use cudarc::driver::sys as dsys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The sum kernels of `kernels/elementwise.cu` the backend launches.
pub const SUM_KERNELS: [&str; 3] = ["sum_f32", "sum_to_bf16", "sum_to_f16"];

/// One CUDA device's cached state (see the module comment). Fields drop in
/// order, the context last (`Drop` makes it current first).
pub struct Device {
    pub ordinal: i32,
    pub multiprocessors: u32,
    /// Compute capability (major, minor): fp8 GEMMs need 9.0+.
    pub capability: (i32, i32),
    /// The compute and the communication stream.
    lanes: [Stream; 2],
    /// Per union of two meshes (its device ids), the stream of its reshard
    /// sends, which wait for receivers outside the send program
    /// (`backend::cuda::reshard`): one per union, so that sends to one
    /// destination mesh never queue behind sends to another.
    reshard_sends: HashMap<Vec<i64>, Stream>,
    events: Vec<Event>,
    blas: Vec<BlasHandle>,
    /// The cuBLASLt handle of the fp8 GEMMs (created at the device's first).
    lt: Option<LtHandle>,
    sums: [Function; 3],
    /// Device bytes for connecting communicators (`GroupComms::connect`):
    /// allocated once, like NCCL's own buffers, outside XLA's memory.
    scratch: Option<DeviceMemory>,
    /// Keeps `sums` valid.
    _module: Module,
    context: Context,
}

// SAFETY: the handles are plain driver/cuBLAS handles, usable from any thread
// once the device's context is current (every user calls `bind` first); the
// `Mutex` around each `Device` serialises all use.
unsafe impl Send for Device {}

impl Drop for Device {
    fn drop(&mut self) {
        // The module unloads from the current context.
        let _ = self.context.make_current();
    }
}

static DEVICES: OnceLock<Mutex<HashMap<i32, Arc<Mutex<Device>>>>> = OnceLock::new();
static IMAGES: OnceLock<ImageCache> = OnceLock::new();

/// Makes the context of XLA's `stream` current on this thread and returns
/// its device's cached state (created on the device's first call: the
/// handler's INITIALIZE stage, before any execution).
pub fn bind(stream: *mut c_void) -> Result<Arc<Mutex<Device>>> {
    bind_or_create(stream).map(|(device, _)| device)
}

/// [`bind`] from an EXECUTE call: the device is normally set up already
/// (INITIALIZE ran); one that is not is set up here and counted in
/// [`LOADED_DURING_EXECUTE`].
pub fn bind_for_execute(stream: *mut c_void) -> Result<Arc<Mutex<Device>>> {
    let (device, created) = bind_or_create(stream)?;
    if created {
        LOADED_DURING_EXECUTE.fetch_add(1, Ordering::Relaxed);
    }
    Ok(device)
}

/// The device of `stream`, and whether this call created its state.
fn bind_or_create(stream: *mut c_void) -> Result<(Arc<Mutex<Device>>, bool)> {
    // SAFETY: `stream` is XLA's live stream for this call (`Frame::stream`
    // refuses null).
    let (ctx, ordinal) = unsafe { api::bind_stream(stream as dsys::CUstream) }?;
    let devices = DEVICES.get_or_init(Default::default);
    let mut devices = crate::sync::lock(devices);
    if let Some(d) = devices.get(&ordinal) {
        return Ok((Arc::clone(d), false));
    }
    let d = Arc::new(Mutex::new(Device::new(ordinal, ctx)?));
    devices.insert(ordinal, Arc::clone(&d));
    Ok((d, true))
}

/// The cached state of CUDA device `ordinal`, if a call has bound it.
pub fn bound(ordinal: i32) -> Option<Arc<Mutex<Device>>> {
    let devices = crate::sync::lock(DEVICES.get()?);
    devices.get(&ordinal).cloned()
}

/// Number of CUDA devices this process sees.
pub fn device_count() -> Result<i32> {
    api::device_count()
}

/// Devices whose kernels were loaded during an EXECUTE call instead of
/// before it (the INITIALIZE stage did not run for them): the GPU check
/// asserts none.
pub static LOADED_DURING_EXECUTE: AtomicU64 = AtomicU64::new(0);

impl Device {
    /// Creates the device's streams and kernels; `ctx` (current) is XLA's.
    fn new(ordinal: i32, ctx: dsys::CUcontext) -> Result<Device> {
        let context = Context::primary(ordinal)?;
        if context.raw() != ctx {
            return Err(Error::Unimplemented(format!(
                "XLA's stream on CUDA device {ordinal} is not in the device's primary context"
            )));
        }
        let dev = api::device_get(ordinal)?;
        use dsys::CUdevice_attribute::*;
        let attr = |a| api::device_attribute(dev, a);
        let (major, minor) =
            (attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
        let multiprocessors = u32::try_from(attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?).unwrap_or(1);
        let target = Target::for_device(major, minor, &kernels::supported_archs()?)?;
        let image = IMAGES.get_or_init(ImageCache::default).get(&target, SOURCES[0])?;
        let module = Module::load(&image)
            .map_err(|e| Error::Internal(format!("{} ({} of {})", e.message(), target.arch(), SOURCES[0].name)))?;
        let sums =
            [module.function(SUM_KERNELS[0])?, module.function(SUM_KERNELS[1])?, module.function(SUM_KERNELS[2])?];
        Ok(Device {
            ordinal,
            multiprocessors,
            capability: (major, minor),
            lanes: [Stream::new()?, Stream::new()?],
            reshard_sends: HashMap::new(),
            events: Vec::new(),
            blas: Vec::new(),
            lt: None,
            sums,
            scratch: None,
            _module: module,
            context,
        })
    }

    /// Makes this device's context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        self.context.make_current()
    }

    /// The device's (retained) primary context.
    pub fn context(&self) -> dsys::CUcontext {
        self.context.raw()
    }

    /// Internal stream `lane`: 0 computes, 1 communicates.
    pub fn lane_stream(&self, lane: usize) -> Option<dsys::CUstream> {
        self.lanes.get(lane).map(Stream::raw)
    }

    /// The stream of the reshard sends to the union `devices` (created on
    /// its first send; the context is current).
    pub fn reshard_send_stream(&mut self, devices: &[i64]) -> Result<dsys::CUstream> {
        if let Some(s) = self.reshard_sends.get(devices) {
            return Ok(s.raw());
        }
        let stream = Stream::new()?;
        let raw = stream.raw();
        self.reshard_sends.insert(devices.to_vec(), stream);
        Ok(raw)
    }

    /// At least `n` events (created on the first call that needs them).
    pub fn reserve_events(&mut self, n: usize) -> Result<()> {
        while self.events.len() < n {
            self.events.push(Event::new("cuEventCreate")?);
        }
        Ok(())
    }

    /// Event `i` of the pool ([`Device::reserve_events`]).
    pub fn event(&self, i: usize) -> Option<dsys::CUevent> {
        self.events.get(i).map(Event::raw)
    }

    /// The cuBLAS handle bound to `stream`, one of this device's internal
    /// streams (created on first use).
    pub fn blas_for(&mut self, stream: dsys::CUstream) -> Result<&BlasHandle> {
        if let Some(i) = self.blas.iter().position(|h| h.stream() == stream) {
            return Ok(&self.blas[i]);
        }
        let lane = self.lanes.iter().find(|s| s.raw() == stream);
        let lane = lane.ok_or_else(|| Error::Internal("a cuBLAS handle for a stream not of this device".into()))?;
        self.blas.push(BlasHandle::new(lane)?);
        Ok(&self.blas[self.blas.len() - 1])
    }

    /// `1 + ranks` bytes of this device's memory for connecting a group of
    /// `ranks` (see `GroupComms::connect`), allocated once and kept
    /// (transfers may still use it on the device).
    pub fn connect_scratch(&mut self, ranks: usize) -> Result<u64> {
        const BYTES: usize = 64 << 10;
        if ranks >= BYTES {
            return Err(Error::Unimplemented(format!("groups of {ranks} ranks (at most {})", BYTES - 1)));
        }
        if let Some(memory) = &self.scratch {
            return Ok(memory.addr());
        }
        self.make_current()?;
        let memory = DeviceMemory::new(BYTES, "cuMemAlloc (communicator connection scratch)")?;
        let addr = memory.addr();
        self.scratch = Some(memory);
        Ok(addr)
    }

    /// The device's cuBLASLt handle (created on first use; its GEMMs'
    /// workspace comes from XLA, per call).
    pub fn lt_handle(&mut self) -> Result<&LtHandle> {
        if self.lt.is_none() {
            self.lt = Some(LtHandle::new()?);
        }
        self.lt.as_ref().ok_or_else(|| Error::Internal("no cuBLASLt handle".into()))
    }

    pub fn sum_kernel(&self, name: &str) -> Result<Function> {
        SUM_KERNELS
            .iter()
            .position(|&k| k == name)
            .map(|i| self.sums[i])
            .ok_or_else(|| Error::Internal(format!("no kernel {name}")))
    }
}

/// Enqueues zeroing a call's result on XLA's stream `xla` (a call with
/// nothing to compute, see `Problem::is_trivial`).
pub fn zero_result(device: &Device, out: &crate::xla::DeviceBuffer<'_>, xla: *mut c_void) -> Result<()> {
    device.make_current()?;
    // SAFETY: `out` is XLA's result buffer of this call on this device,
    // alive until XLA's stream passes the call; the stream is live.
    unsafe { api::zero_async(out.addr, out.bytes, xla as dsys::CUstream) }
}
