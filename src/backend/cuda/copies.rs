//! The copy-engine transport: a plan's `Exchange` step as device-to-device
//! copies between ranks of one process, ordered by events across devices,
//! instead of NCCL's kernels (which take SMs from the overlapped GEMMs).
//!
//! Per ordered pair of ranks (sender `s`, receiver `r`), the `m`-th message
//! goes in three moves, each rank's host handling its exchange steps in
//! plan order:
//! 1. `r` records its *ready* event on its communication stream (its slot is
//!    free: every earlier use of it is before this point in stream order)
//!    and posts a [`Want`]: where the message goes, its bytes, the event.
//! 2. `s` takes the want, makes its stream wait for the ready event, copies
//!    its buffer into `r`'s, records its *copied* event and posts it.
//! 3. `r` takes the copied event and makes its stream wait for it.
//!
//! So each exchange completes on both streams as an NCCL group does (a
//! sender's stream passes it once the data left, a receiver's once it
//! arrived), and the plans' dependencies hold unchanged. The copy runs on
//! the sender's stream, so its source stays untouched until it ran.
//!
//! Events are reused in a ring of [`RING`] per pair and direction: message
//! `m + RING` re-records the event of message `m` only after the other side
//! enqueued its wait on it. The receiver takes copied `m` in the step of
//! message `m`, before it posts any later want, and the sender records
//! copied `m + RING` only after taking want `m + RING`, posted in a later
//! step when no step holds more than `RING` messages of one pair
//! (checked). Likewise for the ready events.
//!
//! Every host wait is bounded by the call's deadline and names the rank
//! that did not post; a rank that fails ends its peers' waits at once with
//! its error (`Mailbox::fail`). Pure: the device side is a [`CopyQueue`]
//! (the CUDA driver in `enqueue`, the model in `emulate`).
#![forbid(unsafe_code)]

use super::addresses::P2p;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Events per pair and direction, reused in turn.
pub const RING: u64 = 4;

/// Where a message goes: posted by its receiver (`region`, lent for the copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Want<E, R> {
    /// The call it belongs to (`CallId`): a sender in another call refuses it.
    pub call: CallId,
    pub region: R,
    pub bytes: usize,
    /// Recorded where the receiver's buffer is free to be written.
    pub ready: E,
}

/// One rank's device side of an exchange: its communication stream and its
/// events of the copy transport.
pub trait CopyQueue {
    /// An event the other ranks' hosts may wait on.
    type Event: Copy;
    /// This rank's memory as another rank's copy may write it.
    type Region: Copy;
    /// Lends `bytes` bytes at `addr` (this rank's) to a peer's copy into it
    /// (`writable`) or out of it.
    fn lend(&mut self, addr: u64, bytes: usize, writable: bool) -> Result<Self::Region>;
    /// This rank's ready event for message `message` from `peer`.
    fn ready_event(&mut self, peer: usize, message: u64) -> Result<Self::Event>;
    /// This rank's copied event for message `message` to `peer`.
    fn copied_event(&mut self, peer: usize, message: u64) -> Result<Self::Event>;
    fn record(&mut self, event: Self::Event) -> Result<()>;
    fn wait(&mut self, event: Self::Event) -> Result<()>;
    /// Copies `bytes` bytes from `src` (this rank's) to `dst` (the receiver's).
    fn copy(&mut self, dst: Self::Region, src: u64, bytes: usize) -> Result<()>;
    /// Copies `bytes` bytes from `src` (a sender's) into `dst` (this rank's).
    fn pull(&mut self, dst: u64, src: Self::Region, bytes: usize) -> Result<()>;
}

impl<E, R> Want<E, R> {
    /// Ok when this post of rank `from` (`(from, me)`) is of `me`'s call and
    /// as large as `me` expects message `message` to be.
    fn check(&self, call: CallId, bytes: usize, (from, me): (usize, usize), message: u64) -> Result<()> {
        if self.call != call {
            return Err(Error::Internal(format!(
                "copy transport: rank {from} posted message {message} of call {:?}, rank {me} is in {call:?}",
                self.call
            )));
        }
        if self.bytes != bytes {
            return Err(Error::Internal(format!(
                "copy transport: rank {from} posted {} bytes as message {message}, rank {me} expects {bytes}",
                self.bytes
            )));
        }
        Ok(())
    }
}

