//! Issues a plan's stream schedule from one host thread, forked from and
//! joined back to the caller's (XLA's) stream: no host synchronisation.
//!
//! `fork`: an event recorded on XLA's stream, waited on by every lane stream,
//! so the lanes see XLA's writes of the operands. Then the commands of
//! `exec::stream::StreamSchedule` in issue order. `join`: an event recorded
//! on every lane stream, waited on by XLA's stream, so XLA's later work sees
//! the output and the workspace is not reused while a lane still runs.
//! `mark`: up to `marks` progress marks, each recorded on a lane after one
//! of its steps, spread evenly over the steps in issue order (the device
//! watchdog's sign that a long call is still moving).
//!
//! An observer (`crate::exec::Observer`, the trace recorder) is told when
//! the host enqueued each step: host times, not device times.
#![forbid(unsafe_code)]

use crate::error::Result;
use crate::exec::stream::{Command, StreamSchedule};
use crate::exec::{LaneObserver, Observer};
use crate::plan::{Plan, Step};
use std::time::Instant;

/// What the issuer needs from a device: streams by index (`lanes` of the
/// schedule; `None` is the caller's stream), events by index.
pub trait StreamOps {
    /// Records event `event` of the call's `events + lanes + 1` events on a stream.
    fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()>;
    /// Makes a stream wait on an event.
    fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()>;
    /// Enqueues a step on its lane's stream.
    fn run(&mut self, lane: usize, step: &Step) -> Result<()>;
    /// Records progress mark `mark` on a lane's stream.
    fn mark(&mut self, lane: usize, mark: usize) -> Result<()>;
}

/// Marks points of a stream that are timed once the streams have run (the
/// one-rank mode's device timeline: timing events).
pub trait Stamps {
    /// Stamps `stream` (`None`: the caller's) here; returns the stamp's index.
    fn stamp(&mut self, stream: Option<usize>) -> Result<usize>;
}

/// [`StreamOps`] that stamps each step's lane right before and right after
/// the step, so a stamp pair spans the step as its stream ran it: the first
/// is reached once the lane's waits for the step's dependencies are over.
pub struct Stamped<'o, O> {
    ops: &'o mut O,
    /// Per step id, the stamps around it (none for a step not issued).
    pub steps: Vec<Option<(usize, usize)>>,
}

impl<'o, O: StreamOps + Stamps> Stamped<'o, O> {
    pub fn new(ops: &'o mut O, plan: &Plan) -> Self {
        Stamped { ops, steps: vec![None; plan.steps.len()] }
    }
}

impl<O: StreamOps + Stamps> StreamOps for Stamped<'_, O> {
    fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        self.ops.record(stream, event)
    }
    fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        self.ops.wait(stream, event)
    }
    fn run(&mut self, lane: usize, step: &Step) -> Result<()> {
        let before = self.ops.stamp(Some(lane))?;
        self.ops.run(lane, step)?;
        let after = self.ops.stamp(Some(lane))?;
        if let Some(slot) = self.steps.get_mut(step.id) {
            *slot = Some((before, after));
        }
        Ok(())
    }
    fn mark(&mut self, lane: usize, mark: usize) -> Result<()> {
        self.ops.mark(lane, mark)
    }
}

/// Events a call needs: the schedule's, one fork event, one join event per lane.
pub fn events_needed(schedule: &StreamSchedule) -> usize {
    schedule.events + 1 + schedule.lanes.len()
}

/// Progress marks a call with `schedule` records when it may record up to `most`.
pub fn marks_needed(schedule: &StreamSchedule, most: usize) -> usize {
    runs(schedule).min(most)
}

fn runs(schedule: &StreamSchedule) -> usize {
    schedule.issue.iter().filter(|(_, c)| matches!(c, Command::Run(_))).count()
}

