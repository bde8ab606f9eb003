//! Per-step costs from a [`Problem`], predictions of each schedule, and the
//! planner's choice.

use super::engine::{simulate, Timeline};
use super::Machine;
use crate::error::{Error, Result};
use crate::plan::{self, Action, Buf, Plan, Schedule, SlotKind, Step};
use crate::problem::Problem;

/// What a simulation counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Compute and communication.
    Full,
    /// Communication is free (infinite bandwidth, no latency): T_compute.
    ComputeOnly,
    /// Compute is free: T_comm.
    CommOnly,
}

/// The problem as `schedule` cuts it, or why the schedule does not apply.
fn cut(problem: &Problem, schedule: Schedule, n: usize) -> Result<Problem> {
    match schedule {
        Schedule::Sliced { .. } | Schedule::Tiled { .. } => {
            if n < 2 || !Schedule::sliceable(problem.pattern()) {
                return Err(Error::InvalidArgument(format!(
                    "{}: no {} schedule for this op over {n} ranks",
                    problem.kind.name(),
                    schedule
                )));
            }
            problem.for_schedule(schedule)
        }
        Schedule::Auto => Err(Error::InvalidArgument("sim: predict a concrete schedule, not Auto".into())),
        _ => Ok(*problem),
    }
}

/// Elements of `buf` in `plan` for `problem` (already cut), and its dtype's size.
fn extent(problem: &Problem, plan: &Plan, buf: Buf) -> (usize, usize) {
    let sizes = problem.sizes();
    let acc = sizes.accumulator().size();
    match buf {
        Buf::X => (sizes.x, sizes.input.size()),
        Buf::W => (sizes.w, sizes.input.size()),
        Buf::XBlock(j) => (problem.x_block(j).map_or(0, |r| r.len()), sizes.input.size()),
        Buf::Out => (sizes.result, acc),
        Buf::OutBlock(_) => (problem.out_range(buf).len(), acc),
        Buf::Slot(i) => match plan.slots.get(i) {
            Some(SlotKind::Input) => (sizes.travel, sizes.input.size()),
            Some(SlotKind::Weight) => (sizes.w, sizes.input.size()),
            Some(SlotKind::Partial) => (sizes.partial, acc),
            Some(SlotKind::Result) | None => (sizes.result, acc),
        },
    }
}

/// Seconds a GEMM or sum step of `plan` takes alone on `machine`.
pub fn step_seconds(problem: &Problem, plan: &Plan, step: &Step, machine: &Machine) -> f64 {
    let c = &machine.compute;
    let acc = problem.accumulator();
    match &step.action {
        Action::Matmul { block, src, dst, accumulate, .. } => problem
            .gemms(*block, *src, *dst)
            .iter()
            .map(|g| c.gemm_s(g.dst.rows, g.lhs.1.cols, g.dst.cols, problem.input, acc, *accumulate))
            .sum(),
        Action::Sum { terms, dst } => c.sum_s(extent(problem, plan, *dst).0, terms.len(), acc),
        // Host devices copy each message out (send) and in (receive) on the
        // shared processors: a read and a write of its bytes each.
        Action::Exchange { sends, recvs } if machine.shared_processors.is_some() => {
            let bytes: usize =
                sends.iter().chain(recvs).map(|t| extent(problem, plan, t.buf)).map(|(e, s)| e * s).sum();
            2.0 * bytes as f64 / c.memory_bytes_per_s
        }
        Action::Exchange { .. } => 0.0,
    }
}

/// Simulates all `n` ranks of `problem` (not cut) under `schedule`.
pub fn predict(problem: &Problem, schedule: Schedule, n: usize, machine: &Machine, mode: Mode) -> Result<Timeline> {
    let cut = cut(problem, schedule, n)?;
    let plans: Vec<Plan> = (0..n).map(|r| plan::plan(problem.pattern(), schedule, n, r)).collect();
    let mut link = machine.link;
    if mode == Mode::ComputeOnly {
        link.bytes_per_s = f64::INFINITY;
        link.latency_s = 0.0;
    }
    let work = |r: usize, step: &Step| match (mode, &step.action) {
        (Mode::CommOnly, _) | (Mode::ComputeOnly, Action::Exchange { .. }) => 0.0,
        _ => step_seconds(&cut, &plans[r], step, machine),
    };
    let bytes = |r: usize, buf: Buf| {
        let (elements, size) = extent(&cut, &plans[r], buf);
        (elements * size) as f64
    };
    simulate(&plans, &link, machine.shared_processors, &work, &bytes)
}

