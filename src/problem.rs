//! One rank's problem: which op, the operands' shapes checked against it, and
//! its geometry — which GEMMs one plan step runs, on which strided views.
//!
//! Every op multiplies `x`-side data by `w`-side data. The plan moves blocks of
//! the first operand (`x` here; the weights for FSDP-style gathers, which Python
//! passes first) and this module says what "block j" means for each op.
#![forbid(unsafe_code)]

use crate::bail;
use crate::dtype::DType;
use crate::error::Result;
use crate::plan::{Buf, Pattern, Sizes};

/// The fused ops, by what moves and where products land. Python picks the
/// kind from the user's op and dimensions, and lays operands out as noted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `all_gather(x, d) @ w`, d a row dim: x `[.., R.., k]` travels, output row blocks.
    AllGatherMatmul,
    /// `all_gather(x, -1) @ w`: x `[m, kb]` travels; `out += x_j @ w[rows j]`.
    AllGatherMatmulContract,
    /// `x @ all_gather(w, 1)`: operands (w `[k, c]`, x `[m, k]`); output column blocks.
    MatmulAllGather,
    /// `x @ all_gather(w, 0)`: operands (w `[kb, n]`, x `[m, N*kb]`); `out += x[:, j] @ w_j`.
    MatmulAllGatherContract,
    /// `psum_scatter(x @ w, d)`, d a row dim: partials of row blocks travel.
    MatmulReduceScatter,
    /// `psum_scatter(x @ w, -1)`: x `[m, k]`, w `[k, N*c]`; partials of column blocks travel.
    MatmulReduceScatterCols,
    /// `all_to_all(x) @ w` with x's blocks stacked `[N, C, k]`; output stacked `[N, C, n]`.
    AllToAllMatmul,
    /// Same, concatenating along the contraction: x `[N, m, kb]`, w `[N*kb, n]`, output `[m, n]`.
    AllToAllMatmulContract,
    /// `all_to_all(x @ w)` splitting rows: x stacked `[N, C, k]`, output stacked `[N, C, n]`.
    MatmulAllToAll,
    /// Same, splitting columns: x `[m, k]`, w `[k, N*c]`, output stacked `[N, m, c]`.
    MatmulAllToAllCols,
    /// `psum(x @ w)`: x `[N*b, k]`, w `[k, n]`, output `[N*b, n]`; partials of
    /// row blocks travel and are summed, then the sums travel to every rank.
    MatmulAllReduce,
    /// `psum_scatter(x @ all_gather(w, A, axis=1), B, scatter_dimension=0)`
    /// over two mesh axes (an FSDP x TP row-parallel layer): operands
    /// (w `[kb, c]`, x `[T*b, kb]`) over a group of F x T ranks (A's size F,
    /// given as `dimension`, then B's T), output stacked `[F, b, c]` (column
    /// block j of the result, from A's rank j, is `out[j]`). Blocks of w
    /// travel round A's ring while the partials of each go round B's.
    AllGatherMatmulReduceScatter,
    /// `all_gather(x, B, axis=0) @ all_gather(w, A, axis=0)` over two mesh
    /// axes (an SP x FSDP column-parallel layer): x `[m, F*kb]` (its rows
    /// gathered over B), w `[kb, c]` (its rows, the contraction, gathered
    /// over A), over a group of F x T ranks (rank `f * T + t`; A's size F
    /// given as `dimension`, then B's T); output `[T*m, c]`. Blocks of x
    /// travel round B's ring and blocks of w round A's; block `p * F + q`
    /// is x's row block p times w's block q, added into output rows p.
    AllGatherBothMatmul,
    /// `psum_scatter(all_gather(x, B, axis=1) @ w, A, scatter_dimension=0)`
    /// over two mesh axes (the weight gradient of `AllGatherBothMatmul`:
    /// `all_gather(x, B)ᵀ @ dy` reduce-scattered over A): x `[F*kq, m]` (its
    /// columns, the contraction, gathered over B), w `[T*m, c]`, over a group
    /// of F x T ranks (rank `f * T + t`; A's size F given as `dimension`,
    /// then B's T); output `[kq, c]`. Blocks of x travel round B's ring;
    /// block `q * T + p` is row block q of x's block p times w's rows p,
    /// added into the partial of the result's row block q, and the partials
    /// are reduce-scattered round A's ring.
    AllGatherContractMatmulReduceScatter,
}

impl OpKind {
    /// The user's names of the two operands, in the order the call passes
    /// them: the operand that travels first (`x` here), then the other. The
    /// FSDP-style gathers pass the gathered weights first.
    pub fn operand_names(self) -> [&'static str; 2] {
        match self {
            OpKind::MatmulAllGather | OpKind::MatmulAllGatherContract | OpKind::AllGatherMatmulReduceScatter => {
                ["w", "x"]
            }
            _ => ["x", "w"],
        }
    }

