"""An SP x FSDP column-parallel layer (one ``shard_map`` over ``fsdp`` x
``tp``): the activations' batch sharded over ``fsdp`` and their sequence
over ``tp`` (sequence parallelism), the weight's rows (the embedding dim)
over ``fsdp`` and its columns over ``tp``. Its product gathers both
operands: ``all_gather(h, "tp", axis=1) @ all_gather(w, "fsdp", axis=0)``
(the gathered dim is the sequence, not the activation's first), which
``overlap`` runs as one ``all_gather_both_matmul`` over both axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    fsdp, tp = mesh.shape["fsdp"], mesh.shape["tp"]
    b, s, d, f = 2, 8 * tp * scale, 16 * fsdp * scale, 24 * tp * scale

    def layer(h, w):
        h_all = jax.lax.all_gather(h, "tp", axis=1, tiled=True)             # [b, s, d]
        w_rows = jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)          # [d, f/tp]
        y = jax.nn.gelu(h_all @ w_rows)                                     # [b, s, f/tp]
        return jax.lax.psum(jnp.mean(y * y), ("fsdp", "tp")), y

    h = place(mesh, P("fsdp", "tp", None), normal(rng, (b * fsdp, s, d)))
    w = place(mesh, P("fsdp", "tp"), normal(rng, (d, f), d ** -0.5))
    fn = jax.shard_map(layer, mesh=mesh, in_specs=(P("fsdp", "tp", None), P("fsdp", "tp")),
                       out_specs=(P(), P("fsdp", None, "tp")))
    return fn, (h, w)


PROGRAM = Program(
    name="sp_fsdp_column_parallel", mesh={"fsdp": 2, "tp": 4}, build=build,
    # Forward: the product with both its gathers, one rewrite.
    fused=1,
    # overlap(grad): the forward's gathered operands are also residuals of
    # the backward, so they stay XLA's; the backward's two reduce-scatters
    # (h's cotangent over tp, the weight gradient over fsdp) fuse (2).
    grad_fused=2,
    unfused="under overlap(grad), the forward's two gathers (their results are residuals of the backward); the "
            "loss psum (a scalar)")
