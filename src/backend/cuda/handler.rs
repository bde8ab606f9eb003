//! The CUDA handler's body for both stages it runs in. INITIALIZE runs on
//! every device before the executable's thunks, in their program order, as
//! XLA sets up its own collectives' communicators: it sets up the device of
//! XLA's stream (streams; the kernels compiled to CUBIN and loaded, as
//! `cuModuleLoadData` takes a process-wide lock that must not be taken
//! while work may run on other devices) and, for an op that communicates,
//! creates its group's communicators and connects them to every peer, the
//! host waits that need the peers to be there too. EXECUTE then only
//! enqueues work: no host wait for a peer, which could be blocked in
//! something waiting for this device.
#![forbid(unsafe_code)]

use super::addresses::{DeviceBuffers, Region};
use super::api::require;
use super::communicators::{CommKey, Placement};
use super::copies::CallId;
use super::copy_links::{self, Chosen};
use super::device;
use super::device_watch::{self, CallWatch};
use super::driver::{CallMemory, CallStream};
use super::enqueue::{CallOps, Exchanges};
use super::libs::Lib;
use super::nccl_group::{self, GroupComms};
use super::site_ops::SiteOps;
use super::{addresses, communicators, stream_issue};
use crate::call::{Call, CallSite};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::Observer;
use crate::group::Group;
use crate::trace::{CallLabel, Recording};
use crate::xla::{Frame, Stage};
use std::time::Instant;

/// The optional placement attributes of a mesh spanning processes (see
/// `communicators::Placement`); absent in a single process.
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

/// A fresh NCCL unique id for the lowering of a group spanning processes
/// (`commfuse_nccl_unique_id`); UNIMPLEMENTED when NCCL cannot be loaded.
pub fn nccl_unique_id() -> Result<[u8; communicators::NCCL_ID_BYTES]> {
    require(&[Lib::Nccl])?;
    nccl_group::unique_id()
}

/// Both stages (see the module's doc).
pub fn handler(frame: &mut Frame<'_>) -> Result<()> {
    match frame.stage() {
        Stage::Instantiate => crate::call::instantiate(frame),
        Stage::Prepare => Err(Error::Internal("the CUDA handler is registered without a PREPARE stage".into())),
        Stage::Initialize => initialize(frame),
        Stage::Execute => collective_matmul(frame),
    }
}

/// This call's device id in the mesh (the process's devices are placed in
/// it by `placement`), its placement, the mesh's device ids, and this
/// device's XLA ordinal.
fn placed<'a>(frame: &Frame<'a>) -> Result<(i64, Placement<'a>, &'a [i64], i32)> {
    let ordinal = frame.device_ordinal()?;
    let mesh_devices = frame.attr_i64_array("mesh_devices")?;
    let placement = placement(frame)?;
    let device = placement.my_device(mesh_devices, ordinal)?;
    Ok((device, placement, mesh_devices, ordinal))
}

/// The group's members: each one's CUDA ordinal in this process, `None`
/// for another process's.
fn members_of(group: &Group, placement: &Placement<'_>, mesh_devices: &[i64]) -> Result<Vec<Option<i32>>> {
    placement.members(mesh_devices, &CommKey::of(group), device::device_count()?)
}

/// The transport of the group `key` (members `members`): chosen at the
/// INITIALIZE stage and kept, so that every rank of a launch takes the same
/// one even if the setting changes while it runs; an EXECUTE call takes the
/// kept one (deciding only if INITIALIZE never ran).
fn transport_of(key: &CommKey, members: impl FnOnce() -> Result<Vec<Option<i32>>>, decide: bool) -> Result<Chosen> {
    match copy_links::decided(key) {
        Some(chosen) if !decide => Ok(chosen),
        _ => copy_links::decide(key, crate::config::transport()?, &members()?),
    }
}

