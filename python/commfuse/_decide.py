"""Decisions made before tracing: what each library call runs as (`decide`),
from its shapes, dtypes and group size, the machine and the `Policy` it is
made under, as a `Decision` value. Every way in reads the same decisions:
the fused ops called by name, ``overlap``'s rewrite (it binds accepted
decisions only), ``commfuse.matmul``'s partitioner, ``commfuse.explain``,
and ``commfuse.plan`` (whose decisions are imposed through a policy).

Under ``schedule="auto"`` a call runs the cost model's pick (``src/sim``)
on the machine the program runs on, or jax.lax's own collective and dot
where the pick's predicted gain over the unoverlapped baseline is not
clearly (`MARGIN` times) more than a fused call's fixed cost. Every figure
a decision rests on is either a preset (the GPU machines) or measured once
per machine and cached (`_calibration`): the same program on the same
machine gets the same decisions in every process.

Under ``jax.jit`` (``overlap``'s rewrite of dots outside shard_map bodies)
the shardings are known only when XLA partitions the program, too late to
leave a dot as the user wrote it. So `decide_dot` judges a dot at trace
time, from its global shapes and the mesh: a dot it declines stays XLA's
own (the compiled program is then the plain one), a dot it fuses runs the
model's best fused schedule whatever the partitioner asks for.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import jax

from . import _abi, _calibration, _fused
from ._decision import Call, Decision, as_asked, empty_decision, with_answer
from ._native import lib
from ._placement import ACROSS_PROCESSES, crossing_axes, spanning_axes

MACHINES = ("cpu_here", "h100_nvlink", "h200_nvlink", "h100_pcie", "h100_cluster")
MACHINE_VAR = "COMMFUSE_MACHINE"
LINK_VAR = "COMMFUSE_CPU_LINK"
# The memory rates of this host's CPU devices the planner measures and adds
# to a ``cpu_here`` description (`_planner/host.py`).
MEMORY_KEYS = ("mem_gbytes_per_s", "touch_gbytes_per_s")
# Whether `auto` may run a call unfused where the model predicts no gain
# (`COMMFUSE_AUTO_UNFUSED=0` makes it always fuse: the test-suite's fused-path
# tests run tiny shapes, which would otherwise never fuse).
AUTO_UNFUSED_VAR = "COMMFUSE_AUTO_UNFUSED"
# A call fuses when the predicted gain is more than this many times its fixed
# cost: a decision near the break-even point would flip with the noise in the
# figures, and buy nothing either way.
MARGIN = 1.5
# A fused call's fixed cost over XLA's own collective and dot on the GPU
# presets: measured on an H100 (GPU.md: 16 us per call, one GPU, small GEMMs).
GPU_CALL_OVERHEAD_S = 16e-6

lib.commfuse_cpu_gemm_gflops.restype = ctypes.c_double
lib.commfuse_cpu_gemm_gflops.argtypes = []


def cpu_gemm_gflops() -> float:
    """This host's single-thread f32 GEMM rate (GFLOP/s), measured once per machine."""
    return _calibration.figure("cpu_gemm_gflops", lambda: float(lib.commfuse_cpu_gemm_gflops()))


def may_decline() -> bool:
    return os.environ.get(AUTO_UNFUSED_VAR, "1") != "0"


