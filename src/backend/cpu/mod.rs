//! The CPU backend: steps on host threads, transfers through an in-process
//! mailbox, matmuls with the `gemm` crate, conversions for bf16/f16.
//!
//! The plan's slots hold the transport's blocks (`transport::Block`), not
//! regions of XLA's workspace: a received block is multiplied where it
//! landed, and a slot is sent by handing its block over, so a gathered block
//! is copied once, when its owner first sends it out of XLA's buffer, however
//! many ranks forward it. XLA's workspace holds the dtype conversions only.
#![deny(unsafe_code)] // only `gemm.rs` opts out, to call the gemm crate

#[allow(unsafe_code)]
mod gemm;
pub mod handler;
pub mod numeric;
pub mod reshard;
pub mod transport;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::{self, Backend, Copies, Direction, Observer, Wait};
use crate::plan::{Buf, Plan, SlotKind, Transfer, Workspace};
use crate::problem::{Problem, Side, View};
use numeric::{load, store, view, view_mut, Accum};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::Instant;
use transport::{Block, Endpoint, Shared};

/// The buffers of one call: XLA's operands, result and workspace.
pub struct Buffers<'a> {
    pub x: &'a [u8],
    pub w: &'a [u8],
    pub out: &'a mut [u8],
    pub workspace: &'a mut [u8],
}

/// How a call's lanes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lanes {
    /// As `Lanes::by_work` says for the plan (its work counted per call).
    ByWork,
    /// In plan order on the calling thread (`exec::run_in_order`).
    InOrder,
    /// Each lane on a thread of its own (`exec::run`).
    Threads,
}

impl Lanes {
    /// Without the link model a transfer is a handover that takes no time,
    /// so a call whose GEMMs are small (`IN_ORDER_MAX_FLOPS`) on a group of
    /// more than two ranks per core runs in plan order: there, waking a
    /// second lane's thread at every step waits for a core that the other
    /// ranks hold. With cores to spare a lane thread wakes at once (the pool
    /// keeps them warm) and lanes are faster (measured by
    /// `python -m commfuse.bench_call`: 2 cores, 8 ranks in order, 2 and 4
    /// on lanes). Larger calls keep their lanes, so a rank computes ahead of
    /// a late peer as far as its plan allows.
    pub fn by_work(flops: f64, link_modelled: bool, ranks: usize) -> Lanes {
        if !link_modelled && flops <= IN_ORDER_MAX_FLOPS && ranks > 2 * cores() {
            Lanes::InOrder
        } else {
            Lanes::Threads
        }
    }
}

/// This host's cores, as the OS lets this process use them.
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Runs `plan` for one device call, accumulating in f32 or f64 as the dtypes
/// ask, its lanes run as `lanes` says, watched by `observer` if any.
pub fn run(
    problem: &Problem,
    plan: &Plan,
    buffers: Buffers<'_>,
    endpoint: &Endpoint,
    observer: Option<&dyn Observer>,
    lanes: Lanes,
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
            backend.run(plan, observer, lanes)
        }
        _ => {
            let backend = endpoint.compute(|| CpuBackend::<f32>::new(problem, plan, buffers, endpoint))?;
            backend.run(plan, observer, lanes)
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

/// Workspace regions only the compute lane uses: dtype conversions, and the
/// packed right-hand side of the GEMMs (`gemm::pack_rhs`).
struct Scratch<'a> {
    travel: Option<&'a mut [u8]>,
    /// A received block of `w` converted (`Pattern::GatherGather`).
    travel_w: Option<&'a mut [u8]>,
    results: Option<&'a mut [u8]>,
    packed: &'a mut [u8],
    /// Whether `packed` holds the whole `w`, packed by an earlier step.
    packed_w: bool,
}

struct CpuBackend<'a, A: Accum> {
    problem: Problem,
    /// `x` and `w` as XLA passed them (what is sent), and both operands in
    /// the accumulator type (XLA's buffers, or their converted copies).
    x: &'a [u8],
    w: &'a [u8],
    x_acc: &'a [u8],
    w_acc: &'a [u8],
    out: Mutex<&'a mut [u8]>,
    /// The plan's slots, each empty until first written. Steps may read a
    /// slot together (a block is sent on while it is multiplied); a write
    /// must have it alone.
    slots: Vec<RwLock<Option<Shared>>>,
    slot_bytes: Vec<usize>,
    slot_kinds: Vec<SlotKind>,
    /// The blocks sent out of `x` (`Buf::X`, `Buf::XBlock`) or `w`
    /// (`Buf::W`): copied once, then handed to every peer that gets them.
    sent: Mutex<HashMap<Buf, Shared>>,
    scratch: Mutex<Scratch<'a>>,
    endpoint: &'a Endpoint,
    copies: CopyCount,
    accum: PhantomData<A>,
}

/// The copies one call made (see `exec::Copies`).
#[derive(Default)]
struct CopyCount {
    count: AtomicUsize,
    bytes: AtomicUsize,
}

