"""What the rewrite reads and binds: the primitives it knows, binding an
equation, describing equations in reports, and the varying-axes type casts."""

from __future__ import annotations

import contextlib
import importlib

import jax
import numpy as np
from jax.extend import core as jcore

_ALL_GATHER = "all_gather"
_REDUCE_SCATTER = ("reduce_scatter", "psum_scatter")  # the primitive's name across JAX versions
_ALL_TO_ALL = "all_to_all"
_CANDIDATES = frozenset((_ALL_GATHER, _ALL_TO_ALL, "all_gather_invariant") + _REDUCE_SCATTER)
# Collectives that are no pattern; a dot_general next to one of them is reported as unmatched.
_OTHER_COLLECTIVES = frozenset(("psum", "psum_invariant", "pmax", "pmin", "ppermute", "pbroadcast"))
_CASTS = frozenset(("pvary",))  # value-preserving type casts a pattern may span
_CALLS = frozenset(("pjit", "jit", "closed_call", "core_call"))
_REMAT = frozenset(("checkpoint", "remat", "remat2"))


# ----------------------------------------------------------------------------
# The only access to JAX internals: binding an equation as jax.core.eval_jaxpr
# does (with the equation's context manager, e.g. compute_on / xla_metadata).
# ----------------------------------------------------------------------------
def _bind_eqn(eqn, invals):
    """Binds ``eqn``'s primitive to ``invals`` with its own params; returns the list of outputs."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
    else:
        subfuns = ()
    # JaxprEqn.ctx (a JaxprEqnContext) is not public API; use it when present.
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _shard_map_call(params, body_fn, invals):
    """Re-creates a shard_map equation with body ``body_fn`` through the public API."""
    if "in_specs" not in params or "out_specs" not in params:
        raise _Unsupported("shard_map parameters of this JAX version are not understood")
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
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is not None:
        fn = shard_map(body_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       axis_names=frozenset(axis_names), check_vma=check)
    else:  # pragma: no cover - JAX before jax.shard_map
        from jax.experimental.shard_map import shard_map as legacy

        auto = frozenset(mesh.axis_names) - frozenset(axis_names)
        fn = legacy(body_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check, auto=auto)
    return list(fn(*invals))


class _Unsupported(Exception):
    pass


# ----------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------
def _is_literal(v) -> bool:
    return isinstance(v, jcore.Literal)


def _fmt(aval) -> str:
    shape = ",".join(str(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    return f"{np.dtype(dtype).name if dtype is not None else '?'}[{shape}]"


def _axes(name) -> tuple:
    return tuple(name) if isinstance(name, (tuple, list)) else (name,)


def _subjaxprs(params):
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


def _closed(v):
    """(jaxpr, consts) of a ClosedJaxpr or an open Jaxpr param."""
    if isinstance(v, jcore.ClosedJaxpr):
        return v.jaxpr, list(v.consts)
    return v, []


def _describe_collective(eqn) -> str:
    p = eqn.params
    name = eqn.primitive.name
    axis = _axes(p.get("axis_name"))
    if name == _ALL_TO_ALL:
        dims = f"split={p.get('split_axis')}, concat={p.get('concat_axis')}"
    elif name in _REDUCE_SCATTER:
        dims = f"dim={p.get('scatter_dimension')}"
    else:
        dims = f"dim={p.get('all_gather_dimension')}"
    src = eqn.invars[0].aval if eqn.invars else None
    return f"{name}(axis={axis}, {dims}) {_fmt(src)} -> {_fmt(eqn.outvars[0].aval)}"


def _describe_dot(eqn) -> str:
    lhs, rhs = (v.aval for v in eqn.invars)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    dims = f"contract {tuple(lc)}x{tuple(rc)}" + (f", batch {tuple(lb)}x{tuple(rb)}" if lb or rb else "")
    return f"dot_general({_fmt(lhs)} @ {_fmt(rhs)} -> {_fmt(eqn.outvars[0].aval)}, {dims})"


def _static_reason(eqn) -> str | None:
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


def _dot_shape_reason(eqn, x_side: int) -> str | None:
    """Why operand ``x_side`` (0: lhs, 1: rhs) of the dot cannot be ``x`` in ``x @ w``."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if len(lb) or len(rb):
        return "dot_general has batch dimensions on both sides"
    if len(lc) != 1:
        return f"dot_general contracts {len(lc)} dimensions (a fused op contracts exactly one)"
    x_aval, w_aval = eqn.invars[x_side].aval, eqn.invars[1 - x_side].aval
    w_name = "rhs" if x_side == 0 else "lhs"
    if len(w_aval.shape) != 2:
        return f"the dot's {w_name} operand {_fmt(w_aval)} is not 2-D"
    if len(x_aval.shape) < 2:
        return f"the dot's {'lhs' if x_side == 0 else 'rhs'} operand {_fmt(x_aval)} has rank < 2"
    return None