@dataclass(frozen=True)
class Machine:
    """The machine decisions are made for: a description the library knows
    (``src/sim``: a preset, optionally with overrides, e.g.
    ``"h100_pcie:topology=ring"`` or ``"cpu_here:gbytes_per_s=0.5"``)."""
    spec: str

    @classmethod
    def current(cls) -> "Machine":
        """The machine `schedule="auto"` plans for: ``COMMFUSE_MACHINE`` if
        set, else by JAX's default backend: this host's CPU devices under the
        link model in ``COMMFUSE_CPU_LINK``, or the GPU preset matching the
        device kind (H200, H100 PCIe, else H100 NVLink)."""
        spec = os.environ.get(MACHINE_VAR, "").strip()
        if spec:
            return cls(spec)
        if jax.default_backend() == "cpu":
            return cls.named("cpu_here")
        kind = jax.devices()[0].device_kind.lower()
        if "h200" in kind:
            return cls("h200_nvlink")
        return cls("h100_pcie" if "pcie" in kind else "h100_nvlink")

    @classmethod
    def named(cls, spec: str) -> "Machine":
        """A preset by name (``cpu_here`` under the link model in
        ``COMMFUSE_CPU_LINK``, as the program would run), or a full spec."""
        if not isinstance(spec, str) or spec.split(":")[0] not in MACHINES:
            raise ValueError(f"unknown machine {spec!r}; expected one of {', '.join(MACHINES)}")
        link = os.environ.get(LINK_VAR, "").strip()
        if spec == "cpu_here" and link:
            return cls(f"cpu_here:{link}")
        return cls(spec)

    @property
    def fields(self) -> dict:
        """The description's overrides, key -> value as written, in order."""
        pairs = (field.partition("=") for field in self.spec.partition(":")[2].split(","))
        return {key.strip(): value.strip() for key, _, value in pairs if key.strip()}

    def with_fields(self, **fields) -> "Machine":
        """This description with `fields` added as overrides (a key it sets already keeps its value)."""
        merged = self.fields
        for key, value in fields.items():
            merged.setdefault(key, str(value))
        name = self.spec.partition(":")[0]
        return Machine(name + (":" + ",".join(f"{k}={v}" for k, v in merged.items()) if merged else ""))

    def across_nodes(self) -> "Machine":
        """This machine as a group spanning its nodes sees it: its network as the link."""
        return self.with_fields(across_nodes=1)

    @classmethod
    def checked(cls, spec: str) -> "Machine":
        """`named(spec)`, its overrides checked by the library now (ValueError
        naming what it refuses), not when a call is first decided."""
        machine = cls.named(spec)
        _abi.machine_summary(machine.spec)
        return machine

    @property
    def is_cpu(self) -> bool:
        return self.spec.startswith("cpu_here")

    @property
    def gemm_gflops(self) -> float | None:
        """The measured GEMM rate the description takes (`cpu_here` only)."""
        return cpu_gemm_gflops() if self.is_cpu else None

    def prepare(self, shapes: _abi.CallShapes, **extra) -> dict:
        """The library's answer for `shapes` on this machine (`_abi.prepare`)."""
        try:
            return _abi.prepare(shapes, self.spec, self.gemm_gflops, **extra)
        except ValueError as e:
            if "machine " not in str(e):
                raise
            source = MACHINE_VAR if os.environ.get(MACHINE_VAR, "").strip() else LINK_VAR
            raise ValueError(f"commfuse: schedule='auto' cannot use the machine description from {source}: {e}") \
                from None

    def call_overhead_s(self, n: int) -> float:
        """What a fused call costs beyond jax.lax's collective and dot,
        whatever its size: measured on this host's CPU devices (`cpu_here`,
        once per machine and group size, see `_calibration`), or as measured
        on an H100 for the GPU presets. 0 (auto then fuses) where it cannot
        be measured."""
        if not self.is_cpu:
            return GPU_CALL_OVERHEAD_S
        # Under the link model the fused call's transfers take modelled time:
        # a figure of its own. The memory rates the planner adds
        # (`_planner/host.py`) do not change what a call costs beyond them.
        link = [f"{key}={value}" for key, value in self.fields.items() if key not in MEMORY_KEYS]
        name = f"cpu_call_overhead_s/{n}" + (":" + ",".join(link) if link else "")
        try:
            return _calibration.figure(
                name, lambda: max(0.0, _calibration.robust(lambda: _fused.measure_call_overhead_s(n))))
        except Exception:  # noqa: BLE001 - no figure (kept for this process only): auto then fuses
            _calibration.remember(name, 0.0)
            return 0.0