/// Which call of the group an exchange belongs to: its call site and XLA's
/// run id (the same on every rank of one execution), so that ranks of
/// different calls never pair their messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallId {
    pub site: i64,
    pub run: i64,
}

/// When a host wait gives up.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    pub at: Instant,
    /// `config::interrupts()` when the call began: a later interrupt ends the wait.
    pub interrupts: u64,
}

type Pair = (usize, usize);

/// Wants or offers of one pair not yet taken, with their message numbers.
type Posts<E, R> = VecDeque<(u64, Want<E, R>)>;

#[derive(Default)]
struct PairState<E, R> {
    /// Wants posted by the receiver and not yet taken, with their message numbers.
    wants: Posts<E, R>,
    copied: VecDeque<(u64, E)>,
    /// Offers of the pull protocol ([`offer`]) not yet pulled, and how many
    /// the sender made so far.
    offers: Posts<E, R>,
    offered: u64,
    /// Messages the receiver asked for, and the sender took, so far.
    wanted: u64,
    taken: u64,
    /// Copied events the sender posted, and the receiver took, so far.
    posted: u64,
    received: u64,
}

struct State<E, R> {
    pairs: HashMap<Pair, PairState<E, R>>,
    /// Per rank, the exchange steps its host has entered: the ranks behind
    /// the others are the ones a timed-out wait names.
    entered: Vec<u64>,
    /// Why the mailbox no longer works (a rank failed or timed out).
    failed: Option<Error>,
}

/// The host side of one group's copy transport: what its ranks post for
/// each other, kept for the group's life (message numbers run across calls).
pub struct Mailbox<E, R> {
    /// The group's device ids, in rank order (for messages).
    pub devices: Vec<i64>,
    state: Mutex<State<E, R>>,
    changed: Condvar,
}

impl<E: Copy, R: Copy> Mailbox<E, R> {
    pub fn new(devices: Vec<i64>) -> Mailbox<E, R> {
        let entered = vec![0; devices.len()];
        Mailbox {
            devices,
            state: Mutex::new(State { pairs: HashMap::new(), entered, failed: None }),
            changed: Condvar::new(),
        }
    }

    /// Ends every wait, now and later, with `error` (the next call of the
    /// group starts over with a new mailbox).
    pub fn fail(&self, error: Error) {
        let mut state = crate::sync::lock(&self.state);
        state.failed.get_or_insert(error);
        self.changed.notify_all();
    }

    /// Counts an exchange step `rank` entered.
    fn enter(&self, rank: usize) {
        if let Some(n) = crate::sync::lock(&self.state).entered.get_mut(rank) {
            *n += 1;
        }
    }

    /// Fails the mailbox with rank `rank`'s error `e`, as the other ranks
    /// report it (the same kind, naming the rank; a deadline as it is).
    pub fn fail_for(&self, rank: usize, e: &Error) {
        let who = self.devices.get(rank).map_or(String::new(), |d| format!(" (device {d})"));
        self.fail(match e {
            Error::DeadlineExceeded(_) => e.clone(),
            other => other.prefixed(&format!("rank {rank}{who} failed: ")),
        });
    }

    /// Whether the mailbox failed.
    pub fn failed(&self) -> bool {
        crate::sync::lock(&self.state).failed.is_some()
    }

    /// Posts `item` from `from` to `to` as the next of its kind (a want or an
    /// offer); returns its message number.
    fn post(&self, from: usize, to: usize, kind: Kind, item: Want<E, R>) -> Result<u64> {
        let mut state = crate::sync::lock(&self.state);
        if let Some(e) = &state.failed {
            return Err(e.clone());
        }
        let (queue, count) = state.pairs.entry((from, to)).or_insert_with(PairState::empty).queue(kind);
        let message = *count;
        *count += 1;
        queue.push_back((message, item));
        self.changed.notify_all();
        Ok(message)
    }

