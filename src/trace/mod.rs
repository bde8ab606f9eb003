//! Timeline recording: what each lane of each device did, and when, written
//! as a Perfetto trace (ui.perfetto.dev opens it).
//!
//! Off by default. While off, a handler pays one relaxed atomic load per call
//! ([`Recording::begin`]) and runs its plan unwatched. While on
//! (`commfuse_trace_start`), the handler passes a [`Recording`] to the
//! executor as its observer (`crate::exec::Observer`), and every lane records
//! into a lane-local buffer — a slice per matmul ("matmul"), sum ("add") and
//! exchange ("exchange", with a "send" or "recv" slice per transfer inside it,
//! as the backend reported them), and a "wait" slice whenever a step had to
//! wait for another lane's step — and hands them to the global buffer when the
//! lane ends. The run is the one that runs untraced: same threads, same order.
//!
//! On the CPU backend the times are when the host did the work. On the CUDA
//! backend they are when the host enqueued each step on its stream (a
//! "matmul" slice there is the time to enqueue the GEMM, not to run it); the
//! device times are not recorded. Timestamps are
//! monotonic nanoseconds since the first use of the recorder in this process.
//! `commfuse_trace_write` stops the recording, waits for runs in flight, and
//! writes the trace: a process track per device, a thread track per lane.
//!
//! A "recv" slice lasts from posting the receive to the data landing, so its
//! length is the time the lane waited for the message (plus one copy).
#![forbid(unsafe_code)]

mod encode;
pub mod proto;
#[cfg(test)]
mod tests;
mod timed;

pub use encode::{encode, encode_json};
pub use timed::{call_events, CALL_START_NS};

use crate::error::{Error, Result};
use crate::exec::{Copies, Direction, LaneObserver, Observer};
use crate::plan::{Action, Buf, Lane, Plan, Step, StepId, Transfer, Workspace};
use crate::problem::Problem;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

static ENABLED: AtomicBool = AtomicBool::new(false);
/// Runs that began recording and have not handed their events in yet.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Numbers the recorded runs, so the slices of one call can be told apart.
static CALLS: AtomicU64 = AtomicU64::new(0);
static EVENTS: Mutex<Vec<Event>> = Mutex::new(Vec::new());

/// How long `stop` waits for runs in flight to hand in their events.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Monotonic nanoseconds since the recorder's epoch (never 0).
pub fn now_ns() -> u64 {
    ns(Instant::now())
}

/// `at` in nanoseconds since the recorder's epoch (never 0).
fn ns(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX).saturating_add(1)
}

/// Whether runs are being recorded.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Starts recording, dropping events a previous recording left unwritten.
/// Errors when a recording is already on.
pub fn start() -> Result<()> {
    let _ = epoch();
    let mut events = crate::sync::lock(&EVENTS);
    if ENABLED.swap(true, Ordering::SeqCst) {
        return Err(Error::InvalidArgument("a commfuse trace is already being recorded".into()));
    }
    events.clear();
    Ok(())
}

/// Stops recording and waits (bounded) for runs in flight to hand in their
/// events; returns how many events are buffered.
pub fn stop() -> usize {
    ENABLED.store(false, Ordering::SeqCst);
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    while IN_FLIGHT.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(200));
    }
    crate::sync::lock(&EVENTS).len()
}

/// Stops recording and takes the buffered events.
pub fn drain() -> Vec<Event> {
    stop();
    std::mem::take(&mut *crate::sync::lock(&EVENTS))
}

/// Stops recording and writes the buffered events to `path` as a Perfetto
/// trace, or as a Chrome trace (JSON) where `path` ends in `.json`; returns
/// the bytes written.
pub fn write(path: &std::path::Path) -> Result<usize> {
    write_events(path, &drain())
}

/// Writes `events` to `path` as [`write`] does.
pub fn write_events(path: &std::path::Path, events: &[Event]) -> Result<usize> {
    let json = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"));
    let bytes = if json { encode_json(events) } else { encode(events) };
    std::fs::write(path, &bytes)
        .map_err(|e| Error::InvalidArgument(format!("writing the trace to {}: {e}", path.display())))?;
    Ok(bytes.len())
}

