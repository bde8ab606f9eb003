//! One rank of an N-rank group on one GPU: rank r's real plan of any op kind
//! and schedule, its GEMMs as in production, and each transfer replaced by a
//! paced copy-engine copy. What a peer would send comes from a device buffer
//! holding that peer's message (the *inbox*); what the rank sends is copied
//! to a *sink*. A timer kernel (`kernels/pace.cu`) holds the communication
//! lane after each copy until the link would have delivered it, so a call
//! takes the time it would take on a link of the given bandwidth and
//! latency, with real kernels, copy engines, events and contention.
//!
//! Pacing: an exchange step stamps the GPU's global timer when its lane
//! reaches it, cuts its transfers into chunks of at most [`CHUNK`] bytes,
//! and takes them in the order the link would deliver them (incoming and
//! outgoing each at the link's rate, as a device's two ports of a switch):
//! each chunk is copied, then the lane waits until `latency + bytes so far /
//! bandwidth` after the stamp. The last wait logs when the step ended, so
//! the achieved rate is measured on the device, not assumed ([`LinkReport`]).
//!
//! With the inbox holding exactly the messages the peers send (the CPU
//! model of the group gives them: `emulate::solo_inbox`), the rank's output
//! is the CPU backend's, bit for bit; a benchmark fills it with any bytes.
#![forbid(unsafe_code)]

use super::addresses::P2p;
use crate::error::{Error, Result};
use std::sync::Mutex;

/// Bytes of one paced copy: small enough that the copies follow the link's
/// rate closely, large enough that each is mostly transfer, not launch.
pub const CHUNK: usize = 4 << 20;

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
        let s = self.latency_s + if self.bytes_per_s.is_finite() { bytes as f64 / self.bytes_per_s } else { 0.0 };
        (s * 1e9).ceil() as u64
    }
}

/// Where the peers' messages are on the device.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbox {
    /// Per peer, its messages to this rank in the order it sends them (address, bytes).
    Messages(Vec<Vec<(u64, usize)>>),
    /// One region every message is read from (its first bytes): for timing only.
    Any { addr: u64, bytes: usize },
}

/// What one exchange step did: its clock slots and its bytes each way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepRecord {
    pub start_slot: usize,
    pub end_slot: usize,
    pub bytes_in: usize,
    pub bytes_out: usize,
}

/// The device side of the pacing, on one stream: the CUDA lane
/// (`enqueue`) or the model's recorder (`emulate`).
pub trait PacedQueue {
    /// Writes the global timer to the u64 at `at`.
    fn stamp(&mut self, at: u64) -> Result<()>;
    /// Copies `bytes` bytes from `src` to `dst` (a copy engine's work).
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Holds the stream until the timer reads the u64 at `start` plus
    /// `after_ns`; then writes the time to `log`, if given.
    fn pace(&mut self, start: u64, after_ns: u64, log: Option<u64>) -> Result<()>;
}

/// Clock slots the timer kernels write: 0 and 1 are a call's start and end
/// (`run` stamps them), then two per exchange step.
pub const CALL_SLOTS: usize = 2;

/// One rank's link to its absent peers, for one call at a time.
pub struct SoloLink {
    pub inbox: Inbox,
    /// Device memory the rank's sends are copied into.
    pub sink: (u64, usize),
    pub pace: Pace,
    /// Device address of `slots` u64 clock slots.
    pub clock: u64,
    pub slots: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Per peer, the next message of `Inbox::Messages` to deliver.
    next: Vec<usize>,
    steps: Vec<StepRecord>,
}

