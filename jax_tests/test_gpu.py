"""The fused ops on GPUs: the CPU suite's numerics on every local GPU.

The device tests are marked ``gpu``: conftest skips them when JAX sees no
GPU. Run on a GPU host with a CUDA jaxlib and the library built with
``COMMFUSE_FEATURES=cuda`` (``scripts/gpu_check.sh`` does all of it).
Covered: 1 GPU as a degenerate axis, all local GPUs, every schedule, bf16,
the timeout when a peer never arrives, and (see GPU.md) fp8.

The unmarked tests at the end run everywhere: the NCCL unique id exchange of
groups spanning processes (``commfuse._nccl_id``) against a fake
``jax.distributed`` key-value client, and the import-time behaviour.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commfuse
from commfuse import _nccl_id
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

def _gpu_counts():
    """1 (degenerate axis) and every local GPU, when there are several."""
    try:
        n = len(jax.devices("gpu"))
    except RuntimeError:
        n = 0
    return sorted({1, max(n, 1)})


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
from commfuse import _nccl_id
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


_TWO_PROCESS_SCRIPT = """
import os, sys
pid = int(sys.argv[1])
os.environ["CUDA_VISIBLE_DEVICES"] = str(pid)
import jax, jax.numpy as jnp, numpy as np
jax.distributed.initialize("127.0.0.1:" + sys.argv[2], num_processes=2, process_id=pid)
import commfuse
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("x",))
f = jax.jit(jax.shard_map(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule=sys.argv[3]), mesh=mesh,
                          in_specs=(P("x"), P()), out_specs=P("x")))
x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64) % 7
w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) % 5
xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda i: x[i])
ws = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P()), lambda i: w[i])
got = np.asarray(f(xs, ws).addressable_data(0))  # this process's device: the whole product
np.testing.assert_array_equal(got, x @ w)
print("OK", pid)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["ring", "sequential"])
def test_two_processes_share_a_communicator_through_the_key_value_store(tmp_path, schedule):
    """Two processes, one GPU each, one group spanning both: the NCCL id is
    made by process 0 at lowering, fetched by process 1 from the key-value
    store, and the result is exact (integer-valued f32)."""
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    script = tmp_path / "two.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    port = str(21000 + os.getpid() % 20000)
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, schedule], env=dict(os.environ),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK {i}" in out, out


# ---- Without a GPU: the NCCL unique id exchange (commfuse._nccl_id) ---------------

class FakeKeyValueClient:
    """The two calls of a ``jax.distributed`` client the exchange uses, over
    one dict shared by the fake processes (threads)."""

    def __init__(self, store=None, cond=None):
        self.store = {} if store is None else store
        self.cond = threading.Condition() if cond is None else cond
        self.sets = []

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            if key in self.store and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.store[key] = value
            self.sets.append(key)
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.store, timeout=timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.store[key]


class FakeDevice:
    def __init__(self, id, process_index, local_hardware_id):
        self.id, self.process_index, self.local_hardware_id = id, process_index, local_hardware_id