    pub fn name(self) -> &'static str {
        use OpKind::*;
        match self {
            AllGatherMatmul | AllGatherMatmulContract => "all_gather_matmul",
            MatmulAllGather | MatmulAllGatherContract => "matmul_all_gather",
            MatmulReduceScatter | MatmulReduceScatterCols => "matmul_reduce_scatter",
            AllToAllMatmul | AllToAllMatmulContract => "all_to_all_matmul",
            MatmulAllToAll | MatmulAllToAllCols => "matmul_all_to_all",
            MatmulAllReduce => "matmul_all_reduce",
            AllGatherMatmulReduceScatter => "all_gather_matmul_reduce_scatter",
            AllGatherBothMatmul => "all_gather_both_matmul",
            AllGatherContractMatmulReduceScatter => "all_gather_contract_matmul_reduce_scatter",
        }
    }

    /// Whether the kind gathers or scatters row blocks of `x` (any row dim):
    /// the kinds the "sliced" and "tiled" schedules cut, fp8 takes and vmap
    /// batches over `x` (a batch dim becomes one more row dim).
    pub fn row_blocks(self) -> bool {
        matches!(self, OpKind::AllGatherMatmul | OpKind::MatmulReduceScatter)
    }

    /// Whether the "sliced" and "tiled" schedules cut this kind's blocks:
    /// the row kinds, and the all-reduce (2-D, its blocks are rows).
    pub fn cuts_rows(self) -> bool {
        self.row_blocks() || self == OpKind::MatmulAllReduce
    }

    /// The kind's plan pattern. A two-axis kind's depends on the size of
    /// its gather axis, which the kind alone does not know: its pattern
    /// here says 0, and `Problem::pattern` gives the one to plan.
    pub fn pattern(self) -> Pattern {
        use OpKind::*;
        match self {
            AllGatherMatmulReduceScatter => Pattern::GatherScatter { gathered: 0 },
            AllGatherBothMatmul => Pattern::GatherGather { gathered: 0, into_out: false },
            AllGatherContractMatmulReduceScatter => Pattern::GatherContractScatter { scattered: 0 },
            AllGatherMatmul | MatmulAllGather => Pattern::Gather { accumulate: false },
            AllGatherMatmulContract | MatmulAllGatherContract => Pattern::Gather { accumulate: true },
            MatmulReduceScatter | MatmulReduceScatterCols => Pattern::Scatter,
            AllToAllMatmul => Pattern::ExchangeThenMatmul { accumulate: false },
            AllToAllMatmulContract => Pattern::ExchangeThenMatmul { accumulate: true },
            MatmulAllToAll | MatmulAllToAllCols => Pattern::MatmulThenExchange,
            MatmulAllReduce => Pattern::AllReduce,
        }
    }
}

/// Shapes and dtypes of one call's operands, as decoded from the frame.
#[derive(Debug, Clone, Copy)]
pub struct Operand<'a> {
    pub dims: &'a [i64],
    pub dtype: DType,
}

/// A strided matrix inside a buffer, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
}

impl View {
    fn rows(offset: usize, rows: usize, cols: usize) -> View {
        View { offset, rows, cols, row_stride: cols }
    }

    /// One past the last element the view touches (0 if empty).
    pub fn end(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            self.offset + (self.rows - 1) * self.row_stride + self.cols
        }
    }
}

/// Which buffer a GEMM operand reads: the step's `src` (x or a received
/// block), or the second operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Src,
    W,
}

/// One GEMM of a plan step: `dst (+)= lhs @ rhs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    pub lhs: (Side, View),
    pub rhs: (Side, View),
    pub dst: View,
}

/// Sizes of one problem, in the canonical names of each kind (see `OpKind`):
/// `outer` segments of `seg` rows for row blocks, else one segment of `m` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Problem {
    pub kind: OpKind,
    /// How many equal parts `Buf::XBlock` cuts the local `x` into (see
    /// `x_block`): the group size, except in a sliced gather (the two-gather
    /// op's too), whose `XBlock(c)` is chunk c of the local x (see
    /// `sliced`), and the gather-contract-scatter kind: F, its row blocks.
    x_parts: usize,
    /// The group size.
    group: usize,
    /// `Schedule::Sliced { slices }`: block indices are fine (`j * slices + c`).
    slices: Option<usize>,
    /// Two-axis kinds: the size F of the first axis (the gather-scatter
    /// kind's gather axis: block `d * F + j` is the scatter axis's row block
    /// d of the product with w's block j; the others' see `OpKind`); 1 for
    /// the others.
    gathered: usize,
    outer: usize,
    /// Rows per segment (row kinds) or rows of the whole `m` dim.
    seg: usize,
    /// Contraction size of one product.
    k: usize,
    /// Columns of one product.
    n: usize,
    pub input: DType,
    pub output: DType,
    x_len: usize,
    w_len: usize,
    out_len: usize,
}

