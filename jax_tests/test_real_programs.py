"""What real programs meet: fused ops beside XLA's own collectives (no
deadlock, whatever order the runtime picks), ``check_vma=False``, the
patterns third-party code writes, ``matmul_all_reduce``, ``auto`` choosing
not to fuse, and a report line for every shard_map body."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import commfuse
from commfuse import _calibration
from conftest import assert_close, place, rand
from programs import collectives, fsdp_mlp, make_mesh

# --------------------------------------------------------------------------
# Beside XLA's own collectives
# --------------------------------------------------------------------------
def test_fsdp_loss_beside_xlas_bias_gathers_runs_hundreds_of_calls():
    """The FSDP MLP whose fused weight gathers have no data dependence on the
    bias gathers XLA runs beside them: deadlocked within ~50 calls when a
    fused op held its device thread while waiting for peers."""
    mesh = make_mesh({"fsdp": 4})
    fn, args = fsdp_mlp.build(mesh, np.random.default_rng(3), scale=2)
    fused = jax.jit(commfuse.overlap(fn, schedule="ring"))
    want = float(jax.jit(fn)(*args))
    for _ in range(200):
        got = fused(*args)
    assert abs(float(got) - want) <= 1e-5 * abs(want)
    grad = jax.jit(jax.grad(commfuse.overlap(fn, schedule="ring")))
    want_grad = jax.jit(jax.grad(fn))(*args)
    for _ in range(50):
        got_grad = grad(*args)
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
        assert_close(np.asarray(g), np.asarray(w), np.float32)


def test_fused_ops_beside_every_kind_of_xla_collective_with_no_data_dependence():
    n = 4
    mesh = make_mesh({"x": n})
    rng = np.random.default_rng(5)

    def body(x, w, a, b, c, d, e):
        y = commfuse.all_gather_matmul(x, w, "x", schedule="ring")
        z = commfuse.matmul_reduce_scatter(x, w, "x", schedule="bidirectional")
        others = (jax.lax.psum(a, "x"), jax.lax.all_gather(b, "x", tiled=True),
                  jax.lax.psum_scatter(c, "x", tiled=True),
                  jax.lax.ppermute(d, "x", [(i, (i + 1) % n) for i in range(n)]),
                  jax.lax.all_to_all(e, "x", 0, 0, tiled=True))
        return y, z, *others

    specs = (P("x"), P()) + (P("x"),) * 5
    outs = (P("x"), P("x"), P(), P("x"), P("x"), P("x"), P("x"))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=outs, check_vma=False))
    args = [place(rand((n * 8, 16), rng=rng), mesh, P("x")), place(rand((16, 12), rng=rng), mesh, P())]
    args += [place(rand((n * 4, 8), rng=rng), mesh, P("x")) for _ in range(5)]
    first = fn(*args)
    for _ in range(60):
        again = fn(*args)
    for u, v in zip(first, again):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    x, w = (np.asarray(a, np.float64) for a in args[:2])
    assert_close(np.asarray(first[0]), np.tile(x @ w, (n, 1)), np.float32)


# --------------------------------------------------------------------------
# check_vma=False
# --------------------------------------------------------------------------
OPS = {
    "all_gather_matmul": (lambda x, w: commfuse.all_gather_matmul(x, w, "x"),
                          lambda x, w: jax.lax.all_gather(x, "x", tiled=True) @ w, (P("x"), P()), P("x")),
    "matmul_reduce_scatter": (lambda x, w: commfuse.matmul_reduce_scatter(x, w, "x"),
                              lambda x, w: jax.lax.psum_scatter(x @ w, "x", tiled=True),
                              (P(None, "x"), P("x")), P("x")),
    "matmul_all_gather": (lambda x, w: commfuse.matmul_all_gather(x, w, "x"),
                          lambda x, w: x @ jax.lax.all_gather(w, "x", axis=1, tiled=True), (P(), P(None, "x")),
                          P("x")),
    "matmul_all_reduce": (lambda x, w: commfuse.matmul_all_reduce(x, w, "x"),
                          lambda x, w: jax.lax.psum(x @ w, "x"), (P(None, "x"), P("x")), P()),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_differentiates_with_and_without_check_vma(op, check_vma):
    fused, plain, in_specs, out_spec = OPS[op]
    mesh = make_mesh({"x": 4})
    rng = np.random.default_rng(9)
    x, w = rand((32, 16), rng=rng), rand((16, 8), rng=rng)
    args = [place(x, mesh, in_specs[0]), place(w, mesh, in_specs[1])]

    def loss(body):
        f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)
        return lambda a, b: jnp.sum(f(a, b) ** 2)

    want = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(*args)
    for how, grad in (("direct", jax.grad(loss(fused), argnums=(0, 1))),
                      ("grad(overlap)", jax.grad(loss(commfuse.overlap(plain)), argnums=(0, 1))),
                      ("overlap(grad)", commfuse.overlap(jax.grad(loss(plain), argnums=(0, 1))))):
        got = jax.jit(grad)(*args)
        for g, r in zip(got, want):
            assert_close(np.asarray(g), np.asarray(r), np.float32, err_msg=f"{op} {how} check_vma={check_vma}")
    _, vjp = jax.vjp(loss(fused), *args)
    for g, r in zip(vjp(jnp.float32(1)), want):
        assert_close(np.asarray(g), np.asarray(r), np.float32, err_msg=f"{op} vjp")


# --------------------------------------------------------------------------
# Patterns real code writes
# --------------------------------------------------------------------------
def _fused_lines(fn):
    return [line for line in fn.last_report if "]: rewrote " in line]


def test_a_weight_gather_that_cannot_fuse_costs_the_scatter_of_its_dot_nothing():
    """einsum("bqd,mqd->bm", x, all_gather(w)) then psum_scatter over another
    axis: the gather feeds a dot with two contracting dims where the gathered
    dim is not the outer one (JAX contracts (d, q)); it read the gather before
    it was evaluated."""
    mesh = make_mesh({"a": 2, "b": 2})
    rng = np.random.default_rng(1)

    def body(x, w):
        wg = jax.lax.all_gather(w, "a", axis=1, tiled=True)
        y = jnp.einsum("bqd,mqd->bm", x, wg)
        return jax.lax.psum_scatter(y, "b", scatter_dimension=0, tiled=True)

    x = place(rand((8, 4, 6), rng=rng), mesh, P())
    w = place(rand((10, 4, 6), rng=rng), mesh, P(None, "a", None))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "a", None)), out_specs=P("b"), check_vma=False)
    g = commfuse.overlap(f)
    assert_close(np.asarray(g(x, w)), np.asarray(jax.jit(f)(x, w)), np.float32)
    assert len(_fused_lines(g)) == 1 and "psum_scatter" not in _fused_lines(g)[0], g.last_report
    assert "reduce_scatter" in _fused_lines(g)[0], g.last_report
    # Inside checkpoint and scan the body keeps its other fusion.
    def scanned(x, w):
        def step(c, _):
            return c, jax.checkpoint(body)(x, w)
        return jax.lax.scan(step, 0.0, None, length=2)[1]
    fs = jax.shard_map(scanned, mesh=mesh, in_specs=(P(), P(None, "a", None)), out_specs=P(None, "b"),
                       check_vma=False)
    gs = commfuse.overlap(fs)
    assert_close(np.asarray(gs(x, w)), np.asarray(jax.jit(fs)(x, w)), np.float32)
    assert len(_fused_lines(gs)) == 1, gs.last_report


def test_rms_norm_between_the_sequence_gather_and_its_dot_moves_before_the_gather():
    mesh = make_mesh({"x": 4})
    rng = np.random.default_rng(2)

    def body(x, scale, w):
        xg = jax.lax.all_gather(x, "x", axis=1, tiled=True)
        normed = xg * jax.lax.rsqrt(jnp.mean(xg * xg, axis=-1, keepdims=True) + 1e-6) * scale
        return normed @ w

    args = (place(rand((2, 16, 32), rng=rng), mesh, P(None, "x")), place(rand((32,), rng=rng), mesh, P()),
            place(rand((32, 16), rng=rng), mesh, P(None, "x")))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P(), P(None, "x")), out_specs=P(None, None, "x"))
    g = commfuse.overlap(f)
    assert_close(np.asarray(g(*args)), np.asarray(jax.jit(f)(*args)), np.float32)
    assert len(_fused_lines(g)) == 1 and "row-wise ops (moved before it)" in _fused_lines(g)[0], g.last_report
    # Not row-wise over the gathered dim (a mean over the sequence): left alone.
    def across(x, scale, w):
        xg = jax.lax.all_gather(x, "x", axis=1, tiled=True)
        return (xg - jnp.mean(xg, axis=1, keepdims=True)) @ w
    f2 = jax.shard_map(across, mesh=mesh, in_specs=(P(None, "x"), P(), P(None, "x")), out_specs=P(None, None, "x"))
    g2 = commfuse.overlap(f2)
    assert_close(np.asarray(g2(*args)), np.asarray(jax.jit(f2)(*args)), np.float32)
    assert not _fused_lines(g2) and any("not row-wise" in line for line in g2.last_report), g2.last_report


def test_rank3_weights_and_two_contracting_dims_fuse():
    mesh = make_mesh({"x": 4})
    rng = np.random.default_rng(4)

    def body(x, wq, wo):
        q = jnp.einsum("bsE,Ehd->bshd", jax.lax.all_gather(x, "x", axis=1, tiled=True), wq)
        return jax.lax.psum_scatter(jnp.einsum("bshd,hdE->bsE", q, wo), "x", scatter_dimension=1, tiled=True)

    args = (place(rand((2, 16, 8), rng=rng), mesh, P(None, "x")), place(rand((8, 4, 2), rng=rng), mesh, P(None, "x")),
            place(rand((4, 2, 8), rng=rng), mesh, P("x")))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P(None, "x"), P("x")), out_specs=P(None, "x"))
    g = commfuse.overlap(f)
    assert_close(np.asarray(g(*args)), np.asarray(jax.jit(f)(*args)), np.float32)
    lines = _fused_lines(g)
    assert len(lines) == 2, g.last_report
    assert "rank-3 w flattened" in lines[0] and "2 contracting dims flattened" in lines[1], lines


def test_psum_of_a_dot_becomes_matmul_all_reduce():
    mesh = make_mesh({"x": 4})
    rng = np.random.default_rng(6)
    body = lambda x, w: jax.lax.psum(x @ w, "x")  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P())
    args = (place(rand((16, 32), rng=rng), mesh, P(None, "x")), place(rand((32, 8), rng=rng), mesh, P("x")))
    g = commfuse.overlap(f)
    assert_close(np.asarray(g(*args)), np.asarray(jax.jit(f)(*args)), np.float32)
    assert len(_fused_lines(g)) == 1 and "matmul_all_reduce" in _fused_lines(g)[0], g.last_report


# --------------------------------------------------------------------------
# matmul_all_reduce
# --------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,tiles", [("ring", 4), ("bidirectional", 2), ("auto", None), ("unfused", None)])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_matmul_all_reduce_matches_psum(schedule, tiles, dtype):
    n = 4
    mesh = make_mesh({"x": n})
    rng = np.random.default_rng(8)
    x, w = rand((2, 16, n * 8), dtype, rng=rng), rand((n * 8, 12), dtype, rng=rng)

    def run(op):
        f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(None, None, "x"), P("x")), out_specs=P()))
        return np.asarray(f(x, w))

    got = run(lambda a, b: commfuse.matmul_all_reduce(a, b, "x", schedule=schedule, tiles=tiles))
    want = run(lambda a, b: commfuse.reference.matmul_all_reduce(a, b, "x"))
    assert got.shape == (2, 16, 12)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("schedule,tiles", [("sequential", None), ("ring", None), ("bidirectional", 1), ("auto", 2)])
def test_matmul_all_reduce_is_one_fused_op_and_leaves_no_collective_to_xla(schedule, tiles):
    # Both halves of the all-reduce run inside the one op.
    mesh = make_mesh({"x": 4})
    x, w = rand((2, 16, 32), seed=3), rand((32, 12), seed=4)
    op = lambda a, b: commfuse.matmul_all_reduce(a, b, "x", schedule=schedule, tiles=tiles)  # noqa: E731
    f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(None, None, "x"), P("x")), out_specs=P()))
    assert collectives(f.lower(x, w).compile().as_text()) == {"commfuse": 1}
    assert_close(np.asarray(f(x, w)), np.einsum("bsk,kn->bsn", x.astype(np.float64), w), np.float32)


@pytest.mark.parametrize("schedule,plan", [("sequential", "sequential"), ("ring", "ring"),
                                           ("bidirectional", "bidirectional")])
def test_an_all_reduce_runs_the_schedule_asked_unchunked(schedule, plan):
    # Chunks pay a ring's latencies per chunk: only `tiles=` (or auto's
    # model) asks for them.
    mesh = make_mesh({"x": 4})
    x, w = rand((2, 16, 32), seed=3), rand((32, 12), seed=4)
    body = jax.shard_map(lambda a, b: jax.lax.psum(a @ b, "x"), mesh=mesh, in_specs=(P(None, None, "x"), P("x")),
                         out_specs=P())
    g = commfuse.overlap(body, schedule=schedule)
    assert_close(np.asarray(jax.jit(g)(x, w)), np.einsum("bsk,kn->bsn", x.astype(np.float64), w), np.float32)
    assert [d.schedule_name for op in g.last_decisions for d in op.calls] == [plan], g.last_report


def test_matmul_all_reduce_refuses_chunks_under_a_sequential_schedule():
    mesh = make_mesh({"x": 4})
    f = jax.shard_map(lambda a, b: commfuse.matmul_all_reduce(a, b, "x", schedule="sequential", tiles=2), mesh=mesh,
                      in_specs=(P(None, "x"), P("x")), out_specs=P())
    with pytest.raises(ValueError, match="tiles=2 with schedule='sequential'"):
        jax.jit(f).lower(jnp.ones((16, 8)), jnp.ones((8, 4)))


def test_a_plans_all_reduce_decision_is_kept_under_a_sequential_schedule():
    # bench_plan runs a plan's decisions with schedule="sequential" for what
    # they leave unfused: the imposed decision (made under ring) must still
    # be found, not replaced by sequential's.
    mesh = make_mesh({"x": 4})
    x, w = rand((2, 16, 32), seed=5), rand((32, 12), seed=6)
    body = jax.shard_map(lambda a, b: jax.lax.psum(a @ b, "x"), mesh=mesh, in_specs=(P(None, None, "x"), P("x")),
                         out_specs=P())

    def compiled(ov):
        return collectives(jax.jit(ov).lower(x, w).compile().as_text())

    ring = commfuse.overlap(body, schedule="ring")
    assert compiled(ring) == {"commfuse": 1}
    imposed = commfuse.overlap(body, schedule="sequential", decisions=ring.last_decisions)
    assert compiled(imposed) == {"commfuse": 1}
    fused = [d for op in imposed.last_decisions for d in op.calls if d.fused]
    assert [d.schedule_name for d in fused] == ["ring"], imposed.last_decisions
    sequential = commfuse.overlap(body, schedule="sequential")
    assert compiled(sequential) == {"commfuse": 1}
    assert [d.schedule_name for op in sequential.last_decisions for d in op.calls] == ["sequential"]
    assert_close(np.asarray(jax.jit(imposed)(x, w)), np.einsum("bsk,kn->bsn", x.astype(np.float64), w), np.float32)


def test_matmul_all_reduce_refuses_rows_that_do_not_split_for_a_fused_schedule():
    mesh = make_mesh({"x": 4})
    f = jax.shard_map(lambda a, b: commfuse.matmul_all_reduce(a, b, "x", schedule="ring"), mesh=mesh,
                      in_specs=(P(None, "x"), P("x")), out_specs=P())
    with pytest.raises(ValueError, match="rows .*equal blocks"):
        jax.jit(f).lower(jnp.ones((6, 8)), jnp.ones((8, 4)))
    # "auto" runs jax.lax's psum instead.
    g = jax.shard_map(lambda a, b: commfuse.matmul_all_reduce(a, b, "x"), mesh=mesh,
                      in_specs=(P(None, "x"), P("x")), out_specs=P())
    x, w = rand((6, 8), seed=1), rand((8, 4), seed=2)
    assert_close(np.asarray(jax.jit(g)(x, w)), x.astype(np.float64) @ w, np.float32)


# --------------------------------------------------------------------------
# auto may choose not to fuse; overlap(schedule=...)
# --------------------------------------------------------------------------
def test_auto_runs_small_calls_unfused_and_says_why(monkeypatch, tmp_path):
    """With this machine's figures cached as a fused call costing 1 ms, a
    small call's predicted gain is less: auto keeps it unfused and says so."""
    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "1")
    monkeypatch.setenv(_calibration.CACHE_VAR, str(tmp_path))
    _calibration.forget()
    monkeypatch.setattr(_calibration, "_MEMORY", {})
    figures = {"cpu_gemm_gflops": 50.0, **{f"cpu_call_overhead_s/{n}": 1e-3 for n in range(2, 17)}}
    _calibration.path().write_text(json.dumps({"figures": figures}))
    mesh = make_mesh({"x": 4})
    body = lambda x, w: jax.lax.psum_scatter(x @ w, "x", tiled=True)  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"))
    x, w = rand((16, 64), seed=3), rand((64, 32), seed=4)
    auto = commfuse.overlap(f)
    assert_close(np.asarray(auto(x, w)), np.asarray(jax.jit(f)(x, w)), np.float32)
    lines = [line for line in auto.last_report if "matmul_reduce_scatter" in line]
    assert len(lines) == 1 and "kept as written" in lines[0] and "fixed cost" in lines[0], auto.last_report
    # Declined, the body is the one the program wrote: its collective, no commfuse call.
    text = jax.jit(auto).lower(x, w).compile().as_text()
    assert "commfuse_collective_matmul" not in text and ("reduce-scatter" in text or "all-reduce" in text)
    # Any other schedule fuses every candidate it can.
    forced = commfuse.overlap(f, schedule="ring")
    assert_close(np.asarray(forced(x, w)), np.asarray(jax.jit(f)(x, w)), np.float32)
    assert len(_fused_lines(forced)) == 1, forced.last_report
    result = commfuse.explain("matmul_reduce_scatter", (16, 16), (16, 32), 4)
    assert result["decision"] == "unfused" and "fixed cost" in result["decision_reason"], result


