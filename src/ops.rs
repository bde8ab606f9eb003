//! The body of the fused-op handler: decode the call, check it, plan it,
//! meet the peers and run.
#![forbid(unsafe_code)]

use crate::backend::cpu::{self, transport};
use crate::comm::Group;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::{self, Schedule, Workspace};
use crate::problem::{OpKind, Operand, Problem};
use crate::xla::Frame;

/// One device's call of a fused op on the CPU backend: decoded and checked
/// on XLA's thread, then run on a thread of its own, finishing through
/// XLA's future (`xla::Deferred`), so that a call waiting for its peers
/// never holds a thread XLA needs for its own collectives.
pub fn collective_matmul_cpu(frame: &mut Frame<'_>) -> Result<()> {
    let call = CpuCall::decode(frame)?;
    match frame.defer("commfuse collective matmul")? {
        Some(deferred) => {
            crate::exec::spawn_call(move || deferred.finish(|args, rets| call.run(args, rets)));
            Ok(())
        }
        // An XLA without FFI futures: run here.
        None => {
            let args = [frame.arg_bytes(0, "x")?, frame.arg_bytes(1, "w")?];
            let mut rets = [frame.ret_bytes(0, "out")?, frame.ret_bytes(1, "workspace")?];
            call.run(&args, &mut rets)
        }
    }
}

/// Everything a CPU call needs once its buffers are at hand, owned, so it
/// can run on another thread.
struct CpuCall {
    kind: OpKind,
    problem: Problem,
    plan: plan::Plan,
    device: i64,
    site: i64,
    rank: usize,
    key: transport::SessionKey,
    timeout: std::time::Duration,
    /// `config::interrupts()` when XLA called the handler.
    interrupts: u64,
    link: Option<transport::link::LinkModel>,
}

impl CpuCall {
    fn decode(frame: &Frame<'_>) -> Result<CpuCall> {
        let interrupts = crate::config::interrupts();
        let kind = kind(frame.attr_i64("kind")?)?;
        let x = frame.arg(0, "x")?;
        let w = frame.arg(1, "w")?;
        let (out_dtype, out_dims) = frame.ret_type(0, "out")?;
        let site = frame.attr_i64("site")?;
        let schedule = schedule(kind, frame.attr_i64("schedule")?)?;
        let device = i64::from(frame.device_ordinal()?);
        let group = Group::from_mesh(
            frame.attr_i64_array("mesh_devices")?,
            frame.attr_i64_array("mesh_shape")?,
            frame.attr_i64_array("axes")?,
            device,
        )?;
        let operands = [(x.dims, x.dtype), (w.dims, w.dtype), (out_dims, out_dtype)];
        let (problem, plan) = problem_and_plan(kind, schedule, operands, frame.attr_i64("dimension")?, &group)?;
        let timeout = crate::config::timeout()?;
        let run = frame.run_id()?;
        // Numbered here, in the order XLA calls the handler on this device.
        let key = transport::SessionKey {
            sequence: transport::next_sequence(device, site, run),
            group: group.devices.clone(),
            site,
            run,
        };
        Ok(CpuCall {
            kind,
            problem,
            plan,
            device,
            site,
            rank: group.rank,
            key,
            timeout,
            interrupts,
            // The link model as it is when the program runs (read on every call).
            link: transport::link::LinkModel::from_env()?,
        })
    }

    /// Meets the peers and runs the plan on the call's buffers: operands
    /// `x`, `w`, results `out`, `workspace`.
    fn run(self, args: &[&[u8]], rets: &mut [&mut [u8]]) -> Result<()> {
        let counts = (args.len(), rets.len());
        let ([x, w], [out, workspace]) = (args, rets) else {
            return Err(Error::InvalidArgument(format!(
                "the call has {} operands and {} results; expected x, w and out, workspace",
                counts.0, counts.1
            )));
        };
        if self.problem.is_trivial() {
            // Every rank has these shapes and skips alike: no peer to meet.
            out.fill(0);
            return Ok(());
        }
        let info = transport::CallInfo {
            op: self.kind.name(),
            rank: self.rank,
            timeout: self.timeout,
            interrupts: self.interrupts,
        };
        let endpoint = transport::Endpoint::join(self.key, info).with_link(self.link);
        let _trace = crate::trace::enter(self.device, self.site, self.kind.name(), &self.plan, &self.problem, x.len());
        let buffers = cpu::Buffers { x, w, out, workspace };
        let result = cpu::run(&self.problem, &self.plan, buffers, &endpoint);
        if let Err(e) = &result {
            endpoint.fail(e);
            // Also said here: other devices of this program may be waiting in
            // one of XLA's collectives for this one, and XLA aborts the
            // process when its own rendezvous times out, before Python could
            // show the error.
            if matches!(e, Error::DeadlineExceeded(_)) {
                eprintln!("{e}");
            }
        }
        result
    }
}

