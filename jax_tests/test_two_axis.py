"""The two-axis fused op, ``all_gather_matmul_reduce_scatter``:

    psum_scatter(x @ all_gather(w, A, axis=1, tiled=True), B, scatter_dimension=0, tiled=True)

over meshes of two axes (A, B), every schedule, against the literal jax.lax
expression and a float64 numpy model on random operands; its gradients
against jax.lax's; the compiled program (one fused call, none of XLA's
gathers or reduce-scatters under "ring"); and the errors that name the
argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import commfuse
from conftest import P, assert_close, rand
from programs import collectives, make_mesh

OP = commfuse.all_gather_matmul_reduce_scatter


def lax_two_axis(x, w, gather_axis, scatter_axis):
    gathered = jax.lax.all_gather(w, gather_axis, axis=1, tiled=True)
    return jax.lax.psum_scatter(x @ gathered, scatter_axis, scatter_dimension=0, tiled=True)


def _case(shape, m, k, n, dtype, seed=0, lead=()):
    """A mesh of `shape` (A, B), global x [F*m, *lead, k] (rows over A,
    contraction over B) and w [k, n] (rows over B, columns over A)."""
    f, t = shape
    mesh = make_mesh({"A": f, "B": t})
    x = rand((f * m, *lead, k), dtype, seed=seed)
    w = rand((k, n), dtype, seed=seed + 1)
    x_spec = P("A", *([None] * len(lead)), "B")
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    ws = jax.device_put(w, NamedSharding(mesh, P("B", "A")))
    spec = dict(mesh=mesh, in_specs=(x_spec, P("B", "A")), out_specs=P(("A", "B")))
    return mesh, x, w, xs, ws, spec


def _model(x, w):
    """What the devices hold, concatenated along dim 0 in (A, B) order: each
    A-row of x's rows times the whole w, its rows split over B in order."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("schedule,slices", [("ring", None), ("sequential", None), ("auto", None),
                                             ("unfused", None), ("ring", 3), ("auto", 2)])
@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 2), (3, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
def test_matches_jax_lax_and_the_model(shape, dtype, schedule, slices):
    f, t = shape
    mesh, x, w, xs, ws, spec = _case(shape, 4 * t, 8 * t, 6 * f, dtype, seed=f * 10 + t)
    op = lambda a, b: OP(a, b, "A", "B", schedule=schedule, slices=slices)  # noqa: E731
    fused = jax.jit(jax.shard_map(op, **spec))(xs, ws)
    plain = jax.jit(jax.shard_map(lambda a, b: lax_two_axis(a, b, "A", "B"), **spec))(xs, ws)
    assert fused.shape == plain.shape == (f * 4 * t, 6 * f)
    assert_close(np.asarray(fused), np.asarray(plain), dtype)
    assert_close(np.asarray(fused), _model(x, w), dtype)


def test_rows_of_a_rank_3_x_and_gradients_match_jax_lax():
    mesh, x, w, xs, ws, spec = _case((2, 4), 4, 16, 10, np.float32, seed=3, lead=(3,))
    spec = dict(spec, in_specs=(P("A", None, "B"), P("B", "A")))

    def loss(op):
        return lambda a, b: jnp.sum(jnp.sin(jax.shard_map(op, **spec)(a, b)))

    fused = lambda a, b: OP(a, b, "A", "B", schedule="ring")  # noqa: E731
    plain = lambda a, b: lax_two_axis(a, b, "A", "B")  # noqa: E731
    out = jax.jit(jax.shard_map(fused, **spec))(xs, ws)
    assert out.shape == (2 * 4, 3, 10)
    assert_close(np.asarray(out), np.asarray(jax.jit(jax.shard_map(plain, **spec))(xs, ws)), np.float32)
    got = jax.jit(jax.grad(loss(fused), argnums=(0, 1)))(xs, ws)
    want = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(xs, ws)
    for g, w_ in zip(got, want):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)


