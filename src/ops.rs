//! The body of each fused op's handler: decode the call, check it, plan it,
//! meet the peers and run.
#![forbid(unsafe_code)]

use crate::backend::cpu::{self, transport};
use crate::comm::Group;
use crate::error::{Error, Result};
use crate::plan::{self, OpKind, Schedule, Workspace};
use crate::problem::{Operand, Problem};
use crate::xla::Frame;
use std::time::Instant;

pub fn all_gather_matmul_cpu(frame: &mut Frame<'_>) -> Result<()> {
    run_cpu(OpKind::AllGatherMatmul, frame)
}

pub fn matmul_reduce_scatter_cpu(frame: &mut Frame<'_>) -> Result<()> {
    run_cpu(OpKind::MatmulReduceScatter, frame)
}

fn run_cpu(op: OpKind, frame: &mut Frame<'_>) -> Result<()> {
    let start = Instant::now();
    let x = frame.arg(0, "x")?;
    let w = frame.arg(1, "w")?;
    let out = frame.take_ret(0, "out")?;
    let workspace = frame.ret_bytes(1, "workspace")?;

    let site = frame.attr_i64("site")?;
    let code = frame.attr_i64("schedule")?;
    let schedule = Schedule::from_code(code)
        .ok_or_else(|| Error::InvalidArgument(format!("{}: unknown schedule code {code}", op.name())))?;
    let device = i64::from(frame.device_ordinal()?);
    let group = Group::from_mesh(
        frame.attr_i64_array("mesh_devices")?,
        frame.attr_i64_array("mesh_shape")?,
        frame.attr_i64_array("axes")?,
        device,
    )?;
    let operand = |dims, dtype| Operand { dims, dtype };
    let problem = Problem::new(
        op,
        operand(x.dims, x.dtype),
        operand(w.dims, w.dtype),
        operand(out.dims, out.dtype),
        frame.attr_i64("dimension")?,
        group.size(),
    )?;
    let plan = plan::plan(op, schedule, group.size(), group.rank);
    let timeout = crate::config::timeout()?;

    let run = frame.run_id()?;
    let key = transport::SessionKey {
        sequence: transport::next_sequence(device, site, run),
        group: group.devices.clone(),
        site,
        run,
    };
    let endpoint = transport::Endpoint::join(key, transport::CallInfo { op: op.name(), rank: group.rank, timeout });
    let buffers = cpu::Buffers { x: x.data, w: w.data, out: out.data, workspace };
    cpu::run(&problem, &plan, buffers, &endpoint, start + timeout)
}

/// Workspace bytes a call needs; Python asks at trace time.
pub fn workspace_bytes(op: OpKind, schedule: Schedule, ranks: usize, dims: &plan::Dims) -> usize {
    // Every rank's plan uses the same slots; rank 0 stands for all.
    Workspace::layout(&plan::plan(op, schedule, ranks, 0), dims).total
}
