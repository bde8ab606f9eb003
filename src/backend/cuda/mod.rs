//! The CUDA backend (`--features cuda`): the CUDA libraries are opened at
//! run time (`libs`: the copy JAX mapped, else a standard install's) and
//! called through the project's function tables over cudarc's generated
//! types (`api`), so the crate builds and its logic is tested where CUDA is
//! absent.
//!
//! It shares the plans, the GEMM geometry and the stream ordering with the
//! CPU path: `exec::stream` turns a plan into per-stream commands, `issue`
//! forks lanes off XLA's stream and joins them back, `gemm` runs each
//! `Problem::gemms` view with cuBLAS on XLA's buffers (`lt`: fp8 GEMMs with
//! cuBLASLt, for fp8 operands with their two scale operands), `nccl` posts each
//! exchange as one group, `comms` keys and caches communicators and maps
//! groups spanning processes (placement, exchanged unique ids), `kernels`
//! compiles `kernels/` with NVRTC to CUBIN for each device, loaded at the
//! handler's INITIALIZE stage, before any execution.
//!
//! `calls` maps a call's plan buffers onto XLA's device addresses (pure,
//! tested without a device) and `device` drives the driver, cuBLAS, the
//! kernels and NCCL with them. `watchdog` bounds the device side: a call
//! whose communication never finishes on the device has its communicators
//! aborted, and its device's next call fails. What still needs a GPU to be
//! verified, and what is missing, is in GPU.md.
#![deny(unsafe_code)]

#[allow(unsafe_code)]
pub mod api;
pub mod calls;
pub mod comms;
#[allow(unsafe_code)]
pub mod device;
#[cfg(test)]
mod emulate;
#[allow(unsafe_code)]
pub mod gemm;
pub mod issue;
#[allow(unsafe_code)]
pub mod kernels;
#[allow(unsafe_code)]
pub mod libs;
#[allow(unsafe_code)]
pub mod lt;
#[allow(unsafe_code)]
pub mod nccl;
pub mod watchdog;

use crate::comm::Group;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::stream::StreamSchedule;
use crate::plan::{Action, Workspace};
use crate::xla::{Frame, Stage};
use api::require;
use calls::{DeviceBuffers, Region, Resolver};
use comms::{CommKey, Placement};
use device::{CallOps, CallWatch};
use libs::Lib;
use std::time::Instant;

/// The optional placement attributes of a mesh spanning processes (see
/// `comms::Placement`); absent in a single process.
fn placement<'a>(frame: &Frame<'a>) -> Result<Placement<'a>> {
    let optional = |name| if frame.has_attr(name) { frame.attr_i64_array(name).map(Some) } else { Ok(None) };
    Ok(Placement {
        local_ordinals: optional("local_ordinals")?,
        groups: optional("nccl_groups")?.unwrap_or(&[]),
        ids: optional("nccl_ids")?.unwrap_or(&[]),
    })
}

/// The device addresses of an fp8 call's `x_scale` and `w_scale` operands
/// (2 and 3): float32 scalars, read by the GEMM on the device.
fn scales(frame: &Frame<'_>) -> Result<(u64, u64)> {
    let scalar = |i, name| {
        let b = frame.device_arg(i, name)?;
        if b.dtype != DType::F32 || !b.dims.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "operand `{name}` must be a float32 scalar (shape ()), got {} of shape {:?}",
                b.dtype.name(),
                b.dims
            )));
        }
        Ok(b.addr)
    };
    Ok((scalar(2, "x_scale")?, scalar(3, "w_scale")?))
}

/// The part of an fp8 call's workspace its cuBLASLt GEMMs may use, after the
/// plan's buffers (`ops::workspace_bytes` sized it).
fn fp8_workspace(layout: &Workspace, addr: u64, bytes: usize) -> Result<(u64, usize)> {
    let offset = crate::ops::fp8_gemm_workspace_offset(layout.total);
    let need = offset + crate::ops::FP8_GEMM_WORKSPACE_BYTES;
    if bytes < need {
        return Err(Error::InvalidArgument(format!(
            "`workspace` has {bytes} bytes; an fp8 call needs {need} (its plan's buffers and the GEMMs' workspace)"
        )));
    }
    Ok((addr + offset as u64, crate::ops::FP8_GEMM_WORKSPACE_BYTES))
}

