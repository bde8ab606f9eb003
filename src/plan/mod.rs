//! Plans: (op, N, rank, schedule) → steps on lanes with their dependencies.
//!
//! Pure code with no I/O, so every property can be checked exhaustively. A plan
//! is a list of steps in one valid order; each step runs on a lane (the compute
//! lane or the communication lane) and lanes run their steps in list order.
//! `deps` names the steps of *other* lanes a step must wait for; same-lane order
//! is implicit. Shapes are not part of a plan: a block is "the rows one rank
//! owns", and `workspace` turns slots into byte offsets once shapes are known.
#![forbid(unsafe_code)]

mod build;
#[cfg(test)]
mod tests;
pub mod workspace;

pub use build::plan;
pub use workspace::{Sizes, Workspace};

use crate::error::{Error, Result};

/// The most ranks a plan is made for (its steps grow with the ranks).
pub const MAX_RANKS: usize = 1 << 16;
/// The most chunks ("sliced", "tiled") a block is cut into.
pub const MAX_CHUNKS: usize = 1 << 10;
/// The most blocks of a cut plan: ranks x chunks (its steps grow with both).
pub const MAX_CUT_BLOCKS: usize = 1 << 18;

/// Whether a plan for `n` ranks under `schedule` stays within the limits
/// above: checked before `plan` allocates steps in proportion to counts a
/// caller chose. `op` names the op in the error.
pub fn check_size(op: &str, schedule: Schedule, n: usize) -> Result<()> {
    let invalid = |m: String| Err(Error::InvalidArgument(format!("{op}: {m}")));
    if n == 0 || n > MAX_RANKS {
        return invalid(format!("the axis size must be in [1, {MAX_RANKS}], got {n}"));
    }
    if let Schedule::Sliced { slices: chunks } | Schedule::Tiled { tiles: chunks } = schedule {
        let unit = if matches!(schedule, Schedule::Sliced { .. }) { "slices" } else { "tiles" };
        if chunks == 0 || chunks > MAX_CHUNKS {
            return invalid(format!("{unit} must be in [1, {MAX_CHUNKS}], got {chunks}"));
        }
        if chunks * n > MAX_CUT_BLOCKS {
            return invalid(format!(
                "{unit}={chunks} over an axis of {n} makes {} blocks; at most {MAX_CUT_BLOCKS} ({unit} x axis size)",
                chunks * n
            ));
        }
    }
    Ok(())
}

/// The shape of a plan's loop; every fused op is one of these (see
/// `crate::problem::OpKind`), and only the GEMM geometry differs between ops
/// of one pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// Blocks of `x` travel round the ring; each is multiplied as it arrives,
    /// into its own output block, or (`accumulate`) into one sum.
    Gather { accumulate: bool },
    /// Partial products travel round the ring, summed on the way; rank j's
    /// output is the sum of block j over all ranks.
    Scatter,
    /// Rank q sends block j of `x` straight to rank j; each received block is
    /// multiplied into its output block (or `accumulate`d into one sum).
    ExchangeThenMatmul { accumulate: bool },
    /// Rank q multiplies the block for rank j and sends it there; received
    /// blocks are copied into the output.
    MatmulThenExchange,
    /// `Scatter`, then each reduced block goes round the ring to every rank
    /// (an all-gather ring of sums, copied into the output as they pass):
    /// every rank ends with every block's sum, as an all-reduce does.
    AllReduce,
    /// Two rings over a group of F x T ranks (rank `f * T + t`): the blocks of
    /// `x` travel round the F ranks that share `t` (a gather), and the
    /// product with each block is reduce-scattered round the T ranks that
    /// share `f`, the partials summed on the way. `gathered` is F (0: not
    /// known from the op kind alone, see `Problem::pattern`).
    GatherScatter { gathered: usize },
    /// Two gathers over a group of F x T ranks (rank `f * T + t`): the row
    /// blocks of `x` travel round the T ranks that share `f` and the blocks
    /// of the second operand (`w`, cut along the contraction) round the F
    /// ranks that share `t`; each product of one block of each is added into
    /// the result's row block of its `x` block. `gathered` is F (0: not known
    /// from the op kind alone, see `Problem::pattern`); `into_out`: the
    /// products add up in the output itself (its dtype is the accumulator's),
    /// else in a result slot that is summed into the output at the end.
    /// Sliced: x's row blocks travel in row chunks, and block
    /// `(p * slices + u) * F + q` is chunk u of x's row block p by w's block q.
    GatherGather { gathered: usize, into_out: bool },
    /// A gather along the contraction, then a reduce-scatter, over a group
    /// of F x T ranks (rank `f * T + t`): the blocks of `x` (the left
    /// operand's columns) travel round the T ranks that share `f` by row
    /// blocks (`XBlock(q)` the own rows of partial q), each product adding
    /// into the partial of its row block of the result (block `q * T + p`:
    /// row block q of x's block p), and the F partials are reduce-scattered
    /// round the F ranks that share `t`. `scattered` is F (0: not known
    /// from the op kind alone).
    GatherContractScatter { scattered: usize },
}

