//! Device-side timeouts: a watchdog for NCCL work that never finishes.
//!
//! Host-side waits are bounded, but once a call's sends and receives are
//! enqueued its handler returns; if a peer never posts the matching calls,
//! this rank's NCCL kernel spins on the device and XLA's stream stalls behind
//! it with no error anywhere. So every call with communication is watched:
//! the handler records two events of a pool on XLA's stream, one before the
//! call's work and one after its join, and hands them to the watchdog (no
//! host synchronisation; no allocation once the pool and queues have grown
//! to the largest number of calls in flight). Up to [`MAX_MARKS`] more
//! events, recorded on the call's lanes after some of its steps, show that
//! the call is moving.
//!
//! One thread per process (started at the first watched call) polls the
//! events every [`POLL_INTERVAL`] while any call is pending, and sleeps on a
//! condition variable otherwise. The timeout counts time *without progress
//! on the device*: from when the call's work started there (its first event
//! completed; XLA's host thread runs ahead of the device, so a call may sit
//! in the stream's queue long before it starts) or, later, from when one of
//! its marks last completed. A long call whose steps keep completing is not
//! expired. When a call makes no progress for the timeout, or the process
//! was interrupted (`config::interrupt`) after the call was submitted, its
//! group is expired as a whole: the
//! group's communicators in this process are aborted (`ncclCommAbort`, which
//! makes the spinning kernels return, so the streams move on), the group is
//! evicted from the communicator cache, and each device with work of that
//! group pending gets a failure record: its next call returns
//! DEADLINE_EXCEEDED (CANCELLED after an interrupt) naming the stopped call,
//! its rank, and which ranks' parts never completed as far as this process
//! knows. The failure is also
//! logged to stderr once, when it is detected.
//!
//! This module is the bookkeeping only, generic over an [`EventSource`] (the
//! driver's events and NCCL's aborts in `device`, a fake in the tests).
#![forbid(unsafe_code)]

use crate::error::{duration_text, Error, Result};
use crate::sync::lock;
use std::fmt::Write as _;
use std::ops::Deref;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often pending events are queried while any call is pending: timeouts
/// are seconds, so a few milliseconds of lateness is nothing, and one query
/// per pending call every 5 ms costs next to nothing on the host.
pub const POLL_INTERVAL: Duration = Duration::from_millis(5);

/// Events a call may record between its start and its end to show progress.
pub const MAX_MARKS: usize = 8;

/// The state of one recorded event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Query {
    /// The stream has passed it (or failed: a device error is not a hang,
    /// and XLA reports it from its own stream).
    Done,
    Pending,
}

/// The answer of one attempt to abort a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abort {
    Done,
    /// A communicator is in use by a call right now (its device's lock is
    /// held): try again at the next poll rather than block the watchdog.
    Busy,
}

/// What the watchdog needs to know about a group of devices.
pub trait WatchedGroup {
    /// The group's mesh device ids in rank order.
    fn devices(&self) -> &[i64];
    /// How many calls rank `rank` has issued on this group so far, when the
    /// rank lives in this process (`None`: another process, unknown here).
    fn issued(&self, rank: usize) -> Option<u64>;
}

/// The device side: events to query, groups to abort.
pub trait EventSource: Send + Sync + 'static {
    type Event: Copy + Send + 'static;
    type Group: WatchedGroup + Send + Sync + 'static;
    /// Whether the stream has passed `event` (a host-side query, never a wait).
    fn query(&self, event: Self::Event) -> Query;
    /// Aborts the group's communicators in this process and evicts it from
    /// the cache. Called again after `Busy`; must not abort anything twice.
    fn abort(&self, group: &Arc<Self::Group>) -> Abort;
}

/// Which call a watch belongs to, for the failure's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchedCall {
    pub op: &'static str,
    /// The call site (the lowering's `site` attribute).
    pub site: i64,
    pub rank: usize,
    /// This rank's call number on the group, from 0: the k-th calls of all
    /// ranks are the ones NCCL pairs.
    pub seq: u64,
}

/// One call's work on one device, as the handler hands it over.
pub struct Watch<S: EventSource> {
    /// The CUDA ordinal: where the failure is reported.
    pub device: i32,
    /// Recorded on XLA's stream before the call's work, and after its join.
    pub start: S::Event,
    pub end: S::Event,
    /// Recorded on the call's lanes after some of its steps (see `MAX_MARKS`).
    pub marks: [Option<S::Event>; MAX_MARKS],
    /// How long the call may go without progress on the device.
    pub timeout: Duration,
    /// `config::interrupts()` when the call was enqueued.
    pub interrupts: u64,
    pub group: Arc<S::Group>,
    pub call: WatchedCall,
}

