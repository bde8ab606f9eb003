"""commfuse ops inside real programs: repeated calls, chains, scans, 2-D meshes."""

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
    make_mesh,
    mesh1d,
    place,
    rand,
    run_sharded,
    sharded_fn,
)

BF16 = jnp.bfloat16


# --------------------------------------------------------------------------
# One program, many calls
# --------------------------------------------------------------------------
def test_one_program_called_100_times():
    n, m, k, f, rows = 4, 4, 16, 6, 8
    mesh = mesh1d(n)
    specs = (P("x", None), P(None, "x"), P(None, "x"), P("x", None))

    def program(x, w1, x2, w2):
        y1 = commfuse.all_gather_matmul(x, w1, "x", schedule="bidirectional")
        y2 = commfuse.matmul_reduce_scatter(x2, w2, "x", schedule="ring")
        return y1, y2

    fn = sharded_fn(program, mesh, specs)
    rng = np.random.default_rng(1234)
    calls = 0
    while calls < 100:
        # Fresh inputs every 5 calls.
        x = rand((n * m, k), rng=rng)
        w1 = rand((k, n * f), rng=rng)
        x2 = rand((n * rows, n * k), rng=rng)
        w2 = rand((n * k, f), rng=rng)
        args = [place(a, mesh, s) for a, s in zip((x, w1, x2, w2), specs)]

        want1 = np.stack(np.split(x.astype(np.float64) @ w1, n, axis=1))
        want2 = np.stack(np.split(x2.astype(np.float64) @ w2, n, axis=0))

        # Dispatch all 5 before looking at any (several executions in flight).
        outs = [fn(*args) for _ in range(5)]
        for i, (y1, y2) in enumerate(outs):
            assert_close(np.asarray(y1), want1, err_msg=f"call {calls + i} (all_gather_matmul)")
            assert_close(np.asarray(y2), want2, err_msg=f"call {calls + i} (matmul_reduce_scatter)")
        calls += len(outs)
    assert calls == 100