impl Pattern {
    /// Every pattern (for exhaustive tests).
    pub const ALL: [Pattern; 7] = [
        Pattern::Gather { accumulate: false },
        Pattern::Gather { accumulate: true },
        Pattern::Scatter,
        Pattern::ExchangeThenMatmul { accumulate: false },
        Pattern::ExchangeThenMatmul { accumulate: true },
        Pattern::MatmulThenExchange,
        Pattern::AllReduce,
    ];

    /// Whether blocks go round the ring (so a bidirectional schedule exists)
    /// rather than straight to their peer.
    pub fn uses_ring(self) -> bool {
        matches!(self, Pattern::Gather { .. } | Pattern::Scatter | Pattern::AllReduce)
    }

    /// Whether partial products travel and are summed on the way.
    pub fn reduces(self) -> bool {
        matches!(
            self,
            Pattern::Scatter
                | Pattern::AllReduce
                | Pattern::GatherScatter { .. }
                | Pattern::GatherContractScatter { .. }
        )
    }

    /// The size F of a two-axis pattern's first axis (`None` for the one-axis patterns).
    pub fn two_axis(self) -> Option<usize> {
        match self {
            Pattern::GatherScatter { gathered } | Pattern::GatherGather { gathered, .. } => Some(gathered),
            Pattern::GatherContractScatter { scattered } => Some(scattered),
            _ => None,
        }
    }
}

/// How the collective is decomposed and overlapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Resolved by [`Schedule::resolve`].
    Auto,
    /// Blocks travel one way round the ring: N-1 transfer steps.
    Ring,
    /// Blocks travel both ways: ⌈(N-1)/2⌉ transfer steps.
    Bidirectional,
    /// The whole collective, then the matmul (or the reverse for RS): no overlap. A baseline.
    Sequential,
    /// Data slicing, the other baseline: the rows of every block are cut into
    /// `slices` chunks and each chunk gets one whole ring collective, which
    /// overlaps the matmul of the neighbouring chunk (AG: chunk c+1 is gathered
    /// while chunk c is multiplied; RS: chunk c is reduce-scattered while
    /// chunk c+1 is multiplied). The first gather (AG) or the last
    /// reduce-scatter (RS) is exposed. Row gathers and scatters only
    /// (`Pattern::Gather { accumulate: false }` and `Pattern::Scatter`), and
    /// the all-reduce, whose chunk c is all-gathered inside the op right after
    /// its reduce-scatter, so both run while chunk c+1 is multiplied. Of the
    /// two-axis patterns, `GatherScatter` (each block of w's columns cut)
    /// and `GatherGather` (x's row blocks travel in chunks, each multiplied
    /// as it arrives: see their docs for their block indices).
    ///
    /// In a sliced plan block indices are fine: block `j * slices + c` is
    /// chunk c of block j (in `Matmul::block` and `OutBlock`), `XBlock(c)` of a
    /// gather is chunk c of the local x, and a slot holds one chunk.
    Sliced { slices: usize },
    /// Ring order at tile granularity: each step's matmul is cut into `tiles`
    /// row tiles and each tile travels on its own as soon as it is computed
    /// (scatter: and summed), so the transfer of tile t runs while tile t+1
    /// is multiplied. Only one tile's compute is left exposed behind the last
    /// transfer (gather) or one tile's transfer after the last compute
    /// (scatter), where per-step granularity exposes a whole block's. Same
    /// patterns and fine block indices as `Sliced`; one chain (forward).
    Tiled { tiles: usize },
}