impl<S: EventSource> Watch<S> {
    /// Every event of the call, to give back to its device's pool.
    fn events(&self) -> impl Iterator<Item = (i32, S::Event)> + '_ {
        let all = [self.start, self.end].into_iter().chain(self.marks.iter().flatten().copied());
        all.map(|e| (self.device, e))
    }
}

struct Entry<S: EventSource> {
    watch: Watch<S>,
    /// When the watchdog first saw `start` completed.
    started: Option<Instant>,
    /// When it last saw `start` or a mark complete.
    moved: Option<Instant>,
    /// Which marks it saw completed (bit i: `marks[i]`).
    marks_done: u32,
}

/// A timed-out call, reported by its device's next call.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failure {
    device: i32,
    /// Expired by an interrupt, not by a timeout.
    interrupted: bool,
    message: String,
    /// Later calls of the same device that were aborted with it.
    more: usize,
}

impl Failure {
    fn error(&self) -> Error {
        let more = match self.more {
            0 => String::new(),
            n => format!(" ({n} later call(s) on this device were aborted too)"),
        };
        if self.interrupted {
            return Error::Interrupted(format!(
                "an earlier commfuse call on CUDA device {} was stopped by an interrupt, so this call was not run: \
                 {}{more}",
                self.device, self.message
            ));
        }
        Error::DeadlineExceeded(format!(
            "an earlier commfuse call on CUDA device {} timed out on the device, so this call was not run: {}{more}",
            self.device, self.message
        ))
    }
}

/// What handlers and the thread share.
struct State<S: EventSource> {
    /// Submitted since the thread last took them.
    pending: Vec<Entry<S>>,
    /// Events no pending call uses, per CUDA ordinal.
    free: Vec<(i32, Vec<S::Event>)>,
    failures: Vec<Failure>,
    /// The thread waits without a timeout: a submission must wake it.
    parked: bool,
    stop: bool,
}

/// The watchdog's state and its logic; [`Watchdog`] adds the thread.
pub struct Core<S: EventSource> {
    source: S,
    state: Mutex<State<S>>,
    wake: Condvar,
    /// Whether `failures` may be non-empty: the hot path's check is one load.
    failed: AtomicBool,
    polls: AtomicU64,
}

/// The thread's own working set, reused from poll to poll.
pub struct Work<S: EventSource> {
    entries: Vec<Entry<S>>,
    /// Expired groups whose abort answered `Busy`.
    aborting: Vec<Arc<S::Group>>,
    /// Groups to expire at this poll, and whether by an interrupt.
    expired: Vec<(Arc<S::Group>, bool)>,
    returned: Vec<(i32, S::Event)>,
}

impl<S: EventSource> Default for Work<S> {
    fn default() -> Self {
        Work { entries: Vec::new(), aborting: Vec::new(), expired: Vec::new(), returned: Vec::new() }
    }
}

impl<S: EventSource> Work<S> {
    fn is_idle(&self) -> bool {
        self.entries.is_empty() && self.aborting.is_empty()
    }
}

impl<S: EventSource> Core<S> {
    pub fn new(source: S) -> Core<S> {
        Core {
            source,
            state: Mutex::new(State {
                pending: Vec::new(),
                free: Vec::new(),
                failures: Vec::new(),
                parked: false,
                stop: false,
            }),
            wake: Condvar::new(),
            failed: AtomicBool::new(false),
            polls: AtomicU64::new(0),
        }
    }

    pub fn source(&self) -> &S {
        &self.source
    }

    /// A free event of device `device`, if the pool has one (else the caller
    /// creates one, in the device's context, outside this lock).
    pub fn take_event(&self, device: i32) -> Option<S::Event> {
        lock(&self.state).free.iter_mut().find(|(d, _)| *d == device).and_then(|(_, events)| events.pop())
    }

    /// Returns events to device `device`'s pool (a call that failed before
    /// it was submitted).
    pub fn give_back(&self, device: i32, events: &[S::Event]) {
        let mut state = lock(&self.state);
        for &e in events {
            free_event(&mut state.free, device, e);
        }
    }

    /// Watches a call until its `end` event completes or its group expires.
    pub fn submit(&self, watch: Watch<S>) {
        let mut state = lock(&self.state);
        state.pending.push(Entry { watch, started: None, moved: None, marks_done: 0 });
        if state.parked {
            self.wake.notify_one();
        }
    }

