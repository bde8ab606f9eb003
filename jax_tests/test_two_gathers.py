"""The two-gather fused op, ``all_gather_both_matmul``:

    all_gather(x, x_axis, axis=0, tiled=True) @ all_gather(w, w_axis, axis=0, tiled=True)

(an SP x FSDP column-parallel layer) over meshes of two axes, every
schedule, against the literal jax.lax expression and a float64 numpy model
on random operands; its gradients against jax.lax's; the compiled program
(one fused call, none of XLA's gathers under "ring"); and the errors that
name the argument."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import commfuse
from conftest import P, assert_close, rand
from programs import collectives, make_mesh

OP = commfuse.all_gather_both_matmul


def lax_two_gathers(x, w, x_axis, w_axis):
    return jax.lax.all_gather(x, x_axis, axis=0, tiled=True) @ jax.lax.all_gather(w, w_axis, axis=0, tiled=True)


def _case(shape, m, k, n, dtype, seed=0, lead=(), tp_first=False):
    """A mesh of `shape` (fsdp F, tp T; `tp_first`: its axes in the other
    order), global x [F*T*m, *lead, k] (its rows over fsdp then tp: a batch
    over fsdp, its sequence over tp) and w [k, n] (rows over fsdp, columns
    over tp); the result's rows over fsdp and its columns over tp."""
    f, t = shape
    mesh = make_mesh({"tp": t, "fsdp": f} if tp_first else {"fsdp": f, "tp": t})
    x = rand((f * t * m, *lead, k), dtype, seed=seed)
    w = rand((k, n), dtype, seed=seed + 1)
    x_spec = P(("fsdp", "tp"), *([None] * len(lead)))
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    ws = jax.device_put(w, NamedSharding(mesh, P("fsdp", "tp")))
    out_spec = P("fsdp", *([None] * len(lead)), "tp")
    spec = dict(mesh=mesh, in_specs=(x_spec, P("fsdp", "tp")), out_specs=out_spec)
    return mesh, x, w, xs, ws, spec