impl CopyCount {
    fn add(&self, bytes: usize) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn get(&self) -> Copies {
        Copies { count: self.count.load(Ordering::Relaxed), bytes: self.bytes.load(Ordering::Relaxed) }
    }
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

/// A received block of `input` in the accumulator type: converted into
/// `scratch` where there is one (the input type is not the accumulator's).
fn landed<'s, A: Accum>(bytes: &'s [u8], input: DType, scratch: Option<&'s mut [u8]>) -> Result<&'s [A]> {
    match scratch {
        Some(t) if input != A::DTYPE => {
            let converted = view_mut::<A>(t)?;
            load(bytes, input, converted)?;
            Ok(converted)
        }
        _ => view(bytes),
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

/// The CPU backend's workspace: copies in the accumulator type of what
/// needs converting (`x` and `w` and a received block when the input type is
/// not the accumulator's, products when the output type is not). The plan's
/// slots are the transport's blocks, not part of it.
pub struct CpuLayout {
    pub total: usize,
    /// The GEMMs' packed right-hand side: the largest any step multiplies by.
    pub packed: Range<usize>,
    pub x: Option<Range<usize>>,
    pub w: Option<Range<usize>>,
    pub travel: Option<Range<usize>>,
    pub travel_w: Option<Range<usize>>,
    pub results: Option<Range<usize>>,
}

/// The conversion copies start on cache lines.
const SCRATCH_ALIGN: usize = 64;

impl CpuLayout {
    pub fn new(problem: &Problem) -> Result<CpuLayout> {
        let sizes = problem.sizes();
        let acc = sizes.accumulator();
        let mut ws = Workspace { slots: vec![], total: 0 };
        let mut copy = |elements: usize| ws.append(elements, acc.size(), SCRATCH_ALIGN);
        let packed = copy(problem.rhs_len())?;
        let convert = sizes.input != acc;
        let x = convert.then(|| copy(sizes.x)).transpose()?;
        let w = convert.then(|| copy(sizes.w)).transpose()?;
        let travel = convert.then(|| copy(sizes.travel)).transpose()?;
        let weights_travel = matches!(problem.pattern(), crate::plan::Pattern::GatherGather { .. });
        let travel_w = (convert && weights_travel).then(|| copy(sizes.w)).transpose()?;
        let results = (sizes.output != acc).then(|| copy(sizes.out_view)).transpose()?;
        Ok(CpuLayout { total: ws.total, packed, x, w, travel, travel_w, results })
    }

    pub fn total(&self) -> usize {
        self.total
    }
}

/// The most floating-point work (2 x multiply-adds, all of one rank's
/// GEMMs) of a call run on one thread (`Lanes::by_work`): about 100 us on
/// these hosts' cores, where waking a second lane's thread at each step
/// costs about as much again (measured by `python -m commfuse.bench_call`).
const IN_ORDER_MAX_FLOPS: f64 = 1.0e7;

impl<'a, A: Accum> CpuBackend<'a, A> {
    fn new(problem: &Problem, plan: &Plan, buffers: Buffers<'a>, endpoint: &'a Endpoint) -> Result<Self> {
        let layout = CpuLayout::new(problem)?;
        if buffers.workspace.len() < layout.total() {
            return Err(Error::InvalidArgument(format!(
                "workspace has {} bytes, the plan needs {}",
                buffers.workspace.len(),
                layout.total()
            )));
        }
        let optional = [&layout.x, &layout.w, &layout.travel, &layout.travel_w, &layout.results];
        let mut regions = vec![layout.packed.clone()];
        regions.extend(optional.iter().filter_map(|r| (*r).clone()));
        let mut parts = split(buffers.workspace, &regions)?.into_iter();
        let packed = parts.next().ok_or_else(|| Error::Internal("no packing region".into()))?;
        let slot_bytes = Workspace::layout(plan, &problem.sizes())?.slots.iter().map(|r| r.len()).collect();
        let mut next = |r: &Option<Range<usize>>| r.as_ref().and_then(|_| parts.next());
        let (x_conv, w_conv, travel) = (next(&layout.x), next(&layout.w), next(&layout.travel));
        let (travel_w, results) = (next(&layout.travel_w), next(&layout.results));
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
            w: buffers.w,
            x_acc: convert(buffers.x, x_conv)?,
            w_acc: convert(buffers.w, w_conv)?,
            out: Mutex::new(buffers.out),
            slots: plan.slots.iter().map(|_| RwLock::new(None)).collect(),
            slot_bytes,
            slot_kinds: plan.slots.clone(),
            sent: Mutex::new(HashMap::new()),
            scratch: Mutex::new(Scratch { travel, travel_w, results, packed, packed_w: false }),
            endpoint,
            copies: CopyCount::default(),
            accum: PhantomData,
        })
    }

    /// Runs the plan's lanes as `lanes` says, then tells the observer what it copied.
    fn run(&self, plan: &Plan, observer: Option<&dyn Observer>, lanes: Lanes) -> Result<()> {
        let lanes = match lanes {
            Lanes::ByWork => Lanes::by_work(
                crate::call::plan_flops(&self.problem, plan),
                self.endpoint.link_modelled(),
                self.problem.group(),
            ),
            decided => decided,
        };
        if lanes == Lanes::InOrder {
            exec::run_in_order(plan, self, observer)?;
        } else {
            exec::run(plan, self, observer)?;
        }
        if let Some(observer) = observer {
            observer.copied(self.copies.get());
        }
        Ok(())
    }

    fn slot_lock(&self, buf: Buf) -> Result<(&RwLock<Option<Shared>>, usize)> {
        match buf {
            Buf::Slot(i) => match (self.slots.get(i), self.slot_bytes.get(i)) {
                (Some(slot), Some(&bytes)) => Ok((slot, bytes)),
                _ => Err(Error::Internal(format!("no slot {i}"))),
            },
            other => Err(Error::Internal(format!("{other:?} is not a workspace slot"))),
        }
    }

    fn read_slot(&self, buf: Buf) -> Result<RwLockReadGuard<'_, Option<Shared>>> {
        match self.slot_lock(buf)?.0.try_read() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(busy(&format!("{buf:?}"))),
        }
    }

    /// The block in a slot, read.
    fn held(guard: &Option<Shared>, buf: Buf) -> Result<&Shared> {
        guard.as_ref().ok_or_else(|| Error::Internal(format!("plan error: {buf} is read before it was written")))
    }

    /// A slot locked for writing, with its size in bytes.
    fn write_slot(&self, buf: Buf) -> Result<(RwLockWriteGuard<'_, Option<Shared>>, usize)> {
        let (lock, bytes) = self.slot_lock(buf)?;
        match lock.try_write() {
            Ok(g) => Ok((g, bytes)),
            Err(TryLockError::Poisoned(p)) => Ok((p.into_inner(), bytes)),
            Err(TryLockError::WouldBlock) => Err(busy(&format!("{buf:?}"))),
        }
    }

    /// A slot's bytes to write: its block when this rank holds the only
    /// reference to it, else a fresh one. A fresh block takes the old one's
    /// contents when `keep` (an add onto a block still shared with a peer):
    /// the only copy a slot can cost, counted.
    fn writable<'g>(&self, slot: &'g mut Option<Shared>, len: usize, keep: bool) -> Result<&'g mut [u8]> {
        let reusable = slot.as_mut().is_some_and(|b| b.len() == len && Arc::get_mut(b).is_some());
        if !reusable {
            let fresh = match slot.as_deref() {
                Some(old) if keep => {
                    self.copies.add(len);
                    Block::copy_of(old.bytes())
                }
                None if keep => {
                    return Err(Error::Internal("plan error: a slot is added to before it was written".into()))
                }
                _ => Block::new(len),
            };
            *slot = Some(Arc::new(fresh));
        }
        match slot.as_mut().and_then(Arc::get_mut) {
            Some(block) => Ok(block.bytes_mut()),
            None => Err(Error::Internal("a fresh block is shared".into())),
        }
    }

    /// The block a send of (part of) `x`, or of `w`, hands over: copied out
    /// of XLA's buffer the first time, the same block after that.
    fn sent_block(&self, buf: Buf) -> Result<Shared> {
        let mut sent = claim(&self.sent, "the blocks sent from x and w")?;
        if let Some(block) = sent.get(&buf) {
            return Ok(Arc::clone(block));
        }
        let bytes = self.sent_bytes(buf)?;
        self.copies.add(bytes.len());
        let block = Arc::new(Block::copy_of(bytes));
        sent.insert(buf, Arc::clone(&block));
        Ok(block)
    }

    /// The bytes of `x` (or `w`) a send of `buf` carries.
    fn sent_bytes(&self, buf: Buf) -> Result<&'a [u8]> {
        match buf {
            Buf::X => Ok(self.x),
            Buf::W => Ok(self.w),
            Buf::XBlock(j) => {
                let part = self.problem.x_block(j).ok_or_else(|| Error::Internal(format!("no part {j} of x")))?;
                let size = self.problem.input.size();
                Ok(&self.x[part.start * size..part.end * size])
            }
            other => Err(Error::Internal(format!("{other:?} is not part of x or w"))),
        }
    }
}

