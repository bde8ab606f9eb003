"""The rewrite outside shard_map bodies: a ``dot_general`` of a program
sharded by ``jax.jit`` becomes ``commfuse.matmul`` (`_matmul.dot_general`),
whose partitioning rule chooses the fused op once the shardings are known."""

from __future__ import annotations

from .. import _matmul
from .._dot_form import DotForm, Unsupported
from .jaxpr import bind_eqn, describe_dot
from .state import State


def eval_dot(eqn, invals, state: State, where: str) -> list:
    """``eqn`` (a dot_general outside any shard_map) as ``commfuse.matmul``
    where it is ``x @ w`` up to transposes and flattening; else unchanged,
    with the reason in the report."""
    here = where or "jit"
    state.jit_dots += 1
    p = eqn.params
    try:
        out, site, why = _matmul.dot_general(*invals, p["dimension_numbers"], precision=p.get("precision"),
                                             preferred_element_type=p.get("preferred_element_type"),
                                             out_sharding=p.get("out_sharding"), schedule=state.schedule,
                                             owner=state.owner, decide_early=True)
    except (Unsupported, TypeError, ValueError) as e:
        state.lines.append(f"overlap[{here}]: kept {describe_dot(eqn)}: {e}")
        return bind_eqn(eqn, invals)
    if site is None:  # auto keeps it XLA's own (its backward products are judged one by one)
        state.lines.append(f"overlap[{here}]: kept {describe_dot(eqn)}: {why}")
        return [out]
    state.matmul_sites.add(site)
    state.lines.append(f"overlap[{here}]: {describe_dot(eqn)} -> commfuse.matmul#{site}{DotForm.of(eqn, 0).notes()}")
    return [out]
