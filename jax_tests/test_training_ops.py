"""Forward numerics, misuse errors and vmap of the training-time ops:

    matmul_all_gather     == x @ all_gather(w, ax, axis=gd, tiled=True)       (gd 0 or 1)
    matmul_reduce_scatter == psum_scatter(x @ w, ax, scatter_dimension=-1, tiled=True)
    all_to_all_matmul     == all_to_all(x, ax, split, concat, tiled=True) @ w
    matmul_all_to_all     == all_to_all(x @ w, ax, split, concat, tiled=True)

plus vmap of every op (fused over x of the row gathers and scatters, else
jax.lax's collective and dot, batched).

Every operand is *varying*: the global array is the concatenation, along dim 0,
of one independent random block per device, so each device sees its own local
operand of an arbitrary shape.  Results are compared device by device with the
literal jax.lax expression (same dtype, conftest tolerance) and with an
independent float64 numpy model of what each device must hold.
"""

from __future__ import annotations

import zlib

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
    place,
    rand,
    run_sharded,
    sharded_fn,
)

F32, BF16 = np.float32, jnp.bfloat16
DTYPES = [F32, BF16]


def _dt_id(d):
    return np.dtype(d).name


# --------------------------------------------------------------------------
# Literal jax.lax definitions of the new ops
# --------------------------------------------------------------------------
def lax_matmul_all_gather(x, w, axis_name, *, gather_dimension=1):
    return jnp.matmul(x, jax.lax.all_gather(w, axis_name, axis=gather_dimension, tiled=True))


def lax_all_to_all_matmul(x, w, axis_name, *, split_dimension, concat_dimension):
    moved = jax.lax.all_to_all(x, axis_name, split_dimension, concat_dimension, tiled=True)
    return jnp.matmul(moved, w)


def lax_matmul_all_to_all(x, w, axis_name, *, split_dimension, concat_dimension):
    y = jnp.matmul(x, w)
    return jax.lax.all_to_all(y, axis_name, split_dimension, concat_dimension, tiled=True)


# --------------------------------------------------------------------------
# Per-device operands
# --------------------------------------------------------------------------
def _blocks(n, local_shape, dtype, rng, scale=1.0):
    """``n`` independent random local blocks (one per device)."""
    return [(rand(local_shape, rng=rng) * np.float32(scale)).astype(np.dtype(dtype)) for _ in range(n)]


def _run_local(fn, mesh, *per_device):
    """Run ``fn`` with device ``i`` holding ``per_device[k][i]`` as argument k.

    Returns the per-device outputs, shape ``(n, *local_out)``.
    """
    args = [np.concatenate(blocks, axis=0) for blocks in per_device]
    specs = [P("x")] * len(args)
    return run_sharded(fn, mesh, specs, *args)


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _np_all_to_all(blocks, split, concat):
    """float64 model of tiled all_to_all: device r gets block r (along
    ``split``) of every device's array, concatenated along ``concat``."""
    n = len(blocks)
    parts = [np.split(_f64(b), n, axis=split) for b in blocks]
    return [np.concatenate([parts[j][r] for j in range(n)], axis=concat) for r in range(n)]


def _check(got, want_lax, want_np, dtype, what):
    assert got.shape == want_lax.shape, (what, got.shape, want_lax.shape)
    assert got.dtype == np.dtype(dtype), (what, got.dtype)
    assert_close(got, want_lax, err_msg=f"{what}: vs jax.lax")
    assert_close(got, np.stack(want_np), dtype=dtype, err_msg=f"{what}: vs numpy float64")


# --------------------------------------------------------------------------
# matmul_all_gather (both gather dims; leading batch dims on x)
# --------------------------------------------------------------------------
def _mmag_case(n, lead, gather_dimension, dtype, seed):
    mesh = mesh1d(n)
    rng = np.random.default_rng(seed)
    kb, c = 6, 5
    if gather_dimension == 1:   # columns: w_r [k, c], x [..., k]
        x_shape, w_shape = tuple(lead) + (kb,), (kb, c)
    else:                       # contraction: w_r [kb, c], x [..., n*kb]
        x_shape, w_shape = tuple(lead) + (n * kb,), (kb, c)
    xs = _blocks(n, x_shape, dtype, rng)
    ws = _blocks(n, w_shape, dtype, rng)
    kw = dict(gather_dimension=gather_dimension)
    got = _run_local(lambda a, b: commfuse.matmul_all_gather(a, b, "x", **kw), mesh, xs, ws)
    want = _run_local(lambda a, b: lax_matmul_all_gather(a, b, "x", **kw), mesh, xs, ws)
    w_full = np.concatenate([_f64(w) for w in ws], axis=gather_dimension)
    want_np = [_f64(x) @ w_full for x in xs]
    _check(got, want, want_np, dtype, f"matmul_all_gather gd={gather_dimension} lead={lead}")


