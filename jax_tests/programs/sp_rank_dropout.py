"""A sequence-parallel MLP pair with Megatron's per-rank dropout: each
device's rows are all-gathered, RMS-normalised with a replicated scale and
multiplied by the column shard of ``w1``; after the row-parallel ``w2`` and
its reduce-scatter, the second layer gathers again and drops features with
a mask drawn from a key folded with the device's ``axis_index`` (inside the
tensor-parallel region each rank draws its own mask, as Megatron's
model-parallel RNG does) before ``w3``.

The norm moves before the first gather (its scale is the same on every
device) and that pair fuses; the mask differs between devices, so the
second gather and its dot must stay as written: moved before the gather,
each block of rows would meet its owner's mask instead of this device's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place

KEEP = 0.75


def build(mesh, rng, scale=1):
    n = mesh.shape["tp"]
    rows, d, ff = 8 * scale, 32 * scale, 64 * scale

    def mlp(x, norm_scale, w1, w2, w3, w4):
        key = jax.random.PRNGKey(7)  # the run's dropout seed, folded per rank below
        xg = jax.lax.all_gather(x, "tp", axis=0, tiled=True)
        h = xg * jax.lax.rsqrt(jnp.mean(xg * xg, axis=-1, keepdims=True) + 1e-6) * norm_scale
        y = jax.lax.psum_scatter(jax.nn.gelu(h @ w1) @ w2, "tp", scatter_dimension=0, tiled=True)
        yg = jax.lax.all_gather(y, "tp", axis=0, tiled=True)
        mask = jax.random.bernoulli(jax.random.fold_in(key, jax.lax.axis_index("tp")), KEEP, (1, d))
        h2 = (yg * mask.astype(yg.dtype) / KEEP) @ w3
        out = jax.lax.psum_scatter(jax.nn.gelu(h2) @ w4, "tp", scatter_dimension=0, tiled=True)
        return jax.lax.psum(jnp.mean(out * out), "tp"), out

    col, row = P(None, "tp"), P("tp", None)
    x = place(mesh, row, normal(rng, (n * rows, d)))
    norm_scale = place(mesh, P(), 1.0 + normal(rng, (d,), 0.1))
    ws = [place(mesh, col, normal(rng, (d, ff), d ** -0.5)), place(mesh, row, normal(rng, (ff, d), ff ** -0.5)),
          place(mesh, col, normal(rng, (d, ff), d ** -0.5)), place(mesh, row, normal(rng, (ff, d), ff ** -0.5))]
    fn = jax.shard_map(mlp, mesh=mesh, in_specs=(row, P(), col, row, col, row), out_specs=(P(), row),
                       check_vma=False)
    return fn, (x, norm_scale, *ws)


PROGRAM = Program(
    name="sp_rank_dropout", mesh={"tp": 4}, build=build,
    fused=3, grad_fused=6,
    unfused="the second all_gather and its dot: the dropout mask between them differs per rank (key folded with "
            "axis_index), so the mask cannot move before the gather; the loss psum (a scalar)")
