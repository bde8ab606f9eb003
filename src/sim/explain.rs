//! `commfuse.explain`: the planner's choice for one call, as JSON.

use super::model::{auto_pick, choose, predict, schedule_name, Mode};
use super::Machine;
use crate::error::Result;
use crate::plan::{self, Action, Lane};
use std::fmt::Write;

/// One call as Python describes it (its schedule is ignored: every one is
/// predicted), and the machine to predict it on.
pub struct Query<'a> {
    pub call: crate::ops::CallShapes<'a>,
    /// A preset name, optionally with overrides (`Machine::from_spec`).
    pub machine: &'a str,
    pub gemm_gflops: Option<f64>,
    /// Processors of this host (for `cpu_here`).
    pub cores: usize,
}

fn action_brief(action: &Action) -> String {
    match action {
        Action::Matmul { block, src, dst, accumulate } => {
            format!("matmul b{block} {}{}{}", src, if *accumulate { " +-> " } else { " -> " }, dst)
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

fn string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn number(v: f64) -> String {
    if v.is_finite() {
        format!("{v:e}")
    } else {
        "null".into()
    }
}

/// The JSON `commfuse.explain` returns: the machine, every candidate
/// schedule's predicted seconds, T_compute, T_comm, the floor, the fastest
/// candidate, the choice (what `schedule="auto"` runs, see `auto_schedule`),
/// and rank 0's plan under it (steps per lane with their predicted start and end).
pub fn explain_json(q: &Query) -> Result<String> {
    let (kind, n, problem) = q.call.problem()?;
    let input = problem.input;
    let machine = Machine::from_spec(q.machine, q.gemm_gflops, q.cores)?;
    let choice = choose(&problem, n, &machine)?;
    let auto = auto_pick(&choice, n, kind.pattern());
    let timeline = predict(&problem, auto, n, &machine, Mode::Full)?;
    let plan = plan::plan(kind.pattern(), auto, n, 0);

    let mut j = String::from("{");
    let _ = write!(j, "\"op\":{},\"n\":{n},\"dtype\":{},", string(kind.name()), string(input.name()));
    let link = &machine.link;
    let topology = match link.topology {
        super::Topology::Switch => "switch",
        super::Topology::Ring => "ring",
    };
    let _ = write!(
        j,
        "\"machine\":{{\"name\":{},\"peak_flops\":{},\"efficiency\":{},\"memory_bytes_per_s\":{},\
         \"link_bytes_per_s\":{},\"latency_s\":{},\"topology\":{}}},",
        string(&machine.name),
        number(machine.compute.peak(input)),
        number(machine.compute.efficiency),
        number(machine.compute.memory_bytes_per_s),
        number(link.bytes_per_s),
        number(link.latency_s),
        string(topology)
    );
    let schedules: Vec<String> =
        choice.predictions.iter().map(|(s, t)| format!("{}:{}", string(&schedule_name(*s)), number(*t))).collect();
    let _ = write!(j, "\"schedules\":{{{}}},", schedules.join(","));
    let parts: Vec<String> = (choice.predictions.iter().zip(&choice.parts))
        .map(|((s, _), (c, m))| {
            format!("{}:{{\"compute\":{},\"comm\":{}}}", string(&schedule_name(*s)), number(*c), number(*m))
        })
        .collect();
    let _ = write!(j, "\"parts\":{{{}}},", parts.join(","));
    let _ = write!(
        j,
        "\"fastest\":{},\"choice\":{},\"t_compute\":{},\"t_comm\":{},\"floor\":{},",
        string(&schedule_name(choice.best)),
        string(&schedule_name(auto)),
        number(choice.t_compute),
        number(choice.t_comm),
        number(choice.floor())
    );
    let lane = |lane: Lane| -> String {
        let steps: Vec<String> = plan
            .lane_steps(lane)
            .map(|s| {
                let (start, end) = timeline.span(0, s.id);
                format!(
                    "{{\"id\":{},\"action\":{},\"deps\":{:?},\"start\":{},\"end\":{}}}",
                    s.id,
                    string(&action_brief(&s.action)),
                    s.deps,
                    number(start),
                    number(end)
                )
            })
            .collect();
        format!("[{}]", steps.join(","))
    };
    let _ = write!(j, "\"plan\":{{\"rank\":0,\"compute\":{},\"comm\":{}}}}}", lane(Lane::Compute), lane(Lane::Comm));
    Ok(j)
}