LEADS = [(), (3,), (2, 3)]


@pytest.mark.parametrize("lead", LEADS, ids=lambda l: f"lead{len(l)}")
@pytest.mark.parametrize("gather_dimension", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("n", [2, 4])
def test_matmul_all_gather(n, dtype, gather_dimension, lead):
    _mmag_case(n, (4,) + lead, gather_dimension, dtype, seed=100 * n + 10 * gather_dimension + len(lead))


@pytest.mark.parametrize("gather_dimension", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
def test_matmul_all_gather_n8(dtype, gather_dimension):
    _mmag_case(8, (2, 3), gather_dimension, dtype, seed=800 + gather_dimension)


def test_matmul_all_gather_negative_dimension():
    mesh = mesh1d(4)
    rng = np.random.default_rng(5)
    xs, ws = _blocks(4, (3, 8), F32, rng), _blocks(4, (8, 2), F32, rng)
    a = _run_local(lambda x, w: commfuse.matmul_all_gather(x, w, "x", gather_dimension=-1), mesh, xs, ws)
    b = _run_local(lambda x, w: lax_matmul_all_gather(x, w, "x", gather_dimension=1), mesh, xs, ws)
    assert_close(a, b)


def test_matmul_all_gather_default_is_columns():
    mesh = mesh1d(2)
    rng = np.random.default_rng(6)
    xs, ws = _blocks(2, (3, 8), F32, rng), _blocks(2, (8, 2), F32, rng)
    got = _run_local(lambda x, w: commfuse.matmul_all_gather(x, w, "x"), mesh, xs, ws)
    assert got.shape == (2, 3, 4)
    assert_close(got, _run_local(lambda x, w: lax_matmul_all_gather(x, w, "x"), mesh, xs, ws))


# --------------------------------------------------------------------------
# matmul_reduce_scatter over the last dim (column scatter)
# --------------------------------------------------------------------------
def _mmrs_last_case(n, lead, dtype, seed, scatter_dimension=-1):
    mesh = mesh1d(n)
    rng = np.random.default_rng(seed)
    k, c = 12, 3
    xs = _blocks(n, tuple(lead) + (k,), dtype, rng)
    ws = _blocks(n, (k, n * c), dtype, rng)
    kw = dict(scatter_dimension=scatter_dimension)
    got = _run_local(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", **kw), mesh, xs, ws)
    # jax.lax.psum_scatter takes only a non-negative scatter_dimension.
    last = len(lead)
    want = _run_local(lambda a, b: lax_matmul_reduce_scatter(a, b, "x", scatter_dimension=last), mesh, xs, ws)
    total = sum(_f64(x) @ _f64(w) for x, w in zip(xs, ws))
    want_np = np.split(total, n, axis=-1)
    assert got.shape == (n,) + tuple(lead) + (c,)
    _check(got, want, want_np, dtype, f"matmul_reduce_scatter last dim lead={lead}")


@pytest.mark.parametrize("lead", [(5,), (2, 3), (2, 1, 3)], ids=lambda l: f"rank{len(l) + 1}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_matmul_reduce_scatter_last_dim(n, dtype, lead):
    _mmrs_last_case(n, lead, dtype, seed=10 * n + len(lead))


def test_matmul_reduce_scatter_last_dim_positive_index():
    # scatter_dimension=2 on a rank-3 x is the same (last) dim as -1.
    _mmrs_last_case(4, (2, 3), F32, seed=33, scatter_dimension=2)


# --------------------------------------------------------------------------
# all_to_all_matmul / matmul_all_to_all (rank-3, Ulysses-like shapes)
# --------------------------------------------------------------------------
def _a2a_shapes(n):
    # x [seq_local, heads, head_dim]: dims 0 and 1 divisible by n and distinct.
    return (2 * n, n, 8)


def _a2amm_case(n, split, concat, dtype, seed):
    mesh = mesh1d(n)
    rng = np.random.default_rng(seed)
    x_shape = _a2a_shapes(n)
    k = x_shape[-1] * (n if concat == 2 else 1)
    xs = _blocks(n, x_shape, dtype, rng)
    ws = _blocks(n, (k, 6), dtype, rng, scale=1.0 / np.sqrt(k))
    kw = dict(split_dimension=split, concat_dimension=concat)
    got = _run_local(lambda a, b: commfuse.all_to_all_matmul(a, b, "x", **kw), mesh, xs, ws)
    want = _run_local(lambda a, b: lax_all_to_all_matmul(a, b, "x", **kw), mesh, xs, ws)
    moved = _np_all_to_all(xs, split, concat)
    want_np = [m @ _f64(w) for m, w in zip(moved, ws)]
    _check(got, want, want_np, dtype, f"all_to_all_matmul split={split} concat={concat}")


def _mma2a_case(n, split, concat, dtype, seed, x_shape=None):
    mesh = mesh1d(n)
    rng = np.random.default_rng(seed)
    x_shape = _a2a_shapes(n) if x_shape is None else x_shape
    k = x_shape[-1]
    xs = _blocks(n, x_shape, dtype, rng)
    ws = _blocks(n, (k, 3 * n), dtype, rng, scale=1.0 / np.sqrt(k))
    kw = dict(split_dimension=split, concat_dimension=concat)
    got = _run_local(lambda a, b: commfuse.matmul_all_to_all(a, b, "x", **kw), mesh, xs, ws)
    # jax.lax.all_to_all wants non-negative dims.
    nonneg = dict(split_dimension=split % len(x_shape), concat_dimension=concat % len(x_shape))
    want = _run_local(lambda a, b: lax_matmul_all_to_all(a, b, "x", **nonneg), mesh, xs, ws)
    ys = [_f64(x) @ _f64(w) for x, w in zip(xs, ws)]
    want_np = _np_all_to_all(ys, nonneg["split_dimension"], nonneg["concat_dimension"])
    _check(got, want, want_np, dtype, f"matmul_all_to_all split={split} concat={concat}")


A2AMM_PAIRS = [(s, c) for s in (0, 1) for c in (0, 1, 2)]
MMA2A_PAIRS = [(s, c) for s in (0, 1, 2) for c in (0, 1, 2)]
_pair_id = lambda p: f"s{p[0]}c{p[1]}"  # noqa: E731


# Full (split, concat) grids: both dtypes at N=2, float32 at N=4; a few
# pairs in bfloat16 at N=4 and at N=8 (runtime).
def _grid(pairs, bf16_n4_pairs):
    return ([(2, d, p) for d in DTYPES for p in pairs] + [(4, F32, p) for p in pairs]
            + [(4, BF16, p) for p in bf16_n4_pairs])


def _grid_id(v):
    n, d, p = v
    return f"n{n}-{_dt_id(d)}-{_pair_id(p)}"


A2AMM_GRID = _grid(A2AMM_PAIRS, [(1, 0), (0, 1), (1, 2)])
MMA2A_GRID = _grid(MMA2A_PAIRS, [(0, 1), (2, 0), (1, 2)])


@pytest.mark.parametrize("n,dtype,pair", A2AMM_GRID, ids=[_grid_id(v) for v in A2AMM_GRID])
def test_all_to_all_matmul(n, dtype, pair):
    _a2amm_case(n, *pair, dtype, seed=1000 + 100 * n + 10 * pair[0] + pair[1])


@pytest.mark.parametrize("dtype,pair", [(F32, (1, 0)), (F32, (0, 2)), (BF16, (1, 0)), (BF16, (1, 2))],
                         ids=lambda v: _pair_id(v) if isinstance(v, tuple) else _dt_id(v))
def test_all_to_all_matmul_n8(dtype, pair):
    _a2amm_case(8, *pair, dtype, seed=1800 + 10 * pair[0] + pair[1])


@pytest.mark.parametrize("n,dtype,pair", MMA2A_GRID, ids=[_grid_id(v) for v in MMA2A_GRID])
def test_matmul_all_to_all(n, dtype, pair):
    _mma2a_case(n, *pair, dtype, seed=2000 + 100 * n + 10 * pair[0] + pair[1])


@pytest.mark.parametrize("dtype,pair", [(F32, (0, 1)), (F32, (2, 0)), (BF16, (0, 1)), (BF16, (2, 2))],
                         ids=lambda v: _pair_id(v) if isinstance(v, tuple) else _dt_id(v))
def test_matmul_all_to_all_n8(dtype, pair):
    _mma2a_case(8, *pair, dtype, seed=2800 + 10 * pair[0] + pair[1])


def test_matmul_all_to_all_rank2_and_negative_dims():
    # Rank-2 x: split the columns of x @ w (-1), concat the rows (-2).
    _mma2a_case(4, -1, -2, F32, seed=7, x_shape=(3, 8))
    _mma2a_case(4, 0, 1, F32, seed=8, x_shape=(4, 8))


def test_ulysses_round_trip():
    """Sequence-parallel attention layout: all_to_all_matmul scatters heads and
    gathers the sequence; matmul_all_to_all scatters the sequence back and
    gathers heads.  Chained, they match the chained lax expressions."""
    n = 4
    mesh = mesh1d(n)
    rng = np.random.default_rng(44)
    s, h, d = 3, 2 * n, 8
    xs = _blocks(n, (s, h, d), F32, rng)
    w1s = _blocks(n, (d, d), F32, rng, scale=1 / np.sqrt(d))
    w2s = _blocks(n, (d, d), F32, rng, scale=1 / np.sqrt(d))

    def fused(x, w1, w2):
        q = commfuse.all_to_all_matmul(x, w1, "x", split_dimension=1, concat_dimension=0)   # [n*s, h/n, d]
        return commfuse.matmul_all_to_all(jnp.tanh(q), w2, "x", split_dimension=0, concat_dimension=1)

    def unfused(x, w1, w2):
        q = lax_all_to_all_matmul(x, w1, "x", split_dimension=1, concat_dimension=0)
        return lax_matmul_all_to_all(jnp.tanh(q), w2, "x", split_dimension=0, concat_dimension=1)

    got = _run_local(fused, mesh, xs, w1s, w2s)
    want = _run_local(unfused, mesh, xs, w1s, w2s)
    assert got.shape == (n, s, h, d)
    assert_close(got, want)


# --------------------------------------------------------------------------
# Misuse: ValueError naming the offending argument
# --------------------------------------------------------------------------
def _trace(fn, x_local, w_local, n=4):
    """Run ``fn`` under shard_map with replicated local operands (errors
    surface at trace time)."""
    run_sharded(lambda a, b: fn(a, b, "x"), mesh1d(n), (P(), P()), x_local, w_local)


def _raises_naming(excinfo_type, fn, x, w, *names):
    with pytest.raises(excinfo_type) as ei:
        _trace(fn, x, w)
    msg = str(ei.value)
    for name in names:
        assert name in msg, f"message does not name {name!r}: {msg}"
    return msg


mag = commfuse.matmul_all_gather
mrs = commfuse.matmul_reduce_scatter
agm = commfuse.all_gather_matmul
a2amm = commfuse.all_to_all_matmul
mma2a = commfuse.matmul_all_to_all


def _with(op, **kw):
    return lambda a, b, ax: op(a, b, ax, **kw)


@pytest.mark.parametrize("gd", [2, 3, -3])
def test_matmul_all_gather_bad_gather_dimension(gd):
    _raises_naming(ValueError, _with(mag, gather_dimension=gd), rand((4, 8)), rand((8, 3)), "gather_dimension")


def test_all_gather_matmul_gather_dimension_last_rejected():
    _raises_naming(ValueError, _with(agm, gather_dimension=-1), rand((4, 8)), rand((8, 3)), "gather_dimension")


@pytest.mark.parametrize("gd,x_shape,w_shape", [
    (1, (4, 7), (8, 3)),    # columns: x's k must equal w's rows
    (0, (4, 8), (8, 3)),    # contraction: x's k must equal N * w's rows (= 32)
    (0, (4, 7), (2, 3)),    # N * 2 = 8 != 7
], ids=["cols", "contraction", "contraction-odd"])
def test_matmul_all_gather_contraction_mismatch(gd, x_shape, w_shape):
    _raises_naming(ValueError, _with(mag, gather_dimension=gd), rand(x_shape), rand(w_shape), "`x`", "`w`")


@pytest.mark.parametrize("op,kw", [
    (mag, dict(gather_dimension=1)),
    (mag, dict(gather_dimension=0)),
    (mrs, dict(scatter_dimension=-1)),
    (a2amm, dict(split_dimension=0, concat_dimension=1)),
    (mma2a, dict(split_dimension=0, concat_dimension=1)),
], ids=["mag-1", "mag-0", "mrs-last", "a2amm", "mma2a"])
@pytest.mark.parametrize("w_rank", [1, 3])
def test_w_not_2d(op, kw, w_rank):
    w = rand((8,) if w_rank == 1 else (2, 8, 3))
    _raises_naming(ValueError, _with(op, **kw), rand((4, 4, 8)), w, "`w`", "2-D")


def test_matmul_reduce_scatter_last_dim_not_divisible():
    # w has 6 columns; 6 % 4 != 0.
    _raises_naming(ValueError, _with(mrs, scatter_dimension=-1), rand((4, 8)), rand((8, 6)), "scatter_dimension")


@pytest.mark.parametrize("op", [a2amm, mma2a], ids=["a2amm", "mma2a"])
@pytest.mark.parametrize("split", [0, 1])
def test_all_to_all_split_not_divisible(op, split):
    x = rand((6, 6, 8))  # 6 % 4 != 0 on both candidate dims
    _raises_naming(ValueError, _with(op, split_dimension=split, concat_dimension=1 - split), x, rand((8, 4)),
                   "split_dimension")


def test_matmul_all_to_all_split_last_not_divisible():
    # Splitting the result's columns: w has 6 columns, 6 % 4 != 0.
    _raises_naming(ValueError, _with(mma2a, split_dimension=-1, concat_dimension=0), rand((4, 8)), rand((8, 6)),
                   "split_dimension")


def test_all_to_all_matmul_split_last_rejected():
    # The last dim of x is the contraction; all_to_all_matmul cannot split it.
    _raises_naming(ValueError, _with(a2amm, split_dimension=2, concat_dimension=0), rand((4, 4, 8)), rand((8, 3)),
                   "split_dimension")


@pytest.mark.parametrize("op,split,concat", [
    (a2amm, 3, 0), (a2amm, 0, 3), (a2amm, -4, 0), (mma2a, 3, 0), (mma2a, 0, -4),
], ids=["a2amm-split3", "a2amm-concat3", "a2amm-split-4", "mma2a-split3", "mma2a-concat-4"])
def test_all_to_all_dimension_out_of_range(op, split, concat):
    bad = "split_dimension" if split in (3, -4) else "concat_dimension"
    _raises_naming(ValueError, _with(op, split_dimension=split, concat_dimension=concat), rand((4, 4, 8)),
                   rand((8, 4)), bad)


@pytest.mark.parametrize("op,concat,w_rows", [
    (a2amm, 0, 6),    # plain contraction: 8 != 6
    (a2amm, 2, 8),    # concat on the last dim widens k to 4 * 8 = 32, not 8
    (mma2a, 1, 6),
], ids=["a2amm", "a2amm-concat-last", "mma2a"])
def test_all_to_all_contraction_mismatch(op, concat, w_rows):
    msg = _raises_naming(ValueError, _with(op, split_dimension=0, concat_dimension=concat), rand((4, 4, 8)),
                         rand((w_rows, 4)), "`w`")
    assert str(w_rows) in msg, msg


# --------------------------------------------------------------------------
# vmap
# --------------------------------------------------------------------------
def _vmap_compare(fused, ref, n, xb_shape, w_shape, in_axis, seed, w_batched=False):
    mesh = mesh1d(n)
    rng = np.random.default_rng(seed)
    xs = _blocks(n, xb_shape, F32, rng)
    ws = _blocks(n, w_shape, F32, rng)
    w_axes = 0 if w_batched else None

    def run(op):
        return _run_local(lambda a, b: jax.vmap(lambda u, v: op(u, v), in_axes=(in_axis, w_axes))(a, b),
                          mesh, xs, ws)

    got = run(fused)
    want = run(ref)
    assert_close(got, want)
    return got


VMAP_SUPPORTED = [
    # op, kwargs, local unbatched x shape, w shape
    ("agmm-d0", agm, lax_all_gather_matmul, dict(gather_dimension=0), (3, 8), (8, 5)),
    ("agmm-rank3-d1", agm, lax_all_gather_matmul, dict(gather_dimension=1), (2, 3, 8), (8, 5)),
    ("mrs-d0", mrs, lax_matmul_reduce_scatter, dict(scatter_dimension=0), (8, 6), (6, 5)),
    ("mrs-rank3-d1", mrs, lax_matmul_reduce_scatter, dict(scatter_dimension=1), (3, 4, 6), (6, 5)),
]


@pytest.mark.parametrize("in_axis", [0, 1, -1])
@pytest.mark.parametrize("case", VMAP_SUPPORTED, ids=[c[0] for c in VMAP_SUPPORTED])
def test_vmap_supported(case, in_axis):
    """vmap over x of the row ops stays fused (its batch becomes a leading
    dim of x): the same numbers as jax.lax's, and the fused op in the
    compiled program (a fallback to jax.lax would pass the numbers alone)."""
    _, op, ref, kw, x_shape, w_shape = case
    n, batch = 4, 3
    nd = len(x_shape) + 1
    # Insert the batch dim at in_axis of the unbatched x; dim 0 must stay the
    # (per-device-concatenated) leading dim of the batched local block.
    axis = in_axis % nd
    if axis == 0:
        xb_shape = (batch,) + x_shape
    else:
        xb_shape = x_shape[:axis] + (batch,) + x_shape[axis:]
    fused = lambda u, v: op(u, v, "x", schedule="ring", **kw)  # noqa: E731 - fused whatever auto would judge
    _vmap_compare(fused, lambda u, v: ref(u, v, "x", **kw),
                  n, xb_shape, w_shape, in_axis, seed=zlib.crc32(case[0].encode()) % 1000 + axis)
    mesh = mesh1d(n)
    batched = jax.vmap(fused, in_axes=(in_axis, None))
    xs, ws = (place(np.zeros((n * s[0],) + tuple(s[1:]), F32), mesh, P("x")) for s in (xb_shape, w_shape))
    text = sharded_fn(batched, mesh, [P("x")] * 2).lower(xs, ws).compile().as_text()
    assert "commfuse_collective_matmul_cpu" in text, "vmap ran jax.lax's collective and dot, not the fused op"


def test_vmap_nested():
    # Two levels of vmap over x of all_gather_matmul.
    n = 2
    mesh = mesh1d(n)
    rng = np.random.default_rng(9)
    xs = _blocks(n, (2, 3, 4, 8), F32, rng)
    ws = _blocks(n, (8, 5), F32, rng)

    def run(op):
        inner = lambda u, v: op(u, v, "x")  # noqa: E731
        return _run_local(lambda a, b: jax.vmap(jax.vmap(inner, (0, None)), (0, None))(a, b), mesh, xs, ws)

    assert_close(run(commfuse.all_gather_matmul), run(lax_all_gather_matmul))


VMAP_UNFUSED = [
    # op name, kwargs, local unbatched x shape, w shape, w batched
    ("mrs-columns", "matmul_reduce_scatter", dict(scatter_dimension=1), (3, 8), (8, 4), False),
    ("mag-cols", "matmul_all_gather", dict(gather_dimension=1), (3, 8), (8, 4), False),
    ("mag-contraction", "matmul_all_gather", dict(gather_dimension=0), (3, 32), (8, 4), False),
    ("a2amm", "all_to_all_matmul", dict(split_dimension=0, concat_dimension=1), (4, 2, 8), (8, 4), False),
    ("mma2a", "matmul_all_to_all", dict(split_dimension=0, concat_dimension=1), (4, 2, 8), (8, 4), False),
    ("agmm-w-batched", "all_gather_matmul", dict(gather_dimension=0), (3, 8), (8, 4), True),
    ("mrs-w-batched", "matmul_reduce_scatter", dict(scatter_dimension=0), (4, 8), (8, 4), True),
]


@pytest.mark.parametrize("case", VMAP_UNFUSED, ids=[c[0] for c in VMAP_UNFUSED])
def test_vmap_without_a_fused_form_runs_jax_lax_batched(case):
    """Batched forms no fused op has (`jax.jacrev` batches a backward op over
    its cotangent, which may be `w`): jax.lax's collective and dot, batched,
    with the reference's numbers."""
    _, name, kw, x_shape, w_shape, w_batched = case
    n, batch = 4, 2
    mesh = mesh1d(n)
    x = rand((n * batch,) + x_shape, seed=1)
    w = rand((n * batch,) + w_shape if w_batched else w_shape, seed=2)
    w_axes = 0 if w_batched else None

    def run(op):
        batched = jax.vmap(lambda u, v: op(u, v, "x", **kw), in_axes=(0, w_axes))
        return np.asarray(run_sharded(batched, mesh, (P("x"), P("x") if w_batched else P()), x, w))

    assert_close(run(getattr(commfuse, name)), run(getattr(commfuse.reference, name)))
