"""Each op kind as jax.lax's own collective and dot, in the kind's layout
(see `_abi.Kind`): what the fused op computes, what ``schedule="unfused"``
and a declining ``auto`` run, and zeros for an empty problem. The user-level
references the tests compare against are in `reference`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _abi
from ._abi import Kind
from ._varying import make_varying, varying_axes, vma_checked

def result_varying(kind: "Kind", operands: frozenset, axes) -> frozenset:
    """The mesh axes a result of `kind` varies over: its `operands`' and the
    op's own, except an all-reduce's (its result is the same on every rank
    of them, as jax.lax.psum's is)."""
    varying = frozenset(operands)
    return varying - frozenset(axes) if kind == Kind.MATMUL_ALL_REDUCE else varying | frozenset(axes)


def empty_result(kind: "Kind", x, w, shape, dtype, axes):
    """Zeros of `shape`, typed as varying like a fused op's result."""
    zeros = jnp.zeros(shape, dtype)
    if not vma_checked():
        return zeros
    return make_varying(zeros, result_varying(kind, varying_axes(x) | varying_axes(w), axes))


def unfused(kind: "Kind", x, w, *, out_dtype, axes, ranks: int, dimension: int, fast_f32: bool, schedule=None):
    """`kind`'s op in its canonical layout (see `Kind`) as jax.lax's own
    collective and dot: what the fused op computes, and its fallback.
    `schedule`: the fused call's code where this stands in for one (a
    sliced two-axis call lays its result out by chunk)."""
    K = Kind
    precision = None if fast_f32 else jax.lax.Precision.HIGHEST
    axes = tuple(axes)

    def dot(a, b):
        return jnp.matmul(a, b, precision=precision, preferred_element_type=out_dtype).astype(out_dtype)

    def gather(a, axis):
        return jax.lax.all_gather(a, axes, axis=axis, tiled=True)

    def scatter(a, axis):
        return jax.lax.psum_scatter(a, axes, scatter_dimension=axis, tiled=True)

    def a2a(a):  # stacked blocks [N, ...]: block j to rank j, received ones stacked by sender
        return jax.lax.all_to_all(a, axes, 0, 0, tiled=True)

    if kind == K.ALL_GATHER_MATMUL:
        return dot(gather(x, dimension), w)
    if kind == K.ALL_GATHER_MATMUL_CONTRACT:
        return dot(gather(x, 1), w)
    if kind == K.MATMUL_ALL_GATHER:  # (w [k, c] travels, x [m, k])
        return dot(w, gather(x, 1))
    if kind == K.MATMUL_ALL_GATHER_CONTRACT:  # (w [kb, n] travels, x [m, N*kb])
        return dot(w, gather(x, 0))
    if kind == K.MATMUL_REDUCE_SCATTER:
        return scatter(dot(x, w), dimension)
    if kind == K.MATMUL_REDUCE_SCATTER_COLS:
        return scatter(dot(x, w), 1)
    if kind == K.ALL_TO_ALL_MATMUL:
        return dot(a2a(x), w)
    if kind == K.ALL_TO_ALL_MATMUL_CONTRACT:  # x [N, m, kb]: received blocks side by side along k
        moved = a2a(x)
        return dot(jnp.moveaxis(moved, 0, 1).reshape(moved.shape[1], moved.shape[0] * moved.shape[2]), w)
    if kind == K.MATMUL_ALL_TO_ALL:
        return a2a(dot(x, w))
    if kind == K.MATMUL_ALL_REDUCE:
        return jax.lax.psum(dot(x, w), axes)
    if kind == K.ALL_GATHER_MATMUL_REDUCE_SCATTER:  # (w [kb, c] travels over axes[0], x [T*b, kb])
        gathered = jax.lax.all_gather(x, axes[0], axis=1, tiled=True)
        y = jax.lax.psum_scatter(dot(w, gathered), axes[1], scatter_dimension=0, tiled=True)
        return _abi.two_axis_to_library(y, dimension, _abi.two_axis_slices(schedule))
    if kind == K.ALL_GATHER_BOTH_MATMUL:  # x [m, F*kb] over axes[1], w [kb, c] over axes[0]
        gathered_x = jax.lax.all_gather(x, axes[1], axis=0, tiled=True)
        return dot(gathered_x, jax.lax.all_gather(w, axes[0], axis=0, tiled=True))
    if kind == K.ALL_GATHER_CONTRACT_MATMUL_REDUCE_SCATTER:  # x [F*kq, m] over axes[1], w [T*m, c]
        gathered_x = jax.lax.all_gather(x, axes[1], axis=1, tiled=True)
        return jax.lax.psum_scatter(dot(gathered_x, w), axes[0], scatter_dimension=0, tiled=True)
    # MATMUL_ALL_TO_ALL_COLS: x [m, k], w [k, N*c]: column block j goes to rank j.
    y = dot(x, w)
    return a2a(jnp.moveaxis(y.reshape(y.shape[0], ranks, y.shape[1] // ranks), 1, 0))


ALL_TO_ALL_KINDS = (Kind.ALL_TO_ALL_MATMUL, Kind.ALL_TO_ALL_MATMUL_CONTRACT, Kind.MATMUL_ALL_TO_ALL,
                     Kind.MATMUL_ALL_TO_ALL_COLS)
