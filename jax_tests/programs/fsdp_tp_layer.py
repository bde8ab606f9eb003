"""An FSDP x TP transformer MLP block on a 2-D mesh, stacked with ``scan``
over layers and rematerialised with ``checkpoint``: the weights are sharded
over ``fsdp`` (gathered per layer) and ``tp`` (Megatron column/row split);
the activations are sequence-sharded over ``tp`` (gathered before the
first projection, reduce-scattered after the second)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    layers, b, s, d, f = 2, 2, 32 * mesh.shape["tp"] * scale, 64 * scale, 128 * scale

    def block(x, weights):
        w1, w2 = weights
        xg = jax.lax.all_gather(x, "tp", axis=1, tiled=True)           # [b, s, d]
        w1g = jax.lax.all_gather(w1, "fsdp", axis=0, tiled=True)       # [d, f/tp]
        h = jax.nn.gelu(xg @ w1g)
        w2g = jax.lax.all_gather(w2, "fsdp", axis=1, tiled=True)       # [f/tp, d]
        y = jax.lax.psum_scatter(h @ w2g, "tp", scatter_dimension=1, tiled=True)
        return x + y, None

    def model(x, w1s, w2s):
        out, _ = jax.lax.scan(jax.checkpoint(block), x, (w1s, w2s))
        return jax.lax.psum(jnp.mean(out * out), ("fsdp", "tp")), out

    x = place(mesh, P("fsdp", "tp"), normal(rng, (b * mesh.shape["fsdp"], s, d)))
    w1s = place(mesh, P(None, "fsdp", "tp"), normal(rng, (layers, d, f), d ** -0.5))
    w2s = place(mesh, P(None, "tp", "fsdp"), normal(rng, (layers, f, d), f ** -0.5))
    specs = (P("fsdp", "tp"), P(None, "fsdp", "tp"), P(None, "tp", "fsdp"))
    fn = jax.shard_map(model, mesh=mesh, in_specs=specs, out_specs=(P(), P("fsdp", "tp")))
    return fn, (x, w1s, w2s)


PROGRAM = Program(
    name="fsdp_tp_layer", mesh={"fsdp": 2, "tp": 2}, build=build,
    fused=2, grad_fused=7,
    unfused="each dot has two collectives (the tp activation gather and the fsdp weight gather, or the fsdp "
            "weight gather and the tp reduce-scatter); the one moving more bytes is fused, the other stays")
