"""commfuse.reshard against jax.device_put on random meshes and layouts."""

from __future__ import annotations

import gc
import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import commfuse

SCHEDULES = ["direct", "broadcast", "auto"]


def _random_mesh(rng, devices, names):
    """A 1-D or 2-D mesh on a random subset of `devices`."""
    count = int(rng.choice([1, 2, 3, 4, 6, 8]))
    chosen = list(rng.permutation(len(devices))[:count])
    if len(names) == 2 and count in (4, 6, 8) and rng.random() < 0.6:
        shape = (2, count // 2)
    else:
        shape, names = (count,), names[:1]
    return Mesh(np.array([devices[i] for i in chosen]).reshape(shape), names)


def _random_spec(rng, mesh, ndim):
    """Each mesh axis on a random dim (or unused, i.e. replicated)."""
    dims = [[] for _ in range(ndim)]
    for axis in mesh.axis_names:
        choice = int(rng.integers(-1, ndim))
        if choice >= 0:
            dims[choice].append(axis)
    return P(*[tuple(d) if len(d) > 1 else (d[0] if d else None) for d in dims])


def _divisible_shape(rng, ndim, shardings):
    shape = []
    for d in range(ndim):
        factor = 1
        for s in shardings:
            entry = s.spec[d] if d < len(s.spec) else None
            axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            factor = np.lcm(factor, int(np.prod([s.mesh.shape[a] for a in axes])))
        shape.append(int(factor * rng.integers(1, 4)))
    return tuple(shape)


def _same(y, ref, sharding):
    assert y.sharding == sharding
    assert y.shape == ref.shape and y.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    by_device = {s.device: s for s in ref.addressable_shards}
    for s in y.addressable_shards:
        assert s.index == by_device[s.device].index
        np.testing.assert_array_equal(np.asarray(s.data), np.asarray(by_device[s.device].data))


@pytest.mark.parametrize("seed", range(12))
def test_reshard_equals_device_put_on_random_meshes_and_layouts(seed):
    rng = np.random.default_rng(seed)
    devices = jax.devices()
    for case in range(4):
        ndim = int(rng.integers(1, 4))
        src_mesh = _random_mesh(rng, devices, ("a", "b"))
        dst_mesh = _random_mesh(rng, devices, ("c", "d"))
        src = NamedSharding(src_mesh, _random_spec(rng, src_mesh, ndim))
        dst = NamedSharding(dst_mesh, _random_spec(rng, dst_mesh, ndim))
        shape = _divisible_shape(rng, ndim, [src, dst])
        dtype = [np.float32, jax.numpy.bfloat16, np.int32][case % 3]
        data = rng.uniform(-100, 100, shape).astype(dtype)
        x = jax.device_put(data, src)
        ref = jax.device_put(x, dst)
        for schedule in SCHEDULES:
            _same(commfuse.reshard(x, dst, schedule=schedule), ref, dst)


def test_pipeline_shapes_rows_to_columns_and_replicated_from_two_sources():
    devices = jax.devices()
    stage0 = Mesh(np.array(devices[:2]), ("tp",))
    stage1 = Mesh(np.array(devices[2:10]).reshape(2, 4), ("dp", "tp"))
    x = jax.device_put(np.random.default_rng(0).standard_normal((64, 32), np.float32), NamedSharding(stage0, P("tp")))
    for spec in [P(), P(None, "tp"), P("dp", "tp"), P(("dp", "tp"))]:
        dst = NamedSharding(stage1, spec)
        for schedule in SCHEDULES:
            _same(commfuse.reshard(x, dst, schedule=schedule), jax.device_put(x, dst), dst)


def test_overlapping_meshes_and_an_unchanged_sharding():
    devices = jax.devices()
    a = Mesh(np.array(devices[:4]), ("x",))
    b = Mesh(np.array(devices[2:6]), ("y",))
    x = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4), NamedSharding(a, P("x")))
    dst = NamedSharding(b, P(None, "y"))
    _same(commfuse.reshard(x, dst), jax.device_put(x, dst), dst)
    assert commfuse.reshard(x, x.sharding) is x
    # Equivalent (same devices, same tiles) under another mesh: the sharding asked for.
    renamed = NamedSharding(Mesh(np.array(devices[:4]), ("z",)), P("z"))
    _same(commfuse.reshard(x, renamed), jax.device_put(x, renamed), renamed)


def test_bad_arguments_name_the_argument():
    devices = jax.devices()
    a = Mesh(np.array(devices[:2]), ("x",))
    b = Mesh(np.array(devices[2:5]), ("y",))
    x = jax.device_put(np.zeros((4, 4), np.float32) + 1, NamedSharding(a, P("x")))
    with pytest.raises(ValueError, match="`sharding`.*does not fit `x`"):
        commfuse.reshard(x, NamedSharding(b, P("y")))
    with pytest.raises(TypeError, match="`sharding` must be a NamedSharding"):
        commfuse.reshard(x, devices[3])
    with pytest.raises(TypeError, match="`x` must be a jax.Array"):
        commfuse.reshard(np.ones((4, 4)), NamedSharding(b, P()))
    with pytest.raises(ValueError, match="`schedule` must be one of"):
        commfuse.reshard(x, NamedSharding(b, P()), schedule="tree")
    with pytest.raises(ValueError, match="`schedule` must be one of"):
        commfuse.reshard(x, NamedSharding(b, P()), schedule=["direct"])
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda v: commfuse.reshard(v, NamedSharding(b, P())))(x)