impl<A: Accum> Backend for CpuBackend<'_, A> {
    fn matmul(&self, block: usize, src: Buf, with: Buf, dst: Buf, accumulate: bool) -> Result<()> {
        self.endpoint.compute(|| self.multiply(block, src, with, dst, accumulate))
    }

    fn sum(&self, terms: &[Buf], dst: Buf) -> Result<()> {
        self.endpoint.compute(|| self.add(terms, dst))
    }

    fn exchange(&self, sends: &[Transfer], recvs: &[Transfer], wait: &Wait) -> Result<Instant> {
        for t in sends {
            let started = Instant::now();
            let block = match t.buf {
                // A handed-over partial leaves the slot, so the peer that adds
                // onto it holds the only reference and needs no copy.
                Buf::Slot(i) if self.slot_kinds.get(i).is_some_and(|k| k.handed_over()) => {
                    let mut slot = self.write_slot(t.buf)?.0;
                    slot.take().ok_or_else(|| {
                        Error::Internal(format!("plan error: {} is sent before it was written", t.buf))
                    })?
                }
                Buf::Slot(_) => Arc::clone(Self::held(&*self.read_slot(t.buf)?, t.buf)?),
                _ => self.sent_block(t.buf)?,
            };
            self.endpoint.send(t.peer, t.tag, block, wait.ready);
            wait.transferred(Direction::Send, t, started, Instant::now());
        }
        // Posting is instant in the model; the exchange ends when its messages arrived.
        let mut ended = wait.ready;
        for t in recvs {
            let started = Instant::now();
            let (mut slot, bytes) = self.write_slot(t.buf)?;
            let (block, arrived) = self.endpoint.recv(t.peer, t.tag, bytes, wait)?;
            // The block stays where it landed; the one it replaces goes back
            // to the pool once no peer holds it.
            *slot = Some(block);
            ended = ended.max(arrived);
            wait.transferred(Direction::Recv, t, started, Instant::now());
        }
        Ok(ended)
    }
}