/// A fresh NCCL unique id for the lowering of a group spanning processes
/// (`commfuse_nccl_unique_id`); UNIMPLEMENTED when NCCL cannot be loaded.
pub fn nccl_unique_id() -> Result<[u8; comms::NCCL_ID_BYTES]> {
    require(&[Lib::Nccl])?;
    device::unique_id()
}

/// The CUDA handler's body for both stages it runs in. INITIALIZE runs on
/// every device before the executable's thunks, in their program order, as
/// XLA sets up its own collectives' communicators: it sets up the device of
/// XLA's stream (streams; the kernels compiled to CUBIN and loaded, as
/// `cuModuleLoadData` takes a process-wide lock that must not be taken
/// while work may run on other devices) and, for an op that communicates,
/// creates its group's communicators and connects them to every peer, the
/// host waits that need the peers to be there too. EXECUTE then only
/// enqueues work: no host wait for a peer, which could be blocked in
/// something waiting for this device.
pub fn handler(frame: &mut Frame<'_>) -> Result<()> {
    match frame.stage() {
        Stage::Initialize => initialize(frame),
        Stage::Execute => collective_matmul(frame),
    }
}

/// The call's group, with its placement, and this device's XLA ordinal.
fn group_of<'a>(frame: &Frame<'a>) -> Result<(Group, Placement<'a>, &'a [i64], i32)> {
    let ordinal = frame.device_ordinal()?;
    let mesh_devices = frame.attr_i64_array("mesh_devices")?;
    let placement = placement(frame)?;
    let device = placement.my_device(mesh_devices, ordinal)?;
    let group =
        Group::from_mesh(mesh_devices, frame.attr_i64_array("mesh_shape")?, frame.attr_i64_array("axes")?, device)?;
    Ok((group, placement, mesh_devices, ordinal))
}

/// The group's communicators (created on first use: a host wait for every
/// member in this process, and for the others through NCCL's bootstrap).
fn communicators(
    group: &Group,
    placement: &Placement<'_>,
    mesh_devices: &[i64],
    ordinal: i32,
    dev: &std::sync::Mutex<device::Device>,
    deadline: Instant,
) -> Result<std::sync::Arc<device::GroupComms>> {
    let key = CommKey::of(group);
    let d = dev.lock().unwrap_or_else(|e| e.into_inner());
    calls::check_same_device(ordinal, d.ordinal)?;
    let members = placement.members(mesh_devices, &key, device::device_count()?)?;
    let id = if members.iter().all(Option::is_some) { None } else { Some(placement.id(&key)?) };
    device::group_comms(&key, &members, id.as_ref(), &d, deadline)
}

/// The INITIALIZE stage (see `handler`).
fn initialize(frame: &mut Frame<'_>) -> Result<()> {
    let start = Instant::now();
    require(&[Lib::Driver, Lib::Nvrtc])?;
    let stream = frame.stream()?;
    let dev = device::bind(stream)?;
    let (group, placement, mesh_devices, ordinal) = group_of(frame)?;
    if group.devices.len() < 2 {
        return Ok(());
    }
    require(&[Lib::Nccl])?;
    let deadline = start + crate::config::timeout()?;
    let comms = communicators(&group, &placement, mesh_devices, ordinal, &dev, deadline)?;
    let mut d = dev.lock().unwrap_or_else(|e| e.into_inner());
    let connected = comms.connect(group.rank, &mut d, stream, deadline);
    if connected.is_err() {
        comms.abort_rank(group.rank);
        device::evict(&CommKey::of(&group), &comms);
    }
    connected
}

