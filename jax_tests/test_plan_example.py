"""The planning example (``python -m commfuse.examples.plan_model``): a
Flax Linen GPT step planned for 8 H100s under a memory limit that binds,
saved and loaded, then trained through the plan on 8 CPU devices with the
plain step's losses."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="the planning example needs flax (the `test` extra installs it)")
pytest.importorskip("optax", reason="the planning example needs optax (the `test` extra installs it)")

from commfuse.examples import plan_model  # noqa: E402


def test_the_planned_step_trains_as_the_plain_step_within_the_limit(tmp_path):
    limit_mib = 0.6
    plan, planned, plain = plan_model.run(limit_mib, steps=3, path=tmp_path / "plan.json")
    assert plan.predicted_memory_bytes <= limit_mib * 2**20
    # The limit binds: the fastest layout of all needs more.
    fastest = min((row for row in plan.candidates if row["predicted_s"] is not None),
                  key=lambda row: row["predicted_s"])
    assert fastest["memory_bytes"] > limit_mib * 2**20
    assert not any(row["fits"] and row["predicted_s"] < plan.predicted_step_s for row in plan.candidates)
    # The plan runs fused (its FSDP gathers consume the weights piece by
    # piece: that is what fits), its decisions imposed through the step.
    assert plan.fused and any(d.fused for d in plan.decisions), plan
    np.testing.assert_allclose(planned, plain, rtol=1e-5)
    assert plain[-1] < plain[0]
