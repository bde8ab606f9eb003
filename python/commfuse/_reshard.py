"""`commfuse.reshard`: move a sharded array to another mesh and layout.

One program runs over the union of the two meshes' devices (source mesh
first, then the destination's other devices, on a 1-D mesh of its own). Each
device passes its source tile (a stand-in where it holds none) to one FFI
call, `commfuse_reshard_cpu`; the Rust planner (`src/reshard/`) decides who
sends which bytes to whom, and each device returns its destination tile. The tiles come from JAX's own `devices_indices_map`, so the result
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
    if not isinstance(schedule, str) or schedule not in METHODS:
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
    if (isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) or not isinstance(sharding, NamedSharding)
            or not isinstance(schedule, str)):
        _check(x, sharding, schedule)  # says which argument is wrong
    key = (x.sharding, sharding, x.shape, x.dtype, schedule)
    program = _programs.get(key)
    if program is None:
        _check(x, sharding, schedule)
        program = _programs[key] = _plan(x, sharding, schedule)
    if program is _SAME:
        # The same devices holding the same tiles: the shards stay, under the sharding asked for.
        if x.sharding == sharding:
            return x
        shards = {s.device: s.data for s in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [shards[d] for d in sharding.addressable_devices_indices_map(x.shape)])
    if program is _DEVICE_PUT:
        return jax.device_put(x, sharding)
    union = program.union
    # Every shard of a NamedSharding has the tile's shape, so the shards go in
    # and come out as they are (no reshape, no copy); a device holding no
    # source tile passes a cached stand-in.
    shards = {s.device: s.data for s in x.addressable_shards}
    pieces = [shards[d] if d in shards else program.stand_in(d) for d in union]
    operand = jax.make_array_from_single_device_arrays(program.operand_shape, program.operand_sharding, pieces)
    moved = program.fn(operand)
    rows = {s.device: s.data for s in moved.addressable_shards}
    tiles = [rows[d] for d in program.dst_devices]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, tiles)


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
    if any(d.platform != "cpu" for d in union) or x.size == 0 or x.ndim == 0:
        if schedule == "auto" or x.size == 0 or x.ndim == 0:  # nothing to plan for a scalar
            return _DEVICE_PUT
        raise NotImplementedError(
            f"commfuse.reshard(schedule={schedule!r}) runs on CPU devices; the CUDA path is not built yet "
            "(schedule='auto' falls back to jax.device_put)")

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
    in_tile, out_tile = x.sharding.shard_shape(x.shape), sharding.shard_shape(x.shape)
    program = _Program(union, x.shape, x.dtype, src, dst, schedule, in_tile, out_tile)
    program.dst_devices = list(sharding.addressable_devices_indices_map(x.shape))
    return program


class _Program:
    """The jitted union program (one FFI call per device) of one layout pair:
    the tiles stacked along dim 0 over the union's devices."""

    def __init__(self, union, shape, dtype, src, dst, schedule, in_tile, out_tile):
        mesh = Mesh(np.array(union), (_AXIS,))
        self.union = union
        self.operand_shape = (len(union) * in_tile[0], *in_tile[1:])
        self.operand_sharding = NamedSharding(mesh, P(_AXIS))
        self._in_tile, self._dtype, self._stand_ins = in_tile, dtype, {}
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
        call = jax.ffi.ffi_call(_native.RESHARD_CPU_TARGET, jax.ShapeDtypeStruct(out_tile, dtype),
                                has_side_effect=True)
        self.fn = jax.jit(jax.shard_map(lambda tile: call(tile, **attrs), mesh=mesh, in_specs=P(_AXIS),
                                        out_specs=P(_AXIS), check_vma=False))

    def stand_in(self, device):
        if device not in self._stand_ins:
            self._stand_ins[device] = jax.device_put(np.zeros(self._in_tile, self._dtype), device)
        return self._stand_ins[device]
