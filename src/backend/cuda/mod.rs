//! The CUDA backend (`--features cuda`): the CUDA libraries are opened at
//! run time (`libs`: the copy JAX mapped, else a standard install's) and
//! called through the project's function tables over cudarc's generated
//! types (`api`), with owning wrappers in `handles`, so the crate builds and
//! its logic is tested where CUDA is absent.
//!
//! It shares the plans, the GEMM geometry and the stream ordering with the
//! CPU path: `exec::stream` turns a plan into per-stream commands,
//! `stream_issue` forks lanes off XLA's stream, issues them and joins them
//! back, `enqueue` puts each step on a device: `gemm` runs each
//! `Problem::gemms` view with cuBLAS on XLA's buffers (`fp8_gemm`: fp8 GEMMs
//! with cuBLASLt and their two scale operands), `nccl` posts each exchange
//! as one group, `nccl_group` and `communicators` key and cache
//! communicators and map groups spanning processes (placement, exchanged
//! unique ids), `kernels` compiles `kernels/` with NVRTC to CUBIN for each
//! device, loaded at the handler's INITIALIZE stage, before any execution.
//!
//! `addresses` maps a call's plan buffers onto its buffers (pure, tested
//! without a device), `site_ops` keeps each call site's lowered operations so
//! a call only binds its buffers' addresses, and `device` holds each
//! device's state. `watchdog`
//! and `device_watch` bound the device side: a call whose communication
//! never finishes on the device has its communicators aborted, and its
//! device's next call fails. What still needs a GPU to be verified, and what
//! is missing, is in GPU.md.
#![deny(unsafe_code)]

pub mod workspace;

#[cfg(feature = "cuda")]
pub mod addresses;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod api;
#[cfg(feature = "cuda")]
pub mod communicators;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod device;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod device_watch;
#[cfg(all(test, feature = "cuda"))]
mod emulate;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod enqueue;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod fp8_gemm;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod gemm;
#[cfg(feature = "cuda")]
pub mod handler;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod handles;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod kernels;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod libs;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod nccl;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod nccl_group;
#[cfg(feature = "cuda")]
pub mod reshard;
#[cfg(feature = "cuda")]
pub mod site_ops;
#[cfg(feature = "cuda")]
pub mod stream_issue;
#[cfg(feature = "cuda")]
pub mod watchdog;
