//! `commfuse.reshard` on GPUs (one process; meshes without a common
//! device): three programs, each one FFI call per device, over NCCL
//! send/receive on a communicator of the union of the two meshes' devices
//! (`CommKey::reshard`: its own, see `communicators::Purpose`).
//!
//! - *connect* (the union's devices, once per pair of meshes): INITIALIZE
//!   creates the communicator and connects every pair of ranks, the one
//!   host wait that needs peers (see `handler`'s module comment), so that
//!   the send and receive programs only enqueue.
//! - *send* (the source mesh): packs the pieces of `x` others need into
//!   `staging` on XLA's stream (copy engines), then posts them in one NCCL
//!   group on the device's reshard stream, forked from XLA's with an event
//!   and not joined back: the sends complete only when the receivers run,
//!   and XLA's stream must go on computing meanwhile. The sends read only
//!   `staging`, a result of the program that Python holds until the
//!   receive program's result is ready (`python/commfuse/_reshard.py`).
//! - *receive* (the destination mesh): on XLA's stream, one NCCL group per
//!   round (forwarding a broadcast chain's chunks), then the copies into
//!   `out`.
//!
//! Both enqueue what `reshard::device` lowers. The watchdog bounds the
//! receive program's groups, as for the fused ops; the sends end with them
//! (a receive that times out aborts the communicator).
//!
//! Over the copy transport (`config::transport`, as for the fused ops: a
//! union of this process's devices with peer access), *connect* only
//! enables peer access; *send* packs, then offers each piece of `staging`
//! with an event recorded after the packing (`copies::offer`, no wait for
//! anyone); *receive* takes each offer, waits for its event and copies the
//! piece into its `staging` on XLA's stream (`copies::pull`, bounded host
//! waits), then unpacks. Reshards go direct there: a broadcast's forwarding
//! would need the forwarder's `staging` after its program ended.
#![forbid(unsafe_code)]

use super::addresses::{check_same_device, poll_until, P2p};
use super::api::require;
use super::communicators::CommKey;
use super::copies::{self, CallId, Deadline};
use super::copy_links::{self, Chosen, CopyLane};
use super::device::{self, Device};
use super::device_watch::{self, CallWatch};
use super::driver::{self, CallMemory, CallStream, Queue};
use super::libs::Lib;
use super::nccl::Comm;
use super::nccl_group::{self, GroupComms};
use crate::error::{Error, Result};
use crate::reshard::attrs::{self, Attrs};
use crate::reshard::device::{check_disjoint, receive_side, send_side, Copy2d, Transfer};
use crate::reshard::{Layout, Plan};
use crate::xla::{Frame, Stage};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Bytes per second and seconds per message `auto` decides on between
/// GPUs: NVLink-class point-to-point (assumed, not yet measured here).
const GPU_LINK: (f64, f64) = (150e9, 15e-6);

/// The connect program (see the module comment).
pub fn connect_handler(frame: &mut Frame<'_>) -> Result<()> {
    let attrs = Attrs::decode(frame)?;
    let stream = CallStream::of(frame)?;
    match frame.stage() {
        Stage::Initialize => {
            require(&[Lib::Driver, Lib::Nvrtc])?;
            let dev = device::bind(&stream)?;
            let (members, chosen) = union_transport(&attrs, true)?;
            if chosen == Chosen::Copies {
                copy_links::enable_peer_access(stream.ordinal, &members)?;
                crate::sync::lock(copy_unions()).insert(attrs.devices.clone());
                return Ok(());
            }
            require(&[Lib::Nccl])?;
            let deadline = Instant::now() + crate::config::timeout()?;
            let (rank, comms) = union_comms(frame, &attrs, &dev, deadline)?;
            let mut d = crate::sync::lock(&dev);
            let connected = comms.connect(rank, &mut d, &stream, deadline);
            if connected.is_err() {
                comms.abort_rank(rank);
                nccl_group::evict(&comms.key, &comms);
            }
            connected
        }
        Stage::Instantiate | Stage::Prepare => {
            Err(Error::Internal(format!("the reshard programs have no {:?} stage", frame.stage())))
        }
        Stage::Execute => {
            let token = frame.device_ret_bytes(0, "connected")?;
            let dev = device::bind_for_execute(&stream)?;
            let d = crate::sync::lock(&dev);
            d.make_current()?;
            driver::zero(&stream, token.addr, token.bytes, &CallMemory::of_frame(frame)?)
        }
    }
}

