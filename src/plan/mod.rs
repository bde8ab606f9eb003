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
pub use workspace::{Dims, Workspace};

/// Which fused op a plan computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `all_gather(x) @ w`: output row-block j is `x_j @ w`.
    AllGatherMatmul,
    /// `psum_scatter(x @ w)`: this rank's output is `Σ_q x_q[block r] @ w`.
    MatmulReduceScatter,
}

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllGatherMatmul => "all_gather_matmul",
            OpKind::MatmulReduceScatter => "matmul_reduce_scatter",
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
}

impl Schedule {
    /// The code Python passes in the `schedule` attribute.
    pub fn from_code(code: i64) -> Option<Schedule> {
        match code {
            0 => Some(Schedule::Auto),
            1 => Some(Schedule::Ring),
            2 => Some(Schedule::Bidirectional),
            3 => Some(Schedule::Sequential),
            _ => None,
        }
    }

    /// `Auto` becomes a concrete schedule. Both directions of a ring of links
    /// carry data at once, so bidirectional halves the transfer steps from N = 3
    /// on; with N <= 2 the two are the same plan.
    pub fn resolve(self, n: usize) -> Schedule {
        match self {
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
    /// The local input rows, whole (AG: this rank's block).
    X,
    /// Rows of block j of the local input (RS: the rows that end on rank j).
    XBlock(usize),
    /// Workspace slot i.
    Slot(usize),
    /// The whole local output (RS).
    Out,
    /// Rows of block j of the output (AG: where `x_j @ w` goes).
    OutBlock(usize),
}

/// What a workspace slot holds; its size follows from the shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    /// One block of input rows, in the input dtype (`block_rows × k`).
    InputRows,
    /// One block of results, in the accumulator dtype (`block_rows × n`).
    Accum,
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
    /// `dst = src @ w`.
    Matmul { src: Buf, dst: Buf },
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
    pub op: OpKind,
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
            Action::Matmul { src, .. } => vec![*src],
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
