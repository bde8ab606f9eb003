"""NCCL unique ids for groups that span processes, exchanged at lowering time.

A fused op on CUDA creates one NCCL communicator per group of devices (the
devices along the op's mesh axes, in rank order). When all of a group's
devices live in this process, the library makes the unique id itself and
nothing here is needed: :func:`lowering_attributes` returns ``{}`` and the
lowering is exactly the single-process one.

When a group spans processes, every member must call ``ncclCommInitRank*``
with the same id. At lowering time, for each such group with a member here:

1. the process holding the group's rank 0 asks the library for an id
   (``ncclGetUniqueId``, :func:`commfuse._native.nccl_unique_id`) and
   publishes it, hex-encoded, in the JAX distributed key-value store under
   :func:`store_key` (the same key the Rust side names,
   ``comms::CommKey::store_key``);
2. the other processes do a blocking get of that key, bounded by the
   configured timeout (``commfuse.configure(timeout_s=...)`` or
   ``COMMFUSE_TIMEOUT_S``);
3. the ids go to the FFI call as attributes (:func:`lowering_attributes`):
   ``local_ordinals`` (per mesh device, its CUDA ordinal in this process or
   -1), ``nccl_groups`` (the spanning groups' device ids, concatenated) and
   ``nccl_ids`` (16 little-endian int64 words per group).

Each process publishes every id it owns before waiting for any other, so
two processes owning each other's rank 0 cannot wait on each other. Ids are
cached per process and key: a group's id is made and published once, however
many ops or programs use the group. Nothing here runs at import (asking JAX
for its process index or devices would start its backends before a user's
``jax.distributed.initialize``).
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Sequence

import numpy as np

ID_BYTES = 128
ID_WORDS = ID_BYTES // 8
KEY_PREFIX = "commfuse/nccl_id/"

_lock = threading.Lock()
_cache: dict[str, bytes] = {}


def store_key(devices: Iterable[int]) -> str:
    """The key-value store key of the group with these global device ids, in rank order."""
    return KEY_PREFIX + "_".join(str(int(d)) for d in devices)


def mesh_groups(device_ids, axes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every group of the mesh along `axes` (mesh axis indices, in the op's
    order), each as its device ids in rank order: the op's axes walked
    row-major with the other coordinates fixed (as the Rust
    ``comm::Group::from_mesh`` does)."""
    ids = np.asarray(device_ids)
    axes = [int(a) for a in axes]
    if not axes or len(set(axes)) != len(axes) or not all(0 <= a < ids.ndim for a in axes):
        raise ValueError(f"axes {axes} must name distinct axes of a mesh of rank {ids.ndim}")
    size = int(np.prod([ids.shape[a] for a in axes]))
    moved = np.moveaxis(ids, axes, list(range(ids.ndim - len(axes), ids.ndim)))
    return [tuple(int(d) for d in row) for row in moved.reshape(-1, size)]


def id_words(nccl_id: bytes) -> np.ndarray:
    """The 128-byte id as the 16 little-endian int64 words of its attribute."""
    if len(nccl_id) != ID_BYTES:
        raise ValueError(f"an NCCL unique id is {ID_BYTES} bytes, got {len(nccl_id)}")
    return np.frombuffer(nccl_id, dtype="<i8").astype(np.int64)


