"""matmul_reduce_scatter: ``psum_scatter(x @ w, axis, scatter_dimension=..., tiled=True)``,
with the reduce-scatter decomposed into ring transfers of partial sums that
overlap the matmul of the next partial."""

from __future__ import annotations

from . import _fused

OP = "matmul_reduce_scatter"


def _result_shape(x_shape, w_shape, dimension, ranks):
    shape = list(x_shape[:-1]) + [w_shape[1]]
    shape[dimension] //= ranks
    return shape


_PRIMITIVE = _fused.FusedPrimitive(OP, op_code=1, result_shape=_result_shape)


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension=0, schedule="auto", precision=None,
                          preferred_element_type=None):
    """Returns ``jax.lax.psum_scatter(x @ w, axis_name, scatter_dimension=..., tiled=True)``.

    Call inside a ``jax.shard_map`` body. ``x`` has rank >= 2 and contracts
    its last dim with ``w``'s first (``w`` is 2-D); ``scatter_dimension`` is
    any dim of the result but the last, and its size must be divisible by
    the axis size. Each rank computes the partial product of one block while
    the running sum of the previous one travels to the next rank; only one
    add is exposed at the tail.

    ``schedule``: "auto", "ring", "bidirectional", or "sequential" (multiply,
    then reduce-scatter: the unoverlapped baseline).
    """
    axes, ranks = _fused.axis_group(OP, axis_name)
    _fused.check_matmul_operands(OP, x, w)
    dimension = _fused.normalize_dimension(OP, "scatter_dimension", scatter_dimension, x.ndim)
    if x.shape[dimension] % ranks:
        raise ValueError(
            f"commfuse.{OP}: the result's scatter_dimension {dimension} has size {x.shape[dimension]}, "
            f"which is not divisible by the size {ranks} of axis {axis_name!r}")
    code = _fused.check_schedule(OP, schedule)
    _fused.check_precision(OP, precision)
    x, w, out_dtype = _fused.promote(OP, x, w, preferred_element_type)
    out, _ = _PRIMITIVE.bind(x, w, out_dtype=out_dtype, dimension=dimension, schedule=code, axes=axes,
                             ranks=ranks)
    return out
