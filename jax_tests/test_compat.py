"""The JAX version differences commfuse meets (``_compat``), checked on
whichever JAX this suite runs on (0.10.2 and 0.12 in CI): each helper does
what its callers rely on."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from commfuse import _compat
from programs import make_mesh


def test_check_vma_follows_the_enclosing_shard_map():
    mesh = make_mesh({"i": 2})
    seen = []
    for check in (True, False):
        def body(x):
            seen.append(_compat.check_vma())
            return x
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=check))(jnp.ones(4))
    assert seen == [True, False]


def test_scan_counts_name_the_consts_and_the_carry():
    def f(c, xs):
        k = jnp.float32(3)
        return jax.lax.scan(lambda carry, x: (carry * k + x, carry), c, xs)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(()), jnp.ones((5,)))
    scan = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")
    n_consts, n_carry = _compat.scan_counts(scan.params)
    assert n_carry == 1 and n_consts + n_carry + 1 == len(scan.invars)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PROCESS = textwrap.dedent("""
    import sys
    import jax
    from commfuse import _compat
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.distributed.initialize("127.0.0.1:" + port, num_processes=2, process_id=pid)
    client = _compat.distributed_client()
    if pid == 0:
        client.key_value_set("commfuse/test/key", "from-0")
    print("got", client.blocking_key_value_get("commfuse/test/key", 20000))
    jax.distributed.shutdown()
""")


def test_the_distributed_client_exchanges_a_value_between_two_processes():
    """What `_nccl_id` needs of JAX's key-value store (its one private name)."""
    assert _compat.distributed_client() is None  # not initialised in the test process
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, str(pid), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the two processes did not finish in 120 s")
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "got from-0" in out, out + err[-2000:]
