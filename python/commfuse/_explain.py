"""``commfuse.explain``: what the cost model (``src/sim``) predicts for one call.

The Rust library simulates every candidate schedule's plan on all ``n`` ranks
of a machine description (GEMM roofline, link bandwidth and latency, switch or
ring topology, one compute and one comm lane per device) and picks the fastest.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os

import jax
import jax.numpy as jnp

from ._native import lib

lib.commfuse_explain.restype = ctypes.c_int64
lib.commfuse_explain.argtypes = [
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
    ctypes.POINTER(ctypes.POINTER(ctypes.c_int64)), ctypes.POINTER(ctypes.c_size_t),
    ctypes.POINTER(ctypes.c_uint32), ctypes.c_char_p, ctypes.c_double, ctypes.c_char_p, ctypes.c_size_t,
]

MACHINES = ("cpu_here", "h100_nvlink", "h200_nvlink", "h100_pcie")
_DTYPES = {"float32": 11, "float64": 12, "bfloat16": 16, "float16": 10}
# Op kind codes (`OpKind::from_code` in src/problem.rs).
_AG, _AG_CONTRACT, _MAG, _MAG_CONTRACT, _RS, _RS_COLS, _A2A, _A2A_CONTRACT, _MA2A, _MA2A_COLS = range(10)


def _call(op: str, x: tuple, w: tuple, n: int, dimension: int):
    """(kind, dimension, travelling operand, other operand, out shape) in the library's layout."""
    def bad(why):
        return ValueError(f"commfuse.explain: {op} with x {x}, w {w}, n={n}: {why}")

    if op in ("all_gather_matmul", "matmul_reduce_scatter"):
        if len(x) < 2 or len(w) != 2:
            raise bad("x must have rank >= 2 and w rank 2")
        d = dimension + len(x) if dimension < 0 else dimension
        if d == len(x) - 1:  # the contraction dim
            if len(x) != 2:
                raise bad("a contraction-dim gather or scatter needs a 2-D x")
            if op == "all_gather_matmul":
                return _AG_CONTRACT, 0, x, w, (x[0], w[1])
            if w[1] % n:
                raise bad(f"w's columns must be divisible by n={n}")
            return _RS_COLS, 0, x, w, (x[0], w[1] // n)
        if not 0 <= d < len(x) - 1:
            raise bad(f"dimension {dimension} is out of range")
        out = list(x[:-1]) + [w[1]]
        if op == "all_gather_matmul":
            out[d] *= n
            return _AG, d, x, w, tuple(out)
        if x[d] % n:
            raise bad(f"x dim {d} must be divisible by n={n}")
        out[d] //= n
        return _RS, d, x, w, tuple(out)
    if op == "matmul_all_gather":  # x @ all_gather(w, dimension): w travels
        if len(x) != 2 or len(w) != 2:
            raise bad("x and w must be 2-D")
        d = dimension + 2 if dimension < 0 else dimension
        if d == 1:
            return _MAG, 0, w, x, (x[0], n * w[1])
        if d == 0:
            return _MAG_CONTRACT, 0, w, x, (x[0], w[1])
        raise bad(f"dimension {dimension} is out of range")
    if op in ("all_to_all_matmul", "matmul_all_to_all"):
        if len(x) != 3 or x[0] != n or len(w) != 2:
            raise bad(f"x must be [n, rows, k] (blocks for each of the {n} peers) and w 2-D")
        kind = _A2A if op == "all_to_all_matmul" else _MA2A
        return kind, 0, x, w, (n, x[1], w[1])
    raise ValueError(f"commfuse.explain: unknown op {op!r}; expected all_gather_matmul, matmul_reduce_scatter, "
                     "matmul_all_gather, all_to_all_matmul or matmul_all_to_all")


def _us(seconds) -> str:
    if seconds is None:
        return "?"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def explain(op: str, x_shape, w_shape, n: int, *, dimension: int = 0, dtype="float32", machine: str = "cpu_here",
            gemm_gflops: float | None = None) -> dict:
    """Prints the plan the cost model picks for ``op`` over ``n`` devices and
    the predicted time of every schedule, and returns the numbers.

    ``x_shape`` and ``w_shape`` are one device's operands as the op takes them
    (``op(x, w, axis)`` inside ``shard_map``); ``dimension`` is the gathered or
    scattered dim. ``machine`` names a preset: ``"h100_nvlink"``,
    ``"h200_nvlink"``, ``"h100_pcie"``, or ``"cpu_here"`` (this host's CPU
    devices; the link model in ``COMMFUSE_CPU_LINK`` applies, and
    ``gemm_gflops``, a measured single-thread GEMM rate, calibrates it). A
    preset may carry overrides: ``"h100_pcie:gbytes_per_s=50,latency_us=10"``.

    Returns a dict: ``schedules`` (name -> predicted seconds), ``choice`` (the
    fastest), ``t_compute``, ``t_comm``, ``floor`` = max(T_compute, T_comm),
    ``machine`` (its figures) and ``plan`` (rank 0's steps per lane with their
    predicted start and end).
    """
    x, w = tuple(int(d) for d in x_shape), tuple(int(d) for d in w_shape)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"commfuse.explain: n must be a positive int, got {n!r}")
    name = jnp.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"commfuse.explain: unsupported dtype {name}; expected one of {', '.join(_DTYPES)}")
    if not isinstance(machine, str) or machine.split(":")[0] not in MACHINES:
        raise ValueError(f"commfuse.explain: unknown machine {machine!r}; expected one of {', '.join(MACHINES)}")
    spec = machine
    link = os.environ.get("COMMFUSE_CPU_LINK", "").strip()
    if machine == "cpu_here" and link:
        spec = f"cpu_here:{link}"
    kind, dim, first, second, out = _call(op, x, w, n, int(dimension))
    rate = float(gemm_gflops) if gemm_gflops is not None else 0.0
    if gemm_gflops is not None and not rate > 0:
        raise ValueError(f"commfuse.explain: gemm_gflops must be positive, got {gemm_gflops!r}")
    if machine.startswith("cpu_here") and gemm_gflops is None:
        rate = cpu_gemm_gflops()
    try:
        result = _query(kind, dim, first, second, out, n, _DTYPES[name], _DTYPES[name], spec, rate)
    except ValueError as e:
        raise ValueError(f"commfuse.explain: {e}") from None
    result["op"] = op
    _print(result, x, w)
    return result


