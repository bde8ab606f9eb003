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
the result (data parallelism beside the collective). Two collectives over
two axes (A, B) are one op over both where the dot has its form, and where
that op does not run, XLA's first collective then the fused second:

=========================================================  ==================================================
shardings                                                   runs as
=========================================================  ==================================================
w's rows on A, x's rows on B                                ``all_gather_both_matmul``
w's columns on A, the result's rows scattered on B          ``all_gather_matmul_reduce_scatter``
one contraction on A and B, the other's and the result's    ``all_gather_contract_matmul_reduce_scatter``
rows (or columns) on B                                      (on the transpose for the columns)
=========================================================  ==================================================

Anything else is the fallback: each operand resharded by XLA to what a
local dot of the result's shard needs, then that dot (same numbers, XLA's
collectives).

The VJP is made of the same op: ``dx = dy @ wᵀ`` and ``dw = xᵀ @ dy`` (x's
rows contracted), each partitioned by the same rule, so the backward pass
fuses its collectives too.
"""

from __future__ import annotations

import contextlib
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
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _abi, _both_sides, _checks, _compat, _fused, _matmul_all_reduce
from . import _all_gather_both_matmul as two_gathers_op
from . import _all_gather_contract_matmul_reduce_scatter as contract_scatter_op
from . import _all_gather_matmul_reduce_scatter as two_axis_op
from ._decide import Policy, decide, decide_dot, mesh_of_trace
from ._decision import Call, Decision
from ._dot_form import DotForm, Unsupported
from ._abi import Kind

TWO_AXIS_OP = two_axis_op.OP
TWO_GATHERS_OP = two_gathers_op.OP
CONTRACT_SCATTER_OP = contract_scatter_op.OP

OP = "matmul"
# The schedules the jit-level op takes ("sliced" and "tiled" need a shard_map
# op's own arguments).
SCHEDULES = tuple(s for s in _abi.SCHEDULES if s not in _abi.CUT_SCHEDULES)

_sites = itertools.count(1)


class Settings(NamedTuple):
    """The static arguments of one partitioned 2-D product (hashable:
    custom_partitioning's static argument). `policy` decides its library
    calls (never strict: a schedule the shards make impossible runs
    unfused, with the reason); its `owner`'s report hears what it became."""
    policy: Policy
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
    XLA's own collectives. Differentiable: the backward products are the
    ones JAX's own transpose of the dot makes, each partitioned the same way.

    ``schedule``: "auto" (judged before partitioning, from the global shapes
    and the mesh: a product it declines is XLA's own dot, as ``jnp.matmul``;
    one it fuses runs the cost model's best schedule), "ring", "bidirectional",
    "sequential" or "unfused". A schedule the shardings make impossible
    (fewer rows than ranks, say) runs the unfused form, and the report says
    so. ``out_sharding`` is ``jnp.matmul``'s: with explicit mesh axes, the
    result's sharding where the operands leave it ambiguous (a sharded
    contraction). Outside ``jit``, on one device or inside a ``shard_map``
    over every mesh axis it is ``jnp.matmul``.
    """
    code = _schedule_code(schedule)
    out_sharding = _as_sharding(out_sharding)
    if not hasattr(x, "ndim") or not hasattr(w, "ndim"):
        x, w = jnp.asarray(x), jnp.asarray(w)
    _checks.check_matmul_operands(OP, x, w)
    _checks.fast_f32(OP, precision)  # checks it
    x, w, out_dtype = _checks.promote(OP, x, w, preferred_element_type)
    matmul_dims = (((x.ndim - 1,), (0,)), ((), ()))
    static = DotStatic(matmul_dims, _hashable_precision(precision), np.dtype(out_dtype), out_sharding,
                       Policy(asked=code, strict=False), next(_sites), code == _abi.AUTO)
    if _outside_partitioning(x, w) is not None:
        return static.plain(x, w)
    if code == _abi.AUTO:
        fuse, _ = _decide_early(x, w, DotForm(x.shape, w.shape, matmul_dims, 0), out_dtype)
        if not fuse:  # judged before partitioning: XLA's own dot, as jnp.matmul would be
            return _kept_dot(x, w, static)
    return _fused_dot(x, w, static)


def dot_general(lhs, rhs, dimension_numbers, *, precision=None, preferred_element_type=None, out_sharding=None,
                policy: Policy = Policy(strict=False), decide_early=False):
    """``jax.lax.dot_general(lhs, rhs, ...)`` as `matmul` where it is ``x @
    w`` up to transposes and flattening (`DotForm`): ``(result, site, why)``,
    its calls decided under `policy` once partitioned. Under "auto" with
    `decide_early`, a dot the cost model declines before partitioning
    (`_decide.decide_dot`) is XLA's own dot (`site` None, `why`
    says why); its backward products are judged each on its own, as
    ``overlap(grad(f))`` judges them. Raises `Unsupported` (nothing traced)
    for any other dot: batch dims, an outer product, dtypes the library
    lacks, no elements, or an explicit result sharding the 2-D product
    cannot take."""
    form = DotForm(lhs.shape, rhs.shape, dimension_numbers, 0, precision, preferred_element_type)
    dtypes = [np.dtype(a.dtype) for a in (lhs, rhs)]
    if any(d not in _abi.DTYPE_CODES for d in dtypes):
        raise Unsupported(f"operand dtypes {[str(d) for d in dtypes]} are not float32, bfloat16, float16 or float64")
    if 0 in lhs.shape or 0 in rhs.shape:
        raise Unsupported("an operand has no elements")
    if _named(out_sharding) and _mapped_out_sharding(out_sharding, form) is None:
        raise Unsupported(f"its explicit out_sharding cannot be given to the 2-D product{form.notes()}")
    form.check_mergeable(lhs, rhs)
    pet = None if preferred_element_type is None else np.dtype(preferred_element_type)
    static = DotStatic(_hashable_dims(dimension_numbers), _hashable_precision(precision), pet, out_sharding,
                       policy._replace(strict=False), next(_sites), decide_early)
    outside = _outside_partitioning(lhs, rhs)
    if outside is not None:
        return static.plain(lhs, rhs), None, outside
    if policy.asked == _abi.AUTO and decide_early:
        fuse, why = _decide_early(lhs, rhs, form, preferred_element_type, policy)
        if not fuse:
            return _kept_dot(lhs, rhs, static), None, f"auto: {why}"
    return _fused_dot(lhs, rhs, static), static.site, None


def _outside_partitioning(lhs, rhs) -> str | None:
    """Why a product must be jax.lax's dot, or None: the partitioned op is a
    custom_vjp around a custom_partitioning, and JAX can neither batch a
    custom_partitioning (``jax.vmap``) nor differentiate a custom_vjp
    forward (``jax.jvp``, ``jacfwd``)."""
    if _compat.traced_by("vmap", lhs, rhs):
        return "under jax.vmap, which cannot batch a partitioned op: jax.lax's dot"
    if _compat.traced_by("jvp", lhs, rhs):
        return "under forward-mode differentiation (jax.jvp, jacfwd): jax.lax's dot"
    return None


def _decide_early(lhs, rhs, form: DotForm, preferred_element_type, policy: Policy = Policy()) -> tuple[bool, str]:
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    out = dtype if preferred_element_type is None else np.dtype(preferred_element_type)
    m = math.prod(form.x_shape[d] for d in form.x_free)
    k = math.prod(form.x_shape[d] for d in form.xc)
    n = math.prod(form.w_shape[d] for d in form.w_free)
    mesh_axes, devices = mesh_of_trace()
    return decide_dot(m, k, n, np.dtype(dtype), np.dtype(out), mesh_axes, devices, policy.resolved_machine())


def _schedule_code(schedule) -> int:
    if schedule not in SCHEDULES:
        raise ValueError(f"commfuse.{OP}: unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
    return _abi.SCHEDULES[schedule]


def _hashable_precision(precision):
    if isinstance(precision, list):
        return tuple(precision)
    return precision


def _hashable_dims(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(int(d) for d in lc), tuple(int(d) for d in rc)), (tuple(int(d) for d in lb),
                                                                     tuple(int(d) for d in rb))


def _as_sharding(out_sharding):
    """`out_sharding` as a sharding: a bare ``PartitionSpec`` names axes of
    the mesh in context (``jax.set_mesh``), as ``jnp.matmul`` reads it."""
    if not isinstance(out_sharding, P):
        return out_sharding
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names:
        raise ValueError(f"commfuse.matmul: out_sharding={out_sharding} is a PartitionSpec, whose axes name the mesh "
                         f"in context, and there is none: call under jax.set_mesh(mesh), or pass a NamedSharding")
    return NamedSharding(mesh, out_sharding)


def _named(sharding) -> bool:
    """Whether a dot's result sharding names mesh axes (explicit axes); JAX
    records an empty one for dots on automatic axes."""
    spec = getattr(sharding, "spec", None)
    return spec is not None and any(entry is not None for entry in spec)


def _mapped_out_sharding(sharding, form: DotForm):
    """The dot's explicit result sharding for the product ``prep_x(x) @
    prep_w(w)``, whose dims are x's free dims and w's free dims flattened:
    the same spec where w keeps one free dim, or where the flattened ones
    after the first are not sharded; None where it cannot be said."""
    nx, nw = len(form.x_free), len(form.w_free)
    if form.x_side != 0 or nw == 0:
        return None
    spec = tuple(sharding.spec) + (None,) * (nx + nw - len(sharding.spec))
    if any(entry is not None for entry in spec[nx + 1:]):
        return None
    mapped = P(*spec[:nx + 1])
    # On the dot's own mesh: a bare spec needs one in context (`jax.set_mesh`).
    mesh = getattr(sharding, "mesh", None)
    return mapped if mesh is None else NamedSharding(mesh, mapped)


# ----------------------------------------------------------------------------
# One dot_general, fused; its backward is JAX's own transpose of the dot,
# each of whose dots is fused in turn. So `grad(overlap(f))` and
# `overlap(grad(f))` make the same products, by construction.
# ----------------------------------------------------------------------------
class DotStatic(NamedTuple):
    """The static arguments of one fused dot_general (hashable)."""
    dimension_numbers: tuple
    precision: object
    preferred_element_type: object
    out_sharding: object
    policy: Policy
    site: int
    decided_early: bool = False  # "auto" judged this dot before partitioning (`_decide.decide_dot`)

    def plain(self, lhs, rhs):
        """The dot as jax.lax computes it: the oracle, and what the backward transposes."""
        extra = {"out_sharding": self.out_sharding} if _named(self.out_sharding) else {}
        return jax.lax.dot_general(lhs, rhs, self.dimension_numbers, precision=self.precision,
                                   preferred_element_type=self.preferred_element_type, **extra)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fused_dot(lhs, rhs, static: DotStatic):
    form = DotForm(lhs.shape, rhs.shape, static.dimension_numbers, 0, static.precision,
                   static.preferred_element_type)
    want = jax.eval_shape(static.plain, lhs, rhs)
    x, w = form.prep_x(lhs), form.prep_w(rhs)
    fast = _checks.fast_f32(OP, static.precision)
    x, w, out_dtype = _checks.promote(OP, x, w, static.preferred_element_type)
    out_sharding = _mapped_out_sharding(static.out_sharding, form) if _named(static.out_sharding) else None
    policy = static.policy._replace(decline=static.policy.decline and not static.decided_early)
    settings = Settings(policy, np.dtype(out_dtype), fast, static.precision, x.ndim, static.site, out_sharding)
    return form.finish(_partitioned(x, w, settings)).astype(want.dtype)


def _fused_dot_fwd(lhs, rhs, static):
    return _fused_dot(lhs, rhs, static), (lhs, rhs)


def _fused_dot_bwd(static, residuals, ct):
    lhs, rhs = residuals
    _, transpose = jax.vjp(static.plain, lhs, rhs)
    closed = jax.make_jaxpr(transpose)(ct)
    return tuple(fuse_dots(closed.jaxpr, closed.consts, [ct], policy=static.policy,
                           decide_early=static.decided_early, on_dot=_report_backward(static)))


_fused_dot.defvjp(_fused_dot_fwd, _fused_dot_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _kept_dot(lhs, rhs, static: DotStatic):
    """A dot `auto` declined: XLA's own, with a backward whose products are
    judged one by one (`_fused_dot_bwd`)."""
    return static.plain(lhs, rhs)


_kept_dot.defvjp(lambda lhs, rhs, static: (static.plain(lhs, rhs), (lhs, rhs)), _fused_dot_bwd)


def _report_backward(static: DotStatic):
    """What the backward of `static`'s dot did with each of its dots, for its owner's report."""
    if not static.policy.owner:
        return None

    def on_dot(eqn, site, why):
        what = f"commfuse.matmul#{site}" if site is not None else f"kept ({why})"
        _record(Traced(static.policy.owner, f"backward of dot #{static.site}: {_describe(eqn)} -> {what}"))

    return on_dot


def _describe(eqn) -> str:
    def fmt(aval):
        return f"{np.dtype(aval.dtype).name}[{','.join(str(d) for d in aval.shape)}]"

    lhs, rhs = (v.aval for v in eqn.invars)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    dims = f"contract {tuple(lc)}x{tuple(rc)}" + (f", batch {tuple(lb)}x{tuple(rb)}" if lb or rb else "")
    return f"dot_general({fmt(lhs)} @ {fmt(rhs)} -> {fmt(eqn.outvars[0].aval)}, {dims})"


def fuse_dots(jaxpr, consts, args, *, policy: Policy, decide_early: bool = False, on_dot=None) -> list:
    """Evaluates `jaxpr` with each of its top-level dot_generals as `dot_general`
    (those that are not ``x @ w`` as they are); `on_dot(eqn, site, why)` hears
    of each (site None: kept, `why` says why)."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, val in zip(jaxpr.constvars, consts):
        env[v] = val
    for v, val in zip(jaxpr.invars, args):
        env[v] = val
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = None
        if eqn.primitive.name == "dot_general":
            p = eqn.params
            try:
                out, site, why = dot_general(*invals, p["dimension_numbers"], precision=p.get("precision"),
                                             preferred_element_type=p.get("preferred_element_type"),
                                             out_sharding=p.get("out_sharding"), policy=policy,
                                             decide_early=decide_early)
                outs = [out]
                if on_dot is not None:
                    on_dot(eqn, site, why)
            except Unsupported as e:
                if on_dot is not None:
                    on_dot(eqn, None, str(e))
        if outs is None:
            outs = _compat.bind_eqn(eqn, invals)
        for v, val in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = val
    return [read(v) for v in jaxpr.outvars]


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
    # The ops over two axes only: the choice where it does not run (XLA's
    # gather of w, then the fused reduce-scatter or gather of x's rows).
    otherwise: object = None

    def describe(self) -> str:
        if self.op == "local":
            return "a local dot (no collective needed)"
        if self.op == "fallback":
            return f"XLA's collectives, then a local dot ({self.why})"
        where = f", dimension {self.dimension}" if self.op in ("all_gather_matmul", "matmul_reduce_scatter",
                                                              TWO_AXIS_OP, TWO_GATHERS_OP,
                                                              CONTRACT_SCATTER_OP) else ""
        then = f", then psum over {self.psum_axes}" if self.psum_axes else ""
        first = f" ({self.why})" if self.why else ""
        return f"{self.op} over {self.axes}{where}{then}{first}"


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

    out_shape = (*x_shape[:nr], w_shape[-1])
    for what, shape, spec in (("x", x_shape, x_spec), ("w", w_shape, w_spec), ("the result", out_shape, out_spec)):
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
        weight = [e for e in events if e[0] in ("gather_w_k", "gather_w_n")]
        if len(events) == 2 and len(weight) == 1:
            # FSDP beside tensor or sequence parallelism: XLA gathers the
            # weight first (it depends on no activation, so XLA may start it
            # early), and the activation's collective is the fused one.
            what, axes, _ = weight[0]
            gathered_w = (reduce, wn) if what == "gather_w_k" else (wk, outn)
            inner = choose(mesh_shape, x_shape, w_shape, x_spec, gathered_w, out_spec)
            if inner.op not in ("fallback", "local"):
                inner = inner._replace(why=f"w gathered over {axes} by XLA first")
                rows = next(e for e in events if e is not weight[0])
                if what == "gather_w_n" and rows[0] == "scatter_rows" and len(axes) == 1 and rows[1] == reduce \
                        and len(reduce) == 1:
                    # w's columns gathered over one axis, the rows scattered
                    # over the contraction's (FSDP x TP row-parallel): one op
                    # over both, where the policy runs it (`_decide_two_axis`).
                    return Choice(TWO_AXIS_OP, Kind.ALL_GATHER_MATMUL_REDUCE_SCATTER, axes + reduce, rows[2],
                                  x_spec, w_spec, out_spec, otherwise=inner)
                if what == "gather_w_k" and rows[0] == "gather_x_rows" and len(axes) == 1 and len(rows[1]) == 1 \
                        and axes != rows[1] and not reduce:
                    # w's rows gathered over one axis, x's rows over another
                    # (SP x FSDP column-parallel): one op over both, where the
                    # policy runs it (`_decide_two_gathers`).
                    return Choice(TWO_GATHERS_OP, Kind.ALL_GATHER_BOTH_MATMUL, axes + rows[1], rows[2], x_spec,
                                  w_spec, out_spec, otherwise=inner)
                if what == "gather_w_k" and rows[0] == "scatter_n" and len(axes) == 1 and len(rows[1]) == 1 \
                        and set(rows[1]) <= set(reduce):
                    # w's contraction gathered over one axis, the result's
                    # columns reduce-scattered over another (as JAX writes the
                    # weight gradient of sequence-parallel activations for an
                    # FSDP weight, dyᵀ @ h): the gather-contract-scatter op on
                    # the transpose, where the policy runs it
                    # (`_decide_contract_scatter`).
                    rest = tuple(a for a in reduce if a not in rows[1])
                    return Choice(CONTRACT_SCATTER_OP, Kind.ALL_GATHER_CONTRACT_MATMUL_REDUCE_SCATTER, axes + rows[1],
                                  nr, x_spec, w_spec, out_spec, psum_axes=rest, otherwise=inner)
                return inner
        contraction = [e for e in events if e[0] == "gather_x_k"]
        rows = [e for e in events if e[0] == "scatter_rows"]
        if len(events) == 2 and contraction and rows and len(contraction[0][1]) == 1 and len(rows[0][1]) == 1 \
                and set(rows[0][1]) <= set(reduce):
            # x's contraction gathered over one axis, the result's rows
            # reduce-scattered over another (a weight gradient of
            # sequence-parallel activations for an FSDP weight, hᵀ @ dy):
            # one op over both, where the policy runs it
            # (`_decide_contract_scatter`); otherwise XLA gathers x's
            # contraction first and the reduce-scatter is fused. The
            # contraction's other axes are summed after either.
            gathered_x = x_spec[:nr] + (reduce,)
            inner = choose(mesh_shape, x_shape, w_shape, gathered_x, w_spec, out_spec)
            if inner.op not in ("fallback", "local"):
                inner = inner._replace(why=f"x's contraction gathered over {contraction[0][1]} by XLA first")
                rest = tuple(a for a in reduce if a not in rows[0][1])
                return Choice(CONTRACT_SCATTER_OP, Kind.ALL_GATHER_CONTRACT_MATMUL_REDUCE_SCATTER,
                              contraction[0][1] + rows[0][1], rows[0][2], x_spec, w_spec, out_spec, psum_axes=rest,
                              otherwise=inner)
        return fallback("more than one collective: " + ", ".join(f"{e[0]} over {e[1]}" for e in events))
    if not events:
        if reduce:
            return Choice("matmul_all_reduce", None, reduce, 0, x_spec, w_spec, out_spec)
        return Choice("local", None, (), 0, x_spec, w_spec, out_spec)
    what, axes, d = events[0]
    scatters = {"scatter_rows": ("matmul_reduce_scatter", Kind.MATMUL_REDUCE_SCATTER),
                "scatter_n": ("matmul_reduce_scatter", Kind.MATMUL_REDUCE_SCATTER_COLS)}
    if what in scatters:
        rest = tuple(a for a in reduce if a not in axes)
        if not set(axes) <= set(reduce) or not axes:
            return fallback(f"the result is scattered over {axes} but the contraction is sharded over {reduce}")
        # The contraction's other axes (data parallelism's, beside FSDP's
        # scatter of a weight gradient) are summed after the fused op.
        op, kind = scatters[what]
        return Choice(op, kind, axes, d if what == "scatter_rows" else nr, x_spec, w_spec, out_spec, psum_axes=rest)
    gathers = {"gather_x_rows": ("all_gather_matmul", Kind.ALL_GATHER_MATMUL),
               "gather_x_k": ("all_gather_matmul", Kind.ALL_GATHER_MATMUL_CONTRACT),
               "gather_w_n": ("matmul_all_gather", Kind.MATMUL_ALL_GATHER),
               "gather_w_k": ("matmul_all_gather", Kind.MATMUL_ALL_GATHER_CONTRACT)}
    op, kind = gathers[what]
    dimension = {"gather_x_rows": d, "gather_x_k": nr, "gather_w_n": 1, "gather_w_k": 0}[what]
    return Choice(op, kind, axes, dimension, x_spec, w_spec, out_spec, psum_axes=reduce)


