//! The stream form of a plan: what a stream-based backend (CUDA) issues from
//! one host thread so that the device runs the plan's steps in a valid order
//! with no host synchronisation.
//!
//! Each lane is a stream. The host walks the plan in order; for each step it
//! makes the step's stream wait on the events of the cross-lane dependencies
//! that the stream does not already know to be finished, enqueues the step,
//! and records an event after it when another lane waits on it. Issuing in
//! plan order puts every record before the waits on it, which is what
//! `cuStreamWaitEvent` needs (it waits for the most recent record). Every
//! event is recorded exactly once, so events are never reused within a call.
#![forbid(unsafe_code)]

use crate::plan::{Lane, Plan, StepId};
use std::collections::BTreeMap;

/// An index into the schedule's events (one per step some other lane waits on).
pub type EventId = usize;

/// One command issued to a lane's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// The stream waits until the event has been recorded and reached.
    Wait(EventId),
    /// The stream runs the step.
    Run(StepId),
    /// The event is recorded on the stream (after the preceding `Run`).
    Record(EventId),
}

/// The commands of one call in the order the host issues them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSchedule {
    /// The lanes the plan uses, in `Lane` order; `issue` refers to them by index.
    pub lanes: Vec<Lane>,
    /// `(lane index, command)` in host issue order.
    pub issue: Vec<(usize, Command)>,
    /// How many events the call needs.
    pub events: usize,
    /// The event recorded after each step, if any lane waits on it.
    pub event_of: Vec<Option<EventId>>,
}

impl StreamSchedule {
    /// Derives the commands from `plan` (see the module comment).
    pub fn new(plan: &Plan) -> StreamSchedule {
        let lanes = plan.lanes();
        let lane_index: BTreeMap<Lane, usize> = lanes.iter().enumerate().map(|(i, &l)| (l, i)).collect();
        let nl = lanes.len();
        // Position of each step on its lane (1-based: 0 means "nothing yet").
        let mut position = vec![0usize; plan.steps.len()];
        let mut count = vec![0usize; nl];
        // `known[l][m]`: lane l knows the first `known[l][m]` steps of lane m finished
        // once its current step starts. `clock[s]` is that knowledge when step s ends.
        let mut known = vec![vec![0usize; nl]; nl];
        let mut clock: Vec<Vec<usize>> = Vec::with_capacity(plan.steps.len());
        let mut waits: Vec<Vec<StepId>> = vec![Vec::new(); plan.steps.len()];
        for (i, step) in plan.steps.iter().enumerate() {
            assert_eq!(step.id, i, "plan steps are numbered in order");
            let l = lane_index[&step.lane];
            // Later dependencies first: waiting on one often implies the earlier ones.
            let mut deps = step.deps.clone();
            deps.sort_unstable_by(|a, b| b.cmp(a));
            deps.dedup();
            for d in deps {
                assert!(d < i, "step {i} depends on later step {d}");
                let m = lane_index[&plan.steps[d].lane];
                if known[l][m] >= position[d] {
                    continue; // same lane, or implied by an earlier wait
                }
                waits[i].push(d);
                for (k, c) in known[l].iter_mut().zip(&clock[d]) {
                    *k = (*k).max(*c);
                }
            }
            count[l] += 1;
            position[i] = count[l];
            known[l][l] = count[l];
            clock.push(known[l].clone());
        }

        let mut event_of = vec![None; plan.steps.len()];
        let mut events = 0;
        for &d in waits.iter().flatten() {
            if event_of[d].is_none() {
                event_of[d] = Some(events);
                events += 1;
            }
        }
        let mut issue = Vec::new();
        for (i, step) in plan.steps.iter().enumerate() {
            let l = lane_index[&step.lane];
            for &d in &waits[i] {
                issue.push((l, Command::Wait(event_of[d].expect("every waited step has an event"))));
            }
            issue.push((l, Command::Run(i)));
            if let Some(e) = event_of[i] {
                issue.push((l, Command::Record(e)));
            }
        }
        StreamSchedule { lanes, issue, events, event_of }
    }

