"""Tensor-parallel self-attention under plain ``jax.jit``, written with
einsums over rank-3 weights as the LLM frameworks write it: the q/k/v
projections column-parallel over heads (``dhk`` weights sharded on ``h``),
the attention per head (batch-dim einsums, no communication), the output
projection row-parallel (``hkd`` contracting two dims) with the result
sequence-sharded over ``tp``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, normal, place


def build(mesh, rng):
    tp = mesh.shape["tp"]
    b, s, d, heads, k = 2, 8 * tp, 32, 2 * tp, 8

    def constrain(a, *spec):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

    def attention(x, wq, wk, wv, wo):
        q = constrain(jnp.einsum("bsd,dhk->bshk", x, wq), None, None, "tp", None)
        kk = constrain(jnp.einsum("bsd,dhk->bshk", x, wk), None, None, "tp", None)
        v = constrain(jnp.einsum("bsd,dhk->bshk", x, wv), None, None, "tp", None)
        scores = jnp.einsum("bqhk,bthk->bhqt", q, kk) * k ** -0.5
        ctx = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(scores, axis=-1), v)
        out = constrain(jnp.einsum("bqhk,hkd->bqd", ctx, wo), None, "tp", None)
        return jnp.mean(out * out), out

    x = place(mesh, P(None, "tp", None), normal(rng, (b, s, d)))
    wq, wk, wv = (place(mesh, P(None, "tp", None), normal(rng, (d, heads, k), d ** -0.5)) for _ in range(3))
    wo = place(mesh, P("tp", None, None), normal(rng, (heads, k, d), (heads * k) ** -0.5))
    return attention, (x, wq, wk, wv, wo)


# Fused calls, as the report's decisions add them up: forward: q, k, v's sequence gathers and the output's
# reduce-scatter over tp; with the gradient: those 4, 1 matmul_all_gather and 3 all-reduces over tp.
JIT_PROGRAM = JitProgram(name="jit_tp_attention", mesh={"tp": 4}, build=build, fused=3 + 1,
                         grad_fused=3 + 1 + 1 + 3 * ALL_REDUCE_CALLS)
