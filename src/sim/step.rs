//! The cost of a whole compiled program on one device: what a step of a
//! training loop takes on a machine (`commfuse.plan` prices its candidate
//! layouts with it; `python/commfuse/_planner/price.py` sends the requests).
//!
//! Every device runs the same SPMD program, so one device stands for all.
//! The program is a list of ops in program order, each naming the earlier
//! ops it reads. The device has two lanes, compute and comm; an op starts
//! when the lanes it occupies are free and the ops it reads have ended:
//! - `gemm` and `memory` on the compute lane (the machine's GEMM roofline,
//!   with its wave model on a GPU, a batch in one kernel; bytes over memory
//!   bandwidth);
//! - `collective` on the comm lane when collectives are `async` (XLA on a
//!   GPU runs them on their own streams, beside independent compute), on
//!   both lanes when `blocking` (XLA's CPU runtime); its time is the ring
//!   algorithm's on the machine's link, or the network's when its group
//!   spans nodes;
//! - `fused` (a commfuse op) on both lanes for the time the cost model
//!   predicts for its schedule (`model::predict`; its overlap is inside);
//! - `loop` on both lanes: its body simulated once, times its trip count;
//! - `conditional` on both lanes: its costliest branch.
//!
//! Memory the runtime maps afresh for each execution (`fresh_bytes`) is
//! first written on the compute lane before the first op, at the machine's
//! `touch_bytes_per_s`.
//!
//! A request (`Request`, JSON):
//! ```text
//! {"machine": "h100_cluster", "gemm_gflops": null, "collectives": "async", "devices": 8, "timeline": false,
//!  "ops": [{"deps": [], "gemm": {"batch": 1, "m": 8, "k": 64, "n": 128, "input": "bfloat16", "output": "bfloat16"}},
//!          {"deps": [0], "memory": {"bytes": 4096}},
//!          {"deps": [], "collective": {"kind": "all-gather", "bytes": 32768, "ranks": 8, "crosses_nodes": false}},
//!          {"deps": [1, 2], "fused": {"call": {<abi::CallShapes>}, "crosses_nodes": false, "overhead_s": 1.6e-5}},
//!          {"deps": [3], "loop": {"trip_count": 4, "ops": [<ops; deps index this list>]}},
//!          {"deps": [4], "conditional": {"branches": [[<ops>], [<ops>]]}}],
//!  "fresh_bytes": 0}
//! ```
//! The answer (`Priced`): `total_s`, `compute_s`, `comm_s`, `exposed_comm_s`,
//! `by_kind` (`gemm`, `memory`, `collective`, `fused` seconds),
//! `collective_calls` (kind -> `{"count", "bytes"}`), `fused_ops`, `machine`
//! (`{"name", "devices_per_node", "shared_processors"}`) and `timeline` (`[{"start_s", "end_s"}]`
//! per top-level op, or null).
#![forbid(unsafe_code)]

use super::model::{self, Mode};
use super::Machine;
use crate::abi::{self, CallShapes};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::{self, Schedule};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// One device's program and the machine to price it on.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// A machine description (`Machine::from_spec`).
    pub machine: String,
    /// This host's measured single-thread GEMM rate (for `cpu_here`), or
    /// one replacing a GPU preset's achievable rate.
    #[serde(default)]
    pub gemm_gflops: Option<f64>,
    #[serde(default)]
    pub collectives: Collectives,
    /// How many devices run the program at once (default 1). Where the
    /// machine's devices share processors (`cpu_here`), each device's GEMMs
    /// and memory work run at `processors / devices` of their speed when
    /// there are more devices than processors.
    #[serde(default)]
    pub devices: Option<usize>,
    /// Answer each top-level op's start and end too.
    #[serde(default)]
    pub timeline: bool,
    /// Bytes the runtime maps afresh for each execution (on CPU devices,
    /// XLA's temporaries where the host's allocator maps them anew): first
    /// written on the compute lane at the machine's `touch_bytes_per_s`,
    /// before the first op.
    #[serde(default)]
    pub fresh_bytes: u64,
    pub ops: Vec<Op>,
}

/// How XLA runs its own collectives beside compute.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Collectives {
    /// On their own lane, overlapping independent compute (XLA on GPUs).
    #[default]
    Async,
    /// Holding both lanes (XLA's CPU runtime).
    Blocking,
}

/// One op: the earlier ops (indices in the same list) it reads, and exactly
/// one cost.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Op {
    #[serde(default)]
    pub deps: Vec<usize>,
    #[serde(default)]
    pub gemm: Option<Gemm>,
    #[serde(default)]
    pub memory: Option<Memory>,
    #[serde(default)]
    pub collective: Option<Collective>,
    #[serde(default)]
    pub fused: Option<Fused>,
    #[serde(default, rename = "loop")]
    pub loop_: Option<Loop>,
    #[serde(default)]
    pub conditional: Option<Conditional>,
}

/// `batch` independent `[m, k] @ [k, n]` products; dtypes by name
/// (`DType::name`: "bfloat16", "float32", ...).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gemm {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub input: String,
    pub output: String,
}

/// Elementwise work, copies, reductions: the bytes they read and write.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    pub bytes: u64,
}

/// XLA's collectives by their HLO names; a kind's index in `ALL` is its discriminant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
pub enum CollectiveKind {
    #[serde(rename = "all-gather")]
    AllGather,
    #[serde(rename = "reduce-scatter")]
    ReduceScatter,
    #[serde(rename = "all-reduce")]
    AllReduce,
    #[serde(rename = "all-to-all")]
    AllToAll,
    #[serde(rename = "collective-permute")]
    CollectivePermute,
}

