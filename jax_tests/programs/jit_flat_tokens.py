"""A tensor- and sequence-parallel MLP under plain ``jax.jit``, written over
flattened tokens as code ported from PyTorch writes it: activations
``[batch, seq, d]`` batch-sharded over ``dp`` and sequence-sharded over
``tp``, flattened (``x.reshape(-1, d)``) for the projections and split back
(``y.reshape(b, s, d)``) before the sequence constraint.

The partitioner cannot keep a merged batch x sequence dim sharded over both
axes, so as written it gathers the sequence before the first projection,
outside any dot. ``overlap`` takes each dot on the operand before the merge
(and the second on the operand split the way its result is), where the
sequence is a dim of its own: the gather and the reduce-scatter are the
fused ops' own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, constrainer, mlp_operands


def build(mesh, rng):
    b, s, d = 2 * mesh.shape["dp"], 16 * mesh.shape["tp"], 32
    constrain = constrainer(mesh)

    def block(x, w1, w2):
        h = jax.nn.gelu(x.reshape(-1, d) @ w1)
        y = constrain((h @ w2).reshape(b, s, d), "dp", "tp", None)
        out = x + y
        return jnp.mean(out * out), out

    x, w1, w2 = mlp_operands(mesh, rng, (b, s, d), P("dp", "tp", None), P(None, "tp"), P("tp", None))
    return block, (x, w1, w2)


# Fused calls, as the report's decisions add them up: forward: 2 matmul_all_gather over tp; with the gradient: 4
# of them and the 2 weight gradients' all-reduces over dp.
JIT_PROGRAM = JitProgram(
    name="jit_flat_tokens", mesh={"dp": 2, "tp": 4}, build=build, fused=2, grad_fused=4 + 2 * ALL_REDUCE_CALLS,
    orders_differ="the weight gradients contract batch x sequence: commfuse.matmul's own VJP takes them on the "
                  "3-D operands, JAX's gradient of the flattened program on rows it splits back; XLA gathers one "
                  "more operand for the first")
