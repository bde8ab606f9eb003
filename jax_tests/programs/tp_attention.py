"""Tensor-parallel self-attention with sequence parallelism and 3-D
projections: the sequence-sharded activations are gathered, projected by a
fused QKV weight ``einsum("bsE,Ethd->bsthd")`` sharded over heads, attended
per local head, projected back by ``einsum("bshd,hdE->bsE")`` (two
contracting dims) and reduce-scattered over the sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    n = mesh.shape["tp"]
    b, s, e, h, d = 2, 32 * n * scale, 64 * scale, 2 * n, 16

    def attention(x, wqkv, wo):
        xg = jax.lax.all_gather(x, "tp", axis=1, tiled=True)
        qkv = jnp.einsum("bsE,Ethd->bsthd", xg, wqkv)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        y = jnp.einsum("bshd,hdE->bsE", o, wo)
        out = jax.lax.psum_scatter(y, "tp", scatter_dimension=1, tiled=True)
        return jax.lax.psum(jnp.mean(out * out), "tp"), out

    x = place(mesh, P(None, "tp"), normal(rng, (b, s, e)))
    wqkv = place(mesh, P(None, None, "tp"), normal(rng, (e, 3, h, d), e ** -0.5))
    wo = place(mesh, P("tp"), normal(rng, (h, d, e), (h * d) ** -0.5))
    fn = jax.shard_map(attention, mesh=mesh, in_specs=(P(None, "tp"), P(None, None, "tp"), P("tp")),
                       out_specs=(P(), P(None, "tp")))
    return fn, (x, wqkv, wo)


PROGRAM = Program(
    name="tp_attention", mesh={"tp": 4}, build=build,
    fused=2, grad_fused=3,
    unfused="the loss psum (a scalar); the attention einsums (batch dims, no collective); under overlap(grad(f)), JAX's forward shard_map returns the gathered value as a residual for the backward one: that gather stays (fusing its dot would gather twice)")
