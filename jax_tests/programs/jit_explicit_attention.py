"""Self-attention's projections on explicit mesh axes (shardings in the
types, ``jax.set_mesh``): the batch over ``data``, heads over ``model``;
``einsum("bsd,dhk->bshk")`` for the queries, keys and values (rank-3
weights), then the output projection ``einsum("bshk,hkd->bsd")``, two
contracting dims sharded over ``model``, with ``out_sharding`` as JAX asks
there. Its weight gradient contracts the batch and sequence dims of the
attention output, sharded ``[b@data, s, h@model, k]``: flattened to the 2-D
product with each merged dim sharded as its first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, normal, place


def build(mesh, rng):
    data, model = mesh.shape["data"], mesh.shape["model"]
    b, s, d, h, k = 2 * data, 8, 32, 2 * model, 8

    def attention(x, wq, wk, wv, wo):
        q, kk, v = (jnp.einsum("bsd,dhk->bshk", x, w) for w in (wq, wk, wv))
        scores = jnp.einsum("bqhk,bshk->bhqs", q, kk) * k ** -0.5
        o = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v)
        y = jnp.einsum("bshk,hkd->bsd", o, wo, out_sharding=P("data", None, None))
        return jnp.mean(y * y), y

    x = place(mesh, P("data", None, None), normal(rng, (b, s, d)))
    ws = [place(mesh, P(None, "model", None), normal(rng, (d, h, k), d ** -0.5)) for _ in range(3)]
    wo = place(mesh, P("model", None, None), normal(rng, (h, k, d), (h * k) ** -0.5))
    return attention, (x, *ws, wo)


# Fused calls, as the report's decisions add them up: forward: the output projection's psum over model (one
# all-reduce); with the gradient: 4 all-reduces over model (the projections' input gradients) and 4 over data (the
# weight gradients).
JIT_PROGRAM = JitProgram(name="jit_explicit_attention", mesh={"data": 2, "model": 4}, build=build,
                         fused=1 * ALL_REDUCE_CALLS,
                         grad_fused=4 * ALL_REDUCE_CALLS + 4 * ALL_REDUCE_CALLS, axis_type="Explicit")
