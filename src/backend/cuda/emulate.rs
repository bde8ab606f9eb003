//! A host emulation of the CUDA path, to check it end to end without a GPU,
//! side by side with the CPU backend.
//!
//! Every rank's call is issued exactly as the handler issues it, each rank
//! on a host thread of its own (`stream_issue::issue` over the site's
//! `site_ops::SiteOps`, each step's operations bound to the rank's buffers
//! at XLA-style device addresses; with the copy transport, each exchange
//! through `copies::exchange` and the ranks' shared mailbox), into recorded
//! per-stream command lists. Then the streams of all ranks run in a
//! discrete-event model of CUDA and NCCL: a stream runs its commands in
//! order; a wait blocks until the event's record that was last issued before
//! the wait (by any host thread) has run, as `cuStreamWaitEvent` does; a GEMM
//! follows `cublasGemmEx`'s column-major definition on the addresses
//! `blas::BlasHandle::gemm` passes, a sum follows the kernel's definition, a
//! copy moves the bytes, and an NCCL group posts its sends, then completes
//! when every receive has a message from its peer (per pair of ranks, first
//! in first out, as NCCL matches point-to-point calls). The streams run in
//! several orders (`Order`), among them adversarial ones, and the outputs
//! must equal those of the CPU backend on the same inputs.
#![forbid(unsafe_code)]

use super::addresses::{Bases, DeviceBuffers, DeviceOp, P2p, Region};
use super::copies::{self, CallId, CopyQueue, Deadline, Mailbox, Omit};
use super::fp8_gemm::LtType;
use super::gemm::ColMajor;
use super::site_ops::SiteOps;
use super::solo::{Inbox, Pace, PacedQueue, SoloLink, StepClock};
use super::stream_issue::{issue, Stamped, Stamps, StreamOps};
use crate::backend::cpu::{self, transport};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::{plan, Plan, Schedule, Step};
use crate::problem::{OpKind, Operand, Problem};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An event of the model: a call's (from its stream schedule), or one of
/// the copy transport's, of a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventId {
    Call { rank: usize, index: usize },
    Ready { rank: usize, peer: usize, slot: u64 },
    Copied { rank: usize, peer: usize, slot: u64 },
}

/// How many times the hosts have recorded each event so far: a wait
/// captures the count when it is issued and is met once that record ran.
#[derive(Default)]
struct Records(Mutex<HashMap<EventId, u64>>);

impl Records {
    fn record(&self, e: EventId) -> u64 {
        let mut m = crate::sync::lock(&self.0);
        let n = m.entry(e).or_insert(0);
        *n += 1;
        *n
    }
    fn issued(&self, e: EventId) -> u64 {
        crate::sync::lock(&self.0).get(&e).copied().unwrap_or(0)
    }
}

/// One command on one stream of the emulated device.
#[derive(Debug, Clone)]
enum Cmd {
    /// The `n`-th record of an event.
    Record(EventId, u64),
    /// Waits for the `n`-th record of an event (0: none was issued, no wait).
    Wait(EventId, u64),
    /// A site's operation with the call's bases it is bound to.
    Op(Box<DeviceOp>, Bases),
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    /// `cuMemcpy2DAsync` (a reshard's packing and unpacking).
    Copy2d(crate::reshard::device::Copy2d),
    /// A timing event (`Stamps`): notes the model's clock when reached.
    Stamp(usize),
}

/// How exchanges go between ranks.
#[derive(Clone, Copy)]
enum Transport<'a> {
    Nccl,
    Copies {
        mailbox: &'a Mailbox<EventId, u64>,
        deadline: Deadline,
        omit: Omit,
        failing: Option<usize>,
    },
    /// One rank alone, its peers' messages copied from its inbox (`solo`).
    Solo(&'a SoloLink),
}

/// Records what the handler would enqueue on one rank; stream `lanes.len()` is XLA's.
struct Recorder<'a> {
    rank: usize,
    /// The call being issued (the copy transport pairs only messages of one call).
    call: CallId,
    site: &'a SiteOps,
    bases: Bases,
    records: &'a Records,
    transport: Transport<'a>,
    streams: Vec<Vec<Cmd>>,
    /// Stamps issued so far.
    stamps: usize,
}

impl Recorder<'_> {
    fn stream(&mut self, stream: Option<usize>) -> &mut Vec<Cmd> {
        let xla = self.streams.len() - 1;
        &mut self.streams[stream.unwrap_or(xla)]
    }
}

impl Stamps for Recorder<'_> {
    fn stamp(&mut self, stream: Option<usize>) -> Result<usize> {
        let index = self.stamps;
        self.stream(stream).push(Cmd::Stamp(index));
        self.stamps += 1;
        Ok(index)
    }
}

impl StreamOps for Recorder<'_> {
    fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        let e = EventId::Call { rank: self.rank, index: event };
        let n = self.records.record(e);
        self.stream(stream).push(Cmd::Record(e, n));
        Ok(())
    }
    fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        let e = EventId::Call { rank: self.rank, index: event };
        let n = self.records.issued(e);
        self.stream(stream).push(Cmd::Wait(e, n));
        Ok(())
    }
    fn run(&mut self, lane: usize, step: &Step) -> Result<()> {
        let bases = self.bases;
        for op in &self.site.steps[step.id] {
            match (op, self.transport) {
                (DeviceOp::Exchange { sends, recvs }, Transport::Copies { mailbox, deadline, omit, failing }) => {
                    let bind = |list: &[P2p<_>]| list.iter().map(|p| p.bind(&bases)).collect::<Vec<_>>();
                    let (sends, recvs) = (bind(sends), bind(recvs));
                    let (rank, records) = (self.rank, self.records);
                    let failing = failing == Some(rank);
                    let mut lane = LaneQueue { rank, records, stream: &mut self.streams[lane], failing };
                    let call = self.call;
                    copies::exchange_omitting(mailbox, call, rank, &sends, &recvs, &mut lane, deadline, omit)?;
                }
                (DeviceOp::Exchange { sends, recvs }, Transport::Solo(link)) => {
                    let bind = |list: &[P2p<_>]| list.iter().map(|p| p.bind(&bases)).collect::<Vec<_>>();
                    link.exchange(&bind(sends), &bind(recvs), &mut PacedLane(&mut self.streams[lane]))?;
                }
                _ => self.streams[lane].push(Cmd::Op(Box::new(op.clone()), bases)),
            }
        }
        Ok(())
    }
    /// Marks only tell the watchdog that a call moves: nothing to emulate.
    fn mark(&mut self, _lane: usize, _mark: usize) -> Result<()> {
        Ok(())
    }
}

