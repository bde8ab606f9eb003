//! The CPU backend: steps on host threads, transfers through an in-process
//! mailbox, matmuls with the `gemm` crate, conversions for bf16/f16.
#![deny(unsafe_code)] // only `gemm.rs` opts out, to call the gemm crate

#[allow(unsafe_code)]
mod gemm;
pub mod numeric;
pub mod transport;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::{self, Backend, Wait};
use crate::plan::{Buf, Plan, Transfer, Workspace};
use crate::problem::Problem;
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

/// Runs `plan` for one device call, accumulating in f32 or f64 as the dtypes ask.
pub fn run(problem: &Problem, plan: &Plan, buffers: Buffers<'_>, endpoint: &Endpoint, deadline: Instant) -> Result<()> {
    match problem.dims.accumulator() {
        DType::F64 => exec::run(plan, &CpuBackend::<f64>::new(problem, plan, buffers, endpoint)?, deadline),
        _ => exec::run(plan, &CpuBackend::<f32>::new(problem, plan, buffers, endpoint)?, deadline),
    }
}

/// Workspace regions only the compute lane uses, for dtype conversions.
struct Scratch<'a> {
    rows: Option<&'a mut [u8]>,
    results: Option<&'a mut [u8]>,
}

struct CpuBackend<'a, A: Accum> {
    problem: Problem,
    x: &'a [u8],
    /// `w` in the accumulator type: XLA's buffer, or its converted copy.
    w: &'a [u8],
    out: Mutex<&'a mut [u8]>,
    /// Steps may read a slot together (a block is sent on while it is
    /// multiplied); a write must have it alone.
    slots: Vec<RwLock<&'a mut [u8]>>,
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

