"""Pure-JAX references of the fused ops: the test oracle, and what the fused
ops must equal. Same signatures as the fused ops (``schedule`` is ignored)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0, schedule="auto", precision=None,
                      preferred_element_type=None):
    """``all_gather(x, axis_name, axis=gather_dimension, tiled=True) @ w``."""
    del schedule
    gathered = jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    return jnp.matmul(gathered, w, precision=precision, preferred_element_type=preferred_element_type)


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension=0, schedule="auto", precision=None,
                          preferred_element_type=None):
    """``psum_scatter(x @ w, axis_name, scatter_dimension=..., tiled=True)``."""
    del schedule
    y = jnp.matmul(x, w, precision=precision, preferred_element_type=preferred_element_type)
    return jax.lax.psum_scatter(y, axis_name, scatter_dimension=scatter_dimension, tiled=True)


def matmul_all_gather(x, w, axis_name, *, gather_dimension=1, schedule="auto", precision=None,
                      preferred_element_type=None):
    """``x @ all_gather(w, axis_name, axis=gather_dimension, tiled=True)``."""
    del schedule
    gathered = jax.lax.all_gather(w, axis_name, axis=gather_dimension, tiled=True)
    return jnp.matmul(x, gathered, precision=precision, preferred_element_type=preferred_element_type)


def all_to_all_matmul(x, w, axis_name, *, split_dimension, concat_dimension, schedule="auto", precision=None,
                      preferred_element_type=None):
    """``all_to_all(x, axis_name, split_dimension, concat_dimension, tiled=True) @ w``."""
    del schedule
    moved = jax.lax.all_to_all(x, axis_name, split_dimension, concat_dimension, tiled=True)
    return jnp.matmul(moved, w, precision=precision, preferred_element_type=preferred_element_type)


def matmul_all_to_all(x, w, axis_name, *, split_dimension, concat_dimension, schedule="auto", precision=None,
                      preferred_element_type=None):
    """``all_to_all(x @ w, axis_name, split_dimension, concat_dimension, tiled=True)``."""
    del schedule
    y = jnp.matmul(x, w, precision=precision, preferred_element_type=preferred_element_type)
    return jax.lax.all_to_all(y, axis_name, split_dimension, concat_dimension, tiled=True)


def matmul_all_reduce(x, w, axis_name, *, schedule="auto", tiles=None, precision=None, preferred_element_type=None):
    """``psum(x @ w, axis_name)``."""
    del schedule, tiles
    y = jnp.matmul(x, w, precision=precision, preferred_element_type=preferred_element_type)
    return jax.lax.psum(y, axis_name)
