"""An SP x FSDP train step with its backward inside one ``shard_map`` over
``fsdp`` x ``tp`` (``value_and_grad`` in the body, as the column-parallel
layer of `sp_fsdp_column_parallel` differentiates): the forward's product
gathers both operands; the input gradient is ``psum_scatter(dy @
all_gather(w, "fsdp")ᵀ, "tp")`` and the weight gradient
``psum_scatter(all_gather(h, "tp")ᵀ @ dy, "fsdp")``, each a gather on one
axis and a reduce-scatter on the other. Under ``ring`` ``overlap`` runs each
of the three as one op over both axes (the gathers' results, read by two
dots each, are gathered again inside each op), leaving XLA the loss's
psum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    fsdp, tp = mesh.shape["fsdp"], mesh.shape["tp"]
    b, s, d, f = 2, 8 * tp * scale, 16 * fsdp * scale, 24 * tp * scale

    def step(h, w):
        def loss(h, w):
            h_all = jax.lax.all_gather(h, "tp", axis=1, tiled=True)         # [b, s, d]
            w_rows = jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)      # [d, f/tp]
            y = jax.nn.gelu(h_all @ w_rows)
            return jnp.mean(y * y)

        value, (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w)
        return jax.lax.psum(value, ("fsdp", "tp")), dh, dw

    h = place(mesh, P("fsdp", "tp", None), normal(rng, (b * fsdp, s, d)))
    w = place(mesh, P("fsdp", "tp"), normal(rng, (d, f), d ** -0.5))
    fn = jax.shard_map(step, mesh=mesh, in_specs=(P("fsdp", "tp", None), P("fsdp", "tp")),
                       out_specs=(P(), P("fsdp", "tp", None), P("fsdp", "tp")))
    return fn, (h, w)


PROGRAM = Program(
    name="sp_fsdp_train_step", mesh={"fsdp": 2, "tp": 4}, build=build,
    # Each of the three products one rewrite, whichever way the cost model
    # runs it (under "ring": three ops over both axes, `test_two_gathers`).
    fused=3,
    # overlap(grad): the forward's gathered operands are residuals of the
    # gradient's own backward, so they stay XLA's; the two reduce-scatters
    # (the input and weight gradients) of the step's backward and of the
    # gradient's fuse, one side each (4).
    grad_fused=4,
    unfused="the loss psum (a scalar); under overlap(grad), the forward's two gathers (residuals of the backward)")
