"""Gradients of the fused ops (their custom VJPs).

* jax.grad of a scalar loss through each fused op, w.r.t. x and w, equals
  jax.grad of the same loss through the literal jax.lax expression, for every
  gather / scatter dimension and all_to_all (split, concat) pair.
* jax.test_util.check_grads (reverse mode, float64) against finite differences.
* The backward pass of all_gather_matmul, matmul_reduce_scatter and
  matmul_all_gather issues no unfused collective: its jaxpr holds no
  all_gather / reduce_scatter / psum / all_to_all / ppermute, only fused ops.
* A tensor-parallel two-layer MLP on a ("dp", "tp") = (2, 4) mesh.

The loss is ``sum(ct * sin(y))`` over the per-device outputs, with a random
cotangent ``ct``; the gradient is taken outside the jitted shard_map (w.r.t.
the global, sharded operands).  Unless a test says otherwise every operand is
*varying*: the global array concatenates, along dim 0, one independent random
block per device.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import NamedSharding

import commfuse
from conftest import (
    P,
    assert_close,
    make_mesh,
    mesh1d,
    place,
    rand,
    tolerance,
)

F32, F64, BF16 = np.float32, np.float64, jnp.bfloat16

# Gradients are sums of products (dx = dY @ wᵀ, dw = xᵀ @ dY), compared
# relative to max |reference| with conftest's per-dtype tolerances: 1e-4 for
# float32 and 2e-2 for bfloat16 (where the fused and the XLA backward round
# their partial sums at different points; observed worst case ~7e-3).
GRAD_RTOL = {np.dtype(d): tolerance(d) for d in (F32, BF16)}


def _dt_id(d):
    return np.dtype(d).name


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


# --------------------------------------------------------------------------
# Literal jax.lax expressions (the oracles)
# --------------------------------------------------------------------------
def lax_agmm(x, w, ax, *, gather_dimension=0):
    return jnp.matmul(jax.lax.all_gather(x, ax, axis=gather_dimension, tiled=True), w)


def lax_mmrs(x, w, ax, *, scatter_dimension=0):
    return jax.lax.psum_scatter(jnp.matmul(x, w), ax, scatter_dimension=scatter_dimension % x.ndim, tiled=True)


def lax_mmag(x, w, ax, *, gather_dimension=1):
    return jnp.matmul(x, jax.lax.all_gather(w, ax, axis=gather_dimension % 2, tiled=True))


def lax_a2amm(x, w, ax, *, split_dimension, concat_dimension):
    return jnp.matmul(jax.lax.all_to_all(x, ax, split_dimension, concat_dimension, tiled=True), w)


def lax_mma2a(x, w, ax, *, split_dimension, concat_dimension):
    return jax.lax.all_to_all(jnp.matmul(x, w), ax, split_dimension, concat_dimension, tiled=True)


OPS = {
    "agmm": (commfuse.all_gather_matmul, lax_agmm),
    "mmrs": (commfuse.matmul_reduce_scatter, lax_mmrs),
    "mmag": (commfuse.matmul_all_gather, lax_mmag),
    "a2amm": (commfuse.all_to_all_matmul, lax_a2amm),
    "mma2a": (commfuse.matmul_all_to_all, lax_mma2a),
}


def _shapes(op, n, kw):
    """Local (per-device) x and w shapes for ``op`` with settings ``kw``."""
    if op == "agmm":
        return ((3, 8) if kw.get("rank", 3) == 2 else (2, 3, 8)), (8, 5)
    if op == "mmrs":
        return (2 * n, n, 8), (8, 3 * n)
    if op == "mmag":
        return ((2, 3, 8), (8, 5)) if kw["gather_dimension"] == 1 else ((2, 3, 4 * n), (4, 5))
    if op == "a2amm":
        k = 8 * (n if kw["concat_dimension"] == 2 else 1)
        return (2 * n, n, 8), (k, 5)
    if op == "mma2a":
        return (2 * n, n, 8), (8, 2 * n)
    raise AssertionError(op)


# --------------------------------------------------------------------------
# Gradient drivers
# --------------------------------------------------------------------------
def _global_fn(op_fn, mesh, in_specs, out_axes):
    """``x, w -> stacked per-device outputs`` under shard_map (not jitted)."""
    def body(*args):
        return op_fn(*args)[None]

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=P(out_axes))


def _out_shape(op_fn, mesh, in_specs, *args):
    """Global shape of the stacked per-device outputs."""
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    return jax.eval_shape(_global_fn(op_fn, mesh, in_specs, "x"), *structs).shape


def _loss_fn(op_fn, mesh, in_specs, out_axes):
    f = _global_fn(op_fn, mesh, in_specs, out_axes)

    def loss(*args_and_ct):
        *args, ct = args_and_ct
        y = f(*args).astype(jnp.float32)
        return jnp.sum(ct * jnp.sin(y))

    return loss


def _grads(op_fn, mesh, in_specs, args, ct, out_axes="x"):
    loss = _loss_fn(op_fn, mesh, in_specs, out_axes)
    g = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    placed = [place(a, mesh, s) for a, s in zip(args, in_specs)]
    return [np.asarray(v) for v in g(*placed, ct)]


def _varying_blocks(n, shape, dtype, rng, scale=1.0):
    return np.concatenate(
        [(rand(shape, rng=rng) * np.float32(scale)).astype(np.dtype(dtype)) for _ in range(n)], axis=0)


def _compare_grads(op, n, dtype, kw, seed, *, upcast_check=True):
    fused_op, lax_op = OPS[op]
    mesh = mesh1d(n)
    rng = np.random.default_rng(seed)
    op_kw = {k: v for k, v in kw.items() if k != "rank"}
    x_shape, w_shape = _shapes(op, n, kw)
    x = _varying_blocks(n, x_shape, dtype, rng)
    w = _varying_blocks(n, w_shape, dtype, rng, scale=1.0 / np.sqrt(w_shape[0]))
    specs = (P("x"), P("x"))
    fused = lambda a, b: fused_op(a, b, "x", **op_kw)  # noqa: E731
    ref = lambda a, b: lax_op(a, b, "x", **op_kw)  # noqa: E731
    out_shape = _out_shape(ref, mesh, specs, x, w)
    ct = rand(out_shape, rng=rng)

    gx, gw = _grads(fused, mesh, specs, (x, w), ct)
    rx, rw = _grads(ref, mesh, specs, (x, w), ct)
    what = f"{op} {op_kw} n={n} {_dt_id(dtype)}"
    assert gx.dtype == x.dtype and gw.dtype == w.dtype, (what, gx.dtype, gw.dtype)
    rtol = GRAD_RTOL[np.dtype(dtype)]
    assert_close(gx, rx, rtol=rtol, err_msg=f"d/dx, {what}")
    assert_close(gw, rw, rtol=rtol, err_msg=f"d/dw, {what}")

    if upcast_check and np.dtype(dtype) != np.dtype(F32):
        # Both low-precision gradients must also be close to the float32 truth.
        hx, hw = _grads(ref, mesh, specs, (x.astype(F32), w.astype(F32)), ct)
        assert_close(gx, hx, rtol=rtol, err_msg=f"d/dx vs float32, {what}")
        assert_close(gw, hw, rtol=rtol, err_msg=f"d/dw vs float32, {what}")


# Every op and dimension. ("rank" only selects the operand shape.)
GRAD_CASES = (
    [("agmm", dict(gather_dimension=0, rank=2))]
    + [("agmm", dict(gather_dimension=d)) for d in (0, 1)]
    + [("mmrs", dict(scatter_dimension=d)) for d in (0, 1, 2)]
    + [("mmag", dict(gather_dimension=d)) for d in (0, 1)]
    + [("a2amm", dict(split_dimension=s, concat_dimension=c)) for s in (0, 1) for c in (0, 1, 2)]
    + [("mma2a", dict(split_dimension=s, concat_dimension=c)) for s in (0, 1, 2) for c in (0, 1, 2)]
)


def _case_id(case):
    op, kw = case
    short = {"gather_dimension": "g", "scatter_dimension": "s", "split_dimension": "s", "concat_dimension": "c",
             "rank": "r"}
    return op + "-" + "".join(f"{short[k]}{v}" for k, v in kw.items())


@pytest.mark.parametrize("case", GRAD_CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=_dt_id)
def test_grad_n2(dtype, case):
    op, kw = case
    _compare_grads(op, 2, dtype, kw, seed=_seed(2, _dt_id(dtype), case))


@pytest.mark.parametrize("case", GRAD_CASES, ids=_case_id)
def test_grad_n4_f32(case):
    op, kw = case
    _compare_grads(op, 4, F32, kw, seed=_seed(4, case))


# N=4 bfloat16 and N=8: one or two representative dims per op (N=8 bfloat16: fewer).
SPARSE_CASES = [
    ("agmm", dict(gather_dimension=1)),
    ("mmrs", dict(scatter_dimension=0)),
    ("mmrs", dict(scatter_dimension=2)),
    ("mmag", dict(gather_dimension=0)),
    ("mmag", dict(gather_dimension=1)),
    ("a2amm", dict(split_dimension=1, concat_dimension=0)),
    ("a2amm", dict(split_dimension=0, concat_dimension=2)),
    ("mma2a", dict(split_dimension=0, concat_dimension=1)),
    ("mma2a", dict(split_dimension=2, concat_dimension=0)),
]


@pytest.mark.parametrize("case", SPARSE_CASES, ids=_case_id)
def test_grad_n4_bf16(case):
    op, kw = case
    _compare_grads(op, 4, BF16, kw, seed=_seed(4, "bf16", case))


N8_CASES = [(F32, c) for c in SPARSE_CASES] + [(BF16, SPARSE_CASES[i]) for i in (0, 2, 3, 5, 8)]


@pytest.mark.parametrize("dtype,case", N8_CASES, ids=[f"{_dt_id(d)}-{_case_id(c)}" for d, c in N8_CASES])
def test_grad_n8(dtype, case):
    op, kw = case
    _compare_grads(op, 8, dtype, kw, seed=_seed(8, _dt_id(dtype), case), upcast_check=False)


# --------------------------------------------------------------------------
# Replicated (invariant) operands: the weight gradient of a weight replicated
# over the op's axis is the sum of every device's contribution.
# --------------------------------------------------------------------------
INVARIANT_CASES = [
    ("agmm", dict(gather_dimension=0)),
    ("mmrs", dict(scatter_dimension=0)),
    ("mmrs", dict(scatter_dimension=2)),
    ("mmag", dict(gather_dimension=0)),
    ("mmag", dict(gather_dimension=1)),
    ("a2amm", dict(split_dimension=1, concat_dimension=0)),
    ("mma2a", dict(split_dimension=0, concat_dimension=1)),
]


@pytest.mark.parametrize("replicated", ["w", "x"])
@pytest.mark.parametrize("case", INVARIANT_CASES, ids=_case_id)
def test_grad_replicated_operand(case, replicated):
    """One operand replicated over the axis (in_spec P()), e.g. a Ulysses
    projection weight: its gradient must match the pure-JAX one (a psum of
    the per-device contributions, inserted by JAX for the reference)."""
    op, kw = case
    n = 2
    fused_op, lax_op = OPS[op]
    mesh = mesh1d(n)
    rng = np.random.default_rng(_seed("inv", replicated, case))
    x_shape, w_shape = _shapes(op, n, kw)
    x = rand(x_shape, rng=rng) if replicated == "x" else _varying_blocks(n, x_shape, F32, rng)
    w = rand(w_shape, rng=rng) if replicated == "w" else _varying_blocks(n, w_shape, F32, rng)
    specs = (P() if replicated == "x" else P("x"), P() if replicated == "w" else P("x"))
    ref = lambda a, b: lax_op(a, b, "x", **kw)  # noqa: E731
    out_shape = _out_shape(ref, mesh, specs, x, w)
    ct = rand(out_shape, rng=rng)
    gx, gw = _grads(lambda a, b: fused_op(a, b, "x", **kw), mesh, specs, (x, w), ct)
    rx, rw = _grads(ref, mesh, specs, (x, w), ct)
    assert_close(gx, rx, rtol=GRAD_RTOL[np.dtype(F32)], err_msg="d/dx")
    assert_close(gw, rw, rtol=GRAD_RTOL[np.dtype(F32)], err_msg="d/dw")


# --------------------------------------------------------------------------
# Gradient taken inside the shard_map body
# --------------------------------------------------------------------------
@pytest.mark.parametrize("case", [("agmm", dict(gather_dimension=1)), ("mmrs", dict(scatter_dimension=2)),
                                  ("mmag", dict(gather_dimension=0))], ids=_case_id)
def test_grad_inside_shard_map(case):
    op, kw = case
    n = 4
    fused_op, lax_op = OPS[op]
    mesh = mesh1d(n)
    rng = np.random.default_rng(_seed("inside", case))
    x_shape, w_shape = _shapes(op, n, kw)
    x = _varying_blocks(n, x_shape, F32, rng)
    w = _varying_blocks(n, w_shape, F32, rng)

    def body_for(opf):
        def body(a, b):
            gx, gw = jax.grad(lambda u, v: jnp.sum(jnp.sin(opf(u, v, "x", **kw))), argnums=(0, 1))(a, b)
            return gx[None], gw[None]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))

    args = (place(x, mesh, P("x")), place(w, mesh, P("x")))
    got = body_for(fused_op)(*args)
    want = body_for(lax_op)(*args)
    assert_close(got[0], want[0], rtol=GRAD_RTOL[np.dtype(F32)], err_msg="d/dx")
    assert_close(got[1], want[1], rtol=GRAD_RTOL[np.dtype(F32)], err_msg="d/dw")


# --------------------------------------------------------------------------
# check_grads in float64 (finite differences)
# --------------------------------------------------------------------------
CHECK_GRADS_CASES = [
    ("agmm", dict(gather_dimension=0, rank=2)),
    ("agmm", dict(gather_dimension=1)),
    ("mmrs", dict(scatter_dimension=0)),
    ("mmrs", dict(scatter_dimension=2)),
    ("mmag", dict(gather_dimension=0)),
    ("mmag", dict(gather_dimension=1)),
]


@pytest.mark.parametrize("case", CHECK_GRADS_CASES, ids=_case_id)
@pytest.mark.parametrize("n", [2, 4])
def test_check_grads_float64(x64, n, case):
    op, kw = case
    fused_op, _ = OPS[op]
    op_kw = {k: v for k, v in kw.items() if k != "rank"}
    mesh = mesh1d(n)
    rng = np.random.default_rng(_seed("f64", n, case))
    x_shape, w_shape = _shapes(op, n, kw)
    x = jnp.asarray(_varying_blocks(n, x_shape, F64, rng))
    w = jnp.asarray(_varying_blocks(n, w_shape, F64, rng))
    assert x.dtype == jnp.float64 and w.dtype == jnp.float64
    specs = (P("x"), P("x"))
    g = jax.jit(_global_fn(lambda a, b: fused_op(a, b, "x", **op_kw), mesh, specs, "x"))
    sx, sw = (NamedSharding(mesh, s) for s in specs)

    def f(a, b):
        # Place inside f: check_grads perturbs its arguments before calling.
        y = g(jax.device_put(a, sx), jax.device_put(b, sw))
        assert y.dtype == jnp.float64
        return y

    jax.test_util.check_grads(f, (x, w), order=1, modes=("rev",))


# --------------------------------------------------------------------------
# No unfused collectives in the backward pass
# --------------------------------------------------------------------------
FUSED_PRIMITIVE = "commfuse_collective_matmul"
COLLECTIVES = ("all_gather", "reduce_scatter", "psum", "all_to_all", "ppermute")


def _subjaxprs(value):
    """The jaxprs held by one equation parameter (possibly inside a tuple/list)."""
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def primitive_names(jaxpr):
    """Every primitive name in ``jaxpr`` and, recursively, in the jaxprs held
    by its equations' parameters (shard_map bodies, pjit, custom_vjp calls,
    scans, conds...), with repetition."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in _subjaxprs(param):
                names.extend(primitive_names(sub))
    return names


