"""Real-world program shapes: small programs written here that reproduce the
forms JAX users write around tensor-parallel, FSDP and expert-parallel
layers, each run plain and through ``commfuse.overlap``.

Every module defines ``PROGRAM``, a `Program`: how to build the function and
its arguments on a mesh, and how many fused ops ``overlap`` must make of it
(forward, and in ``overlap(jax.grad(...))``). ``jax_tests/test_corpus.py``
checks numbers, gradients and counts; ``scripts/corpus_report.py`` times
each plain and overlapped.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np


@dataclass(frozen=True)
class Program:
    name: str
    # Mesh axis names and sizes (the test runs them on CPU devices).
    mesh: dict
    # (mesh, rng, scale) -> (fn, args): fn takes the placed global arrays; its
    # first output is a scalar loss (gradients are taken of it).
    build: Callable
    # Fused ops `overlap(fn)` makes, and `overlap(jax.grad(loss))`, under a
    # schedule that fuses whatever it can.
    fused: int
    grad_fused: int
    # What still does not fuse, and why (said in the report and the note).
    unfused: str = ""


def all_programs() -> list:
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "PROGRAM"):
            found.append(module.PROGRAM)
    return sorted(found, key=lambda p: p.name)


def make_mesh(axes: dict, devices=None):
    """A mesh of `axes` (name -> size) with Auto axis types, on the first devices."""
    n = int(np.prod(list(axes.values())))
    devices = (devices if devices is not None else jax.devices())[:n]
    auto = (jax.sharding.AxisType.Auto,) * len(axes)
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=auto, devices=devices)


def place(mesh, spec, value):
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))


def normal(rng, shape, scale=1.0, dtype=np.float32):
    return (rng.standard_normal(shape) * scale).astype(dtype)
