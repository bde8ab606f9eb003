//! The one-rank mode (`solo`) on GPU 0: runs rank r's call of an N-rank
//! group alone, timed on the device's global timer, and the benchmark a
//! GPU user runs over it (`bench`, behind `commfuse_one_rank_bench` and
//! `python -m commfuse.bench_gpu`): the fused call against one GEMM of the
//! same work, the paced transfers alone and the per-peer GEMMs alone.
#![forbid(unsafe_code)]

use super::addresses::{DeviceBuffers, DeviceOp, Region};
use super::device;
use super::driver::{synchronize, CallMemory, CallStream, Context, DeviceMemory, PaceKernels, Stream};
use super::enqueue::{CallOps, Exchanges};
use super::kernels::{self, ImageCache, Target};
use super::site_ops::SiteOps;
use super::solo::{Inbox, LinkReport, Pace, SoloLink};
use super::stream_issue::{self, issue};
use crate::abi::{self, CallShapes};
use crate::error::{Error, Result};
use crate::plan::{plan, Schedule};
use crate::problem::{OpKind, Problem};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Which of a call's operations run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    All,
    /// The GEMMs and sums alone (exchanges left out).
    Compute,
    /// The paced exchanges alone.
    Transfers,
}

/// What the absent peers send.
pub enum Messages {
    /// Per peer, its messages to this rank in order (`emulate::solo_inbox`).
    Exact(Vec<Vec<Vec<u8>>>),
    /// Bytes of no meaning (timing only).
    Any,
}

/// One rank's call, alone on GPU 0.
pub struct SoloCall<'a> {
    /// The problem as the schedule cuts it (`Problem::for_schedule`).
    pub problem: &'a Problem,
    pub schedule: Schedule,
    pub n: usize,
    pub rank: usize,
    pub x: &'a [u8],
    pub w: &'a [u8],
    pub messages: Messages,
    pub pace: Pace,
    pub part: Part,
    /// float32 GEMMs may use TF32.
    pub tf32: bool,
    pub reps: usize,
}

pub struct SoloResult {
    pub out: Vec<u8>,
    /// Each repetition's call, start to end on XLA's stream (device clock).
    pub seconds: Vec<f64>,
    /// The link rate the last repetition achieved.
    pub link: LinkReport,
}

/// A device slot of GPU 0 that no call of XLA's uses (`device::bind_as`).
const SLOT: usize = 0x501;

