"""Numerics of commfuse.all_gather_matmul / matmul_reduce_scatter.

Every case runs under ``jax.jit(jax.shard_map(...))`` and is compared, device
by device, with the literal jax.lax expressions

    all_gather_matmul     == jax.lax.all_gather(x, ax, axis=gd, tiled=True) @ w
    matmul_reduce_scatter == jax.lax.psum_scatter(x @ w, ax, scatter_dimension=sd, tiled=True)

For bfloat16 / float16 the result is also compared with the same expression
evaluated on the inputs upcast to float32, i.e. close to the exact answer.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commfuse
from conftest import (
    SCHEDULES,
    P,
    assert_close,
    enable_x64,
    lax_all_gather_matmul,
    lax_matmul_reduce_scatter,
    mesh1d,
    rand,
    run_sharded,
    spec_on,
    varying_axes,
)

F32, F64, BF16, F16 = np.float32, np.float64, jnp.bfloat16, np.float16

# The ops accumulate bf16/f16 in float32 and round once, so against the
# float32 reference each element is off by at most half an ulp of the output
# type (2^-9 for bf16, 2^-12 for f16) of the largest value: tighter than the
# dtype tolerance, so that a 1% error cannot pass.
_UPCAST_RTOL = {np.dtype(BF16): 5e-3, np.dtype(F16): 1.5e-3}


# --------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------
def _agmm_case(
    n,
    local_x_shape,
    n_out,
    *,
    x_dtype=F32,
    w_dtype=None,
    gather_dimension=0,
    schedule="auto",
    precision=None,
    preferred_element_type=None,
    seed=0,
    check_upcast=True,
):
    """all_gather_matmul on an ``n``-device mesh.

    ``x`` is sharded along ``gather_dimension`` (local shape ``local_x_shape``);
    ``w`` is column-sharded (local shape ``[k, n_out]``), as in tensor-parallel
    layers.  Returns the per-device fused result.
    """
    w_dtype = x_dtype if w_dtype is None else w_dtype
    mesh = mesh1d(n)
    rng = np.random.default_rng(seed)
    gx_shape = list(local_x_shape)
    gx_shape[gather_dimension] *= n
    k = local_x_shape[-1]
    x = rand(gx_shape, x_dtype, rng=rng)
    w = rand((k, n_out * n), w_dtype, rng=rng)
    specs = (spec_on(len(gx_shape), gather_dimension, "x"), spec_on(2, 1, "x"))
    kwargs = dict(
        gather_dimension=gather_dimension,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )

    got = run_sharded(
        lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule=schedule, **kwargs),
        mesh, specs, x, w,
    )
    want = run_sharded(
        lambda a, b: lax_all_gather_matmul(a, b, "x", **kwargs), mesh, specs, x, w
    )
    out_shape = list(local_x_shape[:-1]) + [n_out]
    out_shape[gather_dimension] *= n
    assert got.shape == (n, *out_shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert_close(got, want)

    if check_upcast and np.dtype(want.dtype).itemsize < 4:
        hi = run_sharded(
            lambda a, b: lax_all_gather_matmul(
                a.astype(jnp.float32), b.astype(jnp.float32), "x",
                gather_dimension=gather_dimension,
            ),
            mesh, specs, x, w,
        )
        assert_close(got, hi, rtol=_UPCAST_RTOL[np.dtype(want.dtype)], err_msg="vs float32 upcast reference")

    # Independent check in float64 numpy: device r holds gather(x) @ w[:, block r].
    full = np.matmul(x.astype(np.float64), w.astype(np.float64))
    blocks = np.split(full, n, axis=-1)
    assert_close(got, np.stack(blocks), dtype=want.dtype, err_msg="vs numpy float64")
    return got


def _mmrs_case(
    n,
    local_x_shape,
    n_out,
    *,
    x_dtype=F32,
    w_dtype=None,
    scatter_dimension=0,
    schedule="auto",
    precision=None,
    preferred_element_type=None,
    seed=0,
    check_upcast=True,
):
    """matmul_reduce_scatter on an ``n``-device mesh.

    ``x`` is sharded along its contraction (last) dim, local shape
    ``local_x_shape``; ``w`` is row-sharded (local ``[k, n_out]``), so the
    partial products summed by the reduce-scatter add up to the full matmul.
    """
    w_dtype = x_dtype if w_dtype is None else w_dtype
    mesh = mesh1d(n)
    rng = np.random.default_rng(seed)
    nd = len(local_x_shape)
    k = local_x_shape[-1]
    gx_shape = list(local_x_shape[:-1]) + [k * n]
    x = rand(gx_shape, x_dtype, rng=rng)
    w = rand((k * n, n_out), w_dtype, rng=rng)
    specs = (spec_on(nd, nd - 1, "x"), spec_on(2, 0, "x"))
    kwargs = dict(
        scatter_dimension=scatter_dimension,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )

    got = run_sharded(
        lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", schedule=schedule, **kwargs),
        mesh, specs, x, w,
    )
    want = run_sharded(
        lambda a, b: lax_matmul_reduce_scatter(a, b, "x", **kwargs), mesh, specs, x, w
    )
    out_shape = list(local_x_shape[:-1]) + [n_out]
    out_shape[scatter_dimension] //= n
    assert got.shape == (n, *out_shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert_close(got, want)

    if check_upcast and np.dtype(want.dtype).itemsize < 4:
        hi = run_sharded(
            lambda a, b: lax_matmul_reduce_scatter(
                a.astype(jnp.float32), b.astype(jnp.float32), "x",
                scatter_dimension=scatter_dimension,
            ),
            mesh, specs, x, w,
        )
        assert_close(got, hi, rtol=_UPCAST_RTOL[np.dtype(want.dtype)], err_msg="vs float32 upcast reference")

    # Independent check in float64 numpy: the full product, split into blocks.
    full = np.matmul(x.astype(np.float64), w.astype(np.float64))
    blocks = np.split(full, n, axis=scatter_dimension)
    assert_close(got, np.stack(blocks), dtype=want.dtype, err_msg="vs numpy float64")
    return got


# --------------------------------------------------------------------------
# dtype x schedule grid (small meshes)
# --------------------------------------------------------------------------
GRID_DTYPES = [F32, BF16, F16]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", GRID_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_all_gather_matmul_grid(n, dtype, schedule):
    _agmm_case(n, (8, 32), 24, x_dtype=dtype, schedule=schedule, seed=n)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", GRID_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_matmul_reduce_scatter_grid(n, dtype, schedule):
    _mmrs_case(n, (8 * n, 32), 24, x_dtype=dtype, schedule=schedule, seed=n)


# N = 8: every schedule in float32, the low-precision dtypes with "auto".
N8_CASES = [(F32, s) for s in SCHEDULES] + [(BF16, "auto"), (F16, "bidirectional")]
N8_IDS = [f"{np.dtype(d).name}-{s}" for d, s in N8_CASES]


@pytest.mark.parametrize("dtype,schedule", N8_CASES, ids=N8_IDS)
def test_all_gather_matmul_n8(dtype, schedule):
    _agmm_case(8, (16, 48), 40, x_dtype=dtype, schedule=schedule, seed=8)


@pytest.mark.parametrize("dtype,schedule", N8_CASES, ids=N8_IDS)
def test_matmul_reduce_scatter_n8(dtype, schedule):
    _mmrs_case(8, (64, 48), 40, x_dtype=dtype, schedule=schedule, seed=8)


@pytest.mark.parametrize("schedule", ["auto", "bidirectional"])
def test_all_gather_matmul_n16(schedule):
    _agmm_case(16, (4, 32), 16, schedule=schedule, seed=16)


@pytest.mark.parametrize("schedule", ["auto", "bidirectional"])
def test_matmul_reduce_scatter_n16(schedule):
    _mmrs_case(16, (32, 32), 16, schedule=schedule, seed=16)


def test_all_gather_matmul_float64():
    with enable_x64():
        for schedule in ("ring", "bidirectional"):
            got = _agmm_case(4, (6, 20), 10, x_dtype=F64, schedule=schedule, seed=64)
            assert got.dtype == np.float64


def test_matmul_reduce_scatter_float64():
    with enable_x64():
        for schedule in ("ring", "bidirectional"):
            got = _mmrs_case(4, (12, 20), 10, x_dtype=F64, schedule=schedule, seed=64)
            assert got.dtype == np.float64


# --------------------------------------------------------------------------
# Odd shapes: one row per rank, k and n not multiples of 8, odd mesh sizes
# --------------------------------------------------------------------------
ODD_SCHEDULES = ["ring", "bidirectional", "sequential"]


@pytest.mark.parametrize("schedule", ODD_SCHEDULES)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_all_gather_matmul_one_row_per_rank(n, schedule):
    _agmm_case(n, (1, 13), 7, schedule=schedule, seed=100 + n)


@pytest.mark.parametrize("schedule", ODD_SCHEDULES)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_matmul_reduce_scatter_one_row_per_rank(n, schedule):
    _mmrs_case(n, (n, 13), 7, schedule=schedule, seed=100 + n)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: np.dtype(d).name)
def test_all_gather_matmul_odd_sizes(dtype):
    # m=3 rows per rank, k=13, n=7 (k, n not multiples of 8) on 4 devices.
    _agmm_case(4, (3, 13), 7, x_dtype=dtype, schedule="bidirectional", seed=7)
    _agmm_case(4, (5, 1), 1, x_dtype=dtype, schedule="ring", seed=8)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: np.dtype(d).name)
def test_matmul_reduce_scatter_odd_sizes(dtype):
    _mmrs_case(4, (12, 13), 7, x_dtype=dtype, schedule="bidirectional", seed=7)
    _mmrs_case(4, (20, 1), 1, x_dtype=dtype, schedule="ring", seed=8)


# --------------------------------------------------------------------------
# Every gather / scatter dimension of rank-3 and rank-4 operands
# --------------------------------------------------------------------------
DIM_CASES = [(3, d) for d in range(2)] + [(4, d) for d in range(3)]
DIM_IDS = [f"rank{r}-dim{d}" for r, d in DIM_CASES]


@pytest.mark.parametrize("schedule", ODD_SCHEDULES + ["auto"])
@pytest.mark.parametrize("rank,dim", DIM_CASES, ids=DIM_IDS)
def test_all_gather_matmul_gather_dimension(rank, dim, schedule):
    local = {3: (2, 3, 12), 4: (2, 3, 2, 12)}[rank]
    _agmm_case(4, local, 5, gather_dimension=dim, schedule=schedule, seed=10 * rank + dim)


@pytest.mark.parametrize("schedule", ODD_SCHEDULES + ["auto"])
@pytest.mark.parametrize("rank,dim", DIM_CASES, ids=DIM_IDS)
def test_matmul_reduce_scatter_scatter_dimension(rank, dim, schedule):
    # Every leading dim divisible by 4, each a different size.
    local = {3: (4, 8, 12), 4: (4, 8, 12, 12)}[rank]
    _mmrs_case(4, local, 5, scatter_dimension=dim, schedule=schedule, seed=10 * rank + dim)


@pytest.mark.parametrize("rank,dim", DIM_CASES, ids=DIM_IDS)
def test_gather_dimension_bf16(rank, dim):
    local = {3: (2, 3, 12), 4: (2, 1, 2, 12)}[rank]
    _agmm_case(2, local, 6, x_dtype=BF16, gather_dimension=dim, seed=rank + dim)
    local = {3: (2, 4, 12), 4: (2, 4, 2, 12)}[rank]
    _mmrs_case(2, local, 6, x_dtype=BF16, scatter_dimension=dim, seed=rank + dim)


# --------------------------------------------------------------------------
# preferred_element_type, precision, mixed dtypes
# --------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["ring", "bidirectional", "sequential"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=lambda d: np.dtype(d).name)
def test_preferred_element_type_float32(dtype, schedule):
    # bf16/f16 inputs, float32 result: products are exact in f32 so the result
    # must match the f32-accumulated reference to float32 accuracy.
    got = _agmm_case(
        4, (4, 40), 12, x_dtype=dtype, schedule=schedule,
        preferred_element_type=jnp.float32, seed=1,
    )
    assert got.dtype == np.float32
    got = _mmrs_case(
        4, (16, 40), 12, x_dtype=dtype, schedule=schedule,
        preferred_element_type=jnp.float32, seed=2,
    )
    assert got.dtype == np.float32


def test_preferred_element_type_same_as_input():
    got = _agmm_case(2, (4, 16), 8, x_dtype=BF16, preferred_element_type=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    got = _mmrs_case(2, (4, 16), 8, x_dtype=F32, preferred_element_type=jnp.float32)
    assert got.dtype == np.float32


def test_precision_highest():
    p = jax.lax.Precision.HIGHEST
    _agmm_case(4, (4, 24), 8, precision=p, schedule="ring")
    _mmrs_case(4, (8, 24), 8, precision=p, schedule="bidirectional")


MIXED = [(BF16, F32), (F32, BF16), (F16, F32), (BF16, F16)]
MIXED_IDS = [f"{np.dtype(a).name}-{np.dtype(b).name}" for a, b in MIXED]


@pytest.mark.parametrize("x_dtype,w_dtype", MIXED, ids=MIXED_IDS)
def test_mixed_dtype_promotion(x_dtype, w_dtype):
    expected = jnp.result_type(x_dtype, w_dtype)
    got = _agmm_case(4, (4, 24), 8, x_dtype=x_dtype, w_dtype=w_dtype, schedule="ring")
    assert got.dtype == expected
    got = _mmrs_case(4, (8, 24), 8, x_dtype=x_dtype, w_dtype=w_dtype, schedule="bidirectional")
    assert got.dtype == expected


# --------------------------------------------------------------------------
# Result typing and the pure-JAX reference
# --------------------------------------------------------------------------
def test_results_typed_varying():
    mesh = mesh1d(4)
    seen = {}
    x = rand((16, 8), seed=1)
    w = rand((8, 6), seed=2)

    def body(a, b):
        y1 = commfuse.all_gather_matmul(a, b, "x")
        y2 = commfuse.matmul_reduce_scatter(y1, jnp.ones((6, 3), y1.dtype), "x")
        seen["agmm"] = varying_axes(y1)
        seen["mmrs"] = varying_axes(y2)
        return y1, y2

    run_sharded(body, mesh, (spec_on(2, 0, "x"), P()), x, w)
    if seen["agmm"] is None:
        pytest.skip("this JAX does not expose varying-axes types")
    assert "x" in seen["agmm"]
    assert "x" in seen["mmrs"]


@pytest.mark.parametrize("n", [2, 4])
def test_reference_matches_lax(n):
    mesh = mesh1d(n)
    rng = np.random.default_rng(n)
    # all_gather_matmul on a rank-3 x, gathering dim 1.
    x = rand((2, 3 * n, 12), rng=rng)
    w = rand((12, 5), rng=rng)
    specs = (spec_on(3, 1, "x"), P())
    ref = run_sharded(
        lambda a, b: commfuse.reference.all_gather_matmul(a, b, "x", gather_dimension=1),
        mesh, specs, x, w,
    )
    lit = run_sharded(
        lambda a, b: lax_all_gather_matmul(a, b, "x", gather_dimension=1), mesh, specs, x, w
    )
    assert_close(ref, lit)
    # matmul_reduce_scatter scattering dim 1, bf16 -> f32.
    x = rand((2, 2 * n, 12), BF16, rng=rng)
    w = rand((12, 5), BF16, rng=rng)
    specs = (P(), P())
    kw = dict(scatter_dimension=1, preferred_element_type=jnp.float32)
    ref = run_sharded(
        lambda a, b: commfuse.reference.matmul_reduce_scatter(a, b, "x", **kw),
        mesh, specs, x, w,
    )
    lit = run_sharded(
        lambda a, b: lax_matmul_reduce_scatter(a, b, "x", **kw), mesh, specs, x, w
    )
    assert ref.dtype == np.float32
    assert_close(ref, lit)


def test_replicated_operands():
    # Replicated (invariant) x and w: the ops must still agree with jax.lax.
    mesh = mesh1d(4)
    x = rand((8, 10), seed=3)
    w = rand((10, 4), seed=4)
    specs = (P(), P())
    got = run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, "x"), mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_all_gather_matmul(a, b, "x"), mesh, specs, x, w)
    assert_close(got, want)
    got = run_sharded(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x"), mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(a, b, "x"), mesh, specs, x, w)
    assert_close(got, want)


def test_precision_names_read_as_jax_reads_them():
    """TF32 on a GPU wherever JAX's own dot may use it: "tensorfloat32" and
    "bfloat16_3x" are `Precision.HIGH`, which a traced dot carries (so a
    named op and the product `overlap` makes of a dot agree); full float32
    for HIGHEST and the f32 dot algorithms."""
    from commfuse._checks import fast_f32

    for fast in (None, "default", "high", "tensorfloat32", "bfloat16_3x", jax.lax.Precision.HIGH,
                 (jax.lax.Precision.HIGH, jax.lax.Precision.DEFAULT)):
        assert fast_f32("op", fast), fast
    for full in ("highest", "float32", jax.lax.Precision.HIGHEST,
                 (jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST)):
        assert not fast_f32("op", full), full
    for algorithm in ("TF32_TF32_F32_X3", "BF16_BF16_F32_X6", "F32_F32_F32"):
        with jax.default_matmul_precision(algorithm):
            assert not fast_f32("op", None), algorithm
    with jax.default_matmul_precision("TF32_TF32_F32"):
        assert fast_f32("op", None)
    with pytest.raises(ValueError, match="commfuse.op: unknown precision 'fast'"):
        fast_f32("op", "fast")
    with jax.default_matmul_precision("tensorfloat32"):
        assert fast_f32("op", None)


def test_a_float64_result_type_without_x64_is_float32_as_in_jnp_matmul():
    import commfuse

    mesh = mesh1d(4)
    x, w = rand((16, 8), seed=1), rand((8, 4), seed=2)
    with warnings.catch_warnings():  # jnp says float64 is not available without x64: the point here
        warnings.simplefilter("ignore", UserWarning)
        want = jnp.matmul(x, w, preferred_element_type=jnp.float64)
    got = run_sharded(lambda x, w: commfuse.all_gather_matmul(x, w, "x", preferred_element_type=jnp.float64),
                      mesh, (P("x"), P()), x, w)
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_allclose(got[0], np.asarray(want), rtol=1e-5)  # every device's copy of the product
