"""A reshape between a collective and its dot that only merges or splits
neighbouring dims, as code that flattens tokens writes it:

* ``all_gather(x, axis=1).reshape(b * s, d) @ w``: a sequence gather, then
  batch and sequence merged into rows. The dot is taken on the gathered
  operand before the merge (the sequence stays a dim of its own, which the
  fused op gathers), and the merge moves to the dot's result.
* ``psum_scatter((h @ w).reshape(b, s, d), scatter_dimension=1)``: the dot's
  rows split back into batch and sequence before a sequence scatter. The
  same split is made of the dot's operand, so the dot's result already has
  the scattered dim.

Both reshapes are free (row-major regroupings); the fused op sees a dot in
`DotForm`'s general form. Shapes only: the values are reshaped by the caller.
"""

from __future__ import annotations

import math

from .._dot_form import Unsupported


def merged_groups(before, after) -> list | None:
    """For each dim of `after`, the consecutive dims of `before` it is made of,
    or None unless reshaping `before` to `after` only merges neighbouring dims."""
    before, after = tuple(before), tuple(after)
    groups, i = [], 0
    for size in after:
        group = [i] if i < len(before) else []
        i += 1
        while group and math.prod(before[d] for d in group) < size and i < len(before):
            group.append(i)
            i += 1
        if not group or math.prod(before[d] for d in group) != size:
            return None
        groups.append(tuple(group))
    return groups if i == len(before) else None


def _no_batch(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    if len(lb) or len(rb):
        raise Unsupported("a reshape between the collective and a grouped matmul")
    return [list(lc), list(rc)]


def _check_outer_parts(parts, bound: int) -> None:
    """A dim split into `parts` (heads x head_dim) keeps a mesh axis whole
    only where its outermost part divides by the axis size (`bound`: a
    multiple of every axis size): else the sharding XLA propagates to the
    parts can cut one axis over two dims (2 kv heads over a tensor axis of
    8: 2 x 4), which XLA pads and runs but JAX's partitioning rules cannot
    name by mesh axes, and the program would not compile."""
    if len(parts) > 1 and parts[0] % bound:
        raise Unsupported(f"regrouping would split a dim into {list(parts)}, whose outer part {parts[0]} does not "
                          f"divide by {bound} (the mesh axes' sizes)")


def unmerged_dot(lhs_shape, rhs_shape, dimension_numbers, befores, bound: int = 1):
    """The dot taken on the shapes its operands had before reshapes that
    merged their dims (`befores`: per operand, that shape, or None for one
    taken as it is): ``(lhs_shape, rhs_shape, dimension_numbers)``. Its
    result, reshaped row-major, is the dot's. Free dims may be merged in any
    way. A contracted dim merged on one side is contracted as its parts,
    the other side's dim split the same way (``x.reshape(-1, d).T @ dy``, a
    weight gradient over flattened rows: ``dy`` split back into batch and
    sequence); the caller reshapes each operand to the shape returned."""
    contracting = _no_batch(dimension_numbers)
    shapes = [tuple(lhs_shape), tuple(rhs_shape)]
    sources, groups = [], []
    for shape, before in zip(shapes, befores):
        found = [(d,) for d in range(len(shape))] if before is None else merged_groups(before, shape)
        if found is None:
            raise Unsupported(f"the reshape {tuple(before)} -> {shape} does not only merge dims")
        sources.append(shape if before is None else tuple(before))
        groups.append(found)
        for g in found:
            if g[0] != 0:  # the leading rows (batch x sequence) stay as they were regrouped
                _check_outer_parts([sources[-1][d] for d in g], bound)
    # Each source dim's sizes once split (a dim contracted with a merged one).
    parts = [{d: (size,) for d, size in enumerate(source)} for source in sources]
    for cl, cr in zip(*contracting):
        sides = [[sources[0][d] for d in groups[0][cl]], [sources[1][d] for d in groups[1][cr]]]
        if sides[0] == sides[1]:
            continue
        for one, other, c in ((0, 1, cl), (1, 0, cr)):
            if len(groups[one][c]) == 1 and math.prod(sides[other]) == sides[one][0]:
                parts[one][groups[one][c][0]] = tuple(sides[other])
                if groups[one][c][0] != 0:
                    _check_outer_parts(sides[other], bound)
                break
        else:
            raise Unsupported("the reshape merges a contracted dim")
    new_shapes, index = [], []
    for side in (0, 1):
        shape, at = [], {}
        for d in range(len(sources[side])):
            at[d] = list(range(len(shape), len(shape) + len(parts[side][d])))
            shape.extend(parts[side][d])
        new_shapes.append(tuple(shape))
        index.append(at)
    new = [[n for c in contracting[side] for d in groups[side][c] for n in index[side][d]] for side in (0, 1)]
    return new_shapes[0], new_shapes[1], ((tuple(new[0]), tuple(new[1])), ((), ()))


def split_dot(lhs_shape, rhs_shape, dimension_numbers, after, bound: int = 1):
    """The dot whose result is this dot's result reshaped to `after`, a
    reshape that only splits dims: each split dim of the result is split in
    the operand it comes from. ``(lhs_shape, rhs_shape, dimension_numbers)``.
    A weight's columns are split (``(h @ wk).reshape(b, s, kv, hd)``) only
    where the outer part divides by `bound` (`_check_outer_parts`)."""
    contracting = _no_batch(dimension_numbers)
    shapes = [tuple(lhs_shape), tuple(rhs_shape)]
    free = [[d for d in range(len(s)) if d not in c] for s, c in zip(shapes, contracting)]
    out = [shapes[side][d] for side in (0, 1) for d in free[side]]
    groups = merged_groups(after, out)
    if groups is None:
        raise Unsupported(f"the reshape {tuple(out)} -> {tuple(after)} does not only split dims")
    for g in groups[len(free[0]):]:
        _check_outer_parts([after[d] for d in g], bound)
    new_shapes, new_contracting, j = [], [], 0
    for side in (0, 1):
        shape, index = [], {}
        for d in range(len(shapes[side])):
            if d in contracting[side]:
                index[d] = len(shape)
                shape.append(shapes[side][d])
            else:
                shape.extend(after[g] for g in groups[j])
                j += 1
        new_shapes.append(tuple(shape))
        new_contracting.append(tuple(index[c] for c in contracting[side]))
    return new_shapes[0], new_shapes[1], ((new_contracting[0], new_contracting[1]), ((), ()))
