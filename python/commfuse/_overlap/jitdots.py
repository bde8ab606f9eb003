"""The rewrite outside shard_map bodies: a ``dot_general`` of a program
sharded by ``jax.jit`` becomes ``commfuse.matmul``, whose partitioning rule
chooses the fused op once the shardings are known (``_matmul``)."""

from __future__ import annotations

import jax
import numpy as np

from .. import _abi, _matmul
from .jaxpr import DotForm, Unsupported, bind_eqn, describe_dot
from .state import State


def eval_dot(eqn, invals, state: State, where: str) -> list:
    """``eqn`` (a dot_general outside any shard_map) as ``commfuse.matmul``
    where it is ``x @ w`` up to transposes and flattening; else unchanged,
    with the reason in the report."""
    here = where or "jit"
    reason = _refusal(eqn)
    form = None
    if reason is None:
        try:
            form = DotForm(eqn, 0)
        except Unsupported as e:
            reason = str(e)
    if reason is None and _out_sharding(eqn) is not None and _mapped_out_sharding(eqn, form) is None:
        # An explicit result sharding belongs to the dot's own dims.
        reason = f"its explicit out_sharding cannot be given to the 2-D product{form.notes()}"
    if reason is not None:
        state.lines.append(f"overlap[{here}]: kept {describe_dot(eqn)}: {reason}")
        return bind_eqn(eqn, invals)
    lhs, rhs = invals
    try:
        y, site = _matmul.traced(form.prep_x(lhs), form.prep_w(rhs), schedule=state.schedule, **_kwargs(eqn, form))
    except (TypeError, ValueError) as e:
        state.lines.append(f"overlap[{here}]: kept {describe_dot(eqn)}: {e}")
        return bind_eqn(eqn, invals)
    state.matmul_sites.add(site)
    state.lines.append(f"overlap[{here}]: {describe_dot(eqn)} -> commfuse.matmul#{site}{form.notes()}")
    out = form.finish(y)
    return [out.astype(eqn.outvars[0].aval.dtype)]


def _refusal(eqn) -> str | None:
    dtypes = [np.dtype(v.aval.dtype) for v in eqn.invars]
    if any(d not in _abi.DTYPE_CODES for d in dtypes):
        return f"operand dtypes {[str(d) for d in dtypes]} are not float32, bfloat16, float16 or float64"
    if any(0 in v.aval.shape for v in eqn.invars):
        return "an operand has no elements"
    return None


def _out_sharding(eqn):
    """The dot's result sharding where it names mesh axes (explicit axes);
    JAX records an empty one for dots on automatic axes."""
    sharding = eqn.params.get("out_sharding")
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(entry is not None for entry in spec):
        return None
    return sharding


def _mapped_out_sharding(eqn, form: DotForm):
    """The dot's explicit result sharding for the product ``prep_x(x) @
    prep_w(w)``, whose dims are x's free dims and w's free dims flattened:
    the same spec where w keeps one free dim, or where the flattened ones
    after the first are not sharded; None where it cannot be said."""
    sharding = _out_sharding(eqn)
    nx, nw = len(form.x_free), len(form.w_free)
    if form.x_side != 0 or nw == 0:
        return None
    spec = tuple(sharding.spec) + (None,) * (nx + nw - len(sharding.spec))
    if any(entry is not None for entry in spec[nx + 1:]):
        return None
    return jax.sharding.PartitionSpec(*spec[:nx + 1])


def _kwargs(eqn, form: DotForm) -> dict:
    kwargs = dict(form.kwargs)
    if _out_sharding(eqn) is not None:
        kwargs["out_sharding"] = _mapped_out_sharding(eqn, form)
    return kwargs
