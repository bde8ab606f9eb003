//! The executor: runs a plan's lanes against a backend, each step after its
//! dependencies. Waits for local lanes are not bounded here: every step
//! ends (a matmul or sum finishes, an exchange is bounded by the backend's
//! transport), and a failing lane cancels the others.
//!
//! Lanes run on their own threads here (the comm lane on the caller's, the
//! compute lane on a pool thread of lower priority), or all on the caller's
//! thread in plan order (`run_in_order`); a backend only
//! has to do one action at a time. A stream-based backend (CUDA) issues the
//! plan's stream form instead (`stream`), where a dependency becomes an event.
//!
//! A run may be watched ([`Observer`]): the executor reports each step's
//! wait and run, the backend each transfer of an exchange, with the times it
//! measured. Watched or not, the run is the same: same threads, same order
//! of posting.
#![forbid(unsafe_code)]

pub mod stream;

use crate::error::{Error, Result};
use crate::plan::{Action, Buf, Lane, Plan, Step, StepId, Transfer};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// The work a backend does for one step. Called from one lane at a time per
/// buffer: the plan guarantees no two running steps write the same buffer.
pub trait Backend: Sync {
    /// The product for `block` from `src` and `with` (the second operand's
    /// side: `Buf::W` or a received block of it) into (or, `accumulate`,
    /// onto) `dst`.
    fn matmul(&self, block: usize, src: Buf, with: Buf, dst: Buf, accumulate: bool) -> Result<()>;
    /// `dst = Σ terms` (`dst` may be `terms[0]`).
    fn sum(&self, terms: &[Buf], dst: Buf) -> Result<()>;
    /// Post the sends, then wait for every receive. Returns when the exchange
    /// ended: under a link model when its last message arrived in the model
    /// (a moment before now if this thread got a core late), else now.
    /// Reports each transfer to `wait.transferred` as it ends.
    fn exchange(&self, sends: &[Transfer], recvs: &[Transfer], wait: &Wait) -> Result<Instant>;
}

/// What a backend copied during one call without computing on it: blocks
/// copied out of XLA's buffers into messages, received blocks copied into
/// the output, blocks copied before an add because a peer still held them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copies {
    pub count: usize,
    pub bytes: usize,
}

/// Watches runs of a plan (the trace recorder, `crate::trace::Recording`).
pub trait Observer: Sync {
    /// The watcher of one lane, used on that lane's thread and dropped when
    /// the lane ends.
    fn lane(&self, lane: Lane) -> Box<dyn LaneObserver + '_>;
    /// The run is over, having copied `copies` (a backend that counts them).
    fn copied(&self, _copies: Copies) {}
}

/// What one lane reports. Times are the backend's: on the CPU when the host
/// ran the work; a backend that enqueues work reports when it enqueued it.
pub trait LaneObserver {
    /// `step` waited for steps of other lanes from `since` until `until`.
    fn waited(&self, step: &Step, since: Instant, until: Instant);
    /// One transfer of the exchange `step`, posted at `started`; a send ended
    /// when its data was handed over, a receive when its data had landed.
    fn transferred(&self, step: &Step, direction: Direction, transfer: &Transfer, started: Instant, ended: Instant);
    /// `step` ran from `started` to `ended` (after its transfers, if any).
    fn step_done(&self, step: &Step, started: Instant, ended: Instant);
}

/// Which way a transfer goes, seen from the reporting rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Send,
    Recv,
}

/// Whether another lane has already failed, and when the step became ready.
pub struct Wait<'a> {
    cancelled: &'a AtomicBool,
    /// The lane's observer and the step, while the run is watched.
    watcher: Option<(&'a dyn LaneObserver, &'a Step)>,
    /// When the step's dependencies (and its lane's previous step) had
    /// finished, with exchanges finishing when their messages arrived in the
    /// link model. A modelled transfer starts then: on a GPU a copy engine
    /// starts it at once, while here the comm thread may wait for a core
    /// that another device's GEMM holds.
    pub ready: Instant,
}

impl Wait<'_> {
    pub fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Tells the run's observer, if any, that one transfer of this exchange
    /// ran from `started` to `ended`.
    pub fn transferred(&self, direction: Direction, transfer: &Transfer, started: Instant, ended: Instant) {
        if let Some((observer, step)) = self.watcher {
            observer.transferred(step, direction, transfer, started, ended);
        }
    }
}

/// One lane's steps in order, each with the steps of other lanes it waits for.
pub fn lane_programs(plan: &Plan) -> Vec<(Lane, Vec<&Step>)> {
    plan.lanes().into_iter().map(|lane| (lane, plan.lane_steps(lane).collect())).collect()
}

