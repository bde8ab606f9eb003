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
Everything else is evaluated unchanged. When a fused op refuses its operands at
trace time, the original equations are kept and the reason is reported.

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
import itertools

import jax
import numpy as np

from .. import _fused, _matmul
from . import inplace
from .interpret import interpret
from .state import State

__all__ = ["overlap"]

_owners = itertools.count(1)


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


def overlap(fun=None, *, schedule: str = "auto", report: bool = False, logger=None):
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
    they were).

    ``report=True`` prints one line per rewrite, per collective left
    unchanged (with the reason) and per shard_map body without candidates;
    ``logger`` (a ``logging.Logger``) gets the same lines through
    ``logger.info``. The returned function keeps the lines of its latest
    trace in its ``last_report`` attribute.

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
        return functools.partial(overlap, schedule=schedule, report=report, logger=logger)
    if not callable(fun):
        raise TypeError(f"commfuse.overlap: expected a callable, got {fun!r}")
    if schedule not in _fused.SCHEDULES or schedule in _fused.CUT_SCHEDULES:
        options = ", ".join(repr(s) for s in _fused.SCHEDULES if s not in _fused.CUT_SCHEDULES)
        raise ValueError(f"commfuse.overlap: unknown schedule {schedule!r}; expected one of {options}")

    jitted_cache: dict = {}
    # The commfuse.matmul calls this function's traces made (forward, and the
    # backward ones JAX's transpose of them makes) carry `owner`; the lines
    # their partitioning reports while a call compiles them go to `compiling`.
    owner = next(_owners)
    compiling: list = []

    def say(line):
        if report:
            print(line)
        if logger is not None:
            logger.info(line)

    def emit(lines, partitioned=()):
        wrapper.last_report = list(lines)
        wrapper.last_partitioned = list(partitioned)
        for line in lines:
            say(line)

    def on_partitioned(entry):
        if entry.owner != owner:
            return
        where = "partitioned" if isinstance(entry, _matmul.Partitioned) else "backward"
        line = f"overlap[{where}]: {entry.line()}"
        partitioned = [entry] if isinstance(entry, _matmul.Partitioned) else []
        if compiling:
            compiling[-1][0].append(line)
            compiling[-1][1].extend(partitioned)
        else:  # compiled by the caller's jit, after this function's trace
            if partitioned and any(p.site == entry.site for p in wrapper.last_partitioned):
                # Compiled again (another layout of the same trace): this
                # compile's lines replace the last one's.
                wrapper.last_report = [ln for ln in wrapper.last_report if not ln.startswith("overlap[partitioned]")]
                wrapper.last_partitioned = []
            wrapper.last_report.append(line)
            wrapper.last_partitioned.extend(partitioned)
            say(line)

    def rewritten(treedef, static, ties, n_leaves, state, out_box, *dyn):
        """Traces ``fun`` and evaluates the rewritten program on ``dyn`` (the array leaves)."""
        static_at = {j: leaf for j, _, leaf in static}

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
        state.__init__(schedule, owner)
        manual = _in_manual_context()  # fun is (part of) a shard_map body itself
        outs = interpret(closed.jaxpr, list(closed.consts), list(dyn), state, "body" if manual else "", manual)
        if not state.shard_maps and not state.jit_dots and not manual:
            state.lines.append("overlap: the traced function has no shard_map and no dot_general outside one; "
                               "nothing was rewritten")
        state.fresh = True
        return outs

    def finish(out_box, outs, root, treedef):
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

    # Where a Python number among the arguments is traced rather than
    # static: (treedef, leaf index) -> the first value seen there, or
    # _TRACED / _STATIC once decided (`traced_numbers`).
    numbers: dict = {}

    def traced_numbers(treedef, leaves) -> tuple[set, set]:
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
            seen = numbers.setdefault((treedef, j), leaf)
            if seen is not _TRACED and seen is not _STATIC and seen != leaf:
                numbers[(treedef, j)] = _TRACED
                newly.add(j)
        return {j for j in range(len(leaves)) if numbers.get((treedef, j)) is _TRACED}, newly

    # Not `fun`'s __dict__: a jit or pmap object's own `lower` and `trace`
    # there would show its program, not the rewritten one.
    @functools.wraps(fun, updated=())
    def wrapper(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        ties = inplace.alias_groups((args, kwargs), treedef)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves) or _in_manual_context():
            # Inside a trace (jit, grad, make_jaxpr, a shard_map body): trace
            # in place; what the caller's trace left as Python values is static.
            dyn = [leaf for leaf in leaves if _is_dynamic(leaf)]
            static = tuple((j, type(leaf), leaf) for j, leaf in enumerate(leaves) if not _is_dynamic(leaf))
            state, out_box = State(schedule, owner), [None, None, None]
            outs = rewritten(treedef, static, ties, len(leaves), state, out_box, *dyn)
            emit(state.lines)
            return finish(out_box, outs, (args, kwargs), treedef)
        traced, newly = traced_numbers(treedef, leaves)
        try:
            return concrete(args, kwargs, leaves, treedef, ties, traced)
        except _SHAPES_THE_PROGRAM:
            if not newly:
                raise
            for j in newly:  # it shapes the program (a Python `if`, a size): static after all
                numbers[(treedef, j)] = _STATIC
            return concrete(args, kwargs, leaves, treedef, ties, traced - newly)

    def concrete(args, kwargs, leaves, treedef, ties, traced):
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
        entry = jitted_cache.get(key) if key is not None else None
        if entry is None:
            state, out_box = State(schedule, owner), [None, None, None]
            state.fresh = False
            fn = jax.jit(_named_like(fun, functools.partial(rewritten, treedef, static, ties, len(leaves), state,
                                                            out_box)))
            entry = (fn, state, out_box, {})
            if key is not None:
                if len(jitted_cache) >= 64:
                    jitted_cache.pop(next(iter(jitted_cache)))
                jitted_cache[key] = entry
        fn, state, out_box, by_layout = entry
        compiling.append(([], []))
        try:
            outs = fn(*dyn)
        except _SHAPES_THE_PROGRAM:
            if key is not None:
                jitted_cache.pop(key, None)
            raise
        finally:
            lines, partitioned = compiling.pop()
        # One trace may serve several layouts of these shapes (explicit axes
        # trace each anew), and jit compiles each layout on its own: each
        # has its own report.
        layout = _layout(dyn)
        if state.fresh or lines or partitioned:  # traced or compiled (again) by this call
            state.fresh = False
            by_layout[layout] = (list(state.lines) + lines, partitioned)
            emit(*by_layout[layout])
        elif layout in by_layout:  # else: a layout JAX took for one it had compiled; the report stands
            report, partitioned = by_layout[layout]
            wrapper.last_report, wrapper.last_partitioned = list(report), list(partitioned)
        return finish(out_box, outs, (args, kwargs), treedef)

    wrapper.last_report = []
    # What each commfuse.matmul this function's latest trace made became
    # once partitioned (`_matmul.Partitioned`: its `fused` library calls).
    wrapper.last_partitioned = []
    wrapper._on_partitioned = on_partitioned  # held here: the partitioner's listeners are weak
    _matmul.listen(on_partitioned)
    return wrapper