impl CollectiveKind {
    const ALL: [CollectiveKind; 5] = [
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllReduce,
        CollectiveKind::AllToAll,
        CollectiveKind::CollectivePermute,
    ];

    /// Its HLO opcode, as requests name it.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "all-gather",
            CollectiveKind::ReduceScatter => "reduce-scatter",
            CollectiveKind::AllReduce => "all-reduce",
            CollectiveKind::AllToAll => "all-to-all",
            CollectiveKind::CollectivePermute => "collective-permute",
        }
    }
}

/// One of XLA's collectives: `bytes` is one device's larger of operand and
/// result; `ranks` the size of its groups.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Collective {
    pub kind: CollectiveKind,
    pub bytes: u64,
    pub ranks: usize,
    #[serde(default)]
    pub crosses_nodes: bool,
}

/// A commfuse fused op, described as `commfuse_prepare` takes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fused {
    pub call: CallShapes,
    #[serde(default)]
    pub crosses_nodes: bool,
    /// What a fused call costs beyond its plan on this machine, whatever
    /// its size (launching it, handing it to the backend's threads): the
    /// fixed cost `auto` weighs too (Python measures it on CPU devices).
    #[serde(default)]
    pub overhead_s: f64,
}

/// A while loop: its body (deps index the body's own list) runs `trip_count` times.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Loop {
    pub trip_count: u64,
    pub ops: Vec<Op>,
}

/// A conditional: one of its branches runs; the costliest is priced.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conditional {
    pub branches: Vec<Vec<Op>>,
}

/// Seconds of each kind of work, summed over the ops that ran (loop bodies
/// times their trip count, the costliest branch of each conditional).
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize)]
pub struct ByKind {
    pub gemm: f64,
    pub memory: f64,
    pub collective: f64,
    pub fused: f64,
}

/// How many collectives of one kind ran, and their bytes (as in the request).
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize)]
pub struct Calls {
    pub count: u64,
    pub bytes: u64,
}

/// When one top-level op ran.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Span {
    pub start_s: f64,
    pub end_s: f64,
}

/// The machine a step was priced on, as `price.py` needs to read programs for it.
#[derive(Debug, Serialize)]
pub struct MachineSummary {
    pub name: String,
    /// Devices per node of its network (none: one node).
    pub devices_per_node: Option<usize>,
    /// The processors its devices share (`cpu_here`: this host's cores as
    /// the model counts them; none where each device computes on its own).
    pub shared_processors: Option<f64>,
}

/// The answer: one device's step, in seconds.
#[derive(Debug, Serialize)]
pub struct Priced {
    /// The step: when its last op ends.
    pub total_s: f64,
    /// The compute lane's work: GEMMs, memory work, and the compute of
    /// fused ops (their compute-only prediction).
    pub compute_s: f64,
    /// Communication: collectives, and the communication of fused ops
    /// (their communication-only prediction).
    pub comm_s: f64,
    /// `total_s - compute_s`: the time compute waits for communication.
    pub exposed_comm_s: f64,
    pub by_kind: ByKind,
    /// Per collective kind ("all-gather", ...): how many ran and their bytes.
    pub collective_calls: BTreeMap<&'static str, Calls>,
    /// How many fused ops ran.
    pub fused_ops: u64,
    pub machine: MachineSummary,
    /// Each top-level op's start and end (with `timeline`); with
    /// `fresh_bytes`, the first op starts after their first write.
    pub timeline: Option<Vec<Span>>,
}

/// What ran, summed.
#[derive(Debug, Default, Clone)]
struct Tally {
    compute_s: f64,
    comm_s: f64,
    by_kind: ByKind,
    /// Indexed by `CollectiveKind as usize`.
    calls: [Calls; 5],
    fused_ops: u64,
}

impl Tally {
    /// Adds `other` run `times` times (a loop's trip count, or 1).
    fn add(&mut self, other: &Tally, times: u64) {
        let t = times as f64;
        self.compute_s += other.compute_s * t;
        self.comm_s += other.comm_s * t;
        self.by_kind.gemm += other.by_kind.gemm * t;
        self.by_kind.memory += other.by_kind.memory * t;
        self.by_kind.collective += other.by_kind.collective * t;
        self.by_kind.fused += other.by_kind.fused * t;
        for (mine, theirs) in self.calls.iter_mut().zip(&other.calls) {
            mine.count = mine.count.saturating_add(theirs.count.saturating_mul(times));
            mine.bytes = mine.bytes.saturating_add(theirs.bytes.saturating_mul(times));
        }
        self.fused_ops = self.fused_ops.saturating_add(other.fused_ops.saturating_mul(times));
    }
}

/// A fused op's predicted (time, compute-only, communication-only) seconds.
type FusedTimes = (f64, f64, f64);
/// What identifies a fused op's prediction: its call's fields and whether it crosses nodes.
type FusedKey = (i64, i64, i64, i64, Vec<i64>, Vec<i64>, u32, u32, bool);

/// The machine and the rules every op is priced by.
struct Pricer {
    machine: Machine,
    across_nodes: Option<Machine>,
    collectives: Collectives,
    /// How much slower a device's GEMMs and memory work run for sharing
    /// processors with the other devices (1: not at all).
    compute_slowdown: f64,
    fused: HashMap<FusedKey, FusedTimes>,
}

