//! The CPU backend: steps on host threads, transfers through an in-process
//! mailbox, matmuls with the `gemm` crate, conversions for bf16/f16.
#![deny(unsafe_code)] // only `gemm.rs` opts out, to call the gemm crate

#[allow(unsafe_code)]
mod gemm;
pub mod handler;
pub mod numeric;
pub mod transport;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::{self, Backend, Direction, Observer, Wait};
use crate::plan::{Buf, Plan, SlotKind, Transfer, Workspace};
use crate::problem::{Problem, Side, View};
use numeric::{load, store, view, view_mut, Accum};
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::Instant;
use transport::Endpoint;

/// The buffers of one call: XLA's operands, result and workspace.
pub struct Buffers<'a> {
    pub x: &'a [u8],
    pub w: &'a [u8],
    pub out: &'a mut [u8],
    pub workspace: &'a mut [u8],
}

/// Runs `plan` for one device call, accumulating in f32 or f64 as the dtypes
/// ask, watched by `observer` if any.
pub fn run(
    problem: &Problem,
    plan: &Plan,
    buffers: Buffers<'_>,
    endpoint: &Endpoint,
    observer: Option<&dyn Observer>,
) -> Result<()> {
    // Python refuses fp8 on CPU at trace time; this is the backstop for a
    // call that bypasses it (every rank fails the same way, before any wait).
    if let Some(fp8) = [problem.input, problem.output].into_iter().find(|d| d.is_fp8()) {
        return Err(fp8_on_cpu(fp8));
    }
    // Converting the operands is a step of its own: it may take a while.
    match problem.accumulator() {
        DType::F64 => {
            let backend = endpoint.compute(|| CpuBackend::<f64>::new(problem, plan, buffers, endpoint))?;
            exec::run(plan, &backend, observer)
        }
        _ => {
            let backend = endpoint.compute(|| CpuBackend::<f32>::new(problem, plan, buffers, endpoint))?;
            exec::run(plan, &backend, observer)
        }
    }
}

/// The CPU backend has no fp8 GEMM, and upcasting would silently change the
/// numerics the caller asked for.
pub fn fp8_on_cpu(dtype: DType) -> Error {
    Error::InvalidArgument(format!(
        "{} operands need the CUDA backend (a GPU of compute capability 9.0+); the CPU backend does not take fp8",
        dtype.name()
    ))
}

/// Workspace regions only the compute lane uses, for dtype conversions.
struct Scratch<'a> {
    travel: Option<&'a mut [u8]>,
    results: Option<&'a mut [u8]>,
}

struct CpuBackend<'a, A: Accum> {
    problem: Problem,
    /// `x` as XLA passed it (what is sent), and both operands in the
    /// accumulator type (XLA's buffers, or their converted copies).
    x: &'a [u8],
    x_acc: &'a [u8],
    w_acc: &'a [u8],
    out: Mutex<&'a mut [u8]>,
    /// Steps may read a slot together (a block is sent on while it is
    /// multiplied); a write must have it alone.
    slots: Vec<RwLock<&'a mut [u8]>>,
    slot_kinds: Vec<SlotKind>,
    scratch: Mutex<Scratch<'a>>,
    endpoint: &'a Endpoint,
    accum: PhantomData<A>,
}

/// Locks a buffer for one step. The plan never lets a step write a buffer
/// while another running step uses it, so a busy lock is a plan bug: say so
/// rather than wait.
fn busy(what: &str) -> Error {
    Error::Internal(format!("plan error: {what} is in use by another lane"))
}

fn claim<'g, T>(m: &'g Mutex<T>, what: &str) -> Result<MutexGuard<'g, T>> {
    match m.try_lock() {
        Ok(g) => Ok(g),
        Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        Err(TryLockError::WouldBlock) => Err(busy(what)),
    }
}

/// Splits the workspace into its regions (which `layout` places in order).
fn split<'a>(mut rest: &'a mut [u8], regions: &[Range<usize>]) -> Result<Vec<&'a mut [u8]>> {
    let mut consumed = 0;
    let mut parts = Vec::with_capacity(regions.len());
    for r in regions {
        if r.start < consumed || r.end > consumed + rest.len() {
            return Err(Error::Internal(format!("workspace region {r:?} out of order or out of bounds")));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - consumed);
        let (part, tail) = tail.split_at_mut(r.len());
        parts.push(part);
        rest = tail;
        consumed = r.end;
    }
    Ok(parts)
}

