"""Where a mesh's devices are: which of its axes' groups span processes.
The CPU backend's transport lives inside one process, so a fused call over
such an axis cannot run there (`_decide.decide` keeps it unfused; a named
op lowered over one runs jax.lax's collectives, `_fused`)."""

from __future__ import annotations

import jax
import numpy as np

# Why a call whose group spans processes on CPU devices runs unfused.
ACROSS_PROCESSES = ("unfused: its group over {axes} spans processes, and the CPU backend's transport lives "
                    "inside one process; XLA's own collectives (gloo or MPI, as JAX is configured) carry it")


def spanning_axes(mesh) -> frozenset:
    """The axes of `mesh` (a concrete Mesh of CPU devices) along which a
    group holds devices of more than one process: a call over any of them
    cannot run fused. Empty for GPU meshes (NCCL spans processes) and for
    a job of one process."""
    devices = getattr(mesh, "devices", None)
    if devices is None or getattr(devices, "size", 0) == 0 or jax.process_count() == 1:
        return frozenset()
    if any(d.platform != "cpu" for d in devices.flat):
        return frozenset()
    processes = np.vectorize(lambda d: d.process_index)(devices)
    out = set()
    for i, name in enumerate(mesh.axis_names):
        lines = np.moveaxis(processes, i, -1).reshape(-1, processes.shape[i])
        if any(len(set(line.tolist())) > 1 for line in lines):
            out.add(name)
    return frozenset(out)