/// Enqueues all of `plan` (whose schedule is `schedule`) on `ops`' streams,
/// with `marks` progress marks (at most one per step), telling `observer`
/// when each step was enqueued.
/// On error, what was enqueued stays enqueued; the caller's stream is joined
/// only on success (the caller reports the error and XLA fails the run).
pub fn issue(
    plan: &Plan,
    schedule: &StreamSchedule,
    ops: &mut impl StreamOps,
    marks: usize,
    observer: Option<&dyn Observer>,
) -> Result<()> {
    let watchers: Vec<Box<dyn LaneObserver + '_>> =
        observer.map_or_else(Vec::new, |o| schedule.lanes.iter().map(|&lane| o.lane(lane)).collect());
    let fork = schedule.events;
    ops.record(None, fork)?;
    for lane in 0..schedule.lanes.len() {
        ops.wait(Some(lane), fork)?;
    }
    let runs = runs(schedule);
    let mut ran = 0;
    for &(lane, command) in &schedule.issue {
        match command {
            Command::Wait(e) => ops.wait(Some(lane), e)?,
            Command::Run(s) => {
                let started = Instant::now();
                ops.run(lane, &plan.steps[s])?;
                if let Some(w) = watchers.get(lane) {
                    w.step_done(&plan.steps[s], started, Instant::now());
                }
                ran += 1;
                // Mark k follows the step where ran * marks / runs first reaches k + 1.
                if ran * marks / runs > (ran - 1) * marks / runs {
                    ops.mark(lane, ran * marks / runs - 1)?;
                }
            }
            Command::Record(e) => ops.record(Some(lane), e)?,
        }
    }
    join_lanes(schedule, ops)
}

