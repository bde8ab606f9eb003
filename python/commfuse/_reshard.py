"""`commfuse.reshard`: move a sharded array to another mesh and layout.

A reshard is two jitted programs, so that compute can run between them: a
*send* program on the source mesh, in which each device posts the pieces of
its shard that others need (FFI target `commfuse_reshard_send_cpu`; it waits
for no one), and a *receive* program on the destination mesh, in which each
device takes its pieces (forwarding a broadcast's chunks as they come) and
returns its shard of the result (`commfuse_reshard_receive_cpu`). The Rust
planner (`src/reshard/`) decides who sends which bytes to whom; the two
programs meet through a call id passed to both. `reshard_start` runs the
send program and returns a handle whose `result()` runs the receive
program: a pipeline issues the send as soon as the array is computed and
asks for the result when the next stage needs it, and the transfer travels
while the stages compute. The tiles come from JAX's own
`devices_indices_map`, so the result is laid out exactly as
`jax.device_put(x, sharding)` lays it out.

On GPUs (one process, meshes without a common device) the programs are
`commfuse_reshard_send_cuda` and `commfuse_reshard_receive_cuda` over NCCL,
after a one-time *connect* program over the union of the meshes' devices
(`src/backend/cuda/reshard.rs`). The send program returns `staging`, the
packed pieces its sends read after the program has finished; it is kept
until the receive's result is ready. NCCL pairs transfers in the order they
are posted, so the receives of one pair of meshes run in the order of their
sends: `result()` of a later reshard first receives the earlier ones.
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _native

# The attribute `method` (src/reshard/attrs.rs: DIRECT, BROADCAST, AUTO).
METHODS = {"direct": 0, "broadcast": 1, "auto": 2}
# Chunk size of a broadcast: small enough that a chain of 8 pipelines well,
# large enough that per-message costs stay small.
CHUNK_BYTES = 256 << 10
_AXIS = "commfuse_reshard"
_sites = itertools.count(1 << 32)
_call_ids = itertools.count()
# Compiled program pairs by layout pair (the oldest dropped beyond this many).
_MAX_PROGRAMS = 256
_programs: dict = {}


def _tile(index, shape):
    """(start, end) per dim of a shard's index (a tuple of slices)."""
    start, end = [], []
    for s, n in zip(index, shape):
        lo, hi, step = s.indices(n)
        if step != 1:
            raise ValueError(f"commfuse.reshard: strided shards are not supported ({index})")
        start.append(lo)
        end.append(hi)
    return start, end


def _check(x, sharding, schedule):
    if isinstance(x, jax.core.Tracer):
        raise TypeError("commfuse.reshard: `x` must be a concrete jax.Array (call reshard outside jit); "
                        "inside a jitted function use jax.lax.with_sharding_constraint")
    if not isinstance(x, jax.Array):
        raise TypeError(f"commfuse.reshard: `x` must be a jax.Array, got {type(x).__name__}")
    if not isinstance(x.sharding, NamedSharding):
        raise TypeError(f"commfuse.reshard: `x` must be sharded with a NamedSharding, got {type(x.sharding).__name__}")
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"commfuse.reshard: `sharding` must be a NamedSharding, got {type(sharding).__name__}")
    if not isinstance(schedule, str) or schedule not in METHODS:
        raise ValueError(f"commfuse.reshard: `schedule` must be one of {sorted(METHODS)}, got {schedule!r}")
    try:
        sharding.shard_shape(x.shape)
    except Exception as e:  # JAX says which dim does not divide
        raise ValueError(f"commfuse.reshard: `sharding` {sharding.spec} does not fit `x` of shape {x.shape}: {e}") from e


class PendingReshard:
    """A reshard under way (`reshard_start`): the source devices have posted
    their pieces; `result()` receives them on the destination devices."""

    def __init__(self, receive, abandon=None):
        self._receive, self._value, self._error = receive, None, None
        self._lock = threading.Lock()  # one receive, whichever thread asks first
        # Unreceived pieces stay with the transport until the receive runs:
        # a handle dropped without `result()` frees them (`_abandon`).
        self._abandon = weakref.finalize(self, *abandon) if abandon else None
        if self._abandon is not None:
            self._abandon.atexit = False  # at exit there is nothing left to free

    def result(self) -> jax.Array:
        """The moved array (dispatched on the first call, asynchronously like
        any JAX computation; the same array on later calls)."""
        with self._lock:
            if self._receive is not None:
                receive, self._receive = self._receive, None
                try:
                    self._value = receive()
                except BaseException as e:  # every later call raises it too
                    self._error = e
                else:
                    if self._abandon is not None:
                        self._abandon.detach()
            if self._error is not None:
                raise self._error
            return self._value


