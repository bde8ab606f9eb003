"""What every fused op shares: the axis and mesh checks, dtype rules, and the
JAX primitive (abstract evaluation, lowering to the FFI target with the mesh's
device ids, batching). Each op's own rules live in its module."""

from __future__ import annotations

import functools
import itertools
import math
import threading
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from . import _abi, _auto, _compat, _native, _nccl_id

# The contract's tables live in `_abi`; the names used throughout the ops.
Kind = _abi.Kind
SCHEDULES = _abi.SCHEDULES
UNFUSED = _abi.UNFUSED
CUT_SCHEDULES = _abi.CUT_SCHEDULES
DTYPE_CODES = _abi.DTYPE_CODES
FP8_CODES = _abi.FP8_CODES
cut_schedule = _abi.cut_schedule
chunks_of = _abi.chunks_of
schedule_name = _abi.schedule_name
_FP8_RESULTS = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))

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
    if len(set(names)) != len(names):
        raise ValueError(f"commfuse.{op}: axis_name {names} repeats an axis")
    ranks = math.prod(mesh.shape[name] for name in names)
    if ranks > _abi.LIMITS["max_ranks"]:
        raise ValueError(
            f"commfuse.{op}: axis_name {names} spans {ranks} devices; the fused ops take at most "
            f"{_abi.LIMITS['max_ranks']}")
    return names, ranks


def normalize_dimension(op: str, arg: str, dimension, ndim: int, *, allow_last: bool = False) -> int:
    """A gather/scatter dim; the last (contracted or column) dim only if `allow_last`."""
    if not isinstance(dimension, (int, np.integer)) or isinstance(dimension, bool):
        raise TypeError(f"commfuse.{op}: {arg} must be an int, got {dimension!r}")
    d = int(dimension) + ndim if dimension < 0 else int(dimension)
    limit = ndim if allow_last else ndim - 1
    if not 0 <= d < limit:
        which = "any dim" if allow_last else "a dim other than the last"
        raise ValueError(
            f"commfuse.{op}: {arg}={dimension} is out of range: it must name {which} of the rank-{ndim} "
            f"array, i.e. be in [{-ndim}, {limit - ndim if limit < ndim else ndim})"
            f"{'' if allow_last else ' excluding -1'}")
    return d


def check_matmul_operands(op: str, x, w, *, x_factor: int = 1, w_factor: int = 1) -> None:
    """`x` (rank >= 2) contracts its last dim with 2-D `w`'s first; the factors
    say how the collective widens either side first (e.g. N for a gathered w)."""
    if x.ndim < 2:
        raise ValueError(f"commfuse.{op}: `x` must have rank >= 2, got shape {x.shape}")
    if w.ndim != 2:
        raise ValueError(f"commfuse.{op}: `w` must be 2-D (rank 2), got shape {w.shape}")
    check_elements(op, "x", x.shape)
    check_elements(op, "w", w.shape)
    xk, wk = x.shape[-1] * x_factor, w.shape[0] * w_factor
    if xk != wk:
        widened = (f" ({'N * ' if x_factor > 1 else ''}{x.shape[-1]} vs {'N * ' if w_factor > 1 else ''}{w.shape[0]}"
                   f" after the collective)" if x_factor > 1 or w_factor > 1 else "")
        raise ValueError(
            f"commfuse.{op}: `x` contracts its last dim ({xk}) with `w`'s first ({wk}){widened}; they must be "
            f"equal (x.shape={x.shape}, w.shape={w.shape})")


def check_elements(op: str, what: str, shape) -> None:
    """`shape` (of `what`) has few enough elements for the library (its
    bytes, in the widest accumulator, fit one allocation)."""
    most = _abi.LIMITS["max_elements"]
    if math.prod(shape) > most:
        raise ValueError(
            f"commfuse.{op}: {what} of shape {tuple(shape)} has {math.prod(shape)} elements; at most {most}")