fn dims_usize(op: &str, arg: &str, dims: &[i64]) -> Result<Vec<usize>> {
    dims.iter()
        .map(|&d| usize::try_from(d).ok())
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| crate::error::Error::InvalidArgument(format!("{op}: `{arg}` has a negative dim: {dims:?}")))
}

/// The most elements one operand or result may have: its bytes in the widest
/// accumulator (f64, which the CPU backend may convert it to) stay within
/// what one allocation can address.
pub const MAX_ELEMENTS: usize = (isize::MAX as usize) / 8;

/// The most segments (the product of `x`'s dims before the gathered or
/// scattered dim) of a row kind: each plan step runs one GEMM per segment.
pub const MAX_SEGMENTS: usize = 1 << 22;

/// `a * b` for sizes, or INVALID_ARGUMENT naming `what` when it overflows.
pub fn checked_mul(op: &str, what: &str, a: usize, b: usize) -> Result<usize> {
    match a.checked_mul(b) {
        Some(p) if p <= MAX_ELEMENTS => Ok(p),
        _ => bail!(InvalidArgument, "{op}: {what} is too large: {a} x {b} exceeds {MAX_ELEMENTS} elements"),
    }
}

/// The element count of `dims`, or INVALID_ARGUMENT naming `arg` when the
/// product of its non-empty dims exceeds `MAX_ELEMENTS`: an empty dim makes
/// the count 0, but every partial product of the dims must still fit.
fn elements(op: &str, arg: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .filter(|&&d| d > 0)
        .try_fold(1usize, |acc, &d| checked_mul(op, &format!("`{arg}` of shape {dims:?}"), acc, d))?;
    Ok(if dims.contains(&0) { 0 } else { dims.iter().product() })
}

/// How one call's operands map onto GEMMs: `outer` segments of `seg` rows
/// (row kinds; else one segment of `m` rows), the contraction `k`, the
/// columns `n` of one product, and the result's dims.
struct Geometry {
    outer: usize,
    seg: usize,
    k: usize,
    n: usize,
    out: Vec<usize>,
}