/// The CPU backend's workspace: the plan's slots, then copies in the
/// accumulator type of what needs converting (`x` and `w` and a received
/// block when the input type is not the accumulator's, products when the
/// output type is not).
pub struct CpuLayout {
    pub plan: Workspace,
    pub x: Option<Range<usize>>,
    pub w: Option<Range<usize>>,
    pub travel: Option<Range<usize>>,
    pub results: Option<Range<usize>>,
}

/// The conversion copies start on cache lines.
const SCRATCH_ALIGN: usize = 64;

impl CpuLayout {
    pub fn new(problem: &Problem, plan: &Plan) -> Result<CpuLayout> {
        let sizes = problem.sizes();
        let acc = sizes.accumulator();
        let mut ws = Workspace::layout(plan, &sizes)?;
        let mut copy = |elements: usize| ws.append(elements, acc.size(), SCRATCH_ALIGN);
        let convert = sizes.input != acc;
        let x = convert.then(|| copy(sizes.x)).transpose()?;
        let w = convert.then(|| copy(sizes.w)).transpose()?;
        let travel = convert.then(|| copy(sizes.travel)).transpose()?;
        let results = (sizes.output != acc).then(|| copy(sizes.out_view)).transpose()?;
        Ok(CpuLayout { plan: ws, x, w, travel, results })
    }

    pub fn total(&self) -> usize {
        self.plan.total
    }
}

impl<'a, A: Accum> CpuBackend<'a, A> {
    fn new(problem: &Problem, plan: &Plan, buffers: Buffers<'a>, endpoint: &'a Endpoint) -> Result<Self> {
        let layout = CpuLayout::new(problem, plan)?;
        if buffers.workspace.len() < layout.total() {
            return Err(Error::InvalidArgument(format!(
                "workspace has {} bytes, the plan needs {}",
                buffers.workspace.len(),
                layout.total()
            )));
        }
        let optional = [&layout.x, &layout.w, &layout.travel, &layout.results];
        let mut regions = layout.plan.slots.clone();
        regions.extend(optional.iter().filter_map(|r| (*r).clone()));
        let mut parts = split(buffers.workspace, &regions)?.into_iter();
        let slots = parts.by_ref().take(layout.plan.slots.len()).map(RwLock::new).collect();
        let mut next = |r: &Option<Range<usize>>| r.as_ref().and_then(|_| parts.next());
        let (x_conv, w_conv, travel, results) =
            (next(&layout.x), next(&layout.w), next(&layout.travel), next(&layout.results));
        // Convert each operand once, up front, when its dtype is not the accumulator's.
        let convert = |raw: &'a [u8], region: Option<&'a mut [u8]>| -> Result<&'a [u8]> {
            match region {
                Some(converted) => {
                    load::<A>(raw, problem.input, view_mut(converted)?)?;
                    Ok(converted)
                }
                None => Ok(raw),
            }
        };
        Ok(CpuBackend {
            problem: *problem,
            x: buffers.x,
            x_acc: convert(buffers.x, x_conv)?,
            w_acc: convert(buffers.w, w_conv)?,
            out: Mutex::new(buffers.out),
            slots,
            slot_kinds: plan.slots.clone(),
            scratch: Mutex::new(Scratch { travel, results }),
            endpoint,
            accum: PhantomData,
        })
    }

    fn slot_lock(&self, buf: Buf) -> Result<&RwLock<&'a mut [u8]>> {
        match buf {
            Buf::Slot(i) => self.slots.get(i).ok_or_else(|| Error::Internal(format!("no slot {i}"))),
            other => Err(Error::Internal(format!("{other:?} is not a workspace slot"))),
        }
    }

    fn read_slot(&self, buf: Buf) -> Result<RwLockReadGuard<'_, &'a mut [u8]>> {
        match self.slot_lock(buf)?.try_read() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(busy(&format!("{buf:?}"))),
        }
    }

    fn write_slot(&self, buf: Buf) -> Result<RwLockWriteGuard<'_, &'a mut [u8]>> {
        match self.slot_lock(buf)?.try_write() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(busy(&format!("{buf:?}"))),
        }
    }

    /// The bytes of `x` a send of `buf` carries.
    fn x_bytes(&self, buf: Buf) -> Result<&'a [u8]> {
        match buf {
            Buf::X => Ok(self.x),
            Buf::XBlock(j) => {
                let part = self.problem.x_block(j).ok_or_else(|| Error::Internal(format!("no part {j} of x")))?;
                let size = self.problem.input.size();
                Ok(&self.x[part.start * size..part.end * size])
            }
            other => Err(Error::Internal(format!("{other:?} is not part of x"))),
        }
    }
}

