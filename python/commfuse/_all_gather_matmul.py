"""all_gather_matmul: ``all_gather(x, axis, axis=gather_dimension, tiled=True) @ w``,
with the gather decomposed into ring transfers that overlap the matmul."""

from __future__ import annotations

from . import _fused

OP = "all_gather_matmul"


def _result_shape(x_shape, w_shape, dimension, ranks):
    shape = list(x_shape[:-1]) + [w_shape[1]]
    shape[dimension] *= ranks
    return shape


_PRIMITIVE = _fused.FusedPrimitive(OP, op_code=0, result_shape=_result_shape)


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0, schedule="auto", precision=None,
                      preferred_element_type=None):
    """Returns ``jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True) @ w``.

    Call inside a ``jax.shard_map`` body. ``x`` has rank >= 2 and contracts
    its last dim with ``w``'s first (``w`` is 2-D); ``gather_dimension`` is
    any dim of ``x`` but the last. Each rank multiplies its own rows first
    while the next block travels round the ring, so no transfer is exposed
    at the head and none is left at the tail.

    ``schedule``: "auto", "ring", "bidirectional", or "sequential" (gather,
    then multiply: the unoverlapped baseline).
    """
    axes, ranks = _fused.axis_group(OP, axis_name)
    _fused.check_matmul_operands(OP, x, w)
    dimension = _fused.normalize_dimension(OP, "gather_dimension", gather_dimension, x.ndim)
    code = _fused.check_schedule(OP, schedule)
    _fused.check_precision(OP, precision)
    x, w, out_dtype = _fused.promote(OP, x, w, preferred_element_type)
    out, _ = _PRIMITIVE.bind(x, w, out_dtype=out_dtype, dimension=dimension, schedule=code, axes=axes,
                             ranks=ranks)
    return out
