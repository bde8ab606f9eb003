"""The fused ops on GPUs: the CPU suite's numerics on every local GPU.

Marked ``gpu``: conftest skips them when JAX sees no GPU. Run on a GPU host
with a CUDA jaxlib and the library built with ``COMMFUSE_FEATURES=cuda``
(``scripts/gpu_check.sh`` does all of it). Covered: 1 GPU as a degenerate
axis, all local GPUs, every schedule, bf16, and the timeout when a peer never
arrives. Not covered yet: fp8 (the backend has no fp8 path yet, see GPU.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commfuse
from conftest import (
    SCHEDULES,
    assert_close,
    lax_all_gather_matmul,
    lax_matmul_reduce_scatter,
    mesh1d,
    rand,
    run_sharded,
    spec_on,
)
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.gpu


def _gpu_counts():
    """1 (degenerate axis) and every local GPU, when there are several."""
    try:
        n = len(jax.devices("gpu"))
    except RuntimeError:
        n = 0
    return sorted({1, max(n, 1)})


@pytest.mark.parametrize("n", _gpu_counts())
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_all_gather_matmul_matches_lax(n, schedule, dtype):
    mesh = mesh1d(n, platform="gpu")
    x = rand((n * 64, 96), dtype, seed=1)
    w = rand((96, 80), dtype, seed=2)
    specs = (spec_on(2, 0, "x"), P())
    got = run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule=schedule), mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_all_gather_matmul(a, b, "x"), mesh, specs, x, w)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("n", _gpu_counts())
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_matmul_reduce_scatter_matches_lax(n, schedule, dtype):
    mesh = mesh1d(n, platform="gpu")
    x = rand((n * n * 32, 96), dtype, seed=3)
    w = rand((96, 80), dtype, seed=4)
    specs = (spec_on(2, 0, "x"), P())
    got = run_sharded(lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", schedule=schedule), mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(a, b, "x"), mesh, specs, x, w)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("n", _gpu_counts())
def test_grad_of_a_fused_layer_matches_lax(n):
    mesh = mesh1d(n, platform="gpu")
    x = rand((n * 32, 64), seed=5)
    w1 = rand((64, 48), seed=6)
    w2 = rand((48, 64), seed=7)
    specs = (spec_on(2, 0, "x"), P(None, "x"), P("x", None))

    def loss(fused):
        ag = commfuse.all_gather_matmul if fused else lax_all_gather_matmul
        rs = commfuse.matmul_reduce_scatter if fused else lax_matmul_reduce_scatter

        def f(a, b, c):
            return jnp.sum(rs(jax.nn.gelu(ag(a, b, "x")), c, "x") ** 2)

        return lambda a, b, c: jax.grad(f, argnums=(0, 1, 2))(a, b, c)

    got = run_sharded(loss(True), mesh, specs, x, w1, w2)
    want = run_sharded(loss(False), mesh, specs, x, w1, w2)
    for g, r in zip(got, want):
        assert_close(g, r, np.float32)


def test_a_missing_peer_times_out_instead_of_hanging(tmp_path):
    """Two processes, one GPU each; the second never calls the op."""
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    script = tmp_path / "peer.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        pid = int(sys.argv[1])
        os.environ["CUDA_VISIBLE_DEVICES"] = str(pid)
        import jax, jax.numpy as jnp, numpy as np
        jax.distributed.initialize("127.0.0.1:" + sys.argv[2], num_processes=2, process_id=pid)
        import commfuse
        from jax.sharding import PartitionSpec as P
        if pid == 1:
            sys.exit(0)  # never arrives
        commfuse.configure(timeout_s=3.0)
        mesh = jax.make_mesh((2,), ("x",))
        f = jax.jit(jax.shard_map(lambda a, b: commfuse.all_gather_matmul(a, b, "x"), mesh=mesh,
                                  in_specs=(P("x"), P()), out_specs=P("x")))
        x = jnp.ones((128, 64)); w = jnp.ones((64, 32))
        try:
            f(x, w).block_until_ready()
        except Exception as e:
            print("ERROR:", e)
            sys.exit(3)
        sys.exit(0)
    """))
    port = str(20000 + os.getpid() % 20000)
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    out0, _ = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=120)
    assert procs[0].returncode == 3, out0
    assert "DEADLINE_EXCEEDED" in out0 or "deadline exceeded" in out0, out0
