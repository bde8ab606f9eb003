"""commfuse.overlap: rewrite plain collective + matmul pairs in shard_map bodies into fused ops.

``overlap(f)`` returns a function with ``f``'s signature and results. Calling
it traces ``f`` to a jaxpr, then evaluates that jaxpr with an interpreter that
re-creates every ``shard_map`` with a rewritten body in which these pairs are
replaced by commfuse's fused, overlapped ops:

* ``all_gather`` (tiled) whose result only feeds one ``dot_general``
  -> ``all_gather_matmul`` (the gathered operand is the activation) or
  ``matmul_all_gather`` (the gathered operand is the 2-D weight);
* ``dot_general`` whose result only feeds a ``reduce_scatter`` (``psum_scatter``)
  -> ``matmul_reduce_scatter``;
* ``all_to_all`` (tiled) only feeding a ``dot_general`` -> ``all_to_all_matmul``,
  and ``dot_general`` only feeding an ``all_to_all`` -> ``matmul_all_to_all``.

A ``dot_general`` qualifies when it is ``x @ w`` up to transposes: no batch
dimensions, one contracting dimension, and one operand (``w``) 2-D. Transposes
are inserted where the contracting dimension of ``x`` is not its last one, where
``w`` contracts its last dimension, or where ``w`` is the left operand.
Everything else is evaluated unchanged. When a fused op refuses its operands at
trace time, the original equations are kept and the reason is reported.

Bodies of ``jit``/``closed_call``/``checkpoint`` are interpreted in place, and
``cond``/``scan``/``while`` are rebuilt with ``lax.switch``/``lax.scan``/
``lax.while_loop`` around rewritten bodies, unless their predicate varies
across ranks (ranks could then take different paths, and a fused op waits for
every rank of its axes). Candidates inside any other higher-order primitive
(``custom_jvp_call``, ``custom_vjp_call``, ...) are left as they are and
reported. A pattern may span ``pvary`` casts (JAX inserts them between a dot
and a ``psum_scatter`` of replicated operands, or on 2-D meshes). If
re-creating a ``shard_map`` (or a ``scan``/``cond``/``while``) fails for any
reason, the original is kept and the reason reported.

Outside any trace, the rewritten program runs under ``jax.jit`` (one compiled
program per argument signature, as ``jax.jit(f)`` would); inside a trace
(``jax.jit``, ``jax.grad``, ``jax.make_jaxpr``, a ``shard_map`` body) it is
traced in place.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections import Counter, defaultdict

import jax
import numpy as np
from jax.extend import core as jcore

__all__ = ["overlap"]

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
    return importlib.import_module(__package__ or "commfuse")


# ----------------------------------------------------------------------------
# The interpreter
# ----------------------------------------------------------------------------
class _State:
    def __init__(self):
        self.lines: list[str] = []
        self.shard_maps = 0
        self._memo: dict = {}

    def needs_work(self, jaxpr, manual: bool) -> bool:
        """Whether interpreting ``jaxpr`` (rather than binding it unchanged) can rewrite anything."""
        key = (id(jaxpr), manual)
        if key not in self._memo:
            self._memo[key] = (jaxpr, False)  # keeps jaxpr alive so its id stays unique
            found = False
            for eqn in jaxpr.eqns:
                name = eqn.primitive.name
                if name == "shard_map" or (manual and name in _CANDIDATES):
                    found = True
                    break
                if any(self.needs_work(sub, manual) for sub in _subjaxprs(eqn.params)):
                    found = True
                    break
            self._memo[key] = (jaxpr, found)
        return self._memo[key][1]


def _interpret(jaxpr, consts, args, state: _State, where: str, manual: bool):
    """Evaluates ``jaxpr``; inside a shard_map body (``manual``) fuses the patterns it finds."""
    env = {}

    def read(v):
        return v.val if _is_literal(v) else env[v]

    def write(v, val):
        if not isinstance(v, jcore.DropVar):
            env[v] = val

    for v, val in zip(jaxpr.constvars, consts):
        write(v, val)
    for v, val in zip(jaxpr.invars, args):
        write(v, val)

    if manual:
        _Rewriter(jaxpr, state, where, read, write).run()
    else:
        for eqn in jaxpr.eqns:
            outs = _eval_eqn(eqn, [read(v) for v in eqn.invars], state, where, manual)
            for v, val in zip(eqn.outvars, outs):
                write(v, val)
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn, invals, state: _State, where: str, manual: bool):
    """One equation that is not part of a pattern: recursing where rewrites may hide."""
    name = eqn.primitive.name
    params = eqn.params
    if name == "shard_map":
        return _eval_shard_map(eqn, invals, state, where)
    subs = list(_subjaxprs(params))
    if not subs or not any(state.needs_work(s, manual) for s in subs):
        return _bind_eqn(eqn, invals)
    here = f"{where}/{name}"
    if name in _CALLS:
        key = "jaxpr" if "jaxpr" in params else "call_jaxpr"
        jaxpr, consts = _closed(params[key])
        return _interpret(jaxpr, consts, invals, state, here, manual)
    divergent = manual and _divergent(eqn)
    if divergent:
        for sub in subs:
            _report_untouched(sub, state, here, divergent)
        return _bind_eqn(eqn, invals)
    rebuild = {"scan": _eval_scan, "cond": _eval_cond, "while": _eval_while}.get(name)
    if name in _REMAT and "jaxpr" in params:
        rebuild = _eval_remat
    if rebuild is not None:
        mark = len(state.lines)
        try:
            return rebuild(params, invals, state, here, manual)
        except Exception as e:  # noqa: BLE001 - never worse than the original program
            del state.lines[mark:]
            for sub in subs:
                _report_untouched(sub, state, here, f"{name} left unchanged: {type(e).__name__}: {e}")
            return _bind_eqn(eqn, invals)
    # Any other higher-order primitive (custom_jvp_call, custom_vjp_call, ...):
    # its semantics hang on its params, so it is bound as it is.
    if manual:
        for sub in subs:
            _report_untouched(sub, state, here, f"inside {name}, which overlap does not rewrite")
    return _bind_eqn(eqn, invals)


def _divergent(eqn) -> str | None:
    """Why ranks may take different paths through a cond/while (a fused op needs every rank of its axes)."""
    name = eqn.primitive.name
    if name == "cond":
        pred = eqn.invars[0].aval
        what = "cond predicate"
    elif name == "while":
        pred = eqn.params["cond_jaxpr"].jaxpr.outvars[0].aval
        what = "while_loop condition"
    else:
        return None
    axes = _vma(pred)
    if not axes:
        return None
    return (f"the {what} varies over mesh axes {tuple(sorted(axes))}, so ranks may take different paths "
            f"and a fused op waits for every rank; not rewritten")


def _report_untouched(jaxpr, state: _State, where: str, reason: str):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CANDIDATES:
            state.lines.append(f"overlap[{where}]: no match: {_describe_collective(eqn)}: {reason}")
        for sub in _subjaxprs(eqn.params):
            _report_untouched(sub, state, where, reason)


def _eval_shard_map(eqn, invals, state: _State, where: str):
    state.shard_maps += 1
    here = f"{where}/shard_map#{state.shard_maps - 1}".lstrip("/")
    body, consts = _closed(eqn.params["jaxpr"])
    if not state.needs_work(body, True):
        return _bind_eqn(eqn, invals)
    mark = len(state.lines)

    def body_fn(*args):
        return tuple(_interpret(body, consts, args, state, here, True))

    try:
        return _shard_map_call(eqn.params, body_fn, invals)
    except Exception as e:  # noqa: BLE001 - never worse than the original program
        del state.lines[mark:]
        state.lines.append(f"overlap[{here}]: shard_map left unchanged: {type(e).__name__}: {e}")
        return _bind_eqn(eqn, invals)


def _eval_remat(params, invals, state, where, manual):
    jaxpr, consts = _closed(params["jaxpr"])
    fn = jax.checkpoint(lambda *a: _interpret(jaxpr, consts, a, state, where, manual),
                        prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))
    return list(fn(*invals))


def _eval_scan(params, invals, state, where, manual):
    jaxpr, consts = _closed(params["jaxpr"])
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    loop_consts = invals[:n_consts]
    init, xs = invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]

    def step(carry, x):
        outs = _interpret(jaxpr, consts, [*loop_consts, *carry, *x], state, where, manual)
        return tuple(outs[:n_carry]), tuple(outs[n_carry:])

    carry, ys = jax.lax.scan(step, tuple(init), tuple(xs), length=params["length"],
                             reverse=params.get("reverse", False), unroll=params.get("unroll", 1))
    return [*carry, *ys]


def _eval_cond(params, invals, state, where, manual):
    index, ops = invals[0], invals[1:]

    def branch(closed, i):
        jaxpr, consts = _closed(closed)
        return lambda *a: tuple(_interpret(jaxpr, consts, a, state, f"{where}.branch{i}", manual))

    branches = [branch(b, i) for i, b in enumerate(params["branches"])]
    return list(jax.lax.switch(index, branches, *ops))


def _eval_while(params, invals, state, where, manual):
    cj, cc = _closed(params["cond_jaxpr"])
    bj, bc = _closed(params["body_jaxpr"])
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]

    def cond_fun(carry):
        return _interpret(cj, cc, [*cond_consts, *carry], state, f"{where}.cond", manual)[0]

    def body_fun(carry):
        return tuple(_interpret(bj, bc, [*body_consts, *carry], state, f"{where}.body", manual))

    return list(jax.lax.while_loop(cond_fun, body_fun, tuple(init)))


# ----------------------------------------------------------------------------
# Pattern matching and rewriting inside a shard_map body
# ----------------------------------------------------------------------------
class _Rewriter:
    """Evaluates one jaxpr of a shard_map body, fusing collective/dot pairs.

    A pair may have value-preserving casts (``pvary``, which only widens the
    type to vary over more axes) between its two equations; they go with it.
    """

    def __init__(self, jaxpr, state: _State, where: str, read, write):
        self.jaxpr, self.state, self.where = jaxpr, state, where
        self.read, self.write = read, write
        eqns = jaxpr.eqns
        producer, users = {}, defaultdict(list)
        for i, eqn in enumerate(eqns):
            for v in eqn.invars:
                if not _is_literal(v):
                    users[v].append(i)
            for v in eqn.outvars:
                producer[v] = i
        outputs = Counter(v for v in jaxpr.outvars if not _is_literal(v))

        self.reasons: dict[int, list[str]] = defaultdict(list)  # collective -> why not fused
        self.done: dict[int, str] = {}          # collective -> line of its rewrite
        self.deferred: set[int] = set()         # input-side collectives (and casts) evaluated at their dot
        self.bound: set[int] = set()
        self.fused_away: set[int] = set()       # equations replaced by a fused op
        self.inputs = defaultdict(list)         # dot -> [(collective, operand index, casts)]
        self.output: dict[int, tuple] = {}      # dot -> (collective, casts)
        self.collectives: list[int] = []

        def single_use(var):
            return not outputs[var] and len(users.get(var, ())) == 1

        def use_reason(var, what):
            n = len(users.get(var, ())) + outputs[var]
            if outputs[var]:
                return f"{what} result is also an output of the body"
            if n == 0:
                return f"{what} result is unused"
            if n > 1:
                names = ", ".join(eqns[j].primitive.name for j in users[var])
                return f"{what} result has other users ({n} uses: {names})"
            return None

        for i, eqn in enumerate(eqns):
            name = eqn.primitive.name
            if name not in _CANDIDATES:
                continue
            self.collectives.append(i)
            reason = _static_reason(eqn)
            if reason:
                self.reasons[i].append(reason)
                continue
            found = []
            if name in (_ALL_GATHER, _ALL_TO_ALL):  # collective -> (casts) -> dot
                out, casts = eqn.outvars[0], []
                while single_use(out) and eqns[users[out][0]].primitive.name in _CASTS:
                    casts.append(users[out][0])
                    out = eqns[casts[-1]].outvars[0]
                why = use_reason(out, name)
                if why is None and eqns[users[out][0]].primitive.name != "dot_general":
                    why = f"{name} result is used by {eqns[users[out][0]].primitive.name}, not a dot_general"
                if why is None:
                    d = users[out][0]
                    self.inputs[d].append((i, list(eqns[d].invars).index(out), casts))
                    self.deferred.update([i, *casts])
                    found.append("in")
                else:
                    found.append(why)
            if name in _REDUCE_SCATTER + (_ALL_TO_ALL,):  # dot -> (casts) -> collective
                src, casts = eqn.invars[0], []
                while (not _is_literal(src) and src in producer and single_use(src)
                       and eqns[producer[src]].primitive.name in _CASTS):
                    casts.insert(0, producer[src])
                    src = eqns[producer[src]].invars[0]
                p = None if _is_literal(src) else producer.get(src)
                if p is None:
                    why = f"{name} operand is not computed in this body"
                elif eqns[p].primitive.name != "dot_general":
                    why = f"{name} operand is produced by {eqns[p].primitive.name}, not a dot_general"
                else:
                    why = use_reason(src, "dot_general")
                if why is None:
                    self.output[p] = (i, casts)
                    found.append("out")
                else:
                    found.append(why)
            if "in" not in found and "out" not in found:
                self.reasons[i].append("; ".join(found))

        # dot_generals next to a collective that is no pattern (psum, ppermute, ...)
        self.lonely_dots = []
        for i, eqn in enumerate(eqns):
            if eqn.primitive.name != "dot_general" or i in self.inputs or i in self.output:
                continue
            near = {eqns[producer[v]].primitive.name for v in eqn.invars
                    if not _is_literal(v) and v in producer}
            near |= {eqns[j].primitive.name for j in users.get(eqn.outvars[0], ())}
            if near & _OTHER_COLLECTIVES and not near & _CANDIDATES:
                self.lonely_dots.append((i, sorted(near & _OTHER_COLLECTIVES)))

    # -- evaluation ------------------------------------------------------------
    def run(self):
        for i, eqn in enumerate(self.jaxpr.eqns):
            if i in self.fused_away or (i in self.deferred and i not in self.bound):
                continue
            if i in self.inputs or i in self.output:
                self._dot(i, eqn)
            else:
                self._plain(eqn)
        self._report()

    def _plain(self, eqn):
        outs = _eval_eqn(eqn, [self.read(v) for v in eqn.invars], self.state, self.where, True)
        for v, val in zip(eqn.outvars, outs):
            self.write(v, val)

    def _dot(self, d, dot):
        eqns = self.jaxpr.eqns
        fused = None
        pending = [t for t in self.inputs.get(d, ()) if t[0] not in self.bound and t[0] not in self.fused_away]
        for c, k, casts in sorted(pending, key=lambda t: t[1]):
            if fused is not None:
                self.reasons[c].append(f"its dot_general is already fused with {fused[1]}")
                continue
            result = self._try_input(d, dot, c, k)
            if result is not None:
                fused = (c, eqns[c].primitive.name)
                self.fused_away.update([c, *casts])
                self.write(dot.outvars[0], result)
        if d in self.output:
            c, casts = self.output[d]
            if c in self.bound or c in self.fused_away:
                pass
            elif fused is not None:
                self.reasons[c].append(f"its dot_general is already fused with the preceding {fused[1]}")
            else:
                result = self._try_output(d, dot, c)
                if result is not None:
                    fused = (c, eqns[c].primitive.name)
                    self.fused_away.update([c, *casts])
                    self.write(eqns[c].outvars[0], result)
        for c, _, casts in pending:  # the input-side collectives left as they were
            if c not in self.fused_away:
                for j in (c, *casts):
                    self.bound.add(j)
                    self._plain(eqns[j])
        if fused is None:
            self._plain(dot)

    def _attempt(self, op_name, x, w, kwargs, form, target, c, pair):
        """Calls commfuse.<op_name>; returns the result in the original layout, or None (reason recorded)."""
        op = getattr(_commfuse(), op_name, None)
        if op is None:
            self.reasons[c].append(f"commfuse.{op_name} is not available in this commfuse build")
            return None
        try:
            y = op(form.prep_x(x), form.prep_w(w), **kwargs, **form.kwargs)
            out = _match_vma(form.finish(y), target.aval)
        except Exception as e:  # noqa: BLE001 - the fused op refused; keep the original equations
            self.reasons[c].append(f"commfuse.{op_name} raised {type(e).__name__}: {e}")
            return None
        want = target.aval
        if tuple(out.shape) != tuple(want.shape) or np.dtype(out.dtype) != np.dtype(want.dtype):
            self.reasons[c].append(
                f"commfuse.{op_name} gave {_fmt(out)} where {_fmt(want)} was expected (not rewritten)")
            return None
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        self.done[c] = (f"overlap[{self.where}]: rewrote {pair} -> commfuse.{op_name}(x: {_fmt(x)}, "
                        f"w: {_fmt(w)}, {args}) -> {_fmt(want)}{form.notes()}")
        return out

    def _try_input(self, d, dot, c, k):
        """``collective(a)`` is operand ``k`` of the dot; tries the fused ops in order of preference."""
        coll = self.jaxpr.eqns[c]
        name, p = coll.primitive.name, coll.params
        kw0 = {"axis_name": _axes(p["axis_name"])}
        a = self.read(coll.invars[0])
        other = self.read(dot.invars[1 - k])
        pair = f"{_describe_collective(coll)} + {_describe_dot(dot)}"
        target = dot.outvars[0]
        # Operand k as the activation x (all_gather_matmul / all_to_all_matmul), or as
        # the 2-D weight w (matmul_all_gather); the one needing no transposed result first.
        roles = ["x", "w"] if k == 0 else ["w", "x"]
        if name == _ALL_TO_ALL:
            roles = ["x"]  # an all_to_all feeding the weight has no fused op
        shape_reasons = []
        for role in roles:
            x_side = k if role == "x" else 1 - k
            why = _dot_shape_reason(dot, x_side)
            if why is not None:
                shape_reasons.append(why)
                continue
            form = _Form(dot, x_side)
            if role == "x" and name == _ALL_GATHER:
                op, x, w = "all_gather_matmul", a, other
                kw = {"gather_dimension": form.x_dim(p["all_gather_dimension"])}
            elif role == "x":
                op, x, w = "all_to_all_matmul", a, other
                kw = {"split_dimension": form.x_dim(p["split_axis"]),
                      "concat_dimension": form.x_dim(p["concat_axis"])}
            else:
                op, x, w = "matmul_all_gather", other, a
                kw = {"gather_dimension": form.w_dim(p["all_gather_dimension"])}
            out = self._attempt(op, x, w, {**kw0, **kw}, form, target, c, pair)
            if out is not None:
                return out
        if len(shape_reasons) == len(roles):
            self.reasons[c].append(shape_reasons[0])
        return None

    def _try_output(self, d, dot, c):
        """``collective(dot(...))``; tries ``x`` = lhs, then ``x`` = rhs."""
        coll = self.jaxpr.eqns[c]
        name, p = coll.primitive.name, coll.params
        kw0 = {"axis_name": _axes(p["axis_name"])}
        # pvary(x @ w) == pvary(x) @ pvary(w): casts between the pair move to the operands,
        # so that the fused op's operands are typed as in the original collective.
        cast_axes = [a for j in self.output[d][1] for a in _axes(self.jaxpr.eqns[j].params.get("axes", ()))]
        lhs, rhs = (_vary(self.read(v), cast_axes) for v in dot.invars)
        pair = f"{_describe_dot(dot)} + {_describe_collective(coll)}"
        target = coll.outvars[0]
        shape_reasons = []
        for x_side in (0, 1):
            why = _dot_shape_reason(dot, x_side)
            if why is not None:
                shape_reasons.append(why)
                continue
            form = _Form(dot, x_side)
            x, w = (lhs, rhs) if x_side == 0 else (rhs, lhs)
            if name in _REDUCE_SCATTER:
                op, kw = "matmul_reduce_scatter", {"scatter_dimension": form.y_dim(p["scatter_dimension"])}
            else:
                op = "matmul_all_to_all"
                kw = {"split_dimension": form.y_dim(p["split_axis"]),
                      "concat_dimension": form.y_dim(p["concat_axis"])}
            out = self._attempt(op, x, w, {**kw0, **kw}, form, target, c, pair)
            if out is not None:
                return out
        if len(shape_reasons) == 2:
            self.reasons[c].append(shape_reasons[0])
        return None

    # -- report ------------------------------------------------------------------
    def _report(self):
        eqns = self.jaxpr.eqns
        lines = []
        for c in self.collectives:
            if c in self.done:
                lines.append((c, self.done[c]))
            else:
                why = "; ".join(dict.fromkeys(self.reasons[c])) or "not rewritten"
                lines.append((c, f"overlap[{self.where}]: no match: {_describe_collective(eqns[c])}: {why}"))
        for d, near in self.lonely_dots:
            lines.append((d, f"overlap[{self.where}]: no match: {_describe_dot(eqns[d])}: its neighbour "
                             f"{', '.join(near)} is no fusable collective (all_gather -> dot, dot -> "
                             f"reduce_scatter, all_to_all <-> dot)"))
        self.state.lines.extend(line for _, line in sorted(lines, key=lambda t: t[0]))


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


# ----------------------------------------------------------------------------
# The public entry point
# ----------------------------------------------------------------------------
def _is_dynamic(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def _in_manual_context() -> bool:
    try:
        mesh = jax.sharding.get_abstract_mesh()
        return bool(not mesh.empty and mesh.manual_axes)
    except Exception:  # noqa: BLE001 - older JAX without abstract meshes
        return False


def overlap(fun=None, *, report: bool = False, logger=None):
    """Returns ``fun`` with its shard_map collective/matmul pairs fused into commfuse ops.

    The result has ``fun``'s signature and results. Each call traces ``fun``
    (``jax.make_jaxpr``) and re-creates its ``shard_map`` bodies with these
    pairs replaced by fused, overlapped ops:

    ==========================================  ===================================
    pattern (inside ``jax.shard_map``)            becomes
    ==========================================  ===================================
    ``all_gather(x, tiled=True) @ w``             ``commfuse.all_gather_matmul``
    ``x @ all_gather(w, tiled=True)``             ``commfuse.matmul_all_gather``
    ``psum_scatter(x @ w, tiled=True)``           ``commfuse.matmul_reduce_scatter``
    ``all_to_all(x, tiled=True) @ w``             ``commfuse.all_to_all_matmul``
    ``all_to_all(x @ w, tiled=True)``             ``commfuse.matmul_all_to_all``
    ==========================================  ===================================

    where the collective's result is used only by the dot (or the dot's only by
    the collective), and the ``dot_general`` is ``x @ w`` up to transposes with
    ``w`` 2-D (``x`` may carry any number of leading dims). Anything else runs
    unchanged.

    ``report=True`` prints one line per rewrite and per collective (or dot next
    to one) left unchanged, with the reason; ``logger`` (a ``logging.Logger``)
    gets the same lines through ``logger.info``. The returned function keeps
    the lines of its latest trace in its ``last_report`` attribute.

    Composes with ``jax.jit`` (either way round) and ``jax.grad``.
    """
    if fun is None:
        return functools.partial(overlap, report=report, logger=logger)
    if not callable(fun):
        raise TypeError(f"commfuse.overlap: expected a callable, got {fun!r}")

    jitted_cache: dict = {}

    def emit(lines):
        wrapper.last_report = list(lines)
        for line in lines:
            if report:
                print(line)
            if logger is not None:
                logger.info(line)

    def rewritten(treedef, static, n_leaves, state, out_box, *dyn):
        """Traces ``fun`` and evaluates the rewritten program on ``dyn`` (the array leaves)."""
        static_at = {j: leaf for j, _, leaf in static}

        def flat_fun(*dyn_args):
            it = iter(dyn_args)
            args, kwargs = jax.tree.unflatten(
                treedef, [static_at[j] if j in static_at else next(it) for j in range(n_leaves)])
            out_leaves, out_tree = jax.tree.flatten(fun(*args, **kwargs))
            # Leaves that are no arrays (a Python int, a string) come back as they are.
            out_box[:] = [out_tree, {j: leaf for j, leaf in enumerate(out_leaves) if not _is_dynamic(leaf)}]
            return [leaf for leaf in out_leaves if _is_dynamic(leaf)]

        closed = jax.make_jaxpr(flat_fun)(*dyn)
        state.__init__()
        manual = _in_manual_context()  # fun is (part of) a shard_map body itself
        outs = _interpret(closed.jaxpr, list(closed.consts), list(dyn), state, "body" if manual else "", manual)
        if not state.shard_maps and not manual:
            state.lines.append("overlap: the traced function has no shard_map; nothing was rewritten")
        state.fresh = True
        return outs

    def unflatten(out_box, outs):
        out_tree, static_out = out_box
        it = iter(outs)
        n = out_tree.num_leaves
        return jax.tree.unflatten(out_tree, [static_out[j] if j in static_out else next(it) for j in range(n)])

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dyn = [leaf for leaf in leaves if _is_dynamic(leaf)]
        # Python scalars, strings, ... are static, as if named in jit's static_argnums.
        static = tuple((j, type(leaf), leaf) for j, leaf in enumerate(leaves) if not _is_dynamic(leaf))
        if any(isinstance(leaf, jax.core.Tracer) for leaf in dyn) or _in_manual_context():
            # Inside a trace (jit, grad, make_jaxpr, a shard_map body): trace in place.
            state, out_box = _State(), [None, None]
            outs = rewritten(treedef, static, len(leaves), state, out_box, *dyn)
            emit(state.lines)
            return unflatten(out_box, outs)
        # Concrete arguments: one jitted program per static part of the call.
        try:
            key = (treedef, static)
            hash(key)
        except TypeError:  # unhashable static leaves: no reuse
            key = None
        entry = jitted_cache.get(key) if key is not None else None
        if entry is None:
            state, out_box = _State(), [None, None]
            state.fresh = False
            fn = jax.jit(functools.partial(rewritten, treedef, static, len(leaves), state, out_box))
            entry = (fn, state, out_box)
            if key is not None:
                if len(jitted_cache) >= 16:
                    jitted_cache.pop(next(iter(jitted_cache)))
                jitted_cache[key] = entry
        fn, state, out_box = entry
        outs = fn(*dyn)
        if state.fresh:  # traced (again) by this call
            state.fresh = False
            emit(state.lines)
        else:
            wrapper.last_report = list(state.lines)
        return unflatten(out_box, outs)

    wrapper.last_report = []
    return wrapper
