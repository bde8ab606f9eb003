//! The executor: runs a plan's lanes against a backend, each step after its
//! dependencies, with every wait bounded by the call's deadline.
//!
//! Lanes run on their own threads here (the compute lane on the caller's); a
//! backend only has to do one action at a time. A GPU backend gets the same
//! per-lane programs (`lane_programs`), where a dependency becomes an event.
#![forbid(unsafe_code)]

pub mod stream;

use crate::error::{Error, Result};
use crate::plan::{Action, Buf, Lane, Plan, Step, StepId, Transfer};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The work a backend does for one step. Called from one lane at a time per
/// buffer: the plan guarantees no two running steps write the same buffer.
pub trait Backend: Sync {
    /// The product for `block` from `src` into (or, `accumulate`, onto) `dst`.
    fn matmul(&self, block: usize, src: Buf, dst: Buf, accumulate: bool) -> Result<()>;
    /// `dst = Σ terms` (`dst` may be `terms[0]`).
    fn sum(&self, terms: &[Buf], dst: Buf) -> Result<()>;
    /// Post the sends, then wait for every receive. While a trace is being
    /// recorded (`crate::trace`) the executor calls this once per transfer,
    /// sends first, so that each transfer gets its own slice.
    fn exchange(&self, sends: &[Transfer], recvs: &[Transfer], wait: &Wait) -> Result<()>;
}

/// How long a step may wait, and whether another lane has already failed.
pub struct Wait<'a> {
    pub deadline: Instant,
    cancelled: &'a AtomicBool,
}

impl Wait<'_> {
    pub fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }
}

/// One lane's steps in order, each with the steps of other lanes it waits for.
pub fn lane_programs(plan: &Plan) -> Vec<(Lane, Vec<&Step>)> {
    plan.lanes().into_iter().map(|lane| (lane, plan.lane_steps(lane).collect())).collect()
}

/// Which steps have finished, and the first error of any lane.
struct Progress {
    done: Mutex<Vec<bool>>,
    changed: Condvar,
    cancelled: AtomicBool,
    first_error: Mutex<Option<Error>>,
}

/// Waits on local lanes get a little longer than the deadline, so that the
/// transport, which knows which peer is missing, reports the timeout.
const LOCAL_GRACE: Duration = Duration::from_secs(1);

impl Progress {
    /// Returns whether the step had to wait.
    fn wait_for(&self, deps: &[StepId], step: StepId, deadline: Instant) -> Result<bool> {
        let deadline = deadline + LOCAL_GRACE;
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        let mut waited = false;
        loop {
            if self.cancelled.load(Ordering::Acquire) {
                return Err(Error::Internal("cancelled because another lane failed".into()));
            }
            if deps.iter().all(|&d| done[d]) {
                return Ok(waited);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<_> = deps.iter().filter(|&&d| !done[d]).collect();
                return Err(Error::DeadlineExceeded(format!("step {step} still waits for local steps {missing:?}")));
            }
            waited = true;
            done = self.changed.wait_timeout(done, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn finish(&self, step: StepId) {
        self.done.lock().unwrap_or_else(|e| e.into_inner())[step] = true;
        self.changed.notify_all();
    }

    fn fail(&self, error: Error) {
        let mut first = self.first_error.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            *first = Some(error);
        }
        drop(first);
        self.cancelled.store(true, Ordering::Release);
        // Take the lock so no waiter misses the wake-up between its check and its wait.
        drop(self.done.lock().unwrap_or_else(|e| e.into_inner()));
        self.changed.notify_all();
    }
}

/// Runs `plan` to the end, or returns the first error of any lane.
pub fn run(plan: &Plan, backend: &dyn Backend, deadline: Instant) -> Result<()> {
    let progress = Progress {
        done: Mutex::new(vec![false; plan.steps.len()]),
        changed: Condvar::new(),
        cancelled: AtomicBool::new(false),
        first_error: Mutex::new(None),
    };
    let programs = lane_programs(plan);
    // `None` unless a trace is being recorded (one relaxed load).
    let recording = crate::trace::Recording::begin(plan);
    let run_lane = |lane: Lane, steps: &[&Step]| {
        let wait = Wait { deadline, cancelled: &progress.cancelled };
        let mut log = recording.as_ref().map(|r| r.lane(lane));
        for step in steps {
            let since = log.as_ref().map(|_| crate::trace::now_ns());
            let result = progress.wait_for(&step.deps, step.id, deadline).and_then(|waited| match (&mut log, since) {
                (Some(log), Some(since)) => {
                    if waited {
                        log.wait(step, since);
                    }
                    log.execute(backend, step, &wait)
                }
                _ => execute(backend, &step.action, &wait),
            });
            if let Err(e) = result {
                progress.fail(e);
                return;
            }
            progress.finish(step.id);
        }
    };
    std::thread::scope(|scope| {
        let (local, others) = programs.split_first().expect("a plan has at least one step");
        for (lane, steps) in others {
            let run_lane = &run_lane;
            scope.spawn(move || run_lane(*lane, steps));
        }
        run_lane(local.0, &local.1);
    });
    match progress.first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn execute(backend: &dyn Backend, action: &Action, wait: &Wait) -> Result<()> {
    match action {
        Action::Matmul { block, src, dst, accumulate } => backend.matmul(*block, *src, *dst, *accumulate),
        Action::Sum { terms, dst } => backend.sum(terms, *dst),
        Action::Exchange { sends, recvs } => backend.exchange(sends, recvs, wait),
    }
}

impl<'a> Wait<'a> {
    /// A wait outside an executor run, for tests of backends.
    pub fn for_test(deadline: Instant, cancelled: &'a AtomicBool) -> Wait<'a> {
        Wait { deadline, cancelled }
    }
}
