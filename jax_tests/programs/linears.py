"""Megatron linears: a column-parallel linear of sequence-gathered
activations, a row-parallel one reduced with ``psum`` (tensor parallelism
without sequence parallelism), and a row-parallel one reduce-scattered over
the sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import Program, normal, place


def build(mesh, rng, scale=1):
    n = mesh.shape["tp"]
    rows, d, f = 64 * n * scale, 128 * scale, 256 * scale

    def mlp(x, w_col, w_row, w_col2, w_row2):
        h = jax.nn.gelu(jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w_col)    # column-parallel
        full = jax.lax.psum(h @ w_row, "tp")                                           # row-parallel, psum
        h2 = jax.nn.gelu(full @ w_col2)                                                # column-parallel
        out = jax.lax.psum_scatter(h2 @ w_row2, "tp", scatter_dimension=0, tiled=True)  # row-parallel, SP
        return jax.lax.psum(jnp.mean(out * out), "tp"), out

    x = place(mesh, P("tp"), normal(rng, (rows, d)))
    w_col = place(mesh, P(None, "tp"), normal(rng, (d, f), d ** -0.5))
    w_row = place(mesh, P("tp"), normal(rng, (f, d), f ** -0.5))
    w_col2 = place(mesh, P(None, "tp"), normal(rng, (d, f), d ** -0.5))
    w_row2 = place(mesh, P("tp"), normal(rng, (f, d), f ** -0.5))
    specs = (P("tp"), P(None, "tp"), P("tp"), P(None, "tp"), P("tp"))
    fn = jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=(P(), P("tp")))
    return fn, (x, w_col, w_row, w_col2, w_row2)


PROGRAM = Program(name="linears", mesh={"tp": 4}, build=build, fused=3, grad_fused=6,
                  unfused="the loss psum (a scalar); under overlap(grad(f)), JAX's forward shard_map returns the gathered value as a residual for the backward one: that gather stays (fusing its dot would gather twice)")
