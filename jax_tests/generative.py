"""A generator of random JAX programs for ``commfuse.overlap``, and the check
every generated program must pass (property-based testing; see
``jax_tests/test_generative.py`` for a bounded run in the test suite and
``scripts/generative_overlap.py`` for long runs).

A program is built from a seed (``generate(seed)``): a mesh (1-D or 2-D), a
mode (``shard_map``: the ops run in a ``jax.shard_map`` body, check_vma on
or off; ``jit``: the ops run under plain ``jax.jit`` on ``NamedSharding``
inputs with ``with_sharding_constraint``), an activation and a list of op
*specs* (plain dicts). The specs are replayed by a `Builder`, which tracks
the activation's shape and dtype (local to a device in a shard_map body,
global under jit), makes the weights each op needs (arguments of the
program, with their shardings) and checks every op against the shape it
meets: an op that does not fit (a dim that does not divide over its axes,
say) is skipped. So any sub-list of a program's specs is a program too,
which is what `shrink` uses to cut a failing program down.

The ops: ``dot_general`` in many forms (contracting any dim, transposed
weights, the weight as the left operand, rank-3 weights, two contracting
dims, batch dims), the collectives (``all_gather``, ``psum_scatter``,
``psum``, ``all_to_all``, ``ppermute``) on random mesh axes and dims,
elementwise and row-wise ops (gelu, bias, rms-norm, bf16/f32 casts),
reshapes and transposes, and control flow (``lax.scan`` over layers,
``jax.checkpoint``, ``lax.cond`` on a replicated predicate). Some ops are
collective + dot pairs built in a form the docs say ``overlap`` fuses
(``rewrite.py``'s patterns); the builder counts the distinct dots they
involve (a dot is fused with at most one collective), per traced body:
a scan body once, each cond branch once.

Also: two shard_maps in a row (``stage``), a shard_map over some of the
mesh's axes (``axis_names``), a dot outside the shard_map (``commfuse.matmul``
under overlap), ``jax.jit`` inside a body, preferred_element_type=float32
and Precision.HIGHEST dots, grouped (batch-dim) dots.

`check(program)` runs the program plain and through ``commfuse.overlap``
(schedule "ring" and "auto"; ``overlap(jax.grad(loss))``;
``jax.grad(overlap(loss))``) and returns the failures it finds: exceptions,
numbers outside the dtype's tolerance, deliberately built pairs left
unfused, internal errors swallowed into the report (``left unchanged:
KeyError``..., or a fused op "refusing" its operands with a TypeError,
KeyError, IndexError... rather than a ValueError). Where numbers differ by more than the tolerance, the
program is run again in float64: only a result further from it than the
plain program's (ill-conditioned programs, an rms-norm of rows near zero,
make float32 itself that far off) is a mismatch.

Importing this module does not set up JAX's devices: the importer sets
``XLA_FLAGS`` (8 or more host devices) and ``COMMFUSE_AUTO_UNFUSED=0``
first (``jax_tests/conftest.py`` does, as does the script).
"""

from __future__ import annotations

import copy
import math
import re
import traceback
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import commfuse

F32, BF16 = "float32", "bfloat16"
MAX_DIM = 64            # largest dim of the activation (local in shard_map bodies)
MAX_ELEMS = 1 << 15     # largest activation
MESHES = ({"x": 2}, {"x": 4}, {"x": 8}, {"a": 2, "b": 2}, {"a": 2, "b": 4}, {"a": 4, "b": 2})
DOT_FORMS = ("kn", "nk", "left", "w3", "k2", "batch")
TOLERANCE = {F32: 1e-4, BF16: 2e-2}
# An internal error swallowed by the rewrite into its report.
SWALLOWED = re.compile(r"left unchanged: ([A-Za-z_][A-Za-z0-9_]*(?:Error|Exception)|KeyError|StopIteration)\b")
# A fused op that "refused" its operands with an exception that is no refusal.
ODD_REFUSAL = re.compile(r"raised (KeyError|TypeError|AttributeError|IndexError|AssertionError|"
                         r"NotImplementedError|ZeroDivisionError|UnboundLocalError|NameError)\b")


# While True (the float64 reference run, `_truth`), every dtype the program names is float64.
_EXACT = [False]


def _dt(name):
    if _EXACT[0]:
        return jnp.float64
    return jnp.bfloat16 if name == BF16 else jnp.float32


def _short(dtype: str) -> str:
    return "bf16" if dtype == BF16 else "f32"


def _fmt(shape, dtype) -> str:
    return f"{_short(dtype)}[{','.join(str(d) for d in shape)}]"