class Decided(NamedTuple):
    """What one partitioned product runs as, decided from its shards'
    shapes before anything is traced: its `choice`, the decisions of its
    library calls (`calls`, in the order they run) and, where the choice
    is a gather then a sum over other axes run as `_both_sides` tiles,
    how (`tiling` and `why`), or `matmul_all_reduce`'s or the op over both
    axes' settings."""
    choice: Choice
    calls: tuple
    all_reduce: object = None
    tiling: object = None
    tiles_why: str = ""
    two_axis: object = None  # the op over both axes' settings
    two_gathers: object = None  # the two-gather op's settings
    contract_scatter: object = None  # the gather-contract-scatter op's settings

    @property
    def fused(self) -> int:
        """How many library calls (fused ops) it runs."""
        return sum(1 for d in self.calls if d.fused)


def decide_choice(choice: Choice, x_shape, w_shape, dtype, settings: Settings, sizes: dict) -> Decided:
    """The decisions of `choice` on one device's shards of these shapes
    (see `Decided`); a schedule the shards make impossible (fewer rows than
    the ring has blocks, say) runs unfused, the reason in its decision.
    `sizes`: the mesh's axis sizes."""
    policy = settings.policy
    ranks = math.prod(sizes[a] for a in choice.axes)
    if choice.op in ("local", "fallback"):
        return Decided(choice, ())
    if choice.op == "matmul_all_reduce":
        settled = _matmul_all_reduce.settle(x_shape, w_shape, dtype, settings.out_dtype, axes=choice.axes,
                                            ranks=ranks, policy=policy, tiles=None, fast_f32=settings.fast_f32)
        return Decided(choice, (settled.forward,), all_reduce=settled)
    if choice.psum_axes and policy.asked != _abi.UNFUSED and choice.op in ("all_gather_matmul",
                                                                            "matmul_all_gather"):
        tiled = _decide_tiles(choice, x_shape, w_shape, dtype, settings, ranks,
                              math.prod(sizes[a] for a in choice.psum_axes))
        if tiled is not None:
            return tiled
    call = _call_of(choice, choice.kind, x_shape, w_shape, dtype, settings, ranks)
    return Decided(choice, (decide(call, policy, choice.axes),))


