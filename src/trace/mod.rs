//! Timeline recording: what each lane of each device did, and when, written
//! as a Perfetto trace (ui.perfetto.dev opens it).
//!
//! Off by default. While off, the executor pays one relaxed atomic load per
//! plan run ([`Recording::begin`]) and one branch on a local per step. While
//! on (`commfuse_trace_start`), every lane of every run records its steps
//! into a lane-local buffer — a slice per matmul ("matmul"), sum ("add") and
//! exchange ("exchange", with a "send" or "recv" slice per transfer inside it),
//! and a "wait" slice whenever a step had to wait for another lane's step —
//! and hands them to the global buffer when the lane ends. Timestamps are
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

pub use encode::encode;

use crate::error::{Error, Result};
use crate::exec::{Backend, Wait};
use crate::plan::{Action, Buf, Lane, Plan, Step, StepId, Workspace};
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
    u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX).saturating_add(1)
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
/// trace; returns the bytes written.
pub fn write(path: &std::path::Path) -> Result<usize> {
    let bytes = encode(&drain());
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

/// Who runs a plan: set by the handler around a run, read by the executor.
#[derive(Debug, Clone)]
pub struct CallInfo {
    pub device: i64,
    pub rank: usize,
    pub op: &'static str,
    pub site: i64,
    /// Bytes of each workspace slot, and of the whole local `x`.
    pub slot_bytes: Vec<usize>,
    pub x_bytes: usize,
    /// Bytes of each `Buf::XBlock(j)` (`Problem::x_block`).
    pub x_block_bytes: Vec<usize>,
}

thread_local! {
    static CURRENT: RefCell<Option<CallInfo>> = const { RefCell::new(None) };
}

/// Clears the calling thread's [`CallInfo`] when dropped.
pub struct CallGuard(bool);

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.0 {
            CURRENT.with(|c| c.borrow_mut().take());
        }
    }
}

/// Tells the recorder, for runs of `plan` on this thread until the guard
/// drops, which device, op and call site they belong to and how big their
/// buffers are. Does nothing (one relaxed load) while recording is off.
pub fn enter(device: i64, site: i64, op: &'static str, plan: &Plan, problem: &Problem, x_bytes: usize) -> CallGuard {
    if !enabled() {
        return CallGuard(false);
    }
    // The call's own layout was checked before it got here.
    let slot_bytes = Workspace::layout(plan, &problem.sizes()).map(|l| l.slots.iter().map(|r| r.len()).collect());
    let x_block_bytes = (0..).map_while(|j| problem.x_block(j)).map(|part| part.len() * problem.input.size()).collect();
    let info = CallInfo {
        device,
        rank: plan.rank,
        op,
        site,
        slot_bytes: slot_bytes.unwrap_or_default(),
        x_bytes,
        x_block_bytes,
    };
    CURRENT.with(|c| *c.borrow_mut() = Some(info));
    CallGuard(true)
}

/// One run of a plan being recorded.
pub struct Recording {
    info: CallInfo,
    call: u64,
    n: usize,
    schedule: String,
}

impl Recording {
    /// `None` (after one relaxed load) unless recording is on.
    pub fn begin(plan: &Plan) -> Option<Recording> {
        if !ENABLED.load(Ordering::Relaxed) {
            return None;
        }
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        if !ENABLED.load(Ordering::SeqCst) {
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        let info = CURRENT.with(|c| c.borrow().clone()).unwrap_or_else(|| CallInfo {
            device: plan.rank as i64,
            rank: plan.rank,
            op: "plan",
            site: -1,
            slot_bytes: Vec::new(),
            x_bytes: 0,
            x_block_bytes: Vec::new(),
        });
        let call = CALLS.fetch_add(1, Ordering::Relaxed);
        Some(Recording { info, call, n: plan.n, schedule: format!("{:?}", plan.schedule).to_lowercase() })
    }

    /// The recorder of one lane; its events go to the global buffer when it drops.
    pub fn lane(&self, lane: Lane) -> LaneLog<'_> {
        LaneLog { recording: self, lane, start_ns: now_ns(), events: Vec::new() }
    }

