"""The training example (commfuse.examples.train_block): a few steps of the
fused program must train exactly like its unfused jax.lax twin and like the
same model trained on one device without sharding."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import jax
import numpy as np
import pytest
from conftest import REPO_ROOT, assert_close, devices

pytest.importorskip("optax", reason="the training example needs optax (pip install '.[examples]')")
pytest.importorskip("equinox", reason="the training example needs equinox (pip install '.[examples]')")

STEPS = 3
# Relative to the largest value, as conftest.assert_close does. The programs
# sum in other orders (float32): the losses differ by ~1e-7 relative; Adam
# amplifies rounding in the parameters whose gradients are tiny (~5e-5 seen).
# Dropping one gradient's dp reduction moves the losses by ~1e-2.
RTOL_LOSS = 1e-4
RTOL_PARAMS = 1e-3


def _load_example():
    try:
        return importlib.import_module("commfuse.examples.train_block")
    except ModuleNotFoundError:
        # An installed commfuse built without the examples subpackage: use the
        # source tree's file, against the installed library.
        path = REPO_ROOT / "python" / "commfuse" / "examples" / "train_block.py"
        spec = importlib.util.spec_from_file_location("_commfuse_example_train_block", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module


tb = _load_example()


@pytest.fixture(scope="module")
def runs():
    devs = devices(tb.DEVICES)
    return {
        "fused": tb.train(STEPS, True, devices=devs),
        "unfused": tb.train(STEPS, False, devices=devs),
        "reference": tb.reference_train(STEPS),
    }


def _leaves(params):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(params)]


def test_losses_match(runs):
    fused, unfused, reference = (np.asarray(runs[k][0]) for k in ("fused", "unfused", "reference"))
    assert fused.shape == (STEPS,)
    assert np.all(np.isfinite(fused))
    assert_close(fused, unfused, rtol=RTOL_LOSS, err_msg="fused vs unfused losses")
    assert_close(unfused, reference, rtol=RTOL_LOSS, err_msg="unfused vs single-device losses")
    assert fused[-1] < fused[0], f"the loss did not decrease: {fused}"


def test_parameters_match(runs):
    names = [f.name for f in tb.dataclasses.fields(tb.Block) if f.name != "heads"]
    fused, unfused, reference = (_leaves(runs[k][1]) for k in ("fused", "unfused", "reference"))
    assert len(fused) == len(names)
    initial = _leaves(tb.Block.init(tb.Config()))
    for name, f, u, r, p0 in zip(names, fused, unfused, reference, initial):
        assert not np.allclose(f, p0), f"{name} was not updated"
        assert_close(f, u, rtol=RTOL_PARAMS, err_msg=f"{name}: fused vs unfused")
        assert_close(u, r, rtol=RTOL_PARAMS, err_msg=f"{name}: unfused vs single-device")


def test_fused_step_uses_commfuse():
    mesh = tb.mesh_for(tb.Config(), devices(tb.DEVICES))
    fused = tb.Trainer(tb.Config(), True, mesh).count_fused_ops()
    unfused = tb.Trainer(tb.Config(), False, mesh).count_fused_ops()
    # Forward: 2 all_gather_matmul, 2 matmul_reduce_scatter, 1 matmul_all_gather;
    # backward: 6 written in the example (plus what the readout's VJP issues).
    assert fused >= 11, f"the fused step has only {fused} {tb.PRIMITIVE} ops"
    assert unfused == 0
