//! The device side of the watchdog (`watchdog`, generic over it): the
//! driver's events recorded around each communicating call and queried by
//! the watchdog thread, and the abort of a timed-out group's communicators.

#![forbid(unsafe_code)]

use super::device::{bound, Device};
use super::driver::{KeptEvent, Queue};
use super::nccl_group::{evict, GroupComms};
use super::watchdog::{Abort, EventSource, Query, Watch, Watchdog, WatchedCall, MAX_MARKS};
use crate::error::{Error, Result};
use std::sync::{Arc, OnceLock, TryLockError};
use std::time::Duration;

/// An event of the watchdog's pool: kept for the process, with its context.
pub type WatchEvent = KeptEvent;

/// The watchdog's device side: the driver's events and NCCL's aborts.
pub struct CudaEvents;

impl EventSource for CudaEvents {
    type Event = WatchEvent;
    type Group = GroupComms;

    fn query(&self, e: WatchEvent) -> Query {
        if e.done() {
            Query::Done
        } else {
            Query::Pending
        }
    }

    /// Evicts the group, then aborts each of its communicators in this
    /// process under its device's lock (the lock every user of that
    /// communicator holds), skipping busy devices until the next poll.
    fn abort(&self, group: &Arc<GroupComms>) -> Abort {
        // First, so that no call gets the group from the cache any more.
        evict(&group.key, group);
        let mut busy = false;
        for (rank, member) in group.members.iter().enumerate() {
            let Some(ordinal) = *member else { continue };
            if !group.is_live(rank) {
                continue;
            }
            // A device no call has bound yet cannot be holding the group
            // (calls bind before asking for communicators, and it is
            // evicted): its communicator is aborted when the group is dropped.
            let Some(device) = bound(ordinal) else { continue };
            let d = match device.try_lock() {
                Ok(d) => d,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    busy = true;
                    continue;
                }
            };
            // NCCL tears the communicator down on its device.
            let _ = d.make_current();
            group.abort_rank(rank);
        }
        if busy {
            Abort::Busy
        } else {
            Abort::Done
        }
    }
}

static WATCHDOG: OnceLock<std::result::Result<Watchdog<CudaEvents>, String>> = OnceLock::new();

/// The process's watchdog, started at the first watched call.
fn watchdog() -> Result<&'static Watchdog<CudaEvents>> {
    WATCHDOG
        .get_or_init(|| Watchdog::start(CudaEvents).map_err(|e| e.message().to_string()))
        .as_ref()
        .map_err(|e| Error::Internal(e.clone()))
}

/// DEADLINE_EXCEEDED if an earlier call on CUDA device `ordinal` timed out on
/// the device since its last call (see `watchdog`); once per timeout.
pub fn check_device_timeouts(ordinal: i32) -> Result<()> {
    match WATCHDOG.get() {
        Some(Ok(w)) => w.check(ordinal),
        _ => Ok(()),
    }
}

/// One call watched for a device-side timeout: events of the pool, the
/// first recorded on XLA's stream before the call's work, the second after
/// its join ([`CallWatch::submit`]), and up to `MAX_MARKS` progress marks
/// recorded on its lanes in between ([`CallWatch::mark`]).
pub struct CallWatch {
    ordinal: i32,
    start: WatchEvent,
    end: WatchEvent,
    marks: [Option<WatchEvent>; MAX_MARKS],
    group: Arc<GroupComms>,
    /// `config::interrupts()` when the call began.
    interrupts: u64,
}

impl CallWatch {
    /// Takes `2 + marks` events (created while the pool has too few: only
    /// while a device has more calls in flight than ever before) and records
    /// the first on `xla`. `device`'s context is current.
    pub fn begin(device: &Device, xla: &impl Queue, group: &Arc<GroupComms>, marks: usize) -> Result<CallWatch> {
        let dog = watchdog()?;
        let interrupts = crate::config::interrupts();
        let take = || match dog.take_event(device.ordinal) {
            Some(e) => Ok(e),
            None => KeptEvent::new(device.ordinal, "cuEventCreate (watchdog)"),
        };
        let start = take()?;
        let end = take().inspect_err(|_| dog.give_back(device.ordinal, &[start]))?;
        let mut watch = CallWatch {
            ordinal: device.ordinal,
            start,
            end,
            marks: [None; MAX_MARKS],
            group: Arc::clone(group),
            interrupts,
        };
        for i in 0..marks.min(MAX_MARKS) {
            match take() {
                Ok(e) => watch.marks[i] = Some(e),
                Err(e) => {
                    watch.cancel();
                    return Err(e);
                }
            }
        }
        match record_on(start, xla) {
            Ok(()) => Ok(watch),
            Err(e) => {
                watch.cancel();
                Err(e)
            }
        }
    }

    /// Records progress mark `mark` on `stream` (a lane of the call).
    pub fn mark(&self, mark: usize, stream: &impl Queue) -> Result<()> {
        match self.marks.get(mark).copied().flatten() {
            Some(e) => record_on(e, stream),
            None => Err(Error::Internal(format!("no progress mark {mark} was taken for this call"))),
        }
    }

    /// Records the second event on `xla` (after the join) and hands the call
    /// to the watchdog, which expires it once it makes no progress on the
    /// device for `timeout`.
    pub fn submit(self, xla: &impl Queue, op: &'static str, site: i64, rank: usize, timeout: Duration) -> Result<()> {
        if let Err(e) = record_on(self.end, xla) {
            self.cancel();
            return Err(e);
        }
        let seq = self.group.count_call(rank);
        watchdog()?.submit(Watch {
            device: self.ordinal,
            start: self.start,
            end: self.end,
            marks: self.marks,
            timeout,
            interrupts: self.interrupts,
            group: self.group,
            call: WatchedCall { op, site, rank, seq },
        });
        Ok(())
    }

    /// Returns the events to the pool (the call failed before it was submitted).
    pub fn cancel(self) {
        if let Ok(dog) = watchdog() {
            dog.give_back(self.ordinal, &[self.start, self.end]);
            for e in self.marks.into_iter().flatten() {
                dog.give_back(self.ordinal, &[e]);
            }
        }
    }
}

/// Records `e` on `stream`: the event is this device's and owned by the
/// call until it is submitted or given back.
fn record_on(e: WatchEvent, stream: &impl Queue) -> Result<()> {
    e.record(stream, "cuEventRecord (watchdog)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::communicators::CommKey;
    use crate::backend::cuda::watchdog::WatchedGroup;

    /// What the watchdog reads of a group (its device ids, the calls each
    /// local rank issued, `None` for a rank of another process), and the
    /// abort of a group with no live communicator: done, touching nothing
    /// (no GPU or NCCL needed).
    #[test]
    fn a_group_tells_the_watchdog_its_devices_and_its_local_ranks_calls() {
        let key = CommKey::fused_ops(vec![5, 1, 7]);
        let group = Arc::new(GroupComms::without_communicators(key, vec![Some(0), None, Some(1)]));
        assert_eq!(group.devices(), &[5, 1, 7]);
        assert_eq!((group.count_call(2), group.count_call(2), group.count_call(0)), (0, 1, 0));
        assert_eq!(
            (group.issued(0), group.issued(1), group.issued(2), group.issued(3)),
            (Some(1), None, Some(2), None)
        );
        assert_eq!(group.count_call(9), 0);
        assert_eq!(CudaEvents.abort(&group), Abort::Done);
    }
}
