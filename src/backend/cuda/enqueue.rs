//! Enqueues one call's steps on a device ([`CallOps`], the `StreamOps` that
//! `stream_issue` drives): GEMMs with cuBLAS or cuBLASLt, the sum kernels,
//! exchanges (NCCL send/receive groups, the copy transport, or the one-rank
//! mode's paced copies), events between the lanes and the watchdog's
//! progress marks, all on the device's internal streams forked from XLA's,
//! through the safe layers (`driver`, `blas`, `nccl`), which check every
//! address against the call's memory.
#![forbid(unsafe_code)]

use super::addresses::{poll_until, Addr, Bases, DeviceOp, P2p};
use super::communicators::CommKey;
use super::copies::{self, CallId, Deadline};
use super::copy_links::{CopyLane, CudaMailbox};
use super::device::Device;
use super::device_watch::CallWatch;
use super::driver::{self, CallMemory, CallStream, Event, Stream};
use super::nccl::Comm;
use super::site_ops::SiteOps;
use super::solo::{PacedQueue, SoloLink, StepClock};
use super::stream_issue::StreamOps;
use crate::error::{Error, Result};
use crate::plan::Step;
use std::sync::Arc;
use std::time::Instant;

/// How one call's exchanges go: NCCL on this rank's communicator, the copy
/// transport through the group's mailbox, or, for one rank measured alone,
/// paced copies from its inbox.
#[derive(Clone, Copy)]
pub enum Exchanges<'a> {
    Nccl(&'a Comm),
    Copies {
        mailbox: &'a CudaMailbox,
        key: &'a CommKey,
        rank: usize,
        call: CallId,
    },
    /// One rank alone on the device, its peers played by paced copies (`solo`).
    Solo(&'a SoloLink),
}

/// Enqueues one call's steps: lanes `Compute`/`Comm` on the device's
/// internal streams, the caller's stream being XLA's.
pub struct CallOps<'a> {
    pub device: &'a Device,
    pub xla: &'a CallStream<'a>,
    /// The site's device operations, and where this call's buffers are.
    pub site: &'a SiteOps,
    pub bases: Bases,
    /// The memory the call's work may touch (XLA's buffers of the call).
    pub memory: &'a CallMemory<'a>,
    /// How the call's exchanges go (none for a plan without any).
    pub transport: Option<Exchanges<'a>>,
    pub deadline: Instant,
    /// `config::interrupts()` when the call began.
    pub interrupts: u64,
    /// Set when a communicator failed or timed out: the caller aborts and evicts it.
    pub comm_failed: bool,
    /// float32 GEMMs may use TF32 (the op's precision allows it).
    pub tf32: bool,
    /// An fp8 call's GEMM workspace in XLA's workspace (`workspace::CudaLayout`).
    pub fp8_workspace: Option<(u64, usize)>,
    /// The call's device-timeout watch, whose progress marks the lanes record.
    pub watch: Option<&'a CallWatch>,
}

impl<'a> CallOps<'a> {
    /// Prepares the device for a call needing `events` events.
    pub fn prepare(device: &mut Device, events: usize) -> Result<()> {
        device.make_current()?;
        device.reserve_events(events)
    }

    /// The device stream of schedule lane `l` (`site_ops::lane_stream`).
    fn lane_index(&self, l: usize) -> Result<usize> {
        self.site.lane_streams.get(l).copied().ok_or_else(|| Error::Internal(format!("no lane {l}")))
    }

    pub(super) fn lane(&self, l: usize) -> Result<&'a Stream> {
        let index = self.lane_index(l)?;
        self.device.lane_stream(index).ok_or_else(|| Error::Internal(format!("no lane {l}")))
    }

    fn event(&self, event: usize) -> Result<&'a Event> {
        self.device.event(event).ok_or_else(|| Error::Internal(format!("no event {event}")))
    }

    fn exchange(&mut self, stream: &'a Stream, sends: &[P2p<Addr>], recvs: &[P2p<Addr>]) -> Result<()> {
        let bases = self.bases;
        let result = match self.transport {
            None => Err(Error::Internal("an exchange without a transport".into())),
            Some(Exchanges::Nccl(comm)) => {
                let posted = comm.exchange(
                    stream,
                    sends.iter().map(|p| p.bind(&bases)),
                    recvs.iter().map(|p| p.bind(&bases)),
                    self.memory,
                );
                // Non-blocking communicators may still be connecting or
                // enqueueing: wait (host side, bounded) until NCCL has taken the group.
                posted.and_then(|()| {
                    poll_until(self.deadline, "an NCCL send/receive group (a peer may not have joined)", || {
                        comm.probe("send/receive")
                    })
                })
            }
            Some(Exchanges::Copies { mailbox, key, rank, call }) => {
                let bind = |list: &[P2p<Addr>]| list.iter().map(|p| p.bind(&bases)).collect::<Vec<_>>();
                let (sends, recvs) = (bind(sends), bind(recvs));
                let mut lane = CopyLane { key, rank, ordinal: self.device.ordinal, stream, memory: self.memory };
                let deadline = Deadline { at: self.deadline, interrupts: self.interrupts };
                copies::exchange(mailbox, call, rank, &sends, &recvs, &mut lane, deadline)
            }
            Some(Exchanges::Solo(link)) => {
                let bind = |list: &[P2p<Addr>]| list.iter().map(|p| p.bind(&bases)).collect::<Vec<_>>();
                let mut lane = PacedLane { stream, memory: self.memory };
                link.exchange(&bind(sends), &bind(recvs), &mut lane)
            }
        };
        if result.is_err() {
            self.comm_failed = true;
        }
        result
    }
}

