"""A tensor- and sequence-parallel MLP as code ported from ``pmap`` writes
it: the sequence-sharded activations are gathered with ``all_gather(x,
"tp", axis=1)`` (``tiled=False``: a new axis of the ranks' blocks) and
reshaped to merge that axis with the sequence, multiplied by the column
shard of ``w1``, then by the row shard of ``w2``, reshaped to split the
sequence into the ranks' blocks and ``psum_scatter``-ed untiled over them.
Each untiled collective and its reshape are one tiled collective: fused
with their dots, forward and backward (JAX's transpose of an untiled
gather is an untiled scatter of that shape)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    n = mesh.shape["tp"]
    b, s, d, f = 2, 8 * scale, 32 * scale, 64 * scale

    def mlp(x, w1, w2):
        xg = jax.lax.all_gather(x, "tp", axis=1).reshape(b, n * s, d)
        y = (jax.nn.gelu(xg @ w1) @ w2).reshape(b, n, s, d)
        y = jax.lax.psum_scatter(y, "tp", scatter_dimension=1, tiled=False)
        return jax.lax.psum(jnp.mean(y * y), "tp") / n, y

    x = place(mesh, P(None, "tp"), normal(rng, (b, n * s, d)))
    w1 = place(mesh, P(None, "tp"), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P("tp", None), normal(rng, (f, d), f ** -0.5))
    fn = jax.shard_map(mlp, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp", None)),
                       out_specs=(P(), P(None, "tp")), check_vma=False)
    return fn, (x, w1, w2)


PROGRAM = Program(
    name="pmap_style_mlp", mesh={"tp": 4}, build=build,
    fused=2, grad_fused=3,
    unfused="the loss psum (a scalar); under overlap(grad(f)), the forward gather, a residual of the backward")