/// The group's communicators (created on first use: a host wait for every
/// member in this process, and for the others through NCCL's bootstrap).
fn communicators(
    group: &Group,
    placement: &Placement<'_>,
    members: &[Option<i32>],
    ordinal: i32,
    dev: &std::sync::Mutex<device::Device>,
    deadline: Instant,
) -> Result<std::sync::Arc<GroupComms>> {
    let key = CommKey::of(group);
    let d = crate::sync::lock(dev);
    addresses::check_same_device(ordinal, d.ordinal)?;
    let id = if members.iter().all(Option::is_some) { None } else { Some(placement.id(&key)?) };
    nccl_group::group_comms(&key, members, id.as_ref(), &d, deadline)
}

/// The INITIALIZE stage (see `handler`).
fn initialize(frame: &mut Frame<'_>) -> Result<()> {
    let start = Instant::now();
    require(&[Lib::Driver, Lib::Nvrtc])?;
    let stream = CallStream::of(frame)?;
    let dev = device::bind(&stream)?;
    let (device, placement, mesh_devices, ordinal) = placed(frame)?;
    let group =
        Group::from_mesh(mesh_devices, frame.attr_i64_array("mesh_shape")?, frame.attr_i64_array("axes")?, device)?;
    if group.devices.len() < 2 {
        return Ok(());
    }
    let members = members_of(&group, &placement, mesh_devices)?;
    let chosen = transport_of(&CommKey::of(&group), || Ok(members.clone()), true)?;
    if chosen == Chosen::Copies {
        // No communicator: copies need only peer access, set up before any copy.
        return copy_links::enable_peer_access(ordinal, &members);
    }
    require(&[Lib::Nccl])?;
    let deadline = start + crate::config::timeout()?;
    let comms = communicators(&group, &placement, &members, ordinal, &dev, deadline)?;
    let mut d = crate::sync::lock(&dev);
    let connected = comms.connect(group.rank, &mut d, &stream, deadline);
    if connected.is_err() {
        comms.abort_rank(group.rank);
        nccl_group::evict(&CommKey::of(&group), &comms);
    }
    connected
}

