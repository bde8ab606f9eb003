"""Which axes a shard_map body's values may differ over (`_overlap.variance`),
the guard that keeps row-wise work with a per-device value after its gather."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from commfuse._overlap import variance
from conftest import P, rewrites_as_written
from programs import make_mesh


def body_axes(body, specs, check_vma=False):
    """The axes each output of `body` (a shard_map body over a dp x tp mesh of
    2 x 2, f32[4, 4] operands) may vary over."""
    mesh = make_mesh({"dp": 2, "tp": 2})
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=check_vma)
    args = [jnp.ones((4, 4), jnp.float32) for _ in specs]
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    (sm,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    inner = sm.params["jaxpr"]
    inner = getattr(inner, "jaxpr", inner)
    known = {}
    outs = variance.fill(inner, [variance.spec_axes(s) for s in sm.params["in_specs"]], known)
    return [set(o) for o in outs]


def test_blocks_of_sharded_inputs_vary_and_replicated_ones_do_not():
    assert body_axes(lambda a, b: (a + 1, b * 2), (P("tp"), P())) == [{"tp"}, set()]
    assert body_axes(lambda a: (a,), (P(("dp", "tp")),)) == [{"dp", "tp"}]


def test_axis_index_and_collectives():
    def body(a, b):
        s = jax.lax.axis_index("tp").astype(jnp.float32)
        return (s * b,                                     # varies over tp
                jax.lax.psum(a, "tp"),                     # same on every tp device
                jax.lax.all_gather(a, "tp", tiled=True),   # same too
                jax.lax.psum_scatter(b, "tp", tiled=True),  # each device its part
                jax.lax.ppermute(b, "tp", [(0, 1), (1, 0)]),
                jax.lax.psum(s * b, "dp"))                 # still varies over tp
    assert body_axes(body, (P("tp"), P())) == [{"tp"}, set(), set(), {"tp"}, {"tp"}, {"tp"}]


def test_sums_over_groups_and_host_callbacks_may_differ_between_devices():
    def body(a, b):
        groups = jax.lax.psum(b, "tp", axis_index_groups=[[0], [1]])  # each device its own group
        host = jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((4, 4), jnp.float32), b)
        empty = jax.lax.scan(lambda c, x: (c * 0, None), a, None, length=0)[0]  # the carry as it came in
        return groups, host, empty
    assert body_axes(body, (P("tp"), P())) == [{"tp"}, {variance.EVERY}, {"tp"}]


def test_a_per_rank_key_makes_its_random_values_vary():
    def body(a):
        key = jax.random.fold_in(jax.random.PRNGKey(0), jax.lax.axis_index("tp"))
        return (a * jax.random.normal(key, (4, 4)), a * jax.random.normal(jax.random.PRNGKey(1), (4, 4)))
    assert body_axes(body, (P(),)) == [{"tp"}, set()]


def test_loops_carry_what_a_step_adds_and_a_varying_condition():
    def scan_body(a, b):
        def step(carry, x):
            return carry + jax.lax.axis_index("tp").astype(jnp.float32), carry * x
        carry, ys = jax.lax.scan(step, b, jnp.stack([b, b]))
        # A carry that starts the same everywhere picks up tp in its first step, and so does what it makes.
        return carry, ys, jax.lax.scan(lambda c, x: (c + x, c), b, jnp.stack([b, b]))[0]
    assert body_axes(scan_body, (P("tp"), P())) == [{"tp"}, {"tp"}, set()]

    def while_body(a, b):
        # The trip count depends on the device: every carried value may differ.
        limit = jax.lax.axis_index("tp")
        return (jax.lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + 1, c[1] * 2), (0, b))[1],)
    assert body_axes(while_body, (P("tp"), P())) == [{"tp"}]

    def cond_body(a, b):
        return (jax.lax.cond(jax.lax.axis_index("tp") > 0, lambda x: x, lambda x: -x, b),
                jax.lax.cond(True, lambda x: x, lambda x: -x, b))
    assert body_axes(cond_body, (P("tp"), P())) == [{"tp"}, set()]


@pytest.mark.parametrize("check_vma", [False, True])
def test_row_wise_work_with_a_per_device_value_stays_after_the_gather(check_vma):
    """``all_gather(x) * s @ w`` with ``s`` from ``axis_index``: each device
    scales every gathered row by its own ``s``. Moved before the gather, each
    block would get its owner's (the wrong numbers this guard prevents); a
    replicated scale still moves and fuses."""
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(3)
    x = jax.device_put(rng.standard_normal((16, 8)).astype(np.float32), jax.NamedSharding(mesh, P("tp")))
    w = jax.device_put(rng.standard_normal((8, 8)).astype(np.float32), jax.NamedSharding(mesh, P()))

    def per_device(x, w):
        s = (jax.lax.axis_index("tp") + 1).astype(jnp.float32)
        return (jax.lax.all_gather(x, "tp", tiled=True) * s @ w)[None]

    def replicated(x, w):
        return (jax.lax.all_gather(x, "tp", tiled=True) * w[0] @ w)[None]

    for body, fused in ((per_device, 0), (replicated, 1)):
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"), check_vma=check_vma)
        rewrites_as_written(fn, (x, w), fused, "may differ between the devices of the gather's axes")


@pytest.mark.parametrize("check_vma", [False, True])
def test_a_cond_on_one_axis_keeps_the_collectives_of_another_fused(check_vma):
    """A predicate from ``axis_index("pp")`` (a pipeline stage) sends every
    device of a tp group down the same branch: the tp pairs inside fuse. One
    from ``axis_index("tp")`` may split a tp group: they stay as written,
    with check_vma's types or without (where only the body tells)."""
    mesh = make_mesh({"pp": 2, "tp": 4})
    rng = np.random.default_rng(8)
    x = jax.device_put(rng.standard_normal((4, 16, 32)).astype(np.float32), jax.NamedSharding(mesh, P("pp", "tp")))
    w = jax.device_put((rng.standard_normal((32, 32)) / 6).astype(np.float32), jax.NamedSharding(mesh, P(None, "tp")))

    def block(x, w, s):
        h = jnp.tanh(jax.lax.all_gather(x, "tp", axis=1, tiled=True) @ (s * w))
        return jax.lax.psum_scatter(h @ w.T, "tp", scatter_dimension=1, tiled=True)

    for axis, fused in (("pp", 4), ("tp", 0)):
        def body(x, w, axis=axis):
            return jax.lax.cond(jax.lax.axis_index(axis) % 2 == 1, lambda x, w: block(x, w, 1.0),
                                lambda x, w: block(x, w, -0.5), x, w)

        fn = jax.shard_map(body, mesh=mesh, in_specs=(P("pp", "tp"), P(None, "tp")), out_specs=P("pp", "tp"),
                           check_vma=check_vma)
        rewrites_as_written(fn, (x, w), fused, "may differ between the devices of mesh axes ('tp',)")