def test_overlap_refuses_an_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule"):
        commfuse.overlap(lambda x: x, schedule="fastest")


# --------------------------------------------------------------------------
# A report line for every body
# --------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["psum_only", "ppermute_ring", "reduced", "nothing"])
def test_every_shard_map_body_gets_a_report_line(case, capsys):
    n = 4
    mesh = make_mesh({"x": n})
    if case == "psum_only":
        body, out = (lambda x: jax.lax.psum(jnp.sum(x * x), "x")), P()
        expect = "psum"
    elif case == "ppermute_ring":
        body, out = (lambda x: jax.lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)])), P("x")
        expect = "ppermute ring is already overlapped"
    elif case == "reduced":
        body, out = (lambda x: jax.lax.all_gather(x, "x", tiled=True, to="reduced") @ jnp.ones((8, 3))), P()
        expect = "to='reduced'"
    else:
        body, out = (lambda x: x * 2), P("x")
        expect = "no collective in this body"
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),), out_specs=out)
    g = commfuse.overlap(f, report=True)
    x = rand((n * 4, 8), seed=5)
    assert_close(np.asarray(g(x)), np.asarray(jax.jit(f)(x)), np.float32)
    printed = capsys.readouterr().out
    assert g.last_report and all(line in printed for line in g.last_report)
    assert any(expect in line for line in g.last_report), g.last_report


