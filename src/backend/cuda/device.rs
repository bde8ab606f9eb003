//! The device half of a call: contexts, streams, events, cuBLAS handles,
//! kernels and NCCL communicators, created once and cached, and the
//! [`StreamOps`] that enqueues a plan's steps on them.
//!
//! Per CUDA device (cached for the process, [`bind`]): the context of XLA's
//! stream (the device's primary context, retained and never released), one
//! compute and one communication stream (non-blocking: no implicit sync with
//! the legacy default stream, which is never used), a pool of events (grown
//! only when a call needs more than any before it), one cuBLAS handle per
//! internal stream, and the `kernels/` module (compiled with NVRTC once per
//! architecture, loaded once per device). XLA's stream is borrowed for the
//! call, never created, synchronised or destroyed here.
//!
//! Per group of devices (cached, [`group_comms`]): non-blocking NCCL
//! communicators for every member in this process, created together from
//! one thread under one unique id (made here for a group of this process,
//! exchanged by the lowering for a group spanning processes); every NCCL
//! wait is a host-side poll of `ncclCommGetAsyncError` bounded by the call's
//! deadline, after which the communicator is aborted and the call reports
//! DEADLINE_EXCEEDED.
//!
//! The hot path (a call after the first on its device and group) allocates
//! no device memory and never synchronises the host with the device.

use super::api::{self, check_blas, check_cu, check_lt, check_nccl};
use super::calls::{self, grid, poll_until, DeviceOp, Poll, Resolver, SumLaunch, BLOCK};
use super::comms::{CommCache, CommKey, IdLedger, ReleaseOnce, NCCL_ID_BYTES};
use super::issue::StreamOps;
use super::kernels::{self, ImageCache, Target, SOURCES};
use super::nccl::P2p;
use super::watchdog::{Abort, CallInfo, EventSource, Query, Watch, Watchdog, WatchedGroup, MAX_MARKS};
use super::{gemm, lt, nccl};
use crate::error::{Error, Result};
use crate::plan::Step;
use cudarc::cublas::sys as bsys;
use cudarc::cublaslt::sys as ltsys;
use cudarc::driver::sys as dsys;
use cudarc::nccl::sys as nsys;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// The sum kernels of `kernels/elementwise.cu` the backend launches.
pub const SUM_KERNELS: [&str; 3] = ["sum_f32", "sum_to_bf16", "sum_to_f16"];

/// One CUDA device's cached state (see the module comment).
pub struct Device {
    pub ordinal: i32,
    ctx: dsys::CUcontext,
    multiprocessors: u32,
    /// The compute and the communication stream.
    lanes: [dsys::CUstream; 2],
    events: Vec<dsys::CUevent>,
    blas: Vec<(dsys::CUstream, bsys::cublasHandle_t)>,
    /// The cuBLASLt handle of the fp8 GEMMs (created at the device's first;
    /// not bound to a stream: each GEMM names its own).
    lt: Option<ltsys::cublasLtHandle_t>,
    /// Compute capability (major, minor): fp8 GEMMs need 9.0+.
    capability: (i32, i32),
    sums: [dsys::CUfunction; 3],
    /// Device bytes for connecting communicators (`GroupComms::connect`):
    /// allocated once, like NCCL's own buffers, outside XLA's memory.
    scratch: Option<(u64, usize)>,
}

