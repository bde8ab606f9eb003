//! The pure half of one device call: where each plan buffer lives in XLA's
//! device memory, which GEMM operands, NCCL transfers and kernel launches a
//! step becomes, how long a host-side poll may last, and which CUDA devices a
//! group's members are. No device is touched here, so all of it is tested
//! without a GPU; `enqueue` hands these descriptions to the safe layers
//! (`driver`, `blas`, `nccl`).
//!
//! A step's device operations are lowered once per call site (`site_ops`),
//! addressed relative to the call's buffers ([`Addr`]); each call binds them
//! to its buffers' device addresses ([`Bases`]) as it enqueues them.
#![forbid(unsafe_code)]

use super::fp8_gemm::{Fp8, Fp8Gemm, Matrix, OutType};
use super::gemm::Operands;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::{Action, Buf, SlotKind, Transfer, Workspace};
use crate::problem::{Gemm, Problem, Side, View};
use std::time::{Duration, Instant};

/// One transfer of an exchange: an address (`A`: a device address, or
/// [`Addr`] as lowered for a site), its length in bytes, the peer's
/// rank in the communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2p<A = u64> {
    pub addr: A,
    pub bytes: usize,
    pub peer: usize,
}

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
    /// fp8 calls only: the device addresses of the float32 scalars
    /// `x_scale` and `w_scale` (operands 2 and 3). With fp8 operands, `w`
    /// is K-major: its `[k, n]` elements are stored as `[n, k]` row-major
    /// (the lowering asks XLA for that layout).
    pub scales: Option<(u64, u64)>,
}

impl DeviceBuffers {
    /// The device address of each [`Base`]: what binds a site's device
    /// operations to this call (absent scales bind to 0, which the fp8
    /// lowering refuses).
    pub fn bases(&self) -> Bases {
        let (x_scale, w_scale) = self.scales.unwrap_or((0, 0));
        Bases([self.x.addr, self.w.addr, self.out.addr, self.workspace.0, x_scale, w_scale])
    }
}

/// The buffers of one call that its device operations address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base {
    X = 0,
    W = 1,
    Out = 2,
    Workspace = 3,
    XScale = 4,
    WScale = 5,
}

/// A place in one of a call's buffers: `offset` bytes into `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addr {
    pub base: Base,
    pub offset: u64,
}

impl Addr {
    pub fn of(base: Base) -> Addr {
        Addr { base, offset: 0 }
    }

    pub fn plus(self, bytes: u64) -> Addr {
        Addr { base: self.base, offset: self.offset + bytes }
    }
}

/// One call's device address of each [`Base`] (`DeviceBuffers::bases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bases(pub [u64; 6]);

impl Bases {
    pub fn at(&self, a: Addr) -> u64 {
        self.0[a.base as usize] + a.offset
    }
}

impl Operands<Addr> {
    pub fn bind(&self, bases: &Bases) -> Operands {
        let at = |(a, dtype): (Addr, DType)| (bases.at(a), dtype);
        Operands { lhs: at(self.lhs), rhs: at(self.rhs), dst: at(self.dst) }
    }
}

impl P2p<Addr> {
    pub fn bind(&self, bases: &Bases) -> P2p {
        P2p { addr: bases.at(self.addr), bytes: self.bytes, peer: self.peer }
    }
}

impl<T: Copy> Matrix<T, Addr> {
    pub fn bind(&self, bases: &Bases) -> Matrix<T> {
        Matrix { addr: bases.at(self.addr), dtype: self.dtype, ld: self.ld }
    }
}

impl Fp8Gemm<Addr> {
    pub fn bind(&self, bases: &Bases) -> Fp8Gemm {
        Fp8Gemm {
            m: self.m,
            n: self.n,
            k: self.k,
            x: self.x.bind(bases),
            w: self.w.bind(bases),
            out: self.out.bind(bases),
            x_scale: bases.at(self.x_scale),
            w_scale: bases.at(self.w_scale),
            accumulate: self.accumulate,
        }
    }
}

