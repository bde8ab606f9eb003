"""The fused ops on GPUs: the CPU suite's numerics on every local GPU.

The device tests are marked ``gpu``: conftest skips them when JAX sees no
GPU. Run on a GPU host with a CUDA jaxlib and the library's default build
(``scripts/gpu_check.sh`` does all of it).
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
    tolerance,
)
from jax.sharding import PartitionSpec as P


def _gpu_counts():
    """1 (degenerate axis) and every local GPU, when there are several."""
    try:
        n = len(jax.devices("gpu"))
    except RuntimeError:
        n = 0
    return sorted({1, max(n, 1)})


# float32 at default precision: TF32 products on both sides (XLA's dot does
# so on sm_80+, and so do the fused GEMMs), each rounding its inputs to 10
# mantissa bits (2^-11 relative), which K = 96 terms accumulate.
_TF32_RTOL = 5e-3


def _rtol(dtype, precision):
    return _TF32_RTOL if np.dtype(dtype) == np.float32 and precision is None else None


@pytest.mark.gpu
@pytest.mark.parametrize("n", _gpu_counts())
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype,precision", [(np.float32, None), (np.float32, "highest"), (jnp.bfloat16, None)])
def test_all_gather_matmul_matches_lax(n, schedule, dtype, precision):
    mesh = mesh1d(n, platform="gpu")
    x = rand((n * 64, 96), dtype, seed=1)
    w = rand((96, 80), dtype, seed=2)
    specs = (spec_on(2, 0, "x"), P())
    got = run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule=schedule, precision=precision),
                      mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_all_gather_matmul(a, b, "x", precision=precision), mesh, specs, x, w)
    assert_close(got, want, dtype, rtol=_rtol(dtype, precision))


@pytest.mark.gpu
@pytest.mark.parametrize("n", _gpu_counts())
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype,precision", [(np.float32, None), (np.float32, "highest"), (jnp.bfloat16, None)])
def test_matmul_reduce_scatter_matches_lax(n, schedule, dtype, precision):
    mesh = mesh1d(n, platform="gpu")
    x = rand((n * n * 32, 96), dtype, seed=3)
    w = rand((96, 80), dtype, seed=4)
    specs = (spec_on(2, 0, "x"), P())
    got = run_sharded(
        lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", schedule=schedule, precision=precision),
        mesh, specs, x, w)
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(a, b, "x", precision=precision), mesh, specs, x, w)
    assert_close(got, want, dtype, rtol=_rtol(dtype, precision))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["matmul_all_gather", "all_to_all_matmul", "matmul_all_to_all"])
def test_the_other_ops_match_lax_on_one_gpu(op):
    mesh = mesh1d(1, platform="gpu")
    x = rand((64, 96), np.float32, seed=8)
    w = rand((96, 80), np.float32, seed=9)
    fused = {
        "matmul_all_gather": lambda a, b: commfuse.matmul_all_gather(a, b, "x", precision="highest"),
        "all_to_all_matmul": lambda a, b: commfuse.all_to_all_matmul(
            a, b, "x", split_dimension=0, concat_dimension=0, precision="highest"),
        "matmul_all_to_all": lambda a, b: commfuse.matmul_all_to_all(
            a, b, "x", split_dimension=0, concat_dimension=0, precision="highest"),
    }[op]
    ref = getattr(commfuse.reference, op)
    kwargs = {} if op == "matmul_all_gather" else dict(split_dimension=0, concat_dimension=0)
    specs = (spec_on(2, 0, "x"), P())
    got = run_sharded(fused, mesh, specs, x, w)
    want = run_sharded(lambda a, b: ref(a, b, "x", precision="highest", **kwargs), mesh, specs, x, w)
    assert_close(got, want, np.float32)


@pytest.mark.gpu
def test_kernels_are_loaded_before_execution_not_inside_it():
    # Every earlier GPU test ran its op: each device was set up at the
    # handler's INITIALIZE stage, none inside an EXECUTE call.
    from commfuse import _native
    mesh = mesh1d(1, platform="gpu")
    x, w = rand((64, 32), seed=1), rand((32, 16), seed=2)
    run_sharded(lambda a, b: commfuse.all_gather_matmul(a, b, "x"), mesh, (spec_on(2, 0, "x"), P()), x, w)
    assert _native.cuda_loads_during_execute() == 0


@pytest.mark.gpu
def test_cuda_libraries_are_the_copies_jax_loaded():
    libs = commfuse.cuda_libraries()
    assert set(libs) == {"cuda", "cublas", "cublasLt", "nccl", "nvrtc"}
    maps = open("/proc/self/maps").read()
    for key, entry in libs.items():
        assert entry["error"] is None and entry["version"], (key, entry)
        # One copy per library in the process: the file JAX's plugin mapped, where it mapped one.
        name = os.path.basename(entry["path"]).split(".so")[0] + ".so"
        mapped = {line.split()[-1] for line in maps.splitlines() if f"/{name}" in line}
        mapped = {os.path.realpath(m) for m in mapped}
        assert mapped == {os.path.realpath(entry["path"])}, (key, entry["path"], mapped)


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
            h = ag(a, b, "x", precision="highest")
            return jnp.sum(rs(jax.nn.gelu(h), c, "x", precision="highest") ** 2)

        return lambda a, b, c: jax.grad(f, argnums=(0, 1, 2))(a, b, c)

    got = run_sharded(loss(True), mesh, specs, x, w1, w2)
    want = run_sharded(loss(False), mesh, specs, x, w1, w2)
    for g, r in zip(got, want):
        assert_close(g, r, np.float32)


# Child scripts run as `script.py PROCESS_ID PORT VISIBLE_GPU [SCHEDULE]`: two
# processes under jax.distributed, each seeing one GPU (the same one when
# the host has one GPU and NCCL allows several ranks on it).
_MISSING_PEER_SCRIPT = """
import os, sys
pid = int(sys.argv[1])
os.environ["CUDA_VISIBLE_DEVICES"] = sys.argv[3]
import jax, jax.numpy as jnp, numpy as np
jax.distributed.initialize("127.0.0.1:" + sys.argv[2], num_processes=2, process_id=pid)
import commfuse
from jax.sharding import NamedSharding, PartitionSpec as P
# Every process takes part in making JAX's clients (they exchange their
# topologies); only then may the second one leave without calling the op.
jax.devices()
if pid == 1:
    sys.exit(0)  # never arrives
