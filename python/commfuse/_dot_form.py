"""A ``dot_general`` seen as the fused ops' ``x [..., k] @ w [k, n]``: which
operand is the activation, the transposes and flattening that make it so,
and how the product's dims map back. Shared by ``commfuse.matmul`` (any
``dot_general`` under jit, and its backward products) and ``overlap``'s
rewrite of shard_map bodies."""

from __future__ import annotations

import itertools
import math

import jax

from ._compat import typeof


class Unsupported(Exception):
    """This ``dot_general`` is not ``x @ w`` up to transposes and flattening."""


class DotForm:
    """A dot_general without batch dims, with operand ``x_side`` (0: lhs,
    1: rhs) as ``x``, seen as ``finish(prep_x(x) @ prep_w(w))``: ``prep_x``
    keeps x's free dims in order and flattens its contracting dims into one,
    last; ``prep_w`` makes ``w`` 2-D (its contracting dims flattened into
    rows, in the same order, then its free dims into columns); ``finish``
    unflattens the columns and puts the dims in the dot's output order. So
    weights of rank > 2 (``bsE,Ehd->bshd``) and several contracting dims
    (``bshd,hdE->bsE``) become the fused ops' ``x [..., k] @ w [k, n]``."""

    def __init__(self, lhs_shape, rhs_shape, dimension_numbers, x_side: int, precision=None,
                 preferred_element_type=None):
        (lc, rc), (lb, rb) = dimension_numbers
        if len(lb) or len(rb):
            raise Unsupported("dot_general has batch dimensions (each batch is its own product)")
        self.x_side = x_side
        xc, wc = (lc, rc) if x_side == 0 else (rc, lc)
        self.xc, self.wc = [int(d) for d in xc], [int(d) for d in wc]
        self.x_shape = tuple(lhs_shape if x_side == 0 else rhs_shape)
        self.w_shape = tuple(rhs_shape if x_side == 0 else lhs_shape)
        self.x_free = [d for d in range(len(self.x_shape)) if d not in self.xc]
        self.w_free = [d for d in range(len(self.w_shape)) if d not in self.wc]
        if not self.x_free:
            raise Unsupported(f"the dot's {'lhs' if x_side == 0 else 'rhs'} operand keeps no dimension")
        if not self.xc:
            raise Unsupported("dot_general contracts no dimension (an outer product)")
        prec = precision
        if x_side == 1 and isinstance(prec, tuple) and len(prec) == 2:
            prec = (prec[1], prec[0])
        self.kwargs = {"precision": prec, "preferred_element_type": preferred_element_type}

    @classmethod
    def of(cls, eqn, x_side: int) -> "DotForm":
        """The form of a ``dot_general`` equation."""
        lhs, rhs = eqn.invars
        return cls(lhs.aval.shape, rhs.aval.shape, eqn.params["dimension_numbers"], x_side,
                   eqn.params.get("precision"), eqn.params.get("preferred_element_type"))

    def x_dim(self, d: int):
        """A dim of ``x`` -> the same dim of ``prep_x(x)``; None if it does not survive as one dim."""
        if d in self.x_free:
            return self.x_free.index(d)
        if self.xc == [d]:
            return len(self.x_free)
        return None

    def w_dim(self, d: int):
        """A dim of ``w`` -> 0 (rows) or 1 (columns) of ``prep_w(w)`` when its
        blocks are contiguous blocks of that 2-D dim (it is the outermost dim
        of the rows or of the columns), else None."""
        if self.wc and d == self.wc[0]:
            return 0
        if self.w_free and d == self.w_free[0]:
            return 1
        return None

    def y_dim(self, d: int):
        """A dim of the dot's result -> the same dim of ``prep_x(x) @ prep_w(w)``,
        or None where the blocks along it are not contiguous there."""
        nx, nw = len(self.x_free), len(self.w_free)
        if self.x_side == 0:
            if d < nx:
                return d
            return nx if d == nx and nw else None
        if d < nw:
            return nx if d == 0 else None
        return d - nw

    def prep_x(self, x):
        """x laid out as ``[free.., k]``. Sizes are read off `x` itself: it may
        be the operand before its collective (a gathered dim still local)."""
        order = self.x_free + self.xc
        if order != list(range(len(self.x_shape))):
            x = jax.lax.transpose(x, tuple(order))
        if len(self.xc) == 1:
            return x
        nf = len(self.x_free)
        return _merged(x, [1] * nf + [len(self.xc)])

    def prep_w(self, w):
        """w laid out as ``[k, n]`` (sizes read off `w`, as for `prep_x`)."""
        order = self.wc + self.w_free
        if order != list(range(len(self.w_shape))):
            w = jax.lax.transpose(w, tuple(order))
        if w.ndim == 2:
            return w
        nc = len(self.wc)
        return _merged(w, [nc, w.ndim - nc])

    def check_mergeable(self, lhs, rhs) -> None:
        """Raises `Unsupported` where `prep_x` or `prep_w` would merge a
        sharded dim of an operand on explicit axes into the one before it
        (the 2-D product could not say how the merged dim is sharded)."""
        x, w = (lhs, rhs) if self.x_side == 0 else (rhs, lhs)
        for a, order, first in ((x, self.x_free + self.xc, len(self.x_free)), (w, self.wc + self.w_free, 0)):
            explicit = explicit_spec(a)
            if explicit is None:
                continue
            runs = [order[first:]] if a is x else [order[:len(self.wc)], order[len(self.wc):]]
            for run in runs:
                _merged_entry(explicit, run)

    def finish(self, y):
        nx = len(self.x_free)
        w_free_shape = tuple(self.w_shape[d] for d in self.w_free)
        if len(w_free_shape) != 1:
            # The columns' first dim takes what the collective made of them (an
            # all_to_all may have split or concatenated it); the others are w's.
            rest = w_free_shape[1:]
            first = y.shape[nx] // math.prod(rest) if rest else y.shape[nx]
            y = y.reshape(tuple(y.shape[:nx]) + (first,) + rest)
        if self.x_side == 1:  # the dot's output lists the rhs's (x's) free dims last
            nw = len(w_free_shape)
            y = jax.lax.transpose(y, tuple(range(nx, nx + nw)) + tuple(range(nx)))
        return y

    def notes(self) -> str:
        parts = []
        if self.x_free + self.xc != list(range(len(self.x_shape))):
            parts.append("x transposed")
        if len(self.xc) > 1:
            parts.append(f"{len(self.xc)} contracting dims flattened")
        if self.wc + self.w_free != list(range(len(self.w_shape))):
            parts.append("w transposed")
        if len(self.w_shape) != 2:
            parts.append(f"rank-{len(self.w_shape)} w flattened to 2-D")
        if self.x_side == 1:
            parts.append("operands swapped, result transposed")
        return f" [{', '.join(parts)}]" if parts else ""