/// A schedule's name as Python spells it (`"tiled(4)"` for the cut ones).
impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Schedule::Auto => write!(f, "auto"),
            Schedule::Ring => write!(f, "ring"),
            Schedule::Bidirectional => write!(f, "bidirectional"),
            Schedule::Sequential => write!(f, "sequential"),
            Schedule::Sliced { slices } => write!(f, "sliced({slices})"),
            Schedule::Tiled { tiles } => write!(f, "tiled({tiles})"),
        }
    }
}

impl Schedule {
    /// Whether sliced and tiled plans exist for `pattern`.
    pub fn sliceable(pattern: Pattern) -> bool {
        matches!(
            pattern,
            Pattern::Gather { accumulate: false }
                | Pattern::Scatter
                | Pattern::AllReduce
                | Pattern::GatherScatter { .. }
                | Pattern::GatherGather { .. }
        )
    }

    /// The chunks each block is cut into: a sliced schedule's slices or a
    /// tiled schedule's tiles, else 1.
    pub fn chunks(self) -> usize {
        match self {
            Schedule::Sliced { slices } => slices,
            Schedule::Tiled { tiles } => tiles,
            _ => 1,
        }
    }

    /// Whether block indices are fine (`j * chunks() + c`), see `Sliced`.
    pub fn cuts_blocks(self) -> bool {
        matches!(self, Schedule::Sliced { .. } | Schedule::Tiled { .. })
    }

    /// `Auto` becomes a concrete schedule. Both directions of a ring of links
    /// carry data at once, so bidirectional halves the transfer steps from N = 3
    /// on; with N <= 2 the two are the same plan. Patterns that send straight
    /// to each peer have one overlapped order, reported as `Ring`.
    pub fn resolve(self, n: usize, pattern: Pattern) -> Schedule {
        match self {
            Schedule::Sequential => Schedule::Sequential,
            Schedule::Sliced { slices } => Schedule::Sliced { slices },
            Schedule::Tiled { tiles } => Schedule::Tiled { tiles },
            // Both rings run one way: one overlapped plan.
            _ if !pattern.uses_ring() || pattern.two_axis().is_some() => Schedule::Ring,
            Schedule::Auto if n <= 2 => Schedule::Ring,
            Schedule::Auto => Schedule::Bidirectional,
            other => other,
        }
    }
}

/// The lanes of a plan: streams on a GPU, threads on the CPU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    Compute,
    Comm,
}

/// A buffer a step reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The local `x` (the operand that travels or is split), whole.
    X,
    /// The local second operand (`w`), whole: what a product multiplies by
    /// unless a received block of it is named (`Action::Matmul::with`), and
    /// what a plan that gathers it too (`Pattern::GatherGather`) sends.
    W,
    /// The part of the local `x` that belongs to block j (a chunk of it in
    /// a sliced plan; a row block in a gather-contract-scatter plan: see
    /// `Problem::x_block`).
    XBlock(usize),
    /// Workspace slot i.
    Slot(usize),
    /// The whole local output.
    Out,
    /// The part of the output that belongs to block j.
    OutBlock(usize),
}

/// The name traces and `commfuse.explain` show: `x`, `x[j]`, `slot{i}`, `out`, `out[j]`.
impl std::fmt::Display for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Buf::X => write!(f, "x"),
            Buf::W => write!(f, "w"),
            Buf::XBlock(j) => write!(f, "x[{j}]"),
            Buf::Slot(i) => write!(f, "slot{i}"),
            Buf::Out => write!(f, "out"),
            Buf::OutBlock(j) => write!(f, "out[{j}]"),
        }
    }
}

