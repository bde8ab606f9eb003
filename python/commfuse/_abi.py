"""The contract with the Rust library: op kind codes, the schedule encoding,
dtype codes, and one call's shapes. This module and ``src/abi.rs`` are the
only places that define them; ``jax_tests/test_abi.py`` compares them with
the tables the library exports.

``prepare(call)`` is the one trace-time call into the library: it answers
with the result's shape, the schedule the call runs (``auto`` resolved by
the cost model when a machine is named), each backend's workspace, and a
summary of the plan (``src/prepare.rs``).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import json
import os
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from ._native import lib


class Kind(enum.IntEnum):
    """The library's op kinds (``abi::KINDS``), with their operand layouts."""
    ALL_GATHER_MATMUL = 0            # x [.., rows.., k] travels; w [k, n]
    ALL_GATHER_MATMUL_CONTRACT = 1   # x [m, kb] travels; w [N*kb, n]; out [m, n]
    MATMUL_ALL_GATHER = 2            # (w [k, c] travels, x [m, k]); out [m, N*c]
    MATMUL_ALL_GATHER_CONTRACT = 3   # (w [kb, n] travels, x [m, N*kb]); out [m, n]
    MATMUL_REDUCE_SCATTER = 4        # x [.., N*b.., k]; w [k, n]
    MATMUL_REDUCE_SCATTER_COLS = 5   # x [m, k]; w [k, N*c]; out [m, c]
    ALL_TO_ALL_MATMUL = 6            # x [N, C, k]; w [k, n]; out [N, C, n]
    ALL_TO_ALL_MATMUL_CONTRACT = 7   # x [N, m, kb]; w [N*kb, n]; out [m, n]
    MATMUL_ALL_TO_ALL = 8            # x [N, C, k]; w [k, n]; out [N, C, n]
    MATMUL_ALL_TO_ALL_COLS = 9       # x [m, k]; w [k, N*c]; out [N, m, c]
    MATMUL_ALL_REDUCE = 10           # x [N*b, k]; w [k, n]; out [N*b, n]
    # Two axes (A of F ranks, then B of T): (w [kb, c] travels over A, x [T*b, kb]); dimension = F;
    # out [F, b, c] (block j: the product with A's rank j's w, rows scattered over B).
    ALL_GATHER_MATMUL_REDUCE_SCATTER = 11
    # Two axes (A of F ranks, then B of T): x [m, F*kb] travels over B, w [kb, c] over A; dimension = F;
    # out [T*m, c] (all_gather(x, B) @ all_gather(w, A), both along their first dim).
    ALL_GATHER_BOTH_MATMUL = 12
    # Two axes (A of F ranks, then B of T): x [F*kq, m] travels over B (its columns, the contraction), w [T*m, c];
    # dimension = F; out [kq, c] (psum_scatter(all_gather(x, B, axis=1) @ w, A): the two-gather op's dw).
    ALL_GATHER_CONTRACT_MATMUL_REDUCE_SCATTER = 13


# Schedule codes (``abi::SCHEDULES``): the low byte; "sliced" and "tiled"
# carry their number of chunks above it. "unfused" is jax.lax's own
# collective and dot: it never reaches a handler.
SCHEDULES = {"auto": 0, "ring": 1, "bidirectional": 2, "sequential": 3, "sliced": 4, "tiled": 5, "unfused": 6}
AUTO = SCHEDULES["auto"]
UNFUSED = SCHEDULES["unfused"]
CHUNKS_SHIFT = 8
# The cut schedules, with the keyword naming their number of chunks.
CUT_SCHEDULES = {"sliced": "slices", "tiled": "tiles"}
_CUT_CODES = {SCHEDULES[name]: name for name in CUT_SCHEDULES}


def schedule_code(schedule: str, chunks: int | None = None) -> int:
    """The code of a schedule name (with its chunks for "sliced" and "tiled")."""
    code = SCHEDULES[schedule]
    return code | (chunks << CHUNKS_SHIFT) if schedule in CUT_SCHEDULES else code


def cut_schedule(code: int):
    """"sliced" or "tiled" for the codes of those schedules, else None."""
    return _CUT_CODES.get(code & 0xFF)


def chunks_of(code: int) -> int:
    return code >> CHUNKS_SHIFT


def schedule_name(code: int) -> str:
    """The name of a schedule code (``"tiled(4)"`` for the cut ones)."""
    cut = cut_schedule(code)
    if cut:
        return f"{cut}({chunks_of(code)})"
    return {v: k for k, v in SCHEDULES.items()}.get(code, f"schedule code {code}")


# XLA's PrimitiveType numbers of the dtypes the ops take (``abi::DTYPES``).
DTYPE_CODES = {
    np.dtype(np.float32): 11,
    np.dtype(np.float64): 12,
    np.dtype(jnp.bfloat16): 16,
    np.dtype(np.float16): 10,
}
# fp8 formats (CUDA only, sm_90+, with x_scale and w_scale).
FP8_CODES = {
    np.dtype(jnp.float8_e4m3fn): 20,
    np.dtype(jnp.float8_e5m2): 19,
}
CODES = {**DTYPE_CODES, **FP8_CODES}


def two_axis_slices(code: int | None) -> int:
    """The chunks each block of w's columns is cut into by the two-axis op's
    schedule `code` (sliced: its slices; else 1)."""
    return chunks_of(code) if code is not None and cut_schedule(code) == "sliced" else 1


