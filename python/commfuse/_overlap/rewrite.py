"""Pattern matching and rewriting inside a shard_map body."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from . import interpret
from .jaxpr import (
    _is_literal,
    _fmt,
    _axes,
    _describe_collective,
    _describe_dot,
    _static_reason,
    _dot_shape_reason,
    _Form,
    _commfuse,
    _vary,
    _match_vma,
    _ALL_GATHER,
    _REDUCE_SCATTER,
    _ALL_TO_ALL,
    _CANDIDATES,
    _OTHER_COLLECTIVES,
    _CASTS,
)



# ----------------------------------------------------------------------------
# Pattern matching and rewriting inside a shard_map body
# ----------------------------------------------------------------------------
class _Rewriter:
    """Evaluates one jaxpr of a shard_map body, fusing collective/dot pairs.

    A pair may have value-preserving casts (``pvary``, which only widens the
    type to vary over more axes) between its two equations; they go with it.
    """

    def __init__(self, jaxpr, state: interpret._State, where: str, read, write):
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
        outs = interpret._eval_eqn(eqn, [self.read(v) for v in eqn.invars], self.state, self.where, True)
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