/// The most terms one sum kernel takes (`MAX_TERMS` in `kernels/elementwise.cu`).
pub const MAX_TERMS: usize = 8;

/// One launch of a `sum_*` kernel of `kernels/elementwise.cu`:
/// `dst[i] = Σ_{t<k} terms[t][i]` for `i < n`, in f32. `A` is how it is
/// addressed: [`Addr`] as lowered for a site, device addresses once bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumLaunch<A = u64> {
    pub kernel: &'static str,
    pub dst: A,
    /// The first `k` are the terms.
    pub terms: [Option<A>; MAX_TERMS],
    pub k: i32,
    pub n: u64,
}

impl SumLaunch<Addr> {
    pub fn bind(&self, bases: &Bases) -> SumLaunch {
        SumLaunch {
            kernel: self.kernel,
            dst: bases.at(self.dst),
            terms: self.terms.map(|t| t.map(|a| bases.at(a))),
            k: self.k,
            n: self.n,
        }
    }
}

impl SumLaunch {
    /// The kernel's `Terms` parameter: eight pointers, null past the `k` terms.
    pub fn kernel_terms(&self) -> [u64; MAX_TERMS] {
        self.terms.map(|t| t.unwrap_or(0))
    }
}

/// What one plan step becomes on the device, in enqueue order, addressed
/// relative to the call's buffers (bound per call with [`Bases`]).
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceOp {
    /// One `cublasGemmEx` (`blas::BlasHandle::gemm`).
    Gemm { gemm: Gemm, ops: Operands<Addr>, accumulate: bool },
    /// One launch of a sum kernel.
    Sum(SumLaunch<Addr>),
    /// One cuBLASLt fp8 GEMM (`blas::LtHandle::matmul` of `Fp8Gemm::lower`).
    Fp8Gemm(Fp8Gemm<Addr>),
    /// One group of sends and receives (`nccl::Comm::exchange`, or the copy transport's `copies::exchange`).
    Exchange { sends: Vec<P2p<Addr>>, recvs: Vec<P2p<Addr>> },
}

/// A workspace slot: where it starts, its bytes and element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub addr: Addr,
    pub bytes: usize,
    pub dtype: DType,
}

/// Maps the plan's buffers onto a call's buffers ([`Addr`]s), once per site.
pub struct Resolver<'a> {
    pub problem: &'a Problem,
    pub layout: &'a Workspace,
    pub slot_kinds: &'a [SlotKind],
}

