"""Fused ops under JAX's other transforms: forward-mode differentiation
(``jax.jvp``, ``jacfwd``), which a custom_vjp cannot take, runs jax.lax's
collective and dot; ``jax.vmap`` of a jit-level product (a
custom_partitioning, which JAX cannot batch) runs jax.lax's dot. Same
numbers as the plain program either way; reverse mode stays fused, and
``jax.jacrev`` (the backward ops batched) gives the plain Jacobian."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import commfuse
from conftest import P
from programs import collectives, make_mesh


def _close(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def _setup():
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(12)
    x = jax.device_put(rng.standard_normal((16, 16)).astype(np.float32), jax.NamedSharding(mesh, P("tp")))
    w = jax.device_put(rng.standard_normal((16, 32)).astype(np.float32), jax.NamedSharding(mesh, P(None, "tp")))
    f = jax.shard_map(lambda x, w: jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w, mesh=mesh,
                      in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    return mesh, x, w, f


def test_forward_mode_through_overlap_and_the_named_ops():
    mesh, x, w, f = _setup()
    dx, dw = x * 0.5 + 1, w * -2 + 0.25
    rewritten = commfuse.overlap(f, schedule="ring")
    want = jax.jit(lambda x, w: jax.jvp(f, (x, w), (dx, dw)))(x, w)
    _close(jax.jit(lambda x, w: jax.jvp(rewritten, (x, w), (dx, dw)))(x, w), want)
    _close(jax.jit(jax.jacfwd(rewritten, argnums=1))(x, w), jax.jit(jax.jacfwd(f, argnums=1))(x, w))
    named = jax.shard_map(lambda x, w: commfuse.all_gather_matmul(x, w, "tp", schedule="ring"), mesh=mesh,
                          in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    _close(jax.jit(lambda x, w: jax.jvp(named, (x, w), (dx, dw)))(x, w), want)
    # Reverse mode is still fused.
    text = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(named(x, w))), argnums=(0, 1))).lower(x, w).compile()
    assert 'custom_call_target="commfuse_collective_matmul' in text.as_text()


def test_forward_mode_and_vmap_of_jit_level_products():
    mesh, x, w, _ = _setup()

    def mlp(x, w):
        return jax.lax.with_sharding_constraint(jnp.tanh(x @ w), jax.NamedSharding(mesh, P()))

    product = lambda a, b: commfuse.matmul(a, b, schedule="ring")  # noqa: E731
    dx, dw = x * 0.5 + 1, w * -2 + 0.25
    _close(jax.jit(lambda x, w: jax.jvp(product, (x, w), (dx, dw)))(x, w),
           jax.jit(lambda x, w: jax.jvp(jnp.matmul, (x, w), (dx, dw)))(x, w))
    xb = jnp.stack([x, 2 * x, -x])
    want = jax.jit(jax.vmap(mlp, in_axes=(0, None)))(xb, w)
    _close(jax.jit(jax.vmap(commfuse.overlap(mlp, schedule="ring"), in_axes=(0, None)))(xb, w), want)
    _close(jax.jit(jax.vmap(product, in_axes=(0, None)))(xb, w), jax.jit(jax.vmap(jnp.matmul, in_axes=(0, None)))(xb, w))


def test_forward_mode_through_every_named_op_kind():
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(13)
    cases = {
        "matmul_reduce_scatter": (
            lambda x, w: commfuse.matmul_reduce_scatter(x, w, "tp", schedule="ring"),
            lambda x, w: jax.lax.psum_scatter(x @ w, "tp", tiled=True), (16, 32), (32, 8), P(None, "tp"), P("tp"),
            P("tp")),
        "matmul_all_reduce": (
            lambda x, w: commfuse.matmul_all_reduce(x, w, "tp", schedule="ring"),
            lambda x, w: jax.lax.psum(x @ w, "tp"), (16, 32), (32, 8), P(None, "tp"), P("tp"), P()),
        "all_to_all_matmul": (
            lambda x, w: commfuse.all_to_all_matmul(x, w, "tp", split_dimension=0, concat_dimension=1,
                                                    schedule="ring"),
            lambda x, w: jax.lax.all_to_all(x, "tp", 0, 1, tiled=True) @ w, (4, 16, 8), (8, 4), P(None, "tp"), P(),
            P("tp")),
        "matmul_all_to_all": (
            lambda x, w: commfuse.matmul_all_to_all(x, w, "tp", split_dimension=0, concat_dimension=1,
                                                    schedule="ring"),
            lambda x, w: jax.lax.all_to_all(x @ w, "tp", 0, 1, tiled=True), (4, 16, 8), (8, 4), P(None, "tp"), P(),
            P("tp")),
    }
    for name, (named, plain, xs, ws, x_spec, w_spec, out_spec) in cases.items():
        x = jax.device_put(rng.standard_normal(xs).astype(np.float32), jax.NamedSharding(mesh, x_spec))
        w = jax.device_put(rng.standard_normal(ws).astype(np.float32), jax.NamedSharding(mesh, w_spec))
        dx, dw = jnp.ones_like(x) * 0.5, w * -2 + 0.25
        jvps = [jax.jit(lambda x, w, f=f: jax.jvp(jax.shard_map(f, mesh=mesh, in_specs=(x_spec, w_spec),
                                                              out_specs=out_spec), (x, w), (dx, dw)))(x, w)
                for f in (named, plain)]
        _close(*jvps, tol=1e-4)


def test_vmap_of_matmul_all_reduce_joins_the_batch_to_the_rows():
    # One fused op on the batch's rows together (not jax.lax's psum per item).
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(17)
    x = jax.device_put(rng.standard_normal((3, 16, 32)).astype(np.float32),
                       jax.NamedSharding(mesh, P(None, None, "tp")))
    w = jax.device_put(rng.standard_normal((32, 8)).astype(np.float32), jax.NamedSharding(mesh, P("tp")))
    body = lambda x, w: jax.vmap(lambda xi: commfuse.matmul_all_reduce(xi, w, "tp", schedule="ring"))(x)  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "tp"), P("tp")), out_specs=P()))
    assert collectives(f.lower(x, w).compile().as_text()) == {"commfuse": 1}
    _close(f(x, w), np.einsum("bsk,kn->bsn", np.asarray(x, np.float64), np.asarray(w, np.float64)), 1e-4)


def test_jacrev_of_fused_ops_batches_the_backward_ops():
    """``jax.jacrev`` vmaps the backward pass over the output's cotangents:
    a backward op batched over its `w` (no fused form) runs jax.lax's
    collective and dot, batched; the Jacobian is the plain program's."""
    mesh, x, w, f = _setup()
    # A 16 x 8 weight: the Jacobian is 16 x 8 by 16 x 8.
    w_small = jax.device_put(np.asarray(w)[:, :8], jax.NamedSharding(mesh, P(None, "tp")))

    def loss_of(fn):
        return lambda w: jnp.tanh(fn(x, w))

    want = jax.jit(jax.jacrev(loss_of(f)))(w_small)
    _close(jax.jit(jax.jacrev(loss_of(commfuse.overlap(f, schedule="ring"))))(w_small), want, 1e-4)