@pytest.mark.parametrize("slices", [None, 2])
def test_vmap_over_x_matches_jax_lax(slices):
    # No fused form batches this kind: jax.lax's collectives and dot, batched,
    # laid out as the library lays out the (sliced) call it stands in for.
    mesh, x, w, xs, ws, spec = _case((2, 2), 4, 8, 4, np.float32, seed=5)
    batch = jax.device_put(np.stack([x, 2 * x + 1]), NamedSharding(mesh, P(None, "A", "B")))
    spec = dict(spec, in_specs=(P(None, "A", "B"), P("B", "A")), out_specs=P(None, ("A", "B")))

    def batched(op):
        return jax.jit(jax.shard_map(lambda a, b: jax.vmap(op, in_axes=(0, None))(a, b), **spec))

    fused = batched(lambda a, b: OP(a, b, "A", "B", schedule="ring", slices=slices))(batch, ws)
    plain = batched(lambda a, b: lax_two_axis(a, b, "A", "B"))(batch, ws)
    assert_close(np.asarray(fused), np.asarray(plain), np.float32)


def test_ring_leaves_xla_no_gather_or_reduce_scatter():
    mesh, x, w, xs, ws, spec = _case((2, 4), 8, 32, 12, np.float32)
    text = jax.jit(jax.shard_map(lambda a, b: OP(a, b, "A", "B", schedule="ring"), **spec)).lower(xs, ws) \
        .compile().as_text()
    assert collectives(text) == {"commfuse": 1}, collectives(text)
    plain = jax.jit(jax.shard_map(lambda a, b: lax_two_axis(a, b, "A", "B"), **spec)).lower(xs, ws) \
        .compile().as_text()
    assert collectives(plain).get("all-gather") and collectives(plain).get("reduce-scatter"), collectives(plain)


@pytest.mark.parametrize("schedule", ["ring", "unfused"])
def test_the_gradient_runs_its_reduce_scatter_and_a_gather_inside_fused_ops(schedule):
    # dx gathers dy's rows over B inside all_gather_matmul, dw reduce-scatters
    # its columns over A inside matmul_reduce_scatter; XLA gathers w's
    # columns (for dx) and dy's rows (for dw). Unfused: jax.lax's own.
    mesh, x, w, xs, ws, spec = _case((2, 4), 8, 32, 12, np.float32, seed=9)
    f = jax.shard_map(lambda a, b: OP(a, b, "A", "B", schedule=schedule), **spec)
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), argnums=(0, 1)))
    counts = collectives(grad.lower(xs, ws).compile().as_text())
    if schedule == "ring":
        assert counts == {"all-gather": 2, "commfuse": 3}, counts
    else:
        assert counts == {"all-gather": 2, "reduce-scatter": 2}, counts
    plain = jax.shard_map(lambda a, b: lax_two_axis(a, b, "A", "B"), **spec)
    want = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(plain(a, b))), argnums=(0, 1)))(xs, ws)
    for g, w_ in zip(grad(xs, ws), want):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)


def _errors(mesh_shape, x_shape, w_shape, in_specs, *args, **kwargs):
    mesh = make_mesh(dict(zip(("A", "B"), mesh_shape)))
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32, sharding=NamedSharding(mesh, in_specs[0]))
    w = jax.ShapeDtypeStruct(w_shape, jnp.float32, sharding=NamedSharding(mesh, in_specs[1]))
    f = jax.shard_map(lambda a, b: OP(a, b, *args, **kwargs), mesh=mesh, in_specs=in_specs, out_specs=P(("A", "B")))
    return jax.jit(f).trace(x, w)