    /// Waits until `take` finds what it looks for in the pair's state, or
    /// the deadline, an interrupt or a failure ends the wait; `missing`
    /// says what never came (naming the rank).
    fn wait_for<T>(
        &self,
        me: usize,
        pair: Pair,
        deadline: Deadline,
        missing: impl Fn(&PairState<E, R>) -> String,
        mut take: impl FnMut(&mut PairState<E, R>) -> Option<T>,
    ) -> Result<T> {
        let mut state = crate::sync::lock(&self.state);
        loop {
            if let Some(e) = &state.failed {
                return Err(e.clone());
            }
            let entry = state.pairs.entry(pair).or_insert_with(PairState::empty);
            if let Some(found) = take(entry) {
                // What was taken (and, for a send, posted) may be what another rank waits for.
                self.changed.notify_all();
                return Ok(found);
            }
            let what = missing(entry);
            let now = Instant::now();
            if now >= deadline.at {
                let mine = state.entered.get(me).copied().unwrap_or(0);
                // The ranks furthest behind hold the others up.
                let least = state.entered.iter().copied().min().unwrap_or(mine);
                let behind: Vec<usize> =
                    (0..state.entered.len()).filter(|&r| least < mine && state.entered[r] == least).collect();
                let devices: Vec<i64> = behind.iter().filter_map(|&r| self.devices.get(r).copied()).collect();
                let why = if behind.is_empty() {
                    String::new()
                } else {
                    format!("; ranks {behind:?} (devices {devices:?}) never got past exchange step {least}, rank {me} is at {mine}")
                };
                return Err(Error::DeadlineExceeded(format!("{what}{why} (group {:?})", self.devices)));
            }
            if crate::config::interrupts() != deadline.interrupts {
                return Err(Error::Interrupted(format!("{what} before an interrupt (SIGINT)")));
            }
            // Short slices, so an interrupt is noticed without a notification.
            let slice = (deadline.at - now).min(Duration::from_millis(50));
            state = self.changed.wait_timeout(state, slice).map_or_else(|p| p.into_inner().0, |(s, _)| s);
        }
    }

    /// Takes the sender's next want from `to` and, under the mailbox's lock,
    /// enqueues its copy with `copy` (which returns the copied event) and
    /// posts the event: a receiver that withdraws its wants
    /// ([`Mailbox::withdraw`]) sees each either untaken or copied.
    fn send(
        &self,
        from: usize,
        to: usize,
        deadline: Deadline,
        copy: impl FnOnce(u64, &Want<E, R>) -> Result<E>,
    ) -> Result<()> {
        let missing =
            |pair: &PairState<E, R>| format!("rank {to} never asked for message {} of rank {from}", pair.taken);
        let mut copy = Some(copy);
        self.wait_for(from, (from, to), deadline, missing, |pair| {
            let (message, want) = pair.wants.pop_front()?;
            pair.taken += 1;
            let copied = copy.take().map_or_else(|| Err(Error::Internal("copied twice".into())), |f| f(message, &want));
            Some(copied.map(|event| {
                pair.posted += 1;
                pair.copied.push_back((message, event));
            }))
        })?
    }

    /// After `to` failed within an exchange step: its wants `posted` (from,
    /// message) are taken back where no sender took them yet, and the
    /// copied events of those already copied are returned, for its stream to
    /// wait on before its buffers go back to XLA.
    fn withdraw(&self, to: usize, posted: &[(usize, u64)]) -> Vec<E> {
        let mut state = crate::sync::lock(&self.state);
        let mut copied = Vec::new();
        for &(from, message) in posted {
            let Some(pair) = state.pairs.get_mut(&(from, to)) else { continue };
            pair.wants.retain(|(m, _)| *m != message);
            if let Some(i) = pair.copied.iter().position(|(m, _)| *m == message) {
                if let Some((_, e)) = pair.copied.remove(i) {
                    copied.push(e);
                }
            }
        }
        copied
    }

    /// The copied event of message `message` from `from`.
    fn take_copied(&self, from: usize, to: usize, message: u64, deadline: Deadline) -> Result<E> {
        let missing = |_: &PairState<E, R>| format!("rank {from} never sent message {message} to rank {to}");
        let (number, event) = self.wait_for(to, (from, to), deadline, missing, |pair| {
            let found = pair.copied.pop_front()?;
            pair.received += 1;
            Some(found)
        })?;
        if number != message {
            return Err(Error::Internal(format!(
                "copy transport: rank {to} expected message {message} from rank {from}, got {number}"
            )));
        }
        Ok(event)
    }
}

/// What a receiver posts (a want of the push protocol) or a sender (an
/// offer of the pull protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Want,
    Offer,
}

impl<E, R> PairState<E, R> {
    /// The queue of `kind` and how many of it were posted so far.
    fn queue(&mut self, kind: Kind) -> (&mut Posts<E, R>, &mut u64) {
        match kind {
            Kind::Want => (&mut self.wants, &mut self.wanted),
            Kind::Offer => (&mut self.offers, &mut self.offered),
        }
    }

