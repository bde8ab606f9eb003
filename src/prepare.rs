//! The one trace-time call. Python describes a call (`abi::CallShapes`, as
//! JSON) and the library answers, as JSON: the result's shape, the schedule
//! it will run (`auto` resolved by the cost model on the machine Python
//! names), each backend's workspace, a summary of rank 0's plan, and with
//! `explain` the cost model's predictions for every schedule
//! (`sim::explain`). `python/commfuse/_abi.py` sends the requests.
#![forbid(unsafe_code)]

use crate::abi::{self, CallShapes};
use crate::backend::cpu::CpuLayout;
use crate::backend::cuda::workspace::CudaLayout;
use crate::error::{Error, Result};
use crate::plan::{self, Action, Buf, Plan, Schedule, Workspace};
use crate::problem::Problem;
use crate::sim::{self, Machine};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub call: CallShapes,
    /// The machine `schedule="auto"` plans for (`sim::Machine::from_spec`);
    /// none: `Schedule::resolve`'s rule.
    #[serde(default)]
    pub machine: Option<String>,
    /// This host's measured single-thread GEMM rate (for `cpu_here`).
    #[serde(default)]
    pub gemm_gflops: Option<f64>,
    /// Add the cost model's predictions of every schedule (needs `machine`).
    #[serde(default)]
    pub explain: bool,
    /// Write the cost model's timeline of the call as it would run (every
    /// rank, under the schedule the answer names) to this path as a Perfetto
    /// trace, JSON where it ends in `.json` (needs `machine`).
    #[serde(default)]
    pub trace: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Prepared {
    pub out: Vec<usize>,
    /// The schedule code the call runs with (`abi::schedule`): the one asked
    /// for, or `auto`'s pick.
    pub schedule: i64,
    pub schedule_name: String,
    /// Workspace bytes on each backend.
    pub workspace: Workspaces,
    /// Rank 0's plan (none for "unfused").
    pub plan: Option<PlanSummary>,
    /// `auto` on a machine: the model's pick, its predicted seconds and the
    /// unoverlapped baseline's (Python weighs the gain against a fused
    /// call's fixed cost).
    pub model: Option<AutoModel>,
    pub explain: Option<Value>,
}

#[derive(Debug, Serialize)]
pub struct Workspaces {
    pub cpu: usize,
    pub cuda: usize,
}

#[derive(Debug, Serialize)]
pub struct PlanSummary {
    /// The schedule the plan was made with (`auto` resolved).
    pub schedule: String,
    pub steps: usize,
    pub exchanges: usize,
    pub slots: usize,
    /// Bytes of blocks one rank holds at most while the call runs: its
    /// slots, and the parts of `x` (and `w`) it sends. On the CPU backend these are the
    /// transport's blocks (outside XLA's workspace); on CUDA the slots are
    /// in the workspace.
    pub blocks_in_flight: usize,
}

#[derive(Debug, Serialize)]
pub struct AutoModel {
    pub pick: String,
    pub pick_s: Option<f64>,
    pub sequential_s: Option<f64>,
    /// The link latencies `sequential_s` holds: one per exchange of its
    /// plan, which runs them one after another. What an all-reduce shares
    /// when XLA combines it with others (`_decide.judge`).
    pub sequential_latency_s: f64,
}

