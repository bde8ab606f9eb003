//! Enqueues one call's steps on a device ([`CallOps`], the `StreamOps` that
//! `stream_issue` drives): GEMMs with cuBLAS or cuBLASLt, the sum kernels,
//! NCCL send/receive groups, events between the lanes and the watchdog's
//! progress marks, all on the device's internal streams forked from XLA's.

use super::addresses::{grid, poll_until, Addr, Bases, DeviceOp, SumLaunch, BLOCK, MAX_TERMS};
use super::api::{self, check_cu};
use super::device::Device;
use super::device_watch::CallWatch;
use super::nccl::{self, P2p};
use super::nccl_group::probe;
use super::site_ops::SiteOps;
use super::stream_issue::StreamOps;
use super::{fp8_gemm, gemm};
use crate::error::{Error, Result};
use crate::plan::Step;
use cudarc::cublaslt::sys as ltsys;
use cudarc::driver::sys as dsys;
use cudarc::nccl::sys as nsys;
use std::ffi::c_void;
use std::ptr;
use std::time::Instant;

/// Enqueues one call's steps: lanes `Compute`/`Comm` on the device's
/// internal streams, the caller's stream being XLA's.
pub struct CallOps<'a> {
    pub device: &'a mut Device,
    pub xla: *mut c_void,
    /// The site's device operations, and where this call's buffers are.
    pub site: &'a SiteOps,
    pub bases: Bases,
    pub comm: Option<nsys::ncclComm_t>,
    pub deadline: Instant,
    /// Set when a communicator failed or timed out: the caller aborts and evicts it.
    pub comm_failed: bool,
    /// float32 GEMMs may use TF32 (the op's precision allows it).
    pub tf32: bool,
    /// An fp8 call's GEMM workspace in XLA's workspace (`workspace::CudaLayout`).
    pub fp8_workspace: Option<(u64, usize)>,
    /// The call's device-timeout watch, whose progress marks the lanes record.
    pub watch: Option<&'a CallWatch>,
}

impl CallOps<'_> {
    /// Prepares the device for a call needing `events` events.
    pub fn prepare(device: &mut Device, events: usize) -> Result<()> {
        device.make_current()?;
        device.reserve_events(events)
    }

    fn stream(&self, stream: Option<usize>) -> Result<dsys::CUstream> {
        match stream {
            None => Ok(self.xla as dsys::CUstream),
            Some(l) => self
                .site
                .lane_streams
                .get(l)
                .and_then(|&s| self.device.lane_stream(s))
                .ok_or_else(|| Error::Internal(format!("no lane {l}"))),
        }
    }

    fn event(&self, event: usize) -> Result<dsys::CUevent> {
        self.device.event(event).ok_or_else(|| Error::Internal(format!("no event {event}")))
    }

    fn exchange(&mut self, stream: dsys::CUstream, sends: &[P2p<Addr>], recvs: &[P2p<Addr>]) -> Result<()> {
        let comm = self.comm.ok_or_else(|| Error::Internal("an exchange without a communicator".into()))?;
        // SAFETY: `comm` is this device's communicator of the group, `stream`
        // its communication stream; the addresses are inside XLA's buffers
        // (lowered by the resolver, bound to buffers `SiteOps::bind` checked),
        // which live until XLA's stream passes the join event, after these
        // transfers.
        let bases = self.bases;
        let posted = unsafe {
            nccl::enqueue_exchange(
                comm,
                stream as nsys::cudaStream_t,
                sends.iter().map(|p| p.bind(&bases)),
                recvs.iter().map(|p| p.bind(&bases)),
            )
        };
        // Non-blocking communicators may still be connecting or enqueueing:
        // wait (host side, bounded) until NCCL has taken the group.
        let result = posted.and_then(|()| {
            // SAFETY: `comm` is live.
            poll_until(self.deadline, "an NCCL send/receive group (a peer may not have joined)", || unsafe {
                probe(comm, "send/receive")
            })
        });
        if result.is_err() {
            self.comm_failed = true;
        }
        result
    }

    fn launch_sum(&mut self, stream: dsys::CUstream, launch: &SumLaunch<Addr>) -> Result<()> {
        if launch.n == 0 {
            return Ok(());
        }
        let launch = launch.bind(&self.bases);
        let f = self.device.sum_kernel(launch.kernel)?.0;
        let (mut out, mut terms, mut k, mut n) = (launch.dst, launch.kernel_terms(), launch.k, launch.n);
        // The kernel's parameters: (T* dst, Terms terms, int k, u64 n),
        // `Terms` being eight pointers by value, laid out as `[u64; 8]`.
        let mut params: [*mut c_void; 4] = [
            (&mut out as *mut u64).cast(),
            (&mut terms as *mut [u64; MAX_TERMS]).cast(),
            (&mut k as *mut i32).cast(),
            (&mut n as *mut u64).cast(),
        ];
        let grid = grid(launch.n, self.device.multiprocessors);
        // SAFETY: `f` is a function of this device's module with exactly
        // these parameters; their values live across the call (the driver
        // copies them); the addresses are inside XLA's buffers (checked by
        // the resolver), alive until the join.
        let launch_kernel = api::driver()?.launch_kernel;
        let launched =
            unsafe { launch_kernel(f, grid, 1, 1, BLOCK, 1, 1, 0, stream, params.as_mut_ptr(), ptr::null_mut()) };
        check_cu(launched, "cuLaunchKernel")
    }
}