    fn empty() -> PairState<E, R> {
        PairState {
            wants: VecDeque::new(),
            copied: VecDeque::new(),
            offers: VecDeque::new(),
            offered: 0,
            wanted: 0,
            taken: 0,
            posted: 0,
            received: 0,
        }
    }
}

/// Which of the protocol's waits to leave out: never, but in the tests that
/// show the model catches a missing dependency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Omit {
    Nothing,
    /// The receiver does not wait for the copy (reads before it landed).
    CopiedWait,
    /// The sender does not wait for the receiver's slot to be free.
    ReadyWait,
}

/// Rank `rank`'s part of one exchange step (`sends` and `recvs` at device
/// addresses: its own buffers), on `queue` (see the module's doc).
pub fn exchange<Q: CopyQueue>(
    mailbox: &Mailbox<Q::Event, Q::Region>,
    call: CallId,
    rank: usize,
    sends: &[P2p],
    recvs: &[P2p],
    queue: &mut Q,
    deadline: Deadline,
) -> Result<()> {
    exchange_omitting(mailbox, call, rank, sends, recvs, queue, deadline, Omit::Nothing)
}

/// [`exchange`], leaving out `omit` (only the tests leave anything out).
#[allow(clippy::too_many_arguments)]
pub fn exchange_omitting<Q: CopyQueue>(
    mailbox: &Mailbox<Q::Event, Q::Region>,
    call: CallId,
    rank: usize,
    sends: &[P2p],
    recvs: &[P2p],
    queue: &mut Q,
    deadline: Deadline,
    omit: Omit,
) -> Result<()> {
    for (list, what) in [(sends, "sends to"), (recvs, "receives from")] {
        for p in list {
            let same = list.iter().filter(|q| q.peer == p.peer).count() as u64;
            if same > RING {
                return Err(Error::Unimplemented(format!(
                    "an exchange step with {same} {what} rank {} (the copy transport takes at most {RING})",
                    p.peer
                )));
            }
        }
    }
    mailbox.enter(rank);
    // The wants this step posted and whose copies it has not waited for yet.
    let mut pending: Vec<(usize, u64)> = Vec::with_capacity(recvs.len());
    let result = (|| {
        // 1. Every receive: the slot is free from here on.
        for r in recvs {
            let (from, to) = (r.peer, rank);
            let message = mailbox.next(from, to, Kind::Want);
            let region = queue.lend(r.addr, r.bytes, true)?;
            let ready = queue.ready_event(from, message)?;
            queue.record(ready)?;
            let posted = mailbox.post(from, to, Kind::Want, Want { call, region, bytes: r.bytes, ready })?;
            if posted != message {
                return Err(Error::Internal(format!("copy transport: want {posted} of rank {to} numbered {message}")));
            }
            pending.push((from, message));
        }
        // 2. Every send: into the receiver's slot once it is free.
        for s in sends {
            // The copied event first: once the copy is enqueued, nothing may
            // fail before its event is recorded and posted (a receiver that
            // fails waits for what was posted).
            let copied = queue.copied_event(s.peer, message_to(mailbox, rank, s.peer))?;
            mailbox.send(rank, s.peer, deadline, |message, want| {
                want.check(call, s.bytes, (s.peer, rank), message)?;
                if omit != Omit::ReadyWait {
                    queue.wait(want.ready)?;
                }
                queue.copy(want.region, s.addr, s.bytes)?;
                queue.record(copied)?;
                Ok(copied)
            })?;
        }
        // 3. Every receive: wait for its copy.
        while let Some(&(from, message)) = pending.first() {
            let copied = mailbox.take_copied(from, rank, message, deadline)?;
            pending.remove(0);
            if omit != Omit::CopiedWait {
                queue.wait(copied)?;
            }
        }
        Ok(())
    })();
    if let Err(e) = &result {
        // Copies already on their way into this rank's buffers are waited
        // for; the others never start.
        for copied in mailbox.withdraw(rank, &pending) {
            let _ = queue.wait(copied);
        }
        // The group's message numbers are now out of step: every rank's
        // waits end, and the next call starts a new mailbox.
        mailbox.fail_for(rank, e);
    }
    result
}

