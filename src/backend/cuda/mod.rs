//! The CUDA backend (`--features cuda`): cudarc with dynamic loading, so the
//! crate builds and its logic is tested where CUDA is absent.
//!
//! It shares the plans, the GEMM geometry and the stream ordering with the
//! CPU path: `exec::stream` turns a plan into per-stream commands, `issue`
//! forks lanes off XLA's stream and joins them back, `gemm` runs each
//! `Problem::gemms` view with cuBLAS on XLA's buffers, `nccl` posts each
//! exchange as one group, `comms` keys and caches communicators, `kernels`
//! compiles `kernels/` with NVRTC, `libs` checks the libraries first.
//!
//! Not yet wired (see GPU.md): the handler needs XLA's stream and raw device
//! addresses of the buffers from `crate::xla`, which has neither yet.
#![deny(unsafe_code)]

pub mod comms;
#[allow(unsafe_code)]
pub mod gemm;
pub mod issue;
pub mod kernels;
#[allow(unsafe_code)]
pub mod libs;
#[allow(unsafe_code)]
pub mod nccl;

use crate::comm::Group;
use crate::error::{Error, Result};
use crate::plan::Schedule;
use crate::problem::OpKind;
use crate::xla::Frame;
use libs::{require, Lib};

/// One device's call of a fused op on a GPU: checks the call as the CPU path
/// does (attributes only: the buffers live on the device, and `Frame` hands out
/// host slices), checks the libraries, then reports what is missing to run it.
pub fn collective_matmul(frame: &mut Frame<'_>) -> Result<()> {
    let code = frame.attr_i64("kind")?;
    let kind = OpKind::from_code(code).ok_or_else(|| Error::InvalidArgument(format!("unknown op kind {code}")))?;
    let schedule_code = frame.attr_i64("schedule")?;
    Schedule::from_code(schedule_code)
        .ok_or_else(|| Error::InvalidArgument(format!("{}: unknown schedule code {schedule_code}", kind.name())))?;
    let device = i64::from(frame.device_ordinal()?);
    // The group is checked (and would key the communicator) before anything else.
    Group::from_mesh(
        frame.attr_i64_array("mesh_devices")?,
        frame.attr_i64_array("mesh_shape")?,
        frame.attr_i64_array("axes")?,
        device,
    )?;
    require(&[Lib::Driver, Lib::Cublas, Lib::Nccl, Lib::Nvrtc])?;
    Err(Error::Unimplemented(format!(
        "{}: the CUDA handler is not wired yet: it needs XLA's stream (XLA_FFI_Stream_Get) and the device \
         addresses of the operands, result and workspace, which commfuse's XLA frame does not expose yet \
         (see GPU.md); run on the CPU backend",
        kind.name()
    )))
}