def exchange(groups: Sequence[Sequence[int]], process_of: dict, me: int, client, timeout_ms: int,
             make_id: Callable[[], bytes], cache: dict | None = None) -> list[bytes]:
    """The unique id of each group, exchanged through `client` (a
    ``jax.distributed`` key-value client: ``key_value_set(key, str)`` and
    ``blocking_key_value_get(key, timeout_in_ms) -> str``).

    `process_of` maps each device id to its process index, `me` is this
    process's. The owner of a group's rank 0 makes the id (`make_id`) and
    publishes it; the others wait for it, at most `timeout_ms`. Ids already
    in `cache` (keyed by :func:`store_key`) are reused and not exchanged again.
    """
    cache = _cache if cache is None else cache
    keys = [store_key(g) for g in groups]
    # Publish every id this process owns first, then wait for the others.
    for group, key in zip(groups, keys):
        if key in cache or process_of[int(group[0])] != me:
            continue
        nccl_id = bytes(make_id())
        id_words(nccl_id)  # checks the length
        try:
            client.key_value_set(key, nccl_id.hex())
        except Exception as e:
            raise RuntimeError(
                f"commfuse: publishing the NCCL unique id of the device group {list(group)} under {key!r} in "
                f"the JAX distributed key-value store failed: {e}") from e
        cache[key] = nccl_id
    for group, key in zip(groups, keys):
        if key in cache:
            continue
        owner = process_of[int(group[0])]
        try:
            value = client.blocking_key_value_get(key, int(timeout_ms))
        except Exception as e:
            raise TimeoutError(
                f"commfuse: waited {timeout_ms} ms for process {owner} (rank 0 of the device group "
                f"{list(group)}) to publish its NCCL unique id under {key!r} in the JAX distributed "
                f"key-value store; did every process lower the same program? ({e})") from e
        try:
            nccl_id = bytes.fromhex(value.decode() if isinstance(value, bytes) else value)
            id_words(nccl_id)
        except ValueError as e:
            raise RuntimeError(f"commfuse: the value under {key!r} is not an NCCL unique id: {e}") from e
        cache[key] = nccl_id
    return [cache[k] for k in keys]


def _default_client():
    from . import _compat

    client = _compat.distributed_client()
    if client is None:
        raise NotImplementedError(
            "commfuse: this mesh spans processes, but jax.distributed is not initialised: the NCCL unique ids "
            "are exchanged through its key-value store (call jax.distributed.initialize first)")
    return client


def lowering_attributes(mesh, axes: Sequence[str], *, process_index: int | None = None, client=None,
                        make_id: Callable[[], bytes] | None = None, timeout_ms: int | None = None) -> dict:
    """Extra attributes of the CUDA FFI call for an op over `axes` of `mesh`.

    ``{}`` when every device of the mesh is in this process (the single
    process case: unchanged lowering). Otherwise ``local_ordinals``, and
    ``nccl_groups`` and ``nccl_ids`` (see the module docstring) when some
    group along `axes` spans processes and has a member here, after
    exchanging their ids. The keyword arguments replace JAX's process index, distributed
    client, the library's id maker and the configured timeout (for tests).
    """
    if process_index is None:
        import jax

        process_index = jax.process_index()
    devices = np.asarray(mesh.devices).reshape(-1)
    if all(d.process_index == process_index for d in devices):
        return {}
    process_of = {int(d.id): int(d.process_index) for d in devices}
    if any(d.process_index == process_index and d.local_hardware_id is None for d in devices):
        raise NotImplementedError("commfuse: this process's devices have no local hardware id (not CUDA devices?)")
    local = np.asarray([d.local_hardware_id if d.process_index == process_index else -1 for d in devices],
                       np.int64)
    axis_index = [list(mesh.axis_names).index(a) for a in axes]
    spanning = [g for g in mesh_groups(np.asarray(mesh.device_ids), axis_index)
                if any(process_of[d] == process_index for d in g)
                and any(process_of[d] != process_index for d in g)]
    attributes = {"local_ordinals": local}
    if spanning:
        if make_id is None:
            from . import _native

            make_id = _native.nccl_unique_id
        if timeout_ms is None:
            from . import _native

            timeout_ms = _native.timeout_ms()
        with _lock:
            ids = exchange(spanning, process_of, process_index, client if client is not None else _default_client(),
                           timeout_ms, make_id)
        attributes["nccl_groups"] = np.asarray([d for g in spanning for d in g], np.int64)
        attributes["nccl_ids"] = np.concatenate([id_words(i) for i in ids])
    return attributes