def reshard_start(x: jax.Array, sharding: NamedSharding, *, schedule: str = "auto") -> PendingReshard:
    """Starts moving `x` to `sharding`: the devices holding `x` post their
    pieces now; `.result()` on the returned handle receives them (see
    `reshard`). Between the two, the devices of both meshes are free to
    compute: a pipeline calls this as soon as a stage's output is issued
    and asks for the result when the next stage needs it. A handle dropped
    without `result()` frees what its senders posted (waiting, where it is
    dropped, for the send program to have run).
    """
    if (isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) or not isinstance(sharding, NamedSharding)
            or not isinstance(schedule, str)):
        _check(x, sharding, schedule)  # says which argument is wrong
    key = (x.sharding, sharding, x.shape, x.dtype, schedule)
    program = _programs.get(key)
    if program is None:
        _check(x, sharding, schedule)
        program = _plan(x, sharding, schedule)
        if len(_programs) >= _MAX_PROGRAMS:
            _programs.pop(next(iter(_programs)))  # the oldest
        _programs[key] = program
    if program is _SAME:
        # The same devices holding the same tiles: the shards stay, under the sharding asked for.
        if x.sharding == sharding:
            return PendingReshard(lambda: x)
        shards = {s.device: s.data for s in x.addressable_shards}
        return PendingReshard(lambda: jax.make_array_from_single_device_arrays(
            x.shape, sharding, [shards[d] for d in sharding.addressable_devices_indices_map(x.shape)]))
    if program is _DEVICE_PUT:
        moved = jax.device_put(x, sharding)
        return PendingReshard(lambda: moved)
    return program.start(x)


def reshard(x: jax.Array, sharding: NamedSharding, *, schedule: str = "auto") -> jax.Array:
    """`x` moved to `sharding` (another mesh and/or layout); equal to
    `jax.device_put(x, sharding)`, with that sharding.

    `schedule`: `"direct"` (each destination device receives each piece it
    needs from one device holding it, the holders balanced), `"broadcast"`
    (a piece needed by several devices travels along pipelined chains rooted
    at the devices holding it, in chunks, so each holder sends it once per
    chain), or `"auto"` (the cost model's pick, on the link model's figures
    when one is set). Runs on CPU devices, and on GPUs of one process between
    meshes without a common device (copy engines, direct only, or NCCL with
    ``commfuse.configure(transport="nccl")``); elsewhere `"auto"` falls back to
    `jax.device_put` and the explicit schedules raise, saying why. To
    overlap the transfer with compute, use `reshard_start`.
    """
    return reshard_start(x, sharding, schedule=schedule).result()


# Layout pairs that need no program (see `_plan`): nothing to move, or
# handed to jax.device_put.
_SAME, _DEVICE_PUT = object(), object()


def _plan(x, sharding, schedule):
    """The program moving arrays like `x` to `sharding` (once per layout
    pair), or `_SAME` or `_DEVICE_PUT`."""
    if x.sharding.is_equivalent_to(sharding, x.ndim):
        return _SAME
    if x.sharding.memory_kind != sharding.memory_kind:
        return _DEVICE_PUT  # a move between memory kinds is XLA's
    src_devices = list(x.sharding.mesh.devices.flat)
    dst_devices = list(sharding.mesh.devices.flat)
    union = src_devices + [d for d in dst_devices if d not in src_devices]
    if x.size == 0 or x.ndim == 0:  # nothing to plan
        return _DEVICE_PUT
    platforms = {d.platform for d in union}
    program = _CpuProgram if platforms == {"cpu"} else _CudaProgram
    if program is _CpuProgram and any(d.process_index != jax.process_index() for d in union):
        # The CPU backend's transport lives inside one process: XLA's own
        # transfers (gloo or MPI) carry a move that spans processes.
        if schedule == "auto":
            return _DEVICE_PUT
        raise NotImplementedError(
            f"commfuse.reshard(schedule={schedule!r}): the meshes span processes, and the CPU backend's transport "
            f"lives inside one process (schedule='auto' falls back to jax.device_put)")
    why = _why_not_cuda(src_devices, dst_devices, platforms) if program is _CudaProgram else None
    if why is not None:
        if schedule == "auto":
            return _DEVICE_PUT
        raise NotImplementedError(
            f"commfuse.reshard(schedule={schedule!r}): {why} (schedule='auto' falls back to jax.device_put)")

    def flat_tiles(index_map):
        out = []
        for d in union:
            if d in index_map:
                start, end = _tile(index_map[d], x.shape)
                out += start + end
            else:
                out += [-1] * (2 * x.ndim)
        return out

    src = flat_tiles(x.sharding.devices_indices_map(x.shape))
    dst = flat_tiles(sharding.devices_indices_map(x.shape))
    return program(x, sharding, schedule, union, src, dst)