@pytest.mark.parametrize("schedule", ["ring", "sequential", "auto", "unfused"])
@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 2), (3, 2), (1, 4), (4, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
def test_matches_jax_lax_and_the_model(shape, dtype, schedule):
    f, t = shape
    mesh, x, w, xs, ws, spec = _case(shape, 4, 8 * f, 6 * t, dtype, seed=f * 10 + t)
    op = lambda a, b: OP(a, b, "tp", "fsdp", schedule=schedule)  # noqa: E731
    fused = jax.jit(jax.shard_map(op, **spec))(xs, ws)
    plain = jax.jit(jax.shard_map(lambda a, b: lax_two_gathers(a, b, "tp", "fsdp"), **spec))(xs, ws)
    assert fused.shape == plain.shape == (f * t * 4, 6 * t)
    assert_close(np.asarray(fused), np.asarray(plain), dtype)
    assert_close(np.asarray(fused), np.asarray(x, np.float64) @ np.asarray(w, np.float64), dtype)


@pytest.mark.parametrize("schedule,slices", [("ring", 2), ("ring", 4), ("auto", 2)])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (3, 2), (1, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
def test_sliced_matches_jax_lax_and_the_model(shape, dtype, schedule, slices, tmp_path):
    # Each device's 4 rows of x travel in `slices` row chunks ("auto" with slices= runs that plan).
    f, t = shape
    mesh, x, w, xs, ws, spec = _case(shape, 4, 8 * f, 6 * t, dtype, seed=f * 10 + t + slices)
    op = lambda a, b: OP(a, b, "tp", "fsdp", schedule=schedule, slices=slices)  # noqa: E731
    with commfuse.trace(tmp_path / "t.json"):
        fused = jax.block_until_ready(jax.jit(jax.shard_map(op, **spec))(xs, ws))
    calls = [e["args"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("cat") == "call"]
    assert calls and {c["schedule"] for c in calls} == {f"sliced({slices})"}, calls
    plain = jax.jit(jax.shard_map(lambda a, b: lax_two_gathers(a, b, "tp", "fsdp"), **spec))(xs, ws)
    assert_close(np.asarray(fused), np.asarray(plain), dtype)
    assert_close(np.asarray(fused), np.asarray(x, np.float64) @ np.asarray(w, np.float64), dtype)
    text = jax.jit(jax.shard_map(op, **spec)).lower(xs, ws).compile().as_text()
    assert collectives(text) == {"commfuse": 1}, collectives(text)


def test_unfused_ignores_slices():
    # "unfused" runs jax.lax's own gathers and dot: nothing is cut, so slices need not divide x's 4 rows.
    mesh, x, w, xs, ws, spec = _case((2, 2), 4, 16, 12, np.float32, seed=9)
    op = lambda a, b: OP(a, b, "tp", "fsdp", schedule="unfused", slices=3)  # noqa: E731
    assert_close(np.asarray(jax.jit(jax.shard_map(op, **spec))(xs, ws)),
                 np.asarray(x, np.float64) @ np.asarray(w, np.float64), np.float32)


def test_a_sliced_product_of_a_rank_3_x_and_its_gradients_match_jax_lax():
    # x [F*T*2, 3, 16]: each device's 6 rows (2 x 3) in 3 chunks, so a chunk cuts across x's leading dim.
    mesh, x, w, xs, ws, spec = _case((2, 2), 2, 16, 12, np.float32, seed=5, lead=(3,))
    fused = lambda a, b: OP(a, b, "tp", "fsdp", schedule="ring", slices=3)  # noqa: E731
    plain = lambda a, b: lax_two_gathers(a, b, "tp", "fsdp")  # noqa: E731
    assert_close(np.asarray(jax.jit(jax.shard_map(fused, **spec))(xs, ws)),
                 np.asarray(jax.jit(jax.shard_map(plain, **spec))(xs, ws)), np.float32)
    loss = lambda body: lambda a, b: jnp.sum(jax.shard_map(body, **spec)(a, b) ** 2)  # noqa: E731
    got = jax.jit(jax.grad(loss(fused), argnums=(0, 1)))(xs, ws)
    want = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(xs, ws)
    for g, w_ in zip(got, want):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)


def test_bf16_operands_with_a_float32_product_and_its_gradients():
    mesh, x, w, xs, ws, spec = _case((2, 2), 4, 16, 8, jnp.bfloat16, seed=4)
    op = lambda a, b: OP(a, b, "tp", "fsdp", schedule="ring", preferred_element_type=jnp.float32)  # noqa: E731
    fused = jax.jit(jax.shard_map(op, **spec))(xs, ws)
    assert fused.dtype == jnp.float32
    assert_close(np.asarray(fused), np.asarray(x, np.float64) @ np.asarray(w, np.float64), np.float32,
                 rtol=1e-5)
    # The cotangent is float32, w bfloat16: the backward's ops take them in one dtype.
    plain = lambda a, b: jnp.matmul(jax.lax.all_gather(a, "tp", axis=0, tiled=True),  # noqa: E731
                                    jax.lax.all_gather(b, "fsdp", axis=0, tiled=True),
                                    preferred_element_type=jnp.float32)
    grads = [jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(jax.shard_map(fn, **spec)(a, b))), argnums=(0, 1)))(xs, ws)
             for fn in (op, plain)]
    for g, w_ in zip(*grads):
        assert g.dtype == w_.dtype == jnp.bfloat16
        assert_close(np.asarray(g), np.asarray(w_), jnp.bfloat16)


def test_the_group_follows_the_axes_named_not_the_mesh_order():
    # tp before fsdp in the mesh, F != T: the op's group is still w_axis major.
    mesh, x, w, xs, ws, spec = _case((2, 4), 4, 16, 8, np.float32, seed=8, tp_first=True)
    fused = jax.jit(jax.shard_map(lambda a, b: OP(a, b, "tp", "fsdp", schedule="ring"), **spec))(xs, ws)
    assert_close(np.asarray(fused), np.asarray(x, np.float64) @ np.asarray(w, np.float64), np.float32)
    loss = lambda fn: lambda a, b: jnp.sum(jnp.sin(jax.shard_map(fn, **spec)(a, b)))  # noqa: E731
    got = jax.jit(jax.grad(loss(lambda a, b: OP(a, b, "tp", "fsdp", schedule="ring")), argnums=(0, 1)))(xs, ws)
    want = jax.jit(jax.grad(loss(lambda a, b: lax_two_gathers(a, b, "tp", "fsdp")), argnums=(0, 1)))(xs, ws)
    for g, w_ in zip(got, want):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)