    /// The commands of one lane (by index into `lanes`), in stream order.
    pub fn lane_commands(&self, lane: usize) -> Vec<Command> {
        self.issue.iter().filter(|(l, _)| *l == lane).map(|(_, c)| *c).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;
    use crate::exec::{self, Backend, Wait};
    use crate::plan::{self, Action, Buf, Pattern, Schedule, Transfer};
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::thread::ThreadId;

    const SCHEDULES: [Schedule; 4] = [Schedule::Auto, Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential];
    const PATTERNS: [Pattern; 7] = Pattern::ALL;

    fn all_plans() -> impl Iterator<Item = Plan> {
        PATTERNS.into_iter().flat_map(|p| {
            SCHEDULES
                .into_iter()
                .flat_map(move |s| (1..=16).flat_map(move |n| (0..n).map(move |r| plan::plan(p, s, n, r))))
        })
    }

    fn label(plan: &Plan) -> String {
        format!("{:?} {:?} n={} rank={}", plan.pattern, plan.schedule, plan.n, plan.rank)
    }

    /// Transitive closure of `edges` over `len` nodes, where every edge goes
    /// from a lower to a higher index.
    fn closure(len: usize, edges: &[(usize, usize)]) -> Vec<Vec<bool>> {
        let mut hb = vec![vec![false; len]; len];
        let mut by_target: Vec<Vec<usize>> = vec![Vec::new(); len];
        for &(a, b) in edges {
            assert!(a < b, "edge {a} -> {b} goes backwards");
            by_target[b].push(a);
        }
        for b in 0..len {
            for &a in &by_target[b] {
                hb[a][b] = true;
                for row in hb.iter_mut().take(a) {
                    if row[a] {
                        row[b] = true;
                    }
                }
            }
        }
        hb
    }

    /// Happens-before between the plan's steps as the plan defines it:
    /// dependencies and same-lane order.
    fn plan_order(plan: &Plan) -> Vec<Vec<bool>> {
        let mut edges = Vec::new();
        let mut last: HashMap<Lane, StepId> = HashMap::new();
        for s in &plan.steps {
            edges.extend(s.deps.iter().filter(|&&d| d != s.id).map(|&d| (d, s.id)));
            if let Some(p) = last.insert(s.lane, s.id) {
                edges.push((p, s.id));
            }
        }
        edges.sort_unstable();
        edges.dedup();
        closure(plan.steps.len(), &edges)
    }

    /// Happens-before between the plan's steps as the streams enforce it:
    /// stream order and wait-after-record, nothing else.
    fn stream_order(plan: &Plan, sched: &StreamSchedule) -> Vec<Vec<bool>> {
        let mut recorded_after: HashMap<EventId, StepId> = HashMap::new();
        let mut edges = Vec::new();
        for lane in 0..sched.lanes.len() {
            let mut last_run: Option<StepId> = None;
            let mut pending_waits: Vec<EventId> = Vec::new();
            for c in sched.lane_commands(lane) {
                match c {
                    Command::Wait(e) => pending_waits.push(e),
                    Command::Run(s) => {
                        assert_eq!(sched.lanes[lane], plan.steps[s].lane, "step {s} issued on the wrong stream");
                        if let Some(p) = last_run {
                            edges.push((p, s));
                        }
                        for e in pending_waits.drain(..) {
                            edges.push((usize::MAX - e, s)); // resolved below
                        }
                        last_run = Some(s);
                    }
                    Command::Record(e) => {
                        let s = last_run.expect("a record follows a step");
                        assert!(recorded_after.insert(e, s).is_none(), "event {e} recorded twice");
                    }
                }
            }
            assert!(pending_waits.is_empty(), "waits at the end of a stream guard nothing");
        }
        let edges: Vec<(usize, usize)> = edges
            .into_iter()
            .map(|(a, b)| {
                if a > plan.steps.len() {
                    let e = usize::MAX - a;
                    let s = *recorded_after.get(&e).unwrap_or_else(|| panic!("event {e} is waited on, never recorded"));
                    (s, b)
                } else {
                    (a, b)
                }
            })
            .collect();
        closure(plan.steps.len(), &edges)
    }

    /// A discrete-event run of the streams: each lane executes its commands in
    /// order; a wait blocks until the event has been reached on its stream.
    /// `pick` chooses which runnable lane moves next. Returns the step order.
    fn simulate(plan: &Plan, sched: &StreamSchedule, mut pick: impl FnMut(&[usize]) -> usize) -> Vec<StepId> {
        let programs: Vec<Vec<Command>> = (0..sched.lanes.len()).map(|l| sched.lane_commands(l)).collect();
        let mut pc = vec![0usize; programs.len()];
        let mut recorded = vec![false; sched.events];
        let mut done = vec![false; plan.steps.len()];
        let mut order = Vec::new();
        loop {
            let runnable: Vec<usize> = (0..programs.len())
                .filter(|&l| match programs[l].get(pc[l]) {
                    None => false,
                    Some(Command::Wait(e)) => recorded[*e],
                    Some(_) => true,
                })
                .collect();
            if runnable.is_empty() {
                let stuck: Vec<_> = (0..programs.len()).filter(|&l| pc[l] < programs[l].len()).collect();
                assert!(stuck.is_empty(), "{}: lanes {stuck:?} wait forever", label(plan));
                return order;
            }
            let l = runnable[pick(&runnable) % runnable.len()];
            match programs[l][pc[l]] {
                Command::Wait(_) => {}
                Command::Run(s) => {
                    for &d in &plan.steps[s].deps {
                        assert!(done[d], "{}: step {s} ran before its dependency {d}", label(plan));
                    }
                    done[s] = true;
                    order.push(s);
                }
                Command::Record(e) => recorded[e] = true,
            }
            pc[l] += 1;
        }
    }

    #[test]
    fn streams_respect_every_dependency_and_every_wait_is_recorded() {
        let mut checked = 0;
        for plan in all_plans() {
            let sched = StreamSchedule::new(&plan);
            let label = label(&plan);
            // Every step runs exactly once; the host issues each record before its waits.
            let mut runs: Vec<StepId> = sched
                .issue
                .iter()
                .filter_map(|(_, c)| match c {
                    Command::Run(s) => Some(*s),
                    _ => None,
                })
                .collect();
            runs.sort_unstable();
            assert_eq!(runs, (0..plan.steps.len()).collect::<Vec<_>>(), "{label}");
            let mut recorded = vec![false; sched.events];
            for (_, c) in &sched.issue {
                match c {
                    Command::Record(e) => recorded[*e] = true,
                    Command::Wait(e) => assert!(recorded[*e], "{label}: wait on event {e} issued before its record"),
                    Command::Run(_) => {}
                }
            }
            assert!(recorded.iter().all(|&r| r), "{label}: an event is recorded that nobody waits on");

            // Every plan dependency holds transitively in what the streams enforce.
            let plan_hb = plan_order(&plan);
            let stream_hb = stream_order(&plan, &sched);
            for s in &plan.steps {
                for &d in &s.deps {
                    assert!(d == s.id || stream_hb[d][s.id], "{label}: step {} may run before {d}", s.id);
                }
            }
            // ...and the streams add no ordering of their own: the same partial order.
            assert_eq!(plan_hb, stream_hb, "{label}: the streams order steps differently from the plan");

            // Discrete-event runs under several interleavings: no deadlock, deps done first.
            let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ plan.n as u64 ^ ((plan.rank as u64) << 8);
            for mut pick in [
                Box::new(|_: &[usize]| 0usize) as Box<dyn FnMut(&[usize]) -> usize>,
                Box::new(|r: &[usize]| r.len() - 1),
                Box::new(move |_: &[usize]| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as usize
                }),
            ] {
                assert_eq!(simulate(&plan, &sched, &mut *pick).len(), plan.steps.len(), "{label}");
            }
            checked += 1;
        }
        assert_eq!(checked, PATTERNS.len() * SCHEDULES.len() * (1..=16).sum::<usize>());
    }

