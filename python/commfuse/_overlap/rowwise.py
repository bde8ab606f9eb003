"""Row-wise work between a row gather and its dot, moved before the gather.

Sequence-parallel layers gather the activation rows and normalise them
before the projection: ``dot(rms_norm(all_gather(x)), w)``. A norm over the
last dim (and any elementwise op) treats every row on its own, so
``rms_norm(all_gather(x)) == all_gather(rms_norm(x))``: applied to the local
rows first, the gather and the dot become one fused op, and the norm does a
1/N of the work.

`find` takes the equations that read the gathered value, up to the one
dot_general they all lead to, when each is row-wise: an elementwise op, a
reduction over other dims, a ``broadcast_in_dim`` (of such a value, or of
something without the gathered rows, like a norm's scale), a ``pvary``, a
``checkpoint_name`` no policy saves. The last may be a reshape that only
merges dims (tokens flattened for the projection): the dot is then taken
on the value before it (`regroup`).
`apply` evaluates them on the local rows, with each ``broadcast_in_dim``'s
shape cut to them.
"""

from __future__ import annotations

import numpy as np

from . import regroup
from .jaxpr import bind_eqn, is_literal

# Elementwise primitives: every operand has the result's shape (or is a scalar literal).
_ELEMENTWISE = frozenset((
    "add", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "square", "exp", "exp2", "log", "log1p",
    "tanh", "logistic", "rsqrt", "sqrt", "cbrt", "neg", "abs", "sign", "erf", "erf_inv", "sin", "cos",
    "convert_element_type", "select_n", "clamp", "expm1", "atan2", "rem", "floor", "ceil", "round",
    "is_finite", "ne", "eq", "lt", "le", "gt", "ge", "and", "or", "not", "stop_gradient", "copy", "copy_p",
    "pvary", "reduce_precision", "name",
))
_REDUCTIONS = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod"))


