//! The device cache: per CUDA device (cached for the process, [`bind`]) the
//! context of XLA's stream (the device's primary context, retained), one
//! compute and one communication stream (non-blocking: no implicit sync with
//! the legacy default stream, which is never used), a pool of events (grown
//! only when a call needs more than any before it), one cuBLAS handle per
//! internal stream, a cuBLASLt handle, and the `kernels/` sums (compiled
//! with NVRTC once per architecture, loaded once per device). XLA's stream
//! is borrowed for the call, never created, synchronised or destroyed here.
//!
//! Everything is held by the owning handles of the safe layers (`driver`,
//! `blas`); the cache never drops a device, so they live for the process,
//! and a device whose set-up fails half way releases what it made.
//!
//! The hot path (a call after the first on its device) allocates no device
//! memory and never synchronises the host with the device.

#![forbid(unsafe_code)]

use super::api;
use super::blas::{BlasHandle, LtHandle};
use super::driver::{self, CallMemory, CallStream, Context, DeviceMemory, Event, Stream, SumKernels};
use super::kernels::{self, ImageCache, Target, ELEMENTWISE};
use crate::error::{Error, Result};
use cudarc::driver::sys as dsys;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// One CUDA device's cached state (see the module comment). Fields drop in
/// order, the context last (`Drop` makes it current first).
pub struct Device {
    pub ordinal: i32,
    pub multiprocessors: u32,
    /// Compute capability (major, minor): fp8 GEMMs need 9.0+.
    pub capability: (i32, i32),
    /// The compute and the communication stream (shared with their cuBLAS handles).
    lanes: [Arc<Stream>; 2],
    /// Per union of two meshes (its device ids), the stream of its reshard
    /// sends, which wait for receivers outside the send program
    /// (`backend::cuda::reshard`): one per union, so that sends to one
    /// destination mesh never queue behind sends to another.
    reshard_sends: HashMap<Vec<i64>, Arc<Stream>>,
    events: Vec<Event>,
    /// The cuBLAS handle of each lane (created at its first GEMM).
    blas: [OnceLock<BlasHandle>; 2],
    /// The cuBLASLt handle of the fp8 GEMMs (created at the device's first).
    lt: OnceLock<LtHandle>,
    sums: SumKernels,
    /// Device bytes for connecting communicators (`GroupComms::connect`):
    /// allocated once, like NCCL's own buffers, outside XLA's memory.
    scratch: Option<DeviceMemory>,
    context: Context,
}

impl Drop for Device {
    fn drop(&mut self) {
        // The module unloads from the current context.
        let _ = self.context.make_current();
    }
}

/// The cached devices by CUDA ordinal and slot: XLA's calls use slot 0;
/// tests that run several ranks on one device give each rank a slot of its
/// own, so that each has its own streams and lock (`bind_as`).
type DeviceCache = Mutex<HashMap<(i32, usize), Arc<Mutex<Device>>>>;
static DEVICES: OnceLock<DeviceCache> = OnceLock::new();
static IMAGES: OnceLock<ImageCache> = OnceLock::new();

/// The cached state of the device of XLA's `stream` (whose context
/// `CallStream::of` made current), created on the device's first call: the
/// handler's INITIALIZE stage, before any execution.
pub fn bind(stream: &CallStream<'_>) -> Result<Arc<Mutex<Device>>> {
    bind_or_create(stream, 0).map(|(device, _)| device)
}

/// [`bind`] for one of several ranks sharing a device in one process (the
/// device tests): slot `slot`'s own streams, events and lock.
pub fn bind_as(stream: &CallStream<'_>, slot: usize) -> Result<Arc<Mutex<Device>>> {
    bind_or_create(stream, slot).map(|(device, _)| device)
}

/// [`bind`] from an EXECUTE call: the device is normally set up already
/// (INITIALIZE ran); one that is not is set up here and counted in
/// [`LOADED_DURING_EXECUTE`].
pub fn bind_for_execute(stream: &CallStream<'_>) -> Result<Arc<Mutex<Device>>> {
    let (device, created) = bind_or_create(stream, 0)?;
    if created {
        LOADED_DURING_EXECUTE.fetch_add(1, Ordering::Relaxed);
    }
    Ok(device)
}

/// The device of `stream`, and whether this call created its state.
fn bind_or_create(stream: &CallStream<'_>, slot: usize) -> Result<(Arc<Mutex<Device>>, bool)> {
    let ordinal = stream.ordinal;
    let devices = DEVICES.get_or_init(Default::default);
    let mut devices = crate::sync::lock(devices);
    if let Some(d) = devices.get(&(ordinal, slot)) {
        return Ok((Arc::clone(d), false));
    }
    let d = Arc::new(Mutex::new(Device::new(ordinal, stream)?));
    devices.insert((ordinal, slot), Arc::clone(&d));
    Ok((d, true))
}