def explicit_spec(a):
    """`a`'s sharding per dim where its type carries one (explicit mesh
    axes), else None (automatic axes: the partitioner decides later)."""
    spec = getattr(getattr(typeof(a), "sharding", None), "spec", None)
    if spec is None or all(entry is None for entry in spec):
        return None
    return tuple(spec) + (None,) * (a.ndim - len(spec))


class SummedForm:
    """Two dots whose results are summed, ``x1 @ w1 + x2 @ w2`` (each a
    `DotForm` with x the lhs and the same result layout), as one product:
    ``prep_x`` lays out ``(x1, x2)`` side by side along the contraction and
    ``prep_w`` stacks ``(w1, w2)`` along its rows, so one fused op's ring
    accumulates both (a LoRA adapter beside a row-parallel layer)."""

    def __init__(self, first: DotForm, second: DotForm):
        def layout(f):
            return (f.x_side, tuple(f.x_shape[d] for d in f.x_free), tuple(f.w_shape[d] for d in f.w_free),
                    f.kwargs["precision"], f.kwargs["preferred_element_type"])

        if first.x_side != 0 or second.x_side != 0:
            raise Unsupported("a sum of products is fused with each product's lhs as x")
        if layout(first) != layout(second):
            raise Unsupported("the summed products lay out their results differently (free dims, precision or "
                              "result type)")
        self.first, self.second = first, second
        self.x_side, self.kwargs = 0, dict(first.kwargs)

    def prep_x(self, xs):
        return jax.numpy.concatenate([self.first.prep_x(xs[0]), self.second.prep_x(xs[1])], axis=-1)

    def prep_w(self, ws):
        return jax.numpy.concatenate([self.first.prep_w(ws[0]), self.second.prep_w(ws[1])], axis=0)

    def y_dim(self, d: int):
        return self.first.y_dim(d)

    def finish(self, y):
        return self.first.finish(y)

    def notes(self) -> str:
        inner = [n.strip(" []") for n in (self.first.notes(), self.second.notes()) if n]
        return " [sum of 2 products: operands concatenated along the contraction" + \
            "".join(f"; {n}" for n in inner) + "]"


def _merged_entry(explicit: tuple, run):
    """The sharding of dims `run` of an operand sharded `explicit`, merged
    into one: its first dim's (row-major: the later dims vary fastest). A
    later dim that is sharded cannot be merged so: `Unsupported`."""
    if any(explicit[d] is not None for d in run[1:]):
        raise Unsupported(f"on explicit axes, a sharded dim of an operand sharded {explicit} would be merged into "
                          f"the one before it")
    return explicit[run[0]]