class Policy(NamedTuple):
    """How the calls of one op (or one rewrite) are decided. Hashable: it
    travels in the ops' static arguments, so the backward ops JAX traces
    later are decided the same way.

    `asked`: the schedule asked for (``_abi.AUTO`` or another code);
    `machine`: a machine spec (None: `Machine.current()` when deciding);
    `decline`: whether "auto" may run a call unfused (False where the choice
    to fuse was made before, see `decide_dot`); `strict`: whether a schedule
    that cannot run these shapes raises (a user's call) or runs unfused with
    the reason (a rewrite's, a partitioner's); `imposed`: ``((Call,
    schedule code), ...)`` decided outside, by a plan; `owner`: the
    ``overlap`` whose report hears of decisions made later (at
    partitioning), 0: none; `early`: whether a dot under ``jax.jit`` is
    judged before partitioning (`decide_dot`: one declined stays XLA's own
    dot, as written) or only once its shardings are known (the planner's
    way, which has them); `spanning`: the mesh axes whose groups span
    processes on CPU devices, where a call over them runs unfused;
    `crossing`: those whose groups span nodes of the machine, where a
    call's transfers cross its network."""
    asked: int = _abi.AUTO
    machine: str | None = None
    decline: bool = True
    strict: bool = True
    imposed: tuple = ()
    owner: int = 0
    early: bool = True
    # Mesh axes whose groups span processes on CPU devices, and nodes of
    # the machine (`_placement.spanning_axes`, `crossing_axes`).
    spanning: frozenset = frozenset()
    crossing: frozenset = frozenset()

    def resolved_machine(self, axes=()) -> Machine:
        """The machine a call over mesh `axes` is decided for: the policy's
        (or the current one), its network's where the group spans nodes."""
        machine = Machine(self.machine) if self.machine is not None else Machine.current()
        return machine.across_nodes() if set(axes) & self.crossing else machine

    def placed(self, mesh) -> "Policy":
        """This policy for calls over `mesh`: the axes whose groups span
        processes (CPU devices) or nodes of the machine."""
        per_node = _abi.machine_summary(self.resolved_machine().spec)["devices_per_node"]
        return self._replace(spanning=spanning_axes(mesh), crossing=crossing_axes(mesh, per_node))

    def with_asked(self, asked: int) -> "Policy":
        return self._replace(asked=int(asked))


def decide(call: Call, policy: Policy = Policy(), axes=(), combined: int = 1) -> Decision:
    """What `call` (over mesh `axes`) runs as under `policy`: a decision
    imposed for it, the schedule asked for, or "auto"'s judgement (see the
    module's doc); jax.lax's collective and dot where its group spans
    processes on CPU devices, whatever was asked. `combined`: how many
    all-reduces (this one included) XLA may combine into one where they
    stay unfused (see `judge`)."""
    empty = empty_decision(call)
    if empty is not None:
        return empty
    spanning = sorted(set(axes) & policy.spanning)
    if spanning:
        return as_asked(call, _abi.UNFUSED, ACROSS_PROCESSES.format(axes=tuple(spanning)))
    imposed = dict(policy.imposed).get(call)
    if imposed is not None:
        return _asked(call, imposed, "imposed by the plan", policy.strict)
    if policy.asked != _abi.AUTO:
        return _asked(call, policy.asked, "as asked", policy.strict)
    if call.dtype in _abi.FP8_CODES:
        return as_asked(call, _abi.AUTO, "fp8: the library's own rule")
    try:
        return _judged(call, policy.resolved_machine(axes), policy.decline and may_decline(), combined)
    except ValueError as e:
        if policy.strict:
            raise
        return as_asked(call, _abi.UNFUSED, f"unfused: the cost model cannot judge it ({e})")


@functools.lru_cache(maxsize=4096)
def _judged(call: Call, machine: Machine, decline: bool, combined: int = 1) -> Decision:
    prepared = machine.prepare(call.shapes(_abi.AUTO))
    code, why = judge(prepared, call.ranks, machine, decline, combined)
    return with_answer(call, code, why, prepared)


def _asked(call: Call, schedule: int, why: str, strict: bool) -> Decision:
    try:
        return as_asked(call, schedule, why)
    except ValueError as e:
        if strict:
            raise
        why = f"schedule={_abi.schedule_name(schedule)!r} cannot run on these shards: {e}"
        return as_asked(call, _abi.UNFUSED, why)