// SAFETY: the handles are plain driver/cuBLAS handles, usable from any thread
// once the device's context is current (every user calls `bind` first); the
// `Mutex` around each `Device` serialises all use.
unsafe impl Send for Device {}

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
        let dev = api::device_get(ordinal)?;
        // The retained reference is kept for the life of the process (the
        // cache never drops a device).
        let primary = api::primary_context(dev)?;
        if primary != ctx {
            return Err(Error::Unimplemented(format!(
                "XLA's stream on CUDA device {ordinal} is not in the device's primary context"
            )));
        }
        use dsys::CUdevice_attribute::*;
        let attr = |a| api::device_attribute(dev, a);
        let (major, minor) =
            (attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
        let multiprocessors = u32::try_from(attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?).unwrap_or(1);
        let target = Target::for_device(major, minor, &kernels::supported_archs()?)?;
        let image = IMAGES.get_or_init(ImageCache::default).get(&target, SOURCES[0])?;
        let d = api::driver()?;
        let mut module: dsys::CUmodule = ptr::null_mut();
        // SAFETY: `image` is a CUBIN (or NUL-terminated PTX) alive for the
        // call; the module stays loaded for the life of the process.
        check_cu(unsafe { (d.module_load_data)(&mut module, image.as_ptr().cast()) }, "cuModuleLoadData")
            .map_err(|e| Error::Internal(format!("{} ({} of {})", e.message(), target.arch(), SOURCES[0].name)))?;
        let mut sums = [ptr::null_mut(); 3];
        for (f, name) in sums.iter_mut().zip(SUM_KERNELS) {
            let cname = CString::new(name).map_err(|_| Error::Internal("kernel name".into()))?;
            // SAFETY: `module` was just loaded and is never unloaded; `cname` is NUL-terminated.
            check_cu(unsafe { (d.module_get_function)(f, module, cname.as_ptr()) }, "cuModuleGetFunction")?;
        }
        let lanes = [api::stream_create()?, api::stream_create()?];
        Ok(Device {
            ordinal,
            ctx,
            multiprocessors,
            lanes,
            events: Vec::new(),
            blas: Vec::new(),
            lt: None,
            capability: (major, minor),
            sums,
            scratch: None,
        })
    }

    /// Makes this device's context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: `ctx` is retained for the life of the process.
        unsafe { api::set_current(self.ctx) }
    }

    /// At least `n` events (created on the first call that needs them).
    fn reserve_events(&mut self, n: usize) -> Result<()> {
        while self.events.len() < n {
            self.events.push(api::event_create("cuEventCreate")?);
        }
        Ok(())
    }

    /// The cuBLAS handle bound to `stream` (created on first use).
    fn blas_for(&mut self, stream: dsys::CUstream) -> Result<bsys::cublasHandle_t> {
        if let Some(&(_, h)) = self.blas.iter().find(|(s, _)| *s == stream) {
            return Ok(h);
        }
        let blas = api::cublas()?;
        let mut h: bsys::cublasHandle_t = ptr::null_mut();
        // SAFETY: a valid out-pointer; the handle is created in the current
        // context (this device's) and kept for the life of the process;
        // `stream` is one of this device's internal streams, never destroyed.
        unsafe {
            check_blas((blas.create)(&mut h), "cublasCreate")?;
            check_blas((blas.set_stream)(h, stream as bsys::cudaStream_t), "cublasSetStream")?;
        }
        self.blas.push((stream, h));
        Ok(h)
    }

    /// `1 + ranks` bytes of this device's memory for connecting a group of
    /// `ranks` (see `GroupComms::connect`), allocated once and never freed
    /// (transfers may still use it on the device).
    fn connect_scratch(&mut self, ranks: usize) -> Result<u64> {
        const BYTES: usize = 64 << 10;
        if ranks >= BYTES {
            return Err(Error::Unimplemented(format!("groups of {ranks} ranks (at most {})", BYTES - 1)));
        }
        if let Some((addr, _)) = self.scratch {
            return Ok(addr);
        }
        self.make_current()?;
        let addr = api::mem_alloc(BYTES, "cuMemAlloc (communicator connection scratch)")?;
        self.scratch = Some((addr, BYTES));
        Ok(addr)
    }

    /// The device's cuBLASLt handle (created on first use, kept for the
    /// life of the process; its GEMMs' workspace comes from XLA, per call).
    fn lt_handle(&mut self) -> Result<ltsys::cublasLtHandle_t> {
        if let Some(h) = self.lt {
            return Ok(h);
        }
        let mut handle: ltsys::cublasLtHandle_t = ptr::null_mut();
        // SAFETY: a valid out-pointer; created in the current context (this device's).
        check_lt(unsafe { (api::cublaslt()?.create)(&mut handle) }, "cublasLtCreate")?;
        self.lt = Some(handle);
        Ok(handle)
    }

    fn sum_kernel(&self, name: &str) -> Result<dsys::CUfunction> {
        SUM_KERNELS
            .iter()
            .position(|&k| k == name)
            .map(|i| self.sums[i])
            .ok_or_else(|| Error::Internal(format!("no kernel {name}")))
    }
}

// ---- NCCL communicators ------------------------------------------------------

/// The communicators of one group's members in this process, by rank.
///
/// Each is released exactly once: aborted by its rank's call when it fails
/// or times out, or, for the rest, aborted when the group is dropped. A
/// group is dropped only after it was evicted (a failure) or its creation
/// failed, and then its other communicators may be connected to a peer that
/// is gone: `ncclCommDestroy` would wait for that peer (it finalises first),
/// `ncclCommAbort` frees them without waiting.
pub struct GroupComms {
    key: CommKey,
    /// Per rank, its CUDA ordinal in this process (`None`: another process).
    members: Vec<Option<i32>>,
    comms: ReleaseOnce<nsys::ncclComm_t>,
    /// Per rank, the calls it has enqueued on the group: the watchdog's
    /// message says which ranks never issued a call that timed out.
    issued: Vec<AtomicU64>,
    /// Per rank, whether its communicator is connected to every peer (`connect`).
    connected: Vec<std::sync::atomic::AtomicBool>,
}

// SAFETY: each communicator is used by one call at a time: rank r's only by
// the calls of device r, which hold that device's lock while using it; the
// release flags are atomic.
unsafe impl Send for GroupComms {}
// SAFETY: as above; shared references only read the handles and flip flags.
unsafe impl Sync for GroupComms {}

impl GroupComms {
    pub fn rank(&self, rank: usize) -> Result<nsys::ncclComm_t> {
        self.comms.get(rank).ok_or_else(|| {
            Error::Internal(format!(
                "no live communicator for rank {rank} in this process (it failed in an earlier call; the next \
                 call creates the group afresh)"
            ))
        })
    }

