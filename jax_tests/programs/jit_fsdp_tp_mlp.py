"""FSDP x TP on a 2-D mesh under plain ``jax.jit`` (TP without sequence
parallelism, the Flax GSPMD guide's layout with FSDP added): w1 sharded
``(fsdp, tp)``, w2 ``(tp, fsdp)``, the batch over ``fsdp``. The first
product gathers w1 over ``fsdp``; the second gathers w2's columns over
``fsdp`` and sums over ``tp``: 4 tiles of w2's columns, each a fused gather whose
sum over ``tp`` (XLA's all-reduce) runs while the next tile is gathered and multiplied."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, normal, place


def build(mesh, rng):
    fsdp, tp = mesh.shape["fsdp"], mesh.shape["tp"]
    b, s, d, f = 2 * fsdp, 8, 16 * fsdp, 32 * fsdp * tp

    def mlp(x, w1, w2):
        h = jax.lax.with_sharding_constraint(jax.nn.gelu(x @ w1), NamedSharding(mesh, P("fsdp", None, "tp")))
        y = jax.lax.with_sharding_constraint(h @ w2, NamedSharding(mesh, P("fsdp", None, None)))
        return jnp.mean(y * y), y

    x = place(mesh, P("fsdp", None, None), normal(rng, (b, s, d)))
    w1 = place(mesh, P("fsdp", "tp"), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P("tp", "fsdp"), normal(rng, (f, d), f ** -0.5))
    return mlp, (x, w1, w2)


# Fused calls, as the report's decisions add them up: forward: w1's gather (1) and w2's 4 column tiles (each a
# gather over fsdp, then psum over tp); with the gradient: twice each, and the 2 weight gradients' all-reduces
# over fsdp.
JIT_PROGRAM = JitProgram(name="jit_fsdp_tp_mlp", mesh={"fsdp": 2, "tp": 2}, build=build, fused=1 + 4,
                         grad_fused=2 * 1 + 2 * 4 + 2 * ALL_REDUCE_CALLS)
