//! The one-rank mode (`solo`) on GPU 0: runs rank r's call of an N-rank
//! group alone, timed on the device's global timer, and the benchmark a
//! GPU user runs over it (`bench`, behind `commfuse_one_rank_bench` and
//! `python -m commfuse.bench_gpu`): the fused call against one GEMM of the
//! same work, the paced transfers alone and the per-peer GEMMs alone; and,
//! asked for, the call's device timeline as a Perfetto trace (`timeline`).
#![forbid(unsafe_code)]

use super::addresses::{DeviceBuffers, DeviceOp, Region};
use super::device;
use super::driver::{synchronize, CallMemory, CallStream, Context, DeviceMemory, PaceKernels, Stream, TimingEvent};
use super::enqueue::{CallOps, Exchanges};
use super::kernels::{self, ImageCache, Target};
use super::site_ops::SiteOps;
use super::solo::{Inbox, LinkReport, Pace, SoloLink};
use super::stream_issue::{self, issue, Stamped, Stamps, StreamOps};
use crate::abi::{self, CallShapes};
use crate::error::{Error, Result};
use crate::plan::{plan, Plan, Schedule, Step};
use crate::problem::{OpKind, Problem};
use crate::trace::{self, CallLabel, Value};
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
    /// Time each step of the last repetition on the device (`timeline`).
    pub timeline: bool,
}

pub struct SoloResult {
    pub out: Vec<u8>,
    /// Each repetition's call, start to end on XLA's stream (device clock).
    pub seconds: Vec<f64>,
    /// The link rate the last repetition achieved.
    pub link: LinkReport,
    /// The last repetition's trace events on the device's clock, where asked for.
    pub timeline: Option<Vec<trace::Event>>,
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
    let p = plan(call.problem.pattern(), call.schedule, call.n, call.rank);
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
    // One timing event at the call's start and two per step (`timeline`).
    let timing = if call.timeline {
        (0..1 + 2 * p.steps.len())
            .map(|_| TimingEvent::new("cuEventCreate (device timeline)"))
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    let (mut seconds, mut report, mut stamps) =
        (Vec::new(), LinkReport { bytes: 0, seconds: 0.0, bytes_per_s: 0.0 }, Vec::new());
    let reps = call.reps.max(1);
    for rep in 0..reps {
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
            // Only the last repetition carries the timing events.
            let timing = if rep + 1 == reps { &timing[..] } else { &[] };
            issue_timed(&p, &site.streams, &mut ops, timing)
                .inspect_err(|_| drop(stream_issue::join_lanes(&site.streams, &mut ops)))
                .and_then(|steps| {
                    stamps = steps;
                    pace_kernels.stamp(&xla, clock.addr() + 8, &memory)
                })
        });
        synchronize(&xla)?;
        issued?;
        let words = clock.read(16)?;
        let time = |i: usize| words.get(8 * i..8 * i + 8).and_then(|w| w.try_into().ok()).map_or(0, u64::from_le_bytes);
        seconds.push(time(1).saturating_sub(time(0)) as f64 / 1e9);
        report = LinkReport::of(&link.steps(), call.pace);
    }
    drop(pace_kernels);
    let timeline = match timing.first() {
        Some(start) => Some(timeline(call, &p, &stamps, &timing, start, report)?),
        None => None,
    };
    Ok(SoloResult { out: outd.read(out_bytes)?, seconds, link: report, timeline })
}

/// Issues a call on its streams, with a timing event on XLA's stream first
/// and one before and after each step on its lane where `timing` holds
/// them; returns each step's pair of indices into `timing` (none without).
fn issue_timed(
    p: &Plan,
    schedule: &crate::exec::stream::StreamSchedule,
    ops: &mut CallOps,
    timing: &[TimingEvent],
) -> Result<Vec<Option<(usize, usize)>>> {
    if timing.is_empty() {
        return issue(p, schedule, ops, 0, None).map(|()| Vec::new());
    }
    let mut timed = TimedOps { ops, timing, used: 0 };
    timed.stamp(None)?;
    let mut stamped = Stamped::new(&mut timed, p);
    issue(p, schedule, &mut stamped, 0, None)?;
    Ok(stamped.steps)
}

/// A call's operations, stamped with the next of `timing`'s events.
struct TimedOps<'o, 'a> {
    ops: &'o mut CallOps<'a>,
    timing: &'o [TimingEvent],
    used: usize,
}

impl StreamOps for TimedOps<'_, '_> {
    fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        self.ops.record(stream, event)
    }
    fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        self.ops.wait(stream, event)
    }
    fn run(&mut self, lane: usize, step: &Step) -> Result<()> {
        self.ops.run(lane, step)
    }
    fn mark(&mut self, lane: usize, mark: usize) -> Result<()> {
        self.ops.mark(lane, mark)
    }
}