def _merged(a, groups):
    """`a` with each run of `groups[i]` consecutive dims merged into one; on
    explicit axes with each merged dim's sharding said (`_merged_entry`: JAX
    asks for it there; `DotForm.check_mergeable` refuses what it cannot
    say before anything is traced)."""
    runs, start = [], 0
    for count in groups:
        runs.append(range(start, start + count))
        start += count
    shape = tuple(math.prod(a.shape[d] for d in run) for run in runs)
    explicit = explicit_spec(a)
    if explicit is None:
        return a.reshape(shape)
    spec = jax.sharding.PartitionSpec(*(_merged_entry(explicit, run) for run in runs))
    return jax.lax.reshape(a, shape, out_sharding=jax.sharding.NamedSharding(typeof(a).sharding.mesh, spec))


class BatchedDot:
    """A ``dot_general`` with batch dims (a grouped matmul: experts, heads) as
    one product per batch index, each a batch-free ``dot_general`` (`form`).
    Its result is the products stacked, batch dims first (``dot_general``'s
    own output order). At most `MOST` products: each becomes a fused call."""

    MOST = 16

    def __init__(self, lhs_shape, rhs_shape, dimension_numbers, precision=None, preferred_element_type=None):
        (lc, rc), (lb, rb) = dimension_numbers
        if not len(lb):
            raise Unsupported("dot_general has no batch dimensions")
        self.lb, self.rb = [int(d) for d in lb], [int(d) for d in rb]
        self.batch_shape = tuple(int(lhs_shape[d]) for d in self.lb)
        self.count = math.prod(self.batch_shape)
        if self.count > self.MOST:
            raise Unsupported(f"dot_general has {self.count} batches (each batch is its own product); at most "
                              f"{self.MOST} are fused, one call each")
        self.lhs_map = _without(len(lhs_shape), self.lb)
        self.rhs_map = _without(len(rhs_shape), self.rb)
        self.sub_lhs_shape = tuple(n for d, n in enumerate(lhs_shape) if d not in self.lb)
        self.sub_rhs_shape = tuple(n for d, n in enumerate(rhs_shape) if d not in self.rb)
        self.sub_dims = ((tuple(self.lhs_map[int(d)] for d in lc), tuple(self.rhs_map[int(d)] for d in rc)), ((), ()))
        self.precision, self.preferred_element_type = precision, preferred_element_type

    @classmethod
    def of(cls, eqn) -> "BatchedDot":
        lhs, rhs = eqn.invars
        return cls(lhs.aval.shape, rhs.aval.shape, eqn.params["dimension_numbers"], eqn.params.get("precision"),
                   eqn.params.get("preferred_element_type"))

    def form(self, x_side: int) -> DotForm:
        """The form of each batch's product, with operand `x_side` as ``x``."""
        return DotForm(self.sub_lhs_shape, self.sub_rhs_shape, self.sub_dims, x_side, self.precision,
                       self.preferred_element_type)

    def indices(self):
        return itertools.product(*(range(n) for n in self.batch_shape))

    def take(self, side: int, operand, index):
        """Operand `side` (0: lhs, 1: rhs) at batch `index` (its batch dims dropped)."""
        dims = self.lb if side == 0 else self.rb
        for d, i in sorted(zip(dims, index), reverse=True):
            operand = jax.lax.index_in_dim(operand, i, axis=d, keepdims=False)
        return operand

    def operand_dim(self, side: int, d: int):
        """A dim of operand `side` -> the same dim of one batch's operand; None for a batch dim."""
        return (self.lhs_map if side == 0 else self.rhs_map).get(d)

    def batch_dim(self, side: int, d: int):
        """Which batch dim (0, 1, ...) dim `d` of operand `side` is, else None."""
        dims = self.lb if side == 0 else self.rb
        return dims.index(d) if d in dims else None

    def out_dim(self, d: int):
        """A dim of the dot's result -> the same dim of one batch's product; None for a batch dim."""
        nb = len(self.lb)
        return None if d < nb else d - nb

    def stack(self, products: list):
        """The products (in `indices` order) as the dot's result."""
        out = jax.numpy.stack(products)
        return out.reshape(self.batch_shape + tuple(products[0].shape))


def _without(ndim: int, removed) -> dict:
    """Each kept dim of a rank-`ndim` array -> its position once `removed` are dropped."""
    kept = [d for d in range(ndim) if d not in removed]
    return {d: i for i, d in enumerate(kept)}
