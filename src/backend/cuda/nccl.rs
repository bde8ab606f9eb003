//! NCCL point-to-point: one plan `Exchange` step as one NCCL group of sends
//! and receives on the communication stream. No NCCL collectives are used.

use super::api::{self, check_nccl};
use crate::error::{Error, Result};
use cudarc::nccl::sys;

/// One transfer of an exchange: an address (`A`: a device address, or
/// `addresses::Addr` as lowered for a site), its length in bytes, the peer's
/// rank in the communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2p<A = u64> {
    pub addr: A,
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
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
    sends: impl IntoIterator<Item = P2p>,
    recvs: impl IntoIterator<Item = P2p>,
) -> Result<()> {
    let nccl = api::nccl()?;
    let peer = |p: &P2p| {
        std::ffi::c_int::try_from(p.peer).map_err(|_| Error::Internal(format!("peer {} out of range", p.peer)))
    };
    let bytes = sys::ncclDataType_t::ncclUint8;
    // SAFETY: balanced by the `group_end` below.
    check_nccl(unsafe { (nccl.group_start)() }, "ncclGroupStart")?;
    let posted = (|| -> Result<()> {
        for s in sends {
            // SAFETY: the caller's contract.
            let status = unsafe { (nccl.send)(s.addr as *const _, s.bytes, bytes, peer(&s)?, comm, stream) };
            check_nccl(status, "ncclSend")?;
        }
        for r in recvs {
            // SAFETY: the caller's contract.
            let status = unsafe { (nccl.recv)(r.addr as *mut _, r.bytes, bytes, peer(&r)?, comm, stream) };
            check_nccl(status, "ncclRecv")?;
        }
        Ok(())
    })();
    // Close the group even after a failed post, so NCCL's group depth stays balanced.
    // SAFETY: closes the group opened above.
    let ended = check_nccl(unsafe { (nccl.group_end)() }, "ncclGroupEnd");
    posted.and(ended)
}
