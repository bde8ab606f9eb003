//! Issues a plan's stream schedule from one host thread, forked from and
//! joined back to the caller's (XLA's) stream: no host synchronisation.
//!
//! `fork`: an event recorded on XLA's stream, waited on by every lane stream,
//! so the lanes see XLA's writes of the operands. Then the commands of
//! `exec::stream::StreamSchedule` in issue order. `join`: an event recorded
//! on every lane stream, waited on by XLA's stream, so XLA's later work sees
//! the output and the workspace is not reused while a lane still runs.
#![forbid(unsafe_code)]

use crate::error::Result;
use crate::exec::stream::{Command, StreamSchedule};
use crate::plan::{Plan, Step};

/// What the issuer needs from a device: streams by index (`lanes` of the
/// schedule; `None` is the caller's stream), events by index.
pub trait StreamOps {
    /// Records event `event` of the call's `events + lanes + 1` events on a stream.
    fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()>;
    /// Makes a stream wait on an event.
    fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()>;
    /// Enqueues a step on its lane's stream.
    fn run(&mut self, lane: usize, step: &Step) -> Result<()>;
}

/// Events a call needs: the schedule's, one fork event, one join event per lane.
pub fn events_needed(schedule: &StreamSchedule) -> usize {
    schedule.events + 1 + schedule.lanes.len()
}

/// Enqueues all of `plan` (whose schedule is `schedule`) on `ops`' streams.
/// On error, what was enqueued stays enqueued; the caller's stream is joined
/// only on success (the caller reports the error and XLA fails the run).
pub fn issue(plan: &Plan, schedule: &StreamSchedule, ops: &mut impl StreamOps) -> Result<()> {
    let fork = schedule.events;
    let join = |lane: usize| schedule.events + 1 + lane;
    ops.record(None, fork)?;
    for lane in 0..schedule.lanes.len() {
        ops.wait(Some(lane), fork)?;
    }
    for &(lane, command) in &schedule.issue {
        match command {
            Command::Wait(e) => ops.wait(Some(lane), e)?,
            Command::Run(s) => ops.run(lane, &plan.steps[s])?,
            Command::Record(e) => ops.record(Some(lane), e)?,
        }
    }
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
    }

    #[test]
    fn lanes_fork_from_and_join_back_to_the_callers_stream() {
        for n in [1, 2, 5] {
            for pattern in [Pattern::Gather { accumulate: false }, Pattern::Scatter, Pattern::MatmulThenExchange] {
                let p = plan(pattern, Schedule::Auto, n, n - 1);
                let s = StreamSchedule::new(&p);
                let mut log = Log::default();
                issue(&p, &s, &mut log).unwrap();
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
}
