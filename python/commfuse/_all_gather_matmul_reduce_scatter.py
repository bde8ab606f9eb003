"""all_gather_matmul_reduce_scatter: ``psum_scatter(x @ all_gather(w,
gather_axis, axis=1), scatter_axis, scatter_dimension=0)``, a dot with a
gather on one mesh axis and a reduce-scatter on another (an FSDP x TP
row-parallel layer: the weight's columns sharded over FSDP, its rows and
the activation's contraction over TP, the output sequence-parallel).

One fused op (``Kind.ALL_GATHER_MATMUL_REDUCE_SCATTER``) over the group of
both axes: the blocks of ``w`` travel round the gather axis's ring while,
for each block in the order they arrive, the product's row blocks are
reduce-scattered round the scatter axis's ring (``Pattern::GatherScatter``
in ``src/plan/build.rs``). Each block's products run while the next block
of ``w`` arrives over one axis and the previous block's partial sums leave
over the other; only the last block's reduce-scatter is left at the tail.
Sliced (``slices=S``), each block's columns are cut into S chunks, each
reduce-scattered on its own ring, so the tail is 1 / (F x S) of the
reduce-scatter. The library returns the result stacked by chunk of ``w``'s
columns (``[F, S, b, c / S]``); it is laid out as ``[b, F*c]`` here.

VJP: ``dx = all_gather(dy, scatter_axis) @ all_gather(w, gather_axis)ᵀ``
and ``dw = psum_scatter(xᵀ @ all_gather(dy, scatter_axis), gather_axis,
scatter_dimension=1)``, each a fused one-axis op with its other collective
XLA's (`_bwd`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import numpy as np

from . import _abi, _checks, _fused, _op, _varying
from ._decide import Policy, decide as decide_call
from ._decision import Call, Decision
from ._op import OpDecision

OP = "all_gather_matmul_reduce_scatter"
KIND = _abi.Kind.ALL_GATHER_MATMUL_REDUCE_SCATTER
# The schedules asked of a whole program (``overlap``, ``commfuse.matmul``)
# that this op runs as they are named; under "bidirectional" a program's
# dot of this form fuses one side, under "unfused" neither.
SCHEDULES = ("auto", "ring", "sequential")


class _Settings(NamedTuple):
    gather_axis: str
    scatter_axis: str
    gathered: int       # F: the gather axis's size
    scattered: int      # T: the scatter axis's size
    forward: Decision   # the fused op (or not fused: jax.lax's gather, dot and reduce-scatter)
    out_dtype: object
    fast_f32: bool
    policy: Policy = Policy()  # what the backward's fused ops are decided under


def all_gather_matmul_reduce_scatter(x, w, gather_axis, scatter_axis, *, schedule="auto", slices=None,
                                     precision=None, preferred_element_type=None):
    """Returns ``jax.lax.psum_scatter(x @ jax.lax.all_gather(w, gather_axis,
    axis=1, tiled=True), scatter_axis, scatter_dimension=0, tiled=True)``.

    Call inside a ``jax.shard_map`` body mapping both axes. ``x`` has rank
    >= 2 (its leading dim is scattered over ``scatter_axis``, so it must
    divide by that axis's size) and contracts its last dim with 2-D ``w``'s
    first; ``w``'s columns are gathered over ``gather_axis``. One fused op
    runs both collectives: ``w``'s blocks travel round ``gather_axis`` while
    the product's row blocks are reduce-scattered round ``scatter_axis``.
    ``schedule``: "auto" (the cost model decides, or jax.lax's collectives
    and dot where fusing does not pay), "ring" (both rings, overlapped),
    "sequential" (every block of ``w`` gathered, then each block's products
    and reduce-scatter in turn; overlaps nothing) or "unfused" (jax.lax's
    own collectives and dot). ``slices`` (> 1, dividing ``w``'s columns):
    each block of ``w``'s columns is cut into that many chunks, each
    reduce-scattered on its own ring while the next is multiplied, so only
    the last chunk's reduce-scatter is left at the tail; with "auto" it
    fixes the plan (the call is fused). Unset, "ring" runs one chunk per
    block and "auto" picks among the unsliced and sliced (2, 4, 8) plans by
    the cost model.
    """
    return run(decide(x, w, gather_axis, scatter_axis, schedule=schedule, slices=slices, precision=precision,
                      preferred_element_type=preferred_element_type), x, w)


def decide(x, w, gather_axis, scatter_axis, *, schedule="auto", slices=None, precision=None,
           preferred_element_type=None, policy: Policy = Policy()) -> OpDecision:
    """What ``all_gather_matmul_reduce_scatter(x, w, ...)`` runs as, from
    shapes (see `_op.OpDecision`)."""
    def checked():
        for arg, axis in (("gather_axis", gather_axis), ("scatter_axis", scatter_axis)):
            if not isinstance(axis, str):
                raise ValueError(f"commfuse.{OP}: {arg} must name one mesh axis, got {axis!r}")
        if gather_axis == scatter_axis:
            raise ValueError(f"commfuse.{OP}: gather_axis and scatter_axis must be two mesh axes, both are "
                             f"{gather_axis!r}; for one axis use all_gather_matmul or matmul_reduce_scatter")
        _, gathered = _checks.axis_group(OP, gather_axis, "gather_axis")
        _, scattered = _checks.axis_group(OP, scatter_axis, "scatter_axis")
        axes, ranks = (gather_axis, scatter_axis), gathered * scattered
        if ranks > _abi.LIMITS["max_ranks"]:
            raise ValueError(f"commfuse.{OP}: gather_axis and scatter_axis span {ranks} devices; the fused ops take "
                             f"at most {_abi.LIMITS['max_ranks']}")
        _checks.check_matmul_operands(OP, x, w)
        if schedule in ("bidirectional", "sliced", "tiled"):
            raise ValueError(f"commfuse.{OP}: schedule {schedule!r} does not exist for this op: both rings run "
                             "one way ('ring', with slices= to cut each block of w's columns), or nothing overlaps "
                             "('sequential')")
        code = _checks.check_schedule(OP, schedule)
        cut = _checks.check_slices(OP, slices, code)
        if cut not in (None, 1) and code != _abi.UNFUSED:  # "unfused": jax.lax's own, nothing is cut
            if w.shape[1] % cut:
                raise ValueError(f"commfuse.{OP}: slices={cut} must divide w's {w.shape[1]} columns (each block "
                                 f"of w's columns is cut into slices chunks)")
            code = _abi.schedule_code("sliced", cut)
        if x.shape[0] % scattered:
            raise ValueError(f"commfuse.{OP}: x's leading dim ({x.shape[0]}, x.shape={tuple(x.shape)}) must be "
                             f"divisible by the size of scatter_axis {scatter_axis!r} ({scattered})")
        fast = _checks.fast_f32(OP, precision)
        dtype, out_dtype = _checks.promoted_dtypes(OP, x.dtype, w.dtype, preferred_element_type)
        asked = policy.with_asked(code)
        settings = settle(x.shape, w.shape, dtype, out_dtype, axes=axes, sizes=(gathered, scattered), policy=asked,
                          fast_f32=fast)
        forward = settings.forward
        static = _op.Static(axes, ranks, gathered, asked, out_dtype, fast, forward)
        return OpDecision(OP, static, (forward,), settled={"settings": settings})

    return _op.decided(OP, policy.strict, checked)


def settle(x_shape, w_shape, dtype, out_dtype, *, axes, sizes, policy: Policy, fast_f32: bool) -> _Settings:
    """The settings one call on shapes that passed the op's checks runs
    with: over mesh `axes` (gather axis, scatter axis) of `sizes` (F, T),
    the decision of its library call under `policy`."""
    rows = math.prod(x_shape[:-1])
    call = Call.of(KIND, sizes[0] * sizes[1], sizes[0], w_shape, (rows, x_shape[-1]), dtype, out_dtype)
    forward = decide_call(call, policy, tuple(axes))
    return _Settings(*axes, *sizes, forward, np.dtype(out_dtype), fast_f32, policy)


def run(decision: OpDecision, x, w):
    """``all_gather_matmul_reduce_scatter`` of `x` and `w` as `decision` (made for their shapes) says."""
    return _op.run_settled(OP, decision, x, w, forward, _both)


def forward(x, w, static: _Settings):
    """The product, its gather and its reduce-scatter (operands promoted and
    typed), as the decision says: one fused op, or jax.lax's collectives and
    dot (`_fused.bind`)."""
    axes = (static.gather_axis, static.scatter_axis)
    out_shape = (x.shape[0] // static.scattered,) + x.shape[1:-1] + (static.gathered * w.shape[1],)
    stacked = _fused.bind(static.forward, w, _fused.rows_2d(x), axes=axes, fast_f32=static.fast_f32)
    return _abi.two_axis_from_library(stacked, _abi.two_axis_slices(static.forward.schedule)).reshape(out_shape)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _both(x, w, static):
    return forward(x, w, static)


def _fwd(x, w, static):
    return _both(x, w, static), (x, w)


def _bwd(static, residuals, dy):
    """dx = all_gather(dy, B) @ all_gather(w, A)ᵀ: dy's row blocks travel
    round B inside a fused ``all_gather_matmul`` (w's columns gathered by
    XLA); dw = psum_scatter(xᵀ @ all_gather(dy, B), A, scatter_dimension=1):
    the product's column blocks reduce-scattered round A inside a fused
    ``matmul_reduce_scatter`` (dy gathered by XLA). Each is decided under the
    forward's policy (a sliced forward's backward runs "ring"), so "unfused"
    or a declining "auto" runs jax.lax's collectives and dots."""
    x, w = residuals
    policy = static.policy._replace(strict=False)
    if _abi.cut_schedule(policy.asked):
        policy = policy.with_asked(_abi.SCHEDULES["ring"])
    over = lambda axis, ranks, out: _op.Static((axis,), ranks, 0, policy, np.dtype(out), static.fast_f32)  # noqa: E731
    dy_rows = _fused.rows_2d(dy)
    w_all = jax.lax.all_gather(w, static.gather_axis, axis=1, tiled=True)
    dx = _op.call_static(_abi.Kind.ALL_GATHER_MATMUL, dy_rows, w_all.T,
                         over(static.scatter_axis, static.scattered, x.dtype)).reshape(x.shape)
    dy_all = jax.lax.all_gather(dy_rows, static.scatter_axis, axis=0, tiled=True)
    dw = _op.call_static(_abi.Kind.MATMUL_REDUCE_SCATTER_COLS, _fused.rows_2d(x).T, dy_all,
                         over(static.gather_axis, static.gathered, w.dtype))
    return _varying.match_primal(dx, x), _varying.match_primal(dw, w)


_both.defvjp(_fwd, _bwd)
