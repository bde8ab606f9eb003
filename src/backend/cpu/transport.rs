//! In-process point-to-point transfers between the device calls of one
//! execution. The N calls of one op meet in a session keyed by their group,
//! call site, run id and how many times this site already ran in this run
//! (a site inside `lax.scan` runs once per iteration). Messages are
//! [`Block`]s: pooled buffers shared by reference, so a send hands its block
//! over without copying it and a receive gets the very block that was sent,
//! which the backend reads where it landed (a gathered block is multiplied by
//! one rank while it is forwarded to the next; the bytes are never copied
//! on the way). A receive waits for its message, with the call's deadline.
//! Under a link model (`link`), the sender stamps each message with the time
//! it arrives under the model, and the receiver sleeps until then.
#![forbid(unsafe_code)]

#[path = "link.rs"]
pub mod link;

use crate::activity::{self, CallIdentity};
use crate::error::{duration_text, Error, Result};
use crate::exec::Wait;
use crate::plan::Tag;
use crate::sync::lock;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Identifies the N calls that make up one op execution.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    /// Device ids of the group, in rank order.
    pub group: Vec<i64>,
    pub site: i64,
    pub run: i64,
    pub sequence: u64,
}

/// One rank's part in a session: for its waits and error messages.
#[derive(Debug, Clone)]
pub struct Participant {
    pub op: &'static str,
    pub rank: usize,
    /// How long a wait lasts with no rank of the session moving.
    pub timeout: Duration,
    /// `config::interrupts()` when the call began: a later interrupt ends its waits.
    pub interrupts: u64,
}

type MailboxKey = (usize, usize, Tag); // (to, from, tag)

/// The bytes of a message or of a backend slot: a pooled buffer of 8-byte
/// words (so any element type is aligned), back in the pool when dropped.
pub struct Block {
    words: Vec<u64>,
    len: usize,
}

impl Block {
    /// A block of `len` bytes; its contents are whatever the pool held.
    pub fn new(len: usize) -> Block {
        Block { words: pool::take(len), len }
    }

    /// A new block holding a copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> Block {
        let mut block = Block::new(bytes.len());
        block.bytes_mut().copy_from_slice(bytes);
        block
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.len]
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        pool::give_back(std::mem::take(&mut self.words));
    }
}

/// A block as messages carry it: shared read-only by every holder.
pub type Shared = Arc<Block>;

/// A message in a mailbox: its block, and when it has arrived under the link model.
struct Message {
    block: Shared,
    arrival: Option<Instant>,
}

struct State {
    arrived: Vec<bool>,
    active: usize,
    left: usize,
    /// The first rank that failed and its error: waiting peers end at once
    /// with it, and late ranks will not be served.
    failure: Option<(usize, Error)>,
    /// Backend steps under way on any rank (matmuls, sums, conversions):
    /// while one runs the op is moving, however long it takes.
    computing: usize,
    /// When each rank last moved (joined, sent, received, finished a step);
    /// `None` for a rank that never arrived.
    moved: Vec<Option<Instant>>,
    /// When any rank last moved.
    last_moved: Instant,
    mailbox: HashMap<MailboxKey, Message>,
}

impl State {
    fn mark(&mut self, rank: usize, now: Instant) {
        self.moved[rank] = Some(now);
        self.last_moved = self.last_moved.max(now);
    }
}

struct Session {
    state: Mutex<State>,
    /// Per rank, signalled when a message for it is posted or the session
    /// fails: a send wakes its receiver only, not every waiting rank.
    delivered: Vec<Condvar>,
}

impl Session {
    /// Wakes every waiting rank: the session failed, each must see it.
    fn wake_all(&self) {
        for delivered in &self.delivered {
            delivered.notify_all();
        }
    }
}

/// One rank's handle on its session; leaving (drop) tidies the session up.
pub struct Endpoint {
    key: SessionKey,
    session: Arc<Session>,
    info: Participant,
    link: Option<link::LinkModel>,
    /// Where the ranks sit on the link model's devices, when a device has
    /// more than one rank in the session (`with_link_positions`).
    positions: Option<Arc<LinkPositions>>,
}

/// The devices the link model connects, in ring order, and per rank of a
/// session the index of its device among them.
#[derive(Debug)]
pub struct LinkPositions {
    pub devices: Vec<i64>,
    pub of_rank: Vec<usize>,
}

fn registry() -> &'static Mutex<HashMap<SessionKey, Arc<Session>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<SessionKey, Arc<Session>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Per (device, call site): the last run seen and how often the site ran in it.
/// (device, call site) -> (run id, calls so far in that run).
type SequenceCounts = HashMap<(i64, i64), (i64, u64)>;