/// The number of the next message from `from` to `to` on the sending side.
fn message_to<E, R>(mailbox: &Mailbox<E, R>, from: usize, to: usize) -> u64 {
    crate::sync::lock(&mailbox.state).pairs.get(&(from, to)).map_or(0, |p| p.taken)
}

/// The pull protocol, for transfers whose source outlives the sender's
/// call (a reshard's send program: Python keeps its `staging` until the
/// receiver's result is ready): the sender records a ready event after its
/// data and posts an offer of its region ([`offer`]), waiting for nobody;
/// the receiver takes the offer, waits for the event and copies into its own
/// buffer on its own stream ([`pull`]). An offer's event may be recorded again
/// for a later offer before the receiver waits on it: the receiver then waits
/// for more of the sender's stream, which never waits for receivers.
pub fn offer<Q: CopyQueue>(
    mailbox: &Mailbox<Q::Event, Q::Region>,
    call: CallId,
    rank: usize,
    sends: &[P2p],
    queue: &mut Q,
) -> Result<()> {
    let result = sends.iter().try_for_each(|s| {
        let region = queue.lend(s.addr, s.bytes, false)?;
        let message = mailbox.next(rank, s.peer, Kind::Offer);
        let ready = queue.ready_event(s.peer, message)?;
        queue.record(ready)?;
        mailbox.post(rank, s.peer, Kind::Offer, Want { call, region, bytes: s.bytes, ready }).map(drop)
    });
    if let Err(e) = &result {
        // Its receivers would wait for offers that never come.
        mailbox.fail_for(rank, e);
    }
    result
}

/// The receiving half of the pull protocol (see [`offer`]): each of `recvs`
/// copied from its sender's offer into this rank's buffer, in plan order.
pub fn pull<Q: CopyQueue>(
    mailbox: &Mailbox<Q::Event, Q::Region>,
    call: CallId,
    rank: usize,
    recvs: &[P2p],
    queue: &mut Q,
    deadline: Deadline,
) -> Result<()> {
    let result = (|| {
        for r in recvs {
            let (message, offer) = mailbox.take_offer(r.peer, rank, deadline)?;
            offer.check(call, r.bytes, (r.peer, rank), message)?;
            queue.wait(offer.ready)?;
            queue.pull(r.addr, offer.region, r.bytes)?;
        }
        Ok(())
    })();
    if let Err(e) = &result {
        mailbox.fail_for(rank, e);
    }
    result
}

impl<E: Copy, R: Copy> Mailbox<E, R> {
    fn take_offer(&self, from: usize, to: usize, deadline: Deadline) -> Result<(u64, Want<E, R>)> {
        let missing = |pair: &PairState<E, R>| format!("rank {from} never offered message {} to rank {to}", pair.taken);
        self.wait_for(to, (from, to), deadline, missing, |pair| {
            let found = pair.offers.pop_front()?;
            pair.taken += 1;
            Some(found)
        })
    }
}

impl<E, R> Mailbox<E, R> {
    /// The number the next post of `kind` from `from` to `to` will have.
    fn next(&self, from: usize, to: usize, kind: Kind) -> u64 {
        crate::sync::lock(&self.state).pairs.get(&(from, to)).map_or(0, |p| match kind {
            Kind::Want => p.wanted,
            Kind::Offer => p.offered,
        })
    }
}

/// The mailboxes of this process's groups, by their devices and purpose
/// (the key of their communicators, `communicators::CommKey`), each made on
/// the group's first call and replaced once it failed.
pub struct Mailboxes<K, E, R> {
    boxes: Mutex<HashMap<K, std::sync::Arc<Mailbox<E, R>>>>,
}

impl<K, E, R> Default for Mailboxes<K, E, R> {
    fn default() -> Self {
        Mailboxes { boxes: Mutex::new(HashMap::new()) }
    }
}

impl<K: std::hash::Hash + Eq + Clone, E: Copy, R: Copy> Mailboxes<K, E, R> {
    /// The live mailbox of `key` (a new one if there is none or it failed).
    pub fn get(&self, key: &K, devices: &[i64]) -> std::sync::Arc<Mailbox<E, R>> {
        let mut boxes = crate::sync::lock(&self.boxes);
        match boxes.get(key) {
            Some(b) if !b.failed() => b.clone(),
            _ => {
                let fresh = std::sync::Arc::new(Mailbox::new(devices.to_vec()));
                boxes.insert(key.clone(), fresh.clone());
                fresh
            }
        }
    }
}