@pytest.mark.parametrize("args,kwargs,match", [
    (("A", "A"), {}, "gather_axis and scatter_axis must be two mesh axes"),
    (("A", "B"), {"schedule": "bidirectional"}, "schedule 'bidirectional' does not exist"),
    (("A", "B"), {"schedule": "tiled"}, "schedule 'tiled' does not exist"),
    (("A", "C"), {}, "unknown scatter_axis 'C'"),
    (("Z", "B"), {}, "unknown gather_axis 'Z'"),
    ((("A",), "B"), {}, "gather_axis must name one mesh axis"),
])
def test_bad_arguments_are_named(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _errors((2, 2), (8, 8), (8, 8), (P("A", "B"), P("B", "A")), *args, **kwargs)


def test_rows_that_do_not_divide_over_the_scatter_axis_are_an_error():
    # 2 rows per device (x [4, 8] over A = 2), scattered over B = 4.
    with pytest.raises(ValueError, match="x's leading dim .* divisible by the size of scatter_axis 'B' .4."):
        _errors((2, 4), (4, 8), (8, 8), (P("A", "B"), P("B", "A")), "A", "B", schedule="ring")


# --------------------------------------------------------------------------
# Reached by overlap from the jax.lax expression
# --------------------------------------------------------------------------
def _fsdp_tp_layer(scatter_dimension):
    """psum_scatter(x @ all_gather(w, A, axis=1), B) as a user writes it, x
    of rank 3 (batch, sequence, contraction), scattered over B along the
    batch (0) or the sequence (1)."""
    mesh, x, w, xs, ws, spec = _case((2, 4), 4, 16, 6, np.float32, seed=21, lead=(8,))
    x_spec = P("A", None, "B")
    out_spec = P(("A", "B")) if scatter_dimension == 0 else P("A", "B")

    def layer(a, b):
        gathered = jax.lax.all_gather(b, "A", axis=1, tiled=True)
        return jax.lax.psum_scatter(a @ gathered, "B", scatter_dimension=scatter_dimension, tiled=True)

    f = jax.shard_map(layer, mesh=mesh, in_specs=(x_spec, P("B", "A")), out_specs=out_spec)
    return f, jax.device_put(x, NamedSharding(mesh, x_spec)), ws


@pytest.mark.parametrize("scatter_dimension", [0, 1])
@pytest.mark.parametrize("schedule", ["ring", "sequential"])
def test_overlap_runs_a_gather_dot_and_reduce_scatter_as_one_op(schedule, scatter_dimension):
    f, xs, ws = _fsdp_tp_layer(scatter_dimension)
    ov = commfuse.overlap(f, schedule=schedule)
    assert_close(np.asarray(jax.jit(ov)(xs, ws)), np.asarray(jax.jit(f)(xs, ws)), np.float32)
    assert collectives(jax.jit(ov).lower(xs, ws).compile().as_text()) == {"commfuse": 1}
    rewrote = [line for line in ov.last_report if "]: rewrote " in line]
    assert len(rewrote) == 1 and "commfuse.all_gather_matmul_reduce_scatter(" in rewrote[0] \
        and f"schedule={schedule!r}" in rewrote[0], ov.last_report
    assert ("moved first" in rewrote[0]) == (scatter_dimension == 1), rewrote[0]
    # Differentiated through the op's VJP, and the differentiated program rewritten.
    loss = lambda g: lambda a, b: jnp.sum(jnp.sin(g(a, b)))  # noqa: E731
    want = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(xs, ws)
    got = jax.jit(jax.grad(loss(ov), argnums=(0, 1)))(xs, ws)
    rewritten = jax.jit(commfuse.overlap(jax.grad(loss(f), argnums=(0, 1)), schedule=schedule))(xs, ws)
    for g, r, w_ in zip(got, rewritten, want):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)
        assert_close(np.asarray(r), np.asarray(w_), np.float32)


def test_overlap_says_why_a_schedule_the_op_lacks_keeps_one_side():
    f, xs, ws = _fsdp_tp_layer(0)
    ov = commfuse.overlap(f, schedule="bidirectional")
    assert_close(np.asarray(jax.jit(ov)(xs, ws)), np.asarray(jax.jit(f)(xs, ws)), np.float32)
    assert not any("all_gather_matmul_reduce_scatter(" in line for line in ov.last_report), ov.last_report
    assert any("not one op over both axes: it has no 'bidirectional' schedule" in line
               for line in ov.last_report), ov.last_report


def test_the_cost_model_orders_the_op_over_both_axes_by_its_time(monkeypatch):
    from commfuse import _both_sides, _explain
    from commfuse._decide import Machine

    shapes = ("matmul_all_gather", (256, 64), (64, 32), 2, 1, "psum_scatter", 4, (256, 64), (64, 64), 4,
              np.dtype(np.float32))
    order, why = _both_sides.choose(*shapes, Machine("h100_nvlink"), False)
    assert sorted(order) == ["gather", "reduce", "tiles"], order
    # The op over both axes, as its library call: w [64, 32] gathered over F = 2, x [256, 64].
    both = ("all_gather_matmul_reduce_scatter", (256, 64), (64, 32), 2)
    order, why = _both_sides.choose(*shapes, Machine("h100_nvlink"), False, two_axis=both)
    assert sorted(order) == ["gather", "reduce", "tiles", "two_axis"] and "two_axis" in why
    # Its prediction cut to nothing or made the slowest moves it first or last.
    predict = _explain.predict
    for scale, place in ((0.0, 0), (1e6, -1)):
        def scaled(op, *args, scale=scale, **kwargs):
            out = predict(op, *args, **kwargs)
            if op == "all_gather_matmul_reduce_scatter":
                out = dict(out, schedules={k: v * scale for k, v in out["schedules"].items()})
            return out

        monkeypatch.setattr(_both_sides._explain, "predict", scaled)
        order, _ = _both_sides.choose(*shapes, Machine("h100_nvlink"), False, two_axis=both)
        assert order[place] == "two_axis", order