/// What a slice is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One whole run of a plan on one lane (named after the op).
    Call,
    /// A step waiting for steps of another lane.
    Wait,
    Matmul,
    /// A `Sum` step.
    Add,
    /// An `Exchange` step; its transfers are `Send` and `Recv` slices inside it.
    Exchange,
    Send,
    Recv,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Call => "call",
            Kind::Wait => "wait",
            Kind::Matmul => "matmul",
            Kind::Add => "add",
            Kind::Exchange => "exchange",
            Kind::Send => "send",
            Kind::Recv => "recv",
        }
    }

    pub fn category(self) -> &'static str {
        match self {
            Kind::Call => "call",
            Kind::Wait => "wait",
            Kind::Matmul | Kind::Add => "compute",
            Kind::Exchange | Kind::Send | Kind::Recv => "comm",
        }
    }

    /// Nesting depth on its lane's track.
    pub fn depth(self) -> u8 {
        match self {
            Kind::Call => 0,
            Kind::Send | Kind::Recv => 2,
            _ => 1,
        }
    }
}

/// A slice argument's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U(u64),
    I(i64),
    S(String),
    B(bool),
}

/// One recorded slice.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub device: i64,
    pub rank: usize,
    pub lane: Lane,
    pub kind: Kind,
    pub op: &'static str,
    pub call: u64,
    pub step: Option<StepId>,
    pub start_ns: u64,
    pub end_ns: u64,
    pub args: Vec<(&'static str, Value)>,
}

impl Event {
    /// The slice's name in the trace: the op's for a call, else the kind's.
    pub fn name(&self) -> &'static str {
        match self.kind {
            Kind::Call => self.op,
            kind => kind.name(),
        }
    }
}

/// What the trace says of a call: who ran it, and how big its buffers are.
#[derive(Debug, Clone)]
pub struct CallLabel {
    pub device: i64,
    pub rank: usize,
    pub op: &'static str,
    pub site: i64,
    /// How its transfers go: `host` (the CPU backend), `nccl` or `copies`;
    /// `one-rank mode` (paced copies, `backend::cuda::solo`) or `predicted`
    /// (the cost model's) for a timeline of known times (`call_events`).
    pub transport: &'static str,
    /// Bytes of each workspace slot, and of the whole local `x`.
    pub slot_bytes: Vec<usize>,
    pub x_bytes: usize,
    /// Bytes of the whole local `w` (`Buf::W`, which a two-gather plan sends).
    pub w_bytes: usize,
    /// Bytes of each `Buf::XBlock(j)` (`Problem::x_block`).
    pub x_block_bytes: Vec<usize>,
}

impl CallLabel {
    /// The label of `device`'s call of `op` at call site `site`.
    pub fn new(device: i64, site: i64, op: &'static str, plan: &Plan, problem: &Problem, x_bytes: usize) -> CallLabel {
        // The call's own layout was checked before it got here.
        let slot_bytes = Workspace::layout(plan, &problem.sizes()).map(|l| l.slots.iter().map(|r| r.len()).collect());
        let x_block_bytes =
            (0..).map_while(|j| problem.x_block(j)).map(|part| part.len() * problem.input.size()).collect();
        CallLabel {
            device,
            rank: plan.rank,
            op,
            site,
            transport: "host",
            slot_bytes: slot_bytes.unwrap_or_default(),
            x_bytes,
            w_bytes: problem.sizes().w * problem.input.size(),
            x_block_bytes,
        }
    }

    /// The bytes of `buf` in this call (none for the output's).
    pub fn bytes(&self, buf: Buf) -> Option<usize> {
        match buf {
            Buf::Slot(i) => self.slot_bytes.get(i).copied(),
            Buf::X => Some(self.x_bytes),
            Buf::W => Some(self.w_bytes),
            Buf::XBlock(j) => self.x_block_bytes.get(j).copied(),
            Buf::Out | Buf::OutBlock(_) => None,
        }
    }

    /// The arguments of this call's call slice on each lane.
    fn call_args(&self, n: usize, schedule: String) -> Vec<(&'static str, Value)> {
        vec![
            ("site", Value::I(self.site)),
            ("n", Value::U(n as u64)),
            ("schedule", Value::S(schedule)),
            ("transport", Value::S(self.transport.to_string())),
        ]
    }
}

