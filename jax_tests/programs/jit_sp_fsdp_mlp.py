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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import JitProgram, normal, place


def build(mesh, rng):
    b, s, d, f = 2 * mesh.shape["fsdp"], 8 * mesh.shape["tensor"], 32, 64

    def constrain(a, *spec):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

    def block(x, w1, w2):
        x = constrain(x, "fsdp", "tensor", None)
        h = constrain(jax.nn.gelu(x @ w1), "fsdp", None, "tensor")
        y = constrain(h @ w2, "fsdp", "tensor", None)
        out = x + y
        return jnp.mean(out * out), out

    x = place(mesh, P("fsdp", "tensor", None), normal(rng, (b, s, d)))
    w1 = place(mesh, P("fsdp", "tensor"), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P("tensor", "fsdp"), normal(rng, (f, d), f ** -0.5))
    return block, (x, w1, w2)


JIT_PROGRAM = JitProgram(name="jit_sp_fsdp_mlp", mesh={"fsdp": 2, "tensor": 4}, build=build, fused=2,
                         grad_fused=12)
