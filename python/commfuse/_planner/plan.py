"""``commfuse.plan``: the layout of a whole training step, chosen among
candidates compiled by XLA and priced by the cost model, under a memory
limit per device; and the `Plan` it returns (what was chosen and why,
against the layouts people train with, ready to place arguments and run).

The search (`plan`): every factorisation of the devices over the mesh axes
(and, where the model marks its activations, sequence-sharded or not) is
compiled once with the blocks recomputing everything; the fastest few that
fit are compiled again with each other remat policy and through
``overlap``, whose cost model decides each product's fused form and
schedule, or none, on the target machine. The baselines (pure DP, FSDP,
Megatron TP+SP, FSDP x TP, each plain and through ``overlap``) are
compiled as the step writes its remat. The plan is the fastest candidate
that fits; every candidate's figures are kept. On CPU devices (under the
link model) a candidate is priced as it runs there (`evaluate.as_run`).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import jax
import numpy as np

from .. import _abi
from .._decide import Machine
from .._decision import Call, Decision
from . import hooks, host, logical
from .evaluate import Evaluation, Step, evaluate, layout_of, make_mesh, program
from .space import AXES, Candidate, baselines, factorizations

GIB = 1 << 30


def size_text(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


@dataclass
class Row:
    """One evaluated candidate, as the plan's tables show it."""
    label: str
    mesh: list
    sequence_parallel: bool
    remat: str | None
    fused: bool
    predicted_s: float | None
    memory_bytes: int
    fits: bool
    compile_s: float
    error: str | None = None
    breakdown: dict = field(default_factory=dict)

    @classmethod
    def of(cls, e: Evaluation, limit: int | None) -> "Row":
        c = e.candidate
        fits = e.ok and (limit is None or e.memory_bytes <= limit)
        breakdown = {}
        if e.priced is not None:
            breakdown = {"compute_s": e.priced.compute_s, "exposed_comm_s": e.priced.exposed_comm_s,
                         "collectives": dict(e.priced.collectives), "fused_ops": e.priced.fused_ops}
        return cls(c.label(), [list(p) for p in c.mesh], c.sequence_parallel, c.remat, c.fused,
                   e.predicted_s if e.ok else None, e.memory_bytes, fits, round(e.compile_s, 2), e.error, breakdown)

    def candidate(self) -> Candidate:
        return Candidate(tuple((a, int(n)) for a, n in self.mesh), self.sequence_parallel, self.remat, self.fused)