def test_rows_of_a_rank_3_x_and_gradients_match_jax_lax():
    mesh, x, w, xs, ws, spec = _case((2, 4), 2, 16, 12, np.float32, seed=3, lead=(3,))

    def loss(op):
        return lambda a, b: jnp.sum(jnp.sin(jax.shard_map(op, **spec)(a, b)))

    fused = lambda a, b: OP(a, b, "tp", "fsdp", schedule="ring")  # noqa: E731
    plain = lambda a, b: lax_two_gathers(a, b, "tp", "fsdp")  # noqa: E731
    out = jax.jit(jax.shard_map(fused, **spec))(xs, ws)
    assert out.shape == (2 * 4 * 2, 3, 12)
    assert_close(np.asarray(out), np.asarray(jax.jit(jax.shard_map(plain, **spec))(xs, ws)), np.float32)
    got = jax.jit(jax.grad(loss(fused), argnums=(0, 1)))(xs, ws)
    want = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(xs, ws)
    for g, w_ in zip(got, want):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)


def test_vmap_over_x_matches_jax_lax():
    # No fused form batches this kind: jax.lax's collectives and dot, batched.
    mesh, x, w, xs, ws, spec = _case((2, 2), 4, 8, 4, np.float32, seed=5)
    batch = jax.device_put(np.stack([x, 2 * x + 1]), NamedSharding(mesh, P(None, ("fsdp", "tp"))))
    spec = dict(spec, in_specs=(P(None, ("fsdp", "tp")), P("fsdp", "tp")), out_specs=P(None, "fsdp", "tp"))

    def batched(op):
        return jax.jit(jax.shard_map(lambda a, b: jax.vmap(op, in_axes=(0, None))(a, b), **spec))

    fused = batched(lambda a, b: OP(a, b, "tp", "fsdp", schedule="ring"))(batch, ws)
    plain = batched(lambda a, b: lax_two_gathers(a, b, "tp", "fsdp"))(batch, ws)
    assert_close(np.asarray(fused), np.asarray(plain), np.float32)


def test_ring_leaves_xla_no_gather():
    mesh, x, w, xs, ws, spec = _case((2, 4), 8, 32, 16, np.float32)
    text = jax.jit(jax.shard_map(lambda a, b: OP(a, b, "tp", "fsdp", schedule="ring"), **spec)).lower(xs, ws) \
        .compile().as_text()
    assert collectives(text) == {"commfuse": 1}, collectives(text)
    plain = jax.jit(jax.shard_map(lambda a, b: lax_two_gathers(a, b, "tp", "fsdp"), **spec)).lower(xs, ws) \
        .compile().as_text()
    assert collectives(plain) == {"all-gather": 2}, collectives(plain)


@pytest.mark.parametrize("schedule", ["ring", "unfused"])
def test_the_gradient_runs_its_collectives_inside_fused_ops(schedule):
    # dx is the two-axis op (dy @ w's gathered transpose, reduce-scattered
    # over tp), dw the gather-contract-scatter kind (x's transpose gathered
    # over tp along the contraction, reduce-scattered over fsdp): each runs
    # both its collectives in one call, so XLA runs none.
    mesh, x, w, xs, ws, spec = _case((2, 4), 8, 32, 16, np.float32, seed=9)
    f = jax.shard_map(lambda a, b: OP(a, b, "tp", "fsdp", schedule=schedule), **spec)
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), argnums=(0, 1)))
    counts = collectives(grad.lower(xs, ws).compile().as_text())
    if schedule == "ring":
        # The forward, dx's op and dw's.
        assert counts == {"commfuse": 3}, counts
    else:
        assert counts.get("commfuse") is None and counts.get("all-gather"), counts
    plain = jax.shard_map(lambda a, b: lax_two_gathers(a, b, "tp", "fsdp"), **spec)
    want = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(plain(a, b))), argnums=(0, 1)))(xs, ws)
    for g, w_ in zip(grad(xs, ws), want):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)


