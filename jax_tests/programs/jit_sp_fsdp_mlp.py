"""MaxText's usual layout under plain ``jax.jit``: the residual stream
batch-sharded over ``fsdp`` and sequence-sharded over ``tensor`` (sequence
parallelism), the MLP weights' embedding dim sharded over ``fsdp`` (FSDP)
and their hidden dim over ``tensor``. Each projection needs two
collectives: the weight's gather over ``fsdp`` and the sequence's gather (or
reduce-scatter) over ``tensor``. XLA gathers the weight first (it depends on
no activation); the sequence collective is the fused op's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import JitProgram, constrainer, mlp_operands


def build(mesh, rng):
    b, s, d = 2 * mesh.shape["fsdp"], 8 * mesh.shape["tensor"], 32
    constrain = constrainer(mesh)

    def block(x, w1, w2):
        x = constrain(x, "fsdp", "tensor", None)
        h = constrain(jax.nn.gelu(x @ w1), "fsdp", None, "tensor")
        y = constrain(h @ w2, "fsdp", "tensor", None)
        out = x + y
        return jnp.mean(out * out), out

    x, w1, w2 = mlp_operands(mesh, rng, (b, s, d), P("fsdp", "tensor", None), P("fsdp", "tensor"),
                             P("tensor", "fsdp"))
    return block, (x, w1, w2)


JIT_PROGRAM = JitProgram(name="jit_sp_fsdp_mlp", mesh={"fsdp": 2, "tensor": 4}, build=build, fused=2,
                         grad_fused=12)