/// The geometry of `kind` with operands of dims `xd` and `wd` over `nr`
/// ranks: the one place that says what each op's result shape is.
fn geometry(kind: OpKind, x: &[i64], w: &[i64], dimension: i64, nr: usize) -> Result<Geometry> {
    use OpKind::*;
    let name = kind.name();
    let [first, second] = kind.operand_names();
    let xd = dims_usize(name, first, x)?;
    let wd = dims_usize(name, second, w)?;
    let (outer, seg, k, n, out): (usize, usize, usize, usize, Vec<usize>) = match kind {
        AllGatherMatmul | MatmulReduceScatter => {
            let rank = xd.len();
            if rank < 2 {
                bail!(InvalidArgument, "{name}: `x` must have rank >= 2, got shape {:?}", x);
            }
            if wd.len() != 2 || wd[0] != xd[rank - 1] {
                bail!(
                    InvalidArgument,
                    "{name}: `w` must be 2-D [{}, n] to contract `x` {:?}, got {:?}",
                    xd[rank - 1],
                    x,
                    w
                );
            }
            let dim_name = if kind == AllGatherMatmul { "gather_dimension" } else { "scatter_dimension" };
            if dimension < 0 || dimension as usize >= rank - 1 {
                bail!(
                    InvalidArgument,
                    "{name}: `{dim_name}` must be in [0, {}) for `x` of rank {rank}, got {dimension}",
                    rank - 1
                );
            }
            let d = dimension as usize;
            elements(name, "x", &xd)?;
            let outer: usize = xd[..d].iter().product();
            // Each step runs one GEMM per segment: their count is bounded
            // before any step lists them.
            if outer > MAX_SEGMENTS {
                bail!(
                    InvalidArgument,
                    "{name}: `x` has {outer} segments before its dim {d} (the product of the dims before it); at most \
                     {MAX_SEGMENTS}: fold them into the rows, or gather or scatter a leading dim"
                );
            }
            let inner: usize = xd[d + 1..rank - 1].iter().product();
            let mut expected = xd.clone();
            expected[rank - 1] = wd[1];
            let seg = if kind == AllGatherMatmul {
                expected[d] =
                    checked_mul(name, &format!("the gathered dim {d} of `x` times the axis size"), xd[d], nr)?;
                xd[d] * inner
            } else {
                if xd[d] % nr != 0 {
                    bail!(InvalidArgument, "{name}: `x` dim {d} ({}) must be divisible by the axis size {nr}", xd[d]);
                }
                expected[d] /= nr;
                xd[d] / nr * inner
            };
            (outer, seg, wd[0], wd[1], expected)
        }
        _ => {
            let two = |arg: &str, d: &[usize]| -> Result<(usize, usize)> {
                match d {
                    [a, b] => Ok((*a, *b)),
                    _ => bail!(InvalidArgument, "{name}: `{arg}` must be 2-D here, got shape {d:?}"),
                }
            };
            let three = |arg: &str, d: &[usize]| -> Result<(usize, usize)> {
                match d {
                    [g, a, b] if *g == nr => Ok((*a, *b)),
                    _ => bail!(InvalidArgument, "{name}: `{arg}` must be [{nr}, rows, cols] here, got shape {d:?}"),
                }
            };
            let divide = |what: &str, v: usize| -> Result<usize> {
                if v % nr != 0 {
                    bail!(InvalidArgument, "{name}: {what} ({v}) must be divisible by the axis size {nr}");
                }
                Ok(v / nr)
            };
            let mismatch = |a: usize, b: usize| -> Result<()> {
                if a != b {
                    bail!(InvalidArgument, "{name}: contraction sizes differ: {a} vs {b} (x {:?}, w {:?})", x, w);
                }
                Ok(())
            };
            let times_axis = |what: &str, v: usize| checked_mul(name, &format!("{what} times the axis size"), v, nr);
            match kind {
                AllGatherMatmulContract => {
                    let (m, kb) = two("x", &xd)?;
                    let (kw, n) = two("w", &wd)?;
                    mismatch(times_axis("the columns of `x`", kb)?, kw)?;
                    (1, m, kb, n, vec![m, n])
                }
                MatmulAllGather => {
                    let (k, c) = two("w", &xd)?;
                    let (m, kx) = two("x", &wd)?;
                    mismatch(kx, k)?;
                    (1, m, k, c, vec![m, times_axis("the columns of the gathered operand", c)?])
                }
                MatmulAllGatherContract => {
                    let (kb, n) = two("w", &xd)?;
                    let (m, kx) = two("x", &wd)?;
                    mismatch(kx, times_axis("the rows of the gathered operand", kb)?)?;
                    (1, m, kb, n, vec![m, n])
                }
                MatmulReduceScatterCols | MatmulAllToAllCols => {
                    let (m, k) = two("x", &xd)?;
                    let (kw, nw) = two("w", &wd)?;
                    mismatch(k, kw)?;
                    let c = divide("the columns of `w`", nw)?;
                    let expected = if kind == MatmulAllToAllCols { vec![nr, m, c] } else { vec![m, c] };
                    (1, m, k, c, expected)
                }
                AllToAllMatmul | MatmulAllToAll => {
                    let (rows, k) = three("x", &xd)?;
                    let (kw, n) = two("w", &wd)?;
                    mismatch(k, kw)?;
                    (1, rows, k, n, vec![nr, rows, n])
                }
                MatmulAllReduce => {
                    let (m, k) = two("x", &xd)?;
                    let (kw, n) = two("w", &wd)?;
                    mismatch(k, kw)?;
                    (1, divide("the rows of `x`", m)?, k, n, vec![m, n])
                }
                AllGatherMatmulReduceScatter => {
                    let (kb, c) = two("w", &xd)?;
                    let (m, kx) = two("x", &wd)?;
                    mismatch(kx, kb)?;
                    let f = two_axis_size(name, "the gather axis", dimension, nr)?;
                    let t = nr / f;
                    if m % t != 0 {
                        bail!(
                            InvalidArgument,
                            "{name}: the rows of `x` ({m}) must be divisible by the scatter axis size {t}"
                        );
                    }
                    (1, m / t, kb, c, vec![f, m / t, c])
                }
                AllGatherContractMatmulReduceScatter => {
                    let (k, m) = two("x", &xd)?;
                    let (mw, c) = two("w", &wd)?;
                    let f = two_axis_size(name, "the scatter axis", dimension, nr)?;
                    mismatch(
                        checked_mul(name, "the columns of `x` times the size of the gather axis", m, nr / f)?,
                        mw,
                    )?;
                    if k % f != 0 {
                        bail!(
                            InvalidArgument,
                            "{name}: the rows of `x` ({k}) must be divisible by the scatter axis size {f}"
                        );
                    }
                    (1, k / f, m, c, vec![k / f, c])
                }
                AllGatherBothMatmul => {
                    let (m, kx) = two("x", &xd)?;
                    let (kb, c) = two("w", &wd)?;
                    let f = two_axis_size(name, "w's gather axis", dimension, nr)?;
                    mismatch(kx, checked_mul(name, "the rows of `w` times the size of w's gather axis", kb, f)?)?;
                    (
                        1,
                        m,
                        kb,
                        c,
                        vec![checked_mul(name, "the rows of `x` times the size of x's gather axis", m, nr / f)?, c],
                    )
                }
                AllToAllMatmulContract => {
                    let (m, kb) = three("x", &xd)?;
                    let (kw, n) = two("w", &wd)?;
                    mismatch(times_axis("the columns of `x`", kb)?, kw)?;
                    (1, m, kb, n, vec![m, n])
                }
                AllGatherMatmul | MatmulReduceScatter => unreachable!(),
            }
        }
    };
    Ok(Geometry { outer, seg, k, n, out })
}

