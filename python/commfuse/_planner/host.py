"""This host's CPU devices as XLA's runtime runs a step on them, measured
for the cost model (``cpu_here``'s ``mem_gbytes_per_s`` and
``touch_gbytes_per_s`` keys, see ``src/sim/mod.rs``).

``cpu_here`` assumes 10 GB/s of memory per unshared device and nothing
for memory mapped afresh; both rank layouts wrongly here (docs/planning.md,
"This host's memory"):

- XLA's own memory work streams several times faster than assumed, so the
  model overpriced a step's memory work, and the small products whose
  time it bounds, against its transfers.
- XLA's CPU runtime allocates an execution's temporaries anew each time,
  and the host's allocator (glibc) maps an allocation of
  `MAPPED_FROM_BYTES` or more afresh each time and unmaps it when freed:
  such a step pays to map its temporaries in again in every step (a step
  saving everything for the backward pass, over 32 MiB of temporaries,
  ran 1.4x slower than with the allocator told to keep its memory).

Both rates are measured once per machine and device count
(`_calibration`), with every device working at once, as in a step, and
given as one unshared device's (the model divides them among the devices
sharing the cores).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from .. import _abi, _calibration
from .._decide import MEMORY_KEYS, Machine

# glibc's largest mmap threshold on a 64-bit host (DEFAULT_MMAP_THRESHOLD_MAX,
# 4 MiB x sizeof(long)): its dynamic threshold never rises past it, so an
# allocation this large is always mapped anew, one below it soon reused.
MAPPED_FROM_BYTES = 32 << 20
# What each device works on while measuring: a stream the size of a step's
# typical memory work (warm in the cache across repetitions, as a step's
# working set mostly is; the call's dispatch, a few percent at this size,
# included), and an output the allocator maps anew each time.
STREAM_SAMPLE_BYTES = 4 << 20
TOUCH_SAMPLE_BYTES = MAPPED_FROM_BYTES + (16 << 20)
# The fastest of this many repetitions per round (`_calibration.robust`
# takes the median of rounds).
REPEATS = 5
# A fresh output less than this much slower than the same op in place is
# no measurable first write (huge pages, an allocator told to keep its
# memory): the rate is then 0, which the model reads as nothing to pay.
MEASURABLE = 0.05
KEYS = MEMORY_KEYS


def with_measured_memory(spec: str, devices: int) -> str:
    """`spec` (a ``cpu_here`` description) with this host's measured rates
    for `devices` devices, for each of `KEYS` it does not set itself. A
    rate that cannot be measured here (fewer CPU devices than `devices`)
    is left out: the model's assumption stands."""
    machine = Machine(spec)
    measures = {"mem_gbytes_per_s": _memory_gbytes_per_s, "touch_gbytes_per_s": _touch_gbytes_per_s}
    measured = {}
    for key in KEYS:
        if key in machine.fields:
            continue
        try:
            rate = _calibration.figure(f"cpu_xla_{key}/{devices}",
                                       lambda m=measures[key]: _calibration.robust(lambda: m(devices)))
        except RuntimeError:
            continue
        measured[key] = f"{rate:.4g}"
    return machine.with_fields(**measured).spec


def mapped_afresh(temp_bytes: int) -> int:
    """Of a program's temporaries (XLA's memory analysis), the bytes the
    host maps afresh for each execution: all of them from
    `MAPPED_FROM_BYTES` on, else none. This takes XLA's CPU runtime to
    allocate the temporaries as one buffer (a step's ran 1.4x slower from
    33 MiB on, and not at 29.7 MiB: docs/planning.md); outputs it
    allocates are not counted (a step donates its state)."""
    return int(temp_bytes) if temp_bytes >= MAPPED_FROM_BYTES else 0


def _sharing(devices: int) -> float:
    """How many devices share each core, as the model counts them (>= 1)."""
    cores = _abi.machine_summary("cpu_here")["shared_processors"] or 1.0
    return max(devices / cores, 1.0)


def _sharded(devices: int, elements: int):
    pool = jax.devices("cpu")[:devices]
    if len(pool) < devices:
        raise RuntimeError(f"measuring memory over {devices} CPU devices needs them; JAX has {len(pool)}")
    mesh = jax.sharding.Mesh(np.asarray(pool), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    return jax.device_put(np.random.default_rng(0).random(devices * elements, np.float32), sharding)


def _fastest(x, *, in_place: bool) -> float:
    """Seconds of the fastest of `REPEATS` calls of an elementwise op on
    `x`, into `x` itself (donated) or into a fresh output; a warm-up call
    first, not counted."""
    op = jax.jit(lambda v: v * 1.5 + 1.0, donate_argnums=0 if in_place else ())

    def call(v):
        out = op(v)
        out.block_until_ready()
        if in_place and not v.is_deleted():
            raise RuntimeError("JAX did not donate the input: no in-place op to measure against")
        return out

    warm = call(x)  # the warm-up
    if in_place:
        x = warm
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        y = call(x)
        best = min(best, time.perf_counter() - start)
        if in_place:
            x = y
    return best


def _memory_gbytes_per_s(devices: int) -> float:
    """The op in place (each element read and written once) on every device at once."""
    elements = STREAM_SAMPLE_BYTES // 4
    return 2 * elements * 4 / _fastest(_sharded(devices, elements), in_place=True) * _sharing(devices) / 1e9


def _touch_gbytes_per_s(devices: int) -> float:
    """The op into a fresh output mapped anew, less the op in place: the
    first write of the output's bytes (0: not measurable, `MEASURABLE`)."""
    elements = TOUCH_SAMPLE_BYTES // 4
    x = _sharded(devices, elements)
    fresh, in_place = _fastest(x, in_place=False), _fastest(x, in_place=True)
    if fresh - in_place < MEASURABLE * in_place:
        return 0.0
    return elements * 4 / (fresh - in_place) * _sharing(devices) / 1e9