def _collectives(names):
    return sorted({p for p in names if any(c in p for c in COLLECTIVES)})


NO_COLLECTIVE_CASES = [
    ("agmm", dict(gather_dimension=0)),
    ("agmm", dict(gather_dimension=1)),
    ("mmrs", dict(scatter_dimension=0)),
    ("mmrs", dict(scatter_dimension=2)),
    ("mmag", dict(gather_dimension=0)),
    ("mmag", dict(gather_dimension=1)),
]


def _grad_jaxpr(opf, op, kw, n=4):
    mesh = mesh1d(n)
    rng = np.random.default_rng(0)
    x_shape, w_shape = _shapes(op, n, kw)
    x = place(_varying_blocks(n, x_shape, F32, rng), mesh, P("x"))
    w = place(_varying_blocks(n, w_shape, F32, rng), mesh, P("x"))
    f = _global_fn(lambda a, b: opf(a, b, "x", **kw), mesh, (P("x"), P("x")), "x")
    loss = lambda a, b: jnp.sum(jnp.sin(f(a, b)))  # noqa: E731
    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("case", NO_COLLECTIVE_CASES, ids=_case_id)
def test_backward_has_no_unfused_collectives(case):
    op, kw = case
    fused_op, lax_op = OPS[op]
    names = primitive_names(_grad_jaxpr(fused_op, op, kw))
    assert _collectives(names) == [], f"unfused collectives in the gradient jaxpr: {_collectives(names)}"
    count = names.count(FUSED_PRIMITIVE)
    assert count >= 3, f"expected the forward and both backward products fused, found {count} {FUSED_PRIMITIVE}"

    # Positive control: the walker does see the collectives of the reference.
    ref_names = primitive_names(_grad_jaxpr(lax_op, op, kw))
    assert _collectives(ref_names), "walker found no collectives in the unfused reference gradient"
    assert FUSED_PRIMITIVE not in ref_names