def test_overlap_runs_bf16_with_a_float32_product_as_the_op():
    # Mixed precision as written: bf16 operands, the dot's product in float32.
    mesh, x, w, xs, ws, spec = _case((2, 4), 4, 16, 6, jnp.bfloat16, seed=23, lead=(8,))
    spec = dict(spec, in_specs=(P("A", None, "B"), P("B", "A")), out_specs=P("A", "B"))

    def layer(a, b):
        product = jnp.matmul(a, jax.lax.all_gather(b, "A", axis=1, tiled=True), preferred_element_type=jnp.float32)
        return jax.lax.psum_scatter(product, "B", scatter_dimension=1, tiled=True)

    f = jax.shard_map(layer, **spec)
    xs = jax.device_put(x, NamedSharding(mesh, P("A", None, "B")))
    ov = commfuse.overlap(f, schedule="ring")
    got, want = jax.jit(ov)(xs, ws), jax.jit(f)(xs, ws)
    assert got.dtype == want.dtype == jnp.float32
    assert_close(np.asarray(got), np.asarray(want), np.float32, rtol=1e-5)
    assert any("all_gather_matmul_reduce_scatter(" in line for line in ov.last_report), ov.last_report


def test_a_decision_imposed_for_the_op_runs_under_any_schedule():
    f, xs, ws = _fsdp_tp_layer(1)
    ring = commfuse.overlap(f, schedule="ring")
    jax.jit(ring)(xs, ws)
    for schedule in ("auto", "bidirectional"):
        imposed = commfuse.overlap(f, schedule=schedule, decisions=ring.last_decisions)
        assert_close(np.asarray(jax.jit(imposed)(xs, ws)), np.asarray(jax.jit(f)(xs, ws)), np.float32)
        assert collectives(jax.jit(imposed).lower(xs, ws).compile().as_text()) == {"commfuse": 1}
        assert any("all_gather_matmul_reduce_scatter(" in line for line in imposed.last_report), imposed.last_report


def test_auto_times_the_op_where_the_weight_cannot_be_tiled():
    # w's 3 local columns split into neither 4 nor 2 tiles: the op over both
    # axes is still timed against fusing one side, and the report says so.
    mesh, x, w, xs, ws, spec = _case((2, 4), 4, 16, 3 * 2, np.float32, seed=29)
    f = jax.shard_map(lambda a, b: lax_two_axis(a, b, "A", "B"), **spec)
    ov = commfuse.overlap(f, schedule="auto")
    assert_close(np.asarray(jax.jit(ov)(xs, ws)), np.asarray(jax.jit(f)(xs, ws)), np.float32)
    report = "\n".join(ov.last_report)
    assert "two_axis" in report and "tiles" not in report.split("predicted")[-1].split("(")[0], report


def test_auto_under_jit_picks_the_op_where_the_cost_model_says_it_pays():
    # An FSDP x TP row-parallel product planned for H100s (compiled here on
    # CPU devices, never run): x [4096 rows, 4096] and w [4096, 512] per
    # device over fsdp 4 x tp 2, where the model times the op below XLA's
    # gather then the fused reduce-scatter (and a smaller one where it does not).
    mesh = make_mesh({"fsdp": 4, "tp": 2})

    def layer(h, w):
        y = h @ w
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("fsdp", "tp", None)))

    def compiled(b, s, k, c):
        h = jax.ShapeDtypeStruct((4 * b, s, 2 * k), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None, "tp")))
        w = jax.ShapeDtypeStruct((2 * k, 4 * c), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp", "fsdp")))
        ov = commfuse.overlap(layer, schedule="auto", machine="h100_nvlink")
        jax.jit(ov).lower(h, w).compile()
        return "\n".join(ov.last_report)

    report = compiled(2, 2048, 4096, 512)
    assert "all_gather_matmul_reduce_scatter over ('fsdp', 'tp'), dimension 1" in report, report
    report = compiled(2, 2048, 1024, 2048)
    assert "matmul_reduce_scatter over ('tp',)" in report and "not one op over both axes: the cost model" in report, \
        report