/// The largest dim a GEMM may name: products of two stay within 64 bits.
const MAX_GEMM_DIM: usize = 1 << 31;

impl Pricer {
    /// The machine a group sees: this one, or across nodes its network's
    /// (an error on a machine of one node).
    fn machine(&self, crosses_nodes: bool, what: &str) -> Result<&Machine> {
        if !crosses_nodes {
            return Ok(&self.machine);
        }
        self.across_nodes.as_ref().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{what} crosses nodes, but machine {:?} has one node (give it `gpus_per_node` and a network)",
                self.machine.name
            ))
        })
    }

    /// Seconds of `batch` GEMMs, one after another, in one kernel.
    fn gemm_s(&self, g: &Gemm) -> Result<f64> {
        for (name, dim) in [("batch", g.batch), ("m", g.m), ("k", g.k), ("n", g.n)] {
            if dim > MAX_GEMM_DIM {
                return Err(Error::InvalidArgument(format!("gemm: {name} = {dim} is above {MAX_GEMM_DIM}")));
            }
        }
        let (input, output) = (dtype(&g.input)?, dtype(&g.output)?);
        // As model.rs prices a plan's GEMM pieces, results written once.
        let one = self.machine.compute.gemm_s(g.m, g.k, g.n, input, output, false);
        if g.batch == 0 {
            return Ok(0.0);
        }
        // A batched dot is one kernel: its fixed cost once, each product's
        // work (`gemm_s` includes the fixed cost, so `one - fixed` >= 0).
        let fixed = self.machine.compute.overhead_s;
        Ok((fixed + g.batch as f64 * (one - fixed)) * self.compute_slowdown)
    }

    /// Seconds to read and write `bytes` once, in one kernel.
    fn memory_s(&self, m: &Memory) -> f64 {
        let c = &self.machine.compute;
        (c.overhead_s + m.bytes as f64 / c.memory_bytes_per_s) * self.compute_slowdown
    }

    /// The ring algorithms' times on the group's bottleneck link.
    fn collective_s(&self, c: &Collective) -> Result<f64> {
        if c.ranks == 0 {
            return Err(Error::InvalidArgument(format!("{}: ranks must be >= 1", c.kind.name())));
        }
        let link = self.machine(c.crosses_nodes, c.kind.name())?.link;
        let (bytes, ranks) = (c.bytes as f64, c.ranks as f64);
        let ring = |bytes: f64| (ranks - 1.0) / ranks * bytes / link.bytes_per_s + (ranks - 1.0) * link.latency_s;
        Ok(match c.kind {
            CollectiveKind::CollectivePermute => bytes / link.bytes_per_s + link.latency_s,
            _ if c.ranks == 1 => 0.0,
            CollectiveKind::AllGather | CollectiveKind::ReduceScatter => ring(bytes),
            CollectiveKind::AllReduce => 2.0 * ring(bytes),
            // Every peer's block straight through the switch.
            CollectiveKind::AllToAll => (ranks - 1.0) / ranks * bytes / link.bytes_per_s + link.latency_s,
        })
    }

    /// The fused op's (time, compute-only, communication-only) seconds under
    /// its schedule (`auto`: the model's pick on this machine).
    fn fused_s(&mut self, f: &Fused) -> Result<FusedTimes> {
        let c = &f.call;
        let key =
            (c.kind, c.schedule, c.ranks, c.dimension, c.x.clone(), c.w.clone(), c.input, c.output, f.crosses_nodes);
        if let Some(&times) = self.fused.get(&key) {
            return Ok(times);
        }
        let (kind, n, _, problem) = c.problem()?;
        let machine = self.machine(f.crosses_nodes, kind.name())?;
        let schedule = match abi::schedule(kind, c.schedule)? {
            Schedule::Auto => model::auto_schedule(&problem, n, machine),
            s => s,
        };
        plan::check_size(kind.name(), schedule, n)?;
        let time = |mode| model::predict(&problem, schedule, n, machine, mode).map(|t| t.makespan);
        let times = (time(Mode::Full)?, time(Mode::ComputeOnly)?, time(Mode::CommOnly)?);
        self.fused.insert(key, times);
        Ok(times)
    }

    /// Simulates `ops` from time 0 on free lanes: the time the last one
    /// ends, what ran added to `tally`, and each op's span into `spans`.
    fn run(&mut self, ops: &[Op], tally: &mut Tally, spans: Option<&mut Vec<Span>>) -> Result<f64> {
        self.run_after(ops, tally, spans, 0.0)
    }

    /// `run`, with the compute lane busy until `compute_busy`.
    fn run_after(
        &mut self,
        ops: &[Op],
        tally: &mut Tally,
        mut spans: Option<&mut Vec<Span>>,
        compute_busy: f64,
    ) -> Result<f64> {
        let (mut compute_free, mut comm_free, mut makespan) = (compute_busy, 0.0f64, compute_busy);
        let mut ends: Vec<f64> = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let mut ready = 0.0f64;
            for &d in &op.deps {
                let end = ends.get(d).ok_or_else(|| {
                    Error::InvalidArgument(format!("op {i} reads op {d}, which is not an earlier op of its list"))
                })?;
                ready = ready.max(*end);
            }
            let both = |ready: f64, compute_free: f64, comm_free: f64| ready.max(compute_free).max(comm_free);
            let (start, end) = match cost(op, i)? {
                Cost::Gemm(g) => {
                    let t = self.gemm_s(g)?;
                    tally.compute_s += t;
                    tally.by_kind.gemm += t;
                    let start = ready.max(compute_free);
                    compute_free = start + t;
                    (start, start + t)
                }
                Cost::Memory(m) => {
                    let t = self.memory_s(m);
                    tally.compute_s += t;
                    tally.by_kind.memory += t;
                    let start = ready.max(compute_free);
                    compute_free = start + t;
                    (start, start + t)
                }
                Cost::Collective(c) => {
                    let t = self.collective_s(c)?;
                    tally.comm_s += t;
                    tally.by_kind.collective += t;
                    let calls = &mut tally.calls[c.kind as usize];
                    calls.count += 1;
                    calls.bytes = calls.bytes.saturating_add(c.bytes);
                    match self.collectives {
                        Collectives::Async => {
                            let start = ready.max(comm_free);
                            comm_free = start + t;
                            (start, start + t)
                        }
                        Collectives::Blocking => {
                            let start = both(ready, compute_free, comm_free);
                            (compute_free, comm_free) = (start + t, start + t);
                            (start, start + t)
                        }
                    }
                }
                Cost::Fused(f) => {
                    if !(f.overhead_s.is_finite() && f.overhead_s >= 0.0) {
                        return Err(Error::InvalidArgument(format!(
                            "op {i}: a fused op's overhead_s must be a non-negative number, got {}",
                            f.overhead_s
                        )));
                    }
                    let (plan_s, compute, comm) = self.fused_s(f)?;
                    let t = plan_s + f.overhead_s;
                    tally.compute_s += compute + f.overhead_s;
                    tally.comm_s += comm;
                    tally.by_kind.fused += t;
                    tally.fused_ops += 1;
                    let start = both(ready, compute_free, comm_free);
                    (compute_free, comm_free) = (start + t, start + t);
                    (start, start + t)
                }
                Cost::Loop(l) => {
                    // An approximation: iterations run back to back, none
                    // overlapping the next, each as long as the body alone.
                    let mut body = Tally::default();
                    let t = self.run(&l.ops, &mut body, None)? * l.trip_count as f64;
                    tally.add(&body, l.trip_count);
                    let start = both(ready, compute_free, comm_free);
                    (compute_free, comm_free) = (start + t, start + t);
                    (start, start + t)
                }
                Cost::Conditional(c) => {
                    let mut costliest: Option<(f64, Tally)> = None;
                    for branch in &c.branches {
                        let mut taken = Tally::default();
                        let t = self.run(branch, &mut taken, None)?;
                        if costliest.as_ref().map_or(true, |(longest, _)| t > *longest) {
                            costliest = Some((t, taken));
                        }
                    }
                    let (t, taken) = costliest.unwrap_or_default();
                    tally.add(&taken, 1);
                    let start = both(ready, compute_free, comm_free);
                    (compute_free, comm_free) = (start + t, start + t);
                    (start, start + t)
                }
            };
            ends.push(end);
            makespan = makespan.max(end);
            if let Some(spans) = spans.as_deref_mut() {
                spans.push(Span { start_s: start, end_s: end });
            }
        }
        Ok(makespan)
    }
}

