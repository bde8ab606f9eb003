"""matmul_reduce_scatter: ``psum_scatter(x @ w, axis, scatter_dimension=..., tiled=True)``,
with the reduce-scatter decomposed into ring transfers of partial sums that
overlap the matmul of the next partial. Scattering the last dim (columns) is
the data-parallel gradient reduce-scatter of a column split.

VJP: d/dx is all_gather_matmul of dY with wᵀ (rows), or the contraction
gather (columns); d/dw is the contraction gather of x with dY (rows) or a
column gather (columns). All fused."""

from __future__ import annotations

import math

from . import _checks, _fp8, _fused, _op
from ._abi import Kind
from ._decide import Policy
from ._op import OpDecision

OP = "matmul_reduce_scatter"


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension=0, schedule="auto", slices=4, tiles=4,
                          precision=None, preferred_element_type=None, x_scale=None, w_scale=None):
    """Returns ``jax.lax.psum_scatter(x @ w, axis_name, scatter_dimension=..., tiled=True)``.

    Call inside a ``jax.shard_map`` body. ``x`` has rank >= 2 and contracts
    its last dim with ``w``'s first (``w`` is 2-D); ``scatter_dimension`` is
    any dim of the result, and its size must be divisible by the axis size.
    Each rank computes the partial product of one block while the running sum
    of the previous one travels to the next rank; only one add is exposed at
    the tail.

    ``schedule``: "auto", "ring", "bidirectional", "sequential" (multiply,
    then reduce-scatter: the unoverlapped baseline), or "sliced" (the
    data-slicing baseline, rows only: each block's rows are cut into
    ``slices`` chunks, each reduce-scattered by one ring while the next chunk
    is multiplied; ``slices`` must divide each block's rows), or "tiled"
    (the ring at tile granularity, rows only: each block's partial is
    computed as ``tiles`` row tiles, each summed and sent on as soon as it is
    computed, so only one tile's transfer waits for a whole step's product
    and only one tile's is left at the tail; ``tiles`` must divide each
    block's rows).

    fp8 (CUDA, sm_90+, forward only, row scatter): as for
    ``all_gather_matmul``: ``x_scale`` and ``w_scale`` float32 scalars,
    result ``preferred_element_type(x_scale * w_scale * (f32(x) @ f32(w)))``.
    """
    decision = decide(x, w, axis_name, scatter_dimension=scatter_dimension, schedule=schedule, slices=slices,
                      tiles=tiles, precision=precision, preferred_element_type=preferred_element_type,
                      x_scale=x_scale, w_scale=w_scale)
    return run(decision, x, w, x_scale, w_scale)


def decide(x, w, axis_name, *, scatter_dimension=0, schedule="auto", slices=4, tiles=4, precision=None,
           preferred_element_type=None, x_scale=None, w_scale=None, policy: Policy = Policy()) -> OpDecision:
    """What ``matmul_reduce_scatter(x, w, ...)`` runs as, from the operands'
    shapes and dtypes (arrays, tracers or ShapeDtypeStructs): raises on
    arguments it refuses unless `policy` is not strict (then a refusal)."""
    def checked():
        axes, ranks = _checks.axis_group(OP, axis_name)
        _checks.check_matmul_operands(OP, x, w)
        kind, dimension, first, second = layout(x.shape, w.shape, ranks, scatter_dimension, axis_name=axis_name)
        asked = policy.with_asked(_checks.check_schedule(OP, schedule, slices, tiles))
        fp8 = _checks.fp8_scales(OP, x, w, x_scale, w_scale, preferred_element_type)
        if fp8 is not None:
            if kind == Kind.MATMUL_REDUCE_SCATTER_COLS:
                raise NotImplementedError(
                    f"commfuse.{OP}: fp8 operands are supported for a row scatter_dimension only, not the last dim")
            _checks.check_precision(OP, precision)
            static = _op.Static(axes, ranks, dimension, asked, fp8[2])
            forward = _op.forward_call(kind, static, first, second, x.dtype)
            return OpDecision(OP, static, (forward,), settled={"kind": kind, "fp8": True})
        static, dtype = _op.settle(OP, x, w, axes=axes, ranks=ranks, dimension=dimension, policy=asked,
                                   precision=precision, preferred_element_type=preferred_element_type)
        forward = _op.forward_call(kind, static, first, second, dtype)
        return OpDecision(OP, static._replace(forward=forward), (forward,), settled={"kind": kind})

    return _op.decided(OP, policy.strict, checked)


