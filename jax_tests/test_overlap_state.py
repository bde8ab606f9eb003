"""What a function does besides returning values happens as well through
``commfuse.overlap``: in-place updates of its arguments (Flax NNX modules and
optimizers, dicts), ``jax.Ref`` updates, RNG state, callbacks; what cannot be
carried is a clear error naming the argument."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import commfuse
from commfuse._overlap.inplace import InPlaceUpdateError


def _x(seed=0, shape=(8, 16)):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# ----------------------------------------------------------------------------
# Flax NNX: the model and optimizer updated in place by the step
# ----------------------------------------------------------------------------
def _nnx_block():
    nnx = pytest.importorskip("flax.nnx", reason="needs flax (the `test` extra installs it)")
    optax = pytest.importorskip("optax", reason="needs optax (the `test` extra installs it)")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 32, rngs=rngs)
            self.down = nnx.Linear(32, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.calls[...] += 1
            return self.down(self.drop(jax.nn.gelu(self.up(x))))

    def step(model, opt, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    def fresh():
        model = Block(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    return nnx, step, fresh


@pytest.mark.parametrize("wrap", ["nnx.jit(overlap(step))", "overlap(step)", "overlap(nnx.jit(step))"])
def test_an_nnx_train_step_learns_through_overlap_as_without_it(wrap):
    nnx, step, fresh = _nnx_block()
    x = _x()
    y = jnp.sin(x)
    runs = {}
    for name in ("plain", wrap):
        model, opt = fresh()
        fn = {"plain": nnx.jit(step), "nnx.jit(overlap(step))": nnx.jit(commfuse.overlap(step)),
              "overlap(step)": commfuse.overlap(step),
              "overlap(nnx.jit(step))": commfuse.overlap(nnx.jit(step))}[name]
        losses = [float(fn(model, opt, x, y)) for _ in range(4)]
        runs[name] = (losses, np.asarray(model.up.kernel[...]), int(model.calls[...]), int(opt.step[...]))
    plain, fused = runs["plain"], runs[wrap]
    assert plain[0][-1] < plain[0][0]  # the plain step learns
    np.testing.assert_allclose(fused[0], plain[0], rtol=1e-5)  # the same loss curve, dropout's RNG included
    np.testing.assert_allclose(fused[1], plain[1], rtol=1e-5, atol=1e-7)
    assert fused[2] == plain[2] == 4 and fused[3] == plain[3] == 4


# ----------------------------------------------------------------------------
# jax.Ref, containers, callbacks
# ----------------------------------------------------------------------------
def test_ref_arguments_and_closed_over_refs_are_updated():
    x = _x(shape=(2, 3))
    ref = jax.new_ref(jnp.zeros(3))
    closed = jax.new_ref(jnp.zeros(3))

    def f(r, x):
        r[...] = r[...] + x.sum(0)
        closed[...] += 2 * x.sum(0)
        return x * 2

    out = commfuse.overlap(f)(ref, x)
    jax.jit(commfuse.overlap(f))(ref, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * 2)
    np.testing.assert_allclose(np.asarray(ref[...]), 2 * np.asarray(x).sum(0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(closed[...]), 4 * np.asarray(x).sum(0), rtol=1e-6)


def test_dict_and_list_entries_updated_in_place_are_written_back_when_called_bare():
    x = _x(shape=(2, 3))
    state = {"seen": jnp.zeros(3), "history": [jnp.zeros(()), jnp.zeros(())]}

    def f(state, x):
        state["seen"] = state["seen"] + x.sum(0)
        state["history"][1] = x.max()
        return x.mean()

    out = commfuse.overlap(f)(state, x)
    assert float(out) == pytest.approx(float(np.asarray(x).mean()), rel=1e-6)
    np.testing.assert_allclose(np.asarray(state["seen"]), np.asarray(x).sum(0), rtol=1e-6)
    assert float(state["history"][1]) == pytest.approx(float(np.asarray(x).max()))
    # Under jax.jit the function mutates jit's own copy, as it would without overlap.
    before = np.asarray(state["seen"])
    jax.jit(commfuse.overlap(f))(state, x)
    np.testing.assert_array_equal(np.asarray(state["seen"]), before)


def test_callbacks_and_debug_prints_run_in_order_every_call(capfd):
    seen = []

    def f(x):
        jax.debug.print("total {t}", t=x.sum())
        io_callback(lambda v: seen.append(float(v)), None, x.sum(), ordered=True)
        io_callback(lambda v: seen.append(-float(v)), None, x.max(), ordered=True)
        return x + 1

    x = _x(shape=(2, 3))
    fused = commfuse.overlap(f)
    fused(x)
    fused(x)
    jax.effects_barrier()
    total, top = float(np.asarray(x).sum()), float(np.asarray(x).max())
    assert seen == pytest.approx([total, -top, total, -top], rel=1e-6)
    assert capfd.readouterr().out.count("total ") == 2


# ----------------------------------------------------------------------------
# What cannot be carried: refused, naming the argument
# ----------------------------------------------------------------------------
def test_a_changed_static_leaf_is_refused_naming_it():
    def f(config, x):
        config["steps"] = config["steps"] + 1
        return x

    with pytest.raises(InPlaceUpdateError, match=r"args\[0\]\['steps'\] in place from 1 to 2"):
        commfuse.overlap(f)({"steps": 1}, _x())


def test_a_changed_structure_is_refused_naming_what_changed():
    def f(state, x):
        state["new"] = x
        return x

    with pytest.raises(InPlaceUpdateError, match=r"added \[\"args\[0\]\['new'\]\"\]"):
        commfuse.overlap(f)({"old": _x()}, _x())


def test_updates_through_tuples_rebuild_them_and_immutable_roots_are_refused():
    def f(d, x):
        d["pair"] = (d["pair"][0] + 1, d["pair"][1])  # a new tuple of the same structure
        return x

    d = {"pair": (jnp.zeros(2), jnp.ones(2))}
    commfuse.overlap(f)(d, _x())
    np.testing.assert_array_equal(np.asarray(d["pair"][0]), np.ones(2))
    np.testing.assert_array_equal(np.asarray(d["pair"][1]), np.ones(2))

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        table: dict

    def g(frozen, x):
        frozen.table["w"] = frozen.table["w"] * 2  # the dict inside a frozen dataclass is still mutable
        return x

    frozen = Frozen({"w": jnp.ones(2)})
    commfuse.overlap(g)(frozen, _x())
    np.testing.assert_array_equal(np.asarray(frozen.table["w"]), 2 * np.ones(2))

    def h(pair, x):
        pair[0]["w"] = pair[0]["w"] + 1  # fine: a dict inside a tuple argument
        return x

    pair = ({"w": jnp.zeros(2)},)
    commfuse.overlap(h)(pair, _x())
    np.testing.assert_array_equal(np.asarray(pair[0]["w"]), np.ones(2))


def test_a_variable_tied_between_two_places_stays_one_variable():
    """Tied embeddings: an update through one place is seen through the
    other, and both places' gradients reach it, as without overlap."""
    nnx = pytest.importorskip("flax.nnx", reason="needs flax (the `test` extra installs it)")

    class Tied(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.ones(3))
            self.b = self.a

    def bump(m, x):
        m.a[...] += x
        return m.b[...].sum()

    def sgd(m, x):
        grads = nnx.grad(lambda m: jnp.sum(m.a[...] * x) + jnp.sum(m.b[...] * x))(m)
        nnx.update(m, jax.tree.map(lambda p, g: p - g, nnx.state(m, nnx.Param), grads))

    for fn in (bump, sgd):
        results = []
        for wrap in (nnx.jit, lambda f: nnx.jit(commfuse.overlap(f)), commfuse.overlap):
            m = Tied()
            out = wrap(fn)(m, jnp.ones(3))
            assert m.b is m.a
            results.append((None if out is None else float(out), np.asarray(m.a[...])))
        for got in results[1:]:
            assert got[0] == results[0][0]
            np.testing.assert_array_equal(got[1], results[0][1])


