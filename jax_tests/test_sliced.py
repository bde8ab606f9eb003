"""schedule="sliced" (the data-slicing baseline): numerics against jax.lax for
all_gather_matmul and matmul_reduce_scatter, for slices k in {1, 2, 4, 8},
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

CASES = [(n, k, dtype) for n in (2, 4, 8) for k in (1, 2, 4, 8) for dtype in (F32, BF16)]


def _id(case):
    n, k, dtype = case
    return f"N{n}-k{k}-{np.dtype(dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_all_gather_matmul_sliced_matches_lax(case):
    n, k, dtype = case
    mesh = mesh1d(n)
    x = rand((n * M, K), dtype, seed=3)
    w = rand((K, NO), dtype, seed=4)
    specs = (P("x", None), P(None, None))
    got = run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule="sliced", slices=k), mesh, specs,
                      x, w)
    want = run_sharded(lambda a, b: lax_all_gather_matmul(a, b, "x"), mesh, specs, x, w)
    assert got.dtype == want.dtype
    assert_close(got, want, dtype)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matmul_reduce_scatter_sliced_matches_lax(case):
    n, k, dtype = case
    mesh = mesh1d(n)
    # Each rank holds x [N*M, K] (different per rank) and scatters the rows.
    x = rand((n * n * M, K), dtype, seed=5)
    w = rand((K, NO), dtype, seed=6)
    specs = (P("x", None), P(None, None))
    got = run_sharded(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", schedule="sliced", slices=k), mesh,
                      specs, x, w)
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(a, b, "x"), mesh, specs, x, w)
    assert got.dtype == want.dtype
    assert_close(got, want, dtype)


def test_default_slices_and_a_non_leading_row_dim():
    n = 4
    mesh = mesh1d(n)
    # x [2, M, K] per rank, gathered along dim 1: 2*M rows per rank, 4 slices by default.
    x = rand((2, n * M, K), seed=7)
    w = rand((K, NO), seed=8)
    specs = (spec_on(3, 1, "x"), P(None, None))
    got = run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, "x", gather_dimension=1, schedule="sliced"),
                      mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_all_gather_matmul(a, b, "x", gather_dimension=1), mesh, specs, x, w)
    assert_close(got, want)
    got = run_sharded(
        lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", scatter_dimension=1, schedule="sliced", slices=2),
        mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(a, b, "x", scatter_dimension=1), mesh, specs, x, w)
    assert_close(got, want)


def test_gradients_of_sliced_ops_match_lax():
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
        commfuse.all_gather_matmul(a, b, "x", schedule="sliced", slices=k), b.T, "x", schedule="sliced", slices=k))
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


def test_slices_must_divide_the_rows():
    with pytest.raises(ValueError, match="slices must divide 16"):
        _trace(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule="sliced", slices=3))
    # Reduce-scatter: x [16, K] per rank, blocks of 4 rows.
    with pytest.raises(ValueError, match="slices must divide 4"):
        _trace(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", schedule="sliced", slices=8))


@pytest.mark.parametrize("slices", [0, -1, 1.5, True])
def test_slices_must_be_a_positive_int(slices):
    with pytest.raises(ValueError, match="slices must be an int >= 1"):
        _trace(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule="sliced", slices=slices))


def test_sliced_is_rejected_where_it_does_not_exist():
    with pytest.raises(ValueError, match="sliced"):
        _trace(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", scatter_dimension=1, schedule="sliced"),
               w_shape=(K, 8))
    with pytest.raises(ValueError, match="sliced"):
        _trace(lambda a, b: commfuse.matmul_all_gather(a, b, "x", schedule="sliced"), x_shape=(16, K),
               w_shape=(K, 8))
