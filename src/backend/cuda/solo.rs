//! One rank of an N-rank group on one GPU: rank r's real plan of any op kind
//! and schedule, its GEMMs as in production, and each transfer replaced by a
//! paced copy-engine copy. What a peer would send comes from a device buffer
//! holding that peer's message (the *inbox*); what the rank sends is copied
//! to a *sink*. The communication lane is held after each copy until the
//! link would have delivered it, so a call takes about the time it would
//! take on a link of the given bandwidth and latency, with real kernels,
//! copy engines, events and contention.
//!
//! Pacing: an exchange step marks the time its lane reaches it, cuts its
//! transfers into chunks ([`Pace::chunk`]) and takes them in the order the
//! link would deliver them (incoming and outgoing each at the link's rate,
//! as a device's two ports of a switch): each chunk is copied, then the lane
//! is held until `latency + bytes so far / bandwidth` after the mark. The
//! marks and holds run on the driver's host thread (`driver::launch_host`),
//! so they need no SM. Each costs some tens of microseconds, so a link is
//! slower than asked: the last hold of a step notes when it ended, and the
//! rate achieved is measured and reported ([`LinkReport`]), not assumed.
//! Tried on an H200 (GPU.md, "The one-rank mode"): a timer kernel as the
//! hold waited for a free SM, which the GEMMs beside it kept until they
//! ended; stream memory operations on mapped host flags, released by a host
//! thread, never completed there.
//!
//! With the inbox holding exactly the messages the peers send (the CPU
//! model of the group gives them: `emulate::solo_inbox`), the rank's output
//! is the CPU backend's, bit for bit; a benchmark fills it with any bytes.
#![forbid(unsafe_code)]

use super::addresses::P2p;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// A link's pace: the rate of each direction (a device's incoming and its
/// outgoing port) and the latency every exchange step pays first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pace {
    pub bytes_per_s: f64,
    pub latency_s: f64,
}

impl Pace {
    /// The link of a cost-model machine (`sim::Machine::from_spec`:
    /// `h100_nvlink`, `h100_pcie`, or a preset with `gbytes_per_s=...,latency_us=...`).
    pub fn of_machine(spec: &str) -> Result<Pace> {
        let link = crate::sim::Machine::from_spec(spec, None, 1)?.link;
        Ok(Pace { bytes_per_s: link.bytes_per_s, latency_s: link.latency_s })
    }

    /// Nanoseconds after a step's start by which `bytes` have arrived.
    pub fn due_ns(&self, bytes: usize) -> u64 {
        let transfer = if self.bytes_per_s.is_finite() { (bytes as f64 * 1e9 / self.bytes_per_s).ceil() } else { 0.0 };
        ((self.latency_s * 1e9).round() as u64).saturating_add(transfer as u64)
    }

    /// Bytes of one paced copy: what the link moves in 100 us, at least 4
    /// MiB, so that a hold's own cost (tens of microseconds) is small beside it.
    pub fn chunk(&self) -> usize {
        let per_100us = if self.bytes_per_s.is_finite() { self.bytes_per_s * 100e-6 } else { MAX_CHUNK as f64 };
        (per_100us as usize).clamp(MIN_CHUNK, MAX_CHUNK)
    }
}

/// The largest paced copy (an unlimited link copies in pieces of this).
pub const MAX_CHUNK: usize = 256 << 20;

/// The longest a step may be held: a pace slower than this for a step's
/// bytes is refused (a hold blocks the driver's host thread).
pub const MAX_HOLD_NS: u64 = 10_000_000_000;

/// The smallest paced copy.
pub const MIN_CHUNK: usize = 4 << 20;

/// When an exchange step began and ended, in nanoseconds of [`now_ns`];
/// written by the holds on the host as the stream reaches them.
#[derive(Debug, Default)]
pub struct StepClock {
    start: AtomicU64,
    end: AtomicU64,
}

impl StepClock {
    /// The stream reached the step.
    pub fn mark_start(&self) {
        self.start.store(now_ns().max(1), Ordering::Release);
    }

