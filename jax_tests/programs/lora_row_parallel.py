"""A LoRA adapter beside a row-parallel layer (``tp``, one ``shard_map``):
``psum_scatter(h @ W + (h @ A) @ B, "tp")``, the contraction of ``h``, ``W``
and ``A`` sharded over ``tp``, the adapter's ``B`` replicated. The two
products are summed before the one collective: ``overlap`` fuses them into
one ``matmul_reduce_scatter`` on ``[h | h @ A]`` and ``[W; B]``, and beside
it ``psum(h @ W + g @ V)`` (two inputs projected and summed, as a
multi-input layer writes it) as one ``matmul_all_reduce``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    tp = mesh.shape["tp"]
    rows, k, d, r = 16 * tp * scale, 32 * tp * scale, 64 * scale, 8

    def step(h, g, W, A, B, V):
        y = jax.lax.psum_scatter(h @ W + (h @ A) @ B, "tp", scatter_dimension=0, tiled=True)
        z = jax.lax.psum(h @ W + g @ V, "tp")
        loss = jax.lax.psum(jnp.sum(y ** 2), "tp") / z.size + jnp.mean(z ** 2)
        return loss, y, z

    h = place(mesh, P(None, "tp"), normal(rng, (rows, k)))
    g = place(mesh, P(None, "tp"), normal(rng, (rows, k)))
    W = place(mesh, P("tp"), normal(rng, (k, d), k ** -0.5))
    A = place(mesh, P("tp"), normal(rng, (k, r), k ** -0.5))
    B = place(mesh, P(), normal(rng, (r, d), r ** -0.5))
    V = place(mesh, P("tp"), normal(rng, (k, d), k ** -0.5))
    fn = jax.shard_map(step, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp"), P("tp"), P(), P("tp")),
                       out_specs=(P(), P("tp"), P()))
    return fn, (h, g, W, A, B, V)


# Fused: the two sums of products (2). Differentiated: the same 2, and the
# backward's all_gather of y's cotangent into each of its four dots (h's
# cotangent through W, the adapter's through B, W's and B's gradients): 6.
# B's gradient psum over tp stays XLA's (its dot went with the gather).
PROGRAM = Program(name="lora_row_parallel", mesh={"tp": 4}, build=build, fused=2, grad_fused=6,
                  unfused="the loss psum (a scalar); B's gradient psum (its dot went with the gather)")
