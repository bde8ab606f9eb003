"""Real-world program shapes: small programs written here that reproduce the
forms JAX users write around tensor-parallel, FSDP and expert-parallel
layers, each run plain and through ``commfuse.overlap``.

Every shard_map module defines ``PROGRAM``, a `Program`: how to build the
function and its arguments on a mesh, and how many fused ops ``overlap`` must
make of it (forward, and in ``overlap(jax.grad(...))``).
``jax_tests/test_corpus.py`` checks numbers, gradients and counts;
``scripts/corpus_report.py`` times each plain and overlapped. The ``jit_*``
modules define ``JIT_PROGRAM``, a `JitProgram`: sharded by ``jax.jit`` alone,
checked by ``jax_tests/test_jit_programs.py`` (fused ops counted in the
compiled program, after partitioning).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
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


# The fused calls of one all-reduce of a product (`psum(x @ w)`):
# `commfuse.matmul_all_reduce` runs both halves, in chunks, in one op.
ALL_REDUCE_CALLS = 1


@dataclass(frozen=True)
class JitProgram:
    """A program sharded by ``jax.jit`` alone (``NamedSharding`` inputs,
    sharding constraints, explicit mesh axes): no shard_map."""
    name: str
    mesh: dict
    # (mesh, rng) -> (fn, args): fn's first output is a scalar loss.
    build: Callable
    # Fused ops in the compiled program of `overlap(fn)`, and of
    # `overlap(jax.value_and_grad(loss))`, after partitioning: each program
    # writes them as the sum of what its products become (its comment says
    # which), and the test checks the report's decisions add up to the same.
    fused: int
    grad_fused: int
    # The mesh's axis type (jax.sharding.AxisType's name).
    axis_type: str = "Auto"
    # What does not fuse, and why.
    unfused: str = ""
    # Why XLA's own collectives differ between grad(overlap(f)) and
    # overlap(grad(f)), where they do (the fused products are the same).
    orders_differ: str = ""
    # The gradients constrained to their arguments' shardings, as a
    # training step whose optimizer state is sharded like the parameters
    # keeps them (FSDP's weight gradients reduce-scattered, not all-reduced).
    grads_in_layout: bool = False


def value_and_grads(program: JitProgram, fn, args):
    """`fn`'s loss (its first output) and its gradients for every argument,
    constrained to the arguments' shardings where `program` keeps them there
    (`JitProgram.grads_in_layout`)."""
    import jax

    grads = jax.value_and_grad(lambda *a: fn(*a)[0], argnums=tuple(range(len(args))))
    if not program.grads_in_layout:
        return grads

    def in_layout(*a):
        value, g = grads(*a)
        return value, tuple(jax.lax.with_sharding_constraint(gi, ai.sharding) for gi, ai in zip(g, args))
    return in_layout


def _modules():
    for info in pkgutil.iter_modules(__path__):
        yield importlib.import_module(f"{__name__}.{info.name}")


def all_programs() -> list:
    return sorted((m.PROGRAM for m in _modules() if hasattr(m, "PROGRAM")), key=lambda p: p.name)


def all_jit_programs() -> list:
    return sorted((m.JIT_PROGRAM for m in _modules() if hasattr(m, "JIT_PROGRAM")), key=lambda p: p.name)


def make_mesh(axes: dict, devices=None, axis_type: str = "Auto"):
    """A mesh of `axes` (name -> size) with Auto (or `axis_type`) axis types, on the first devices."""
    n = int(np.prod(list(axes.values())))
    devices = (devices if devices is not None else jax.devices())[:n]
    types = (getattr(jax.sharding.AxisType, axis_type),) * len(axes)
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=types, devices=devices)


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(text: str) -> dict:
    """XLA's collectives and commfuse's calls in a compiled program's text
    (a collective of several operands has a tuple type: any text before it)."""
    counts = {c: len(re.findall(rf"\s{c}(?:-start)?\(", text)) for c in _COLLECTIVES}
    counts["commfuse"] = text.count('custom_call_target="commfuse_collective_matmul')
    return {k: v for k, v in counts.items() if v}


def place(mesh, spec, value):
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))


def normal(rng, shape, scale=1.0, dtype=np.float32):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def constrainer(mesh):
    """``constrain(a, *spec)``: `a` constrained to ``P(*spec)`` on `mesh`, as
    the LLM frameworks' logical axis rules pin activations."""
    def constrain(a, *spec):
        return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
    return constrain


def mlp_operands(mesh, rng, shape, x_spec, w1_spec, w2_spec):
    """An activation of `shape` ``(b, s, d)`` and an MLP's ``w1 [d, 2d]``,
    ``w2 [2d, d]`` (scaled to keep the activations' size), placed."""
    d = shape[-1]
    return (place(mesh, x_spec, normal(rng, shape)), place(mesh, w1_spec, normal(rng, (d, 2 * d), d ** -0.5)),
            place(mesh, w2_spec, normal(rng, (2 * d, d), (2 * d) ** -0.5)))