def test_a_dp_tp_step_leaves_xla_no_all_reduce_of_a_product():
    # Every all-reduce of dp_tp_row_parallel but the loss's (a scalar) is a
    # product's: under ring each is one fused op, and XLA runs none of them.
    from programs import dp_tp_row_parallel

    program = dp_tp_row_parallel.PROGRAM
    mesh = make_mesh(program.mesh)
    fn, args = program.build(mesh, np.random.default_rng(3))
    text = jax.jit(commfuse.overlap(fn, schedule="ring")).lower(*args).compile().as_text()
    assert collectives(text) == {"all-reduce": 1, "commfuse": 3}, collectives(text)
    assert re.search(r"= f32\[\] all-reduce(?:-start)?\(", text), "the one XLA all-reduce is the scalar loss's"
    for got, want in zip(jax.tree.leaves(jax.jit(commfuse.overlap(fn, schedule="ring"))(*args)),
                         jax.tree.leaves(jax.jit(fn)(*args))):
        assert_close(np.asarray(got), np.asarray(want), np.float32)


def test_an_fsdp_tp_row_parallel_layer_leaves_xla_no_gather_or_scatter():
    # fsdp_tp_row_parallel: the weight's columns gathered over fsdp, the
    # product reduce-scattered over tp along the sequence. Under ring both
    # collectives run inside one op over both axes; plain XLA runs each.
    from programs import fsdp_tp_row_parallel

    program = fsdp_tp_row_parallel.PROGRAM
    mesh = make_mesh(program.mesh)
    fn, args = program.build(mesh, np.random.default_rng(6))
    ov = commfuse.overlap(fn, schedule="ring")
    assert collectives(jax.jit(ov).lower(*args).compile().as_text()) == {"all-reduce": 1, "commfuse": 1}
    assert collectives(jax.jit(fn).lower(*args).compile().as_text()) == \
        {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1}
    assert any("commfuse.all_gather_matmul_reduce_scatter(" in line for line in ov.last_report), ov.last_report
    for got, want in zip(jax.tree.leaves(jax.jit(ov)(*args)), jax.tree.leaves(jax.jit(fn)(*args))):
        assert_close(np.asarray(got), np.asarray(want), np.float32)


