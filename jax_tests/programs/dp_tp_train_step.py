"""A data- and tensor-parallel training step inside one ``shard_map`` (a
2-D mesh ``dp`` x ``tp``): a sequence-parallel MLP (rows gathered over
``tp`` into the first product, its second product reduce-scattered back),
the gradients summed over ``dp`` with ``psum`` and SGD applied in the body.
Each weight gradient's dot has a collective on each side: the gathered
activations (over ``tp``) feed it and its result is summed (over ``dp``);
``overlap`` hides both with tiles of the gathered operand, each fused with
its dot, each tile's sum running while the next is multiplied."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    rows, d, f = 32 * dp * tp * scale, 64 * scale, 128 * scale

    def step(x, y, w1, w2):
        def loss(w1, w2):
            h = jax.nn.gelu(jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1)
            out = jax.lax.psum_scatter(h @ w2, "tp", scatter_dimension=0, tiled=True)
            return jax.lax.psum(jnp.mean((out - y) ** 2), ("dp", "tp"))

        value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
        g1, g2 = jax.lax.psum(g1, "dp"), jax.lax.psum(g2, "dp")
        return value, w1 - 0.1 * g1, w2 - 0.1 * g2

    x = place(mesh, P(("dp", "tp")), normal(rng, (rows, d)))
    y = place(mesh, P(("dp", "tp")), normal(rng, (rows, d)))
    w1 = place(mesh, P(None, "tp"), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P("tp"), normal(rng, (f, d), f ** -0.5))
    fn = jax.shard_map(step, mesh=mesh, in_specs=(P(("dp", "tp")), P(("dp", "tp")), P(None, "tp"), P("tp")),
                       out_specs=(P(), P(None, "tp"), P("tp")), check_vma=False)
    return fn, (x, y, w1, w2)


PROGRAM = Program(name="dp_tp_train_step", mesh={"dp": 2, "tp": 4}, build=build, fused=5, grad_fused=7,
                  unfused="the loss psum (a scalar); under overlap(grad(step)), the gathered activations are "
                          "residuals of the outer forward pass")
