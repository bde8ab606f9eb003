"""matmul_all_reduce: ``psum(x @ w, axis)``, tensor parallelism without
sequence parallelism (a row-parallel linear).

The all-reduce is a reduce-scatter and an all-gather: the rows of ``x`` are
cut into ``tiles`` chunks; each chunk's product is reduce-scattered by the
fused ring (``matmul_reduce_scatter``) and then all-gathered, and the
all-gather of chunk c (jax.lax's own collective) has no data dependence on
the fused reduce-scatter of chunk c+1, which runs meanwhile. Only the last
chunk's all-gather is left exposed.

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
    tiles: int
    forward: Decision   # each chunk's fused reduce-scatter (or not fused: jax.lax's psum of the product)
    out_dtype: object
    fast_f32: bool


def matmul_all_reduce(x, w, axis_name, *, schedule="auto", tiles=None, precision=None, preferred_element_type=None):
    """Returns ``jax.lax.psum(x @ w, axis_name)``.

    Call inside a ``jax.shard_map`` body. ``x`` has rank >= 2 and contracts
    its last dim with 2-D ``w``'s first. The rows of ``x`` (all dims but the
    last) are cut into ``tiles`` chunks (default: 4, or the most of 4, 2, 1
    that divide the rows into a multiple of the axis size; 1 under
    ``schedule="sequential"``, which overlaps nothing); each chunk is
    reduce-scattered by the fused ring (``schedule`` as for
    ``matmul_reduce_scatter``: "auto", "ring", "bidirectional",
    "sequential") and all-gathered while the next chunk is reduce-scattered.
    ``schedule="unfused"`` is jax.lax's own ``psum`` of the product.
    """
    return run(decide(x, w, axis_name, schedule=schedule, tiles=tiles, precision=precision,
                      preferred_element_type=preferred_element_type), x, w)


def decide(x, w, axis_name, *, schedule="auto", tiles=None, precision=None, preferred_element_type=None,
           policy: Policy = Policy()) -> OpDecision:
    """What ``matmul_all_reduce(x, w, ...)`` runs as, from shapes (see `_op.OpDecision`)."""
    def checked():
        axes, ranks = _checks.axis_group(OP, axis_name)
        _checks.check_matmul_operands(OP, x, w)
        code = _checks.check_schedule(OP, schedule)
        if tiles is not None and (not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1):
            raise ValueError(f"commfuse.{OP}: tiles must be an int >= 1, got {tiles!r}")
        fast = _checks.fast_f32(OP, precision)
        dtype, out_dtype = _checks.promoted_dtypes(OP, x.dtype, w.dtype, preferred_element_type)
        settings = settle(x.shape, w.shape, dtype, out_dtype, axes=axes, ranks=ranks, policy=policy.with_asked(code),
                          tiles=tiles, fast_f32=fast)
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


def settle(x_shape, w_shape, dtype, out_dtype, *, axes, ranks: int, policy: Policy, tiles, fast_f32: bool) -> _Settings:
    """The settings one call runs with: the tiles (default: 4, or the most of
    4, 2, 1 that divide the rows into a multiple of the axis size; 1 under
    a sequential schedule, unless decisions are imposed) and each
    chunk's decision (``auto``: unfused where nothing can be cut into a
    ring's blocks or the cost model predicts no gain; unfused, the whole op
    is one psum rather than chunked gathers)."""
    rows = math.prod(x_shape[:-1])
    if tiles is None:
        # Chunks let one chunk's gather run beside the next one's reduce-
        # scatter; a sequential schedule overlaps nothing, so they would only
        # add calls (each with a fused call's fixed cost). Imposed decisions
        # (a plan's) were made for the default chunks: their calls keep them.
        sequential = policy.asked == _abi.SCHEDULES["sequential"] and not policy.imposed
        choices = (1,) if sequential else (4, 2, 1)
        tiles = next((t for t in choices if rows % (t * ranks) == 0), None)
    chunk = Call.of(_abi.Kind.MATMUL_REDUCE_SCATTER, ranks, 0, (rows // (tiles or 1), x_shape[-1]), w_shape, dtype,
                    out_dtype)

    def unfused(why):  # the whole op as jax.lax's psum of the product
        return Decision(chunk, _abi.UNFUSED, why, (*x_shape[:-1], w_shape[-1]))

    if 0 in x_shape or 0 in w_shape:
        # Nothing to cut into a ring's blocks (and jax.lax all-gathers no
        # empty chunk): jax.lax's own psum of the product, empty or zeros.
        forward = unfused("an operand has no elements")
    elif policy.asked == _abi.UNFUSED:
        forward = unfused("as asked")
    elif tiles is None or rows % (tiles * ranks):
        t = f"T = tiles = {tiles}" if tiles is not None else "T = 1, 2 or 4"
        why = (f"x has {rows} rows (all dims but the last, x.shape={tuple(x_shape)}), and a ring over {ranks} "
               f"devices cuts them into {ranks} x T equal blocks ({t})")
        if policy.asked == _abi.AUTO:
            forward = unfused(f"auto: {why}")
        elif policy.strict:
            raise ValueError(f"commfuse.{OP}: {why} for schedule={_abi.schedule_name(policy.asked)!r}")
        else:
            forward = unfused(f"schedule={_abi.schedule_name(policy.asked)!r} cannot run on these shards: {why}")
    elif ranks == 1:
        forward = unfused("one rank: nothing to reduce")
    else:
        forward = decide_call(chunk, policy, axes)
    return _Settings(tuple(axes), ranks, int(tiles or 1), forward, np.dtype(out_dtype), fast_f32)


def _unfused(x, w, static):
    precision = None if static.fast_f32 else jax.lax.Precision.HIGHEST
    y = jnp.matmul(x, w, precision=precision, preferred_element_type=static.out_dtype).astype(static.out_dtype)
    return jax.lax.psum(y, static.axes)


def _gather_invariant(y, axes):
    """all_gather typed as the same on every rank (as psum's result is), where
    varying axes are tracked; JAX spells the option ``to="invarying"``."""
    if not _varying.vma_checked():
        return jax.lax.all_gather(y, axes, tiled=True)
    try:
        return jax.lax.all_gather(y, axes, tiled=True, to="invarying")
    except ValueError:  # a JAX that spells it "invariant"
        return jax.lax.all_gather(y, axes, tiled=True, to="invariant")


def forward(x, w, static: _Settings):
    """The all-reduce of ``x @ w`` over ``static.axes`` (operands promoted and
    typed): chunked fused reduce-scatters, each chunk all-gathered while the
    next is reduce-scattered. Also the jit-level ``commfuse.matmul``'s
    lowering of this pattern."""
    if not static.forward.fused:
        return _unfused(x, w, static)
    tiles = static.tiles
    flat = _fused.rows_2d(x)
    chunk = flat.shape[0] // tiles
    outs = []
    for c in range(tiles):
        part = _fused.bind(static.forward, flat[c * chunk:(c + 1) * chunk], w, axes=static.axes,
                           fast_f32=static.fast_f32)
        outs.append(_gather_invariant(part, static.axes))
    out = outs[0] if tiles == 1 else jnp.concatenate(outs, axis=0)
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
    return _match(dx, x), _match(dw, w)


def _match(ct, primal):
    """A cotangent typed as varying over exactly the primal's axes (a product
    of an invariant cotangent and a varying operand varies over more)."""
    if not _varying.vma_checked():
        return ct
    extra = _varying.varying_axes(ct) - _varying.varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


_all_reduce.defvjp(_fwd, _bwd)