/// One device's call of a fused op on a GPU: the same call as the CPU
/// path decodes, then the plan's stream schedule enqueued on the device's
/// streams, forked from and joined back to XLA's stream. Returns once
/// everything is enqueued (no host synchronisation).
pub fn collective_matmul(frame: &mut Frame<'_>) -> Result<()> {
    let (device, placement, mesh_devices, ordinal) = placed(frame)?;
    let [first, second] = Call::operand_names(frame);
    let x = frame.device_arg(0, first)?;
    let w = frame.device_arg(1, second)?;
    let out = frame.device_ret(0, "out")?;
    let workspace = frame.device_ret_bytes(1, "workspace")?;
    let call = Call::decode(frame, [(x.dims, x.dtype), (w.dims, w.dtype), (out.dims, out.dtype)], device)?;
    require(&[Lib::Driver, Lib::Cublas, Lib::Nvrtc])?;
    if x.dtype.is_fp8() {
        require(&[Lib::CublasLt])?;
    }
    let CallSite { kind, site, group, problem, plan, .. } = &*call.decoded;
    let timeout = &call.timeout;
    let xla_stream = CallStream::of(frame)?;
    let memory = CallMemory::of_frame(frame)?;
    if problem.is_trivial() {
        // Nothing to multiply or move (every rank skips alike): zeros, as
        // jax.lax gives for an empty contraction.
        let dev = device::bind_for_execute(&xla_stream)?;
        return device::zero_result(&crate::sync::lock(&dev), (out.addr, out.bytes), &xla_stream, &memory);
    }
    let site_ops = call.decoded.derived(|site| SiteOps::new(&site.problem, &site.plan))?;
    let region = |addr, bytes, dtype| Region { addr, bytes, dtype };
    let buffers = DeviceBuffers {
        x: region(x.addr, x.bytes, x.dtype),
        w: region(w.addr, w.bytes, w.dtype),
        out: region(out.addr, out.bytes, out.dtype),
        workspace: (workspace.addr, workspace.bytes),
        scales: if x.dtype.is_fp8() { Some(scales(frame)?) } else { None },
    };
    let bases = site_ops.bind(&buffers)?;
    let deadline = call.deadline();

    let dev = device::bind_for_execute(&xla_stream)?;
    // An earlier call on this device that timed out on the device (see
    // `watchdog`) fails this one before it touches the group again.
    device_watch::check_device_timeouts(crate::sync::lock(&dev).ordinal)?;
    // The transport; for NCCL, communicators first (their creation takes the
    // group's lock and sets other devices' contexts), then this device's
    // lock for the enqueueing.
    let key = CommKey::of(group);
    // Over copies a call needs no member list: only NCCL's communicators do.
    let members = || members_of(group, &placement, mesh_devices);
    let chosen = site_ops.exchanges.then(|| transport_of(&key, members, false)).transpose()?;
    let comms = match chosen {
        Some(Chosen::Nccl) => {
            require(&[Lib::Nccl])?;
            Some(communicators(group, &placement, &members()?, ordinal, &dev, deadline)?)
        }
        _ => None,
    };
    let mailbox = (chosen == Some(Chosen::Copies)).then(|| copy_links::mailbox(&key));
    let transport = match (&comms, &mailbox) {
        (Some(c), _) => Some(Exchanges::Nccl(c.rank(group.rank)?)),
        (None, Some(m)) => {
            let call = CallId { site: *site, run: frame.run_id()? };
            Some(Exchanges::Copies { mailbox: m, key: &key, rank: group.rank, call })
        }
        (None, None) => None,
    };
    let mut d = crate::sync::lock(&dev);
    CallOps::prepare(&mut d, site_ops.events)?;
    // Calls that communicate over NCCL are watched until their work finishes
    // on the device: a peer that never arrives would leave the stream
    // stalled. The copy transport's streams only ever wait for events whose
    // records are already enqueued (its host waits are bounded instead).
    let watch = comms.as_ref().map(|c| CallWatch::begin(&d, &xla_stream, c, site_ops.marks)).transpose()?;
    let mut ops = CallOps {
        device: &d,
        xla: &xla_stream,
        site: &site_ops,
        bases,
        memory: &memory,
        transport,
        deadline,
        interrupts: call.interrupts,
        comm_failed: false,
        tf32: frame.has_attr("tf32") && frame.attr_i64("tf32")? != 0,
        fp8_workspace: site_ops.fp8_workspace(&buffers),
        watch: watch.as_ref(),
    };
    let marked = if watch.is_some() { site_ops.marks } else { 0 };
    let transport_name = chosen.map_or("none", Chosen::name);
    let recording = Recording::begin(plan, || CallLabel {
        transport: transport_name,
        ..CallLabel::new(i64::from(ordinal), *site, kind.name(), plan, problem, x.bytes)
    });
    let observer = recording.as_ref().map(|r| r as &dyn Observer);
    let mut result = stream_issue::issue(plan, &site_ops.streams, &mut ops, marked, observer);
    if let (Err(e), Some(m)) = (&result, &mailbox) {
        // Whatever failed, the group's messages are out of step: its other
        // ranks stop waiting, and its next call starts a new mailbox. Peers'
        // copies already on their way into this call's buffers (and its own
        // out) run on its lanes, which never wait for anything unrecorded:
        // XLA's stream waits for them before it reuses the buffers.
        m.fail_for(group.rank, e);
        if let Err(join) = stream_issue::join_lanes(&site_ops.streams, &mut ops) {
            result = result.map_err(|e| Error::Internal(format!("{e}; joining the lanes after it: {join}")));
        }
    }
    let comm_failed = ops.comm_failed;
    let result = match (result, watch) {
        (Ok(()), Some(w)) => w.submit(&xla_stream, kind.name(), *site, group.rank, *timeout),
        (Err(e), Some(w)) => {
            w.cancel();
            Err(e)
        }
        (result, None) => result,
    };
    if let Some(c) = comms.as_ref().filter(|_| comm_failed) {
        c.abort_rank(group.rank);
        nccl_group::evict(&key, c);
    }
    result.map_err(|e| match e {
        Error::DeadlineExceeded(m) => {
            Error::DeadlineExceeded(format!("{} (rank {} of group {:?}): {m}", kind.name(), group.rank, group.devices))
        }
        other => other,
    })
}