/// The copy transport's device side on one lane of a recorded rank.
struct LaneQueue<'r> {
    rank: usize,
    records: &'r Records,
    stream: &'r mut Vec<Cmd>,
    /// The copies of this rank fail (a fault the tests inject).
    failing: bool,
}

impl CopyQueue for LaneQueue<'_> {
    type Event = EventId;
    type Region = u64;
    fn lend(&mut self, addr: u64, _bytes: usize, _writable: bool) -> Result<u64> {
        Ok(addr)
    }
    fn ready_event(&mut self, peer: usize, message: u64) -> Result<EventId> {
        Ok(EventId::Ready { rank: self.rank, peer, slot: message % copies::RING })
    }
    fn copied_event(&mut self, peer: usize, message: u64) -> Result<EventId> {
        Ok(EventId::Copied { rank: self.rank, peer, slot: message % copies::RING })
    }
    fn record(&mut self, e: EventId) -> Result<()> {
        let n = self.records.record(e);
        self.stream.push(Cmd::Record(e, n));
        Ok(())
    }
    fn wait(&mut self, e: EventId) -> Result<()> {
        let n = self.records.issued(e);
        self.stream.push(Cmd::Wait(e, n));
        Ok(())
    }
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if self.failing {
            return Err(Error::Internal("CUDA driver cuMemcpyDtoDAsync: CUDA_ERROR_ILLEGAL_ADDRESS".into()));
        }
        self.stream.push(Cmd::Copy { dst, src, bytes });
        Ok(())
    }
    fn pull(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.copy(dst, src, bytes)
    }
}

/// The one-rank mode's pacing on a recorded stream: the copies move bytes;
/// the holds only keep a stream until a time, which the model (ordering,
/// not timing) has no use for.
struct PacedLane<'s>(&'s mut Vec<Cmd>);

impl PacedQueue for PacedLane<'_> {
    fn start(&mut self, _clock: &Arc<StepClock>) -> Result<()> {
        Ok(())
    }
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.0.push(Cmd::Copy { dst, src, bytes });
        Ok(())
    }
    fn hold(&mut self, _clock: &Arc<StepClock>, _after_ns: u64, _last: bool) -> Result<()> {
        Ok(())
    }
}

/// Device memory of all ranks: buffer `id` lives at `base(id)`; and every
/// message an NCCL group delivered, as (from, to, bytes), in order.
#[derive(Default)]
struct Memory {
    buffers: Vec<Vec<u8>>,
    delivered: Vec<(usize, usize, Vec<u8>)>,
    /// When each stamp was reached: stamp index -> commands run before it.
    stamps: HashMap<usize, u64>,
}

const SPAN: u64 = 1 << 32;

fn base(id: usize) -> u64 {
    (id as u64 + 1) * SPAN
}

impl Memory {
    fn locate(&self, addr: u64, bytes: usize) -> (usize, usize) {
        let id = (addr / SPAN) as usize - 1;
        let offset = (addr % SPAN) as usize;
        assert!(offset + bytes <= self.buffers[id].len(), "{bytes} bytes at {addr:#x} overrun buffer {id}");
        (id, offset)
    }
    fn read(&self, addr: u64, bytes: usize) -> Vec<u8> {
        let (id, o) = self.locate(addr, bytes);
        self.buffers[id][o..o + bytes].to_vec()
    }
    fn write(&mut self, addr: u64, data: &[u8]) {
        let (id, o) = self.locate(addr, data.len());
        self.buffers[id][o..o + data.len()].copy_from_slice(data);
    }
    fn f32(&self, addr: u64, index: usize) -> f32 {
        let a = addr + 4 * index as u64;
        f32::from_le_bytes(self.read(a, 4).try_into().unwrap())
    }
    fn set_f32(&mut self, addr: u64, index: usize, v: f32) {
        self.write(addr + 4 * index as u64, &v.to_le_bytes());
    }
}

