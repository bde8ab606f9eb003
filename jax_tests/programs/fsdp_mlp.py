"""FSDP MLP: each layer gathers its column-sharded weight and its bias
(``x @ all_gather(W) + all_gather(b)``); the loss is a ``pmean`` over the
batch shards. The form of a ZeRO-3 / FSDP trainer's dense stack."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    widths = [256 * scale, 384 * scale, 256 * scale, 128 * scale]
    batch = 64 * scale * mesh.shape["fsdp"]

    def loss(params, x):
        h = x
        for w, b in params:
            wg = jax.lax.all_gather(w, "fsdp", axis=1, tiled=True)
            bg = jax.lax.all_gather(b, "fsdp", axis=0, tiled=True)
            h = jax.nn.relu(h @ wg + bg)
        return jax.lax.pmean(jnp.mean(h * h), "fsdp")

    params = [(place(mesh, P(None, "fsdp"), normal(rng, (a, b), a ** -0.5)),
               place(mesh, P("fsdp"), normal(rng, (b,), 0.1))) for a, b in zip(widths[:-1], widths[1:])]
    x = place(mesh, P("fsdp"), normal(rng, (batch, widths[0])))
    specs = ([(P(None, "fsdp"), P("fsdp")) for _ in params], P("fsdp"))
    fn = jax.shard_map(loss, mesh=mesh, in_specs=specs, out_specs=P())
    return fn, (params, x)


PROGRAM = Program(
    name="fsdp_mlp", mesh={"fsdp": 4}, build=build,
    # One matmul_all_gather per layer. Under grad, each layer's weight gather
    # also feeds the weight-gradient and input-gradient dots.
    fused=3, grad_fused=3,
    unfused="the bias gathers (no dot next to them); under overlap(grad(f)), JAX's forward shard_map returns the gathered value as a residual for the backward one: that gather stays (fusing its dot would gather twice)")
