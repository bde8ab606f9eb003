"""The rewrite outside shard_map bodies: a ``dot_general`` of a program
sharded by ``jax.jit`` becomes ``commfuse.matmul`` (`_matmul.dot_general`),
whose partitioning rule chooses the fused op once the shardings are known."""

from __future__ import annotations

from collections import Counter

import jax

from .. import _matmul
from .._dot_form import DotForm, Unsupported, _explicit_spec
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
        self.uses = Counter(v for e in self.eqns for v in e.invars if not is_literal(v))
        self.uses.update(v for v in jaxpr.outvars if not is_literal(v))
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
        if any(_explicit_spec(a) is not None for a in invals):
            return eval_dot(eqn, invals, state, where)
        for k, v in enumerate(eqn.invars):
            reshape = None if is_literal(v) else self._reshape(self.producer.get(v))
            if reshape is None:
                continue
            try:
                *_, merged_dn = regroup.unmerged_dot(*shapes, dn, k, reshape.invars[0].aval.shape)
            except Unsupported:
                continue
            vals = list(invals)
            vals[k] = read(reshape.invars[0])
            return [y.reshape(out_shape) for y in eval_dot(eqn, vals, state, where, merged_dn)]
        users = [j for j, e in enumerate(self.eqns) if any(u is eqn.outvars[0] for u in e.invars)]
        reshape = self._reshape(users[0]) if self.uses[eqn.outvars[0]] == 1 and len(users) == 1 else None
        if reshape is not None:
            try:
                lhs, rhs, split_dn = regroup.split_dot(*shapes, dn, reshape.outvars[0].aval.shape)
            except Unsupported:
                return eval_dot(eqn, invals, state, where)
            y = eval_dot(eqn, [invals[0].reshape(lhs), invals[1].reshape(rhs)], state, where, split_dn)[0]
            write(reshape.outvars[0], y)
            self.done.add(users[0])
            return [y.reshape(out_shape)]
        return eval_dot(eqn, invals, state, where)


def eval_dot(eqn, invals, state: State, where: str, dimension_numbers=None) -> list:
    """``eqn`` (a dot_general outside any shard_map) as ``commfuse.matmul``
    where it is ``x @ w`` up to transposes and flattening; else unchanged,
    with the reason in the report. `dimension_numbers` replaces the
    equation's where its operands were regrouped (`Regrouping`)."""
    here = where or "jit"
    state.jit_dots += 1
    p = eqn.params
    dn = p["dimension_numbers"] if dimension_numbers is None else dimension_numbers
    regrouped = "" if dimension_numbers is None else " [taken on the operands before the reshape next to it]"
    if dimension_numbers is not None:
        p = {**p, "dimension_numbers": dn}
    try:
        out, site, why = _matmul.dot_general(*invals, dn, precision=p.get("precision"),
                                             preferred_element_type=p.get("preferred_element_type"),
                                             out_sharding=p.get("out_sharding"), schedule=state.schedule,
                                             owner=state.owner, decide_early=True)
    except (Unsupported, TypeError, ValueError) as e:
        state.lines.append(f"overlap[{here}]: kept {describe_dot(eqn)}: {e}")
        if dimension_numbers is not None:
            return [jax.lax.dot_general(*invals, dn, precision=p.get("precision"),
                                        preferred_element_type=p.get("preferred_element_type"))]
        return bind_eqn(eqn, invals)
    if site is None:  # auto keeps it XLA's own (its backward products are judged one by one)
        state.lines.append(f"overlap[{here}]: kept {describe_dot(eqn)}: {why}")
        return [out]
    state.matmul_sites.add(site)
    notes = DotForm(invals[0].shape, invals[1].shape, dn, 0).notes()
    state.lines.append(f"overlap[{here}]: {describe_dot(eqn)} -> commfuse.matmul#{site}{notes}{regrouped}")
    return [out]
