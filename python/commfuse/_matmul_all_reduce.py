"""matmul_all_reduce: ``psum(x @ w, axis)``, tensor parallelism without
sequence parallelism (a row-parallel linear).

One fused op (``Kind.MATMUL_ALL_REDUCE``) runs both halves of the
all-reduce: the partial products of each row block go round a ring and are
summed (the reduce-scatter), then each block's sum goes round the ring to
every rank (the all-gather), copied into the output as it passes. Cut into
chunks (the "sliced" plan), chunk c's two rings run while chunk c+1 is
multiplied, so only the last chunk's rings are left exposed; nothing of the
collective is left to XLA.

VJP: the result is the same on every rank, so its cotangent is too, and
``d/dx = dY @ wᵀ``, ``d/dw = xᵀ @ dY`` need no communication. Under
``check_vma=False`` JAX hands each rank a part of the cotangent and
transposes ``psum`` into a ``psum``; the VJP does the same.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _abi, _checks, _fused, _op, _varying
from ._decide import Policy, decide as decide_call
from ._decision import Call, Decision
from ._op import OpDecision

OP = "matmul_all_reduce"


class _Settings(NamedTuple):
    axes: tuple
    ranks: int
    forward: Decision   # the fused all-reduce (or not fused: jax.lax's psum of the product)
    out_dtype: object
    fast_f32: bool


def matmul_all_reduce(x, w, axis_name, *, schedule="auto", tiles=None, precision=None, preferred_element_type=None):
    """Returns ``jax.lax.psum(x @ w, axis_name)``.

    Call inside a ``jax.shard_map`` body. ``x`` has rank >= 2 and contracts
    its last dim with 2-D ``w``'s first. One fused op reduce-scatters the
    product's row blocks (all dims of ``x`` but the last) round a ring and
    all-gathers their sums round it. ``schedule``: "auto" (the cost model
    picks the plan, or jax.lax's psum where fusing does not pay), "ring",
    "bidirectional", "sequential" (the two rings after the whole product;
    overlaps nothing), or "unfused" (jax.lax's own ``psum`` of the
    product). ``tiles`` (> 1): the rows are cut into that many chunks,
    each reduced and gathered inside the op while the next chunk is
    multiplied (the "sliced" plan, one forward ring per chunk), under any
    schedule but "sequential" (an error there); given with "auto", it
    fixes the plan (the call is fused). Unset: "ring" and "bidirectional"
    run unchunked, and "auto" picks among the unchunked, sliced and tiled
    plans by the cost model.
    """
    return run(decide(x, w, axis_name, schedule=schedule, tiles=tiles, precision=precision,
                      preferred_element_type=preferred_element_type), x, w)


def decide(x, w, axis_name, *, schedule="auto", tiles=None, precision=None, preferred_element_type=None,
           policy: Policy = Policy(), combined: int = 1) -> OpDecision:
    """What ``matmul_all_reduce(x, w, ...)`` runs as, from shapes (see
    `_op.OpDecision`). `combined`: the all-reduces of the program (this one
    included) that XLA may combine into one where they stay unfused, which
    "auto" weighs (`_decide.judge`)."""
    def checked():
        axes, ranks = _checks.axis_group(OP, axis_name)
        _checks.check_matmul_operands(OP, x, w)
        code = _checks.check_schedule(OP, schedule)
        most = _abi.LIMITS["max_chunks"]
        if tiles is not None and (not isinstance(tiles, int) or isinstance(tiles, bool) or not 1 <= tiles <= most):
            raise ValueError(f"commfuse.{OP}: tiles must be an int in [1, {most}], got {tiles!r}")
        fast = _checks.fast_f32(OP, precision)
        dtype, out_dtype = _checks.promoted_dtypes(OP, x.dtype, w.dtype, preferred_element_type)
        settings = settle(x.shape, w.shape, dtype, out_dtype, axes=axes, ranks=ranks, policy=policy.with_asked(code),
                          tiles=tiles, fast_f32=fast, combined=combined)
        static = _op.Static(axes, ranks, 0, policy.with_asked(code), out_dtype, fast, settings.forward)
        return OpDecision(OP, static, (settings.forward,), settled={"settings": settings})

    return _op.decided(OP, policy.strict, checked)


def run(decision: OpDecision, x, w):
    """``matmul_all_reduce`` of `x` and `w` as `decision` (made for their shapes) says."""
    x, w = _op.prepared_operands(OP, x, w, decision)
    settings = decision.settled["settings"]
    if _op.forward_mode(x, w):
        unfused = Decision(settings.forward.call, _abi.UNFUSED, "forward-mode differentiation", ())
        return forward(x, w, settings._replace(forward=unfused))
    return _all_reduce(x, w, settings)


def settle(x_shape, w_shape, dtype, out_dtype, *, axes, ranks: int, policy: Policy, tiles, fast_f32: bool,
           combined: int = 1) -> _Settings:
    """The settings one call runs with: its decision (``auto``: unfused
    where nothing can be cut into a ring's blocks or the cost model
    predicts no gain; a decision imposed by a plan as it was made), the
    chunks ("sliced") where `tiles` asks for them."""
    rows = math.prod(x_shape[:-1])
    call = Call.of(_abi.Kind.MATMUL_ALL_REDUCE, ranks, 0, (rows, x_shape[-1]), w_shape, dtype, out_dtype)
    asked = policy.asked

    def unfused(why):  # the whole op as jax.lax's psum of the product
        return Decision(call, _abi.UNFUSED, why, (*x_shape[:-1], w_shape[-1]))

    if tiles not in (None, 1) and asked == _abi.SCHEDULES["sequential"] and policy.strict:
        raise ValueError(f"commfuse.{OP}: tiles={tiles} with schedule='sequential': chunks overlap nothing there; "
                         "leave tiles unset or pick 'ring', 'bidirectional' or 'auto'")
    if 0 in x_shape or 0 in w_shape:
        # Nothing to cut into a ring's blocks (and jax.lax all-gathers no
        # empty chunk): jax.lax's own psum of the product, empty or zeros.
        return _Settings(tuple(axes), ranks, unfused("an operand has no elements"), np.dtype(out_dtype), fast_f32)
    if asked == _abi.UNFUSED:
        forward = unfused("as asked")
    elif rows % ranks or (tiles is not None and rows % (tiles * ranks)):
        t = f"T = tiles = {tiles}" if tiles is not None else "T = 1"
        why = (f"x has {rows} rows (all dims but the last, x.shape={tuple(x_shape)}), and a ring over {ranks} "
               f"devices cuts them into {ranks} x T equal blocks ({t})")
        if asked == _abi.AUTO:
            forward = unfused(f"auto: {why}")
        elif policy.strict:
            raise ValueError(f"commfuse.{OP}: {why} for schedule={_abi.schedule_name(asked)!r}")
        else:
            forward = unfused(f"schedule={_abi.schedule_name(asked)!r} cannot run on these shards: {why}")
    elif ranks == 1:
        forward = unfused("one rank: nothing to reduce")
    else:
        if tiles is not None and tiles > 1 and asked != _abi.SCHEDULES["sequential"]:
            # Chunks let chunk c's two rings run while chunk c+1 is multiplied
            # (one forward ring per chunk, whatever ring schedule was asked).
            policy = policy.with_asked(_abi.schedule_code("sliced", tiles))
        forward = decide_call(call, policy, axes, combined)
    return _Settings(tuple(axes), ranks, forward, np.dtype(out_dtype), fast_f32)


def _unfused(x, w, static):
    precision = None if static.fast_f32 else jax.lax.Precision.HIGHEST
    y = jnp.matmul(x, w, precision=precision, preferred_element_type=static.out_dtype).astype(static.out_dtype)
    return jax.lax.psum(y, static.axes)


def forward(x, w, static: _Settings):
    """The all-reduce of ``x @ w`` over ``static.axes`` (operands promoted and
    typed): one fused op on x's rows, or jax.lax's psum of the product. Also
    the jit-level ``commfuse.matmul``'s lowering of this pattern."""
    if not static.forward.fused:
        return _unfused(x, w, static)
    out = _fused.bind(static.forward, _fused.rows_2d(x), w, axes=static.axes, fast_f32=static.fast_f32)
    return out.reshape(x.shape[:-1] + (w.shape[1],))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _all_reduce(x, w, static):
    return forward(x, w, static)


def _fwd(x, w, static):
    return _all_reduce(x, w, static), (x, w)


def _bwd(static, residuals, dy):
    x, w = residuals
    precision = None if static.fast_f32 else jax.lax.Precision.HIGHEST
    if not _varying.vma_checked():
        dy = jax.lax.psum(dy, static.axes)
    dy_x, w_x = _varying.vary_together(dy, w, ())
    dx = jnp.matmul(dy_x, w_x.T, precision=precision).astype(x.dtype)
    x2, dy2 = _varying.vary_together(_fused.rows_2d(x), _fused.rows_2d(dy), ())
    dw = jnp.matmul(x2.T, dy2, precision=precision).astype(w.dtype)
    return _varying.match_primal(dx, x), _varying.match_primal(dw, w)


_all_reduce.defvjp(_fwd, _bwd)
