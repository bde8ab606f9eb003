//! Workspace layout: byte offsets of a plan's slots and of the conversion
//! scratch, once the shapes are known. Python asks for the total at trace time
//! (through `commfuse_workspace_bytes`) and hands XLA-owned memory of that size
//! to every call, so nothing is allocated on the hot path.

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

/// Where each region lives in the workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workspace {
    pub slots: Vec<Range<usize>>,
    /// `x` and `w` in the accumulator type, when the input type differs from it.
    pub x: Option<Range<usize>>,
    pub w: Option<Range<usize>>,
    /// A received block in the accumulator type, same condition.
    pub travel: Option<Range<usize>>,
    /// Products in the accumulator type, for outputs of another type.
    pub results: Option<Range<usize>>,
    pub total: usize,
}

/// Regions start on cache-line boundaries.
const ALIGN: usize = 64;

impl Workspace {
    /// The layout, or INVALID_ARGUMENT when its bytes would not fit one
    /// allocation (sizes from a hostile call frame; every product checked).
    pub fn layout(plan: &Plan, sizes: &Sizes) -> Result<Workspace> {
        let acc = sizes.accumulator().size();
        let mut cursor = 0usize;
        let mut region = |elements: usize, size: usize| -> Result<Range<usize>> {
            let start = cursor;
            let end = elements.checked_mul(size).and_then(|bytes| start.checked_add(bytes));
            let aligned = end.and_then(|e| e.checked_next_multiple_of(ALIGN)).filter(|&a| a <= isize::MAX as usize);
            let (end, aligned) = end
                .zip(aligned)
                .ok_or_else(|| Error::InvalidArgument(format!("the workspace would exceed {} bytes", isize::MAX)))?;
            cursor = aligned;
            Ok(start..end)
        };
        let slots = plan
            .slots
            .iter()
            .map(|kind| match kind {
                SlotKind::Input => region(sizes.travel, sizes.input.size()),
                SlotKind::Partial => region(sizes.partial, acc),
                SlotKind::Result => region(sizes.result, acc),
            })
            .collect::<Result<Vec<_>>>()?;
        let convert = sizes.input != sizes.accumulator();
        let x = convert.then(|| region(sizes.x, acc)).transpose()?;
        let w = convert.then(|| region(sizes.w, acc)).transpose()?;
        let travel = convert.then(|| region(sizes.travel, acc)).transpose()?;
        let results = (sizes.output != sizes.accumulator()).then(|| region(sizes.out_view, acc)).transpose()?;
        Ok(Workspace { slots, x, w, travel, results, total: cursor })
    }
}