impl<A: Accum> CpuBackend<'_, A> {
    fn multiply(&self, block: usize, src: Buf, with: Buf, dst: Buf, accumulate: bool) -> Result<()> {
        let input = self.problem.input;
        let mut scratch = claim(&self.scratch, "the conversion scratch")?;
        let Scratch { travel, travel_w, results, packed, packed_w } = &mut *scratch;

        // The x-side data in the accumulator type.
        let src_guard;
        let src_acc: &[A] = match src {
            Buf::X | Buf::XBlock(_) => view(self.x_acc)?,
            Buf::Slot(i) if self.slot_kinds.get(i) == Some(&SlotKind::Input) => {
                src_guard = self.read_slot(src)?;
                landed(Self::held(&src_guard, src)?.bytes(), input, travel.as_deref_mut())?
            }
            other => return Err(Error::Internal(format!("matmul reads {other:?}"))),
        };
        let with_guard;
        let w_acc: &[A] = match with {
            Buf::W => view(self.w_acc)?,
            Buf::Slot(i) if self.slot_kinds.get(i) == Some(&SlotKind::Weight) => {
                with_guard = self.read_slot(with)?;
                landed(Self::held(&with_guard, with)?.bytes(), input, travel_w.as_deref_mut())?
            }
            other => return Err(Error::Internal(format!("matmul multiplies by {other:?}"))),
        };
        let side = |s: Side| if s == Side::Src { src_acc } else { w_acc };

        let (mut out_guard, mut slot_guard);
        let (dst_bytes, dst_dtype): (&mut [u8], DType) = match dst {
            Buf::Out | Buf::OutBlock(_) => {
                out_guard = claim(&self.out, "the output")?;
                (&mut out_guard[..], self.problem.output)
            }
            Buf::Slot(_) => {
                let bytes;
                (slot_guard, bytes) = self.write_slot(dst)?;
                (self.writable(&mut slot_guard, bytes, accumulate)?, A::DTYPE)
            }
            other => return Err(Error::Internal(format!("matmul writes {other:?}"))),
        };
        let whole_w = |v: View| v.offset == 0 && v.rows * v.cols == w_acc.len() && v.row_stride == v.cols;
        for g in self.problem.gemms(block, src, dst) {
            let lhs = (side(g.lhs.0), g.lhs.1);
            // The whole `w` is packed by the first step that multiplies by
            // it, and kept for the call; any other right-hand side per use.
            let keep = g.rhs.0 == Side::W && with == Buf::W && whole_w(g.rhs.1);
            let packed = view_mut::<A>(packed)?;
            if !(keep && *packed_w) {
                *packed_w = false;
                gemm::pack_rhs((side(g.rhs.0), g.rhs.1), packed)?;
                *packed_w = keep;
            }
            let rhs = gemm::PackedRhs::packed(packed, g.rhs.1.rows, g.rhs.1.cols)?;
            if dst_dtype == A::DTYPE {
                gemm::matmul_packed(lhs, &rhs, (view_mut(dst_bytes)?, g.dst), accumulate)?;
                continue;
            }
            // Another output dtype: multiply into scratch, then store row by row.
            if accumulate {
                return Err(Error::Internal("accumulating into a converted output".into()));
            }
            let s = results.as_deref_mut().ok_or_else(|| Error::Internal("no result scratch".into()))?;
            let (rows, cols) = (g.dst.rows, g.dst.cols);
            let tmp = &mut view_mut::<A>(s)?[..rows * cols];
            gemm::matmul_packed(lhs, &rhs, (&mut *tmp, View { offset: 0, rows, cols, row_stride: cols }), false)?;
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
            let (mut slot, bytes) = self.write_slot(dst)?;
            let acc: &mut [A] = view_mut(self.writable(&mut slot, bytes, true)?)?;
            for t in rest {
                let term = self.read_slot(*t)?;
                acc.iter_mut().zip(view::<A>(Self::held(&term, *t)?.bytes())?).for_each(|(a, b)| *a += *b);
            }
            return Ok(());
        }
        if !matches!(dst, Buf::Out | Buf::OutBlock(_)) {
            return Err(Error::Internal(format!("sum writes {dst:?}")));
        }
        let guards = terms.iter().map(|t| self.read_slot(*t)).collect::<Result<Vec<_>>>()?;
        let views =
            guards.iter().zip(terms).map(|(g, t)| view::<A>(Self::held(g, *t)?.bytes())).collect::<Result<Vec<_>>>()?;
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
        if views.len() == 1 {
            // A block received into the output: a copy (with the dtype's conversion).
            self.copies.add(range.len() * size);
        }
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
        let mut packed = vec![0f32; k * n];
        let packing = gemm::pack_rhs((&b, View { offset: 0, rows: k, cols: n, row_stride: n }), &mut packed);
        let Ok(b) = packing.and_then(|()| gemm::PackedRhs::packed(&packed, k, n)) else {
            return f64::NAN;
        };
        let best = (0..3)
            .map(|_| {
                let start = Instant::now();
                let ok = gemm::matmul_packed(
                    (&a, View { offset: 0, rows: m, cols: k, row_stride: k }),
                    &b,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call::problem_and_plan;
    use crate::exec::LaneObserver;
    use crate::group::Group;
    use crate::plan::{Lane, Schedule};
    use crate::problem::OpKind;
    use std::sync::Condvar;
    use std::time::Duration;

    /// Keeps what the backend says it copied, and when each compute step
    /// ran; counts its rank's products into `products` (shared by the ranks).
    #[derive(Default)]
    struct Watch {
        copies: Mutex<Option<Copies>>,
        computed: Mutex<Vec<(crate::plan::Step, Instant, Instant)>>,
        products: Option<(Arc<Products>, usize)>,
    }

    /// How many products each rank has finished, waited on by a rank that
    /// starts only after the others' first few (`run_ranks`).
    #[derive(Default)]
    struct Products {
        done: Mutex<HashMap<usize, usize>>,
        changed: Condvar,
    }

    struct LaneWatch<'w>(Option<&'w Watch>);

    impl LaneObserver for LaneWatch<'_> {
        fn waited(&self, _: &crate::plan::Step, _: Instant, _: Instant) {}
        fn transferred(&self, _: &crate::plan::Step, _: Direction, _: &Transfer, _: Instant, _: Instant) {}
        fn step_done(&self, step: &crate::plan::Step, started: Instant, ended: Instant) {
            if let Some(watch) = self.0 {
                watch.computed.lock().unwrap().push((step.clone(), started, ended));
                if let (Some((products, rank)), crate::plan::Action::Matmul { .. }) = (&watch.products, &step.action) {
                    *products.done.lock().unwrap().entry(*rank).or_default() += 1;
                    products.changed.notify_all();
                }
            }
        }
    }

    impl Observer for Watch {
        fn lane(&self, lane: Lane) -> Box<dyn LaneObserver + '_> {
            Box::new(LaneWatch((lane == Lane::Compute).then_some(self)))
        }
        fn copied(&self, copies: Copies) {
            *self.copies.lock().unwrap() = Some(copies);
        }
    }

    /// What one rank's run reported, and when it started.
    struct RankRun {
        started: Instant,
        copies: Copies,
        computed: Vec<(crate::plan::Step, Instant, Instant)>,
        out: Vec<u8>,
    }

    /// Runs `kind` over `n` ranks on f32 operands of the given dims; with
    /// `late = Some((rank, products))`, `rank` starts only once each other
    /// rank has finished `products` products (or, should they never, after
    /// 20 s: what a test of their order then sees).
    fn run_ranks(
        kind: OpKind,
        schedule: Schedule,
        n: usize,
        dims: [&[i64]; 3],
        site: i64,
        late: Option<(usize, usize)>,
    ) -> Vec<RankRun> {
        run_ranks_as(kind, schedule, n, dims, site, late, Lanes::ByWork)
    }

    fn run_ranks_as(
        kind: OpKind,
        schedule: Schedule,
        n: usize,
        dims: [&[i64]; 3],
        site: i64,
        late: Option<(usize, usize)>,
        lanes: Lanes,
    ) -> Vec<RankRun> {
        run_ranks_over(kind, schedule, n, dims, site, late, lanes, example_dimension(kind))
    }

    /// `run_ranks_as` with the `dimension` attribute given (a two-axis kind's F).
    #[allow(clippy::too_many_arguments)]
    fn run_ranks_over(
        kind: OpKind,
        schedule: Schedule,
        n: usize,
        dims: [&[i64]; 3],
        site: i64,
        late: Option<(usize, usize)>,
        lanes: Lanes,
        dimension: i64,
    ) -> Vec<RankRun> {
        let products = Arc::new(Products::default());
        let products = &products;
        std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..n)
                .map(|rank| {
                    scope.spawn(move || {
                        let group = Group { devices: (0..n as i64).map(|d| 900 + d).collect(), rank };
                        let [x, w, out] = dims.map(|d| (d, DType::F32));
                        let (problem, plan) = problem_and_plan(kind, schedule, [x, w, out], dimension, &group).unwrap();
                        let bytes = |d: &[i64]| d.iter().product::<i64>() as usize * 4;
                        // f32 values of a few bits each, different on every rank: exact sums.
                        let fill = |len: usize| {
                            let values = (0..len / 4).map(|i| ((i * 7 + rank * 13) % 17) as f32 - 8.0);
                            values.flat_map(f32::to_le_bytes).collect::<Vec<u8>>()
                        };
                        let (xb, wb, mut ob) = (fill(bytes(x.0)), fill(bytes(w.0)), vec![0u8; bytes(out.0)]);
                        let mut workspace = vec![0u64; CpuLayout::new(&problem).unwrap().total().div_ceil(8)];
                        let workspace = bytemuck::cast_slice_mut::<u64, u8>(&mut workspace);
                        let key = transport::SessionKey { group: group.devices.clone(), site, run: -11, sequence: 0 };
                        let info = transport::Participant {
                            op: kind.name(),
                            rank,
                            timeout: Duration::from_secs(20),
                            interrupts: crate::config::interrupts(),
                        };
                        let mut watch = Watch::default();
                        match late {
                            Some((late_rank, wanted)) if late_rank == rank => {
                                let done = products.done.lock().unwrap();
                                let behind = |done: &mut HashMap<usize, usize>| {
                                    (0..n).any(|r| r != rank && done.get(&r).copied().unwrap_or(0) < wanted)
                                };
                                let wait = Duration::from_secs(20);
                                drop(products.changed.wait_timeout_while(done, wait, behind).unwrap());
                            }
                            Some(_) => watch.products = Some((Arc::clone(products), rank)),
                            None => {}
                        }
                        let started = Instant::now();
                        let endpoint = Endpoint::join(key, info);
                        let buffers = Buffers { x: &xb, w: &wb, out: &mut ob, workspace };
                        run(&problem, &plan, buffers, &endpoint, Some(&watch), lanes).unwrap();
                        let copies = watch.copies.lock().unwrap().expect("the run reports its copies");
                        let computed = std::mem::take(&mut *watch.computed.lock().unwrap());
                        RankRun { started, copies, computed, out: ob }
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        })
    }

    fn copies(kind: OpKind, schedule: Schedule, n: usize, dims: [&[i64]; 3], site: i64) -> Vec<Copies> {
        run_ranks(kind, schedule, n, dims, site, None).into_iter().map(|r| r.copies).collect()
    }

    #[test]
    fn a_gathered_block_is_copied_once_by_its_owner_however_many_ranks_forward_it() {
        let (n, rows, k, cols) = (4, 8, 16, 8);
        let x_bytes = rows * k * 4;
        let dims: [&[i64]; 3] = [&[rows as i64, k as i64], &[k as i64, cols as i64], &[(n * rows) as i64, cols as i64]];
        for (i, schedule) in [Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential].into_iter().enumerate() {
            for (rank, c) in copies(OpKind::AllGatherMatmul, schedule, n, dims, 7100 + i as i64).iter().enumerate() {
                // Before blocks were handed over, each of the N-1 hops copied twice (into a message, out of it).
                assert_eq!(*c, Copies { count: 1, bytes: x_bytes }, "{schedule:?} rank {rank}");
            }
        }
    }

    #[test]
    fn partial_sums_travel_without_copies() {
        let (n, rows, k, cols) = (4, 8, 16, 8);
        let dims: [&[i64]; 3] = [&[(n * rows) as i64, k as i64], &[k as i64, cols as i64], &[rows as i64, cols as i64]];
        let schedules = [Schedule::Ring, Schedule::Bidirectional, Schedule::Tiled { tiles: 2 }];
        for (i, schedule) in schedules.into_iter().enumerate() {
            for (rank, c) in copies(OpKind::MatmulReduceScatter, schedule, n, dims, 7200 + i as i64).iter().enumerate()
            {
                // Adds onto received sums (bidirectional, tiled: inside the GEMM) find the block unshared.
                assert_eq!(*c, Copies::default(), "{schedule:?} rank {rank}");
            }
        }
    }

    #[test]
    fn in_plan_order_and_on_lane_threads_give_the_same_bits_for_every_kind_and_schedule() {
        let (n, rows, k, cols) = (4i64, 8i64, 12i64, 4i64);
        let mut site = 7400;
        for kind in crate::abi::KINDS {
            let dims = example_dims(kind, n, rows, k, cols);
            let dims: [&[i64]; 3] = [&dims[0], &dims[1], &dims[2]];
            for schedule in [Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential] {
                site += 2;
                let runs = |lanes, site| {
                    run_ranks_as(kind, schedule, n as usize, dims, site, None, lanes)
                        .into_iter()
                        .map(|r| r.out)
                        .collect::<Vec<_>>()
                };
                let (in_order, threads) = (runs(Lanes::InOrder, site), runs(Lanes::Threads, site + 1));
                assert!(in_order.iter().flatten().any(|&b| b != 0), "{kind:?} {schedule:?}: all zeros");
                assert_eq!(in_order, threads, "{kind:?} {schedule:?}");
            }
        }
    }

    /// Operand and result dims of `kind` over `n` ranks (canonical layouts, see `OpKind`).
    fn example_dims(kind: OpKind, n: i64, m: i64, k: i64, c: i64) -> [Vec<i64>; 3] {
        match kind {
            OpKind::AllGatherMatmul => [vec![m, k], vec![k, c], vec![n * m, c]],
            OpKind::AllGatherMatmulContract => [vec![m, k], vec![n * k, c], vec![m, c]],
            OpKind::MatmulAllGather => [vec![k, c], vec![m, k], vec![m, n * c]],
            OpKind::MatmulAllGatherContract => [vec![k, c], vec![m, n * k], vec![m, c]],
            OpKind::MatmulReduceScatter => [vec![n * m, k], vec![k, c], vec![m, c]],
            OpKind::MatmulReduceScatterCols => [vec![m, k], vec![k, n * c], vec![m, c]],
            OpKind::AllToAllMatmul => [vec![n, m, k], vec![k, c], vec![n, m, c]],
            OpKind::AllToAllMatmulContract => [vec![n, m, k], vec![n * k, c], vec![m, c]],
            OpKind::MatmulAllToAll => [vec![n, m, k], vec![k, c], vec![n, m, c]],
            OpKind::MatmulAllToAllCols => [vec![m, k], vec![k, n * c], vec![n, m, c]],
            OpKind::MatmulAllReduce => [vec![n * m, k], vec![k, c], vec![n * m, c]],
            OpKind::AllGatherMatmulReduceScatter => {
                let f = example_dimension(kind);
                [vec![k, c], vec![n / f * m, k], vec![f, m, c]]
            }
            OpKind::AllGatherBothMatmul => {
                let f = example_dimension(kind);
                [vec![m, f * k], vec![k, c], vec![n / f * m, c]]
            }
            OpKind::AllGatherContractMatmulReduceScatter => {
                let f = example_dimension(kind);
                [vec![f * m, k], vec![n / f * k, c], vec![m, c]]
            }
        }
    }

    /// The `dimension` attribute of `kind`'s examples: a two-axis kind's
    /// first axis is 2 ranks (n = 2 x n/2).
    fn example_dimension(kind: OpKind) -> i64 {
        if kind.pattern().two_axis().is_some() {
            2
        } else {
            0
        }
    }

    /// The two-axis op on the CPU backend against its definition: rank
    /// (f, t) of F x T ends with out[j] = sum over t' of rank (f, t')'s rows
    /// block t of x times rank (j, t')'s w (w's block j gathered over F, the
    /// product's rows scattered over T); sliced into S column chunks, the
    /// output is stacked by chunk: [F, S, rows, c / S].
    #[test]
    fn the_two_axis_op_computes_the_gathered_product_reduce_scattered() {
        let (n, m, k, c) = (4usize, 3usize, 5usize, 4usize);
        let (f_size, t_size) = (2, 2);
        let kind = OpKind::AllGatherMatmulReduceScatter;
        let dims = example_dims(kind, n as i64, m as i64, k as i64, c as i64);
        let dims: [&[i64]; 3] = [&dims[0], &dims[1], &dims[2]];
        // The values `run_ranks_as` fills rank `rank`'s operand of `len` floats with.
        let fill = |rank: usize, len: usize| -> Vec<f64> {
            (0..len).map(|i| ((i * 7 + rank * 13) % 17) as f64 - 8.0).collect()
        };
        let schedules = [Schedule::Ring, Schedule::Sequential, Schedule::Sliced { slices: 2 }];
        for (i, schedule) in schedules.into_iter().enumerate() {
            let slices = schedule.chunks();
            let runs = run_ranks_as(kind, schedule, n, dims, 7500 + i as i64, None, Lanes::Threads);
            for (r, run) in runs.iter().enumerate() {
                let (f, t) = (r / t_size, r % t_size);
                let got: Vec<f32> = bytemuck::cast_slice(&run.out).to_vec();
                for j in 0..f_size {
                    for row in 0..m {
                        for col in 0..c {
                            let want: f64 = (0..t_size)
                                .map(|u| {
                                    let x = fill(f * t_size + u, t_size * m * k);
                                    let w = fill(j * t_size + u, k * c);
                                    (0..k).map(|q| x[(t * m + row) * k + q] * w[q * c + col]).sum::<f64>()
                                })
                                .sum();
                            let (chunk, within) = (col / (c / slices), col % (c / slices));
                            let at = ((j * slices + chunk) * m + row) * (c / slices) + within;
                            assert_eq!(got[at] as f64, want, "{schedule:?} rank {r} out[{j}][{row}][{col}]");
                        }
                    }
                }
            }
        }
    }

    /// The two-gather op on the CPU backend against its definition: rank
    /// (f, t) of F x T ends with row block p of the result = rank (f, p)'s
    /// x times w gathered over F (rank (q, t)'s w is w's rows block q).
    #[test]
    fn the_two_gather_op_computes_the_product_of_both_gathered_operands() {
        let (m, k, c) = (3usize, 5usize, 4usize);
        let fill = |rank: usize, len: usize| -> Vec<f64> {
            (0..len).map(|i| ((i * 7 + rank * 13) % 17) as f64 - 8.0).collect()
        };
        let kind = OpKind::AllGatherBothMatmul;
        let f_size = example_dimension(kind) as usize;
        for (i, (n, schedule)) in
            [(4, Schedule::Ring), (4, Schedule::Sequential), (6, Schedule::Ring), (6, Schedule::Sliced { slices: 3 })]
                .into_iter()
                .enumerate()
        {
            let t_size = n / f_size;
            let dims = example_dims(kind, n as i64, m as i64, k as i64, c as i64);
            let dims: [&[i64]; 3] = [&dims[0], &dims[1], &dims[2]];
            let runs = run_ranks_as(kind, schedule, n, dims, 7600 + i as i64, None, Lanes::Threads);
            for (r, run) in runs.iter().enumerate() {
                let (f, t) = (r / t_size, r % t_size);
                let got: Vec<f32> = bytemuck::cast_slice(&run.out).to_vec();
                assert_eq!(got.len(), t_size * m * c);
                for p in 0..t_size {
                    let x = fill(f * t_size + p, m * f_size * k);
                    for row in 0..m {
                        for col in 0..c {
                            let want: f64 = (0..f_size)
                                .map(|q| {
                                    let w = fill(q * t_size + t, k * c);
                                    (0..k).map(|kk| x[row * f_size * k + q * k + kk] * w[kk * c + col]).sum::<f64>()
                                })
                                .sum();
                            let at = (p * m + row) * c + col;
                            assert_eq!(got[at] as f64, want, "{schedule:?} n={n} rank {r} out[{p}][{row}][{col}]");
                        }
                    }
                }
            }
        }
    }

    /// The gather-contract-scatter op on the CPU backend against its
    /// definition: rank (f, t) of F x T ends with row block f of the sum over
    /// f' of rank (f', t)'s x gathered along its columns over T (rank (f', p)'s
    /// x is columns block p) times rank (f', t)'s w.
    #[test]
    fn the_gather_contract_scatter_op_reduce_scatters_the_product_of_the_gathered_columns() {
        let (m, k, c) = (3usize, 4usize, 5usize);
        let fill = |rank: usize, len: usize| -> Vec<f64> {
            (0..len).map(|i| ((i * 7 + rank * 13) % 17) as f64 - 8.0).collect()
        };
        let kind = OpKind::AllGatherContractMatmulReduceScatter;
        // (n, F): F > 2 reuses the two partial slots and receives F row blocks per step.
        let cases = [(4, 2, Schedule::Ring), (4, 2, Schedule::Sequential), (6, 2, Schedule::Ring)].into_iter().chain([
            (6, 3, Schedule::Ring),
            (8, 4, Schedule::Ring),
            (6, 3, Schedule::Sequential),
        ]);
        for (i, (n, f_size, schedule)) in cases.enumerate() {
            let t_size = n / f_size;
            let dims =
                [vec![(f_size * m) as i64, k as i64], vec![(t_size * k) as i64, c as i64], vec![m as i64, c as i64]];
            let dims: [&[i64]; 3] = [&dims[0], &dims[1], &dims[2]];
            let site = 7700 + i as i64;
            let runs = run_ranks_over(kind, schedule, n, dims, site, None, Lanes::Threads, f_size as i64);
            for (r, run) in runs.iter().enumerate() {
                let (f, t) = (r / t_size, r % t_size);
                let got: Vec<f32> = bytemuck::cast_slice(&run.out).to_vec();
                assert_eq!(got.len(), m * c);
                for row in 0..m {
                    for col in 0..c {
                        let want: f64 = (0..f_size)
                            .map(|g| {
                                let w = fill(g * t_size + t, t_size * k * c);
                                (0..t_size)
                                    .map(|p| {
                                        let x = fill(g * t_size + p, f_size * m * k);
                                        (0..k).map(|j| x[(f * m + row) * k + j] * w[(p * k + j) * c + col]).sum::<f64>()
                                    })
                                    .sum::<f64>()
                            })
                            .sum();
                        assert_eq!(got[row * c + col] as f64, want, "{schedule:?} n={n} rank {r} out[{row}][{col}]");
                    }
                }
            }
        }
    }

    #[test]
    fn a_late_peer_does_not_stall_the_ring_scatter_gemms_of_the_others() {
        // Rank 1 starts only once the others have computed three partials
        // each (the run-ahead), although from its second step on each
        // rank's chain needs rank 1's sums: were they to wait for it, it
        // would start after 20 s and their partials after it. Order, not
        // time: no clock reading is compared with a duration.
        // (Big enough to run on lanes: smaller calls run in plan order.)
        let (n, rows, k, cols) = (4, 128, 256, 128);
        let dims: [&[i64]; 3] = [&[(n * rows) as i64, k as i64], &[k as i64, cols as i64], &[rows as i64, cols as i64]];
        let runs = run_ranks(OpKind::MatmulReduceScatter, Schedule::Ring, n, dims, 7300, Some((1, 3)));
        let late_start = runs[1].started;
        for (rank, run) in runs.iter().enumerate().filter(|(r, _)| *r != 1) {
            let products: Vec<Instant> = run
                .computed
                .iter()
                .filter(|(step, ..)| matches!(step.action, crate::plan::Action::Matmul { .. }))
                .map(|(_, _, ended)| *ended)
                .collect();
            assert_eq!(products.len(), n, "rank {rank}: n-1 partials and the own block");
            for (s, ended) in products.iter().take(3).enumerate() {
                assert!(*ended < late_start, "rank {rank}: partial {s} waited for the late rank");
            }
            // The final sum needs the chain through rank 1: it ends after rank 1 started.
            let (_, _, final_sum) = run.computed.last().unwrap();
            assert!(*final_sum > late_start, "rank {rank}");
        }
    }
}
