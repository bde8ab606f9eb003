"""Grouped-query attention with fewer heads than the tensor axis, under
plain ``jax.jit``, as a Llama-style model in plain JAX writes it at small
sizes (4 query and 2 kv heads of 16 on a tensor axis of 8): ``(h @
wq).reshape(b, s, heads, hd)`` splits each head over several devices,
rotary embedding rotates each head's halves, ``jax.nn.dot_product_attention``
runs per head, and the output projection is row-parallel on the merged
heads. In the gradient XLA tiles the kv projections' operands 2 or 4 ways,
each tile on several devices of the axis, which no PartitionSpec of the mesh
names: JAX's decoding of that sharding for a partitioning rule failed the
compile (KeyError in custom_partitioner, the planner's llama corpus at
tensor=8); the rule now reads XLA's shardings itself and takes such an
operand as replicated (`_matmul._mesh_axes`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, normal, place


def rotate(x):
    """Rotary embedding's "rotate half" layout: each head's two halves."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    angles = jnp.arange(x.shape[1], dtype=x.dtype)[None, :, None, None] * 0.1
    return jnp.concatenate([x1 * jnp.cos(angles) - x2 * jnp.sin(angles), x2 * jnp.cos(angles) + x1 * jnp.sin(angles)],
                           axis=-1)


def build(mesh, rng):
    b, s, d, heads, kv = 2, 16, 64, 4, 2
    hd = d // heads

    def attention(x, wq, wk, wv, wo):
        def split(w, count):
            return (x @ w).reshape(b, s, count, hd)

        q, k, v = rotate(split(wq, heads)), rotate(split(wk, kv)), split(wv, kv)
        mixed = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        y = mixed.reshape(b, s, heads * hd) @ wo
        return jnp.mean(y * y), y

    x = place(mesh, P(), normal(rng, (b, s, d)))
    ws = [place(mesh, P(None, "tensor"), normal(rng, (d, count * hd), d ** -0.5)) for count in (heads, kv, kv)]
    wo = place(mesh, P("tensor", None), normal(rng, (d, d), d ** -0.5))
    return attention, (x, *ws, wo)


# Fused calls, as the report's decisions add them up: forward: the output projection's psum over tensor; with the
# gradient: that one, the q projection's input gradient summed over tensor, and the k and v projections' input
# gradients (their weights' rows gathered: matmul_all_gather); the k and v weight gradients, whose operands XLA
# tiles over part of the axis, are taken replicated (local dots).
JIT_PROGRAM = JitProgram(name="jit_few_heads_attention", mesh={"tensor": 8}, build=build, fused=1 * ALL_REDUCE_CALLS,
                         grad_fused=2 * ALL_REDUCE_CALLS + 2)