/// The size F of a two-axis kind's first axis, given as `dimension`: it
/// must divide the group of `nr` ranks (`what` names the axis in the error).
fn two_axis_size(name: &str, what: &str, dimension: i64, nr: usize) -> Result<usize> {
    usize::try_from(dimension).ok().filter(|&f| f >= 1 && nr % f == 0).ok_or_else(|| {
        crate::error::Error::InvalidArgument(format!(
            "{name}: {what} size ({dimension}) must divide the group size {nr}"
        ))
    })
}

/// The result's dims of `kind` on operands `x` and `w` over `ranks` devices
/// (Python asks at trace time, through `prepare`).
pub fn result_dims(kind: OpKind, x: &[i64], w: &[i64], dimension: i64, ranks: usize) -> Result<Vec<usize>> {
    geometry(kind, x, w, dimension, ranks).map(|g| g.out)
}

impl Problem {
    /// Checks the operands of `kind` over `ranks` devices; `dimension` is the
    /// gathered or scattered dim of `x` (row kinds; ignored otherwise).
    pub fn new(kind: OpKind, x: Operand, w: Operand, out: Operand, dimension: i64, ranks: usize) -> Result<Problem> {
        let name = kind.name();
        if x.dtype != w.dtype {
            bail!(
                InvalidArgument,
                "{name}: the operands are {} and {}; they must have one dtype",
                x.dtype.name(),
                w.dtype.name()
            );
        }
        let Geometry { outer, seg, k, n, out: expected } = geometry(kind, x.dims, w.dims, dimension, ranks)?;
        let [first, second] = kind.operand_names();
        let od = dims_usize(name, "out", out.dims)?;
        let nr = ranks;
        if od != expected {
            bail!(
                InvalidArgument,
                "{name}: result shape {:?} does not match the operands: expected {expected:?}",
                out.dims
            );
        }
        let gathered = match kind {
            OpKind::AllGatherMatmulReduceScatter => expected[0],
            OpKind::AllGatherBothMatmul | OpKind::AllGatherContractMatmulReduceScatter => dimension as usize,
            _ => 1,
        };
        Ok(Problem {
            kind,
            // The gather-contract-scatter kind sends x by its F row blocks.
            x_parts: if kind == OpKind::AllGatherContractMatmulReduceScatter { gathered } else { nr },
            group: nr,
            slices: None,
            gathered,
            outer,
            seg,
            k,
            n,
            input: x.dtype,
            output: out.dtype,
            x_len: elements(name, first, &dims_usize(name, first, x.dims)?)?,
            w_len: elements(name, second, &dims_usize(name, second, w.dims)?)?,
            out_len: elements(name, "out", &od)?,
        })
    }

    /// The problem under `Schedule::Sliced { slices }`: each block's rows are
    /// cut into `slices` chunks, block indices become fine (`j * slices + c`
    /// is chunk c of block j), and a workspace slot holds one chunk. Row
    /// gathers and scatters along the leading dim (one segment) only; the
    /// rows of a block must divide into the chunks.
    pub fn sliced(self, slices: usize) -> Result<Problem> {
        self.cut_blocks(slices, "sliced", "slices")
    }

    /// The problem under `Schedule::Tiled { tiles }`: the blocks cut as `sliced` cuts them.
    pub fn tiled(self, tiles: usize) -> Result<Problem> {
        self.cut_blocks(tiles, "tiled", "tiles")
    }

    /// The problem under `schedule` (`Sliced`, `Tiled`: blocks cut into chunks).
    pub fn for_schedule(self, schedule: crate::plan::Schedule) -> Result<Problem> {
        match schedule {
            crate::plan::Schedule::Sliced { slices } => self.sliced(slices),
            crate::plan::Schedule::Tiled { tiles } => self.tiled(tiles),
            _ => Ok(self),
        }
    }

