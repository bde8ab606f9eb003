"""The logical axes of a step's arguments, and the mesh shardings a layout's
rules give them.

Where the framework carries names (Flax Linen's ``nn.with_logical_partitioning``
boxes, kept through optax's state; an NNX ``State``'s sharding metadata,
``nnx.with_partitioning``), they are read (`names_of`); elsewhere
each parameter's dims are named by how the step's dots use it (`infer`): a
weight that a dot contracts along the model dim and whose result feeds
attention's batched products or widens the model dim is column-parallel
(``("embed", "mlp")``), one whose product returns to the model dim is
row-parallel (``("mlp", "embed")``), an embedding table gathered by token
ids is ``("vocab", "embed")``, a head projecting to the vocabulary
``("embed", "vocab")``, an expert dim a dot batches over ``"expert"``, a
stacked leading dim a scan slices ``"layers"``. The batch argument's leading
dim is ``"batch"``; optimizer state takes the names of the parameter it
mirrors (the same path suffix and shape).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend import core as jcore

from .hooks import mesh_spec

# Logical names the rules give mesh axes; anything else is replicated.
PARAM_TENSOR = ("mlp", "heads", "kv", "vocab")      # sharded over the tensor axis (column or row parallel)
ACT_TENSOR = ("act_mlp", "act_heads", "act_kv", "act_vocab")


@dataclass(frozen=True)
class Names:
    """One flat argument leaf's logical names (one per dim, None: no name)
    and where they came from ("flax", "inferred", "mirrored", "batch", "none")."""
    names: tuple
    source: str


def _is_box(x) -> bool:
    return type(x).__name__ in ("LogicallyPartitioned", "Partitioned") and hasattr(x, "names") and hasattr(x, "value")


def leaves_with_names(args) -> tuple[list, list, object]:
    """(flat leaves, their Flax names or None, treedef) of the tuple `args`,
    flattened as ``jax.jit`` flattens them: Linen's boxes (each holds one
    leaf) and NNX states' sharding metadata read."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    names = []
    for arg in args:
        names.extend(_flax_names(arg))
    if len(names) != len(leaves):  # a box holding several leaves: names unknown
        names = [None] * len(leaves)
    return leaves, names, treedef


