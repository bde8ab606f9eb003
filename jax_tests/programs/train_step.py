"""A training step with the optimizer inside the ``shard_map``: the body
takes the gradient of a tensor- and sequence-parallel MLP's loss with
``jax.value_and_grad`` and applies SGD, so the backward pass's own
collective patterns (``dot -> transpose -> psum_scatter``, a gathered
activation read by the forward and the weight-gradient dots) are in the
body ``overlap`` sees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    n = mesh.shape["tp"]
    rows, d, f = 32 * n * scale, 64 * scale, 128 * scale

    def step(x, y, w1, w2):
        def loss(w1, w2):
            h = jax.nn.gelu(jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1)
            out = jax.lax.psum_scatter(h @ w2, "tp", scatter_dimension=0, tiled=True)
            return jax.lax.psum(jnp.mean((out - y) ** 2), "tp")

        value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
        return value, w1 - 0.1 * g1, w2 - 0.1 * g2

    x = place(mesh, P("tp"), normal(rng, (rows, d)))
    y = place(mesh, P("tp"), normal(rng, (rows, d)))
    w1 = place(mesh, P(None, "tp"), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P("tp"), normal(rng, (f, d), f ** -0.5))
    fn = jax.shard_map(step, mesh=mesh, in_specs=(P("tp"), P("tp"), P(None, "tp"), P("tp")),
                       out_specs=(P(), P(None, "tp"), P("tp")))
    return fn, (x, y, w1, w2)


PROGRAM = Program(name="train_step", mesh={"tp": 4}, build=build, fused=5, grad_fused=4,
                  unfused='the loss psum (a scalar); under overlap(grad(step)), the gathered activations are residuals of the outer forward pass')
