"""The Flax GSPMD guide's ``DotReluDot`` on explicit mesh axes (shardings
in the types): the batch over ``data``, w1 column- and w2 row-parallel over
``model``; the second product's sharded contraction needs ``out_sharding``
(as ``jnp.matmul`` does there) and an all-reduce over ``model``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import ALL_REDUCE_CALLS, JitProgram, normal, place


def build(mesh, rng):
    data, model = mesh.shape["data"], mesh.shape["model"]
    b, d, f = 8 * data * model, 32, 16 * model

    def dot_relu_dot(x, w1, w2):
        y = jax.nn.relu(jnp.matmul(x, w1))
        z = jnp.matmul(y, w2, out_sharding=P("data", None))
        return jnp.mean(z * z), z

    x = place(mesh, P("data", None), normal(rng, (b, d)))
    w1 = place(mesh, P(None, "model"), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P("model", None), normal(rng, (f, d), f ** -0.5))
    return dot_relu_dot, (x, w1, w2)


# Fused calls, as the report's decisions add them up: forward: the second product's psum over model; with the
# gradient: 2 all-reduces over model (input gradients) and 2 over data (weight gradients).
JIT_PROGRAM = JitProgram(name="jit_explicit_mlp", mesh={"data": 2, "model": 4}, build=build,
                         fused=1 * ALL_REDUCE_CALLS,
                         grad_fused=2 * ALL_REDUCE_CALLS + 2 * ALL_REDUCE_CALLS, axis_type="Explicit")
