"""schedule="sliced" (the data-slicing baseline) and schedule="tiled" (the ring
at tile granularity), which cut each block into k chunks: numerics against
jax.lax for all_gather_matmul and matmul_reduce_scatter, for k in {1, 2, 4, 8},
N in {2, 4, 8}, f32 and bf16; other dims, gradients, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commfuse
from conftest import (
    P,
    assert_close,
    lax_all_gather_matmul,
    lax_matmul_reduce_scatter,
    mesh1d,
    rand,
    run_sharded,
    spec_on,
)

F32, BF16 = np.float32, jnp.bfloat16
M, K, NO = 16, 32, 24  # rows per rank's block (divisible by every k), contraction, columns

CUT = {"sliced": "slices", "tiled": "tiles"}
CASES = [(s, n, k, dtype) for s in CUT for n in (2, 4, 8) for k in (1, 2, 4, 8) for dtype in (F32, BF16)]


def _id(case):
    schedule, n, k, dtype = case
    return f"{schedule}-N{n}-k{k}-{np.dtype(dtype).name}"


def _cut(schedule, k):
    """The keywords of `schedule` cut into k chunks."""
    return {"schedule": schedule, CUT[schedule]: k}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_all_gather_matmul_cut_matches_lax(case):
    schedule, n, k, dtype = case
    mesh = mesh1d(n)
    x = rand((n * M, K), dtype, seed=3)
    w = rand((K, NO), dtype, seed=4)
    specs = (P("x", None), P(None, None))
    got = run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, "x", **_cut(schedule, k)), mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_all_gather_matmul(a, b, "x"), mesh, specs, x, w)
    assert got.dtype == want.dtype
    assert_close(got, want, dtype)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matmul_reduce_scatter_cut_matches_lax(case):
    schedule, n, k, dtype = case
    mesh = mesh1d(n)
    # Each rank holds x [N*M, K] (different per rank) and scatters the rows.
    x = rand((n * n * M, K), dtype, seed=5)
    w = rand((K, NO), dtype, seed=6)
    specs = (P("x", None), P(None, None))
    got = run_sharded(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", **_cut(schedule, k)), mesh, specs,
                      x, w)
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(a, b, "x"), mesh, specs, x, w)
    assert got.dtype == want.dtype
    assert_close(got, want, dtype)


@pytest.mark.parametrize("schedule", CUT)
def test_default_chunks_and_a_non_leading_row_dim(schedule):
    n = 4
    mesh = mesh1d(n)
    # x [2, M, K] per rank, gathered along dim 1: 2*M rows per rank, 4 slices by default.
    x = rand((2, n * M, K), seed=7)
    w = rand((K, NO), seed=8)
    specs = (spec_on(3, 1, "x"), P(None, None))
    got = run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, "x", gather_dimension=1, schedule=schedule),
                      mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_all_gather_matmul(a, b, "x", gather_dimension=1), mesh, specs, x, w)
    assert_close(got, want)
    got = run_sharded(
        lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", scatter_dimension=1, **_cut(schedule, 2)),
        mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(a, b, "x", scatter_dimension=1), mesh, specs, x, w)
    assert_close(got, want)


@pytest.mark.parametrize("schedule", CUT)
def test_gradients_of_cut_ops_match_lax(schedule):
    n, k = 4, 2
    mesh = mesh1d(n)
    x = rand((n * M, K), seed=9)
    w = rand((K, NO), seed=10)
    specs = (P("x", None), P(None, None))

    def loss(op):
        def f(a, b):
            y = op(a, b)
            return jnp.sum(y * y)
        return lambda a, b: jax.grad(f, argnums=(0, 1))(a, b)

    fused = loss(lambda a, b: commfuse.matmul_reduce_scatter(
        commfuse.all_gather_matmul(a, b, "x", **_cut(schedule, k)), b.T, "x", **_cut(schedule, k)))
    ref = loss(lambda a, b: lax_matmul_reduce_scatter(lax_all_gather_matmul(a, b, "x"), b.T, "x"))
    got = run_sharded(fused, mesh, specs, x, w)
    want = run_sharded(ref, mesh, specs, x, w)
    for g, r in zip(got, want):
        assert_close(g, r)


def _trace(fn, n=4, x_shape=(64, K), w_shape=(K, NO)):
    mesh = mesh1d(n)
    x = np.zeros(x_shape, np.float32)
    w = np.zeros(w_shape, np.float32)
    return run_sharded(fn, mesh, (P("x", None), P(None, None)), x, w)


@pytest.mark.parametrize("schedule", CUT)
def test_chunks_must_divide_the_rows(schedule):
    unit = CUT[schedule]
    with pytest.raises(ValueError, match=f"{unit}=3 equal chunks; {unit} must divide 16"):
        _trace(lambda a, b: commfuse.all_gather_matmul(a, b, "x", **_cut(schedule, 3)))
    # Reduce-scatter: x [16, K] per rank, blocks of 4 rows.
    with pytest.raises(ValueError, match=f"{unit} must divide 4"):
        _trace(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", **_cut(schedule, 3)))
    # More chunks than rows: nothing to cut.
    with pytest.raises(ValueError, match=f"{unit}=8 is more than the 4 rows of each rank's block"):
        _trace(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", **_cut(schedule, 8)))


@pytest.mark.parametrize("unit", ["slices", "tiles"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_chunks_must_be_a_positive_int(unit, value):
    with pytest.raises(ValueError, match=rf"{unit} must be an int in \[1, 1024\]"):
        _trace(lambda a, b: commfuse.all_gather_matmul(a, b, "x", **{unit: value}))


@pytest.mark.parametrize("schedule", CUT)
def test_cut_schedules_are_rejected_where_they_do_not_exist(schedule):
    with pytest.raises(ValueError, match=f"schedule='{schedule}' exists only for all_gather_matmul"):
        _trace(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", scatter_dimension=1, schedule=schedule),
               w_shape=(K, 8))
    with pytest.raises(ValueError, match=f"schedule='{schedule}' exists only for all_gather_matmul"):
        _trace(lambda a, b: commfuse.matmul_all_gather(a, b, "x", schedule=schedule), x_shape=(16, K),
               w_shape=(K, 8))
