//! A host emulation of the CUDA path, to check it end to end without a GPU,
//! side by side with the CPU backend.
//!
//! Every rank's call is issued exactly as the handler issues it
//! (`stream_issue::issue` over the site's `site_ops::SiteOps`, each step's
//! operations bound to the rank's buffers at XLA-style device addresses),
//! into recorded per-stream command lists. Then the streams of all ranks run in a
//! discrete-event model of CUDA and NCCL: a stream runs its commands in
//! order, a wait blocks until the event's record has run, a GEMM follows
//! `cublasGemmEx`'s column-major definition on the addresses `gemm::enqueue`
//! passes, a sum follows the kernel's definition, and an NCCL group posts its
//! sends, then completes when every receive has a message from its peer
//! (per pair of ranks, first in first out, as NCCL matches point-to-point
//! calls). The outputs must equal those of the CPU backend on the same inputs.
#![forbid(unsafe_code)]

use super::addresses::{Bases, DeviceBuffers, DeviceOp, Region};
use super::fp8_gemm::LtType;
use super::gemm::ColMajor;
use super::site_ops::SiteOps;
use super::stream_issue::{issue, StreamOps};
use crate::backend::cpu::{self, transport};
use crate::dtype::DType;
use crate::error::Result;
use crate::plan::{plan, Schedule, Step};
use crate::problem::{OpKind, Operand, Problem};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// One command on one stream of the emulated device: a site's operation
/// with the call's bases it is bound to.
#[derive(Debug, Clone)]
enum Cmd {
    Record(usize),
    Wait(usize),
    Op(Box<DeviceOp>, Bases),
}

/// Records what the handler would enqueue; stream `lanes.len()` is XLA's.
struct Recorder<'a> {
    site: &'a SiteOps,
    bases: Bases,
    streams: Vec<Vec<Cmd>>,
}

impl Recorder<'_> {
    fn stream(&mut self, stream: Option<usize>) -> &mut Vec<Cmd> {
        let xla = self.streams.len() - 1;
        &mut self.streams[stream.unwrap_or(xla)]
    }
}

impl StreamOps for Recorder<'_> {
    fn record(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        self.stream(stream).push(Cmd::Record(event));
        Ok(())
    }
    fn wait(&mut self, stream: Option<usize>, event: usize) -> Result<()> {
        self.stream(stream).push(Cmd::Wait(event));
        Ok(())
    }
    fn run(&mut self, lane: usize, step: &Step) -> Result<()> {
        let bases = self.bases;
        self.streams[lane].extend(self.site.steps[step.id].iter().map(|op| Cmd::Op(Box::new(op.clone()), bases)));
        Ok(())
    }
    /// Marks only tell the watchdog that a call moves: nothing to emulate.
    fn mark(&mut self, _lane: usize, _mark: usize) -> Result<()> {
        Ok(())
    }
}

/// Device memory of all ranks: buffer `id` lives at `base(id)`.
struct Memory {
    buffers: Vec<Vec<u8>>,
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

/// The outputs of every rank through the emulated CUDA path.
/// `reverse` visits ranks and streams backwards, one command per visit
/// (another interleaving than the forward, run-as-far-as-possible one).
fn emulated(problem: &Problem, kind: OpKind, schedule: Schedule, n: usize, reverse: bool) -> Vec<Vec<u8>> {
    let sizes = problem.sizes();
    let mut mem = Memory { buffers: Vec::new() };
    // Per rank: buffer ids of x, w, out, workspace, and the recorded streams.
    let mut ranks = Vec::new();
    for rank in 0..n {
        let p = plan(kind.pattern(), schedule, n, rank);
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
        let mut rec = Recorder { site: &site, bases, streams: vec![Vec::new(); site.streams.lanes.len() + 1] };
        issue(&p, &site.streams, &mut rec, 0, None).unwrap();
        ranks.push((id, rec.streams, site.events));
    }
    // Run all streams of all ranks until none can move.
    let mut channels = HashMap::new();
    let mut pc: Vec<Vec<usize>> = ranks.iter().map(|(_, s, _)| vec![0; s.len()]).collect();
    let mut posted: Vec<Vec<bool>> = ranks.iter().map(|(_, s, _)| vec![false; s.len()]).collect();
    let mut recorded: Vec<Vec<bool>> = ranks.iter().map(|(_, _, e)| vec![false; *e]).collect();
    loop {
        let mut moved = false;
        let mut visits: Vec<(usize, usize)> =
            ranks.iter().enumerate().flat_map(|(r, (_, st, _))| (0..st.len()).map(move |s| (r, s))).collect();
        if reverse {
            visits.reverse();
        }
        for (r, s) in visits {
            let cmds = &ranks[r].1[s];
            while let Some(cmd) = cmds.get(pc[r][s]) {
                let done = match cmd {
                    Cmd::Record(e) => {
                        recorded[r][*e] = true;
                        true
                    }
                    Cmd::Wait(e) => recorded[r][*e],
                    Cmd::Op(op, bases) => execute(op, bases, r, &mut mem, &mut channels, &mut posted[r][s]),
                };
                if !done {
                    break;
                }
                pc[r][s] += 1;
                moved = true;
                if reverse {
                    break;
                }
            }
        }
        if !moved {
            break;
        }
    }
    for (r, (_, streams, _)) in ranks.iter().enumerate() {
        for (s, cmds) in streams.iter().enumerate() {
            assert_eq!(pc[r][s], cmds.len(), "{kind:?} {schedule:?}: rank {r} stream {s} is stuck");
        }
    }
    assert!(channels.values().all(|q| q.is_empty()), "{kind:?} {schedule:?}: messages nobody received");
    ranks.iter().map(|(id, _, _)| mem.buffers[id + 2].clone()).collect()
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
                    let p = plan(kind.pattern(), schedule, n, rank);
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

/// Small shapes of every op kind for `n` ranks (dimension 0 for row kinds).
pub fn cases(n: i64) -> Vec<Case> {
    use OpKind::*;
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
    ]
}

/// The outputs of `case` on every rank through the CPU backend, for the
/// inputs `fill` gives (used by the GPU test of `device` too).
pub fn reference(case: &Case, schedule: Schedule, n: usize, site: i64) -> Vec<Vec<u8>> {
    let (kind, x, w, out) = case;
    let op = |dims| Operand { dims, dtype: DType::F32 };
    let problem = Problem::new(*kind, op(x), op(w), op(out), 0, n).unwrap();
    let problem = problem.for_schedule(schedule).unwrap();
    on_cpu(&problem, *kind, schedule, n, site)
}

#[test]
fn the_cuda_path_computes_what_the_cpu_backend_computes() {
    let mut site = 0x0c0d_a000;
    for n in 1..=4 {
        for case in cases(n as i64) {
            let (kind, x, w, out) = &case;
            let op = |dims| Operand { dims, dtype: DType::F32 };
            let problem = Problem::new(*kind, op(x), op(w), op(out), 0, n).unwrap();
            let mut schedules = vec![Schedule::Auto, Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential];
            if kind.row_blocks() {
                schedules.push(Schedule::Sliced { slices: 3 }); // the cases' blocks have 3 rows
            }
            for schedule in schedules {
                let problem = problem.for_schedule(schedule).unwrap();
                site += 1;
                let want = reference(&case, schedule, n, site);
                for reverse in [false, true] {
                    let got = emulated(&problem, *kind, schedule, n, reverse);
                    for rank in 0..n {
                        assert!(
                            got[rank] == want[rank],
                            "{kind:?} {schedule:?} n={n}: rank {rank} differs from the CPU backend"
                        );
                    }
                }
            }
        }
    }
}
