"""The rewrite outside shard_map bodies: a ``dot_general`` of a program
sharded by ``jax.jit`` becomes ``commfuse.matmul`` (`_matmul.dot_general`),
whose partitioning rule chooses the fused op once the shardings are known."""

from __future__ import annotations

import math
from collections import defaultdict

import jax

from .. import _matmul
from .._dot_form import DotForm, Unsupported, explicit_spec
from . import regroup
from .jaxpr import bind_eqn, describe_dot, is_literal
from .state import State


class Regrouping:
    """The dots of one jaxpr outside shard_map bodies, with a reshape that
    merges an operand's free dims before them (``x.reshape(-1, d) @ w``) or
    splits their result's after them: each is taken on the regrouped
    operands (`regroup`). A merged dim whose inner part is sharded (batch x
    sequence, the sequence over tp) is one the partitioner cannot keep
    sharded: it would gather the operand first, outside any fused op.
    Operands on explicit axes are left as written (their reshapes carry
    their own shardings)."""

    def __init__(self, jaxpr):
        self.eqns = jaxpr.eqns
        self.producer = {v: i for i, e in enumerate(self.eqns) for v in e.outvars}
        self.users = defaultdict(list)
        for i, e in enumerate(self.eqns):
            for v in e.invars:
                if not is_literal(v):
                    self.users[v].append(i)
        self.outputs = {v for v in jaxpr.outvars if not is_literal(v)}
        self.done: set[int] = set()  # reshapes whose result a regrouped dot wrote

    def _reshape(self, i):
        eqn = self.eqns[i] if i is not None else None
        if eqn is None or eqn.primitive.name != "reshape" or eqn.params.get("dimensions") is not None:
            return None
        return eqn

    def eval(self, i, read, write, state: State, where: str) -> list:
        eqn = self.eqns[i]
        dn = eqn.params["dimension_numbers"]
        invals = [read(v) for v in eqn.invars]
        shapes = [tuple(v.aval.shape) for v in eqn.invars]
        out_shape = tuple(eqn.outvars[0].aval.shape)
        if any(explicit_spec(a) is not None for a in invals):
            return eval_dot(eqn, invals, state, where)
        reshapes = [None if is_literal(v) else self._reshape(self.producer.get(v)) for v in eqn.invars]
        # Both operands regrouped where both were merged (a weight gradient
        # contracting flattened rows), else the one that can be.
        tries = [reshapes] if all(reshapes) else []
        tries += [[r if j == k else None for j, r in enumerate(reshapes)] for k, r in enumerate(reshapes) if r]
        for chosen in tries:
            befores = [None if r is None else r.invars[0].aval.shape for r in chosen]
            try:
                *unmerged, merged_dn = regroup.unmerged_dot(*shapes, dn, befores, _axis_bound())
            except Unsupported:
                continue
            vals = [(v if r is None else read(r.invars[0])).reshape(shape)
                    for v, r, shape in zip(invals, chosen, unmerged)]
            return eval_dot(eqn, invals, state, where, (vals, merged_dn, lambda y: y.reshape(out_shape)))
        result = eqn.outvars[0]
        users = self.users.get(result, [])
        reshape = self._reshape(users[0]) if len(users) == 1 and result not in self.outputs else None
        if reshape is None:
            return eval_dot(eqn, invals, state, where)
        try:
            lhs, rhs, split_dn = regroup.split_dot(*shapes, dn, reshape.outvars[0].aval.shape, _axis_bound())
        except Unsupported:
            return eval_dot(eqn, invals, state, where)

        def split_result(y):
            write(reshape.outvars[0], y)
            self.done.add(users[0])
            return y.reshape(out_shape)

        return eval_dot(eqn, invals, state, where, ([invals[0].reshape(lhs), invals[1].reshape(rhs)], split_dn,
                                                    split_result))


def _axis_bound() -> int:
    """A multiple of every mesh axis size a product may be sharded over: the
    axes of the mesh in context (``jax.set_mesh``), else all devices (the
    largest any axis can be)."""
    sizes = [s for s in jax.sharding.get_abstract_mesh().axis_sizes if s > 1]
    return math.lcm(*sizes) if sizes else jax.device_count()


def eval_dot(eqn, invals, state: State, where: str, regrouped=None) -> list:
    """``eqn`` (a dot_general outside any shard_map) as ``commfuse.matmul``
    where it is ``x @ w`` up to transposes and flattening; else unchanged,
    with the reason in the report. `regrouped` is ``(operands, dimension
    numbers, finish)``: the same product on regrouped operands (`Regrouping`)
    and what makes the dot's result of it, taken where the product is fused
    (one kept XLA's own stays as written, so a declining `auto` changes
    nothing; what was traced for it is dead code)."""
    here = where or "jit"
    state.jit_dots += 1
    if regrouped is not None:
        vals, dn, finish = regrouped
        try:
            out, site, _ = _matmul_of(eqn, vals, dn, state)
        except (Unsupported, TypeError, ValueError):
            site = None
        if site is not None:
            _fused_line(eqn, vals, dn, site, state, here, " [taken on the operands before the reshape next to it]")
            return [finish(out)]
    try:
        out, site, why = _matmul_of(eqn, invals, eqn.params["dimension_numbers"], state)
    except (Unsupported, TypeError, ValueError) as e:
        state.lines.append(f"overlap[{here}]: kept {describe_dot(eqn)}: {e}")
        return bind_eqn(eqn, invals)
    if site is None:  # auto keeps it XLA's own (its backward products are judged one by one)
        state.lines.append(f"overlap[{here}]: kept {describe_dot(eqn)}: {why}")
        return [out]
    _fused_line(eqn, invals, eqn.params["dimension_numbers"], site, state, here)
    return [out]


def _matmul_of(eqn, operands, dimension_numbers, state: State):
    """`_matmul.dot_general` of `operands` with the equation's other params: (result, site, why)."""
    p = eqn.params
    return _matmul.dot_general(*operands, dimension_numbers, precision=p.get("precision"),
                               preferred_element_type=p.get("preferred_element_type"),
                               out_sharding=p.get("out_sharding"), policy=state.policy,
                               decide_early=state.policy.early)


def _fused_line(eqn, operands, dimension_numbers, site, state: State, here: str, note: str = ""):
    state.matmul_sites.add(site)
    notes = DotForm(operands[0].shape, operands[1].shape, dimension_numbers, 0).notes()
    state.lines.append(f"overlap[{here}]: {describe_dot(eqn)} -> commfuse.matmul#{site}{notes}{note}")
