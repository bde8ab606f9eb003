"""What the rewrite reads and binds: the primitives it knows, binding an
equation, describing equations in reports, a dot_general seen as ``x @ w``,
and the varying-axes type casts."""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core as jcore

from .. import (_all_gather_matmul, _all_to_all, _compat, _matmul_all_gather, _matmul_all_reduce,
               _matmul_reduce_scatter, _varying)
from .._dot_form import Unsupported

ALL_GATHER = "all_gather"
ALL_GATHER_REDUCED = "all_gather_reduced"  # all_gather(..., to="reduced")
REDUCE_SCATTER = ("reduce_scatter", "psum_scatter")  # the primitive's name across JAX versions
ALL_TO_ALL = "all_to_all"
PSUM = ("psum", "psum_invariant")
DOT = "dot_general"
GATHERS = (ALL_GATHER, ALL_GATHER_REDUCED)
CANDIDATES = frozenset(GATHERS + (ALL_TO_ALL, "all_gather_invariant") + REDUCE_SCATTER + PSUM)
# Collectives that are no pattern; they are named in reports.
OTHER_COLLECTIVES = frozenset(("pmax", "pmin", "ppermute", "pbroadcast", "axis_index"))
CASTS = frozenset(("pvary",))  # value-preserving type casts a pattern may span
CALLS = frozenset(("pjit", "jit", "closed_call", "core_call"))
REMAT = frozenset(("checkpoint", "remat", "remat2"))


bind_eqn = _compat.bind_eqn


def shard_map_call(params, body_fn, invals):
    """Re-creates a shard_map equation with body ``body_fn`` through the public API."""
    if "in_specs" not in params or "out_specs" not in params:
        raise Unsupported("shard_map parameters of this JAX version are not understood")
    mesh = params["mesh"]
    if "newly_manual_axes" in params:
        axis_names = params["newly_manual_axes"]
    elif "manual_axes" in params:
        axis_names = params["manual_axes"]
    elif "auto" in params:
        axis_names = frozenset(mesh.axis_names) - frozenset(params["auto"])
    else:
        axis_names = frozenset(mesh.axis_names)
    check = params.get("check_vma", params.get("check_rep", True))
    in_specs, out_specs = tuple(params["in_specs"]), tuple(params["out_specs"])
    fn = jax.shard_map(body_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       axis_names=frozenset(axis_names), check_vma=check)
    return list(fn(*invals))


# ----------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------
def is_literal(v) -> bool:
    return isinstance(v, jcore.Literal)


def fmt(aval) -> str:
    shape = ",".join(str(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    return f"{np.dtype(dtype).name if dtype is not None else '?'}[{shape}]"


def axes_of(name) -> tuple:
    return tuple(name) if isinstance(name, (tuple, list)) else (name,)


def subjaxprs(params):
    """The (open) jaxprs carried in an equation's params."""
    def walk(v):
        if isinstance(v, jcore.ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, jcore.Jaxpr):
            yield v
        elif isinstance(v, (tuple, list)):
            for item in v:
                yield from walk(item)

    for value in params.values():
        yield from walk(value)


def closed(v):
    """(jaxpr, consts) of a ClosedJaxpr or an open Jaxpr param."""
    if isinstance(v, jcore.ClosedJaxpr):
        return v.jaxpr, list(v.consts)
    return v, []


def describe_collective(eqn) -> str:
    p = eqn.params
    name = eqn.primitive.name
    axis = axes_of(p.get("axis_name", p.get("axes")))
    if name == ALL_TO_ALL:
        dims = f", split={p.get('split_axis')}, concat={p.get('concat_axis')}"
    elif name in REDUCE_SCATTER:
        dims = f", dim={p.get('scatter_dimension')}"
    elif name in GATHERS or name == "all_gather_invariant":
        dims = f", dim={p.get('all_gather_dimension')}"
    else:
        dims = ""
    src = eqn.invars[0].aval if eqn.invars else None
    return f"{name}(axis={axis}{dims}) {fmt(src)} -> {fmt(eqn.outvars[0].aval)}"


def describe_dot(eqn) -> str:
    lhs, rhs = (v.aval for v in eqn.invars)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    dims = f"contract {tuple(lc)}x{tuple(rc)}" + (f", batch {tuple(lb)}x{tuple(rb)}" if lb or rb else "")
    return f"dot_general({fmt(lhs)} @ {fmt(rhs)} -> {fmt(eqn.outvars[0].aval)}, {dims})"


def collective_axes(eqn) -> tuple:
    p = eqn.params
    return axes_of(p["axis_name"] if "axis_name" in p else p.get("axes"))


def static_reason(eqn) -> str | None:
    """Why a collective can never be fused, judging by its params alone."""
    p = eqn.params
    name = eqn.primitive.name
    if name == "all_gather_invariant":
        return "all_gather_invariant is not rewritten (the fused result would be typed as varying)"
    if not p.get("tiled", True):
        return f"non-tiled {name} (tiled=False)"
    if p.get("axis_index_groups") is not None:
        return f"{name} uses axis_index_groups"
    return None


# The fused ops the rewrite makes, by name (one table, not names looked up in strings).
def fused_ops() -> dict:
    """Each fused op's name -> (its `decide`, from shapes, and its `run` of a decision)."""
    return {
        "all_gather_matmul": (_all_gather_matmul.decide, _all_gather_matmul.run),
        "matmul_all_gather": (_matmul_all_gather.decide, _matmul_all_gather.run),
        "matmul_reduce_scatter": (_matmul_reduce_scatter.decide, _matmul_reduce_scatter.run),
        "matmul_all_reduce": (_matmul_all_reduce.decide, _matmul_all_reduce.run),
        "all_to_all_matmul": (_all_to_all.decide_all_to_all_matmul, _all_to_all.run_all_to_all_matmul),
        "matmul_all_to_all": (_all_to_all.decide_matmul_all_to_all, _all_to_all.run_matmul_all_to_all),
    }


# ----------------------------------------------------------------------------
# Varying axes
# ----------------------------------------------------------------------------
vma = _compat.varying_axes
typeof = _compat.typeof
_cast_varying = _compat.cast_varying


def vary(value, axes):
    """``value`` typed as varying over ``axes`` too (a no-op on its values)."""
    if not _varying.vma_checked():
        return value
    missing = tuple(a for a in dict.fromkeys(axes) if a not in vma(typeof(value)))
    return _cast_varying(value, missing) if missing else value


def match_vma(value, aval):
    """``value`` cast to also vary over the axes ``aval`` varies over.

    A fused op's result varies over its axes and its operands' axes (an
    all-reduce's over its operands' but not its own); the original
    may vary over more (a ``pvary`` between the pair). Where the fused result varies
    over more axes than the original (only possible with check_vma=False, where
    the types are not checked), it is left as it is."""
    if not _varying.vma_checked():
        return value
    missing = tuple(sorted(vma(aval) - vma(typeof(value))))
    return _cast_varying(value, missing) if missing else value