def test_a_later_call_with_other_shapes_does_not_reuse_an_earlier_traces_updates():
    def f(x, d):
        if x.shape[0] == 4:
            d["a"] = d["a"] + 1
        else:
            d["b"] = d["b"] + 100
        return x.shape[0]

    g = commfuse.overlap(f)
    d = {"a": jnp.zeros(()), "b": jnp.ones(())}
    assert [g(jnp.ones(4), d), g(jnp.ones(8), d), g(jnp.ones(4), d)] == [4, 8, 4]
    assert (float(d["a"]), float(d["b"])) == (2.0, 101.0)


def test_one_object_passed_as_two_arguments_is_read_and_updated_as_without_overlap():
    def read(a, b):
        return a["w"] + b["w"]

    def bump(a, b):
        a["w"] = a["w"] * 2  # seen through `b` too: it is the same dict
        return b["w"]

    d = {"w": jnp.ones(3)}
    for wrap in (commfuse.overlap, lambda f: jax.jit(commfuse.overlap(f))):
        np.testing.assert_array_equal(np.asarray(wrap(read)(d, d)), 2 * np.ones(3))
    np.testing.assert_array_equal(np.asarray(commfuse.overlap(bump)(d, d)), 2 * np.ones(3))
    np.testing.assert_array_equal(np.asarray(d["w"]), 2 * np.ones(3))