@dataclass
class Plan:
    """What `commfuse.plan` chose for a step on `devices` devices of
    `machine`: the `mesh` (``((axis, size), ...)``), the logical axis
    `rules`, each argument leaf's sharding (`specs`), whether activations
    between blocks are sequence-sharded, the blocks' `remat` policy,
    whether the step runs `fused` (through ``overlap``) and the decision of
    each of its products' library calls (`decisions`); its
    `predicted_step_s` (the cost model on the target, from the compiled
    program) and `predicted_memory_bytes` per device (XLA's memory analysis
    of the CPU compile: an estimate for a GPU); the `baselines` (each
    layout people train with, plain and through ``overlap``), the
    `runners_up`, every candidate evaluated, and `why` it wins.

    ``plan.shard(args)`` places arguments as the plan says; ``plan.apply(step)``
    returns the jitted, sharded, overlapped step; ``str(plan)`` is a table;
    ``plan.to_json()`` / ``Plan.from_json(text)`` save and load it."""
    devices: int
    machine: str
    memory_limit: int | None
    mesh: tuple
    rules: tuple
    specs: list
    donate: tuple
    sequence_parallel: bool
    remat: str | None
    fused: bool
    decisions: list
    predicted_step_s: float
    predicted_memory_bytes: int
    baselines: dict
    runners_up: list
    candidates: list
    why: str
    planning_s: float
    notes: list = field(default_factory=list)

    @property
    def mesh_shape(self) -> dict:
        return dict(self.mesh)

    @property
    def candidate(self) -> Candidate:
        return Candidate(tuple(self.mesh), self.sequence_parallel, self.remat, self.fused)

    def make_mesh(self, devices=None) -> jax.sharding.Mesh:
        """The plan's mesh over `devices` (default: the first ``self.devices`` of JAX's)."""
        devices = list(jax.devices()[:self.devices] if devices is None else devices)
        if len(devices) != self.devices:
            raise ValueError(f"commfuse.Plan: the plan is for {self.devices} devices; {len(devices)} are here "
                             f"(JAX sees {len(jax.devices())})")
        return make_mesh(self.candidate, devices)

    def shardings(self, args, mesh=None):
        """The NamedSharding of each of `args`' leaves, as a tree like `args`."""
        mesh = mesh or self.make_mesh()
        leaves, treedef = jax.tree_util.tree_flatten(args)
        if len(leaves) != len(self.specs):
            raise ValueError(f"commfuse.Plan.shard: the plan was made for arguments of {len(self.specs)} leaves; "
                             f"these have {len(leaves)}")
        specs = [jax.sharding.PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in spec))
                 for spec in self.specs]
        return jax.tree_util.tree_unflatten(treedef, [jax.sharding.NamedSharding(mesh, s) for s in specs])

    def shard(self, args, mesh=None):
        """`args` (a tuple of the step's arguments) placed on the plan's mesh as the plan shards them."""
        return jax.device_put(args, self.shardings(args, mesh))

    def apply(self, step, mesh=None):
        """`step` jitted for the plan: its arguments sharded (and donated) as
        the plan says, traced under the plan's rules and remat policy, and,
        where the plan is fused, through ``overlap`` with the plan's
        decisions imposed. Call it with arguments placed by `shard`. Its
        first call for each argument signature traces and compiles the step,
        clearing JAX's caches first (their traces are not keyed on the
        plan's rules: a body traced under other rules would be reused)."""
        mesh = mesh or self.make_mesh()
        fn, _ = program(step, self.candidate, self.machine, imposed=self.decisions)
        jitted = jax.jit(fn, donate_argnums=self.donate)
        layout = layout_of(self.candidate, mesh)
        compiled: dict = {}

        def lower(*args):
            with hooks.tracing(layout):
                return jitted.lower(*args)

        def planned(*args):
            # Traced under the plan's layout once per argument signature (a
            # trace outside it would not see its rules and remat policy).
            key = jax.tree_util.tree_structure(args), tuple(
                (np.shape(a), str(a.dtype), getattr(a, "sharding", None)) for a in jax.tree_util.tree_leaves(args))
            if key not in compiled:
                compiled[key] = lower(*args).compile()
            return compiled[key](*args)

        planned.lower = lower
        planned.__name__ = getattr(step, "__name__", "step")
        return planned

    # -- the table ---------------------------------------------------------------
    def table(self) -> str:
        us = lambda s: "-" if s is None else (f"{s * 1e3:9.2f} ms" if s >= 1e-3 else f"{s * 1e6:9.1f} us")
        gib = lambda b: f"{size_text(b):>11}"
        limit = "none" if self.memory_limit is None else size_text(self.memory_limit)
        lines = [f"commfuse.plan: {self.devices} devices of {self.machine}, memory limit {limit} per device, "
                 f"planned in {self.planning_s:.1f} s",
                 f"  plan: {self.candidate.label()}: predicted {us(self.predicted_step_s).strip()} per step, "
                 f"{gib(self.predicted_memory_bytes).strip()} per device",
                 f"  {self.why}",
                 f"  {'layout':<58} {'step':>12} {'memory':>11}  fits"]
        for name, pair in self.baselines.items():
            for way, row in pair.items():
                lines.append(f"  {(name + ' (' + way + ')'):<58} {us(row['predicted_s']):>12} "
                             f"{gib(row['memory_bytes']):>11}  {_fits(row)}")
        lines.append(f"  {'runners-up':<58}")
        for row in self.runners_up:
            lines.append(f"  {row['label']:<58} {us(row['predicted_s']):>12} {gib(row['memory_bytes']):>11}  "
                         f"{_fits(row)}")
        fused = sum(1 for d in self.decisions if d.fused)
        lines.append(f"  {len(self.decisions)} library calls decided, {fused} fused; "
                     f"{len(self.candidates)} candidates compiled")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # -- JSON ------------------------------------------------------------------------
    def to_json(self, path=None) -> str:
        data = asdict(self)
        data["decisions"] = [_decision_json(d) for d in self.decisions]
        data["mesh"] = [list(p) for p in self.mesh]
        data["rules"] = [[name, list(axes) if isinstance(axes, tuple) else axes] for name, axes in self.rules]
        text = json.dumps(data, indent=1)
        if path is not None:
            with open(os.fspath(path), "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path) -> "Plan":
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            with open(os.fspath(text_or_path)) as f:
                text = f.read()
        data = json.loads(text)
        data["decisions"] = [_decision_of(d) for d in data["decisions"]]
        data["mesh"] = tuple((a, int(n)) for a, n in data["mesh"])
        data["rules"] = tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in data["rules"])
        data["donate"] = tuple(data["donate"])
        return cls(**data)


def _fits(row: dict) -> str:
    if row.get("error"):
        return "error"
    return "yes" if row["fits"] else "NO"


def _decision_json(d: Decision) -> dict:
    c = d.call
    return {"kind": c.kind.name, "ranks": c.ranks, "dimension": c.dimension, "x": list(c.x), "w": list(c.w),
            "dtype": c.dtype.name, "out_dtype": c.out_dtype.name, "schedule": d.schedule_name, "code": d.schedule,
            "why": d.why}


def _decision_of(d: dict) -> Decision:
    call = Call.of(_abi.Kind[d["kind"]], d["ranks"], d["dimension"], d["x"], d["w"], d["dtype"], d["out_dtype"])
    return Decision(call, int(d["code"]), d["why"], ())


# ----------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------
def plan(step, *example_args, devices: int = 8, memory_limit: int | None = None, machine: str = "h100_nvlink",
         axes=AXES, remat=hooks.REMAT_POLICIES, batch_argnums=(-1,), top: int = 2, log=None,
         cache: dict | None = None) -> Plan:
    """Chooses the layout of a training step (see the module's doc).

    ``step(*example_args)`` is one step, not jitted; `example_args` may be
    arrays or ``jax.ShapeDtypeStruct``s (nothing is allocated), with Flax's
    logical names where the model carries them. The batch is the argument
    at `batch_argnums` (its leading dim is the batch); the others are
    donated. `devices`: how many devices to plan for (JAX must see that
    many: on CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=N``);
    `memory_limit`: bytes per device (None: no limit); `machine`: the target
    (``"h100_nvlink"``, ``"h200_nvlink"``, ``"h100_pcie"``, ``"h100_cluster"``
    for nodes of 8 across a network, or ``"cpu_here"``, this host's CPU
    devices under the link model); `axes`: the mesh axes; `remat`: the
    policies of ``commfuse.remat_policy`` to try; `top`: how many of the
    fastest layouts to refine; `log(line)` hears progress; `cache`: a dict
    of evaluations to reuse between plans of the same step (planning again
    under another memory limit compiles nothing twice; kept apart by
    machine, devices and axes).
    The returned plan's ``evaluations`` (not saved) holds every candidate's
    `Evaluation`."""
    start = time.perf_counter()
    say = log or (lambda line: None)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"commfuse.plan: devices must be a positive int, got {devices!r}")
    if len(jax.devices()) < devices:
        raise ValueError(f"commfuse.plan: planning for {devices} devices compiles for {devices} devices, and JAX sees "
                         f"{len(jax.devices())}; on CPU start Python with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={devices}")
    if memory_limit is not None and not (isinstance(memory_limit, (int, float)) and memory_limit > 0):
        raise ValueError(f"commfuse.plan: memory_limit must be a positive number of bytes or None, got "
                         f"{memory_limit!r}")
    try:
        target = Machine.checked(machine)
    except ValueError as e:
        raise ValueError(f"commfuse.plan: machine: {e}") from None
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if not axes or len(set(axes)) != len(axes) or not all(isinstance(a, str) for a in axes):
        raise ValueError(f"commfuse.plan: axes must name distinct mesh axes, got {axes!r}")
    unknown = [r for r in remat if r not in hooks.REMAT_POLICIES]
    if unknown:
        raise ValueError(f"commfuse.plan: remat {unknown} not among {hooks.REMAT_POLICIES}")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"commfuse.plan: top must be a positive int, got {top!r}")
    if not example_args:
        raise ValueError("commfuse.plan: give the step's example arguments (arrays or jax.ShapeDtypeStructs)")
    batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    if any(not isinstance(a, int) or not -len(example_args) <= a < len(example_args) for a in batch_argnums):
        raise ValueError(f"commfuse.plan: batch_argnums {batch_argnums!r} must index the {len(example_args)} "
                         f"example arguments")

    names = logical.names_of(step, example_args, batch_argnums=batch_argnums)
    leaves, _, treedef = logical.leaves_with_names(example_args)
    n_args = len(example_args)
    batch = {a % n_args for a in batch_argnums}
    the_step = Step(step, leaves, treedef, names, tuple(a for a in range(n_args) if a not in batch))
    pool = jax.devices()[:devices]
    if target.is_cpu:
        # This host's CPU devices as XLA's runtime runs the step: its memory
        # rates measured, not assumed (`host`).
        target = Machine(host.with_measured_memory(target.spec, devices))
    gemm_gflops = target.gemm_gflops
    per_node = _abi.machine_summary(target.spec)["devices_per_node"]
    collectives = "blocking" if target.is_cpu else "async"
    notes = _name_notes(names)
    # A shared cache holds evaluations of several plans: of this step, on
    # this machine and this many devices, keyed by candidate.
    shared = {} if cache is None else cache.setdefault((target.spec, devices, axes), {})
    evaluated: dict = shared
    skipped: dict = {}

    seen: list = []  # the candidates of this plan, in the order judged

    def judge(candidate: Candidate) -> Evaluation:
        if candidate not in seen:
            seen.append(candidate)
        if candidate not in evaluated:
            e = evaluate(the_step, candidate, pool, machine=target.spec, gemm_gflops=gemm_gflops,
                         devices_per_node=per_node, collectives=collectives, priced_as_run=target.is_cpu)
            evaluated[candidate] = e
            say(f"  {candidate.label():<58} {_show(e, memory_limit)}")
        return evaluated[candidate]

    def fits(e: Evaluation) -> bool:
        return e.ok and (memory_limit is None or e.memory_bytes <= memory_limit)

    # Which of the model's knobs exist: a remat policy the planner sets (and
    # the step's own), and activations it can sequence-shard.
    meshes = factorizations(devices, axes)
    sp_matters, hook, own = _probe(the_step, meshes, pool)
    if not hook:
        notes.append("the step sets no commfuse.remat_policy: its blocks keep the remat it writes")
    first_remat = remat[0] if hook and remat else None
    say(f"commfuse.plan: {len(meshes)} meshes of {devices} devices over {axes}"
        + (", and sequence-parallel activations" if sp_matters else ""))

    def ranked():
        return sorted((evaluated[c] for c in seen if evaluated[c].ok), key=lambda e: (not fits(e), e.predicted_s))

    # Every mesh, its blocks recomputing the most (the least memory); then
    # the residual stream sequence-sharded on the fastest with a tensor axis.
    for mesh in meshes:
        c = Candidate(mesh, False, first_remat)
        specs = the_step.abstract(make_mesh(c, pool), c.rules())[1]
        if memory_limit is not None and the_step.bytes_per_device(specs, c.sizes) > memory_limit:
            # Not compiled (nor kept in `cache`: under a larger limit it is a candidate).
            skipped[c] = Evaluation(c, memory_bytes=the_step.bytes_per_device(specs, c.sizes),
                                    error="its arguments alone exceed the memory limit")
            continue
        judge(c)
    if sp_matters:
        for e in [e for e in ranked() if e.candidate.sizes.get("tensor", 1) > 1][:top + 1]:
            judge(e.candidate.with_(sequence_parallel=True))
    # The fastest few: each remat policy (in `remat`'s order, the policies
    # keeping more after one over the limit skipped: they need more), and
    # the best of them through overlap.
    for e in ranked()[:top]:
        base = e.candidate
        variants = [base]
        for r in (remat if hook else ()):
            v = judge(base.with_(remat=r))
            variants.append(v.candidate)
            if not fits(v):
                break
        best = min((evaluated[v] for v in variants), key=lambda x: (not fits(x), x.predicted_s))
        judge(best.candidate.with_(fused=True))

    table = {}
    for name, c in baselines(devices, axes).items():
        c = c.with_(remat=own)
        table[name] = {"plain": Row.of(judge(c), memory_limit).__dict__,
                       "fused": Row.of(judge(c.with_(fused=True)), memory_limit).__dict__}

    # This plan's candidates (a shared cache may hold others).
    mine = [evaluated[c] for c in seen] + list(skipped.values())
    pool_rows = sorted(mine, key=lambda e: (not fits(e), e.predicted_s if e.ok else math.inf))
    winner = pool_rows[0]
    if not winner.ok:
        raise ValueError("commfuse.plan: no candidate compiled: " +
                         "; ".join(f"{e.candidate.label()}: {e.error}" for e in pool_rows[:4]))
    if not fits(winner):
        notes.append(f"no candidate fits {size_text(memory_limit)}: the plan is the fastest of those that do not")
    decisions = winner.decisions  # a plain winner's are none
    mesh = make_mesh(winner.candidate, pool)
    specs = [[list(e) if isinstance(e, tuple) else e for e in spec]
             for spec in the_step.abstract(mesh, winner.candidate.rules())[1]]
    runners = [Row.of(e, memory_limit).__dict__ for e in pool_rows[1:4]]
    out = Plan(devices, target.spec, memory_limit, winner.candidate.mesh, winner.candidate.rules(), specs,
               the_step.donate, winner.candidate.sequence_parallel, winner.candidate.remat, winner.candidate.fused,
               decisions, winner.predicted_s, winner.memory_bytes, table, runners,
               [Row.of(e, memory_limit).__dict__ for e in pool_rows],
               _why(winner, table, mine, memory_limit), 0.0, notes)
    out.planning_s = time.perf_counter() - start
    out.evaluations = {e.candidate: e for e in mine}
    return out


def _show(e: Evaluation, limit) -> str:
    if not e.ok:
        return f"error: {e.error}"
    fit = "" if limit is None or e.memory_bytes <= limit else "  over the limit"
    return f"{e.predicted_s * 1e3:9.3f} ms {size_text(e.memory_bytes):>11}  ({e.compile_s:.1f} s){fit}"


def _why(winner: Evaluation, table: dict, evaluated: list, limit) -> str:
    """Why the winner wins: against the best baseline that fits, and the
    fastest candidate of all where that one does not fit."""
    fitting = [(name, way, row) for name, pair in table.items() for way, row in pair.items()
               if row["fits"] and row["predicted_s"] is not None]
    parts = []
    if fitting:
        name, way, row = min(fitting, key=lambda t: t[2]["predicted_s"])
        parts.append(f"{row['predicted_s'] / winner.predicted_s:.2f}x faster than the best baseline that fits "
                     f"({name}, {way}: {row['predicted_s'] * 1e3:.2f} ms)")
    else:
        parts.append("no baseline fits the memory limit")
    fastest = min((e for e in evaluated if e.ok), key=lambda e: e.predicted_s)
    if fastest is not winner and limit is not None and fastest.memory_bytes > limit:
        parts.append(f"the fastest candidate ({fastest.candidate.label()}, {fastest.predicted_s * 1e3:.2f} ms) needs "
                     f"{size_text(fastest.memory_bytes)}, over the limit")
    if winner.priced is not None:
        parts.append(f"compute {winner.priced.compute_s * 1e3:.2f} ms, exposed communication "
                     f"{winner.priced.exposed_comm_s * 1e3:.2f} ms")
    return "; ".join(parts)


