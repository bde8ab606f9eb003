"""One candidate of a step, lowered and compiled by XLA for the planner's
devices (CPU devices stand in for any target: the SPMD partitioner emits
the same collectives and per-device shapes), and judged: its memory per
device from XLA's compiled memory analysis, its time from the cost model
pricing the compiled program on the target machine (`price`), and, through
``overlap``, the decision each of its products was given."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from .. import _abi
from .._overlap import library_decisions, overlap
from . import hooks, host
from .logical import Names, sharding_specs
from .price import price
from .space import Candidate

# Planning compiles need buffer assignment and the partitioned program, not
# fast machine code: XLA's backend optimizations off cut a compile by about
# a third here and change neither.
COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}


@dataclass
class Step:
    """What the planner plans: the step function, its arguments' flat leaves
    (arrays or ShapeDtypeStructs), their tree, their logical names, and the
    arguments donated (all but the batch: a training step's parameters and
    optimizer state are replaced by its results)."""
    fn: object
    leaves: list
    treedef: object
    names: list[Names]
    donate: tuple

    def abstract(self, mesh, rules) -> tuple[list, list]:
        """The arguments as ShapeDtypeStructs sharded over `mesh` by `rules`, and their specs."""
        sizes = dict(mesh.shape)
        specs = sharding_specs(self.names, self.leaves, rules, sizes)
        structs = [jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype,
                                        sharding=jax.sharding.NamedSharding(mesh, spec))
                   for leaf, spec in zip(self.leaves, specs)]
        return structs, specs

    def bytes_per_device(self, specs, sizes: dict) -> int:
        """The arguments' bytes on one device under `specs`."""
        total = 0
        for leaf, spec in zip(self.leaves, specs):
            shards = math.prod(math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e))
                               for e in spec if e is not None)
            total += int(np.prod(np.shape(leaf), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize // shards
        return total


@dataclass
class Evaluation:
    """A compiled candidate: `memory_bytes` per device (XLA's analysis of
    the CPU compile: arguments + outputs + temporaries - aliased, an
    estimate for a GPU's), `predicted_s` (the cost model's step time on the
    target), the priced breakdown, the decisions of its products, and how
    long compiling took; or the `error` that stopped it."""
    candidate: Candidate
    memory_bytes: int = 0
    memory: dict = field(default_factory=dict)
    predicted_s: float = math.inf
    priced: object = None
    decisions: list = field(default_factory=list)
    compile_s: float = 0.0
    hlo: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def make_mesh(candidate: Candidate, devices):
    shape = tuple(n for _, n in candidate.mesh)
    names = tuple(a for a, _ in candidate.mesh)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def layout_of(candidate: Candidate, mesh) -> hooks.Layout:
    return hooks.Layout(mesh, candidate.rules(), candidate.remat)


def program(fn, candidate: Candidate, machine_spec: str, imposed=None):
    """The function compiled for `candidate`: the step `fn`, or `fn`
    through ``overlap`` deciding for the target machine (with `imposed`
    decisions)."""
    if not candidate.fused:
        return fn, None
    # Decisions given (even none): each product is judged once partitioned,
    # its shardings known (not before, as under a user's own jit).
    ov = overlap(fn, schedule="auto", machine=machine_spec, decisions=imposed or [])
    return ov, ov


def as_run(fn, candidate: Candidate, machine_spec: str, decisions=()):
    """The step as it runs on CPU devices under the link model, which
    throttles commfuse's transport and not XLA's collectives: every
    product's collective a commfuse call, so that its transfers take the
    link's time: a plain layout's, and what a fused one's `decisions` (the
    library decisions of its products) leave unfused, as "sequential"
    calls (the transfers, then the product, as an unfused program waits
    for them); the rest as decided."""
    if not candidate.fused:
        return overlap(fn, schedule="sequential")
    sequential = _abi.SCHEDULES["sequential"]
    exposed = [(d.call, sequential if d.schedule == _abi.UNFUSED else d.schedule) for d in decisions]
    return overlap(fn, schedule="sequential", machine=machine_spec, decisions=exposed)


def evaluate(step: Step, candidate: Candidate, devices, *, machine: str, gemm_gflops=None,
             devices_per_node=None, collectives="async", keep_hlo: bool = False,
             priced_as_run: bool = False) -> Evaluation:
    """`candidate` compiled for `devices` and judged on `machine` (see
    `Evaluation`). `priced_as_run` (CPU devices under the link model): its
    time is the cost model's on the program that runs there (`as_run`,
    compiled too), each product a commfuse call with a fused call's fixed
    cost; its memory and decisions stay the planned program's."""
    mesh = make_mesh(candidate, devices)
    out = Evaluation(candidate)
    start = time.perf_counter()
    try:
        structs, _ = step.abstract(mesh, candidate.rules())
        args = jax.tree_util.tree_unflatten(step.treedef, structs)
        fn, ov = program(step.fn, candidate, machine)
        with hooks.tracing(layout_of(candidate, mesh)):
            lowered = jax.jit(fn, donate_argnums=step.donate).lower(*args)
            compiled = lowered.compile(compiler_options=COMPILE_OPTIONS)
        analysis = compiled.memory_analysis()
        text = compiled.as_text()
        decisions = library_decisions(ov.last_decisions) if ov is not None else []
        temp = getattr(analysis, "temp_size_in_bytes", 0) or 0
        if priced_as_run:
            run = as_run(step.fn, candidate, machine, decisions)
            with hooks.tracing(layout_of(candidate, mesh)):
                ran = jax.jit(run, donate_argnums=step.donate).lower(*args).compile(compiler_options=COMPILE_OPTIONS)
            text, temp = ran.as_text(), getattr(ran.memory_analysis(), "temp_size_in_bytes", 0) or 0
    except Exception as e:  # noqa: BLE001 - a layout XLA or the step refuses is no candidate; said why
        out.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out.compile_s = time.perf_counter() - start
        return out
    out.compile_s = time.perf_counter() - start
    out.memory = {k: int(getattr(analysis, f"{k}_size_in_bytes", 0) or 0)
                  for k in ("argument", "output", "temp", "alias", "generated_code")}
    m = out.memory
    out.memory_bytes = m["argument"] + m["output"] + m["temp"] - m["alias"]
    out.priced = price(text, machine, gemm_gflops=gemm_gflops, devices_per_node=devices_per_node,
                       collectives=collectives, fresh_bytes=host.mapped_afresh(temp))
    out.predicted_s = out.priced.total_s
    out.decisions = decisions
    if keep_hlo:
        out.hlo = text
    return out
