"""all_gather_matmul: ``all_gather(x, axis, axis=gather_dimension, tiled=True) @ w``,
with the gather decomposed into ring transfers that overlap the matmul.

VJP: d/dx is matmul_reduce_scatter of dY with wᵀ; d/dw = Σ_j x_jᵀ @ dY_j is the
contraction-gather loop (x_j travels, each step accumulates). Both fused."""

from __future__ import annotations

import math

from . import _checks, _fp8, _fused, _op
from ._abi import Kind
from ._decide import Policy
from ._op import OpDecision

OP = "all_gather_matmul"


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0, schedule="auto", slices=4, tiles=4,
                      precision=None, preferred_element_type=None, x_scale=None, w_scale=None):
    """Returns ``jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True) @ w``.

    Call inside a ``jax.shard_map`` body. ``x`` has rank >= 2 and contracts
    its last dim with ``w``'s first (``w`` is 2-D); ``gather_dimension`` is
    any dim of ``x`` but the last. Each rank multiplies its own rows first
    while the next block travels round the ring, so no transfer is exposed
    at the head and none is left at the tail.

    ``schedule``: "auto", "ring", "bidirectional", "sequential" (gather,
    then multiply: the unoverlapped baseline), or "sliced" (the data-slicing
    baseline: the rows are cut into ``slices`` chunks, each gathered by one
    ring all-gather while the previous chunk is multiplied; ``slices`` must
    divide the rows of x, all dims but the last), or "tiled" (the ring at
    tile granularity: each block travels and is multiplied as ``tiles`` row
    tiles, each passed on as soon as it arrives, so only one tile's product
    is left after the last transfer; ``tiles`` must divide the rows of x).

    fp8 (CUDA, sm_90+, forward only): ``x`` and ``w`` ``float8_e4m3fn``
    with ``x_scale`` and ``w_scale`` float32 scalars; the result is
    ``preferred_element_type(x_scale * w_scale * (f32(x) @ f32(w)))``,
    bfloat16 by default. On CPU, fp8 operands are a TypeError.
    """
    decision = decide(x, w, axis_name, gather_dimension=gather_dimension, schedule=schedule, slices=slices,
                      tiles=tiles, precision=precision, preferred_element_type=preferred_element_type,
                      x_scale=x_scale, w_scale=w_scale)
    return run(decision, x, w, x_scale, w_scale)


def decide(x, w, axis_name, *, gather_dimension=0, schedule="auto", slices=4, tiles=4, precision=None,
           preferred_element_type=None, x_scale=None, w_scale=None, policy: Policy = Policy()) -> OpDecision:
    """What ``all_gather_matmul(x, w, ...)`` runs as, from the operands'
    shapes and dtypes (arrays, tracers or ShapeDtypeStructs): raises on
    arguments it refuses unless `policy` is not strict (then a refusal)."""
    def checked():
        axes, ranks = _checks.axis_group(OP, axis_name)
        _checks.check_matmul_operands(OP, x, w)
        _checks.normalize_dimension(OP, "gather_dimension", gather_dimension, x.ndim)  # not the contraction
        kind, dimension, first, second = layout(x.shape, w.shape, ranks, gather_dimension)
        asked = policy.with_asked(_checks.check_schedule(OP, schedule, slices, tiles))
        fp8 = _checks.fp8_scales(OP, x, w, x_scale, w_scale, preferred_element_type)
        if fp8 is not None:
            _checks.check_precision(OP, precision)
            static = _op.Static(axes, ranks, dimension, asked, fp8[2])
            forward = _op.forward_call(kind, static, first, second, x.dtype)
            return OpDecision(OP, static, (forward,), settled={"kind": kind, "fp8": True})
        static, dtype = _op.settle(OP, x, w, axes=axes, ranks=ranks, dimension=dimension, policy=asked,
                                   precision=precision, preferred_element_type=preferred_element_type)
        forward = _op.forward_call(kind, static, x.shape, w.shape, dtype)
        return OpDecision(OP, static._replace(forward=forward), (forward,), settled={"kind": kind})

    return _op.decided(OP, policy.strict, checked)


def run(decision: OpDecision, x, w, x_scale=None, w_scale=None):
    """``all_gather_matmul`` of `x` and `w` (and fp8 operands' scales) as `decision`
    (made for their shapes) says."""
    static, settled = decision.static, decision.settled
    if settled.get("fp8"):
        return _fp8.fp8_call(settled["kind"], x, w, (x_scale, w_scale, static.out_dtype), axes=static.axes,
                             ranks=static.ranks, dimension=static.dimension, policy=static.policy)
    x, w = _op.prepared_operands(OP, x, w, decision)
    return _gather_rows(x, w, static)


def layout(x_shape, w_shape, ranks: int, gather_dimension: int = 0) -> tuple:
    """The library call this op makes on one device's operands of these
    shapes: (kind, its dimension, the first operand's shape, the second's).
    Gathering x's last dim (the contraction: this op's weight gradient) is
    the accumulating kind; `commfuse.explain` takes it too."""
    d = _checks.normalize_dimension(OP, "gather_dimension", gather_dimension, len(x_shape), allow_last=True)
    if d == len(x_shape) - 1:
        return Kind.ALL_GATHER_MATMUL_CONTRACT, 0, (math.prod(x_shape[:-1]), x_shape[-1]), tuple(w_shape)
    return Kind.ALL_GATHER_MATMUL, d, tuple(x_shape), tuple(w_shape)


def _gather_rows_bwd(static, residuals, dy):
    x, w = residuals
    d = static.dimension
    dx = _op.call_static(Kind.MATMUL_REDUCE_SCATTER, dy, w.T, static, out_dtype=x.dtype)
    # dw = Σ_j x_jᵀ @ dY[block j]: x_jᵀ travels (gathered along its last dim).
    dw = _op.call_static(Kind.ALL_GATHER_MATMUL_CONTRACT, _fused.rows_2d(x, d).T, _fused.rows_2d(dy, d), static,
                            dimension=0, out_dtype=w.dtype)
    return dx, dw


_gather_rows = _op.differentiable(Kind.ALL_GATHER_MATMUL, _gather_rows_bwd)