def test_sums_of_products_before_one_collective_are_one_fused_op():
    # psum_scatter(h @ W + (h @ A) @ B) and psum(h @ W + g @ V): under ring
    # XLA runs neither collective; only the scalar loss's psum is left.
    from programs import lora_row_parallel

    program = lora_row_parallel.PROGRAM
    mesh = make_mesh(program.mesh)
    fn, args = program.build(mesh, np.random.default_rng(4))
    ov = commfuse.overlap(fn, schedule="ring")
    text = jax.jit(ov).lower(*args).compile().as_text()
    assert collectives(text) == {"all-reduce": 1, "commfuse": 2}, collectives(text)
    assert re.search(r"= f32\[\] all-reduce(?:-start)?\(", text), "the one XLA all-reduce is the scalar loss's"
    for got, want in zip(jax.tree.leaves(jax.jit(ov)(*args)), jax.tree.leaves(jax.jit(fn)(*args))):
        assert_close(np.asarray(got), np.asarray(want), np.float32)
    summed = [line for line in ov.last_report if "sum of 2 products" in line]
    assert len(summed) == 2 and "matmul_reduce_scatter" in summed[0] and "matmul_all_reduce" in summed[1], \
        "\n".join(ov.last_report)


def test_a_sum_with_a_term_that_is_not_a_product_says_so():
    mesh = make_mesh({"x": 4})
    body = jax.shard_map(lambda h, w, b: jax.lax.psum(h @ w + b, "x"), mesh=mesh,
                         in_specs=(P(None, "x"), P("x"), P()), out_specs=P())
    args = (rand((16, 32), seed=1), rand((32, 8), seed=2), rand((16, 8), seed=3))
    ov = commfuse.overlap(body, schedule="ring")
    assert_close(np.asarray(jax.jit(ov)(*args)), np.asarray(jax.jit(body)(*args)), np.float32)
    assert any("a sum whose terms are not two dot_generals' results" in line for line in ov.last_report), \
        ov.last_report


def test_a_tp_sp_step_with_its_backward_in_the_body_leaves_xla_no_gather_or_scatter():
    # dp_tp_train_step: value_and_grad inside the shard_map, the weight
    # gradients' gathered activations re-gathered inside fused ops; what XLA
    # keeps are all-reduces over dp (the loss's, and each gradient tile's sum).
    from programs import dp_tp_train_step

    program = dp_tp_train_step.PROGRAM
    mesh = make_mesh(program.mesh)
    fn, args = program.build(mesh, np.random.default_rng(5))
    ov = commfuse.overlap(fn, schedule="ring")
    counts = collectives(jax.jit(ov).lower(*args).compile().as_text())
    assert "all-gather" not in counts and "reduce-scatter" not in counts and counts["commfuse"] >= 5, counts
    for got, want in zip(jax.tree.leaves(jax.jit(ov)(*args)), jax.tree.leaves(jax.jit(fn)(*args))):
        assert_close(np.asarray(got), np.asarray(want), np.float32)