/// The low byte of a schedule code that means `Schedule::Sliced` or
/// `Schedule::Tiled`; the number of slices or tiles is in the bits above it
/// (`SLICED | slices << 8`). Python builds these codes (`_fused.schedule_code`).
pub const SLICED: i64 = 4;
pub const TILED: i64 = 5;

/// Decodes the `schedule` attribute: `Schedule::from_code`'s codes, or a sliced or tiled code.
pub fn schedule(kind: OpKind, code: i64) -> Result<Schedule> {
    if code < 0 {
        return Err(Error::InvalidArgument(format!(
            "{}: schedule code {code} is negative: not a schedule (a sliced or tiled code carries its count above \
             the low byte, at most {})",
            kind.name(),
            plan::MAX_CHUNKS
        )));
    }
    if matches!(code & 0xff, SLICED | TILED) {
        let (what, unit) = if code & 0xff == SLICED { ("sliced", "slices") } else { ("tiled", "tiles") };
        let chunks = code >> 8;
        if chunks < 1 || chunks > plan::MAX_CHUNKS as i64 {
            return Err(Error::InvalidArgument(format!(
                "{}: the {what} schedule needs {unit} in [1, {}], got {chunks}",
                kind.name(),
                plan::MAX_CHUNKS
            )));
        }
        let chunks = chunks as usize;
        if !Schedule::sliceable(kind.pattern())
            || !matches!(kind, OpKind::AllGatherMatmul | OpKind::MatmulReduceScatter)
        {
            return Err(Error::InvalidArgument(format!(
                "{}: schedule \"{what}\" exists only for all_gather_matmul and matmul_reduce_scatter along a row \
                 dim",
                kind.name()
            )));
        }
        return Ok(if code & 0xff == SLICED {
            Schedule::Sliced { slices: chunks }
        } else {
            Schedule::Tiled { tiles: chunks }
        });
    }
    Schedule::from_code(code)
        .ok_or_else(|| Error::InvalidArgument(format!("{}: unknown schedule code {code}", kind.name())))
}

/// The problem as `schedule` cuts it (sliced schedules address chunks of blocks).
/// The problem one call describes (operands x, w, out as (dims, dtype)), cut
/// as `schedule` cuts it, and this rank's plan: what the CPU and the CUDA
/// handlers both run.
pub fn problem_and_plan(
    kind: OpKind,
    schedule: Schedule,
    [x, w, out]: [(&[i64], DType); 3],
    dimension: i64,
    group: &Group,
) -> Result<(Problem, plan::Plan)> {
    let operand = |(dims, dtype)| Operand { dims, dtype };
    plan::check_size(kind.name(), schedule, group.size())?;
    let problem = Problem::new(kind, operand(x), operand(w), operand(out), dimension, group.size())?;
    let problem = problem.for_schedule(schedule)?;
    Ok((problem, plan::plan(kind.pattern(), schedule, group.size(), group.rank)))
}

/// The op kind of the `kind` attribute.
pub fn kind(code: i64) -> Result<OpKind> {
    OpKind::from_code(code).ok_or_else(|| Error::InvalidArgument(format!("unknown op kind {code}")))
}

/// The shapes of one call as Python describes them at trace time.
#[derive(Clone, Copy)]
pub struct CallShapes<'a> {
    pub kind: i64,
    pub schedule: i64,
    pub ranks: i64,
    pub dimension: i64,
    pub x: &'a [i64],
    pub w: &'a [i64],
    pub out: &'a [i64],
    pub input: u32,
    pub output: u32,
}

