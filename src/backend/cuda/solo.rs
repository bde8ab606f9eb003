//! One rank of an N-rank group on one GPU: rank r's real plan of any op kind
//! and schedule, its GEMMs as in production, and each transfer replaced by a
//! paced copy-engine copy. What a peer would send comes from a device buffer
//! holding that peer's message (the *inbox*); what the rank sends is copied
//! to a *sink*. A timer kernel (`kernels/pace.cu`) holds the communication
//! lane after each copy until the link would have delivered it, so a call
//! takes the time it would take on a link of the given bandwidth and
//! latency, with real kernels, copy engines, events and contention.
//!
//! Pacing: an exchange step cuts its transfers into chunks ([`Pace::chunk`])
//! and takes them in the order the link would deliver them (incoming and
//! outgoing each at the link's rate, as a device's two ports of a switch).
//! The lane writes a *started* flag when it reaches the step, then copies
//! each chunk and waits for a *released* flag to reach that chunk's count;
//! after the step it writes an *ended* flag. A host thread, the [`pace`]r,
//! watches the flags: when a step starts it notes the time and raises
//! *released* chunk by chunk at `latency + bytes so far / bandwidth` after
//! it, and it notes when the step ended. The flags are words of pinned host
//! memory the stream writes and waits on itself (`driver::MappedWords`,
//! stream memory operations), so pacing takes no SM: a pacing kernel waited
//! behind the GEMMs for one, and host callbacks each cost tens of
//! microseconds (on an H200 they reached 12-60% and 6-44% of an NVLink's
//! rate). The steps' times as the pacer saw them give the achieved rate
//! ([`LinkReport`]), measured, not assumed.
//!
//! With the inbox holding exactly the messages the peers send (the CPU
//! model of the group gives them: `emulate::solo_inbox`), the rank's output
//! is the CPU backend's, bit for bit; a benchmark fills it with any bytes.
#![forbid(unsafe_code)]

use super::addresses::P2p;
use crate::error::{Error, Result};
use std::sync::{Mutex, OnceLock};
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
        (self.latency_s * 1e9).round() as u64 + transfer as u64
    }

    /// Bytes of one paced copy: what the link moves in 50 us, at least 4
    /// MiB, so that a hold's own latency (some microseconds) is small beside it.
    pub fn chunk(&self) -> usize {
        let per_50us = if self.bytes_per_s.is_finite() { self.bytes_per_s * 50e-6 } else { f64::MAX };
        (per_50us.min(1e12) as usize).max(MIN_CHUNK)
    }
}

/// The smallest paced copy.
pub const MIN_CHUNK: usize = 4 << 20;

/// Nanoseconds since this process first asked (a monotonic clock).
pub fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    u64::try_from(BASE.get_or_init(Instant::now).elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The three pacing flags, as words the stream and the pacer share.
pub mod flags {
    /// Exchange steps the stream has reached (it writes `step + 1`).
    pub const STARTED: usize = 0;
    /// Chunks the pacer has released (the stream waits for `hold + 1`).
    pub const RELEASED: usize = 1;
    /// Exchange steps the stream has passed (it writes `step + 1`).
    pub const ENDED: usize = 2;
    pub const COUNT: usize = 3;
    /// What the pacer raises *released* to when it returns: every wait ends.
    /// Not `u32::MAX`: a stream's "at least" wait compares cyclically
    /// (`(int32_t)(flag - value) >= 0`, cuStreamWaitValue32's GEQ), so the
    /// largest value every count is below is `i32::MAX`.
    pub const TOP: u32 = i32::MAX as u32;

    /// A count as a flag's value, below [`TOP`].
    pub fn count(n: usize) -> u32 {
        u32::try_from(n).unwrap_or(TOP).min(TOP - 1)
    }
}

/// The pacer's view of the flags (the mapped words on a GPU).
pub trait Flags {
    fn load(&self, flag: usize) -> Result<u32>;
    fn store(&self, flag: usize, value: u32) -> Result<()>;
}

/// Paces one call's `steps` (see the module's doc) as the stream reaches
/// them; returns each step's (start, end) in [`now_ns`]. Bounded: a step the
/// stream does not reach, or does not pass, before `deadline` ends it with
/// DEADLINE_EXCEEDED. On every return the flag *released* is raised to the
/// top ([`flags::TOP`]), so the stream never waits on a pacer that is gone.
pub fn pace(steps: &[StepRecord], flags: &impl Flags, deadline: Instant) -> Result<Vec<(u64, u64)>> {
    struct ReleaseAll<'f, F: Flags>(&'f F);
    impl<F: Flags> Drop for ReleaseAll<'_, F> {
        fn drop(&mut self) {
            let _ = self.0.store(flags::RELEASED, flags::TOP);
        }
    }
    let _release_all = ReleaseAll(flags);
    let wait_flag = |flag: usize, at_least: u32, what: &str| -> Result<()> {
        while flags.load(flag)? < at_least {
            if Instant::now() > deadline {
                return Err(Error::DeadlineExceeded(format!("one-rank mode: the stream never {what}")));
            }
            std::hint::spin_loop();
        }
        Ok(())
    };
    let mut spans = Vec::with_capacity(steps.len());
    for (s, step) in steps.iter().enumerate() {
        let count = flags::count(s + 1);
        wait_flag(flags::STARTED, count, &format!("reached exchange step {s}"))?;
        let start = now_ns();
        for (i, &due) in step.dues.iter().enumerate() {
            let due = start.saturating_add(due);
            let mut now = now_ns();
            while now < due {
                if due - now > 200_000 {
                    std::thread::sleep(std::time::Duration::from_nanos(due - now - 100_000));
                } else {
                    std::hint::spin_loop();
                }
                now = now_ns();
            }
            flags.store(flags::RELEASED, flags::count(step.first_hold + i + 1))?;
        }
        wait_flag(flags::ENDED, count, &format!("passed exchange step {s}"))?;
        spans.push((start, now_ns()));
    }
    Ok(spans)
}