/// Whether the reshard communicator of the union `devices` exists with
/// every rank live and connected: Python runs the connect program when it
/// does not (the first reshard between two meshes, or after a failure
/// evicted it).
pub fn connected(devices: &[i64]) -> bool {
    let members: Vec<Option<i32>> = devices.iter().map(|&d| i32::try_from(d).ok()).collect();
    let copies = crate::config::transport().and_then(|t| copy_links::choose(t, &members));
    if matches!(copies, Ok(Chosen::Copies)) {
        return crate::sync::lock(copy_unions()).contains(devices);
    }
    nccl_group::cached(&CommKey::reshard(devices.to_vec()))
        .is_some_and(|c| (0..devices.len()).all(|r| c.is_live(r) && c.is_connected(r)))
}

/// The unions whose peer access the connect program set up for copies.
fn copy_unions() -> &'static Mutex<std::collections::HashSet<Vec<i64>>> {
    static UNIONS: OnceLock<Mutex<std::collections::HashSet<Vec<i64>>>> = OnceLock::new();
    UNIONS.get_or_init(Default::default)
}

/// The union's members as this process's CUDA ordinals (a reshard's union
/// is all in this process: its device ids are the ordinals) and its
/// transport: chosen by the connect program (`decide`) and kept, so that
/// its send and receive programs take the same one.
fn union_transport(attrs: &Attrs, decide: bool) -> Result<(Vec<Option<i32>>, Chosen)> {
    let count = device::device_count()?;
    let members = attrs
        .devices
        .iter()
        .map(|&id| match i32::try_from(id) {
            Ok(o) if (0..count).contains(&o) => Ok(Some(o)),
            _ => Err(Error::Unimplemented(format!(
                "reshard between devices of several processes (device {id} is not one of this process's {count})"
            ))),
        })
        .collect::<Result<Vec<_>>>()?;
    let key = CommKey::reshard(attrs.devices.clone());
    let chosen = match copy_links::decided(&key) {
        Some(chosen) if !decide => chosen,
        _ => copy_links::decide(&key, crate::config::transport()?, &members)?,
    };
    Ok((members, chosen))
}

/// Aborts the reshard communicator of the union `devices`, every rank, and
/// evicts it: Python does so when a receive failed, so that sends posted
/// for it can never pair with a later reshard's receives (the next reshard
/// connects a new communicator). Returns whether there was one.
pub fn abort(devices: &[i64]) -> bool {
    let key = CommKey::reshard(devices.to_vec());
    // Copies: offers of the failed reshard must not meet a later one's pulls.
    copy_links::mailbox(&key).fail(Error::DeadlineExceeded(
        "an earlier reshard between these meshes failed; the next one starts afresh".into(),
    ));
    let Some(comms) = nccl_group::cached(&key) else { return false };
    (0..devices.len()).for_each(|r| comms.abort_rank(r));
    nccl_group::evict(&key, &comms);
    true
}

