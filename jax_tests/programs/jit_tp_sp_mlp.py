"""A tensor- and sequence-parallel MLP block under plain ``jax.jit``: the
weights are ``NamedSharding`` inputs (column- then row-parallel over
``tp``), the activations sequence-sharded over ``tp`` and batch-sharded over
``dp``, pinned by ``with_sharding_constraint`` as the LLM frameworks' logical
axis rules do. The partitioner needs an all-gather of the sequence before
the first projection and a reduce-scatter after the second."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, constrainer, mlp_operands


def build(mesh, rng):
    b, s, d = 2 * mesh.shape["dp"], 16 * mesh.shape["tp"], 32
    constrain = constrainer(mesh)

    def block(x, w1, w2):
        h = constrain(jnp.einsum("bsd,df->bsf", x, w1), "dp", None, "tp")
        y = constrain(jax.nn.gelu(h) @ w2, "dp", "tp", None)
        out = x + y
        return jnp.mean(out * out), out

    x, w1, w2 = mlp_operands(mesh, rng, (b, s, d), P("dp", "tp", None), P(None, "tp"), P("tp", None))
    return block, (x, w1, w2)


# Fused calls, as the report's decisions add them up: forward: the sequence gather and the reduce-scatter over
# tp; with the gradient: 2 of each and the 2 weight gradients' all-reduces over dp.
JIT_PROGRAM = JitProgram(name="jit_tp_sp_mlp", mesh={"dp": 2, "tp": 4}, build=build, fused=1 + 1,
                         grad_fused=2 + 2 + 2 * ALL_REDUCE_CALLS)
