"""A reshape between a collective and its dot that only merges the dot's free
dims (``all_gather(x, axis=1).reshape(-1, d) @ w``) or splits them
(``psum_scatter((h @ w).reshape(b, s, d), scatter_dimension=1)``): fused,
the dot taken on the regrouped operand (``_overlap/regroup.py``), with the
numbers of the program as written; reshapes that regroup anything else
stay as written, and the report says why. Also mixed precision's bf16
product widened to f32 before its sum, fused with f32 products."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import P, rewrites_as_written
from programs import make_mesh

import commfuse
from commfuse._overlap import regroup


def _placed(mesh, rng, shape, spec, dtype=np.float32):
    return jax.device_put(rng.standard_normal(shape).astype(dtype), jax.NamedSharding(mesh, spec))


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_sequence_gather_flattened_into_rows_fuses_with_each_dot(check_vma):
    """q, k, v from one flattened gather (three fused ops), and the output
    projection split back before the sequence reduce-scatter (a fourth)."""
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(1)
    b, s, d = 2, 16, 32
    x = _placed(mesh, rng, (b, s, d), P(None, "tp"))
    ws = [_placed(mesh, rng, (d, d), P(None, "tp")) for _ in range(3)]
    wo = _placed(mesh, rng, (d, d), P("tp"))

    def body(x, wq, wk, wv, wo):
        flat = jax.lax.all_gather(x, "tp", axis=1, tiled=True).reshape(-1, d)
        q, k, v = (flat @ w for w in (wq, wk, wv))
        y = (jax.nn.tanh(q) * k + v) @ wo
        return jax.lax.psum_scatter(y.reshape(b, s, d), "tp", scatter_dimension=1, tiled=True)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), *[P(None, "tp")] * 3, P("tp")),
                       out_specs=P(None, "tp"), check_vma=check_vma)
    rewrites_as_written(fn, (x, *ws, wo), 4)


def test_a_split_then_a_transpose_before_the_scatter():
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(2)
    h = _placed(mesh, rng, (24, 16), P(None, "tp"))
    w = _placed(mesh, rng, (16, 8), P("tp"))

    def body(h, w):
        y = (h @ w).reshape(3, 8, 8).transpose(1, 0, 2)  # [seq, batch, d]
        return jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp"))
    rewrites_as_written(fn, (h, w), 1)


def test_a_gathered_weight_whose_free_dims_are_merged():
    """FSDP: a rank-3 weight gathered over its contracted dim, heads and head
    dim merged into columns."""
    mesh = make_mesh({"fsdp": 4})
    rng = np.random.default_rng(3)
    x = _placed(mesh, rng, (8, 16), P())
    w = _placed(mesh, rng, (16, 2, 4), P("fsdp"))

    def body(x, w):
        return x @ jax.lax.all_gather(w, "fsdp", axis=0, tiled=True).reshape(16, 8)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("fsdp")), out_specs=P(), check_vma=False)
    rewrites_as_written(fn, (x, w), 1)


def test_a_merge_into_the_contracted_dim_splits_the_weights_rows_the_same_way():
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(4)
    x = _placed(mesh, rng, (4, 8, 2, 4), P(None, "tp"))
    w = _placed(mesh, rng, (8, 6), P())

    def body(x, w):  # heads and head dim merged, then contracted: x's two dims with w's rows as (2, 4)
        return jax.lax.all_gather(x, "tp", axis=1, tiled=True).reshape(4, 8, 8) @ w

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P()), out_specs=P(), check_vma=False)
    rewrites_as_written(fn, (x, w), 1)


def test_a_reshape_that_is_no_regrouping_stays_as_written():
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(5)
    x = _placed(mesh, rng, (2, 8, 6), P(None, "tp"))
    w = _placed(mesh, rng, (4, 5), P())

    def body(x, w):  # rows and features reshuffled: no dot of the gathered layout gives this
        return jax.lax.all_gather(x, "tp", axis=1, tiled=True).reshape(24, 4) @ w

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P()), out_specs=P(), check_vma=False)
    rewrites_as_written(fn, (x, w), 0, "used by reshape")


@pytest.mark.parametrize("before, after, groups", [
    ((2, 8, 16), (16, 16), [(0, 1), (2,)]),
    ((2, 1, 3), (2, 3), [(0,), (1, 2)]),
    ((4, 5), (4, 5), [(0,), (1,)]),
    ((2, 8, 6), (24, 4), None),
    ((6,), (2, 3), None),
    ((2, 3, 1), (6,), None),
])
def test_merged_groups(before, after, groups):
    assert regroup.merged_groups(before, after) == groups


def test_the_regrouped_dots_compute_the_reshaped_products():
    rng = np.random.default_rng(6)
    dn = (((1,), (0,)), ((), ()))
    lhs, rhs = rng.standard_normal((12, 5)), rng.standard_normal((5, 7))
    before = (3, 4, 5)
    l2, r2, dn2 = regroup.unmerged_dot(lhs.shape, rhs.shape, dn, (before, None))
    got = jax.lax.dot_general(lhs.reshape(l2), rhs.reshape(r2), dn2)
    np.testing.assert_allclose(np.asarray(got).reshape(12, 7), lhs @ rhs, rtol=1e-5)
    # A weight gradient: both operands' rows merged from (3, 4), contracted.
    dy = rng.standard_normal((12, 7))
    wgrad = (((0,), (0,)), ((), ()))
    l4, r4, dn4 = regroup.unmerged_dot(lhs.shape, dy.shape, wgrad, ((3, 4, 5), (3, 4, 7)))
    got = jax.lax.dot_general(lhs.reshape(l4), dy.reshape(r4), dn4)
    np.testing.assert_allclose(np.asarray(got), lhs.T @ dy, rtol=1e-5)
    # Merged on one side only: the other operand's rows are split the same way.
    l5, r5, dn5 = regroup.unmerged_dot(lhs.shape, dy.shape, wgrad, ((3, 4, 5), None))
    assert r5 == (3, 4, 7)
    got = jax.lax.dot_general(lhs.reshape(l5), dy.reshape(r5), dn5)
    np.testing.assert_allclose(np.asarray(got), lhs.T @ dy, rtol=1e-5)
    with pytest.raises(regroup.Unsupported, match="contracted"):
        regroup.unmerged_dot(lhs.shape, dy.shape, wgrad, ((3, 4, 5), (2, 6, 7)))
    after = (2, 6, 7)
    l3, r3, dn3 = regroup.split_dot(lhs.shape, rhs.shape, dn, after)
    got = jax.lax.dot_general(lhs.reshape(l3), rhs.reshape(r3), dn3)
    np.testing.assert_allclose(np.asarray(got), (lhs @ rhs).reshape(after), rtol=1e-5)


@pytest.mark.parametrize("collective", ["psum_scatter", "psum"])
def test_a_bf16_product_widened_to_f32_before_its_sum_fuses_with_f32_products(collective):
    """Mixed precision's ``(x @ w).astype(jnp.float32)`` before the sum: the
    fused op's products are f32, so its result is at least as close to the
    exact sum as the program's (whose bf16 products were rounded first)."""
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(7)
    x = _placed(mesh, rng, (16, 64), P(None, "tp"), jnp.bfloat16)
    w = _placed(mesh, rng, (64, 24), P("tp"), jnp.bfloat16)

    def body(x, w):
        y = (x @ w).astype(jnp.float32)
        if collective == "psum":
            return jax.lax.psum(y, "tp")
        return jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)

    out = P() if collective == "psum" else P("tp")
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=out, check_vma=False)
    rewritten = commfuse.overlap(fn, schedule="ring")
    got, written = (np.asarray(jax.jit(f)(x, w)) for f in (rewritten, fn))
    assert got.dtype == np.float32
    assert sum("convert to float32" in line and "rewrote" in line for line in rewritten.last_report) == 1
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    scale = np.abs(exact).max()
    assert np.abs(got - exact).max() <= np.abs(written - exact).max() + 1e-6 * scale
    np.testing.assert_allclose(got, written, atol=2e-2 * scale)