def _query(kind: int, dim: int, first, second, out, n: int, input_code: int, output_code: int, spec: str,
           rate: float) -> dict:
    """The library's JSON answer for one call in its own layout (kind, shapes, dtype codes)."""
    arrays = [(ctypes.c_int64 * max(1, len(s)))(*s) for s in (first, second, out)]
    shapes = (ctypes.POINTER(ctypes.c_int64) * 3)(*[ctypes.cast(a, ctypes.POINTER(ctypes.c_int64)) for a in arrays])
    ranks = (ctypes.c_size_t * 3)(len(first), len(second), len(out))
    codes = (ctypes.c_uint32 * 2)(input_code, output_code)
    size = 1 << 16
    while True:
        buffer = ctypes.create_string_buffer(size)
        length = lib.commfuse_explain(kind, n, dim, shapes, ranks, codes, spec.encode(), rate, buffer, size)
        if length < 0:
            raise ValueError(buffer.value.decode(errors="replace"))
        if length < size:
            break
        size = length + 1
    return json.loads(buffer.value.decode())


lib.commfuse_cpu_gemm_gflops.restype = ctypes.c_double
lib.commfuse_cpu_gemm_gflops.argtypes = []


def cpu_gemm_gflops() -> float:
    """This host's single-thread f32 GEMM rate (GFLOP/s), measured once per process."""
    return float(lib.commfuse_cpu_gemm_gflops())