    /// Returns once `after_ns` have passed since the start (at once if the
    /// start was never marked); notes the time as the step's end if `last`.
    /// Sleeps while more than 200 us remain, then spins: bounded by `after_ns`.
    pub fn hold_until(&self, after_ns: u64, last: bool) {
        let start = self.start.load(Ordering::Acquire);
        let due = if start == 0 { 0 } else { start.saturating_add(after_ns) };
        let mut now = now_ns();
        while now < due {
            let left = due - now;
            if left > 200_000 {
                std::thread::sleep(std::time::Duration::from_nanos(left - 100_000));
            } else {
                std::hint::spin_loop();
            }
            now = now_ns();
        }
        if last {
            self.end.store(now, Ordering::Release);
        }
    }

    /// (start, end) in ns, once both were noted.
    pub fn span(&self) -> Option<(u64, u64)> {
        let (start, end) = (self.start.load(Ordering::Acquire), self.end.load(Ordering::Acquire));
        (start > 0 && end >= start).then_some((start, end))
    }
}

/// Nanoseconds since this process first asked (a monotonic clock).
pub fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    u64::try_from(BASE.get_or_init(Instant::now).elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Where the peers' messages are on the device.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbox {
    /// Per peer, its messages to this rank in the order it sends them (address, bytes).
    Messages(Vec<Vec<(u64, usize)>>),
    /// One region every message is read from (its first bytes): for timing only.
    Any { addr: u64, bytes: usize },
}

/// What one exchange step did: its bytes each way and when it ran.
#[derive(Debug, Clone)]
pub struct StepRecord {
    pub bytes_in: usize,
    pub bytes_out: usize,
    pub clock: Arc<StepClock>,
}

/// The device side of the pacing, on one stream: the CUDA lane
/// (`enqueue`) or the model's recorder (`emulate`).
pub trait PacedQueue {
    /// Marks the step's start when the stream gets there (`StepClock::mark_start`).
    fn start(&mut self, clock: &Arc<StepClock>) -> Result<()>;
    /// Copies `bytes` bytes from `src` to `dst` (a copy engine's work).
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Holds the stream until `after_ns` after the step's start (`StepClock::hold_until`).
    fn hold(&mut self, clock: &Arc<StepClock>, after_ns: u64, last: bool) -> Result<()>;
}

/// One rank's link to its absent peers, for one call at a time.
pub struct SoloLink {
    pub inbox: Inbox,
    /// Device memory the rank's sends are copied into.
    pub sink: (u64, usize),
    pub pace: Pace,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Per peer, the next message of `Inbox::Messages` to deliver.
    next: Vec<usize>,
    steps: Vec<StepRecord>,
}

impl SoloLink {
    pub fn new(inbox: Inbox, sink: (u64, usize), pace: Pace) -> SoloLink {
        SoloLink { inbox, sink, pace, state: Mutex::default() }
    }

    /// Starts a call: every peer's messages from the first, no steps yet.
    pub fn begin_call(&self) {
        let mut state = crate::sync::lock(&self.state);
        state.next.clear();
        state.steps.clear();
    }

    /// The steps of the call so far.
    pub fn steps(&self) -> Vec<StepRecord> {
        crate::sync::lock(&self.state).steps.clone()
    }

