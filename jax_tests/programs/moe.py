"""An expert-parallel MoE feed-forward: tokens already routed to experts
(``[experts, capacity, d]``) are dispatched with ``all_to_all``, each device
runs its expert's FFN, and the results return with the reverse
``all_to_all``; a second variant keeps two experts per device and runs them
as one grouped (batched) matmul, whose output is reduce-scattered over a
tensor-parallel split of the experts' hidden dim."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    n = mesh.shape["ep"]
    cap, d, f = 32 * scale, 64 * scale, 128 * scale

    def moe(x, w1, w2, wg1, wg2):
        # One expert per device: [N, cap, d] -> all_to_all -> FFN -> all_to_all back.
        routed = jax.lax.all_to_all(x, "ep", 0, 0, tiled=True)
        h = jax.nn.gelu(routed @ w1[0])
        back = jax.lax.all_to_all(h @ w2[0], "ep", 0, 0, tiled=True)
        # Two experts per device, hidden dim split over the axis: a grouped
        # matmul (batched over the experts) and a reduce-scatter of its output.
        g = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", back.reshape(2, -1, d), wg1))
        y = jnp.einsum("ecf,efd->ecd", g, wg2)
        out = jax.lax.psum_scatter(y, "ep", scatter_dimension=1, tiled=True)
        return jax.lax.psum(jnp.mean(out * out), "ep"), out

    x = place(mesh, P("ep"), normal(rng, (n * n, cap, d)))
    w1 = place(mesh, P("ep"), normal(rng, (n, d, f), d ** -0.5))
    w2 = place(mesh, P("ep"), normal(rng, (n, f, d), f ** -0.5))
    wg1 = place(mesh, P(None, None, "ep"), normal(rng, (2, d, f), d ** -0.5))
    wg2 = place(mesh, P(None, "ep"), normal(rng, (2, f, d), f ** -0.5))
    specs = (P("ep"), P("ep"), P("ep"), P(None, None, "ep"), P(None, "ep"))
    fn = jax.shard_map(moe, mesh=mesh, in_specs=specs, out_specs=(P(), P(None, "ep")))
    return fn, (x, w1, w2, wg1, wg2)


PROGRAM = Program(
    name="moe", mesh={"ep": 4}, build=build, fused=3, grad_fused=6,
    unfused="under overlap(grad(f)), JAX's forward shard_map returns the dispatched value as a residual for the "
            "backward one: that all_to_all stays (fusing its dot would move it twice)")
