"""Which mesh axes each value of a shard_map body may differ over.

Row-wise work moves from after a row gather to before it (`rowwise`) only
if every other value it reads is the same on every device of the gather's
axes: ``all_gather(x) * s`` equals ``all_gather(x * s)`` when ``s`` is one
number everywhere, not when it comes from ``axis_index`` or from a block of
a sharded input. The values' types cannot tell: with ``check_vma=False``
they say nothing, and with ``check_vma=True`` they are conservative (an
``all_gather``'s result is typed as varying, and a replicated value meeting
it is cast to vary too). So this module works it out from the body itself.

A value may vary over an axis when it is a block of an input sharded over
it, comes from ``axis_index`` over it, or from a collective that leaves the
devices different (``ppermute``, ``psum_scatter``, ``all_to_all``), or is
computed from such a value; ``psum``, ``pmax``, ``pmin`` and ``all_gather``
over an axis make it the same on every device of that axis again. Bodies of
scans, whiles, conds, calls and remats are followed with their inputs'
axes; anything else nested is taken to vary over every axis (`EVERY`).
"""

from __future__ import annotations

from .jaxpr import CALLS, REMAT, closed, collective_axes, is_literal, subjaxprs

# Stands for every axis: a value whose axes are not known.
EVERY = "*"
# Collectives whose result is the same on every device of their axes.
_SAME_AFTER = frozenset(("psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant"))
# Collectives whose result differs between the devices of their axes.
_DIFFERENT_AFTER = frozenset(("ppermute", "psum_scatter", "reduce_scatter", "all_to_all", "all_gather_reduced",
                              "pbroadcast"))


def spec_axes(spec) -> frozenset:
    """The mesh axes a shard_map input spec (a PartitionSpec) shards over:
    the devices of those axes hold different blocks."""
    names = set(getattr(spec, "unreduced", None) or ())  # each device holds a partial sum
    for entry in spec or ():
        if isinstance(entry, (tuple, list)):
            names.update(e for e in entry if e is not None)
        elif entry is not None:
            names.add(entry)
    return frozenset(names)


def axes_of(known: dict, v) -> frozenset:
    """The axes variable `v` (of a body `fill` saw) may vary over (`EVERY` if unknown)."""
    return frozenset() if is_literal(v) else known.get(v, frozenset((EVERY,)))


def varies(known: dict, v, axes) -> bool:
    """Whether variable `v` (of a body `fill` saw) may differ between the devices of `axes`."""
    found = axes_of(known, v)
    return EVERY in found or bool(found & frozenset(axes))


def fill(jaxpr, arg_axes, known: dict) -> list:
    """Records in `known` (variable -> frozenset of axes) the axes every value
    of `jaxpr` and of the jaxprs inside it may vary over, its invars varying
    over `arg_axes` (its constvars over none); returns its outvars' axes. A
    jaxpr met twice keeps the union of what each meeting found."""
    env = {}

    def axes(v):
        return frozenset() if is_literal(v) else env.get(v, frozenset((EVERY,)))

    def note(v, value):
        env[v] = value
        known[v] = known.get(v, frozenset()) | value

    for v in jaxpr.constvars:
        note(v, frozenset())
    for v, a in zip(jaxpr.invars, arg_axes):
        note(v, frozenset(a))
    for eqn in jaxpr.eqns:
        ins = [axes(v) for v in eqn.invars]
        for v, a in zip(eqn.outvars, _equation(eqn, ins, known)):
            note(v, a)
    return [axes(v) for v in jaxpr.outvars]


def _union(sets) -> frozenset:
    out = frozenset()
    for s in sets:
        out |= s
    return out


def _equation(eqn, ins: list, known: dict) -> list:
    name = eqn.primitive.name
    params = eqn.params
    outs = len(eqn.outvars)
    if name == "axis_index":
        return [frozenset(collective_axes(eqn))]
    collective = name in _SAME_AFTER or name in _DIFFERENT_AFTER or "axis_name" in params
    if collective:
        axes = frozenset(collective_axes(eqn))
        # Over groups of an axis (axis_index_groups) the groups' results differ.
        same = name in _SAME_AFTER and params.get("axis_index_groups") is None
        per_out = [a - axes if same else a | axes for a in ins][:outs]
        return per_out + [_union(ins) | (frozenset() if same else axes)] * (outs - len(per_out))
    if "callback" in name:
        return [frozenset((EVERY,))] * outs  # a host function may return anything per device
    if name == "scan":
        return _scan(params, ins, known)
    if name == "while":
        return _while(params, ins, known)
    if name == "cond":
        index, operands = ins[0], ins[1:]
        branches = [fill(closed(b)[0], operands, known) for b in params["branches"]]
        return [index | _union(per_out) for per_out in zip(*branches)]
    if name in CALLS or name in REMAT or name.startswith("custom_"):
        body = params.get("jaxpr", params.get("call_jaxpr", params.get("fun_jaxpr")))
        if body is not None:
            jaxpr = closed(body)[0]
            if len(jaxpr.invars) == len(ins) and len(jaxpr.outvars) == outs:
                return fill(jaxpr, ins, known)
        if name.startswith("custom_"):
            # A rule written in Python (custom_transpose, say): what it returns is not known here.
            for sub in subjaxprs(params):
                fill(sub, [frozenset((EVERY,))] * len(sub.invars), known)
            return [frozenset((EVERY,))] * outs
    if any(True for _ in subjaxprs(params)):
        for sub in subjaxprs(params):
            fill(sub, [frozenset((EVERY,))] * len(sub.invars), known)
        return [frozenset((EVERY,))] * outs
    return [_union(ins)] * outs


def _scan(params, ins, known):
    from .. import _compat

    jaxpr = closed(params["jaxpr"])[0]
    n_consts, n_carry = _compat.scan_counts(params)
    consts, carry, xs = ins[:n_consts], list(ins[n_consts:n_consts + n_carry]), ins[n_consts + n_carry:]
    # The carry varies over what it starts with and what a step adds: to a fixed point.
    while True:
        outs = fill(jaxpr, [*consts, *carry, *xs], known)
        grown = [c | o for c, o in zip(carry, outs[:n_carry])]
        if grown == carry:
            # The final carry may be the initial one (a scan of length 0).
            return [*carry, *outs[n_carry:]]
        carry = grown


def _while(params, ins, known):
    cond, body = closed(params["cond_jaxpr"])[0], closed(params["body_jaxpr"])[0]
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, carry = ins[:nc], ins[nc:nc + nb], list(ins[nc + nb:])
    while True:
        # A condition that differs between devices makes every carried value differ by as much.
        (stop,) = fill(cond, [*cond_consts, *carry], known)
        outs = fill(body, [*body_consts, *carry], known)
        grown = [c | o | stop for c, o in zip(carry, outs)]
        if grown == carry:
            return carry
        carry = grown