pub fn prepare(request: &Request) -> Result<Prepared> {
    let (kind, n, out, problem) = request.call.problem()?;
    if request.call.schedule == abi::UNFUSED && !request.explain {
        if request.trace.is_some() {
            return Err(Error::InvalidArgument("an unfused call runs no plan: there is no timeline to trace".into()));
        }
        let workspace = Workspaces { cpu: 0, cuda: 0 };
        let name = "unfused".to_string();
        return Ok(Prepared {
            out,
            schedule: abi::UNFUSED,
            schedule_name: name,
            workspace,
            plan: None,
            model: None,
            explain: None,
        });
    }
    let mut schedule = if request.explain { Schedule::Auto } else { abi::schedule(kind, request.call.schedule)? };
    let machine = match &request.machine {
        Some(spec) => {
            let cores = std::thread::available_parallelism().map_or(1, |p| p.get());
            Some(Machine::from_spec(spec, request.gemm_gflops.filter(|g| *g > 0.0), cores)?)
        }
        None => None,
    };
    // The model times a call it can (an op over several ranks); `auto` then
    // takes its pick, else `Schedule::resolve`'s rule at plan time.
    let choice = match &machine {
        Some(machine) if schedule == Schedule::Auto => sim::choose(&problem, n, machine).ok(),
        _ => None,
    };
    let explain = match (request.explain, &machine, &choice) {
        (false, _, _) => None,
        (true, Some(machine), Some(choice)) => Some(sim::explain::explain(&problem, n, machine, choice)?),
        (true, None, _) => return Err(Error::InvalidArgument("explain needs a machine".into())),
        (true, Some(_), None) => {
            return Err(Error::InvalidArgument(format!("{}: the cost model cannot time this call", kind.name())))
        }
    };
    let model = choice.as_ref().zip(machine.as_ref()).map(|(choice, machine)| {
        let pick = sim::auto_pick(choice, n, problem.pattern());
        schedule = pick;
        let sequential = plan::plan(problem.pattern(), Schedule::Sequential, n, 0);
        let exchanges = sequential.steps.iter().filter(|s| matches!(s.action, plan::Action::Exchange { .. })).count();
        AutoModel {
            pick: pick.to_string(),
            pick_s: choice.time(pick),
            sequential_s: choice.time(Schedule::Sequential),
            sequential_latency_s: exchanges as f64 * machine.link.latency_s,
        }
    });
    plan::check_size(kind.name(), schedule, n)?;
    // The predicted timeline needs the problem before the schedule cuts it;
    // it is written once everything else has succeeded.
    let predicted = match &request.trace {
        Some(path) => {
            let machine =
                machine.as_ref().ok_or_else(|| Error::InvalidArgument("a predicted trace needs a machine".into()))?;
            Some((path, sim::explain::predicted_timeline(&problem, schedule, n, machine)?))
        }
        None => None,
    };
    let problem = problem.for_schedule(schedule)?;
    // Every rank's plan uses the same slots; rank 0 stands for all.
    let plan = plan::plan(problem.pattern(), schedule, n, 0);
    let workspace =
        Workspaces { cpu: CpuLayout::new(&problem)?.total(), cuda: CudaLayout::new(&problem, &plan)?.total() };
    let summary = PlanSummary {
        schedule: plan.schedule.to_string(),
        steps: plan.steps.len(),
        exchanges: plan.steps.iter().filter(|s| matches!(s.action, Action::Exchange { .. })).count(),
        slots: plan.slots.len(),
        blocks_in_flight: blocks_in_flight(&problem, &plan)?,
    };
    let prepared = Prepared {
        out,
        schedule: abi::schedule_code(schedule),
        schedule_name: schedule.to_string(),
        workspace,
        plan: Some(summary),
        model,
        explain,
    };
    if let Some((path, events)) = predicted {
        crate::trace::write_events(std::path::Path::new(path), &events)?;
    }
    Ok(prepared)
}

/// See `PlanSummary::blocks_in_flight`.
fn blocks_in_flight(problem: &Problem, plan: &Plan) -> Result<usize> {
    let slots: usize = Workspace::layout(plan, &problem.sizes())?.slots.iter().map(|r| r.len()).sum();
    let mut sent: Vec<Buf> = plan
        .steps
        .iter()
        .filter_map(|s| match &s.action {
            Action::Exchange { sends, .. } => Some(sends.iter().map(|t| t.buf)),
            _ => None,
        })
        .flatten()
        .filter(|b| matches!(b, Buf::X | Buf::XBlock(_) | Buf::W))
        .collect();
    sent.sort_by_key(|b| match b {
        Buf::XBlock(j) => *j + 2,
        Buf::W => 1,
        _ => 0,
    });
    sent.dedup();
    let size = problem.input.size();
    let operand_parts: usize = sent
        .iter()
        .map(|b| match b {
            Buf::XBlock(j) => problem.x_block(*j).map_or(0, |r| r.len() * size),
            Buf::W => problem.sizes().w * size,
            _ => problem.sizes().x * size,
        })
        .sum();
    Ok(slots + operand_parts)
}