/// What a step's slice is, and its arguments (`label` sizes its buffers).
fn step_slice(step: &Step, label: &CallLabel) -> (Kind, Vec<(&'static str, Value)>) {
    let deps = ("deps", Value::S(list(&step.deps)));
    match &step.action {
        Action::Matmul { block, src, with, dst, accumulate } => {
            let mut args = vec![
                deps,
                ("block", Value::U(*block as u64)),
                ("src", Value::S(src.to_string())),
                ("dst", Value::S(dst.to_string())),
                ("accumulate", Value::B(*accumulate)),
            ];
            // The local w is every product's but a two-gather plan's.
            if *with != Buf::W {
                args.push(("with", Value::S(with.to_string())));
            }
            (Kind::Matmul, args)
        }
        Action::Sum { terms, dst } => (
            Kind::Add,
            vec![
                deps,
                ("terms", Value::S(list(terms.iter().map(|t| t.to_string())))),
                ("dst", Value::S(dst.to_string())),
            ],
        ),
        Action::Exchange { sends, recvs } => {
            let total: usize = sends.iter().chain(recvs).filter_map(|t| label.bytes(t.buf)).sum();
            (
                Kind::Exchange,
                vec![
                    deps,
                    ("to", Value::S(list(sends.iter().map(|t| t.peer)))),
                    ("from", Value::S(list(recvs.iter().map(|t| t.peer)))),
                    ("bytes", Value::U(total as u64)),
                ],
            )
        }
    }
}

/// The number of a new recorded call, counted in flight until its events
/// are handed in (the caller's drop ends it); `None`, after one relaxed
/// load, unless recording is on.
fn begin_call() -> Option<u64> {
    if !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
    if !ENABLED.load(Ordering::SeqCst) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        return None;
    }
    Some(CALLS.fetch_add(1, Ordering::Relaxed))
}

/// One run of a plan being recorded: the executor's observer.
pub struct Recording {
    label: CallLabel,
    call: u64,
    n: usize,
    schedule: String,
    /// What the backend copied, once the run is over.
    copies: Mutex<Option<Copies>>,
}

impl Recording {
    /// `None` (after one relaxed load) unless recording is on; `label` is
    /// only asked for when it is.
    pub fn begin(plan: &Plan, label: impl FnOnce() -> CallLabel) -> Option<Recording> {
        let call = begin_call()?;
        Some(Recording {
            label: label(),
            call,
            n: plan.n,
            schedule: plan.schedule.to_string(),
            copies: Mutex::new(None),
        })
    }

    /// The recorder of one lane; its events go to the global buffer when it drops.
    pub fn lane(&self, lane: Lane) -> LaneLog<'_> {
        LaneLog { recording: self, lane, start_ns: now_ns(), events: RefCell::new(Vec::new()) }
    }

    fn bytes(&self, buf: Buf) -> Option<usize> {
        self.label.bytes(buf)
    }
}

impl Observer for Recording {
    fn lane(&self, lane: Lane) -> Box<dyn LaneObserver + '_> {
        Box::new(Recording::lane(self, lane))
    }

    fn copied(&self, copies: Copies) {
        *crate::sync::lock(&self.copies) = Some(copies);
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        // The copies go on the compute lane's call slice, handed in when that lane ended.
        if let Some(copies) = crate::sync::lock(&self.copies).take() {
            let mut events = crate::sync::lock(&EVENTS);
            let call = events.iter_mut().rev().find(|e| {
                e.kind == Kind::Call && e.call == self.call && e.lane == Lane::Compute && e.device == self.label.device
            });
            if let Some(call) = call {
                call.args.push(("copies", Value::U(copies.count as u64)));
                call.args.push(("copied_bytes", Value::U(copies.bytes as u64)));
            }
        }
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One lane's events of one run.
pub struct LaneLog<'r> {
    recording: &'r Recording,
    lane: Lane,
    start_ns: u64,
    events: RefCell<Vec<Event>>,
}

fn list<T: std::fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    items.into_iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

