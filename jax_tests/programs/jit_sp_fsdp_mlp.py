"""MaxText's usual layout under plain ``jax.jit``: the residual stream
batch-sharded over ``data`` and ``fsdp`` and sequence-sharded over
``tensor`` (sequence parallelism), the MLP weights' embedding dim sharded
over ``fsdp`` (FSDP) and their hidden dim over ``tensor``. Each projection
needs two collectives: the weight's gather over ``fsdp`` and the
sequence's gather (or reduce-scatter) over ``tensor``. Under ``ring`` each
projection is one op over both axes (``all_gather_both_matmul``, then
``all_gather_matmul_reduce_scatter``); where that op does not run (under
``bidirectional``, or ``auto`` where the cost model prefers one side), XLA
gathers the weight first (it depends on no activation) and the sequence
collective is the fused op's. (A weight gradient constrained to the weight's layout, rows
over ``fsdp``, is the fused reduce-scatter over ``fsdp`` then XLA's sum
over ``data``: `test_jit_programs`, the gradient here is left to XLA.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, constrainer, mlp_operands


def build(mesh, rng):
    b, s, d = 2 * mesh.shape["data"] * mesh.shape["fsdp"], 8 * mesh.shape["tensor"], 32
    constrain = constrainer(mesh)

    def block(x, w1, w2):
        x = constrain(x, ("data", "fsdp"), "tensor", None)
        h = constrain(jax.nn.gelu(x @ w1), ("data", "fsdp"), None, "tensor")
        y = constrain(h @ w2, ("data", "fsdp"), "tensor", None)
        out = x + y
        return jnp.mean(out * out), out

    x, w1, w2 = mlp_operands(mesh, rng, (b, s, d), P(("data", "fsdp"), "tensor", None), P("fsdp", "tensor"),
                             P("tensor", "fsdp"))
    return block, (x, w1, w2)


# Fused calls, as the report's decisions add them up: forward: the sequence gather and the reduce-scatter over
# tensor; with the gradient: 2 of each and the 2 weight gradients' all-reduces over (data, fsdp).
JIT_PROGRAM = JitProgram(name="jit_sp_fsdp_mlp", mesh={"data": 2, "fsdp": 2, "tensor": 2}, build=build, fused=1 + 1,
                         grad_fused=2 + 2 + 2 * ALL_REDUCE_CALLS)