def test_alternating_programs_share_devices():
    # Two different compiled programs using the ops on the same devices,
    # called alternately: no state may leak from one to the other.
    n = 4
    mesh = mesh1d(n)
    specs = (P("x", None), P())
    fa = sharded_fn(lambda a, b: commfuse.all_gather_matmul(a, b, "x"), mesh, specs)
    fb = sharded_fn(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x"), mesh, specs)
    rng = np.random.default_rng(5)
    for it in range(6):
        xa, wa = rand((n * 3, 10), rng=rng), rand((10, 7), rng=rng)
        xb, wb = rand((n * 8, 10), rng=rng), rand((10, 5), rng=rng)
        ya = fa(place(xa, mesh, specs[0]), place(wa, mesh, specs[1]))
        yb = fb(place(xb, mesh, specs[0]), place(wb, mesh, specs[1]))
        assert_close(np.asarray(ya), np.stack([xa.astype(np.float64) @ wa] * n), err_msg=f"iter {it}")
        # Each device's x block is its own partial operand: sum over devices.
        parts = np.split(xb.astype(np.float64), n, axis=0)
        total = sum(p @ wb for p in parts)
        assert_close(np.asarray(yb), np.stack(np.split(total, n, axis=0)), err_msg=f"iter {it}")


# --------------------------------------------------------------------------
# Two fused ops in one program: a tensor-parallel MLP
# --------------------------------------------------------------------------
def _mlp(fused: bool, schedule="auto"):
    def f(x, w1, w2):
        if fused:
            h = commfuse.all_gather_matmul(x, w1, "x", schedule=schedule)
        else:
            h = lax_all_gather_matmul(x, w1, "x")
        a = jax.nn.gelu(h)
        if fused:
            y = commfuse.matmul_reduce_scatter(a, w2, "x", schedule=schedule)
        else:
            y = lax_matmul_reduce_scatter(a, w2, "x")
        return h, y

    return f


@pytest.mark.parametrize(
    "dtype,schedule,n",
    [(np.float32, "auto", 4), (np.float32, "sequential", 8), (BF16, "bidirectional", 4)],
    ids=["f32-auto-4", "f32-sequential-8", "bf16-bidirectional-4"],
)
def test_mlp_two_fused_ops(dtype, schedule, n):
    seq, d, ff = 8 * n, 32, 16 * n
    mesh = mesh1d(n)
    rng = np.random.default_rng(n)
    x = rand((seq, d), dtype, rng=rng)
    w1 = (rand((d, ff), rng=rng) / np.sqrt(d)).astype(dtype)
    w2 = (rand((ff, d), rng=rng) / np.sqrt(ff)).astype(dtype)
    specs = (P("x", None), P(None, "x"), P("x", None))
    h, y = run_sharded(_mlp(True, schedule), mesh, specs, x, w1, w2)
    h_ref, y_ref = run_sharded(_mlp(False), mesh, specs, x, w1, w2)
    assert h.shape == (n, seq, ff // n) and y.shape == (n, seq // n, d)
    assert y.dtype == np.dtype(dtype)
    assert_close(h, h_ref)
    assert_close(y, y_ref)

    # float64 numpy model of the whole layer.
    x64, w164, w264 = (a.astype(np.float64) for a in (x, w1, w2))
    hf = x64 @ w164
    af = np.asarray(jax.nn.gelu(jnp.asarray(hf, jnp.float32)), np.float64)
    yf = af @ w264
    assert_close(y, np.stack(np.split(yf, n, axis=0)), dtype=dtype)


# --------------------------------------------------------------------------
# Inside lax.scan
# --------------------------------------------------------------------------
def _scan_program(fused: bool):
    agmm = (lambda a, b: commfuse.all_gather_matmul(a, b, "x")) if fused else (
        lambda a, b: lax_all_gather_matmul(a, b, "x"))
    mmrs = (lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", schedule="bidirectional")) if fused else (
        lambda a, b: lax_matmul_reduce_scatter(a, b, "x"))

    def f(c0, xs, w1s, w2s, wx):
        def step(c, inp):
            x_t, w1, w2 = inp
            h = agmm(c, w1)                       # [n*m, f/n]
            c_new = jnp.tanh(mmrs(jnp.tanh(h), w2))  # [m, d]
            side = agmm(x_t, wx)                  # independent of the carry
            return c_new, (h, c_new, side)

        c_last, (hs, cs, sides) = jax.lax.scan(step, c0, (xs, w1s, w2s))
        return c_last, hs, cs, sides

    return f


def test_ops_inside_scan():
    n, m, d, ff, steps = 4, 3, 16, 24, 5
    mesh = mesh1d(n)
    rng = np.random.default_rng(77)
    c0 = rand((n * m, d), rng=rng)
    xs = rand((steps, n * 2, 8), rng=rng)
    w1s = rand((steps, d, ff), rng=rng) / np.float32(np.sqrt(d))
    w2s = rand((steps, ff, d), rng=rng) / np.float32(np.sqrt(ff))
    wx = rand((8, 5), rng=rng)
    specs = (P("x", None), P(None, "x", None), P(None, None, "x"), P(None, "x", None), P())
    args = (c0, xs, w1s, w2s, wx)
    got = run_sharded(_scan_program(True), mesh, specs, *args)
    want = run_sharded(_scan_program(False), mesh, specs, *args)
    names = ("final carry", "h per step", "carry per step", "side per step")
    for g, w, name in zip(got, want, names):
        assert g.shape == w.shape, name
        assert_close(g, w, err_msg=name)
    # Each iteration separately (scan outputs are stacked on axis 1 here:
    # [device, step, ...]).
    for t in range(steps):
        for g, w, name in zip(got[1:], want[1:], names[1:]):
            assert_close(g[:, t], w[:, t], err_msg=f"{name}, step {t}")
    # The side output: gather(xs[t]) @ wx on every device.
    for t in range(steps):
        exp = xs[t].astype(np.float64) @ wx
        assert_close(got[3][:, t], np.stack([exp] * n), err_msg=f"side step {t}")


# --------------------------------------------------------------------------
# 2-D mesh ("dp", "tp") = (2, 4)
# --------------------------------------------------------------------------
@pytest.fixture
def mesh2x4():
    return make_mesh((2, 4), ("dp", "tp"))


@pytest.mark.parametrize("axis", ["dp", "tp"])
@pytest.mark.parametrize("schedule", ["ring", "bidirectional", "auto"])
def test_2d_mesh_all_gather_matmul(mesh2x4, axis, schedule):
    mesh = mesh2x4
    rng = np.random.default_rng(zlib.crc32(f"agmm-{axis}-{schedule}".encode()))
    x = rand((2 * 3, 4 * 2, 12), rng=rng)     # local [3, 2, 12]
    w = rand((12, 2 * 5), rng=rng)            # local [12, 5] (columns over dp)
    specs = (P("dp", "tp", None), P(None, "dp"))
    gd = 0 if axis == "dp" else 1
    got = run_sharded(
        lambda a, b: commfuse.all_gather_matmul(a, b, axis, gather_dimension=gd, schedule=schedule),
        mesh, specs, x, w)
    want = run_sharded(
        lambda a, b: lax_all_gather_matmul(a, b, axis, gather_dimension=gd), mesh, specs, x, w)
    assert got.shape == want.shape
    assert_close(got, want)


@pytest.mark.parametrize("axis", ["dp", "tp"])
@pytest.mark.parametrize("schedule", ["ring", "bidirectional", "auto"])
def test_2d_mesh_matmul_reduce_scatter(mesh2x4, axis, schedule):
    mesh = mesh2x4
    rng = np.random.default_rng(zlib.crc32(f"mmrs-{axis}-{schedule}".encode()))
    other = "tp" if axis == "dp" else "dp"
    # Contraction dim sharded over `axis`, rows over the other axis.
    x = rand((mesh.shape[other] * 8, mesh.shape[axis] * 6), rng=rng)  # local [8, 6]
    w = rand((mesh.shape[axis] * 6, 5), rng=rng)                      # local [6, 5]
    specs = (P(other, axis), P(axis, None))
    got = run_sharded(
        lambda a, b: commfuse.matmul_reduce_scatter(a, b, axis, schedule=schedule),
        mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(a, b, axis), mesh, specs, x, w)
    assert got.shape == want.shape == (8, 8 // mesh.shape[axis], 5)
    assert_close(got, want)


@pytest.mark.parametrize("axes", [("dp", "tp"), ("tp", "dp")], ids=["dp,tp", "tp,dp"])
def test_2d_mesh_tuple_axis_all_gather_matmul(mesh2x4, axes):
    mesh = mesh2x4
    rng = np.random.default_rng(11)
    x = rand((8 * 2, 9), rng=rng)
    w = rand((9, 6), rng=rng)
    specs = (P(axes, None), P())
    got = run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, axes), mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_all_gather_matmul(a, b, axes), mesh, specs, x, w)
    assert got.shape == (8, 16, 6)
    assert_close(got, want)
    # x sharded in the same axis order as the gather: every device sees all of x.
    assert_close(got, np.stack([x.astype(np.float64) @ w] * 8), dtype=np.float32)


@pytest.mark.parametrize("axes", [("dp", "tp"), ("tp", "dp")], ids=["dp,tp", "tp,dp"])
def test_2d_mesh_tuple_axis_matmul_reduce_scatter(mesh2x4, axes):
    mesh = mesh2x4
    rng = np.random.default_rng(12)
    x = rand((16, 8 * 3), rng=rng)
    w = rand((8 * 3, 4), rng=rng)
    specs = (P(None, axes), P(axes, None))
    got = run_sharded(lambda a, b: commfuse.matmul_reduce_scatter(a, b, axes), mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(a, b, axes), mesh, specs, x, w)
    assert got.shape == (8, 2, 4)
    assert_close(got, want)
    # Independent check: device (dp, tp) holds block (index along `axes`) of x @ w.
    blocks = np.split(x.astype(np.float64) @ w, 8, axis=0)
    exp = []
    for dp in range(2):
        for tp in range(4):
            idx = dp * 4 + tp if axes == ("dp", "tp") else tp * 2 + dp
            exp.append(blocks[idx])
    assert_close(got, np.stack(exp), dtype=np.float32)


def test_2d_mesh_ops_over_both_axes_in_one_program(mesh2x4):
    # all_gather_matmul over "tp" feeding matmul_reduce_scatter over "dp".
    mesh = mesh2x4
    rng = np.random.default_rng(13)
    x = rand((2 * 4 * 2, 8), rng=rng)     # local [2, 8] rows over (dp, tp)
    w1 = rand((8, 4 * 6), rng=rng)        # local [8, 6] columns over tp
    w2 = rand((6, 10), rng=rng)
    specs = (P(("dp", "tp"), None), P(None, "tp"), P())

    def fused(a, b, c):
        h = commfuse.all_gather_matmul(a, b, "tp")
        return commfuse.matmul_reduce_scatter(h, c, "dp", scatter_dimension=0)

    def literal(a, b, c):
        h = lax_all_gather_matmul(a, b, "tp")
        return lax_matmul_reduce_scatter(h, c, "dp", scatter_dimension=0)

    got = run_sharded(fused, mesh, specs, x, w1, w2)
    want = run_sharded(literal, mesh, specs, x, w1, w2)
    assert got.shape == (8, 4, 10)
    assert_close(got, want)


# --------------------------------------------------------------------------
# Gradients when an operand is replicated over an axis the other varies over
# --------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_grad_with_weight_replicated_over_another_axis(mesh2x4, op):
    """Data + tensor parallelism: x split over dp and tp, w only over tp. The
    weight gradient must be summed over dp, as JAX does for a plain dot."""
    mesh = mesh2x4
    rng = np.random.default_rng(zlib.crc32(op.encode()))
    if op == "all_gather_matmul":
        x, w = rand((2 * 4 * 3, 16), rng=rng), rand((16, 4 * 5), rng=rng)
        specs, out_spec = (P(("dp", "tp")), P(None, "tp")), P("dp", "tp")
        fused = lambda a, b: commfuse.all_gather_matmul(a, b, "tp")
        plain = lambda a, b: lax_all_gather_matmul(a, b, "tp")
    else:
        x, w = rand((2 * 4 * 3, 4 * 16), rng=rng), rand((4 * 16, 5), rng=rng)
        specs, out_spec = (P("dp", "tp"), P("tp", None)), P(("dp", "tp"))
        fused = lambda a, b: commfuse.matmul_reduce_scatter(a, b, "tp")
        plain = lambda a, b: lax_matmul_reduce_scatter(a, b, "tp")
    xs, ws = place(x, mesh, specs[0]), place(w, mesh, specs[1])

    def grads(f):
        g = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out_spec)
        return jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(g(a, b))), argnums=(0, 1)))(xs, ws)

    for got, want in zip(grads(fused), grads(plain)):
        assert_close(np.asarray(got), np.asarray(want))