def _flax_names(arg) -> list:
    """Each leaf's logical names in one argument, as Flax carries them (None: none)."""
    nnx = _nnx()
    if nnx is not None and isinstance(arg, nnx.State):
        specs = jax.tree_util.tree_leaves(nnx.get_partition_spec(arg),
                                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        return [tuple(spec) if len(spec) else None for spec in specs]
    names = []
    for item in jax.tree_util.tree_flatten(arg, is_leaf=_is_box)[0]:
        if _is_box(item):
            names.extend([tuple(item.names)] * len(jax.tree_util.tree_leaves(item)))
        else:
            names.append(None)
    return names


def _nnx():
    try:
        from flax import nnx
    except ImportError:  # Flax is optional
        return None
    return nnx


def names_of(step, args, *, batch_argnums=(-1,)) -> list[Names]:
    """Every flat leaf's logical names: Flax's where it carries them, else
    inferred from the step's dots (see the module's doc)."""
    leaves, flax_names, treedef = leaves_with_names(args)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    n_args = len(args)
    batch_positions = {a % n_args for a in batch_argnums}
    arg_of = [_arg_index(path) for path in paths]
    result: list = [None] * len(leaves)
    for j, (leaf, names) in enumerate(zip(leaves, flax_names)):
        if names is not None:
            result[j] = Names(tuple(names), "flax")
        elif arg_of[j] in batch_positions and np.ndim(leaf) >= 1:
            result[j] = Names(("batch",) + (None,) * (np.ndim(leaf) - 1), "batch")
    missing = [j for j, r in enumerate(result) if r is None and np.ndim(leaves[j]) >= 1]
    if missing:
        inferred = infer(step, args, leaves, set(missing))
        named = {j: Names(tuple(n), "flax") for j, n in enumerate(flax_names) if n is not None}
        named.update({j: Names(n, "inferred") for j, n in inferred.items()})
        for j in missing:
            # Optimizer state mirrors the parameters before it: the same
            # path suffix and shape, in an earlier argument.
            earlier = {i: n for i, n in named.items() if arg_of[i] < arg_of[j]}
            twin = _mirror(paths, leaves, j, earlier)
            if twin is not None:
                result[j] = Names(named[twin].names, "mirrored")
            elif j in inferred:
                result[j] = Names(inferred[j], "inferred")
    return [r if r is not None else Names((None,) * np.ndim(leaf), "none") for r, leaf in zip(result, leaves)]


def _arg_index(path) -> int:
    return path[0].idx if path and hasattr(path[0], "idx") else 0


def _mirror(paths, leaves, j, named: dict):
    """The named leaf whose path is the longest suffix of leaf `j`'s, with its shape."""
    mine = [str(k) for k in paths[j]]
    best, best_len = None, 0
    for i, _ in named.items():
        if np.shape(leaves[i]) != np.shape(leaves[j]):
            continue
        theirs = [str(k) for k in paths[i]]
        n = 0
        while n < min(len(mine), len(theirs)) and mine[-1 - n] == theirs[-1 - n]:
            n += 1
        if n > best_len:
            best, best_len = i, n
    return best


# ----------------------------------------------------------------------------
# Inference from the dots
# ----------------------------------------------------------------------------
_FOLLOW = frozenset(("convert_element_type", "copy", "pvary", "reduce_precision", "optimization_barrier"))
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr")


@dataclass
class _Use:
    """How a dot uses a value: its dims contracted, batched, and kept, and
    whether its result flows into attention's batched products."""
    contracted: tuple
    batched: tuple
    kept: tuple
    out_shape: tuple
    other_shape: tuple
    after_attention: bool = False  # its other operand comes out of attention


def infer(step, args, leaves, wanted: set) -> dict:
    """Names of the flat leaves in `wanted` (indices), from how the step's
    jaxpr uses them; leaves it cannot name are left out."""
    try:
        closed = jax.make_jaxpr(step)(*args)
    except Exception:  # noqa: BLE001 - a step that cannot be traced here: nothing inferred
        return {}
    jaxpr = closed.jaxpr
    tracker = _Tracker()
    for j, var in enumerate(jaxpr.invars):
        if j in wanted:
            tracker.track(var, j, stacked=0)
    tracker.walk(jaxpr)
    d_model = _model_dim(tracker, leaves, wanted)
    names = {}
    for j in wanted:
        inferred = _name(tracker.uses.get(j, []), tracker.gathered.get(j, False), tracker.stacked.get(j, 0),
                         np.shape(leaves[j]), d_model, tracker.vocab)
        if inferred is not None:
            names[j] = inferred
    return names


class _Tracker:
    """Follows each wanted leaf through casts, scans (a sliced leading dim
    is "layers") and calls to the dots and gathers that read it, and which
    activations come out of attention (a batched product of two
    activations) without passing a weight since."""

    def __init__(self):
        self.origin: dict = {}        # var -> (leaf index, stacked leading dims sliced off)
        self.uses: dict = defaultdict(list)
        self.gathered: dict = {}
        self.stacked: dict = {}
        self.attention: set = set()   # vars computed from attention's products
        self.vocab = None

    def track(self, var, leaf: int, stacked: int):
        self.origin[var] = (leaf, stacked)
        self.stacked[leaf] = max(self.stacked.get(leaf, 0), stacked)

    def walk(self, jaxpr):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            live = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
            ins = [self.origin.get(v) if not isinstance(v, jcore.Literal) else None for v in eqn.invars]
            from_attention = any(v in self.attention for v in live)
            if name == "dot_general":
                self._dot(eqn, ins)
                (_, _), (lb, _) = eqn.params["dimension_numbers"]
                if all(origin is None for origin in ins) and (lb or from_attention):
                    self.attention.update(eqn.outvars)
                continue
            if name == "gather" and ins[0] is not None:
                self.gathered[ins[0][0]] = True
                self.vocab = eqn.invars[0].aval.shape[ins[0][1]]
            elif name in _FOLLOW and ins and ins[0] is not None:
                self.track(eqn.outvars[0], *ins[0])
            elif name == "scan":
                self._enter(eqn.params["jaxpr"].jaxpr, eqn, ins, eqn.params.get("num_consts", 0) +
                            eqn.params.get("num_carry", 0))
                continue
            elif name in _CALLS or name.startswith("custom_"):
                sub = _sub(eqn)
                if sub is not None:
                    self._enter(sub, eqn, ins, None)
                    continue
            if from_attention:
                self.attention.update(eqn.outvars)

    def _enter(self, body, eqn, ins, sliced_from):
        """Walks a scan's or a call's body, its inputs tracked as the
        equation's (a scan's xs with one more stacked dim: `sliced_from` on)."""
        for k, (v, outer, origin) in enumerate(zip(body.invars, eqn.invars, ins)):
            if not isinstance(outer, jcore.Literal) and outer in self.attention:
                self.attention.add(v)
            if origin is not None:
                leaf, stacked = origin
                self.track(v, leaf, stacked + (1 if sliced_from is not None and k >= sliced_from else 0))
        self.walk(body)

    def _dot(self, eqn, ins):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        for side, origin in enumerate(ins):
            if origin is None:
                continue
            leaf, _ = origin
            shape = eqn.invars[side].aval.shape
            contracted, batched = (lc, lb) if side == 0 else (rc, rb)
            kept = tuple(d for d in range(len(shape)) if d not in contracted and d not in batched)
            other = eqn.invars[1 - side]
            after = not isinstance(other, jcore.Literal) and other in self.attention
            self.uses[leaf].append(_Use(tuple(contracted), tuple(batched), kept, eqn.outvars[0].aval.shape,
                                        other.aval.shape, after))


def _sub(eqn):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return getattr(sub, "jaxpr", sub)
    return None


def _model_dim(tracker: _Tracker, leaves, wanted: set):
    """The model (residual stream) dim: the embedding table's last dim if
    one is gathered, else the most common dim among the 2-D weights."""
    for j, gathered in tracker.gathered.items():
        if gathered:
            return np.shape(leaves[j])[-1]
    sizes = Counter()
    for j in wanted:
        shape = np.shape(leaves[j])[tracker.stacked.get(j, 0):]
        if len(shape) >= 2:
            sizes.update(shape)
    return sizes.most_common(1)[0][0] if sizes else None


def _name(uses, gathered: bool, stacked: int, shape, d_model, vocab):
    """One leaf's names from its uses, or None."""
    lead = ("layers",) * stacked
    own = tuple(shape[stacked:])
    if gathered and len(own) == 2:
        return lead + ("vocab", "embed")
    if len(own) == 1:
        return lead + ("norm",)
    if not uses or len(own) < 2:
        return None
    use = uses[0]
    if len(own) == 2 and not use.batched and len(use.contracted) == 1 and len(use.kept) == 1:
        k_dim, n_dim = use.contracted[0], use.kept[0]
        k, n = own[k_dim], own[n_dim]
        names = [None, None]
        if vocab is not None and n == vocab and k == d_model:
            names[k_dim], names[n_dim] = "embed", "vocab"
        elif k == d_model and n != d_model:
            names[k_dim], names[n_dim] = "embed", "mlp"
        elif n == d_model and k != d_model:
            names[k_dim], names[n_dim] = "mlp", "embed"
        elif k == d_model and n == d_model:
            # A square projection (attention's, where heads x head_dim is the
            # model dim): column-parallel into attention, row-parallel out of it.
            names[k_dim], names[n_dim] = ("mlp", "embed") if use.after_attention else ("embed", "mlp")
        else:
            return None
        return lead + tuple(names)
    if len(own) == 3 and len(use.batched) == 1 and len(use.contracted) == 1:
        names = [None, None, None]
        e, k_dim = use.batched[0], use.contracted[0]
        kept = [d for d in range(3) if d not in (e, k_dim)][0]
        names[e] = "expert"
        names[k_dim] = "embed" if own[k_dim] == d_model else "mlp"
        names[kept] = "mlp" if names[k_dim] == "embed" else "embed"
        return lead + tuple(names)
    return None


# ----------------------------------------------------------------------------
# Shardings
# ----------------------------------------------------------------------------
def sharding_specs(names: list[Names], leaves, rules, mesh_sizes: dict) -> list:
    """Each leaf's PartitionSpec under `rules`, a dim whose size does not
    divide over its mesh axes left unsharded."""
    specs = []
    for n, leaf in zip(names, leaves):
        spec = list(mesh_spec(n.names, rules))
        shape = np.shape(leaf)
        for d, entry in enumerate(spec):
            axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
            if axes and shape[d] % math.prod(mesh_sizes[a] for a in axes):
                spec[d] = None
        specs.append(jax.sharding.PartitionSpec(*spec))
    return specs
