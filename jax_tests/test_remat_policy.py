"""Fused ops under ``jax.checkpoint`` with JAX's dot policies: saved where the
dot they replace would be (``commfuse.checkpoint_policy``, which
``commfuse.overlap`` applies), so the backward pass does not run them, and
their collectives, again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commfuse
from conftest import P
from programs import make_mesh

TARGET = 'custom_call_target="commfuse_collective_matmul'
LAYERS, B, S, D, F, TP = 2, 2, 16, 32, 64, 4


def _stack(policy, named: bool):
    """A scanned stack of remat'ed Megatron TP+SP MLP layers: the loss of a shard_map."""
    def layer(x, w):
        w1, w2 = w
        if named:
            h = commfuse.all_gather_matmul(x, w1, "tp", gather_dimension=1, schedule="ring")
            y = commfuse.matmul_reduce_scatter(jax.nn.silu(h), w2, "tp", scatter_dimension=1, schedule="ring")
        else:
            h = jnp.einsum("bsd,df->bsf", jax.lax.all_gather(x, "tp", axis=1, tiled=True), w1)
            y = jax.lax.psum_scatter(jnp.einsum("bsf,fd->bsd", jax.nn.silu(h), w2), "tp", scatter_dimension=1,
                                     tiled=True)
        return x + y, None

    def body(x, w1s, w2s):
        out, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, (w1s, w2s))
        return jax.lax.psum(jnp.sum(out ** 2), "tp") / (B * S * D)

    mesh = make_mesh({"tp": TP})
    specs = (P(None, "tp"), P(None, None, "tp"), P(None, "tp", None))
    loss = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    rng = np.random.default_rng(5)
    shapes = ((B, S, D), (LAYERS, D, F), (LAYERS, F, D))
    args = [jax.device_put((rng.standard_normal(s) * (1 if i == 0 else s[1] ** -0.5)).astype(np.float32),
                           jax.NamedSharding(mesh, spec)) for i, (s, spec) in enumerate(zip(shapes, specs))]
    return loss, args


def _close(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def _fused_calls(fn, args) -> int:
    return jax.jit(fn).lower(*args).compile().as_text().count(TARGET)


def test_overlap_saves_fused_ops_where_a_dot_policy_saves_dots():
    plain, args = _stack(jax.checkpoint_policies.checkpoint_dots, named=False)
    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(*args)
    grad = jax.value_and_grad(commfuse.overlap(plain, schedule="ring"), argnums=(0, 1, 2))
    _close(jax.jit(grad)(*args), want, 2e-5)
    saved = _fused_calls(grad, args)
    # Nothing saved: the backward pass runs the forward's gather-and-multiply again.
    nothing, _ = _stack(jax.checkpoint_policies.nothing_saveable, named=False)
    again = _fused_calls(jax.value_and_grad(commfuse.overlap(nothing, schedule="ring"), argnums=(0, 1, 2)), args)
    assert saved < again, (saved, again)


@pytest.mark.parametrize("policy", ["checkpoint_dots", "dots_with_no_batch_dims_saveable"])
def test_named_fused_ops_are_saved_under_the_wrapped_policy(policy):
    policy = getattr(jax.checkpoint_policies, policy)
    loss, args = _stack(policy, named=True)
    wrapped, _ = _stack(commfuse.checkpoint_policy(policy), named=True)
    grads = [jax.value_and_grad(f, argnums=(0, 1, 2)) for f in (loss, wrapped)]
    _close(jax.jit(grads[1])(*args), jax.jit(grads[0])(*args), 1e-6)
    assert _fused_calls(grads[1], args) < _fused_calls(grads[0], args)
    assert commfuse.checkpoint_policy(None) is None


def test_a_policy_reading_the_dots_parameters_gets_them():
    """A policy written against dot_general's parameters (saving only dots
    without a result sharding, say) reads them off the fused op too."""
    def unsharded_dots(prim, *_, **params):
        return prim is jax.lax.dot_general_p and params["out_sharding"] is None \
            and params["preferred_element_type"] is None

    loss, args = _stack(commfuse.checkpoint_policy(unsharded_dots), named=True)
    plain, _ = _stack(unsharded_dots, named=False)
    grads = [jax.value_and_grad(f, argnums=(0, 1, 2)) for f in (loss, plain)]
    _close(jax.jit(grads[0])(*args), jax.jit(grads[1])(*args), 2e-5)
    nothing, _ = _stack(jax.checkpoint_policies.nothing_saveable, named=True)
    assert _fused_calls(grads[0], args) < _fused_calls(jax.value_and_grad(nothing, argnums=(0, 1, 2)), args)


def _raising_policy(prim, *_, **params):
    raise RuntimeError("a policy that cannot answer")


def _offloading(*names):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names), offload_src="device",
        offload_dst="pinned_host")


@pytest.mark.parametrize("policy, fused", [
    (jax.checkpoint_policies.save_only_these_names(), 1),
    (jax.checkpoint_policies.save_only_these_names("xg"), 0),
    (_offloading("other"), 1),   # answers JAX's `Recompute` for "xg", not a bool
    (_offloading("xg"), 0),      # `Offloadable`: kept too
    (_raising_policy, 0),        # cannot say: as if it saved the name
], ids=["saves-nothing", "saves-xg", "offloads-other", "offloads-xg", "raises"])
def test_a_named_gathered_activation_fuses_unless_the_policy_saves_it(policy, fused):
    """``checkpoint_name(all_gather(x), "xg") @ w`` inside ``jax.checkpoint``:
    the name is an identity, so the pair fuses, unless the policy saves that
    name (the program then keeps the gathered value for the backward pass,
    which fusing would take away: it stays as written)."""
    from jax.ad_checkpoint import checkpoint_name

    mesh = make_mesh({"tp": TP})
    rng = np.random.default_rng(4)
    x = jax.device_put(rng.standard_normal((S, D)).astype(np.float32), jax.NamedSharding(mesh, P("tp")))
    w = jax.device_put(rng.standard_normal((D, F)).astype(np.float32), jax.NamedSharding(mesh, P(None, "tp")))

    def layer(x, w):
        xg = checkpoint_name(jax.lax.all_gather(x, "tp", axis=0, tiled=True), "xg")
        return jnp.sum(jnp.tanh(xg @ w) ** 2)

    body = jax.checkpoint(layer, policy=policy)
    loss = jax.shard_map(lambda x, w: jax.lax.psum(body(x, w), "tp"), mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                         out_specs=P(), check_vma=False)
    rewritten = commfuse.overlap(loss, schedule="ring")
    np.testing.assert_allclose(np.asarray(jax.jit(rewritten)(x, w)), np.asarray(jax.jit(loss)(x, w)), rtol=1e-5)
    report = "\n".join(rewritten.last_report)
    assert report.count("rewrote") == fused, report
    if not fused:
        assert "an enclosing checkpoint policy saves the value it names ('xg')" in report, report
    if policy is not _raising_policy:  # JAX's own gradient consults the policy, and raises with it
        grads = jax.jit(jax.grad(rewritten, argnums=(0, 1)))(x, w)
        for got, want in zip(grads, jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