pub fn next_sequence(device: i64, site: i64, run: i64) -> u64 {
    static COUNTS: OnceLock<Mutex<SequenceCounts>> = OnceLock::new();
    let mut counts = lock(COUNTS.get_or_init(Default::default));
    let entry = counts.entry((device, site)).or_insert((run, 0));
    if entry.0 == run {
        let sequence = entry.1;
        entry.1 += 1;
        sequence
    } else {
        *entry = (run, 1);
        0
    }
}

impl Endpoint {
    pub fn join(key: SessionKey, info: Participant) -> Endpoint {
        let n = key.group.len();
        let now = Instant::now();
        let session = lock(registry())
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(Session {
                    state: Mutex::new(State {
                        arrived: vec![false; n],
                        active: 0,
                        left: 0,
                        failure: None,
                        computing: 0,
                        moved: vec![None; n],
                        last_moved: now,
                        mailbox: HashMap::new(),
                    }),
                    delivered: (0..n).map(|_| Condvar::new()).collect(),
                })
            })
            .clone();
        {
            let mut state = lock(&session.state);
            state.arrived[info.rank] = true;
            state.active += 1;
            // Waiters re-read `last_moved` when their sleep ends: nobody to wake.
            state.mark(info.rank, now);
        }
        Endpoint { key, session, info, link: None, positions: None }
    }

    /// Throttles this endpoint's sends by `link` (see `link`); `None` is full speed.
    pub fn with_link(mut self, link: Option<link::LinkModel>) -> Endpoint {
        self.link = link;
        self
    }

    /// Whether sends are throttled by a link model (transfers then take time to overlap).
    pub fn link_modelled(&self) -> bool {
        self.link.is_some()
    }

    /// The link model sees rank r on device `positions.devices[positions.of_rank[r]]`
    /// instead of on the session group's device r (a reshard's send and
    /// receive parts of one device share its ports).
    pub fn with_link_positions(mut self, positions: Arc<LinkPositions>) -> Endpoint {
        self.positions = Some(positions);
        self
    }

    /// Runs one local step (a matmul, a sum, a conversion): while it runs
    /// the session counts as moving, so peers waiting for this rank's next
    /// message do not time out however long the step computes.
    pub fn compute<T>(&self, step: impl FnOnce() -> T) -> T {
        /// Ends the step even if it panics, so the count cannot stay raised.
        struct Computing<'a>(&'a Endpoint);
        impl Drop for Computing<'_> {
            fn drop(&mut self) {
                let mut state = lock(&self.0.session.state);
                state.computing -= 1;
                // A waiter whose sleep ends at the session's expiry re-reads
                // `last_moved` then: waking every waiter at every step's end
                // would cost each rank a switch per peer step for nothing.
                state.mark(self.0.info.rank, Instant::now());
            }
        }
        lock(&self.session.state).computing += 1;
        let _computing = Computing(self);
        step()
    }

    /// Hands `block` over to rank `to` (no copy: the receiver gets this
    /// block). Under the link model the transfer starts at `ready` (see
    /// `exec::Wait::ready`), at most now.
    pub fn send(&self, to: usize, tag: Tag, block: Shared, ready: Instant) {
        let now = Instant::now();
        let posted = ready.min(now);
        let (devices, from, to_at) = match &self.positions {
            Some(p) => (&p.devices, p.of_rank[self.info.rank], p.of_rank[to]),
            None => (&self.key.group, self.info.rank, to),
        };
        // A message to a rank on the same device is a memory copy, not a transfer.
        let linked = self.link.filter(|_| devices[from] != devices[to_at]);
        let arrival = linked.map(|l| l.arrival(posted, devices, from, to_at, block.len()));
        let message = Message { block, arrival };
        let mut state = lock(&self.session.state);
        state.mark(self.info.rank, now);
        if state.failure.is_some() {
            return; // nobody will read it (the block drops outside the lock)
        }
        let previous = state.mailbox.insert((to, self.info.rank, tag), message);
        drop(state);
        // A stale message (only after a failure) is dropped outside the lock.
        drop(previous);
        self.session.delivered[to].notify_all();
    }

    /// Waits for the message and returns its block, `len` bytes, and when it
    /// arrived (under the link model, when the model says, else now).
    ///
    /// The wait fails when no rank of the session has moved for the
    /// timeout and none is computing, not when the op as a whole runs
    /// long; at once when another rank failed or `wait` is cancelled.
    pub fn recv(&self, from: usize, tag: Tag, len: usize, wait: &Wait) -> Result<(Shared, Instant)> {
        let key = (self.info.rank, from, tag);
        let started = Instant::now();
        let mut state = lock(&self.session.state);
        let (message, arrived) = loop {
            let now = Instant::now();
            // A message under the link model is there once it has arrived.
            let arrival = state.mailbox.get(&key).map(|m| m.arrival.filter(|&a| a > now));
            if let Some(None) = arrival {
                let message = state.mailbox.remove(&key).expect("present");
                state.mark(self.info.rank, now);
                break (message.block, message.arrival.unwrap_or(now));
            }
            if wait.cancelled() {
                return Err(Error::Internal("cancelled because another lane failed".into()));
            }
            if let Some((rank, error)) = &state.failure {
                return Err(self.peer_failed(*rank, error));
            }
            if crate::config::interrupts() != self.info.interrupts {
                let error = self.interrupted();
                state.failure = Some((self.info.rank, error.clone()));
                self.session.wake_all();
                return Err(error);
            }
            let expires = state.last_moved + self.info.timeout;
            if state.computing == 0 && now >= expires {
                let error = self.timeout(&state, from, tag, now - started);
                state.failure = Some((self.info.rank, error.clone()));
                self.session.wake_all();
                return Err(error);
            }
            // Sleep until the message arrives or the session would expire,
            // waking now and then to notice a cancellation or an interrupt.
            let mut slice = Duration::from_millis(50);
            if state.computing == 0 {
                slice = slice.min(expires - now);
            }
            if let Some(Some(at)) = arrival {
                slice = slice.min(at - now);
            }
            state = crate::sync::wait_timeout(&self.session.delivered[self.info.rank], state, slice).0;
        };
        drop(state);
        if message.len() != len {
            return Err(Error::Internal(format!(
                "message from rank {from} has {} bytes, expected {len}",
                message.len()
            )));
        }
        Ok((message, arrived))
    }

    /// The op failed on this rank with `error`: peers waiting for it end at
    /// once with it, late peers will not be served, so the session is
    /// dropped once those who came have left.
    pub fn fail(&self, error: &Error) {
        let mut state = lock(&self.session.state);
        if state.failure.is_none() {
            state.failure = Some((self.info.rank, error.clone()));
        }
        drop(state);
        self.session.wake_all();
    }

    /// "op (call site s, run r): rank i of n (device d)".
    fn who(&self) -> String {
        let SessionKey { group, site, run, .. } = &self.key;
        let rank = self.info.rank;
        format!(
            "{} (call site {site}, run {run}): rank {rank} of {} (device {})",
            self.info.op,
            group.len(),
            group[rank]
        )
    }

    /// This rank ends because `rank` failed first: the same kind of error,
    /// with that rank's message.
    fn peer_failed(&self, rank: usize, error: &Error) -> Error {
        let message = format!(
            "{} stopped: rank {rank} (device {}) failed first: {}",
            self.who(),
            self.key.group[rank],
            error.message()
        );
        match error {
            Error::InvalidArgument(_) => Error::InvalidArgument(message),
            Error::Unimplemented(_) => Error::Unimplemented(message),
            Error::DeadlineExceeded(_) => Error::DeadlineExceeded(message),
            Error::Internal(_) => Error::Internal(message),
            Error::Interrupted(_) => Error::Interrupted(message),
        }
    }

    fn interrupted(&self) -> Error {
        Error::Interrupted(format!("{} stopped waiting: the process was interrupted (SIGINT)", self.who()))
    }

    fn timeout(&self, state: &State, from: usize, tag: Tag, waited: Duration) -> Error {
        let group = &self.key.group;
        let now = Instant::now();
        let missing: Vec<usize> = (0..group.len()).filter(|&r| !state.arrived[r]).collect();
        let devices: Vec<i64> = missing.iter().map(|&r| group[r]).collect();
        let idle = |r: usize| state.moved[r].map_or(0.0, |t| (now - t).as_secs_f64());
        let why = if missing.is_empty() {
            format!(
                "every rank arrived, so rank {from} failed or stalled before step {} (it last moved {} ago)",
                tag.step,
                duration_text(idle(from))
            )
        } else {
            // Where the missing devices are, as far as this process knows;
            // why they are there (a branch, a stalled runtime, another
            // program) it cannot tell, so it does not guess.
            let this_call = CallIdentity {
                kind: self.info.op,
                site: self.key.site,
                run: Some(self.key.run),
                sequence: self.key.sequence,
            };
            format!(
                "ranks {missing:?} (devices {devices:?}) never arrived: {}",
                activity::describe_missing(&devices, &this_call)
            )
        };
        Error::DeadlineExceeded(format!(
            "{} waited {} for rank {from} (device {}), and no rank of the group moved for {}; {why}. \
             Every rank of the group must reach the op; if they are only slow, raise the deadline with \
             COMMFUSE_TIMEOUT_S / commfuse.configure(timeout_s=...)",
            self.who(),
            duration_text(waited.as_secs_f64()),
            group[from],
            duration_text(self.info.timeout.as_secs_f64()),
        ))
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let mut registry = lock(registry());
        let mut state = lock(&self.session.state);
        state.active -= 1;
        state.left += 1;
        // A rank that only sends may leave before its peers arrive: its
        // messages wait for them. After a failure nobody will read them: they
        // go once those who came have gone, but the session stays (empty)
        // until every rank came and went, so a late rank meets the failure at
        // once instead of a new session it would wait in until the deadline.
        if state.failure.is_some() && state.active == 0 {
            state.mailbox.clear();
        }
        if state.left == self.key.group.len() {
            state.mailbox.clear();
            if registry.get(&self.key).is_some_and(|s| Arc::ptr_eq(s, &self.session)) {
                registry.remove(&self.key);
            }
        }
    }
}

