"""all_gather_both_matmul: ``all_gather(x, x_axis, axis=0) @ all_gather(w,
w_axis, axis=0)``, a dot whose two operands are gathered over two mesh axes
(an SP x FSDP column-parallel layer: the activation's sequence sharded over
TP, the weight's rows over FSDP and its columns over TP).

One fused op (``Kind.ALL_GATHER_BOTH_MATMUL``) over the group of both axes:
the row blocks of ``x`` travel round ``x_axis``'s ring and the blocks of
``w`` round ``w_axis``'s, each ring's step an exchange of its own, in turn
(``Pattern::GatherGather`` in ``src/plan/build.rs``). The product of each
pair (x's row block p, its columns of w's block q, times w's block q) is
added into row block p of the result as soon as the later of its two
blocks has arrived, so the products each exchange makes possible run
while the next one travels: nothing waits at the head (the own blocks are
multiplied first), and nothing travels after the last product. Every
received block is kept, as the unfused form holds the gathered operands.
Sliced (``slices=S``), x's row blocks travel in S row chunks, each
multiplied as it arrives, so what waits for the last transfer is one
chunk's products instead of a whole block's.

VJP: ``dx = psum_scatter(dy @ all_gather(w, w_axis)ᵀ, x_axis)``, which is
``all_gather_matmul_reduce_scatter(dy, wᵀ, w_axis, x_axis)``, and ``dw =
psum_scatter(all_gather(x, x_axis)ᵀ @ dy, w_axis)``, which is
``all_gather_contract_matmul_reduce_scatter(xᵀ, dy, x_axis, w_axis)``
(xᵀ's blocks round ``x_axis``'s ring, the partials of dw's row blocks
reduce-scattered round ``w_axis``'s): each runs both its collectives in
one fused op (`_bwd`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import numpy as np

from . import _abi, _checks, _fused, _op, _varying
from . import _all_gather_contract_matmul_reduce_scatter as contract_scatter
from . import _all_gather_matmul_reduce_scatter as gather_scatter
from ._decide import Policy, decide as decide_call
from ._decision import Call, Decision
from ._op import OpDecision

OP = "all_gather_both_matmul"
KIND = _abi.Kind.ALL_GATHER_BOTH_MATMUL
# The schedules asked of a whole program that this op runs as they are named.
SCHEDULES = ("auto", "ring", "sequential")


class _Settings(NamedTuple):
    x_axis: str
    w_axis: str
    x_ranks: int        # T: x_axis's size
    w_ranks: int        # F: w_axis's size
    forward: Decision   # the fused op (or not fused: jax.lax's gathers and dot)
    out_dtype: object
    fast_f32: bool
    policy: Policy = Policy()  # what the backward's fused ops are decided under


def all_gather_both_matmul(x, w, x_axis, w_axis, *, schedule="auto", slices=None, precision=None,
                           preferred_element_type=None):
    """Returns ``jax.lax.all_gather(x, x_axis, axis=0, tiled=True) @
    jax.lax.all_gather(w, w_axis, axis=0, tiled=True)``.

    Call inside a ``jax.shard_map`` body mapping both axes. ``x`` has rank
    >= 2 (its leading dim is gathered over ``x_axis``) and contracts its
    last dim with 2-D ``w``'s first, which is gathered over ``w_axis``: x's
    last dim is ``w_axis``'s size times w's rows. One fused op runs both
    gathers while it multiplies. ``schedule``: "auto" (the cost model
    decides, or jax.lax's collectives and dot where fusing does not pay),
    "ring" (both rings, overlapped), "sequential" (both gathers, then the
    products; overlaps nothing) or "unfused" (jax.lax's own collectives and
    dot). ``slices`` (> 1, dividing x's rows, the product of its dims but
    the last): x's row blocks travel in that many row chunks, each
    multiplied as it arrives, so only the last chunk's products are left
    after the last transfer; with "auto" it fixes the plan (the call is
    fused). Unset, "ring" sends whole blocks and "auto" picks among the
    unsliced and sliced (2, 4, 8) plans by the cost model.
    """
    return run(decide(x, w, x_axis, w_axis, schedule=schedule, slices=slices, precision=precision,
                      preferred_element_type=preferred_element_type), x, w)


def decide(x, w, x_axis, w_axis, *, schedule="auto", slices=None, precision=None, preferred_element_type=None,
           policy: Policy = Policy()) -> OpDecision:
    """What ``all_gather_both_matmul(x, w, ...)`` runs as, from shapes (see `_op.OpDecision`)."""
    def checked():
        for arg, axis in (("x_axis", x_axis), ("w_axis", w_axis)):
            if not isinstance(axis, str):
                raise ValueError(f"commfuse.{OP}: {arg} must name one mesh axis, got {axis!r}")
        if x_axis == w_axis:
            raise ValueError(f"commfuse.{OP}: x_axis and w_axis must be two mesh axes, both are {x_axis!r}; for "
                             "one axis gather one operand with XLA and use all_gather_matmul or matmul_all_gather")
        _, t_ranks = _checks.axis_group(OP, x_axis, "x_axis")
        _, f_ranks = _checks.axis_group(OP, w_axis, "w_axis")
        ranks = f_ranks * t_ranks
        if ranks > _abi.LIMITS["max_ranks"]:
            raise ValueError(f"commfuse.{OP}: x_axis and w_axis span {ranks} devices; the fused ops take at most "
                             f"{_abi.LIMITS['max_ranks']}")
        _checks.check_matmul_operands(OP, x, w, w_factor=f_ranks)
        if schedule in ("bidirectional", "sliced", "tiled"):
            raise ValueError(f"commfuse.{OP}: schedule {schedule!r} does not exist for this op: both rings run one "
                             "way ('ring', with slices= to cut x's row blocks), or nothing overlaps ('sequential')")
        code = _checks.check_schedule(OP, schedule)
        cut = _checks.check_slices(OP, slices, code)
        rows = math.prod(x.shape[:-1])
        if cut not in (None, 1) and code != _abi.UNFUSED:  # "unfused": jax.lax's own, nothing is cut
            if rows % cut:
                raise ValueError(f"commfuse.{OP}: slices={cut} must divide x's {rows} rows (the product of its "
                                 f"dims but the last, x.shape={tuple(x.shape)}): each row block of x travels in "
                                 "slices chunks")
            code = _abi.schedule_code("sliced", cut)
        fast = _checks.fast_f32(OP, precision)
        dtype, out_dtype = _checks.promoted_dtypes(OP, x.dtype, w.dtype, preferred_element_type)
        asked = policy.with_asked(code)
        settings = settle(x.shape, w.shape, dtype, out_dtype, axes=(x_axis, w_axis), sizes=(t_ranks, f_ranks),
                          policy=asked, fast_f32=fast)
        forward = settings.forward
        static = _op.Static((w_axis, x_axis), ranks, f_ranks, asked, out_dtype, fast, forward)
        return OpDecision(OP, static, (forward,), settled={"settings": settings})

    return _op.decided(OP, policy.strict, checked)


def settle(x_shape, w_shape, dtype, out_dtype, *, axes, sizes, policy: Policy, fast_f32: bool) -> _Settings:
    """The settings one call on shapes that passed the op's checks runs
    with: over mesh `axes` (x's axis, w's axis) of `sizes` (T, F), the
    decision of its library call under `policy`. The library's group is
    w's axis major (rank f * T + t)."""
    rows = math.prod(x_shape[:-1])
    call = Call.of(KIND, sizes[0] * sizes[1], sizes[1], (rows, x_shape[-1]), w_shape, dtype, out_dtype)
    forward = decide_call(call, policy, (axes[1], axes[0]))
    return _Settings(*axes, *sizes, forward, np.dtype(out_dtype), fast_f32, policy)


def run(decision: OpDecision, x, w):
    """``all_gather_both_matmul`` of `x` and `w` as `decision` (made for their shapes) says."""
    return _op.run_settled(OP, decision, x, w, forward, _both)


def forward(x, w, static: _Settings):
    """The product and both gathers (operands promoted and typed), as the
    decision says: one fused op, or jax.lax's collectives and dot (`_fused.bind`)."""
    out_shape = (static.x_ranks * x.shape[0],) + x.shape[1:-1] + (w.shape[1],)
    out = _fused.bind(static.forward, _fused.rows_2d(x), w, axes=(static.w_axis, static.x_axis),
                      fast_f32=static.fast_f32)
    return out.reshape(out_shape)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _both(x, w, static):
    return forward(x, w, static)


def _fwd(x, w, static):
    return _both(x, w, static), (x, w)


def _bwd(static, residuals, dy):
    """dx = psum_scatter(dy @ all_gather(wᵀ, w_axis, axis=1), x_axis): the
    two-axis op; dw = psum_scatter(all_gather(xᵀ, x_axis, axis=1) @ dy,
    w_axis): the gather-contract-scatter op. Each runs both its
    collectives in one fused call, decided under the forward's policy, so
    "unfused" or a declining "auto" runs jax.lax's collectives and dots."""
    x, w = residuals
    # Both ops run "ring", "sequential" and "unfused" as asked, a sliced forward's "ring"; any other schedule
    # (a whole program's) "auto".
    runs = [_abi.SCHEDULES[n] for n in SCHEDULES] + [_abi.UNFUSED]
    policy = static.policy._replace(strict=False)
    asked = _abi.SCHEDULES["ring"] if _abi.cut_schedule(policy.asked) else policy.asked
    policy = policy.with_asked(asked if asked in runs else _abi.AUTO)
    # dy is in the product's dtype (preferred_element_type); w in the operands'.
    dy_rows, w_t = _fused.common(_fused.rows_2d(dy), w.T)
    two = gather_scatter.settle(dy_rows.shape, w_t.shape, dy_rows.dtype, x.dtype,
                                axes=(static.w_axis, static.x_axis), sizes=(static.w_ranks, static.x_ranks),
                                policy=policy, fast_f32=static.fast_f32)
    dx = gather_scatter.forward(dy_rows, w_t, two).reshape(x.shape)
    x_t, dy_rows = _fused.common(_fused.rows_2d(x).T, dy_rows)
    scatter = contract_scatter.settle(x_t.shape, dy_rows.shape, x_t.dtype, w.dtype,
                                      axes=(static.x_axis, static.w_axis), sizes=(static.x_ranks, static.w_ranks),
                                      policy=policy, fast_f32=static.fast_f32)
    dw = contract_scatter.forward(x_t, dy_rows, scatter)
    return _varying.match_primal(dx, x), _varying.match_primal(dw, w)


_both.defvjp(_fwd, _bwd)