    fn bytes(&self, buf: Buf) -> Option<usize> {
        match buf {
            Buf::Slot(i) => self.info.slot_bytes.get(i).copied(),
            Buf::X => Some(self.info.x_bytes),
            Buf::XBlock(j) => self.info.x_block_bytes.get(j).copied(),
            Buf::Out | Buf::OutBlock(_) => None,
        }
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One lane's events of one run.
pub struct LaneLog<'r> {
    recording: &'r Recording,
    lane: Lane,
    start_ns: u64,
    events: Vec<Event>,
}

fn list<T: std::fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    items.into_iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

impl LaneLog<'_> {
    fn push(&mut self, kind: Kind, step: &Step, start_ns: u64, args: Vec<(&'static str, Value)>) {
        let info = &self.recording.info;
        self.events.push(Event {
            device: info.device,
            rank: info.rank,
            lane: self.lane,
            kind,
            op: info.op,
            call: self.recording.call,
            step: Some(step.id),
            start_ns,
            end_ns: now_ns().max(start_ns),
            args,
        });
    }

    /// `step` waited for its dependencies from `since` until now.
    pub fn wait(&mut self, step: &Step, since: u64) {
        self.push(Kind::Wait, step, since, vec![("for_steps", Value::S(list(&step.deps)))]);
    }

    /// Runs `step` on `backend`, recording it. An exchange is run one
    /// transfer at a time (its sends, then its receives: the order a backend
    /// runs them in) so that each transfer gets its own slice.
    /// Returns when the step finished, as `exec` counts it.
    pub fn execute(&mut self, backend: &dyn Backend, step: &Step, wait: &Wait) -> Result<Instant> {
        let start = now_ns();
        let deps = ("deps", Value::S(list(&step.deps)));
        match &step.action {
            Action::Matmul { block, src, dst, accumulate } => {
                let result = backend.matmul(*block, *src, *dst, *accumulate).map(|()| Instant::now());
                let args = vec![
                    deps,
                    ("block", Value::U(*block as u64)),
                    ("src", Value::S(src.to_string())),
                    ("dst", Value::S(dst.to_string())),
                    ("accumulate", Value::B(*accumulate)),
                ];
                self.push(Kind::Matmul, step, start, args);
                result
            }
            Action::Sum { terms, dst } => {
                let result = backend.sum(terms, *dst).map(|()| Instant::now());
                let args = vec![
                    deps,
                    ("terms", Value::S(list(terms.iter().map(|t| t.to_string())))),
                    ("dst", Value::S(dst.to_string())),
                ];
                self.push(Kind::Add, step, start, args);
                result
            }
            Action::Exchange { sends, recvs } => {
                let mut result = Ok(wait.ready);
                let mut total = 0;
                let transfers = sends.iter().map(|t| (Kind::Send, t)).chain(recvs.iter().map(|t| (Kind::Recv, t)));
                for (kind, t) in transfers {
                    let begun = now_ns();
                    let one = std::slice::from_ref(t);
                    let ended = match kind {
                        Kind::Send => backend.exchange(one, &[], wait),
                        _ => backend.exchange(&[], one, wait),
                    };
                    result = result.and_then(|latest| Ok(ended?.max(latest)));
                    let mut args = vec![
                        ("peer", Value::U(t.peer as u64)),
                        ("buf", Value::S(t.buf.to_string())),
                        ("tag", Value::S(format!("{:?}#{}", t.tag.direction, t.tag.step).to_lowercase())),
                    ];
                    if let Some(b) = self.recording.bytes(t.buf) {
                        args.push(("bytes", Value::U(b as u64)));
                        total += b;
                    }
                    self.push(kind, step, begun, args);
                    if result.is_err() {
                        break;
                    }
                }
                let args = vec![
                    deps,
                    ("to", Value::S(list(sends.iter().map(|t| t.peer)))),
                    ("from", Value::S(list(recvs.iter().map(|t| t.peer)))),
                    ("bytes", Value::U(total as u64)),
                ];
                self.push(Kind::Exchange, step, start, args);
                result
            }
        }
    }
}

impl Drop for LaneLog<'_> {
    fn drop(&mut self) {
        let r = self.recording;
        let call = Event {
            device: r.info.device,
            rank: r.info.rank,
            lane: self.lane,
            kind: Kind::Call,
            op: r.info.op,
            call: r.call,
            step: None,
            start_ns: self.start_ns,
            end_ns: now_ns().max(self.events.iter().map(|e| e.end_ns).max().unwrap_or(0)),
            args: vec![
                ("site", Value::I(r.info.site)),
                ("n", Value::U(r.n as u64)),
                ("schedule", Value::S(r.schedule.clone())),
            ],
        };
        let mut events = crate::sync::lock(&EVENTS);
        events.push(call);
        events.append(&mut self.events);
    }
}