    /// Device `device`'s next call: DEADLINE_EXCEEDED if an earlier call of
    /// the device timed out on it since the last check (reported once).
    pub fn check(&self, device: i32) -> Result<()> {
        if !self.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut state = lock(&self.state);
        let Some(at) = state.failures.iter().position(|f| f.device == device) else { return Ok(()) };
        let failure = state.failures.swap_remove(at);
        if state.failures.is_empty() {
            self.failed.store(false, Ordering::Release);
        }
        Err(failure.error())
    }

    /// How many times the pending calls were polled (for tests: an idle
    /// watchdog does not poll).
    pub fn polls(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }

    /// Whether the thread waits for a submission, nothing pending (for tests).
    pub fn is_parked(&self) -> bool {
        lock(&self.state).parked
    }

    /// One poll at time `now`: takes the newly submitted calls, drops the
    /// finished ones, expires the groups of calls that made no progress for
    /// their timeout or were interrupted, retries the aborts that were busy.
    /// Returns whether anything is still pending.
    pub fn tick(&self, work: &mut Work<S>, now: Instant) -> bool {
        work.entries.append(&mut lock(&self.state).pending);
        self.polls.fetch_add(1, Ordering::Relaxed);
        let interrupts = crate::config::interrupts();
        let Work { entries, aborting, expired, returned } = work;
        let source = &self.source;
        entries.retain_mut(|e| {
            if e.started.is_none() {
                if source.query(e.watch.start) == Query::Pending {
                    return true;
                }
                e.started = Some(now);
                e.moved = Some(now);
            }
            if source.query(e.watch.end) == Query::Done {
                returned.extend(e.watch.events());
                return false;
            }
            if e.started.is_some() {
                for (i, mark) in e.watch.marks.iter().enumerate() {
                    let seen = e.marks_done & (1 << i) != 0;
                    if let Some(mark) = mark.filter(|_| !seen) {
                        if source.query(mark) == Query::Done {
                            e.marks_done |= 1 << i;
                            e.moved = Some(now);
                        }
                    }
                }
            }
            let interrupted = e.watch.interrupts != interrupts;
            let late = e.moved.is_some_and(|t| now.duration_since(t) >= e.watch.timeout);
            // A group already being aborted is not expired again: its late
            // calls (ones that took it from the cache before its eviction)
            // wait until that abort is done.
            let known = expired.iter().map(|(g, _)| g).chain(aborting.iter()).any(|g| Arc::ptr_eq(g, &e.watch.group));
            if (late || interrupted) && !known {
                expired.push((Arc::clone(&e.watch.group), interrupted && !late));
            }
            true
        });

        let mut failures = Vec::new();
        for (group, interrupted) in expired.drain(..) {
            failures.extend(describe(&group, entries, interrupted, now));
            entries.retain(|e| {
                let keep = !Arc::ptr_eq(&e.watch.group, &group);
                if !keep {
                    returned.extend(e.watch.events());
                }
                keep
            });
            aborting.push(group);
        }
        aborting.retain(|g| source.abort(g) == Abort::Busy);

        if !returned.is_empty() || !failures.is_empty() {
            let mut state = lock(&self.state);
            for (device, e) in returned.drain(..) {
                free_event(&mut state.free, device, e);
            }
            for f in &failures {
                match state.failures.iter_mut().find(|old| old.device == f.device) {
                    // The device has not run a call since the first failure:
                    // that one is the cause, the rest came after it.
                    Some(old) => old.more += 1 + f.more,
                    None => state.failures.push(f.clone()),
                }
            }
            if !state.failures.is_empty() {
                self.failed.store(true, Ordering::Release);
            }
        }
        for f in &failures {
            let what = if f.interrupted { "interrupt" } else { "timeout" };
            eprintln!("commfuse: device-side {what} on CUDA device {}: {}", f.device, f.message);
        }
        !work.is_idle()
    }
}

fn free_event<E>(free: &mut Vec<(i32, Vec<E>)>, device: i32, event: E) {
    match free.iter_mut().find(|(d, _)| *d == device) {
        Some((_, events)) => events.push(event),
        None => free.push((device, vec![event])),
    }
}

/// The failure of each device with pending work of the expired `group`: its
/// earliest call of the group, and which ranks' parts of that call never
/// completed.
fn describe<S: EventSource>(
    group: &Arc<S::Group>,
    entries: &[Entry<S>],
    interrupted: bool,
    now: Instant,
) -> Vec<Failure> {
    let mine = || entries.iter().filter(|e| Arc::ptr_eq(&e.watch.group, group));
    let mut failures: Vec<Failure> = Vec::new();
    for e in mine() {
        let device = e.watch.device;
        if failures.iter().any(|f| f.device == device) {
            continue;
        }
        let first = mine().filter(|x| x.watch.device == device).min_by_key(|x| x.watch.call.seq).unwrap_or(e);
        let more = mine().filter(|x| x.watch.device == device).count() - 1;
        let message = message(group.as_ref(), first, mine(), interrupted, now);
        failures.push(Failure { device, interrupted, message, more });
    }
    failures
}