    /// Enqueues one exchange step on `queue`: the receives from the inbox,
    /// the sends into the sink, paced as the module's doc says.
    pub fn exchange(&self, sends: &[P2p], recvs: &[P2p], queue: &mut impl PacedQueue) -> Result<()> {
        let mut state = crate::sync::lock(&self.state);
        let chunk = self.pace.chunk();
        // (due ns, destination, source, bytes), incoming and outgoing each
        // delivered at the link's rate.
        let mut chunks: Vec<(u64, u64, u64, usize)> = Vec::new();
        let mut bytes_in = 0;
        for r in recvs {
            let src = self.message(&mut state, r)?;
            for (offset, bytes) in pieces(r.bytes, chunk) {
                bytes_in += bytes;
                chunks.push((self.pace.due_ns(bytes_in), r.addr + offset as u64, src + offset as u64, bytes));
            }
        }
        let mut bytes_out = 0;
        for s in sends {
            for (offset, bytes) in pieces(s.bytes, chunk.min(self.sink.1)) {
                bytes_out += bytes;
                chunks.push((self.pace.due_ns(bytes_out), self.sink.0, s.addr + offset as u64, bytes));
            }
        }
        chunks.sort_by_key(|c| c.0);
        if let Some(&(due, ..)) = chunks.last().filter(|c| c.0 > MAX_HOLD_NS) {
            return Err(Error::InvalidArgument(format!(
                "one-rank mode: a link of {} B/s and {} s of latency would hold an exchange step {} s (at most {} s)",
                self.pace.bytes_per_s,
                self.pace.latency_s,
                due as f64 / 1e9,
                MAX_HOLD_NS / 1_000_000_000
            )));
        }
        let clock = Arc::new(StepClock::default());
        queue.start(&clock)?;
        for (i, &(due, dst, src, bytes)) in chunks.iter().enumerate() {
            queue.copy(dst, src, bytes)?;
            queue.hold(&clock, due, i + 1 == chunks.len())?;
        }
        if chunks.is_empty() {
            queue.hold(&clock, self.pace.due_ns(0), true)?;
        }
        state.steps.push(StepRecord { bytes_in, bytes_out, clock });
        Ok(())
    }

    /// The device address the message `r` asks for is read from.
    fn message(&self, state: &mut State, r: &P2p) -> Result<u64> {
        match &self.inbox {
            Inbox::Any { addr, bytes } if r.bytes <= *bytes => Ok(*addr),
            Inbox::Any { bytes, .. } => Err(Error::Internal(format!(
                "one-rank mode: a message of {} bytes from rank {} is larger than the inbox's {bytes}",
                r.bytes, r.peer
            ))),
            Inbox::Messages(peers) => {
                if state.next.len() < peers.len() {
                    state.next.resize(peers.len(), 0);
                }
                let index = state.next.get(r.peer).copied().unwrap_or(0);
                let &(addr, bytes) = peers.get(r.peer).and_then(|m| m.get(index)).ok_or_else(|| {
                    Error::Internal(format!("one-rank mode: rank {} sends no message {index}", r.peer))
                })?;
                if bytes != r.bytes {
                    return Err(Error::Internal(format!(
                        "one-rank mode: message {index} of rank {} has {bytes} bytes, the plan receives {}",
                        r.peer, r.bytes
                    )));
                }
                state.next[r.peer] += 1;
                Ok(addr)
            }
        }
    }
}

/// `(offset, bytes)` pieces of at most `chunk` bytes covering `bytes`.
fn pieces(bytes: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..bytes.div_ceil(chunk)).map(move |i| (i * chunk, chunk.min(bytes - i * chunk)))
}

/// The link rate a call achieved: the bytes of the busier direction over
/// the steps' time past their latency (from their clocks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkReport {
    pub bytes: usize,
    pub seconds: f64,
    pub bytes_per_s: f64,
}

