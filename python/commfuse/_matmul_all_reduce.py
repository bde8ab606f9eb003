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

from . import _abi, _auto, _checks, _fused, _varying

OP = "matmul_all_reduce"


class _Settings(NamedTuple):
    axes: tuple
    ranks: int
    tiles: int
    schedule: int
    out_dtype: object
    fast_f32: bool


def matmul_all_reduce(x, w, axis_name, *, schedule="auto", tiles=None, precision=None, preferred_element_type=None):
    """Returns ``jax.lax.psum(x @ w, axis_name)``.

    Call inside a ``jax.shard_map`` body. ``x`` has rank >= 2 and contracts
    its last dim with 2-D ``w``'s first. The rows of ``x`` (all dims but the
    last) are cut into ``tiles`` chunks (default: 4, or the most of 4, 2, 1
    that divide the rows into a multiple of the axis size); each chunk is
    reduce-scattered by the fused ring (``schedule`` as for
    ``matmul_reduce_scatter``: "auto", "ring", "bidirectional",
    "sequential") and all-gathered while the next chunk is reduce-scattered.
    ``schedule="unfused"`` is jax.lax's own ``psum`` of the product.
    """
    axes, ranks = _checks.axis_group(OP, axis_name)
    _checks.check_matmul_operands(OP, x, w)
    code = _checks.check_schedule(OP, schedule)
    if tiles is not None and (not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1):
        raise ValueError(f"commfuse.{OP}: tiles must be an int >= 1, got {tiles!r}")
    fast = _checks.fast_f32(OP, precision)
    x, w, out_dtype = _checks.promote(OP, x, w, preferred_element_type)
    settings = settle(x.shape, w.shape, x.dtype, out_dtype, axes=axes, ranks=ranks, schedule=code, tiles=tiles,
                      fast_f32=fast, schedule_name=schedule)
    x, w = _varying.vary_together(x, w, axes)
    if _fused.forward_mode(OP, x, w):
        return forward(x, w, settings._replace(schedule=_abi.UNFUSED))
    return _all_reduce(x, w, settings)


def settle(x_shape, w_shape, dtype, out_dtype, *, axes, ranks: int, schedule: int, tiles, fast_f32: bool,
           schedule_name: str, decline: bool = True) -> _Settings:
    """The settings one call runs with: the tiles (default: 4, or the most of
    4, 2, 1 that divide the rows into a multiple of the axis size) and the
    schedule (``auto`` resolved: unfused where nothing can be cut into a
    ring's blocks or the cost model predicts no gain)."""
    code = schedule
    rows = math.prod(x_shape[:-1])
    if tiles is None:
        tiles = next((t for t in (4, 2, 1) if rows % (t * ranks) == 0), None)
    if 0 in x_shape or 0 in w_shape:
        # Nothing to cut into a ring's blocks (and jax.lax all-gathers no
        # empty chunk): jax.lax's own psum of the product, empty or zeros.
        code = _abi.UNFUSED
        _fused.record_decision(OP, "unfused", "an operand has no elements")
    elif code == _abi.UNFUSED:
        _fused.record_decision(OP, "unfused", "as asked")
    elif tiles is None or rows % (tiles * ranks):
        t = f"T = tiles = {tiles}" if tiles is not None else "T = 1, 2 or 4"
        why = (f"x has {rows} rows (all dims but the last, x.shape={tuple(x_shape)}), and a ring over {ranks} "
               f"devices cuts them into {ranks} x T equal blocks ({t})")
        if code != _abi.AUTO:
            raise ValueError(f"commfuse.{OP}: {why} for schedule={schedule_name!r}")
        code = _abi.UNFUSED  # "auto": nothing to cut into a ring's blocks
        _fused.record_decision(OP, "unfused", f"auto: {why}")
    if code == _abi.AUTO and ranks > 1:
        # The cost model judges one chunk's reduce-scatter; unfused, the
        # whole op is one psum rather than chunked gathers.
        shapes = _abi.call_shapes(_abi.Kind.MATMUL_REDUCE_SCATTER, _abi.AUTO, ranks, 0,
                                  (rows // tiles, x_shape[-1]), w_shape, dtype, out_dtype)
        _, code, why = _auto.resolve(shapes, _fused.measure_call_overhead_s, decline=decline)
        if code == _abi.UNFUSED:
            _fused.record_decision(OP, "unfused", why)
    return _Settings(tuple(axes), ranks, int(tiles or 1), code, out_dtype, fast_f32)


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
    if static.schedule == _abi.UNFUSED or static.ranks == 1:
        if static.ranks == 1:
            _fused.record_decision(OP, "unfused", "one rank: nothing to reduce")
        return _unfused(x, w, static)
    tiles = static.tiles
    flat = _fused.rows_2d(x)
    chunk = flat.shape[0] // tiles
    outs = []
    for c in range(tiles):
        part = _fused.call(_abi.Kind.MATMUL_REDUCE_SCATTER, flat[c * chunk:(c + 1) * chunk], w,
                           out_dtype=static.out_dtype, schedule=static.schedule, axes=static.axes, ranks=static.ranks,
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