/// When each step finished (model time, see `Wait::ready`), and the first
/// error of any lane.
struct Progress {
    done: Mutex<Vec<Option<Instant>>>,
    changed: Condvar,
    cancelled: AtomicBool,
    first_error: Mutex<Option<Error>>,
}

impl Progress {
    /// Returns whether the step had to wait, and when its dependencies finished.
    fn wait_for(&self, deps: &[StepId]) -> Result<(bool, Option<Instant>)> {
        let mut done = crate::sync::lock(&self.done);
        let mut waited = false;
        loop {
            if self.cancelled.load(Ordering::Acquire) {
                return Err(Error::Internal("cancelled because another lane failed".into()));
            }
            if deps.iter().all(|&d| done[d].is_some()) {
                return Ok((waited, deps.iter().filter_map(|&d| done[d]).max()));
            }
            waited = true;
            done = crate::sync::wait(&self.changed, done);
        }
    }

    fn finish(&self, step: StepId, at: Instant) {
        crate::sync::lock(&self.done)[step] = Some(at);
        self.changed.notify_all();
    }

    fn fail(&self, error: Error) {
        let mut first = crate::sync::lock(&self.first_error);
        if first.is_none() {
            *first = Some(error);
        }
        drop(first);
        self.cancelled.store(true, Ordering::Release);
        // Take the lock so no waiter misses the wake-up between its check and its wait.
        drop(crate::sync::lock(&self.done));
        self.changed.notify_all();
    }
}

/// Runs `plan` to the end, or returns the first error of any lane; tells
/// `observer`, if any, what each lane did.
pub fn run(plan: &Plan, backend: &dyn Backend, observer: Option<&dyn Observer>) -> Result<()> {
    let progress = Progress {
        done: Mutex::new(vec![None; plan.steps.len()]),
        changed: Condvar::new(),
        cancelled: AtomicBool::new(false),
        first_error: Mutex::new(None),
    };
    let programs = lane_programs(plan);
    let start = Instant::now();
    let run_steps = |lane: Lane, steps: &[&Step]| {
        let watcher = observer.map(|o| o.lane(lane));
        let watcher = watcher.as_deref();
        let mut previous = start;
        for step in steps {
            let since = Instant::now();
            let result = progress.wait_for(&step.deps).and_then(|(waited, deps_done)| {
                let started = Instant::now();
                if let (Some(w), true) = (watcher, waited) {
                    w.waited(step, since, started);
                }
                let wait = Wait {
                    cancelled: &progress.cancelled,
                    watcher: watcher.map(|w| (w, *step)),
                    ready: deps_done.map_or(previous, |d| d.max(previous)),
                };
                let finished = execute(backend, &step.action, &wait);
                if let Some(w) = watcher {
                    w.step_done(step, started, Instant::now());
                }
                finished
            });
            match result {
                Ok(finished) => {
                    previous = finished;
                    progress.finish(step.id, finished);
                }
                Err(e) => {
                    progress.fail(e);
                    return;
                }
            }
        }
    };
    // A lane that panics fails the call at once, instead of leaving its peers
    // to wait for their timeout.
    let run_lane = |lane: Lane, steps: &[&Step]| {
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_steps(lane, steps)));
        if ran.is_err() {
            progress.fail(Error::Internal(format!("the {lane:?} lane panicked")));
        }
    };
    // The comm lane, where there is one, runs on the caller's thread; the
    // compute lane on a thread below it (see `lane_threads`).
    let mut programs = programs;
    if let Some(comm) = programs.iter().position(|(lane, _)| *lane == Lane::Comm) {
        programs.swap(0, comm);
    }
    let (local, others) = programs.split_first().expect("a plan has at least one step");
    match lane_threads::reserve(others.len()) {
        Some(reserved) => reserved.pool().in_place_scope(|scope| {
            for (lane, steps) in others {
                let run_lane = &run_lane;
                scope.spawn(move |_| run_lane(*lane, steps));
            }
            run_lane(local.0, &local.1);
        }),
        None => std::thread::scope(|scope| {
            for (lane, steps) in others {
                let run_lane = &run_lane;
                scope.spawn(move || {
                    crate::thread_priority::lower_this_thread();
                    run_lane(*lane, steps)
                });
            }
            run_lane(local.0, &local.1);
        }),
    }
    let first_error = crate::sync::lock(&progress.first_error).take();
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Threads for the compute lanes, kept between calls, running below the
/// threads that post transfers (`thread_priority`: 5 nice levels). On a host with fewer
/// cores than lanes (8 CPU devices on 2 cores) a comm lane that woke to post
/// its next ring step waited for a core behind the other devices' GEMMs,
/// 1-3 ms at the head of every call and at each step, all of it exposed: a
/// transfer posted late delays its whole ring, a GEMM piece run late only
/// eats into the slack the schedule gave it. A GPU's copy engines do not
/// wait for its SMs either. Measured (`python -m commfuse.bench --quick`,
/// 4 devices, 2 cores): `all_gather_matmul` ring under the link model from
/// 18.4 to 14.2 ms at 1x, real links unchanged.
/// The pool is fixed-size, and a lane blocks while it waits for peers, so a
/// call only uses it while enough threads are free; otherwise it spawns
/// (lowering the spawned thread alike).
/// Lanes must not run rayon work themselves (the GEMMs use
/// `Parallelism::None`): a nested join on a pool thread could pick up
/// another call's lane and block on its peers.
mod lane_threads {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::OnceLock;