class _Form:
    """A dot_general seen as ``finish(prep_x(x) @ prep_w(w))`` with ``x`` operand ``x_side``."""

    def __init__(self, eqn, x_side: int):
        (lc, rc), _ = eqn.params["dimension_numbers"]
        self.x_side = x_side
        self.n = len(eqn.invars[x_side].aval.shape)
        self.xc = int((lc if x_side == 0 else rc)[0])
        self.wc = int((rc if x_side == 0 else lc)[0])
        prec = eqn.params.get("precision")
        if x_side == 1 and isinstance(prec, tuple) and len(prec) == 2:
            prec = (prec[1], prec[0])
        self.kwargs = {"precision": prec, "preferred_element_type": eqn.params.get("preferred_element_type")}

    def x_dim(self, d: int) -> int:
        """A dim of ``x`` -> the same dim of ``prep_x(x)`` (the contracting dim goes last)."""
        if d == self.xc:
            return self.n - 1
        return d if d < self.xc else d - 1

    def w_dim(self, d: int) -> int:
        return d if self.wc == 0 else 1 - d

    def y_dim(self, d: int) -> int:
        """A dim of the dot's result -> the same dim of ``prep_x(x) @ prep_w(w)``."""
        if self.x_side == 0:
            return d
        return self.n - 1 if d == 0 else d - 1

    def prep_x(self, x):
        if self.xc == self.n - 1:
            return x
        return jax.lax.transpose(x, tuple(i for i in range(self.n) if i != self.xc) + (self.xc,))

    def prep_w(self, w):
        return w if self.wc == 0 else jax.lax.transpose(w, (1, 0))

    def finish(self, y):
        if self.x_side == 0:
            return y
        return jax.lax.transpose(y, (self.n - 1,) + tuple(range(self.n - 1)))

    def notes(self) -> str:
        parts = []
        if self.xc != self.n - 1:
            parts.append("x transposed")
        if self.wc != 0:
            parts.append("w transposed")
        if self.x_side == 1:
            parts.append("operands swapped, result transposed")
        return f" [{', '.join(parts)}]" if parts else ""


def _commfuse():
    return importlib.import_module(__name__.split(".")[0])


def _vma(aval) -> frozenset:
    """The mesh axes a value is typed as varying over (the field moved across JAX versions)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and getattr(mat, "varying", None) is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def _typeof(value):
    typeof = getattr(jax, "typeof", None) or jax.core.get_aval
    return typeof(value)


def _cast_varying(value, axes: tuple):
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(value, axes, to="varying")
    return jax.lax.pvary(value, axes)


def _vary(value, axes):
    """``value`` typed as varying over ``axes`` too (a no-op on its values)."""
    missing = tuple(a for a in dict.fromkeys(axes) if a not in _vma(_typeof(value)))
    return _cast_varying(value, missing) if missing else value


def _match_vma(value, aval):
    """``value`` cast to also vary over the axes ``aval`` varies over.

    A fused op's result varies over its axes and its operands' axes; the original
    may vary over more (a ``pvary`` between the pair). Where the fused result varies
    over more axes than the original (only possible with check_vma=False, where
    the types are not checked), it is left as it is."""
    missing = tuple(sorted(_vma(aval) - _vma(_typeof(value))))
    return _cast_varying(value, missing) if missing else value
