"""The JAX version differences commfuse meets, in one place.

Supported: jax 0.10.2 (what Python 3.11 gets) to 0.12.x (Python 3.12), both
tested in CI. Where a name moved between those versions, both spellings are
tried here and nowhere else. Public names only, but for what JAX keeps
private and commfuse needs: its distributed client (`distributed_client`)
and the classes of its forward-mode and batching tracers (`traced_by`).
"""

from __future__ import annotations

import contextlib

import jax
from jax._src import source_info_util  # what jax.core.eval_jaxpr keeps an equation's source in; nothing public
from jax._src.interpreters import partial_eval  # checkpoint policies' answers (`Recompute`); nothing public
from jax.interpreters import batching

# How batching rules mark an unbatched value.
NOT_MAPPED = getattr(batching, "not_mapped", None)


def traced_by(kind: str, *values) -> bool:
    """Whether any of `values` is traced, at any depth of its tracers, by
    forward-mode differentiation (``"jvp"``: ``jax.jvp``, ``jacfwd``,
    ``hessian``) or by ``jax.vmap`` (``"vmap"``). Reverse mode (``grad``,
    ``vjp``, ``linearize``) traces with other tracers. JAX has no public
    test for this: the tracer classes are its own."""
    from jax._src.interpreters import ad
    from jax._src.interpreters import batching as batching_src

    wanted = {"jvp": ad.JVPTracer, "vmap": batching_src.BatchTracer}[kind]
    for value in values:
        for _ in range(64):  # tracers wrap tracers: a handful deep at most
            if not isinstance(value, jax.core.Tracer):
                break
            if isinstance(value, wanted):
                return True
            value = getattr(value, "primal", getattr(value, "val", None))
    return False


def check_vma() -> bool:
    """Whether the enclosing shard_map tracks varying manual axes
    (``check_vma=True``, the default). Outside a shard_map: the global flag."""
    return bool(jax.config.check_vma)


def typeof(value):
    return jax.typeof(value)


def varying_axes(aval) -> frozenset:
    """The mesh axes an abstract value is typed as varying over (the field
    moved from ``vma`` to ``manual_axis_type.varying``)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and getattr(mat, "varying", None) is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def with_varying(aval, shape, dtype, varying):
    """`aval` with another shape and dtype, typed as varying over `varying`."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False,
                           manual_axis_type=mat.update(varying=varying))
    if hasattr(aval, "vma"):
        return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False, vma=varying)
    return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False)


def cast_varying(value, axes: tuple):
    """``value`` typed as varying over `axes` too (values unchanged)."""
    return jax.lax.pcast(value, tuple(axes), to="varying")


def scan_counts(params) -> tuple[int, int]:
    """(consts, carry) operand counts of a ``scan`` equation: jax 0.10 names
    them; from 0.11 ``ft_in`` holds the flat trees of (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts_tree, carry_tree, _ = params["ft_in"].unpack()
    return len(consts_tree), len(carry_tree)


def source_context(eqn):
    """The equation's source location and name stack (``jax.named_scope``)
    for what is traced in its place, as ``jax.core.eval_jaxpr`` keeps them:
    the rewritten program's HLO metadata and profiles name the user's
    scopes and lines."""
    info = eqn.source_info
    return source_info_util.user_context(info.traceback,
                                         name_stack=source_info_util.current_name_stack() + info.name_stack)


def policy_saves(decision) -> bool:
    """A ``jax.checkpoint`` policy's answer as "saved": policies answer a
    bool, or one of JAX's ``Saveable``, ``Recompute`` and ``Offloadable``
    (an object, so truthy, even for ``Recompute``)."""
    if isinstance(decision, bool):
        return decision
    return decision is not partial_eval.Recompute


def bind_eqn(eqn, invals) -> list:
    """Binds a jaxpr equation's primitive to `invals` with its own params, as
    ``jax.core.eval_jaxpr`` does (within the equation's context, e.g.
    ``compute_on``, where the equation has one); returns the list of outputs."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def auto_axes_scope():
    """A context in which the current abstract mesh's explicit axes are
    automatic. From jax 0.11 a ``custom_partitioning`` rule's lowering runs
    under the caller's abstract mesh: with explicit axes, the sharding
    constraints JAX adds to the per-device body reach the CPU backend, which
    has no implementation for them (``NOT_FOUND: ... custom call to
    Sharding``). The body works on shards, so its axes are automatic."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return contextlib.nullcontext()
    auto = jax.sharding.AxisType.Auto
    return jax.sharding.use_abstract_mesh(mesh.update_axis_types({a: auto for a in mesh.explicit_axes}))


def mesh_spec_of(sharding, mesh):
    """XLA's own sharding of an array (a ``GSPMDSharding``, as a
    ``custom_partitioning`` rule with ``decode_shardings=False`` gets it) as
    a PartitionSpec of `mesh`; raises where no PartitionSpec of the mesh
    expresses it. JAX's decoder (the one its rules use when they decode) is
    private: read here only, on every supported JAX by
    ``jax_tests/test_jit_programs.py``."""
    from jax._src import sharding_impls

    return sharding_impls.parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0]


def distributed_client():
    """The client of ``jax.distributed``'s key-value store (None before
    ``jax.distributed.initialize``). JAX has no public handle on it, and
    groups spanning processes exchange their NCCL ids through it
    (`_nccl_id`): the one private name commfuse reads, here only, checked
    on both JAX versions by ``jax_tests/test_gpu.py``'s two-process tests."""
    from jax._src import distributed

    return getattr(getattr(distributed, "global_state", None), "client", None)