def test_a_bf16_gather_widened_to_f32_before_its_dot_stays_as_written():
    """Moving the cast before the gather would gather f32: twice the bytes
    the program moves."""
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(8)
    x = _placed(mesh, rng, (16, 32), P("tp"), jnp.bfloat16)
    w = _placed(mesh, rng, (32, 8), P(None, "tp"))

    def body(x, w):
        return jax.lax.all_gather(x, "tp", axis=0, tiled=True).astype(jnp.float32) @ w

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"), check_vma=False)
    rewrites_as_written(fn, (x, w), 0, "it would gather float32 where the program gathers bfloat16")


def test_a_norm_then_the_flattening_between_the_gather_and_its_dot():
    """Row-wise work (an RMS norm with a replicated scale) moves before the
    gather, and the merge of batch and sequence after it moves to the result."""
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(9)
    x = _placed(mesh, rng, (2, 16, 32), P(None, "tp"))
    g = _placed(mesh, rng, (32,), P())
    w = _placed(mesh, rng, (32, 16), P(None, "tp"))

    def body(x, g, w):
        xg = jax.lax.all_gather(x, "tp", axis=1, tiled=True)
        normed = xg * jax.lax.rsqrt(jnp.mean(xg * xg, axis=-1, keepdims=True) + 1e-6) * g
        return normed.reshape(-1, 32) @ w

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(), P(None, "tp")), out_specs=P(None, "tp"),
                       check_vma=False)
    rewrites_as_written(fn, (x, g, w), 1)


