//! The slices of one call whose steps' start and end are known on one clock
//! rather than observed as they run: the one-rank mode's device timeline
//! (`backend::cuda::solo_device`, timing events around each step on its
//! stream) and the cost model's predicted one (`sim::explain`). Per lane:
//! the call's slice, a slice per step, and a "wait" slice where a step that
//! depends on the other lane began after its lane's previous step (or the
//! call's start) ended. A gap before a step without such dependencies is
//! left empty (on a device: the host had not enqueued the step yet).
#![forbid(unsafe_code)]

use super::{list, step_slice, CallLabel, Event, Kind, Value};
use crate::plan::{Lane, Plan};

/// Where such a call starts on its trace's clock: Perfetto reads a
/// timestamp of 0 as unset, so 1 µs in.
pub const CALL_START_NS: u64 = 1_000;

/// The events of `label`'s call number `call` of `plan`: `spans[step id]`
/// holds a step's (start, end) in nanoseconds on the clock `start_ns`, the
/// call's start, is on; a step without a span (not run) is left out, and so
/// is a lane without any. `args` go on each lane's call slice after the
/// label's own.
pub fn call_events(
    plan: &Plan,
    spans: &[Option<(u64, u64)>],
    label: &CallLabel,
    call: u64,
    start_ns: u64,
    args: &[(&'static str, Value)],
) -> Vec<Event> {
    let mut events = Vec::new();
    for lane in [Lane::Compute, Lane::Comm] {
        let event = |kind, step, start_ns, end_ns: u64, args| Event {
            device: label.device,
            rank: label.rank,
            lane,
            kind,
            op: label.op,
            call,
            step,
            start_ns,
            end_ns: end_ns.max(start_ns),
            args,
        };
        let mut lane_events = Vec::new();
        let mut previous_end = start_ns;
        for step in plan.lane_steps(lane) {
            let Some((start, end)) = spans.get(step.id).copied().flatten() else { continue };
            if !step.deps.is_empty() && start > previous_end {
                let for_steps = vec![("for_steps", Value::S(list(&step.deps)))];
                lane_events.push(event(Kind::Wait, Some(step.id), previous_end, start, for_steps));
            }
            let (kind, step_args) = step_slice(step, label);
            lane_events.push(event(kind, Some(step.id), start, end, step_args));
            previous_end = previous_end.max(end);
        }
        if lane_events.is_empty() {
            continue;
        }
        let mut call_args = label.call_args(plan.n, plan.schedule.to_string());
        call_args.extend(args.iter().cloned());
        events.push(event(Kind::Call, None, start_ns, previous_end, call_args));
        events.append(&mut lane_events);
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::plan::{plan, Pattern, Schedule};
    use crate::problem::{OpKind, Operand, Problem};

    /// An all-gather-matmul of 8x16 rows per rank by 16x8 over `n` ranks.
    fn problem(n: usize) -> Problem {
        let op = |dims| Operand { dims, dtype: DType::F32 };
        let out = [8 * n as i64, 8];
        Problem::new(OpKind::AllGatherMatmul, op(&[8, 16]), op(&[16, 8]), op(&out), 0, n).unwrap()
    }

    fn label(plan: &Plan, problem: &Problem) -> CallLabel {
        let x_bytes = problem.sizes().x * problem.input.size();
        CallLabel { transport: "solo", ..CallLabel::new(0, 3, "all_gather_matmul", plan, problem, x_bytes) }
    }

    /// Each lane runs its steps back to back, each step starting once its
    /// dependencies on the other lane have ended (2 ns later): the slices
    /// are the steps at their times, with a wait exactly where a step's
    /// dependency held it.
    #[test]
    fn steps_become_slices_at_their_times_with_waits_where_a_dependency_held_them() {
        let problem = problem(4);
        let p = plan(Pattern::Gather { accumulate: false }, Schedule::Ring, 4, 1);
        let mut spans = vec![None; p.steps.len()];
        let mut lane_free = [100u64, 100];
        // Plan order respects dependencies: each step's deps are earlier steps.
        for step in &p.steps {
            let lane = step.lane as usize;
            let ready = step.deps.iter().map(|&d| spans[d].map_or(0, |(_, e): (u64, u64)| e + 2)).max().unwrap_or(0);
            let start = lane_free[lane].max(ready);
            // Transfers slower than the matmuls: the matmuls wait for arrivals.
            let end = start + if step.lane == Lane::Comm { 40 } else { 10 + step.id as u64 };
            spans[step.id] = Some((start, end));
            lane_free[lane] = end;
        }
        let events = call_events(&p, &spans, &label(&p, &problem), 9, 100, &[("pace", Value::S("h100".into()))]);
        for lane in [Lane::Compute, Lane::Comm] {
            let mine: Vec<&Event> = events.iter().filter(|e| e.lane == lane).collect();
            let call = mine.iter().find(|e| e.kind == Kind::Call).unwrap();
            assert_eq!(call.start_ns, 100);
            assert!(
                call.args.contains(&("pace", Value::S("h100".into())))
                    && call.args.contains(&("transport", Value::S("solo".into())))
            );
            let steps: Vec<&Event> =
                mine.iter().copied().filter(|e| !matches!(e.kind, Kind::Call | Kind::Wait)).collect();
            let want: Vec<usize> = p.lane_steps(lane).map(|s| s.id).collect();
            assert_eq!(steps.iter().map(|e| e.step.unwrap()).collect::<Vec<_>>(), want, "{lane:?}");
            assert_eq!(call.end_ns, steps.last().unwrap().end_ns);
            for e in &steps {
                assert_eq!(Some((e.start_ns, e.end_ns)), spans[e.step.unwrap()]);
            }
            for pair in steps.windows(2) {
                let step = &p.steps[pair[1].step.unwrap()];
                let wait = mine.iter().find(|e| e.kind == Kind::Wait && e.step == Some(step.id));
                if pair[1].start_ns > pair[0].end_ns {
                    assert!(!step.deps.is_empty());
                    let wait = wait.expect("a held step shows its wait");
                    assert_eq!((wait.start_ns, wait.end_ns), (pair[0].end_ns, pair[1].start_ns));
                    assert_eq!(wait.args, vec![("for_steps", Value::S(list(&step.deps)))]);
                } else {
                    assert!(wait.is_none(), "step {} ran at once", step.id);
                }
            }
        }
        // The comm lane's first exchange waits for nothing; some compute step waited for an arrival.
        assert!(events.iter().any(|e| e.kind == Kind::Wait && e.lane == Lane::Compute));
        assert!(events.iter().any(|e| e.kind == Kind::Exchange && e.args.iter().any(|(k, _)| *k == "bytes")));
    }

    #[test]
    fn steps_that_did_not_run_and_empty_lanes_are_left_out() {
        let problem = problem(2);
        let p = plan(Pattern::Gather { accumulate: false }, Schedule::Ring, 2, 0);
        let spans: Vec<Option<(u64, u64)>> =
            p.steps.iter().map(|s| (s.lane == Lane::Compute).then_some((5 + s.id as u64, 6 + s.id as u64))).collect();
        let events = call_events(&p, &spans, &label(&p, &problem), 1, 5, &[]);
        assert!(events.iter().all(|e| e.lane == Lane::Compute));
        assert_eq!(events.iter().filter(|e| e.kind == Kind::Matmul).count(), p.lane_steps(Lane::Compute).count());
        assert!(call_events(&p, &vec![None; p.steps.len()], &label(&p, &problem), 1, 5, &[]).is_empty());
    }
}
