//! The copy transport (`copies`) on CUDA devices: which groups take it, the
//! peer access it needs, each group's mailbox (process-wide, by the group's
//! communicator key), and each rank's events, kept for the process.
#![forbid(unsafe_code)]

use super::communicators::CommKey;
use super::copies::{CopyQueue, Mailbox, Mailboxes, RING};
use super::driver::{self, CallMemory, Context, KeptEvent, PeerRegion, Queue};
use crate::config::Transport;
use crate::error::{Error, Result};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

/// A group's mailbox on CUDA devices.
pub type CudaMailbox = Mailbox<KeptEvent, PeerRegion>;

/// Which transport a group's exchanges take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chosen {
    Copies,
    Nccl,
}

impl Chosen {
    pub fn name(self) -> &'static str {
        match self {
            Chosen::Copies => "copies",
            Chosen::Nccl => "nccl",
        }
    }
}

/// The transport of a group whose members are `members` (each one's CUDA
/// ordinal in this process, `None` for another process's), under `setting`.
/// Every rank decides alike (same members, same setting, same devices), so
/// they never mix transports. Copies need every member here and each pair
/// able to reach the other's memory; `copies` forced where they cannot
/// serve is UNIMPLEMENTED saying why.
pub fn choose(setting: Transport, members: &[Option<i32>]) -> Result<Chosen> {
    if setting == Transport::Nccl {
        return Ok(Chosen::Nccl);
    }
    let why_not = copies_refused(members)?;
    match (setting, why_not) {
        (_, None) => Ok(Chosen::Copies),
        (Transport::Copies, Some(why)) => Err(Error::Unimplemented(format!(
            "the copy transport cannot serve this group: {why}; configure transport='nccl' or 'auto'"
        ))),
        (_, Some(_)) => Ok(Chosen::Nccl),
    }
}

/// Chooses the transport of the group `key` (`choose`) and keeps it for the
/// group's later calls (`decided`).
pub fn decide(key: &CommKey, setting: Transport, members: &[Option<i32>]) -> Result<Chosen> {
    let chosen = choose(setting, members)?;
    crate::sync::lock(decisions()).insert(key.clone(), chosen);
    Ok(chosen)
}

/// The transport last chosen for the group `key`, if any.
pub fn decided(key: &CommKey) -> Option<Chosen> {
    crate::sync::lock(decisions()).get(key).copied()
}

fn decisions() -> &'static Mutex<HashMap<CommKey, Chosen>> {
    static DECISIONS: OnceLock<Mutex<HashMap<CommKey, Chosen>>> = OnceLock::new();
    DECISIONS.get_or_init(Default::default)
}

/// Why copies cannot serve `members`, if they cannot (peer access is asked
/// of the driver once per pair and kept).
fn copies_refused(members: &[Option<i32>]) -> Result<Option<String>> {
    let Some(ordinals) = members.iter().copied().collect::<Option<Vec<i32>>>() else {
        return Ok(Some("some of its devices belong to other processes".into()));
    };
    static ACCESS: OnceLock<Mutex<HashMap<(i32, i32), bool>>> = OnceLock::new();
    let access = ACCESS.get_or_init(Default::default);
    for &a in &ordinals {
        for &b in &ordinals {
            let known = crate::sync::lock(access).get(&(a, b)).copied();
            let can = match known {
                Some(can) => can,
                None => {
                    let can = driver::can_access_peer(a, b)?;
                    crate::sync::lock(access).insert((a, b), can);
                    can
                }
            };
            if !can {
                return Ok(Some(format!("CUDA device {a} cannot access device {b}'s memory (no peer access)")));
            }
        }
    }
    Ok(None)
}

/// Lets device `ordinal`'s context reach every other member's memory, once
/// per pair (the INITIALIZE stage, before any copy).
pub fn enable_peer_access(ordinal: i32, members: &[Option<i32>]) -> Result<()> {
    static ENABLED: OnceLock<Mutex<HashSet<(i32, i32)>>> = OnceLock::new();
    let enabled = ENABLED.get_or_init(Default::default);
    let mine = Context::primary(ordinal)?;
    for &peer in members.iter().flatten() {
        if peer == ordinal || crate::sync::lock(enabled).contains(&(ordinal, peer)) {
            continue;
        }
        driver::enable_peer_access(&mine, &Context::primary(peer)?)?;
        crate::sync::lock(enabled).insert((ordinal, peer));
    }
    // Leaves this device's context current, as the caller had it.
    mine.make_current()
}