def two_axis_to_library(y, gathered: int, slices: int):
    """The two-axis op's result `y` ``[b, F*c]`` in the library's layout
    ``[F, b, c]``, each ``[b, c]`` block of w's columns cut into `slices`
    column chunks stacked first (``src/problem.rs``, `Problem::out_range`):
    ``[F, S, b, c/S]``."""
    b, c = y.shape[0], y.shape[1] // gathered
    return jnp.moveaxis(y.reshape(b, gathered, slices, c // slices), 0, 2).reshape(gathered, b, c)


def two_axis_from_library(stacked, slices: int):
    """`two_axis_to_library` undone: ``[F, b, c]`` as laid out, to ``[b, F*c]``."""
    f, b, c = stacked.shape
    blocks = jnp.moveaxis(stacked.reshape(f, slices, b, c // slices), 1, 2).reshape(f, b, c)
    return jnp.moveaxis(blocks, 0, 1).reshape(b, f * c)


class CallShapes(NamedTuple):
    """One call as the library takes it (``abi::CallShapes``): the operands
    in the kind's layout; the result's shape follows from them."""
    kind: int
    schedule: int
    ranks: int
    dimension: int
    x: tuple
    w: tuple
    input: int
    output: int


def call_shapes(kind, schedule: int, ranks: int, dimension: int, x_shape, w_shape, input_dtype,
                output_dtype) -> CallShapes:
    return CallShapes(int(kind), int(schedule), int(ranks), int(dimension), tuple(int(d) for d in x_shape),
                tuple(int(d) for d in w_shape), CODES[jnp.dtype(input_dtype)], CODES[jnp.dtype(output_dtype)])


lib.commfuse_prepare.restype = ctypes.c_int64
lib.commfuse_prepare.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
lib.commfuse_abi_tables.restype = ctypes.c_int64
lib.commfuse_abi_tables.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
lib.commfuse_price_step.restype = ctypes.c_int64
lib.commfuse_price_step.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]


def _ask(function, *args) -> str:
    """A text answer of `function` (see `exports::python::answer`), growing the buffer as it says."""
    size = 1 << 14
    while True:
        buffer = ctypes.create_string_buffer(size)
        length = function(*args, buffer, size)
        if length < 0:
            raise ValueError(buffer.value.decode(errors="replace"))
        if length < size:
            return buffer.value.decode()
        size = length + 1


def prepare(call: CallShapes, machine: str | None = None, gemm_gflops: float | None = None, explain: bool = False,
            trace=None) -> dict:
    """The library's answer for `call` (``src/prepare.rs``): ``out`` (the
    result's shape), ``schedule`` (the code to run: the one asked for, or
    ``auto``'s pick on `machine`), ``schedule_name``, ``workspace``
    (``{"cpu": bytes, "cuda": bytes}``), ``plan`` (rank 0's: its resolved
    schedule, steps, exchanges, slots), ``model`` (``auto`` on a machine:
    its pick, ``pick_s`` and ``sequential_s`` predicted seconds) and, with
    `explain`, ``explain`` (the cost model's view, see ``commfuse.explain``).
    With `trace` (a path; needs `machine`) it also writes the cost model's
    timeline of the call under the schedule it answers, every rank, as a
    Perfetto trace (JSON where the path ends in ``.json``), every time it
    is asked (answers without a trace are cached).
    ValueError with the library's reason for a call it refuses."""
    if trace is not None:
        return _prepare(call, machine, gemm_gflops, explain, os.fspath(trace))
    return _prepare_cached(call, machine, gemm_gflops, explain)


def _prepare(call: CallShapes, machine: str | None, gemm_gflops: float | None, explain: bool,
             trace: str | None = None) -> dict:
    request = {"call": call._asdict(), "explain": explain}
    if trace is not None:
        request["trace"] = trace
    if machine is not None:
        request["machine"] = machine
    if gemm_gflops is not None:
        request["gemm_gflops"] = float(gemm_gflops)
    return json.loads(_ask(lib.commfuse_prepare, json.dumps(request).encode()))


_prepare_cached = functools.lru_cache(maxsize=4096)(_prepare)


def price_step(request: dict) -> dict:
    """The library's price of one device's program (``src/sim/step.rs``;
    `request` as it documents), ValueError with its reason for a request it
    refuses."""
    return json.loads(_ask(lib.commfuse_price_step, json.dumps(request).encode()))


@functools.lru_cache(maxsize=64)
def machine_summary(machine: str) -> dict:
    """What the library makes of a machine description: ``{"name",
    "devices_per_node"}`` (None: one node) and ``"shared_processors"`` (the
    processors its devices share, as the cost model counts them: this
    host's cores for ``cpu_here``; None for devices of their own);
    ValueError naming what it refuses in `machine`."""
    return price_step({"machine": machine, "ops": []})["machine"]


def tables() -> dict:
    """The library's tables (``abi::tables``): kinds and what each takes,
    schedules, chunks shift, dtypes, limits, attribute names."""
    return json.loads(_ask(lib.commfuse_abi_tables))


# The library's limits on axis sizes, chunk counts and element counts
# (``plan::MAX_*``, ``problem::MAX_ELEMENTS``), checked again at trace time.
LIMITS = tables()["limits"]
# Each kind's facts (``OpKind``'s, exported): the kinds of row blocks (what
# "sliced"/"tiled", fp8 and vmap take), and the attribute names of a call.
ROW_BLOCK_KINDS = frozenset(Kind[name] for name, info in tables()["kind_info"].items() if info["row_blocks"])
# The kinds "sliced" and "tiled" cut: the row blocks and the all-reduce.
CUT_KINDS = frozenset(Kind[name] for name, info in tables()["kind_info"].items() if info["cuts_rows"])
ATTRIBUTES = tuple(tables()["attributes"])