    /// `sliced` and `tiled`; `what` and `unit` name the schedule and its chunks in errors.
    fn cut_blocks(mut self, slices: usize, what: &str, unit: &str) -> Result<Problem> {
        let name = self.kind.name();
        if self.kind == OpKind::AllGatherMatmulReduceScatter {
            // Each block of w's columns is cut into `slices` chunks, each reduce-scattered on its own ring.
            if what != "sliced" {
                bail!(InvalidArgument, "{name}: no {what} schedule; \"sliced\" cuts each block of w's columns");
            }
            if slices == 0 || slices > self.n.max(1) || self.n % slices != 0 {
                bail!(
                    InvalidArgument,
                    "{name}: {unit}={slices} must divide the {} columns of each block of w (the sliced schedule \
                     cuts them into {unit} chunks)",
                    self.n
                );
            }
            self.slices = Some(slices);
            return Ok(self);
        }
        if self.kind == OpKind::AllGatherBothMatmul && what != "sliced" {
            bail!(InvalidArgument, "{name}: no {what} schedule; \"sliced\" cuts x's row blocks");
        }
        if !self.kind.cuts_rows() && self.kind != OpKind::AllGatherBothMatmul {
            bail!(InvalidArgument, "{name}: the {what} schedule needs a row gather, scatter or all-reduce");
        }
        if slices == 0 {
            bail!(InvalidArgument, "{name}: the {what} schedule needs {unit} >= 1, got 0");
        }
        if self.outer != 1 {
            bail!(
                InvalidArgument,
                "{name}: the {what} schedule needs the gathered or scattered dim to be the leading one \
                 ({} leading segments here)",
                self.outer
            );
        }
        // A plan holds steps in proportion to the chunks: bounded by the
        // rows before anything is planned.
        if slices > self.seg.max(1) {
            bail!(
                InvalidArgument,
                "{name}: {unit}={slices} is more than the {} rows of each block (the {what} schedule cuts each \
                 block's rows into {unit} chunks)",
                self.seg
            );
        }
        if self.seg % slices != 0 {
            bail!(
                InvalidArgument,
                "{name}: the {what} schedule cuts the {} rows of each block into {slices} equal chunks; \
                 {slices} must divide {}",
                self.seg,
                self.seg
            );
        }
        if matches!(self.kind, OpKind::AllGatherMatmul | OpKind::AllGatherBothMatmul) {
            self.x_parts = slices;
        }
        self.slices = Some(slices);
        Ok(self)
    }

    /// The elements of the local `x` that `Buf::XBlock(j)` names (what a
    /// backend sends for it), or `None` past the last part.
    pub fn x_block(&self, j: usize) -> Option<std::ops::Range<usize>> {
        let part = self.x_len / self.x_parts;
        (j < self.x_parts).then(|| j * part..(j + 1) * part)
    }

    /// The size F of a two-axis kind's first axis (the gather axis of
    /// `AllGatherMatmulReduceScatter`, w's of `AllGatherBothMatmul`, the
    /// scatter axis of `AllGatherContractMatmulReduceScatter`; 1 for the others).
    pub fn gathered(&self) -> usize {
        self.gathered
    }

    /// The pattern this problem is planned with (`OpKind::pattern`, with a
    /// two-axis kind's first axis size filled in, and whether a two-gather
    /// plan adds its products up in the output: where its dtype is the
    /// accumulator's).
    pub fn pattern(&self) -> Pattern {
        match self.kind.pattern() {
            Pattern::GatherScatter { .. } => Pattern::GatherScatter { gathered: self.gathered },
            Pattern::GatherContractScatter { .. } => Pattern::GatherContractScatter { scattered: self.gathered },
            Pattern::GatherGather { .. } => {
                Pattern::GatherGather { gathered: self.gathered, into_out: self.output == self.accumulator() }
            }
            pattern => pattern,
        }
    }

    pub fn accumulator(&self) -> DType {
        DType::accumulator(self.input, self.output)
    }

    /// Nothing to compute: the result is empty, or the contraction is (the
    /// result is then zeros, as `jax.lax.dot` gives). Every rank has the
    /// same shapes, so every rank skips the op alike, sending nothing.
    /// The group size.
    pub fn group(&self) -> usize {
        self.group
    }

    pub fn is_trivial(&self) -> bool {
        self.out_len == 0 || self.k == 0
    }

    /// The elements of the right-hand side of every GEMM `gemms` gives: each
    /// multiplies by a `k x n` view (of `w`, or of a received block).
    pub fn rhs_len(&self) -> usize {
        self.k.saturating_mul(self.n)
    }

    /// Element counts for the workspace layout.
    pub fn sizes(&self) -> Sizes {
        use OpKind::*;
        let (travel, partial) = match self.kind {
            AllGatherMatmul => (self.x_len, 0),
            AllGatherMatmulContract | MatmulAllGather | MatmulAllGatherContract => (self.x_len, 0),
            AllToAllMatmul | AllToAllMatmulContract => (self.x_len / self.group, 0),
            MatmulReduceScatter | MatmulReduceScatterCols => (0, self.out_len),
            MatmulAllToAll | MatmulAllToAllCols | MatmulAllReduce => (0, self.out_len / self.group),
            // A partial is one (row block, block of w) product.
            AllGatherMatmulReduceScatter => (self.x_len, self.out_len / self.gathered),
            // Blocks of w travel in slots of their own (`SlotKind::Weight`, `Sizes::w`).
            AllGatherBothMatmul => (self.x_len, 0),
            // x travels in its F row blocks; a partial is one row block of the result (the output's size).
            AllGatherContractMatmulReduceScatter => (self.x_len / self.gathered.max(1), self.out_len),
        };
        let parts = self.slices.unwrap_or(1);
        // Slices cut what travels, but a two-axis call's whole local w travels
        // however its columns are sliced.
        let travel = if self.kind == AllGatherMatmulReduceScatter { travel } else { travel / parts };
        let partial = partial / parts;
        Sizes {
            x: self.x_len,
            w: self.w_len,
            travel,
            partial,
            result: self.out_len,
            out_view: self.out_len,
            input: self.input,
            output: self.output,
        }
    }

