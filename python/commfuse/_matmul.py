"""matmul: ``x @ w`` on arrays sharded by ``jax.jit`` (``NamedSharding``,
``with_sharding_constraint``, explicit mesh axes), with the collective the
partitioner needs fused into the product.

The op is a ``custom_partitioning`` with a Shardy sharding rule (the rule of
a dot: ``rows.. k, k n -> rows.. n``, ``k`` a reduction factor), so the
shardings propagate through it as through ``jnp.matmul``. Once they are
known, `choose` reads the operands' and the result's shardings and picks the
one collective the product needs, run as a fused op on each device's shards:

=========================================================  ==============================
shardings (T: the mesh axes that differ)                    runs as
=========================================================  ==============================
x's rows on T, the result's rows not                        ``all_gather_matmul``
x's contraction on T, w's not                               the contraction gather
w's columns on T, the result's columns not                  ``matmul_all_gather`` (dim 1)
w's contraction on T, x's not                               ``matmul_all_gather`` (dim 0)
x's and w's contraction on T, the result's rows on T        ``matmul_reduce_scatter``
x's and w's contraction on T, the result's columns on T     ``matmul_reduce_scatter`` (cols)
x's and w's contraction on T, the result not                ``matmul_all_reduce``
nothing differs                                             a local dot
=========================================================  ==============================

Other axes may shard the rows and columns too, the same in the operands and
the result (data parallelism beside the collective). Anything else is the
fallback: each operand resharded by XLA to what a local dot of the result's
shard needs, then that dot (same numbers, XLA's collectives).

The VJP is made of the same op: ``dx = dy @ wᵀ`` and ``dw = xᵀ @ dy`` (x's
rows contracted), each partitioned by the same rule, so the backward pass
fuses its collectives too.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _abi, _compat, _fused, _matmul_all_reduce
from ._abi import Kind

OP = "matmul"
# The schedules the jit-level op takes ("sliced" and "tiled" need a shard_map
# op's own arguments).
SCHEDULES = tuple(s for s in _abi.SCHEDULES if s not in _abi.CUT_SCHEDULES)

_sites = itertools.count(1)


class Settings(NamedTuple):
    """The static arguments of one call (hashable: custom_partitioning's static argument)."""
    schedule: int
    out_dtype: np.dtype
    fast_f32: bool
    precision: object
    x_ndim: int
    site: int
    out_sharding: object = None   # jnp.matmul's, for explicit mesh axes


def matmul(x, w, *, schedule="auto", precision=None, preferred_element_type=None, out_sharding=None):
    """Returns ``x @ w`` (``jnp.matmul``), with the collective its shardings need fused.

    Call under ``jax.jit`` on sharded arrays (no ``shard_map`` needed). ``x``
    has rank >= 2 and contracts its last dim with 2-D ``w``'s first. At
    partitioning time, from the operands' and the result's shardings, the
    product runs as ``all_gather_matmul``, ``matmul_reduce_scatter``,
    ``matmul_all_reduce``, the FSDP weight gather (``matmul_all_gather``) or a
    local dot, on each device's shards; any other sharding falls back to
    XLA's own collectives. Differentiable; the backward products are
    partitioned the same way.

    ``schedule``: "auto" (the cost model's pick for each fused op, which may
    be jax.lax's own collective and dot), "ring", "bidirectional",
    "sequential" or "unfused". ``out_sharding`` is ``jnp.matmul``'s: with
    explicit mesh axes, the result's sharding where the operands leave it
    ambiguous (a sharded contraction). Outside ``jit``, on one device or
    inside a ``shard_map`` over every mesh axis it is ``jnp.matmul``.
    """
    return traced(x, w, schedule=schedule, precision=precision, preferred_element_type=preferred_element_type,
                  out_sharding=out_sharding)[0]


def traced(x, w, *, schedule="auto", precision=None, preferred_element_type=None, out_sharding=None):
    """`matmul`, and the number its partitioning reports under (``commfuse.matmul#N``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"commfuse.{OP}: unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
    if not hasattr(x, "ndim") or not hasattr(w, "ndim"):
        x, w = jnp.asarray(x), jnp.asarray(w)
    _fused.check_matmul_operands(OP, x, w)
    fast = _fused.fast_f32(OP, precision)
    x, w, out_dtype = _fused.promote(OP, x, w, preferred_element_type)
    site = next(_sites)
    settings = Settings(_abi.SCHEDULES[schedule], np.dtype(out_dtype), fast, _hashable_precision(precision), x.ndim,
                        site, out_sharding)
    return _matmul(x, w, settings), site


def _hashable_precision(precision):
    if isinstance(precision, list):
        return tuple(precision)
    return precision


# ----------------------------------------------------------------------------
# Differentiation: the backward products are the same op.
# ----------------------------------------------------------------------------
@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, settings: Settings):
    return _partitioned(x, w, settings)


def _fwd(x, w, settings):
    return _partitioned(x, w, settings), (x, w)


def _bwd(settings, residuals, dy):
    x, w = residuals
    dy = dy.astype(jnp.promote_types(dy.dtype, x.dtype))
    backward = settings._replace(x_ndim=dy.ndim, out_dtype=np.dtype(x.dtype))
    dx = _partitioned(dy, w.astype(dy.dtype).T,
                      backward._replace(site=next(_sites), out_sharding=_explicit_sharding(x)))
    rows = math.prod(x.shape[:-1])
    xt = x.reshape(rows, x.shape[-1]).T.astype(dy.dtype)
    dw = _partitioned(xt, dy.reshape(rows, dy.shape[-1]),
                      backward._replace(x_ndim=2, out_dtype=np.dtype(w.dtype), site=next(_sites),
                                        out_sharding=_explicit_sharding(w)))
    # Each gradient sharded as its primal (Shardy's sharding groups): its
    # product then knows the result's sharding it must make, as the
    # forward's does from the program's constraints.
    dx, _ = _compat.same_sharding(dx, x)
    dw, _ = _compat.same_sharding(dw, w)
    return dx, dw


_matmul.defvjp(_fwd, _bwd)


def _explicit_sharding(a):
    """`a`'s sharding where its type carries one (explicit mesh axes), else None."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if not any(t == explicit for t in getattr(mesh, "axis_types", ())):
        return None
    return sharding


def _local_dot(x, w, settings: Settings):
    precision = settings.precision
    if precision is None and not settings.fast_f32:
        precision = jax.lax.Precision.HIGHEST
    extra = {} if settings.out_sharding is None else {"out_sharding": settings.out_sharding}
    return jnp.matmul(x, w, precision=precision, preferred_element_type=settings.out_dtype,
                      **extra).astype(settings.out_dtype)


_partitioned = custom_partitioning(_local_dot, static_argnums=(2,))


# ----------------------------------------------------------------------------
# The choice: a pure function of the mesh, the shapes and the shardings.
# ----------------------------------------------------------------------------
class Choice(NamedTuple):
    """What one partitioned call runs on each device's shards."""
    op: str                # "all_gather_matmul", ..., "local" or "fallback"
    kind: object           # the library kind (None: local dot or all-reduce)
    axes: tuple            # the collective's mesh axes (row-major ranks)
    dimension: int         # the gathered or scattered dim of x / the result (row ops)
    x_spec: tuple          # each operand's and the result's sharding, per dim a tuple of axes
    w_spec: tuple
    out_spec: tuple
    why: str = ""
    psum_axes: tuple = ()  # summed after the fused op (XLA's all-reduce)

    def describe(self) -> str:
        if self.op == "local":
            return "a local dot (no collective needed)"
        if self.op == "fallback":
            return f"XLA's collectives, then a local dot ({self.why})"
        where = f", dimension {self.dimension}" if self.op in ("all_gather_matmul", "matmul_reduce_scatter") else ""
        then = f", then psum over {self.psum_axes}" if self.psum_axes else ""
        return f"{self.op} over {self.axes}{where}{then}"


def spec_axes(spec, ndim: int) -> tuple:
    """A PartitionSpec as a tuple of `ndim` tuples of mesh axes."""
    entries = list(spec) + [None] * (ndim - len(spec))
    out = []
    for entry in entries[:ndim]:
        if entry is None or entry is P.UNCONSTRAINED:
            out.append(())
        elif isinstance(entry, (tuple, list)):
            out.append(tuple(entry))
        else:
            out.append((entry,))
    return tuple(out)


def _extra(longer: tuple, shorter: tuple):
    """The axes `longer` adds after `shorter` (a prefix of it), else None."""
    if longer[:len(shorter)] != shorter or len(longer) == len(shorter):
        return None
    return longer[len(shorter):]


def choose(mesh_shape: dict, x_shape, w_shape, x_spec, w_spec, out_spec) -> Choice:
    """The fused op (or local dot, or fallback) for ``x @ w`` with these
    shardings (per dim, a tuple of mesh axes); `mesh_shape` maps axis names
    to sizes."""
    nr = len(x_shape) - 1
    xr, xk, wk, wn = x_spec[:nr], x_spec[nr], w_spec[0], w_spec[1]
    outr, outn = out_spec[:nr], out_spec[nr]

    def size(axes):
        return math.prod(mesh_shape[a] for a in axes)

    def fallback(why):
        return Choice("fallback", None, (), 0, outr + ((),), ((), outn), out_spec, why)

    for what, shape, spec in (("x", x_shape, x_spec), ("w", w_shape, w_spec)):
        for d, (n, axes) in enumerate(zip(shape, spec)):
            if axes and n % size(axes):
                return fallback(f"{what}'s dim {d} ({n}) does not divide over {axes}")
    events = []  # (what, axes, dim)
    # The axes both contractions share (leading) are summed over; what one
    # of them adds is gathered first (data parallelism's gradient sum beside
    # a tensor-parallel gather: the gather fused, then a psum).
    common = 0
    while common < min(len(xk), len(wk)) and xk[common] == wk[common]:
        common += 1
    reduce, x_more, w_more = xk[:common], xk[common:], wk[common:]
    if x_more and w_more:
        return fallback(f"x's contraction is sharded over {xk} and w's over {wk}")
    if x_more:
        events.append(("gather_x_k", x_more, 0))
    elif w_more:
        events.append(("gather_w_k", w_more, 0))
    for d in range(nr):
        if xr[d] == outr[d]:
            continue
        gathered, scattered = _extra(xr[d], outr[d]), _extra(outr[d], xr[d])
        if gathered:
            events.append(("gather_x_rows", gathered, d))
        elif scattered:
            events.append(("scatter_rows", scattered, d))
        else:
            return fallback(f"x's dim {d} is sharded over {xr[d]} and the result's over {outr[d]}")
    if wn != outn:
        gathered, scattered = _extra(wn, outn), _extra(outn, wn)
        if gathered:
            events.append(("gather_w_n", gathered, 0))
        elif scattered:
            events.append(("scatter_n", scattered, 0))
        else:
            return fallback(f"w's columns are sharded over {wn} and the result's over {outn}")
    if len(events) > 1:
        return fallback("more than one collective: " + ", ".join(f"{e[0]} over {e[1]}" for e in events))
    if not events:
        if reduce:
            return Choice("matmul_all_reduce", None, reduce, 0, x_spec, w_spec, out_spec)
        return Choice("local", None, (), 0, x_spec, w_spec, out_spec)
    what, axes, d = events[0]
    scatters = {"scatter_rows": ("matmul_reduce_scatter", Kind.MATMUL_REDUCE_SCATTER),
                "scatter_n": ("matmul_reduce_scatter", Kind.MATMUL_REDUCE_SCATTER_COLS)}
    if what in scatters:
        if axes != reduce:
            return fallback(f"the result is scattered over {axes} but the contraction is sharded over {reduce}")
        op, kind = scatters[what]
        return Choice(op, kind, axes, d if what == "scatter_rows" else nr, x_spec, w_spec, out_spec)
    gathers = {"gather_x_rows": ("all_gather_matmul", Kind.ALL_GATHER_MATMUL),
               "gather_x_k": ("all_gather_matmul", Kind.ALL_GATHER_MATMUL_CONTRACT),
               "gather_w_n": ("matmul_all_gather", Kind.MATMUL_ALL_GATHER),
               "gather_w_k": ("matmul_all_gather", Kind.MATMUL_ALL_GATHER_CONTRACT)}
    op, kind = gathers[what]
    dimension = {"gather_x_rows": d, "gather_x_k": nr, "gather_w_n": 1, "gather_w_k": 0}[what]
    return Choice(op, kind, axes, dimension, x_spec, w_spec, out_spec, psum_axes=reduce)


def run_choice(choice: Choice, x, w, settings: Settings, ranks: int):
    """`choice` on one device's shards `x` and `w` (inside the partitioned program)."""
    if choice.op in ("local", "fallback"):
        return _local_dot(x, w, settings._replace(out_sharding=None))  # shards: no mesh here
    common = dict(out_dtype=settings.out_dtype, schedule=settings.schedule, axes=choice.axes, ranks=ranks,
                  fast_f32=settings.fast_f32)
    if choice.op == "matmul_all_reduce":
        static = _matmul_all_reduce.settle(x.shape, w.shape, x.dtype, settings.out_dtype, axes=choice.axes,
                                           ranks=ranks, schedule=settings.schedule, tiles=None,
                                           fast_f32=settings.fast_f32, schedule_name=_abi.schedule_name(
                                               settings.schedule))
        return _matmul_all_reduce.forward(x, w, static)
    kind = choice.kind
    if kind in (Kind.ALL_GATHER_MATMUL, Kind.MATMUL_REDUCE_SCATTER):
        out = _fused.call(kind, x, w, dimension=choice.dimension, **common)
    else:
        rows = _fused.rows_2d(x)
        if kind in (Kind.MATMUL_ALL_GATHER, Kind.MATMUL_ALL_GATHER_CONTRACT):
            out = _fused.call(kind, w, rows, **common)  # w travels: it is the first operand
        else:
            out = _fused.call(kind, rows, w, **common)
        out = out.reshape(x.shape[:-1] + (out.shape[-1],))
    return jax.lax.psum(out, choice.psum_axes) if choice.psum_axes else out


# ----------------------------------------------------------------------------
# What the partitioner calls.
# ----------------------------------------------------------------------------
class Partitioned(NamedTuple):
    """One call's choice, as the report shows it."""
    site: int
    x_shape: tuple
    w_shape: tuple
    choice: Choice
    ran_as: tuple   # what the fused ops ran as: (op, schedule, why) per library call

    def line(self) -> str:
        counts = {}
        for entry in self.ran_as:
            counts[entry] = counts.get(entry, 0) + 1
        ran = "; ".join(f"{f'{n} x ' if n > 1 else ''}{op}: {schedule} ({why})"
                        for (op, schedule, why), n in counts.items())
        return (f"commfuse.matmul#{self.site} x{list(self.x_shape)} @ w{list(self.w_shape)}: "
                f"{self.choice.describe()}" + (f"; ran as {ran}" if ran else ""))


_LOCK = threading.Lock()
_LISTENERS: list = []  # weak references: a listener lives as long as its owner keeps it


def listen(callback):
    """Calls `callback(Partitioned)` for every call partitioned from now on,
    while `callback` is alive (held weakly): how ``overlap``'s report learns
    what each call became."""
    with _LOCK:
        _LISTENERS.append(weakref.ref(callback))


def _record(entry: Partitioned):
    with _LOCK:
        _LISTENERS[:] = [ref for ref in _LISTENERS if ref() is not None]
        listeners = [ref() for ref in _LISTENERS]
    for callback in listeners:
        if callback is not None:
            callback(entry)


def _sharding(mesh, spec: tuple):
    return NamedSharding(mesh, P(*[axes if len(axes) != 1 else axes[0] if axes else None for axes in spec]))


def _specs(mesh, arg_shapes, result_shape):
    x, w = arg_shapes
    return (spec_axes(x.sharding.spec, x.ndim), spec_axes(w.sharding.spec, 2),
            spec_axes(result_shape.sharding.spec, len(result_shape.shape)))


def _partition(settings: Settings, mesh, arg_shapes, result_shape):
    x, w = arg_shapes
    x_spec, w_spec, out_spec = _specs(mesh, arg_shapes, result_shape)
    choice = choose(dict(mesh.shape), x.shape, w.shape, x_spec, w_spec, out_spec)
    ranks = math.prod(mesh.shape[a] for a in choice.axes)

    def lower(x_local, w_local):
        # Traced by the partitioner once this returns; what the fused ops
        # decided (auto's pick) is known only then.
        made = len(_fused.decisions())
        with _compat.auto_axes_scope():
            out = run_choice(choice, x_local, w_local, settings, ranks)
        _record(Partitioned(settings.site, tuple(x.shape), tuple(w.shape), choice, tuple(_fused.decisions()[made:])))
        return out

    return (mesh, lower, _sharding(mesh, choice.out_spec),
            (_sharding(mesh, choice.x_spec), _sharding(mesh, choice.w_spec)))


def _infer_from_operands(settings: Settings, mesh, arg_shapes, result_shape):
    """GSPMD's propagation (when Shardy is off): x's rows and w's columns,
    an axis on both kept on the columns (the all-gather matmul's result)."""
    x, w = arg_shapes
    x_spec, w_spec = spec_axes(x.sharding.spec, x.ndim), spec_axes(w.sharding.spec, 2)
    used = set(w_spec[1]) | set(x_spec[-1])
    rows = tuple(tuple(a for a in axes if a not in used) for axes in x_spec[:-1])
    return _sharding(mesh, rows + (w_spec[1],))


def _sharding_rule(settings: Settings, mesh, value_types, result_types):
    rows = " ".join(f"r{i}" for i in range(settings.x_ndim - 1))
    return f"{rows} k, k n -> {rows} n", {"reduction_factors": ("k",)}


_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer_from_operands,
                           sharding_rule=_sharding_rule)