def test_explain_prices_the_plan_over_both_axes():
    # One device's x [256, 512] (K = F x 256), w [256, 256], over F = 2 x T = 4.
    r = commfuse.explain("all_gather_both_matmul", (256, 512), (256, 256), 8, dimension=2, machine="h100_nvlink")
    assert r["choice"] in r["schedules"], r["choice"]
    # x's 256 rows per device travel whole or in 2, 4 or 8 row chunks.
    assert set(r["schedules"]) == {"ring", "sequential", "sliced(2)", "sliced(4)", "sliced(8)"}, r["schedules"]
    assert r["schedules"]["ring"] < r["schedules"]["sequential"], r["schedules"]
    with pytest.raises(ValueError, match="dimension is the size of w's gather axis"):
        commfuse.explain("all_gather_both_matmul", (256, 512), (256, 256), 8, dimension=3)
    # Memory: the unfused form holds both gathered operands; the fused op keeps every received block
    # (and one copy of each own block it sends; float32 products add up in the output itself).
    x_bytes, w_bytes = 256 * 512 * 4, 256 * 256 * 4
    assert r["memory"]["unfused_temporaries"] == 4 * x_bytes + 2 * w_bytes, r["memory"]
    assert r["memory"]["blocks_in_flight"] == 4 * x_bytes + 2 * w_bytes, r["memory"]


def _errors(mesh_shape, x_shape, w_shape, *args, **kwargs):
    mesh = make_mesh(dict(zip(("fsdp", "tp"), mesh_shape)))
    in_specs = (P(("fsdp", "tp")), P("fsdp", "tp"))
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32, sharding=NamedSharding(mesh, in_specs[0]))
    w = jax.ShapeDtypeStruct(w_shape, jnp.float32, sharding=NamedSharding(mesh, in_specs[1]))
    f = jax.shard_map(lambda a, b: OP(a, b, *args, **kwargs), mesh=mesh, in_specs=in_specs,
                      out_specs=P("fsdp", "tp"))
    return jax.jit(f).trace(x, w)


@pytest.mark.parametrize("args,kwargs,match", [
    (("tp", "tp"), {}, "x_axis and w_axis must be two mesh axes"),
    (("tp", "fsdp"), {"schedule": "bidirectional"}, "schedule 'bidirectional' does not exist"),
    (("tp", "fsdp"), {"schedule": "sliced"}, "schedule 'sliced' does not exist"),
    (("tp", "fsdp"), {"slices": 3}, "slices=3 must divide x's 4 rows"),
    (("tp", "fsdp"), {"slices": 0}, r"slices must be an int in \[1, "),
    (("tp", "fsdp"), {"slices": 2, "schedule": "sequential"}, "slices=2 with schedule='sequential'"),
    (("tp", "C"), {}, "unknown w_axis 'C'"),
    (("Z", "fsdp"), {}, "unknown x_axis 'Z'"),
    ((("tp",), "fsdp"), {}, "x_axis must name one mesh axis"),
])
def test_bad_arguments_are_named(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _errors((2, 2), (16, 16), (16, 8), *args, **kwargs)


def test_a_contraction_that_does_not_match_after_the_gather_is_an_error():
    # x's 16 columns vs w's 4 rows gathered over fsdp = 2: 8.
    with pytest.raises(ValueError, match=r"contracts its last dim \(16\) with `w`'s first \(8\)"):
        _errors((2, 2), (16, 16), (8, 8), "tp", "fsdp")


# --------------------------------------------------------------------------
# Reached by overlap and commfuse.matmul from the jax.lax expression
# --------------------------------------------------------------------------
def _sp_fsdp_layer(mesh, b, s, d, f, dtype=jnp.float32):
    """all_gather(h, "tp", axis=1) @ all_gather(w, "fsdp", axis=0) as a user
    writes it (h's batch over fsdp, its sequence over tp; w's rows over
    fsdp, its columns over tp), and abstract global operands of it."""
    def layer(h, w):
        h_all = jax.lax.all_gather(h, "tp", axis=1, tiled=True)
        w_rows = jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)
        return h_all @ w_rows

    in_specs = (P("fsdp", "tp", None), P("fsdp", "tp"))
    fn = jax.shard_map(layer, mesh=mesh, in_specs=in_specs, out_specs=P("fsdp", None, "tp"))
    h = jax.ShapeDtypeStruct((b, s, d), dtype, sharding=NamedSharding(mesh, in_specs[0]))
    w = jax.ShapeDtypeStruct((d, f), dtype, sharding=NamedSharding(mesh, in_specs[1]))
    return fn, (h, w)