# --------------------------------------------------------------------------
# Two-layer tensor-parallel MLP on a (dp=2, tp=4) mesh
# --------------------------------------------------------------------------
def _mlp(fused: bool, vary_weights_over_dp: bool):
    agmm = commfuse.all_gather_matmul if fused else lax_agmm
    mmrs = commfuse.matmul_reduce_scatter if fused else lax_mmrs

    def body(x, w1, w2):
        # x [b, s, d] (batch over dp, sequence over tp); w1 [d, f/tp]; w2 [f/tp, d].
        if vary_weights_over_dp:
            w1 = jax.lax.pcast(w1, "dp", to="varying")
            w2 = jax.lax.pcast(w2, "dp", to="varying")
        h = agmm(x, w1, "tp", gather_dimension=1)          # [b, S, f/tp]
        return mmrs(jax.nn.gelu(h), w2, "tp", scatter_dimension=1)   # [b, s, d]

    return body


@pytest.mark.parametrize("vary_weights_over_dp", [False, True], ids=["replicated-weights", "pcast-weights"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=_dt_id)
def test_mlp_gradient_2x4_mesh(dtype, vary_weights_over_dp):
    """The weights are replicated over "dp" (the usual data-parallel layout),
    so their gradients sum over dp. ``pcast-weights`` makes that explicit in
    the body with ``jax.lax.pcast(w, "dp", to="varying")``."""
    mesh = make_mesh((2, 4), ("dp", "tp"))
    rng = np.random.default_rng(_seed("mlp", _dt_id(dtype), vary_weights_over_dp))
    b, s, d, f = 2, 3, 16, 32
    x = rand((2 * b, 4 * s, d), dtype, rng=rng)
    w1 = (rand((d, f), rng=rng) / np.sqrt(d)).astype(dtype)
    w2 = (rand((f, d), rng=rng) / np.sqrt(f)).astype(dtype)
    specs = (P("dp", "tp", None), P(None, "tp"), P("tp", None))
    ct = rand((2 * b, 4 * s, d), rng=rng)

    def grads(fused):
        sm = jax.shard_map(_mlp(fused, vary_weights_over_dp), mesh=mesh, in_specs=specs,
                           out_specs=P("dp", "tp", None))
        loss = lambda *a: jnp.sum(ct * jnp.sin(sm(*a).astype(jnp.float32)))  # noqa: E731
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return [np.asarray(v) for v in g(*[place(a, mesh, sp) for a, sp in zip((x, w1, w2), specs)])]

    got = grads(True)
    want = grads(False)
    rtol = GRAD_RTOL[np.dtype(dtype)]
    for name, g_, w_ in zip(("x", "w1", "w2"), got, want):
        assert g_.dtype == np.dtype(dtype), name
        assert_close(g_, w_, rtol=rtol, err_msg=f"d/d{name}")
