//! The safe layer over NCCL (`api`'s NCCL table): communicators owned by
//! [`Comm`] (aborted once, when asked or on drop), the creation of a group's
//! communicators, and the only NCCL traffic the backend makes: one plan
//! `Exchange` step as one NCCL group of sends and receives, its addresses
//! checked against the call's `CallMemory` first. No NCCL collectives are used.

use super::addresses::{P2p, Poll};
use super::api::{self, check_nccl};
use super::driver::{CallMemory, Context, Queue};
use crate::error::{Error, Result};
use cudarc::nccl::sys;
use std::ffi::c_int;
use std::sync::Mutex;

/// An NCCL unique id: what the ranks of one group share to create it.
pub type UniqueId = sys::ncclUniqueId;

/// A fresh unique id (`ncclGetUniqueId`).
pub fn unique_id() -> Result<UniqueId> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer of the id's size.
    check_nccl(unsafe { (api::nccl()?.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
    Ok(id)
}

/// The loaded NCCL's version code (`ncclGetVersion`).
pub fn version_code() -> Result<i32> {
    let mut runtime = 0;
    // SAFETY: a valid out-pointer.
    check_nccl(unsafe { (api::nccl()?.get_version)(&mut runtime) }, "ncclGetVersion")?;
    Ok(runtime)
}

/// One rank's communicator; `None` inside once aborted. The lock makes every
/// use and the abort one at a time, so no call uses it while it is torn down.
pub struct Comm(Mutex<Option<sys::ncclComm_t>>);

// SAFETY: the handle is only used under the lock, and NCCL communicators may
// be used from any thread.
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

impl Comm {
    fn live(&self) -> Result<std::sync::MutexGuard<'_, Option<sys::ncclComm_t>>> {
        let guard = crate::sync::lock(&self.0);
        if guard.is_none() {
            // Aborted by this rank's failing call or by the watchdog after a timeout.
            return Err(Error::DeadlineExceeded(
                "the communicator was aborted after an earlier failure or timeout; the next call creates it afresh"
                    .into(),
            ));
        }
        Ok(guard)
    }

    /// Whether it has not been aborted.
    pub fn is_live(&self) -> bool {
        crate::sync::lock(&self.0).is_some()
    }

    /// Aborts the communicator (`ncclCommAbort`: frees it without waiting
    /// for peers, which may be gone); later uses fail. A second abort does nothing.
    pub fn abort(&self) {
        if let Some(c) = crate::sync::lock(&self.0).take() {
            if let Ok(nccl) = api::nccl() {
                // SAFETY: `c` is live and released here once (taken out of the lock).
                let _ = unsafe { (nccl.comm_abort)(c) };
            }
        }
    }

    /// Polls the (non-blocking) communicator once: done, still in progress,
    /// or its asynchronous error naming `what`.
    pub fn probe(&self, what: &str) -> Result<Poll> {
        let guard = self.live()?;
        let Some(comm) = *guard else { return Err(Error::Internal("no communicator".into())) };
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is live under the lock; `state` is a valid out-pointer.
        check_nccl(unsafe { (api::nccl()?.comm_get_async_error)(comm, &mut state) }, "ncclCommGetAsyncError")?;
        match state {
            sys::ncclResult_t::ncclSuccess => Ok(Poll::Done),
            sys::ncclResult_t::ncclInProgress => Ok(Poll::Pending),
            other => Err(Error::Internal(format!("NCCL {what}: asynchronous error {other:?}"))),
        }
    }

    /// Enqueues the sends and receives of one exchange as one group on
    /// `stream` (of the communicator's device), after checking every buffer
    /// against `memory` (sends are only read, but must be the call's too).
    /// Every rank issues its groups in plan order, which pairs them (the
    /// plan tests check that sends and receives match step by step).
    pub(super) fn exchange(
        &self,
        stream: &impl Queue,
        sends: impl IntoIterator<Item = P2p> + Clone,
        recvs: impl IntoIterator<Item = P2p> + Clone,
        memory: &CallMemory<'_>,
    ) -> Result<()> {
        let peer =
            |p: &P2p| c_int::try_from(p.peer).map_err(|_| Error::Internal(format!("peer {} out of range", p.peer)));
        for p in sends.clone() {
            memory.check_read(p.addr, p.bytes, "an NCCL send")?;
            peer(&p)?;
        }
        for p in recvs.clone() {
            memory.check_write(p.addr, p.bytes, "an NCCL receive")?;
            peer(&p)?;
        }
        let guard = self.live()?;
        let Some(comm) = *guard else { return Err(Error::Internal("no communicator".into())) };
        let nccl = api::nccl()?;
        let stream = stream.raw() as sys::cudaStream_t;
        let bytes = sys::ncclDataType_t::ncclUint8;
        // SAFETY: balanced by the `group_end` below.
        check_nccl(unsafe { (nccl.group_start)() }, "ncclGroupStart")?;
        let posted = (|| -> Result<()> {
            for s in sends {
                // SAFETY: `comm` is live under the lock, `stream` while
                // borrowed; the buffer lies in the call's memory (checked).
                let status = unsafe { (nccl.send)(s.addr as *const _, s.bytes, bytes, peer(&s)?, comm, stream) };
                check_nccl(status, "ncclSend")?;
            }
            for r in recvs {
                // SAFETY: as for the sends.
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
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.abort();
    }
}

/// A non-blocking communicator configuration for the loaded NCCL, other
/// fields left to NCCL (`version`: `addresses::nccl_config_version`).
pub type Config = sys::ncclConfig_t;

/// Creates the communicators of a group of `members.len()` ranks sharing
/// `id`, in one NCCL group, for the ranks of this process (`members[rank]`:
/// its CUDA ordinal, `None` for a rank of another process; each device's
/// primary context is made current for its rank). Returns them by rank,
/// whatever NCCL handed out (owned: dropped on failure, each aborted), and
/// whether posting the creation succeeded; creation finishes asynchronously
/// (`Comm::probe`).
pub fn create_group(members: &[Option<i32>], id: UniqueId, config: &Config) -> (Vec<Option<Comm>>, Result<()>) {
    let mut raw: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); members.len()];
    let posted = (|| -> Result<()> {
        let n = c_int::try_from(members.len()).map_err(|_| Error::Internal("group too large".into()))?;
        let nccl = api::nccl()?;
        // SAFETY: no arguments; balanced by the `group_end` below.
        check_nccl(unsafe { (nccl.group_start)() }, "ncclGroupStart")?;
        let posted = (|| -> Result<()> {
            for (rank, (member, comm)) in members.iter().zip(raw.iter_mut()).enumerate() {
                let Some(o) = *member else { continue };
                // Retained for the creation; XLA (and the device cache) hold it too.
                let context = Context::primary(o)?;
                context.make_current()?;
                let mut config = *config;
                // SAFETY: `comm` and `config` are valid for the call; the id is
                // shared by every rank of this group and no other.
                let status = unsafe { (nccl.comm_init_rank_config)(comm, n, id, rank as c_int, &mut config) };
                check_nccl(status, "ncclCommInitRankConfig")?;
            }
            Ok(())
        })();
        // SAFETY: closes the group opened above, also after a failed post.
        let ended = check_nccl(unsafe { (nccl.group_end)() }, "ncclGroupEnd");
        posted.and(ended)
    })();
    let comms = raw.into_iter().map(|c| (!c.is_null()).then(|| Comm(Mutex::new(Some(c))))).collect();
    (comms, posted)
}