@pytest.mark.parametrize("shape, fused", [
    # One device's h [1, 2048, 4096] and w [1024, 7168] over fsdp 4 x tp 2: the op's plan is predicted fastest.
    ((4, 2, 1, 2048, 4096, 7168), "all_gather_both_matmul"),
    # h [1, 512, 4096] and w [2048, 1792] over fsdp 2 x tp 4: the 16 per-peer pieces lose more than fusing
    # x's gather (the larger) alone leaves exposed: the cost model fuses x's side.
    ((2, 4, 1, 512, 4096, 1792), "all_gather_matmul"),
])
def test_auto_takes_the_op_over_both_axes_where_the_cost_model_says_it_pays(shape, fused):
    f, t, b, s, d, c = shape
    mesh = make_mesh({"fsdp": f, "tp": t})
    fn, args = _sp_fsdp_layer(mesh, b * f, s * t, d, c * t, jnp.bfloat16)
    ov = commfuse.overlap(fn, schedule="auto", machine="h100_nvlink")
    jax.jit(ov).trace(*args)
    rewrote = [line for line in ov.last_report if "]: rewrote " in line]
    assert len(rewrote) == 1 and f"commfuse.{fused}(" in rewrote[0], ov.last_report
    if fused != "all_gather_both_matmul":
        assert any("the cost model fuses x's" in line for line in ov.last_report), ov.last_report


@pytest.mark.parametrize("schedule", ["ring", "bidirectional"])
def test_an_sp_fsdp_column_parallel_product_under_jit_is_one_op_over_both_axes(schedule):
    # h's sequence over tp, w's rows over fsdp and columns over tp: under
    # ring one fused op runs both gathers; the op has no bidirectional
    # schedule, so there XLA gathers w and h's gather is fused.
    mesh = make_mesh({"fsdp": 2, "tp": 4})
    rng = np.random.default_rng(19)
    h = jax.device_put(rng.standard_normal((4, 16, 32), np.float32), NamedSharding(mesh, P("fsdp", "tp", None)))
    w = jax.device_put(rng.standard_normal((32, 24), np.float32) / 6, NamedSharding(mesh, P("fsdp", "tp")))

    def layer(h, w):
        y = jax.lax.with_sharding_constraint(h @ w, NamedSharding(mesh, P("fsdp", None, "tp")))
        return jnp.mean(y * y), y

    ov = commfuse.overlap(layer, schedule=schedule)
    got, want = jax.jit(ov)(h, w), jax.jit(layer)(h, w)
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)
    counts = collectives(jax.jit(ov).lower(h, w).compile().as_text())
    report = "\n".join(ov.last_report)
    if schedule == "ring":
        assert "all-gather" not in counts and counts["commfuse"] == 1, counts
        assert "all_gather_both_matmul over ('fsdp', 'tp'), dimension 1" in report, report
    else:
        assert counts.get("all-gather") == 1 and counts["commfuse"] == 1, counts
        assert "all_gather_matmul over ('tp',), dimension 1" in report, report
    loss = lambda fn: lambda a, b: fn(a, b)[0]  # noqa: E731
    got = jax.jit(jax.grad(loss(ov), argnums=(0, 1)))(h, w)
    want = jax.jit(jax.grad(loss(layer), argnums=(0, 1)))(h, w)
    for g, w_ in zip(got, want):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)


