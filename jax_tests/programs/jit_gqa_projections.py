"""Grouped-query attention's projections under plain ``jax.jit`` as a
Llama-style model in plain JAX writes them: 2-D weights sharded over a
tensor axis of 8, ``(h @ wq).reshape(b, s, heads, hd)`` with 8 query
heads, ``(h @ wv).reshape(b, s, kv, hd)`` with 2 kv heads (fewer than the
axis), each kv head repeated for its queries, the output projection
row-parallel on the merged heads. XLA shards the (kv, head_dim) split 2 x 4
over the one tensor axis, which JAX's partitioning rules cannot name by
mesh axes: regrouping a product onto that split made the program fail to
compile (IndivisibleError in custom_partitioner); it is taken on the
merged columns instead (`_overlap/regroup.py`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, normal, place


def build(mesh, rng):
    tp = mesh.shape["tensor"]
    b, s, d, heads, kv, hd = 2, 16, 64, tp, 2, 16

    def projections(x, wq, wv, wo):
        q = (x @ wq).reshape(b, s, heads, hd)
        v = jnp.repeat((x @ wv).reshape(b, s, kv, hd), heads // kv, axis=2)
        y = (q * v).reshape(b, s, heads * hd) @ wo
        return jnp.mean(y * y), y

    x = place(mesh, P(), normal(rng, (b, s, d)))
    wq = place(mesh, P(None, "tensor"), normal(rng, (d, heads * hd), d ** -0.5))
    wv = place(mesh, P(None, "tensor"), normal(rng, (d, kv * hd), d ** -0.5))
    wo = place(mesh, P("tensor", None), normal(rng, (heads * hd, d), (heads * hd) ** -0.5))
    return projections, (x, wq, wv, wo)


# Fused calls, as the report's decisions add them up: forward: the output projection's psum over tensor; with the
# gradient: that one and the two input gradients' sums over tensor (of q's and v's projections).
JIT_PROGRAM = JitProgram(name="jit_gqa_projections", mesh={"tensor": 8}, build=build, fused=1 * ALL_REDUCE_CALLS,
                         grad_fused=3 * ALL_REDUCE_CALLS)