def _why_not_cuda(src_devices, dst_devices, platforms):
    """Why the GPU programs cannot move between these meshes, or None."""
    if platforms != {"gpu"}:
        return f"runs on CPU devices or on GPUs, not between {sorted(platforms)} devices"
    if jax.process_count() > 1:
        return "on GPUs it runs in one process (this job has several)"
    shared = [d.id for d in dst_devices if d in src_devices]
    if shared:
        return f"on GPUs the two meshes must not share devices (they share {shared})"
    try:
        _native.cuda_target()  # registers the reshard's CUDA handlers too
    except NotImplementedError as e:
        return f"the CUDA backend is not available: {e}"
    return None


class _Program:
    """What the send and receive programs of one layout pair share: their
    attributes and the relabelling of the result."""

    def __init__(self, x, sharding, schedule, union, src, dst):
        self.site = next(_sites)
        self._sharding = sharding
        self.attrs = dict(
            devices=np.asarray([d.id for d in union], np.int64),
            shape=np.asarray(x.shape, np.int64),
            itemsize=np.int64(x.dtype.itemsize),
            src=np.asarray(src, np.int64),
            dst=np.asarray(dst, np.int64),
            method=np.int64(METHODS[schedule]),
            chunk_bytes=np.int64(CHUNK_BYTES),
            site=np.int64(self.site),
        )

    def _jit(self, x, send, send_out_specs, receive):
        """The send program (each device passes its shard of `x` as it is and
        returns `send`'s result) and the receive program (each returns its
        shard of the result), both taking the call id."""
        attrs = self.attrs
        self._send = jax.jit(jax.shard_map(
            lambda tile, call_id: send(tile, call_id, **attrs), mesh=x.sharding.mesh,
            in_specs=(x.sharding.spec, P()), out_specs=send_out_specs, check_vma=False))
        self._receive = jax.jit(jax.shard_map(
            lambda call_id: receive(call_id, **attrs), mesh=self._sharding.mesh, in_specs=P(),
            out_specs=self._sharding.spec, check_vma=False))

    def _received(self, moved):
        if moved.sharding != self._sharding:  # the same layout, named as asked
            moved = jax.make_array_from_single_device_arrays(
                moved.shape, self._sharding, [s.data for s in moved.addressable_shards])
        return moved


class _CpuProgram(_Program):
    """The CPU programs (each one FFI call per device of its mesh), and the
    call ids that pair their runs."""

    def __init__(self, x, sharding, schedule, union, src, dst):
        super().__init__(x, sharding, schedule, union, src, dst)
        # The send program's result is a byte per device.
        send = jax.ffi.ffi_call(_native.RESHARD_SEND_CPU_TARGET, jax.ShapeDtypeStruct((1,), np.uint8),
                                has_side_effect=True)
        receive = jax.ffi.ffi_call(_native.RESHARD_RECEIVE_CPU_TARGET,
                                   jax.ShapeDtypeStruct(sharding.shard_shape(x.shape), x.dtype), has_side_effect=True)
        self._jit(x, send, P(tuple(x.sharding.mesh.axis_names)), receive)

    def start(self, x):
        call_id = np.uint32(next(_call_ids) & 0xFFFF_FFFF)
        sent = self._send(x, call_id)
        return PendingReshard(lambda: self._received(self._receive(call_id)), (_abandon, sent, self.site, call_id))


class _CudaProgram(_Program):
    """The GPU programs of one layout pair (see the module docstring)."""

    def __init__(self, x, sharding, schedule, union, src, dst):
        super().__init__(x, sharding, schedule, union, src, dst)
        attrs = self.attrs
        self._union = tuple(d.id for d in union)
        union_mesh = Mesh(np.array(union), (_AXIS,))
        connect = jax.ffi.ffi_call(_native.RESHARD_CONNECT_CUDA_TARGET, jax.ShapeDtypeStruct((1,), np.uint8),
                                   has_side_effect=True)
        self._connect = jax.jit(jax.shard_map(
            lambda token: connect(token, **attrs), mesh=union_mesh, in_specs=P(_AXIS), out_specs=P(_AXIS),
            check_vma=False))
        self._union_sharding = NamedSharding(union_mesh, P(_AXIS))
        tile = jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype)
        out_tile = jax.ShapeDtypeStruct(sharding.shard_shape(x.shape), x.dtype)
        # The send program returns `staging` (shaped like its tile); the
        # receive program's `staging` is a temporary of its program.
        send = jax.ffi.ffi_call(_native.RESHARD_SEND_CUDA_TARGET, tile, has_side_effect=True)
        receive = jax.ffi.ffi_call(_native.RESHARD_RECEIVE_CUDA_TARGET, (out_tile, out_tile), has_side_effect=True)
        self._jit(x, send, x.sharding.spec, lambda call_id, **attrs: receive(call_id, **attrs)[0])

    def start(self, x):
        pairing = _pairing(self._union)
        with pairing.lock:
            # Once per pair of meshes, and again after a failure evicted the communicator.
            if not _native.reshard_cuda_connected(self._union):
                pairing.fail_pending("its communicator was lost (an earlier reshard between these meshes failed)")
                token = jax.device_put(np.zeros(len(self._union), np.uint8), self._union_sharding)
                jax.block_until_ready(self._connect(token))
            call_id = np.uint32(next(_call_ids) & 0xFFFF_FFFF)
            transfer = _Transfer(self, self._send(x, call_id), call_id)
            pairing.pending.append(transfer)
        pairing._drain()  # handles dropped while this held the lock
        return PendingReshard(lambda: pairing.take(transfer), (pairing.drop, transfer))