/// What a workspace slot holds; its size follows from the shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    /// One travelling block (a chunk, in a sliced plan) of `x`, in the input dtype.
    Input,
    /// One travelling block of the second operand (`w`, as large as the
    /// local one), in the input dtype (`Pattern::GatherGather`).
    Weight,
    /// One block (a chunk, in a sliced plan) of products, in the accumulator
    /// dtype. A send hands a partial over: no plan reads a sent partial again
    /// before rewriting it (the plan tests check this), so a backend may give
    /// the sent buffer away instead of keeping a reference to it.
    Partial,
    /// The whole output, in the accumulator dtype (accumulating patterns).
    Result,
}

impl SlotKind {
    /// Whether a send gives this slot's contents away (see `SlotKind::Partial`).
    pub fn handed_over(self) -> bool {
        self == SlotKind::Partial
    }
}

/// Two transfer chains go round the ring; a tag tells their messages apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Towards rank + 1.
    Forward,
    /// Towards rank - 1.
    Backward,
}

/// Matches a send with its receive: same chain, same step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag {
    pub direction: Direction,
    pub step: usize,
}

/// One point-to-point transfer of one whole buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    pub peer: usize,
    pub buf: Buf,
    pub tag: Tag,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The product for block `block` (whose data `src` holds) into `dst`;
    /// `accumulate` adds to `dst` instead of overwriting it. What is
    /// multiplied by what is the op's geometry (`crate::problem`); the
    /// second operand's side reads `with`: `Buf::W`, or a slot holding a
    /// received block of it (`Pattern::GatherGather`).
    Matmul { block: usize, src: Buf, with: Buf, dst: Buf, accumulate: bool },
    /// `dst = Σ terms`, in the accumulator dtype; `dst` may be `terms[0]`.
    Sum { terms: Vec<Buf>, dst: Buf },
    /// A group of transfers posted together (one NCCL group on a GPU); it
    /// ends when every receive has landed and every send has left.
    Exchange { sends: Vec<Transfer>, recvs: Vec<Transfer> },
}

pub type StepId = usize;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub id: StepId,
    pub lane: Lane,
    pub action: Action,
    /// Steps on other lanes that must finish first.
    pub deps: Vec<StepId>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub pattern: Pattern,
    pub schedule: Schedule,
    pub n: usize,
    pub rank: usize,
    pub slots: Vec<SlotKind>,
    pub steps: Vec<Step>,
}

impl Plan {
    /// Steps of one lane, in the order that lane runs them.
    pub fn lane_steps(&self, lane: Lane) -> impl Iterator<Item = &Step> {
        self.steps.iter().filter(move |s| s.lane == lane)
    }

    /// Whether a send of `buf` hands it over (see `SlotKind::Partial`).
    pub fn hands_over(&self, buf: Buf) -> bool {
        matches!(buf, Buf::Slot(i) if self.slots.get(i).is_some_and(|k| k.handed_over()))
    }

    /// The lanes this plan uses.
    pub fn lanes(&self) -> Vec<Lane> {
        let mut lanes: Vec<Lane> = self.steps.iter().map(|s| s.lane).collect();
        lanes.sort();
        lanes.dedup();
        lanes
    }
}

impl Action {
    /// Buffers the action reads.
    pub fn reads(&self) -> Vec<Buf> {
        match self {
            Action::Matmul { src, with, dst, accumulate: true, .. } => vec![*src, *with, *dst],
            Action::Matmul { src, with, .. } => vec![*src, *with],
            Action::Sum { terms, .. } => terms.clone(),
            Action::Exchange { sends, .. } => sends.iter().map(|t| t.buf).collect(),
        }
    }

    /// Buffers the action writes.
    pub fn writes(&self) -> Vec<Buf> {
        match self {
            Action::Matmul { dst, .. } | Action::Sum { dst, .. } => vec![*dst],
            Action::Exchange { recvs, .. } => recvs.iter().map(|t| t.buf).collect(),
        }
    }
}
