"""The JAX primitive every fused op binds: `bind` runs one library call
as its `Decision` says (made before, by `_decide`), with abstract
evaluation, lowering to the FFI target with the mesh's device ids, and
batching. The argument checks are in `_checks`, the varying-axes typing in
`_varying`, the unfused forms in `_unfused`, fp8 in `_fp8`; the ops'
shared wrapper (deciding, then binding; the VJP) in `_op`, each op's own
rules in its module."""

from __future__ import annotations

import itertools
import math
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from . import _abi, _compat, _native, _nccl_id
from ._checks import check_elements
from ._decision import NONE, Call, Decision, as_asked
from ._placement import ACROSS_PROCESSES, spanning_axes
from ._unfused import empty_result, result_varying, unfused
from ._varying import vma_checked

# The contract's tables live in `_abi`; the names used throughout the ops.
Kind = _abi.Kind
SCHEDULES = _abi.SCHEDULES
UNFUSED = _abi.UNFUSED
CUT_SCHEDULES = _abi.CUT_SCHEDULES
DTYPE_CODES = _abi.DTYPE_CODES
cut_schedule = _abi.cut_schedule
chunks_of = _abi.chunks_of
schedule_name = _abi.schedule_name

_sites = itertools.count(1)


# Layout helpers: the Rust kinds take canonical 2-D/3-D operands.

def rows_2d(a, dimension: int = 0):
    """`a` as a matrix whose rows run over `dimension` first (so its blocks along that dim are row blocks).
    Sizes spelled out: a reshape to -1 divides by the others, 0 for empty operands."""
    return jnp.moveaxis(a, dimension, 0).reshape(math.prod(a.shape[:-1]), a.shape[-1])


def unrows_2d(a, shape, dimension: int = 0):
    """Inverse of rows_2d for a result of `shape`."""
    moved = (shape[dimension],) + tuple(s for i, s in enumerate(shape) if i != dimension)
    return jnp.moveaxis(a.reshape(moved), 0, dimension)


