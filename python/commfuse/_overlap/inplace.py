"""In-place updates of a function's arguments, carried through ``overlap``.

``overlap(fun)`` traces ``fun`` on copies of its arguments (a pytree is
rebuilt from its leaves), so what ``fun`` does to mutable objects among them
— a Flax NNX module's or optimizer's Variables (``opt.update(model, grads)``),
an ``nnx.Rngs`` advancing, a dict or list updated in place — happens to the
copies. Those updates are found after the trace (the copies' leaves compared
with the ones they were built from), returned from the traced program as
extra outputs, and written back into the caller's own objects along the same
key paths. What cannot be written back (a changed structure, a static leaf, an
immutable container) is a trace-time error naming the argument's path, never
a silent drop. ``jax.Ref`` arguments need none of this: their updates are
equations of the traced program itself."""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.tree_util import DictKey, GetAttrKey, SequenceKey, keystr


class InPlaceUpdateError(TypeError):
    """``fun`` changed its arguments in a way ``overlap`` cannot carry out."""


@dataclass(frozen=True)
class Updates:
    """Which argument leaves ``fun`` replaced in place (flat indices into
    the ``(args, kwargs)`` leaves), in the order their new values are
    returned after ``fun``'s own outputs."""
    indices: tuple = ()


def _where(path) -> str:
    """A key path of ``(args, kwargs)`` as the caller wrote it: ``args[0].w``, ``kwargs['opt']``."""
    if not path:
        return "the arguments"
    head, rest = path[0], path[1:]
    if isinstance(head, SequenceKey) and head.idx == 1 and rest and isinstance(rest[0], DictKey):
        return f"argument {rest[0].key!r}{keystr(tuple(rest[1:]))}"
    if isinstance(head, SequenceKey) and head.idx == 0 and rest and isinstance(rest[0], SequenceKey):
        return f"args[{rest[0].idx}]{keystr(tuple(rest[1:]))}"
    return keystr(tuple(path))


def find(treedef, before: list, traced_args, is_dynamic) -> tuple[Updates, list]:
    """The in-place updates ``fun`` made to ``traced_args`` (the ``(args,
    kwargs)`` rebuilt from the leaves `before`): the `Updates` and the new
    leaves. Raises `InPlaceUpdateError` for what cannot be carried back."""
    with_paths, after_tree = jax.tree_util.tree_flatten_with_path(traced_args)
    if after_tree != treedef:
        raise InPlaceUpdateError(_structure_message(treedef, before, with_paths))
    indices, leaves = [], []
    for j, ((path, new), old) in enumerate(zip(with_paths, before)):
        if new is old:
            continue
        if not is_dynamic(old) or not is_dynamic(new):
            if _same_static(old, new):
                continue
            raise InPlaceUpdateError(
                f"commfuse.overlap: the function changed {_where(path)} in place from {old!r} to {new!r}; only "
                "array values can be carried out of the traced program (return the new value instead)")
        indices.append(j)
        leaves.append(new)
    return Updates(tuple(indices)), leaves


def _same_static(old, new) -> bool:
    try:
        return bool(old == new)
    except Exception:  # noqa: BLE001 - incomparable: treat as changed
        return False


def _structure_message(treedef, before, with_paths_after) -> str:
    paths_before = {_where(p) for p, _ in
                    jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, before))[0]}
    paths_after = {_where(p) for p, _ in with_paths_after}
    added, removed = sorted(paths_after - paths_before), sorted(paths_before - paths_after)
    what = "; ".join(part for part in (f"added {added[:4]}" if added else "", f"removed {removed[:4]}" if removed
                                       else "") if part) or "changed the containers' own structure"
    return (f"commfuse.overlap: the function changed the structure of its arguments in place ({what}); overlap "
            "carries in-place updates of array values (Flax NNX Variables, dict and list entries) but not new or "
            "removed attributes or entries: return the new structure instead")


def alias_groups(root, treedef) -> tuple:
    """Where the caller's arguments hold one mutable object at several places
    (a Variable tied between two modules, a dict reachable twice): per such
    object, one leaf index under each place. The traced copies are tied the
    same way (`tie`), so an update through one place is seen through the
    others, as it is without ``overlap``."""
    by_object: dict = {}
    for j, path in enumerate(_paths(root, treedef)):
        if len(path) < 2 or not all(isinstance(key, _WALKABLE) for key in path):
            continue  # a pytree node without key paths (one registered without keys) is never tied
        parent = _walk(root, path[:-1])
        if isinstance(parent, tuple):  # immutable: nothing can be updated through it
            continue
        places = by_object.setdefault(id(parent), {})
        places.setdefault(tuple(path[:-1]), j)
    return tuple(tuple(places.values()) for places in by_object.values() if len(places) > 1)


