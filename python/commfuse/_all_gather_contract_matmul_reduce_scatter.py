"""all_gather_contract_matmul_reduce_scatter: ``psum_scatter(all_gather(x,
gather_axis, axis=1) @ w, scatter_axis, scatter_dimension=0)``, a dot whose
left operand is gathered along the contraction over one mesh axis and whose
result's rows are reduce-scattered over another: the weight gradient of an
SP x FSDP layer (``all_gather(h, "tp")ᵀ @ dy`` reduce-scattered over
``fsdp``). Not public: the two-gather op's backward, ``overlap``'s
rewrite of that form in a ``shard_map`` body and ``commfuse.matmul``
under ``jax.jit`` (`_matmul.choose`) reach it.

One fused op (``Kind.ALL_GATHER_CONTRACT_MATMUL_REDUCE_SCATTER``) over the
group of both axes (``Pattern::GatherContractScatter`` in
``src/plan/build.rs``): x's blocks travel round ``gather_axis``'s ring by
row blocks (the rows of the partial the ring sends first, first), each
product added into the partial of its row block of the result, and the
partials are reduce-scattered round ``scatter_axis``'s ring, each while
the next partial is multiplied: the reduce-scatter starts as the gather
ends. x is ``[F*kq, m]`` (F ``scatter_axis``'s
size), w ``[T*m, c]`` (T ``gather_axis``'s), the result ``[kq, c]``.

VJP: jax.lax's, of the expression above (it is itself a gradient; a
second-order gradient through it is rare).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import numpy as np

from . import _abi, _checks, _fused, _op, _unfused
from ._decide import Policy, decide as decide_call
from ._decision import Call, Decision
from ._op import OpDecision

OP = "all_gather_contract_matmul_reduce_scatter"
KIND = _abi.Kind.ALL_GATHER_CONTRACT_MATMUL_REDUCE_SCATTER
# The schedules asked of a whole program that this op runs as they are named.
SCHEDULES = ("auto", "ring", "sequential")


class _Settings(NamedTuple):
    gather_axis: str
    scatter_axis: str
    gathered: int       # T: gather_axis's size
    scattered: int      # F: scatter_axis's size
    forward: Decision   # the fused op (or not fused: jax.lax's gather, dot and reduce-scatter)
    out_dtype: object
    fast_f32: bool


def decide(x, w, gather_axis, scatter_axis, *, schedule="auto", precision=None, preferred_element_type=None,
           policy: Policy = Policy()) -> OpDecision:
    """What the op on `x` ``[F*kq, m]`` and `w` ``[T*m, c]`` runs as, from shapes (see `_op.OpDecision`)."""
    def checked():
        for arg, axis in (("gather_axis", gather_axis), ("scatter_axis", scatter_axis)):
            if not isinstance(axis, str):
                raise ValueError(f"commfuse.{OP}: {arg} must name one mesh axis, got {axis!r}")
        if gather_axis == scatter_axis:
            raise ValueError(f"commfuse.{OP}: gather_axis and scatter_axis must be two mesh axes, both are "
                             f"{gather_axis!r}")
        _, gathered = _checks.axis_group(OP, gather_axis, "gather_axis")
        _, scattered = _checks.axis_group(OP, scatter_axis, "scatter_axis")
        if gathered * scattered > _abi.LIMITS["max_ranks"]:
            raise ValueError(f"commfuse.{OP}: gather_axis and scatter_axis span {gathered * scattered} devices; the "
                             f"fused ops take at most {_abi.LIMITS['max_ranks']}")
        if x.ndim != 2 or w.ndim != 2 or x.shape[1] * gathered != w.shape[0] or x.shape[0] % scattered:
            raise ValueError(f"commfuse.{OP}: x must be [F*kq, m] and w [T*m, c] (F = {scattered}, T = {gathered}), "
                             f"got x {tuple(x.shape)}, w {tuple(w.shape)}")
        code = _checks.check_schedule(OP, schedule)
        if code not in [_abi.SCHEDULES[n] for n in SCHEDULES] + [_abi.UNFUSED]:
            raise ValueError(f"commfuse.{OP}: schedule {schedule!r} does not exist for this op: both rings run one "
                             "way ('ring'), or nothing overlaps ('sequential')")
        fast = _checks.fast_f32(OP, precision)
        dtype, out_dtype = _checks.promoted_dtypes(OP, x.dtype, w.dtype, preferred_element_type)
        asked = policy.with_asked(code)
        settings = settle(x.shape, w.shape, dtype, out_dtype, axes=(gather_axis, scatter_axis),
                          sizes=(gathered, scattered), policy=asked, fast_f32=fast)
        static = _op.Static((scatter_axis, gather_axis), scattered * gathered, scattered, asked, out_dtype, fast,
                            settings.forward)
        return OpDecision(OP, static, (settings.forward,), settled={"settings": settings})

    return _op.decided(OP, policy.strict, checked)


def settle(x_shape, w_shape, dtype, out_dtype, *, axes, sizes, policy: Policy, fast_f32: bool) -> _Settings:
    """The settings one call on shapes that passed the op's checks runs
    with: over mesh `axes` (gather axis, scatter axis) of `sizes` (T, F),
    the decision of its library call under `policy`. The library's group
    is the scatter axis major (rank f * T + t)."""
    call = Call.of(KIND, sizes[0] * sizes[1], sizes[1], tuple(x_shape), tuple(w_shape), dtype, out_dtype)
    forward = decide_call(call, policy, (axes[1], axes[0]))
    return _Settings(*axes, *sizes, forward, np.dtype(out_dtype), fast_f32)


def run(decision: OpDecision, x, w):
    """The op on `x` and `w` as `decision` (made for their shapes) says."""
    return _op.run_settled(OP, decision, x, w, forward, _both)


def forward(x, w, static: _Settings):
    """The gather, the product and the reduce-scatter (operands promoted and
    typed), as the decision says: one fused op, or jax.lax's (`_fused.bind`)."""
    return _fused.bind(static.forward, x, w, axes=(static.scatter_axis, static.gather_axis), fast_f32=static.fast_f32)


def _expression(x, w, static: _Settings):
    return _unfused.unfused(KIND, x, w, out_dtype=static.out_dtype, axes=(static.scatter_axis, static.gather_axis),
                            ranks=static.scattered * static.gathered, dimension=static.scattered,
                            fast_f32=static.fast_f32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _both(x, w, static):
    return forward(x, w, static)


def _fwd(x, w, static):
    return _both(x, w, static), (x, w)


def _bwd(static, residuals, dy):
    x, w = residuals
    return jax.vjp(lambda a, b: _expression(a, b, static), x, w)[1](dy.astype(static.out_dtype))


_both.defvjp(_fwd, _bwd)