/// Drops the sessions of call site `site` and run `run` that nobody is in:
/// messages posted by ranks that only send (the send part of a reshard)
/// for receivers that will never come. Returns how many it dropped.
pub fn abandon(site: i64, run: i64) -> usize {
    let mut registry = lock(registry());
    let before = registry.len();
    registry.retain(|key, session| key.site != site || key.run != run || lock(&session.state).active > 0);
    before - registry.len()
}

/// Message buffers, reused across calls so the hot path does not allocate
/// once the pool holds enough of them. Words keep them 8-byte aligned. The
/// pool keeps at most 256 buffers and 1 GiB in all: a process that once
/// moved huge blocks does not hold on to them for ever.
mod pool {
    use super::lock;
    use std::sync::{Mutex, OnceLock};

    struct Pool {
        buffers: Vec<Vec<u64>>,
        bytes: usize,
        keep: usize,
        keep_bytes: usize,
    }

    impl Pool {
        fn new(keep: usize, keep_bytes: usize) -> Pool {
            Pool { buffers: Vec::new(), bytes: 0, keep, keep_bytes }
        }

        /// A buffer with room for `words` (reused when one is held).
        fn take(&mut self, words: usize) -> Vec<u64> {
            let found = match self.buffers.iter().position(|b| b.capacity() >= words) {
                Some(i) => Some(self.buffers.swap_remove(i)),
                None => self.buffers.pop(),
            };
            if let Some(b) = &found {
                self.bytes -= b.capacity() * 8;
            }
            found.unwrap_or_default()
        }