def test_a_widened_product_before_an_all_to_all_stays_as_written():
    """There is no sum to take in f32 there: the program's bf16 products stand."""
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(10)
    x = _placed(mesh, rng, (16, 32), P(), jnp.bfloat16)
    w = _placed(mesh, rng, (32, 16), P(), jnp.bfloat16)

    def body(x, w):
        return jax.lax.all_to_all((x @ w).astype(jnp.float32), "tp", 0, 1, tiled=True)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(None, "tp"), check_vma=False)
    rewrites_as_written(fn, (x, w), 0, "fused only for a 16-bit product then summed")


def test_the_backward_of_a_widened_sum_gathers_the_cotangent_narrowed_into_both_products():
    """The gradient of ``psum_scatter((h @ w).astype(f32))``: JAX gathers the
    f32 cotangent and casts it to bf16 for the two backward products. The
    cast moves before the gather (half the bytes) and each product is fused
    with the gather."""
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(11)
    x = _placed(mesh, rng, (16, 32), P("tp"), jnp.bfloat16)
    w1 = _placed(mesh, rng, (32, 64), P(None, "tp"), jnp.bfloat16)
    w2 = _placed(mesh, rng, (64, 32), P("tp"), jnp.bfloat16)

    def body(x, w1, w2):
        h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
        y = (jax.nn.gelu(h) @ w2).astype(jnp.float32)
        return jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"),
                       check_vma=False)
    grad = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2))
    rewritten = commfuse.overlap(grad, schedule="ring")
    for got, want in zip(jax.jit(rewritten)(x, w1, w2), jax.jit(grad)(x, w1, w2)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
    moved = [line for line in rewritten.last_report if "rewrote" in line and "row-wise ops (moved before it)" in line]
    assert len(moved) == 2 and all("float32[4,32] -> float32[16,32]" in line for line in moved), rewritten.last_report


def test_a_split_whose_outer_part_does_not_divide_by_the_axes_is_not_regrouped_onto():
    from commfuse._dot_form import Unsupported
    contract = (((2,), (0,)), ((), ()))
    # (h @ wv).reshape(b, s, kv, hd): the weight's columns split into 2 kv heads of 16.
    for bound, ok in ((1, True), (2, True), (8, False)):
        if ok:
            assert regroup.split_dot((2, 16, 64), (64, 32), contract, (2, 16, 2, 16), bound)[1] == (64, 2, 16)
        else:
            with pytest.raises(Unsupported, match="outer part 2 does not divide by 8"):
                regroup.split_dot((2, 16, 64), (64, 32), contract, (2, 16, 2, 16), bound)
    # The rows' split into batch x sequence is not the weight's: taken whatever the bound.
    assert regroup.split_dot((32, 64), (64, 32), (((1,), (0,)), ((), ())), (2, 16, 32), 8)[0] == (2, 16, 64)
    # The weight gradient of that projection, dv merged from (b, s, kv, hd):
    # its (kv, hd) columns are a split too; its (b, s) rows are not.
    weight_grad = (((0, 1), (0, 1)), ((), ()))
    with pytest.raises(Unsupported, match="outer part 2"):
        regroup.unmerged_dot((2, 16, 64), (2, 16, 32), weight_grad, [None, (2, 16, 2, 16)], 8)
    assert regroup.unmerged_dot((2, 16, 64), (2, 16, 32), weight_grad, [None, (2, 16, 2, 16)], 2)[1] == (2, 16, 2, 16)
    # x.reshape(-1, d) @ w: rows merged from batch x sequence, taken apart whatever the bound.
    assert regroup.unmerged_dot((32, 64), (64, 8), (((1,), (0,)), ((), ())), [(2, 16, 64), None], 8)[0] == (2, 16, 64)
