//! The CUDA backend's workspace: the plan's slots, then, for fp8 operands,
//! the GEMMs' cuBLASLt workspace (all of a call's GEMMs run on one stream,
//! one after another, so one suffices), so that it comes from XLA's
//! allocator too. Compiled without the `cuda` feature: Python sizes a CUDA
//! call's workspace at lowering time from any build.
#![forbid(unsafe_code)]

use crate::error::Result;
use crate::plan::{Plan, Workspace};
use crate::problem::Problem;
use std::ops::Range;

/// Device bytes an fp8 call's GEMMs may use (cuBLASLt's workspace: NVIDIA's
/// recommendation for Hopper; smaller ones rule out some fp8 kernels).
pub const FP8_GEMM_WORKSPACE_BYTES: usize = 32 << 20;

/// cuBLASLt wants its workspace 256-byte aligned.
const FP8_GEMM_WORKSPACE_ALIGN: usize = 256;

/// Where a CUDA call's regions live in its workspace.
pub struct CudaLayout {
    pub plan: Workspace,
    /// The fp8 GEMMs' workspace (fp8 operands only).
    pub fp8_gemm: Option<Range<usize>>,
}

impl CudaLayout {
    pub fn new(problem: &Problem, plan: &Plan) -> Result<CudaLayout> {
        let mut ws = Workspace::layout(plan, &problem.sizes())?;
        let fp8_gemm = problem
            .input
            .is_fp8()
            .then(|| ws.append(FP8_GEMM_WORKSPACE_BYTES, 1, FP8_GEMM_WORKSPACE_ALIGN))
            .transpose()?;
        Ok(CudaLayout { plan: ws, fp8_gemm })
    }

    pub fn total(&self) -> usize {
        self.plan.total
    }
}