def stack_blocks(a, dimension: int, ranks: int):
    """The `ranks` blocks of `a` along `dimension`, stacked first: [ranks, *block_shape]."""
    shape = a.shape
    split = shape[:dimension] + (ranks, shape[dimension] // ranks) + shape[dimension + 1:]
    return jnp.moveaxis(a.reshape(split), dimension, 0)


def concat_blocks(stacked, dimension: int):
    """Inverse of stack_blocks: concatenates stacked[i] along `dimension`."""
    ranks, block = stacked.shape[0], stacked.shape[1:]
    moved = jnp.moveaxis(stacked, 0, dimension)
    return moved.reshape(block[:dimension] + (ranks * block[dimension],) + block[dimension + 1:])


def common(a, b):
    """`a` and `b` in their promoted dtype (cotangents may differ from the primals)."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


def bind(decision: Decision, x, w, *, axes, scales=(), fast_f32: bool = True):
    """Runs one library call as `decision` says, on `x` and `w` (checked and
    laid out for its kind): the fused op, jax.lax's own collective and dot
    (`_abi.UNFUSED`), or zeros (`NONE`: nothing to multiply or move).
    `scales`: ``(x_scale, w_scale)`` with fp8 operands; `fast_f32`: float32
    GEMMs may use TF32 on GPUs."""
    call = decision.call
    if (tuple(x.shape), tuple(w.shape), np.dtype(x.dtype)) != (call.x, call.w, call.dtype):
        raise AssertionError(f"commfuse: a decision for {call.describe()} bound to operands x{list(x.shape)} "
                             f"w{list(w.shape)} ({np.dtype(x.dtype).name})")
    if decision.recut:
        # Slices are chunks of contiguous rows: a cut call on other rows
        # runs on x with the row dim leading.
        flat = Call.of(call.kind, call.ranks, 0, (math.prod(call.x[:-1]), call.x[-1]), call.w, call.dtype,
                       call.out_dtype)
        out = bind(as_asked(flat, decision.schedule, decision.why), rows_2d(x, call.dimension), w, axes=axes,
                   scales=scales, fast_f32=fast_f32)
        return unrows_2d(out, decision.out_shape, call.dimension)
    check_elements(call.op, "the result", decision.out_shape)
    if decision.schedule == NONE:
        # jax.lax's all_gather and psum_scatter lower no empty gathered or
        # scattered dim: zeros, with no communication (every rank has the
        # same shapes), as jax.lax's dot gives for an empty contraction.
        return empty_result(call.kind, x, w, decision.out_shape, call.out_dtype, axes)
    if decision.schedule == UNFUSED:
        return unfused(call.kind, x, w, out_dtype=call.out_dtype, axes=axes, ranks=call.ranks,
                       dimension=call.dimension, fast_f32=fast_f32)
    return _PRIMITIVE.bind(
        x, w, *scales, kind=Kind(call.kind), out_shape=tuple(decision.out_shape), out_dtype=call.out_dtype,
        dimension=call.dimension, schedule=decision.schedule, axes=tuple(axes), ranks=call.ranks,
        workspace=decision.workspace, site=next(_sites), fast_f32=bool(fast_f32))


def measure_call_overhead_s(n: int) -> float:
    """A fused call's fixed cost on `n` of this host's CPU devices: a
    reduce-scatter matmul too small for its compute or transfers to count,
    fused and as jax.lax's collective and dot (the fastest of 7 interleaved
    runs of 20 calls each), the difference (see `_decide.Machine.call_overhead_s`)."""
    import time

    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    devices = jax.local_devices(backend="cpu")
    if len(devices) < n:
        return 0.0
    mesh = Mesh(np.array(devices[:n]), ("i",))
    x = np.ones((8 * n, 8 * n), np.float32)
    w = np.ones((8 * n, 8), np.float32)

    def compiled(op):
        f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(None, "i"), P("i")), out_specs=P("i")))
        f(x, w).block_until_ready()
        return f

    def per_call(f):
        start = time.perf_counter()
        for _ in range(20):
            out = f(x, w)
        out.block_until_ready()
        return (time.perf_counter() - start) / 20

    # Each device's shards: x's columns and w's rows split over the n devices.
    ring = as_asked(Call.of(Kind.MATMUL_REDUCE_SCATTER, n, 0, (8 * n, 8), (8, 8), np.float32, np.float32),
                    SCHEDULES["ring"])
    fused = compiled(lambda a, b: bind(ring, a, b, axes=("i",)))
    plain = compiled(lambda a, b: jax.lax.psum_scatter(a @ b, "i", tiled=True))
    # Interleaved, the fastest of each: the least disturbed by other work on the host.
    times = [(per_call(fused), per_call(plain)) for _ in range(7)]
    return min(t for t, _ in times) - min(t for _, t in times)


def _abstract_eval(x, w, *scales, kind, out_shape, out_dtype, axes, **_):
    # Typed as varying over the op's axes (and whatever x and w vary over), so
    # that a custom_vjp and out_specs see the truth (a fused op's result is
    # not the same on every rank; an all-reduce's is, over its axes).
    operands = _compat.varying_axes(x) | _compat.varying_axes(w)
    varying = result_varying(kind, operands, axes) if vma_checked() else frozenset()
    return _compat.with_varying(x, out_shape, out_dtype, varying)


def _lower_cpu(ctx, x, w, *scales, kind, workspace, **params):
    if scales:  # fp8 traced where a GPU exists, lowered for CPU devices
        raise TypeError(
            f"commfuse ({kind.name.lower()}): fp8 operands need CUDA devices (sm_90+); this mesh is on CPU")
    spanning = sorted(set(params["axes"]) & spanning_axes(_lowering_mesh(kind, ctx)))
    if spanning:
        # Its peers are in other processes, which the CPU backend's transport
        # cannot reach: jax.lax's collective and dot (XLA's own collectives,
        # over gloo or MPI), said once per op and axes.
        _say_across_processes(kind, tuple(spanning))
        return mlir.lower_fun(partial(_unfused_call, kind=kind, **params), multiple_results=False)(ctx, x, w)
    return _lower_target(_native.CPU_TARGET, ctx, x, w, kind=kind, workspace_bytes=workspace[0], **params)


def _unfused_call(x, w, *, kind, out_dtype, axes, ranks, dimension, fast_f32, schedule, **_):
    return unfused(kind, x, w, out_dtype=out_dtype, axes=axes, ranks=ranks, dimension=dimension, fast_f32=fast_f32,
                   schedule=schedule)


_SAID: set = set()


def _say_across_processes(kind, axes: tuple) -> None:
    if (kind, axes) not in _SAID:
        _SAID.add((kind, axes))
        warnings.warn(f"commfuse ({kind.name.lower()}): {ACROSS_PROCESSES.format(axes=axes)}", stacklevel=2)


def _lower_cuda(ctx, x, w, *scales, kind, axes, fast_f32, workspace, **params):
    try:
        target = _native.cuda_target()
    except NotImplementedError as e:
        raise NotImplementedError(
            f"commfuse ({kind.name.lower()}) cannot run on CUDA here: {e}; run on CPU devices, or use "
            "commfuse.reference") from e
    # Groups spanning processes get their NCCL ids through the distributed
    # key-value store; nothing when the whole mesh is in this process.
    placement = _nccl_id.lowering_attributes(_lowering_mesh(kind, ctx), axes)
    extra = dict(placement, tf32=int(fast_f32))
    return _lower_target(target, ctx, x, w, *scales, kind=kind, axes=axes, extra=extra, workspace_bytes=workspace[1],
                         **params)


def _lower_target(target, ctx, x, w, *scales, kind, site, schedule, dimension, axes, workspace_bytes, extra=None,
                  **_):
    """The FFI call of `target`, with the same attributes on every platform.
    The call has a second result, its workspace (`workspace_bytes` for the
    platform being lowered): XLA allocates it with the call's buffers, and
    nothing else sees it. fp8 calls add the two scale operands and ask for
    `w` K-major (column-major [k, n], minor-to-major (0, 1)): cuBLASLt's fp8
    GEMMs take only operands contiguous along k; XLA does the transpose."""
    mesh = _lowering_mesh(kind, ctx)
    layouts = dict(operand_layouts=[None, (0, 1), None, None]) if scales else {}
    lowering = jax.ffi.ffi_lowering(target, **layouts)
    workspace = ctx.avals_out[0].update(shape=(workspace_bytes,), dtype=np.dtype(np.uint8), weak_type=False)
    ctx = ctx.replace(avals_out=[ctx.avals_out[0], workspace])
    attributes = dict(
        kind=int(kind),
        site=int(site),
        schedule=int(schedule),
        dimension=int(dimension),
        mesh_devices=np.asarray(mesh.device_ids, np.int64).reshape(-1),
        mesh_shape=np.asarray(mesh.device_ids.shape, np.int64),
        axes=np.asarray([mesh.axis_names.index(a) for a in axes], np.int64),
        **(extra or {}),
    )
    unknown = set(attributes) - set(_abi.ATTRIBUTES)
    if unknown:  # the contract (`abi::ATTRIBUTES`) names every attribute a handler reads
        raise AssertionError(f"commfuse: attributes {sorted(unknown)} are not in the library's contract")
    out, _ = lowering(ctx, x, w, *scales, **attributes)
    return [out]


def _lower_unsupported(platform, ctx, *args, kind, **params):
    raise NotImplementedError(
        f"commfuse ({kind.name.lower()}) has no {platform.upper()} implementation; run on CPU or CUDA "
        f"devices, or use commfuse.reference")


_NOT_MAPPED = _compat.NOT_MAPPED


def _batch(args, dims, *, kind, dimension, out_dtype, schedule, axes, ranks, fast_f32, **_):
    if len(args) != 2:
        raise NotImplementedError("vmap of commfuse ops with fp8 operands is not supported; fold the batch into "
                                  "x's leading dims")
    x, w = args
    x_dim, w_dim = dims
    if kind == Kind.MATMUL_ALL_REDUCE and w_dim is _NOT_MAPPED:
        # The batch joins x's rows: the same schedule on the larger call.
        x = jnp.moveaxis(x, x_dim, 0)
        flat = rows_2d(x)
        batched = Call.of(kind, ranks, 0, flat.shape, w.shape, x.dtype, out_dtype)
        out = bind(as_asked(batched, schedule, "decided for the call before vmap"), flat, w, axes=axes,
                   fast_f32=fast_f32)
        return out.reshape(x.shape[0], x.shape[1], w.shape[1]), 0
    if kind not in _abi.ROW_BLOCK_KINDS or w_dim is not _NOT_MAPPED:
        # No fused form batches this (`jax.jacrev` batches a backward op over
        # its cotangent, which may be `w`): jax.lax's collective and dot, batched.
        def one(x, w):
            return unfused(kind, x, w, out_dtype=out_dtype, axes=axes, ranks=ranks, dimension=dimension,
                           fast_f32=fast_f32, schedule=schedule)

        in_axes = tuple(None if d is _NOT_MAPPED else d for d in dims)
        return jax.vmap(one, in_axes=in_axes)(x, w), 0
    x = jnp.moveaxis(x, x_dim, 0)
    # The batch is a leading dim of x: the same schedule on the larger call.
    batched = Call.of(kind, ranks, dimension + 1, x.shape, w.shape, x.dtype, out_dtype)
    return bind(as_asked(batched, schedule, "decided for the call before vmap"), x, w, axes=axes,
                fast_f32=fast_f32), 0


def _apply_primitive(*args, **params):
    # Bound outside any trace: compile the one op, as JAX does for its own.
    return jax.jit(partial(_PRIMITIVE.bind, **params))(*args)


_PRIMITIVE = Primitive("commfuse_collective_matmul")
_PRIMITIVE.def_abstract_eval(_abstract_eval)
_PRIMITIVE.def_impl(_apply_primitive)
mlir.register_lowering(_PRIMITIVE, _lower_cpu, platform="cpu")
mlir.register_lowering(_PRIMITIVE, _lower_cuda, platform="cuda")
mlir.register_lowering(_PRIMITIVE, partial(_lower_unsupported, "rocm"), platform="rocm")
batching.primitive_batchers[_PRIMITIVE] = _batch


def _lowering_mesh(kind, ctx):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None or getattr(mesh, "device_ids", None) is None:
        raise ValueError(
            f"commfuse ({kind.name.lower()}) must be lowered inside a jax.shard_map over a concrete mesh "
            f"(found axis context {type(ctx.module_context.axis_context).__name__})")
    return mesh


def checkpoint_policy(policy):
    """``commfuse.checkpoint_policy(policy)``: a ``jax.checkpoint`` policy
    that saves a fused op's result wherever `policy` would save the dot it
    replaces. JAX's dot policies (``checkpoint_dots``,
    ``dots_with_no_batch_dims_saveable``, ...) know ``dot_general`` only,
    so under them a fused op would run again in the backward pass, its
    collective included. ``commfuse.overlap`` applies it to the
    ``jax.checkpoint``s it rewrites; wrap the policy yourself where fused ops
    are called by name inside ``jax.checkpoint``. ``None`` stays ``None``."""
    if policy is None:
        return None

    def saveable(prim, *args, **params):
        if _is_fused(prim, params):
            # The parameters a 2-D dot_general equation carries.
            return policy(jax.lax.dot_general_p, *args[:2], dimension_numbers=(((1,), (0,)), ((), ())),
                          precision=None, preferred_element_type=None, out_sharding=None)
        return policy(prim, *args, **params)

    return saveable


def _is_fused(prim, params) -> bool:
    """Whether a policy's equation is a fused op: the primitive, or the
    ``custom_vjp_call`` around one (the differentiable form `_op.differentiable` makes)."""
    if prim is _PRIMITIVE:
        return True
    if not prim.name.startswith("custom_vjp"):
        return False
    body = params.get("call_jaxpr", params.get("fun_jaxpr"))
    body = getattr(body, "jaxpr", body)
    if body is None:
        return False
    # One fused op and its layout (`_op.differentiable`'s form), not a user's function holding one among other work.
    names = [e.primitive.name for e in body.eqns]
    return sum(e.primitive is _PRIMITIVE for e in body.eqns) == 1 and "dot_general" not in names \
        and not any(n.startswith("custom_") or n in ("pjit", "jit", "while", "scan", "cond") for n in names)