def test_repeated_calls_reuse_one_program_and_stay_correct():
    devices = jax.devices()
    a = Mesh(np.array(devices[:2]), ("x",))
    b = Mesh(np.array(devices[2:8]), ("y",))
    dst = NamedSharding(b, P())
    for i, schedule in itertools.product(range(3), SCHEDULES):
        x = jax.device_put(np.full((6, 4), i, np.float32) + np.arange(4, dtype=np.float32), NamedSharding(a, P("x")))
        _same(commfuse.reshard(x, dst, schedule=schedule), jax.device_put(x, dst), dst)


def test_started_transfers_complete_after_other_work_and_in_any_order():
    """The pipeline pattern: start several transfers, compute on both
    meshes, then take the results (not in the order started)."""
    devices = jax.devices()
    stage0 = Mesh(np.array(devices[:4]), ("tp",))
    stage1 = Mesh(np.array(devices[4:12]).reshape(2, 4), ("dp", "tp"))
    rng = np.random.default_rng(3)
    xs = [jax.device_put(rng.standard_normal((32, 16), np.float32), NamedSharding(stage0, P("tp"))) for _ in range(3)]
    dst = NamedSharding(stage1, P("dp"))
    pending = [commfuse.reshard_start(x, dst, schedule=s) for x, s in zip(xs, ["direct", "broadcast", "auto"])]
    busy1 = jax.jit(lambda a: a @ a.T, out_shardings=NamedSharding(stage1, P("dp")))
    busy0 = jax.jit(lambda a: a @ a.T, out_shardings=NamedSharding(stage0, P("tp")))
    jax.block_until_ready([busy1(jax.device_put(np.ones((64, 64), np.float32), dst)), busy0(xs[0])])
    for i in (2, 0, 1):
        moved = pending[i].result()
        _same(moved, jax.device_put(xs[i], dst), dst)
        assert pending[i].result() is moved  # the same array, not a second receive


def test_a_dropped_handle_frees_what_its_senders_posted():
    devices = jax.devices()
    a = Mesh(np.array(devices[:2]), ("x",))
    b = Mesh(np.array(devices[2:6]), ("y",))
    x = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4), NamedSharding(a, P("x")))
    dst = NamedSharding(b, P())
    # Calling the finalizer frees the posted pieces now: one session dropped.
    pending = commfuse.reshard_start(x, dst)
    assert pending._abandon() == 1
    # Dropping the handle runs it: afterwards there is nothing left to drop.
    pending = commfuse.reshard_start(x, dst)
    finalizer = pending._abandon
    _, _, (sent, site, call_id), _ = finalizer.peek()
    del pending, sent
    gc.collect()
    assert not finalizer.alive
    assert commfuse._native.lib.commfuse_reshard_abandon(site, int(call_id)) == 0
    # A received transfer has nothing left to free.
    pending = commfuse.reshard_start(x, dst)
    _same(pending.result(), jax.device_put(x, dst), dst)
    assert not pending._abandon.alive


def test_the_trace_shows_each_devices_sends_and_receives(tmp_path):
    from test_trace import lanes_by_device

    devices = jax.devices()
    a = Mesh(np.array(devices[:2]), ("x",))
    b = Mesh(np.array(devices[2:6]), ("y",))
    x = jax.device_put(np.arange(256.0, dtype=np.float32).reshape(16, 16), NamedSharding(a, P("x")))
    dst = NamedSharding(b, P())
    with commfuse.trace(tmp_path / "reshard.pftrace") as path:
        jax.block_until_ready(commfuse.reshard(x, dst, schedule="direct"))
    lanes, _ = lanes_by_device(path)
    for device in devices[:2]:  # each source sends its 8 rows to each of the 4 destinations
        slices = lanes[device.id]["comm"]
        assert [s.name for s in slices if s.depth == 0] == ["reshard send"]
        sends = [s for s in slices if s.name == "send"]
        assert sorted(s.args["peer_device"] for s in sends) == [d.id for d in devices[2:6]]
        assert all(s.args["bytes"] == 8 * 16 * 4 for s in sends)
    for device in devices[2:6]:  # each destination receives both halves
        slices = lanes[device.id]["comm"]
        assert [s.name for s in slices if s.depth == 0] == ["reshard receive"]
        recvs = [s for s in slices if s.name == "recv"]
        assert sorted(s.args["peer_device"] for s in recvs) == [devices[0].id, devices[1].id]
        assert sum(s.args["bytes"] for s in recvs) == x.nbytes