def find(eqns, start, gathered_dim: int, users, outputs, producer, first: int, varies, saved_name):
    """The row-wise equations from variable `start` (the gathered value, whose
    rows run along `gathered_dim`) to the dot_generals they lead to, all
    reading one value (the end of the row-wise work).
    `varies(v)` says whether a value may differ between the devices of the
    gather's axes: one that does cannot move before the gather (each block
    would meet its owner's value rather than this device's).
    `saved_name(eqn)` says whether a ``checkpoint_name`` equation names a
    value a checkpoint policy saves (it is then no row-wise step: the
    program saves the gathered rows).

    Returns ``((equations, row_dims, dots, end, reshape), None)``: the
    equations in order, each value's row dim, the dots reading the result
    as ``(equation, operand)`` pairs, the result, and the reshape that
    merges its dims on the way to the dots (`regroup`) or None; or
    ``(None, why)``.
    `first` is the first equation to look at. A value from elsewhere
    broadcast up to the gathered rows (a norm's scale) joins the equations:
    its broadcast is cut to the local rows too."""
    rows = {start: gathered_dim}
    chain, dots, reshapes, varying = [], [], [], None
    for i in range(first, len(eqns)):
        eqn = eqns[i]
        if not any(not is_literal(v) and v in rows for v in eqn.invars):
            continue
        name = eqn.primitive.name
        if name == "dot_general":
            dots.append(i)
            continue
        if name == "reshape" and eqn.params.get("dimensions") is None \
                and regroup.merged_groups(eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape) is not None:
            reshapes.append(i)  # the rows end here; the dot is taken on the unmerged value
            continue
        if name == "name" and saved_name(eqn):
            return None, f"an enclosing checkpoint policy saves the value it names ({eqn.params.get('name')!r})"
        dim = _row_dim(eqn, rows)
        if dim is None:
            return None, f"it is used by {name}, which is not row-wise over the gathered dim"
        if name in _ELEMENTWISE:
            for v in eqn.invars:
                if is_literal(v) or v in rows:
                    continue
                if varies(v):
                    # Said only if nothing else stops the move: a value used
                    # elsewhere too (a residual of a backward pass) says so first.
                    varying = varying or (f"{name} reads a value that may differ between the devices of the "
                                          f"gather's axes, so it cannot move before the gather")
                    continue
                shape = getattr(v.aval, "shape", ())
                # Scalars and values of size 1 along the rows broadcast over any rows.
                if len(shape) <= dim or shape[dim] == 1:
                    continue
                b = producer.get(v)
                if b is None or eqns[b].primitive.name != "broadcast_in_dim" \
                        or dim in eqns[b].params["broadcast_dimensions"]:
                    return None, f"it meets a value of its full shape from elsewhere in {name}"
                chain.append(b)
                rows[v] = dim
        chain.append(i)
        for v in eqn.outvars:
            rows[v] = dim
    reshape = None
    if reshapes:
        merged = eqns[reshapes[0]].outvars[0]
        readers = sorted(set(users.get(merged, ())))
        if len(reshapes) != 1 or dots or outputs[merged] or not readers \
                or any(eqns[r].primitive.name != "dot_general" for r in readers):
            return None, "it is used by reshape, which is not row-wise over the gathered dim"
        reshape, dots = reshapes[0], readers
    if not dots:
        return None, "its row-wise uses lead to no dot_general"
    # One value all the dots read (a cotangent feeding the backward's two
    # products), each in one operand.
    read = eqns[reshape].outvars[0] if reshape is not None else None
    ends = {v for d in dots for v in eqns[d].invars if not is_literal(v) and (v in rows or v is read)}
    if len(ends) != 1:
        return None, f"its row-wise uses lead to {len(dots)} dot_generals through different values"
    operands = [[k for k, v in enumerate(eqns[d].invars) if v in ends] for d in dots]
    if any(len(ks) != 1 for ks in operands):
        return None, "it feeds both operands of the dot_general"
    end = eqns[reshape].invars[0] if reshape is not None else ends.pop()
    inside = set(chain) | set(dots) | ({reshape} if reshape is not None else set())
    for v in rows:
        if outputs[v] or any(u not in inside for u in users.get(v, ())):
            return None, "a value computed from it is also used elsewhere"
        if v is not end and any(d in users.get(v, ()) for d in dots):
            return None, "it feeds the dot_general more than once"
    if reshape is not None and len(users.get(end, ())) != 1:
        return None, "the dot_general's operand has other users"
    if varying:
        return None, varying
    if np.dtype(end.aval.dtype).itemsize > np.dtype(start.aval.dtype).itemsize:
        # Moved before the gather, a widening cast would have it move more bytes.
        return None, (f"moved before the gather, it would gather {end.aval.dtype} where the program gathers "
                      f"{start.aval.dtype}")
    return (sorted(chain), rows, [(d, ks[0]) for d, ks in zip(dots, operands)], end, reshape), None


def _row_dim(eqn, rows):
    """The row dim of `eqn`'s result if it is row-wise in its operands from
    the gathered value (`rows`), else None."""
    name = eqn.primitive.name
    dims = {rows[v] for v in eqn.invars if not is_literal(v) and v in rows}
    if len(dims) != 1:
        return None
    dim = dims.pop()
    if name in _ELEMENTWISE:
        return dim
    if name in _REDUCTIONS:
        axes = tuple(eqn.params.get("axes", ()))
        if dim in axes:
            return None
        return dim - sum(1 for a in axes if a < dim)
    if name == "broadcast_in_dim":
        return eqn.params["broadcast_dimensions"][dim]
    return None


def apply(eqns, chain, rows, start, local, read, local_rows: int):
    """Evaluates `chain` with `start` bound to the local rows `local`
    (`local_rows` of them); other operands come from `read`. Returns the
    environment of local values."""
    env = {start: local}
    for i in chain:
        eqn = eqns[i]
        invals = [v.val if is_literal(v) else env[v] if v in env else read(v) for v in eqn.invars]
        if eqn.primitive.name == "broadcast_in_dim":
            shape = list(eqn.params["shape"])
            shape[rows[eqn.outvars[0]]] = local_rows
            eqn = eqn.replace(params={**eqn.params, "shape": tuple(shape)})
        for v, val in zip(eqn.outvars, bind_eqn(eqn, invals)):
            env[v] = val
    return env