impl<A: Accum> Backend for CpuBackend<'_, A> {
    fn matmul(&self, block: usize, src: Buf, dst: Buf, accumulate: bool) -> Result<()> {
        self.endpoint.compute(|| self.multiply(block, src, dst, accumulate))
    }

    fn sum(&self, terms: &[Buf], dst: Buf) -> Result<()> {
        self.endpoint.compute(|| self.add(terms, dst))
    }

    fn exchange(&self, sends: &[Transfer], recvs: &[Transfer], wait: &Wait) -> Result<Instant> {
        for t in sends {
            let started = Instant::now();
            match t.buf {
                Buf::Slot(_) => self.endpoint.send(t.peer, t.tag, &self.read_slot(t.buf)?, wait.ready),
                _ => self.endpoint.send(t.peer, t.tag, self.x_bytes(t.buf)?, wait.ready),
            }
            wait.transferred(Direction::Send, t, started, Instant::now());
        }
        // Posting is instant in the model; the exchange ends when its messages arrived.
        let mut ended = wait.ready;
        for t in recvs {
            let started = Instant::now();
            ended = ended.max(self.endpoint.recv(t.peer, t.tag, &mut self.write_slot(t.buf)?, wait)?);
            wait.transferred(Direction::Recv, t, started, Instant::now());
        }
        Ok(ended)
    }
}