    /// Aborts rank `rank`'s communicator after it failed or timed out: the
    /// caller (the only user of that rank's communicator, under its device's
    /// lock) evicts the group from the cache, so no new call gets it; the
    /// other ranks' communicators are aborted by their own failing calls or
    /// when the group is dropped.
    pub fn abort_rank(&self, rank: usize) {
        if let Some(c) = self.comms.release(rank) {
            abort_comm(c);
        }
    }

    /// Connects rank `rank`'s communicator to every peer once (one byte
    /// each way with each, on `stream`), waiting on the host until NCCL has
    /// set the connections up: NCCL connects peers at their first transfer,
    /// a host-side handshake that needs the peer to post its side too. The
    /// INITIALIZE stage does it, where every device takes part in program
    /// order, so that no EXECUTE call waits on the host for a peer.
    pub fn connect(&self, rank: usize, device: &mut Device, stream: *mut c_void, deadline: Instant) -> Result<()> {
        let Some(done) = self.connected.get(rank) else {
            return Err(Error::Internal(format!("rank {rank} is not in the group {:?}", self.key.devices)));
        };
        if done.load(Ordering::Acquire) {
            return Ok(());
        }
        let comm = self.rank(rank)?;
        let scratch = device.connect_scratch(self.members.len())?;
        let peers = (0..self.members.len()).filter(|&p| p != rank);
        let sends: Vec<P2p> = peers.clone().map(|peer| P2p { addr: scratch, bytes: 1, peer }).collect();
        let recvs: Vec<P2p> = peers.map(|peer| P2p { addr: scratch + 1 + peer as u64, bytes: 1, peer }).collect();
        // SAFETY: `comm` is this device's communicator of the group and
        // `stream` XLA's stream of this device; the scratch is this device's
        // memory, one byte sent and one byte per peer received, never freed.
        unsafe { nccl::enqueue_exchange(comm, stream as nsys::cudaStream_t, &sends, &recvs) }?;
        // SAFETY: `comm` is live.
        poll_until(deadline, "connecting the group's communicators (a peer may not have joined)", || unsafe {
            probe(comm, "connection")
        })?;
        done.store(true, Ordering::Release);
        Ok(())
    }

    /// Counts a call of `rank` enqueued on the group; returns its number (from 0).
    fn count_call(&self, rank: usize) -> u64 {
        self.issued.get(rank).map_or(0, |c| c.fetch_add(1, Ordering::AcqRel))
    }
}

impl WatchedGroup for GroupComms {
    fn devices(&self) -> &[i64] {
        &self.key.devices
    }

    fn issued(&self, rank: usize) -> Option<u64> {
        self.members.get(rank)?.as_ref()?;
        self.issued.get(rank).map(|c| c.load(Ordering::Acquire))
    }
}

impl Drop for GroupComms {
    fn drop(&mut self) {
        for c in self.comms.release_all() {
            // No call holds the group any more (this is the last reference);
            // each communicator is released once (see above).
            abort_comm(c);
        }
    }
}

/// Aborts `c`, a communicator a `GroupComms` created and released once.
fn abort_comm(c: nsys::ncclComm_t) {
    if let Ok(nccl) = api::nccl() {
        // SAFETY: the caller releases `c` exactly once (`ReleaseOnce`).
        let _ = unsafe { (nccl.comm_abort)(c) };
    }
}

static COMMS: OnceLock<CommCache<GroupComms>> = OnceLock::new();
static IDS: OnceLock<IdLedger> = OnceLock::new();

/// The cached communicators of `key`'s group, created together on first
/// use for the members in this process: `members[rank]` is the member's CUDA
/// ordinal here, or `None` for a member of another process. A group
/// entirely in this process makes its own unique id; one spanning processes
/// uses `id`, the id its lowering exchanged (`comms::Placement::id`), once.
/// `current` is restored as the thread's context afterwards.
pub fn group_comms(
    key: &CommKey,
    members: &[Option<i32>],
    id: Option<&[u8; NCCL_ID_BYTES]>,
    current: &Device,
    deadline: Instant,
) -> Result<Arc<GroupComms>> {
    COMMS.get_or_init(Default::default).get_or_create(key, || {
        let id = match id {
            Some(id) => {
                IDS.get_or_init(Default::default).claim(key, id)?;
                nsys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) }
            }
            None if members.iter().all(Option::is_some) => new_unique_id()?,
            None => {
                return Err(Error::Internal(format!(
                    "the group {:?} spans processes but has no unique id",
                    key.devices
                )))
            }
        };
        let made = create(key, members, id, deadline);
        current.make_current()?;
        made
    })
}

/// A fresh NCCL unique id (`ncclGetUniqueId`), for the lowering of a group
/// spanning processes: its rank 0's process makes it and publishes it.
pub fn unique_id() -> Result<[u8; NCCL_ID_BYTES]> {
    Ok(new_unique_id()?.internal.map(|c| c as u8))
}