def tie(root, treedef, groups: tuple) -> tuple:
    """Makes the copies in `root` (``(args, kwargs)`` rebuilt from leaves)
    share what `alias_groups` found shared in the caller's arguments;
    returns `root`, its argument tuple rebuilt where one object is passed
    as two positional arguments."""
    if not groups:
        return root
    paths = _paths(root, treedef)
    args, kwargs = root
    for group in groups:
        first = _walk(root, paths[group[0]][:-1])
        for j in group[1:]:
            place = paths[j][:-1]
            if len(place) == 2 and place[0] == SequenceKey(0):  # one object passed as two positional arguments
                args = args[:place[1].idx] + (first,) + args[place[1].idx + 1:]
            else:
                _assign((args, kwargs), place, 0, first, write=True)
    return args, kwargs


_WALKABLE = (SequenceKey, DictKey, GetAttrKey)


def _walk(root, path):
    obj = root
    for key in path:
        obj = _child(obj, key, path)
    return obj


def check_writable(root, treedef, updates: Updates) -> None:
    """Raises `InPlaceUpdateError` if an update's path cannot be written in
    `root` (the caller's own ``(args, kwargs)``): checked before anything is
    written, so a failure leaves the caller's objects untouched."""
    paths = _paths(root, treedef)
    for j in updates.indices:
        _assign(root, paths[j], 0, None, write=False)


def write_back(root, treedef, updates: Updates, values: list) -> None:
    """Writes each updated leaf's new value into the caller's objects."""
    paths = _paths(root, treedef)
    for j, value in zip(updates.indices, values):
        _assign(root, paths[j], 0, value, write=True)


def _paths(root, treedef) -> list:
    with_paths, tree = jax.tree_util.tree_flatten_with_path(root)
    if tree != treedef:  # the caller changed its objects since the call began
        raise InPlaceUpdateError("commfuse.overlap: the arguments changed structure during the call")
    return [p for p, _ in with_paths]


_KEEP = object()  # `_assign`: the container was written in place


def _assign(obj, path, depth: int, value, *, write: bool):
    """Puts `value` at ``path[depth:]`` under `obj`. A mutable container
    (an object's attribute, a dict, a list) is written in place and `_KEEP`
    returned; an immutable one (a tuple, a namedtuple) is rebuilt and the new
    one returned, for its own parent to take in its place."""
    key = path[depth]
    if depth + 1 < len(path):
        child = _assign(_child(obj, key, path), path, depth + 1, value, write=write)
        if child is _KEEP:
            return _KEEP
    else:
        child = value
    if depth == 0:  # the (args, kwargs) tuple itself: nothing above it to write into
        raise InPlaceUpdateError(
            f"commfuse.overlap: the function updated {_where(path)} in place, inside immutable containers up to the "
            "argument itself; return the new value instead")
    if isinstance(key, SequenceKey) and isinstance(obj, list) \
            or isinstance(key, DictKey) and hasattr(obj, "__setitem__") \
            or isinstance(key, GetAttrKey) and not isinstance(obj, tuple) and not _frozen(obj):
        if write:
            _set(obj, key, child)
        return _KEEP
    if isinstance(key, SequenceKey) and type(obj) is tuple:
        return obj[:key.idx] + (child,) + obj[key.idx + 1:]
    if isinstance(key, GetAttrKey) and isinstance(obj, tuple) and hasattr(obj, "_replace"):
        return obj._replace(**{key.name: child})
    raise InPlaceUpdateError(
        f"commfuse.overlap: the function updated {_where(path)} in place, but a {type(obj).__name__} cannot be "
        "written into or rebuilt; return the new value instead")


def _frozen(obj) -> bool:
    params = getattr(type(obj), "__dataclass_params__", None)
    return bool(getattr(params, "frozen", False))


def _child(obj, key, path):
    if isinstance(key, SequenceKey):
        return obj[key.idx]
    if isinstance(key, DictKey):
        return obj[key.key]
    if isinstance(key, GetAttrKey):
        return getattr(obj, key.name)
    raise InPlaceUpdateError(
        f"commfuse.overlap: the function updated {_where(path)} in place, inside a {type(obj).__name__} whose "
        "children have no key path to write back along; return the new value instead")


def _set(obj, key, value) -> None:
    if isinstance(key, SequenceKey):
        obj[key.idx] = value
    elif isinstance(key, DictKey):
        obj[key.key] = value
    elif key.name == "value" and callable(getattr(obj, "set_value", None)):
        obj.set_value(value)  # Flax NNX Variables: their `.value` setter is deprecated
    else:
        setattr(obj, key.name, value)