    #[test]
    fn waits_are_minimal() {
        for plan in all_plans() {
            let sched = StreamSchedule::new(&plan);
            for lane in 0..sched.lanes.len() {
                // Drop each wait in turn: the dependencies must then be violated.
                let waits: Vec<usize> = sched
                    .issue
                    .iter()
                    .enumerate()
                    .filter(|(_, (l, c))| *l == lane && matches!(c, Command::Wait(_)))
                    .map(|(i, _)| i)
                    .collect();
                for &w in &waits {
                    let mut fewer = sched.clone();
                    fewer.issue.remove(w);
                    let hb = stream_order(&plan, &fewer);
                    let violated = plan.steps.iter().any(|s| s.deps.iter().any(|&d| d != s.id && !hb[d][s.id]));
                    assert!(violated, "{}: wait {w} is redundant", label(&plan));
                }
            }
        }
    }

    #[test]
    fn a_plan_on_one_lane_needs_no_events() {
        let plan = plan::plan(Pattern::Gather { accumulate: false }, Schedule::Ring, 1, 0);
        let sched = StreamSchedule::new(&plan);
        assert_eq!(sched.events, 0);
        assert!(sched.issue.iter().all(|(_, c)| matches!(c, Command::Run(_))));
    }

    /// Records which thread ran each action; the executor runs one lane per thread.
    struct Recorder {
        log: Mutex<Vec<(ThreadId, Action)>>,
    }

