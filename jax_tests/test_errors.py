"""Misuse raises clear errors at trace time; a missing peer ends in a timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commfuse
from conftest import P, mesh1d, rand, run_sharded

OPS = {
    "all_gather_matmul": (commfuse.all_gather_matmul, "gather_dimension"),
    "matmul_reduce_scatter": (commfuse.matmul_reduce_scatter, "scatter_dimension"),
}
OP_NAMES = list(OPS)


def _call(op_name, x_local, w, *, n=4, axis_name="x", **kwargs):
    """Call op ``op_name`` inside shard_map over mesh axis "x" of size ``n``.

    ``x_local`` is the per-device x (replicated, so any shape works); ``w`` is
    replicated too.
    """
    op, _ = OPS[op_name]
    mesh = mesh1d(n)
    run_sharded(lambda a, b: op(a, b, axis_name, **kwargs), mesh, (P(), P()), x_local, w)


def _msg(excinfo) -> str:
    return str(excinfo.value)


def _contains(msg: str, fragment: str) -> bool:
    return fragment.lower() in msg.lower()


# --------------------------------------------------------------------------
# axis names / context
# --------------------------------------------------------------------------
@pytest.mark.parametrize("op_name", OP_NAMES)
def test_unknown_axis_name(op_name):
    with pytest.raises(ValueError) as ei:
        _call(op_name, rand((8, 4)), rand((4, 3)), axis_name="nope_axis")
    msg = _msg(ei)
    assert "axis_name" in msg, msg
    assert "nope_axis" in msg, msg


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_unknown_axis_in_tuple(op_name):
    with pytest.raises(ValueError) as ei:
        _call(op_name, rand((8, 4)), rand((4, 3)), axis_name=("x", "bogus_axis"))
    msg = _msg(ei)
    assert "axis_name" in msg and "bogus_axis" in msg, msg


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_outside_shard_map_eager(op_name):
    op, _ = OPS[op_name]
    with pytest.raises(ValueError) as ei:
        op(jnp.asarray(rand((8, 4))), jnp.asarray(rand((4, 3))), "x")
    assert "shard_map" in _msg(ei), _msg(ei)


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_outside_shard_map_jit(op_name):
    op, _ = OPS[op_name]
    f = jax.jit(lambda a, b: op(a, b, "x"))
    with pytest.raises(ValueError) as ei:
        f(jnp.asarray(rand((8, 4))), jnp.asarray(rand((4, 3))))
    assert "shard_map" in _msg(ei), _msg(ei)


# --------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "x_shape,kwargs",
    [((6, 8), {}), ((2, 8), {}), ((4, 6, 8), {"scatter_dimension": 1})],
    ids=["rows6", "rows2", "rank3-dim1"],
)
def test_not_divisible(x_shape, kwargs):
    with pytest.raises(ValueError) as ei:
        _call("matmul_reduce_scatter", rand(x_shape), rand((8, 3)), n=4, **kwargs)
    assert _contains(_msg(ei), "divisible"), _msg(ei)


def _assert_names_rank(msg: str, arg: str):
    assert _contains(msg, "rank") or _contains(msg, "2-D"), msg
    assert re.search(rf"\b{arg}\b", msg), f"argument name {arg!r} missing from: {msg}"


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_x_rank_too_small(op_name):
    with pytest.raises(ValueError) as ei:
        _call(op_name, rand((8,)), rand((8, 3)))
    _assert_names_rank(_msg(ei), "x")


@pytest.mark.parametrize("w_shape", [(4,), (4, 3, 2)], ids=["rank1", "rank3"])
@pytest.mark.parametrize("op_name", OP_NAMES)
def test_w_not_2d(op_name, w_shape):
    with pytest.raises(ValueError) as ei:
        _call(op_name, rand((8, 4)), rand(w_shape))
    _assert_names_rank(_msg(ei), "w")


# Out of range for both ops; the last dim is out of range only for the gather
# (matmul_reduce_scatter may scatter the result's columns).
_OUT_OF_RANGE = [("r2-2", (8, 4), 2), ("r2-7", (8, 4), 7), ("r2-neg3", (8, 4), -3), ("r3-3", (8, 8, 4), 3)]
_LAST_DIM = [("r2-last", (8, 4), 1), ("r2-neg1", (8, 4), -1), ("r3-last", (8, 8, 4), 2)]
_DIM_CASES = [(op, shape, dim) for op in OP_NAMES for _, shape, dim in _OUT_OF_RANGE] + [
    ("all_gather_matmul", shape, dim) for _, shape, dim in _LAST_DIM]
_DIM_IDS = [f"{op}-{name}" for op in OP_NAMES for name, _, _ in _OUT_OF_RANGE] + [
    f"all_gather_matmul-{name}" for name, _, _ in _LAST_DIM]


@pytest.mark.parametrize("op_name,x_shape,dim", _DIM_CASES, ids=_DIM_IDS)
def test_dimension_out_of_range(op_name, x_shape, dim):
    _, dim_kw = OPS[op_name]
    with pytest.raises(ValueError) as ei:
        _call(op_name, rand(x_shape), rand((4, 4)), **{dim_kw: dim})
    assert dim_kw in _msg(ei), _msg(ei)
    if op_name == "all_gather_matmul" and x_shape == (8, 4):  # the dims it may name, both ways
        assert "one of [0] (or [-2] from the end)" in _msg(ei), _msg(ei)


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_contraction_mismatch(op_name):
    with pytest.raises(ValueError) as ei:
        _call(op_name, rand((8, 5)), rand((6, 3)))
    assert _contains(_msg(ei), "contract"), _msg(ei)


# --------------------------------------------------------------------------
# dtypes and options
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int32, np.complex64], ids=["int32", "complex64"])
@pytest.mark.parametrize("op_name", OP_NAMES)
def test_unsupported_dtype(op_name, dtype):
    x = (rand((8, 4)) * 10).astype(dtype)
    w = (rand((4, 4)) * 10).astype(dtype)
    with pytest.raises(TypeError) as ei:
        _call(op_name, x, w)
    assert _contains(_msg(ei), "dtype"), _msg(ei)


@pytest.mark.parametrize("schedule", ["fast", "", "ringg"])
@pytest.mark.parametrize("op_name", OP_NAMES)
def test_unknown_schedule(op_name, schedule):
    with pytest.raises(ValueError) as ei:
        _call(op_name, rand((8, 4)), rand((4, 4)), schedule=schedule)
    assert _contains(_msg(ei), "schedule"), _msg(ei)


# --------------------------------------------------------------------------
# configure()
# --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, -0.5, 0, float("inf"), 2.0 ** 64 / 1000, 1e30])
def test_configure_rejects_timeouts_that_are_no_deadline(bad, restore_commfuse_timeout):
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, at most 1e"):
        commfuse.configure(timeout_s=bad)


def test_configure_accepts_positive_timeout(restore_commfuse_timeout):
    commfuse.configure(timeout_s=30)
    # The ops still work afterwards.
    mesh = mesh1d(2)
    x, w = rand((4, 3)), rand((3, 2))
    y = run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, "x"),
                    mesh, (P("x", None), P()), x, w)
    np.testing.assert_allclose(y[0], x @ w, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# A rank that never reaches the op: the waiting rank must time out
# --------------------------------------------------------------------------
_TIMEOUT_SCRIPT = textwrap.dedent(
    """
    import os, re, sys, time
    flags = re.sub(r"--xla_force_host_platform_device_count=\\S*", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=4"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import commfuse

    mode, op = sys.argv[1], sys.argv[2]
    if mode == "configure":
        commfuse.configure(timeout_s=2.0)

    n = 4
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices("cpu")[:n])
    rng = np.random.default_rng(0)
    if op == "all_gather_matmul":
        x = rng.uniform(-1, 1, (n * 2, 16)).astype(np.float32)
        fused = lambda a, b: commfuse.all_gather_matmul(a, b, "x")
        other = lambda a, b: jnp.tile(a @ b, (n, 1))
    else:
        x = rng.uniform(-1, 1, (n * n, 16)).astype(np.float32)
        fused = lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x")
        other = lambda a, b: (a @ b)[:1]
    w = rng.uniform(-1, 1, (16, 8)).astype(np.float32)

    def body(a, b):
        # Only rank 0 reaches the fused op; the others skip it.
        y = jax.lax.cond(jax.lax.axis_index("x") == 0, fused, other, a, b)
        return y[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x", None), P()),
                              out_specs=P("x")))
    xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    t0 = time.monotonic()
    try:
        jax.block_until_ready(f(xs, ws))
    except Exception as e:
        print(f"RAISED after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}",
              flush=True)
        sys.exit(3)
    print("NO ERROR", flush=True)
    sys.exit(0)
    """
)


@pytest.mark.parametrize(
    "mode,op_name",
    [("env", "all_gather_matmul"), ("env", "matmul_reduce_scatter"),
     ("configure", "all_gather_matmul")],
)
def test_missing_peer_times_out(tmp_path, mode, op_name):
    script = tmp_path / "missing_peer.py"
    script.write_text(_TIMEOUT_SCRIPT)
    env = dict(os.environ)
    # With "configure" the env deadline is long: configure() must override it.
    env["COMMFUSE_TIMEOUT_S"] = "2" if mode == "env" else "600"
    # Make the child import the same commfuse as this process.
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(commfuse.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p
    )
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, str(script), mode, op_name],
            env=env, capture_output=True, text=True, timeout=60,
        )
    except subprocess.TimeoutExpired as e:
        out = "".join(
            s.decode(errors="replace") if isinstance(s, bytes) else s
            for s in (e.stdout or "", e.stderr or "")
        )
        pytest.fail(
            "the program with a missing peer did not finish within 60 s "
            f"(deadline 2 s); output so far:\n{out[-3000:]}"
        )
    elapsed = time.monotonic() - t0
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"expected a failure, got:\n{output[-3000:]}"
    assert "never arrived" in output, output[-3000:]
    # The ranks that took the other branch are in no commfuse call: the error
    # says so, and does not guess at the program's branches. (They may have
    # run the call-overhead measurement `auto` makes on first use, and left it.)
    outside = re.compile(
        r"ranks \[1, 2, 3\] \(devices \[1, 2, 3\]\) never arrived: devices \[1, 2, 3\] have not "
        r"entered any commfuse call (in this process|since leaving one [0-9 to]+ ms ago \(call site)")
    assert outside.search(output), output[-3000:]
    assert "is inside another commfuse call" not in output, output[-3000:]
    assert "lax.cond" not in output, output[-3000:]
    assert "deadline" in output.lower(), output[-3000:]
    assert elapsed < 30, f"took {elapsed:.1f}s with a 2 s deadline:\n{output[-3000:]}"


def test_configure_sets_the_gpu_transport_and_leaves_the_timeout(restore_commfuse_timeout, monkeypatch):
    from commfuse import _native
    monkeypatch.delenv("COMMFUSE_TRANSPORT", raising=False)
    commfuse.configure(timeout_s=12)
    try:
        assert _native.transport() == "auto"
        commfuse.configure(transport="nccl")
        assert _native.transport() == "nccl"
        assert _native.timeout_ms() == 12000, "setting the transport changed the timeout"
        commfuse.configure(transport="copies")
        assert _native.transport() == "copies"
        for bad in ("NCCL", "p2p", "", 3):
            with pytest.raises(ValueError, match="transport"):
                commfuse.configure(transport=bad)
        assert _native.transport() == "copies", "a refused value changed the setting"
        commfuse.configure(transport=None)
        monkeypatch.setenv("COMMFUSE_TRANSPORT", "nccl")
        assert _native.transport() == "nccl"
        monkeypatch.setenv("COMMFUSE_TRANSPORT", "fast")
        with pytest.raises(ValueError, match="COMMFUSE_TRANSPORT"):
            _native.transport()
    finally:
        commfuse.configure(transport=None)
