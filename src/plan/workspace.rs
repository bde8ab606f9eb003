//! Workspace layout: byte offsets of a plan's slots and of the conversion
//! scratch, once the shapes are known. Python asks for the total at trace time
//! (through `commfuse_workspace_bytes`) and hands XLA-owned memory of that size
//! to every call, so nothing is allocated on the hot path.

use super::{Plan, SlotKind};
use crate::dtype::DType;
use std::ops::Range;

/// Shapes of one rank's problem: blocks of `block_rows × k` input rows,
/// `k × n` weights, `block_rows × n` output rows per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub block_rows: usize,
    pub k: usize,
    pub n: usize,
    pub input: DType,
    pub output: DType,
}

impl Dims {
    pub fn accumulator(&self) -> DType {
        DType::accumulator(self.input, self.output)
    }
}

/// Where each region lives in the workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workspace {
    pub slots: Vec<Range<usize>>,
    /// `w` in the accumulator type, when the input type differs from it.
    pub weights: Option<Range<usize>>,
    /// One block of input rows in the accumulator type, same condition.
    pub rows: Option<Range<usize>>,
    /// One block of results in the accumulator type, for matmuls whose
    /// destination has another type.
    pub results: Option<Range<usize>>,
    pub total: usize,
}

/// Regions start on cache-line boundaries.
const ALIGN: usize = 64;

impl Workspace {
    pub fn layout(plan: &Plan, dims: &Dims) -> Workspace {
        let acc = dims.accumulator();
        let mut cursor = 0;
        let mut region = |bytes: usize| {
            let start = cursor;
            cursor = (start + bytes).div_ceil(ALIGN) * ALIGN;
            start..start + bytes
        };
        let slots = plan
            .slots
            .iter()
            .map(|kind| match kind {
                SlotKind::InputRows => region(dims.block_rows * dims.k * dims.input.size()),
                SlotKind::Accum => region(dims.block_rows * dims.n * acc.size()),
            })
            .collect();
        let convert_inputs = dims.input != acc;
        let weights = convert_inputs.then(|| region(dims.k * dims.n * acc.size()));
        let rows = convert_inputs.then(|| region(dims.block_rows * dims.k * acc.size()));
        let results = (dims.output != acc).then(|| region(dims.block_rows * dims.n * acc.size()));
        Workspace { slots, weights, rows, results, total: cursor }
    }
}