/// One device's call of a fused op on a GPU: the same checks, problem and
/// plan as the CPU path, then the plan's stream schedule enqueued on the
/// device's streams, forked from and joined back to XLA's stream. Returns
/// once everything is enqueued (no host synchronisation).
pub fn collective_matmul(frame: &mut Frame<'_>) -> Result<()> {
    let start = Instant::now();
    let kind = crate::ops::kind(frame.attr_i64("kind")?)?;
    let site = frame.attr_i64("site")?;
    let schedule = crate::ops::schedule(kind, frame.attr_i64("schedule")?)?;
    let (group, placement, mesh_devices, ordinal) = group_of(frame)?;
    require(&[Lib::Driver, Lib::Cublas, Lib::Nccl, Lib::Nvrtc])?;

    let x = frame.device_arg(0, "x")?;
    let w = frame.device_arg(1, "w")?;
    if x.dtype.is_fp8() {
        require(&[Lib::CublasLt])?;
    }
    let out = frame.device_ret(0, "out")?;
    let workspace = frame.device_ret_bytes(1, "workspace")?;
    let operands = [(x.dims, x.dtype), (w.dims, w.dtype), (out.dims, out.dtype)];
    let (problem, plan) = crate::ops::problem_and_plan(kind, schedule, operands, frame.attr_i64("dimension")?, &group)?;
    if problem.is_trivial() {
        // Nothing to multiply or move (every rank skips alike): zeros, as
        // jax.lax gives for an empty contraction.
        let stream = frame.stream()?;
        let dev = device::bind_for_execute(stream)?;
        return device::zero_result(&dev.lock().unwrap_or_else(|e| e.into_inner()), &out, stream);
    }
    let layout = Workspace::layout(&plan, &problem.sizes())?;
    let fp8_workspace =
        x.dtype.is_fp8().then(|| fp8_workspace(&layout, workspace.addr, workspace.bytes)).transpose()?;
    let region = |addr, bytes, dtype| Region { addr, bytes, dtype };
    let buffers = DeviceBuffers {
        x: region(x.addr, x.bytes, x.dtype),
        w: region(w.addr, w.bytes, w.dtype),
        out: region(out.addr, out.bytes, out.dtype),
        workspace: (workspace.addr, workspace.bytes),
        scales: if x.dtype.is_fp8() { Some(scales(frame)?) } else { None },
    };
    let resolver = Resolver::new(&problem, &layout, &plan.slots, buffers)?;
    let streams = StreamSchedule::new(&plan);
    let timeout = crate::config::timeout()?;
    let deadline = start + timeout;

    let xla_stream = frame.stream()?;
    let dev = device::bind_for_execute(xla_stream)?;
    // An earlier call on this device that timed out on the device (see
    // `watchdog`) fails this one before it touches the group again.
    device::check_device_timeouts(dev.lock().unwrap_or_else(|e| e.into_inner()).ordinal)?;
    // Communicators first (their creation takes the group's lock and sets
    // other devices' contexts), then this device's lock for the enqueueing.
    let exchanges = plan.steps.iter().any(|s| matches!(s.action, Action::Exchange { .. }));
    let key = CommKey::of(&group);
    let comms =
        exchanges.then(|| communicators(&group, &placement, mesh_devices, ordinal, &dev, deadline)).transpose()?;
    let mut d = dev.lock().unwrap_or_else(|e| e.into_inner());
    CallOps::prepare(&mut d, issue::events_needed(&streams))?;
    // Calls that communicate are watched until their work finishes on the
    // device: a peer that never arrives would leave the stream stalled.
    let marks = issue::marks_needed(&streams, watchdog::MAX_MARKS);
    let watch = comms.as_ref().map(|c| CallWatch::begin(&d, xla_stream, c, marks)).transpose()?;
    let mut ops = CallOps {
        device: &mut d,
        xla: xla_stream,
        lanes: streams.lanes.iter().map(|&l| CallOps::lane_stream(l)).collect(),
        resolver: &resolver,
        comm: comms.as_ref().map(|c| c.rank(group.rank)).transpose()?,
        deadline,
        comm_failed: false,
        tf32: frame.has_attr("tf32") && frame.attr_i64("tf32")? != 0,
        fp8_workspace,
        watch: watch.as_ref(),
    };
    let marked = if watch.is_some() { marks } else { 0 };
    let result = issue::issue(&plan, &streams, &mut ops, marked);
    let comm_failed = ops.comm_failed;
    drop(ops);
    let result = match (result, watch) {
        (Ok(()), Some(w)) => w.submit(xla_stream, kind.name(), site, group.rank, timeout),
        (Err(e), Some(w)) => {
            w.cancel();
            Err(e)
        }
        (result, None) => result,
    };
    if let Some(c) = comms.as_ref().filter(|_| comm_failed) {
        c.abort_rank(group.rank);
        device::evict(&key, c);
    }
    result.map_err(|e| match e {
        Error::DeadlineExceeded(m) => {
            Error::DeadlineExceeded(format!("{} (rank {} of group {:?}): {m}", kind.name(), group.rank, group.devices))
        }
        other => other,
    })
}
