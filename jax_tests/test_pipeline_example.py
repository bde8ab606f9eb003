"""The pipeline example (commfuse.examples.pipeline): two stages on two
meshes with different TP layouts, activations and gradients crossing with
commfuse.reshard, must train like the same model on one device."""

from __future__ import annotations

import numpy as np

from commfuse.examples import pipeline


def test_two_stage_pipeline_trains_like_one_device():
    lines = []
    losses, timings = pipeline.run(steps=3, microbatches=3, reps=1, trace_dir=None, out=lines.append)
    assert len(losses) == 3
    for loss, reference in losses:
        np.testing.assert_allclose(loss, reference, rtol=1e-5)
    assert losses[-1][0] < losses[0][0], "the loss goes down"
    # The reported overlap is the share of the transfers' time that the step
    # did not add to its compute (no bound: noise can push it past 0 or 1).
    assert abs(timings["hidden"] - (1 - timings["exposed"] / timings["transfers_only"])) < 1e-9
    assert any("of the transfer time hidden behind compute" in line for line in lines)
    assert sum(line.startswith("step time with") for line in lines) == 2