/// Where the peers' messages are on the device.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbox {
    /// Per peer, its messages to this rank in the order it sends them (address, bytes).
    Messages(Vec<Vec<(u64, usize)>>),
    /// One region every message is read from (its first bytes): for timing only.
    Any { addr: u64, bytes: usize },
}

/// One exchange step as enqueued: its bytes each way, and its holds: the
/// first one's number in the call and each one's time after the step's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRecord {
    pub bytes_in: usize,
    pub bytes_out: usize,
    pub first_hold: usize,
    pub dues: Vec<u64>,
}

/// The device side of the pacing, on one stream: the CUDA lane
/// (`enqueue`) or the model's recorder (`emulate`).
pub trait PacedQueue {
    /// Writes *started* = `step + 1` when the stream gets there.
    fn start(&mut self, step: usize) -> Result<()>;
    /// Copies `bytes` bytes from `src` to `dst` (a copy engine's work).
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Waits until *released* reaches `hold + 1`.
    fn hold(&mut self, hold: usize) -> Result<()>;
    /// Writes *ended* = `step + 1`.
    fn end(&mut self, step: usize) -> Result<()>;
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
        if chunks.is_empty() {
            // Still a message's latency.
            chunks.push((self.pace.due_ns(0), 0, 0, 0));
        }
        let step = state.steps.len();
        let first_hold = state.steps.last().map_or(0, |s| s.first_hold + s.dues.len());
        queue.start(step)?;
        for (i, &(_, dst, src, bytes)) in chunks.iter().enumerate() {
            if bytes > 0 {
                queue.copy(dst, src, bytes)?;
            }
            queue.hold(first_hold + i)?;
        }
        queue.end(step)?;
        let dues = chunks.iter().map(|c| c.0).collect();
        state.steps.push(StepRecord { bytes_in, bytes_out, first_hold, dues });
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
    /// From the steps and their (start, end) as the pacer saw them.
    pub fn of(steps: &[StepRecord], spans: &[(u64, u64)], pace: Pace) -> LinkReport {
        let mut bytes = 0;
        let mut seconds = 0.0;
        for (s, &(start, end)) in steps.iter().zip(spans) {
            bytes += s.bytes_in.max(s.bytes_out);
            seconds += (end.saturating_sub(start) as f64 / 1e9 - pace.latency_s).max(0.0);
        }
        let bytes_per_s = if seconds > 0.0 { bytes as f64 / seconds } else { 0.0 };
        LinkReport { bytes, seconds, bytes_per_s }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    /// Records what an exchange enqueues.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl PacedQueue for Log {
        fn start(&mut self, step: usize) -> Result<()> {
            self.0.push(format!("start {step}"));
            Ok(())
        }
        fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()> {
            self.0.push(format!("copy {dst} {src} {bytes}"));
            Ok(())
        }
        fn hold(&mut self, hold: usize) -> Result<()> {
            self.0.push(format!("hold {hold}"));
            Ok(())
        }
        fn end(&mut self, step: usize) -> Result<()> {
            self.0.push(format!("end {step}"));
            Ok(())
        }
    }

