"""Untiled collectives (``all_gather(tiled=False)``, ``psum_scatter(tiled=False)``)
with the reshapes that make them tiled ones, as code from ``pmap`` writes
them: fused as the tiled collectives they are, the same numbers as written,
on one mesh axis and next to a sum over another."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import P, rewrites_as_written
from programs import make_mesh


@pytest.mark.parametrize("a, b, rows", [(4, 2, 2), (2, 4, 8)])
def test_an_untiled_gather_into_a_dot_whose_result_is_summed_over_another_axis(a, b, rows):
    """The gather over `a` and the reduce-scatter over `b` around one dot (FSDP x TP)."""
    mesh = make_mesh({"a": a, "b": b})
    rng = np.random.default_rng(3)
    x = jax.device_put(rng.standard_normal((a * rows, 16)).astype(np.float32), jax.NamedSharding(mesh, P("a", "b")))
    w = jax.device_put(rng.standard_normal((16, 32)).astype(np.float32), jax.NamedSharding(mesh, P("b", None)))

    def body(x, w):
        g = jax.lax.all_gather(x, "a", axis=0, tiled=False)
        return jax.lax.psum_scatter(g.reshape(-1, g.shape[2]) @ w, "b", scatter_dimension=1, tiled=True)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("a", "b"), P("b", None)), out_specs=P(None, "b"),
                       check_vma=False)
    rewrites_as_written(fn, (x, w), 1)


def test_an_untiled_scatter_after_a_transpose_and_the_split():
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(4)
    x = jax.device_put(rng.standard_normal((2, 16, 32)).astype(np.float32), jax.NamedSharding(mesh, P(None, None, "tp")))
    w = jax.device_put(rng.standard_normal((32, 12)).astype(np.float32), jax.NamedSharding(mesh, P("tp")))

    def body(x, w):
        y = jnp.swapaxes(x @ w, 0, 1).reshape(4, 4, 2, 12)  # rows split into the ranks' blocks
        return jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=False)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "tp"), P("tp")), out_specs=P("tp"), check_vma=False)
    rewrites_as_written(fn, (x, w), 1)


def test_a_reshape_that_does_not_merge_the_ranks_axis_is_not_taken_for_a_tiled_gather():
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(5)
    x = jax.device_put(rng.standard_normal((8, 8)).astype(np.float32), jax.NamedSharding(mesh, P("tp")))
    w = jax.device_put(rng.standard_normal((4, 8)).astype(np.float32), jax.NamedSharding(mesh, P()))

    def body(x, w):
        g = jax.lax.all_gather(x, "tp", axis=0, tiled=False)  # [4, 2, 8]
        return (g.reshape(4, 16) @ jnp.tile(w, (4, 1)).reshape(16, 8))[None]  # merges the rows with the features

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"), check_vma=False)
    rewrites_as_written(fn, (x, w), 0)