def _call_of(choice: Choice, kind, x_shape, w_shape, dtype, settings: Settings, ranks: int) -> Call:
    """The library call `choice` makes on shards of these shapes (the
    traveling operand first: w for the weight gathers)."""
    rows = (math.prod(x_shape[:-1]), x_shape[-1])
    if kind in _abi.ROW_BLOCK_KINDS:
        first, second, dimension = x_shape, w_shape, choice.dimension
    elif kind in (Kind.MATMUL_ALL_GATHER, Kind.MATMUL_ALL_GATHER_CONTRACT):
        first, second, dimension = w_shape, rows, 0
    else:
        first, second, dimension = rows, w_shape, 0
    return Call.of(kind, ranks, dimension, first, second, dtype, settings.out_dtype)


def run_decided(decided: Decided, x, w, settings: Settings):
    """`decided` on one device's shards `x` and `w` (inside the partitioned program)."""
    choice = decided.choice
    if choice.op in ("local", "fallback"):
        return _local_dot(x, w, settings._replace(out_sharding=None))  # shards: no mesh here
    if decided.all_reduce is not None:
        return _matmul_all_reduce.forward(x, w, decided.all_reduce)
    if decided.two_axis is not None:
        # The op scatters x's leading dim: the scattered one moved there and back.
        d = choice.dimension
        return jnp.moveaxis(two_axis_op.forward(jnp.moveaxis(x, d, 0), w, decided.two_axis), 0, d)
    if decided.two_gathers is not None:
        # The op gathers x's leading dim: the gathered one moved there and back.
        d = choice.dimension
        return jnp.moveaxis(two_gathers_op.forward(jnp.moveaxis(x, d, 0), w, decided.two_gathers), 0, d)
    if decided.contract_scatter is not None:
        # The op reduce-scatters the rows of its (2-D) x.
        scattered = decided.contract_scatter.scattered
        if choice.dimension < x.ndim - 1:
            # x's dim d: moved first, the rows flattened, and back.
            moved = jnp.moveaxis(x, choice.dimension, 0)
            out = contract_scatter_op.forward(_fused.rows_2d(moved), w, decided.contract_scatter)
            out = out.reshape((moved.shape[0] // scattered, *moved.shape[1:-1], out.shape[-1]))
            out = jnp.moveaxis(out, 0, choice.dimension)
        else:
            # The result's columns: (x @ w)ᵀ = wᵀ @ xᵀ, w's columns the op's rows.
            out = contract_scatter_op.forward(w.T, _fused.rows_2d(x).T, decided.contract_scatter).T
            out = out.reshape((*x.shape[:-1], out.shape[-1]))
        return jax.lax.psum(out, choice.psum_axes) if choice.psum_axes else out
    if decided.tiling is not None:
        side, *_ = _gathered_operand(choice.kind, x.ndim, choice.dimension)
        operand = (x, w)[side]
        parts = []
        for t, decision in enumerate(decided.calls):
            tile = decided.tiling.tile(operand, t)
            x_t, w_t = (tile, w) if side == 0 else (x, tile)
            parts.append(jax.lax.psum(_bind(choice, decision, x_t, w_t, settings), choice.psum_axes))
        return decided.tiling.combine(parts)
    out = _bind(choice, decided.calls[0], x, w, settings)
    return jax.lax.psum(out, choice.psum_axes) if choice.psum_axes else out


def _bind(choice: Choice, decision: Decision, x, w, settings: Settings):
    """One library call of `choice` on shards `x` and `w`, as `decision` says."""
    kind = choice.kind
    if kind in _abi.ROW_BLOCK_KINDS:
        return _fused.bind(decision, x, w, axes=choice.axes, fast_f32=settings.fast_f32)
    rows = _fused.rows_2d(x)
    if kind in (Kind.MATMUL_ALL_GATHER, Kind.MATMUL_ALL_GATHER_CONTRACT):
        out = _fused.bind(decision, w, rows, axes=choice.axes, fast_f32=settings.fast_f32)  # w travels
    else:
        out = _fused.bind(decision, rows, w, axes=choice.axes, fast_f32=settings.fast_f32)
    return out.reshape(x.shape[:-1] + (out.shape[-1],))


# The gathered operand of each gather kind: (which operand, its gathered dim
# as a function of x's rank and the choice's dimension, its dims the result
# keeps, and the result dim each becomes).
def _gathered_operand(kind, x_ndim: int, dimension: int):
    if kind == Kind.ALL_GATHER_MATMUL:
        return 0, dimension, list(range(x_ndim - 1)), lambda d: d
    if kind == Kind.ALL_GATHER_MATMUL_CONTRACT:
        return 0, x_ndim - 1, list(range(x_ndim - 1)), lambda d: d
    if kind == Kind.MATMUL_ALL_GATHER:
        return 1, 1, [1], lambda d: x_ndim - 1
    return 1, 0, [1], lambda d: x_ndim - 1  # MATMUL_ALL_GATHER_CONTRACT


def _decide_tiles(choice: Choice, x_shape, w_shape, dtype, settings: Settings, ranks: int,
                  n_reduce: int) -> Decided | None:
    """A gather over `choice.axes` then a sum over `choice.psum_axes` (FSDP x
    TP) as `_both_sides`' tiles where the cost model prefers them: each tile
    of the gathered operand one fused call, its result summed by jax.lax
    while the next tile runs. None: one fused call then the sum."""
    side, g, free, out_dim_of = _gathered_operand(choice.kind, len(x_shape), choice.dimension)
    operand = (x_shape, w_shape)[side]
    tiling, _ = _both_sides.find_tiling(operand, g, free, out_dim_of, None, ranks)
    if tiling is None:
        return None
    op = "all_gather_matmul" if side == 0 else "matmul_all_gather"
    rows = math.prod(x_shape[:-1])
    k = x_shape[-1] * (ranks if choice.kind == Kind.ALL_GATHER_MATMUL_CONTRACT else 1)
    n = w_shape[1] * (ranks if choice.kind == Kind.MATMUL_ALL_GATHER else 1)
    if choice.kind == Kind.ALL_GATHER_MATMUL:
        rows *= ranks
    machine = settings.policy.resolved_machine(choice.axes + choice.psum_axes)
    try:
        order, why = _both_sides.choose(op, tuple(x_shape), tuple(w_shape), ranks, g, "psum", n_reduce, (rows, k),
                                        (k, n), tiling.count, np.dtype(settings.out_dtype), machine,
                                        settings.policy.decline)
    except (ValueError, TypeError, KeyError):
        return None
    if order[0] != "tiles":
        return None
    tile_shape = list(operand)
    tile_shape[tiling.dim] //= tiling.count
    shapes = (tuple(tile_shape), w_shape) if side == 0 else (x_shape, tuple(tile_shape))
    decision = decide(_call_of(choice, choice.kind, *shapes, dtype, settings, ranks), settings.policy, choice.axes)
    if not decision.fused:
        return None
    why = f"{tiling.count} tiles, each summed over {choice.psum_axes} while the next runs: {why}"
    return Decided(choice, (decision,) * tiling.count, tiling=tiling, tiles_why=why)


def _settle_two_axis(op, policy, settle) -> tuple[object | None, str, bool]:
    """An op over two axes (`op`: its module) on shards that `settle(policy)`
    settles, under `policy`: (its settings, "", whether the cost model is
    still to weigh it against the other ways) where it runs (a schedule it
    has was asked for, "auto", or a decision imposed for its call), else
    (None, why not, False)."""
    if policy.asked == _abi.UNFUSED:
        return None, "unfused, as asked", False
    asked = policy.asked if policy.asked in (_abi.SCHEDULES[n] for n in op.SCHEDULES) else _abi.AUTO
    two = settle(policy.with_asked(asked))
    imposed = dict(policy.imposed).get(two.forward.call) is not None
    if asked != policy.asked and not imposed:
        return None, f"it has no {_abi.schedule_name(policy.asked)!r} schedule", False
    if not two.forward.fused:
        return None, two.forward.why, False
    return two, "", asked == _abi.AUTO and not imposed


def _decide_two_axis(choice: Choice, x_shape, w_shape, dtype, settings: Settings,
                     sizes: dict) -> tuple[Decided | None, str]:
    """The op over both axes on these shards where it runs: under a
    schedule it has that was asked for, a decision imposed for it, or
    "auto" where the cost model times it below the choice otherwise made
    (`_both_sides`: XLA's gather, then the fused reduce-scatter) and its own
    judgement fuses. (None, why not): the choice otherwise made."""
    policy = settings.policy
    f, t = (sizes[a] for a in choice.axes)
    d = choice.dimension
    moved = (x_shape[d], *x_shape[:d], *x_shape[d + 1:])
    rows, k, c = math.prod(moved[:-1]), moved[-1], w_shape[1]
    if rows == 0 or k == 0 or c == 0:
        return None, "an operand has no elements"
    two, why, weigh = _settle_two_axis(two_axis_op, policy, lambda asked: two_axis_op.settle(
        moved, w_shape, dtype, settings.out_dtype, axes=choice.axes, sizes=(f, t), policy=asked,
        fast_f32=settings.fast_f32))
    if two is None:
        return None, why
    if weigh:
        why = _beats_the_reduce_side(("matmul_all_gather", (rows, k), w_shape, f, 1), (t, (rows, k), (k, f * c)),
                                     (TWO_AXIS_OP, (rows, k), tuple(w_shape), f), settings, choice.axes)
        if why:
            return None, why
    return Decided(choice, (two.forward,), two_axis=two), ""


def _beats_the_reduce_side(gather: tuple, reduce: tuple, both: tuple, settings: Settings, axes) -> str:
    """"" where the cost model (`_both_sides.choose`) times the op over both
    axes `both` (its library call: op, x, w, F) below the dot's reduce side
    fused (XLA's gather first), else why not. `gather`: the gather side's
    fused op (op, x, w, ranks, dimension); `reduce`: the reduce-scatter's
    ranks and its dot's shapes (x, w)."""
    policy = settings.policy
    try:
        order, why = _both_sides.choose(*gather, "psum_scatter", *reduce, None, np.dtype(settings.out_dtype),
                                        policy.resolved_machine(axes), policy.decline, two_axis=both)
    except (ValueError, TypeError, KeyError) as e:
        return f"the cost model cannot time it ({e})"
    if "two_axis" not in order:
        return f"the cost model cannot time it: {why}"
    if order.index("two_axis") > order.index("reduce"):
        return f"the cost model fuses the reduce side: {why}"
    return ""


def _decide_two_gathers(choice: Choice, x_shape, w_shape, dtype, settings: Settings,
                        sizes: dict) -> tuple[Decided | None, str]:
    """The two-gather op on these shards where it runs: under a schedule
    it has that was asked for, a decision imposed for it, or "auto" where
    the cost model (`_both_sides.choose_two_gathers`) times it below fusing
    either gather alone and its own judgement fuses. (None, why not): the
    choice otherwise made, XLA's gather of w (it depends on no activation,
    so XLA may start it early), then the fused gather of x's rows, whichever
    side the cost model would fuse."""
    policy = settings.policy
    w_axis, x_axis = choice.axes
    f, t = sizes[w_axis], sizes[x_axis]
    d = choice.dimension
    moved = (x_shape[d], *x_shape[:d], *x_shape[d + 1:])
    if 0 in moved or 0 in w_shape:
        return None, "an operand has no elements"
    two, why, weigh = _settle_two_axis(two_gathers_op, policy, lambda asked: two_gathers_op.settle(
        moved, w_shape, dtype, settings.out_dtype, axes=(x_axis, w_axis), sizes=(t, f), policy=asked,
        fast_f32=settings.fast_f32))
    if two is None:
        return None, why
    if weigh:
        call = two.forward.call
        try:
            order, why = _both_sides.choose_two_gathers(call.x, call.w, t, f, call.dtype,
                                                        policy.resolved_machine(choice.axes), policy.decline)
        except (ValueError, TypeError, KeyError) as e:
            return None, f"the cost model cannot time it ({e})"
        if order[0] != "two_gathers":
            return None, f"the cost model fuses one side: {why}"
    return Decided(choice, (two.forward,), two_gathers=two), ""


def _decide_contract_scatter(choice: Choice, x_shape, w_shape, dtype, settings: Settings,
                             sizes: dict) -> tuple[Decided | None, str]:
    """The gather-contract-scatter op on these shards where it runs: under
    a schedule it has that was asked for, a decision imposed for it, or
    "auto" where the cost model times it below the choice otherwise made
    (`_both_sides`: XLA's gather of the contraction, then the fused
    reduce-scatter) and its own judgement fuses. (None, why not): that
    choice."""
    policy = settings.policy
    gather_axis, scatter_axis = choice.axes
    t, f = sizes[gather_axis], sizes[scatter_axis]
    if 0 in x_shape or 0 in w_shape:
        return None, "an operand has no elements"
    d = choice.dimension
    if d < len(x_shape) - 1:
        # x's contraction gathered, its dim d reduce-scattered: moved first, the rows flattened.
        moved = (x_shape[d], *x_shape[:d], *x_shape[d + 1:])
        op_x, op_w = (math.prod(moved[:-1]), moved[-1]), tuple(w_shape)
    else:
        # w's contraction gathered, the result's columns reduce-scattered: the op on wᵀ and xᵀ.
        op_x, op_w = (w_shape[1], w_shape[0]), (x_shape[-1], math.prod(x_shape[:-1]))
    (rows, m), c = op_x, op_w[1]
    two, why, weigh = _settle_two_axis(contract_scatter_op, policy, lambda asked: contract_scatter_op.settle(
        op_x, op_w, dtype, settings.out_dtype, axes=choice.axes, sizes=(t, f), policy=asked,
        fast_f32=settings.fast_f32))
    if two is None:
        return None, why
    if weigh:
        # The gather side: x_all @ w as wᵀ @ all_gather(xᵀ) (`matmul_all_gather` of the contraction).
        why = _beats_the_reduce_side(("matmul_all_gather", (c, t * m), (m, rows), t, 0), (f, (rows, t * m), (t * m, c)),
                                     (CONTRACT_SCATTER_OP, op_x, op_w, f), settings, choice.axes)
        if why:
            return None, why
    return Decided(choice, (two.forward,), contract_scatter=two), ""


# ----------------------------------------------------------------------------
# What the partitioner calls, and who hears of it.
# ----------------------------------------------------------------------------
class Partitioned(NamedTuple):
    """One call's choice and decisions, as the report shows it."""
    site: int
    x_shape: tuple
    w_shape: tuple
    decided: Decided
    owner: int = 0  # the `overlap` that made the call (0: none)

    @property
    def choice(self) -> Choice:
        return self.decided.choice

    @property
    def fused(self) -> int:
        """How many library calls (fused ops) it became."""
        return self.decided.fused

    def line(self) -> str:
        d = self.decided
        if d.all_reduce is not None:
            forward = d.all_reduce.forward
            ran = f"matmul_all_reduce: {forward.schedule_name} ({forward.why})"
        else:
            counts = {}
            for decision in d.calls:
                counts[decision.describe()] = counts.get(decision.describe(), 0) + 1
            ran = "; ".join(f"{f'{n} x ' if n > 1 else ''}{text}" for text, n in counts.items())
            if d.tiling is not None:
                ran = f"{ran}; composed: tiles ({d.tiles_why})"
        return (f"commfuse.matmul#{self.site} x{list(self.x_shape)} @ w{list(self.w_shape)}: "
                f"{self.choice.describe()}" + (f"; ran as {ran}" if ran else ""))


class Traced(NamedTuple):
    """A line for an owner's report made at trace time (a backward dot fused or kept)."""
    owner: int
    text: str

    def line(self) -> str:
        return self.text


# Each `overlap`'s report by owner id (it lives as long as its overlap), and
# the lists of whoever watches every call (`watching`).
_LOCK = threading.Lock()
_REPORTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_WATCHERS: list = []
_owners = itertools.count(1)


def register(report) -> int:
    """An owner id whose entries (`Partitioned`, `Traced`) go to
    ``report.hear(entry)`` while `report` lives."""
    with _LOCK:
        owner = next(_owners)
        _REPORTS[owner] = report
    return owner


@contextlib.contextmanager
def watching():
    """A list that gets every `Partitioned` entry recorded while open, whoever made the call."""
    seen: list = []
    with _LOCK:
        _WATCHERS.append(seen)
    try:
        yield seen
    finally:
        with _LOCK:
            _WATCHERS.remove(seen)


def _record(entry):
    with _LOCK:
        report = _REPORTS.get(entry.owner) if entry.owner else None
        watchers = list(_WATCHERS) if isinstance(entry, Partitioned) else []
    for seen in watchers:
        seen.append(entry)
    if report is not None:
        report.hear(entry)


def _sharding(mesh, spec: tuple):
    return NamedSharding(mesh, P(*[axes if len(axes) != 1 else axes[0] if axes else None for axes in spec]))


def _mesh_axes(mesh, sharding, ndim: int) -> tuple:
    """An operand's or the result's sharding as mesh axes per dimension.
    The partitioner hands XLA's own shardings (``decode_shardings=False``):
    propagation can tile a dimension over part of a mesh axis (4 ways of an
    8-device axis after a reshape splits heads), which no PartitionSpec of
    the mesh expresses; such an array is taken as replicated, and XLA
    gathers it to that before the op (what the plain program's dot would
    need of it too)."""
    if isinstance(sharding, NamedSharding):
        return spec_axes(sharding.spec, ndim)
    if sharding is None:
        return ((),) * ndim
    try:
        spec = _compat.mesh_spec_of(sharding, mesh)
    except (KeyError, ValueError, AssertionError):  # what JAX's decoder raises for a sharding no spec names
        return ((),) * ndim
    return spec_axes(spec, ndim)


def _specs(mesh, arg_shapes, result_shape):
    x, w = arg_shapes
    return (_mesh_axes(mesh, x.sharding, x.ndim), _mesh_axes(mesh, w.sharding, 2),
            _mesh_axes(mesh, result_shape.sharding, len(result_shape.shape)))


def _partition(settings: Settings, mesh, arg_shapes, result_shape):
    x, w = arg_shapes
    x_spec, w_spec, out_spec = _specs(mesh, arg_shapes, result_shape)
    sizes = dict(mesh.shape)
    choice = choose(sizes, x.shape, w.shape, x_spec, w_spec, out_spec)
    settings = settings._replace(policy=settings.policy.placed(mesh))
    decided = None
    both = {TWO_AXIS_OP: _decide_two_axis, TWO_GATHERS_OP: _decide_two_gathers,
            CONTRACT_SCATTER_OP: _decide_contract_scatter}.get(choice.op)
    if both is not None:
        decided, why = both(choice, _local(x.shape, choice.x_spec, sizes), _local(w.shape, choice.w_spec, sizes),
                            np.dtype(x.dtype), settings, sizes)
        if decided is None:
            choice = choice.otherwise._replace(why=f"{choice.otherwise.why}; not one op over both axes: {why}")
    if decided is None:
        decided = decide_choice(choice, _local(x.shape, choice.x_spec, sizes), _local(w.shape, choice.w_spec, sizes),
                                np.dtype(x.dtype), settings, sizes)
    _record(Partitioned(settings.site, tuple(x.shape), tuple(w.shape), decided, settings.policy.owner))

    def lower(x_local, w_local):
        with _compat.auto_axes_scope():
            return run_decided(decided, x_local, w_local, settings)

    return (mesh, lower, _sharding(mesh, choice.out_spec),
            (_sharding(mesh, choice.x_spec), _sharding(mesh, choice.w_spec)))


def _local(shape, spec: tuple, sizes: dict) -> tuple:
    """One device's shard of an array of `shape` sharded as `spec`."""
    return tuple(n // math.prod(sizes[a] for a in axes) for n, axes in zip(shape, spec))


def _infer_from_operands(settings: Settings, mesh, arg_shapes, result_shape):
    """GSPMD's propagation (when Shardy is off): x's rows and w's columns,
    an axis on both kept on the columns (the all-gather matmul's result)."""
    x, w = arg_shapes
    x_spec, w_spec = _mesh_axes(mesh, x.sharding, x.ndim), _mesh_axes(mesh, w.sharding, 2)
    used = set(w_spec[1]) | set(x_spec[-1])
    rows = tuple(tuple(a for a in axes if a not in used) for axes in x_spec[:-1])
    return _sharding(mesh, rows + (w_spec[1],))


def _sharding_rule(settings: Settings, mesh, value_types, result_types):
    rows = " ".join(f"r{i}" for i in range(settings.x_ndim - 1))
    return f"{rows} k, k n -> {rows} n", {"reduction_factors": ("k",)}


_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer_from_operands,
                           sharding_rule=_sharding_rule, decode_shardings=False)