def judge(prepared: dict, n: int, machine: Machine, may_decline: bool, combined: int = 1) -> tuple:
    """(code, why): the model's pick in the library's answer `prepared`, or
    unfused where its predicted gain over the unoverlapped baseline is not
    `MARGIN` times a fused call's fixed cost. With `combined` > 1 the
    baseline is XLA's all-reduce combined with the others: one chain of
    link latencies for all of them, so each pays 1/combined of its own."""
    if n == 1 and may_decline:
        # XLA drops a collective over one device; a fused call would only add its fixed cost.
        return _abi.UNFUSED, "unfused: a group of one device has no communication to hide"
    model = prepared.get("model")
    if model is None:
        return prepared["schedule"], "the cost model cannot time this call; the library's default schedule"
    pick, fused, unfused = model["pick"], model["pick_s"], model["sequential_s"]
    if n == 1 or fused is None or unfused is None:
        return prepared["schedule"], f"{pick}, the cost model's pick"
    than = "unfused"
    if combined > 1:
        unfused -= (1 - 1 / combined) * model["sequential_latency_s"]
        than = f"unfused combined by XLA with {combined - 1} other all-reduce{'s' if combined > 2 else ''}"
    gain = unfused - fused
    if not may_decline:
        return prepared["schedule"], f"{pick}: predicted {us(gain)} faster than {than}"
    overhead = machine.call_overhead_s(n)
    if gain <= MARGIN * overhead:
        over = f" over {than}" if combined > 1 else ""
        return _abi.UNFUSED, (f"unfused: the model predicts {us(gain)} of gain from fusing ({pick}){over}, not "
                              f"{MARGIN}x a fused call's fixed cost of {us(overhead)} over {n} devices")
    return prepared["schedule"], f"{pick}: predicted {us(gain)} faster than {than} (fixed cost {us(overhead)})"


def us(seconds) -> str:
    if seconds is None:
        return "?"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


# ----------------------------------------------------------------------------
# Dots under jax.jit, judged before partitioning
# ----------------------------------------------------------------------------
def decide_dot(m: int, k: int, n: int, dtype, out_dtype, mesh_axes: dict | None, devices: int,
               machine: Machine | None = None) -> tuple[bool, str]:
    """Whether to fuse ``x [m, k] @ w [k, n]`` (global shapes) of a program
    sharded by jit, and why. The shardings are unknown yet, so the product is
    judged in the layout of tensor parallelism with sequence parallelism,
    split over all `devices` with its collective over the largest mesh axis
    (all devices if no mesh is known): once gathering the rows (``[m/D, k] @
    [k, n/T]`` on each of D devices, over T ranks), once reduce-scattering
    them (``[m T/D, k/T] @ [k/T, n]``). It fuses when both pay."""
    if not may_decline():
        return True, "auto with COMMFUSE_AUTO_UNFUSED=0"
    sizes = [s for s in (mesh_axes or {}).values() if s > 1]
    ranks = max(sizes) if sizes else devices
    if ranks <= 1:
        return False, "a mesh of one device: no collective to hide"
    if m % devices or k % ranks or n % ranks or (m * ranks) % devices:
        return False, (f"its shapes ({m}x{k} @ {k}x{n}) do not split over the {devices} devices with a "
                       f"collective over {ranks}: judged by XLA")
    rows, rows_gathered = m // devices, m * ranks // devices
    layouts = ((_abi.Kind.ALL_GATHER_MATMUL, (rows, k), (k, n // ranks)),
               (_abi.Kind.MATMUL_REDUCE_SCATTER, (rows_gathered, k // ranks), (k // ranks, n)))
    policy = Policy(machine=(machine or Machine.current()).spec)
    verdicts = []
    for kind, x_shape, w_shape in layouts:
        decision = decide(Call.of(kind, ranks, 0, x_shape, w_shape, dtype, out_dtype), policy)
        verdicts.append((decision.fused, f"as {kind.name.lower()} over {ranks}: {decision.why}"))
    fuse = all(ok for ok, _ in verdicts)
    return fuse, "; ".join(why for _, why in verdicts)


def mesh_of_trace() -> tuple[dict | None, int]:
    """The mesh axes in scope (``jax.set_mesh``), if any, and the device count they span."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None, jax.device_count()
    axes = dict(mesh.shape)
    return axes, math.prod(axes.values())