/// The send program (see the module comment).
pub fn send_handler(frame: &mut Frame<'_>) -> Result<()> {
    let Some(call) = ReshardCall::at_execute(frame)? else { return Ok(()) };
    let (x, staging) = (frame.device_arg_bytes(0, "x")?.into(), frame.device_ret_bytes(0, "staging")?.into());
    let side = send_side(&call.planned.layout, &call.planned.plan, call.rank, x, staging)?;
    let xla = CallStream::of(frame)?;
    let memory = CallMemory::of_frame(frame)?;
    if call.chosen == Chosen::Copies {
        return call.with_copies(frame, &xla, &memory, |lane, mailbox| {
            for copy in &side.pack {
                copy_on(copy, &xla, &memory)?;
            }
            let sends: Vec<P2p> =
                side.sends.iter().map(|t| P2p { addr: t.addr, bytes: t.bytes, peer: t.peer }).collect();
            copies::offer(mailbox, call.copy_call(), call.rank, &sends, lane)
        });
    }
    call.enqueue(frame, "reshard send", &xla, &memory, |d, comm| {
        for copy in &side.pack {
            copy_on(copy, &xla, &memory)?;
        }
        if side.sends.is_empty() {
            return Ok(None);
        }
        // The union's reshard stream waits for the packing, then sends on its own.
        let sends = d.reshard_send_stream(&call.attrs.devices)?;
        d.reserve_events(1)?;
        let packed = d.event(0).ok_or_else(|| Error::Internal("no event 0".into()))?;
        // A later record of the event does not affect this wait.
        packed.record(&xla, "cuEventRecord")?;
        packed.wait_on(&*sends)?;
        // Not watched: nothing waits for these sends but the receivers,
        // whose receive program is watched (its timeout aborts the
        // communicator, which ends the sends too); a pipeline may ask for the
        // result long after the send program ran. They read only `staging`,
        // which Python keeps until the receivers finished.
        comm.exchange(&*sends, &side.sends, &[]).map(|()| None)
    })
}

/// The receive program (see the module comment).
pub fn receive_handler(frame: &mut Frame<'_>) -> Result<()> {
    let Some(call) = ReshardCall::at_execute(frame)? else { return Ok(()) };
    let (out, staging) = (frame.device_ret_bytes(0, "out")?.into(), frame.device_ret_bytes(1, "staging")?.into());
    let side = receive_side(&call.planned.layout, &call.planned.plan, call.rank, out, staging)?;
    let xla = CallStream::of(frame)?;
    let memory = CallMemory::of_frame(frame)?;
    if call.chosen == Chosen::Copies {
        let deadline = Deadline { at: call.deadline, interrupts: call.interrupts };
        return call.with_copies(frame, &xla, &memory, |lane, mailbox| {
            for round in &side.rounds {
                if !round.sends.is_empty() {
                    return Err(Error::Internal("reshard over copies: a receiver forwards (planned direct)".into()));
                }
                let recvs: Vec<P2p> =
                    round.recvs.iter().map(|t| P2p { addr: t.addr, bytes: t.bytes, peer: t.peer }).collect();
                copies::pull(mailbox, call.copy_call(), call.rank, &recvs, lane, deadline)?;
            }
            for copy in &side.unpack {
                copy_on(copy, &xla, &memory)?;
            }
            Ok(())
        });
    }
    call.enqueue(frame, "reshard receive", &xla, &memory, |d, comm| {
        let watch = if side.rounds.is_empty() {
            None
        } else {
            comm.watched(d, &xla, |comm| side.rounds.iter().try_for_each(|r| comm.exchange(&xla, &r.sends, &r.recvs)))?
        };
        for copy in &side.unpack {
            copy_on(copy, &xla, &memory)?;
        }
        Ok(watch)
    })
}

/// A plan worked out once per attribute set.
struct Planned {
    layout: Layout,
    plan: Plan,
}

/// Emptied when it holds this many plans.
const PLANS_KEPT: usize = 64;

