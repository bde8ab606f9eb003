"""What a model says so that `commfuse.plan` can change it: its blocks'
remat policy (`remat_policy`) and its activations' logical axes
(`constrain`). Both read the layout being traced (`Layout`, entered by the
planner and by `Plan.apply`); outside one they are what the model asked for
by default, so a model written with them runs unchanged without a plan.

Flax Linen models name their activations with ``nn.with_logical_constraint``
and their parameters with ``nn.with_logical_partitioning``; the planner sets
Flax's rules while it traces them. `constrain` is the same for code without
Flax.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import jax

# The remat policies the planner chooses among, cheapest in memory first.
REMAT_POLICIES = ("nothing", "dots", "everything")

_POLICIES = {
    # Every value is recomputed in the backward pass but the block's inputs.
    "nothing": jax.checkpoint_policies.nothing_saveable,
    # Products with weights are kept (attention's batched products are not:
    # they grow with the square of the sequence).
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Nothing is recomputed: what the block would keep without remat.
    "everything": jax.checkpoint_policies.everything_saveable,
}


@dataclass(frozen=True)
class Layout:
    """What the planner sets while a step is traced: the mesh, the logical
    axis rules (``((logical name, mesh axes or None), ...)``, Flax's form)
    and the blocks' remat policy (a name of `REMAT_POLICIES`, None: the
    model's own)."""
    mesh: object
    rules: tuple
    remat: str | None = None


_CURRENT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("commfuse_layout", default=None)


def current() -> Layout | None:
    """The layout being traced, or None outside the planner."""
    return _CURRENT.get()


@contextlib.contextmanager
def tracing(layout: Layout):
    """Traces under `layout`: its rules in Flax's context where Flax is
    installed (``nn.with_logical_constraint`` then resolves them), and the
    hooks of this module read it. JAX's caches of traced functions are
    cleared first (they are not keyed on the rules)."""
    # JAX caches the traces of jit, scan and checkpoint bodies by function
    # and argument types: a body traced under other rules (the same mesh,
    # another sharding of its activations) would be reused as it was.
    jax.clear_caches()
    token = _CURRENT.set(layout)
    try:
        with contextlib.ExitStack() as stack:
            flax_rules = _flax_rules_context(layout.rules)
            if flax_rules is not None:
                stack.enter_context(flax_rules)
            stack.enter_context(jax.set_mesh(layout.mesh))
            yield layout
    finally:
        _CURRENT.reset(token)


def _flax_rules_context(rules):
    try:
        import flax.linen as nn
    except ImportError:  # Flax is optional: `constrain` serves code without it
        return None
    return nn.logical_axis_rules(rules)


# What the planner learns of a step's remat by tracing it: how often a
# `remat_policy` was asked while a layout was traced, and the defaults of
# those asked under a layout that leaves the remat to the step.
_CONSULTED = [0]
_DEFAULTS: set = set()


def consultations() -> int:
    return _CONSULTED[0]


def defaults_seen(reset: bool = False) -> frozenset:
    """The defaults asked since the last reset (and reset them, with `reset`)."""
    seen = frozenset(_DEFAULTS)
    if reset:
        _DEFAULTS.clear()
    return seen


def remat_policy(default: str = "nothing"):
    """A ``jax.checkpoint`` policy (for ``jax.checkpoint(block, policy=...)``
    or ``nn.remat(Block, policy=...)``) that the planner can choose: while a
    plan's step is traced it is the plan's choice for the step's blocks,
    elsewhere `default`: ``"nothing"`` (recompute everything but the block's
    inputs), ``"dots"`` (keep products with weights) or ``"everything"``
    (recompute nothing)."""
    if default not in _POLICIES:
        raise ValueError(f"commfuse.remat_policy: default must be one of {REMAT_POLICIES}, got {default!r}")

    def policy(prim, *avals, **params):
        layout = _CURRENT.get()
        if layout is not None:
            _CONSULTED[0] += 1
            if layout.remat is None:
                _DEFAULTS.add(default)
        name = layout.remat if layout is not None and layout.remat is not None else default
        return _POLICIES[name](prim, *avals, **params)

    return policy


def constrain(x, names):
    """``x`` constrained to the sharding its logical axis `names` (one per
    dim, or None) map to under the layout being traced; ``x`` unchanged
    outside the planner. For code without Flax's ``nn.with_logical_constraint``."""
    layout = _CURRENT.get()
    if layout is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"commfuse.constrain: {len(names)} names for an array of rank {x.ndim}: {names}")
    spec = mesh_spec(names, layout.rules)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(layout.mesh, spec))


def mesh_spec(names, rules) -> jax.sharding.PartitionSpec:
    """The PartitionSpec logical `names` map to under `rules`, as Flax's
    ``nn.logical_to_mesh_axes`` maps them: rules in order of precedence,
    each giving its mesh axes to the dim of its name when that dim has none
    yet and no other dim took those axes (so ``batch -> (data, fsdp)``
    before ``embed -> fsdp`` leaves an activation's embed dim unsharded).
    ``(name, None)`` fixes a dim unsharded."""
    unassigned = object()
    result = [unassigned if isinstance(name, str) else None for name in names]
    used: set = set()
    for logical, axes in rules:
        if logical not in names:
            continue
        pos = list(names).index(logical)
        group = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        if result[pos] is unassigned and not used & set(group):
            result[pos] = None if not group else (group[0] if len(group) == 1 else group)
            used.update(group)
    return jax.sharding.PartitionSpec(*(None if r is unassigned else r for r in result))
