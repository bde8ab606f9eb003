"""`commfuse.reshard`: move a sharded array to another mesh and layout.

One program runs over the union of the two meshes' devices (source mesh
first, then the destination's other devices, on a 1-D mesh of its own). Each
device passes its source tile flattened (padding where it holds none) to one
FFI call, `commfuse_reshard_cpu`; the Rust planner (`src/reshard/`) decides
who sends which bytes to whom, and each device returns its destination tile
flattened. The tiles come from JAX's own `devices_indices_map`, so the result
is laid out exactly as `jax.device_put(x, sharding)` lays it out.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _native

# The attribute `method` (src/backend/cpu/reshard.rs: DIRECT, BROADCAST, AUTO).
METHODS = {"direct": 0, "broadcast": 1, "auto": 2}
# Chunk size of a broadcast: small enough that a chain of 8 pipelines well,
# large enough that per-message costs stay small.
CHUNK_BYTES = 256 << 10
_AXIS = "commfuse_reshard"
_sites = itertools.count(1 << 32)
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
    if schedule not in METHODS:
        raise ValueError(f"commfuse.reshard: `schedule` must be one of {sorted(METHODS)}, got {schedule!r}")
    try:
        sharding.shard_shape(x.shape)
    except Exception as e:  # JAX says which dim does not divide
        raise ValueError(f"commfuse.reshard: `sharding` {sharding.spec} does not fit `x` of shape {x.shape}: {e}") from e
    if not x.is_fully_addressable or not sharding.is_fully_addressable:
        raise NotImplementedError("commfuse.reshard: every device of both meshes must be in this process")


def reshard(x: jax.Array, sharding: NamedSharding, *, schedule: str = "auto") -> jax.Array:
    """`x` moved to `sharding` (another mesh and/or layout); equal to
    `jax.device_put(x, sharding)`, with that sharding.

    `schedule`: `"direct"` (each destination device receives each piece it
    needs from one device holding it, the holders balanced), `"broadcast"`
    (a piece needed by several devices travels along pipelined chains rooted
    at the devices holding it, in chunks, so each holder sends it once per
    chain), or `"auto"` (the cost model's pick, on the link model's figures
    when one is set). Runs on CPU devices; on other platforms `"auto"` falls
    back to `jax.device_put` and the explicit schedules raise.
    """
    _check(x, sharding, schedule)
    if x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    src_devices = list(x.sharding.mesh.devices.flat)
    dst_devices = list(sharding.mesh.devices.flat)
    union = src_devices + [d for d in dst_devices if d not in src_devices]
    if any(d.platform != "cpu" for d in union) or x.size == 0:
        if schedule == "auto" or x.size == 0:
            return jax.device_put(x, sharding)
        raise NotImplementedError(
            f"commfuse.reshard(schedule={schedule!r}) runs on CPU devices; the CUDA path is not built yet "
            "(schedule='auto' falls back to jax.device_put)")
    src_map = x.sharding.devices_indices_map(x.shape)
    dst_map = sharding.devices_indices_map(x.shape)

    def flat_tiles(index_map):
        out = []
        for d in union:
            if d in index_map:
                start, end = _tile(index_map[d], x.shape)
                out += start + end
            else:
                out += [-1] * (2 * x.ndim)
        return out

    src, dst = flat_tiles(src_map), flat_tiles(dst_map)
    in_len = max(1, int(np.prod(x.sharding.shard_shape(x.shape))))
    out_shape = sharding.shard_shape(x.shape)
    out_len = max(1, int(np.prod(out_shape)))
    key = (tuple(d.id for d in union), x.shape, x.dtype, tuple(src), tuple(dst), schedule)
    program = _programs.get(key)
    if program is None:
        program = _programs[key] = _program(union, x.shape, x.dtype, src, dst, schedule, in_len, out_len)
    program, umesh = program

    shards = {s.device: s.data for s in x.addressable_shards}
    pieces = []
    for d in union:
        if d in shards:
            piece = shards[d].reshape(1, -1)
            if piece.shape[1] < in_len:
                piece = jax.numpy.pad(piece, ((0, 0), (0, in_len - piece.shape[1])))
        else:
            piece = jax.device_put(np.zeros((1, in_len), x.dtype), d)
        pieces.append(piece)
    operand = jax.make_array_from_single_device_arrays((len(union), in_len), NamedSharding(umesh, P(_AXIS)), pieces)
    moved = program(operand)
    rows = {s.device: s.data for s in moved.addressable_shards}
    out_size = int(np.prod(out_shape))
    tiles = [rows[d][0, :out_size].reshape(out_shape) for d in sharding.addressable_devices_indices_map(x.shape)]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, tiles)


def _program(union, shape, dtype, src, dst, schedule, in_len, out_len):
    """The jitted union program: one FFI call per device."""
    umesh = Mesh(np.array(union), (_AXIS,))
    attrs = dict(
        devices=np.asarray([d.id for d in union], np.int64),
        shape=np.asarray(shape, np.int64),
        itemsize=np.int64(np.dtype(dtype).itemsize),
        src=np.asarray(src, np.int64),
        dst=np.asarray(dst, np.int64),
        method=np.int64(METHODS[schedule]),
        chunk_bytes=np.int64(CHUNK_BYTES),
        site=np.int64(next(_sites)),
    )
    call = jax.ffi.ffi_call(_native.RESHARD_CPU_TARGET, jax.ShapeDtypeStruct((1, out_len), dtype),
                            has_side_effect=True)

    def body(piece):
        return call(piece, **attrs)

    return jax.jit(jax.shard_map(body, mesh=umesh, in_specs=P(_AXIS), out_specs=P(_AXIS), check_vma=False)), umesh