MACHINE_VAR = "COMMFUSE_MACHINE"


def default_machine() -> str:
    """The machine `schedule="auto"` plans for: ``COMMFUSE_MACHINE`` if set (a
    preset, optionally with overrides), else by JAX's default backend: this
    host's CPU devices under the link model in ``COMMFUSE_CPU_LINK``, or the
    GPU preset matching the device kind (H200, H100 PCIe, else H100 NVLink)."""
    spec = os.environ.get(MACHINE_VAR, "").strip()
    if spec:
        return spec
    if jax.default_backend() == "cpu":
        link = os.environ.get("COMMFUSE_CPU_LINK", "").strip()
        return f"cpu_here:{link}" if link else "cpu_here"
    kind = jax.devices()[0].device_kind.lower()
    if "h200" in kind:
        return "h200_nvlink"
    return "h100_pcie" if "pcie" in kind else "h100_nvlink"


def auto_schedule_code(kind: int, dim: int, x_shape, w_shape, out_shape, n: int, input_code: int,
                       output_code: int) -> int:
    """The schedule code `schedule="auto"` runs: the model's pick for this call
    on `default_machine()` (see `sim::auto_schedule`), resolved at trace time so
    that the workspace and the plan agree. 0 (the library's own rule) if the
    model cannot time the call."""
    spec = default_machine()
    rate = cpu_gemm_gflops() if spec.startswith("cpu_here") else 0.0
    return _auto_code(kind, dim, tuple(x_shape), tuple(w_shape), tuple(out_shape), n, input_code, output_code,
                      spec, rate)


@functools.lru_cache(maxsize=4096)
def _auto_code(kind, dim, x_shape, w_shape, out_shape, n, input_code, output_code, spec, rate) -> int:
    try:
        choice = _query(kind, dim, x_shape, w_shape, out_shape, n, input_code, output_code, spec, rate)["choice"]
    except ValueError as e:
        if "argument: machine " in str(e):  # `Machine::from_spec`: a bad description, not an untimeable call
            source = MACHINE_VAR if os.environ.get(MACHINE_VAR, "").strip() else "COMMFUSE_CPU_LINK"
            raise ValueError(f"commfuse: schedule='auto' cannot use the machine description from {source}: {e}") \
                from None
        return 0
    if choice.startswith("tiled("):
        return 5 | (int(choice[len("tiled("):-1]) << 8)
    return {"ring": 1, "bidirectional": 2}.get(choice, 0)


def _print(r: dict, x: tuple, w: tuple) -> None:
    m = r["machine"]
    lines = [f"commfuse.explain: {r['op']} x{list(x)} w{list(w)} over n={r['n']} ({r['dtype']}) on {m['name']} "
             f"({m['peak_flops'] * m['efficiency'] / 1e12:.3g} TFLOP/s, {m['link_bytes_per_s'] / 1e9:.3g} GB/s "
             f"{m['topology']}, {m['latency_s'] * 1e6:.3g} us)"]
    for name, t in r["schedules"].items():
        mark = "  <- chosen" if name == r["choice"] else ""
        lines.append(f"  {name:<14} {_us(t):>12}  {t / r['floor']:.2f}x floor{mark}")
    lines.append(f"  floor = max(T_compute {_us(r['t_compute'])}, T_comm {_us(r['t_comm'])}) = {_us(r['floor'])}")
    lines.append(f"  plan of rank 0 under {r['choice']}:")
    for lane in ("compute", "comm"):
        steps = r["plan"][lane]
        shown = [f"#{s['id']} {s['action']} [{_us(s['start'])}..{_us(s['end'])}]" for s in steps[:8]]
        more = f" ... ({len(steps) - 8} more)" if len(steps) > 8 else ""
        lines.append(f"    {lane:<7}: " + ("; ".join(shown) or "(none)") + more)
    print("\n".join(lines))
