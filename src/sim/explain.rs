//! `commfuse.explain`: the planner's choice for one problem, as JSON.

use super::model::{auto_pick, predict, Choice, Mode};
use super::{Machine, Topology};
use crate::error::{Error, Result};
use crate::plan::{self, Action, Lane, Schedule};
use crate::problem::Problem;
use crate::trace::{self, CallLabel};
use serde_json::{json, Value};

fn action_brief(action: &Action) -> String {
    match action {
        Action::Matmul { block, src, with, dst, accumulate } => {
            // The local w is every product's but a two-gather plan's.
            let with = if *with == plan::Buf::W { String::new() } else { format!(" x {with}") };
            format!("matmul b{block} {src}{with}{}{dst}", if *accumulate { " +-> " } else { " -> " })
        }
        Action::Sum { terms, dst } => {
            let terms: Vec<String> = terms.iter().map(|b| b.to_string()).collect();
            format!("sum {} -> {}", terms.join("+"), dst)
        }
        Action::Exchange { sends, recvs } => {
            let sends: Vec<String> = sends.iter().map(|t| format!("{}->{}", t.buf, t.peer)).collect();
            let recvs: Vec<String> = recvs.iter().map(|t| format!("{}<-{}", t.buf, t.peer)).collect();
            format!("exchange send {} recv {}", sends.join(" "), recvs.join(" "))
        }
    }
}

/// A number for JSON: infinities and NaN (an untimeable step) become null.
fn number(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        Value::Null
    }
}

/// What `commfuse.explain` returns for `problem` over `n` ranks on
/// `machine`, given the model's `choice`: the machine, every candidate
/// schedule's predicted seconds (and its compute-only and comm-only parts),
/// T_compute (the pieces), one whole GEMM, T_comm, the floor, the fastest candidate, what
/// `schedule="auto"` picks (`auto_pick`), and rank 0's plan under it (steps
/// per lane with their predicted start and end).
pub fn explain(problem: &Problem, n: usize, machine: &Machine, choice: &Choice) -> Result<Value> {
    let kind = problem.kind;
    let input = problem.input;
    let auto = auto_pick(choice, n, problem.pattern());
    let timeline = predict(problem, auto, n, machine, Mode::Full)?;
    let plan = plan::plan(problem.pattern(), auto, n, 0);
    let link = &machine.link;
    let topology = match link.topology {
        Topology::Switch => "switch",
        Topology::Ring => "ring",
    };
    let schedules: serde_json::Map<String, Value> =
        choice.predictions.iter().map(|(s, t)| (s.to_string(), number(*t))).collect();
    let parts: serde_json::Map<String, Value> = (choice.predictions.iter().zip(&choice.parts))
        .map(|((s, _), (c, m))| (s.to_string(), json!({"compute": number(*c), "comm": number(*m)})))
        .collect();
    let lane = |lane: Lane| -> Vec<Value> {
        plan.lane_steps(lane)
            .map(|s| {
                let (start, end) = timeline.span(0, s.id);
                json!({
                    "id": s.id,
                    "action": action_brief(&s.action),
                    "deps": s.deps,
                    "start": number(start),
                    "end": number(end),
                })
            })
            .collect()
    };
    Ok(json!({
        "op": kind.name(),
        "n": n,
        "dtype": input.name(),
        "machine": {
            "name": machine.name,
            "peak_flops": number(machine.compute.peak(input)),
            "efficiency": number(machine.compute.efficiency),
            "memory_bytes_per_s": number(machine.compute.memory_bytes_per_s),
            "link_bytes_per_s": number(link.bytes_per_s),
            "latency_s": number(link.latency_s),
            "topology": topology,
        },
        "schedules": schedules,
        "parts": parts,
        "fastest": choice.best.to_string(),
        "choice": auto.to_string(),
        "t_compute": number(choice.t_compute),
        "t_gemm": number(choice.t_gemm),
        "t_comm": number(choice.t_comm),
        "floor": number(choice.floor()),
        "plan": {"rank": 0, "compute": lane(Lane::Compute), "comm": lane(Lane::Comm)},
    }))
}

/// The cost model's timeline of `problem` (not cut) over `n` ranks under
/// `schedule` on `machine`, as trace events: a device per rank, its steps
/// at their predicted times (`trace::call_events`).
pub fn predicted_timeline(
    problem: &Problem,
    schedule: Schedule,
    n: usize,
    machine: &Machine,
) -> Result<Vec<trace::Event>> {
    let timeline = predict(problem, schedule, n, machine, Mode::Full)?;
    let cut = problem.for_schedule(schedule)?;
    const START_NS: u64 = trace::CALL_START_NS;
    let ns = |s: f64| START_NS + (s.max(0.0) * 1e9) as u64;
    let mut events = Vec::new();
    for rank in 0..n {
        let plan = plan::plan(problem.pattern(), schedule, n, rank);
        let spans = timeline
            .steps
            .get(rank)
            .ok_or_else(|| Error::Internal(format!("the simulation has no rank {rank}")))?
            .iter()
            .map(|&(start, end)| (start.is_finite() && end.is_finite()).then(|| (ns(start), ns(end))))
            .collect::<Vec<_>>();
        let x_bytes = cut.sizes().x * cut.input.size();
        let label = CallLabel {
            transport: "predicted",
            ..CallLabel::new(rank as i64, 0, problem.kind.name(), &plan, &cut, x_bytes)
        };
        let args = [("clock", trace::Value::S(format!("the cost model on {}", machine.name)))];
        events.extend(trace::call_events(&plan, &spans, &label, 0, START_NS, &args));
    }
    Ok(events)
}