impl LinkReport {
    pub fn of(steps: &[StepRecord], pace: Pace) -> LinkReport {
        let mut bytes = 0;
        let mut seconds = 0.0;
        for s in steps {
            if let Some((start, end)) = s.clock.span() {
                bytes += s.bytes_in.max(s.bytes_out);
                seconds += ((end - start) as f64 / 1e9 - pace.latency_s).max(0.0);
            }
        }
        let bytes_per_s = if seconds > 0.0 { bytes as f64 / seconds } else { 0.0 };
        LinkReport { bytes, seconds, bytes_per_s }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what an exchange enqueues, running the holds as it goes.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl PacedQueue for Log {
        fn start(&mut self, clock: &Arc<StepClock>) -> Result<()> {
            clock.mark_start();
            self.0.push("start".into());
            Ok(())
        }
        fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()> {
            self.0.push(format!("copy {dst} {src} {bytes}"));
            Ok(())
        }
        fn hold(&mut self, clock: &Arc<StepClock>, after_ns: u64, last: bool) -> Result<()> {
            clock.hold_until(after_ns, last);
            self.0.push(format!("hold {after_ns} {last}"));
            Ok(())
        }
    }

    #[test]
    fn a_step_delivers_each_direction_at_the_links_rate_and_notes_its_end() {
        let pace = Pace { bytes_per_s: 1e12, latency_s: 1e-6 };
        let chunk = pace.chunk();
        assert_eq!(chunk, 100_000_000);
        let inbox = Inbox::Messages(vec![vec![], vec![(5000, chunk + 100)]]);
        let link = SoloLink::new(inbox, (9000, chunk), pace);
        link.begin_call();
        let recvs = [P2p { addr: 7000, bytes: chunk + 100, peer: 1 }];
        let sends = [P2p { addr: 8000, bytes: 1 << 20, peer: 1 }];
        let mut log = Log::default();
        link.exchange(&sends, &recvs, &mut log).unwrap();
        let want = [
            "start".to_string(),
            format!("copy 9000 8000 {}", 1 << 20),
            format!("hold {} false", 1_000 + (1u64 << 20).div_ceil(1000)),
            format!("copy 7000 5000 {chunk}"),
            format!("hold {} false", 1_000 + chunk as u64 / 1000),
            format!("copy {} {} 100", 7000 + chunk, 5000 + chunk),
            format!("hold {} true", 1_000 + (chunk as u64 + 100).div_ceil(1000)),
        ];
        assert_eq!(log.0, want);
        let steps = link.steps();
        assert_eq!((steps[0].bytes_in, steps[0].bytes_out), (chunk + 100, 1 << 20));
        // The holds made the step last as long as the link would: 100 us.
        let report = LinkReport::of(&steps, pace);
        assert!(report.seconds >= 100e-6 && report.bytes_per_s <= 1e12 * 1.001, "{report:?}");
        // The peer has no second message.
        let e = link.exchange(&[], &recvs, &mut Log::default()).unwrap_err();
        assert!(e.message().contains("rank 1 sends no message 1"), "{e}");
    }

    #[test]
    fn a_call_starts_afresh_and_the_inbox_bounds_the_messages() {
        let link = SoloLink::new(Inbox::Any { addr: 1, bytes: 64 }, (2, 64), Pace::of_machine("h100_nvlink").unwrap());
        link.begin_call();
        let recv = [P2p { addr: 3, bytes: 64, peer: 0 }];
        link.exchange(&[], &recv, &mut Log::default()).unwrap();
        link.exchange(&[], &recv, &mut Log::default()).unwrap();
        assert_eq!(link.steps().len(), 2);
        link.begin_call();
        assert!(link.steps().is_empty());
        let e = link.exchange(&[], &[P2p { addr: 3, bytes: 65, peer: 0 }], &mut Log::default()).unwrap_err();
        assert!(e.message().contains("larger than the inbox"), "{e}");
        // A link too slow to deliver a step in bounded time is refused.
        let slow = SoloLink::new(Inbox::Any { addr: 1, bytes: 64 }, (2, 64), Pace { bytes_per_s: 1.0, latency_s: 0.0 });
        slow.begin_call();
        let e = slow.exchange(&[], &recv, &mut Log::default()).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("would hold an exchange step 64 s")), "{e}");
        // An unlimited link copies in bounded pieces.
        assert_eq!(Pace { bytes_per_s: f64::INFINITY, latency_s: 0.0 }.chunk(), MAX_CHUNK);
    }

    #[test]
    fn a_hold_without_a_start_returns_at_once() {
        let clock = StepClock::default();
        let begun = Instant::now();
        clock.hold_until(10_000_000_000, true);
        assert!(begun.elapsed().as_secs() < 5);
        assert_eq!(clock.span(), None);
    }
}