/// Runs one device operation; `false` when an NCCL group must wait for a message.
fn execute(
    op: &DeviceOp,
    bases: &Bases,
    rank: usize,
    mem: &mut Memory,
    channels: &mut HashMap<(usize, usize), VecDeque<Vec<u8>>>,
    posted: &mut bool,
) -> bool {
    match op {
        DeviceOp::Gemm { gemm, ops, accumulate } => {
            for t in [ops.lhs.1, ops.rhs.1, ops.dst.1] {
                assert_eq!(t, DType::F32, "the emulation is f32 only");
            }
            let Some(c) = ColMajor::of(gemm).unwrap() else { return true };
            // The extents the safe layer checks lie inside the buffers.
            for (addr, bytes) in c.extents(ops.bind(bases)) {
                mem.locate(addr, bytes);
            }
            let (a, b, out) = c.addresses(ops.bind(bases));
            for j in 0..c.n {
                for i in 0..c.m {
                    let mut acc = 0.0f32;
                    for p in 0..c.k {
                        acc += mem.f32(a, i + p * c.lda) * mem.f32(b, p + j * c.ldb);
                    }
                    let prior = if *accumulate { mem.f32(out, i + j * c.ldc) } else { 0.0 };
                    mem.set_f32(out, i + j * c.ldc, acc + prior);
                }
            }
            true
        }
        DeviceOp::Fp8Gemm(g) => {
            // cuBLASLt's TN call as `fp8_gemm::Fp8Gemm::lower` gives it, on bytes.
            let call = g.bind(bases).lower((9, 0)).unwrap();
            for (addr, bytes) in call.extents().unwrap() {
                mem.locate(addr, bytes);
            }
            assert_eq!(call.d_layout.dtype, LtType::F32, "the emulation writes f32 only");
            let scale = mem.f32(call.a_scale, 0) * mem.f32(call.b_scale, 0);
            let byte = |mem: &Memory, addr: u64, i: i64| mem.read(addr + i as u64, 1)[0];
            let (a, b, d) = (call.a_layout, call.b_layout, call.d_layout);
            for c in 0..d.cols as i64 {
                for r in 0..d.rows as i64 {
                    // op(A) = Aᵀ: element (r, kk) of op(A) is A(kk, r).
                    let dot: f32 = (0..a.rows as i64)
                        .map(|kk| e4m3(byte(mem, call.a, kk + r * a.ld)) * e4m3(byte(mem, call.b, kk + c * b.ld)))
                        .sum();
                    let at = (r + c * d.ld) as usize;
                    let prior = if call.beta == 0.0 { 0.0 } else { call.beta * mem.f32(call.d, at) };
                    mem.set_f32(call.d, at, scale * dot + prior);
                }
            }
            true
        }
        DeviceOp::Sum(s) => {
            assert_eq!(s.kernel, "sum_f32", "the emulation is f32 only");
            let s = s.bind(bases);
            let terms = s.kernel_terms();
            for i in 0..s.n as usize {
                let v = terms[..s.k as usize].iter().map(|&t| mem.f32(t, i)).sum();
                mem.set_f32(s.dst, i, v);
            }
            true
        }
        DeviceOp::Exchange { sends, recvs } => {
            if !*posted {
                for s in sends.iter().map(|s| s.bind(bases)) {
                    let data = mem.read(s.addr, s.bytes);
                    channels.entry((rank, s.peer)).or_default().push_back(data);
                }
                *posted = true;
            }
            let mut wanted: HashMap<usize, usize> = HashMap::new();
            for r in recvs {
                *wanted.entry(r.peer).or_default() += 1;
            }
            let ready = wanted.iter().all(|(&peer, &n)| channels.get(&(peer, rank)).map_or(0, |q| q.len()) >= n);
            if !ready {
                return false;
            }
            for r in recvs.iter().map(|r| r.bind(bases)) {
                let data = channels.get_mut(&(r.peer, rank)).unwrap().pop_front().unwrap();
                assert_eq!(data.len(), r.bytes, "rank {rank}: a message of the wrong size from {}", r.peer);
                mem.write(r.addr, &data);
                mem.delivered.push((r.peer, rank, data));
            }
            *posted = false;
            true
        }
    }
}

/// The value of a `float8_e4m3fn` byte: sign, 4 exponent bits (bias 7),
/// 3 mantissa bits; exponent 0 is subnormal; S.1111.111 is NaN (no infinities).
pub fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    if exp == 0xf && man == 7.0 {
        return f32::NAN;
    }
    sign * if exp == 0 { man / 8.0 * 2f32.powi(-6) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) }
}

/// Distinct small integers (exact in f32 whatever the summation order).
pub fn fill(len: usize, salt: usize) -> Vec<u8> {
    (0..len).flat_map(|i| (((i * 7 + salt * 5) % 11) as f32 - 5.0).to_le_bytes()).collect()
}

/// The order the model visits streams in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Ranks and streams forwards, each as far as it can go.
    Forward,
    /// Backwards, one command per visit.
    Backward,
    /// Communication lanes first (each as far as it can go), then the rest:
    /// transfers run as early as their waits allow.
    CommFirst,
}

const ORDERS: [Order; 3] = [Order::Forward, Order::Backward, Order::CommFirst];

/// How one emulation goes: its transport, what the copy transport leaves
/// out, and which ranks take part (`absent` never issues its call).
#[derive(Clone, Copy)]
struct Setup {
    copies: bool,
    omit: Omit,
    absent: Option<usize>,
    /// A rank whose copies fail on its device.
    failing: Option<usize>,
    deadline: Duration,
    /// Calls each rank makes in turn over one mailbox (the last one's output counts).
    calls: usize,
}

impl Setup {
    const NCCL: Setup = Setup {
        copies: false,
        omit: Omit::Nothing,
        absent: None,
        failing: None,
        deadline: Duration::from_secs(20),
        calls: 1,
    };
    const COPIES: Setup = Setup { copies: true, ..Setup::NCCL };
}

/// The streams of every rank after its host issued the call, or the error
/// its host met.
type Issued = Vec<Result<(usize, Vec<Vec<Cmd>>)>>;

