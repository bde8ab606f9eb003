"""What every fused op shares: the axis and mesh checks, dtype rules, and the
JAX primitive (abstract evaluation, lowering to the FFI target with the mesh's
device ids, batching). Each op's own rules live in its module."""

from __future__ import annotations

import itertools
import math
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from . import _native

SCHEDULES = {"auto": 0, "ring": 1, "bidirectional": 2, "sequential": 3}

# XLA PrimitiveType numbers of the dtypes the ops take.
DTYPE_CODES = {
    np.dtype(np.float32): 11,
    np.dtype(np.float64): 12,
    np.dtype(jnp.bfloat16): 16,
    np.dtype(np.float16): 10,
}

_sites = itertools.count(1)


def axis_group(op: str, axis_name) -> tuple[tuple[str, ...], int]:
    """The op's mesh axes and the group size; raises if not inside a shard_map over them."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names:
        raise ValueError(f"commfuse.{op}: axis_name must name at least one mesh axis")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        raise ValueError(
            f"commfuse.{op} must be called inside a jax.shard_map body (no manual mesh axes are in "
            f"scope here), with axis_name naming one of the shard_map's mesh axes")
    for name in names:
        if name not in mesh.axis_names:
            raise ValueError(f"commfuse.{op}: unknown axis_name {name!r}; the mesh axes are {mesh.axis_names}")
        if name not in mesh.manual_axes:
            raise ValueError(
                f"commfuse.{op}: axis_name {name!r} is not mapped by the enclosing jax.shard_map; call "
                f"the op inside a shard_map over it")
    automatic = [a for a in mesh.axis_names if a not in mesh.manual_axes]
    if automatic:
        raise ValueError(
            f"commfuse.{op} needs a jax.shard_map over every mesh axis, but axes {automatic} are left "
            f"automatic; pass axis_names covering all of {mesh.axis_names}")
    if len(set(names)) != len(names):
        raise ValueError(f"commfuse.{op}: axis_name {names} repeats an axis")
    return names, math.prod(mesh.shape[name] for name in names)


def normalize_dimension(op: str, arg: str, dimension, ndim: int) -> int:
    """A gather/scatter dim: any dim but the last (contracted or output column) one."""
    if not isinstance(dimension, (int, np.integer)) or isinstance(dimension, bool):
        raise TypeError(f"commfuse.{op}: {arg} must be an int, got {dimension!r}")
    d = int(dimension) + ndim if dimension < 0 else int(dimension)
    if not 0 <= d < ndim - 1:
        raise ValueError(
            f"commfuse.{op}: {arg}={dimension} is out of range: it must name a dim of the rank-{ndim} "
            f"array other than the last, i.e. be in [{-ndim}, {ndim - 1}) excluding -1")
    return d


def check_matmul_operands(op: str, x, w) -> None:
    if x.ndim < 2:
        raise ValueError(f"commfuse.{op}: `x` must have rank >= 2, got shape {x.shape}")
    if w.ndim != 2:
        raise ValueError(f"commfuse.{op}: `w` must be 2-D (rank 2), got shape {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"commfuse.{op}: `x` contracts its last dim ({x.shape[-1]}) with `w`'s first "
            f"({w.shape[0]}); they must be equal (x.shape={x.shape}, w.shape={w.shape})")


def promote(op: str, x, w, preferred_element_type):
    """Casts `x` and `w` to their common type as jnp.matmul does; returns them and the output dtype."""
    dtype = jnp.promote_types(x.dtype, w.dtype)
    if dtype not in DTYPE_CODES:
        raise TypeError(
            f"commfuse.{op}: unsupported dtype {dtype} (from x: {x.dtype}, w: {w.dtype}); expected "
            f"float32, bfloat16, float16 or float64")
    out = dtype if preferred_element_type is None else np.dtype(preferred_element_type)
    if out not in DTYPE_CODES:
        raise TypeError(
            f"commfuse.{op}: unsupported preferred_element_type dtype {out}; expected float32, "
            f"bfloat16, float16 or float64")
    return x.astype(dtype), w.astype(dtype), out


def check_schedule(op: str, schedule) -> int:
    if schedule not in SCHEDULES:
        raise ValueError(f"commfuse.{op}: unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
    return SCHEDULES[schedule]


def check_precision(op: str, precision) -> None:
    # The CPU backend always multiplies at full precision of the accumulator
    # type; the argument is checked and kept for parity with jnp.matmul.
    allowed = (None, "default", "high", "highest", "fastest", "bfloat16", "tensorfloat32", "float32")
    values = precision if isinstance(precision, tuple) else (precision,)
    for p in values:
        if not (p in allowed or isinstance(p, jax.lax.Precision)):
            raise ValueError(f"commfuse.{op}: unknown precision {p!r}")


class FusedPrimitive:
    """The JAX primitive of one fused op: ``(x, w) -> (out, workspace)``.

    The workspace result is scratch memory owned by XLA: the library never
    allocates on the hot path. ``rebind`` re-issues the op for the batching
    rule with x's batch dim folded into its leading dims.
    """

    def __init__(self, op: str, op_code: int, result_shape: Callable):
        self.op = op
        self.op_code = op_code
        # (x_shape, w_shape, dimension, ranks) -> the result's shape.
        self.result_shape = result_shape
        self.prim = Primitive(f"commfuse_{op}")
        self.prim.multiple_results = True
        self.prim.def_abstract_eval(self._abstract_eval)
        self.prim.def_impl(partial(_apply_primitive, self.prim))
        mlir.register_lowering(self.prim, self._lower_cpu, platform="cpu")
        for platform in ("cuda", "rocm"):
            mlir.register_lowering(self.prim, partial(self._lower_unsupported, platform), platform=platform)
        batching.primitive_batchers[self.prim] = self._batch

    def bind(self, x, w, *, out_dtype, dimension, schedule, axes, ranks):
        """Issues the op; returns (out, workspace)."""
        block_rows = math.prod(x.shape[:-1]) // (ranks if self.op_code == 1 else 1)
        workspace = _native.workspace_bytes(
            self.op_code, schedule, ranks, block_rows, w.shape[0], w.shape[1],
            DTYPE_CODES[np.dtype(x.dtype)], DTYPE_CODES[np.dtype(out_dtype)])
        return self.prim.bind(
            x, w, out_shape=tuple(self.result_shape(x.shape, w.shape, dimension, ranks)),
            out_dtype=np.dtype(out_dtype), dimension=dimension, schedule=schedule, axes=tuple(axes),
            ranks=ranks, workspace_bytes=workspace, site=next(_sites))

    def _abstract_eval(self, x, w, *, out_shape, out_dtype, workspace_bytes, axes, **_):
        # Typed as varying over the op's axes (and whatever x and w vary over),
        # so a custom_vjp or out_specs see the truth (see XLA_FFI_NOTES, point 3).
        # The workspace has x's rank, so it can share x's sharding.
        varying = _varying(x) | _varying(w) | frozenset(axes)
        workspace_shape = (1,) * (x.ndim - 1) + (workspace_bytes,)
        return (_typed_like(x, out_shape, out_dtype, varying),
                _typed_like(x, workspace_shape, np.dtype(np.uint8), varying))

    def _lower_cpu(self, ctx, x, w, *, site, schedule, dimension, axes, **_):
        mesh = _lowering_mesh(self.op, ctx)
        lowering = jax.ffi.ffi_lowering(_native.target_name(self.op, "cpu"))
        return lowering(
            ctx, x, w,
            site=int(site),
            schedule=int(schedule),
            dimension=int(dimension),
            mesh_devices=np.asarray(mesh.device_ids, np.int64).reshape(-1),
            mesh_shape=np.asarray(mesh.device_ids.shape, np.int64),
            axes=np.asarray([mesh.axis_names.index(a) for a in axes], np.int64),
        )

    def _lower_unsupported(self, platform, ctx, *args, **params):
        raise NotImplementedError(
            f"commfuse.{self.op} has no {platform.upper()} implementation in this build "
            f"(the library was built {'with' if _native.CUDA_BUILT else 'without'} the `cuda` feature, and "
            f"the CUDA backend is not available yet); run on CPU devices or use commfuse.reference.{self.op}")

    def _batch(self, args, dims, *, dimension, out_dtype, schedule, axes, ranks, workspace_bytes, **_):
        x, w = args
        x_dim, w_dim = dims
        if w_dim is not batching.not_mapped:
            raise NotImplementedError(
                f"vmap of commfuse.{self.op} over `w` is not supported: only `x` may carry a batch "
                f"dimension (it is folded into x's leading dims). Map over x only, or loop over the "
                f"weights with lax.map.")
        x = jnp.moveaxis(x, x_dim, 0)
        out, workspace = self.bind(x, w, out_dtype=out_dtype, dimension=dimension + 1, schedule=schedule,
                                   axes=axes, ranks=ranks)
        # The batched call's workspace is at least as large; the unbatched
        # result type only needs its first bytes (nobody reads them).
        return (out, workspace[..., :workspace_bytes].reshape((1,) * (x.ndim - 2) + (workspace_bytes,))), \
            (0, batching.not_mapped)


def _varying(aval) -> frozenset:
    """The mesh axes an abstract value varies over (the field moved across JAX versions)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _typed_like(aval, shape, dtype, varying):
    """`aval` with another shape and dtype (same rank), varying over `varying`."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False, manual_axis_type=mat.update(varying=varying))
    if hasattr(aval, "vma"):
        return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False, vma=varying)
    return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False)


def _apply_primitive(prim, *args, **params):
    from jax._src import dispatch  # eager mode only; inside jit the lowering is used

    return dispatch.apply_primitive(prim, *args, **params)


def _lowering_mesh(op: str, ctx):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None or getattr(mesh, "device_ids", None) is None:
        raise ValueError(
            f"commfuse.{op} must be lowered inside a jax.shard_map over a concrete mesh "
            f"(found axis context {type(ctx.module_context.axis_context).__name__})")
    return mesh
