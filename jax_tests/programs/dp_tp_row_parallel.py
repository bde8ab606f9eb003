"""A data- and tensor-parallel training step without sequence parallelism
(a 2-D mesh ``dp`` x ``tp``, one ``shard_map``): a column-parallel first
layer, a row-parallel second layer whose partial products are summed with
``psum(h @ w2, "tp")``, and the weight gradients summed over ``dp`` by JAX
itself (the weights are the same on every ``dp`` rank, so their cotangents
are summed: a ``psum`` of each gradient's dot). Every one of those
all-reduces is a product's: ``overlap`` runs each as one
``matmul_all_reduce``, both halves inside the fused op, where the earlier
form left an XLA all-gather behind every chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    rows, d, f = 32 * dp * tp * scale, 64 * scale, 64 * tp * scale

    def step(x, y, w1, w2):
        def loss(w1, w2):
            h = jax.nn.gelu(x @ w1)
            out = jax.lax.psum(h @ w2, "tp")
            return jax.lax.pmean(jnp.mean((out - y) ** 2), "dp")

        value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)  # summed over dp by JAX
        return value, w1 - 0.1 * g1, w2 - 0.1 * g2

    x = place(mesh, P("dp"), normal(rng, (rows, d)))
    y = place(mesh, P("dp"), normal(rng, (rows, d)))
    w1 = place(mesh, P(None, "tp"), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P("tp"), normal(rng, (f, d), f ** -0.5))
    fn = jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), P("dp"), P(None, "tp"), P("tp")),
                       out_specs=(P(), P(None, "tp"), P("tp")))
    return fn, (x, y, w1, w2)


# Fused: the forward row-parallel all-reduce over tp and the two weight
# gradients' all-reduces over dp: 3. Differentiated again (the loss's
# gradient with respect to every input), the same 3 and the second-order
# terms' weight gradients over dp and row-parallel products over tp: 6.
PROGRAM = Program(name="dp_tp_row_parallel", mesh={"dp": 2, "tp": 4}, build=build, fused=3, grad_fused=6,
                  unfused="the loss pmean over dp (a scalar)")