    /// Enough for the compute lanes of 32 devices calling at once.
    const THREADS: usize = 32;

    static IN_USE: AtomicUsize = AtomicUsize::new(0);

    fn pool() -> Option<&'static rayon::ThreadPool> {
        static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
        POOL.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(THREADS)
                .thread_name(|i| format!("commfuse-lane-{i}"))
                .start_handler(|_| crate::thread_priority::lower_this_thread())
                .build()
                .ok()
        })
        .as_ref()
    }

    /// `count` threads of the pool, held until the guard drops.
    pub struct Reserved(usize);

    impl Reserved {
        pub fn pool(&self) -> &'static rayon::ThreadPool {
            pool().expect("reserved from an existing pool")
        }
    }

    impl Drop for Reserved {
        fn drop(&mut self) {
            IN_USE.fetch_sub(self.0, Ordering::AcqRel);
        }
    }

    pub fn reserve(count: usize) -> Option<Reserved> {
        pool()?;
        let previous = IN_USE.fetch_add(count, Ordering::AcqRel);
        if previous + count > THREADS {
            IN_USE.fetch_sub(count, Ordering::AcqRel);
            return None;
        }
        Some(Reserved(count))
    }
}

/// Runs `job` (one deferred call: it may wait for its peers) on a thread of its own: a parked pool thread while one is
/// free, else a fresh thread, so that any number of calls can wait at once.
pub fn spawn_call(job: impl FnOnce() + Send + 'static) {
    call_threads::spawn(Box::new(job));
}

/// The threads deferred calls run on (see `spawn_call`), kept between calls.
///
/// Not a work-stealing pool: the thread that finishes a call also runs
/// XLA's continuation of that device's program (completing the future runs
/// it), which may block in one of XLA's own collectives; a job queued
/// behind it on that thread would wait for it, and its peers for the job.
/// So a job is handed to an idle thread, or to a new one when none is idle,
/// never queued behind a busy one.
mod call_threads {
    use std::collections::VecDeque;
    use std::sync::{Condvar, Mutex, OnceLock};

    type Job = Box<dyn FnOnce() + Send>;

    #[derive(Default)]
    struct Shared {
        state: Mutex<State>,
        work: Condvar,
    }

    #[derive(Default)]
    struct State {
        jobs: VecDeque<Job>,
        idle: usize,
    }

    fn shared() -> &'static Shared {
        static SHARED: OnceLock<Shared> = OnceLock::new();
        SHARED.get_or_init(Shared::default)
    }

    pub fn spawn(job: Job) {
        let shared = shared();
        let mut state = crate::sync::lock(&shared.state);
        state.jobs.push_back(job);
        if state.idle >= state.jobs.len() {
            shared.work.notify_one();
            return;
        }
        drop(state);
        // A thread that cannot be made leaves the job queued for the next
        // idle one; failing that, the call times out like any missing peer.
        let _ = std::thread::Builder::new().name("commfuse-call".into()).spawn(move || work(shared));
    }

    fn work(shared: &Shared) {
        let mut state = crate::sync::lock(&shared.state);
        loop {
            match state.jobs.pop_front() {
                Some(job) => {
                    drop(state);
                    job();
                    state = crate::sync::lock(&shared.state);
                }
                None => {
                    state.idle += 1;
                    state = crate::sync::wait(&shared.work, state);
                    state.idle -= 1;
                }
            }
        }
    }
}