        fn give_back(&mut self, buffer: Vec<u64>) {
            let bytes = buffer.capacity() * 8;
            if self.buffers.len() < self.keep && self.bytes + bytes <= self.keep_bytes {
                self.bytes += bytes;
                self.buffers.push(buffer);
            }
        }
    }

    fn pool() -> &'static Mutex<Pool> {
        static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
        POOL.get_or_init(|| Mutex::new(Pool::new(256, 1 << 30)))
    }

    pub fn take(bytes: usize) -> Vec<u64> {
        let words = bytes.div_ceil(8);
        let mut buffer = lock(pool()).take(words);
        buffer.resize(words, 0);
        buffer
    }

    pub fn give_back(buffer: Vec<u64>) {
        lock(pool()).give_back(buffer);
    }

    #[cfg(test)]
    mod tests {
        use super::Pool;

        #[test]
        fn the_pool_holds_at_most_its_count_and_byte_budget() {
            let mut pool = Pool::new(3, 1000);
            for words in [50, 60, 20, 10] {
                pool.give_back(Vec::with_capacity(words));
            }
            // 50 + 60 words are 880 bytes: 20 more (160 bytes) would pass the
            // budget, 10 more (80 bytes) do not.
            assert_eq!((pool.buffers.len(), pool.bytes), (3, 960));
            let reused = pool.take(55);
            assert_eq!((reused.capacity(), pool.bytes), (60, 480));
            pool.give_back(Vec::with_capacity(10));
            pool.give_back(Vec::with_capacity(10));
            assert_eq!(pool.buffers.len(), 3, "at most three buffers");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Direction;
    use std::sync::atomic::AtomicBool;

    /// The copying forms the tests speak in.
    impl Endpoint {
        fn send_copy(&self, to: usize, tag: Tag, data: &[u8], ready: Instant) {
            self.send(to, tag, Arc::new(Block::copy_of(data)), ready)
        }

        fn recv_into(&self, from: usize, tag: Tag, dst: &mut [u8], wait: &Wait) -> Result<Instant> {
            let (block, arrived) = self.recv(from, tag, dst.len(), wait)?;
            dst.copy_from_slice(block.bytes());
            Ok(arrived)
        }
    }

    fn key(site: i64) -> SessionKey {
        SessionKey { group: vec![10, 11, 12], site, run: 1, sequence: 0 }
    }

    fn info(rank: usize) -> Participant {
        Participant {
            op: "test_op",
            rank,
            timeout: Duration::from_millis(200),
            interrupts: crate::config::interrupts(),
        }
    }

    fn tag(step: usize) -> Tag {
        Tag { direction: Direction::Forward, step }
    }

    #[test]
    fn a_message_reaches_its_receiver_across_threads() {
        let cancelled = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let a = Endpoint::join(key(1), info(0));
                a.send_copy(1, tag(0), &[1, 2, 3, 4, 5], Instant::now());
            });
            let b = Endpoint::join(key(1), info(1));
            let wait = Wait::unwatched(&cancelled);
            let mut dst = [0u8; 5];
            b.recv_into(0, tag(0), &mut dst, &wait).unwrap();
            assert_eq!(dst, [1, 2, 3, 4, 5]);
        });
    }

    #[test]
    fn a_missing_rank_gives_a_deadline_error_naming_it() {
        let cancelled = AtomicBool::new(false);
        let a = Endpoint::join(key(2), info(0));
        let wait = Wait::unwatched(&cancelled);
        let start = Instant::now();
        let e = a.recv_into(2, tag(0), &mut [0u8; 4], &wait).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        let Error::DeadlineExceeded(message) = e else { panic!("{e:?}") };
        assert!(message.contains("ranks [1, 2] (devices [11, 12]) never arrived"), "{message}");
    }

    /// A deadline error of a group of devices `group` in which only rank 0 came.
    fn alone_in(group: Vec<i64>, site: i64) -> String {
        let cancelled = AtomicBool::new(false);
        let key = SessionKey { group, site, run: 1, sequence: 0 };
        let a = Endpoint::join(key, info(0));
        let e = a.recv_into(1, tag(0), &mut [0u8; 4], &Wait::unwatched(&cancelled)).unwrap_err();
        assert!(matches!(e, Error::DeadlineExceeded(_)), "{e:?}");
        e.message().to_string()
    }

    #[test]
    fn a_missing_rank_that_never_entered_any_call_is_said_to_be_outside_commfuse() {
        // Device 4101 left a commfuse call before; 4102 never entered one.
        drop(activity::enter(4101, CallIdentity { kind: "all_gather_matmul", site: 40, run: Some(1), sequence: 0 }));
        let message = alone_in(vec![4100, 4101, 4102], 41);
        for part in [
            "ranks [1, 2] (devices [4101, 4102]) never arrived: ",
            "device 4102 has not entered any commfuse call in this process; ",
            "device 4101 has not entered any commfuse call since leaving one ",
            " ms ago (call site 40, kind all_gather_matmul, run 1). ",
            "Every rank of the group must reach the op; if they are only slow, raise the deadline",
        ] {
            assert!(message.contains(part), "{part:?} not in {message}");
        }
        assert!(!message.contains("lax.cond"), "{message}");
    }

    #[test]
    fn a_missing_rank_inside_another_call_is_said_to_be_there() {
        let elsewhere = CallIdentity { kind: "matmul_reduce_scatter", site: 43, run: Some(9), sequence: 0 };
        let _inside = activity::enter(4201, elsewhere);
        let message = alone_in(vec![4200, 4201], 42);
        for part in [
            "rank 0 of 2 (device 4200) waited ",
            "ranks [1] (devices [4201]) never arrived: device 4201 is inside another commfuse call \
             (call site 43, kind matmul_reduce_scatter, run 9) since ",
        ] {
            assert!(message.contains(part), "{part:?} not in {message}");
        }
        assert!(!message.contains("lax.cond"), "{message}");
    }

    #[test]
    fn a_peer_that_computes_longer_than_the_timeout_is_waited_for() {
        // The timeout is 200 ms; rank 0 computes for 600 ms before it sends,
        // and rank 2 waits for rank 1, which waits for rank 0.
        let cancelled = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let a = Endpoint::join(key(5), info(0));
                a.compute(|| std::thread::sleep(Duration::from_millis(600)));
                a.send_copy(1, tag(0), &[1, 2], Instant::now());
            });
            s.spawn(|| {
                let b = Endpoint::join(key(5), info(1));
                let mut got = [0u8; 2];
                b.recv_into(0, tag(0), &mut got, &Wait::unwatched(&cancelled)).unwrap();
                b.send_copy(2, tag(1), &got, Instant::now());
            });
            let c = Endpoint::join(key(5), info(2));
            let start = Instant::now();
            let mut got = [0u8; 2];
            c.recv_into(1, tag(1), &mut got, &Wait::unwatched(&cancelled)).unwrap();
            assert_eq!(got, [1, 2]);
            assert!(start.elapsed() >= Duration::from_millis(550), "{:?}", start.elapsed());
        });
    }

    #[test]
    fn the_timeout_counts_from_the_last_progress_of_any_rank() {
        // Rank 1 computes for 300 ms, then stops moving without sending:
        // rank 0 fails 200 ms after that, not 200 ms after it began waiting.
        let cancelled = AtomicBool::new(false);
        std::thread::scope(|s| {
            let start = Instant::now();
            s.spawn(|| {
                let b = Endpoint::join(key(6), info(1));
                b.compute(|| std::thread::sleep(Duration::from_millis(300)));
                std::thread::sleep(Duration::from_millis(700));
            });
            let a = Endpoint::join(key(6), info(0));
            let e = a.recv_into(1, tag(3), &mut [0u8; 4], &Wait::unwatched(&cancelled)).unwrap_err();
            let waited = start.elapsed();
            // Counted from the op's start it would end at 200 ms.
            assert!(waited >= Duration::from_millis(480) && waited < Duration::from_secs(5), "{waited:?}");
            let Error::DeadlineExceeded(message) = e else { panic!("{e:?}") };
            for part in [
                "no rank of the group moved for 200.0 ms",
                "ranks [2] (devices [12]) never arrived",
                "rank 0 of 3 (device 10) waited ",
                "for rank 1 (device 11)",
            ] {
                assert!(message.contains(part), "{part:?} not in {message}");
            }
        });
    }

    #[test]
    fn a_stalled_rank_is_named_once_every_rank_arrived() {
        let cancelled = AtomicBool::new(false);
        let (a, _b, _c) =
            (Endpoint::join(key(7), info(0)), Endpoint::join(key(7), info(1)), Endpoint::join(key(7), info(2)));
        let e = a.recv_into(2, tag(4), &mut [0u8; 4], &Wait::unwatched(&cancelled)).unwrap_err();
        let m = e.message();
        let said = "every rank arrived, so rank 2 failed or stalled before step 4 (it last moved ";
        let at = m.find(said).unwrap_or_else(|| panic!("{e}")) + said.len();
        // The deadline (200 ms) after it last moved, give or take the scheduler.
        let ms: f64 = m[at..].split(" ms ago)").next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{e}"));
        assert!((190.0..1000.0).contains(&ms), "{e}");
    }

    #[test]
    fn a_rank_that_fails_ends_its_peers_waits_at_once_with_its_error() {
        let cancelled = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let b = Endpoint::join(key(8), info(1));
                std::thread::sleep(Duration::from_millis(30));
                b.fail(&Error::InvalidArgument("workspace has 0 bytes, the plan needs 64".into()));
            });
            let mut long = info(0);
            long.timeout = Duration::from_secs(30);
            let a = Endpoint::join(key(8), long);
            let start = Instant::now();
            let e = a.recv_into(1, tag(0), &mut [0u8; 4], &Wait::unwatched(&cancelled)).unwrap_err();
            assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
            let Error::InvalidArgument(message) = e else { panic!("{e:?}") };
            assert!(message.contains("rank 1 (device 11) failed first: workspace has 0 bytes"), "{message}");
        });
    }

    #[test]
    fn sessions_are_removed_when_everyone_left() {
        {
            let _a = Endpoint::join(key(3), info(0));
            let _b = Endpoint::join(key(3), info(1));
            let _c = Endpoint::join(key(3), info(2));
            assert!(lock(registry()).contains_key(&key(3)));
        }
        assert!(!lock(registry()).contains_key(&key(3)));
    }

    #[test]
    fn an_abandoned_session_drops_the_messages_its_senders_left() {
        let key = SessionKey { site: 3317, ..key(0) };
        let sender = Endpoint::join(key.clone(), info(0));
        sender.send_copy(1, tag(0), &[7; 64], Instant::now());
        drop(sender);
        assert!(lock(registry()).contains_key(&key), "the message waits for its receiver");
        let receiving = Endpoint::join(key.clone(), info(1));
        assert_eq!(abandon(3317, key.run), 0, "a session someone is in stays");
        drop(receiving);
        assert_eq!(abandon(3317, key.run), 1);
        assert!(!lock(registry()).contains_key(&key));
    }

    #[test]
    fn a_failed_session_stays_until_every_rank_came_and_a_late_rank_fails_at_once() {
        let cancelled = AtomicBool::new(false);
        let wait = Wait::unwatched(&cancelled);
        {
            let a = Endpoint::join(key(4), info(0));
            assert!(a.recv_into(1, tag(0), &mut [0u8; 4], &wait).is_err());
        }
        assert!(lock(registry()).contains_key(&key(4)), "ranks 1 and 2 have not come yet");
        let late = Endpoint::join(key(4), info(1));
        late.send_copy(2, tag(0), &[1; 4], Instant::now()); // dropped: nobody will read it
        let started = Instant::now();
        let error = late.recv_into(0, tag(1), &mut [0u8; 4], &wait).unwrap_err().to_string();
        assert!(error.contains("rank 0 (device 10) failed first"), "{error}");
        assert!(started.elapsed() < info(1).timeout, "at once, not after the deadline");
        drop(late);
        drop(Endpoint::join(key(4), info(2)));
        assert!(!lock(registry()).contains_key(&key(4)), "every rank came and went");
    }

    /// Posts `sends` (from, to) of `bytes` each, all ready at one instant,
    /// over a fresh group of devices under `link`, receives each, and
    /// returns each message's modelled transit: its arrival stamp less the
    /// instant it was ready. Checks that no receive returned before its
    /// message's arrival. Order and accounting, not wall-clock time: how
    /// long the host took to get here is not measured.
    fn modelled_sends(link: &str, group: Vec<i64>, sends: &[(usize, usize)], bytes: usize) -> Vec<Duration> {
        modelled_sends_at(link, group, None, sends, bytes)
    }

    fn modelled_sends_at(
        link: &str,
        group: Vec<i64>,
        positions: Option<LinkPositions>,
        sends: &[(usize, usize)],
        bytes: usize,
    ) -> Vec<Duration> {
        let model = link::LinkModel::parse(link).unwrap();
        let positions = positions.map(Arc::new);
        let key = SessionKey { group: group.clone(), site: 77, run: 1, sequence: 0 };
        let ends: Vec<Endpoint> = (0..group.len())
            .map(|r| {
                let info = Participant {
                    op: "test_op",
                    rank: r,
                    timeout: Duration::from_secs(10),
                    interrupts: crate::config::interrupts(),
                };
                let end = Endpoint::join(key.clone(), info).with_link(model);
                match &positions {
                    Some(p) => end.with_link_positions(p.clone()),
                    None => end,
                }
            })
            .collect();
        let data = vec![7u8; bytes];
        let cancelled = AtomicBool::new(false);
        let ready = Instant::now();
        for (i, &(from, to)) in sends.iter().enumerate() {
            ends[from].send_copy(to, tag(i), &data, ready);
        }
        let mut dst = vec![0u8; bytes];
        let mut times = vec![];
        for (i, &(from, to)) in sends.iter().enumerate() {
            let wait = Wait::unwatched(&cancelled);
            let arrived = ends[to].recv_into(from, tag(i), &mut dst, &wait).unwrap();
            assert!(Instant::now() >= arrived, "message {i} was received before its modelled arrival");
            times.push(arrived - ready);
            assert!(dst.iter().all(|&b| b == 7));
        }
        times
    }

    /// A modelled transit is the model's arithmetic (to a microsecond).
    fn modelled(transit: Duration, model_ms: f64, label: &str) {
        let ms = transit.as_secs_f64() * 1e3;
        assert!((ms - model_ms).abs() <= 1e-3, "{label}: modelled {ms:.4} ms, expected {model_ms:.2} ms");
    }

    // 400 kB at 0.005 GB/s is 80 ms; the latency adds 10 ms. Small messages
    // keep the real copies (slow in debug builds) out of the measurement.
    const LINK: &str = "gbytes_per_s=0.005,latency_us=10000";
    const BYTES: usize = 400_000;

    #[test]
    fn a_throttled_transfer_takes_latency_plus_bytes_over_bandwidth() {
        let t = modelled_sends(LINK, vec![3000, 3001], &[(0, 1)], BYTES);
        modelled(t[0], 90.0, "one transfer");
    }

    #[test]
    fn a_message_between_ranks_on_one_device_does_not_take_the_link() {
        let model = link::LinkModel::parse(LINK).unwrap();
        // Ranks 0 and 2 are device 3200, rank 1 is device 3201.
        let positions = Arc::new(LinkPositions { devices: vec![3200, 3201], of_rank: vec![0, 1, 0] });
        let key = SessionKey { group: vec![3200, 3201, 3200], site: 79, run: 1, sequence: 0 };
        let ends: Vec<Endpoint> = (0..3)
            .map(|r| Endpoint::join(key.clone(), info(r)).with_link(model).with_link_positions(positions.clone()))
            .collect();
        ends[0].send_copy(2, tag(0), &[1; 64], Instant::now());
        ends[0].send_copy(1, tag(1), &[1; 64], Instant::now());
        let state = lock(&ends[0].session.state);
        assert!(state.mailbox[&(2, 0, tag(0))].arrival.is_none(), "a memory copy: there at once");
        assert!(state.mailbox[&(1, 0, tag(1))].arrival.is_some(), "a transfer: there when the model says");
    }

    #[test]
    fn ranks_on_one_device_share_its_ports() {
        // Ranks 0 and 2 are device 3100: their sends to device 3101 share its out port.
        let positions = LinkPositions { devices: vec![3100, 3101], of_rank: vec![0, 1, 0] };
        let t = modelled_sends_at(LINK, vec![3100, 3101, 3100], Some(positions), &[(0, 1), (2, 1)], BYTES);
        modelled(t[1].max(t[0]), 170.0, "two transfers through one out port");
    }

    #[test]
    fn two_transfers_sharing_a_switch_port_take_twice_as_long() {
        // Into one device from two peers: its in port is shared.
        let t = modelled_sends(LINK, vec![3110, 3111, 3112], &[(0, 2), (1, 2)], BYTES);
        modelled(t[1].max(t[0]), 170.0, "two into one port");
        // Out of one device to two peers: its out port is shared.
        let t = modelled_sends(LINK, vec![3200, 3201, 3202], &[(0, 1), (0, 2)], BYTES);
        modelled(t[1].max(t[0]), 170.0, "two out of one port");
    }

    #[test]
    fn a_ring_sends_to_both_neighbours_at_full_bandwidth_each() {
        let ring = format!("{LINK},topology=ring");
        let t = modelled_sends(&ring, vec![3300, 3301, 3302, 3303], &[(0, 1), (0, 3)], BYTES);
        modelled(t[1].max(t[0]), 90.0, "ring, both neighbours");
        // Under a switch the same two share the out port.
        let t = modelled_sends(LINK, vec![3400, 3401, 3402, 3403], &[(0, 1), (0, 3)], BYTES);
        modelled(t[1].max(t[0]), 170.0, "switch, both neighbours");
    }

    #[test]
    fn a_transfer_starts_when_its_step_became_ready_not_when_its_thread_ran() {
        // The sender's thread got a core 40 ms after the step was ready: the
        // message still arrives 90 ms after `ready`, so 50 ms from now.
        let model = link::LinkModel::parse(LINK).unwrap();
        let key = SessionKey { group: vec![3500, 3501], site: 78, run: 1, sequence: 0 };
        let end = |rank| {
            let info = Participant {
                op: "test_op",
                rank,
                timeout: Duration::from_secs(10),
                interrupts: crate::config::interrupts(),
            };
            Endpoint::join(key.clone(), info).with_link(model)
        };
        let (a, b) = (end(0), end(1));
        let ready = Instant::now() - Duration::from_millis(40);
        a.send_copy(1, tag(0), &vec![7u8; BYTES], ready);
        let cancelled = AtomicBool::new(false);
        let wait = Wait::unwatched(&cancelled);
        let arrived = b.recv_into(0, tag(0), &mut vec![0u8; BYTES], &wait).unwrap();
        modelled(arrived - ready, 90.0, "arrival after ready");
        assert!(Instant::now() >= arrived, "received before it arrived");
    }

    #[test]
    fn sequence_numbers_count_per_run() {
        assert_eq!(next_sequence(900, 1, 7), 0);
        assert_eq!(next_sequence(900, 1, 7), 1);
        assert_eq!(next_sequence(901, 1, 7), 0);
        assert_eq!(next_sequence(900, 1, 8), 0);
    }
}