impl Stamps for TimedOps<'_, '_> {
    fn stamp(&mut self, stream: Option<usize>) -> Result<usize> {
        let event = self
            .timing
            .get(self.used)
            .ok_or_else(|| Error::Internal("the device timeline ran out of timing events".into()))?;
        match stream {
            None => event.record(self.ops.xla, "cuEventRecord (device timeline)")?,
            Some(lane) => event.record(self.ops.lane(lane)?, "cuEventRecord (device timeline)")?,
        }
        self.used += 1;
        Ok(self.used - 1)
    }
}

/// The trace events of a call whose steps `stamps` timed (indices into
/// `timing`, all done), on the device's clock from `start`.
fn timeline(
    call: &SoloCall,
    p: &Plan,
    stamps: &[Option<(usize, usize)>],
    timing: &[TimingEvent],
    start: &TimingEvent,
    link: LinkReport,
) -> Result<Vec<trace::Event>> {
    const START_NS: u64 = trace::CALL_START_NS;
    let ns = |index: usize| -> Result<u64> {
        let event = timing.get(index).ok_or_else(|| Error::Internal(format!("no timing event {index}")))?;
        Ok(START_NS + (f64::from(event.ms_since(start)?.max(0.0)) * 1e6) as u64)
    };
    let spans = stamps
        .iter()
        .map(|pair| pair.map(|(a, b)| Ok::<_, Error>((ns(a)?, ns(b)?))).transpose())
        .collect::<Result<Vec<_>>>()?;
    let sizes = call.problem.sizes();
    let label = CallLabel {
        transport: "one-rank mode",
        ..CallLabel::new(0, 0, call.problem.kind.name(), p, call.problem, sizes.x * sizes.input.size())
    };
    let mb_per_s = |bytes_per_s: f64| Value::U((bytes_per_s / 1e6).max(0.0) as u64);
    let args = [
        ("clock", Value::S("device (CUDA timing events)".into())),
        ("pace_mb_per_s", mb_per_s(call.pace.bytes_per_s)),
        ("link_mb_per_s", mb_per_s(link.bytes_per_s)),
    ];
    Ok(trace::call_events(p, &spans, &label, 0, START_NS, &args))
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
    /// Where to write one fused call's device timeline as a Perfetto trace
    /// (JSON where the path ends in `.json`), from a run apart from the timed ones.
    #[serde(default)]
    pub trace: Option<String>,
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
    /// The trace written, if one was asked for.
    pub trace: Option<String>,
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
    let call_of = |part: Part, reps: usize, timeline: bool| SoloCall {
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
        reps,
        timeline,
    };
    let median = |part: Part| -> Result<(f64, LinkReport)> {
        let result = run(&call_of(part, request.reps, false))?;
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
                timeline: false,
            };
            Some(median_of(run(&call)?.seconds))
        }
        None => None,
    };
    if let Some(path) = &request.trace {
        // Two repetitions, the first a warm-up: the timed runs above carry no timing events.
        let events = run(&call_of(Part::All, 2, true))?.timeline.unwrap_or_default();
        trace::write_events(std::path::Path::new(path), &events)?;
    }
    Ok(BenchRow {
        schedule: schedule.to_string(),
        fused_s,
        gemm_s,
        transfers_s,
        pieces_s,
        link_bytes_per_s: link.bytes_per_s,
        pace_bytes_per_s: pace.bytes_per_s,
        trace: request.trace.clone(),
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
    use crate::backend::cuda::emulate::{cases, fill, problem_of, reference, schedules, solo_inbox, timeline_faults};
    use crate::backend::cuda::libs::Lib;

    /// Rank 0 and rank N-1 of N = 2, 4 and 8, alone on GPU 0 with their
    /// peers' messages paced to an H100's NVLink: every op kind and
    /// schedule, bit for bit as the CPU backend computes for that rank, its
    /// device timeline in order.
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
                            timeline: true,
                        };
                        let got = run(&call).unwrap();
                        assert!(got.out == want[rank], "{kind:?} {schedule:?}: rank {rank} of {n} differs on GPU 0");
                        assert!(got.seconds.iter().all(|&s| s > 0.0), "{:?}", got.seconds);
                        // The device timeline: each step a slice, in lane order, after its
                        // dependencies (timing events resolve about half a microsecond).
                        let p = plan(problem.pattern(), schedule, n, rank);
                        let faults = timeline_faults(&p, &got.timeline.unwrap(), 1_000);
                        assert!(faults.is_empty(), "{kind:?} {schedule:?} rank {rank} of {n}: {faults:?}");
                    }
                }
            }
        }
    }
}