fn message<'a, S: EventSource>(
    group: &S::Group,
    e: &Entry<S>,
    group_entries: impl Iterator<Item = &'a Entry<S>> + Clone,
    interrupted: bool,
    now: Instant,
) -> String {
    let WatchedCall { op, site, rank, seq } = e.watch.call;
    let devices = group.devices();
    let since = |t: Option<Instant>| t.map_or(0.0, |t| now.duration_since(t).as_secs_f64());
    let why = if interrupted {
        "the process was interrupted (SIGINT) while it had not completed".to_string()
    } else {
        format!(
            "it made no progress on the device for {} (it started there {} ago; COMMFUSE_TIMEOUT_S / \
             commfuse.configure(timeout_s=))",
            duration_text(e.watch.timeout.as_secs_f64()),
            duration_text(since(e.started))
        )
    };
    let mut text = format!(
        "{op} (call site {site}), rank {rank} of the group {devices:?} (mesh device ids), call {} on this group: \
         {why}; the group's communicators in this process were aborted, so the outputs of that call and of the \
         later calls on its stream that used the group are invalid. Ranks whose part of the call never completed:",
        seq + 1,
    );
    let mut listed = 0;
    for (q, device) in devices.iter().enumerate() {
        let pending = group_entries.clone().find(|x| x.watch.call.rank == q && x.watch.call.seq == seq);
        let state = match (pending, group.issued(q)) {
            (Some(x), _) if x.started.is_some() => "still running on its device".to_string(),
            (Some(_), _) => "issued, but queued on its device behind other work (never started)".to_string(),
            (None, Some(issued)) if issued <= seq => {
                format!("had not issued it (it issued {issued} call(s) on this group)")
            }
            (None, Some(_)) => continue,
            (None, None) => "in another process (not known here)".to_string(),
        };
        let this = if q == rank { ", this call" } else { "" };
        let _ = write!(text, "{} rank {q} (mesh device {device}{this}): {state}", if listed == 0 { "" } else { ";" });
        listed += 1;
    }
    text.push('.');
    text
}

/// The watchdog: its [`Core`] and the thread polling it.
pub struct Watchdog<S: EventSource> {
    core: Arc<Core<S>>,
    thread: Option<JoinHandle<()>>,
}

impl<S: EventSource> Watchdog<S> {
    /// Starts the thread (parked until the first submission).
    pub fn start(source: S) -> Result<Watchdog<S>> {
        let core = Arc::new(Core::new(source));
        let thread = std::thread::Builder::new()
            .name("commfuse-watchdog".into())
            .spawn({
                let core = Arc::clone(&core);
                move || run(&core)
            })
            .map_err(|e| Error::Internal(format!("starting the device-timeout watchdog thread: {e}")))?;
        Ok(Watchdog { core, thread: Some(thread) })
    }
}

impl<S: EventSource> Deref for Watchdog<S> {
    type Target = Core<S>;
    fn deref(&self) -> &Core<S> {
        &self.core
    }
}