impl<A: Accum> CpuBackend<'_, A> {
    fn multiply(&self, block: usize, src: Buf, dst: Buf, accumulate: bool) -> Result<()> {
        let input = self.problem.input;
        let mut scratch = claim(&self.scratch, "the conversion scratch")?;
        let Scratch { travel, results } = &mut *scratch;

        // The x-side data in the accumulator type.
        let src_guard;
        let src_acc: &[A] = match src {
            Buf::X | Buf::XBlock(_) => view(self.x_acc)?,
            Buf::Slot(i) if self.slot_kinds.get(i) == Some(&SlotKind::Input) => {
                src_guard = self.read_slot(src)?;
                match travel {
                    Some(t) if input != A::DTYPE => {
                        let converted = view_mut::<A>(t)?;
                        load(&src_guard, input, converted)?;
                        converted
                    }
                    _ => view(&src_guard)?,
                }
            }
            other => return Err(Error::Internal(format!("matmul reads {other:?}"))),
        };
        let w_acc: &[A] = view(self.w_acc)?;
        let side = |s: Side| if s == Side::Src { src_acc } else { w_acc };

        let (mut out_guard, mut slot_guard);
        let (dst_bytes, dst_dtype): (&mut [u8], DType) = match dst {
            Buf::Out | Buf::OutBlock(_) => {
                out_guard = claim(&self.out, "the output")?;
                (&mut out_guard[..], self.problem.output)
            }
            Buf::Slot(_) => {
                slot_guard = self.write_slot(dst)?;
                (&mut slot_guard[..], A::DTYPE)
            }
            other => return Err(Error::Internal(format!("matmul writes {other:?}"))),
        };
        for g in self.problem.gemms(block, src, dst) {
            let (lhs, rhs) = ((side(g.lhs.0), g.lhs.1), (side(g.rhs.0), g.rhs.1));
            if dst_dtype == A::DTYPE {
                gemm::matmul(lhs, rhs, (view_mut(dst_bytes)?, g.dst), accumulate)?;
                continue;
            }
            // Another output dtype: multiply into scratch, then store row by row.
            if accumulate {
                return Err(Error::Internal("accumulating into a converted output".into()));
            }
            let s = results.as_deref_mut().ok_or_else(|| Error::Internal("no result scratch".into()))?;
            let (rows, cols) = (g.dst.rows, g.dst.cols);
            let tmp = &mut view_mut::<A>(s)?[..rows * cols];
            gemm::matmul(lhs, rhs, (&mut *tmp, View { offset: 0, rows, cols, row_stride: cols }), false)?;
            let size = dst_dtype.size();
            for (i, row) in tmp.chunks_exact(cols.max(1)).enumerate().take(rows) {
                let start = (g.dst.offset + i * g.dst.row_stride) * size;
                store(row, dst_dtype, &mut dst_bytes[start..start + cols * size])?;
            }
        }
        Ok(())
    }

    fn add(&self, terms: &[Buf], dst: Buf) -> Result<()> {
        let (first, rest) = terms.split_first().ok_or_else(|| Error::Internal("sum of nothing".into()))?;
        if dst == *first {
            // In place: dst += Σ rest.
            let mut acc = self.write_slot(dst)?;
            let acc: &mut [A] = view_mut(&mut acc)?;
            for t in rest {
                let term = self.read_slot(*t)?;
                acc.iter_mut().zip(view::<A>(&term)?).for_each(|(a, b)| *a += *b);
            }
            return Ok(());
        }
        if !matches!(dst, Buf::Out | Buf::OutBlock(_)) {
            return Err(Error::Internal(format!("sum writes {dst:?}")));
        }
        let guards = terms.iter().map(|t| self.read_slot(*t)).collect::<Result<Vec<_>>>()?;
        let views = guards.iter().map(|g| view::<A>(g)).collect::<Result<Vec<_>>>()?;
        let mut out = claim(&self.out, "the output")?;
        let output = self.problem.output;
        let range = self.problem.out_range(dst);
        let base = range.start;
        if views.iter().any(|v| v.len() != range.len()) {
            return Err(Error::Internal(format!("sum of {} elements into {range:?}", views[0].len())));
        }
        // Sum a chunk at a time in the accumulator type, then store it.
        const CHUNK: usize = 512;
        let mut chunk = [A::default(); CHUNK];
        let size = output.size();
        for start in (0..range.len()).step_by(CHUNK) {
            let end = (start + CHUNK).min(range.len());
            let c = &mut chunk[..end - start];
            c.copy_from_slice(&views[0][start..end]);
            for v in &views[1..] {
                c.iter_mut().zip(&v[start..end]).for_each(|(a, b)| *a += *b);
            }
            store(c, output, &mut out[(base + start) * size..(base + end) * size])?;
        }
        Ok(())
    }
}

/// This host's single-thread f32 GEMM rate in GFLOP/s, measured once per
/// process (the best of 3 products of 256x512 by 512x512, 134 MFLOP each):
/// the calibration of the cost model's `cpu_here` machine.
pub fn gemm_gflops() -> f64 {
    static RATE: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *RATE.get_or_init(|| {
        let (m, k, n) = (256, 512, 512);
        // Not zeros: some kernels take shortcuts on them.
        let fill = |len: usize, seed: usize| -> Vec<f32> {
            (0..len).map(|i| ((i * 7919 + seed) % 1009) as f32 / 1009.0 - 0.5).collect()
        };
        let (a, b, mut c) = (fill(m * k, 1), fill(k * n, 2), vec![0f32; m * n]);
        let best = (0..3)
            .map(|_| {
                let start = Instant::now();
                let ok = gemm::matmul(
                    (&a, View { offset: 0, rows: m, cols: k, row_stride: k }),
                    (&b, View { offset: 0, rows: k, cols: n, row_stride: n }),
                    (&mut c, View { offset: 0, rows: m, cols: n, row_stride: n }),
                    false,
                );
                if ok.is_err() {
                    return f64::INFINITY;
                }
                start.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        2.0 * (m * k * n) as f64 / best / 1e9
    })
}