/// The plan of `attrs` over `chosen`: direct over copies (see the module
/// comment), where an explicit broadcast is UNIMPLEMENTED saying so.
fn planned(attrs: &Attrs, chosen: Chosen) -> Result<Arc<Planned>> {
    static PLANS: OnceLock<Mutex<HashMap<Attrs, Arc<Planned>>>> = OnceLock::new();
    let direct;
    let attrs = match (chosen, attrs.method) {
        (Chosen::Copies, attrs::BROADCAST) => {
            return Err(Error::Unimplemented(
                "reshard(schedule='broadcast') over the copy transport: it moves pieces direct; use \
                 schedule='direct' or 'auto', or commfuse.configure(transport='nccl')"
                    .into(),
            ))
        }
        (Chosen::Copies, attrs::AUTO) => {
            direct = Attrs { method: attrs::DIRECT, ..attrs.clone() };
            &direct
        }
        _ => attrs,
    };
    let plans = PLANS.get_or_init(Default::default);
    if let Some(p) = crate::sync::lock(plans).get(attrs) {
        return Ok(Arc::clone(p));
    }
    let (layout, _, plan) = attrs.plan(GPU_LINK)?;
    check_disjoint(&layout, &attrs.devices)?;
    let p = Arc::new(Planned { layout, plan });
    let mut plans = crate::sync::lock(plans);
    if plans.len() >= PLANS_KEPT {
        plans.clear();
    }
    plans.insert(attrs.clone(), Arc::clone(&p));
    Ok(p)
}

/// The union's communicators (created on first use; all in this process)
/// and this device's rank in them.
fn union_comms(
    frame: &Frame<'_>,
    attrs: &Attrs,
    dev: &Mutex<Device>,
    deadline: Instant,
) -> Result<(usize, Arc<GroupComms>)> {
    let ordinal = frame.device_ordinal()?;
    let rank = attrs.rank_of(i64::from(ordinal))?;
    let d = crate::sync::lock(dev);
    check_same_device(ordinal, d.ordinal)?;
    let (members, _) = union_transport(attrs, false)?;
    let comms = nccl_group::group_comms(&CommKey::reshard(attrs.devices.clone()), &members, None, &d, deadline)?;
    Ok((rank, comms))
}

/// One device's call of the send or receive program.
struct ReshardCall {
    attrs: Attrs,
    planned: Arc<Planned>,
    chosen: Chosen,
    rank: usize,
    site: i64,
    deadline: Instant,
    interrupts: u64,
    timeout: std::time::Duration,
}

impl ReshardCall {
    /// At INITIALIZE, sets up the device (its kernels loaded before any
    /// execution, as for the fused ops) and returns `None`; at EXECUTE, the call.
    fn at_execute(frame: &Frame<'_>) -> Result<Option<ReshardCall>> {
        if frame.stage() == Stage::Initialize {
            device::bind(&CallStream::of(frame)?)?;
            return Ok(None);
        }
        Self::decode(frame).map(Some)
    }

    fn decode(frame: &Frame<'_>) -> Result<ReshardCall> {
        let attrs = Attrs::decode(frame)?;
        let rank = attrs.rank_of(i64::from(frame.device_ordinal()?))?;
        let (_, chosen) = union_transport(&attrs, false)?;
        let planned = planned(&attrs, chosen)?;
        let timeout = crate::config::timeout()?;
        let deadline = Instant::now() + timeout;
        let interrupts = crate::config::interrupts();
        Ok(ReshardCall { attrs, planned, chosen, rank, site: frame.attr_i64("site")?, deadline, interrupts, timeout })
    }

    /// The copy transport's identity of this reshard: its layout pair's call
    /// site, which the send and the receive program share (their XLA runs
    /// differ).
    fn copy_call(&self) -> CallId {
        CallId { site: self.site, run: 0 }
    }

