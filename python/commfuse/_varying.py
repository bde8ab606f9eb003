"""Varying manual axes: fused ops' operands and results typed as
``shard_map``'s ``check_vma`` checks them (a fused op's result varies over
its axes and its operands'); under ``check_vma=False`` nothing is."""

from __future__ import annotations

import jax

from . import _compat


def vary_together(x, w, axes):
    """`x` and `w` typed as varying over the same mesh axes: both operands',
    and the op's. The fused ops' VJPs return cotangents of that type; JAX
    then transposes the cast itself (a psum over the axes an operand was
    replicated on), as it does for a plain dot_general. Under
    ``check_vma=False`` nothing is typed as varying, and the shard_map sums
    replicated operands' cotangents itself: the operands stay as they are."""
    if not vma_checked():
        return x, w
    target = _compat.varying_axes(jax.typeof(x)) | _compat.varying_axes(jax.typeof(w)) | frozenset(axes)
    return make_varying(x, target), make_varying(w, target)


def make_varying(a, axes):
    """`a` typed as varying over `axes` too (under ``check_vma=True``)."""
    mesh_axes = jax.sharding.get_abstract_mesh().axis_names
    missing = tuple(n for n in mesh_axes if n in frozenset(axes) - _compat.varying_axes(jax.typeof(a)))
    if not missing:
        return a
    return _compat.cast_varying(a, missing)


def vma_checked() -> bool:
    """Whether the enclosing shard_map tracks varying manual axes
    (``check_vma=True``, the default); under ``check_vma=False`` no value is
    typed as varying, and a result typed so would not match its cotangent."""
    return _compat.check_vma()


def varying_axes(value) -> frozenset:
    """The mesh axes `value` is typed as varying over (empty under check_vma=False)."""
    return _compat.varying_axes(jax.typeof(value))


def match_primal(ct, primal):
    """A cotangent typed as varying over exactly `primal`'s axes: a product
    of an invariant cotangent and a varying operand varies over more, which
    a VJP sums away."""
    if not vma_checked():
        return ct
    extra = varying_axes(ct) - varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct
