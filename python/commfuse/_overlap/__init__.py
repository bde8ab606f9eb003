"""commfuse.overlap: rewrite plain collective + matmul pairs in shard_map bodies into fused ops.

``overlap(f)`` returns a function with ``f``'s signature and results. Calling
it traces ``f`` to a jaxpr, then evaluates that jaxpr with an interpreter that
re-creates every ``shard_map`` with a rewritten body in which these pairs are
replaced by commfuse's fused, overlapped ops:

* ``all_gather`` (tiled) whose result only feeds one ``dot_general``
  -> ``all_gather_matmul`` (the gathered operand is the activation) or
  ``matmul_all_gather`` (the gathered operand is the 2-D weight);
* ``dot_general`` whose result only feeds a ``reduce_scatter`` (``psum_scatter``)
  -> ``matmul_reduce_scatter``;
* ``all_to_all`` (tiled) only feeding a ``dot_general`` -> ``all_to_all_matmul``,
  and ``dot_general`` only feeding an ``all_to_all`` -> ``matmul_all_to_all``.

A ``dot_general`` qualifies when it is ``x @ w`` up to transposes and
flattening (``_dot_form.DotForm``: several contracting dims, weights of rank
> 2, either operand as ``x``), or a grouped matmul with up to 16 batches (one
fused call per batch). A dot with a gather into it and a sum of its result
over another axis may run as tiles that hide both (``_both_sides``).
Everything else is evaluated unchanged. Each candidate's fused op is decided
from its shapes before anything is traced (`_op.OpDecision`): one it refuses,
or ``auto`` declines, keeps the original equations, and the report says why.

Bodies of ``jit``/``closed_call``/``checkpoint`` are interpreted in place, and
``cond``/``scan``/``while`` are rebuilt with ``lax.switch``/``lax.scan``/
``lax.while_loop`` around rewritten bodies, unless their predicate varies
across ranks (ranks could then take different paths, and a fused op waits for
every rank of its axes). Candidates inside any other higher-order primitive
(``custom_jvp_call``, ``custom_vjp_call``, ...) are left as they are and
reported. A pattern may span ``pvary`` casts (JAX inserts them between a dot
and a ``psum_scatter`` of replicated operands, or on 2-D meshes). If
re-creating a ``shard_map`` (or a ``scan``/``cond``/``while``) fails for any
reason, the original is kept and the reason reported.

Outside any trace, the rewritten program runs under ``jax.jit`` (one compiled
program per argument signature, as ``jax.jit(f)`` would); inside a trace
(``jax.jit``, ``jax.grad``, ``jax.make_jaxpr``, a ``shard_map`` body) it is
traced in place.
"""

from __future__ import annotations

import functools
import types
from typing import NamedTuple

import jax
import numpy as np

from .. import _abi, _matmul
from .._decide import Machine, Policy
from .._decision import NONE, Call, Decision
from .._op import OpDecision
from . import inplace
from .interpret import interpret
from .state import State

__all__ = ["overlap", "Overlap"]


# ----------------------------------------------------------------------------
# The public entry point
# ----------------------------------------------------------------------------
# Leaves traced as arguments; the rest (Python scalars, strings, ...) are
# static, as if named in jit's static_argnums. A `jax.Ref` is an argument:
# the traced program updates it in place.
_DYNAMIC = tuple(t for t in (jax.Array, np.ndarray, np.generic, jax.core.Tracer, getattr(jax, "Ref", None))
                 if t is not None)


def _is_dynamic(leaf) -> bool:
    return isinstance(leaf, _DYNAMIC)


def _named_like(fun, call):
    """`call` (which takes the arrays among `fun`'s arguments, flattened)
    under `fun`'s name: JAX names the compiled module, its profile and its
    errors ("argument arrays[0] of step") after it."""
    def arrays_of(*arrays):
        return call(*arrays)

    arrays_of.__name__ = arrays_of.__qualname__ = getattr(fun, "__name__", type(fun).__name__)
    return arrays_of


def _is_number(leaf) -> bool:
    """A Python number (not a bool: a flag)."""
    return isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool)


_TRACED, _STATIC = object(), object()
# What tracing a Python number raises where it shapes the program.
_SHAPES_THE_PROGRAM = (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                       jax.errors.TracerIntegerConversionError)


def _in_manual_context() -> bool:
    try:
        mesh = jax.sharding.get_abstract_mesh()
        return bool(not mesh.empty and mesh.manual_axes)
    except Exception:  # noqa: BLE001 - older JAX without abstract meshes
        return False


def _layout(leaves):
    """The shardings of `leaves`, as a key (a spec's trailing unsharded dims
    dropped: JAX compiles ``P('tp')`` and ``P('tp', None)`` once)."""
    def key(sharding):
        spec = getattr(sharding, "spec", None)
        if spec is None:
            return sharding
        entries = list(spec)
        while entries and entries[-1] is None:
            entries.pop()
        return type(sharding), getattr(sharding, "mesh", None), tuple(entries), getattr(sharding, "memory_kind", None)

    layout = tuple(key(getattr(leaf, "sharding", None)) for leaf in leaves)
    try:
        hash(layout)
    except TypeError:
        return None
    return layout



def overlap(fun=None, *, schedule: str = "auto", report: bool = False, logger=None, machine: str | None = None,
            decisions=None):
    """Returns ``fun`` with its shard_map collective/matmul pairs fused into commfuse ops.

    The result has ``fun``'s signature and results. Each call traces ``fun``
    (``jax.make_jaxpr``) and re-creates its ``shard_map`` bodies with these
    pairs replaced by fused, overlapped ops:

    ==========================================  ===================================
    pattern (inside ``jax.shard_map``)            becomes
    ==========================================  ===================================
    ``all_gather(x, tiled=True) @ w``             ``commfuse.all_gather_matmul``
    ``x @ all_gather(w, tiled=True)``             ``commfuse.matmul_all_gather``
    ``psum_scatter(x @ w, tiled=True)``           ``commfuse.matmul_reduce_scatter``
    ``all_to_all(x, tiled=True) @ w``             ``commfuse.all_to_all_matmul``
    ``all_to_all(x @ w, tiled=True)``             ``commfuse.matmul_all_to_all``
    ==========================================  ===================================

    where the collective's result is used only by the dot (or the dot's only by
    the collective), and the ``dot_general`` is ``x @ w`` up to transposes and
    flattening, or a grouped matmul (one fused call per batch). Outside
    shard_map bodies, under ``jax.jit``, every such dot becomes
    ``commfuse.matmul``. Anything else runs unchanged.

    ``schedule`` is given to every fused op the rewrite makes: ``"auto"`` (the
    cost model's pick per op, which may be to leave a pair unfused where it
    predicts no gain), or any other schedule, which fuses every candidate it
    can (``"ring"``, ``"bidirectional"``, ...; ``"unfused"`` keeps them all as
    they were). ``machine`` is the machine ``"auto"`` decides for (a preset
    of ``commfuse.explain``; default: the one the program runs on).
    ``decisions`` imposes decisions made outside (``Plan.decisions`` of
    ``commfuse.plan``, another overlap's ``last_decisions``, or ``(call,
    schedule)`` pairs): a library call they name runs as they say, the
    others as ``schedule`` says; with them (even none), each dot under
    ``jax.jit`` is decided once its shardings are known, as a plan's were.

    ``report=True`` prints one line per rewrite, per collective left
    unchanged (with the reason) and per shard_map body without candidates;
    ``logger`` (a ``logging.Logger``) gets the same lines through
    ``logger.info``. The returned object keeps the lines of its latest
    trace in ``last_report``, and the decisions behind them in
    ``last_decisions``.

    What ``fun`` does besides returning values happens as without
    ``overlap``: in-place updates of its arguments (Flax NNX modules and
    optimizers, ``nnx.Rngs``, dict and list entries) are written back into
    the caller's objects, ``jax.Ref`` updates and callbacks
    (``io_callback``, ``jax.debug.print``) are part of the traced program.
    What cannot be carried back (a new attribute, a changed Python value) is
    an ``InPlaceUpdateError`` naming the argument.

    Composes with ``jax.jit``, ``nnx.jit`` (either way round) and ``jax.grad``.
    """
    if fun is None:
        return functools.partial(overlap, schedule=schedule, report=report, logger=logger, machine=machine,
                                 decisions=decisions)
    if not callable(fun):
        raise TypeError(f"commfuse.overlap: expected a callable, got {fun!r}")
    if schedule not in _abi.SCHEDULES or schedule in _abi.CUT_SCHEDULES:
        options = ", ".join(repr(s) for s in _abi.SCHEDULES if s not in _abi.CUT_SCHEDULES)
        raise ValueError(f"commfuse.overlap: unknown schedule {schedule!r}; expected one of {options}")
    spec = None
    if machine is not None:
        try:
            spec = Machine.checked(machine).spec
        except ValueError as e:
            raise ValueError(f"commfuse.overlap: machine: {e}") from None
    # Decisions made elsewhere (a plan's) were made on the products' known
    # shardings: with them, dots under jit are decided once partitioned too.
    policy = Policy(machine=spec, strict=False, imposed=_imposed(decisions), early=decisions is None)
    return Overlap(fun, schedule, policy, report, logger)


def library_decisions(decisions) -> list:
    """The library calls' `Decision`s among `decisions` (an overlap's
    `last_decisions`: `OpDecision`s and `Partitioned` entries, or
    `Decision`s), in order; calls with nothing to run left out."""
    calls = []
    for d in decisions:
        if isinstance(d, OpDecision):
            calls.extend(d.calls)
        elif isinstance(d, _matmul.Partitioned):
            calls.extend(d.decided.calls)
        elif isinstance(d, Decision):
            calls.append(d)
        else:
            raise TypeError(f"commfuse.overlap: decisions must hold decisions (a plan's, or an overlap's "
                            f"last_decisions) or (call, schedule) pairs, got {d!r}")
    return [c for c in calls if c.schedule != NONE]


def _imposed(decisions) -> tuple:
    """`decisions` as ``((Call, schedule code), ...)``: from decisions (see
    `library_decisions`), a mapping of calls to schedules, or ``(call,
    schedule)`` pairs, a schedule a name or a code the library runs."""
    if decisions is None:
        return ()
    if isinstance(decisions, dict):
        pairs = list(decisions.items())
    else:
        pairs, others = [], []
        for item in decisions:
            is_pair = type(item) is tuple and len(item) == 2 and isinstance(item[0], Call)
            (pairs if is_pair else others).append(item)
        pairs += [(d.call, d.schedule) for d in library_decisions(others)]
    imposed = {}
    for call, schedule in pairs:
        if not isinstance(call, Call):
            raise TypeError(f"commfuse.overlap: decisions: {call!r} is not a library call (commfuse Call)")
        code = _abi.SCHEDULES.get(schedule) if isinstance(schedule, str) else schedule
        if isinstance(code, (bool, np.bool_)) or not isinstance(code, (int, np.integer)) or not _runs(int(code)):
            raise ValueError(f"commfuse.overlap: decisions: the schedule imposed on {call.describe()} must be one "
                             f"a call runs (a schedule name but 'auto', or its code), got {schedule!r}")
        if imposed.get(call, int(code)) != int(code):
            raise ValueError(f"commfuse.overlap: decisions: {call.describe()} is imposed both "
                             f"{_abi.schedule_name(imposed[call])} and {_abi.schedule_name(int(code))}")
        imposed[call] = int(code)
    return tuple(imposed.items())


def _runs(code: int) -> bool:
    """Whether a call can run under schedule `code` (not "auto": a choice, not a schedule)."""
    base = code & 0xFF
    known = base in _abi.SCHEDULES.values() and base != _abi.AUTO
    return known and (bool(_abi.cut_schedule(code)) == (_abi.chunks_of(code) > 0))


class _Compiled(NamedTuple):
    """One jitted program of an `Overlap` (one argument signature) and what
    its trace recorded: `state` (its report lines and decisions), `out_box`
    (its results' structure and in-place updates), `by_layout` (each layout
    it was compiled for: its report)."""
    fn: object
    state: State
    out_box: list
    by_layout: dict


class Overlap:
    """``overlap(fun)``: calls ``fun`` with its collective/matmul pairs
    fused. It owns its compiled programs (one per argument signature, as
    ``jax.jit(fun)`` keeps them) and its report: the lines of its latest
    trace and compile (`last_report`), the decisions behind them
    (`last_decisions`), and what each ``commfuse.matmul`` it made became once
    partitioned (`last_partitioned`)."""

    def __init__(self, fun, schedule: str, policy: Policy, report: bool, logger):
        # Not `fun`'s __dict__: a jit or pmap object's own `lower` and `trace`
        # there would show its program, not the rewritten one.
        functools.update_wrapper(self, fun, updated=())
        self._fun, self._schedule, self._print, self._logger = fun, schedule, report, logger
        # The partitioner's entries of this object's products (its backward
        # ones included, made later by JAX's transpose) come to `hear`.
        self._policy = policy._replace(owner=_matmul.register(self))
        self._cache: dict = {}
        # Where a Python number among the arguments is traced rather than
        # static: (treedef, leaf index) -> the first value seen there, or
        # _TRACED / _STATIC once decided (`_traced_numbers`).
        self._numbers: dict = {}
        # The latest report: its trace's lines and decisions, and the
        # partitioner's entries heard since (`_matmul.Partitioned`, `Traced`)
        # with their lines.
        self._lines: list = []
        self._decisions: list = []
        self._after: list = []
        # Calls compiling now: each gathers the entries its compile makes.
        self._compiling: list = []

    def __get__(self, instance, owner=None):
        """As a method, bound to its instance (as the function it wraps would
        be: its report still reachable through the bound method)."""
        return self if instance is None else types.MethodType(self, instance)

    # -- the report ----------------------------------------------------------
    @property
    def last_report(self) -> list:
        return list(self._lines) + [line for line, _ in self._after]

    @property
    def last_partitioned(self) -> list:
        return [entry for _, entry in self._after if isinstance(entry, _matmul.Partitioned)]

    @property
    def last_decisions(self) -> list:
        """The latest trace's decisions: each fused op of its shard_map bodies
        (`_op.OpDecision`), then each ``commfuse.matmul`` once partitioned
        (`_matmul.Partitioned`, its decisions in ``.decided``)."""
        return list(self._decisions) + self.last_partitioned

    def _say(self, line: str) -> None:
        if self._print:
            print(line)
        if self._logger is not None:
            self._logger.info(line)

    def _show(self, lines, decisions, after) -> None:
        self._lines, self._decisions, self._after = list(lines), list(decisions), list(after)
        for line in self.last_report:
            self._say(line)

    def hear(self, entry) -> None:
        """An entry of the partitioner (`_matmul._record`) for one of this object's products."""
        where = "partitioned" if isinstance(entry, _matmul.Partitioned) else "backward"
        item = (f"overlap[{where}]: {entry.line()}", entry)
        if self._compiling:
            self._compiling[-1].append(item)
            return
        # Compiled by the caller's jit, after this object's trace.
        if isinstance(entry, _matmul.Partitioned) and any(p.site == entry.site for p in self.last_partitioned):
            # Compiled again (another layout of the same trace): this
            # compile's entries replace the last one's.
            self._after = [(line, e) for line, e in self._after if not isinstance(e, _matmul.Partitioned)]
        self._after.append(item)
        self._say(item[0])

    # -- calls ---------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        ties = inplace.alias_groups((args, kwargs), treedef)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves) or _in_manual_context():
            # Inside a trace (jit, grad, make_jaxpr, a shard_map body): trace
            # in place; what the caller's trace left as Python values is static.
            dyn = [leaf for leaf in leaves if _is_dynamic(leaf)]
            static = tuple((j, type(leaf), leaf) for j, leaf in enumerate(leaves) if not _is_dynamic(leaf))
            state, out_box = self._state(), [None, None, None]
            outs = self._rewritten(treedef, static, ties, len(leaves), state, out_box, *dyn)
            self._show(state.lines, state.decisions, [])
            return self._finish(out_box, outs, (args, kwargs), treedef)
        traced, newly = self._traced_numbers(treedef, leaves)
        try:
            return self._concrete(args, kwargs, leaves, treedef, ties, traced)
        except _SHAPES_THE_PROGRAM:
            if not newly:
                raise
            for j in newly:  # it shapes the program (a Python `if`, a size): static after all
                self._numbers[(treedef, j)] = _STATIC
            return self._concrete(args, kwargs, leaves, treedef, ties, traced - newly)

    def _state(self) -> State:
        return State(self._schedule, self._policy)

    def _rewritten(self, treedef, static, ties, n_leaves, state, out_box, *dyn):
        """Traces ``fun`` and evaluates the rewritten program on ``dyn`` (the array leaves)."""
        static_at = {j: leaf for j, _, leaf in static}
        fun = self._fun

        def flat_fun(*dyn_args):
            it = iter(dyn_args)
            leaves = [static_at[j] if j in static_at else next(it) for j in range(n_leaves)]
            traced_args = inplace.tie(jax.tree.unflatten(treedef, leaves), treedef, ties)
            args, kwargs = traced_args
            out_leaves, out_tree = jax.tree.flatten(fun(*args, **kwargs))
            # What `fun` did to its (copied) arguments in place goes out as
            # extra results, to be written back into the caller's objects.
            updates, updated = inplace.find(treedef, leaves, traced_args, _is_dynamic)
            # Leaves that are no arrays (a Python int, a string) come back as they are.
            out_box[:] = [out_tree, {j: leaf for j, leaf in enumerate(out_leaves) if not _is_dynamic(leaf)}, updates]
            return [leaf for leaf in out_leaves if _is_dynamic(leaf)] + updated

        closed = jax.make_jaxpr(flat_fun)(*dyn)
        state.__init__(self._schedule, self._policy)
        manual = _in_manual_context()  # fun is (part of) a shard_map body itself
        outs = interpret(closed.jaxpr, list(closed.consts), list(dyn), state, "body" if manual else "", manual)
        if not state.shard_maps and not state.jit_dots and not manual:
            state.lines.append("overlap: the traced function has no shard_map and no dot_general outside one; "
                               "nothing was rewritten")
        state.fresh = True
        return outs

    @staticmethod
    def _finish(out_box, outs, root, treedef):
        """``fun``'s results from the program's outputs, after writing its
        in-place updates back into the caller's arguments `root`."""
        out_tree, static_out, updates = out_box
        n_updates = len(updates.indices)
        results, updated = (outs[:len(outs) - n_updates], outs[len(outs) - n_updates:]) if n_updates else (outs, [])
        if n_updates:
            inplace.check_writable(root, treedef, updates)
            inplace.write_back(root, treedef, updates, updated)
        it = iter(results)
        n = out_tree.num_leaves
        return jax.tree.unflatten(out_tree, [static_out[j] if j in static_out else next(it) for j in range(n)])

    def _traced_numbers(self, treedef, leaves) -> tuple[set, set]:
        """The positions of Python numbers to trace, and those among them
        traced from this call on. A number is static (a flag, a count that
        shapes the program) until its position takes a second value (a
        learning rate from a schedule, a step count): from then on it is
        traced, as ``jax.jit`` traces Python numbers, so a new value does
        not compile the program again."""
        newly = set()
        for j, leaf in enumerate(leaves):
            if not _is_number(leaf):
                continue
            seen = self._numbers.setdefault((treedef, j), leaf)
            if seen is not _TRACED and seen is not _STATIC and seen != leaf:
                self._numbers[(treedef, j)] = _TRACED
                newly.add(j)
        return {j for j in range(len(leaves)) if self._numbers.get((treedef, j)) is _TRACED}, newly

    def _concrete(self, args, kwargs, leaves, treedef, ties, traced):
        """A call on concrete arguments: one jitted program per static part
        and per argument signature (what a trace of `fun` records, its
        results' structure and in-place updates, belongs to that trace
        alone). Strings, Python numbers not in `traced`, ... are static."""
        dynamic = [_is_dynamic(leaf) or j in traced for j, leaf in enumerate(leaves)]
        dyn = [leaf for leaf, d in zip(leaves, dynamic) if d]
        static = tuple((j, type(leaf), leaf) for j, (leaf, d) in enumerate(zip(leaves, dynamic)) if not d)
        signature = tuple((tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf))),
                           bool(getattr(leaf, "weak_type", False))) for leaf in dyn)
        try:
            key = (treedef, static, ties, signature)
            hash(key)
        except TypeError:  # unhashable static leaves: no reuse
            key = None
        entry = self._cache.get(key) if key is not None else None
        if entry is None:
            state, out_box = self._state(), [None, None, None]
            state.fresh = False
            fn = jax.jit(_named_like(self._fun, functools.partial(self._rewritten, treedef, static, ties, len(leaves),
                                                                  state, out_box)))
            entry = _Compiled(fn, state, out_box, {})
            if key is not None:
                if len(self._cache) >= 64:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = entry
        self._compiling.append([])
        try:
            outs = entry.fn(*dyn)
        except _SHAPES_THE_PROGRAM:
            if key is not None:
                self._cache.pop(key, None)
            raise
        finally:
            heard = self._compiling.pop()
        # One trace may serve several layouts of these shapes (explicit axes
        # trace each anew), and jit compiles each layout on its own: each
        # has its own report.
        layout = _layout(dyn)
        state = entry.state
        if state.fresh or heard:  # traced or compiled (again) by this call
            state.fresh = False
            entry.by_layout[layout] = (list(state.lines), list(state.decisions), heard)
            self._show(*entry.by_layout[layout])
        elif layout in entry.by_layout:  # else: a layout JAX took for one it had compiled; the report stands
            lines, decisions, after = entry.by_layout[layout]
            self._lines, self._decisions, self._after = list(lines), list(decisions), list(after)
        return self._finish(entry.out_box, outs, (args, kwargs), treedef)