def run(decision: OpDecision, x, w, x_scale=None, w_scale=None):
    """``matmul_reduce_scatter`` of `x` and `w` (and fp8 operands' scales) as `decision`
    (made for their shapes) says."""
    static, settled = decision.static, decision.settled
    if settled.get("fp8"):
        return _fp8.fp8_call(settled["kind"], x, w, (x_scale, w_scale, static.out_dtype), axes=static.axes,
                             ranks=static.ranks, dimension=static.dimension, policy=static.policy)
    x, w = _op.prepared_operands(OP, x, w, decision)
    if settled["kind"] == Kind.MATMUL_REDUCE_SCATTER_COLS:
        out = _scatter_cols(_fused.rows_2d(x), w, static)
        return out.reshape(x.shape[:-1] + (out.shape[-1],))
    return _scatter_rows(x, w, static)


def layout(x_shape, w_shape, ranks: int, scatter_dimension: int = 0, *, axis_name="the axis") -> tuple:
    """The library call this op makes on one device's operands of these
    shapes: (kind, its dimension, the first operand's shape, the second's);
    ValueError if the scattered dim does not divide over `ranks`."""
    d = _checks.normalize_dimension(OP, "scatter_dimension", scatter_dimension, len(x_shape), allow_last=True)
    size = w_shape[1] if d == len(x_shape) - 1 else x_shape[d]
    if size % ranks:
        raise ValueError(
            f"commfuse.{OP}: the result's scatter_dimension {d} has size {size}, which is not divisible by the "
            f"size {ranks} of {axis_name!r}")
    if d == len(x_shape) - 1:
        return Kind.MATMUL_REDUCE_SCATTER_COLS, 0, (math.prod(x_shape[:-1]), x_shape[-1]), tuple(w_shape)
    return Kind.MATMUL_REDUCE_SCATTER, d, tuple(x_shape), tuple(w_shape)


def _scatter_rows_bwd(static, residuals, dy):
    x, w = residuals
    d = static.dimension
    dx = _op.call_static(Kind.ALL_GATHER_MATMUL, dy, w.T, static, out_dtype=x.dtype)
    # dw = Σ_j x[block j]ᵀ @ dY_j: dY_j travels; x's block j is a column block of xᵀ.
    dw = _op.call_static(Kind.MATMUL_ALL_GATHER_CONTRACT, _fused.rows_2d(dy, d), _fused.rows_2d(x, d).T, static,
                            dimension=0, out_dtype=w.dtype)
    return dx, dw


_scatter_rows = _op.differentiable(Kind.MATMUL_REDUCE_SCATTER, _scatter_rows_bwd)


def _scatter_cols_bwd(static, residuals, dy):
    x, w = residuals
    # dx = Σ_j dY_j @ w[:, cols j]ᵀ: dY_j travels, contracting with row block j of wᵀ.
    dx = _op.call_static(Kind.ALL_GATHER_MATMUL_CONTRACT, dy, w.T, static, dimension=0, out_dtype=x.dtype)
    # dw[:, cols j] = xᵀ @ dY_j: a column gather of dY.
    dw = _op.call_static(Kind.MATMUL_ALL_GATHER, dy, x.T, static, dimension=0, out_dtype=w.dtype)
    return dx, dw


_scatter_cols = _op.differentiable(Kind.MATMUL_REDUCE_SCATTER_COLS, _scatter_cols_bwd, dimension=0)