    /// Runs `body` over the copy transport: the device locked and current,
    /// a copy lane on XLA's stream over the call's memory, the union's mailbox.
    fn with_copies(
        &self,
        frame: &Frame<'_>,
        xla: &CallStream<'_>,
        memory: &CallMemory<'_>,
        body: impl FnOnce(&mut CopyLane<'_, CallStream<'_>>, &copy_links::CudaMailbox) -> Result<()>,
    ) -> Result<()> {
        require(&[Lib::Driver])?;
        let dev = device::bind_for_execute(xla)?;
        let ordinal = frame.device_ordinal()?;
        check_same_device(ordinal, crate::sync::lock(&dev).ordinal)?;
        if !crate::sync::lock(copy_unions()).contains(&self.attrs.devices) {
            return Err(Error::Internal(format!(
                "the copy transport of devices {:?} is not set up (commfuse.reshard runs its connect program first)",
                self.attrs.devices
            )));
        }
        let key = CommKey::reshard(self.attrs.devices.clone());
        let mailbox = copy_links::mailbox(&key);
        let d = crate::sync::lock(&dev);
        d.make_current()?;
        let mut lane = CopyLane { key: &key, rank: self.rank, ordinal, stream: xla, memory };
        body(&mut lane, &mailbox)
    }

    /// Runs `body` with the device locked and current and its communicator
    /// (over `memory`, the call's buffers); `body` returns the watch of the
    /// NCCL groups it enqueued on XLA's stream `xla`, which goes to the
    /// watchdog. A communicator that failed is aborted and evicted, as the
    /// fused ops do.
    fn enqueue(
        &self,
        frame: &Frame<'_>,
        op: &'static str,
        xla: &CallStream<'_>,
        memory: &CallMemory<'_>,
        body: impl FnOnce(&mut Device, &UnionComm<'_>) -> Result<Option<CallWatch>>,
    ) -> Result<()> {
        require(&[Lib::Driver, Lib::Nccl])?;
        let dev = device::bind_for_execute(xla)?;
        device_watch::check_device_timeouts(crate::sync::lock(&dev).ordinal)?;
        let ordinal = frame.device_ordinal()?;
        check_same_device(ordinal, crate::sync::lock(&dev).ordinal)?;
        let rank = self.rank;
        // Created and connected by the connect program, never here (no host
        // wait for peers in an EXECUTE call).
        let key = CommKey::reshard(self.attrs.devices.clone());
        let comms = nccl_group::cached(&key).filter(|c| c.is_connected(rank)).ok_or_else(|| {
            Error::Internal(format!(
                "no connected reshard communicator for devices {:?} (commfuse.reshard runs its connect program \
                 before the send program)",
                key.devices
            ))
        })?;
        if !comms.is_live(rank) {
            return Err(Error::DeadlineExceeded(format!(
                "the reshard communicator of devices {:?} was aborted after an earlier reshard between these meshes \
                 failed or timed out; the next commfuse.reshard connects a new one",
                key.devices
            )));
        }
        let comm = UnionComm {
            comms: &comms,
            comm: comms.rank(rank)?,
            memory,
            failed: Cell::new(false),
            deadline: self.deadline,
        };
        let mut d = crate::sync::lock(&dev);
        d.make_current()?;
        let result = match body(&mut d, &comm) {
            Ok(Some(watch)) => watch.submit(xla, op, self.site, rank, self.timeout),
            Ok(None) => {
                // Counted all the same: the watchdog names the ranks that
                // never issued a call by these counts, equal on every rank.
                comms.count_call(rank);
                Ok(())
            }
            Err(e) => Err(e),
        };
        if comm.failed.get() {
            comms.abort_rank(rank);
            nccl_group::evict(&comms.key, &comms);
        }
        result
    }
}

/// A call's communicator of the union.
struct UnionComm<'a> {
    comms: &'a Arc<GroupComms>,
    comm: &'a Comm,
    /// The memory the call's transfers may touch.
    memory: &'a CallMemory<'a>,
    /// Set when an NCCL group failed or timed out: the call aborts the communicator.
    failed: Cell<bool>,
    deadline: Instant,
}