/// Runs `call` `call.reps` times on GPU 0 (see the module's doc).
pub fn run(call: &SoloCall) -> Result<SoloResult> {
    if call.problem.input.is_fp8() {
        return Err(Error::Unimplemented("the one-rank mode does not run fp8 calls".into()));
    }
    let context = Context::primary(0)?;
    context.make_current()?;
    let stream = Stream::new()?;
    let xla = CallStream::playing_xla(&stream)?;
    let sizes = call.problem.sizes();
    let p = plan(call.problem.kind.pattern(), call.schedule, call.n, call.rank);
    let mut site = SiteOps::new(call.problem, &p)?;
    let largest_message = site
        .steps
        .iter()
        .flatten()
        .filter_map(|op| match op {
            DeviceOp::Exchange { recvs, .. } => recvs.iter().map(|r| r.bytes).max(),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    for ops in &mut site.steps {
        ops.retain(|op| match (call.part, op) {
            (Part::All, _) => true,
            (Part::Compute, op) => !matches!(op, DeviceOp::Exchange { .. }),
            (Part::Transfers, op) => matches!(op, DeviceOp::Exchange { .. }),
        });
    }
    let (x_bytes, w_bytes) = (sizes.x * sizes.input.size(), sizes.w * sizes.input.size());
    let out_bytes = sizes.result * sizes.output.size();
    if call.x.len() != x_bytes || call.w.len() != w_bytes {
        return Err(Error::InvalidArgument(format!(
            "the one-rank mode's x and w have {} and {} bytes; the problem needs {x_bytes} and {w_bytes}",
            call.x.len(),
            call.w.len()
        )));
    }
    let with = |bytes: &[u8]| DeviceMemory::with(bytes, "cuMemAlloc (one-rank mode)");
    let zeroed = |bytes: usize| with(&vec![0; bytes]);
    let (xd, wd, outd, wsd) = (with(call.x)?, with(call.w)?, zeroed(out_bytes)?, zeroed(site.layout.total())?);
    let mut inbox_memory = Vec::new();
    let inbox = match &call.messages {
        Messages::Exact(peers) => {
            let mut addresses = Vec::with_capacity(peers.len());
            for messages in peers {
                let mut list = Vec::with_capacity(messages.len());
                for m in messages {
                    let d = with(m)?;
                    list.push((d.addr(), m.len()));
                    inbox_memory.push(d);
                }
                addresses.push(list);
            }
            Inbox::Messages(addresses)
        }
        Messages::Any => {
            // 0x3e3e is a bfloat16 near 0.19 and 0x3e3e3e3e a float32 near 0.19: ordinary numbers.
            let d = with(&vec![0x3e; largest_message])?;
            let inbox = Inbox::Any { addr: d.addr(), bytes: largest_message };
            inbox_memory.push(d);
            inbox
        }
    };
    // Sends are cut to the sink's size (`SoloLink::exchange`).
    let sink = zeroed(call.pace.chunk().min(64 << 20))?;
    // The call's start and end on the device's global timer.
    let clock = zeroed(16)?;
    let link = SoloLink::new(inbox, (sink.addr(), sink.bytes()), call.pace);
    let mut owned: Vec<&DeviceMemory> = vec![&xd, &wd, &outd, &wsd, &sink, &clock];
    owned.extend(inbox_memory.iter());
    let memory = CallMemory::of_owned(&owned);
    let buffers = DeviceBuffers {
        x: Region { addr: xd.addr(), bytes: x_bytes, dtype: sizes.input },
        w: Region { addr: wd.addr(), bytes: w_bytes, dtype: sizes.input },
        out: Region { addr: outd.addr(), bytes: out_bytes, dtype: sizes.output },
        workspace: (wsd.addr(), site.layout.total()),
        scales: None,
    };
    let bases = site.bind(&buffers)?;
    let device = device::bind_as(&xla, SLOT)?;
    let mut d = crate::sync::lock(&device);
    let target = Target::for_device(d.capability.0, d.capability.1, &kernels::supported_archs()?)?;
    static IMAGES: std::sync::OnceLock<ImageCache> = std::sync::OnceLock::new();
    let pace_kernels = PaceKernels::load(&IMAGES.get_or_init(ImageCache::default).get(&target, kernels::PACE)?)?;
    CallOps::prepare(&mut d, site.events)?;
    let (mut seconds, mut report) = (Vec::new(), LinkReport { bytes: 0, seconds: 0.0, bytes_per_s: 0.0 });
    for _ in 0..call.reps.max(1) {
        link.begin_call();
        let mut ops = CallOps {
            device: &d,
            xla: &xla,
            site: &site,
            bases,
            memory: &memory,
            transport: Some(Exchanges::Solo(&link)),
            deadline: Instant::now() + Duration::from_secs(60),
            interrupts: crate::config::interrupts(),
            comm_failed: false,
            tf32: call.tf32,
            fp8_workspace: None,
            watch: None,
        };
        let issued = pace_kernels.stamp(&xla, clock.addr(), &memory).and_then(|()| {
            // A failed issue leaves work on the lanes: joined back into XLA's
            // stream all the same, so the synchronisation below covers it
            // before any memory is freed.
            issue(&p, &site.streams, &mut ops, 0, None)
                .inspect_err(|_| drop(stream_issue::join_lanes(&site.streams, &mut ops)))
                .and_then(|()| pace_kernels.stamp(&xla, clock.addr() + 8, &memory))
        });
        synchronize(&xla)?;
        issued?;
        let words = clock.read(16)?;
        let time = |i: usize| words.get(8 * i..8 * i + 8).and_then(|w| w.try_into().ok()).map_or(0, u64::from_le_bytes);
        seconds.push(time(1).saturating_sub(time(0)) as f64 / 1e9);
        report = LinkReport::of(&link.steps(), call.pace);
    }
    drop(pace_kernels);
    Ok(SoloResult { out: outd.read(out_bytes)?, seconds, link: report })
}

/// One benchmark case: a call's shapes (as `commfuse_prepare` takes them),
/// the rank it runs, the link it is paced to and the repetitions.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchRequest {
    pub call: CallShapes,
    #[serde(default)]
    pub rank: usize,
    /// A cost-model machine whose link paces the transfers (`Pace::of_machine`).
    pub machine: String,
    #[serde(default = "default_reps")]
    pub reps: usize,
}

fn default_reps() -> usize {
    10
}

/// Medians of one case on the GPU, in seconds.
#[derive(Debug, Serialize)]
pub struct BenchRow {
    pub schedule: String,
    /// The fused call.
    pub fused_s: f64,
    /// One GEMM of the same total work (a group of one), where the kind has one.
    pub gemm_s: Option<f64>,
    /// The paced transfers alone.
    pub transfers_s: f64,
    /// The call's GEMMs and sums alone (the per-peer pieces, no transfers).
    pub pieces_s: f64,
    /// The link rate the fused call achieved, and the one asked for.
    pub link_bytes_per_s: f64,
    pub pace_bytes_per_s: f64,
}

/// Runs one case (see [`BenchRequest`]).
pub fn bench(request: &BenchRequest) -> Result<BenchRow> {
    let (kind, n, _, problem) = request.call.problem()?;
    let schedule = abi::schedule(kind, request.call.schedule)?.resolve(n, kind.pattern());
    let problem = problem.for_schedule(schedule)?;
    let pace = Pace::of_machine(&request.machine)?;
    let sizes = problem.sizes();
    let operands = |elements: usize| vec![0x3eu8; elements * sizes.input.size()];
    let (x, w) = (operands(sizes.x), operands(sizes.w));
    let median = |part: Part| -> Result<(f64, LinkReport)> {
        let call = SoloCall {
            problem: &problem,
            schedule,
            n,
            rank: request.rank,
            x: &x,
            w: &w,
            messages: Messages::Any,
            pace,
            part,
            tf32: true,
            reps: request.reps,
        };
        let result = run(&call)?;
        Ok((median_of(result.seconds), result.link))
    };
    let (fused_s, link) = median(Part::All)?;
    let (transfers_s, _) = median(Part::Transfers)?;
    let (pieces_s, _) = median(Part::Compute)?;
    let gemm_s = match total_work(&request.call, kind, n) {
        Some(whole) => {
            let (_, _, _, whole) = whole.problem()?;
            let sizes = whole.sizes();
            let (x, w) = (operands(sizes.x), operands(sizes.w));
            let call = SoloCall {
                problem: &whole,
                schedule: Schedule::Sequential,
                n: 1,
                rank: 0,
                x: &x,
                w: &w,
                messages: Messages::Any,
                pace,
                part: Part::All,
                tf32: true,
                reps: request.reps,
            };
            Some(median_of(run(&call)?.seconds))
        }
        None => None,
    };
    Ok(BenchRow {
        schedule: schedule.to_string(),
        fused_s,
        gemm_s,
        transfers_s,
        pieces_s,
        link_bytes_per_s: link.bytes_per_s,
        pace_bytes_per_s: pace.bytes_per_s,
    })
}

/// [`bench`] of a JSON request, answered as JSON.
pub fn bench_json(request: &str) -> Result<String> {
    let request: BenchRequest = serde_json::from_str(request)
        .map_err(|e| Error::InvalidArgument(format!("one-rank benchmark request: {e}")))?;
    serde_json::to_string(&bench(&request)?).map_err(|e| Error::Internal(e.to_string()))
}

/// The shapes of one GEMM doing the whole group's work of `call`, as a
/// group of one: the gathered rows of an all-gather-matmul, the full
/// product of a matmul-reduce-scatter; none for the other kinds.
fn total_work(call: &CallShapes, kind: OpKind, n: usize) -> Option<CallShapes> {
    let mut whole = CallShapes { ranks: 1, schedule: abi::schedule_code(Schedule::Sequential), ..call.clone() };
    match kind {
        OpKind::AllGatherMatmul => {
            let rows = usize::try_from(call.dimension).ok()?;
            *whole.x.get_mut(rows)? *= n as i64;
            Some(whole)
        }
        OpKind::MatmulReduceScatter => Some(whole),
        _ => None,
    }
}

fn median_of(mut seconds: Vec<f64>) -> f64 {
    seconds.sort_by(f64::total_cmp);
    match seconds.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => seconds[n / 2],
        n => (seconds[n / 2 - 1] + seconds[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::emulate::{cases, fill, problem_of, reference, schedules, solo_inbox};
    use crate::backend::cuda::libs::Lib;

    /// Rank 0 and rank N-1 of N = 2, 4 and 8, alone on GPU 0 with their
    /// peers' messages paced to an H100's NVLink: every op kind and
    /// schedule, bit for bit as the CPU backend computes for that rank.
    #[test]
    #[ignore = "needs a CUDA GPU: scripts/gpu_device_check.sh runs it"]
    fn one_rank_of_n_on_one_gpu_runs_every_op_as_the_cpu_backend_does() {
        crate::backend::cuda::api::require(&[Lib::Driver, Lib::Cublas, Lib::Nvrtc]).unwrap();
        let pace = Pace::of_machine("h100_nvlink").unwrap();
        let mut site = 0x7400;
        for n in [2usize, 4, 8] {
            for case in cases(n as i64) {
                let kind = case.0;
                for schedule in schedules(kind) {
                    site += 1;
                    let want = reference(&case, schedule, n, site);
                    let problem = problem_of(&case, n, schedule);
                    let sizes = problem.sizes();
                    for rank in [0, n - 1] {
                        let (xs, ws) = (fill(sizes.x, rank), fill(sizes.w, 100 + rank));
                        let call = SoloCall {
                            problem: &problem,
                            schedule,
                            n,
                            rank,
                            x: &xs,
                            w: &ws,
                            messages: Messages::Exact(solo_inbox(&case, schedule, n, rank)),
                            pace,
                            part: Part::All,
                            tf32: false,
                            reps: 2,
                        };
                        let got = run(&call).unwrap();
                        assert!(got.out == want[rank], "{kind:?} {schedule:?}: rank {rank} of {n} differs on GPU 0");
                        assert!(got.seconds.iter().all(|&s| s > 0.0), "{:?}", got.seconds);
                    }
                }
            }
        }
    }
}
