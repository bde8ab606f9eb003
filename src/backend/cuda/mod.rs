//! The CUDA backend (`--features cuda`): the CUDA libraries are opened at
//! run time (`libs`: the copy JAX mapped, else a standard install's) and
//! called in three layers, as cudarc does: `api` holds each library's
//! function table over cudarc's generated types (sys) and maps its status
//! codes to errors (result); one safe layer per library owns its handles
//! and makes every call the backend needs: `driver` (contexts, streams,
//! events, memory, the sum kernels, copies), `blas` (cuBLAS and cuBLASLt
//! GEMMs), `nccl` (communicators and point-to-point groups), `nvrtc`
//! (compiling `kernels/`). Those calls check every device address against
//! the memory of the call (`driver::CallMemory`). All other modules forbid
//! `unsafe`. So the crate builds and its logic is tested where CUDA is absent.
//!
//! It shares the plans, the GEMM geometry and the stream ordering with the
//! CPU path: `exec::stream` turns a plan into per-stream commands,
//! `stream_issue` forks lanes off XLA's stream, issues them and joins them
//! back, `enqueue` puts each step on a device: `gemm` (the column-major view
//! of each `Problem::gemms` GEMM) and `fp8_gemm` (cuBLASLt's fp8 rules) are
//! pure; exchanges go over NCCL (`nccl_group` and `communicators` key and
//! cache communicators and map groups spanning processes: placement,
//! exchanged unique ids) or, for groups of this process, as copies on copy
//! engines (`copies`, the protocol; `copy_links`, its CUDA side; chosen by
//! `config::transport`);
//! `kernels` compiles `kernels/` with NVRTC to CUBIN for each device, loaded
//! at the handler's INITIALIZE stage, before any execution.
//!
//! `addresses` maps a call's plan buffers onto its buffers (pure, tested
//! without a device), `site_ops` keeps each call site's lowered operations so
//! a call only binds its buffers' addresses, and `device` holds each
//! device's state. `watchdog` and `device_watch` bound the device side: a
//! call whose communication never finishes on the device has its
//! communicators aborted, and its device's next call fails. What still needs
//! a GPU to be verified, and what is missing, is in GPU.md.
#![deny(unsafe_code)]

pub mod workspace;

#[cfg(feature = "cuda")]
pub mod addresses;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod api;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod blas;
#[cfg(feature = "cuda")]
pub mod communicators;
#[cfg(feature = "cuda")]
pub mod copies;
#[cfg(feature = "cuda")]
pub mod copy_links;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod device_watch;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod driver;
#[cfg(all(test, feature = "cuda"))]
mod emulate;
#[cfg(feature = "cuda")]
pub mod enqueue;
#[cfg(feature = "cuda")]
pub mod fp8_gemm;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
pub mod handler;
#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod libs;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod nccl_group;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod reshard;
#[cfg(feature = "cuda")]
pub mod site_ops;
#[cfg(feature = "cuda")]
pub mod solo;
#[cfg(feature = "cuda")]
pub mod solo_device;
#[cfg(feature = "cuda")]
pub mod stream_issue;
#[cfg(feature = "cuda")]
pub mod watchdog;