impl Resolver<'_> {
    /// Checks that the GPU path takes the call: float32, bfloat16 or float16
    /// in and out (f32 accumulation), or the fp8 combinations `check_fp8` names.
    pub fn new<'a>(problem: &'a Problem, layout: &'a Workspace, slot_kinds: &'a [SlotKind]) -> Result<Resolver<'a>> {
        for dtype in [problem.input, problem.output] {
            if dtype == DType::F64 {
                return Err(Error::Unimplemented("the CUDA backend does not take float64".into()));
            }
        }
        if problem.input.is_fp8() || problem.output.is_fp8() {
            check_fp8(problem)?;
        }
        // cublasGemmEx with f32 compute takes f32→f32, bf16→bf16|f32 and
        // f16→f16|f32 (A and B of the input type, C of the output type);
        // slots are f32, so each input type also needs its f32 output.
        // fp8 inputs go to cuBLASLt, which writes bf16, f16 or f32.
        use DType::*;
        if !problem.input.is_fp8()
            && !matches!((problem.input, problem.output), (F32, F32) | (BF16, BF16 | F32) | (F16, F16 | F32))
        {
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
        if slot_kinds.len() != layout.slots.len() {
            return Err(Error::Internal("slot kinds and workspace layout disagree".into()));
        }
        Ok(Resolver { problem, layout, slot_kinds })
    }

    /// Bytes of `x`, `w` and `out` (the problem's sizes in their types).
    pub fn buffer_bytes(&self) -> [usize; 3] {
        let s = self.problem.sizes();
        [s.x * self.problem.input.size(), s.w * self.problem.input.size(), s.result * self.problem.output.size()]
    }

    /// Workspace slot `i`: its region, in the input type (travelling blocks)
    /// or in f32 (partials and results).
    pub fn slot(&self, i: usize) -> Result<Slot> {
        let range = self.layout.slots.get(i).ok_or_else(|| Error::Internal(format!("no slot {i}")))?;
        let dtype = match self.slot_kinds[i] {
            SlotKind::Input | SlotKind::Weight => self.problem.input,
            SlotKind::Partial | SlotKind::Result => DType::F32,
        };
        Ok(Slot { addr: Addr::of(Base::Workspace).plus(range.start as u64), bytes: range.len(), dtype })
    }

    /// Base address and type of the `x`-side data a matmul reads from `src`
    /// (`Problem::gemms` offsets are relative to the whole of `x` for `X` and
    /// `XBlock`, and to the slot for a received block).
    fn src(&self, src: Buf) -> Result<(Addr, DType)> {
        match src {
            Buf::X | Buf::XBlock(_) => Ok((Addr::of(Base::X), self.problem.input)),
            Buf::Slot(i) if self.slot_kinds.get(i) == Some(&SlotKind::Input) => {
                let s = self.slot(i)?;
                Ok((s.addr, s.dtype))
            }
            other => Err(Error::Internal(format!("matmul reads {other:?}"))),
        }
    }

    /// Base address and type of the `w`-side data a matmul multiplies by:
    /// the local `w`, or a received block of it.
    fn with(&self, with: Buf) -> Result<(Addr, DType)> {
        match with {
            Buf::W => Ok((Addr::of(Base::W), self.problem.input)),
            Buf::Slot(i) if self.slot_kinds.get(i) == Some(&SlotKind::Weight) => {
                let s = self.slot(i)?;
                Ok((s.addr, s.dtype))
            }
            other => Err(Error::Internal(format!("matmul multiplies by {other:?}"))),
        }
    }

    /// Base address and type a matmul writes into.
    fn dst(&self, dst: Buf, accumulate: bool) -> Result<(Addr, DType)> {
        let (addr, dtype) = match dst {
            Buf::Out | Buf::OutBlock(_) => (Addr::of(Base::Out), self.problem.output),
            Buf::Slot(i) if matches!(self.slot_kinds.get(i), Some(SlotKind::Partial | SlotKind::Result)) => {
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
    pub fn operands(&self, g: &Gemm, src: Buf, with: Buf, dst: Buf, accumulate: bool) -> Result<Operands<Addr>> {
        let src = self.src(src)?;
        let w = self.with(with)?;
        let side = |s: Side| if s == Side::Src { src } else { w };
        Ok(Operands { lhs: side(g.lhs.0), rhs: side(g.rhs.0), dst: self.dst(dst, accumulate)? })
    }

    /// The cuBLASLt GEMM of one fp8 GEMM view: `x`-side rows as they are
    /// (`[m, k]`, contiguous along k), `w` K-major (see `DeviceBuffers::scales`).
    /// The row kinds that take fp8 read the whole of `w` in every GEMM, so
    /// its K-major view is the whole `[n, k]` buffer.
    pub fn fp8_gemm(&self, g: &Gemm, src: Buf, dst: Buf, accumulate: bool) -> Result<Fp8Gemm<Addr>> {
        let ((Side::Src, x), (Side::W, w)) = (g.lhs, g.rhs) else {
            return Err(Error::Internal(format!("an fp8 GEMM of {g:?} with w on the left")));
        };
        let whole_w = View { offset: 0, rows: w.rows, cols: w.cols, row_stride: w.cols };
        if w != whole_w || w.rows * w.cols != self.problem.sizes().w {
            return Err(Error::Internal(format!("an fp8 GEMM reads part of w: {w:?}")));
        }
        let (src, in_type) = self.src(src)?;
        let (out, out_type) = self.dst(dst, accumulate)?;
        let ld = |v: &View| v.row_stride.max(v.cols);
        Ok(Fp8Gemm {
            m: x.rows,
            n: w.cols,
            k: x.cols,
            // fp8 elements are one byte: element offsets are byte offsets.
            x: Matrix { addr: src.plus(x.offset as u64), dtype: fp8(in_type)?, ld: ld(&x) },
            w: Matrix { addr: Addr::of(Base::W), dtype: fp8(self.problem.input)?, ld: w.rows },
            out: Matrix {
                addr: out.plus((g.dst.offset * out_type.size()) as u64),
                dtype: out_of(out_type)?,
                ld: ld(&g.dst),
            },
            x_scale: Addr::of(Base::XScale),
            w_scale: Addr::of(Base::WScale),
            accumulate,
        })
    }

    /// The device operations of one step: the only description of a step
    /// the device path uses (and the host emulation in the tests runs).
    pub fn lower(&self, action: &Action) -> Result<Vec<DeviceOp>> {
        match action {
            // fp8 calls are row gathers and scatters: they multiply by the local w.
            Action::Matmul { with, .. } if self.problem.input.is_fp8() && *with != Buf::W => {
                Err(Error::Internal(format!("an fp8 product multiplies by {with}")))
            }
            Action::Matmul { block, src, dst, accumulate, .. } if self.problem.input.is_fp8() => self
                .problem
                .gemms(*block, *src, *dst)
                .iter()
                .map(|g| self.fp8_gemm(g, *src, *dst, *accumulate).map(DeviceOp::Fp8Gemm))
                .collect(),
            Action::Matmul { block, src, with, dst, accumulate } => self
                .problem
                .gemms(*block, *src, *dst)
                .into_iter()
                .map(|gemm| {
                    Ok(DeviceOp::Gemm {
                        gemm,
                        ops: self.operands(&gemm, *src, *with, *dst, *accumulate)?,
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
    pub fn p2p(&self, t: &Transfer) -> Result<P2p<Addr>> {
        let x_bytes = self.buffer_bytes()[0];
        let (addr, bytes) = match t.buf {
            Buf::X => (Addr::of(Base::X), x_bytes),
            Buf::W => (Addr::of(Base::W), self.buffer_bytes()[1]),
            Buf::XBlock(j) => {
                let part = self.problem.x_block(j).ok_or_else(|| Error::Internal(format!("no part {j} of x")))?;
                let size = self.problem.input.size();
                (Addr::of(Base::X).plus((part.start * size) as u64), part.len() * size)
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
    pub fn sum(&self, terms: &[Buf], dst: Buf) -> Result<SumLaunch<Addr>> {
        if terms.is_empty() || terms.len() > MAX_TERMS {
            return Err(Error::Internal(format!("a sum of {} terms", terms.len())));
        }
        let mut addrs = [None; MAX_TERMS];
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
            *a = Some(s.addr);
        }
        let term_elems = len.unwrap_or(0) / 4;
        let first = addrs[0].ok_or_else(|| Error::Internal("a sum without terms".into()))?;
        let (kernel, dst_addr, n) = match dst {
            Buf::Slot(_) if dst == terms[0] => ("sum_f32", first, term_elems),
            Buf::Out | Buf::OutBlock(_) => {
                let range = self.problem.out_range(dst);
                let out = self.problem.output;
                let size = out.size();
                let out_bytes = self.buffer_bytes()[2];
                if range.end * size > out_bytes {
                    return Err(Error::Internal(format!("sum into {range:?} of a {out_bytes}-byte output")));
                }
                let kernel = match out {
                    DType::F32 => "sum_f32",
                    DType::BF16 => "sum_to_bf16",
                    DType::F16 => "sum_to_f16",
                    DType::F64 => return Err(Error::Unimplemented("the CUDA backend does not take float64".into())),
                    DType::F8E4M3FN | DType::F8E5M2 => {
                        return Err(Error::Internal(format!("a sum into a {} output", out.name())))
                    }
                };
                (kernel, Addr::of(Base::Out).plus((range.start * size) as u64), range.len())
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

/// What the fp8 path takes (GPU.md, fp8): both operands of one fp8 format,
/// not both e5m2 (cuBLASLt has no such kernel), a bf16, f16 or f32 result,
/// and the row gather or scatter ops (the two scales are checked per call,
/// `site_ops::SiteOps::bind`).
fn check_fp8(problem: &Problem) -> Result<()> {
    let (input, output) = (problem.input, problem.output);
    if !input.is_fp8() || output.is_fp8() {
        return Err(Error::Unimplemented(format!(
            "the CUDA backend takes fp8 operands with a bfloat16, float16 or float32 result, not {} operands \
             with a {} result",
            input.name(),
            output.name()
        )));
    }
    if input == DType::F8E5M2 {
        return Err(Error::Unimplemented(
            "cuBLASLt has no fp8 GEMM with both operands float8_e5m2; make one of them float8_e4m3fn".into(),
        ));
    }
    if !problem.kind.row_blocks() {
        return Err(Error::Unimplemented(format!(
            "{}: fp8 operands are supported by all_gather_matmul and matmul_reduce_scatter (row dims) only",
            problem.kind.name()
        )));
    }
    Ok(())
}

fn fp8(dtype: DType) -> Result<Fp8> {
    match dtype {
        DType::F8E4M3FN => Ok(Fp8::E4M3),
        DType::F8E5M2 => Ok(Fp8::E5M2),
        other => Err(Error::Internal(format!("{} in an fp8 GEMM", other.name()))),
    }
}

fn out_of(dtype: DType) -> Result<OutType> {
    match dtype {
        DType::BF16 => Ok(OutType::Bf16),
        DType::F16 => Ok(OutType::F16),
        DType::F32 => Ok(OutType::F32),
        other => Err(Error::Internal(format!("an fp8 GEMM into {}", other.name()))),
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

/// Calls `probe` until it is done, fails, or `deadline` passes (then
/// `DeadlineExceeded` naming `what`), or the process is interrupted (then
/// `Interrupted`). Between probes the thread yields, then sleeps briefly
/// (the probes are host-side queries, never device syncs).
pub fn poll_until(deadline: Instant, what: &str, mut probe: impl FnMut() -> Result<Poll>) -> Result<()> {
    let interrupts = crate::config::interrupts();
    let mut spins = 0u32;
    loop {
        if probe()? == Poll::Done {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::DeadlineExceeded(format!("{what} did not complete before the deadline")));
        }
        if crate::config::interrupts() != interrupts {
            return Err(Error::Interrupted(format!("{what} was stopped by an interrupt (SIGINT)")));
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
/// stream's device: `communicators::Placement` maps mesh devices to CUDA ordinals of
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
    use crate::backend::cuda::site_ops::SiteOps;
    use crate::plan::{plan, Action, Direction, Pattern, Schedule, Tag};
    use crate::problem::{OpKind, Operand};

    const X: u64 = 0x7000_0000;
    const W: u64 = 0x7100_0000;
    const OUT: u64 = 0x7200_0000;
    const WS: u64 = 0x7300_0000;

    fn problem(kind: OpKind, x: &[i64], w: &[i64], out: &[i64], input: DType, output: DType) -> Problem {
        let op = |dims, dtype| Operand { dims, dtype };
        // The two-gather case runs over F = 2 x T = 2.
        let dimension = if kind.pattern().two_axis().is_some() { 2 } else { 0 };
        Problem::new(kind, op(x, input), op(w, input), op(out, output), dimension, 4).unwrap()
    }

    fn buffers(p: &Problem, layout: &Workspace) -> DeviceBuffers {
        let s = p.sizes();
        let region = |addr, elems: usize, dtype: DType| Region { addr, bytes: elems * dtype.size(), dtype };
        DeviceBuffers {
            x: region(X, s.x, p.input),
            w: region(W, s.w, p.input),
            out: region(OUT, s.result, p.output),
            workspace: (WS, layout.total),
            scales: None,
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
            (AllGatherBothMatmul, vec![3, 10], vec![5, 6], vec![6, 6]),
            (AllGatherContractMatmulReduceScatter, vec![6, 5], vec![10, 6], vec![3, 6]),
            (AllToAllMatmul, vec![4, 3, 8], vec![8, 6], vec![4, 3, 6]),
            (AllToAllMatmulContract, vec![4, 5, 3], vec![12, 6], vec![5, 6]),
            (MatmulAllToAll, vec![4, 3, 8], vec![8, 6], vec![4, 3, 6]),
            (MatmulAllToAllCols, vec![5, 8], vec![8, 12], vec![4, 5, 3]),
            (MatmulAllReduce, vec![12, 8], vec![8, 6], vec![12, 6]),
        ];
        let mut counts = [0usize; 3];
        for (kind, x, w, out) in &cases {
            for (input, output) in [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::F16, DType::F32)] {
                let p = problem(*kind, x, w, out, input, output);
                for schedule in [Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential] {
                    for rank in 0..4 {
                        let plan = plan(p.pattern(), schedule, 4, rank);
                        let layout = Workspace::layout(&plan, &p.sizes()).unwrap();
                        let b = buffers(&p, &layout);
                        let r = Resolver::new(&p, &layout, &plan.slots).unwrap();
                        let bases = b.bases();
                        let inside = |addr: u64, bytes: usize| {
                            [(X, b.x.bytes), (W, b.w.bytes), (OUT, b.out.bytes), (WS, layout.total)]
                                .iter()
                                .any(|&(base, len)| addr >= base && addr + bytes as u64 <= base + len as u64)
                        };
                        for step in &plan.steps {
                            match &step.action {
                                Action::Matmul { block, src, with, dst, accumulate } => {
                                    for g in p.gemms(*block, *src, *dst) {
                                        let ops = r.operands(&g, *src, *with, *dst, *accumulate).unwrap().bind(&bases);
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
                                    let s = r.sum(terms, *dst).unwrap().bind(&bases);
                                    let out_size = if s.kernel == "sum_f32" { 4 } else { 2 };
                                    assert_eq!(
                                        s.kernel == "sum_f32",
                                        *dst != Buf::Out && !matches!(dst, Buf::OutBlock(_)) || output == DType::F32
                                    );
                                    assert!(inside(s.dst, s.n as usize * out_size), "{kind:?} {step:?}");
                                    for t in &s.kernel_terms()[..s.k as usize] {
                                        assert!(inside(*t, s.n as usize * 4));
                                    }
                                    assert!(s.kernel_terms()[s.k as usize..].iter().all(|&t| t == 0));
                                    counts[1] += 1;
                                }
                                Action::Exchange { sends, recvs } => {
                                    for t in sends.iter().chain(recvs) {
                                        let m = r.p2p(t).unwrap().bind(&bases);
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

    /// fp8 plans: every matmul step of all_gather_matmul and
    /// matmul_reduce_scatter (every schedule, sliced too) becomes cuBLASLt
    /// GEMMs that pass cuBLASLt's fp8 rules on sm_90, read x rows (or a
    /// received block) and the whole K-major w, write inside the output or
    /// a slot, and carry the two scales; nothing goes to cublasGemmEx.
    #[test]
    fn fp8_plans_lower_to_cublaslt_gemms_inside_the_buffers() {
        use OpKind::*;
        let (xs, ws) = (0x7400_0000, 0x7400_0010);
        let (k, n) = (64usize, 48usize);
        let mut gemms = 0;
        for ranks in 1..=4usize {
            let cases = [
                (AllGatherMatmul, vec![8 * 4, k as i64], vec![ranks as i64 * 32, n as i64]),
                (MatmulReduceScatter, vec![ranks as i64 * 32, k as i64], vec![32, n as i64]),
            ];
            for (kind, x, out) in &cases {
                let schedules =
                    [Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential, Schedule::Sliced { slices: 2 }];
                for (schedule, output) in schedules.into_iter().flat_map(|s| [(s, DType::BF16), (s, DType::F32)]) {
                    let op = |dims, dtype| Operand { dims, dtype };
                    let w = [k as i64, n as i64];
                    let p =
                        Problem::new(*kind, op(x, DType::F8E4M3FN), op(&w, DType::F8E4M3FN), op(out, output), 0, ranks)
                            .unwrap();
                    let p = p.for_schedule(schedule).unwrap();
                    for rank in 0..ranks {
                        let plan = plan(kind.pattern(), schedule, ranks, rank);
                        let layout = Workspace::layout(&plan, &p.sizes()).unwrap();
                        let b = DeviceBuffers { scales: Some((xs, ws)), ..buffers(&p, &layout) };
                        let r = Resolver::new(&p, &layout, &plan.slots).unwrap();
                        let within = |addr: u64, bytes: usize, (base, len): (u64, usize)| {
                            addr >= base && addr + bytes as u64 <= base + len as u64
                        };
                        let slots = (WS, layout.total);
                        for step in &plan.steps {
                            let ops = r.lower(&step.action).unwrap();
                            if !matches!(step.action, Action::Matmul { .. }) {
                                continue;
                            }
                            for op in ops {
                                let DeviceOp::Fp8Gemm(g) = op else {
                                    panic!("{kind:?}: an fp8 step lowered to {op:?}")
                                };
                                let g = g.bind(&b.bases());
                                let call = g.lower((9, 0)).unwrap_or_else(|e| panic!("{kind:?} {schedule:?}: {e}"));
                                assert_eq!((g.k, g.n, g.x_scale, g.w_scale), (k, n, xs, ws));
                                assert_eq!((call.a, call.a_layout.ld, call.a_scale), (W, k as i64, ws));
                                assert_eq!((g.w.dtype, g.x.dtype), (Fp8::E4M3, Fp8::E4M3));
                                let x_bytes = (g.m - 1) * g.x.ld + k;
                                assert!(
                                    within(g.x.addr, x_bytes, (X, b.x.bytes)) || within(g.x.addr, x_bytes, slots),
                                    "{kind:?} {schedule:?} rank {rank}: x outside"
                                );
                                let size = if g.out.dtype == OutType::F32 { 4 } else { 2 };
                                let out_bytes = ((g.m - 1) * g.out.ld + n) * size;
                                let in_out = within(g.out.addr, out_bytes, (OUT, b.out.bytes));
                                assert!(in_out || within(g.out.addr, out_bytes, slots), "{kind:?}: out outside");
                                // Partial sums stay f32; only whole products land in a bf16 output.
                                assert!(g.out.dtype == OutType::F32 || (in_out && !g.accumulate));
                                gemms += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(gemms > 100, "{gemms}");
    }

    #[test]
    fn fp8_calls_outside_the_supported_set_are_refused() {
        let layout_of =
            |p: &Problem| Workspace::layout(&plan(p.kind.pattern(), Schedule::Ring, 4, 0), &p.sizes()).unwrap();
        let check = |kind: OpKind, x: &[i64], w: &[i64], out: &[i64], input, output, scales| {
            let p = problem(kind, x, w, out, input, output);
            let plan = plan(kind.pattern(), Schedule::Ring, 4, 0);
            let site = SiteOps::new(&p, &plan)?;
            let mut b = DeviceBuffers { scales, ..buffers(&p, &layout_of(&p)) };
            b.workspace.1 = site.layout.total();
            site.bind(&b).map(|_| ())
        };
        let check = |kind, x, w, out, input, output, scales| {
            check(kind, x, w, out, input, output, scales).err().map(|e: Error| e.to_string())
        };
        let s = Some((0x100, 0x110));
        let (x, w, out) = ([16, 32], [32, 16], [64, 16]);
        let e4 = DType::F8E4M3FN;
        assert_eq!(check(OpKind::AllGatherMatmul, &x, &w, &out, e4, DType::BF16, s), None);
        let e = check(OpKind::AllGatherMatmul, &x, &w, &out, e4, DType::BF16, None).unwrap();
        assert!(e.contains("x_scale") && e.contains("w_scale"), "{e}");
        let e = check(OpKind::AllGatherMatmul, &x, &w, &out, DType::F8E5M2, DType::F32, s).unwrap();
        assert!(e.contains("float8_e5m2"), "{e}");
        let e = check(OpKind::AllGatherMatmul, &x, &w, &out, e4, e4, s).unwrap();
        assert!(e.contains("float8_e4m3fn result"), "{e}");
        let e = check(OpKind::AllToAllMatmul, &[4, 3, 32], &w, &[4, 3, 16], e4, DType::F32, s).unwrap();
        assert!(e.contains("all_gather_matmul and matmul_reduce_scatter"), "{e}");
    }

    #[test]
    fn bad_calls_are_refused() {
        let p = problem(OpKind::MatmulReduceScatter, &[12, 8], &[8, 6], &[3, 6], DType::F32, DType::F32);
        let plan = plan(Pattern::Scatter, Schedule::Ring, 4, 1);
        let layout = Workspace::layout(&plan, &p.sizes()).unwrap();
        let site = SiteOps::new(&p, &plan).unwrap();
        let mut b = buffers(&p, &layout);
        b.workspace.1 -= 1;
        let e = site.bind(&b).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("`workspace`")), "{e}");
        let mut b = buffers(&p, &layout);
        b.out.bytes += 4;
        let e = site.bind(&b).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("`out`")), "{e}");
        assert!(site.bind(&buffers(&p, &layout)).is_ok());
        let r = Resolver::new(&p, &layout, &plan.slots).unwrap();
        let tag = Tag { direction: Direction::Forward, step: 0 };
        assert!(r.p2p(&Transfer { peer: 0, buf: Buf::Out, tag }).is_err());
        assert!(r.p2p(&Transfer { peer: 0, buf: Buf::XBlock(4), tag }).is_err());
        assert!(r.sum(&[], Buf::Out).is_err());
        assert!(r.sum(&[Buf::X], Buf::Out).is_err());
        assert!(r.slot(99).is_err());

        for (input, output) in [(DType::F32, DType::BF16), (DType::BF16, DType::F16), (DType::F16, DType::BF16)] {
            let p = problem(OpKind::MatmulReduceScatter, &[12, 8], &[8, 6], &[3, 6], input, output);
            let layout = Workspace::layout(&plan, &p.sizes()).unwrap();
            let e = Resolver::new(&p, &layout, &plan.slots).err().unwrap();
            assert!(matches!(&e, Error::Unimplemented(m) if m.contains("cublasGemmEx")), "{e}");
        }
        let p64 = problem(OpKind::MatmulReduceScatter, &[12, 8], &[8, 6], &[3, 6], DType::F64, DType::F64);
        let layout = Workspace::layout(&plan, &p64.sizes()).unwrap();
        assert!(matches!(Resolver::new(&p64, &layout, &plan.slots), Err(Error::Unimplemented(_))));
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
