//! What one call site becomes on a device, made on its first call and kept
//! with the site (`call::CallSite::derived`): the workspace layout, the
//! stream schedule, and every step's device operations addressed relative to
//! the call's buffers. A call then only checks its buffers and binds their
//! addresses (`SiteOps::bind`): it builds no plan, no layout and no schedule,
//! and allocates nothing in proportion to the plan.
#![forbid(unsafe_code)]

use super::addresses::{Bases, DeviceBuffers, DeviceOp, Resolver};
use super::stream_issue;
use super::watchdog;
use super::workspace::CudaLayout;
use crate::error::{Error, Result};
use crate::exec::stream::StreamSchedule;
use crate::plan::{Action, Lane, Plan};
use crate::problem::Problem;

/// A site's device operations and the figures its calls need (see the module's doc).
pub struct SiteOps {
    pub layout: CudaLayout,
    pub streams: StreamSchedule,
    /// The device stream of each schedule lane (`lane_stream`).
    pub lane_streams: Vec<usize>,
    /// Each plan step's device operations, by step id.
    pub steps: Vec<Vec<DeviceOp>>,
    /// Events a call records (`stream_issue::events_needed`).
    pub events: usize,
    /// Progress marks a watched call records (`stream_issue::marks_needed`).
    pub marks: usize,
    /// Whether the plan exchanges anything (a call then needs communicators).
    pub exchanges: bool,
    /// Bytes of `x`, `w` and `out` a call's buffers must have.
    buffer_bytes: [usize; 3],
    fp8: bool,
}

/// The device stream of a lane: 0 is the compute stream, 1 the communication stream.
pub fn lane_stream(lane: Lane) -> usize {
    match lane {
        Lane::Compute => 0,
        Lane::Comm => 1,
    }
}

impl SiteOps {
    /// Lowers every step of `plan` (see `Resolver::lower`); fails where the
    /// GPU path does not take the problem.
    pub fn new(problem: &Problem, plan: &Plan) -> Result<SiteOps> {
        let layout = CudaLayout::new(problem, plan)?;
        let resolver = Resolver::new(problem, &layout.plan, &plan.slots)?;
        let mut steps = Vec::with_capacity(plan.steps.len());
        for (i, step) in plan.steps.iter().enumerate() {
            if step.id != i {
                return Err(Error::Internal(format!("step {i} of the plan has id {}", step.id)));
            }
            steps.push(resolver.lower(&step.action)?);
        }
        let streams = StreamSchedule::new(plan);
        Ok(SiteOps {
            lane_streams: streams.lanes.iter().map(|&l| lane_stream(l)).collect(),
            events: stream_issue::events_needed(&streams),
            marks: stream_issue::marks_needed(&streams, watchdog::MAX_MARKS),
            exchanges: plan.steps.iter().any(|s| matches!(s.action, Action::Exchange { .. })),
            buffer_bytes: resolver.buffer_bytes(),
            fp8: problem.input.is_fp8(),
            layout,
            streams,
            steps,
        })
    }

    /// Checks one call's buffers against the site (their sizes as
    /// lowered, a workspace as large as the layout, the scales of an fp8
    /// call) and gives the addresses its operations bind to.
    pub fn bind(&self, buffers: &DeviceBuffers) -> Result<Bases> {
        let regions = [("x", &buffers.x), ("w", &buffers.w), ("out", &buffers.out)];
        for ((name, region), bytes) in regions.into_iter().zip(self.buffer_bytes) {
            if region.bytes != bytes {
                return Err(Error::InvalidArgument(format!(
                    "`{name}` has {} bytes; this call site was lowered for {bytes}",
                    region.bytes
                )));
            }
        }
        if buffers.workspace.1 < self.layout.total() {
            return Err(Error::InvalidArgument(format!(
                "`workspace` has {} bytes, the plan needs {}",
                buffers.workspace.1,
                self.layout.total()
            )));
        }
        if self.fp8 && buffers.scales.is_none() {
            return Err(Error::InvalidArgument(
                "fp8 operands need the float32 scalars `x_scale` and `w_scale` (operands 2 and 3)".into(),
            ));
        }
        Ok(buffers.bases())
    }

    /// The part of an fp8 call's workspace its cuBLASLt GEMMs may use, after
    /// the plan's buffers (`workspace::CudaLayout`), once `bind` has checked
    /// the workspace's size.
    pub fn fp8_workspace(&self, buffers: &DeviceBuffers) -> Option<(u64, usize)> {
        let region = self.layout.fp8_gemm.clone()?;
        Some((buffers.workspace.0 + region.start as u64, region.len()))
    }
}