commfuse.configure(timeout_s=3.0)
mesh = jax.make_mesh((2,), ("x",))
f = jax.jit(jax.shard_map(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule="ring"), mesh=mesh,
                          in_specs=(P("x"), P()), out_specs=P("x")))
x = jax.make_array_from_callback((128, 64), NamedSharding(mesh, P("x")), lambda i: np.ones((128, 64), np.float32)[i])
w = jax.make_array_from_callback((64, 32), NamedSharding(mesh, P()), lambda i: np.ones((64, 32), np.float32)[i])
try:
    f(x, w).block_until_ready()
except Exception as e:
    print("ERROR:", e)
    sys.exit(3)
sys.exit(0)
"""

_TWO_PROCESS_SCRIPT = """
import os, sys
pid = int(sys.argv[1])
os.environ["CUDA_VISIBLE_DEVICES"] = sys.argv[3]
import jax, jax.numpy as jnp, numpy as np
jax.distributed.initialize("127.0.0.1:" + sys.argv[2], num_processes=2, process_id=pid)
import commfuse
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("x",))
f = jax.jit(jax.shard_map(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule=sys.argv[4]), mesh=mesh,
                          in_specs=(P("x"), P()), out_specs=P("x")))
x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64) % 7
w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) % 5
xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda i: x[i])
ws = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P()), lambda i: w[i])
got = np.asarray(f(xs, ws).addressable_data(0))  # this process's device: the whole product
np.testing.assert_array_equal(got, x @ w)
print("OK", pid)
"""


def _two_process_gpus():
    """The GPU each of two processes sees, and the environment they need: a
    GPU each where there are two; else both on GPU 0, which NCCL allows from
    2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1; COMMFUSE_TEST_SHARED_GPU=1 tries it
    with any NCCL, to see what it says)."""
    if len(jax.devices("gpu")) >= 2:
        return ["0", "1"], {}
    version = commfuse.cuda_libraries()["nccl"]["version"] or "not loaded"
    major_minor = tuple(int(v) for v in version.split(".")[:2]) if version[0].isdigit() else (0, 0)
    if major_minor < (2, 30) and os.environ.get("COMMFUSE_TEST_SHARED_GPU") != "1":
        pytest.skip(f"needs 2 GPUs, or NCCL 2.30+ for two ranks on one GPU (NCCL here: {version})")
    # Two JAX processes on one GPU: neither may take most of its memory.
    return ["0", "0"], {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def _run_two(tmp_path, script_text, *args, timeout=300):
    gpus, extra_env = _two_process_gpus()
    script = tmp_path / "child.py"
    script.write_text(script_text)
    port = str(20000 + os.getpid() % 20000)
    env = dict(os.environ, **extra_env)
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, gpus[i], *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs)]


@pytest.mark.gpu
def test_a_missing_peer_times_out_instead_of_hanging(tmp_path):
    """Two processes; the second never calls the op."""
    (code0, out0), _ = _run_two(tmp_path, _MISSING_PEER_SCRIPT, timeout=120)
    assert code0 == 3, out0
    assert "DEADLINE_EXCEEDED" in out0 or "deadline exceeded" in out0, out0


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["ring", "sequential"])
def test_two_processes_share_a_communicator_through_the_key_value_store(tmp_path, schedule):
    """Two processes, one group spanning both: the NCCL id is made by
    process 0 at lowering, fetched by process 1 from the key-value store,
    and the result is exact (integer-valued f32)."""
    results = _run_two(tmp_path, _TWO_PROCESS_SCRIPT, schedule)
    for i, (code, out) in enumerate(results):
        assert code == 0 and f"OK {i}" in out, "\n\n".join(f"process {j} (exit {c}):\n{o}" for j, (c, o) in
                                                            enumerate(results))


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


# The mesh of the Rust tests (communicators.rs): 2x4 ("dp", "tp") with shuffled ids.
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
        assert _native.timeout_ms() == 30_000
        monkeypatch.delenv("COMMFUSE_TIMEOUT_S")
        assert _native.timeout_ms() == 30_000
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


_IMPORT_SCRIPT = """
import commfuse, commfuse._nccl_id, commfuse._native
from jax._src import xla_bridge
assert not xla_bridge.backends_are_initialized(), "a JAX backend was started at import"
print("clean")
"""


def test_importing_commfuse_starts_no_jax_backend():
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", _IMPORT_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stdout + out.stderr


# ---- Without a GPU: where the CUDA libraries come from --------------------------------

def _fake_nvidia_tree(root, packages):
    for package, files in packages.items():
        lib = root / "nvidia" / package / "lib"
        lib.mkdir(parents=True)
        for f in files:
            (lib / f).write_bytes(b"")
    return [str(root / "nvidia")]


def test_pip_library_dirs_put_jaxs_cuda_major_first(tmp_path):
    from commfuse import _native
    roots = _fake_nvidia_tree(tmp_path, {
        "cu13": ["libcublas.so.13"], "nccl": ["libnccl.so.2"], "cublas": ["libcublas.so.12"],
        "cuda_nvrtc": ["libnvrtc.so.12"], "nvtx": [],
    })
    lib = tmp_path / "nvidia"
    as_13 = _native.pip_library_dirs(13, roots)
    assert as_13 == [str(lib / d / "lib") for d in ("cu13", "nccl", "cublas", "cuda_nvrtc", "nvtx")]
    as_12 = _native.pip_library_dirs(12, roots)
    assert as_12[:2] == [str(lib / "cublas" / "lib"), str(lib / "cuda_nvrtc" / "lib")]
    assert as_12[-1] == str(lib / "cu13" / "lib") and str(lib / "nccl" / "lib") in as_12


_CUDA_LIBRARIES_SCRIPT = """
import json, commfuse
print(json.dumps(commfuse.cuda_libraries()))
"""


def _cuda_installs():
    roots = os.environ.get("COMMFUSE_TEST_CUDA_ROOTS", "")
    return [tuple(entry.split("=", 1)) for entry in roots.split(",") if "=" in entry]


@pytest.mark.skipif(not os.environ.get("COMMFUSE_TEST_CUDA_LIBRARY") or not _cuda_installs(),
                    reason="needs a CUDA build of the library (COMMFUSE_TEST_CUDA_LIBRARY) and pip CUDA installs "
                           "(COMMFUSE_TEST_CUDA_ROOTS=12=DIR,13=DIR); .ci/run provides both")
@pytest.mark.parametrize("major", ["12", "13"])
def test_cuda_libraries_are_found_in_a_pip_install_of_each_major(major):
    """What a user with pip's CUDA packages sees: the package's `nvidia`
    directories on sys.path, found by Python and handed to the library,
    which loads each and reads its version (no GPU: the driver is missing)."""
    import json
    roots = dict(_cuda_installs())
    root = os.path.realpath(roots[major])
    env = dict(os.environ, COMMFUSE_LIBRARY=os.environ["COMMFUSE_TEST_CUDA_LIBRARY"],
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("COMMFUSE_CUDA_LIBRARY_PATH", None)
    out = subprocess.run([sys.executable, "-c", _CUDA_LIBRARIES_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(found) == {"cuda", "cublas", "cublasLt", "nccl", "nvrtc"}
    for key, entry in found.items():
        if key == "cuda":
            continue  # the driver comes with a GPU
        assert entry["error"] is None, (key, entry)
        assert os.path.realpath(entry["path"]).startswith(root + os.sep), (key, entry["path"], root)
        assert entry["version"].split(".")[0] == ("2" if key == "nccl" else major), (key, entry["version"])


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


# fp8 GEMMs on Hopper accumulate in the tensor cores at about 2^-13 relative
# precision, not full float32 (seen here: 1e-3 relative against the float32
# product of the dequantised values).
_FP8_RTOL = 3e-3


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
    want = run_sharded(
        lambda a, b: lax_all_gather_matmul(dq(a, xs), dq(b, ws), "x", precision="highest").astype(out_dtype), mesh,
        specs, xq, wq)
    assert_close(got, want, out_dtype, rtol=max(_FP8_RTOL, tolerance(out_dtype)))


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
    want = run_sharded(lambda a, b: lax_matmul_reduce_scatter(dq(a, xs), dq(b, ws), "x", precision="highest"), mesh,
                       specs, xq, wq)
    assert_close(got, want, np.float32, rtol=_FP8_RTOL)
