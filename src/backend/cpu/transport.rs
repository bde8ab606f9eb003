//! In-process point-to-point transfers between the device calls of one
//! execution. The N calls of one op meet in a session keyed by their group,
//! call site, run id and how many times this site already ran in this run
//! (a site inside `lax.scan` runs once per iteration). A send copies the
//! block into a pooled buffer and drops it in the receiver's mailbox; a
//! receive waits for it, with the call's deadline. Under a link model
//! (`link`), the sender stamps each message with the time it arrives under the
//! model, and the receiver sleeps until then.
#![forbid(unsafe_code)]

#[path = "link.rs"]
pub mod link;

use crate::error::{Error, Result};
use crate::exec::Wait;
use crate::plan::Tag;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
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

/// Names for error messages.
#[derive(Debug, Clone)]
pub struct CallInfo {
    pub op: &'static str,
    pub rank: usize,
    pub timeout: Duration,
}

type MailboxKey = (usize, usize, Tag); // (to, from, tag)

/// A message in a mailbox: its bytes, and when it has arrived under the link model.
struct Message {
    data: Vec<u64>,
    arrival: Option<Instant>,
}

struct State {
    arrived: Vec<bool>,
    active: usize,
    left: usize,
    /// A rank gave up waiting: the op failed, late ranks will not be served.
    failed: bool,
    mailbox: HashMap<MailboxKey, Message>,
}

struct Session {
    state: Mutex<State>,
    delivered: Condvar,
}

/// One rank's handle on its session; leaving (drop) tidies the session up.
pub struct Endpoint {
    key: SessionKey,
    session: Arc<Session>,
    info: CallInfo,
    link: Option<link::LinkModel>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not poison every later call.
    m.lock().unwrap_or_else(|e| e.into_inner())
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
    pub fn join(key: SessionKey, info: CallInfo) -> Endpoint {
        let n = key.group.len();
        let session = lock(registry())
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(Session {
                    state: Mutex::new(State {
                        arrived: vec![false; n],
                        active: 0,
                        left: 0,
                        failed: false,
                        mailbox: HashMap::new(),
                    }),
                    delivered: Condvar::new(),
                })
            })
            .clone();
        {
            let mut state = lock(&session.state);
            state.arrived[info.rank] = true;
            state.active += 1;
        }
        session.delivered.notify_all();
        Endpoint { key, session, info, link: None }
    }

    /// Throttles this endpoint's sends by `link` (see `link`); `None` is full speed.
    pub fn with_link(mut self, link: Option<link::LinkModel>) -> Endpoint {
        self.link = link;
        self
    }

    /// Under the link model the transfer starts at `ready` (see
    /// `exec::Wait::ready`), at most now; the copy is part of it.
    pub fn send(&self, to: usize, tag: Tag, data: &[u8], ready: Instant) {
        let posted = ready.min(Instant::now());
        let mut message = pool::take(data.len());
        bytemuck::cast_slice_mut::<u64, u8>(&mut message)[..data.len()].copy_from_slice(data);
        let arrival = self.link.map(|l| l.arrival(posted, &self.key.group, self.info.rank, to, data.len()));
        let message = Message { data: message, arrival };
        let previous = lock(&self.session.state).mailbox.insert((to, self.info.rank, tag), message);
        if let Some(stale) = previous {
            pool::give_back(stale.data);
        }
        self.session.delivered.notify_all();
    }

    /// Waits for the message and copies it into `dst`; returns when it
    /// arrived (under the link model, when the model says, else now).
    pub fn recv(&self, from: usize, tag: Tag, dst: &mut [u8], wait: &Wait) -> Result<Instant> {
        let key = (self.info.rank, from, tag);
        let mut state = lock(&self.session.state);
        let (message, arrived) = loop {
            let now = Instant::now();
            // A message under the link model is there once it has arrived.
            let arrival = state.mailbox.get(&key).map(|m| m.arrival.filter(|&a| a > now));
            if let Some(None) = arrival {
                let message = state.mailbox.remove(&key).expect("present");
                break (message.data, message.arrival.unwrap_or(now));
            }
            if wait.cancelled() {
                return Err(Error::Internal("cancelled because another lane failed".into()));
            }
            if now >= wait.deadline {
                state.failed = true;
                return Err(self.timeout(&state, from, tag));
            }
            // Sleep until the message arrives, or wake up now and then to
            // notice a cancellation by another lane.
            let mut slice = (wait.deadline - now).min(Duration::from_millis(50));
            if let Some(Some(at)) = arrival {
                slice = slice.min(at - now);
            }
            state = self.session.delivered.wait_timeout(state, slice).unwrap_or_else(|e| e.into_inner()).0;
        };
        drop(state);
        let bytes = bytemuck::cast_slice::<u64, u8>(&message);
        let result = if bytes.len() >= dst.len() {
            dst.copy_from_slice(&bytes[..dst.len()]);
            Ok(arrived)
        } else {
            Err(Error::Internal(format!("message from rank {from} has {} bytes, expected {}", bytes.len(), dst.len())))
        };
        pool::give_back(message);
        result
    }

    /// The op failed on this rank: late peers will not be served, so the
    /// session is dropped once those who came have left.
    pub fn fail(&self) {
        lock(&self.session.state).failed = true;
    }

    fn timeout(&self, state: &State, from: usize, tag: Tag) -> Error {
        let CallInfo { op, rank, timeout } = &self.info;
        let SessionKey { group, site, run, .. } = &self.key;
        let missing: Vec<usize> = (0..group.len()).filter(|&r| !state.arrived[r]).collect();
        let devices: Vec<i64> = missing.iter().map(|&r| group[r]).collect();
        let why = if missing.is_empty() {
            format!("every rank arrived, so rank {from} failed or stalled before step {}", tag.step)
        } else {
            format!("ranks {missing:?} (devices {devices:?}) never arrived")
        };
        Error::DeadlineExceeded(format!(
            "{op} (call site {site}, run {run}): rank {rank} of {} (device {}) waited {:.1} s for rank {from} \
             (device {}); {why}. Every rank of the axis must reach the op (check lax.cond/while branches), or \
             raise the deadline with COMMFUSE_TIMEOUT_S / commfuse.configure(timeout_s=...)",
            group.len(),
            group[*rank],
            timeout.as_secs_f64(),
            group[from],
        ))
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let mut registry = lock(registry());
        let mut state = lock(&self.session.state);
        state.active -= 1;
        state.left += 1;
        // Done when every rank came and went, or, after a failure, when those
        // who came have gone (a late rank then meets a new session and times
        // out on its own). A rank that only sends may leave before its peers
        // arrive: its messages must wait for them.
        if state.left == self.key.group.len() || (state.failed && state.active == 0) {
            // Unread messages remain only after a failure.
            for (_, message) in state.mailbox.drain() {
                pool::give_back(message.data);
            }
            if registry.get(&self.key).is_some_and(|s| Arc::ptr_eq(s, &self.session)) {
                registry.remove(&self.key);
            }
        }
    }
}

