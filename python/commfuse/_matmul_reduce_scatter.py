"""matmul_reduce_scatter: ``psum_scatter(x @ w, axis, scatter_dimension=..., tiled=True)``,
with the reduce-scatter decomposed into ring transfers of partial sums that
overlap the matmul of the next partial. Scattering the last dim (columns) is
the data-parallel gradient reduce-scatter of a column split.

VJP: d/dx is all_gather_matmul of dY with wᵀ (rows), or the contraction
gather (columns); d/dw is the contraction gather of x with dY (rows) or a
column gather (columns). All fused."""

from __future__ import annotations

import math

from . import _checks, _fp8, _fused
from ._abi import Kind

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
    axes, ranks = _checks.axis_group(OP, axis_name)
    _checks.check_matmul_operands(OP, x, w)
    kind, dimension, _, _ = layout(x.shape, w.shape, ranks, scatter_dimension, axis_name=axis_name)
    code = _checks.check_schedule(OP, schedule, slices, tiles)
    fp8 = _checks.fp8_scales(OP, x, w, x_scale, w_scale, preferred_element_type)
    if fp8 is not None:
        if kind == Kind.MATMUL_REDUCE_SCATTER_COLS:
            raise NotImplementedError(
                f"commfuse.{OP}: fp8 operands are supported for a row scatter_dimension only, not the last dim")
        _checks.check_precision(OP, precision)
        return _fp8.fp8_call(kind, x, w, fp8, axes=axes, ranks=ranks, dimension=dimension,
                               schedule=code)
    x, w, static = _fused.static_of(OP, x, w, axes=axes, ranks=ranks, dimension=dimension, schedule_code=code,
                                    precision=precision, preferred_element_type=preferred_element_type)
    if kind == Kind.MATMUL_REDUCE_SCATTER_COLS:
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
    dx = _fused.call_static(Kind.ALL_GATHER_MATMUL, dy, w.T, static, out_dtype=x.dtype)
    # dw = Σ_j x[block j]ᵀ @ dY_j: dY_j travels; x's block j is a column block of xᵀ.
    dw = _fused.call_static(Kind.MATMUL_ALL_GATHER_CONTRACT, _fused.rows_2d(dy, d), _fused.rows_2d(x, d).T, static,
                            dimension=0, out_dtype=w.dtype)
    return dx, dw


_scatter_rows = _fused.differentiable(Kind.MATMUL_REDUCE_SCATTER, _scatter_rows_bwd)


def _scatter_cols_bwd(static, residuals, dy):
    x, w = residuals
    # dx = Σ_j dY_j @ w[:, cols j]ᵀ: dY_j travels, contracting with row block j of wᵀ.
    dx = _fused.call_static(Kind.ALL_GATHER_MATMUL_CONTRACT, dy, w.T, static, dimension=0, out_dtype=x.dtype)
    # dw[:, cols j] = xᵀ @ dY_j: a column gather of dY.
    dw = _fused.call_static(Kind.MATMUL_ALL_GATHER, dy, x.T, static, dimension=0, out_dtype=w.dtype)
    return dx, dw


_scatter_cols = _fused.differentiable(Kind.MATMUL_REDUCE_SCATTER_COLS, _scatter_cols_bwd, dimension=0)