# ----------------------------------------------------------------------------
# dot_general forms
# ----------------------------------------------------------------------------
def dot_layout(shape, form: dict):
    """(weight shape, dimension_numbers, weight is lhs, result shape) of a
    dot of an activation of `shape` in `form`, or None if it does not fit.

    form: {"wl": kind, "cd": contracted dim of h, "cd2": second one ("k2"),
    "bd": batch dim ("batch"), "n": output size, "n2": second output dim ("w3")}."""
    r = len(shape)
    wl, cd, n = form["wl"], form["cd"], form["n"]
    if not 0 <= cd < r:
        return None
    free = [d for d in range(r) if d != cd]
    none = ((), ())
    if wl == "kn":
        return (shape[cd], n), (((cd,), (0,)), none), False, tuple(shape[d] for d in free) + (n,)
    if wl == "nk":
        return (n, shape[cd]), (((cd,), (1,)), none), False, tuple(shape[d] for d in free) + (n,)
    if wl == "left":
        return (shape[cd], n), (((0,), (cd,)), none), True, (n,) + tuple(shape[d] for d in free)
    if wl == "w3":
        n2 = form["n2"]
        if n % n2:
            return None
        return ((shape[cd], n // n2, n2), (((cd,), (0,)), none), False,
                tuple(shape[d] for d in free) + (n // n2, n2))
    if wl == "k2":
        cd2 = form["cd2"]
        if r < 3 or not 0 <= cd2 < r or cd2 == cd:
            return None
        free = [d for d in range(r) if d not in (cd, cd2)]
        return ((shape[cd], shape[cd2], n), (((cd, cd2), (0, 1)), none), False,
                tuple(shape[d] for d in free) + (n,))
    if wl == "batch":
        bd = form["bd"]
        if r < 3 or not 0 <= bd < r or bd == cd:
            return None
        free = [d for d in range(r) if d not in (cd, bd)]
        return ((shape[bd], shape[cd], n), (((cd,), (1,)), ((bd,), (0,))), False,
                (shape[bd],) + tuple(shape[d] for d in free) + (n,))
    raise ValueError(wl)


def contracted(shape, form) -> tuple:
    """The activation dims a form contracts."""
    return (form["cd"], form["cd2"]) if form["wl"] == "k2" else (form["cd"],)


def _dot(h, w, layout, form=None):
    _, dn, w_left, _ = layout
    w = w.astype(h.dtype)
    form = form or {}
    kw = {}
    if form.get("pet"):  # bf16 operands, f32 result
        kw["preferred_element_type"] = _dt(F32)
    if form.get("prec"):
        kw["precision"] = jax.lax.Precision.HIGHEST
    return jax.lax.dot_general(w, h, dn, **kw) if w_left else jax.lax.dot_general(h, w, dn, **kw)


def dot_desc(form) -> str:
    wl = form["wl"]
    extra = {"k2": f", cd2={form.get('cd2')}", "batch": f", bd={form.get('bd')}", "w3": f", n2={form.get('n2')}"}
    flags = (", preferred_element_type=f32" if form.get("pet") else "") + (", HIGHEST" if form.get("prec") else "")
    return f"{wl}(cd={form['cd']}{extra.get(wl, '')}, n={form['n']}{flags})"


# ----------------------------------------------------------------------------
# The builder: replays op specs, tracking the activation
# ----------------------------------------------------------------------------
@dataclass
class Weight:
    shape: tuple        # the global shape (with the scan layer dims first)
    spec: tuple         # PartitionSpec entries
    values: np.ndarray


class Builder:
    """Replays specs on an activation of `shape` and `dtype`.

    `mesh` maps axis names to sizes; `mode` is "shard_map" (shapes are local
    to a device) or "jit" (global); `layers` is the scan layer counts
    around this builder (its weights get those leading dims)."""

    def __init__(self, mesh: dict, mode: str, shape, dtype, rng, *, check_vma=True, layers=(), depth=0,
                 mesh_obj=None, allow_bf16=True):
        self.mesh, self.mode, self.rng = mesh, mode, rng
        # XLA's CPU compiler aborts the process on a bf16 psum/psum_scatter in a shard_map over
        # some of the mesh's axes (AllReducePromotion: "Invalid binary instruction opcode copy").
        self.allow_bf16 = allow_bf16
        self.check_vma, self.layers, self.depth, self.mesh_obj = check_vma, tuple(layers), depth, mesh_obj
        self.shape, self.dtype = tuple(shape), dtype
        self.steps = []          # (h, ws) -> h
        self.weights: list[Weight] = []
        self.lines: list[str] = []
        self.pairs: list[str] = []   # the deliberately built fusable pairs
        self.last_dot = self.prev_dot = False
        self.expect = 0              # distinct dots in them (per trace)
        self.applied: list[dict] = []

    # -- helpers ----------------------------------------------------------------
    def size(self, axes) -> int:
        return math.prod(self.mesh[a] for a in axes)

    def sub(self, *, layers=None, shape=None, dtype=None) -> "Builder":
        return Builder(self.mesh, self.mode, self.shape if shape is None else shape,
                       self.dtype if dtype is None else dtype, self.rng, check_vma=self.check_vma,
                       layers=self.layers if layers is None else layers, depth=self.depth + 1,
                       mesh_obj=self.mesh_obj, allow_bf16=self.allow_bf16)

    def weight(self, local_shape, spec=None, scale=1.0, *, positive=False) -> int:
        """A new weight argument; the body sees `local_shape` (shard_map mode)."""
        spec = tuple(spec) if spec is not None else (None,) * len(local_shape)
        glob = []
        for d, entry in zip(local_shape, spec):
            axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            glob.append(d * self.size(axes) if self.mode == "shard_map" else d)
        shape = self.layers + tuple(glob)
        if positive:
            values = 1.0 + 0.25 * self.rng.uniform(-1, 1, size=shape)
        else:
            values = self.rng.uniform(-1, 1, size=shape) * scale
        self.weights.append(Weight(shape, (None,) * len(self.layers) + spec, values.astype(np.float32)))
        return len(self.weights) - 1

    def fits(self, shape) -> bool:
        return all(1 <= d <= MAX_DIM for d in shape) and math.prod(shape) <= MAX_ELEMS and 1 <= len(shape) <= 4

    def say(self, line):
        self.lines.append("  " * self.depth + line)

    def step(self, fn):
        self.steps.append(fn)

    def run(self, h, ws):
        for fn in self.steps:
            if fn is not STAGE:
                h = fn(h, ws)
        return h

    def stages(self) -> list:
        """The steps split at `op_stage` markers, each with the weights it reads (all of them)."""
        out, cur = [], []
        for fn in self.steps:
            if fn is STAGE:
                out.append(cur)
                cur = []
            else:
                cur.append(fn)
        return out + [cur]

    def axes_ok(self, axes) -> bool:
        return bool(axes) and all(a in self.mesh for a in axes) and len(set(axes)) == len(axes) \
            and self.mode == "shard_map"

    # -- replay -------------------------------------------------------------------
    def apply(self, spec: dict) -> bool:
        """Applies one spec; False (and nothing changed) where it does not fit."""
        snapshot = (self.shape, self.dtype, len(self.steps), len(self.weights), len(self.lines),
                    len(self.pairs), self.expect, self.last_dot)
        # Whether the activation is a dot_general's result (an all_to_all or psum taking it is
        # that dot's output-side candidate too).
        self.prev_dot, self.last_dot = self.last_dot, False
        try:
            ok = getattr(self, "op_" + spec["op"])(**{k: v for k, v in spec.items() if k != "op"})
        except _Skip:
            ok = False
        if ok and spec["op"] in ENDS_WITH_DOT:
            self.last_dot = True
        if not ok:
            (self.shape, self.dtype, n_steps, n_w, n_lines, n_pairs, self.expect, self.last_dot) = snapshot
            del self.steps[n_steps:], self.weights[n_w:], self.lines[n_lines:], self.pairs[n_pairs:]
            return False
        self.applied.append(spec)
        return True

    def replay(self, specs) -> list:
        return [s for s in specs if self.apply(s)]

    # -- the dot ---------------------------------------------------------------------
    def _dot_weight(self, form, layout, wspec=None, gathered=None):
        """The weight of a dot: (index, its local shape)."""
        wshape = layout[0]
        k = math.prod(self.shape[d] for d in contracted(self.shape, form))
        spec = None
        if wspec is not None and self.mode == "shard_map":
            d, axes = wspec
            if d < len(wshape) and self.axes_ok(axes):
                spec = [None] * len(wshape)
                spec[d] = tuple(axes)
        if self.mode == "jit" and wspec is not None:
            d, axes = wspec
            if d < len(wshape) and all(a in self.mesh for a in axes) and wshape[d] % self.size(axes) == 0:
                spec = [None] * len(wshape)
                spec[d] = tuple(axes)
        return self.weight(wshape, spec, scale=math.sqrt(3.0 / k)), wshape

    def _apply_dot(self, form, wspec=None):
        layout = dot_layout(self.shape, form)
        if layout is None or not self.fits(layout[3]) or any(d > MAX_DIM for d in layout[0]):
            raise _Skip
        i, _ = self._dot_weight(form, layout, wspec)
        before = self._step_dot(lambda h, ws, i=i, layout=layout: _dot(h, ws[i], layout, form), layout, form)
        return f"dot {dot_desc(form)} {before} @ w{list(layout[0])} -> {_fmt(self.shape, self.dtype)}"

    def _step_dot(self, fn, layout, form):
        """Adds `fn`, a dot of `layout` in `form`, as the next step; returns the
        operand as it was (shape and dtype, for the description)."""
        self.step(fn)
        before = _fmt(self.shape, self.dtype)
        self.shape = layout[3]
        if form.get("pet"):
            self.dtype = F32
        return before

    def _claim(self, what, dots=1):
        self.pairs.append(what)
        self.expect += dots

    # -- collectives (shard_map bodies) ----------------------------------------------
    def _gather(self, axes, dim):
        if not self.axes_ok(axes) or not 0 <= dim < len(self.shape):
            raise _Skip
        shape = list(self.shape)
        shape[dim] *= self.size(axes)
        if not self.fits(shape):
            raise _Skip
        axes = tuple(axes)
        self.step(lambda h, ws: jax.lax.all_gather(h, axes, axis=dim, tiled=True))
        before, self.shape = self.shape, tuple(shape)
        return f"all_gather(axes={axes}, dim={dim}, tiled) {_fmt(before, self.dtype)} -> {_fmt(self.shape, self.dtype)}"

    def _scatter(self, axes, dim):
        if not self.axes_ok(axes) or not 0 <= dim < len(self.shape) or self.shape[dim] % self.size(axes):
            raise _Skip
        shape = list(self.shape)
        shape[dim] //= self.size(axes)
        axes = tuple(axes)
        vary = self._vary_over
        self.step(lambda h, ws: jax.lax.psum_scatter(vary(h, axes), axes, scatter_dimension=dim, tiled=True))
        before, self.shape = self.shape, tuple(shape)
        return (f"psum_scatter(axes={axes}, dim={dim}, tiled) {_fmt(before, self.dtype)} -> "
                f"{_fmt(self.shape, self.dtype)}")

    def _psum(self, axes):
        if not self.axes_ok(axes):
            raise _Skip
        axes = tuple(axes)
        vary = self._vary_over
        # check_vma: psum wants its operand varying over all its axes (a pvary, which a pattern spans)
        self.step(lambda h, ws: jax.lax.psum(vary(h, axes), axes))
        return f"psum(axes={axes}) {_fmt(self.shape, self.dtype)}"

    def _a2a(self, axes, split, concat):
        r = len(self.shape)
        if not self.axes_ok(axes) or not (0 <= split < r and 0 <= concat < r):
            raise _Skip
        n = self.size(axes)
        if self.shape[split] % n:
            raise _Skip
        shape = list(self.shape)
        shape[split] //= n
        shape[concat] *= n
        if not self.fits(shape):
            raise _Skip
        axes = tuple(axes)
        self.step(lambda h, ws: jax.lax.all_to_all(h, axes, split, concat, tiled=True))
        before, self.shape = self.shape, tuple(shape)
        return (f"all_to_all(axes={axes}, split={split}, concat={concat}, tiled) {_fmt(before, self.dtype)} -> "
                f"{_fmt(self.shape, self.dtype)}")

    # -- op specs: pairs built to fuse --------------------------------------------------
    def _batch_ok(self, form, *dims) -> bool:
        """A grouped matmul (batch dims) fuses as one call per batch (at most 16), where the
        collective's dims (`dims`, of the activation) are not its batch dim."""
        if form["wl"] != "batch":
            return True
        bd = form.get("bd", -1)
        return 0 <= bd < len(self.shape) and self.shape[bd] <= 16 and bd not in dims

    def op_ag_dot(self, axes, dim, form, wspec=None):
        """all_gather(h, dim) whose only use is a dot with it as the activation."""
        if dim in contracted(self.shape, form) or not 0 <= dim < len(self.shape) or not self._batch_ok(form, dim):
            return False
        a = self._gather(axes, dim)
        b = self._apply_dot(form, wspec)
        self.say(f"[pair] {a}  ->  {b}")
        self._claim(f"all_gather(dim={dim}) -> dot {dot_desc(form)}")
        return True

    def op_dot_rs(self, form, axes, dim, wspec=None):
        """psum_scatter(dot(h, w), dim): the dot's only use is the scatter."""
        if form["wl"] == "batch" and (dim == 0 or not self._batch_ok(form)):
            return False  # (a grouped matmul's result has its batch dim first)
        a = self._apply_dot(form, wspec)
        b = self._scatter(axes, dim)
        self.say(f"[pair] {a}  ->  {b}")
        self._claim(f"dot {dot_desc(form)} -> psum_scatter(dim={dim})")
        return True

    def op_dot_psum(self, form, axes, wspec=None):
        if not self._batch_ok(form):
            return False
        a = self._apply_dot(form, wspec)
        b = self._psum(axes)
        self.say(f"[pair] {a}  ->  {b}")
        self._claim(f"dot {dot_desc(form)} -> psum")
        return True

    def op_a2a_dot(self, axes, split, concat, form, wspec=None):
        """all_to_all(h) feeding a dot as its activation; split is a free dim of h."""
        if split in contracted(self.shape, form) or not self._batch_ok(form, split, concat):
            return False
        if form["wl"] == "k2" and concat in contracted(self.shape, form):
            return False
        a = self._a2a(axes, split, concat)
        b = self._apply_dot(form, wspec)
        if self.prev_dot:
            # The all_to_all is also the previous dot's output-side candidate, which may take it
            # (a dot is fused with the collective moving more bytes): not claimed.
            self.say(f"{a}  ->  {b} (the all_to_all also takes the previous dot's result: not claimed)")
            return True
        self.say(f"[pair] {a}  ->  {b}")
        self._claim(f"all_to_all(split={split}, concat={concat}) -> dot {dot_desc(form)}")
        return True

    def op_dot_a2a(self, form, axes, split, concat, wspec=None):
        """all_to_all(dot(h, w)) with a 2-D weight (every dim of the result one of the product's)."""
        if form["wl"] not in ("kn", "nk", "left"):
            return False
        a = self._apply_dot(form, wspec)
        b = self._a2a(axes, split, concat)
        self.say(f"[pair] {a}  ->  {b}")
        self._claim(f"dot {dot_desc(form)} -> all_to_all(split={split}, concat={concat})")
        return True

    def op_dot_agw(self, form, axes, wdim):
        """h @ all_gather(w_shard, wdim): the gathered weight's only use is the dot
        (wdim: the weight's first contracting or first free dim)."""
        if form["wl"] not in ("kn", "nk", "left", "w3") or not self.axes_ok(axes):
            return False
        layout = dot_layout(self.shape, form)
        if layout is None or not self.fits(layout[3]):
            return False
        wshape = list(layout[0])
        n = self.size(axes)
        if not 0 <= wdim < len(wshape) or wshape[wdim] % n:
            return False
        if form["wl"] == "w3" and wdim == 2:
            return False  # the second free dim: no contiguous block of the 2-D weight
        local = list(wshape)
        local[wdim] //= n
        spec = [None] * len(wshape)
        spec[wdim] = tuple(axes)
        k = math.prod(self.shape[d] for d in contracted(self.shape, form))
        i = self.weight(tuple(local), spec, scale=math.sqrt(3.0 / k))
        axes = tuple(axes)

        def fn(h, ws, i=i, layout=layout):
            w = jax.lax.all_gather(ws[i].astype(h.dtype), axes, axis=wdim, tiled=True)
            return _dot(h, w, layout, form)

        before = self._step_dot(fn, layout, form)
        self.say(f"[pair] dot {dot_desc(form)} {before} @ all_gather(w{local}, axes={axes}, "
                 f"dim={wdim}) -> {_fmt(self.shape, self.dtype)}")
        self._claim(f"dot {dot_desc(form)} of all_gather(w, dim={wdim})")
        return True

    def op_ag_norm_dot(self, axes, dim, form, wspec=None):
        """all_gather(h, dim) -> rms-norm over the last dim -> dot (row-wise work moved before the gather)."""
        if form["wl"] not in ("kn", "nk", "left", "w3") or form["cd"] != len(self.shape) - 1 \
                or dim == len(self.shape) - 1:
            return False
        a = self._gather(axes, dim)
        self._rmsnorm()
        b = self._apply_dot(form, wspec)
        self.say(f"[pair] {a}  ->  rms_norm(last dim)  ->  {b}")
        self._claim(f"all_gather(dim={dim}) -> rms_norm -> dot {dot_desc(form)}")
        return True

    def op_ag_2dots(self, axes, dim, n):
        """all_gather(h, dim) read by two dots (each its own fused op), summed."""
        r = len(self.shape)
        if dim == r - 1:
            return False
        a = self._gather(axes, dim)
        k = self.shape[-1]
        if n > MAX_DIM:
            return False
        out = self.shape[:-1] + (n,)
        if not self.fits(out):
            return False
        i1 = self.weight((k, n), scale=math.sqrt(1.5 / k))
        i2 = self.weight((n, k), scale=math.sqrt(1.5 / k))
        self.step(lambda h, ws: (jnp.matmul(h, ws[i1].astype(h.dtype))
                                 + jnp.einsum("...k,nk->...n", h, ws[i2].astype(h.dtype))))
        self.shape = out
        self.say(f"[pair x2] {a}  ->  h @ w1 + einsum('...k,nk->...n', h, w2) -> {_fmt(out, self.dtype)}")
        self._claim(f"all_gather(dim={dim}) -> 2 dots", dots=2)
        return True

    def op_megatron(self, axes, dim, f, forms=("kn", "kn")):
        """all_gather(dim) -> dot d->f -> gelu -> dot f->d -> psum_scatter(dim): 2 pairs, shape kept."""
        r = len(self.shape)
        d = self.shape[-1]
        if dim == r - 1:
            return False
        f1 = {"wl": forms[0], "cd": r - 1, "n": f}
        f2 = {"wl": forms[1], "cd": r - 1, "n": d}
        if forms[0] not in ("kn", "nk") or forms[1] not in ("kn", "nk"):
            return False
        a = self._gather(axes, dim)
        b = self._apply_dot(f1)
        self._gelu()
        c = self._apply_dot(f2)
        e = self._scatter(axes, dim)
        self.say(f"[pair x2] megatron: {a} -> {b} -> gelu -> {c} -> {e}")
        self._claim(f"megatron all_gather(dim={dim}) -> dot; dot -> psum_scatter(dim={dim})", dots=2)
        return True

    def op_ulysses(self, axes, split, concat, form="kn"):
        """all_to_all(split, concat) -> dot d->d -> all_to_all back: the dot is fused once."""
        r = len(self.shape)
        if split == r - 1 or concat == r - 1 or split == concat or form not in ("kn", "nk"):
            return False
        a = self._a2a(axes, split, concat)
        b = self._apply_dot({"wl": form, "cd": r - 1, "n": self.shape[-1]})
        c = self._a2a(axes, concat, split)
        self.say(f"[pair] ulysses: {a} -> {b} -> {c}")
        self._claim("ulysses all_to_all -> dot -> all_to_all (one dot)")
        return True

    def op_tp_psum(self, axes, f):
        """dot d->f (column-parallel) -> gelu -> dot f->d -> psum: shape kept, 1 pair."""
        r = len(self.shape)
        d = self.shape[-1]
        if not self.axes_ok(axes):
            return False
        self._apply_dot({"wl": "kn", "cd": r - 1, "n": f}, (1, tuple(axes)))
        self._gelu()
        b = self._apply_dot({"wl": "kn", "cd": r - 1, "n": d}, (0, tuple(axes)))
        c = self._psum(axes)
        self.say(f"[pair] tp: dot -> gelu -> {b} -> {c}")
        self._claim("tp dot -> psum")
        return True

    def op_dot_t_rs(self, form, perm, axes, dim, wspec=None):
        """psum_scatter(transpose(dot(h, w))): the rewrite spans transposes on the output side."""
        if form["wl"] not in ("kn", "nk", "left"):
            return False
        a = self._apply_dot(form, wspec)
        if sorted(perm) != list(range(len(self.shape))) or list(perm) == sorted(perm):
            raise _Skip
        perm = tuple(perm)
        self.step(lambda h, ws: jnp.transpose(h, perm))
        self.shape = tuple(self.shape[q] for q in perm)
        b = self._scatter(axes, dim)
        self.say(f"[pair] {a}  ->  transpose{perm}  ->  {b}")
        self._claim(f"dot {dot_desc(form)} -> transpose{perm} -> psum_scatter(dim={dim})")
        return True

    def op_ag_dot_agw(self, axes, dim, axes_w, wdim, form):
        """all_gather(h) @ all_gather(w): one dot next to two gathers (fused with one of them)."""
        if form["wl"] not in ("kn", "nk") or dim in contracted(self.shape, form) or not 0 <= dim < len(self.shape):
            return False
        a = self._gather(axes, dim)
        layout = dot_layout(self.shape, form)
        if layout is None or not self.fits(layout[3]) or not self.axes_ok(axes_w):
            raise _Skip
        wshape = list(layout[0])
        n = self.size(axes_w)
        if wshape[wdim] % n:
            raise _Skip
        local = list(wshape)
        local[wdim] //= n
        spec = [None, None]
        spec[wdim] = tuple(axes_w)
        i = self.weight(tuple(local), spec, scale=math.sqrt(3.0 / wshape[0 if form["wl"] == "kn" else 1]))
        axes_w = tuple(axes_w)

        def fn(h, ws, i=i, layout=layout):
            return _dot(h, jax.lax.all_gather(ws[i].astype(h.dtype), axes_w, axis=wdim, tiled=True), layout, form)

        before = self._step_dot(fn, layout, form)
        self.say(f"[pair] {a}  ->  dot {dot_desc(form)} {before} @ all_gather(w{local}, "
                 f"axes={axes_w}, dim={wdim}) -> {_fmt(self.shape, self.dtype)}")
        self._claim(f"all_gather(dim={dim}) -> dot {dot_desc(form)} <- all_gather(w, dim={wdim}) (one dot)")
        return True

    def op_gather_untiled(self, axes, dim):
        """all_gather(tiled=False) (a new dim), merged into `dim`, then a dot: not fusable."""
        if not self.axes_ok(axes) or not 0 <= dim < len(self.shape) - 1:
            return False
        n = self.size(axes)
        shape = list(self.shape)
        shape[dim] *= n
        if not self.fits(shape):
            return False
        axes, new = tuple(axes), tuple(shape)

        def fn(h, ws):
            g = jax.lax.all_gather(h, axes, axis=dim, tiled=False)
            return g.reshape(new)

        self.step(fn)
        self.say(f"all_gather(axes={axes}, dim={dim}, tiled=False) + reshape {_fmt(self.shape, self.dtype)} -> "
                 f"{_fmt(new, self.dtype)}")
        self.shape = new
        return True

    def op_tied(self, n):
        """y = gelu(h @ w); y @ w.T: one weight read by two dots (its gradient summed)."""
        k = self.shape[-1]
        if n > MAX_DIM or not self.fits(self.shape[:-1] + (n,)):
            return False
        i = self.weight((k, n), scale=math.sqrt(3.0 / max(k, n)))
        self.step(lambda h, ws: jax.nn.gelu(h @ ws[i].astype(h.dtype)) @ ws[i].astype(h.dtype).T)
        self.say(f"tied: gelu(h @ w[{k},{n}]) @ w.T {_fmt(self.shape, self.dtype)}")
        return True

    def op_stage(self):
        """Ends one shard_map and starts another (shard_map mode, top level): the activation
        goes out stacked over every manual axis and comes back in the same way."""
        if self.mode != "shard_map" or self.depth != 0:
            return False
        self.steps.append(STAGE)
        self.say("--- end of this shard_map; a new shard_map starts (same local activation)")
        return True

    # -- op specs: single ops --------------------------------------------------------
    def op_dot(self, form, wspec=None):
        self.say(self._apply_dot(form, wspec))
        return True

    def op_gather(self, axes, dim):
        self.say(self._gather(axes, dim) + " (result not used by a dot directly: then gelu)")
        self._gelu()
        return True

    def op_scatter(self, axes, dim):
        self._gelu()
        self.say("gelu, then " + self._scatter(axes, dim))
        return True

    def op_psum(self, axes):
        self.say(self._psum(axes))
        return True

    def op_a2a(self, axes, split, concat):
        self.say(self._a2a(axes, split, concat))
        return True

    def op_ppermute(self, axes, shift=1):
        if not self.axes_ok(axes):
            return False
        n = self.size(axes)
        perm = [(j, (j + shift) % n) for j in range(n)]
        axes = tuple(axes)
        self.step(lambda h, ws: jax.lax.ppermute(h, axes, perm))
        self.say(f"ppermute(axes={axes}, shift={shift}) {_fmt(self.shape, self.dtype)}")
        return True

    def op_ag_dot_residual(self, axes, dim):
        """g = all_gather(h); g @ w + g: the gather has a non-dot use (not claimed)."""
        r = len(self.shape)
        if dim == r - 1:
            return False
        a = self._gather(axes, dim)
        k = self.shape[-1]
        i = self.weight((k, k), scale=math.sqrt(3.0 / k))
        self.step(lambda h, ws: h @ ws[i].astype(h.dtype) + h)
        self.say(f"{a} -> g @ w[{k},{k}] + g (gather also read by the add)")
        return True

    def op_dot_twice(self, n):
        """y = h @ w; y * sigmoid(y): a dot whose result has two users."""
        k = self.shape[-1]
        if n != k:
            return False
        i = self.weight((k, k), scale=math.sqrt(3.0 / k))
        self.step(lambda h, ws: (lambda y: y * jax.nn.sigmoid(y))(h @ ws[i].astype(h.dtype)))
        self.say(f"y = h @ w[{k},{k}]; y * sigmoid(y)")
        return True

    def _gelu(self):
        self.step(lambda h, ws: jax.nn.gelu(h))

    def op_gelu(self):
        self._gelu()
        self.say("gelu")
        return True

    def op_tanh(self):
        self.step(lambda h, ws: jnp.tanh(h) * 2)
        self.say("2 * tanh")
        return True

    def op_bias(self):
        i = self.weight((self.shape[-1],), scale=0.5)
        self.step(lambda h, ws: h + ws[i].astype(h.dtype))
        self.say(f"+ bias[{self.shape[-1]}]")
        return True

    def _rmsnorm(self):
        i = self.weight((self.shape[-1],), positive=True)

        def fn(h, ws):
            ms = jnp.mean(h * h, axis=-1, keepdims=True)
            return h * jax.lax.rsqrt(ms + 1e-6) * ws[i].astype(h.dtype)

        self.step(fn)

    def op_rmsnorm(self):
        self._rmsnorm()
        self.say("rms_norm(last dim) * scale")
        return True

    def op_cast(self, to):
        if to == self.dtype or (to == BF16 and not self.allow_bf16):
            return False
        self.step(lambda h, ws: h.astype(_dt(to)))
        self.say(f"cast {_short(self.dtype)} -> {_short(to)}")
        self.dtype = to
        return True

    def op_reshape(self, kind, dim, factor=2):
        """'merge': dims dim, dim+1 -> one; 'split': dim -> (dim/factor, factor)."""
        s = list(self.shape)
        if kind == "merge":
            if not 0 <= dim < len(s) - 1 or len(s) <= 2:
                return False
            new = s[:dim] + [s[dim] * s[dim + 1]] + s[dim + 2:]
        else:
            if not 0 <= dim < len(s) or s[dim] % factor or s[dim] // factor < 2 or len(s) >= 4:
                return False
            new = s[:dim] + [s[dim] // factor, factor] + s[dim + 1:]
        if not self.fits(new):
            return False
        new = tuple(new)
        self.step(lambda h, ws: h.reshape(new))
        self.say(f"reshape {_fmt(self.shape, self.dtype)} -> {_fmt(new, self.dtype)}")
        self.shape = new
        return True

    def op_transpose(self, i, j):
        r = len(self.shape)
        if not (0 <= i < r and 0 <= j < r) or i == j:
            return False
        perm = list(range(r))
        perm[i], perm[j] = perm[j], perm[i]
        perm = tuple(perm)
        self.step(lambda h, ws: jnp.transpose(h, perm))
        new = tuple(self.shape[p] for p in perm)
        self.say(f"transpose{perm} {_fmt(self.shape, self.dtype)} -> {_fmt(new, self.dtype)}")
        self.shape = new
        return True

    def op_constrain(self, spec):
        """with_sharding_constraint (jit mode)."""
        if self.mode != "jit" or len(spec) != len(self.shape):
            return False
        used = [a for e in spec if e is not None for a in e]
        if len(set(used)) != len(used) or any(a not in self.mesh for a in used):
            return False
        for d, e in zip(self.shape, spec):
            if e is not None and d % self.size(e):
                return False
        mesh = self.mesh_obj
        sharding = NamedSharding(mesh, P(*[tuple(e) if e is not None else None for e in spec]))
        self.step(lambda h, ws: jax.lax.with_sharding_constraint(h, sharding))
        self.say(f"with_sharding_constraint({_fmt(self.shape, self.dtype)}, P{tuple(spec)})")
        return True

    def op_jit_pair(self, kind, rowdim, axes, n):
        """Under jit, a dot whose shardings call for one fused op (`_matmul.choose`):
        'gather_rows': x rows sharded over `axes`, the result's not (all_gather_matmul);
        'scatter_rows': x's and w's contraction over `axes`, the result's rows over them
        (matmul_reduce_scatter); 'gather_w': w's columns over `axes`, the result's not
        (matmul_all_gather)."""
        r = len(self.shape)
        if self.mode != "jit" or not 0 <= rowdim < r - 1 or not all(a in self.mesh for a in axes):
            return False
        if len(set(axes)) != len(axes):
            return False
        sz, k = self.size(axes), self.shape[-1]
        if n > MAX_DIM or not self.fits(self.shape[:-1] + (n,)):
            return False
        axes = tuple(axes)
        none = [None] * r
        x_spec, out_spec, w_spec = list(none), list(none), [None, None]
        if kind == "gather_rows":
            if self.shape[rowdim] % sz:
                return False
            x_spec[rowdim] = axes
        elif kind == "scatter_rows":
            if k % sz or self.shape[rowdim] % sz:
                return False
            x_spec[-1], w_spec[0], out_spec[rowdim] = axes, axes, axes
        elif kind == "gather_w":
            if n % sz:
                return False
            w_spec[1] = axes
        else:
            return False
        i = self.weight((k, n), w_spec, scale=math.sqrt(3.0 / k))
        xs = NamedSharding(self.mesh_obj, P(*x_spec))
        os = NamedSharding(self.mesh_obj, P(*out_spec))

        def fn(h, ws):
            h = jax.lax.with_sharding_constraint(h, xs)
            y = jnp.matmul(h, ws[i].astype(h.dtype))
            return jax.lax.with_sharding_constraint(y, os)

        self.step(fn)
        before, self.shape = self.shape, self.shape[:-1] + (n,)
        self.say(f"[jit pair] {kind}: wsc(x, P{tuple(x_spec)}) {_fmt(before, self.dtype)} @ w[{k},{n}] "
                 f"P{tuple(w_spec)} -> wsc(P{tuple(out_spec)}) {_fmt(self.shape, self.dtype)}")
        self._claim(f"jit {kind} over {axes}")
        return True

    # -- control flow ----------------------------------------------------------------
    def _vary_over(self, h, axes):
        """`h` typed as varying over `axes` too (check_vma bodies)."""
        if self.mode != "shard_map" or not self.check_vma:
            return h
        have = jax.typeof(h)
        vma = getattr(getattr(have, "manual_axis_type", None), "varying", None)
        if vma is None:
            vma = getattr(have, "vma", frozenset())
        missing = tuple(a for a in axes if a not in vma)
        return jax.lax.pcast(h, missing, to="varying") if missing else h

    def _vary_all(self, h):
        return self._vary_over(h, tuple(self.mesh))

    def _body(self, specs, *, layers=None, dtype=None):
        sub = self.sub(layers=layers, dtype=dtype)
        sub.replay(specs)
        return sub

    def _attach(self, sub) -> list:
        """Adds `sub`'s weights to this builder's; returns their indices."""
        first = len(self.weights)
        self.weights.extend(sub.weights)
        return list(range(first, len(self.weights)))

    def op_scan(self, length, body, residual=True, remat=False, unroll=1):
        if self.depth >= 2:
            raise _Skip
        sub = self._body(body, layers=self.layers + (length,))
        if not sub.applied or sub.shape != self.shape or sub.dtype != self.dtype:
            return False
        idx = self._attach(sub)
        vary = self._vary_all

        def fn(h, ws, sub=sub, idx=idx):
            def layer(carry, layer_ws):
                y = sub.run(carry, layer_ws)
                return (carry + y if residual else vary(y)), None

            f = jax.checkpoint(layer) if remat else layer
            h, _ = jax.lax.scan(f, vary(h), tuple(ws[j] for j in idx), length=length, unroll=unroll)
            return h

        self.step(fn)
        self.say(f"scan(length={length}, residual={residual}, checkpoint={remat}, unroll={unroll}) over:")
        self.lines.extend(sub.lines)
        self.pairs.extend(f"scan: {p}" for p in sub.pairs)
        self.expect += sub.expect
        return True

    def op_remat(self, body, policy=None):
        if self.depth >= 2:
            raise _Skip
        sub = self._body(body)
        if not sub.applied:
            return False
        idx = self._attach(sub)
        pol = {None: None, "dots": jax.checkpoint_policies.dots_saveable,
               "nothing": jax.checkpoint_policies.nothing_saveable}[policy]

        def fn(h, ws, sub=sub, idx=idx):
            return jax.checkpoint(lambda h, *w: sub.run(h, w), policy=pol)(h, *(ws[j] for j in idx))

        self.step(fn)
        self.say(f"checkpoint(policy={policy}) over:")
        self.lines.extend(sub.lines)
        self.pairs.extend(f"checkpoint: {p}" for p in sub.pairs)
        self.shape, self.dtype = sub.shape, sub.dtype
        self.expect += sub.expect
        return True

    def op_inner_jit(self, body):
        """jax.jit around some ops (a pjit equation in the body, interpreted in place)."""
        if self.depth >= 2:
            raise _Skip
        sub = self._body(body)
        if not sub.applied:
            return False
        idx = self._attach(sub)

        def fn(h, ws, sub=sub, idx=idx):
            return jax.jit(lambda h, *w: sub.run(h, w))(h, *(ws[j] for j in idx))

        self.step(fn)
        self.say("jax.jit over:")
        self.lines.extend(sub.lines)
        self.pairs.extend(f"jit: {p}" for p in sub.pairs)
        self.shape, self.dtype = sub.shape, sub.dtype
        self.expect += sub.expect
        return True

    def op_cond(self, body, residual=True):
        """lax.cond on a replicated scalar: branch 0 runs `body`, branch 1 the same ops with other
        weights, then 2*tanh."""
        if self.depth >= 2:
            raise _Skip
        b0 = self._body(body)
        b1 = self._body(b0.applied)
        if not b0.applied or b0.shape != self.shape or b0.dtype != self.dtype or b1.applied != b0.applied:
            return False
        b1.op_tanh()
        i0, i1 = self._attach(b0), self._attach(b1)
        pred = self.weight((1,))  # replicated: every rank takes the same branch
        vary = self._vary_all

        def fn(h, ws, b0=b0, b1=b1, i0=i0, i1=i1):
            h = vary(h)
            w0, w1 = tuple(ws[j] for j in i0), tuple(ws[j] for j in i1)

            def br(b):
                def run(h, w0, w1):
                    y = b.run(h, w0 if b is b0 else w1)
                    return h + y if residual else vary(y)
                return run

            return jax.lax.cond(ws[pred][0] > 0, br(b0), br(b1), h, w0, w1)

        self.step(fn)
        self.say(f"cond(replicated predicate, residual={residual}); branch 0 (branch 1: same ops, "
                 f"other weights, then 2*tanh):")
        self.lines.extend(b0.lines)
        self.pairs.extend(f"cond: {p}" for p in b0.pairs + b1.pairs)
        self.expect += b0.expect + b1.expect
        return True


class _Skip(Exception):
    pass


# The ops whose last equation is a dot_general making the activation.
ENDS_WITH_DOT = frozenset(("ag_dot", "a2a_dot", "dot_agw", "ag_norm_dot", "dot", "ag_dot_agw", "tied", "jit_pair"))


def STAGE(h, ws):  # a marker among the steps (op_stage)
    raise AssertionError("STAGE is split out by build()")


# ----------------------------------------------------------------------------
# The generator
# ----------------------------------------------------------------------------
def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _axes(rng, mesh: dict):
    names = list(mesh)
    if len(names) == 2 and rng.random() < 0.2:
        return tuple(names) if rng.random() < 0.7 else tuple(reversed(names))
    return (_pick(rng, names),)


def _form(rng, shape, *, forms=DOT_FORMS, cd=None, n=None):
    r = len(shape)
    wl = _pick(rng, forms)
    if cd is None:
        cd = r - 1 if rng.random() < 0.7 else int(rng.integers(r))
    form = {"wl": wl, "cd": cd, "n": int(n if n is not None else _pick(rng, (8, 16, 32)))}
    if wl == "w3":
        form["n2"] = int(_pick(rng, (2, 4)))
    if wl == "k2":
        others = [d for d in range(r) if d != cd]
        form["cd2"] = int(_pick(rng, others)) if others else 0
    if wl == "batch":
        others = [d for d in range(r) if d != cd]
        form["bd"] = int(_pick(rng, others)) if others else 0
    u = rng.random()
    if u < 0.12 and wl in ("kn", "nk", "w3") and cd == r - 1:  # XLA's CPU dot rejects others (bf16 x bf16 = f32)
        form["pet"] = True
    elif u < 0.2:
        form["prec"] = True
    return form


def _wspec(rng, mesh):
    if rng.random() < 0.6:
        return None
    return (int(rng.integers(2)), _axes(rng, mesh))


def _single_op(rng, b: Builder) -> dict:
    """A random spec for the builder's current activation."""
    shape, r, mesh = b.shape, len(b.shape), b.mesh
    ax = _axes(rng, mesh)
    dim = int(rng.integers(r))
    if b.mode == "jit":
        kinds = ["dot", "dot", "jit_pair", "jit_pair", "gelu", "bias", "rmsnorm", "cast", "reshape", "transpose",
                 "constrain", "constrain"]
    else:
        kinds = ["ag_dot", "ag_dot", "dot_rs", "dot_rs", "dot_psum", "a2a_dot", "dot_a2a", "dot_agw", "ag_norm_dot",
                 "ag_2dots", "megatron", "ulysses", "tp_psum", "dot", "dot", "gather", "scatter", "psum", "a2a",
                 "ppermute", "ag_dot_residual", "dot_twice", "gelu", "bias", "rmsnorm", "cast", "reshape",
                 "transpose", "dot_t_rs", "ag_dot_agw", "gather_untiled", "tied"]
        if b.depth == 0:
            kinds.append("stage")
    if b.depth == 0:
        kinds += ["scan", "remat", "cond", "scan", "remat", "cond", "inner_jit"]
    elif b.depth == 1:
        kinds += ["scan", "remat", "cond", "inner_jit"]
    kind = _pick(rng, kinds)
    if kind == "ag_dot":
        form = _form(rng, shape, forms=("kn", "nk", "left", "w3", "k2", "batch"))
        free = [d for d in range(r) if d not in contracted(shape, form)]
        return {"op": kind, "axes": ax, "dim": int(_pick(rng, free)) if free else 0, "form": form,
                "wspec": _wspec(rng, mesh)}
    if kind == "dot_rs":
        form = _form(rng, shape, forms=("kn", "nk", "left", "w3", "k2", "batch"))
        lay = dot_layout(shape, form)
        rdims = len(lay[3]) if lay else r
        return {"op": kind, "form": form, "axes": ax, "dim": int(rng.integers(rdims)), "wspec": _wspec(rng, mesh)}
    if kind == "dot_psum":
        return {"op": kind, "form": _form(rng, shape, forms=("kn", "nk", "left", "w3", "k2", "batch")), "axes": ax,
                "wspec": _wspec(rng, mesh)}
    if kind == "a2a_dot":
        form = _form(rng, shape, forms=("kn", "nk", "left", "w3", "k2", "batch"))
        free = [d for d in range(r) if d not in contracted(shape, form)]
        return {"op": kind, "axes": ax, "split": int(_pick(rng, free)) if free else 0,
                "concat": int(rng.integers(r)), "form": form, "wspec": _wspec(rng, mesh)}
    if kind == "dot_a2a":
        form = _form(rng, shape, forms=("kn", "nk", "left"))
        rr = r  # a 2-D weight keeps the rank
        return {"op": kind, "form": form, "axes": ax, "split": int(rng.integers(rr)), "concat": int(rng.integers(rr)),
                "wspec": _wspec(rng, mesh)}
    if kind == "dot_agw":
        form = _form(rng, shape, forms=("kn", "nk", "left", "w3"))
        lay = dot_layout(shape, form)
        # the weight's first contracting dim, or its first free dim
        if lay is None:
            wdim = 0
        elif form["wl"] == "nk":
            wdim = int(_pick(rng, (0, 1)))
        else:
            wdim = int(_pick(rng, (0, 1)))
        return {"op": kind, "form": form, "axes": ax, "wdim": wdim}
    if kind == "ag_norm_dot":
        form = _form(rng, shape, forms=("kn", "nk", "left", "w3"), cd=r - 1)
        return {"op": kind, "axes": ax, "dim": int(rng.integers(max(r - 1, 1))), "form": form,
                "wspec": _wspec(rng, mesh)}
    if kind == "ag_2dots":
        return {"op": kind, "axes": ax, "dim": int(rng.integers(max(r - 1, 1))), "n": int(_pick(rng, (8, 16, 32)))}
    if kind == "megatron":
        return {"op": kind, "axes": ax, "dim": int(rng.integers(max(r - 1, 1))), "f": int(_pick(rng, (16, 32))),
                "forms": (_pick(rng, ("kn", "nk")), _pick(rng, ("kn", "nk")))}
    if kind == "ulysses":
        s, c = (int(v) for v in rng.permutation(max(r - 1, 2))[:2])
        return {"op": kind, "axes": ax, "split": s, "concat": c, "form": _pick(rng, ("kn", "nk"))}
    if kind == "tp_psum":
        return {"op": kind, "axes": ax, "f": int(_pick(rng, (16, 32)))}
    if kind == "dot_t_rs":
        form = _form(rng, shape, forms=("kn", "nk", "left"))
        perm = [int(v) for v in rng.permutation(r)]
        return {"op": kind, "form": form, "perm": perm, "axes": ax, "dim": int(rng.integers(r)),
                "wspec": _wspec(rng, mesh)}
    if kind == "ag_dot_agw":
        form = _form(rng, shape, forms=("kn", "nk"), cd=r - 1)
        return {"op": kind, "axes": ax, "dim": int(rng.integers(max(r - 1, 1))), "axes_w": _axes(rng, mesh),
                "wdim": int(rng.integers(2)), "form": form}
    if kind == "gather_untiled":
        return {"op": kind, "axes": ax, "dim": int(rng.integers(max(r - 1, 1)))}
    if kind == "tied":
        return {"op": kind, "n": int(_pick(rng, (8, 16, 32)))}
    if kind == "stage":
        return {"op": kind}
    if kind == "dot":
        return {"op": kind, "form": _form(rng, shape), "wspec": _wspec(rng, mesh)}
    if kind in ("gather", "scatter"):
        return {"op": kind, "axes": ax, "dim": dim}
    if kind == "psum":
        return {"op": kind, "axes": ax}
    if kind == "a2a":
        return {"op": kind, "axes": ax, "split": dim, "concat": int(rng.integers(r))}
    if kind == "ppermute":
        return {"op": kind, "axes": ax, "shift": int(_pick(rng, (1, -1)))}
    if kind == "ag_dot_residual":
        return {"op": kind, "axes": ax, "dim": int(rng.integers(max(r - 1, 1)))}
    if kind == "dot_twice":
        return {"op": kind, "n": shape[-1]}
    if kind in ("gelu", "bias", "rmsnorm"):
        return {"op": kind}
    if kind == "cast":
        return {"op": kind, "to": F32 if b.dtype == BF16 else BF16}
    if kind == "reshape":
        return {"op": kind, "kind": _pick(rng, ("merge", "split")), "dim": dim, "factor": int(_pick(rng, (2, 4)))}
    if kind == "transpose":
        i, j = (int(v) for v in rng.permutation(r)[:2]) if r >= 2 else (0, 0)
        return {"op": kind, "i": i, "j": j}
    if kind == "constrain":
        spec = [None] * r
        for a in mesh:
            if rng.random() < 0.6:
                d = int(rng.integers(r))
                spec[d] = (a,) if spec[d] is None else spec[d] + (a,)
        return {"op": kind, "spec": spec}
    if kind == "jit_pair":
        return {"op": kind, "kind": _pick(rng, ("gather_rows", "scatter_rows", "gather_w")),
                "rowdim": int(rng.integers(max(r - 1, 1))), "axes": ax, "n": int(_pick(rng, (16, 32)))}
    if kind in ("scan", "remat", "cond", "inner_jit"):
        body = _block(rng, b, shape_preserving=kind not in ("remat", "inner_jit"))
        if kind == "inner_jit":
            return {"op": "inner_jit", "body": body}
        if kind == "scan":
            return {"op": "scan", "length": int(_pick(rng, (1, 2, 3))), "body": body,
                    "residual": bool(rng.random() < 0.8), "remat": bool(rng.random() < 0.4),
                    "unroll": int(_pick(rng, (1, 1, 2)))}
        if kind == "remat":
            return {"op": "remat", "body": body, "policy": _pick(rng, (None, "dots", "nothing"))}
        return {"op": "cond", "body": body, "residual": bool(rng.random() < 0.8)}
    raise AssertionError(kind)


def _block(rng, b: Builder, *, shape_preserving: bool) -> list:
    """The body of a scan, checkpoint or cond: a template (shape kept) or random ops."""
    shape, r, mesh = b.shape, len(b.shape), b.mesh
    ax = _axes(rng, mesh)
    d = shape[-1]
    if b.mode == "jit":
        templates = ["jit_mlp", "plain"]
    else:
        templates = ["megatron", "tp_psum", "ulysses", "fsdp", "norm_gather", "plain", "random"]
    t = _pick(rng, templates)
    if not shape_preserving and rng.random() < 0.5:
        t = "random"
    rowdim = int(rng.integers(max(r - 1, 1)))
    f = int(_pick(rng, (16, 32)))
    if t == "megatron":
        return [{"op": "megatron", "axes": ax, "dim": rowdim, "f": f,
                 "forms": (_pick(rng, ("kn", "nk")), _pick(rng, ("kn", "nk")))}]
    if t == "tp_psum":
        return [{"op": "tp_psum", "axes": ax, "f": f}]
    if t == "ulysses":
        s, c = (int(v) for v in rng.permutation(max(r - 1, 2))[:2])
        return [{"op": "ulysses", "axes": ax, "split": s, "concat": c, "form": _pick(rng, ("kn", "nk"))}]
    if t == "fsdp":
        return [{"op": "dot_agw", "form": {"wl": _pick(rng, ("kn", "nk")), "cd": r - 1, "n": f}, "axes": ax,
                 "wdim": int(_pick(rng, (0, 1)))},
                {"op": "gelu"},
                {"op": "dot_agw", "form": {"wl": _pick(rng, ("kn", "nk")), "cd": r - 1, "n": d}, "axes": ax,
                 "wdim": int(_pick(rng, (0, 1)))}]
    if t == "norm_gather":
        return [{"op": "ag_norm_dot", "axes": ax, "dim": rowdim, "form": {"wl": "kn", "cd": r - 1, "n": f}},
                {"op": "gelu"},
                {"op": "dot_rs", "form": {"wl": _pick(rng, ("kn", "nk")), "cd": r - 1, "n": d}, "axes": ax,
                 "dim": rowdim}]
    if t == "jit_mlp":
        return [{"op": "jit_pair", "kind": "gather_rows", "rowdim": rowdim, "axes": ax, "n": f},
                {"op": "gelu"},
                {"op": "jit_pair", "kind": "scatter_rows", "rowdim": rowdim, "axes": ax, "n": d}]
    if t == "plain":
        return [{"op": "dot", "form": {"wl": _pick(rng, ("kn", "nk")), "cd": r - 1, "n": d}}, {"op": "bias"},
                {"op": "gelu"}, {"op": "rmsnorm"}]
    # random: a few single ops (the scan/cond check drops it if the shape changes)
    sub = b.sub()
    specs = []
    for _ in range(int(rng.integers(1, 4))):
        for _attempt in range(6):
            spec = _single_op(rng, sub)
            if spec["op"] in ("cast",) and shape_preserving:
                continue
            if sub.apply(spec):
                specs.append(spec)
                break
    return specs


@dataclass
class Program:
    seed: int
    mode: str                   # "shard_map" | "jit"
    mesh_axes: dict
    check_vma: bool
    x_shape: tuple              # local (shard_map) or global (jit) shape of the activation
    x_spec: tuple
    specs: list                 # the op specs (replayable)
    outer_dot: bool = False     # shard_map mode: a dot after the shard_map (commfuse.matmul under overlap)
    manual: tuple = ()          # shard_map mode: its manual axes where not all of the mesh's (axis_names)
    # filled by build():
    fn: object = None
    loss: object = None
    args: tuple = ()
    lines: list = field(default_factory=list)
    pairs: list = field(default_factory=list)
    expect: int = 0
    mesh: object = None
    dtypes: set = field(default_factory=set)

    def describe(self) -> str:
        head = (f"seed {self.seed}: {self.mode}, mesh {self.mesh_axes}"
                + (f", check_vma={self.check_vma}" if self.mode == "shard_map" else "")
                + (f", axis_names={set(self.manual)} (the other axes auto)" if self.manual else "")
                + f", x {'local' if self.mode == 'shard_map' else 'global'} f32{list(self.x_shape)} "
                  f"spec P{tuple(self.x_spec)}")
        body = "\n".join("  " + line for line in self.lines)
        tail = "\n  then (outside the shard_map) out @ w_out" if self.outer_dot else ""
        pairs = f"\n  deliberate fusable pairs ({self.expect} dots): {self.pairs}" if self.pairs else ""
        return head + "\n" + body + tail + pairs

    def with_specs(self, specs, **changes) -> "Program":
        p = copy.copy(self)
        p.specs = list(specs)
        for k, v in changes.items():
            setattr(p, k, v)
        p.fn = None
        return p


def _mesh(axes: dict):
    n = math.prod(axes.values())
    devs = jax.devices()[:n]
    types = (jax.sharding.AxisType.Auto,) * len(axes)
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=types, devices=devs)


def generate(seed: int) -> Program:
    rng = np.random.default_rng(seed)
    mode = "jit" if rng.random() < 0.2 else "shard_map"
    mesh_axes = dict(_pick(rng, MESHES))
    check_vma = bool(rng.random() < 0.6)
    manual = ()
    if mode == "shard_map" and len(mesh_axes) == 2 and rng.random() < 0.2:
        manual = (_pick(rng, list(mesh_axes)),)
    sub_mesh = {a: mesh_axes[a] for a in manual} if manual else mesh_axes
    r = int(_pick(rng, (2, 2, 3)))
    x_shape = [int(_pick(rng, (8, 16))) for _ in range(r)]
    if r == 3:
        x_shape[0] = int(_pick(rng, (2, 4, 8)))
    x_spec = [None] * r
    for a in sub_mesh:
        if rng.random() < 0.6:
            d = int(rng.integers(r))
            if mode == "jit" and x_shape[d] % mesh_axes[a]:
                continue
            x_spec[d] = (a,) if x_spec[d] is None else x_spec[d] + (a,)
    if mode == "jit":  # global shapes divisible by every axis sharding them
        for d, e in enumerate(x_spec):
            if e is not None and x_shape[d] % math.prod(mesh_axes[a] for a in e):
                x_spec[d] = None
    x_spec = tuple(x_spec)
    prog = Program(seed, mode, mesh_axes, check_vma, tuple(x_shape), x_spec, [], manual=manual)
    b = Builder(sub_mesh, mode, x_shape, F32, np.random.default_rng([seed, 1]), check_vma=check_vma,
                mesh_obj=_mesh(mesh_axes), allow_bf16=not manual)
    specs = []
    if rng.random() < 0.25:
        spec = {"op": "cast", "to": BF16}
        if b.apply(spec):
            specs.append(spec)
    for _ in range(int(rng.integers(2, 7))):
        for _attempt in range(8):
            spec = _single_op(rng, b)
            if b.apply(spec):
                specs.append(spec)
                break
    prog.specs = specs
    prog.outer_dot = mode == "shard_map" and rng.random() < 0.2
    return prog


def build(prog: Program) -> Program:
    """Replays the program's specs: its function, loss, arguments and expectations."""
    mesh = _mesh(prog.mesh_axes)
    sub_mesh = {a: prog.mesh_axes[a] for a in prog.manual} if prog.manual else prog.mesh_axes
    b = Builder(sub_mesh, prog.mode, prog.x_shape, F32, np.random.default_rng([prog.seed, 1]),
                check_vma=prog.check_vma, mesh_obj=mesh, allow_bf16=not prog.manual)
    prog.specs = b.replay(prog.specs)
    out_dtype = b.dtype
    dtypes = {F32}
    for line in b.lines:
        if "bf16" in line:
            dtypes.add(BF16)
    vrng = np.random.default_rng([prog.seed, 2])
    factor = {d: (math.prod(sub_mesh[a] for a in e) if e and prog.mode == "shard_map" else 1)
              for d, e in enumerate(prog.x_spec)}
    x_global = tuple(n * factor[d] for d, n in enumerate(prog.x_shape))
    x = vrng.uniform(-1, 1, size=x_global).astype(np.float32)

    def spec_of(entries):
        return P(*[tuple(e) if isinstance(e, (tuple, list)) else e for e in entries])

    x_p = spec_of(prog.x_spec)
    w_specs = [spec_of(w.spec) for w in b.weights]
    args = [jax.device_put(x, NamedSharding(mesh, x_p))]
    args += [jax.device_put(w.values, NamedSharding(mesh, s)) for w, s in zip(b.weights, w_specs)]
    all_axes = tuple(sub_mesh)

    if prog.mode == "shard_map":
        kw = {"axis_names": frozenset(prog.manual)} if prog.manual else {}
        stages = b.stages()

        def stage_fn(steps, last):
            def body(x, *ws):
                for step in steps:
                    x = step(x, ws)
                return x.astype(_dt(F32)) if last else x
            return body

        stacked = P(all_axes)
        maps = [jax.shard_map(stage_fn(steps, j == len(stages) - 1), mesh=mesh,
                              in_specs=(x_p if j == 0 else stacked, *w_specs), out_specs=stacked,
                              check_vma=prog.check_vma, **kw)
                for j, steps in enumerate(stages)]

        def smap(x, *ws):
            for m in maps:
                x = m(x, *ws)
            return x

        out_shape = (b.shape[0] * math.prod(sub_mesh.values()),) + tuple(b.shape[1:])
        if prog.outer_dot:
            wo = vrng.uniform(-1, 1, size=(out_shape[-1], 8)).astype(np.float32) * out_shape[-1] ** -0.5
            args.append(jax.device_put(wo, NamedSharding(mesh, P())))
            out_shape = out_shape[:-1] + (8,)

            def fn(x, *ws):
                return smap(x, *ws[:-1]) @ ws[-1]
        else:
            fn = smap
    else:
        def fn(x, *ws):
            return b.run(x, ws).astype(_dt(F32))
        out_shape = b.shape
    probe = np.asarray(vrng.uniform(-1, 1, size=out_shape), np.float32)

    def loss(*a):
        return jnp.sum(fn(*a) * probe)

    prog.fn, prog.loss, prog.args, prog.mesh = fn, loss, tuple(args), mesh
    prog.lines, prog.pairs, prog.expect, prog.dtypes = b.lines, b.pairs, b.expect, dtypes | {out_dtype}
    return prog


# ----------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------
@dataclass
class Failure:
    seed: int
    variant: str      # which run: "overlap ring", "overlap(grad) ring", ...
    kind: str         # "exception" | "mismatch" | "unfused" | "swallowed" | "odd-refusal"
    detail: str       # one or two lines
    report: list = field(default_factory=list)

    @property
    def signature(self) -> str:
        """What makes two failures the same class (numbers and shapes dropped)."""
        d = self.detail.split("\n")[0].split("; ")[0]
        d = re.sub(r"Var\(id=\d+\):\S+", "Var", d)
        d = re.sub(r"\{V:[^}]*\}", "", d)
        d = re.sub(r"\([0-9, ]+\)", "(..)", d)
        d = re.sub(r"(bf16|f32|float32|bfloat16|float16|int32)\[[0-9,]*\]", "T", d)
        d = re.sub(r"\d+", "N", d)
        d = re.sub(r"'[a-z]'", "'A'", d)
        # the variant is left out: one bug shows in several of them
        return f"{self.kind} | {d[:160]}"

    def __str__(self):
        return f"[{self.kind}] {self.variant}: {self.detail}"


_EMBEDDED_FRAME = re.compile(r'File "([^"]*/commfuse/[^"]*)", line (\d+), in (\S+)')
_EMBEDDED_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (.*)$", re.M)


def _through_commfuse(e: BaseException) -> bool:
    """Whether the traceback (or a traceback quoted in the message, as XLA's
    custom_partitioner errors do) passes through commfuse's package."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame in traceback.extract_tb(e.__traceback__):
            if "/python/commfuse/" in frame.filename.replace("\\", "/") or "/site-packages/commfuse/" in frame.filename:
                return True
        if _EMBEDDED_FRAME.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _exc_line(e: BaseException) -> str:
    text = str(e)
    msg = text.strip().split("\n")[0]
    where = ""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if "/commfuse/" in frame.filename.replace("\\", "/"):
            where = f" (at {frame.filename.split('/commfuse/')[-1]}:{frame.lineno} in {frame.name})"
            break
    if "Traceback (most recent call last)" in text:  # an error quoted by XLA (custom_partitioner)
        frames = _EMBEDDED_FRAME.findall(text)
        errors = _EMBEDDED_ERROR.findall(text)
        if errors:
            msg = f"{msg.split('Traceback')[0].strip()} {errors[-1][0]}: {errors[-1][1]}"
        if frames:
            f, line, fn = frames[-1]
            where = f" (at {f.split('/commfuse/')[-1]}:{line} in {fn})"
    return f"{type(e).__name__}: {msg[:400]}{where}"


def _compare(got, want, tol, truth=None) -> str | None:
    """Where `got` differs from `want` (the plain program's) by more than `tol` of max|want|.

    With `truth` (the plain program in float64), a difference counts only where
    `got` is also further from the truth than the plain program is (by more than
    the tolerance): an ill-conditioned program (an rms-norm of rows near zero, say)
    makes float32 itself that far off."""
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    tl = jax.tree.leaves(truth) if truth is not None else [None] * len(wl)
    if len(gl) != len(wl):
        return f"{len(gl)} results, expected {len(wl)}"
    for j, (g, w, t) in enumerate(zip(gl, wl, tl)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return f"result {j}: shape {g.shape}, expected {w.shape}"
        if not np.all(np.isfinite(w)):
            continue
        scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 1e-30)
        err = float(np.max(np.abs(g - w))) if w.size else 0.0
        if np.isfinite(err) and err <= tol * scale:
            continue
        what = f"result {j} {list(w.shape)}: max|got-want| = {err:.3g} > {tol:g} * max|want| ({scale:.3g})"
        if t is not None and np.isfinite(err):
            t = np.asarray(t, np.float64)
            err_got, err_plain = float(np.max(np.abs(g - t))), float(np.max(np.abs(w - t)))
            if err_got <= tol * scale + 4 * err_plain:
                continue  # the plain program is as far from float64's numbers: conditioning, not commfuse
            what += f" (vs float64: overlap's error {err_got:.3g}, plain program's {err_plain:.3g})"
        return what
    return None


def _truth(prog, grad: bool):
    """The plain program (or its gradient) run in float64 (its casts to bf16 or f32 too)."""
    ctx = getattr(jax, "enable_x64", None)
    if ctx is not None:
        ctx = ctx(True)
    else:  # older JAX
        from jax.experimental import enable_x64 as ctx
        ctx = ctx()
    with ctx:
        _EXACT[0] = True
        try:
            return _truth_run(prog, grad)
        finally:
            _EXACT[0] = False


def _truth_run(prog, grad: bool):
    args = [jax.device_put(np.asarray(a, np.float64), a.sharding) for a in prog.args]
    if grad:
        out = jax.jit(jax.grad(prog.loss, argnums=tuple(range(len(args)))))(*args)
    else:
        out = jax.jit(prog.fn)(*args)
    return jax.tree.map(np.asarray, out)


def _fused_lines(report) -> int:
    return sum(1 for line in report if "]: rewrote " in line)


def _report_failures(prog, variant, report) -> list:
    out = []
    for line in report:
        m = SWALLOWED.search(line)
        if m:
            out.append(Failure(prog.seed, variant, "swallowed", line.split("left unchanged: ", 1)[1][:300], report))
        m = ODD_REFUSAL.search(line)
        if m:
            out.append(Failure(prog.seed, variant, "odd-refusal", line[line.find("commfuse."):][:300], report))
    return out


def _unfused_detail(report) -> str:
    reasons = [line.split("]: ", 1)[-1] for line in report if "left unchanged: " in line]
    reasons += [line.split("no match: ", 1)[1] for line in report if "no match: " in line]
    reasons += [line.split(" as well: ", 1)[1] for line in report if " as well: " in line]
    reasons = [re.sub(r"^\S+\(axis=[^)]*\)[^:]*: ", "", r) for r in reasons]
    parts = [p for r in reasons for p in r.split("; ")]
    # the telling ones first: an exception, then anything but "fused with another collective instead"
    parts.sort(key=lambda p: (0 if (" raised " in p or "left unchanged" in p) else
                              2 if "instead (a dot is fused with one collective)" in p else 1))
    return "; ".join(dict.fromkeys(parts))[:400] or "no 'no match' line"


HLO_TARGET = 'custom_call_target="commfuse_collective_matmul'  # as jax_tests/test_jit_programs.py counts

VARIANTS = ("overlap ring", "overlap auto", "overlap(grad) ring", "grad(overlap) ring")
# Others the script can be asked for (--variants).
MORE_VARIANTS = ("overlap bidirectional", "overlap sequential", "overlap(grad) auto", "grad(overlap) auto")


def check(prog: Program, *, variants=VARIANTS) -> tuple[list, str | None]:
    """Runs `prog` plain and through overlap; returns (failures, None), or
    ([], why) where the plain program itself does not run (a generator bug)."""
    if prog.fn is None:
        build(prog)
    fn, loss, args = prog.fn, prog.loss, prog.args
    argnums = tuple(range(len(args)))
    tol = TOLERANCE[BF16 if BF16 in prog.dtypes else F32]
    try:
        want = jax.jit(fn)(*args)
        want_grad = jax.jit(jax.grad(loss, argnums=argnums))(*args)
        jax.block_until_ready((want, want_grad))
    except Exception as e:  # noqa: BLE001 - the program itself is invalid
        return [], f"plain program failed: {_exc_line(e)}"
    failures, truths = [], {}
    for variant in variants:
        schedule = variant.split(" ")[-1]
        report, hlo = [], None
        try:
            if variant.startswith("overlap("):
                ov = commfuse.overlap(jax.grad(loss, argnums=argnums), schedule=schedule)
                got = ov(*args)
                ref = want_grad
            elif variant.startswith("grad("):
                ov = commfuse.overlap(loss, schedule=schedule)
                got = jax.jit(jax.grad(ov, argnums=argnums))(*args)
                ref = want_grad
            else:
                ov = commfuse.overlap(fn, schedule=schedule)
                if prog.mode == "jit":
                    compiled = jax.jit(ov).lower(*args).compile()
                    hlo = compiled.as_text()
                    got = compiled(*args)
                else:
                    got = ov(*args)
                ref = want
            got = jax.block_until_ready(got)
            report = list(ov.last_report)
        except Exception as e:  # noqa: BLE001
            kind = "exception" if _through_commfuse(e) else "exception (not through commfuse)"
            failures.append(Failure(prog.seed, variant, kind, _exc_line(e)))
            continue
        bad = _compare(got, ref, tol)
        if bad:
            try:
                key = ref is want_grad
                if key not in truths:
                    truths[key] = _truth(prog, key)
                truth = truths[key]
                bad = _compare(got, ref, tol, truth)
            except Exception as e:  # noqa: BLE001 - no float64 run: judge without it
                bad += f" (no float64 reference: {type(e).__name__})"
        if bad:
            failures.append(Failure(prog.seed, variant, "mismatch", bad, report))
        failures.extend(_report_failures(prog, variant, report))
        # every deliberately built pair fused (forward programs; grad(overlap) rewrites the forward trace)
        if prog.expect and not variant.startswith("overlap("):
            if prog.mode == "jit":
                if hlo is not None:
                    n = hlo.count(HLO_TARGET)
                    if n < prog.expect:
                        parts = [line for line in report if "partitioned" in line]
                        failures.append(Failure(prog.seed, variant, "unfused",
                                                f"{n} fused ops in the compiled HLO, expected >= {prog.expect}: "
                                                + "; ".join(p.split("]: ", 1)[-1] for p in parts)[:300], report))
            else:
                n = _fused_lines(report)
                if n < prog.expect:
                    failures.append(Failure(prog.seed, variant, "unfused",
                                            f"{n} rewrites, expected >= {prog.expect}: {_unfused_detail(report)}",
                                            report))
    return failures, None


def run_seed(seed: int, **kw) -> tuple[Program, list, str | None]:
    prog = build(generate(seed))
    failures, invalid = check(prog, **kw)
    return prog, failures, invalid


# ----------------------------------------------------------------------------
# Shrinking
# ----------------------------------------------------------------------------
def _still(prog: Program, signature: str, variants) -> bool:
    try:
        build(prog)
        failures, invalid = check(prog, variants=variants)
    except Exception:  # noqa: BLE001
        return False
    return invalid is None and any(f.signature == signature for f in failures)


def shrink(prog: Program, failure: Failure, *, budget: int = 40) -> Program:
    """A smaller program (fewer ops, inlined control flow) failing with the same signature."""
    sig, variants = failure.signature, (failure.variant,)
    best, tries = prog, 0

    def candidates(specs):
        for i in range(len(specs)):
            yield specs[:i] + specs[i + 1:]
        for i, s in enumerate(specs):
            if s["op"] in ("scan", "remat", "cond"):
                yield specs[:i] + list(s["body"]) + specs[i + 1:]
                for j in range(len(s["body"])):
                    inner = dict(s, body=s["body"][:j] + s["body"][j + 1:])
                    yield specs[:i] + [inner] + specs[i + 1:]
                if s["op"] == "scan" and s.get("length", 1) > 1:
                    yield specs[:i] + [dict(s, length=1)] + specs[i + 1:]

    changed = True
    while changed and tries < budget:
        changed = False
        for specs in candidates(best.specs):
            tries += 1
            if tries > budget:
                break
            cand = best.with_specs(specs)
            if _still(cand, sig, variants):
                best, changed = cand, True
                break
        if not changed and best.outer_dot and tries < budget:
            cand = best.with_specs(best.specs, outer_dot=False)
            tries += 1
            if _still(cand, sig, variants):
                best, changed = cand, True
    build(best)
    return best