    #[test]
    fn a_step_delivers_each_direction_at_the_links_rate() {
        let pace = Pace { bytes_per_s: 1e12, latency_s: 1e-6 };
        let chunk = pace.chunk();
        assert_eq!(chunk, 50_000_000);
        let inbox = Inbox::Messages(vec![vec![], vec![(5000, chunk + 100)]]);
        let link = SoloLink::new(inbox, (9000, chunk), pace);
        link.begin_call();
        let recvs = [P2p { addr: 7000, bytes: chunk + 100, peer: 1 }];
        let sends = [P2p { addr: 8000, bytes: 1 << 20, peer: 1 }];
        let mut log = Log::default();
        link.exchange(&sends, &recvs, &mut log).unwrap();
        let want = [
            "start 0".to_string(),
            format!("copy 9000 8000 {}", 1 << 20),
            "hold 0".into(),
            format!("copy 7000 5000 {chunk}"),
            "hold 1".into(),
            format!("copy {} {} 100", 7000 + chunk, 5000 + chunk),
            "hold 2".into(),
            "end 0".into(),
        ];
        assert_eq!(log.0, want);
        let dues = vec![1_000 + (1u64 << 20).div_ceil(1000), 1_000 + chunk as u64 / 1000, 1_000 + 50_001];
        let step = StepRecord { bytes_in: chunk + 100, bytes_out: 1 << 20, first_hold: 0, dues };
        assert_eq!(link.steps(), vec![step]);
        // A step with nothing to move still pays the latency; holds number on.
        let mut log = Log::default();
        link.exchange(&[], &[], &mut log).unwrap();
        assert_eq!(log.0, ["start 1", "hold 3", "end 1"]);
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
    }

    /// Flags in host memory, for a stream played by a thread.
    #[derive(Default)]
    struct HostFlags([AtomicU32; flags::COUNT]);

    impl Flags for HostFlags {
        fn load(&self, flag: usize) -> Result<u32> {
            Ok(self.0[flag].load(Ordering::Acquire))
        }
        fn store(&self, flag: usize, value: u32) -> Result<()> {
            self.0[flag].store(value, Ordering::Release);
            Ok(())
        }
    }

    /// A thread plays the stream (writes *started*, waits for each hold's
    /// release, writes *ended*); the pacer releases each hold no earlier
    /// than its due time after the step's start, and the rate it reports is
    /// at most the link's.
    #[test]
    fn the_pacer_releases_each_hold_at_its_time() {
        let link_pace = Pace { bytes_per_s: 1e10, latency_s: 20e-6 };
        let link = SoloLink::new(Inbox::Any { addr: 1, bytes: 8 << 20 }, (2, 8 << 20), link_pace);
        link.begin_call();
        let recv = [P2p { addr: 3, bytes: 6 << 20, peer: 0 }];
        link.exchange(&[], &recv, &mut Log::default()).unwrap();
        link.exchange(&[], &recv, &mut Log::default()).unwrap();
        let steps = link.steps();
        let flags = HostFlags::default();
        let released_at = std::thread::scope(|s| {
            let stream = s.spawn(|| {
                let mut released_at = Vec::new();
                for (i, step) in steps.iter().enumerate() {
                    flags.store(flags::STARTED, i as u32 + 1).unwrap();
                    let start = Instant::now();
                    for h in 0..step.dues.len() {
                        while flags.load(flags::RELEASED).unwrap() < (step.first_hold + h + 1) as u32 {
                            std::hint::spin_loop();
                        }
                        released_at.push((start.elapsed(), step.dues[h]));
                    }
                    flags.store(flags::ENDED, i as u32 + 1).unwrap();
                }
                released_at
            });
            let spans = pace(&steps, &flags, Instant::now() + Duration::from_secs(10)).unwrap();
            let report = LinkReport::of(&steps, &spans, link.pace);
            assert_eq!(report.bytes, 12 << 20);
            assert!(report.bytes_per_s > 0.0 && report.bytes_per_s <= 1e10 * 1.01, "{report:?}");
            stream.join().unwrap()
        });
        assert_eq!(released_at.len(), 4);
        for (elapsed, due) in released_at {
            // The stream saw the start no later than the pacer did.
            assert!(elapsed.as_nanos() as u64 + 1 >= due, "released after {elapsed:?}, due {due} ns");
        }
        assert_eq!(flags.load(flags::RELEASED).unwrap(), flags::TOP, "released to the top on return");
    }

    #[test]
    fn a_stream_that_never_reaches_a_step_ends_the_pacer_with_a_deadline() {
        let pace_of = Pace::of_machine("h100_nvlink").unwrap();
        let link = SoloLink::new(Inbox::Any { addr: 1, bytes: 64 }, (2, 64), pace_of);
        link.begin_call();
        link.exchange(&[], &[P2p { addr: 3, bytes: 64, peer: 0 }], &mut Log::default()).unwrap();
        let flags = HostFlags::default();
        let e = pace(&link.steps(), &flags, Instant::now() + Duration::from_millis(50)).unwrap_err();
        assert!(matches!(&e, Error::DeadlineExceeded(m) if m.contains("never reached exchange step 0")), "{e}");
        assert_eq!(flags.load(flags::RELEASED).unwrap(), flags::TOP);
    }
}