class FakeMesh:
    """A mesh of `shape` over `ids`; device i is in process i // per_process."""

    def __init__(self, ids, shape, axis_names, per_process):
        self.device_ids = np.asarray(ids).reshape(shape)
        self.axis_names = tuple(axis_names)
        self.devices = np.asarray([FakeDevice(int(i), int(i) // per_process, int(i) % per_process)
                                   for i in self.device_ids.reshape(-1)], dtype=object).reshape(shape)


# The mesh of the Rust tests (comms.rs): 2x4 ("dp", "tp") with shuffled ids.
IDS = [5, 1, 7, 3, 0, 4, 2, 6]


def _ids_maker(tag):
    counter = iter(range(1, 1000))
    return lambda: bytes([tag, next(counter)]) + bytes(126)


def test_store_keys_and_groups_match_the_rust_side():
    ids = np.asarray(IDS).reshape(2, 4)
    tp = _nccl_id.mesh_groups(ids, [1])
    assert tp == [(5, 1, 7, 3), (0, 4, 2, 6)]
    assert _nccl_id.store_key(tp[1]) == "commfuse/nccl_id/0_4_2_6"  # CommKey::store_key's test
    assert _nccl_id.mesh_groups(ids, [0]) == [(5, 0), (1, 4), (7, 2), (3, 6)]
    assert _nccl_id.mesh_groups(ids, [0, 1]) == [tuple(IDS)]
    assert _nccl_id.mesh_groups(ids, [1, 0]) == [(5, 0, 1, 4, 7, 2, 3, 6)]
    with pytest.raises(ValueError):
        _nccl_id.mesh_groups(ids, [1, 1])
    nccl_id = bytes(range(128))
    words = _nccl_id.id_words(nccl_id)
    assert words.dtype == np.int64 and words.shape == (16,)
    assert int(words[0]) == int.from_bytes(nccl_id[:8], "little", signed=True)
    assert words.astype("<i8").tobytes() == nccl_id
    with pytest.raises(ValueError):
        _nccl_id.id_words(bytes(64))


def test_single_process_meshes_lower_unchanged():
    mesh = FakeMesh(IDS, (2, 4), ("dp", "tp"), per_process=8)
    client = FakeKeyValueClient()
    assert _nccl_id.lowering_attributes(mesh, ("tp",), process_index=0, client=client,
                                        make_id=_ids_maker(1)) == {}
    assert client.store == {}
    # The real mesh of this suite, with JAX's own process index.
    real = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    assert _nccl_id.lowering_attributes(real, ("x",), client=client, make_id=_ids_maker(1)) == {}


def test_the_owner_of_rank_0_publishes_and_the_others_wait_for_the_id():
    # Two processes of 4 devices: 0..3 and 4..7. Along "dp" every group
    # spans both; along "tp" the groups are (5, 1, 7, 3) and (0, 4, 2, 6).
    mesh = FakeMesh(IDS, (2, 4), ("dp", "tp"), per_process=4)
    store, cond = {}, threading.Condition()
    clients = {p: FakeKeyValueClient(store, cond) for p in (0, 1)}
    got = {}
    for p in (0, 1):
        # Each fake process in its own thread, with its own cache.
        def run(p=p, cache={}):
            got[p] = _nccl_id.exchange(
                _nccl_id.mesh_groups(mesh.device_ids, [0]), {d: d // 4 for d in IDS}, p, clients[p], 5000,
                _ids_maker(p + 1), cache)

        got[f"thread{p}"] = threading.Thread(target=run)
    # Process 1 starts first and blocks on keys that process 0 owns.
    got["thread1"].start()
    time.sleep(0.1)
    got["thread0"].start()
    got["thread0"].join(10)
    got["thread1"].join(10)
    assert got[0] == got[1] and len(got[0]) == 4
    # (5, 0) and (7, 2): rank 0 (5, 7) is in process 1; (1, 4), (3, 6): in process 0.
    owners = {g: g[0] // 4 for g in _nccl_id.mesh_groups(mesh.device_ids, [0])}
    for (group, owner), nccl_id in zip(owners.items(), got[0]):
        assert nccl_id[0] == owner + 1, (group, nccl_id[:2])
        assert store[_nccl_id.store_key(group)] == nccl_id.hex()
    assert sorted(clients[0].sets) == sorted(_nccl_id.store_key(g) for g, o in owners.items() if o == 0)
    assert sorted(clients[1].sets) == sorted(_nccl_id.store_key(g) for g, o in owners.items() if o == 1)


def test_lowering_attributes_carry_placement_and_ids_of_spanning_groups():
    mesh = FakeMesh(IDS, (2, 4), ("dp", "tp"), per_process=4)
    client = FakeKeyValueClient()
    cache = {}
    original = _nccl_id._cache
    try:
        _nccl_id._cache = cache
        # Process 0 owns rank 0 of (1, 4) and (3, 6) along "dp"; pre-publish process 1's.
        for g in [(5, 0), (7, 2)]:
            client.key_value_set(_nccl_id.store_key(g), bytes([9, g[0]] + [0] * 126).hex())
        attrs = _nccl_id.lowering_attributes(mesh, ("dp",), process_index=0, client=client,
                                             make_id=_ids_maker(1), timeout_ms=1000)
        np.testing.assert_array_equal(attrs["local_ordinals"], [-1, 1, -1, 3, 0, -1, 2, -1])
        groups = attrs["nccl_groups"].reshape(-1, 2)
        assert [tuple(g) for g in groups] == [(5, 0), (1, 4), (7, 2), (3, 6)]
        ids = attrs["nccl_ids"].reshape(-1, 16)
        assert ids.dtype == np.int64
        assert ids[0].astype("<i8").tobytes()[:2] == bytes([9, 5])
        assert ids[1].astype("<i8").tobytes()[:2] == bytes([1, 1])
        # A second lowering (another op, another program) reuses the ids.
        again = _nccl_id.lowering_attributes(mesh, ("dp",), process_index=0, client=client,
                                             make_id=_ids_maker(1), timeout_ms=1000)
        np.testing.assert_array_equal(again["nccl_ids"], attrs["nccl_ids"])
        assert len(client.sets) == 4
        # Rows of processes: along "tp" no group spans processes (placement
        # only, no exchange); along "dp" each does.
        rows = FakeMesh(range(8), (2, 4), ("dp", "tp"), per_process=4)
        tp = _nccl_id.lowering_attributes(rows, ("tp",), process_index=1, client=None, make_id=None)
        assert set(tp) == {"local_ordinals"}
        np.testing.assert_array_equal(tp["local_ordinals"], [-1] * 4 + [0, 1, 2, 3])
    finally:
        _nccl_id._cache = original


def test_a_missing_owner_is_a_timeout_naming_the_group_and_process():
    mesh = FakeMesh(IDS, (2, 4), ("dp", "tp"), per_process=4)
    original = _nccl_id._cache
    try:
        _nccl_id._cache = {}
        with pytest.raises(TimeoutError, match=r"process 1 \(rank 0 of the device group \[5, 0\]\)"):
            _nccl_id.lowering_attributes(mesh, ("dp",), process_index=0, client=FakeKeyValueClient(),
                                         make_id=_ids_maker(1), timeout_ms=50)
        # Its own ids were published before it waited (so no two processes wait on each other).
        assert set(_nccl_id._cache) == {_nccl_id.store_key(g) for g in [(1, 4), (3, 6)]}
    finally:
        _nccl_id._cache = original


def test_a_spanning_mesh_without_jax_distributed_says_so():
    from jax._src import distributed

    if distributed.global_state.client is not None:
        pytest.skip("jax.distributed is initialised in this process")
    with pytest.raises(NotImplementedError, match="jax.distributed.initialize"):
        _nccl_id._default_client()


def test_the_id_wait_uses_the_configured_timeout(monkeypatch):
    from commfuse import _native

    try:
        commfuse.configure(timeout_s=2.5)
        assert _native.timeout_ms() == 2500
        commfuse.configure(timeout_s=None)
        monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "7")
        assert _native.timeout_ms() == 7000
        monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "inf")
        assert _native.timeout_ms() == 60_000
        monkeypatch.delenv("COMMFUSE_TIMEOUT_S")
        assert _native.timeout_ms() == 60_000
    finally:
        commfuse.configure(timeout_s=None)


def test_a_library_without_nccl_says_so():
    from commfuse import _native

    try:
        nccl_id = _native.nccl_unique_id()
    except NotImplementedError as e:
        assert "cuda" in str(e) or "libnccl" in str(e)
    else:  # a CUDA build on a host with NCCL
        assert len(nccl_id) == 128


def test_importing_commfuse_starts_no_jax_backend():
    code = textwrap.dedent("""
        import commfuse, commfuse._nccl_id, commfuse._native
        from jax._src import xla_bridge
        assert not xla_bridge.backends_are_initialized(), "a JAX backend was started at import"
        print("clean")
    """)
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stdout + out.stderr


# ---- fp8 ----------------------------------------------------------------------------
# The API (GPU.md, "fp8"): x and w float8_e4m3fn, `x_scale` and `w_scale`
# float32 scalars (dequantisation factors), `preferred_element_type` bfloat16
# (default), float16 or float32; the result is
# preferred_element_type(x_scale * w_scale * (f32(x) @ f32(w))) with f32
# accumulation, on sm_90 through cuBLASLt. Misuse and CPU-only hosts are
# covered by test_fp8_api.py (runs everywhere); these have never run on a GPU.

_FP8 = [(jnp.float8_e4m3fn, jnp.float8_e4m3fn)]


def _sm90():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return False
    return bool(gpus) and all(float(getattr(d, "compute_capability", "0")) >= 9.0 for d in gpus)


def _quantize(a, dtype):
    """`a` as fp8 with a per-tensor scale: a ~= q * scale."""
    limit = float(jnp.finfo(dtype).max)
    scale = np.float32(np.abs(a).max() / limit)
    return (a / scale).astype(dtype), scale


@pytest.mark.gpu
@pytest.mark.parametrize("n", _gpu_counts())
@pytest.mark.parametrize("x_dtype,w_dtype", _FP8)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, np.float32])
def test_fp8_all_gather_matmul_matches_the_dequantized_product(n, x_dtype, w_dtype, out_dtype):
    if not _sm90():
        pytest.skip("fp8 needs sm_90")
    mesh = mesh1d(n, platform="gpu")
    xq, xs = _quantize(rand((n * 64, 128), np.float32, seed=11), x_dtype)
    wq, ws = _quantize(rand((128, 96), np.float32, seed=12), w_dtype)
    specs = (spec_on(2, 0, "x"), P())

    def fused(a, b):
        return commfuse.all_gather_matmul(a, b, "x", x_scale=xs, w_scale=ws, preferred_element_type=out_dtype)

    got = run_sharded(fused, mesh, specs, xq, wq)
    dq = lambda q, s: q.astype(np.float32) * s  # noqa: E731
    want = run_sharded(lambda a, b: lax_all_gather_matmul(dq(a, xs), dq(b, ws), "x").astype(out_dtype), mesh,
                       specs, xq, wq)
    assert_close(got, want, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("n", _gpu_counts())
def test_fp8_matmul_reduce_scatter_matches_the_dequantized_product(n):
    if not _sm90():
        pytest.skip("fp8 needs sm_90")
    mesh = mesh1d(n, platform="gpu")
    xq, xs = _quantize(rand((n * n * 32, 128), np.float32, seed=13), jnp.float8_e4m3fn)
    wq, ws = _quantize(rand((128, 64), np.float32, seed=14), jnp.float8_e4m3fn)
    specs = (spec_on(2, 0, "x"), P())

    def fused(a, b):
        return commfuse.matmul_reduce_scatter(a, b, "x", x_scale=xs, w_scale=ws, preferred_element_type=np.float32)

    got = run_sharded(fused, mesh, specs, xq, wq)
    dq = lambda q, s: q.astype(np.float32) * s  # noqa: E731
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(dq(a, xs), dq(b, ws), "x"), mesh, specs, xq, wq)
    assert_close(got, want, np.float32)
