"""A sequence-parallel transformer layer written over flattened tokens, as
code ported from PyTorch writes it: activations ``[batch, seq, d]`` are
sharded over the sequence; each sub-layer normalises its own rows, gathers
the sequence (``all_gather(x, axis=1)``), flattens batch and sequence into
rows (``x.reshape(-1, d)``) for its projections, and splits the rows back
(``y.reshape(b, s, d)``) before the sequence reduce-scatter.

The merge sits between the gather and the dots, the split between the dot
and the scatter: ``overlap`` takes each dot on the unmerged (or split)
operand, where the sequence is a dim of its own, and moves the reshape to
the other side of the fused op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place

HEADS = 4


def build(mesh, rng, scale=1):
    n = mesh.shape["tp"]
    batch, seq, d, ff = 2, 4 * n * scale, 32 * scale, 64 * scale
    hd = d // HEADS

    def norm(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g

    def layer(x, g1, wq, wk, wv, wo, g2, w1, w2):
        b, s_local, _ = x.shape
        s = s_local * n
        flat = jax.lax.all_gather(norm(x, g1), "tp", axis=1, tiled=True).reshape(-1, d)
        q, k, v = ((flat @ w).reshape(b, s, -1, hd) for w in (wq, wk, wv))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * hd ** -0.5
        causal = jnp.tril(jnp.ones((s, s), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b * s, -1)
        x = x + jax.lax.psum_scatter((ctx @ wo).reshape(b, s, d), "tp", scatter_dimension=1, tiled=True)
        flat = jax.lax.all_gather(norm(x, g2), "tp", axis=1, tiled=True).reshape(-1, d)
        y = (jax.nn.gelu(flat @ w1) @ w2).reshape(b, s, d)
        x = x + jax.lax.psum_scatter(y, "tp", scatter_dimension=1, tiled=True)
        return jax.lax.psum(jnp.mean(x * x), "tp") / n, x

    seq_spec, col, row = P(None, "tp", None), P(None, "tp"), P("tp", None)
    x = place(mesh, seq_spec, normal(rng, (batch, seq, d)))
    gains = [place(mesh, P(), 1.0 + normal(rng, (d,), 0.1)) for _ in range(2)]
    attn = [place(mesh, col, normal(rng, (d, d), d ** -0.5)) for _ in range(3)]
    wo = place(mesh, row, normal(rng, (d, d), d ** -0.5))
    w1, w2 = place(mesh, col, normal(rng, (d, ff), d ** -0.5)), place(mesh, row, normal(rng, (ff, d), ff ** -0.5))
    fn = jax.shard_map(layer, mesh=mesh, in_specs=(seq_spec, P(), col, col, col, row, P(), col, row),
                       out_specs=(P(), seq_spec))
    return fn, (x, gains[0], *attn, wo, gains[1], w1, w2)


PROGRAM = Program(
    name="sp_flat_tokens", mesh={"tp": 4}, build=build,
    fused=6, grad_fused=5,
    unfused="the loss psum (a scalar); under overlap(grad(f)), the forward gathers (residuals of the backward) and "
            "the weight gradients' gathers (the flattened rows they contract merge the gathered sequence)")