fn new_unique_id() -> Result<nsys::ncclUniqueId> {
    let mut id = nsys::ncclUniqueId { internal: [0; NCCL_ID_BYTES] };
    // SAFETY: a valid out-pointer of the id's size.
    check_nccl(unsafe { (api::nccl()?.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
    Ok(id)
}

/// Drops a failed group from the cache (the next call creates it afresh),
/// unless another member already replaced it.
pub fn evict(key: &CommKey, failed: &Arc<GroupComms>) {
    if let Some(cache) = COMMS.get() {
        cache.remove(key, failed);
    }
}

/// A non-blocking communicator configuration, other fields left to NCCL.
fn config() -> Result<nsys::ncclConfig_t> {
    const UNDEF: i32 = i32::MIN; // NCCL_CONFIG_UNDEF_INT
    let mut runtime = 0;
    // SAFETY: a valid out-pointer.
    check_nccl(unsafe { (api::nccl()?.get_version)(&mut runtime) }, "ncclGetVersion")?;
    Ok(nsys::ncclConfig_t {
        size: std::mem::size_of::<nsys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: calls::nccl_config_version(runtime),
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    })
}

/// Polls a non-blocking communicator once.
///
/// # Safety
/// `comm` is a live communicator.
unsafe fn probe(comm: nsys::ncclComm_t, what: &'static str) -> Result<Poll> {
    let mut state = nsys::ncclResult_t::ncclSuccess;
    // SAFETY: the caller's contract; `state` is a valid out-pointer.
    check_nccl(unsafe { (api::nccl()?.comm_get_async_error)(comm, &mut state) }, "ncclCommGetAsyncError")?;
    match state {
        nsys::ncclResult_t::ncclSuccess => Ok(Poll::Done),
        nsys::ncclResult_t::ncclInProgress => Ok(Poll::Pending),
        other => Err(Error::Internal(format!("NCCL {what}: asynchronous error {other:?}"))),
    }
}

fn create(key: &CommKey, members: &[Option<i32>], id: nsys::ncclUniqueId, deadline: Instant) -> Result<GroupComms> {
    let n = i32::try_from(members.len()).map_err(|_| Error::Internal("group too large".into()))?;
    let mut config = config()?;
    let nccl = api::nccl()?;
    let mut comms: Vec<nsys::ncclComm_t> = vec![ptr::null_mut(); members.len()];
    // SAFETY: no arguments; balanced by the `group_end` below.
    check_nccl(unsafe { (nccl.group_start)() }, "ncclGroupStart")?;
    let posted = (|| -> Result<()> {
        for (rank, (member, comm)) in members.iter().zip(comms.iter_mut()).enumerate() {
            let Some(o) = *member else { continue };
            // The primary context is retained for the life of the process (XLA holds it too).
            let ctx = api::primary_context(api::device_get(o)?)?;
            // SAFETY: `ctx` is live; `comm` and `config` are valid for the
            // call; the id is shared by every rank of this group and no other.
            unsafe {
                api::set_current(ctx)?;
                check_nccl(
                    (nccl.comm_init_rank_config)(comm, n, id, rank as i32, &mut config),
                    "ncclCommInitRankConfig",
                )?;
            }
        }
        Ok(())
    })();
    // SAFETY: closes the group opened above, also after a failed post.
    let ended = check_nccl(unsafe { (nccl.group_end)() }, "ncclGroupEnd");
    // Owned from here on: on any failure below, dropping `group` aborts
    // every communicator NCCL handed out, each once.
    let group = GroupComms {
        key: key.clone(),
        members: members.to_vec(),
        comms: ReleaseOnce::new(comms.iter().map(|&c| (!c.is_null()).then_some(c)).collect()),
        issued: members.iter().map(|_| AtomicU64::new(0)).collect(),
        connected: members.iter().map(|_| Default::default()).collect(),
    };
    let ready = posted.and(ended.map(|_| ())).and_then(|()| {
        for (&c, member) in comms.iter().zip(members) {
            if member.is_none() {
                continue;
            }
            if c.is_null() {
                return Err(Error::Internal("NCCL created no communicator".into()));
            }
            // SAFETY: `c` was created above.
            poll_until(
                deadline,
                "NCCL communicator creation (a member of the group may not have joined)",
                || unsafe { probe(c, "communicator creation") },
            )?;
        }
        Ok(())
    });
    ready.map(|()| group)
}

// ---- device-side timeouts ------------------------------------------------------

/// An event of the watchdog's pool, with the (primary, retained) context it
/// was created in.
#[derive(Clone, Copy)]
pub struct WatchEvent {
    ctx: dsys::CUcontext,
    event: dsys::CUevent,
}

// SAFETY: driver handles, usable from any thread with their context current
// (`query` makes it so); an event is used by one call or by the watchdog at a
// time (the pool hands it to one owner).
unsafe impl Send for WatchEvent {}

/// The watchdog's device side: the driver's events and NCCL's aborts.
pub struct CudaEvents;

impl EventSource for CudaEvents {
    type Event = WatchEvent;
    type Group = GroupComms;

    fn query(&self, e: WatchEvent) -> Query {
        // SAFETY: the context is retained and the event never destroyed (the
        // pool keeps its events for the life of the process). A device error
        // counts as done: not a hang, and XLA reports it from its own stream.
        let done = unsafe { api::set_current(e.ctx).is_err() || api::event_done(e.event) };
        if done {
            Query::Done
        } else {
            Query::Pending
        }
    }

    /// Evicts the group, then aborts each of its communicators in this
    /// process under its device's lock (the lock every user of that
    /// communicator holds), skipping busy devices until the next poll.
    fn abort(&self, group: &Arc<GroupComms>) -> Abort {
        // First, so that no call gets the group from the cache any more.
        evict(&group.key, group);
        let mut busy = false;
        for (rank, member) in group.members.iter().enumerate() {
            let Some(ordinal) = *member else { continue };
            if group.comms.get(rank).is_none() {
                continue;
            }
            // A device no call has bound yet cannot be holding the group
            // (calls bind before asking for communicators, and it is
            // evicted): its communicator is aborted when the group is dropped.
            let Some(device) = bound(ordinal) else { continue };
            let d = match device.try_lock() {
                Ok(d) => d,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    busy = true;
                    continue;
                }
            };
            // NCCL tears the communicator down on its device.
            let _ = d.make_current();
            group.abort_rank(rank);
        }
        if busy {
            Abort::Busy
        } else {
            Abort::Done
        }
    }
}

/// The cached state of CUDA device `ordinal`, if a call has bound it.
fn bound(ordinal: i32) -> Option<Arc<Mutex<Device>>> {
    let devices = crate::sync::lock(DEVICES.get()?);
    devices.get(&ordinal).cloned()
}

static WATCHDOG: OnceLock<std::result::Result<Watchdog<CudaEvents>, String>> = OnceLock::new();

/// The process's watchdog, started at the first watched call.
fn watchdog() -> Result<&'static Watchdog<CudaEvents>> {
    WATCHDOG
        .get_or_init(|| Watchdog::start(CudaEvents).map_err(|e| e.message().to_string()))
        .as_ref()
        .map_err(|e| Error::Internal(e.clone()))
}

/// DEADLINE_EXCEEDED if an earlier call on CUDA device `ordinal` timed out on
/// the device since its last call (see `watchdog`); once per timeout.
pub fn check_device_timeouts(ordinal: i32) -> Result<()> {
    match WATCHDOG.get() {
        Some(Ok(w)) => w.check(ordinal),
        _ => Ok(()),
    }
}

/// One call watched for a device-side timeout: events of the pool, the
/// first recorded on XLA's stream before the call's work, the second after
/// its join ([`CallWatch::submit`]), and up to `MAX_MARKS` progress marks
/// recorded on its lanes in between ([`CallWatch::mark`]).
pub struct CallWatch {
    ordinal: i32,
    start: WatchEvent,
    end: WatchEvent,
    marks: [Option<WatchEvent>; MAX_MARKS],
    group: Arc<GroupComms>,
    /// `config::interrupts()` when the call began.
    interrupts: u64,
}

impl CallWatch {
    /// Takes `2 + marks` events (created while the pool has too few: only
    /// while a device has more calls in flight than ever before) and records
    /// the first on `xla`. `device`'s context is current.
    pub fn begin(device: &Device, xla: *mut c_void, group: &Arc<GroupComms>, marks: usize) -> Result<CallWatch> {
        let dog = watchdog()?;
        let interrupts = crate::config::interrupts();
        let take = || match dog.take_event(device.ordinal) {
            Some(e) => Ok(e),
            None => api::event_create("cuEventCreate (watchdog)").map(|event| WatchEvent { ctx: device.ctx, event }),
        };
        let start = take()?;
        let end = take().inspect_err(|_| dog.give_back(device.ordinal, &[start]))?;
        let mut watch = CallWatch {
            ordinal: device.ordinal,
            start,
            end,
            marks: [None; MAX_MARKS],
            group: Arc::clone(group),
            interrupts,
        };
        for i in 0..marks.min(MAX_MARKS) {
            match take() {
                Ok(e) => watch.marks[i] = Some(e),
                Err(e) => {
                    watch.cancel();
                    return Err(e);
                }
            }
        }
        match record_on(start, xla) {
            Ok(()) => Ok(watch),
            Err(e) => {
                watch.cancel();
                Err(e)
            }
        }
    }

    /// Records progress mark `mark` on `stream` (a lane of the call).
    pub fn mark(&self, mark: usize, stream: dsys::CUstream) -> Result<()> {
        match self.marks.get(mark).copied().flatten() {
            Some(e) => record_on(e, stream as *mut c_void),
            None => Err(Error::Internal(format!("no progress mark {mark} was taken for this call"))),
        }
    }

    /// Records the second event on `xla` (after the join) and hands the call
    /// to the watchdog, which expires it once it makes no progress on the
    /// device for `timeout`.
    pub fn submit(self, xla: *mut c_void, op: &'static str, site: i64, rank: usize, timeout: Duration) -> Result<()> {
        if let Err(e) = record_on(self.end, xla) {
            self.cancel();
            return Err(e);
        }
        let seq = self.group.count_call(rank);
        watchdog()?.submit(Watch {
            device: self.ordinal,
            start: self.start,
            end: self.end,
            marks: self.marks,
            timeout,
            interrupts: self.interrupts,
            group: self.group,
            call: CallInfo { op, site, rank, seq },
        });
        Ok(())
    }

    /// Returns the events to the pool (the call failed before it was submitted).
    pub fn cancel(self) {
        if let Ok(dog) = watchdog() {
            dog.give_back(self.ordinal, &[self.start, self.end]);
            for e in self.marks.into_iter().flatten() {
                dog.give_back(self.ordinal, &[e]);
            }
        }
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

fn record_on(e: WatchEvent, xla: *mut c_void) -> Result<()> {
    // SAFETY: XLA's stream is live for the call; the event is this device's
    // and owned by the call until it is submitted or given back.
    unsafe { api::event_record(e.event, xla as dsys::CUstream, "cuEventRecord (watchdog)") }
}

// ---- one call ------------------------------------------------------------------

/// Enqueues one call's steps: lanes `Compute`/`Comm` on the device's
/// internal streams, the caller's stream being XLA's.
pub struct CallOps<'a> {
    pub device: &'a mut Device,
    pub xla: *mut c_void,
    /// The stream of each schedule lane (by index into `StreamSchedule::lanes`).
    pub lanes: Vec<usize>,
    pub resolver: &'a Resolver<'a>,
    pub comm: Option<nsys::ncclComm_t>,
    pub deadline: Instant,
    /// Set when a communicator failed or timed out: the caller aborts and evicts it.
    pub comm_failed: bool,
    /// float32 GEMMs may use TF32 (the op's precision allows it).
    pub tf32: bool,
    /// An fp8 call's GEMM workspace in XLA's workspace (`workspace::CudaLayout`).
    pub fp8_workspace: Option<(u64, usize)>,
    /// The call's device-timeout watch, whose progress marks the lanes record.
    pub watch: Option<&'a CallWatch>,
}

impl CallOps<'_> {
    /// Prepares the device for a call needing `events` events.
    pub fn prepare(device: &mut Device, events: usize) -> Result<()> {
        device.make_current()?;
        device.reserve_events(events)
    }

    /// Index 0 is the compute stream, 1 the communication stream.
    pub fn lane_stream(lane: crate::plan::Lane) -> usize {
        match lane {
            crate::plan::Lane::Compute => 0,
            crate::plan::Lane::Comm => 1,
        }
    }

    fn stream(&self, stream: Option<usize>) -> Result<dsys::CUstream> {
        match stream {
            None => Ok(self.xla as dsys::CUstream),
            Some(l) => {
                self.lanes.get(l).map(|&s| self.device.lanes[s]).ok_or_else(|| Error::Internal(format!("no lane {l}")))
            }
        }
    }

    fn event(&self, event: usize) -> Result<dsys::CUevent> {
        self.device.events.get(event).copied().ok_or_else(|| Error::Internal(format!("no event {event}")))
    }

    fn exchange(&mut self, stream: dsys::CUstream, sends: &[P2p], recvs: &[P2p]) -> Result<()> {
        let comm = self.comm.ok_or_else(|| Error::Internal("an exchange without a communicator".into()))?;
        // SAFETY: `comm` is this device's communicator of the group, `stream`
        // its communication stream; the addresses are inside XLA's buffers
        // (checked by the resolver), which live until XLA's stream passes the
        // join event, after these transfers.
        let posted = unsafe { nccl::enqueue_exchange(comm, stream as nsys::cudaStream_t, sends, recvs) };
        // Non-blocking communicators may still be connecting or enqueueing:
        // wait (host side, bounded) until NCCL has taken the group.
        let result = posted.and_then(|()| {
            // SAFETY: `comm` is live.
            poll_until(self.deadline, "an NCCL send/receive group (a peer may not have joined)", || unsafe {
                probe(comm, "send/receive")
            })
        });
        if result.is_err() {
            self.comm_failed = true;
        }
        result
    }

    fn launch_sum(&mut self, stream: dsys::CUstream, launch: SumLaunch) -> Result<()> {
        if launch.n == 0 {
            return Ok(());
        }
        let f = self.device.sum_kernel(launch.kernel)?;
        let (mut out, mut terms, mut k, mut n) = (launch.dst, launch.terms, launch.k, launch.n);
        // The kernel's parameters: (T* dst, Terms terms, int k, u64 n),
        // `Terms` being eight pointers by value, laid out as `[u64; 8]`.
        let mut params: [*mut c_void; 4] = [
            (&mut out as *mut u64).cast(),
            (&mut terms as *mut [u64; calls::MAX_TERMS]).cast(),
            (&mut k as *mut i32).cast(),
            (&mut n as *mut u64).cast(),
        ];
        let grid = grid(launch.n, self.device.multiprocessors);
        // SAFETY: `f` is a function of this device's module with exactly
        // these parameters; their values live across the call (the driver
        // copies them); the addresses are inside XLA's buffers (checked by
        // the resolver), alive until the join.
        let launch_kernel = api::driver()?.launch_kernel;
        let launched =
            unsafe { launch_kernel(f, grid, 1, 1, BLOCK, 1, 1, 0, stream, params.as_mut_ptr(), ptr::null_mut()) };
        check_cu(launched, "cuLaunchKernel")
    }
}

impl StreamOps for CallOps<'_> {
    fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        let (s, e) = (self.stream(stream)?, self.event(event)?);
        // SAFETY: both handles are live (XLA's stream for the call, ours cached).
        unsafe { api::event_record(e, s, "cuEventRecord") }
    }

    fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        let (s, e) = (self.stream(stream)?, self.event(event)?);
        // SAFETY: as in `record`.
        unsafe { api::stream_wait_event(s, e) }
    }

    fn mark(&mut self, lane: usize, mark: usize) -> Result<()> {
        match self.watch {
            Some(watch) => watch.mark(mark, self.stream(Some(lane))?),
            None => Ok(()),
        }
    }

    fn run(&mut self, lane: usize, step: &Step) -> Result<()> {
        let stream = self.stream(Some(lane))?;
        for op in self.resolver.lower(&step.action)? {
            match op {
                DeviceOp::Gemm { gemm, ops, accumulate } => {
                    let handle = self.device.blas_for(stream)?;
                    // SAFETY: `handle` is bound to this lane's stream in this
                    // device's (current) context; the resolver placed every
                    // view inside XLA's buffers, alive until the join.
                    unsafe { gemm::enqueue(handle, &gemm, ops, accumulate, self.tf32) }?;
                }
                DeviceOp::Fp8Gemm(g) => {
                    let call = g.lower(self.device.capability)?;
                    let handle = self.device.lt_handle()?;
                    let workspace = self.fp8_workspace.ok_or_else(|| {
                        Error::Internal("an fp8 GEMM without its workspace in the call's workspace".into())
                    })?;
                    // SAFETY: the handle belongs to this device's (current)
                    // context; the resolver placed the operands, result and
                    // scales inside XLA's buffers, and the workspace is the
                    // call's own part of XLA's workspace (the call's GEMMs
                    // all run on this one stream), alive until the join.
                    unsafe { lt::enqueue(handle, stream as ltsys::cudaStream_t, &call, workspace) }?;
                }
                DeviceOp::Sum(launch) => self.launch_sum(stream, launch)?,
                DeviceOp::Exchange { sends, recvs } => self.exchange(stream, &sends, &recvs)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::calls::{DeviceBuffers, Region};
    use crate::backend::cuda::comms::CommKey;
    use crate::backend::cuda::emulate::{cases, fill, reference};
    use crate::backend::cuda::issue::{events_needed, issue};
    use crate::backend::cuda::libs::Lib;
    use crate::dtype::DType;
    use crate::exec::stream::StreamSchedule;
    use crate::plan::{plan, Schedule, Workspace};
    use crate::problem::{Operand, Problem};
    use std::time::Duration;

    /// Device memory of a test, freed on drop.
    struct DeviceMem(u64);

    impl DeviceMem {
        fn with(bytes: &[u8]) -> DeviceMem {
            // SAFETY: a fresh allocation of at least `bytes.len()` bytes in
            // the current context, filled from a live host slice.
            let p = api::mem_alloc(bytes.len().max(1), "cuMemAlloc").unwrap();
            if !bytes.is_empty() {
                unsafe { api::memcpy_htod(p, bytes) }.unwrap();
            }
            DeviceMem(p)
        }

        fn read(&self, len: usize) -> Vec<u8> {
            let mut v = vec![0u8; len];
            // SAFETY: the allocation holds at least `len` bytes; the copy is synchronous.
            unsafe { api::memcpy_dtoh(&mut v, self.0) }.unwrap();
            v
        }
    }

    impl Drop for DeviceMem {
        fn drop(&mut self) {
            // SAFETY: allocated by `with`, freed once, after the stream was synchronised.
            let _ = unsafe { api::mem_free(self.0) };
        }
    }

    /// What the watchdog reads of a group (its device ids, the calls each
    /// local rank issued, `None` for a rank of another process), and the
    /// abort of a group with no live communicator: done, touching nothing
    /// (no GPU or NCCL needed).
    #[test]
    fn a_group_tells_the_watchdog_its_devices_and_its_local_ranks_calls() {
        let group = Arc::new(GroupComms {
            key: CommKey { devices: vec![5, 1, 7] },
            members: vec![Some(0), None, Some(1)],
            comms: ReleaseOnce::new(vec![None, None, None]),
            issued: (0..3).map(|_| AtomicU64::new(0)).collect(),
            connected: (0..3).map(|_| Default::default()).collect(),
        });
        assert_eq!(group.devices(), &[5, 1, 7]);
        assert_eq!((group.count_call(2), group.count_call(2), group.count_call(0)), (0, 1, 0));
        assert_eq!(
            (group.issued(0), group.issued(1), group.issued(2), group.issued(3)),
            (Some(1), None, Some(2), None)
        );
        assert_eq!(group.count_call(9), 0);
        assert_eq!(CudaEvents.abort(&group), Abort::Done);
    }

    /// Runs `case` on device `ordinal` as rank `rank` of a group of the
    /// first `n` CUDA devices; returns the output bytes.
    fn run_on(ordinal: i32, rank: usize, n: usize, case: &super::super::emulate::Case, schedule: Schedule) -> Vec<u8> {
        let ctx = api::primary_context(api::device_get(ordinal).unwrap()).unwrap();
        // SAFETY: the primary context stays retained.
        unsafe { api::set_current(ctx) }.unwrap();
        // Plays XLA's stream.
        let stream = api::stream_create().unwrap();
        let (kind, x, w, out) = case;
        let op = |dims| Operand { dims, dtype: DType::F32 };
        let problem = Problem::new(*kind, op(x), op(w), op(out), 0, n).unwrap();
        let sizes = problem.sizes();
        let p = plan(kind.pattern(), schedule, n, rank);
        let layout = Workspace::layout(&p, &sizes).unwrap();
        let (xd, wd) = (DeviceMem::with(&fill(sizes.x, rank)), DeviceMem::with(&fill(sizes.w, 100 + rank)));
        let outd = DeviceMem::with(&vec![0xff; sizes.result * 4]);
        let wsd = DeviceMem::with(&vec![0; layout.total]);
        let region = |m: &DeviceMem, elems: usize| Region { addr: m.0, bytes: elems * 4, dtype: DType::F32 };
        let buffers = DeviceBuffers {
            x: region(&xd, sizes.x),
            w: region(&wd, sizes.w),
            out: region(&outd, sizes.result),
            workspace: (wsd.0, layout.total),
            scales: None,
        };
        let resolver = Resolver::new(&problem, &layout, &p.slots, buffers).unwrap();
        let sched = StreamSchedule::new(&p);
        let deadline = Instant::now() + Duration::from_secs(60);
        let device = bind(stream as *mut c_void).unwrap();
        let comms = (n > 1).then(|| {
            let key = CommKey { devices: (0..n as i64).collect() };
            let members: Vec<Option<i32>> = (0..n as i32).map(Some).collect();
            let d = device.lock().unwrap();
            group_comms(&key, &members, None, &d, deadline).unwrap()
        });
        let mut d = device.lock().unwrap();
        CallOps::prepare(&mut d, events_needed(&sched)).unwrap();
        let mut ops = CallOps {
            device: &mut d,
            xla: stream as *mut c_void,
            lanes: sched.lanes.iter().map(|&l| CallOps::lane_stream(l)).collect(),
            resolver: &resolver,
            comm: comms.as_ref().map(|c| c.rank(rank).unwrap()),
            deadline,
            comm_failed: false,
            tf32: false,
            fp8_workspace: None,
            watch: None,
        };
        issue(&p, &sched, &mut ops, 0).unwrap();
        drop(d);
        // SAFETY: `stream` is live; the test (not the hot path) waits for it.
        unsafe { api::stream_synchronize(stream) }.unwrap();
        outd.read(sizes.result * 4)
    }

    /// The CUDA devices of this process; fails (these tests run only when
    /// asked for, on a GPU host) when the libraries or a GPU are missing.
    fn usable_devices() -> i32 {
        api::require(&[Lib::Driver, Lib::Cublas, Lib::Nccl, Lib::Nvrtc]).unwrap();
        let n = device_count().unwrap();
        assert!(n > 0, "no CUDA device is visible");
        n
    }

    /// The device path on one real GPU, every op kind, against the CPU backend.
    #[test]
    #[ignore = "needs a CUDA GPU: scripts/gpu_device_check.sh runs it"]
    fn one_gpu_runs_every_op_as_the_cpu_backend_does() {
        usable_devices();
        let mut site = 0x6e00;
        for case in cases(1) {
            for schedule in [Schedule::Ring, Schedule::Sequential] {
                site += 1;
                let got = run_on(0, 0, 1, &case, schedule);
                assert!(got == reference(&case, schedule, 1, site)[0], "{:?} {schedule:?} differs on the GPU", case.0);
            }
        }
    }

    /// All local GPUs as one group (NCCL communicators created together,
    /// one thread per device, as XLA runs them), every op kind and schedule.
    #[test]
    #[ignore = "needs 2 or more CUDA GPUs: scripts/gpu_device_check.sh runs it where there are"]
    fn all_local_gpus_run_every_op_as_the_cpu_backend_does() {
        let n = usable_devices().min(8) as usize;
        assert!(n >= 2, "this test needs 2 or more CUDA GPUs, found {n}");
        let mut site = 0x6f00;
        for case in cases(n as i64) {
            for schedule in [Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential] {
                site += 1;
                let got: Vec<Vec<u8>> = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..n)
                        .map(|r| {
                            s.spawn({
                                let case = &case;
                                move || run_on(r as i32, r, n, case, schedule)
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                let want = reference(&case, schedule, n, site);
                for r in 0..n {
                    assert!(got[r] == want[r], "{:?} {schedule:?}: rank {r} of {n} differs on the GPUs", case.0);
                }
            }
        }
    }
}