/// The schedules the planner compares for `problem` over `n` ranks.
pub fn candidates(problem: &Problem, n: usize) -> Vec<Schedule> {
    let pattern = problem.pattern();
    let mut out = vec![Schedule::Sequential, Schedule::Ring];
    if pattern.uses_ring() && n >= 3 {
        out.push(Schedule::Bidirectional);
    }
    for slices in [2, 4, 8] {
        if cut(problem, Schedule::Sliced { slices }, n).is_ok() {
            out.push(Schedule::Sliced { slices });
        }
    }
    for tiles in [2, 4, 8] {
        if cut(problem, Schedule::Tiled { tiles }, n).is_ok() {
            out.push(Schedule::Tiled { tiles });
        }
    }
    out
}

/// The planner's answer: the fastest schedule by the model, every
/// candidate's predicted time, and the floor.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub best: Schedule,
    /// (schedule, predicted seconds), in `candidates` order.
    pub predictions: Vec<(Schedule, f64)>,
    /// The least compute-only time of any candidate (no communication):
    /// the per-peer pieces' GEMMs and sums.
    pub t_compute: f64,
    /// The op's local product as one GEMM (what the unfused form multiplies),
    /// at most `t_compute`: the pieces' GEMMs lose their last waves and fixed
    /// costs against it.
    pub t_gemm: f64,
    /// The least communication-only time of any candidate (free compute).
    pub t_comm: f64,
    /// (compute-only, communication-only) seconds of each candidate, in
    /// `predictions` order: a sequential schedule takes about their sum.
    pub parts: Vec<(f64, f64)>,
}

impl Choice {
    /// max(one whole GEMM, T_comm): no decomposition can beat it, so the
    /// pieces' loss against one GEMM shows as distance to it.
    pub fn floor(&self) -> f64 {
        self.t_gemm.max(self.t_comm)
    }

    pub fn time(&self, schedule: Schedule) -> Option<f64> {
        self.predictions.iter().find(|(s, _)| *s == schedule).map(|(_, t)| *t)
    }
}

/// Picks the schedule the model predicts fastest for `problem` (its op kind
/// and shapes) over `n` ranks on `machine`. What `schedule="auto"` can call.
pub fn choose(problem: &Problem, n: usize, machine: &Machine) -> Result<Choice> {
    let (mut predictions, mut parts) = (vec![], vec![]);
    for schedule in candidates(problem, n) {
        let time = predict(problem, schedule, n, machine, Mode::Full)?.makespan;
        let compute = predict(problem, schedule, n, machine, Mode::ComputeOnly)?.makespan;
        let comm = predict(problem, schedule, n, machine, Mode::CommOnly)?.makespan;
        predictions.push((schedule, time));
        parts.push((compute, comm));
    }
    let t_compute = parts.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let t_comm = parts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    // Ties go to the earlier candidate (the simpler schedule).
    let best = predictions.iter().fold(None, |best: Option<(Schedule, f64)>, &(s, t)| match best {
        Some((_, bt)) if bt <= t => best,
        _ => Some((s, t)),
    });
    let best = best.map(|(s, _)| s).unwrap_or(Schedule::Ring);
    // One GEMM is never priced above the pieces it replaces (a shape whose
    // pieces fill the waves better than the whole does).
    let t_gemm = whole_gemm_s(problem, n, machine).map_or(t_compute, |t| t.min(t_compute));
    Ok(Choice { best, predictions, t_compute, t_gemm, t_comm, parts })
}