    impl Recorder {
        fn note(&self, action: Action) {
            self.log.lock().unwrap().push((std::thread::current().id(), action));
        }
    }

    impl Backend for Recorder {
        fn matmul(&self, block: usize, src: Buf, with: Buf, dst: Buf, accumulate: bool) -> Result<()> {
            self.note(Action::Matmul { block, src, with, dst, accumulate });
            Ok(())
        }
        fn sum(&self, terms: &[Buf], dst: Buf) -> Result<()> {
            self.note(Action::Sum { terms: terms.to_vec(), dst });
            Ok(())
        }
        fn exchange(&self, sends: &[Transfer], recvs: &[Transfer], _wait: &Wait) -> Result<std::time::Instant> {
            self.note(Action::Exchange { sends: sends.to_vec(), recvs: recvs.to_vec() });
            Ok(std::time::Instant::now())
        }
    }

    #[test]
    fn cpu_executor_and_streams_run_each_lane_in_the_same_order() {
        for n in [1, 2, 3, 4, 7, 8] {
            for pattern in PATTERNS {
                for schedule in SCHEDULES {
                    for rank in 0..n {
                        let plan = plan::plan(pattern, schedule, n, rank);
                        let recorder = Recorder { log: Mutex::new(Vec::new()) };
                        exec::run(&plan, &recorder, None).unwrap();
                        let mut by_thread: Vec<(ThreadId, Vec<Action>)> = Vec::new();
                        for (t, a) in recorder.log.into_inner().unwrap() {
                            match by_thread.iter_mut().find(|(u, _)| *u == t) {
                                Some((_, list)) => list.push(a),
                                None => by_thread.push((t, vec![a])),
                            }
                        }
                        let sched = StreamSchedule::new(&plan);
                        let mut streams: Vec<Vec<Action>> = (0..sched.lanes.len())
                            .map(|l| {
                                let runs = sched.lane_commands(l).into_iter().filter_map(|c| match c {
                                    Command::Run(s) => Some(plan.steps[s].action.clone()),
                                    _ => None,
                                });
                                runs.collect()
                            })
                            .collect();
                        let mut threads: Vec<Vec<Action>> = by_thread.into_iter().map(|(_, l)| l).collect();
                        let key = |v: &Vec<Action>| format!("{v:?}");
                        streams.sort_by_key(key);
                        threads.sort_by_key(key);
                        assert_eq!(streams, threads, "{}", label(&plan));
                    }
                }
            }
        }
    }
}
