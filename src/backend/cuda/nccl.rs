//! NCCL point-to-point: one plan `Exchange` step as one NCCL group of sends
//! and receives on the communication stream. No NCCL collectives are used.

use crate::error::{Error, Result};

/// One transfer of an exchange: a device address, its length in bytes, the
/// peer's rank in the communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2p {
    pub addr: u64,
    pub bytes: usize,
    pub peer: usize,
}

/// Enqueues the sends and receives of one exchange as one group. Every rank
/// issues its groups in plan order, which pairs them (the plan tests check
/// that sends and receives match step by step).
///
/// # Safety
/// `comm` is a live communicator of this device; `stream` a stream of the
/// same device; every address is device memory of at least `bytes` bytes that
/// stays valid (and, for sends, unchanged) until the stream reaches the group.
pub unsafe fn enqueue_exchange(
    comm: cudarc::nccl::sys::ncclComm_t,
    stream: cudarc::nccl::sys::cudaStream_t,
    sends: &[P2p],
    recvs: &[P2p],
) -> Result<()> {
    use cudarc::nccl::{result, sys};
    let fail = |what: &str, e: result::NcclError| Error::Internal(format!("NCCL {what}: {e:?}"));
    let peer = |p: &P2p| {
        std::ffi::c_int::try_from(p.peer).map_err(|_| Error::Internal(format!("peer {} out of range", p.peer)))
    };
    result::group_start().map_err(|e| fail("group start", e))?;
    let posted = (|| -> Result<()> {
        for s in sends {
            // SAFETY: the caller's contract.
            unsafe {
                result::send(s.addr as *const _, s.bytes, sys::ncclDataType_t::ncclUint8, peer(s)?, comm, stream)
            }
            .map_err(|e| fail("send", e))?;
        }
        for r in recvs {
            // SAFETY: the caller's contract.
            unsafe { result::recv(r.addr as *mut _, r.bytes, sys::ncclDataType_t::ncclUint8, peer(r)?, comm, stream) }
                .map_err(|e| fail("recv", e))?;
        }
        Ok(())
    })();
    // Close the group even after a failed post, so NCCL's group depth stays balanced.
    let ended = result::group_end().map_err(|e| fail("group end", e));
    posted.and(ended.map(|_| ()))
}