impl<'a, A: Accum> CpuBackend<'a, A> {
    fn new(problem: &Problem, plan: &Plan, buffers: Buffers<'a>, endpoint: &'a Endpoint) -> Result<Self> {
        let layout = Workspace::layout(plan, &problem.dims);
        if buffers.workspace.len() < layout.total {
            return Err(Error::InvalidArgument(format!(
                "workspace has {} bytes, the plan needs {}",
                buffers.workspace.len(),
                layout.total
            )));
        }
        let mut regions = layout.slots.clone();
        let optional = [&layout.weights, &layout.rows, &layout.results];
        regions.extend(optional.iter().filter_map(|r| (*r).clone()));
        let mut parts = split(buffers.workspace, &regions)?.into_iter();
        let slots = parts.by_ref().take(layout.slots.len()).map(RwLock::new).collect();
        let mut next = |r: &Option<Range<usize>>| r.as_ref().and_then(|_| parts.next());
        let (weights, rows, results) = (next(&layout.weights), next(&layout.rows), next(&layout.results));
        let w: &'a [u8] = match weights {
            Some(converted) => {
                load::<A>(buffers.w, problem.dims.input, view_mut(converted)?)?;
                converted
            }
            None => buffers.w,
        };
        Ok(CpuBackend {
            problem: *problem,
            x: buffers.x,
            w,
            out: Mutex::new(buffers.out),
            slots,
            scratch: Mutex::new(Scratch { rows, results }),
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

    /// Rows of segment `seg` of `buf`'s block.
    fn rows(&self, buf: Buf, seg: usize) -> Range<usize> {
        let Problem { ranks, seg_rows, .. } = self.problem;
        let start = match buf {
            Buf::XBlock(j) | Buf::OutBlock(j) => (seg * ranks + j) * seg_rows,
            Buf::X | Buf::Slot(_) | Buf::Out => seg * seg_rows,
        };
        start..start + seg_rows
    }

    /// Byte range of rows `rows` of `width` elements of `dtype`.
    fn bytes(rows: Range<usize>, width: usize, dtype: DType) -> Range<usize> {
        let row = width * dtype.size();
        rows.start * row..rows.end * row
    }
}

impl<A: Accum> Backend for CpuBackend<'_, A> {
    fn matmul(&self, src: Buf, dst: Buf) -> Result<()> {
        let (r, k, n) = (self.problem.seg_rows, self.problem.dims.k, self.problem.dims.n);
        let input = self.problem.dims.input;
        let w: &[A] = view(self.w)?;
        let mut scratch = claim(&self.scratch, "the conversion scratch")?;
        let Scratch { rows: row_scratch, results: result_scratch } = &mut *scratch;

        let src_guard;
        let src_bytes: &[u8] = match src {
            Buf::X | Buf::XBlock(_) => self.x,
            Buf::Slot(_) => {
                src_guard = self.read_slot(src)?;
                &src_guard[..]
            }
            other => return Err(Error::Internal(format!("matmul reads {other:?}"))),
        };
        let (mut out_guard, mut slot_guard);
        let (dst_all, dst_dtype): (&mut [u8], DType) = match dst {
            Buf::Out | Buf::OutBlock(_) => {
                out_guard = claim(&self.out, "the output")?;
                (&mut out_guard[..], self.problem.dims.output)
            }
            Buf::Slot(_) => {
                slot_guard = self.write_slot(dst)?;
                (&mut slot_guard[..], A::DTYPE)
            }
            other => return Err(Error::Internal(format!("matmul writes {other:?}"))),
        };
        for seg in 0..self.problem.outer {
            let lhs_bytes = &src_bytes[Self::bytes(self.rows(src, seg), k, input)];
            let lhs: &[A] = match row_scratch {
                Some(s) if input != A::DTYPE => {
                    let converted = &mut view_mut::<A>(s)?[..r * k];
                    load(lhs_bytes, input, converted)?;
                    converted
                }
                _ => view(lhs_bytes)?,
            };
            let dst_bytes = &mut dst_all[Self::bytes(self.rows(dst, seg), n, dst_dtype)];
            if dst_dtype == A::DTYPE {
                gemm::matmul(r, k, n, lhs, w, view_mut(dst_bytes)?)?;
            } else {
                let s = result_scratch.as_deref_mut().ok_or_else(|| Error::Internal("no result scratch".into()))?;
                let tmp = &mut view_mut::<A>(s)?[..r * n];
                gemm::matmul(r, k, n, lhs, w, tmp)?;
                store(tmp, dst_dtype, dst_bytes)?;
            }
        }
        Ok(())
    }

    fn sum(&self, terms: &[Buf], dst: Buf) -> Result<()> {
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
        if dst != Buf::Out {
            return Err(Error::Internal(format!("sum writes {dst:?}")));
        }
        let guards = terms.iter().map(|t| self.read_slot(*t)).collect::<Result<Vec<_>>>()?;
        let views = guards.iter().map(|g| view::<A>(g)).collect::<Result<Vec<_>>>()?;
        let mut out = claim(&self.out, "the output")?;
        let output = self.problem.dims.output;
        // Sum a chunk at a time in the accumulator type, then store it.
        const CHUNK: usize = 512;
        let mut chunk = [A::default(); CHUNK];
        let len = views[0].len();
        for start in (0..len).step_by(CHUNK) {
            let end = (start + CHUNK).min(len);
            let c = &mut chunk[..end - start];
            c.copy_from_slice(&views[0][start..end]);
            for v in &views[1..] {
                c.iter_mut().zip(&v[start..end]).for_each(|(a, b)| *a += *b);
            }
            store(c, output, &mut out[Self::bytes(start..end, 1, output)])?;
        }
        Ok(())
    }

    fn exchange(&self, sends: &[Transfer], recvs: &[Transfer], wait: &Wait) -> Result<()> {
        for t in sends {
            match t.buf {
                Buf::X => self.endpoint.send(t.peer, t.tag, self.x),
                _ => self.endpoint.send(t.peer, t.tag, &self.read_slot(t.buf)?),
            }
        }
        for t in recvs {
            self.endpoint.recv(t.peer, t.tag, &mut self.write_slot(t.buf)?, wait)?;
        }
        Ok(())
    }
}
