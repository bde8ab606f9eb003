"""The interpreter: evaluates a jaxpr, re-creating shard_maps (and the
scans, conds and whiles inside them) around rewritten bodies; outside
shard_map bodies, dot_generals become ``commfuse.matmul`` (``jitdots``)."""

from __future__ import annotations

from functools import partial

import jax
from jax.extend import core as jcore

from .. import _compat, _fused
from .jaxpr import CALLS, CANDIDATES, DOT, REMAT, bind_eqn, closed, collective_axes, describe_collective, is_literal
from .jaxpr import shard_map_call, subjaxprs, vma
from .jitdots import Regrouping
from . import variance
from .rewrite import Rewriter
from .state import State


def interpret(jaxpr, consts, args, state: State, where: str, manual: bool):
    """Evaluates ``jaxpr``; inside a shard_map body (``manual``) fuses the patterns it finds."""
    env = {}

    def read(v):
        return v.val if is_literal(v) else env[v]

    def write(v, val):
        if not isinstance(v, jcore.DropVar):
            env[v] = val

    for v, val in zip(jaxpr.constvars, consts):
        write(v, val)
    for v, val in zip(jaxpr.invars, args):
        write(v, val)

    if manual:
        rewriter = Rewriter(jaxpr, state, where, read, write, env.__contains__,
                            partial(eval_eqn, state=state, where=where, manual=True))
        rewriter.run()
        return [rewriter.read(v) for v in jaxpr.outvars]
    regrouping = Regrouping(jaxpr)
    for i, eqn in enumerate(jaxpr.eqns):
        if i in regrouping.done:
            continue
        with _compat.source_context(eqn):
            if eqn.primitive.name == DOT:  # outside any shard_map body
                outs = regrouping.eval(i, read, write, state, where)
            else:
                outs = eval_eqn(eqn, [read(v) for v in eqn.invars], state=state, where=where, manual=manual)
        for v, val in zip(eqn.outvars, outs):
            write(v, val)
    return [read(v) for v in jaxpr.outvars]


def eval_eqn(eqn, invals, *, state: State, where: str, manual: bool):
    """One equation that is not part of a pattern: recursing where rewrites may hide."""
    name = eqn.primitive.name
    params = eqn.params
    if name == "shard_map":
        return _eval_shard_map(eqn, invals, state, where)
    subs = list(subjaxprs(params))
    if not subs or not any(state.needs_work(s, manual) for s in subs):
        return bind_eqn(eqn, invals)
    here = f"{where}/{name}"
    if name in CALLS:
        key = "jaxpr" if "jaxpr" in params else "call_jaxpr"
        jaxpr, consts = closed(params[key])
        # Inlined, a nested jit's in/out shardings stay as constraints: the
        # program keeps its layouts whether or not anything inside is fused.
        invals = _constrained(invals, params.get("in_shardings", ()))
        outs = interpret(jaxpr, consts, invals, state, here, manual)
        return _constrained(outs, params.get("out_shardings", ()))
    divergent = manual and _divergent(eqn, state)
    if divergent:
        for sub in subs:
            _report_untouched(sub, state, here, divergent)
        return bind_eqn(eqn, invals)
    rebuild = {"scan": _eval_scan, "cond": _eval_cond, "while": _eval_while}.get(name)
    if name in REMAT and "jaxpr" in params:
        rebuild = _eval_remat
    if rebuild is not None:
        mark = state.mark()
        try:
            return rebuild(params, invals, state, here, manual)
        except Exception as e:  # noqa: BLE001 - never worse than the original program
            state.undo(mark)
            for sub in subs:
                _report_untouched(sub, state, here, f"{name} left unchanged: {type(e).__name__}: {e}")
            return bind_eqn(eqn, invals)
    # Any other higher-order primitive (custom_jvp_call, custom_vjp_call, ...):
    # its semantics hang on its params, so it is bound as it is.
    if manual:
        for sub in subs:
            _report_untouched(sub, state, here, f"inside {name}, which overlap does not rewrite")
    return bind_eqn(eqn, invals)


def _constrained(values, shardings):
    """`values`, each constrained to its entry of a jit's `shardings` where
    that entry is a sharding (not left to the partitioner)."""
    if not shardings:
        return list(values)
    return [jax.lax.with_sharding_constraint(v, s) if isinstance(s, jax.sharding.Sharding) else v
            for v, s in zip(values, shardings)]


