"""Sequence parallelism with flat tokens beside FSDP under plain
``jax.jit``, a training step's gradients kept in the parameters' layout:
the tokens ``[b*s, d]`` sharded over ``(fsdp, tensor)``, w1 ``(fsdp,
tensor)`` and w2 ``(tensor, fsdp)``. The first projection gathers the
tokens over ``tensor`` and w1's rows over ``fsdp`` (the two-gather op);
the second gathers w2's columns over ``fsdp`` and reduce-scatters the
tokens over ``tensor`` (the two-axis op). The weight gradients, reduce-
scattered over ``fsdp`` into their layout, gather the tokens (their
contraction) over ``tensor``: JAX writes each as ``dyᵀ @ h``, the
gather-contract-scatter op on its transpose."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import JitProgram, constrainer, normal, place


def build(mesh, rng):
    tokens, d = 8 * mesh.shape["fsdp"] * mesh.shape["tensor"], 16 * mesh.shape["fsdp"] * mesh.shape["tensor"]
    constrain = constrainer(mesh)

    def block(x, w1, w2):
        h = constrain(jax.nn.gelu(x @ w1), "fsdp", "tensor")
        y = constrain(h @ w2, ("fsdp", "tensor"), None)
        out = x + y
        return jnp.mean(out * out), out

    x = place(mesh, P(("fsdp", "tensor"), None), normal(rng, (tokens, d)))
    w1 = place(mesh, P("fsdp", "tensor"), normal(rng, (d, 2 * d), d ** -0.5))
    w2 = place(mesh, P("tensor", "fsdp"), normal(rng, (2 * d, d), (2 * d) ** -0.5))
    return block, (x, w1, w2)


# Fused calls, as the report's decisions add them up: at these sizes "auto" fuses one side of each product (XLA
# gathers the weight, or the tokens for a weight gradient, first): forward 2; with the gradient, the 2 forward
# products, the 2 input gradients and the 2 weight gradients, one each. Under "ring" each is one op over both
# axes, and XLA keeps only the loss's all-reduce (`test_jit_programs`).
JIT_PROGRAM = JitProgram(name="jit_sp_fsdp_flat_tokens", mesh={"fsdp": 2, "tensor": 2}, build=build, fused=1 + 1,
                         grad_fused=2 + 2 + 2, grads_in_layout=True)