impl UnionComm<'_> {
    /// Runs `groups` (the call's NCCL groups on `stream`) under a device-side
    /// watch; returns the watch to submit, or gives its events back.
    fn watched(
        &self,
        d: &Device,
        stream: &impl Queue,
        groups: impl FnOnce(&Self) -> Result<()>,
    ) -> Result<Option<CallWatch>> {
        let watch = CallWatch::begin(d, stream, self.comms, 0)?;
        match groups(self) {
            Ok(()) => Ok(Some(watch)),
            Err(e) => {
                watch.cancel();
                Err(e)
            }
        }
    }

    /// One NCCL group of sends and receives on `stream`, waited for (host
    /// side, bounded) until NCCL has taken it.
    fn exchange(&self, stream: &impl Queue, sends: &[Transfer], recvs: &[Transfer]) -> Result<()> {
        let p2p = |t: &Transfer| P2p { addr: t.addr, bytes: t.bytes, peer: t.peer };
        let posted = self.comm.exchange(stream, sends.iter().map(p2p), recvs.iter().map(p2p), self.memory);
        let taken = posted.and_then(|()| {
            poll_until(self.deadline, "a reshard's NCCL group (a peer may not have joined)", || {
                self.comm.probe("reshard")
            })
        });
        if taken.is_err() {
            self.failed.set(true);
        }
        taken
    }
}