def prepare(op: str, x, w, *, axes, ranks: int, dimension: int, schedule_code: int, precision,
            preferred_element_type):
    """The common tail of every op's checks: precision, dtype promotion, the
    operands' varying axes, and the static arguments of the fused call."""
    fast = fast_f32(op, precision)
    x, w, out_dtype = promote(op, x, w, preferred_element_type)
    x, w = vary_together(x, w, axes)
    return x, w, Static(tuple(axes), ranks, dimension, schedule_code, out_dtype, fast)


def promote(op: str, x, w, preferred_element_type):
    """Casts `x` and `w` to their common type as jnp.matmul does; returns them and the output dtype."""
    try:
        dtype = jnp.promote_types(x.dtype, w.dtype)
    except jax.dtypes.TypePromotionError as e:  # e.g. two fp8 formats
        raise TypeError(f"commfuse.{op}: unsupported dtype combination x: {x.dtype}, w: {w.dtype} ({e})") from e
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


def fp8_scales(op: str, x, w, x_scale, w_scale, preferred_element_type):
    """For fp8 operands: ``(x_scale, w_scale, out_dtype)`` checked; None for
    other operands (which take no scales). fp8 needs the CUDA backend: on a
    build or host without it this is a TypeError at trace time, rather than
    an upcast that would silently change the numerics asked for."""
    is_fp8 = [np.dtype(a.dtype) in FP8_CODES for a in (x, w)]
    if not any(is_fp8):
        for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
            if scale is not None:
                raise TypeError(
                    f"commfuse.{op}: `{name}` is for fp8 operands (float8_e4m3fn); x is {x.dtype} and w is "
                    f"{w.dtype}")
        return None
    if x.dtype != w.dtype:
        raise TypeError(
            f"commfuse.{op}: unsupported dtype combination x: {x.dtype}, w: {w.dtype}; fp8 operands must both "
            "be float8_e4m3fn")
    if np.dtype(x.dtype) == np.dtype(jnp.float8_e5m2):
        raise TypeError(
            f"commfuse.{op}: x and w are both float8_e5m2, for which cuBLASLt has no GEMM; use float8_e4m3fn")
    checked = []
    for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
        if scale is None:
            raise TypeError(
                f"commfuse.{op}: fp8 operands need `{name}`, a float32 scalar (the dequantisation factor: "
                "real value ~= fp8 value * scale)")
        weak = isinstance(scale, (int, float)) and not isinstance(scale, bool)  # a Python number
        if jnp.shape(scale) != () or not (weak or np.dtype(jnp.result_type(scale)) == np.dtype(np.float32)):
            raise TypeError(
                f"commfuse.{op}: `{name}` must be a float32 scalar (shape ()), got "
                f"{jnp.result_type(scale)} of shape {jnp.shape(scale)}")
        checked.append(jnp.asarray(scale, np.float32))
    out = np.dtype(jnp.bfloat16) if preferred_element_type is None else np.dtype(preferred_element_type)
    if out not in _FP8_RESULTS:
        raise TypeError(
            f"commfuse.{op}: with fp8 operands, preferred_element_type must be bfloat16 (the default), float16 "
            f"or float32; got {out}")
    _require_fp8_backend(op, x.dtype)
    return checked[0], checked[1], out


def _require_fp8_backend(op: str, dtype) -> None:
    """fp8 operands need the CUDA build and a GPU; TypeError naming `x` and `w` otherwise."""
    why = None
    if not _native.cuda_built():
        why = f"the library {_native.LIBRARY_PATH} was built without the `cuda` feature"
    else:
        try:
            has_gpu = bool(jax.devices("gpu"))
        except RuntimeError:
            has_gpu = False
        if not has_gpu:
            why = "JAX sees no GPU"
    if why is not None:
        raise TypeError(
            f"commfuse.{op}: `x` and `w` are {dtype}: fp8 operands need a CUDA build of commfuse and a GPU of "
            f"compute capability 9.0+ (sm_90), and {why}; on CPU, cast them yourself (e.g. to bfloat16, "
            "multiplied by their scales)")


