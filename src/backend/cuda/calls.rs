//! The pure half of one device call: where each plan buffer lives in XLA's
//! device memory, which GEMM operands, NCCL transfers and kernel launches a
//! step becomes, how long a host-side poll may last, and which CUDA devices a
//! group's members are. No device is touched here, so all of it is tested
//! without a GPU; `device` feeds these descriptions to the driver, cuBLAS and
//! NCCL.
#![forbid(unsafe_code)]

use super::gemm::Operands;
use super::nccl::P2p;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::{Action, Buf, SlotKind, Transfer, Workspace};
use crate::problem::{Gemm, Problem, Side};
use std::time::{Duration, Instant};

/// A device buffer: address, length in bytes, element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub addr: u64,
    pub bytes: usize,
    pub dtype: DType,
}

/// XLA's buffers of one call, as device addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuffers {
    pub x: Region,
    pub w: Region,
    pub out: Region,
    /// The workspace result: start and length in bytes.
    pub workspace: (u64, usize),
}

/// The most terms one sum kernel takes (`MAX_TERMS` in `kernels/elementwise.cu`).
pub const MAX_TERMS: usize = 8;

/// One launch of a `sum_*` kernel of `kernels/elementwise.cu`:
/// `dst[i] = Σ_{t<k} terms[t][i]` for `i < n`, in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumLaunch {
    pub kernel: &'static str,
    pub dst: u64,
    pub terms: [u64; MAX_TERMS],
    pub k: i32,
    pub n: u64,
}

/// What one plan step becomes on the device, in enqueue order.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceOp {
    /// One `cublasGemmEx` (`gemm::enqueue`).
    Gemm { gemm: Gemm, ops: Operands, accumulate: bool },
    /// One launch of a sum kernel.
    Sum(SumLaunch),
    /// One NCCL group of sends and receives (`nccl::enqueue_exchange`).
    Exchange { sends: Vec<P2p>, recvs: Vec<P2p> },
}

/// Maps the plan's buffers onto XLA's memory for one call.
pub struct Resolver<'a> {
    pub problem: &'a Problem,
    pub layout: &'a Workspace,
    pub slot_kinds: &'a [SlotKind],
    pub buffers: DeviceBuffers,
}

