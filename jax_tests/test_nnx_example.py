"""The Flax NNX example (``python -m commfuse.examples.nnx_tp``): a block
sharded with ``nnx.with_partitioning`` under ``jax.jit`` trains through
``commfuse.overlap`` with the plain run's losses and fused ops in the
compiled step."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax", reason="the NNX example needs flax (the `test` extra installs it)")
pytest.importorskip("optax", reason="the NNX example needs optax (the `test` extra installs it)")

from commfuse.examples import nnx_tp  # noqa: E402


def test_nnx_block_trains_through_overlap_with_the_plain_losses_and_fused_ops():
    plain, fused, count, report = nnx_tp.run(3, schedule="ring")
    np.testing.assert_allclose(fused, plain, rtol=1e-4)
    assert plain[-1] < plain[0]  # it trains
    # Row-parallel products' all-reduce over `model` (forward and backward)
    # and the weight gradients' over `data`, each one fused op.
    assert count >= 4, "\n".join(report)
    partitioned = [line for line in report if line.startswith("overlap[partitioned]")]
    assert any("matmul_all_reduce over ('model',)" in line for line in partitioned), "\n".join(report)
    assert any("matmul_all_reduce over ('data',)" in line for line in partitioned), "\n".join(report)


def test_nnx_example_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "commfuse.examples.nnx_tp", "--steps", "2"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "fused ops in the compiled overlapped step (after partitioning)" in out.stdout
    assert "largest relative loss difference" in out.stdout