impl<S: EventSource> Drop for Watchdog<S> {
    /// Stops the thread (the process-wide watchdog is never dropped; tests' are).
    fn drop(&mut self) {
        lock(&self.core.state).stop = true;
        self.core.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: polls while anything is pending, parks otherwise.
fn run<S: EventSource>(core: &Core<S>) {
    let mut work = Work::default();
    let mut state = lock(&core.state);
    loop {
        if state.stop {
            return;
        }
        if state.pending.is_empty() && work.is_idle() {
            state.parked = true;
            state = crate::sync::wait(&core.wake, state);
            state.parked = false;
            continue;
        }
        drop(state);
        // A panic here would otherwise end the thread and leave every later
        // call unwatched: report it, forget this poll's calls, carry on.
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| core.tick(&mut work, Instant::now()))) {
            let what = panic.downcast_ref::<&str>().copied().or(panic.downcast_ref::<String>().map(String::as_str));
            eprintln!(
                "commfuse: the device-timeout watchdog panicked ({}); {} pending call(s) are no longer watched",
                what.unwrap_or("no message"),
                work.entries.len()
            );
            work.entries.clear();
            work.aborting.clear();
        }
        state = lock(&core.state);
        if !work.is_idle() && !state.stop {
            // Woken early only by `stop` (submissions do not notify a polling thread).
            state = match core.wake.wait_timeout(state, POLL_INTERVAL) {
                Ok((s, _)) => s,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::atomic::AtomicUsize;

    /// A group: mesh device ids, and per rank its issued calls (`None`:
    /// another process).
    struct FakeGroup {
        devices: Vec<i64>,
        issued: Vec<Option<AtomicU64>>,
    }

    impl FakeGroup {
        fn new(devices: &[i64], issued: &[Option<u64>]) -> Arc<FakeGroup> {
            let issued = issued.iter().map(|i| i.map(AtomicU64::new)).collect();
            Arc::new(FakeGroup { devices: devices.to_vec(), issued })
        }
    }

    impl WatchedGroup for FakeGroup {
        fn devices(&self) -> &[i64] {
            &self.devices
        }
        fn issued(&self, rank: usize) -> Option<u64> {
            self.issued[rank].as_ref().map(|i| i.load(Ordering::SeqCst))
        }
    }

    /// Events are numbers; the test says which completed. Aborts are
    /// counted per group, and answer `Busy` while `busy` is positive.
    #[derive(Default)]
    struct Fake {
        done: Mutex<HashSet<u32>>,
        queries: AtomicUsize,
        aborts: Mutex<Vec<(Vec<i64>, Abort)>>,
        busy: AtomicUsize,
    }

    impl Fake {
        fn complete(&self, event: u32) {
            self.done.lock().unwrap().insert(event);
        }
        fn aborts(&self) -> Vec<(Vec<i64>, Abort)> {
            self.aborts.lock().unwrap().clone()
        }
    }

    impl EventSource for Fake {
        type Event = u32;
        type Group = FakeGroup;
        fn query(&self, event: u32) -> Query {
            self.queries.fetch_add(1, Ordering::SeqCst);
            if self.done.lock().unwrap().contains(&event) {
                Query::Done
            } else {
                Query::Pending
            }
        }
        fn abort(&self, group: &Arc<FakeGroup>) -> Abort {
            let answer = match self.busy.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1)) {
                Ok(_) => Abort::Busy,
                Err(_) => Abort::Done,
            };
            self.aborts.lock().unwrap().push((group.devices.clone(), answer));
            answer
        }
    }

    const TIMEOUT: Duration = Duration::from_secs(10);

    /// A call of `rank` (its `seq`-th on `group`) on CUDA device `device`
    /// with events `2 * id` (start) and `2 * id + 1` (end).
    fn watch(device: i32, id: u32, group: &Arc<FakeGroup>, rank: usize, seq: u64) -> Watch<Fake> {
        Watch {
            device,
            start: 2 * id,
            end: 2 * id + 1,
            marks: [None; MAX_MARKS],
            timeout: TIMEOUT,
            interrupts: crate::config::interrupts(),
            group: Arc::clone(group),
            call: WatchedCall { op: "all_gather_matmul", site: 7, rank, seq },
        }
    }

    fn message_of(core: &Core<Fake>, device: i32) -> String {
        match core.check(device) {
            Err(Error::DeadlineExceeded(m)) => m,
            other => panic!("device {device}: expected DEADLINE_EXCEEDED, got {other:?}"),
        }
    }

    #[test]
    fn a_call_that_completes_in_time_is_dropped_and_aborts_nothing() {
        let core = Core::new(Fake::default());
        let mut work = Work::default();
        let t0 = Instant::now();
        let group = FakeGroup::new(&[0, 1], &[Some(1), Some(1)]);
        core.submit(watch(0, 0, &group, 0, 0));
        assert!(core.tick(&mut work, t0), "not started: still pending");
        core.source().complete(0);
        assert!(core.tick(&mut work, t0 + Duration::from_secs(1)));
        core.source().complete(1);
        // Past what would be the deadline had it not completed: it did.
        assert!(!core.tick(&mut work, t0 + 2 * TIMEOUT), "completed: nothing pending");
        assert!(core.source().aborts().is_empty());
        assert_eq!(core.check(0), Ok(()));
        // Its two events went back to device 0's pool, for the next call.
        let mut reused = [core.take_event(0), core.take_event(0)];
        reused.sort();
        assert_eq!(reused, [Some(0), Some(1)]);
        assert_eq!((core.take_event(0), core.take_event(1)), (None, None));
    }

    #[test]
    fn the_timeout_counts_from_the_start_on_the_device_not_from_the_enqueue() {
        let core = Core::new(Fake::default());
        let mut work = Work::default();
        let t0 = Instant::now();
        let group = FakeGroup::new(&[0, 1], &[Some(1), Some(1)]);
        core.submit(watch(0, 0, &group, 0, 0));
        // Queued behind other work for longer than the timeout: not late.
        assert!(core.tick(&mut work, t0 + 3 * TIMEOUT));
        core.source().complete(0);
        assert!(core.tick(&mut work, t0 + 4 * TIMEOUT));
        assert!(core.tick(&mut work, t0 + 5 * TIMEOUT - Duration::from_millis(1)));
        assert!(core.source().aborts().is_empty());
        assert_eq!(core.check(0), Ok(()));
        assert!(!core.tick(&mut work, t0 + 5 * TIMEOUT));
        assert_eq!(core.source().aborts().len(), 1);
    }

    #[test]
    fn a_call_past_its_timeout_aborts_its_group_once_and_fails_the_devices_next_call() {
        let core = Core::new(Fake::default());
        let mut work = Work::default();
        let t0 = Instant::now();
        // Rank 1 (device 1, in this process) issued 3 calls on the group;
        // rank 0 is on its 4th (seq 3), which never completes.
        let group = FakeGroup::new(&[0, 1], &[Some(4), Some(3)]);
        core.submit(watch(0, 0, &group, 0, 3));
        core.source().complete(0);
        assert!(core.tick(&mut work, t0));
        assert!(core.tick(&mut work, t0 + TIMEOUT - Duration::from_millis(1)));
        assert!(core.source().aborts().is_empty());
        assert_eq!(core.check(0), Ok(()));
        assert!(!core.tick(&mut work, t0 + TIMEOUT), "expired and aborted: nothing pending");
        for later in 1..4 {
            assert!(!core.tick(&mut work, t0 + later * TIMEOUT));
        }
        assert_eq!(core.source().aborts(), vec![(vec![0, 1], Abort::Done)], "one abort of the group");
        assert_eq!(core.check(1), Ok(()), "device 1 had no call of the group pending");

        let m = message_of(&core, 0);
        for part in [
            "earlier commfuse call on CUDA device 0 timed out on the device",
            "all_gather_matmul (call site 7), rank 0 of the group [0, 1]",
            "call 4 on this group",
            "made no progress on the device for 10.0 s",
            "rank 0 (mesh device 0, this call): still running on its device",
            "rank 1 (mesh device 1): had not issued it (it issued 3 call(s) on this group)",
        ] {
            assert!(m.contains(part), "{part:?} not in {m:?}");
        }
        assert_eq!(core.check(0), Ok(()), "reported once");
        // The expired call's events are back in the pool.
        assert!(core.take_event(0).is_some() && core.take_event(0).is_some());
    }

    #[test]
    fn a_busy_abort_is_retried_until_done_and_never_after() {
        let core = Core::new(Fake::default());
        core.source().busy.store(2, Ordering::SeqCst);
        let mut work = Work::default();
        let t0 = Instant::now();
        let group = FakeGroup::new(&[3, 2], &[Some(1), Some(0)]);
        core.submit(watch(3, 0, &group, 0, 0));
        core.source().complete(0);
        core.tick(&mut work, t0);
        assert!(core.tick(&mut work, t0 + TIMEOUT), "the abort was busy: retried at the next poll");
        // The failure is recorded at once, whatever the abort's progress.
        assert!(message_of(&core, 3).contains("rank 1 (mesh device 2): had not issued it"));
        assert!(core.tick(&mut work, t0 + TIMEOUT), "busy again");
        assert!(!core.tick(&mut work, t0 + TIMEOUT), "done");
        assert!(!core.tick(&mut work, t0 + 2 * TIMEOUT));
        let answers: Vec<Abort> = core.source().aborts().into_iter().map(|(_, a)| a).collect();
        assert_eq!(answers, vec![Abort::Busy, Abort::Busy, Abort::Done]);
    }

    #[test]
    fn several_devices_and_groups_pending_at_once_fail_only_where_their_group_expired() {
        let core = Core::new(Fake::default());
        let mut work = Work::default();
        let t0 = Instant::now();
        let fine = FakeGroup::new(&[0, 1], &[Some(1), Some(1)]);
        // Both ranks of `stuck` (devices 4 and 5) are here and blocked on
        // their first call; rank 1 started 2 s after rank 0, and rank 0 has
        // a second call queued behind the first.
        let stuck = FakeGroup::new(&[4, 5], &[Some(2), Some(1)]);
        // A group spanning processes: rank 1 lives elsewhere.
        let spanning = FakeGroup::new(&[6, 9], &[Some(1), None]);
        core.submit(watch(0, 0, &fine, 0, 0));
        core.submit(watch(1, 1, &fine, 1, 0));
        core.submit(watch(4, 2, &stuck, 0, 0));
        core.submit(watch(4, 3, &stuck, 0, 1));
        core.submit(watch(5, 4, &stuck, 1, 0));
        core.submit(watch(6, 5, &spanning, 0, 0));
        for e in [0, 2, 4, 10] {
            core.source().complete(e);
        }
        core.tick(&mut work, t0);
        core.source().complete(8);
        core.tick(&mut work, t0 + Duration::from_secs(2));
        core.source().complete(1);
        core.source().complete(3);
        core.tick(&mut work, t0 + Duration::from_secs(3));
        assert_eq!((core.check(0), core.check(1)), (Ok(()), Ok(())));
        // Rank 0 of `stuck` and the spanning call are late; rank 1 of
        // `stuck` is not yet, but its group goes with rank 0's.
        assert!(!core.tick(&mut work, t0 + TIMEOUT), "every call done or expired");
        let mut aborted: Vec<Vec<i64>> = core.source().aborts().into_iter().map(|(g, _)| g).collect();
        aborted.sort();
        assert_eq!(aborted, vec![vec![4, 5], vec![6, 9]]);
        assert!(!core.tick(&mut work, t0 + 2 * TIMEOUT));
        assert_eq!(core.source().aborts().len(), 2);

        let m4 = message_of(&core, 4);
        assert!(m4.contains("rank 0 of the group [4, 5]") && m4.contains("call 1 on this group"), "{m4}");
        assert!(m4.contains("rank 1 (mesh device 5): still running on its device"), "{m4}");
        assert!(m4.contains("1 later call(s) on this device were aborted too"), "{m4}");
        let m5 = message_of(&core, 5);
        assert!(m5.contains("rank 1 of the group [4, 5]") && m5.contains("rank 0 (mesh device 4)"), "{m5}");
        let m6 = message_of(&core, 6);
        assert!(m6.contains("rank 1 (mesh device 9): in another process (not known here)"), "{m6}");
        assert!(!m6.contains("aborted too"), "{m6}");
        for device in [0, 1, 4, 5, 6] {
            assert_eq!(core.check(device), Ok(()), "device {device}");
        }
    }

    #[test]
    fn a_call_queued_behind_the_stuck_one_is_reported_as_never_started() {
        let core = Core::new(Fake::default());
        let mut work = Work::default();
        let t0 = Instant::now();
        let group = FakeGroup::new(&[0, 1], &[Some(2), Some(2)]);
        // Rank 1's call 2 is queued behind its stuck call 1 (another group's).
        let other = FakeGroup::new(&[1, 2], &[Some(1), Some(0)]);
        core.submit(watch(1, 0, &other, 0, 0));
        core.submit(watch(1, 1, &group, 1, 1));
        core.submit(watch(0, 2, &group, 0, 0));
        core.submit(watch(0, 3, &group, 0, 1));
        for e in [0, 4, 5, 6] {
            core.source().complete(e);
        }
        core.tick(&mut work, t0);
        core.tick(&mut work, t0 + TIMEOUT);
        let m = message_of(&core, 0);
        assert!(m.contains("rank 0 of the group [0, 1]") && m.contains("call 2 on this group"), "{m}");
        assert!(m.contains("rank 1 (mesh device 1): issued, but queued on its device behind other work"), "{m}");
        // Device 1's call of `other` expired too, so device 1 fails for
        // that one, the earliest, with the queued call of `group` after it.
        let m1 = message_of(&core, 1);
        assert!(m1.contains("of the group [1, 2]") && m1.contains("1 later call(s)"), "{m1}");
    }

    #[test]
    fn a_call_whose_marks_keep_completing_is_not_expired_however_long_it_runs() {
        let core = Core::new(Fake::default());
        let mut work = Work::default();
        let t0 = Instant::now();
        let group = FakeGroup::new(&[0, 1], &[Some(1), Some(1)]);
        let mut w = watch(0, 0, &group, 0, 0);
        w.marks[..3].copy_from_slice(&[Some(100), Some(101), Some(102)]);
        core.submit(w);
        core.source().complete(0);
        assert!(core.tick(&mut work, t0));
        // Each mark completes a little before the timeout since the last one.
        let step = TIMEOUT - Duration::from_secs(1);
        for (i, mark) in [100, 101, 102].into_iter().enumerate() {
            core.source().complete(mark);
            assert!(core.tick(&mut work, t0 + step * (i as u32 + 1)));
        }
        assert!(core.tick(&mut work, t0 + step * 3 + TIMEOUT - Duration::from_millis(1)));
        assert!(core.source().aborts().is_empty(), "moving for 3.6 timeouts, never expired");
        assert_eq!(core.check(0), Ok(()));
        // Then no progress for the timeout: expired, and all five events return to the pool.
        assert!(!core.tick(&mut work, t0 + step * 3 + TIMEOUT));
        let m = message_of(&core, 0);
        assert!(m.contains("made no progress on the device for 10.0 s (it started there 37.0 s ago"), "{m}");
        let pooled: HashSet<u32> = std::iter::from_fn(|| core.take_event(0)).collect();
        assert_eq!(pooled, HashSet::from([0, 1, 100, 101, 102]));
    }

    #[test]
    fn an_interrupt_expires_the_calls_enqueued_before_it_at_the_next_poll() {
        let core = Core::new(Fake::default());
        let mut work = Work::default();
        let t0 = Instant::now();
        let group = FakeGroup::new(&[0, 1], &[Some(1), Some(0)]);
        let mut w = watch(0, 0, &group, 0, 0);
        // As if the process was interrupted after the call was enqueued.
        w.interrupts = crate::config::interrupts().wrapping_sub(1);
        core.submit(w);
        core.source().complete(0);
        assert!(!core.tick(&mut work, t0 + Duration::from_millis(5)), "expired long before the timeout");
        assert_eq!(core.source().aborts(), vec![(vec![0, 1], Abort::Done)]);
        match core.check(0) {
            Err(Error::Interrupted(m)) => assert!(m.contains("stopped by an interrupt") && m.contains("SIGINT"), "{m}"),
            other => panic!("expected an interrupt error, got {other:?}"),
        }
    }

    /// The thread: no polls while nothing is pending, modest polling while a
    /// call is, parked again once it completed; stopped on drop.
    #[test]
    fn the_thread_parks_when_nothing_is_pending_and_polls_at_an_interval_otherwise() {
        // Order, not timing: each state is waited for (bounded), and what a
        // state forbids (a parked thread polling, polls faster than the
        // interval) cannot happen however slowly the host runs the thread.
        let until = |what: &str, done: &dyn Fn() -> bool| {
            let t = Instant::now();
            while !done() {
                assert!(t.elapsed() < Duration::from_secs(10), "{what}");
                std::thread::sleep(POLL_INTERVAL);
            }
        };
        let dog = Watchdog::start(Fake::default()).unwrap();
        until("the idle thread never parked", &|| dog.is_parked());
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(dog.polls(), 0, "an idle watchdog never polls");

        let group = FakeGroup::new(&[0, 1], &[Some(1), Some(1)]);
        let start = Instant::now();
        dog.submit(watch(0, 0, &group, 0, 0));
        until("a pending call was not polled", &|| dog.polls() >= 3);
        let (polls, window) = (dog.polls(), start.elapsed());
        let most = (window.as_millis() / POLL_INTERVAL.as_millis()) as u64 + 5;
        assert!(polls <= most, "{polls} polls in {window:?}: faster than every {POLL_INTERVAL:?}");

        dog.source().complete(0);
        dog.source().complete(1);
        until("the completed call was never dropped", &|| dog.take_event(0).is_some());
        until("the thread did not park once nothing was pending", &|| dog.is_parked());
        let parked = dog.polls();
        let queries = dog.source().queries.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(dog.polls(), parked, "parked again once nothing is pending");
        assert_eq!(dog.source().queries.load(Ordering::SeqCst), queries);
        assert!(dog.source().aborts().is_empty());
    }

    /// End to end through the thread: a call that never completes fails the
    /// device's next call, within the timeout plus a few polls.
    #[test]
    fn the_thread_expires_a_stuck_call() {
        let dog = Watchdog::start(Fake::default()).unwrap();
        let group = FakeGroup::new(&[0, 1], &[Some(1), Some(0)]);
        dog.source().complete(0);
        let mut w = watch(0, 0, &group, 0, 0);
        w.timeout = Duration::from_millis(30);
        let t = Instant::now();
        dog.submit(w);
        loop {
            match dog.check(0) {
                Ok(()) => assert!(t.elapsed() < Duration::from_secs(10), "never expired"),
                Err(e) => {
                    assert!(matches!(e, Error::DeadlineExceeded(_)) && e.message().contains("had not issued it"));
                    break;
                }
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        assert!(t.elapsed() >= Duration::from_millis(30));
        let t = Instant::now();
        while dog.source().aborts().is_empty() {
            assert!(t.elapsed() < Duration::from_secs(10), "never aborted");
            std::thread::sleep(POLL_INTERVAL);
        }
        assert_eq!(dog.source().aborts(), vec![(vec![0, 1], Abort::Done)]);
    }
}