def test_a_pytree_node_registered_without_keys_is_an_argument_like_any_other():
    """``register_pytree_node`` gives its children no key paths (Equinox's
    ``nn.State`` is one): nothing under it can be tied or written back, and
    a function that only reads it runs."""
    class Box:
        def __init__(self, items):
            self.items = items

    jax.tree_util.register_pytree_node(Box, lambda b: ((b.items,), None), lambda _, c: Box(c[0]))

    def f(box, x):
        return x * box.items[0] + box.items[1]

    box, x = Box((jnp.full(3, 2.0), jnp.ones(3))), jnp.arange(3.0)
    want = np.asarray(f(box, x))
    np.testing.assert_array_equal(np.asarray(commfuse.overlap(f)(box, x)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(commfuse.overlap(f))(box, x)), want)


def test_the_wrapper_does_not_take_a_jitted_functions_own_methods():
    """``overlap(jax.jit(f))`` is a plain function: a copied ``lower`` would
    lower the program without the rewrite."""
    jitted = jax.jit(lambda x: x * 2)
    wrapped = commfuse.overlap(jitted)
    assert not hasattr(wrapped, "lower")
    assert wrapped.__name__ == jitted.__name__
    np.testing.assert_array_equal(np.asarray(wrapped(jnp.ones(2))), 2 * np.ones(2))


def test_a_python_number_that_changes_between_calls_is_traced_not_compiled_again():
    """A learning rate from a schedule or a step count, passed as a Python
    number to ``overlap(step)`` called directly: traced once it changes, as
    ``jax.jit`` traces it, so each new value does not trace and compile the
    step again; one that shapes the program (a Python ``if``) stays static."""
    traces = []

    def step(w, x, lr, t):
        traces.append(None)
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - lr / (1 + t) * g, loss

    w, x = _x(1, (16, 8)), _x(2, (4, 16))
    fused, plain = commfuse.overlap(step), jax.jit(step)
    for i in range(6):
        lr, t = 1e-2 * (i + 1), i
        got, want = fused(w, x, lr, t), plain(w, x, lr, t)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
    assert len(traces) == 3, len(traces)  # plain jit once; overlap at the first value and the second (traced)

    def gated(x, scale):
        return x * scale if scale > 0 else x  # a Python `if` on the number: it must stay static

    g = commfuse.overlap(gated)
    for scale in (2.0, -1.0, 3.0):
        np.testing.assert_array_equal(np.asarray(g(x, scale)), np.asarray(gated(x, scale)))


def test_a_direct_calls_program_and_its_errors_carry_the_functions_name():
    def train_step(x, w):
        return jnp.tanh(x @ w)

    devices = jax.devices()
    x, w = jax.device_put(_x(3, (4, 8)), devices[0]), jax.device_put(_x(4, (8, 2)), devices[1])
    with pytest.raises(ValueError, match=r"argument arrays\[0\] of train_step .* argument arrays\[1\] of train_step"):
        commfuse.overlap(train_step)(x, w)