impl StreamOps for CallOps<'_> {
    fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        let (s, e) = (self.stream(stream)?, self.event(event)?);
        // SAFETY: both handles are live (XLA's stream for the call, ours cached).
        unsafe { api::event_record(e, s, "cuEventRecord") }
    }

    fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        let (s, e) = (self.stream(stream)?, self.event(event)?);
        // SAFETY: as in `record`.
        unsafe { api::stream_wait_event(s, e) }
    }

    fn mark(&mut self, lane: usize, mark: usize) -> Result<()> {
        match self.watch {
            Some(watch) => watch.mark(mark, self.stream(Some(lane))?),
            None => Ok(()),
        }
    }

    fn run(&mut self, lane: usize, step: &Step) -> Result<()> {
        let stream = self.stream(Some(lane))?;
        let site = self.site;
        let ops = site.steps.get(step.id).ok_or_else(|| Error::Internal(format!("no step {}", step.id)))?;
        for op in ops {
            match op {
                DeviceOp::Gemm { gemm, ops, accumulate } => {
                    let handle = self.device.blas_for(stream)?.raw();
                    // SAFETY: `handle` is bound to this lane's stream in this
                    // device's (current) context; the resolver placed every
                    // view inside the call's buffers (`SiteOps::bind` checked
                    // them), alive until the join.
                    unsafe { gemm::enqueue(handle, gemm, ops.bind(&self.bases), *accumulate, self.tf32) }?;
                }
                DeviceOp::Fp8Gemm(g) => {
                    let call = g.bind(&self.bases).lower(self.device.capability)?;
                    let handle = self.device.lt_handle()?.raw();
                    let workspace = self.fp8_workspace.ok_or_else(|| {
                        Error::Internal("an fp8 GEMM without its workspace in the call's workspace".into())
                    })?;
                    // SAFETY: the handle belongs to this device's (current)
                    // context; the resolver placed the operands, result and
                    // scales inside XLA's buffers, and the workspace is the
                    // call's own part of XLA's workspace (the call's GEMMs
                    // all run on this one stream), alive until the join.
                    unsafe { fp8_gemm::enqueue(handle, stream as ltsys::cudaStream_t, &call, workspace) }?;
                }
                DeviceOp::Sum(launch) => self.launch_sum(stream, launch)?,
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
    use crate::backend::cuda::emulate::{cases, fill, reference};
    use crate::backend::cuda::handles::{Context, DeviceMemory, Stream};
    use crate::backend::cuda::libs::Lib;
    use crate::backend::cuda::stream_issue::issue;
    use crate::backend::cuda::{device, nccl_group};
    use crate::dtype::DType;
    use crate::plan::{plan, Schedule};
    use crate::problem::{Operand, Problem};
    use std::time::Duration;

    /// Runs `case` on device `ordinal` as rank `rank` of a group of the
    /// first `n` CUDA devices; returns the output bytes.
    fn run_on(ordinal: i32, rank: usize, n: usize, case: &super::super::emulate::Case, schedule: Schedule) -> Vec<u8> {
        let context = Context::primary(ordinal).unwrap();
        context.make_current().unwrap();
        // Plays XLA's stream.
        let xla = Stream::new().unwrap();
        let stream = xla.raw();
        let (kind, x, w, out) = case;
        let op = |dims| Operand { dims, dtype: DType::F32 };
        let problem = Problem::new(*kind, op(x), op(w), op(out), 0, n).unwrap();
        let sizes = problem.sizes();
        let p = plan(kind.pattern(), schedule, n, rank);
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
        let deadline = Instant::now() + Duration::from_secs(60);
        let device = device::bind(stream as *mut c_void).unwrap();
        let comms = (n > 1).then(|| {
            let key = CommKey::fused_ops((0..n as i64).collect());
            let members: Vec<Option<i32>> = (0..n as i32).map(Some).collect();
            let d = device.lock().unwrap();
            nccl_group::group_comms(&key, &members, None, &d, deadline).unwrap()
        });
        let mut d = device.lock().unwrap();
        CallOps::prepare(&mut d, site.events).unwrap();
        let mut ops = CallOps {
            device: &mut d,
            xla: stream as *mut c_void,
            site: &site,
            bases,
            comm: comms.as_ref().map(|c| c.rank(rank).unwrap()),
            deadline,
            comm_failed: false,
            tf32: false,
            fp8_workspace: None,
            watch: None,
        };
        issue(&p, &site.streams, &mut ops, 0, None).unwrap();
        drop(d);
        // SAFETY: `stream` is live; the test (not the hot path) waits for it.
        unsafe { api::stream_synchronize(stream) }.unwrap();
        outd.read(sizes.result * 4).unwrap()
    }

    /// The CUDA devices of this process; fails (these tests run only when
    /// asked for, on a GPU host) when the libraries or a GPU are missing.
    fn usable_devices() -> i32 {
        api::require(&[Lib::Driver, Lib::Cublas, Lib::Nccl, Lib::Nvrtc]).unwrap();
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
                let got = run_on(0, 0, 1, &case, schedule);
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
                let got: Vec<Vec<u8>> = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..n)
                        .map(|r| {
                            s.spawn({
                                let case = &case;
                                move || run_on(r as i32, r, n, case, schedule)
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                let want = reference(&case, schedule, n, site);
                for r in 0..n {
                    assert!(got[r] == want[r], "{:?} {schedule:?}: rank {r} of {n} differs on the GPUs", case.0);
                }
            }
        }
    }
}