def test_meshes_with_explicit_axes():
    """`jax.make_mesh`'s default axis types (Explicit in JAX >= 0.7)."""
    devices = jax.devices()
    a = jax.make_mesh((4,), ("x",), devices=devices[:4])
    b = jax.make_mesh((2, 4), ("dp", "tp"), devices=devices[4:12])
    x = jax.device_put(np.random.default_rng(5).standard_normal((64, 8), np.float32), NamedSharding(a, P("x")))
    for spec in [P("dp"), P(None, "tp"), P(("dp", "tp"))]:
        dst = NamedSharding(b, spec)
        _same(commfuse.reshard(x, dst), jax.device_put(x, dst), dst)


def test_gpu_receives_run_in_the_order_of_their_sends_whichever_result_is_asked_first():
    # The GPU path's ordering (`_Pairing`), with programs that record the
    # receives they run: NCCL pairs transfers in the order they were posted,
    # so a later result first receives the earlier ones; a dropped handle
    # is received (drained) too; a failed receive fails its own handle and,
    # as its sends may still be posted, every reshard sent after it.
    from commfuse import _reshard
    received = []

    class Program:
        _union = (-1, -2)  # no such communicator: the abort finds none

        def _receive(self, call_id):
            received.append(int(call_id))
            if call_id == 3:
                raise RuntimeError("receive 3 failed")
            return jax.numpy.full((2,), int(call_id))

        def _received(self, moved):
            return moved

    pairing = _reshard._Pairing()

    def start(ids):
        transfers = [_reshard._Transfer(Program(), jax.numpy.zeros(1), i) for i in ids]
        pairing.pending.extend(transfers)
        return [_reshard.PendingReshard(lambda t=t: pairing.take(t), (pairing.drop, t)) for t in transfers]

    handles = start(range(5))
    assert int(handles[2].result()[0]) == 2
    assert received == [0, 1, 2]
    assert int(handles[0].result()[0]) == 0 and int(handles[2].result()[1]) == 2
    assert received == [0, 1, 2]
    handles[1] = None  # received already: dropping it receives nothing more
    gc.collect()
    assert received == [0, 1, 2]
    with pytest.raises(RuntimeError, match="not received: an earlier reshard between these meshes failed"):
        handles[4].result()
    assert received == [0, 1, 2, 3] and not pairing.pending
    for _ in range(2):
        with pytest.raises(RuntimeError, match="receive 3 failed"):
            handles[3].result()

    # A handle dropped while the lock is held (a collection inside `take`
    # on this thread) neither waits for the lock nor receives out of order:
    # the holder drains it once it lets go.
    handles = start((5, 6))
    with pairing.lock:
        handles[1] = None
        gc.collect()
        assert received == [0, 1, 2, 3]
    pairing._drain()  # what `take` does after releasing the lock
    assert received == [0, 1, 2, 3, 5, 6]
    assert int(handles[0].result()[0]) == 5


def _gpu_meshes(count):
    gpus = jax.devices("gpu")
    if len(gpus) < 2 * count:
        pytest.skip(f"needs {2 * count} GPUs: two meshes of {count} that share no device (found {len(gpus)})")
    return Mesh(np.array(gpus[:count]), ("a",)), Mesh(np.array(gpus[count:2 * count]), ("b",))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["direct", "broadcast", "auto"])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_reshard_between_gpu_meshes_equals_device_put(schedule, count):
    source, destination = _gpu_meshes(count)
    rng = np.random.default_rng(count)
    for dtype in (np.float32, jax.numpy.bfloat16, np.int32):
        host = rng.standard_normal((16 * count, 24)).astype(dtype)
        x = jax.device_put(host, NamedSharding(source, P("a", None)))
        for spec in (P(None, "b"), P(), P("b", None)):
            to = NamedSharding(destination, spec)
            got = commfuse.reshard(x, to, schedule=schedule)
            assert got.sharding == to
            np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.device_put(x, to)))


@pytest.mark.gpu
def test_gpu_reshards_taken_out_of_order_and_overlapping_meshes():
    source, destination = _gpu_meshes(1)
    xs = [jax.device_put(np.full((8, 4), i, np.float32), NamedSharding(source, P())) for i in range(3)]
    pending = [commfuse.reshard_start(x, NamedSharding(destination, P())) for x in xs]
    for i in (2, 0, 1):
        np.testing.assert_array_equal(np.asarray(pending[i].result()), np.full((8, 4), i, np.float32))
    gpus = jax.devices("gpu")
    a, b = Mesh(np.array(gpus[:2]), ("a",)), Mesh(np.array(gpus[1::-1]), ("a",))
    x = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4), NamedSharding(a, P("a")))
    np.testing.assert_array_equal(np.asarray(commfuse.reshard(x, NamedSharding(b, P("a")))), np.asarray(x))
    with pytest.raises(NotImplementedError, match="must not share devices"):
        commfuse.reshard(x, NamedSharding(b, P("a")), schedule="direct")


def test_no_gpu_reshard_communicator_exists_where_none_was_connected():
    # The C ABI Python asks before a GPU reshard (`_CudaProgram.start`);
    # here, with no GPU, no communicator was made for any union.
    from commfuse import _native
    assert _native.reshard_cuda_connected([0, 1]) is False
    assert _native.reshard_cuda_connected([]) is False
