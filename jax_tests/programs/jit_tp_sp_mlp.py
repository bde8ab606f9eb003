"""A tensor- and sequence-parallel MLP block under plain ``jax.jit``: the
weights are ``NamedSharding`` inputs (column- then row-parallel over
``tp``), the activations sequence-sharded over ``tp`` and batch-sharded over
``dp``, pinned by ``with_sharding_constraint`` as the LLM frameworks' logical
axis rules do. The partitioner needs an all-gather of the sequence before
the first projection and a reduce-scatter after the second."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import JitProgram, normal, place


def build(mesh, rng):
    b, s, d, f = 2 * mesh.shape["dp"], 16 * mesh.shape["tp"], 32, 64

    def constrain(a, *spec):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

    def block(x, w1, w2):
        h = constrain(jnp.einsum("bsd,df->bsf", x, w1), "dp", None, "tp")
        y = constrain(jax.nn.gelu(h) @ w2, "dp", "tp", None)
        out = x + y
        return jnp.mean(out * out), out

    x = place(mesh, P("dp", "tp", None), normal(rng, (b, s, d)))
    w1 = place(mesh, P(None, "tp"), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P("tp", None), normal(rng, (f, d), f ** -0.5))
    return block, (x, w1, w2)


JIT_PROGRAM = JitProgram(name="jit_tp_sp_mlp", mesh={"dp": 2, "tp": 4}, build=build, fused=2, grad_fused=12)
