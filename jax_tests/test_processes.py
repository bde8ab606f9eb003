"""Programs of several processes on CPU devices: two ``jax.distributed``
processes of two CPU devices each on localhost, XLA's collectives over
gloo. A group that spans the processes cannot use the CPU backend's
transport (it lives inside one process): its calls run XLA's own
collectives, with the same numbers as plain and the reason said; a group
inside one process still fuses. Never a wait for ranks that cannot arrive."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import os, sys, warnings
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["COMMFUSE_TIMEOUT_S"] = "10"   # a wait that cannot end would fail here, not hang
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.distributed.initialize("127.0.0.1:" + port, num_processes=2, process_id=pid)
    import numpy as np
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    import commfuse

    assert jax.device_count() == 4 and jax.local_device_count() == 2
    AUTO = (jax.sharding.AxisType.Auto,)

    def placed(a, mesh, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    def whole(a):
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    def close(name, got, want):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=name)
        print("OK", name, flush=True)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    w1 = (rng.standard_normal((16, 64)) / 4).astype(np.float32)
    w2 = (rng.standard_normal((64, 16)) / 8).astype(np.float32)
    want = np.asarray(jax.nn.gelu(jnp.asarray(x) @ w1) @ w2)

    def mlp(x, w1, w2):
        h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
        return jax.lax.psum_scatter(jax.nn.gelu(h) @ w2, "tp", scatter_dimension=0, tiled=True)

    def named(x, w1, w2):
        h = commfuse.all_gather_matmul(x, w1, "tp", schedule="ring")
        return commfuse.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", schedule="ring")

    def fused_calls(fn, *args):
        return fn.lower(*args).compile().as_text().count("commfuse_collective_matmul_cpu")

    # tp over all four devices: the group spans the processes.
    mesh = jax.make_mesh((4,), ("tp",), axis_types=AUTO)
    specs = (P("tp"), P(None, "tp"), P("tp"))
    args = [placed(a, mesh, s) for a, s in zip((x, w1, w2), specs)]
    plain = jax.jit(jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P("tp")))
    close("plain across processes", whole(plain(*args)), want)
    for schedule in ("ring", "auto"):
        fn = commfuse.overlap(jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P("tp")), schedule=schedule)
        jitted = jax.jit(fn)
        close(f"overlap {schedule} across processes", whole(jitted(*args)), want)
        assert fused_calls(jitted, *args) == 0
        report = "\\n".join(fn.last_report)
        assert "spans processes" in report and "rewrote" not in report, report
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        direct = jax.jit(jax.shard_map(named, mesh=mesh, in_specs=specs, out_specs=P("tp")))
        close("named ops across processes", whole(direct(*args)), want)
    assert fused_calls(direct, *args) == 0
    assert any("spans processes" in str(w.message) for w in said), [str(w.message) for w in said]

    # dp across the processes, tp inside each: the tp groups still fuse.
    mesh2 = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=AUTO * 2)
    specs2 = (P(("dp", "tp")), P(None, "tp"), P("tp"))
    xs = np.concatenate([x, 2 * x])
    want2 = np.concatenate([want, np.asarray(jax.nn.gelu(2 * jnp.asarray(x) @ w1) @ w2)])

    def dp_mlp(x, w1, w2):
        return mlp(x, w1, w2)

    args2 = [placed(a, mesh2, s) for a, s in zip((xs, w1, w2), specs2)]
    fn = commfuse.overlap(jax.shard_map(dp_mlp, mesh=mesh2, in_specs=specs2, out_specs=P(("dp", "tp"))),
                          schedule="ring")
    jitted = jax.jit(fn)
    close("overlap ring inside each process", whole(jitted(*args2)), want2)
    assert fused_calls(jitted, *args2) == 2, fn.last_report

    # commfuse.matmul under jit, NamedSharding over the four devices.
    xm, wm = placed(x, mesh, P("tp", None)), placed(w1, mesh, P())
    product = jax.jit(lambda a, b: commfuse.matmul(a, b, schedule="ring"),
                      out_shardings=NamedSharding(mesh, P()))
    close("commfuse.matmul across processes", whole(product(xm, wm)), x @ w1)
    assert fused_calls(product, xm, wm) == 0

    # reshard between two layouts of the four devices: XLA's own move.
    moved = commfuse.reshard(xm, NamedSharding(mesh, P(None, "tp")))
    assert moved.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)
    close("reshard across processes", whole(moved), x)
    try:
        commfuse.reshard(xm, NamedSharding(mesh, P(None, "tp")), schedule="direct")
    except NotImplementedError as e:
        assert "span processes" in str(e), e
    else:
        raise AssertionError("an explicit reshard schedule across processes ran")
    jax.distributed.shutdown()
    print("DONE", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_of_cpu_devices_run_every_way_in_with_plain_numbers():
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(pid), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for pid in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the two processes did not finish in 300 s")
    for pid, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {pid}:\n{out}\n{err[-4000:]}"
        assert "DONE" in out, f"process {pid}:\n{out}\n{err[-4000:]}"
        for name in ("plain across processes", "overlap ring across processes", "overlap auto across processes",
                     "named ops across processes", "overlap ring inside each process",
                     "commfuse.matmul across processes", "reshard across processes"):
            assert f"OK {name}" in out, f"process {pid} lacks {name!r}:\n{out}\n{err[-4000:]}"