@pytest.mark.parametrize("schedule", ["ring", "bidirectional"])
def test_a_product_with_its_contraction_gathered_and_rows_reduce_scattered_under_jit(schedule):
    # commfuse.matmul(a, b): a [32, 64] its contraction over (fsdp, tp), b [64, 24] over fsdp, the result's rows
    # over fsdp: under ring one op over both axes (the gather-contract-scatter kind); it has no bidirectional
    # schedule, so there XLA gathers a's contraction over tp and the reduce-scatter is fused.
    mesh = make_mesh({"fsdp": 2, "tp": 4})
    a = jax.device_put(rand((32, 64), np.float32, seed=21), NamedSharding(mesh, P(None, ("fsdp", "tp"))))
    b = jax.device_put(rand((64, 24), np.float32, seed=22), NamedSharding(mesh, P("fsdp", None)))
    out = NamedSharding(mesh, P("fsdp", None))
    f = jax.jit(lambda a, b: jax.lax.with_sharding_constraint(commfuse.matmul(a, b, schedule=schedule), out))
    assert_close(np.asarray(f(a, b)), np.asarray(a, np.float64) @ np.asarray(b, np.float64), np.float32)
    counts = collectives(f.lower(a, b).compile().as_text())
    if schedule == "ring":
        assert counts == {"commfuse": 1}, counts
    else:
        assert counts == {"all-gather": 1, "commfuse": 1}, counts


def test_an_sp_fsdp_weight_gradient_under_jit_is_one_op_over_both_axes():
    # Flat tokens h [64, 32] over (fsdp, tp), w [32, 24] rows over fsdp and columns over tp, the gradient kept in
    # w's layout: JAX's transpose writes dw as dyᵀ @ h (h's tokens, the contraction, over (fsdp, tp); dy's over
    # fsdp), which runs as the gather-contract-scatter op on its transpose; the forward as the two-gather op.
    mesh = make_mesh({"fsdp": 2, "tp": 4})
    h = jax.device_put(rand((64, 32), np.float32, seed=23), NamedSharding(mesh, P(("fsdp", "tp"), None)))
    w = jax.device_put(rand((32, 24), np.float32, seed=24) / 6, NamedSharding(mesh, P("fsdp", "tp")))

    def step(h, w):
        def loss(w):
            y = jax.lax.with_sharding_constraint(h @ w, NamedSharding(mesh, P("fsdp", "tp")))
            return jnp.mean(y * y)

        value, grad = jax.value_and_grad(loss)(w)
        return value, jax.lax.with_sharding_constraint(grad, NamedSharding(mesh, P("fsdp", "tp")))

    ov = commfuse.overlap(step, schedule="ring")
    got, want = jax.jit(ov)(h, w), jax.jit(step)(h, w)
    for g, w_ in zip(got, want):
        assert_close(np.asarray(g), np.asarray(w_), np.float32)
    plain = collectives(jax.jit(step).lower(h, w).compile().as_text())
    counts = collectives(jax.jit(ov).lower(h, w).compile().as_text())
    assert plain.get("all-gather", 0) >= 2, plain
    # Left to XLA: the loss's all-reduces only.
    assert "all-gather" not in counts and "reduce-scatter" not in counts and counts["commfuse"] == 2, counts
    report = "\n".join(ov.last_report)
    assert "all_gather_both_matmul over ('fsdp', 'tp'), dimension 0" in report, report
    assert "all_gather_contract_matmul_reduce_scatter over ('tp', 'fsdp'), dimension 1" in report, report


def test_an_sp_fsdp_column_parallel_layer_leaves_xla_no_gather():
    # sp_fsdp_column_parallel: both gathers into one dot. Under ring they run
    # inside one op over both axes; plain XLA runs each. Its gradient: dx and
    # dw are each one op over both axes, so XLA runs no collective at all.
    from programs import sp_fsdp_column_parallel

    program = sp_fsdp_column_parallel.PROGRAM
    mesh = make_mesh(program.mesh)
    fn, args = program.build(mesh, np.random.default_rng(6))
    ov = commfuse.overlap(fn, schedule="ring")
    assert collectives(jax.jit(ov).lower(*args).compile().as_text()) == {"all-reduce": 1, "commfuse": 1}
    assert collectives(jax.jit(fn).lower(*args).compile().as_text()) == {"all-gather": 2, "all-reduce": 1}
    assert any("commfuse.all_gather_both_matmul(" in line for line in ov.last_report), ov.last_report
    for got, want in zip(jax.tree.leaves(jax.jit(ov)(*args)), jax.tree.leaves(jax.jit(fn)(*args))):
        assert_close(np.asarray(got), np.asarray(want), np.float32)
    grad = jax.jit(jax.grad(lambda *a: ov(*a)[0], argnums=(0, 1)))
    # (The loss psum's cotangent needs no collective.)
    assert collectives(grad.lower(*args).compile().as_text()) == {"commfuse": 3}
    want = jax.jit(jax.grad(lambda *a: fn(*a)[0], argnums=(0, 1)))(*args)
    for got, w_ in zip(grad(*args), want):
        assert_close(np.asarray(got), np.asarray(w_), np.float32)