def _name_notes(names) -> list:
    sources = {}
    for n in names:
        sources[n.source] = sources.get(n.source, 0) + 1
    return ["argument leaves named: " + ", ".join(f"{k} {v}" for k, v in sorted(sources.items()))]


def _probe(step: Step, meshes, pool) -> tuple:
    """What tracing the step (no compile) tells of its knobs: whether
    sequence-sharding the residual stream changes its program (its
    activations carry a "length" name: the traces differ), whether it asks
    ``commfuse.remat_policy`` (the planner's to set), and the policy it
    asks for by default (None: not one)."""
    tensor = [m for m in meshes if dict(m).get("tensor", 1) > 1]
    consulted = hooks.consultations()
    hooks.defaults_seen(reset=True)
    texts = []
    for sp in ((False, True) if tensor else (False,)):
        c = Candidate(tensor[0] if tensor else meshes[0], sp)
        mesh = make_mesh(c, pool)
        structs, _ = step.abstract(mesh, c.rules())
        args = jax.tree_util.tree_unflatten(step.treedef, structs)
        with hooks.tracing(layout_of(c, mesh)):
            texts.append(str(jax.make_jaxpr(step.fn)(*args)))
    hook = hooks.consultations() > consulted
    defaults = hooks.defaults_seen()
    own = next(iter(defaults)) if hook and len(defaults) == 1 else None
    return len(texts) == 2 and texts[0] != texts[1], hook, own
