"""``commfuse.trace``: record a timeline of the fused ops and write it as a
Perfetto trace (open it at https://ui.perfetto.dev)."""

from __future__ import annotations

import contextlib
import ctypes
import os

from ._native import lib

lib.commfuse_trace_start.restype = ctypes.c_int32
lib.commfuse_trace_start.argtypes = []
lib.commfuse_trace_stop.restype = ctypes.c_int64
lib.commfuse_trace_stop.argtypes = []
lib.commfuse_trace_write.restype = ctypes.c_int64
lib.commfuse_trace_write.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]


@contextlib.contextmanager
def trace(path):
    """Records every fused op run inside the block and writes ``path`` on exit.

    Per device and lane (compute, comm) the trace holds one slice per plan
    step, with its step id, op, call site and arguments: ``matmul``, ``add``,
    ``exchange`` (with a ``send`` or ``recv`` slice per transfer inside it,
    carrying the peer and the bytes), and ``wait`` where a step waited for a
    step of the other lane; a slice named after the op spans each call. A
    ``commfuse.reshard`` shows as a "reshard send" and a "reshard receive"
    call on the comm lane of each device taking part, with a ``send`` or
    ``recv`` slice per piece (peer device, bytes). In Perfetto each device is
    a process and each lane a thread.

    JAX dispatches asynchronously: block on the results inside the block
    (``jax.block_until_ready``) so the runs are over before it ends. Recording
    costs nothing while no trace is active. Yields the path.
    """
    path = os.fspath(path)
    if lib.commfuse_trace_start() != 0:
        raise RuntimeError("commfuse.trace: a trace is already being recorded")
    try:
        yield path
    finally:
        error = ctypes.create_string_buffer(512)
        written = lib.commfuse_trace_write(os.fsencode(path), error, len(error))
        if written < 0:
            raise OSError(f"commfuse.trace: {error.value.decode(errors='replace')}")
