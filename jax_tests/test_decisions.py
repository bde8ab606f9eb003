"""Fusion decisions as values: made from shapes before anything is traced,
read the same way by the named ops, ``overlap``'s rewrite and report,
``commfuse.matmul``'s partitioner and ``commfuse.explain``, and imposed
from outside (a plan's)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, mesh1d, place, rand
from jax.sharding import PartitionSpec as P
from programs import make_mesh

import commfuse
from commfuse import _abi, _all_gather_matmul, _matmul_reduce_scatter
from commfuse._decide import Policy, decide
from commfuse._decision import NONE, Call, Decision
from commfuse._op import OpDecision

RING = _abi.SCHEDULES["ring"]
BIDIRECTIONAL = _abi.SCHEDULES["bidirectional"]


def _call(ranks=4, rows=8, k=16, n=12, kind=_abi.Kind.ALL_GATHER_MATMUL):
    return Call.of(kind, ranks, 0, (rows, k), (k, n), np.float32, np.float32)


def test_a_decision_is_a_value_of_the_call_and_the_policy():
    call = _call()
    a, b = decide(call, Policy(asked=RING)), decide(call, Policy(asked=RING))
    assert a == b and hash(a) == hash(b)
    assert a.fused and a.schedule == RING and a.why == "as asked"
    assert a.out_shape == (4 * 8, 12)
    assert decide(call, Policy(asked=_abi.UNFUSED)).schedule == _abi.UNFUSED


def test_an_imposed_decision_wins_over_the_schedule_asked():
    call, other = _call(), _call(rows=16)
    policy = Policy(asked=RING, imposed=((call, BIDIRECTIONAL),))
    assert decide(call, policy).schedule == BIDIRECTIONAL
    assert decide(call, policy).why == "imposed by the plan"
    assert decide(other, policy).schedule == RING


def test_a_schedule_that_cannot_run_raises_for_a_user_and_is_a_reason_for_a_rewrite():
    # tiled(3) does not divide 8 rows: the user's call raises, a rewrite's decision says why.
    call = _call(rows=8)
    tiled = _abi.schedule_code("tiled", 3)
    with pytest.raises(ValueError, match="tiles=3"):
        decide(call, Policy(asked=tiled))
    refused = decide(call, Policy(asked=tiled, strict=False))
    assert refused.schedule == _abi.UNFUSED and not refused.fused
    assert "cannot run on these shards" in refused.why and "tiles=3" in refused.why


def test_an_empty_call_is_decided_to_run_nothing():
    call = Call.of(_abi.Kind.ALL_GATHER_MATMUL, 4, 0, (0, 16), (16, 12), np.float32, np.float32)
    d = decide(call, Policy(asked=RING))
    assert d.schedule == NONE and not d.fused and d.out_shape == (0, 12)


def test_auto_decides_from_shapes_on_the_machine_it_is_given(monkeypatch):
    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "1")
    big = _call(ranks=8, rows=4096, k=8192, n=4096)
    tiny = _call(ranks=2, rows=8, k=8, n=8)
    on_gpu = decide(big, Policy(machine="h100_nvlink"))
    assert on_gpu.fused and on_gpu.predicted is not None
    fused_s, unfused_s = on_gpu.predicted
    assert fused_s < unfused_s
    # A fused call's fixed cost (16 us on the GPU presets) is more than the
    # gain on a tiny product: auto keeps jax.lax's.
    declined = decide(tiny, Policy(machine="h100_nvlink"))
    assert declined.schedule == _abi.UNFUSED and "fixed cost" in declined.why


def test_auto_weighs_an_all_reduce_against_xla_combining_it_with_others(monkeypatch):
    # On the GPU preset this all-reduce's gain from fusing is mostly its own
    # chain of link latencies; combined by XLA with 7 others, the unfused
    # form pays an eighth of them, and auto keeps it unfused.
    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "1")
    call = Call.of(_abi.Kind.MATMUL_ALL_REDUCE, 8, 0, (1024, 1024), (1024, 1024), np.float32, np.float32)
    alone = decide(call, Policy(machine="h100_nvlink"))
    combined = decide(call, Policy(machine="h100_nvlink"), combined=8)
    assert alone.fused and "faster than unfused (" in alone.why, alone.why
    assert combined.schedule == _abi.UNFUSED and "combined by XLA with 7 other all-reduces" in combined.why


def test_the_rewrite_counts_the_all_reduces_xla_may_combine(monkeypatch):
    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "1")
    mesh = make_mesh({"x": 4})
    body = lambda x, w1, w2: (jax.lax.psum(x @ w1, "x"), jax.lax.psum(x @ w2, "x"))  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x"), P("x")), out_specs=(P(), P()))
    args = [rand(s, seed=i) for i, s in enumerate([(64, 128), (128, 64), (128, 64)])]
    ov = commfuse.overlap(f, machine="h100_nvlink")
    for got, want in zip(jax.jit(ov)(*args), jax.jit(f)(*args)):
        assert_close(np.asarray(got), np.asarray(want), np.float32)
    lines = [line for line in ov.last_report if "matmul_all_reduce" in line]
    assert len(lines) == 2 and all("combined by XLA with 1 other all-reduce" in line for line in lines), lines


def test_an_ops_decision_is_made_from_shape_structs_inside_the_body():
    """The named op's `decide` takes ShapeDtypeStructs: nothing is traced
    for it, and what it decides is what the op binds."""
    mesh = mesh1d(4, "tp")
    seen = {}

    def body(x, w):
        xs, ws = jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype)
        decision = _all_gather_matmul.decide(xs, ws, "tp", schedule="bidirectional")
        seen["decision"] = decision
        return _all_gather_matmul.run(decision, x, w)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp")))
    x, w = rand((16, 8), seed=1), rand((8, 6), seed=2)
    got = np.asarray(f(place(x, mesh, P("tp")), place(w, mesh, P())))
    for per_device in got:  # every rank holds the whole product
        assert_close(per_device, x @ w, np.float32)
    decision = seen["decision"]
    assert isinstance(decision, OpDecision) and decision.fused
    (call,) = decision.calls
    assert call.schedule == BIDIRECTIONAL and call.call.x == (4, 8) and call.call.ranks == 4
    text = f.lower(place(x, mesh, P("tp")), place(w, mesh, P())).compile().as_text()
    assert _schedules_in(text) == [BIDIRECTIONAL]


def test_a_refused_op_is_a_value_under_a_lenient_policy_and_an_error_for_a_user():
    mesh = mesh1d(4, "tp")

    def body(x, w):
        xs = jax.ShapeDtypeStruct(x.shape, x.dtype)
        ws = jax.ShapeDtypeStruct((w.shape[0] + 1, w.shape[1]), w.dtype)  # contraction mismatch
        refused = _matmul_reduce_scatter.decide(xs, ws, "tp", policy=Policy(strict=False))
        assert not refused.fused and "contracts its last dim" in refused.refused
        with pytest.raises(ValueError, match="contracts its last dim"):
            _matmul_reduce_scatter.decide(xs, ws, "tp")
        return x @ w

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P(None, "tp")))(
        place(rand((8, 16)), mesh, P(None, "tp")), place(rand((16, 8)), mesh, P("tp")))


def _tp_mlp(mesh):
    def body(x, w1, w2):
        h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
        return jax.lax.psum_scatter(jax.nn.gelu(h) @ w2, "tp", scatter_dimension=0, tiled=True)

    return jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))


def _schedules_in(text: str) -> list:
    """The schedule codes of the commfuse custom calls of a compiled program, in order."""
    return [int(m) for m in re.findall(r"commfuse_collective_matmul_cpu.*?schedule = (\d+)", text)]


def test_the_report_is_the_list_of_decisions_and_the_program_runs_them():
    mesh = mesh1d(4, "tp")
    x, w1, w2 = rand((32, 16), seed=3), rand((16, 24), seed=4), rand((24, 16), seed=5)
    args = (place(x, mesh, P("tp")), place(w1, mesh, P(None, "tp")), place(w2, mesh, P("tp")))
    fused = commfuse.overlap(_tp_mlp(mesh), schedule="ring")
    out = jax.jit(fused)(*args)
    want = jax.jit(_tp_mlp(mesh))(*args)
    assert_close(np.asarray(out), np.asarray(want), np.float32)
    decisions = fused.last_decisions
    assert [d.op for d in decisions] == ["all_gather_matmul", "matmul_reduce_scatter"]
    assert all(isinstance(d, OpDecision) and d.fused for d in decisions)
    rewrites = [line for line in fused.last_report if "]: rewrote " in line]
    assert len(rewrites) == len(decisions)
    for line, d in zip(rewrites, decisions):
        assert d.why in line
    text = jax.jit(fused).lower(*args).compile().as_text()
    assert _schedules_in(text) == [c.schedule for d in decisions for c in d.calls]


def test_a_declining_auto_traces_nothing():
    """auto declines a tiny layer: the rewritten program holds exactly the
    equations of the original (no trace of the declined fused ops)."""
    mesh = mesh1d(4, "tp")
    x, w1, w2 = rand((8, 4), seed=3), rand((4, 8), seed=4), rand((8, 4), seed=5)
    args = (place(x, mesh, P("tp")), place(w1, mesh, P(None, "tp")), place(w2, mesh, P("tp")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMMFUSE_AUTO_UNFUSED", "1")
        mp.setenv("COMMFUSE_MACHINE", "h100_nvlink")
        fused = commfuse.overlap(_tp_mlp(mesh))
        rewritten = jax.make_jaxpr(fused)(*args)
    # Both candidates were decided (values in the report: each way each was
    # tried, the gather as the activation's and as the weight's), none fused.
    declined = fused.last_decisions
    assert {"all_gather_matmul", "matmul_reduce_scatter"} <= {d.op for d in declined}
    assert all(isinstance(d, OpDecision) and not d.fused and "fixed cost" in d.why for d in declined), declined
    plain = jax.make_jaxpr(_tp_mlp(mesh))(*args)
    assert _primitives(rewritten.jaxpr) == _primitives(plain.jaxpr)


def _primitives(jaxpr) -> list:
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", None)
            if inner is not None:
                out.extend(_primitives(getattr(inner, "jaxpr", inner)))
    return out


def test_imposed_decisions_reach_the_program():
    """A plan's decisions, imposed through overlap, are what the compiled
    program runs, whatever schedule is asked for the rest."""
    mesh = mesh1d(4, "tp")
    x, w1, w2 = rand((32, 16), seed=6), rand((16, 24), seed=7), rand((24, 16), seed=8)
    args = (place(x, mesh, P("tp")), place(w1, mesh, P(None, "tp")), place(w2, mesh, P("tp")))
    probe = commfuse.overlap(_tp_mlp(mesh), schedule="ring")
    jax.make_jaxpr(probe)(*args)
    gather_call = probe.last_decisions[0].calls[0].call
    imposed = commfuse.overlap(_tp_mlp(mesh), schedule="ring", decisions=[(gather_call, "bidirectional")])
    out = jax.jit(imposed)(*args)
    assert_close(np.asarray(out), np.asarray(jax.jit(_tp_mlp(mesh))(*args)), np.float32)
    text = jax.jit(imposed).lower(*args).compile().as_text()
    assert _schedules_in(text) == [BIDIRECTIONAL, RING]
    assert imposed.last_decisions[0].calls[0].why == "imposed by the plan"
    with pytest.raises(ValueError, match="but 'auto'"):
        commfuse.overlap(_tp_mlp(mesh), decisions=[(gather_call, "auto")])
    with pytest.raises(ValueError, match="but 'auto'"):
        commfuse.overlap(_tp_mlp(mesh), decisions=[(gather_call, 99)])
    with pytest.raises(ValueError, match="imposed both"):
        commfuse.overlap(_tp_mlp(mesh), decisions=[(gather_call, "ring"), (gather_call, "bidirectional")])
    with pytest.raises(TypeError, match="decisions must hold"):
        commfuse.overlap(_tp_mlp(mesh), decisions=[("all_gather_matmul", "ring")])
    # Another overlap's decisions, as they are: the same program.
    again = commfuse.overlap(_tp_mlp(mesh), schedule="ring", decisions=imposed.last_decisions)
    assert _schedules_in(jax.jit(again).lower(*args).compile().as_text()) == [BIDIRECTIONAL, RING]


def test_explain_and_the_op_take_the_same_decision(monkeypatch):
    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "1")
    for rows, n in ((64, 16), (4096, 4096)):
        explained = commfuse._explain.predict("matmul_reduce_scatter", (rows, 16), (16, n), 4, machine="h100_nvlink")
        call = Call.of(_abi.Kind.MATMUL_REDUCE_SCATTER, 4, 0, (rows, 16), (16, n), np.float32, np.float32)
        op = decide(call, Policy(machine="h100_nvlink"))
        assert explained["decision"] == ("unfused" if not op.fused else explained["choice"]), (explained, op)
        assert explained["decision_reason"] == op.why


def test_partitioned_products_are_reported_as_decisions():
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    x = place(rand((16, 32), seed=9), mesh, P("tp", None))
    w = place(rand((32, 8), seed=10), mesh, P())
    fused = commfuse.overlap(lambda x, w: jax.lax.with_sharding_constraint(
        x @ w, jax.sharding.NamedSharding(mesh, P())), schedule="ring")
    assert_close(np.asarray(jax.jit(fused)(x, w)), np.asarray(x) @ np.asarray(w), np.float32)
    (entry,) = fused.last_partitioned
    assert entry.choice.op == "all_gather_matmul"
    (decision,) = entry.decided.calls
    assert isinstance(decision, Decision) and decision.schedule == RING and decision.call.x == (4, 32)
    assert entry in fused.last_decisions
