//! The NCCL communicators of a group (`GroupComms`), per group of devices
//! cached for the process ([`group_comms`]): non-blocking communicators for
//! every member in this process, created together from one thread under one
//! unique id (made here for a group of this process, exchanged by the
//! lowering for a group spanning processes); every NCCL wait is a host-side
//! poll of `ncclCommGetAsyncError` bounded by the call's deadline, after
//! which the communicator is aborted and the call reports DEADLINE_EXCEEDED.

use super::addresses::{self, poll_until, Poll};
use super::api::{self, check_nccl};
use super::communicators::{CommCache, CommKey, IdLedger, ReleaseOnce, NCCL_ID_BYTES};
use super::device::Device;
use super::handles::Context;
use super::nccl::{self, P2p};
use super::watchdog::WatchedGroup;
use crate::error::{Error, Result};
use cudarc::nccl::sys as nsys;
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// The communicators of one group's members in this process, by rank.
///
/// Each is released exactly once: aborted by its rank's call when it fails
/// or times out, or, for the rest, aborted when the group is dropped. A
/// group is dropped only after it was evicted (a failure) or its creation
/// failed, and then its other communicators may be connected to a peer that
/// is gone: `ncclCommDestroy` would wait for that peer (it finalises first),
/// `ncclCommAbort` frees them without waiting.
pub struct GroupComms {
    pub key: CommKey,
    /// Per rank, its CUDA ordinal in this process (`None`: another process).
    pub members: Vec<Option<i32>>,
    comms: ReleaseOnce<nsys::ncclComm_t>,
    /// Per rank, the calls it has enqueued on the group: the watchdog's
    /// message says which ranks never issued a call that timed out.
    issued: Vec<AtomicU64>,
    /// Per rank, whether its communicator is connected to every peer (`connect`).
    connected: Vec<AtomicBool>,
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

    /// Whether rank `rank` has a communicator in this process not yet released.
    pub fn is_live(&self, rank: usize) -> bool {
        self.comms.get(rank).is_some()
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
        unsafe { nccl::enqueue_exchange(comm, stream as nsys::cudaStream_t, sends, recvs) }?;
        // SAFETY: `comm` is live.
        poll_until(deadline, "connecting the group's communicators (a peer may not have joined)", || unsafe {
            probe(comm, "connection")
        })?;
        done.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether rank `rank` has been connected to every peer (`connect`).
    pub fn is_connected(&self, rank: usize) -> bool {
        self.connected.get(rank).is_some_and(|c| c.load(Ordering::Acquire))
    }

    /// Counts a call of `rank` enqueued on the group; returns its number (from 0).
    pub fn count_call(&self, rank: usize) -> u64 {
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
/// uses `id`, the id its lowering exchanged (`communicators::Placement::id`), once.
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

/// `key`'s cached communicators, if they were made (none are created).
pub fn cached(key: &CommKey) -> Option<Arc<GroupComms>> {
    COMMS.get()?.get(key)
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
        version: addresses::nccl_config_version(runtime),
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
pub unsafe fn probe(comm: nsys::ncclComm_t, what: &'static str) -> Result<Poll> {
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
            // Retained for the creation; XLA (and the device cache) hold it too.
            let context = Context::primary(o)?;
            context.make_current()?;
            // SAFETY: `comm` and `config` are valid for the call; the id is
            // shared by every rank of this group and no other.
            unsafe {
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

#[cfg(test)]
impl GroupComms {
    /// A group of no live communicator (nothing to release), for tests.
    pub fn without_communicators(key: CommKey, members: Vec<Option<i32>>) -> GroupComms {
        let n = members.len();
        GroupComms {
            key,
            members,
            comms: ReleaseOnce::new(vec![None; n]),
            issued: (0..n).map(|_| AtomicU64::new(0)).collect(),
            connected: (0..n).map(|_| AtomicBool::new(false)).collect(),
        }
    }
}
