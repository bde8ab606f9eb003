"""Where a mesh's devices are: which of its axes' groups span processes
(the CPU backend's transport lives inside one process, so a fused call over
such an axis cannot run there: `_decide.decide` keeps it unfused, and a
named op lowered over one runs jax.lax's collectives, `_fused`), and which
span nodes of a machine (their transfers cross its network: `decide`
judges them on it)."""

from __future__ import annotations

import jax
import numpy as np

# Why a call whose group spans processes on CPU devices runs unfused.
ACROSS_PROCESSES = ("unfused: its group over {axes} spans processes, and the CPU backend's transport lives "
                    "inside one process; XLA's own collectives (gloo or MPI, as JAX is configured) carry it")


def _axes_where(mesh, where) -> frozenset:
    """The axes of `mesh` along which some group holds devices of more
    than one value of `where(device)`."""
    labels = np.vectorize(where)(mesh.devices)
    out = set()
    for i, name in enumerate(mesh.axis_names):
        lines = np.moveaxis(labels, i, -1).reshape(-1, labels.shape[i])
        if any(len(set(line.tolist())) > 1 for line in lines):
            out.add(name)
    return frozenset(out)


def crossing_axes(mesh, devices_per_node: int | None) -> frozenset:
    """The axes of `mesh` along which a group holds devices of more than
    one node of `devices_per_node` (devices counted by id, as the planner
    lays its CPU devices out for a machine's: node i holds ids
    ``[i * devices_per_node, (i + 1) * devices_per_node)``). Empty for a
    machine of one node."""
    devices = getattr(mesh, "devices", None)
    if not devices_per_node or devices is None or getattr(devices, "size", 0) == 0:
        return frozenset()
    return _axes_where(mesh, lambda d: d.id // devices_per_node)


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
    return _axes_where(mesh, lambda d: d.process_index)