/// Issues every rank's call, each rank on a thread of its own (the copy
/// transport's hosts wait for each other), into fresh device memory.
fn issue_all(problem: &Problem, schedule: Schedule, n: usize, setup: Setup) -> (Memory, Issued) {
    let sizes = problem.sizes();
    let mut mem = Memory::default();
    let mut sites = Vec::new();
    for rank in 0..n {
        let p = plan(problem.pattern(), schedule, n, rank);
        let site = SiteOps::new(problem, &p).unwrap();
        let id = mem.buffers.len();
        mem.buffers.push(fill(sizes.x, rank));
        mem.buffers.push(fill(sizes.w, 100 + rank));
        mem.buffers.push(vec![0xff; sizes.result * 4]); // garbage: every element must be written
        mem.buffers.push(vec![0xff; site.layout.total()]);
        let region = |i: usize, bytes| Region { addr: base(i), bytes, dtype: DType::F32 };
        let buffers = DeviceBuffers {
            x: region(id, sizes.x * 4),
            w: region(id + 1, sizes.w * 4),
            out: region(id + 2, sizes.result * 4),
            workspace: (base(id + 3), site.layout.total()),
            scales: None,
        };
        let bases = site.bind(&buffers).unwrap();
        sites.push((id, p, site, bases));
    }
    let records = Records::default();
    let mailbox = Mailbox::new((0..n as i64).collect());
    let deadline = Deadline { at: Instant::now() + setup.deadline, interrupts: crate::config::interrupts() };
    let transport = if setup.copies {
        Transport::Copies { mailbox: &mailbox, deadline, omit: setup.omit, failing: setup.failing }
    } else {
        Transport::Nccl
    };
    let issued = std::thread::scope(|scope| {
        let handles: Vec<_> = sites
            .iter()
            .enumerate()
            .filter(|(rank, _)| Some(*rank) != setup.absent)
            .map(|(rank, (id, p, site, bases))| {
                let records = &records;
                scope.spawn(move || {
                    let streams = vec![Vec::new(); site.streams.lanes.len() + 1];
                    let call = CallId { site: 0x0e0, run: 0 };
                    let mut rec = Recorder { rank, call, site, bases: *bases, records, transport, streams, stamps: 0 };
                    for run in 0..setup.calls {
                        rec.call.run = run as i64;
                        issue(p, &site.streams, &mut rec, 0, None)?;
                    }
                    Ok((*id, rec.streams))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (mem, issued)
}

/// Runs every rank's streams in the model in `order` until none can move;
/// returns the memory then, or why a stream got stuck.
fn run_streams(mut mem: Memory, ranks: &[(usize, Vec<Vec<Cmd>>)], order: Order) -> std::result::Result<Memory, String> {
    let mut channels = HashMap::new();
    let mut pc: Vec<Vec<usize>> = ranks.iter().map(|(_, s)| vec![0; s.len()]).collect();
    let mut posted: Vec<Vec<bool>> = ranks.iter().map(|(_, s)| vec![false; s.len()]).collect();
    let mut ran: HashMap<EventId, u64> = HashMap::new();
    // The model's clock: commands run so far, over every stream.
    let mut clock = 0u64;
    let mut visits: Vec<(usize, usize)> =
        ranks.iter().enumerate().flat_map(|(r, (_, st))| (0..st.len()).map(move |s| (r, s))).collect();
    match order {
        Order::Forward => {}
        Order::Backward => visits.reverse(),
        // Stream 1 is a communication lane wherever a plan has two lanes.
        Order::CommFirst => visits.sort_by_key(|&(r, s)| (s != 1, r, s)),
    }
    loop {
        let mut moved = false;
        for &(r, s) in &visits {
            let cmds = &ranks[r].1[s];
            while let Some(cmd) = cmds.get(pc[r][s]) {
                let done = match cmd {
                    Cmd::Record(e, n) => {
                        let last = ran.entry(*e).or_insert(0);
                        *last = (*last).max(*n);
                        true
                    }
                    Cmd::Wait(e, n) => *n == 0 || ran.get(e).copied().unwrap_or(0) >= *n,
                    Cmd::Op(op, bases) => execute(op, bases, r, &mut mem, &mut channels, &mut posted[r][s]),
                    Cmd::Copy { dst, src, bytes } => {
                        let data = mem.read(*src, *bytes);
                        mem.write(*dst, &data);
                        true
                    }
                    Cmd::Stamp(index) => {
                        mem.stamps.insert(*index, clock);
                        true
                    }
                    Cmd::Copy2d(c) => {
                        let (src, dst) = c.spans().expect("a copy too large to address");
                        mem.locate(c.src, src);
                        mem.locate(c.dst, dst);
                        for row in 0..c.height as u64 {
                            let data = mem.read(c.src + row * c.src_pitch as u64, c.width);
                            mem.write(c.dst + row * c.dst_pitch as u64, &data);
                        }
                        true
                    }
                };
                if !done {
                    break;
                }
                pc[r][s] += 1;
                clock += 1;
                moved = true;
                if order == Order::Backward {
                    break;
                }
            }
        }
        if !moved {
            break;
        }
    }
    for (r, (_, streams)) in ranks.iter().enumerate() {
        for (s, cmds) in streams.iter().enumerate() {
            if pc[r][s] != cmds.len() {
                return Err(format!("rank {r} stream {s} is stuck at {:?}", cmds[pc[r][s]]));
            }
        }
    }
    if !channels.values().all(|q: &VecDeque<Vec<u8>>| q.is_empty()) {
        return Err("messages nobody received".into());
    }
    Ok(mem)
}

/// The outputs of every rank through the emulated CUDA path, for each order.
fn emulated(problem: &Problem, kind: OpKind, schedule: Schedule, n: usize, setup: Setup) -> Vec<Vec<Vec<u8>>> {
    let (mem, issued) = issue_all(problem, schedule, n, setup);
    let ranks: Vec<_> =
        issued.into_iter().map(|r| r.unwrap_or_else(|e| panic!("{kind:?} {schedule:?}: {e}"))).collect();
    ORDERS
        .iter()
        .map(|&order| {
            let mem = Memory { buffers: mem.buffers.clone(), ..Memory::default() };
            let mem =
                run_streams(mem, &ranks, order).unwrap_or_else(|e| panic!("{kind:?} {schedule:?} {order:?}: {e}"));
            ranks.iter().map(|(id, _)| mem.buffers[id + 2].clone()).collect()
        })
        .collect()
}

/// The outputs of every rank through the CPU backend.
fn on_cpu(problem: &Problem, kind: OpKind, schedule: Schedule, n: usize, site: i64) -> Vec<Vec<u8>> {
    let sizes = problem.sizes();
    let group: Vec<i64> = (0..n as i64).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let group = group.clone();
                scope.spawn(move || {
                    let p = plan(problem.pattern(), schedule, n, rank);
                    let layout = cpu::CpuLayout::new(problem).unwrap();
                    let (x, w) = (fill(sizes.x, rank), fill(sizes.w, 100 + rank));
                    let mut out = vec![0u8; sizes.result * 4];
                    let mut words = vec![0u64; layout.total().div_ceil(8)];
                    let workspace = bytemuck::cast_slice_mut::<u64, u8>(&mut words);
                    let key = transport::SessionKey { group, site, run: -7, sequence: 0 };
                    let info = transport::Participant {
                        op: kind.name(),
                        rank,
                        timeout: Duration::from_secs(20),
                        interrupts: crate::config::interrupts(),
                    };
                    let endpoint = transport::Endpoint::join(key, info);
                    let buffers = cpu::Buffers { x: &x, w: &w, out: &mut out, workspace };
                    cpu::run(problem, &p, buffers, &endpoint, None, cpu::Lanes::ByWork).unwrap();
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// One problem per op kind over `n` ranks: (kind, x dims, w dims, out dims).
pub type Case = (OpKind, Vec<i64>, Vec<i64>, Vec<i64>);

/// `case`'s problem over `n` ranks as `schedule` cuts it (f32 operands).
pub fn problem_of(case: &Case, n: usize, schedule: Schedule) -> Problem {
    let (kind, x, w, out) = case;
    let op = |dims| Operand { dims, dtype: DType::F32 };
    // A two-axis kind's `dimension` is its first axis's size F: the
    // output's leading dim (gather-scatter), x's columns over w's rows (two gathers).
    let dimension = match kind {
        OpKind::AllGatherMatmulReduceScatter => out[0],
        OpKind::AllGatherBothMatmul => x[1] / w[0],
        OpKind::AllGatherContractMatmulReduceScatter => x[0] / out[0],
        _ => 0,
    };
    Problem::new(*kind, op(x), op(w), op(out), dimension, n).unwrap().for_schedule(schedule).unwrap()
}

/// Small shapes of every op kind for `n` ranks (dimension 0 for row kinds).
pub fn cases(n: i64) -> Vec<Case> {
    use OpKind::*;
    // The gather-contract-scatter case's scatter axis: 4, 3 or 2 ranks where
    // they divide n, so that its two partial slots are reused (F > 2).
    let f = [4, 3, 2, 1].into_iter().find(|f| n % f == 0).expect("1 divides n");
    vec![
        (AllGatherMatmul, vec![3, 8], vec![8, 6], vec![3 * n, 6]),
        (AllGatherMatmulContract, vec![5, 3], vec![3 * n, 7], vec![5, 7]),
        (MatmulAllGather, vec![8, 3], vec![5, 8], vec![5, 3 * n]),
        (MatmulAllGatherContract, vec![3, 7], vec![5, 3 * n], vec![5, 7]),
        (MatmulReduceScatter, vec![3 * n, 8], vec![8, 6], vec![3, 6]),
        (MatmulReduceScatterCols, vec![5, 8], vec![8, 3 * n], vec![5, 3]),
        (AllToAllMatmul, vec![n, 3, 8], vec![8, 6], vec![n, 3, 6]),
        (AllToAllMatmulContract, vec![n, 5, 3], vec![3 * n, 6], vec![5, 6]),
        (MatmulAllToAll, vec![n, 3, 8], vec![8, 6], vec![n, 3, 6]),
        (MatmulAllToAllCols, vec![5, 8], vec![8, 3 * n], vec![n, 5, 3]),
        (MatmulAllReduce, vec![3 * n, 8], vec![8, 6], vec![3 * n, 6]),
        // Over F x T ranks: F = 2 where n is even, else 1 (the last: `f`).
        (AllGatherMatmulReduceScatter, vec![8, 6], vec![3 * n / (2 - n % 2), 8], vec![2 - n % 2, 3, 6]),
        (AllGatherBothMatmul, vec![3, 4 * (2 - n % 2)], vec![4, 6], vec![3 * n / (2 - n % 2), 6]),
        (AllGatherContractMatmulReduceScatter, vec![3 * f, 4], vec![4 * n / f, 6], vec![3, 6]),
    ]
}

/// The outputs of `case` on every rank through the CPU backend, for the
/// inputs `fill` gives (used by the GPU test of `device` too).
pub fn reference(case: &Case, schedule: Schedule, n: usize, site: i64) -> Vec<Vec<u8>> {
    on_cpu(&problem_of(case, n, schedule), case.0, schedule, n, site)
}

/// The schedules to emulate for `kind` (cut into blocks of 3 rows where the kind takes that).
pub fn schedules(kind: OpKind) -> Vec<Schedule> {
    let mut schedules = vec![Schedule::Auto, Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential];
    if kind.cuts_rows() || matches!(kind, OpKind::AllGatherMatmulReduceScatter | OpKind::AllGatherBothMatmul) {
        // The cases' blocks have 3 rows (x's row blocks of the two-gather
        // case too; the gather-scatter case: w's blocks 6 columns).
        schedules.push(Schedule::Sliced { slices: 3 });
    }
    schedules
}

/// Every op kind and schedule for `ns` ranks through the emulated path with
/// `setup`, against the CPU backend; returns the cases that differed.
fn compare(ns: &[usize], setup: Setup, site: &mut i64) -> Vec<String> {
    let mut differed = Vec::new();
    for &n in ns {
        for case in cases(n as i64) {
            let kind = &case.0;
            for schedule in schedules(*kind) {
                let problem = problem_of(&case, n, schedule);
                *site += 1;
                let want = reference(&case, schedule, n, *site);
                for (order, got) in ORDERS.iter().zip(emulated(&problem, *kind, schedule, n, setup)) {
                    if got != want {
                        differed.push(format!("{kind:?} {schedule:?} n={n} {order:?}"));
                    }
                }
            }
        }
    }
    differed
}

#[test]
fn the_cuda_path_computes_what_the_cpu_backend_computes() {
    let mut site = 0x0c0d_a000;
    let differed = compare(&[1, 2, 3, 4], Setup::NCCL, &mut site);
    assert!(differed.is_empty(), "differ from the CPU backend: {differed:?}");
}

/// The copy transport, every op kind and schedule, N up to 16, every order.
#[test]
fn the_copy_transport_computes_what_the_cpu_backend_computes() {
    let mut site = 0x0c0e_a000;
    let differed = compare(&[1, 2, 3, 4, 5, 8, 16], Setup::COPIES, &mut site);
    assert!(differed.is_empty(), "differ from the CPU backend: {differed:?}");
}

/// Leaving out either wait of the copy transport gives wrong results the
/// model catches: the receiver reading its slot before the copy landed, or
/// the sender overwriting a slot the receiver still reads.
#[test]
fn the_model_catches_a_missing_dependency_of_the_copy_transport() {
    let mut site = 0x0c0f_a000;
    for omit in [Omit::CopiedWait, Omit::ReadyWait] {
        let differed = compare(&[2, 4], Setup { omit, ..Setup::COPIES }, &mut site);
        assert!(!differed.is_empty(), "{omit:?} left out, yet every case matched the CPU backend");
    }
}

/// The first case of 4 ranks on a ring issued with `setup`: how long the
/// hosts took, and what each rank's issuing ended in.
fn ring_of_four(setup: Setup) -> (Duration, Issued) {
    let case = &cases(4)[0];
    let started = Instant::now();
    let (_, issued) = issue_all(&problem_of(case, 4, Schedule::Ring), Schedule::Ring, 4, setup);
    (started.elapsed(), issued)
}

/// A rank that never arrives ends every other rank's host wait with
/// DEADLINE_EXCEEDED naming it; nothing is left waiting on a device.
#[test]
fn a_rank_that_never_arrives_ends_the_copy_transport_with_a_deadline_naming_it() {
    let (took, issued) = ring_of_four(Setup { absent: Some(2), deadline: Duration::from_millis(300), ..Setup::COPIES });
    assert!(took < Duration::from_secs(10));
    assert_eq!(issued.len(), 3);
    for result in issued {
        let e = result.expect_err("no rank can finish without rank 2");
        assert!(
            matches!(&e, Error::DeadlineExceeded(m) if m.contains("ranks [2] (devices [2]) never got past exchange step 0")),
            "{e}"
        );
    }
}

/// A rank whose copy fails ends every other rank's host wait at once, with
/// its error's code, naming it and saying why.
#[test]
fn a_rank_that_fails_ends_the_copy_transport_at_once_naming_it() {
    let (took, issued) = ring_of_four(Setup { failing: Some(1), deadline: Duration::from_secs(20), ..Setup::COPIES });
    assert!(took < Duration::from_secs(5), "the peers waited for their deadline");
    for (rank, result) in issued.into_iter().enumerate() {
        let e = result.expect_err("no rank can finish when rank 1 fails");
        let m = e.message();
        assert!(m.contains("ILLEGAL_ADDRESS"), "rank {rank}: {e}");
        if rank != 1 {
            assert!(matches!(&e, Error::Internal(m) if m.contains("rank 1 (device 1) failed")), "{e}");
        }
    }
}

/// Reshards over the copy transport in the model: every send program packs
/// and offers, then every receive program pulls and unpacks (the order the
/// pipeline issues them in); 200 random layouts between disjoint meshes,
/// direct as over copies, in every stream order: each destination tile is
/// the planner's.
/// The copy transport's identity of the reshards of the model.
const RESHARD: CallId = CallId { site: 0x5e5d, run: 0 };

#[test]
fn reshards_over_copies_deliver_every_tile_as_the_planner_says() {
    use crate::reshard::device::{receive_side, send_side, Buffer};
    use crate::reshard::tests::{filled, random_layout};
    use crate::reshard::{plan, Layout, Method};
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x0c0e);
    let deadline = Deadline { at: Instant::now() + Duration::from_secs(20), interrupts: crate::config::interrupts() };
    for _ in 0..200 {
        let mixed = random_layout(&mut rng);
        // The same tiles on disjoint ranks: the sources first, then the destinations.
        let n = mixed.ranks();
        let src = mixed.src.iter().cloned().chain(std::iter::repeat_n(None, n)).collect();
        let dst = std::iter::repeat_n(None, n).chain(mixed.dst.iter().cloned()).collect();
        let layout = Layout::new(mixed.shape.clone(), mixed.itemsize, src, dst).unwrap();
        let plan = plan(&layout, Method::Direct);
        let (records, mailbox) = (Records::default(), Mailbox::<EventId, u64>::new((0..2 * n as i64).collect()));
        // Rank r's tile (x or out) is buffer 2r, its staging buffer 2r + 1.
        let mut mem = Memory::default();
        for r in 0..2 * n {
            let tile = layout.src[r].as_ref().or(layout.dst[r].as_ref());
            let bytes = tile.map_or(0, |t| layout.bytes(t));
            mem.buffers.push(match &layout.src[r] {
                Some(t) => filled(&layout, t),
                None => vec![0xee; bytes],
            });
            mem.buffers.push(vec![0xee; bytes]);
        }
        let buffer = |id: usize, mem: &Memory| Buffer { addr: base(id), bytes: mem.buffers[id].len() };
        let mut ranks: Vec<(usize, Vec<Vec<Cmd>>)> = Vec::new();
        let p2p = |t: &crate::reshard::device::Transfer| P2p { addr: t.addr, bytes: t.bytes, peer: t.peer };
        for r in (0..2 * n).filter(|&r| layout.src[r].is_some()) {
            let side = send_side(&layout, &plan, r, buffer(2 * r, &mem), buffer(2 * r + 1, &mem)).unwrap();
            let mut stream: Vec<Cmd> = side.pack.iter().map(|c| Cmd::Copy2d(*c)).collect();
            let sends: Vec<P2p> = side.sends.iter().map(p2p).collect();
            let mut lane = LaneQueue { rank: r, records: &records, stream: &mut stream, failing: false };
            copies::offer(&mailbox, RESHARD, r, &sends, &mut lane).unwrap();
            ranks.push((2 * r, vec![stream]));
        }
        for r in (0..2 * n).filter(|&r| layout.dst[r].is_some()) {
            let side = receive_side(&layout, &plan, r, buffer(2 * r, &mem), buffer(2 * r + 1, &mem)).unwrap();
            let mut stream = Vec::new();
            for round in &side.rounds {
                assert!(round.sends.is_empty(), "a direct plan forwards");
                let recvs: Vec<P2p> = round.recvs.iter().map(p2p).collect();
                let mut lane = LaneQueue { rank: r, records: &records, stream: &mut stream, failing: false };
                copies::pull(&mailbox, RESHARD, r, &recvs, &mut lane, deadline).unwrap();
            }
            stream.extend(side.unpack.iter().map(|c| Cmd::Copy2d(*c)));
            ranks.push((2 * r, vec![stream]));
        }
        for order in ORDERS {
            let run = run_streams(Memory { buffers: mem.buffers.clone(), ..Memory::default() }, &ranks, order).unwrap();
            for r in (0..2 * n).filter(|&r| layout.dst[r].is_some()) {
                let want = filled(&layout, layout.dst[r].as_ref().unwrap());
                assert!(run.buffers[2 * r] == want, "{order:?}: rank {r} of {layout:?}");
            }
        }
    }
}

/// Several calls in turn over one mailbox and one set of events, as a
/// program's step after step: the events' ring wraps across calls, and the
/// last call's outputs are still the CPU backend's.
#[test]
fn the_copy_transport_serves_calls_in_turn_over_one_mailbox() {
    let mut site = 0x0c10_a000;
    let differed = compare(&[2, 3, 4, 8], Setup { calls: 3, ..Setup::COPIES }, &mut site);
    assert!(differed.is_empty(), "differ from the CPU backend: {differed:?}");
}

/// The messages rank `rank` of `n` receives in `case` under `schedule`, per
/// peer in the order it sends them: what the one-rank mode's inbox holds
/// to reproduce the group's result (the model of the whole group over NCCL,
/// run forwards).
pub fn solo_inbox(case: &Case, schedule: Schedule, n: usize, rank: usize) -> Vec<Vec<Vec<u8>>> {
    let (mem, issued) = issue_all(&problem_of(case, n, schedule), schedule, n, Setup::NCCL);
    let ranks: Vec<_> = issued.into_iter().map(Result::unwrap).collect();
    let mem = run_streams(mem, &ranks, Order::Forward).unwrap();
    let mut inbox = vec![Vec::new(); n];
    for (from, to, data) in mem.delivered {
        if to == rank {
            inbox[from].push(data);
        }
    }
    inbox
}

/// Rank `rank` of `n` issued alone in the model, its peers' messages copied
/// from `inbox` at the pace of an H100's NVLink, with a stamp before and
/// after each step where `timeline` asks (as `solo_device` times them).
struct SoloIssued {
    plan: Plan,
    mem: Memory,
    ranks: [(usize, Vec<Vec<Cmd>>); 1],
    /// Per step, its stamps (none without `timeline`).
    stamped: Vec<Option<(usize, usize)>>,
}

fn solo_issue(
    case: &Case,
    schedule: Schedule,
    n: usize,
    rank: usize,
    inbox: &[Vec<Vec<u8>>],
    timeline: bool,
) -> SoloIssued {
    let problem = problem_of(case, n, schedule);
    let sizes = problem.sizes();
    let p = plan(problem.pattern(), schedule, n, rank);
    let site = SiteOps::new(&problem, &p).unwrap();
    let mut mem = Memory::default();
    mem.buffers.push(fill(sizes.x, rank));
    mem.buffers.push(fill(sizes.w, 100 + rank));
    mem.buffers.push(vec![0xff; sizes.result * 4]);
    mem.buffers.push(vec![0xff; site.layout.total()]);
    let mut messages = Vec::new();
    for peer in inbox {
        let mut list = Vec::new();
        for m in peer {
            list.push((base(mem.buffers.len()), m.len()));
            mem.buffers.push(m.clone());
        }
        messages.push(list);
    }
    let pace = Pace::of_machine("h100_nvlink").unwrap();
    let sink = base(mem.buffers.len());
    mem.buffers.push(vec![0; super::solo::MIN_CHUNK]);
    let region = |i: usize, bytes| Region { addr: base(i), bytes, dtype: DType::F32 };
    let buffers = DeviceBuffers {
        x: region(0, sizes.x * 4),
        w: region(1, sizes.w * 4),
        out: region(2, sizes.result * 4),
        workspace: (base(3), site.layout.total()),
        scales: None,
    };
    let bases = site.bind(&buffers).unwrap();
    let link = SoloLink::new(Inbox::Messages(messages), (sink, super::solo::MIN_CHUNK), pace);
    link.begin_call();
    let records = Records::default();
    let streams = vec![Vec::new(); site.streams.lanes.len() + 1];
    let call = CallId { site: 0x0e1, run: 0 };
    let transport = Transport::Solo(&link);
    let mut rec = Recorder { rank, call, site: &site, bases, records: &records, transport, streams, stamps: 0 };
    let stamped = if timeline {
        rec.stamp(None).unwrap();
        let mut stamped = Stamped::new(&mut rec, &p);
        issue(&p, &site.streams, &mut stamped, 0, None).unwrap();
        stamped.steps
    } else {
        issue(&p, &site.streams, &mut rec, 0, None).unwrap();
        Vec::new()
    };
    SoloIssued { plan: p, mem, ranks: [(0, rec.streams)], stamped }
}

/// Rank `rank` of `n` alone in the model (`solo_issue`): its output in each order.
fn solo_emulated(case: &Case, schedule: Schedule, n: usize, rank: usize, inbox: &[Vec<Vec<u8>>]) -> Vec<Vec<u8>> {
    let SoloIssued { mem, ranks, .. } = solo_issue(case, schedule, n, rank, inbox, false);
    ORDERS
        .iter()
        .map(|&order| {
            let mem = Memory { buffers: mem.buffers.clone(), ..Memory::default() };
            let mem =
                run_streams(mem, &ranks, order).unwrap_or_else(|e| panic!("{:?} {schedule:?} {order:?}: {e}", case.0));
            mem.buffers[2].clone()
        })
        .collect()
}

/// One rank of a group alone (the one-rank mode), every op kind and
/// schedule, N = 2, 3, 4 and 8, the first and the last rank: given its
/// peers' messages, it computes what the CPU backend computes for it, in
/// every stream order (the copies, not only the GEMMs, are waited for).
#[test]
fn one_rank_alone_computes_what_the_cpu_backend_computes() {
    let mut site = 0x0c11_a000;
    let mut differed = Vec::new();
    for n in [2usize, 3, 4, 8] {
        for case in cases(n as i64) {
            for schedule in schedules(case.0) {
                site += 1;
                let want = reference(&case, schedule, n, site);
                for rank in [0, n - 1] {
                    let inbox = solo_inbox(&case, schedule, n, rank);
                    assert!(inbox.iter().map(Vec::len).sum::<usize>() > 0, "{:?} {schedule:?}: no messages", case.0);
                    for (order, got) in ORDERS.iter().zip(solo_emulated(&case, schedule, n, rank, &inbox)) {
                        if got != want[rank] {
                            differed.push(format!("{:?} {schedule:?} n={n} rank {rank} {order:?}", case.0));
                        }
                    }
                }
            }
        }
    }
    assert!(differed.is_empty(), "differ from the CPU backend: {differed:?}");
}

/// The comparison above sees the messages: with each one's values negated
/// (same sizes, same order), rank 0's output differs in every order.
#[test]
fn one_rank_alone_with_other_messages_differs() {
    let case = &cases(4)[0];
    let want = reference(case, Schedule::Ring, 4, 0x0c12_a000);
    let mut inbox = solo_inbox(case, Schedule::Ring, 4, 0);
    for byte in inbox.iter_mut().flatten().flat_map(|m| m.iter_mut().skip(3).step_by(4)) {
        *byte ^= 0x80; // an f32's sign bit
    }
    let got = solo_emulated(case, Schedule::Ring, 4, 0, &inbox);
    assert!(got.iter().all(|g| *g != want[0]));
}

/// What is wrong with a one-rank call's timeline `events` of `plan` (none:
/// fine): each step is one slice; a lane's slices are in its order and apart;
/// each step begins after the steps it depends on end. `slack_ns` forgives
/// a clock's resolution.
pub fn timeline_faults(plan: &Plan, events: &[crate::trace::Event], slack_ns: u64) -> Vec<String> {
    use crate::plan::Lane;
    use crate::trace::Kind;
    let mut faults = Vec::new();
    let mut spans = vec![None; plan.steps.len()];
    for e in events.iter().filter(|e| !matches!(e.kind, Kind::Call | Kind::Wait)) {
        match e.step.and_then(|id| spans.get_mut(id)) {
            Some(span @ None) => *span = Some((e.start_ns, e.end_ns)),
            _ => faults.push(format!("a stray or second slice: {e:?}")),
        }
    }
    let Some(spans) = spans.into_iter().collect::<Option<Vec<(u64, u64)>>>() else {
        faults.push("a step without a slice".into());
        return faults;
    };
    for lane in [Lane::Compute, Lane::Comm] {
        let ids: Vec<usize> = plan.lane_steps(lane).map(|s| s.id).collect();
        for pair in ids.windows(2) {
            if spans[pair[0]].1 > spans[pair[1]].0 + slack_ns {
                faults.push(format!("steps {pair:?} overlap on their lane: {:?}", (spans[pair[0]], spans[pair[1]])));
            }
        }
    }
    for step in &plan.steps {
        for &dep in &step.deps {
            if spans[dep].1 > spans[step.id].0 + slack_ns {
                faults.push(format!("step {} began before its dependency {dep} ended", step.id));
            }
        }
    }
    faults
}

/// The one-rank mode's device timeline (`solo_device::timeline`) in the
/// model, every op kind and schedule at N = 4, each stream order: a stamp
/// before and after each step on its lane makes one slice per step, the
/// slices of a lane in its order and apart, and every step after the steps
/// of the other lane it depends on — which holds only if each first stamp
/// comes after the step's waits. The stamps leave the output as it was.
#[test]
fn one_rank_alone_has_a_device_timeline_with_each_step_after_its_dependencies() {
    use crate::trace::{self, CallLabel, Kind};
    let (n, rank) = (4, 0);
    let mut waits = 0;
    for case in cases(n as i64) {
        for schedule in schedules(case.0) {
            let want = reference(&case, schedule, n, 0x0c13_a000);
            let inbox = solo_inbox(&case, schedule, n, rank);
            let SoloIssued { plan: p, mem, ranks, stamped } = solo_issue(&case, schedule, n, rank, &inbox, true);
            let problem = problem_of(&case, n, schedule);
            let label = CallLabel::new(0, 1, case.0.name(), &p, &problem, problem.sizes().x * 4);
            for order in ORDERS {
                let what = format!("{:?} {schedule:?} {order:?}", case.0);
                let fresh = Memory { buffers: mem.buffers.clone(), ..Memory::default() };
                let ran = run_streams(fresh, &ranks, order).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(ran.buffers[2] == want[rank], "{what}: the stamps changed the output");
                let at = |stamp: usize| ran.stamps[&stamp];
                let spans: Vec<Option<(u64, u64)>> =
                    stamped.iter().map(|pair| pair.map(|(a, b)| (at(a), at(b)))).collect();
                let events = trace::call_events(&p, &spans, &label, 0, at(0), &[]);
                let faults = timeline_faults(&p, &events, 0);
                assert!(faults.is_empty(), "{what}: {faults:?}");
                waits += events.iter().filter(|e| e.kind == Kind::Wait).count();
                let json: serde_json::Value = serde_json::from_slice(&trace::encode_json(&events)).unwrap();
                assert_eq!(
                    json["traceEvents"].as_array().map(|a| a.iter().filter(|e| e["ph"] == "X").count()),
                    Some(events.len())
                );
            }
        }
    }
    assert!(waits > 0, "some step waited for the other lane");
}