/// Runs one step; returns when it finished (model time, see `Wait::ready`).
/// Runs `plan`'s steps on this thread, one after another in the plan's order
/// (a valid order: every dependency comes first), telling `observer` what
/// each lane did. For calls so small that handing a lane to another thread
/// and waking it at every step costs more than the overlap could win. Every
/// rank runs its plan in the same order and an exchange posts its sends
/// before it waits, so the earliest exchange any rank waits in has its
/// messages posted or coming: no rank waits for one that waits for it.
pub fn run_in_order(plan: &Plan, backend: &dyn Backend, observer: Option<&dyn Observer>) -> Result<()> {
    let cancelled = AtomicBool::new(false);
    let watchers: Vec<(Lane, Box<dyn LaneObserver + '_>)> = match observer {
        Some(o) => plan.lanes().into_iter().map(|lane| (lane, o.lane(lane))).collect(),
        None => Vec::new(),
    };
    let mut previous = Instant::now();
    for step in &plan.steps {
        let watcher = watchers.iter().find(|(lane, _)| *lane == step.lane).map(|(_, w)| w.as_ref());
        let started = Instant::now();
        let wait = Wait { cancelled: &cancelled, watcher: watcher.map(|w| (w, step)), ready: previous };
        previous = execute(backend, &step.action, &wait)?;
        if let Some(w) = watcher {
            w.step_done(step, started, Instant::now());
        }
    }
    Ok(())
}

fn execute(backend: &dyn Backend, action: &Action, wait: &Wait) -> Result<Instant> {
    match action {
        Action::Matmul { block, src, with, dst, accumulate } => {
            backend.matmul(*block, *src, *with, *dst, *accumulate)?
        }
        Action::Sum { terms, dst } => backend.sum(terms, *dst)?,
        Action::Exchange { sends, recvs } => return backend.exchange(sends, recvs, wait),
    }
    Ok(Instant::now())
}

impl<'a> Wait<'a> {
    /// A wait outside an executor run (a backend's own loop, such as
    /// `backend::cpu::reshard`, or a test), never cancelled from outside.
    pub fn unwatched(cancelled: &'a AtomicBool) -> Wait<'a> {
        Wait { cancelled, watcher: None, ready: Instant::now() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{plan, Pattern, Schedule};
    use std::time::Duration;

    /// Multiplies instantly; its exchanges panic.
    struct PanickingComm;

    impl Backend for PanickingComm {
        fn matmul(&self, _: usize, _: Buf, _: Buf, _: Buf, _: bool) -> Result<()> {
            Ok(())
        }
        fn sum(&self, _: &[Buf], _: Buf) -> Result<()> {
            Ok(())
        }
        fn exchange(&self, _: &[Transfer], _: &[Transfer], _: &Wait) -> Result<Instant> {
            panic!("a bug in a backend");
        }
    }

    /// Records the thread and nice value each lane's steps ran with.
    #[derive(Default)]
    struct Recording {
        compute: Mutex<Vec<(std::thread::ThreadId, i32)>>,
        comm: Mutex<Vec<(std::thread::ThreadId, i32)>>,
    }

    impl Backend for Recording {
        fn matmul(&self, _: usize, _: Buf, _: Buf, _: Buf, _: bool) -> Result<()> {
            let here = (std::thread::current().id(), crate::thread_priority::nice_of_this_thread());
            self.compute.lock().unwrap().push(here);
            Ok(())
        }
        fn sum(&self, _: &[Buf], _: Buf) -> Result<()> {
            Ok(())
        }
        fn exchange(&self, _: &[Transfer], _: &[Transfer], _: &Wait) -> Result<Instant> {
            let here = (std::thread::current().id(), crate::thread_priority::nice_of_this_thread());
            self.comm.lock().unwrap().push(here);
            Ok(Instant::now())
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_comm_lane_runs_on_the_callers_thread_and_the_compute_lane_below_it() {
        let p = plan(Pattern::Gather { accumulate: false }, Schedule::Ring, 4, 0);
        let backend = Recording::default();
        let caller = (std::thread::current().id(), crate::thread_priority::nice_of_this_thread());
        run(&p, &backend, None).unwrap();
        let (comm, compute) = (backend.comm.into_inner().unwrap(), backend.compute.into_inner().unwrap());
        assert!(!comm.is_empty() && !compute.is_empty());
        assert!(comm.iter().all(|&c| c == caller), "comm steps {comm:?}, the caller {caller:?}");
        let lowered = (caller.1 + crate::thread_priority::COMPUTE_LANE_NICE).min(19);
        assert!(
            compute.iter().all(|&(thread, nice)| thread != caller.0 && nice == lowered),
            "compute steps {compute:?}"
        );
    }

    #[test]
    fn a_panicking_lane_fails_the_call_at_once_instead_of_at_the_deadline() {
        let p = plan(Pattern::Gather { accumulate: false }, Schedule::Ring, 4, 0);
        let start = Instant::now();
        let e = run(&p, &PanickingComm, None).unwrap_err();
        assert!(e.to_string().contains("Comm lane panicked"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    }
}