/// An op's one cost, by kind.
enum Cost<'a> {
    Gemm(&'a Gemm),
    Memory(&'a Memory),
    Collective(&'a Collective),
    Fused(&'a Fused),
    Loop(&'a Loop),
    Conditional(&'a Conditional),
}

/// The one cost op `index` names, or an error saying it must name one.
fn cost(op: &Op, index: usize) -> Result<Cost<'_>> {
    let costs = [
        op.gemm.as_ref().map(Cost::Gemm),
        op.memory.as_ref().map(Cost::Memory),
        op.collective.as_ref().map(Cost::Collective),
        op.fused.as_ref().map(Cost::Fused),
        op.loop_.as_ref().map(Cost::Loop),
        op.conditional.as_ref().map(Cost::Conditional),
    ];
    let mut given = costs.into_iter().flatten();
    match (given.next(), given.next()) {
        (Some(cost), None) => Ok(cost),
        _ => Err(Error::InvalidArgument(format!(
            "op {index} must have exactly one of gemm, memory, collective, fused, loop, conditional"
        ))),
    }
}

/// The dtype of a name as `DType::name` spells it.
fn dtype(name: &str) -> Result<DType> {
    abi::DTYPES.iter().map(|&(d, _)| d).find(|d| d.name() == name).ok_or_else(|| {
        let known: Vec<&str> = abi::DTYPES.iter().map(|&(d, _)| d.name()).collect();
        Error::InvalidArgument(format!("unknown dtype {name:?}; expected one of {}", known.join(", ")))
    })
}

/// The predicted step of one device's program on the request's machine.
pub fn price(request: &Request) -> Result<Priced> {
    let cores = std::thread::available_parallelism().map_or(1, |p| p.get());
    let machine = Machine::from_spec(&request.machine, request.gemm_gflops.filter(|g| *g > 0.0), cores)?;
    let devices = match request.devices {
        Some(0) => return Err(Error::InvalidArgument("devices must be >= 1".into())),
        Some(d) => d as f64,
        None => 1.0,
    };
    let compute_slowdown = machine.shared_processors.map_or(1.0, |p| (devices / p).max(1.0));
    let summary = MachineSummary {
        name: machine.name.clone(),
        devices_per_node: machine.network.map(|n| n.devices_per_node),
        shared_processors: machine.shared_processors,
    };
    let mut pricer = Pricer {
        across_nodes: machine.across_nodes(),
        machine,
        collectives: request.collectives,
        compute_slowdown,
        fused: HashMap::new(),
    };
    let mut tally = Tally::default();
    let mut spans = request.timeline.then(Vec::new);
    // Memory mapped afresh is mapped in as it is first written: memory
    // work of the compute lane, before the ops that write it.
    let fresh_s = request.fresh_bytes as f64 / pricer.machine.compute.touch_bytes_per_s * compute_slowdown;
    tally.compute_s += fresh_s;
    tally.by_kind.memory += fresh_s;
    let total_s = pricer.run_after(&request.ops, &mut tally, spans.as_mut(), fresh_s)?;
    let collective_calls = CollectiveKind::ALL.iter().zip(tally.calls).map(|(k, c)| (k.name(), c)).collect();
    Ok(Priced {
        total_s,
        compute_s: tally.compute_s,
        comm_s: tally.comm_s,
        exposed_comm_s: (total_s - tally.compute_s).max(0.0),
        by_kind: tally.by_kind,
        collective_calls,
        fused_ops: tally.fused_ops,
        machine: summary,
        timeline: spans,
    })
}

/// `price` from and to JSON (the C ABI's `commfuse_price_step`).
pub fn price_json(request: &str) -> Result<String> {
    let request: Request = serde_json::from_str(request)
        .map_err(|e| Error::InvalidArgument(format!("a price request that does not parse: {e}")))?;
    let priced = price(&request)?;
    serde_json::to_string(&priced).map_err(|e| Error::Internal(format!("writing the priced step: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Problem;
    use serde_json::{json, Value};

    fn priced(request: Value) -> Result<Value> {
        price_json(&request.to_string()).map(|text| serde_json::from_str(&text).unwrap())
    }

    fn seconds(v: &Value) -> f64 {
        v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
    }

    fn gemm(deps: &[usize]) -> Value {
        json!({"deps": deps, "gemm": {"batch": 2, "m": 4096, "k": 4096, "n": 4096, "input": "bfloat16",
                                      "output": "bfloat16"}})
    }

    fn all_gather(deps: &[usize], bytes: u64, ranks: usize, crosses_nodes: bool) -> Value {
        json!({"deps": deps, "collective": {"kind": "all-gather", "bytes": bytes, "ranks": ranks,
                                            "crosses_nodes": crosses_nodes}})
    }

    /// One op's time alone on `machine`.
    fn alone(machine: &str, op: Value) -> f64 {
        seconds(&priced(json!({"machine": machine, "ops": [op]})).unwrap()["total_s"])
    }

    #[test]
    fn independent_compute_adds_up_on_the_compute_lane() {
        let machine = Machine::h100_nvlink();
        // Each op is a batch of two products in one kernel.
        let one = machine.compute.gemm_s(4096, 4096, 4096, DType::BF16, DType::BF16, false);
        let g = 2.0 * one - machine.compute.overhead_s;
        let m = machine.compute.overhead_s + 1e9 / machine.compute.memory_bytes_per_s;
        let r = priced(json!({"machine": "h100_nvlink", "timeline": true,
                              "ops": [gemm(&[]), gemm(&[]), {"memory": {"bytes": 1_000_000_000u64}}]}))
        .unwrap();
        assert!(close(seconds(&r["total_s"]), 2.0 * g + m), "{r}");
        assert!(close(seconds(&r["compute_s"]), 2.0 * g + m));
        assert!(close(seconds(&r["by_kind"]["gemm"]), 2.0 * g));
        assert!(close(seconds(&r["by_kind"]["memory"]), m));
        assert_eq!((seconds(&r["comm_s"]), seconds(&r["exposed_comm_s"])), (0.0, 0.0));
        let spans = r["timeline"].as_array().unwrap();
        assert!(close(seconds(&spans[1]["start_s"]), g) && close(seconds(&spans[2]["end_s"]), 2.0 * g + m));
        assert!(priced(json!({"machine": "h100_nvlink", "ops": []})).unwrap()["timeline"].is_null());
    }

    #[test]
    fn an_async_collective_hides_behind_independent_compute_but_not_dependent() {
        let bytes = 1u64 << 30;
        let (g, c) = (alone("h100_nvlink", gemm(&[])), alone("h100_nvlink", all_gather(&[], bytes, 8, false)));
        // The ring formula on NVLink (450 GB/s, 8 us per step).
        assert!(close(c, 7.0 / 8.0 * bytes as f64 / 450e9 + 7.0 * 8e-6), "{c}");
        let ask = |collectives: &str, deps: &[usize]| {
            priced(json!({"machine": "h100_nvlink", "collectives": collectives,
                          "ops": [gemm(&[]), all_gather(deps, bytes, 8, false)]}))
            .unwrap()
        };
        let overlapped = ask("async", &[]);
        assert!(close(seconds(&overlapped["total_s"]), g.max(c)), "{overlapped}");
        assert!(close(seconds(&overlapped["exposed_comm_s"]), (c - g).max(0.0)));
        let dependent = ask("async", &[0]);
        assert!(close(seconds(&dependent["total_s"]), g + c));
        assert!(close(seconds(&dependent["exposed_comm_s"]), c));
        // XLA's CPU runtime: the collective holds the device; nothing overlaps.
        let blocking = ask("blocking", &[]);
        assert!(close(seconds(&blocking["total_s"]), g + c), "{blocking}");
        assert!(close(seconds(&blocking["comm_s"]), c) && close(seconds(&blocking["compute_s"]), g));
        let calls = &blocking["collective_calls"]["all-gather"];
        assert_eq!((calls["count"].as_u64(), calls["bytes"].as_u64()), (Some(1), Some(bytes)));
        assert_eq!(blocking["collective_calls"]["all-reduce"]["count"], 0);
    }

    #[test]
    fn collectives_follow_the_ring_formulas() {
        let (bytes, ranks) = (1u64 << 28, 4usize);
        let time = |kind: &str, ranks: usize| {
            alone("h100_pcie", json!({"collective": {"kind": kind, "bytes": bytes, "ranks": ranks}}))
        };
        let (bw, lat, b) = (64e9, 15e-6, bytes as f64);
        assert!(close(time("reduce-scatter", ranks), 0.75 * b / bw + 3.0 * lat));
        assert!(close(time("all-reduce", ranks), 2.0 * (0.75 * b / bw + 3.0 * lat)));
        assert!(close(time("all-to-all", ranks), 0.75 * b / bw + lat));
        assert!(close(time("collective-permute", 2), b / bw + lat));
        assert_eq!(time("all-gather", 1), 0.0);
        assert!(time("all-gather", 16) > time("all-gather", 8));
    }

    #[test]
    fn a_loop_is_its_body_times_its_trip_count() {
        let body = json!([gemm(&[]), all_gather(&[0], 1 << 26, 8, false)]);
        let once = priced(json!({"machine": "h100_nvlink", "ops": body})).unwrap();
        let looped = priced(json!({"machine": "h100_nvlink",
                                   "ops": [gemm(&[]), {"deps": [0], "loop": {"trip_count": 3, "ops": body}}]}))
        .unwrap();
        let g = alone("h100_nvlink", gemm(&[]));
        assert!(close(seconds(&looped["total_s"]), g + 3.0 * seconds(&once["total_s"])), "{looped}");
        assert!(close(seconds(&looped["by_kind"]["gemm"]), 4.0 * g));
        assert!(close(seconds(&looped["comm_s"]), 3.0 * seconds(&once["comm_s"])));
        assert_eq!(looped["collective_calls"]["all-gather"]["count"], 3);
        assert_eq!(looped["collective_calls"]["all-gather"]["bytes"], 3u64 << 26);
        let never = priced(json!({"machine": "h100_nvlink", "ops": [{"loop": {"trip_count": 0, "ops": body}}]}));
        assert_eq!(seconds(&never.unwrap()["total_s"]), 0.0);
    }

    #[test]
    fn a_conditional_costs_its_costliest_branch() {
        let r = priced(json!({"machine": "h100_nvlink", "ops": [{"conditional": {"branches": [
            [gemm(&[])], [gemm(&[]), gemm(&[0])], []]}}]}))
        .unwrap();
        let g = alone("h100_nvlink", gemm(&[]));
        assert!(close(seconds(&r["total_s"]), 2.0 * g) && close(seconds(&r["by_kind"]["gemm"]), 2.0 * g), "{r}");
    }

    /// The call `_abi.call_shapes` writes for all_gather_matmul of bf16 x
    /// [1024, 8192] and w [8192, 3584] over 8 ranks under `schedule`.
    fn call(schedule: i64) -> Value {
        json!({"kind": 0, "schedule": schedule, "ranks": 8, "dimension": 0, "x": [1024, 8192], "w": [8192, 3584],
               "input": 16, "output": 16})
    }

    #[test]
    fn a_fused_op_costs_what_the_model_predicts_for_its_schedule() {
        let shapes: CallShapes = serde_json::from_value(call(1)).unwrap();
        let (_, n, _, problem): (_, usize, _, Problem) = shapes.problem().unwrap();
        for (machine, spec) in [(Machine::h100_nvlink(), "h100_nvlink"), (Machine::h100_pcie(), "h100_pcie")] {
            let predict = |schedule, mode| model::predict(&problem, schedule, n, &machine, mode).unwrap().makespan;
            let r = priced(json!({"machine": spec, "ops": [{"fused": {"call": call(1)}}]})).unwrap();
            assert!(close(seconds(&r["total_s"]), predict(Schedule::Ring, Mode::Full)), "{r}");
            assert!(close(seconds(&r["by_kind"]["fused"]), seconds(&r["total_s"])));
            assert!(close(seconds(&r["compute_s"]), predict(Schedule::Ring, Mode::ComputeOnly)));
            assert!(close(seconds(&r["comm_s"]), predict(Schedule::Ring, Mode::CommOnly)));
            assert_eq!(r["fused_ops"], 1);
            // `auto` runs the model's pick on the machine priced.
            let auto = priced(json!({"machine": spec, "ops": [{"fused": {"call": call(0)}}]})).unwrap();
            let pick = model::auto_schedule(&problem, n, &machine);
            assert!(close(seconds(&auto["total_s"]), predict(pick, Mode::Full)), "{auto}");
        }
        // Two of the same call are priced once and counted twice; the second waits for both lanes.
        let twice = priced(json!({"machine": "h100_nvlink", "ops": [{"fused": {"call": call(1)}},
                                                                     {"fused": {"call": call(1)}}]}))
        .unwrap();
        assert_eq!(twice["fused_ops"], 2);
        assert!(close(seconds(&twice["total_s"]), 2.0 * alone("h100_nvlink", json!({"fused": {"call": call(1)}}))));
    }

    #[test]
    fn crossing_nodes_is_slower_and_needs_a_network() {
        let (inside, across) = (
            alone("h100_cluster", all_gather(&[], 1 << 28, 16, false)),
            alone("h100_cluster", all_gather(&[], 1 << 28, 16, true)),
        );
        assert!(across > 5.0 * inside, "{inside} vs {across}");
        let fused =
            |crosses: bool| alone("h100_cluster", json!({"fused": {"call": call(1), "crosses_nodes": crosses}}));
        assert!(fused(true) > fused(false));
        assert!(close(fused(false), alone("h100_nvlink", json!({"fused": {"call": call(1)}}))));
        // Any machine gets a network from its spec.
        let slow = alone("h100_nvlink:gpus_per_node=4,net_gbytes_per_s=10", all_gather(&[], 1 << 28, 16, true));
        assert!(slow > across);
        for op in [all_gather(&[], 8, 2, true), json!({"fused": {"call": call(1), "crosses_nodes": true}})] {
            let e = priced(json!({"machine": "h100_nvlink", "ops": [op]})).unwrap_err().to_string();
            assert!(e.contains("crosses nodes") && e.contains("gpus_per_node"), "{e}");
        }
    }

    #[test]
    fn devices_sharing_processors_share_their_speed() {
        let one = alone("cpu_here:gemm_gflops=10", gemm(&[]));
        let cores = std::thread::available_parallelism().map_or(1, |p| p.get()) as f64;
        let shared = priced(json!({"machine": "cpu_here:gemm_gflops=10", "devices": 64, "ops": [gemm(&[])]}));
        assert!(close(seconds(&shared.unwrap()["total_s"]), one * (64.0 / cores).max(1.0)));
        // A GPU per device shares nothing.
        let gpu = priced(json!({"machine": "h100_nvlink", "devices": 64, "ops": [gemm(&[])]})).unwrap();
        assert!(close(seconds(&gpu["total_s"]), alone("h100_nvlink", gemm(&[]))));
    }

    #[test]
    fn a_batched_dot_pays_its_fixed_cost_once() {
        let product = |batch: usize| {
            json!({"deps": [], "gemm": {"batch": batch, "m": 64, "k": 16, "n": 64, "input": "float32",
                                          "output": "float32"}})
        };
        for machine in ["cpu_here:gemm_gflops=10", "h100_nvlink"] {
            let (one, many) = (alone(machine, product(1)), alone(machine, product(32)));
            let fixed = Machine::from_spec(machine, None, 1).unwrap().compute.overhead_s;
            assert!(fixed > 0.0 && close(many, fixed + 32.0 * (one - fixed)), "{machine}: {one} {many}");
        }
    }

    #[test]
    fn fresh_memory_is_first_written_at_the_touch_rate_before_the_ops() {
        let machine = "cpu_here:gemm_gflops=10,touch_gbytes_per_s=2";
        let ops = alone(machine, gemm(&[]));
        let answer = priced(json!({"machine": machine, "fresh_bytes": 4_000_000_000u64, "ops": [gemm(&[])]})).unwrap();
        // 4 GB at 2 GB/s on the compute lane, then the GEMM after it.
        assert!(close(seconds(&answer["total_s"]), 2.0 + ops));
        assert!(close(seconds(&answer["by_kind"]["memory"]), 2.0));
        // A preset maps nothing afresh; a rate of 0 says there is nothing to pay.
        for machine in ["cpu_here:gemm_gflops=10", "h100_nvlink", "cpu_here:gemm_gflops=10,touch_gbytes_per_s=0"] {
            let fresh = json!({"machine": machine, "fresh_bytes": 4_000_000_000u64, "ops": [gemm(&[])]});
            assert!(close(seconds(&priced(fresh).unwrap()["total_s"]), alone(machine, gemm(&[]))));
        }
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let message = |request: Value| priced(request).unwrap_err().to_string();
        assert!(price_json("{").unwrap_err().to_string().contains("does not parse"));
        let m = "h100_nvlink";
        let cases = [
            (json!({"machine": m, "ops": [], "typo": 1}), "unknown field"),
            (json!({"ops": []}), "missing field `machine`"),
            (json!({"machine": "tpu", "ops": []}), "unknown machine"),
            (json!({"machine": m, "collectives": "sometimes", "ops": []}), "unknown variant"),
            (json!({"machine": m, "devices": 0, "ops": []}), "devices"),
            (json!({"machine": m, "ops": [{}]}), "exactly one of"),
            (json!({"machine": m, "ops": [{"memory": {"bytes": 1}, "gemm": gemm(&[])["gemm"]}]}), "exactly one of"),
            (json!({"machine": m, "ops": [{"deps": [0], "memory": {"bytes": 1}}]}), "not an earlier op"),
            (json!({"machine": m, "ops": [{"memory": {"bytes": -1}}]}), "invalid value"),
            (
                json!({"machine": m, "ops": [{"gemm": {"batch": 1, "m": 1, "k": 1, "n": 1, "input": "int8",
                                                    "output": "float32"}}]}),
                "unknown dtype \"int8\"",
            ),
            (
                json!({"machine": m, "ops": [{"gemm": {"batch": 1, "m": 1u64 << 40, "k": 1, "n": 1, "input": "float32",
                                                    "output": "float32"}}]}),
                "above",
            ),
            (json!({"machine": m, "ops": [{"collective": {"kind": "all-gather", "bytes": 1, "ranks": 0}}]}), "ranks"),
            (
                json!({"machine": m, "ops": [{"collective": {"kind": "broadcast", "bytes": 1, "ranks": 2}}]}),
                "unknown variant",
            ),
            (
                json!({"machine": m, "ops": [{"fused": {"call": {"kind": 0, "schedule": 6, "ranks": 8, "dimension": 0,
                    "x": [8, 8], "w": [8, 8], "input": 11, "output": 11}}}]}),
                "never reaches the library",
            ),
            (
                json!({"machine": m, "ops": [{"fused": {"call": {"kind": 0, "schedule": 1, "ranks": 8, "dimension": 0,
                    "x": [8, 8], "w": [9, 8], "input": 11, "output": 11}}}]}),
                "`w` must be",
            ),
            (
                json!({"machine": m, "ops": [{"loop": {"trip_count": 2, "ops": [{"deps": [1], "memory": {"bytes": 1}}]}}]}),
                "not an earlier op",
            ),
        ];
        for (request, want) in cases {
            let got = message(request.clone());
            assert!(got.contains(want), "{request}: {got}");
        }
        // Huge trip counts saturate the counts rather than overflow.
        let body = json!([all_gather(&[], u64::MAX, 2, false)]);
        let r = priced(json!({"machine": m, "ops": [{"loop": {"trip_count": u64::MAX, "ops": body}}]})).unwrap();
        assert_eq!(r["collective_calls"]["all-gather"]["bytes"], u64::MAX);
    }

    #[test]
    fn a_fused_ops_fixed_cost_adds_to_its_plan() {
        let op = |overhead: f64| json!({"fused": {"call": call(1), "overhead_s": overhead}});
        let plain = priced(json!({"machine": "h100_nvlink", "ops": [op(0.0)]})).unwrap();
        let with = priced(json!({"machine": "h100_nvlink", "ops": [op(1e-3)]})).unwrap();
        let gap = with["total_s"].as_f64().unwrap() - plain["total_s"].as_f64().unwrap();
        assert!((gap - 1e-3).abs() < 1e-12, "{gap}");
        let e = priced(json!({"machine": "h100_nvlink", "ops": [op(-1.0)]})).unwrap_err().to_string();
        assert!(e.contains("overhead_s"), "{e}");
    }

    #[test]
    fn the_cluster_preset_and_the_network_keys() {
        let cluster = Machine::from_spec("h100_cluster", None, 2).unwrap();
        assert_eq!(cluster.network.map(|n| n.devices_per_node), Some(8));
        assert_eq!(cluster.network.map(|n| n.link.bytes_per_s), Some(50e9));
        assert_eq!(Machine { network: None, name: "h100_nvlink".into(), ..cluster.clone() }, Machine::h100_nvlink());
        let m =
            Machine::from_spec("h100_cluster:net_latency_us=3,gpus_per_node=4,net_gbytes_per_s=25", None, 2).unwrap();
        let net = m.network.unwrap();
        assert_eq!((net.devices_per_node, net.link.bytes_per_s), (4, 25e9));
        assert!((net.link.latency_s - 3e-6).abs() < 1e-15);
        assert_eq!(m.across_nodes().unwrap().link, net.link);
        assert!(Machine::h100_nvlink().across_nodes().is_none());
        let summary = |spec: &str| priced(json!({"machine": spec, "ops": []})).unwrap()["machine"].clone();
        assert_eq!(
            summary("h100_cluster"),
            json!({"name": "h100_cluster", "devices_per_node": 8, "shared_processors": null})
        );
        let cores = std::thread::available_parallelism().map_or(1, |p| p.get()) as f64;
        assert_eq!(summary("cpu_here")["shared_processors"], cores);
        assert_eq!(summary("cpu_here:gpus_per_node=2")["devices_per_node"], 2);
        assert!(summary("h100_nvlink")["devices_per_node"].is_null());
        let e = Machine::from_spec("h100_nvlink:net_gbytes_per_s=25", None, 2).unwrap_err().to_string();
        assert!(e.contains("gpus_per_node"), "{e}");
        let e = Machine::from_spec("h100_nvlink:gpus_per_node=0", None, 2).unwrap_err().to_string();
        assert!(e.contains("whole number"), "{e}");
        let e = Machine::from_spec("h100_nvlink:nodes=2", None, 2).unwrap_err().to_string();
        assert!(e.contains("net_latency_us") && e.contains("across_nodes"), "{e}");
        // `across_nodes=1`: the machine a group spanning nodes sees, its link the network's.
        let across = Machine::from_spec("h100_cluster:across_nodes=1", None, 2).unwrap();
        assert_eq!(across.link, cluster.network.unwrap().link);
        assert_eq!(across, cluster.across_nodes().unwrap());
        assert_eq!(Machine::from_spec("h100_cluster:across_nodes=0", None, 2).unwrap(), cluster);
        let e = Machine::from_spec("h100_nvlink:across_nodes=1", None, 2).unwrap_err().to_string();
        assert!(e.contains("gpus_per_node"), "{e}");
        let e = Machine::from_spec("h100_cluster:across_nodes=yes", None, 2).unwrap_err().to_string();
        assert!(e.contains("1 or 0"), "{e}");
    }
}