/// `prepare` from and to JSON (the C ABI's `commfuse_prepare`).
pub fn prepare_json(request: &str) -> Result<String> {
    let request: Request = serde_json::from_str(request)
        .map_err(|e| Error::InvalidArgument(format!("a prepare request that does not parse: {e}")))?;
    let prepared = prepare(&request)?;
    serde_json::to_string(&prepared).map_err(|e| Error::Internal(format!("writing the prepared call: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(text: &str) -> Result<Value> {
        prepare_json(text).map(|j| serde_json::from_str(&j).unwrap())
    }

    #[test]
    fn a_call_gives_its_result_schedule_workspaces_and_plan() {
        // A bf16 gather over 4 ranks: the CPU converts to f32, the GPU does not.
        let r = request(
            r#"{"call":{"kind":0,"schedule":1,"ranks":4,"dimension":0,"x":[8,16],"w":[16,4],"input":16,"output":16}}"#,
        )
        .unwrap();
        assert_eq!(r["out"], serde_json::json!([32, 4]));
        assert_eq!((r["schedule"].as_i64(), r["schedule_name"].as_str()), (Some(1), Some("ring")));
        let (cpu, cuda) = (r["workspace"]["cpu"].as_u64().unwrap(), r["workspace"]["cuda"].as_u64().unwrap());
        assert!(cuda > 0 && cpu > cuda, "cpu {cpu}, cuda {cuda}");
        assert_eq!(r["plan"]["schedule"], "ring");
        assert_eq!(r["plan"]["exchanges"], 3);
        assert!(r["model"].is_null() && r["explain"].is_null());
    }

    #[test]
    fn auto_on_a_machine_takes_the_models_pick() {
        let r = request(
            r#"{"call":{"kind":4,"schedule":0,"ranks":8,"dimension":0,"x":[4096,4096],"w":[4096,4096],"input":16,
                "output":16},"machine":"h100_nvlink"}"#,
        )
        .unwrap();
        let pick = r["model"]["pick"].as_str().unwrap();
        assert_eq!(r["schedule_name"], pick);
        assert!(r["model"]["pick_s"].as_f64().unwrap() < r["model"]["sequential_s"].as_f64().unwrap());
        // Without a machine, auto stays auto and the plan resolves it.
        let r = request(
            r#"{"call":{"kind":4,"schedule":0,"ranks":8,"dimension":0,"x":[64,8],"w":[8,8],"input":11,"output":11}}"#,
        )
        .unwrap();
        assert_eq!((r["schedule"].as_i64(), r["plan"]["schedule"].as_str()), (Some(0), Some("bidirectional")));
    }

    #[test]
    fn unfused_and_explain() {
        let unfused = request(
            r#"{"call":{"kind":2,"schedule":6,"ranks":4,"dimension":0,"x":[8,3],"w":[5,8],"input":11,"output":11}}"#,
        )
        .unwrap();
        assert_eq!((unfused["out"].clone(), unfused["plan"].is_null()), (serde_json::json!([5, 12]), true));
        let e = request(
            r#"{"call":{"kind":0,"schedule":0,"ranks":4,"dimension":0,"x":[64,64],"w":[64,64],"input":11,"output":11},
                "machine":"h100_nvlink","explain":true}"#,
        )
        .unwrap();
        let explained = &e["explain"];
        assert_eq!(explained["op"], "all_gather_matmul");
        assert!(explained["schedules"]["ring"].as_f64().unwrap() > 0.0);
        assert!(!explained["plan"]["compute"].as_array().unwrap().is_empty());
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let message = |text: &str| request(text).unwrap_err().to_string();
        assert!(message("{").contains("does not parse"));
        assert!(message(
            r#"{"call":{"kind":0,"schedule":0,"ranks":4,"dimension":0,"x":[4,2],"w":[3,4],"input":11,"output":11}}"#
        )
        .contains("`w` must be 2-D [2, n]"));
        assert!(message(r#"{"call":{"kind":0,"schedule":0,"ranks":4,"dimension":0,"x":[4,2],"w":[2,4],"input":11,"output":11},"machine":"nope"}"#)
            .contains("machine"));
        assert!(message(r#"{"call":{"kind":0,"schedule":0,"ranks":4,"dimension":0,"x":[4,2],"w":[2,4],"input":11,"output":11},"typo":1}"#)
            .contains("unknown field"));
    }
}