/// Joins every lane back into the caller's stream: what `issue` does last,
/// and what a caller does after a failed `issue` whose lanes may still hold
/// work on the call's buffers that never waits for anything unrecorded (the
/// copy transport's), so that the caller's stream covers it.
pub fn join_lanes(schedule: &StreamSchedule, ops: &mut impl StreamOps) -> Result<()> {
    let join = |lane: usize| schedule.events + 1 + lane;
    for lane in 0..schedule.lanes.len() {
        ops.record(Some(lane), join(lane))?;
        ops.wait(None, join(lane))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{plan, Pattern, Schedule};

    /// Streams as lists of what they were given, in order.
    #[derive(Default)]
    struct Log {
        ops: Vec<(Option<usize>, String)>,
    }

    impl StreamOps for Log {
        fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
            self.ops.push((stream, format!("record {event}")));
            Ok(())
        }
        fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
            self.ops.push((stream, format!("wait {event}")));
            Ok(())
        }
        fn run(&mut self, lane: usize, step: &Step) -> Result<()> {
            self.ops.push((Some(lane), format!("run {}", step.id)));
            Ok(())
        }
        fn mark(&mut self, lane: usize, mark: usize) -> Result<()> {
            self.ops.push((Some(lane), format!("mark {mark}")));
            Ok(())
        }
    }

    impl Stamps for Log {
        fn stamp(&mut self, stream: Option<usize>) -> Result<usize> {
            let index = self.ops.iter().filter(|(_, o)| o.starts_with("stamp")).count();
            self.ops.push((stream, format!("stamp {index}")));
            Ok(index)
        }
    }

    #[test]
    fn stamps_bracket_each_step_on_its_lane_after_its_waits() {
        for pattern in [Pattern::Gather { accumulate: false }, Pattern::Scatter] {
            let p = plan(pattern, Schedule::Ring, 4, 2);
            let s = StreamSchedule::new(&p);
            let mut log = Log::default();
            let mut stamped = Stamped::new(&mut log, &p);
            issue(&p, &s, &mut stamped, 0, None).unwrap();
            let steps = stamped.steps;
            for step in &p.steps {
                let (before, after) = steps[step.id].expect("every step is stamped");
                let at = |what: String| log.ops.iter().position(|(_, o)| *o == what).unwrap();
                let run = at(format!("run {}", step.id));
                // On the step's lane: the stamp, the step, the stamp, with nothing between.
                assert_eq!(at(format!("stamp {before}")) + 1, run);
                assert_eq!(at(format!("stamp {after}")), run + 1);
                assert_eq!(log.ops[run - 1].0, log.ops[run].0);
                assert_eq!(log.ops[run + 1].0, log.ops[run].0);
            }
        }
    }

    #[test]
    fn marks_are_spread_over_the_steps_each_after_a_step_of_its_lane() {
        for n in [1, 2, 4, 8] {
            let p = plan(Pattern::Scatter, Schedule::Ring, n, 0);
            let s = StreamSchedule::new(&p);
            for most in [0, 1, 3, 8] {
                let marks = marks_needed(&s, most);
                assert_eq!(marks, p.steps.len().min(most));
                let mut log = Log::default();
                issue(&p, &s, &mut log, marks, None).unwrap();
                let recorded: Vec<usize> =
                    log.ops.iter().filter_map(|(_, o)| o.strip_prefix("mark ")?.parse().ok()).collect();
                assert_eq!(recorded, (0..marks).collect::<Vec<_>>(), "n={n} most={most}");
                for (i, op) in log.ops.iter().enumerate().filter(|(_, (_, o))| o.starts_with("mark")) {
                    assert!(log.ops[i - 1].1.starts_with("run") && log.ops[i - 1].0 == op.0, "{:?}", log.ops);
                }
                // The last mark follows the last step.
                if marks > 0 {
                    let last_run = log.ops.iter().rposition(|(_, o)| o.starts_with("run")).unwrap();
                    assert_eq!(log.ops[last_run + 1].1, format!("mark {}", marks - 1));
                }
            }
        }
    }

    #[test]
    fn lanes_fork_from_and_join_back_to_the_callers_stream() {
        for n in [1, 2, 5] {
            for pattern in [Pattern::Gather { accumulate: false }, Pattern::Scatter, Pattern::MatmulThenExchange] {
                let p = plan(pattern, Schedule::Auto, n, n - 1);
                let s = StreamSchedule::new(&p);
                let mut log = Log::default();
                issue(&p, &s, &mut log, 0, None).unwrap();
                let fork = s.events;
                let caller: Vec<&String> = log.ops.iter().filter(|(st, _)| st.is_none()).map(|(_, o)| o).collect();
                assert_eq!(caller.first().map(|s| s.as_str()), Some(format!("record {fork}").as_str()));
                assert_eq!(caller.len(), 1 + s.lanes.len(), "the caller's stream only forks and joins");
                for lane in 0..s.lanes.len() {
                    let ops: Vec<&String> =
                        log.ops.iter().filter(|(st, _)| *st == Some(lane)).map(|(_, o)| o).collect();
                    assert_eq!(ops.first().map(|s| s.as_str()), Some(format!("wait {fork}").as_str()));
                    assert_eq!(ops.last().map(|s| s.as_str()), Some(format!("record {}", fork + 1 + lane).as_str()));
                }
                // The caller waits on each join event after it is recorded.
                for lane in 0..s.lanes.len() {
                    let e = format!("{}", fork + 1 + lane);
                    let rec = log.ops.iter().position(|o| o == &(Some(lane), format!("record {e}"))).unwrap();
                    let wait = log.ops.iter().position(|o| o == &(None, format!("wait {e}"))).unwrap();
                    assert!(rec < wait);
                }
                let runs = log.ops.iter().filter(|(_, o)| o.starts_with("run")).count();
                assert_eq!(runs, p.steps.len());
                assert!(events_needed(&s) > fork + s.lanes.len());
            }
        }
    }

    /// Notes which steps each lane's observer was told of, in order.
    #[derive(Default)]
    struct Told(std::sync::Mutex<Vec<(crate::plan::Lane, usize)>>);

    struct ToldLane<'a>(&'a Told, crate::plan::Lane);

    impl Observer for Told {
        fn lane(&self, lane: crate::plan::Lane) -> Box<dyn LaneObserver + '_> {
            Box::new(ToldLane(self, lane))
        }
    }

    impl LaneObserver for ToldLane<'_> {
        fn waited(&self, _: &Step, _: Instant, _: Instant) {}
        fn transferred(&self, _: &Step, _: crate::exec::Direction, _: &crate::plan::Transfer, _: Instant, _: Instant) {}
        fn step_done(&self, step: &Step, started: Instant, ended: Instant) {
            assert!(started <= ended);
            self.0 .0.lock().unwrap().push((self.1, step.id));
        }
    }

    #[test]
    fn an_observer_is_told_of_every_step_on_its_lane_in_issue_order() {
        for pattern in [Pattern::Gather { accumulate: false }, Pattern::Scatter, Pattern::MatmulThenExchange] {
            let p = plan(pattern, Schedule::Ring, 4, 1);
            let s = StreamSchedule::new(&p);
            let told = Told::default();
            let mut log = Log::default();
            issue(&p, &s, &mut log, 0, Some(&told)).unwrap();
            let issued: Vec<(crate::plan::Lane, usize)> = log
                .ops
                .iter()
                .filter_map(|(lane, o)| Some((s.lanes[(*lane)?], o.strip_prefix("run ")?.parse().ok()?)))
                .collect();
            assert_eq!(told.0.into_inner().unwrap(), issued);
            assert_eq!(issued.len(), p.steps.len());
        }
    }
}
