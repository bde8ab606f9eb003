"""The planner's benchmark machinery (``python -m commfuse.bench_plan``):
its rank correlation, its binding limit, and a candidate run as measured
(placed as planned, its products' collectives through the link model)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from commfuse import bench_plan
from commfuse._planner import corpus
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


def test_a_candidate_runs_as_planned_and_counts_what_xla_moves_itself(monkeypatch):
    monkeypatch.setenv(bench_plan.LINK_VAR, bench_plan.link_spec(50.0))
    case = corpus.build("gpt_linen", "test")
    step = bench_plan._step_of(case)
    pool = jax.devices()[:8]
    fsdp = Candidate((("data", 1), ("fsdp", 8), ("tensor", 1)), remat="nothing")
    runner = bench_plan.Runner(step, case.args, fsdp, [], pool)
    first = runner.run(1)
    assert first > 0 and runner.memory_bytes > 0
    # The state advances: parameters are the last step's (donated and replaced).
    params = jax.tree.leaves(runner.state[0])
    assert all(not p.is_deleted() for p in params)
    assert runner.xla_bytes >= 0 and runner.xla_link_s >= 0