/// The cached state of CUDA device `ordinal`, if a call has bound it.
pub fn bound(ordinal: i32) -> Option<Arc<Mutex<Device>>> {
    let devices = crate::sync::lock(DEVICES.get()?);
    devices.get(&(ordinal, 0)).cloned()
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
    /// Creates the device's streams and kernels; the context of XLA's
    /// `stream` is current.
    fn new(ordinal: i32, stream: &CallStream<'_>) -> Result<Device> {
        let context = Context::primary(ordinal)?;
        if !context.owns(stream) {
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
        let image = IMAGES.get_or_init(ImageCache::default).get(&target, ELEMENTWISE)?;
        let sums = SumKernels::load(&image)
            .map_err(|e| Error::Internal(format!("{} ({} of {})", e.message(), target.arch(), ELEMENTWISE.name)))?;
        Ok(Device {
            ordinal,
            multiprocessors,
            capability: (major, minor),
            lanes: [Arc::new(Stream::new()?), Arc::new(Stream::new()?)],
            reshard_sends: HashMap::new(),
            events: Vec::new(),
            blas: Default::default(),
            lt: OnceLock::new(),
            sums,
            scratch: None,
            context,
        })
    }

    /// Makes this device's context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        self.context.make_current()
    }

    /// Internal stream `lane`: 0 computes, 1 communicates.
    pub fn lane_stream(&self, lane: usize) -> Option<&Stream> {
        self.lanes.get(lane).map(|s| &**s)
    }

    /// The stream of the reshard sends to the union `devices` (created on
    /// its first send; the context is current).
    pub fn reshard_send_stream(&mut self, devices: &[i64]) -> Result<Arc<Stream>> {
        if let Some(s) = self.reshard_sends.get(devices) {
            return Ok(Arc::clone(s));
        }
        let stream = Arc::new(Stream::new()?);
        self.reshard_sends.insert(devices.to_vec(), Arc::clone(&stream));
        Ok(stream)
    }

    /// At least `n` events (created on the first call that needs them).
    pub fn reserve_events(&mut self, n: usize) -> Result<()> {
        while self.events.len() < n {
            self.events.push(Event::new("cuEventCreate")?);
        }
        Ok(())
    }

    /// Event `i` of the pool ([`Device::reserve_events`]).
    pub fn event(&self, i: usize) -> Option<&Event> {
        self.events.get(i)
    }

    /// The cuBLAS handle of internal stream `lane` (created on first use;
    /// the context is current).
    pub fn blas(&self, lane: usize) -> Result<&BlasHandle> {
        let (Some(cell), Some(stream)) = (self.blas.get(lane), self.lanes.get(lane)) else {
            return Err(Error::Internal(format!("no lane {lane}")));
        };
        if cell.get().is_none() {
            // The device's lock is held: nobody else sets it meanwhile.
            let _ = cell.set(BlasHandle::new(stream)?);
        }
        cell.get().ok_or_else(|| Error::Internal("no cuBLAS handle".into()))
    }

    /// `1 + ranks` bytes of this device's memory for connecting a group of
    /// `ranks` (see `GroupComms::connect`), allocated once and kept
    /// (transfers may still use it on the device).
    pub fn connect_scratch(&mut self, ranks: usize) -> Result<&DeviceMemory> {
        const BYTES: usize = 64 << 10;
        if ranks >= BYTES {
            return Err(Error::Unimplemented(format!("groups of {ranks} ranks (at most {})", BYTES - 1)));
        }
        if self.scratch.is_none() {
            self.make_current()?;
            self.scratch = Some(DeviceMemory::new(BYTES, "cuMemAlloc (communicator connection scratch)")?);
        }
        self.scratch.as_ref().ok_or_else(|| Error::Internal("no connection scratch".into()))
    }

    /// The device's cuBLASLt handle (created on first use; its GEMMs'
    /// workspace comes from XLA, per call).
    pub fn lt_handle(&self) -> Result<&LtHandle> {
        if self.lt.get().is_none() {
            // The device's lock is held: nobody else sets it meanwhile.
            let _ = self.lt.set(LtHandle::new()?);
        }
        self.lt.get().ok_or_else(|| Error::Internal("no cuBLASLt handle".into()))
    }

    /// The sum kernels of `kernels/elementwise.cu`, loaded in this device's context.
    pub fn sums(&self) -> &SumKernels {
        &self.sums
    }
}

/// Enqueues zeroing a call's result `out` on XLA's stream (a call with
/// nothing to compute, see `Problem::is_trivial`).
pub fn zero_result(device: &Device, out: (u64, usize), xla: &CallStream<'_>, memory: &CallMemory<'_>) -> Result<()> {
    device.make_current()?;
    driver::zero(xla, out.0, out.1, memory)
}