impl Resolver<'_> {
    /// Checks that the GPU path takes the call: float32, bfloat16 or float16
    /// in and out (f32 accumulation), and a workspace as large as the layout.
    pub fn new<'a>(
        problem: &'a Problem,
        layout: &'a Workspace,
        slot_kinds: &'a [SlotKind],
        buffers: DeviceBuffers,
    ) -> Result<Resolver<'a>> {
        for dtype in [problem.input, problem.output] {
            if dtype == DType::F64 {
                return Err(Error::Unimplemented("the CUDA backend does not take float64".into()));
            }
        }
        // cublasGemmEx with f32 compute takes f32→f32, bf16→bf16|f32 and
        // f16→f16|f32 (A and B of the input type, C of the output type);
        // slots are f32, so each input type also needs its f32 output.
        use DType::*;
        if !matches!((problem.input, problem.output), (F32, F32) | (BF16, BF16 | F32) | (F16, F16 | F32)) {
            return Err(Error::Unimplemented(format!(
                "the CUDA backend does not take {} operands with a {} result (cublasGemmEx has no such \
                 combination); cast the operands or ask for float32",
                problem.input.name(),
                problem.output.name()
            )));
        }
        if problem.accumulator() != DType::F32 {
            return Err(Error::Internal(format!("accumulator {:?} on the GPU path", problem.accumulator())));
        }
        if buffers.workspace.1 < layout.total {
            return Err(Error::InvalidArgument(format!(
                "workspace has {} bytes, the plan needs {}",
                buffers.workspace.1, layout.total
            )));
        }
        if slot_kinds.len() != layout.slots.len() {
            return Err(Error::Internal("slot kinds and workspace layout disagree".into()));
        }
        Ok(Resolver { problem, layout, slot_kinds, buffers })
    }

    /// Workspace slot `i`: its region, in the input type (travelling blocks)
    /// or in f32 (partials and results).
    pub fn slot(&self, i: usize) -> Result<Region> {
        let range = self.layout.slots.get(i).ok_or_else(|| Error::Internal(format!("no slot {i}")))?;
        let dtype = match self.slot_kinds[i] {
            SlotKind::Input => self.problem.input,
            SlotKind::Partial | SlotKind::Result => DType::F32,
        };
        Ok(Region { addr: self.buffers.workspace.0 + range.start as u64, bytes: range.len(), dtype })
    }

    /// Base address and type of the `x`-side data a matmul reads from `src`
    /// (`Problem::gemms` offsets are relative to the whole of `x` for `X` and
    /// `XBlock`, and to the slot for a received block).
    fn src(&self, src: Buf) -> Result<(u64, DType)> {
        match src {
            Buf::X | Buf::XBlock(_) => Ok((self.buffers.x.addr, self.buffers.x.dtype)),
            Buf::Slot(i) if self.slot_kinds.get(i) == Some(&SlotKind::Input) => {
                let s = self.slot(i)?;
                Ok((s.addr, s.dtype))
            }
            other => Err(Error::Internal(format!("matmul reads {other:?}"))),
        }
    }

    /// Base address and type a matmul writes into.
    fn dst(&self, dst: Buf, accumulate: bool) -> Result<(u64, DType)> {
        let (addr, dtype) = match dst {
            Buf::Out | Buf::OutBlock(_) => (self.buffers.out.addr, self.buffers.out.dtype),
            Buf::Slot(i) if self.slot_kinds.get(i) != Some(&SlotKind::Input) => {
                let s = self.slot(i)?;
                (s.addr, s.dtype)
            }
            other => return Err(Error::Internal(format!("matmul writes {other:?}"))),
        };
        // As on the CPU: partial sums stay in f32; only whole products land
        // in a narrower output.
        if accumulate && dtype != DType::F32 {
            return Err(Error::Internal(format!("accumulating into {} {dst:?}", dtype.name())));
        }
        Ok((addr, dtype))
    }

    /// The cuBLAS operands of one GEMM of a matmul step.
    pub fn operands(&self, g: &Gemm, src: Buf, dst: Buf, accumulate: bool) -> Result<Operands> {
        let src = self.src(src)?;
        let w = (self.buffers.w.addr, self.buffers.w.dtype);
        let side = |s: Side| if s == Side::Src { src } else { w };
        Ok(Operands { lhs: side(g.lhs.0), rhs: side(g.rhs.0), dst: self.dst(dst, accumulate)? })
    }

    /// The device operations of one step: the only description of a step
    /// the device path uses (and the host emulation in the tests runs).
    pub fn lower(&self, action: &Action) -> Result<Vec<DeviceOp>> {
        match action {
            Action::Matmul { block, src, dst, accumulate } => self
                .problem
                .gemms(*block, *src, *dst)
                .into_iter()
                .map(|gemm| {
                    Ok(DeviceOp::Gemm {
                        gemm,
                        ops: self.operands(&gemm, *src, *dst, *accumulate)?,
                        accumulate: *accumulate,
                    })
                })
                .collect(),
            Action::Sum { terms, dst } => Ok(vec![DeviceOp::Sum(self.sum(terms, *dst)?)]),
            Action::Exchange { sends, recvs } => {
                let p2p = |list: &[Transfer]| list.iter().map(|t| self.p2p(t)).collect::<Result<Vec<_>>>();
                Ok(vec![DeviceOp::Exchange { sends: p2p(sends)?, recvs: p2p(recvs)? }])
            }
        }
    }

    /// Address and bytes of a transfer's buffer.
    pub fn p2p(&self, t: &Transfer) -> Result<P2p> {
        let (addr, bytes) = match t.buf {
            Buf::X => (self.buffers.x.addr, self.buffers.x.bytes),
            Buf::XBlock(j) => {
                let part = self.problem.x_block(j).ok_or_else(|| Error::Internal(format!("no part {j} of x")))?;
                let size = self.problem.input.size();
                (self.buffers.x.addr + (part.start * size) as u64, part.len() * size)
            }
            Buf::Slot(i) => {
                let s = self.slot(i)?;
                (s.addr, s.bytes)
            }
            other => return Err(Error::Internal(format!("{other:?} is never transferred"))),
        };
        Ok(P2p { addr, bytes, peer: t.peer })
    }

    /// The kernel launch of a `Sum` step: in place into a slot (`dst` is
    /// `terms[0]`), or into (a block of) the output, converting to its type.
    pub fn sum(&self, terms: &[Buf], dst: Buf) -> Result<SumLaunch> {
        if terms.is_empty() || terms.len() > MAX_TERMS {
            return Err(Error::Internal(format!("a sum of {} terms", terms.len())));
        }
        let mut addrs = [0u64; MAX_TERMS];
        let mut len = None;
        for (a, t) in addrs.iter_mut().zip(terms) {
            let Buf::Slot(i) = *t else {
                return Err(Error::Internal(format!("sum reads {t:?}")));
            };
            let s = self.slot(i)?;
            if s.dtype != DType::F32 {
                return Err(Error::Internal(format!("sum reads {t:?} of type {}", s.dtype.name())));
            }
            if *len.get_or_insert(s.bytes) != s.bytes {
                return Err(Error::Internal(format!("sum of terms of different sizes: {terms:?}")));
            }
            *a = s.addr;
        }
        let term_elems = len.unwrap_or(0) / 4;
        let (kernel, dst_addr, n) = match dst {
            Buf::Slot(_) if dst == terms[0] => ("sum_f32", addrs[0], term_elems),
            Buf::Out | Buf::OutBlock(_) => {
                let range = self.problem.out_range(dst);
                let out = self.buffers.out;
                let size = out.dtype.size();
                if range.end * size > out.bytes {
                    return Err(Error::Internal(format!("sum into {range:?} of a {}-byte output", out.bytes)));
                }
                let kernel = match out.dtype {
                    DType::F32 => "sum_f32",
                    DType::BF16 => "sum_to_bf16",
                    DType::F16 => "sum_to_f16",
                    DType::F64 => return Err(Error::Unimplemented("the CUDA backend does not take float64".into())),
                };
                (kernel, out.addr + (range.start * size) as u64, range.len())
            }
            other => return Err(Error::Internal(format!("sum writes {other:?}"))),
        };
        if n != term_elems {
            return Err(Error::Internal(format!("sum of {term_elems} elements into {n}")));
        }
        let k = i32::try_from(terms.len()).map_err(|_| Error::Internal("too many terms".into()))?;
        Ok(SumLaunch { kernel, dst: dst_addr, terms: addrs, k, n: n as u64 })
    }
}