def fp8_call(kind: "Kind", x, w, scales, *, axes, ranks: int, dimension: int, schedule: int):
    """One fused op on fp8 operands (checked by `fp8_scales`): forward only."""
    x_scale, w_scale, out_dtype = scales
    x, w = vary_together(x, w, axes)
    return _fp8_op(Kind(kind), x, w, x_scale, w_scale, Static(tuple(axes), ranks, dimension, schedule, out_dtype))


@partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _fp8_op(kind, x, w, x_scale, w_scale, static):
    return call(kind, x, w, out_dtype=static.out_dtype, schedule=static.schedule, axes=static.axes,
                ranks=static.ranks, dimension=static.dimension, scales=(x_scale, w_scale))


def _fp8_bwd(kind, static, residuals, dy):
    raise NotImplementedError(
        f"commfuse ({kind.name.lower()}): gradients of fp8 operands are not defined; differentiate through "
        "your own casts (e.g. quantise inside the function and pass the high-precision values to jax.grad "
        "with a straight-through estimator)")


_fp8_op.defvjp(lambda kind, x, w, xs, ws, static: (_fp8_op(kind, x, w, xs, ws, static), None), _fp8_bwd)


def vary_together(x, w, axes):
    """`x` and `w` typed as varying over the same mesh axes: both operands',
    and the op's. The fused ops' VJPs return cotangents of that type; JAX
    then transposes the cast itself (a psum over the axes an operand was
    replicated on), as it does for a plain dot_general. Under
    ``check_vma=False`` nothing is typed as varying, and the shard_map sums
    replicated operands' cotangents itself: the operands stay as they are."""
    if not vma_checked():
        return x, w
    target = _varying(jax.typeof(x)) | _varying(jax.typeof(w)) | frozenset(axes)
    return make_varying(x, target), make_varying(w, target)


def make_varying(a, axes):
    """`a` typed as varying over `axes` too (under ``check_vma=True``)."""
    mesh_axes = jax.sharding.get_abstract_mesh().axis_names
    missing = tuple(n for n in mesh_axes if n in frozenset(axes) - _varying(jax.typeof(a)))
    if not missing:
        return a
    return _compat.cast_varying(a, missing)


_ABSENT = object()