class _Transfer:
    """One reshard started on GPUs: its program, the send's `staging`, the
    call id, and its result once received."""

    __slots__ = ("program", "staging", "call_id", "value")

    def __init__(self, program, staging, call_id):
        self.program, self.staging, self.call_id, self.value = program, staging, call_id, None


class _Pairing:
    """The started reshards between one union of GPU meshes (one NCCL
    communicator), received in the order they were sent."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending = collections.deque()
        # Transfers of dropped handles, received by whoever next holds the lock.
        self.abandoned = collections.deque()

    def take(self, transfer):
        """`transfer`'s result, after receiving every reshard sent before it."""
        with self.lock:
            value = self._receive_through(transfer)
        self._drain()
        if isinstance(value, Exception):
            raise value
        return value

    def drop(self, transfer):
        """Receives (and discards) a reshard whose handle was dropped, so its
        sends do not wait for receivers that never come. A finalizer: it may
        run inside `take` on the same thread (a collection while receiving),
        so it never waits for the lock; the holder drains after releasing it."""
        self.abandoned.append(transfer)
        self._drain()

    def _drain(self):
        while self.abandoned and self.lock.acquire(blocking=False):
            try:
                while self.abandoned:
                    self._receive_through(self.abandoned.popleft())
            finally:
                self.lock.release()

    def _receive_through(self, transfer):
        """Receives, in order, every pending reshard up to `transfer` and
        returns its result (or the exception its receive raised). Holds the lock."""
        while transfer in self.pending:
            first = self.pending.popleft()
            try:
                first.value = first.program._received(first.program._receive(first.call_id))
            except BaseException as e:  # raised by the handle it belongs to
                first.value = e
                # Its sends may still be posted: they must never pair with a
                # later receive. Abort the communicator; the next reshard
                # connects a new one.
                _native.reshard_cuda_abort(first.program._union)
                _keep_staging(first.staging)
                self.fail_pending(f"an earlier reshard between these meshes failed ({type(e).__name__}: {e})")
                if not isinstance(e, Exception):
                    raise
            else:
                _keep_until_ready(first.staging, first.value)
            first.staging = None
        value, transfer.value = transfer.value, None
        return value

    def fail_pending(self, why):
        """Fails every pending reshard (their sends went to a communicator
        that is gone); their staging is kept a while, as sends may read it
        until the abort ends them. Holds the lock."""
        while self.pending:
            t = self.pending.popleft()
            t.value = RuntimeError(f"commfuse.reshard: not received: {why}")
            _keep_staging(t.staging)
            t.staging = None


_pairings: dict = {}
_pairings_lock = threading.Lock()


def _pairing(union):
    with _pairings_lock:
        return _pairings.setdefault(union, _Pairing())


# Send programs' `staging` with their receive's result: each kept until that
# result is ready (its receives are done, so the sends have read it).
_in_flight = collections.deque()
_MAX_IN_FLIGHT = 64
# The staging of reshards that were never received (their communicator was
# aborted): kept for the last this many, long after the abort ended their sends.
_orphans = collections.deque(maxlen=64)
_staging_lock = threading.Lock()


def _keep_until_ready(staging, received):
    with _staging_lock:
        while _in_flight and _in_flight[0][1].is_ready():
            _in_flight.popleft()
        oldest = _in_flight.popleft() if len(_in_flight) >= _MAX_IN_FLIGHT else None
        _in_flight.append((staging, received))
    if oldest is not None:
        jax.block_until_ready(oldest[1])


def _keep_staging(staging):
    with _staging_lock:
        _orphans.append(staging)


def _abandon(sent, site, call_id):
    """Frees what the send of call `call_id` posted, once it has run."""
    try:
        jax.block_until_ready(sent)
    except Exception:  # the send failed: nothing to keep for receivers that will not come either
        pass
    return _native.lib.commfuse_reshard_abandon(site, int(call_id))