/// Threads per block of the elementwise kernels.
pub const BLOCK: u32 = 256;

/// Grid size for `n` elements of a grid-stride kernel: enough blocks to
/// cover `n` once, at most `4 × multiprocessors` (the loop does the rest).
pub fn grid(n: u64, multiprocessors: u32) -> u32 {
    let cover = n.div_ceil(u64::from(BLOCK)).max(1);
    let cap = u64::from(multiprocessors.max(1)) * 4;
    cover.min(cap) as u32
}

/// The answer of one host-side probe of an asynchronous operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poll {
    Done,
    Pending,
}

/// Calls `probe` until it is done, fails, or `deadline` passes; then
/// `DeadlineExceeded` naming `what`. Between probes the thread yields, then
/// sleeps briefly (the probes are host-side queries, never device syncs).
pub fn poll_until(deadline: Instant, what: &str, mut probe: impl FnMut() -> Result<Poll>) -> Result<()> {
    let mut spins = 0u32;
    loop {
        if probe()? == Poll::Done {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::DeadlineExceeded(format!("{what} did not complete before the deadline")));
        }
        spins += 1;
        if spins < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The `version` an `ncclConfig_t` carries: the library's own version when it
/// is older than the bindings (it then reads only the fields it knows), else
/// the bindings' (2.30.0, `NCCL_VERSION(2, 30, 0)`), so a newer library
/// never reads past the struct.
pub fn nccl_config_version(runtime: i32) -> u32 {
    const BINDINGS: i32 = 2 * 10_000 + 30 * 100;
    runtime.clamp(0, BINDINGS) as u32
}

/// XLA's device ordinal of the call must be the CUDA ordinal of its
/// stream's device: `comms::Placement` maps mesh devices to CUDA ordinals of
/// this process, which is only right if XLA numbers devices the same way.
pub fn check_same_device(xla_ordinal: i32, cuda_ordinal: i32) -> Result<()> {
    if xla_ordinal == cuda_ordinal {
        return Ok(());
    }
    Err(Error::Unimplemented(format!(
        "XLA's device ordinal {xla_ordinal} runs on CUDA device {cuda_ordinal}: the CUDA backend assumes XLA's \
         ordinals are the CUDA ordinals of this process's visible devices"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{plan, Action, Direction, Pattern, Schedule, Tag};
    use crate::problem::{OpKind, Operand};

    const X: u64 = 0x7000_0000;
    const W: u64 = 0x7100_0000;
    const OUT: u64 = 0x7200_0000;
    const WS: u64 = 0x7300_0000;

    fn problem(kind: OpKind, x: &[i64], w: &[i64], out: &[i64], input: DType, output: DType) -> Problem {
        let op = |dims, dtype| Operand { dims, dtype };
        Problem::new(kind, op(x, input), op(w, input), op(out, output), 0, 4).unwrap()
    }

    fn buffers(p: &Problem, layout: &Workspace) -> DeviceBuffers {
        let s = p.sizes();
        let region = |addr, elems: usize, dtype: DType| Region { addr, bytes: elems * dtype.size(), dtype };
        DeviceBuffers {
            x: region(X, s.x, p.input),
            w: region(W, s.w, p.input),
            out: region(OUT, s.result, p.output),
            workspace: (WS, layout.total),
        }
    }

    /// Every step of every rank's plan of every op resolves to buffers inside
    /// XLA's memory, in the types cuBLAS, NCCL and the kernels expect.
    #[test]
    fn every_step_of_every_op_resolves_inside_the_buffers() {
        use OpKind::*;
        type Case = (OpKind, Vec<i64>, Vec<i64>, Vec<i64>);
        let cases: Vec<Case> = vec![
            (AllGatherMatmul, vec![3, 8], vec![8, 6], vec![12, 6]),
            (AllGatherMatmulContract, vec![5, 3], vec![12, 7], vec![5, 7]),
            (MatmulAllGather, vec![8, 3], vec![5, 8], vec![5, 12]),
            (MatmulAllGatherContract, vec![3, 7], vec![5, 12], vec![5, 7]),
            (MatmulReduceScatter, vec![12, 8], vec![8, 6], vec![3, 6]),
            (MatmulReduceScatterCols, vec![5, 8], vec![8, 12], vec![5, 3]),
            (AllToAllMatmul, vec![4, 3, 8], vec![8, 6], vec![4, 3, 6]),
            (AllToAllMatmulContract, vec![4, 5, 3], vec![12, 6], vec![5, 6]),
            (MatmulAllToAll, vec![4, 3, 8], vec![8, 6], vec![4, 3, 6]),
            (MatmulAllToAllCols, vec![5, 8], vec![8, 12], vec![4, 5, 3]),
        ];
        let mut counts = [0usize; 3];
        for (kind, x, w, out) in &cases {
            for (input, output) in [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::F16, DType::F32)] {
                let p = problem(*kind, x, w, out, input, output);
                for schedule in [Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential] {
                    for rank in 0..4 {
                        let plan = plan(kind.pattern(), schedule, 4, rank);
                        let layout = Workspace::layout(&plan, &p.sizes());
                        let b = buffers(&p, &layout);
                        let r = Resolver::new(&p, &layout, &plan.slots, b).unwrap();
                        let inside = |addr: u64, bytes: usize| {
                            [(X, b.x.bytes), (W, b.w.bytes), (OUT, b.out.bytes), (WS, layout.total)]
                                .iter()
                                .any(|&(base, len)| addr >= base && addr + bytes as u64 <= base + len as u64)
                        };
                        for step in &plan.steps {
                            match &step.action {
                                Action::Matmul { block, src, dst, accumulate } => {
                                    for g in p.gemms(*block, *src, *dst) {
                                        let ops = r.operands(&g, *src, *dst, *accumulate).unwrap();
                                        for ((base, dtype), view) in
                                            [(ops.lhs, g.lhs.1), (ops.rhs, g.rhs.1), (ops.dst, g.dst)]
                                        {
                                            let (start, end) = (view.offset * dtype.size(), view.end() * dtype.size());
                                            assert!(inside(base + start as u64, end - start), "{kind:?} {step:?}");
                                        }
                                        assert_eq!(ops.rhs.1, if g.rhs.0 == Side::W { input } else { ops.lhs.1 });
                                        counts[0] += 1;
                                    }
                                }
                                Action::Sum { terms, dst } => {
                                    let s = r.sum(terms, *dst).unwrap();
                                    let out_size = if s.kernel == "sum_f32" { 4 } else { 2 };
                                    assert_eq!(
                                        s.kernel == "sum_f32",
                                        *dst != Buf::Out && !matches!(dst, Buf::OutBlock(_)) || output == DType::F32
                                    );
                                    assert!(inside(s.dst, s.n as usize * out_size), "{kind:?} {step:?}");
                                    for t in &s.terms[..s.k as usize] {
                                        assert!(inside(*t, s.n as usize * 4));
                                    }
                                    assert!(s.terms[s.k as usize..].iter().all(|&t| t == 0));
                                    counts[1] += 1;
                                }
                                Action::Exchange { sends, recvs } => {
                                    for t in sends.iter().chain(recvs) {
                                        let m = r.p2p(t).unwrap();
                                        assert!(m.bytes > 0 && inside(m.addr, m.bytes), "{kind:?} {t:?}");
                                        assert_eq!(m.peer, t.peer);
                                    }
                                    // A send and its matching receive on the peer carry as many bytes.
                                    for (s, rv) in sends.iter().zip(recvs) {
                                        assert_eq!(r.p2p(s).unwrap().bytes, r.p2p(rv).unwrap().bytes, "{kind:?}");
                                    }
                                    counts[2] += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(counts.iter().all(|&c| c > 50), "{counts:?}");
    }

    #[test]
    fn bad_calls_are_refused() {
        let p = problem(OpKind::MatmulReduceScatter, &[12, 8], &[8, 6], &[3, 6], DType::F32, DType::F32);
        let plan = plan(Pattern::Scatter, Schedule::Ring, 4, 1);
        let layout = Workspace::layout(&plan, &p.sizes());
        let mut b = buffers(&p, &layout);
        b.workspace.1 -= 1;
        assert!(matches!(Resolver::new(&p, &layout, &plan.slots, b), Err(Error::InvalidArgument(_))));
        let b = buffers(&p, &layout);
        let r = Resolver::new(&p, &layout, &plan.slots, b).unwrap();
        let tag = Tag { direction: Direction::Forward, step: 0 };
        assert!(r.p2p(&Transfer { peer: 0, buf: Buf::Out, tag }).is_err());
        assert!(r.p2p(&Transfer { peer: 0, buf: Buf::XBlock(4), tag }).is_err());
        assert!(r.sum(&[], Buf::Out).is_err());
        assert!(r.sum(&[Buf::X], Buf::Out).is_err());
        assert!(r.slot(99).is_err());

        for (input, output) in [(DType::F32, DType::BF16), (DType::BF16, DType::F16), (DType::F16, DType::BF16)] {
            let p = problem(OpKind::MatmulReduceScatter, &[12, 8], &[8, 6], &[3, 6], input, output);
            let layout = Workspace::layout(&plan, &p.sizes());
            let b = buffers(&p, &layout);
            let e = Resolver::new(&p, &layout, &plan.slots, b).err().unwrap();
            assert!(matches!(&e, Error::Unimplemented(m) if m.contains("cublasGemmEx")), "{e}");
        }
        let p64 = problem(OpKind::MatmulReduceScatter, &[12, 8], &[8, 6], &[3, 6], DType::F64, DType::F64);
        let layout = Workspace::layout(&plan, &p64.sizes());
        let b = buffers(&p64, &layout);
        assert!(matches!(Resolver::new(&p64, &layout, &plan.slots, b), Err(Error::Unimplemented(_))));
    }

    #[test]
    fn grids_cover_and_are_capped() {
        assert_eq!(grid(0, 132), 1);
        assert_eq!(grid(1, 132), 1);
        assert_eq!(grid(256, 132), 1);
        assert_eq!(grid(257, 132), 2);
        assert_eq!(grid(u64::MAX, 132), 528);
        assert_eq!(grid(1 << 20, 0), 4);
    }

    #[test]
    fn polls_end_on_done_error_or_deadline() {
        let far = Instant::now() + Duration::from_secs(60);
        let mut n = 0;
        poll_until(far, "x", || {
            n += 1;
            Ok(if n < 100 { Poll::Pending } else { Poll::Done })
        })
        .unwrap();
        assert_eq!(n, 100);
        let e = poll_until(far, "x", || Err(Error::Internal("boom".into()))).unwrap_err();
        assert_eq!(e, Error::Internal("boom".into()));
        let soon = Instant::now() + Duration::from_millis(20);
        let e = poll_until(soon, "NCCL group", || Ok(Poll::Pending)).unwrap_err();
        assert!(matches!(&e, Error::DeadlineExceeded(m) if m.contains("NCCL group")), "{e}");
        assert!(Instant::now() >= soon);
    }

    #[test]
    fn nccl_config_versions() {
        assert_eq!(nccl_config_version(22_105), 22_105);
        assert_eq!(nccl_config_version(23_000), 23_000);
        assert_eq!(nccl_config_version(23_104), 23_000);
        assert_eq!(nccl_config_version(-1), 0);
    }

    #[test]
    fn xla_ordinals_must_be_cuda_ordinals() {
        assert!(check_same_device(3, 3).is_ok());
        let e = check_same_device(1, 0).unwrap_err();
        assert!(matches!(&e, Error::Unimplemented(m) if m.contains("CUDA device 0")), "{e}");
    }
}