impl SoloLink {
    pub fn new(inbox: Inbox, sink: (u64, usize), pace: Pace, clock: u64, slots: usize) -> SoloLink {
        SoloLink { inbox, sink, pace, clock, slots, state: Mutex::default() }
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

    fn slot(&self, slot: usize) -> u64 {
        self.clock + 8 * slot as u64
    }

    /// Enqueues one exchange step on `queue`: the receives from the inbox,
    /// the sends into the sink, paced as the module's doc says.
    pub fn exchange(&self, sends: &[P2p], recvs: &[P2p], queue: &mut impl PacedQueue) -> Result<()> {
        let mut state = crate::sync::lock(&self.state);
        let start_slot = CALL_SLOTS + 2 * state.steps.len();
        let end_slot = start_slot + 1;
        if end_slot >= self.slots {
            return Err(Error::Internal(format!(
                "one-rank mode: step {} needs clock slot {end_slot} of {}",
                state.steps.len(),
                self.slots
            )));
        }
        // (due ns, destination, source, bytes), incoming and outgoing each
        // delivered at the link's rate.
        let mut chunks: Vec<(u64, u64, u64, usize)> = Vec::new();
        let mut bytes_in = 0;
        for r in recvs {
            let src = self.message(&mut state, r)?;
            for (offset, bytes) in pieces(r.bytes, CHUNK) {
                bytes_in += bytes;
                chunks.push((self.pace.due_ns(bytes_in), r.addr + offset as u64, src + offset as u64, bytes));
            }
        }
        let mut bytes_out = 0;
        for s in sends {
            for (offset, bytes) in pieces(s.bytes, CHUNK.min(self.sink.1)) {
                bytes_out += bytes;
                chunks.push((self.pace.due_ns(bytes_out), self.sink.0, s.addr + offset as u64, bytes));
            }
        }
        chunks.sort_by_key(|c| c.0);
        let (start, end) = (self.slot(start_slot), self.slot(end_slot));
        queue.stamp(start)?;
        for (i, &(due, dst, src, bytes)) in chunks.iter().enumerate() {
            queue.copy(dst, src, bytes)?;
            queue.pace(start, due, (i + 1 == chunks.len()).then_some(end))?;
        }
        if chunks.is_empty() {
            queue.pace(start, self.pace.due_ns(0), Some(end))?;
        }
        state.steps.push(StepRecord { start_slot, end_slot, bytes_in, bytes_out });
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

/// The link rate a call achieved, from its clock slots: the bytes of the
/// busier direction over the steps' time past their latency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkReport {
    pub bytes: usize,
    pub seconds: f64,
    pub bytes_per_s: f64,
}

impl LinkReport {
    pub fn of(steps: &[StepRecord], clock: &[u64], pace: Pace) -> LinkReport {
        let mut bytes = 0;
        let mut seconds = 0.0;
        for s in steps {
            let (start, end) = (clock.get(s.start_slot).copied(), clock.get(s.end_slot).copied());
            if let (Some(start), Some(end)) = (start, end) {
                bytes += s.bytes_in.max(s.bytes_out);
                seconds += (end.saturating_sub(start) as f64 / 1e9 - pace.latency_s).max(0.0);
            }
        }
        let bytes_per_s = if seconds > 0.0 { bytes as f64 / seconds } else { 0.0 };
        LinkReport { bytes, seconds, bytes_per_s }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what an exchange enqueues.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl PacedQueue for Log {
        fn stamp(&mut self, at: u64) -> Result<()> {
            self.0.push(format!("stamp {at}"));
            Ok(())
        }
        fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()> {
            self.0.push(format!("copy {dst} {src} {bytes}"));
            Ok(())
        }
        fn pace(&mut self, start: u64, after_ns: u64, log: Option<u64>) -> Result<()> {
            self.0.push(format!("pace {start} {after_ns} {log:?}"));
            Ok(())
        }
    }

    #[test]
    fn a_step_delivers_each_direction_at_the_links_rate_and_logs_its_end() {
        let pace = Pace { bytes_per_s: 1e9, latency_s: 1e-6 };
        let inbox = Inbox::Messages(vec![vec![], vec![(5000, 6 << 20)]]);
        let link = SoloLink::new(inbox, (9000, CHUNK), pace, 100, 8);
        link.begin_call();
        let recvs = [P2p { addr: 7000, bytes: 6 << 20, peer: 1 }];
        let sends = [P2p { addr: 8000, bytes: 1 << 20, peer: 1 }];
        let mut log = Log::default();
        link.exchange(&sends, &recvs, &mut log).unwrap();
        // Clock slot 2 (the first after the call's two) at 100 + 16.
        let want = [
            "stamp 116".to_string(),
            format!("copy 9000 8000 {}", 1 << 20),
            format!("pace 116 {} None", 1_000 + (1u64 << 20)),
            format!("copy 7000 5000 {CHUNK}"),
            format!("pace 116 {} None", 1_000 + CHUNK as u64),
            format!("copy {} {} {}", 7000 + CHUNK, 5000 + CHUNK, (6 << 20) - CHUNK),
            format!("pace 116 {} Some(124)", 1_000 + (6u64 << 20)),
        ];
        assert_eq!(log.0, want);
        assert_eq!(
            link.steps(),
            vec![StepRecord { start_slot: 2, end_slot: 3, bytes_in: 6 << 20, bytes_out: 1 << 20 }]
        );
        // The peer has no second message.
        let e = link.exchange(&[], &recvs, &mut Log::default()).unwrap_err();
        assert!(e.message().contains("rank 1 sends no message 1"), "{e}");
        // Achieved: 6 MiB over the logged time less the latency.
        let clock = [0, 0, 1_000, 1_000 + 1_000 + 6_291_456];
        let report = LinkReport::of(&link.steps(), &clock, pace);
        assert_eq!(report.bytes, 6 << 20);
        assert!((report.bytes_per_s - 1e9).abs() < 1.0, "{report:?}");
    }

    #[test]
    fn the_clock_bounds_the_steps_and_a_call_starts_afresh() {
        let link =
            SoloLink::new(Inbox::Any { addr: 1, bytes: 64 }, (2, 64), Pace::of_machine("h100_nvlink").unwrap(), 0, 4);
        link.begin_call();
        let recv = [P2p { addr: 3, bytes: 64, peer: 0 }];
        link.exchange(&[], &recv, &mut Log::default()).unwrap();
        let e = link.exchange(&[], &recv, &mut Log::default()).unwrap_err();
        assert!(e.message().contains("clock slot 5 of 4"), "{e}");
        link.begin_call();
        assert!(link.steps().is_empty());
        let e = link.exchange(&[], &[P2p { addr: 3, bytes: 65, peer: 0 }], &mut Log::default()).unwrap_err();
        assert!(e.message().contains("larger than the inbox"), "{e}");
        link.exchange(&[], &recv, &mut Log::default()).unwrap();
    }
}
