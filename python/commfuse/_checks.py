"""The argument checks every fused op shares, each naming the argument it
refuses at trace time: the mesh axes, dims, operand shapes and dtypes,
schedules and their cuts, precisions and fp8 scales."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _abi, _native
from ._abi import CUT_SCHEDULES, DTYPE_CODES, FP8_CODES, SCHEDULES, Kind, chunks_of, cut_schedule

def axis_group(op: str, axis_name, arg: str = "axis_name") -> tuple[tuple[str, ...], int]:
    """The op's mesh axes and the group size; raises if not inside a
    shard_map over them. `arg`: the argument's name in messages."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names:
        raise ValueError(f"commfuse.{op}: {arg} must name at least one mesh axis")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        raise ValueError(
            f"commfuse.{op} must be called inside a jax.shard_map body (no manual mesh axes are in "
            f"scope here), with {arg} naming one of the shard_map's mesh axes")
    for name in names:
        if name not in mesh.axis_names:
            raise ValueError(f"commfuse.{op}: unknown {arg} {name!r}; the mesh axes are {mesh.axis_names}")
        if name not in mesh.manual_axes:
            raise ValueError(
                f"commfuse.{op}: {arg} {name!r} is not mapped by the enclosing jax.shard_map; call "
                f"the op inside a shard_map over it")
    if len(set(names)) != len(names):
        raise ValueError(f"commfuse.{op}: {arg} {names} repeats an axis")
    ranks = math.prod(mesh.shape[name] for name in names)
    if ranks > _abi.LIMITS["max_ranks"]:
        raise ValueError(
            f"commfuse.{op}: {arg} {names} spans {ranks} devices; the fused ops take at most "
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
            f"array: one of {list(range(limit))} (or {list(range(-ndim, limit - ndim))} from the end)")
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


def promote(op: str, x, w, preferred_element_type):
    """Casts `x` and `w` to their common type as jnp.matmul does; returns them and the output dtype."""
    dtype, out = promoted_dtypes(op, x.dtype, w.dtype, preferred_element_type)
    return x.astype(dtype), w.astype(dtype), out


def promoted_dtypes(op: str, x_dtype, w_dtype, preferred_element_type):
    """The common dtype of operands of `x_dtype` and `w_dtype` as jnp.matmul
    promotes them, and the result's dtype."""
    try:
        dtype = jnp.promote_types(x_dtype, w_dtype)
    except jax.dtypes.TypePromotionError as e:  # e.g. two fp8 formats
        raise TypeError(f"commfuse.{op}: unsupported dtype combination x: {x_dtype}, w: {w_dtype} ({e})") from e
    if dtype not in DTYPE_CODES:
        raise TypeError(
            f"commfuse.{op}: unsupported dtype {dtype} (from x: {x_dtype}, w: {w_dtype}); expected "
            f"float32, bfloat16, float16 or float64")
    # Canonical, as jnp.matmul takes it: float64 is float32 unless x64 is on.
    out = dtype if preferred_element_type is None else np.dtype(jax.dtypes.canonicalize_dtype(preferred_element_type))
    if out not in DTYPE_CODES:
        raise TypeError(
            f"commfuse.{op}: unsupported preferred_element_type dtype {out}; expected float32, "
            f"bfloat16, float16 or float64")
    return np.dtype(dtype), np.dtype(out)


_FP8_RESULTS = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


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


def check_slices(op: str, slices, code: int):
    """A two-axis op's ``slices=`` (None, or an int in [1, max_chunks]) as an int or None, for the
    schedule `code` asked: chunks overlap nothing under "sequential"."""
    most = _abi.LIMITS["max_chunks"]
    if slices is None:
        return None
    if not isinstance(slices, (int, np.integer)) or isinstance(slices, bool) or not 1 <= slices <= most:
        raise ValueError(f"commfuse.{op}: slices must be an int in [1, {most}], got {slices!r}")
    if slices > 1 and code == SCHEDULES["sequential"]:
        raise ValueError(f"commfuse.{op}: slices={slices} with schedule='sequential': chunks overlap nothing there; "
                         "leave slices unset or pick 'ring' or 'auto'")
    return int(slices)


def check_cut(kind: "Kind", x_shape, dimension: int, ranks: int, code: int) -> None:
    """A sliced or tiled call must be a row gather or scatter whose block rows divide into the chunks."""
    schedule = cut_schedule(code)
    if kind == Kind.ALL_GATHER_MATMUL_REDUCE_SCATTER and schedule == "sliced":
        # Sliced, each block of w's columns (`x_shape`: w [kb, c], the operand that travels) is cut into chunks.
        if x_shape[1] % chunks_of(code):
            raise ValueError(f"commfuse ({kind.name.lower()}): slices={chunks_of(code)} must divide w's "
                             f"{x_shape[1]} columns")
        return
    # Sliced, the two-gather op's row blocks of x (`x_shape`: its rows, then the contraction) travel in chunks.
    two_gathers = kind == Kind.ALL_GATHER_BOTH_MATMUL and schedule == "sliced"
    if kind not in _abi.CUT_KINDS and not two_gathers:
        raise ValueError(
            f"commfuse ({kind.name.lower()}): schedule={schedule!r} exists only for all_gather_matmul and "
            f"matmul_reduce_scatter along a row dimension (not the last dim), and matmul_all_reduce (and sliced, "
            f"all_gather_matmul_reduce_scatter and all_gather_both_matmul)")
    rows = math.prod(x_shape[:-1])
    if kind in (Kind.MATMUL_REDUCE_SCATTER, Kind.MATMUL_ALL_REDUCE):
        rows //= ranks
    chunks, unit = chunks_of(code), CUT_SCHEDULES[schedule]
    op = kind.name.lower()
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
    """`precision` is None, a `jax.lax.Precision`, one of its names, or a pair of them."""
    values = precision if isinstance(precision, tuple) else (precision,)
    for p in values:
        if p is None or isinstance(p, jax.lax.Precision):
            continue
        try:
            jax.lax.Precision(p)
        except (ValueError, TypeError):
            raise ValueError(f"commfuse.{op}: unknown precision {p!r}") from None


def _asks_full_f32(p) -> bool:
    """Whether a precision (or a `jax_default_matmul_precision` value) asks
    for full float32 products, as JAX reads it: its names are aliases of
    `jax.lax.Precision` ("tensorfloat32" and "bfloat16_3x" are HIGH: TF32
    on a GPU, as XLA's own dot takes them), and the dot algorithms that
    keep float32's accuracy ("F32_F32_F32", and the multi-pass ones:
    "BF16_BF16_F32_X3", "TF32_TF32_F32_X3", ...) ask for it too."""
    if isinstance(p, jax.lax.Precision):
        return p == jax.lax.Precision.HIGHEST
    name = str(p or "default")
    try:
        return jax.lax.Precision(name) == jax.lax.Precision.HIGHEST
    except ValueError:
        upper = name.upper()
        return "F32_F32_F32" in upper or upper.endswith(("_X3", "_X6", "_X9")) or upper == "TENSORFLOAT32_3X"


def fast_f32(op: str, precision) -> bool:
    """Whether float32 GEMMs may use TF32 tensor cores (GPU only: the CPU
    backend always multiplies in full float32): `precision`, or when it is
    None the `jax_default_matmul_precision` setting, read as `jnp.matmul`
    reads it; either operand asking for full float32 wins."""
    check_precision(op, precision)
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    values = precision if isinstance(precision, tuple) else (precision,)
    return not any(_asks_full_f32(p) for p in values)
