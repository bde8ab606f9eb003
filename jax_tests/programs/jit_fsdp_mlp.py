"""An FSDP (ZeRO-3) MLP under plain ``jax.jit``: the batch and every weight
sharded over ``fsdp`` (w1 on its rows, w2 on its columns); the partitioner
gathers each weight before its product, and reduce-scatters the weight
gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, normal, place


def build(mesh, rng):
    n = mesh.shape["fsdp"]
    b, d, f = 8 * n, 16 * n, 32 * n

    def mlp(x, w1, w2):
        h = jax.lax.with_sharding_constraint(jax.nn.relu(x @ w1), NamedSharding(mesh, P("fsdp", None)))
        y = jax.lax.with_sharding_constraint(h @ w2, NamedSharding(mesh, P("fsdp", None)))
        return jnp.mean(y * y), y

    x = place(mesh, P("fsdp", None), normal(rng, (b, d)))
    w1 = place(mesh, P("fsdp", None), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P(None, "fsdp"), normal(rng, (f, d), f ** -0.5))
    return mlp, (x, w1, w2)


# Fused calls, as the report's decisions add them up: forward: both weights gathered over fsdp (2
# matmul_all_gather); with the gradient: 3 matmul_all_gather, 1 all_gather_matmul and the 2 weight gradients'
# all-reduces over fsdp.
JIT_PROGRAM = JitProgram(name="jit_fsdp_mlp", mesh={"fsdp": 4}, build=build, fused=2,
                         grad_fused=3 + 1 + 2 * ALL_REDUCE_CALLS)
