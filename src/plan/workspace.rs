//! Workspace layout: byte offsets of a plan's slots once the shapes are
//! known. Each backend appends the scratch it needs of its own after them
//! (`backend::cpu::CpuLayout`: conversion copies; `backend::cuda::workspace`:
//! the fp8 GEMMs' workspace). Python asks for the total at trace time
//! (`crate::prepare`) and hands XLA-owned memory of that size to every call,
//! so nothing is allocated on the hot path.

use super::{Plan, SlotKind};
use crate::dtype::DType;
use crate::error::{Error, Result};
use std::ops::Range;

/// Element counts of what a plan moves and computes, and the dtypes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// The operand that travels or is split (`x`), whole.
    pub x: usize,
    /// The other operand (`w`), whole.
    pub w: usize,
    /// One travelling block of `x`.
    pub travel: usize,
    /// One block of products.
    pub partial: usize,
    /// The whole output.
    pub result: usize,
    /// The largest part of the output one product writes.
    pub out_view: usize,
    pub input: DType,
    pub output: DType,
}

impl Sizes {
    pub fn accumulator(&self) -> DType {
        DType::accumulator(self.input, self.output)
    }
}

/// Where the plan's slots live in the workspace, and its size so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workspace {
    pub slots: Vec<Range<usize>>,
    pub total: usize,
}

/// Regions start on cache-line boundaries.
const ALIGN: usize = 64;

impl Workspace {
    /// The slots' layout, or INVALID_ARGUMENT when its bytes would not fit
    /// one allocation (sizes from a hostile call frame; every product checked).
    pub fn layout(plan: &Plan, sizes: &Sizes) -> Result<Workspace> {
        let acc = sizes.accumulator().size();
        let mut workspace = Workspace { slots: Vec::with_capacity(plan.slots.len()), total: 0 };
        for kind in &plan.slots {
            let slot = match kind {
                SlotKind::Input => workspace.append(sizes.travel, sizes.input.size(), ALIGN)?,
                SlotKind::Weight => workspace.append(sizes.w, sizes.input.size(), ALIGN)?,
                SlotKind::Partial => workspace.append(sizes.partial, acc, ALIGN)?,
                SlotKind::Result => workspace.append(sizes.result, acc, ALIGN)?,
            };
            workspace.slots.push(slot);
        }
        Ok(workspace)
    }

    /// A region of `elements` of `size` bytes after everything so far,
    /// starting on an `align`-byte boundary (a backend's own scratch).
    pub fn append(&mut self, elements: usize, size: usize, align: usize) -> Result<Range<usize>> {
        let start = self.total.checked_next_multiple_of(align);
        let end = start.and_then(|s| elements.checked_mul(size).and_then(|bytes| s.checked_add(bytes)));
        match start.zip(end.filter(|&e| e <= isize::MAX as usize)) {
            Some((start, end)) => {
                self.total = end;
                Ok(start..end)
            }
            None => Err(Error::InvalidArgument(format!("the workspace would exceed {} bytes", isize::MAX))),
        }
    }
}