impl LaneLog<'_> {
    fn push(&self, kind: Kind, step: &Step, start: Instant, end: Instant, args: Vec<(&'static str, Value)>) {
        let label = &self.recording.label;
        let start_ns = ns(start);
        self.events.borrow_mut().push(Event {
            device: label.device,
            rank: label.rank,
            lane: self.lane,
            kind,
            op: label.op,
            call: self.recording.call,
            step: Some(step.id),
            start_ns,
            end_ns: ns(end).max(start_ns),
            args,
        });
    }
}

impl LaneObserver for LaneLog<'_> {
    fn waited(&self, step: &Step, since: Instant, until: Instant) {
        self.push(Kind::Wait, step, since, until, vec![("for_steps", Value::S(list(&step.deps)))]);
    }

    fn transferred(&self, step: &Step, direction: Direction, t: &Transfer, started: Instant, ended: Instant) {
        let mut args = vec![
            ("peer", Value::U(t.peer as u64)),
            ("buf", Value::S(t.buf.to_string())),
            ("tag", Value::S(format!("{:?}#{}", t.tag.direction, t.tag.step).to_lowercase())),
        ];
        if let Some(b) = self.recording.bytes(t.buf) {
            args.push(("bytes", Value::U(b as u64)));
        }
        let kind = match direction {
            Direction::Send => Kind::Send,
            Direction::Recv => Kind::Recv,
        };
        self.push(kind, step, started, ended, args);
    }

    fn step_done(&self, step: &Step, started: Instant, ended: Instant) {
        let (kind, args) = step_slice(step, &self.recording.label);
        self.push(kind, step, started, ended, args);
    }
}

impl Drop for LaneLog<'_> {
    fn drop(&mut self) {
        let r = self.recording;
        let mut lane_events = std::mem::take(self.events.get_mut());
        let call = Event {
            device: r.label.device,
            rank: r.label.rank,
            lane: self.lane,
            kind: Kind::Call,
            op: r.label.op,
            call: r.call,
            step: None,
            start_ns: self.start_ns,
            end_ns: now_ns().max(lane_events.iter().map(|e| e.end_ns).max().unwrap_or(0)),
            args: r.label.call_args(r.n, r.schedule.clone()),
        };
        let mut events = crate::sync::lock(&EVENTS);
        events.push(call);
        events.append(&mut lane_events);
    }
}

/// The slices of one call that runs no plan (`commfuse.reshard`'s send and
/// receive parts): a call slice on the comm lane with a "send" or "recv"
/// slice per transfer, handed to the global buffer when it drops.
pub struct Transfers {
    device: i64,
    rank: usize,
    op: &'static str,
    call: u64,
    start_ns: u64,
    args: Vec<(&'static str, Value)>,
    events: Vec<Event>,
}

impl Transfers {
    /// `None` (after one relaxed load) unless recording is on; `args` go on the call slice.
    pub fn begin(device: i64, rank: usize, op: &'static str, args: Vec<(&'static str, Value)>) -> Option<Transfers> {
        let call = begin_call()?;
        Some(Transfers { device, rank, op, call, start_ns: now_ns(), args, events: Vec::new() })
    }

    /// One transfer (`Kind::Send` or `Kind::Recv`) from `started` to `ended`.
    pub fn transfer(&mut self, kind: Kind, started: Instant, ended: Instant, args: Vec<(&'static str, Value)>) {
        let start_ns = ns(started);
        self.events.push(Event {
            device: self.device,
            rank: self.rank,
            lane: Lane::Comm,
            kind,
            op: self.op,
            call: self.call,
            step: None,
            start_ns,
            end_ns: ns(ended).max(start_ns),
            args,
        });
    }
}

impl Drop for Transfers {
    fn drop(&mut self) {
        let call = Event {
            device: self.device,
            rank: self.rank,
            lane: Lane::Comm,
            kind: Kind::Call,
            op: self.op,
            call: self.call,
            step: None,
            start_ns: self.start_ns,
            end_ns: now_ns().max(self.events.iter().map(|e| e.end_ns).max().unwrap_or(0)),
            args: std::mem::take(&mut self.args),
        };
        let mut events = crate::sync::lock(&EVENTS);
        events.push(call);
        events.append(&mut self.events);
        drop(events);
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}
