//! The NCCL communicators of a group (`GroupComms`), per group of devices
//! cached for the process ([`group_comms`]): non-blocking communicators for
//! every member in this process, created together from one thread under one
//! unique id (made here for a group of this process, exchanged by the
//! lowering for a group spanning processes); every NCCL wait is a host-side
//! poll of `ncclCommGetAsyncError` bounded by the call's deadline, after
//! which the communicator is aborted and the call reports DEADLINE_EXCEEDED.

#![forbid(unsafe_code)]

use super::addresses::{self, poll_until, P2p};
use super::communicators::{CommCache, CommKey, IdLedger, NCCL_ID_BYTES};
use super::device::Device;
use super::driver::{CallMemory, Queue};
use super::nccl::{self, Comm, Config, UniqueId};
use super::watchdog::WatchedGroup;
use crate::error::{Error, Result};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// The communicators of one group's members in this process, by rank.
///
/// Each is released exactly once (`nccl::Comm`): aborted by its rank's call
/// when it fails or times out, or, for the rest, aborted when the group is dropped. A
/// group is dropped only after it was evicted (a failure) or its creation
/// failed, and then its other communicators may be connected to a peer that
/// is gone: `ncclCommDestroy` would wait for that peer (it finalises first),
/// `ncclCommAbort` frees them without waiting.
pub struct GroupComms {
    pub key: CommKey,
    /// Per rank, its CUDA ordinal in this process (`None`: another process).
    pub members: Vec<Option<i32>>,
    comms: Vec<Option<Comm>>,
    /// Per rank, the calls it has enqueued on the group: the watchdog's
    /// message says which ranks never issued a call that timed out.
    issued: Vec<AtomicU64>,
    /// Per rank, whether its communicator is connected to every peer (`connect`).
    connected: Vec<AtomicBool>,
}

impl GroupComms {
    pub fn rank(&self, rank: usize) -> Result<&Comm> {
        self.comms.get(rank).and_then(Option::as_ref).filter(|c| c.is_live()).ok_or_else(|| {
            Error::Internal(format!(
                "no live communicator for rank {rank} in this process (it failed in an earlier call; the next \
                 call creates the group afresh)"
            ))
        })
    }

    /// Whether rank `rank` has a communicator in this process not yet released.
    pub fn is_live(&self, rank: usize) -> bool {
        self.comms.get(rank).and_then(Option::as_ref).is_some_and(Comm::is_live)
    }

    /// Aborts rank `rank`'s communicator after it failed or timed out: the
    /// caller (the only user of that rank's communicator, under its device's
    /// lock) evicts the group from the cache, so no new call gets it; the
    /// other ranks' communicators are aborted by their own failing calls or
    /// when the group is dropped.
    pub fn abort_rank(&self, rank: usize) {
        if let Some(c) = self.comms.get(rank).and_then(Option::as_ref) {
            c.abort();
        }
    }

    /// Connects rank `rank`'s communicator to every peer once (one byte
    /// each way with each, on `stream`), waiting on the host until NCCL has
    /// set the connections up: NCCL connects peers at their first transfer,
    /// a host-side handshake that needs the peer to post its side too. The
    /// INITIALIZE stage does it, where every device takes part in program
    /// order, so that no EXECUTE call waits on the host for a peer.
    pub fn connect(&self, rank: usize, device: &mut Device, stream: &impl Queue, deadline: Instant) -> Result<()> {
        let Some(done) = self.connected.get(rank) else {
            return Err(Error::Internal(format!("rank {rank} is not in the group {:?}", self.key.devices)));
        };
        if done.load(Ordering::Acquire) {
            return Ok(());
        }
        let comm = self.rank(rank)?;
        let scratch = device.connect_scratch(self.members.len())?;
        let at = scratch.addr();
        let peers = (0..self.members.len()).filter(|&p| p != rank);
        let sends = peers.clone().map(|peer| P2p { addr: at, bytes: 1, peer });
        let recvs = peers.map(|peer| P2p { addr: at + 1 + peer as u64, bytes: 1, peer });
        // One byte sent and one byte per peer received, in the device's
        // scratch, never freed.
        comm.exchange(stream, sends, recvs, &CallMemory::of_owned(&[scratch]))?;
        poll_until(deadline, "connecting the group's communicators (a peer may not have joined)", || {
            comm.probe("connection")
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
                UniqueId { internal: id.map(|b| b as std::ffi::c_char) }
            }
            None if members.iter().all(Option::is_some) => nccl::unique_id()?,
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
    Ok(nccl::unique_id()?.internal.map(|c| c as u8))
}

/// Drops a failed group from the cache (the next call creates it afresh),
/// unless another member already replaced it.
pub fn evict(key: &CommKey, failed: &Arc<GroupComms>) {
    if let Some(cache) = COMMS.get() {
        cache.remove(key, failed);
    }
}

/// A non-blocking communicator configuration, other fields left to NCCL.
fn config() -> Result<Config> {
    const UNDEF: i32 = i32::MIN; // NCCL_CONFIG_UNDEF_INT
    let runtime = nccl::version_code()?;
    Ok(Config {
        size: std::mem::size_of::<Config>(),
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

fn create(key: &CommKey, members: &[Option<i32>], id: UniqueId, deadline: Instant) -> Result<GroupComms> {
    let (comms, posted) = nccl::create_group(members, id, &config()?);
    // Owned from here on: on any failure below, dropping `group` aborts
    // every communicator NCCL handed out, each once.
    let group = GroupComms {
        key: key.clone(),
        members: members.to_vec(),
        comms,
        issued: members.iter().map(|_| AtomicU64::new(0)).collect(),
        connected: members.iter().map(|_| Default::default()).collect(),
    };
    posted?;
    for (rank, member) in members.iter().enumerate() {
        if member.is_none() {
            continue;
        }
        let comm = group.comms[rank].as_ref().ok_or_else(|| Error::Internal("NCCL created no communicator".into()))?;
        poll_until(deadline, "NCCL communicator creation (a member of the group may not have joined)", || {
            comm.probe("communicator creation")
        })?;
    }
    Ok(group)
}

#[cfg(test)]
impl GroupComms {
    /// A group of no live communicator (nothing to release), for tests.
    pub fn without_communicators(key: CommKey, members: Vec<Option<i32>>) -> GroupComms {
        let n = members.len();
        GroupComms {
            key,
            members,
            comms: (0..n).map(|_| None).collect(),
            issued: (0..n).map(|_| AtomicU64::new(0)).collect(),
            connected: (0..n).map(|_| AtomicBool::new(false)).collect(),
        }
    }
}
