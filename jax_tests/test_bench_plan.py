"""The planner's benchmark machinery (``python -m commfuse.bench_plan``):
its rank correlation, its binding limit, and a candidate run as measured
(placed as planned, its products' collectives through the link model)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from commfuse import bench_plan
from commfuse._planner import corpus
from commfuse._planner.evaluate import evaluate
from commfuse._planner.space import Candidate


def test_spearman_is_the_rank_correlation():
    assert bench_plan.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench_plan.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # Monotone, not linear: ranks only.
    assert bench_plan.spearman([1, 2, 3, 4], [1, 10, 100, 1000]) == pytest.approx(1.0)
    # Ties share their mean rank.
    assert bench_plan.spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    assert abs(bench_plan.spearman(a, b)) < 0.4


def test_candidates_run_as_planned_their_transfers_through_the_link(monkeypatch):
    """A plain layout runs with its products' collectives through the link
    model (commfuse's sequential schedule): XLA is left far fewer bytes to
    move than its plain program has; a fused one runs its decisions."""
    monkeypatch.setenv(bench_plan.LINK_VAR, bench_plan.link_spec(50.0))
    case = corpus.build("gpt_linen", "test")
    step = bench_plan._step_of(case)
    pool = jax.devices()[:8]
    fsdp = Candidate((("data", 1), ("fsdp", 8), ("tensor", 1)), remat="nothing")
    planned = evaluate(step, fsdp, pool, machine="cpu_here", collectives="blocking")
    runner = bench_plan.Runner(step, case.args, fsdp, [], pool)
    assert runner.run(1) > 0 and runner.memory_bytes > 0
    # The state advances: parameters are the last step's (donated and replaced).
    assert all(not p.is_deleted() for p in jax.tree.leaves(runner.state[0]))
    plain_bytes = sum(planned.priced.collective_bytes.values())
    assert plain_bytes > 0 and runner.xla_bytes < 0.5 * plain_bytes, (runner.xla_bytes, plain_bytes)
    assert "commfuse_collective_matmul_cpu" in runner.compiled.as_text()
    fused = fsdp.with_(fused=True)
    e = evaluate(step, fused, pool, machine="cpu_here", collectives="blocking")
    assert e.decisions, "the fused candidate decided no library call"
    fused_runner = bench_plan.Runner(step, case.args, fused, e.decisions, pool)
    assert fused_runner.run(1) > 0
    text = fused_runner.compiled.as_text()
    assert text.count("commfuse_collective_matmul_cpu") >= sum(1 for d in e.decisions if d.fused)