/// Seconds of the op's local product as one GEMM on `machine` (what the
/// unfused form multiplies): the GEMM pieces of rank 0's ring plan joined
/// along the dim the op's blocks cut (rows, contraction or columns), the
/// ranks sharing the machine's processors as the pieces do. `None` where
/// the pieces differ in shape.
pub fn whole_gemm_s(problem: &Problem, n: usize, machine: &Machine) -> Option<f64> {
    use crate::problem::OpKind::*;
    let plan = plan::plan(problem.pattern(), Schedule::Ring, n, 0);
    let pieces: Vec<(usize, usize, usize)> = plan
        .steps
        .iter()
        .filter_map(|s| match s.action {
            Action::Matmul { block, src, dst, .. } => Some(problem.gemms(block, src, dst)),
            _ => None,
        })
        .flatten()
        .map(|g| (g.dst.rows, g.lhs.1.cols, g.dst.cols))
        .collect();
    let &(m, k, c) = pieces.first()?;
    if pieces.iter().any(|&p| p != (m, k, c)) {
        return None;
    }
    let count = pieces.len();
    let (m, k, c) = match problem.kind {
        AllGatherMatmul | MatmulReduceScatter | AllToAllMatmul | MatmulAllToAll | MatmulAllReduce => (m * count, k, c),
        AllGatherMatmulContract | MatmulAllGatherContract | AllToAllMatmulContract => (m, k * count, c),
        MatmulAllGather | MatmulReduceScatterCols | MatmulAllToAllCols => (m, k, c * count),
        // Every row block by every block of w: x @ the gathered w.
        AllGatherMatmulReduceScatter => (m * (count / problem.gathered()), k, c * problem.gathered()),
        // Every row block by every block of w: the gathered x @ the gathered w.
        AllGatherBothMatmul => (m * (count / problem.gathered()), k * problem.gathered(), c),
        // Every row block by every block of x's columns: x gathered @ w.
        AllGatherContractMatmulReduceScatter => (m * problem.gathered(), k * (count / problem.gathered()), c),
    };
    let shared = machine.shared_processors.map_or(1.0, |p| (n as f64 / p).max(1.0));
    Some(shared * machine.compute.gemm_s(m, k, c, problem.input, problem.accumulator(), false))
}

/// How much faster (by the model) a tiled schedule must be than the best
/// per-step one for `auto` to take it: smaller GEMMs and more messages are
/// where the model is least exact.
const TILED_MARGIN: f64 = 0.97;

/// The schedule `schedule="auto"` runs for `problem` over `n` ranks on
/// `machine`: the overlapped schedule (ring, bidirectional or tiled) the
/// model predicts fastest, tiled only if it beats the per-step ones by 3%;
/// the baselines (sequential, sliced) are never picked, except the sliced
/// all-reduce (its chunks are what overlaps the all-gather half) and the
/// sliced two-axis ops (their chunks shorten the tail after the last
/// transfer). `Schedule::resolve`'s rule if the model cannot time it.
pub fn auto_schedule(problem: &Problem, n: usize, machine: &Machine) -> Schedule {
    match choose(problem, n, machine) {
        Ok(choice) => auto_pick(&choice, n, problem.pattern()),
        Err(_) => Schedule::Auto.resolve(n, problem.pattern()),
    }
}

/// `auto_schedule`'s pick from predictions already made.
pub fn auto_pick(choice: &Choice, n: usize, pattern: crate::plan::Pattern) -> Schedule {
    // Ties go to the earlier candidate (ring before bidirectional, fewer tiles first).
    let fastest = |tiled: bool| {
        choice
            .predictions
            .iter()
            .filter(|(s, _)| match s {
                Schedule::Ring | Schedule::Bidirectional => !tiled,
                Schedule::Sliced { .. } => {
                    !tiled
                        && matches!(
                            pattern,
                            crate::plan::Pattern::AllReduce
                                | crate::plan::Pattern::GatherScatter { .. }
                                | crate::plan::Pattern::GatherGather { .. }
                        )
                }
                Schedule::Tiled { .. } => tiled,
                _ => false,
            })
            .fold(None, |best: Option<(Schedule, f64)>, &(s, t)| match best {
                Some((_, bt)) if bt <= t => best,
                _ => Some((s, t)),
            })
    };
    match (fastest(false), fastest(true)) {
        (Some((_, per_step)), Some((tiled, t))) if t < TILED_MARGIN * per_step => tiled,
        (Some((per_step, _)), _) => per_step,
        _ => Schedule::Auto.resolve(n, pattern),
    }
}