def check_schedule(op: str, schedule, slices=_ABSENT, tiles=_ABSENT) -> int:
    """The schedule's code. Ops that take ``slices`` and ``tiles`` (row
    gathers and scatters) pass them; the others reject "sliced" and "tiled"."""
    if schedule not in SCHEDULES:
        raise ValueError(f"commfuse.{op}: unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
    if slices is _ABSENT:
        if schedule in CUT_SCHEDULES:
            raise ValueError(
                f"commfuse.{op}: schedule={schedule!r} exists only for all_gather_matmul and matmul_reduce_scatter "
                f"along a row dimension; use one of {[s for s in SCHEDULES if s not in CUT_SCHEDULES]}")
        return SCHEDULES[schedule]
    most = _abi.LIMITS["max_chunks"]
    for name, value in (("slices", slices), ("tiles", tiles)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value <= most:
            raise ValueError(f"commfuse.{op}: {name} must be an int in [1, {most}], got {value!r}")
    if schedule == "sliced":
        return _abi.schedule_code(schedule, int(slices))
    if schedule == "tiled":
        return _abi.schedule_code(schedule, int(tiles))
    return SCHEDULES[schedule]


def _check_cut(kind: "Kind", x_shape, dimension: int, ranks: int, code: int) -> None:
    """A sliced or tiled call must be a row gather or scatter whose block rows divide into the chunks."""
    schedule = cut_schedule(code)
    if kind not in (Kind.ALL_GATHER_MATMUL, Kind.MATMUL_REDUCE_SCATTER):
        raise ValueError(
            f"commfuse ({kind.name.lower()}): schedule={schedule!r} exists only for all_gather_matmul and "
            f"matmul_reduce_scatter along a row dimension (not the last dim)")
    rows = math.prod(x_shape[:-1])
    if kind == Kind.MATMUL_REDUCE_SCATTER:
        rows //= ranks
    chunks, unit = chunks_of(code), CUT_SCHEDULES[schedule]
    op = "all_gather_matmul" if kind == Kind.ALL_GATHER_MATMUL else "matmul_reduce_scatter"
    if rows and chunks > rows:
        raise ValueError(
            f"commfuse.{op}: {unit}={chunks} is more than the {rows} rows of each rank's block (all dims of x but "
            f"the last, x.shape={tuple(x_shape)}); schedule={schedule!r} cuts those rows into {unit} chunks")
    if chunks * ranks > _abi.LIMITS["max_cut_blocks"]:
        raise ValueError(
            f"commfuse.{op}: {unit}={chunks} over an axis of {ranks} devices makes {chunks * ranks} blocks; "
            f"schedule={schedule!r} takes at most {_abi.LIMITS['max_cut_blocks']} ({unit} x axis size)")
    if rows % chunks:
        raise ValueError(
            f"commfuse.{op}: schedule={schedule!r} cuts each rank's block of {rows} rows (all dims of x but the "
            f"last, x.shape={tuple(x_shape)}) into {unit}={chunks} equal chunks; {unit} must divide {rows}")


def check_precision(op: str, precision) -> None:
    allowed = (None, "default", "high", "highest", "fastest", "bfloat16", "tensorfloat32", "float32")
    values = precision if isinstance(precision, tuple) else (precision,)
    for p in values:
        if not (p in allowed or isinstance(p, jax.lax.Precision)):
            raise ValueError(f"commfuse.{op}: unknown precision {p!r}")


# Precisions (and `jax_default_matmul_precision` values) that ask for full
# float32 products; the others let float32 GEMMs use TF32 on GPUs, as XLA's
# own dot does under its default precision.
_FULL_F32 = {"high", "highest", "float32", "bfloat16_3x", "tensorfloat32_3x"}


def fast_f32(op: str, precision) -> bool:
    """Whether float32 GEMMs may use TF32 tensor cores (GPU only: the CPU
    backend always multiplies in full float32): `precision`, or when it is
    None the `jax_default_matmul_precision` setting, read as `jnp.matmul`
    reads it; either operand asking for full float32 wins."""
    check_precision(op, precision)
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    values = precision if isinstance(precision, tuple) else (precision,)
    for p in values:
        name = p.name if isinstance(p, jax.lax.Precision) else str(p or "default")
        if name.lower() in _FULL_F32 or "F32_F32_F32" in name.upper():
            return False
    return True


class Static(NamedTuple):
    """The non-differentiable arguments of one fused op call."""
    axes: tuple
    ranks: int
    dimension: int
    schedule: int
    out_dtype: np.dtype
    # float32 GEMMs may use TF32 on GPUs (see `fast_f32`).
    fast_f32: bool = True


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


@functools.lru_cache(maxsize=4096)
def result_shape(kind: "Kind", x_shape, w_shape, dimension: int, ranks: int) -> tuple:
    """The result's shape, as the library computes it (`problem::result_dims`;
    a shapes-only `prepare`, which also checks the operands)."""
    shapes = _abi.call(kind, UNFUSED, ranks, dimension, x_shape, w_shape, np.float32, np.float32)
    return tuple(_abi.prepare(shapes)["out"])


def call_static(kind: "Kind", x, w, static: Static, *, dimension=None, out_dtype=None, forward=False):
    """`call` with the settings of a user's op (for its VJP's inner ops). A
    sliced or tiled op's VJP cuts the row gathers and scatters it can and
    runs the other kinds (weight gradients) with "auto"."""
    x, w = common(x, w)
    schedule = static.schedule
    if cut_schedule(schedule) and not forward and kind not in (Kind.ALL_GATHER_MATMUL, Kind.MATMUL_REDUCE_SCATTER):
        schedule = SCHEDULES["auto"]
    return call(kind, x, w, out_dtype=static.out_dtype if out_dtype is None else out_dtype, schedule=schedule,
                axes=static.axes, ranks=static.ranks, dimension=static.dimension if dimension is None else dimension,
                fast_f32=static.fast_f32)


def differentiable(kind: "Kind", backward, *, dimension=None):
    """The op `kind` as a differentiable function ``(x, w, static) -> out``:
    `backward(static, (x, w), dy) -> (dx, dw)` gives its VJP, built from
    fused ops in turn."""

    @partial(jax.custom_vjp, nondiff_argnums=(2,))
    def op(x, w, static: Static):
        return call_static(kind, x, w, static, dimension=dimension, forward=True)

    op.defvjp(lambda x, w, static: (op(x, w, static), (x, w)), backward)
    return op


# What each op this thread issued since `decisions()` was last cleared ran
# as: (op name, schedule name, why). `overlap(report=True)` reports them.
_DECISIONS = threading.local()


def decisions(clear: bool = False) -> list:
    made = getattr(_DECISIONS, "made", [])
    if clear:
        _DECISIONS.made = []
    return list(made)


def record_decision(op: str, schedule: str, why: str) -> None:
    if not hasattr(_DECISIONS, "made"):
        _DECISIONS.made = []
    _DECISIONS.made.append((op, schedule, why))


def call(kind: "Kind", x, w, *, out_dtype, schedule: int, axes, ranks: int, dimension: int = 0, scales=(),
         fast_f32: bool = True, decline: bool = True):
    """Issues one fused op (operands already checked and laid out for `kind`);
    `scales`: ``(x_scale, w_scale)`` with fp8 operands; `fast_f32`: float32
    GEMMs may use TF32 on GPUs. Under ``"unfused"``, or where ``"auto"``'s
    cost model predicts no gain (unless not `decline`: the choice was made
    before, see `_auto.decide_dot`), it is jax.lax's own collective and dot."""
    op = kind.name.lower()
    out_shape = result_shape(kind, tuple(x.shape), tuple(w.shape), dimension, ranks)
    check_elements(op, "the result", out_shape)
    if cut_schedule(schedule):
        _check_cut(kind, x.shape, dimension, ranks, schedule)
    if 0 in x.shape or 0 in w.shape or 0 in out_shape:
        # Nothing to multiply or nothing to move: the result is zeros, as
        # jax.lax's dot gives for an empty contraction. jax.lax's all_to_all
        # takes empty blocks (and its gradient keeps the operands JAX needs
        # to lower it), so those kinds run it; its all_gather and psum_scatter
        # lower no empty gathered or scattered dim, so the others are zeros
        # here, with no communication (every rank has the same shapes).
        why = "an operand or the result has no elements"
        if kind in _ALL_TO_ALL_KINDS:
            record_decision(op, "unfused", why)
            return unfused(kind, x, w, out_dtype=out_dtype, axes=axes, ranks=ranks, dimension=dimension,
                           fast_f32=fast_f32)
        record_decision(op, "none", why)
        return empty_result(x, w, out_shape, out_dtype, axes)
    if schedule == UNFUSED:
        record_decision(op, "unfused", "as asked")
        return unfused(kind, x, w, out_dtype=out_dtype, axes=axes, ranks=ranks, dimension=dimension,
                       fast_f32=fast_f32)
    if cut_schedule(schedule) and (x.ndim != 2 or dimension != 0):
        # Slices are chunks of contiguous rows: run on x with the row dim
        # leading (its blocks stay row blocks), then put the dims back.
        out = call(kind, rows_2d(x, dimension), w, out_dtype=out_dtype, schedule=schedule, axes=axes,
                   ranks=ranks, dimension=0, scales=scales, fast_f32=fast_f32, decline=decline)
        return unrows_2d(out, out_shape, dimension)
    # "auto" asks the cost model, on the machine the program runs on (fp8:
    # the library's own rule), then weighs its pick against the call's cost.
    shapes = _abi.call(kind, schedule, ranks, dimension, x.shape, w.shape, x.dtype, out_dtype)
    if schedule == _abi.AUTO and not scales:
        prepared, code, why = _auto.prepare(shapes, measure_call_overhead_s, decline=decline)
    else:
        prepared, code, why = _abi.prepare(shapes), schedule, "as asked"
    record_decision(op, schedule_name(code), why)
    if code == UNFUSED:
        return unfused(kind, x, w, out_dtype=out_dtype, axes=axes, ranks=ranks, dimension=dimension,
                       fast_f32=fast_f32)
    workspace = (prepared["workspace"]["cpu"], prepared["workspace"]["cuda"])
    return _PRIMITIVE.bind(
        x, w, *scales, kind=Kind(kind), out_shape=tuple(out_shape), out_dtype=np.dtype(out_dtype), dimension=dimension,
        schedule=code, axes=tuple(axes), ranks=ranks, workspace=workspace, site=next(_sites),
        fast_f32=bool(fast_f32))


def measure_call_overhead_s(n: int) -> float:
    """A fused call's fixed cost on `n` of this host's CPU devices: a
    reduce-scatter matmul too small for its compute or transfers to count,
    fused and as jax.lax's collective and dot (the fastest of 7 interleaved
    runs of 20 calls each), the difference (see `_auto.call_overhead_s`)."""
    import time

    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    devices = jax.devices("cpu")
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

    ring = SCHEDULES["ring"]
    fused = compiled(lambda a, b: call(Kind.MATMUL_REDUCE_SCATTER, a, b, out_dtype=np.float32, schedule=ring,
                                       axes=("i",), ranks=n))
    plain = compiled(lambda a, b: jax.lax.psum_scatter(a @ b, "i", tiled=True))
    # Interleaved, the fastest of each: the least disturbed by other work on the host.
    times = [(per_call(fused), per_call(plain)) for _ in range(7)]
    return min(t for t, _ in times) - min(t for _, t in times)


_ALL_TO_ALL_KINDS = (Kind.ALL_TO_ALL_MATMUL, Kind.ALL_TO_ALL_MATMUL_CONTRACT, Kind.MATMUL_ALL_TO_ALL,
                     Kind.MATMUL_ALL_TO_ALL_COLS)


def _abstract_eval(x, w, *scales, out_shape, out_dtype, axes, **_):
    # Typed as varying over the op's axes (and whatever x and w vary over), so
    # that a custom_vjp and out_specs see the truth (a fused op's result is
    # not the same on every rank).
    varying = (_varying(x) | _varying(w) | frozenset(axes)) if vma_checked() else frozenset()
    return _typed_like(x, out_shape, out_dtype, varying)


def empty_result(x, w, shape, dtype, axes):
    """Zeros of `shape`, typed as varying like a fused op's result."""
    zeros = jnp.zeros(shape, dtype)
    if not vma_checked():
        return zeros
    return make_varying(zeros, _varying(jax.typeof(x)) | _varying(jax.typeof(w)) | frozenset(axes))


def unfused(kind: "Kind", x, w, *, out_dtype, axes, ranks: int, dimension: int, fast_f32: bool):
    """`kind`'s op in its canonical layout (see `Kind`) as jax.lax's own
    collective and dot: what the fused op computes, and its fallback."""
    K = Kind
    precision = None if fast_f32 else jax.lax.Precision.HIGHEST
    axes = tuple(axes)

    def dot(a, b):
        return jnp.matmul(a, b, precision=precision, preferred_element_type=out_dtype).astype(out_dtype)

    def gather(a, axis):
        return jax.lax.all_gather(a, axes, axis=axis, tiled=True)

    def scatter(a, axis):
        return jax.lax.psum_scatter(a, axes, scatter_dimension=axis, tiled=True)

    def a2a(a):  # stacked blocks [N, ...]: block j to rank j, received ones stacked by sender
        return jax.lax.all_to_all(a, axes, 0, 0, tiled=True)

    if kind == K.ALL_GATHER_MATMUL:
        return dot(gather(x, dimension), w)
    if kind == K.ALL_GATHER_MATMUL_CONTRACT:
        return dot(gather(x, 1), w)
    if kind == K.MATMUL_ALL_GATHER:  # (w [k, c] travels, x [m, k])
        return dot(w, gather(x, 1))
    if kind == K.MATMUL_ALL_GATHER_CONTRACT:  # (w [kb, n] travels, x [m, N*kb])
        return dot(w, gather(x, 0))
    if kind == K.MATMUL_REDUCE_SCATTER:
        return scatter(dot(x, w), dimension)
    if kind == K.MATMUL_REDUCE_SCATTER_COLS:
        return scatter(dot(x, w), 1)
    if kind == K.ALL_TO_ALL_MATMUL:
        return dot(a2a(x), w)
    if kind == K.ALL_TO_ALL_MATMUL_CONTRACT:  # x [N, m, kb]: received blocks side by side along k
        moved = a2a(x)
        return dot(jnp.moveaxis(moved, 0, 1).reshape(moved.shape[1], moved.shape[0] * moved.shape[2]), w)
    if kind == K.MATMUL_ALL_TO_ALL:
        return a2a(dot(x, w))
    # MATMUL_ALL_TO_ALL_COLS: x [m, k], w [k, N*c]: column block j goes to rank j.
    y = dot(x, w)
    return a2a(jnp.moveaxis(y.reshape(y.shape[0], ranks, y.shape[1] // ranks), 1, 0))


def _lower_cpu(ctx, x, w, *scales, kind, workspace, **params):
    if scales:  # fp8 traced where a GPU exists, lowered for CPU devices
        raise TypeError(
            f"commfuse ({kind.name.lower()}): fp8 operands need CUDA devices (sm_90+); this mesh is on CPU")
    return _lower_target(_native.CPU_TARGET, ctx, x, w, kind=kind, workspace_bytes=workspace[0], **params)


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
    out, _ = lowering(
        ctx, x, w, *scales,
        kind=int(kind),
        site=int(site),
        schedule=int(schedule),
        dimension=int(dimension),
        mesh_devices=np.asarray(mesh.device_ids, np.int64).reshape(-1),
        mesh_shape=np.asarray(mesh.device_ids.shape, np.int64),
        axes=np.asarray([mesh.axis_names.index(a) for a in axes], np.int64),
        **(extra or {}),
    )
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
    if kind not in (Kind.ALL_GATHER_MATMUL, Kind.MATMUL_REDUCE_SCATTER) or w_dim is not _NOT_MAPPED:
        raise NotImplementedError(
            "vmap of this commfuse op is supported only over `x` of all_gather_matmul and "
            "matmul_reduce_scatter with a row gather/scatter dimension (the batch dim becomes a leading "
            "dim of x). Fold the batch into x's leading dims yourself, or loop with lax.map.")
    x = jnp.moveaxis(x, x_dim, 0)
    out = call(kind, x, w, out_dtype=out_dtype, schedule=schedule, axes=axes, ranks=ranks, dimension=dimension + 1,
               fast_f32=fast_f32)
    return out, 0


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


def vma_checked() -> bool:
    """Whether the enclosing shard_map tracks varying manual axes
    (``check_vma=True``, the default); under ``check_vma=False`` no value is
    typed as varying, and a result typed so would not match its cotangent."""
    return _compat.check_vma()


def varying_axes(value) -> frozenset:
    """The mesh axes `value` is typed as varying over (empty under check_vma=False)."""
    return _varying(jax.typeof(value))


_varying = _compat.varying_axes
_typed_like = _compat.with_varying


def _lowering_mesh(kind, ctx):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None or getattr(mesh, "device_ids", None) is None:
        raise ValueError(
            f"commfuse ({kind.name.lower()}) must be lowered inside a jax.shard_map over a concrete mesh "
            f"(found axis context {type(ctx.module_context.axis_context).__name__})")
    return mesh
