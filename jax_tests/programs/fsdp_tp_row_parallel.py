"""An FSDP x TP row-parallel layer (one ``shard_map`` over ``fsdp`` x
``tp``): the weight's rows (the contraction) sharded over ``tp`` and its
columns over ``fsdp``, the batch over ``fsdp``, the output sequence-parallel
over ``tp``. Its one product has a collective on each side:
``psum_scatter(h @ all_gather(w, "fsdp", axis=1), "tp", scatter_dimension=1)``
(the scattered dim is the sequence, not the product's first), which
``overlap`` runs as one ``all_gather_matmul_reduce_scatter`` over both axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    fsdp, tp = mesh.shape["fsdp"], mesh.shape["tp"]
    b, s, f, d = 2, 8 * tp * scale, 16 * tp * scale, 24 * fsdp * scale

    def layer(h, w):
        w_cols = jax.lax.all_gather(w, "fsdp", axis=1, tiled=True)           # [f/tp, d]
        y = jax.lax.psum_scatter(h @ w_cols, "tp", scatter_dimension=1, tiled=True)  # [b, s/tp, d]
        return jax.lax.psum(jnp.mean(y * y), ("fsdp", "tp")), y

    h = place(mesh, P("fsdp", None, "tp"), normal(rng, (b * fsdp, s, f)))
    w = place(mesh, P("tp", "fsdp"), normal(rng, (f, d), f ** -0.5))
    fn = jax.shard_map(layer, mesh=mesh, in_specs=(P("fsdp", None, "tp"), P("tp", "fsdp")),
                       out_specs=(P(), P("fsdp", "tp")))
    return fn, (h, w)


PROGRAM = Program(
    name="fsdp_tp_row_parallel", mesh={"fsdp": 2, "tp": 4}, build=build,
    # Forward: the product with both its collectives, one rewrite.
    fused=1,
    # overlap(grad): the forward's gathered weight is also a residual of the
    # backward, so only its reduce-scatter fuses (1); the backward's gather of
    # y's cotangent into h's cotangent (1) and the weight gradient's
    # reduce-scatter over fsdp (1).
    grad_fused=3,
    unfused="under overlap(grad), the forward's weight gather (its result is a residual of the backward) and "
            "the gather of y's cotangent into the weight gradient (the gradient's dot went with its "
            "reduce-scatter); the loss psum (a scalar)")