/// The live mailbox of the group `key` (a new one after a failure).
pub fn mailbox(key: &CommKey) -> Arc<CudaMailbox> {
    static BOXES: OnceLock<Mailboxes<CommKey, KeptEvent, PeerRegion>> = OnceLock::new();
    BOXES.get_or_init(Default::default).get(key, &key.devices)
}

/// Which of a rank's events of the copy transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Recorded by a receiver where its slot is free.
    Ready,
    /// Recorded by a sender after its copy.
    Copied,
}

/// Rank `rank`'s event `role` for messages with `peer` numbered `message`
/// in group `key` (made on first use on device `ordinal`, current, and kept
/// for the process: `RING` per pair and role).
pub fn event(key: &CommKey, rank: usize, peer: usize, role: Role, message: u64, ordinal: i32) -> Result<KeptEvent> {
    static EVENTS: OnceLock<Mutex<HashMap<CommKey, Vec<Option<KeptEvent>>>>> = OnceLock::new();
    let n = key.devices.len();
    let (ring, roles) = (RING as usize, 2);
    if rank >= n || peer >= n {
        return Err(Error::Internal(format!("copy transport: rank {rank} or peer {peer} outside a group of {n}")));
    }
    let index = ((rank * n + peer) * roles + role as usize) * ring + (message % RING) as usize;
    let mut events = crate::sync::lock(EVENTS.get_or_init(Default::default));
    if !events.contains_key(key) {
        events.insert(key.clone(), vec![None; n * n * roles * ring]);
    }
    let slots = events.get_mut(key).ok_or_else(|| Error::Internal("copy transport: no events".into()))?;
    match slots[index] {
        Some(e) => Ok(e),
        None => {
            let e = KeptEvent::new(ordinal, "cuEventCreate (copy transport)")?;
            slots[index] = Some(e);
            Ok(e)
        }
    }
}

/// The copy transport's device side on one stream of a call of rank
/// `rank` of the group `key`, on CUDA device `ordinal`, over the call's `memory`.
pub struct CopyLane<'a, S: Queue> {
    pub key: &'a CommKey,
    pub rank: usize,
    pub ordinal: i32,
    pub stream: &'a S,
    pub memory: &'a CallMemory<'a>,
}

impl<S: Queue> CopyQueue for CopyLane<'_, S> {
    type Event = KeptEvent;
    type Region = PeerRegion;
    fn lend(&mut self, addr: u64, bytes: usize, writable: bool) -> Result<PeerRegion> {
        self.memory.lend(addr, bytes, writable)
    }
    fn ready_event(&mut self, peer: usize, message: u64) -> Result<KeptEvent> {
        event(self.key, self.rank, peer, Role::Ready, message, self.ordinal)
    }
    fn copied_event(&mut self, peer: usize, message: u64) -> Result<KeptEvent> {
        event(self.key, self.rank, peer, Role::Copied, message, self.ordinal)
    }
    fn record(&mut self, e: KeptEvent) -> Result<()> {
        e.record(self.stream, "cuEventRecord (copy transport)")
    }
    fn wait(&mut self, e: KeptEvent) -> Result<()> {
        e.wait_on(self.stream)
    }
    fn copy(&mut self, dst: PeerRegion, src: u64, bytes: usize) -> Result<()> {
        driver::copy_to_peer(self.stream, dst, src, bytes, self.memory)
    }
    fn pull(&mut self, dst: u64, src: PeerRegion, bytes: usize) -> Result<()> {
        driver::copy_from_peer(self.stream, dst, src, bytes, self.memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_serve_only_groups_of_this_process() {
        let remote = [Some(0), None];
        assert_eq!(choose(Transport::Auto, &remote).unwrap(), Chosen::Nccl);
        assert_eq!(choose(Transport::Nccl, &[Some(0), Some(0)]).unwrap(), Chosen::Nccl);
        let e = choose(Transport::Copies, &remote).unwrap_err();
        assert!(matches!(&e, Error::Unimplemented(m) if m.contains("other processes")), "{e}");
        // Several ranks on one device need no peer access (and no driver).
        assert_eq!(choose(Transport::Copies, &[Some(0), Some(0), Some(0)]).unwrap(), Chosen::Copies);
        assert_eq!(choose(Transport::Auto, &[Some(0), Some(0)]).unwrap(), Chosen::Copies);
    }
}