impl CallShapes<'_> {
    /// The op, group size and problem these shapes describe (before slicing).
    pub fn problem(&self) -> Result<(OpKind, usize, Problem)> {
        let kind = kind(self.kind)?;
        let ranks = usize::try_from(self.ranks).ok().filter(|&r| (1..=plan::MAX_RANKS).contains(&r));
        let ranks = ranks.ok_or_else(|| {
            Error::InvalidArgument(format!("ranks must be in [1, {}], got {}", plan::MAX_RANKS, self.ranks))
        })?;
        let dtype = |code: u32| {
            DType::from_xla(code).ok_or_else(|| Error::InvalidArgument(format!("unsupported dtype code {code}")))
        };
        let (input, output) = (dtype(self.input)?, dtype(self.output)?);
        let problem = Problem::new(
            kind,
            Operand { dims: self.x, dtype: input },
            Operand { dims: self.w, dtype: input },
            Operand { dims: self.out, dtype: output },
            self.dimension,
            ranks,
        )?;
        Ok((kind, ranks, problem))
    }
}

/// Device bytes an fp8 call's GEMMs may use (cuBLASLt's workspace: NVIDIA's
/// recommendation for Hopper; smaller ones rule out some fp8 kernels).
pub const FP8_GEMM_WORKSPACE_BYTES: usize = 32 << 20;

/// Where an fp8 call's GEMM workspace starts in the call's workspace: after
/// the plan's buffers, 256-byte aligned.
pub fn fp8_gemm_workspace_offset(plan_bytes: usize) -> usize {
    plan_bytes.div_ceil(256) * 256
}

/// Workspace bytes a call needs; Python asks at trace time. An fp8 call
/// adds its GEMMs' workspace (all of a call's GEMMs run on one stream, one
/// after another, so one suffices), so that it comes from XLA's allocator too.
pub fn workspace_bytes(call: &CallShapes) -> Result<usize> {
    let (kind, ranks, problem) = call.problem()?;
    let schedule = schedule(kind, call.schedule)?;
    plan::check_size(kind.name(), schedule, ranks)?;
    let fp8 = problem.input.is_fp8();
    let problem = problem.for_schedule(schedule)?;
    // Every rank's plan uses the same slots; rank 0 stands for all.
    let plan_bytes = Workspace::layout(&plan::plan(kind.pattern(), schedule, ranks, 0), &problem.sizes())?.total;
    Ok(if fp8 { fp8_gemm_workspace_offset(plan_bytes) + FP8_GEMM_WORKSPACE_BYTES } else { plan_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_codes_at_the_edges_say_what_is_wrong() {
        let kind = OpKind::AllGatherMatmul;
        let message = |code: i64| schedule(kind, code).unwrap_err().to_string();
        assert_eq!(schedule(kind, TILED | (4 << 8)), Ok(Schedule::Tiled { tiles: 4 }));
        assert_eq!(schedule(kind, SLICED | (1024 << 8)), Ok(Schedule::Sliced { slices: 1024 }));
        // tiles = 2^55 wraps the code negative: once "unknown schedule code -9223372036854775803".
        let wrapped = TILED | (1i64 << 55).wrapping_shl(8);
        assert!(message(wrapped).contains("is negative: not a schedule"), "{}", message(wrapped));
        // tiles = 2^56 shifts out to 0 tiles: once "needs tiles >= 1".
        assert!(message(TILED).contains("needs tiles in [1, 1024], got 0"), "{}", message(TILED));
        assert!(message(TILED | (1025 << 8)).contains("got 1025"));
        assert!(message(TILED | (1 << 40 << 8)).contains("got 1099511627776"));
        assert!(message(99).contains("unknown schedule code 99"));
    }

    #[test]
    fn workspace_sizing_refuses_plans_past_the_limits_without_making_them() {
        let shapes = |ranks, schedule| CallShapes {
            kind: 0,
            schedule,
            ranks,
            dimension: 0,
            x: &[0, 8],
            w: &[8, 6],
            out: &[0, 6],
            input: 11,
            output: 11,
        };
        let e = workspace_bytes(&shapes(1 << 40, 1)).unwrap_err();
        assert!(e.to_string().contains("ranks must be in [1, 65536]"), "{e}");
        let e = workspace_bytes(&shapes(4, TILED | (2 << 8))).unwrap_err();
        assert!(e.to_string().contains("tiles=2 is more than the 0 rows"), "{e}");
    }
}