/// Enqueues one of the lowering's copies on `stream`, inside `memory`.
fn copy_on(copy: &Copy2d, stream: &impl Queue, memory: &CallMemory<'_>) -> Result<()> {
    driver::copy_2d(stream, copy, memory)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::driver::{synchronize, Context, DeviceMemory, Stream};
    use crate::reshard::device::{Buffer, Round};
    use crate::reshard::tests::filled;
    use crate::reshard::{plan, Method, Region};
    use std::time::Duration;

    /// Rank `rank`'s part of `layout` on `xla`, as the handlers enqueue it
    /// (without XLA: the test's own stream and memory): packs its source
    /// tile and hands the pieces to `send`; for its destination tile, hands
    /// each round to `receive`, then unpacks. Waits for the stream; returns
    /// the destination tile, if it has one, and every allocation, which the
    /// caller keeps as long as a peer may still read them.
    fn run_sides(
        layout: &Layout,
        plan: &Plan,
        rank: usize,
        xla: &CallStream<'_>,
        send: impl FnOnce(&CallMemory<'_>, &[Transfer]),
        mut receive: impl FnMut(&CallMemory<'_>, &Round),
    ) -> (Option<Vec<u8>>, Vec<DeviceMemory>) {
        let memory = |bytes: &[u8]| DeviceMemory::with(bytes, "cuMemAlloc (test)").unwrap();
        let buffer = |m: &DeviceMemory| Buffer { addr: m.addr(), bytes: m.bytes() };
        let mut kept = vec![];
        if let Some(tile) = &layout.src[rank] {
            let (x, staging) = (memory(&filled(layout, tile)), memory(&vec![0xee; layout.bytes(tile)]));
            let side = send_side(layout, plan, rank, buffer(&x), buffer(&staging)).unwrap();
            let owned = CallMemory::of_owned(&[&x, &staging]);
            side.pack.iter().for_each(|c| copy_on(c, xla, &owned).unwrap());
            send(&owned, &side.sends);
            drop(owned);
            kept.extend([x, staging]);
        }
        let out = layout.dst[rank].as_ref().map(|tile| {
            let (out, staging) = (memory(&vec![0xee; layout.bytes(tile)]), memory(&vec![0xee; layout.bytes(tile)]));
            let side = receive_side(layout, plan, rank, buffer(&out), buffer(&staging)).unwrap();
            let owned = CallMemory::of_owned(&[&out, &staging]);
            side.rounds.iter().for_each(|round| receive(&owned, round));
            side.unpack.iter().for_each(|c| copy_on(c, xla, &owned).unwrap());
            drop(owned);
            kept.push(staging);
            out
        });
        // The test (not the hot path) waits for its stream.
        synchronize(xla).unwrap();
        let tile = out.as_ref().map(|o| o.read(o.bytes()).unwrap());
        kept.extend(out);
        (tile, kept)
    }

    /// Rank `rank`'s part of `layout` on CUDA device `rank` over NCCL.
    fn run_rank(layout: &Layout, plan: &Plan, rank: usize) -> Option<Vec<u8>> {
        let context = Context::primary(rank as i32).unwrap();
        context.make_current().unwrap();
        let stream = Stream::new().unwrap();
        let xla = CallStream::playing_xla(&stream).unwrap();
        let dev = device::bind(&xla).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let members: Vec<Option<i32>> = (0..layout.ranks() as i32).map(Some).collect();
        let key = CommKey::reshard((0..layout.ranks() as i64).collect());
        let comms = nccl_group::group_comms(&key, &members, None, &crate::sync::lock(&dev), deadline).unwrap();
        comms.connect(rank, &mut crate::sync::lock(&dev), &xla, deadline).unwrap();
        fn union<'m>(
            comms: &'m Arc<GroupComms>,
            rank: usize,
            memory: &'m CallMemory<'m>,
            deadline: Instant,
        ) -> UnionComm<'m> {
            UnionComm { comms, comm: comms.rank(rank).unwrap(), memory, failed: Cell::new(false), deadline }
        }
        let (tile, _kept) = run_sides(
            layout,
            plan,
            rank,
            &xla,
            |owned, sends| union(&comms, rank, owned, deadline).exchange(&xla, sends, &[]).unwrap(),
            |owned, round| union(&comms, rank, owned, deadline).exchange(&xla, &round.sends, &round.recvs).unwrap(),
        );
        tile
    }

    /// Rank `rank`'s part of `layout` over the copy transport, every rank
    /// on GPU 0: the source offers, the destination pulls. Each rank keeps
    /// its memory until every rank is done (`done`): an offer is read by its
    /// receiver after the sender's call returned, as `commfuse.reshard`'s
    /// staging outlives its send program.
    fn run_rank_over_copies(layout: &Layout, plan: &Plan, rank: usize, done: &std::sync::Barrier) -> Option<Vec<u8>> {
        use crate::backend::cuda::copies::{self, Deadline};
        let context = Context::primary(0).unwrap();
        context.make_current().unwrap();
        let stream = Stream::new().unwrap();
        let xla = CallStream::playing_xla(&stream).unwrap();
        let deadline =
            Deadline { at: Instant::now() + Duration::from_secs(60), interrupts: crate::config::interrupts() };
        let key = CommKey::reshard((8000..8000 + layout.ranks() as i64).collect());
        let mailbox = copy_links::mailbox(&key);
        let call = CallId { site: 0x5e50, run: 0 };
        let p2p = |list: &[Transfer]| {
            list.iter().map(|t| P2p { addr: t.addr, bytes: t.bytes, peer: t.peer }).collect::<Vec<_>>()
        };
        let (tile, kept) = run_sides(
            layout,
            plan,
            rank,
            &xla,
            |owned, sends| {
                let mut lane = CopyLane { key: &key, rank, ordinal: 0, stream: &xla, memory: owned };
                copies::offer(&mailbox, call, rank, &p2p(sends), &mut lane).unwrap();
            },
            |owned, round| {
                assert!(round.sends.is_empty(), "a direct plan forwards");
                let mut lane = CopyLane { key: &key, rank, ordinal: 0, stream: &xla, memory: owned };
                copies::pull(&mailbox, call, rank, &p2p(&round.recvs), &mut lane, deadline).unwrap();
            },
        );
        done.wait();
        drop(kept);
        tile
    }

    /// Layouts between ranks that all live on GPU 0, over the copy
    /// transport (direct, as reshards over copies go): 4 source ranks with
    /// rows to 4 destination ranks with columns, rows and replicas, and the
    /// reverse; every tile as the planner's.
    #[test]
    #[ignore = "needs a CUDA GPU: scripts/gpu_device_check.sh runs it"]
    fn ranks_on_one_gpu_move_layouts_over_copies_as_the_planner_says() {
        require(&[Lib::Driver, Lib::Nvrtc]).unwrap();
        let half = 4;
        let (rows, cols) = (16 * half, 8 * half);
        let tile = |r: (usize, usize), c: (usize, usize)| Some(Region { start: vec![r.0, c.0], end: vec![r.1, c.1] });
        let split = |i: usize, n: usize| (i * n / half, (i + 1) * n / half);
        let by_rows: Vec<_> = (0..half).map(|i| tile(split(i, rows), (0, cols))).collect();
        let others: [Vec<Option<Region>>; 3] = [
            (0..half).map(|i| tile((0, rows), split(i, cols))).collect(),
            by_rows.clone(),
            (0..half).map(|_| tile((0, rows), (0, cols))).collect(),
        ];
        let none = || (0..half).map(|_| None::<Region>);
        for other in others {
            for (src, dst) in [(by_rows.clone(), other.clone()), (other.clone(), by_rows.clone())] {
                let src: Vec<_> = src.into_iter().chain(none()).collect();
                let dst: Vec<_> = none().chain(dst).collect();
                let layout = Layout::new(vec![rows, cols], 4, src, dst).unwrap();
                let plan = plan(&layout, Method::Direct);
                let done = std::sync::Barrier::new(2 * half);
                let outs: Vec<Option<Vec<u8>>> = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..2 * half)
                        .map(|r| {
                            let (layout, plan, done) = (&layout, &plan, &done);
                            s.spawn(move || run_rank_over_copies(layout, plan, r, done))
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (rank, out) in outs.into_iter().enumerate() {
                    if let Some(tile) = &layout.dst[rank] {
                        assert!(out.unwrap() == filled(&layout, tile), "rank {rank} of {layout:?}");
                    }
                }
            }
        }
    }

    /// Rows over the first half of the local GPUs to columns, rows and
    /// replicas over the second half, each method, one thread per GPU (as
    /// XLA runs them); every tile as the planner's.
    #[test]
    #[ignore = "needs 2 or more CUDA GPUs: scripts/gpu_device_check.sh runs it where there are"]
    fn gpus_move_layouts_as_the_planner_says() {
        require(&[Lib::Driver, Lib::Nccl, Lib::Nvrtc]).unwrap();
        let half = (device::device_count().unwrap() / 2).min(4) as usize;
        assert!(half >= 1, "this test needs 2 or more CUDA GPUs");
        let (rows, cols) = (16 * half, 8 * half);
        let tile = |r: (usize, usize), c: (usize, usize)| Some(Region { start: vec![r.0, c.0], end: vec![r.1, c.1] });
        let split = |i: usize, of: usize, n: usize| (i * n / of, (i + 1) * n / of);
        let src: Vec<_> =
            (0..half).map(|i| tile(split(i, half, rows), (0, cols))).chain((0..half).map(|_| None)).collect();
        let dsts: [Vec<Option<Region>>; 3] = [
            (0..half).map(|i| tile((0, rows), split(i, half, cols))).collect(),
            (0..half).map(|i| tile(split(i, half, rows), (0, cols))).collect(),
            (0..half).map(|_| tile((0, rows), (0, cols))).collect(),
        ];
        for dst in dsts {
            let dst: Vec<_> = (0..half).map(|_| None).chain(dst).collect();
            let layout = Layout::new(vec![rows, cols], 4, src.clone(), dst).unwrap();
            for method in [Method::Direct, Method::Broadcast { chunk_bytes: 256 }] {
                let plan = plan(&layout, method);
                let outs: Vec<Option<Vec<u8>>> = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..2 * half)
                        .map(|r| {
                            s.spawn({
                                let (layout, plan) = (&layout, &plan);
                                move || run_rank(layout, plan, r)
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (rank, out) in outs.into_iter().enumerate() {
                    if let Some(tile) = &layout.dst[rank] {
                        assert!(out.unwrap() == filled(&layout, tile), "{method:?}: rank {rank} of {layout:?}");
                    }
                }
            }
        }
    }
}