/// The one-rank mode's pacing on one of a call's streams: copies on the
/// stream, marks and holds on the driver's host thread as the stream
/// reaches them.
struct PacedLane<'a> {
    stream: &'a Stream,
    memory: &'a CallMemory<'a>,
}

impl PacedQueue for PacedLane<'_> {
    fn start(&mut self, clock: &Arc<StepClock>) -> Result<()> {
        let clock = Arc::clone(clock);
        driver::launch_host(self.stream, Box::new(move || clock.mark_start()))
    }
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        driver::copy(self.stream, dst, src, bytes, self.memory)
    }
    fn hold(&mut self, clock: &Arc<StepClock>, after_ns: u64, last: bool) -> Result<()> {
        let clock = Arc::clone(clock);
        driver::launch_host(self.stream, Box::new(move || clock.hold_until(after_ns, last)))
    }
}

impl StreamOps for CallOps<'_> {
    fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        let e = self.event(event)?;
        match stream {
            None => e.record(self.xla, "cuEventRecord"),
            Some(l) => e.record(self.lane(l)?, "cuEventRecord"),
        }
    }

    fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        let e = self.event(event)?;
        match stream {
            None => e.wait_on(self.xla),
            Some(l) => e.wait_on(self.lane(l)?),
        }
    }

    fn mark(&mut self, lane: usize, mark: usize) -> Result<()> {
        match self.watch {
            Some(watch) => watch.mark(mark, self.lane(lane)?),
            None => Ok(()),
        }
    }

    fn run(&mut self, lane: usize, step: &Step) -> Result<()> {
        let (site, device, memory) = (self.site, self.device, self.memory);
        let stream = self.lane(lane)?;
        let ops = site.steps.get(step.id).ok_or_else(|| Error::Internal(format!("no step {}", step.id)))?;
        for op in ops {
            match op {
                DeviceOp::Gemm { gemm, ops, accumulate } => {
                    let handle = device.blas(self.lane_index(lane)?)?;
                    handle.gemm(gemm, ops.bind(&self.bases), *accumulate, self.tf32, memory)?;
                }
                DeviceOp::Fp8Gemm(g) => {
                    let call = g.bind(&self.bases).lower(device.capability)?;
                    let workspace = self.fp8_workspace.ok_or_else(|| {
                        Error::Internal("an fp8 GEMM without its workspace in the call's workspace".into())
                    })?;
                    // The call's own part of XLA's workspace: the call's GEMMs
                    // all run on this one stream.
                    device.lt_handle()?.matmul(stream, &call, workspace, memory)?;
                }
                DeviceOp::Sum(launch) => {
                    device.sums().launch(stream, &launch.bind(&self.bases), memory, device.multiprocessors)?
                }
                DeviceOp::Exchange { sends, recvs } => self.exchange(stream, sends, recvs)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::addresses::{DeviceBuffers, Region};
    use crate::backend::cuda::communicators::CommKey;
    use crate::backend::cuda::driver::{synchronize, Context, DeviceMemory};
    use crate::backend::cuda::emulate::{cases, fill, problem_of, reference, schedules};
    use crate::backend::cuda::libs::Lib;
    use crate::backend::cuda::stream_issue::issue;
    use crate::backend::cuda::{device, nccl_group};
    use crate::dtype::DType;
    use crate::plan::{plan, Schedule};
    use std::time::Duration;

    /// One rank's part of a device test: its CUDA device, its slot there
    /// (several ranks on one device each take their own, `device::bind_as`),
    /// and how the group exchanges (with the group's key for copies).
    struct Rank {
        ordinal: i32,
        slot: usize,
        rank: usize,
        n: usize,
        copies: Option<CommKey>,
        timeout: Duration,
    }

    impl Rank {
        fn nccl(ordinal: i32, rank: usize, n: usize) -> Rank {
            Rank { ordinal, slot: 0, rank, n, copies: None, timeout: Duration::from_secs(60) }
        }
    }

    /// Runs `case` as `me` describes; returns the output bytes.
    fn run_on(me: &Rank, case: &super::super::emulate::Case, schedule: Schedule) -> Vec<u8> {
        try_run_on(me, case, schedule).unwrap()
    }

    /// [`run_on`], or the error the call's enqueueing ended in.
    fn try_run_on(me: &Rank, case: &super::super::emulate::Case, schedule: Schedule) -> Result<Vec<u8>> {
        let (ordinal, rank, n) = (me.ordinal, me.rank, me.n);
        let context = Context::primary(ordinal).unwrap();
        context.make_current().unwrap();
        // Plays XLA's stream.
        let xla_stream = Stream::new().unwrap();
        let xla = CallStream::playing_xla(&xla_stream).unwrap();
        let problem = problem_of(case, n, schedule);
        let sizes = problem.sizes();
        let p = plan(problem.pattern(), schedule, n, rank);
        let site = SiteOps::new(&problem, &p).unwrap();
        let memory = |bytes: &[u8]| DeviceMemory::with(bytes, "cuMemAlloc (test)").unwrap();
        let (xd, wd) = (memory(&fill(sizes.x, rank)), memory(&fill(sizes.w, 100 + rank)));
        let outd = memory(&vec![0xff; sizes.result * 4]);
        let wsd = memory(&vec![0; site.layout.total()]);
        let region = |m: &DeviceMemory, elems: usize| Region { addr: m.addr(), bytes: elems * 4, dtype: DType::F32 };
        let buffers = DeviceBuffers {
            x: region(&xd, sizes.x),
            w: region(&wd, sizes.w),
            out: region(&outd, sizes.result),
            workspace: (wsd.addr(), site.layout.total()),
            scales: None,
        };
        let bases = site.bind(&buffers).unwrap();
        let deadline = Instant::now() + me.timeout;
        let device = device::bind_as(&xla, me.slot).unwrap();
        let call_memory = CallMemory::of_owned(&[&xd, &wd, &outd, &wsd]);
        let comms = (n > 1 && me.copies.is_none()).then(|| {
            // Ranks in device slots share one GPU (NCCL 2.30+ with
            // NCCL_MULTI_RANK_GPU_ENABLE=1); otherwise rank r is GPU r.
            let (key, members): (CommKey, Vec<Option<i32>>) = if me.slot > 0 {
                (CommKey::fused_ops((7200..7200 + n as i64).collect()), vec![Some(me.ordinal); n])
            } else {
                (CommKey::fused_ops((0..n as i64).collect()), (0..n as i32).map(Some).collect())
            };
            let d = device.lock().unwrap();
            nccl_group::group_comms(&key, &members, None, &d, deadline).unwrap()
        });
        let mailbox = me.copies.as_ref().map(crate::backend::cuda::copy_links::mailbox);
        let transport = match (&comms, &mailbox, &me.copies) {
            (Some(c), _, _) => Some(Exchanges::Nccl(c.rank(rank).unwrap())),
            (None, Some(m), Some(key)) => {
                Some(Exchanges::Copies { mailbox: m, key, rank, call: CallId { site: 0x7e57, run: 0 } })
            }
            _ => None,
        };
        let mut d = device.lock().unwrap();
        CallOps::prepare(&mut d, site.events).unwrap();
        let mut ops = CallOps {
            device: &d,
            xla: &xla,
            site: &site,
            bases,
            memory: &call_memory,
            transport,
            deadline,
            interrupts: crate::config::interrupts(),
            comm_failed: false,
            tf32: false,
            fp8_workspace: None,
            watch: None,
        };
        let issued = issue(&p, &site.streams, &mut ops, 0, None);
        drop(d);
        synchronize(&xla).unwrap();
        issued.map(|()| outd.read(sizes.result * 4).unwrap())
    }

    /// Every rank of `n` on a thread of its own (as XLA runs the devices),
    /// `rank(r)` saying where and how rank r runs; checks each rank's output
    /// against the CPU backend's, naming `place` when one differs.
    fn every_rank_as_the_cpu_backend(
        n: usize,
        case: &super::super::emulate::Case,
        schedule: Schedule,
        site: i64,
        place: &str,
        rank: impl Fn(usize) -> Rank + Sync,
    ) {
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let rank = &rank;
            let handles: Vec<_> = (0..n).map(|r| s.spawn(move || run_on(&rank(r), case, schedule))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want = reference(case, schedule, n, site);
        for r in 0..n {
            assert!(got[r] == want[r], "{:?} {schedule:?}: rank {r} of {n} differs {place}", case.0);
        }
    }

    /// The CUDA devices of this process; fails (these tests run only when
    /// asked for, on a GPU host) when the libraries or a GPU are missing.
    fn usable_devices() -> i32 {
        crate::backend::cuda::api::require(&[Lib::Driver, Lib::Cublas, Lib::Nccl, Lib::Nvrtc]).unwrap();
        let n = device::device_count().unwrap();
        assert!(n > 0, "no CUDA device is visible");
        n
    }

    /// The device path on one real GPU, every op kind, against the CPU backend.
    #[test]
    #[ignore = "needs a CUDA GPU: scripts/gpu_device_check.sh runs it"]
    fn one_gpu_runs_every_op_as_the_cpu_backend_does() {
        usable_devices();
        let mut site = 0x6e00;
        for case in cases(1) {
            for schedule in [Schedule::Ring, Schedule::Sequential] {
                site += 1;
                let got = run_on(&Rank::nccl(0, 0, 1), &case, schedule);
                assert!(got == reference(&case, schedule, 1, site)[0], "{:?} {schedule:?} differs on the GPU", case.0);
            }
        }
    }

    /// All local GPUs as one group (NCCL communicators created together,
    /// one thread per device, as XLA runs them), every op kind and schedule.
    #[test]
    #[ignore = "needs 2 or more CUDA GPUs: scripts/gpu_device_check.sh runs it where there are"]
    fn all_local_gpus_run_every_op_as_the_cpu_backend_does() {
        let n = usable_devices().min(8) as usize;
        assert!(n >= 2, "this test needs 2 or more CUDA GPUs, found {n}");
        let mut site = 0x6f00;
        for case in cases(n as i64) {
            for schedule in [Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential] {
                site += 1;
                every_rank_as_the_cpu_backend(n, &case, schedule, site, "on the GPUs", |r| Rank::nccl(r as i32, r, n));
            }
        }
    }

    /// N = 2, 4 and 8 ranks on GPU 0, each with its own streams, exchanging
    /// by copies: every op kind and schedule, bit for bit as the CPU backend.
    #[test]
    #[ignore = "needs a CUDA GPU: scripts/gpu_device_check.sh runs it"]
    fn several_ranks_on_one_gpu_run_every_op_with_copies_as_the_cpu_backend_does() {
        usable_devices();
        let mut site = 0x7100;
        for n in [2usize, 4, 8] {
            let key = CommKey::fused_ops((7000..7000 + n as i64).collect());
            for case in cases(n as i64) {
                for schedule in schedules(case.0) {
                    site += 1;
                    every_rank_as_the_cpu_backend(n, &case, schedule, site, "on GPU 0", |r| Rank {
                        slot: 1 + r,
                        copies: Some(key.clone()),
                        ..Rank::nccl(0, r, n)
                    });
                }
            }
        }
    }

    /// Two ranks on GPU 0 over NCCL (2.30 or later, which accepts several
    /// ranks on one GPU with NCCL_MULTI_RANK_GPU_ENABLE=1): every op kind and
    /// schedule, bit for bit as the CPU backend.
    #[test]
    #[ignore = "needs a CUDA GPU and NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1: scripts/gpu_device_check.sh runs it"]
    fn two_ranks_on_one_gpu_run_every_op_over_nccl_as_the_cpu_backend_does() {
        usable_devices();
        let version = crate::backend::cuda::nccl::version_code().unwrap();
        assert!(version >= 23000, "NCCL {version} refuses several ranks on one GPU: 2.30 or later is needed");
        assert_eq!(std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").as_deref(), Ok("1"), "set NCCL_MULTI_RANK_GPU_ENABLE=1");
        let n = 2;
        let mut site = 0x7300;
        for case in cases(n as i64) {
            for schedule in schedules(case.0) {
                site += 1;
                every_rank_as_the_cpu_backend(n, &case, schedule, site, "on GPU 0 over NCCL", |r| Rank {
                    slot: 1 + r,
                    ..Rank::nccl(0, r, n)
                });
            }
        }
    }

    /// A rank that never arrives: the others end in DEADLINE_EXCEEDED naming
    /// it, and their streams still finish (nothing waits on the device).
    #[test]
    #[ignore = "needs a CUDA GPU: scripts/gpu_device_check.sh runs it"]
    fn a_rank_that_never_arrives_ends_the_copy_transport_on_one_gpu_with_a_deadline() {
        usable_devices();
        let n = 4;
        let key = CommKey::fused_ops((7100..7100 + n as i64).collect());
        let case = &cases(n as i64)[0];
        let errors: Vec<Error> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .filter(|&r| r != 2)
                .map(|r| {
                    let me = Rank {
                        slot: 1 + r,
                        copies: Some(key.clone()),
                        timeout: Duration::from_millis(500),
                        ..Rank::nccl(0, r, n)
                    };
                    s.spawn(move || try_run_on(&me, case, Schedule::Ring).expect_err("rank 2 never arrives"))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for e in errors {
            assert!(matches!(&e, Error::DeadlineExceeded(m) if m.contains("ranks [2]")), "{e}");
        }
    }
}