def _divergent(eqn, state: State) -> str | None:
    """Why the ranks of a collective inside a cond/while may take different
    paths through it (a fused op needs every rank of its axes): its
    predicate may differ between devices of those axes, by its type or by
    what it is computed from (`variance`). A predicate that differs only
    over other axes (a pipeline stage's) keeps each group together."""
    name = eqn.primitive.name
    if name == "cond":
        pred, what = eqn.invars[0], "cond predicate"
    elif name == "while":
        pred, what = eqn.params["cond_jaxpr"].jaxpr.outvars[0], "while_loop condition"
    else:
        return None
    pred_axes = variance.axes_of(state.axes, pred) | vma(pred.aval)
    inside = frozenset(a for sub in subjaxprs(eqn.params) for a in _collective_axes_in(sub))
    clash = inside & pred_axes if variance.EVERY not in pred_axes else inside
    if not clash:
        return None
    return (f"the {what} may differ between the devices of mesh axes {tuple(sorted(clash))} that collectives "
            f"inside it span, so ranks may take different paths and a fused op waits for every rank; not rewritten")


def _collective_axes_in(jaxpr) -> set:
    """The mesh axes of the candidate collectives in `jaxpr` and the jaxprs inside it."""
    axes = set()
    for e in jaxpr.eqns:
        if e.primitive.name in CANDIDATES:
            axes.update(collective_axes(e))
        for sub in subjaxprs(e.params):
            axes |= _collective_axes_in(sub)
    return axes


def _report_untouched(jaxpr, state: State, where: str, reason: str):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in CANDIDATES:
            state.lines.append(f"overlap[{where}]: no match: {describe_collective(eqn)}: {reason}")
        for sub in subjaxprs(eqn.params):
            _report_untouched(sub, state, where, reason)


def _eval_shard_map(eqn, invals, state: State, where: str):
    state.shard_maps += 1
    here = f"{where}/shard_map#{state.shard_maps - 1}".lstrip("/")
    body, consts = closed(eqn.params["jaxpr"])
    if not state.needs_work(body, True):
        state.lines.append(f"overlap[{here}]: no collective in this body; nothing to fuse")
        return bind_eqn(eqn, invals)
    mark = state.mark()
    variance.fill(body, [variance.spec_axes(s) for s in eqn.params.get("in_specs", ())], state.axes)

    def body_fn(*args):
        return tuple(interpret(body, consts, args, state, here, True))

    # The axes whose groups span processes (CPU devices of a multi-process
    # job: their candidates are decided unfused, and say why) or nodes of
    # the machine (decided on its network).
    outer = state.policy
    state.policy = outer.placed(eqn.params.get("mesh"))
    try:
        return shard_map_call(eqn.params, body_fn, invals)
    except Exception as e:  # noqa: BLE001 - never worse than the original program
        state.undo(mark)
        state.lines.append(f"overlap[{here}]: shard_map left unchanged: {type(e).__name__}: {e}")
        return bind_eqn(eqn, invals)
    finally:
        state.policy = outer


def _eval_remat(params, invals, state, where, manual):
    jaxpr, consts = closed(params["jaxpr"])
    own = [params["policy"]] if params.get("policy") is not None else []

    def body(*a):
        state.policies.extend(own)  # seen by the rewrites inside (`Rewriter._saved_name`)
        try:
            return interpret(jaxpr, consts, a, state, where, manual)
        finally:
            del state.policies[len(state.policies) - len(own):]

    fn = jax.checkpoint(body, prevent_cse=params.get("prevent_cse", True),
                        policy=_fused.checkpoint_policy(params.get("policy")))
    return list(fn(*invals))


def _eval_scan(params, invals, state, where, manual):
    jaxpr, consts = closed(params["jaxpr"])
    n_consts, n_carry = _compat.scan_counts(params)
    loop_consts = invals[:n_consts]
    init, xs = invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]

    def step(carry, x):
        outs = interpret(jaxpr, consts, [*loop_consts, *carry, *x], state, where, manual)
        return tuple(outs[:n_carry]), tuple(outs[n_carry:])

    carry, ys = jax.lax.scan(step, tuple(init), tuple(xs), length=params["length"],
                             reverse=params.get("reverse", False), unroll=params.get("unroll", 1))
    return [*carry, *ys]


def _eval_cond(params, invals, state, where, manual):
    index, ops = invals[0], invals[1:]

    def branch(branch_jaxpr, i):
        jaxpr, consts = closed(branch_jaxpr)
        return lambda *a: tuple(interpret(jaxpr, consts, a, state, f"{where}.branch{i}", manual))

    branches = [branch(b, i) for i, b in enumerate(params["branches"])]
    return list(jax.lax.switch(index, branches, *ops))


def _eval_while(params, invals, state, where, manual):
    cj, cc = closed(params["cond_jaxpr"])
    bj, bc = closed(params["body_jaxpr"])
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]

    def cond_fun(carry):
        return interpret(cj, cc, [*cond_consts, *carry], state, f"{where}.cond", manual)[0]

    def body_fun(carry):
        return tuple(interpret(bj, bc, [*body_consts, *carry], state, f"{where}.body", manual))

    return list(jax.lax.while_loop(cond_fun, body_fun, tuple(init)))