/// Message buffers, reused across calls so the hot path does not allocate
/// once the pool holds enough of them. Words keep them 8-byte aligned.
mod pool {
    use super::lock;
    use std::sync::{Mutex, OnceLock};

    const KEEP: usize = 256;

    fn buffers() -> &'static Mutex<Vec<Vec<u64>>> {
        static POOL: OnceLock<Mutex<Vec<Vec<u64>>>> = OnceLock::new();
        POOL.get_or_init(Default::default)
    }

    pub fn take(bytes: usize) -> Vec<u64> {
        let words = bytes.div_ceil(8);
        let mut pool = lock(buffers());
        let mut buffer = match pool.iter().position(|b| b.capacity() >= words) {
            Some(i) => pool.swap_remove(i),
            None => pool.pop().unwrap_or_default(),
        };
        drop(pool);
        buffer.resize(words, 0);
        buffer
    }

    pub fn give_back(buffer: Vec<u64>) {
        let mut pool = lock(buffers());
        if pool.len() < KEEP {
            pool.push(buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Direction;
    use std::sync::atomic::AtomicBool;

    fn key(site: i64) -> SessionKey {
        SessionKey { group: vec![10, 11, 12], site, run: 1, sequence: 0 }
    }

    fn info(rank: usize) -> CallInfo {
        CallInfo { op: "test_op", rank, timeout: Duration::from_millis(200) }
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
                a.send(1, tag(0), &[1, 2, 3, 4, 5], Instant::now());
            });
            let b = Endpoint::join(key(1), info(1));
            let wait = Wait::for_test(Instant::now() + Duration::from_secs(5), &cancelled);
            let mut dst = [0u8; 5];
            b.recv(0, tag(0), &mut dst, &wait).unwrap();
            assert_eq!(dst, [1, 2, 3, 4, 5]);
        });
    }

    #[test]
    fn a_missing_rank_gives_a_deadline_error_naming_it() {
        let cancelled = AtomicBool::new(false);
        let a = Endpoint::join(key(2), info(0));
        let wait = Wait::for_test(Instant::now() + Duration::from_millis(100), &cancelled);
        let start = Instant::now();
        let e = a.recv(2, tag(0), &mut [0u8; 4], &wait).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        let Error::DeadlineExceeded(message) = e else { panic!("{e:?}") };
        assert!(message.contains("ranks [1, 2] (devices [11, 12]) never arrived"), "{message}");
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
    fn a_failed_session_is_removed_when_its_ranks_left() {
        let cancelled = AtomicBool::new(false);
        {
            let a = Endpoint::join(key(4), info(0));
            let wait = Wait::for_test(Instant::now() + Duration::from_millis(20), &cancelled);
            assert!(a.recv(1, tag(0), &mut [0u8; 4], &wait).is_err());
        }
        assert!(!lock(registry()).contains_key(&key(4)));
    }

    /// Posts `sends` (from, to) of `bytes` each at once over a fresh group of
    /// `n` devices under `link`, and returns when each receive completed.
    fn timed_sends(link: &str, group: Vec<i64>, sends: &[(usize, usize)], bytes: usize) -> Vec<Duration> {
        let model = link::LinkModel::parse(link).unwrap();
        let key = SessionKey { group: group.clone(), site: 77, run: 1, sequence: 0 };
        let ends: Vec<Endpoint> = (0..group.len())
            .map(|r| {
                let info = CallInfo { op: "test_op", rank: r, timeout: Duration::from_secs(10) };
                Endpoint::join(key.clone(), info).with_link(model)
            })
            .collect();
        let data = vec![7u8; bytes];
        let cancelled = AtomicBool::new(false);
        let start = Instant::now();
        for (i, &(from, to)) in sends.iter().enumerate() {
            ends[from].send(to, tag(i), &data, Instant::now());
        }
        let mut dst = vec![0u8; bytes];
        let mut times = vec![];
        for (i, &(from, to)) in sends.iter().enumerate() {
            let wait = Wait::for_test(Instant::now() + Duration::from_secs(10), &cancelled);
            ends[to].recv(from, tag(i), &mut dst, &wait).unwrap();
            times.push(start.elapsed());
            assert!(dst.iter().all(|&b| b == 7));
        }
        times
    }

    fn within(measured: Duration, model_ms: f64, label: &str) {
        let ms = measured.as_secs_f64() * 1e3;
        eprintln!("{label}: measured {ms:.2} ms, model {model_ms:.2} ms ({:+.1}%)", (ms / model_ms - 1.0) * 100.0);
        assert!((ms - model_ms).abs() <= 0.1 * model_ms, "{label}: {ms:.2} ms vs model {model_ms:.2} ms");
    }

    // 400 kB at 0.005 GB/s is 80 ms; the latency adds 10 ms. Small messages
    // keep the real copies (slow in debug builds) out of the measurement.
    const LINK: &str = "gbytes_per_s=0.005,latency_us=10000";
    const BYTES: usize = 400_000;

    #[test]
    fn a_throttled_transfer_takes_latency_plus_bytes_over_bandwidth() {
        let t = timed_sends(LINK, vec![3000, 3001], &[(0, 1)], BYTES);
        within(t[0], 90.0, "one transfer");
    }

    #[test]
    fn two_transfers_sharing_a_switch_port_take_twice_as_long() {
        // Into one device from two peers: its in port is shared.
        let t = timed_sends(LINK, vec![3100, 3101, 3102], &[(0, 2), (1, 2)], BYTES);
        within(t[1].max(t[0]), 170.0, "two into one port");
        // Out of one device to two peers: its out port is shared.
        let t = timed_sends(LINK, vec![3200, 3201, 3202], &[(0, 1), (0, 2)], BYTES);
        within(t[1].max(t[0]), 170.0, "two out of one port");
    }

    #[test]
    fn a_ring_sends_to_both_neighbours_at_full_bandwidth_each() {
        let ring = format!("{LINK},topology=ring");
        let t = timed_sends(&ring, vec![3300, 3301, 3302, 3303], &[(0, 1), (0, 3)], BYTES);
        within(t[1].max(t[0]), 90.0, "ring, both neighbours");
        // Under a switch the same two share the out port.
        let t = timed_sends(LINK, vec![3400, 3401, 3402, 3403], &[(0, 1), (0, 3)], BYTES);
        within(t[1].max(t[0]), 170.0, "switch, both neighbours");
    }

    #[test]
    fn a_transfer_starts_when_its_step_became_ready_not_when_its_thread_ran() {
        // The sender's thread got a core 40 ms after the step was ready: the
        // message still arrives 90 ms after `ready`, so 50 ms from now.
        let model = link::LinkModel::parse(LINK).unwrap();
        let key = SessionKey { group: vec![3500, 3501], site: 78, run: 1, sequence: 0 };
        let end = |rank| {
            let info = CallInfo { op: "test_op", rank, timeout: Duration::from_secs(10) };
            Endpoint::join(key.clone(), info).with_link(model)
        };
        let (a, b) = (end(0), end(1));
        let ready = Instant::now() - Duration::from_millis(40);
        a.send(1, tag(0), &vec![7u8; BYTES], ready);
        let cancelled = AtomicBool::new(false);
        let wait = Wait::for_test(Instant::now() + Duration::from_secs(10), &cancelled);
        let arrived = b.recv(0, tag(0), &mut vec![0u8; BYTES], &wait).unwrap();
        within(arrived - ready, 90.0, "arrival after ready");
        within(Instant::now() - ready, 90.0, "receive after ready");
    }

    #[test]
    fn sequence_numbers_count_per_run() {
        assert_eq!(next_sequence(900, 1, 7), 0);
        assert_eq!(next_sequence(900, 1, 7), 1);
        assert_eq!(next_sequence(901, 1, 7), 0);
        assert_eq!(next_sequence(900, 1, 8), 0);
    }
}