    /// The GEMMs that compute the product for `block` from `src` into `dst`.
    pub fn gemms(&self, block: usize, src: Buf, dst: Buf) -> Vec<Gemm> {
        use OpKind::*;
        let Problem { group: nr, outer, seg, k, n, .. } = *self;
        if self.kind == AllGatherMatmulReduceScatter {
            return vec![self.two_axis_gemm(block, dst)];
        }
        if self.kind == AllGatherContractMatmulReduceScatter {
            // Block q * T + p: row block q of x's block p (the step's source:
            // the own x, `XBlock(q)`, or a received row block) times w's rows
            // p, into the partial of the result's row block q.
            let t = self.group / self.gathered;
            let (q, p) = (block / t, block % t);
            let in_x = if matches!(src, Buf::XBlock(_)) { q * seg * k } else { 0 };
            return vec![Gemm {
                lhs: (Side::Src, View::rows(in_x, seg, k)),
                rhs: (Side::W, View::rows(p * k * n, k, n)),
                dst: View::rows(0, seg, n),
            }];
        }
        if self.kind == AllGatherBothMatmul {
            // Block (p * S + u) * F + q (S the slices, 1 unsliced): row chunk
            // u of x's row block p (the step's source: a received chunk, or
            // the own x whole), its columns of block q, times w's block q
            // (the step's `with`), into those rows of the result (a slot
            // laid out as the output).
            let (f, slices) = (self.gathered, self.slices.unwrap_or(1));
            let (p, u, q) = (block / (f * slices), block / f % slices, block % f);
            let rows = seg / slices;
            let in_x = if matches!(src, Buf::XBlock(_)) { u * rows * f * k } else { 0 };
            return vec![Gemm {
                lhs: (Side::Src, View { offset: in_x + q * k, rows, cols: k, row_stride: f * k }),
                rhs: (Side::W, View::rows(0, k, n)),
                dst: View::rows((p * seg + u * rows) * n, rows, n),
            }];
        }
        if let Some(parts) = self.slices {
            return self.sliced_gemms(parts, block, src, dst);
        }
        let j = block;
        // `x`-side data of block j: a part of x, or a whole (received or own) block.
        let in_x = |offset: usize| if matches!(src, Buf::XBlock(_)) { offset } else { 0 };
        let w_all = View::rows(0, k, n);
        // A product's destination: a slot holds exactly one block.
        let into = |offset_in_out: usize, rows: usize, cols: usize, row_stride: usize| match dst {
            Buf::Slot(_) => View::rows(0, rows, cols),
            _ => View { offset: offset_in_out, rows, cols, row_stride },
        };
        match self.kind {
            AllGatherMatmul => (0..outer)
                .map(|p| Gemm {
                    lhs: (Side::Src, View::rows(p * seg * k, seg, k)),
                    rhs: (Side::W, w_all),
                    dst: into((p * nr + j) * seg * n, seg, n, n),
                })
                .collect(),
            MatmulAllReduce => vec![Gemm {
                lhs: (Side::Src, View::rows(j * seg * k, seg, k)),
                rhs: (Side::W, w_all),
                dst: match dst {
                    Buf::Slot(_) | Buf::Out => View::rows(0, seg, n),
                    _ => unreachable!("all-reduce products go to a slot or (one rank) the output"),
                },
            }],
            MatmulReduceScatter => (0..outer)
                .map(|p| Gemm {
                    lhs: (Side::Src, View::rows((p * nr + j) * seg * k, seg, k)),
                    rhs: (Side::W, w_all),
                    dst: match dst {
                        Buf::Slot(_) | Buf::Out => View::rows(p * seg * n, seg, n),
                        _ => unreachable!("scatter products go to a slot or the output"),
                    },
                })
                .collect(),
            AllGatherMatmulContract | AllToAllMatmulContract => vec![Gemm {
                lhs: (Side::Src, View::rows(in_x(j * seg * k), seg, k)),
                rhs: (Side::W, View::rows(j * k * n, k, n)),
                dst: View::rows(0, seg, n),
            }],
            MatmulAllGather => vec![Gemm {
                lhs: (Side::W, View::rows(0, seg, k)),
                rhs: (Side::Src, View::rows(0, k, n)),
                dst: into(j * n, seg, n, nr * n),
            }],
            MatmulAllGatherContract => vec![Gemm {
                lhs: (Side::W, View { offset: j * k, rows: seg, cols: k, row_stride: nr * k }),
                rhs: (Side::Src, View::rows(0, k, n)),
                dst: View::rows(0, seg, n),
            }],
            MatmulReduceScatterCols | MatmulAllToAllCols => vec![Gemm {
                lhs: (Side::Src, View::rows(0, seg, k)),
                rhs: (Side::W, View { offset: j * n, rows: k, cols: n, row_stride: nr * n }),
                dst: into(j * seg * n, seg, n, n),
            }],
            AllToAllMatmul | MatmulAllToAll => vec![Gemm {
                lhs: (Side::Src, View::rows(in_x(j * seg * k), seg, k)),
                rhs: (Side::W, w_all),
                dst: into(j * seg * n, seg, n, n),
            }],
            AllGatherMatmulReduceScatter => unreachable!("two_axis_gemm"),
            AllGatherBothMatmul | AllGatherContractMatmulReduceScatter => unreachable!("above"),
        }
    }

