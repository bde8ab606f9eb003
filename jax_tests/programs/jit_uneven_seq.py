"""A tensor- and sequence-parallel MLP block under plain ``jax.jit``, called
on a sequence that divides the ``tp`` axis and on one that does not (10
positions over 4 devices: a short prompt, a last partial chunk). XLA pads
the uneven one; commfuse's fused ops need equal blocks, so its products
fall back to XLA's collectives and a local dot, while the even call's
gather and reduce-scatter fuse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import JitProgram, normal, place


def build(mesh, rng):
    d, f = 32, 64

    def constrain(a, *spec):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

    def block(x, w1, w2):
        x = constrain(x, None, "tp", None)  # the sequence over tp (10 positions: uneven)
        h = constrain(jnp.einsum("bsd,df->bsf", x, w1), None, None, "tp")
        return x + constrain(jax.nn.gelu(h) @ w2, None, "tp", None)

    def two_calls(even, uneven, w1, w2):
        a, b = block(even, w1, w2), block(uneven, w1, w2)
        return jnp.mean(a * a) + jnp.mean(b * b), a, b

    even = place(mesh, P(), normal(rng, (2, 4 * mesh.shape["tp"], d)))
    uneven = place(mesh, P(), normal(rng, (2, 10, d)))
    w1 = place(mesh, P(None, "tp"), normal(rng, (d, f), d ** -0.5))
    w2 = place(mesh, P("tp", None), normal(rng, (f, d), f ** -0.5))
    return two_calls, (even, uneven, w1, w2)


# Fused calls, as the report's decisions add them up: forward: the even call's gather and reduce-scatter; with
# the gradient: 2 of each.
JIT_PROGRAM = JitProgram(name="jit_uneven_seq", mesh={"tp": 4}, build=build, fused=1 + 1, grad_fused=2 + 2,
                         unfused="the uneven call's gather and reduce-scatter: 10 positions do not divide over 4 "
                                 "devices (XLA pads them; the fused ops need equal blocks)")
