"""matmul_all_gather: ``x @ all_gather(w, axis, axis=gather_dimension, tiled=True)``,
FSDP/ZeRO-3 weight gathering with the gather overlapped by the matmul.
Dimension 1 gathers output column blocks; dimension 0 gathers along the
contraction, each step accumulating ``x[:, block j] @ w_j``.

VJP: d/dx is the other gather of this op with wᵀ; d/dw is
matmul_reduce_scatter of xᵀ @ dY over the gathered dim. All fused."""

from __future__ import annotations

import math

from . import _checks, _fused, _op
from ._abi import Kind
from ._decide import Policy
from ._op import OpDecision

OP = "matmul_all_gather"


def matmul_all_gather(x, w, axis_name, *, gather_dimension=1, schedule="auto", precision=None,
                      preferred_element_type=None):
    """Returns ``x @ jax.lax.all_gather(w, axis_name, axis=gather_dimension, tiled=True)``.

    Call inside a ``jax.shard_map`` body. ``w`` is 2-D (each rank's shard of
    the weight); ``x`` has rank >= 2 and contracts its last dim with the
    gathered weight's first. ``gather_dimension=1`` gathers columns (the
    output's column blocks), ``0`` gathers rows (the contraction).
    """
    decision = decide(x, w, axis_name, gather_dimension=gather_dimension, schedule=schedule, precision=precision,
                      preferred_element_type=preferred_element_type)
    return run(decision, x, w)


def decide(x, w, axis_name, *, gather_dimension=1, schedule="auto", precision=None, preferred_element_type=None,
           policy: Policy = Policy()) -> OpDecision:
    """What ``matmul_all_gather(x, w, ...)`` runs as, from the operands'
    shapes and dtypes (arrays, tracers or ShapeDtypeStructs): raises on
    arguments it refuses unless `policy` is not strict (then a refusal)."""
    def checked():
        axes, ranks = _checks.axis_group(OP, axis_name)
        if w.ndim != 2:
            raise ValueError(f"commfuse.{OP}: `w` must be 2-D (rank 2), got shape {w.shape}")
        if x.ndim < 2:
            raise ValueError(f"commfuse.{OP}: `x` must have rank >= 2, got shape {x.shape}")
        kind, _, first, second = layout(x.shape, w.shape, ranks, gather_dimension)
        _checks.check_matmul_operands(OP, x, w, w_factor=ranks if kind == Kind.MATMUL_ALL_GATHER_CONTRACT else 1)
        asked = policy.with_asked(_checks.check_schedule(OP, schedule))
        static, dtype = _op.settle(OP, x, w, axes=axes, ranks=ranks, dimension=0, policy=asked,
                                   precision=precision, preferred_element_type=preferred_element_type)
        forward = _op.forward_call(kind, static, first, second, dtype)
        return OpDecision(OP, static._replace(forward=forward), (forward,), settled={"kind": kind})

    return _op.decided(OP, policy.strict, checked)


def run(decision: OpDecision, x, w):
    """``matmul_all_gather`` of `x` and `w` as `decision` (made for their shapes) says."""
    x, w = _op.prepared_operands(OP, x, w, decision)
    rows = _fused.rows_2d(x)
    gather = _gather_cols if decision.settled["kind"] == Kind.MATMUL_ALL_GATHER else _gather_contraction
    out = gather(w, rows, decision.static)
    return out.reshape(x.shape[:-1] + (out.shape[-1],))


def layout(x_shape, w_shape, ranks: int, gather_dimension: int = 1) -> tuple:
    """The library call this op makes on one device's operands of these
    shapes: (kind, its dimension, the first operand's shape, the second's).
    `w` travels, so it is the first."""
    d = _checks.normalize_dimension(OP, "gather_dimension", gather_dimension, 2, allow_last=True)
    rows = (math.prod(x_shape[:-1]), x_shape[-1])
    kind = Kind.MATMUL_ALL_GATHER if d == 1 else Kind.MATMUL_ALL_GATHER_CONTRACT
    return kind, 0, tuple(w_shape), rows


def _gather_cols_bwd(static, residuals, dy):
    w, x = residuals
    # dx = Σ_j dY[:, cols j] @ w_jᵀ: w_jᵀ travels, accumulating.
    dx = _op.call_static(Kind.MATMUL_ALL_GATHER_CONTRACT, w.T, dy, static, dimension=0, out_dtype=x.dtype)
    # dw_r = Σ_q (x_qᵀ @ dY_q)[:, cols r]: a column reduce-scatter.
    dw = _op.call_static(Kind.MATMUL_REDUCE_SCATTER_COLS, x.T, dy, static, dimension=0, out_dtype=w.dtype)
    return dw, dx


_gather_cols = _op.differentiable(Kind.MATMUL_ALL_GATHER, _gather_cols_bwd, dimension=0)


def _gather_contraction_bwd(static, residuals, dy):
    w, x = residuals
    # dx[:, cols j] = dY @ w_jᵀ: a column gather of wᵀ.
    dx = _op.call_static(Kind.MATMUL_ALL_GATHER, w.T, dy, static, dimension=0, out_dtype=x.dtype)
    # dw_r = Σ_q (x_qᵀ @ dY_q)[rows r]: a row reduce-scatter.
    dw = _op.call_static(Kind.MATMUL_REDUCE_SCATTER, x.T, dy, static, dimension=0, out_dtype=w.dtype)
    return dw, dx


_gather_contraction = _op.differentiable(Kind.MATMUL_ALL_GATHER_CONTRACT, _gather_contraction_bwd, dimension=0)
