//! One XLA call of a fused op, decoded once from its frame for either
//! backend: the op, its schedule, the group, the problem and this rank's
//! plan, and the deadline settings as they are when the call runs. Each
//! backend's handler (`backend::cpu::handler`, `backend::cuda::handler`)
//! reads its buffers and calls `Call::decode`.
#![forbid(unsafe_code)]

use crate::abi;
use crate::dtype::DType;
use crate::error::Result;
use crate::group::Group;
use crate::plan::{self, Plan, Schedule};
use crate::problem::{OpKind, Operand, Problem};
use crate::xla::Frame;
use std::time::{Duration, Instant};

pub struct Call {
    pub kind: OpKind,
    /// The call site (the lowering's `site` attribute).
    pub site: i64,
    pub schedule: Schedule,
    pub group: Group,
    /// The problem as the schedule cuts it, and this rank's plan.
    pub problem: Problem,
    pub plan: Plan,
    /// How long a wait may go without progress (`config::timeout`).
    pub timeout: Duration,
    /// When XLA called the handler: host waits that have no progress to
    /// count (creating a group's communicators) end at `deadline()`.
    pub started: Instant,
    /// `config::interrupts()` when XLA called the handler.
    pub interrupts: u64,
}

impl Call {
    /// Decodes the attributes of `frame` for operands `x`, `w` and result
    /// `out` (dims and dtype, as the backend read them), with `device` this
    /// call's device id in the mesh.
    pub fn decode(frame: &Frame<'_>, [x, w, out]: [(&[i64], DType); 3], device: i64) -> Result<Call> {
        let started = Instant::now();
        let interrupts = crate::config::interrupts();
        let kind = abi::kind(frame.attr_i64("kind")?)?;
        let site = frame.attr_i64("site")?;
        let schedule = abi::schedule(kind, frame.attr_i64("schedule")?)?;
        let group = Group::from_mesh(
            frame.attr_i64_array("mesh_devices")?,
            frame.attr_i64_array("mesh_shape")?,
            frame.attr_i64_array("axes")?,
            device,
        )?;
        let (problem, plan) = problem_and_plan(kind, schedule, [x, w, out], frame.attr_i64("dimension")?, &group)?;
        Ok(Call { kind, site, schedule, group, problem, plan, timeout: crate::config::timeout()?, started, interrupts })
    }

    /// The user's names of operands 0 and 1 of `frame`'s call (see
    /// `OpKind::operand_names`), for errors about its buffers.
    pub fn operand_names(frame: &Frame<'_>) -> [&'static str; 2] {
        let kind = frame.attr_i64("kind").and_then(abi::kind);
        kind.map_or(["x", "w"], OpKind::operand_names)
    }

    pub fn deadline(&self) -> Instant {
        self.started + self.timeout
    }
}

/// The problem one call describes (operands x, w, out as (dims, dtype)), cut
/// as `schedule` cuts it, and the plan of `group`'s rank; the plan's size
/// checked before it is made.
pub fn problem_and_plan(
    kind: OpKind,
    schedule: Schedule,
    [x, w, out]: [(&[i64], DType); 3],
    dimension: i64,
    group: &Group,
) -> Result<(Problem, Plan)> {
    let operand = |(dims, dtype)| Operand { dims, dtype };
    plan::check_size(kind.name(), schedule, group.size())?;
    let problem = Problem::new(kind, operand(x), operand(w), operand(out), dimension, group.size())?;
    let problem = problem.for_schedule(schedule)?;
    Ok((problem, plan::plan(kind.pattern(), schedule, group.size(), group.rank)))
}