    /// The GEMM of a two-axis kind's `block` = `d * F * S + j * S + u` (S
    /// the slices, 1 unsliced): row block d of the local x times column
    /// chunk u of the block of w that the step's source holds (j's), into a
    /// slot of one chunk's partial.
    fn two_axis_gemm(&self, block: usize, dst: Buf) -> Gemm {
        let Problem { seg, k, n, .. } = *self;
        let slices = self.slices.unwrap_or(1);
        let (d, u) = (block / (self.gathered * slices), block % slices);
        let cols = n / slices;
        Gemm {
            lhs: (Side::W, View::rows(d * seg * k, seg, k)),
            rhs: (Side::Src, View { offset: u * cols, rows: k, cols, row_stride: n }),
            dst: match dst {
                Buf::Slot(_) => View::rows(0, seg, cols),
                _ => unreachable!("two-axis products go to a slot"),
            },
        }
    }

    /// `gemms` of a sliced problem (one segment; see `sliced`): fine block
    /// `b` is chunk `b % parts` of block `b / parts`.
    fn sliced_gemms(&self, parts: usize, b: usize, src: Buf, dst: Buf) -> Vec<Gemm> {
        let Problem { seg, k, n, .. } = *self;
        let (j, c, rows) = (b / parts, b % parts, seg / parts);
        let w_all = View::rows(0, k, n);
        match self.kind {
            // x is one block; a received chunk is a whole slot.
            OpKind::AllGatherMatmul => vec![Gemm {
                lhs: (Side::Src, View::rows(if matches!(src, Buf::XBlock(_)) { c * rows * k } else { 0 }, rows, k)),
                rhs: (Side::W, w_all),
                dst: match dst {
                    Buf::Slot(_) => View::rows(0, rows, n),
                    _ => View::rows((j * seg + c * rows) * n, rows, n),
                },
            }],
            OpKind::MatmulReduceScatter | OpKind::MatmulAllReduce => vec![Gemm {
                lhs: (Side::Src, View::rows((j * seg + c * rows) * k, rows, k)),
                rhs: (Side::W, w_all),
                dst: match dst {
                    Buf::Slot(_) => View::rows(0, rows, n),
                    _ => View::rows(c * rows * n, rows, n),
                },
            }],
            _ => unreachable!("`sliced` admits row gathers and scatters only"),
        }
    }

    /// The elements of the output a `Sum` into `dst` writes.
    pub fn out_range(&self, dst: Buf) -> std::ops::Range<usize> {
        if let (OpKind::AllGatherMatmulReduceScatter, Buf::OutBlock(b)) = (self.kind, dst) {
            // The output is stacked by chunk of w's columns: block d * F * S + q lands in out[q].
            let chunks = self.gathered * self.slices.unwrap_or(1);
            let block = self.out_len / chunks;
            let q = b % chunks;
            return q * block..(q + 1) * block;
        }
        if let (Some(parts), Buf::OutBlock(b), OpKind::MatmulAllReduce) = (self.slices, dst, self.kind) {
            // Fine block b of the whole output: chunk b % parts of block b / parts.
            let chunk = self.out_len / (self.group * parts);
            return b * chunk..(b + 1) * chunk;
        }
        if let (Some(parts), Buf::OutBlock(b)) = (self.slices, dst) {
            // Chunk b % parts of the own block (a sliced scatter's output).
            let chunk = self.out_len / parts;
            return (b % parts) * chunk..(b % parts + 1) * chunk;
        }
        match dst {
            Buf::OutBlock(q) => {
                let block = self.out_len / self.group;
                q * block..(q + 1) * block
            }
            _ => 0..self.out_len,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