def test_an_sp_fsdp_step_with_its_backward_in_the_body_leaves_xla_no_gather_or_scatter():
    # sp_fsdp_train_step: value_and_grad inside the shard_map. Under ring the
    # forward is the two-gather op, the input gradient the two-axis op (the
    # gathered weight's transpose), the weight gradient the
    # gather-contract-scatter op; each gathered value, read by two dots, is
    # gathered again inside each op, so XLA runs only the loss's psum.
    from programs import sp_fsdp_train_step

    program = sp_fsdp_train_step.PROGRAM
    mesh = make_mesh(program.mesh)
    fn, args = program.build(mesh, np.random.default_rng(12))
    ov = commfuse.overlap(fn, schedule="ring")
    assert collectives(jax.jit(ov).lower(*args).compile().as_text()) == {"all-reduce": 1, "commfuse": 3}
    assert collectives(jax.jit(fn).lower(*args).compile().as_text()) == \
        {"all-gather": 2, "reduce-scatter": 2, "all-reduce": 1}
    report = "\n".join(ov.last_report)
    for op in ("all_gather_both_matmul", "all_gather_matmul_reduce_scatter",
               "all_gather_contract_matmul_reduce_scatter"):
        assert f"-> commfuse.{op}(" in report, report
    for got, want in zip(jax.tree.leaves(jax.jit(ov)(*args)), jax.tree.leaves(jax.jit(fn)(*args))):
        assert_close(np.asarray(got), np.asarray(want), np.float32)
    # Under auto the weight gradient's sides cannot be timed apart (its
    # contraction is gathered along one of two dims): the op over both axes
    # is tried first and decides for itself (the tests' auto never declines).
    auto = commfuse.overlap(fn)
    jax.jit(auto).lower(*args)
    assert any("-> commfuse.all_gather_contract_matmul_reduce_scatter(" in line for line in auto.last_report), \
        auto.last_report


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (8, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_gather_contract_scatter_op_matches_jax_lax(shape):
    # psum_scatter(all_gather(x, "tp", axis=1) @ w, "fsdp"): x [F*kq, m] per
    # device, w [T*m, c], every schedule it has, f32 and bf16 (F > 2: its
    # two partial slots reused).
    from commfuse import _all_gather_contract_matmul_reduce_scatter as contract

    f, t = shape
    mesh = make_mesh({"fsdp": f, "tp": t})
    for dtype in (np.float32, jnp.bfloat16):
        x = jax.device_put(rand((f * f * 8, t * 6), dtype, seed=2), NamedSharding(mesh, P("fsdp", "tp")))
        w = jax.device_put(rand((f * t * 6, t * 5), dtype, seed=3), NamedSharding(mesh, P("fsdp", "tp")))
        spec = dict(mesh=mesh, in_specs=(P("fsdp", "tp"), P("fsdp", "tp")), out_specs=P("fsdp", "tp"))

        def lax(a, b):
            return jax.lax.psum_scatter(jax.lax.all_gather(a, "tp", axis=1, tiled=True) @ b, "fsdp",
                                        scatter_dimension=0, tiled=True)

        want = jax.jit(jax.shard_map(lax, **spec))(x, w)
        for schedule in ("ring", "sequential", "unfused"):
            def fused(a, b, schedule=schedule):
                return contract.run(contract.decide(a, b, "tp", "fsdp", schedule=schedule), a, b)

            got = jax.jit(jax.shard_map(fused, **spec))(x, w)
            assert_close(np.asarray(got), np.asarray(want), dtype, err_msg=f"{schedule} {np.dtype(dtype).name}")
            if schedule == "ring":
                text = jax.jit(jax.shard_map(fused, **spec)).lower(x, w).compile().as_text()
                assert collectives(text) == {"commfuse": 1}, collectives(text)
