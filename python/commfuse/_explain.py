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
    fastest fused schedule), ``decision`` (what ``schedule="auto"`` runs: the
    choice, or ``"unfused"`` where the predicted gain is below a fused call's
    fixed cost) and ``decision_reason``, ``t_compute``, ``t_comm``,
    ``floor`` = max(T_compute, T_comm),
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
    may_decline = os.environ.get(AUTO_UNFUSED_VAR, "1") != "0"
    code, why = _decide(kind, dim, first, second, out, n, _DTYPES[name], _DTYPES[name], spec, rate, may_decline)
    result["decision"] = "unfused" if code == _UNFUSED else result["choice"]
    result["decision_reason"] = why
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


# Whether `auto` may run a call unfused where the model predicts no gain
# (`COMMFUSE_AUTO_UNFUSED=0` makes it always fuse: the test-suite's fused-path
# tests run tiny shapes, which would otherwise never fuse).
AUTO_UNFUSED_VAR = "COMMFUSE_AUTO_UNFUSED"
_UNFUSED = 6  # `_fused.UNFUSED` (not imported: `_fused` imports this module)


def auto_decision(kind: int, dim: int, x_shape, w_shape, out_shape, n: int, input_code: int,
                  output_code: int) -> tuple:
    """(schedule code, why) `schedule="auto"` runs for this call: the cost
    model's pick on `default_machine()` (see `sim::auto_schedule`), resolved at
    trace time so that the workspace and the plan agree; or unfused (jax.lax's
    own collective and dot) where the pick's predicted gain over the
    unoverlapped collective-then-matmul is smaller than a fused call's fixed
    cost. 0 (the library's own rule) if the model cannot time the call."""
    spec = default_machine()
    rate = cpu_gemm_gflops() if spec.startswith("cpu_here") else 0.0
    return _decide(kind, dim, tuple(x_shape), tuple(w_shape), tuple(out_shape), n, input_code, output_code,
                   spec, rate, os.environ.get(AUTO_UNFUSED_VAR, "1") != "0")


def auto_schedule_code(kind: int, dim: int, x_shape, w_shape, out_shape, n: int, input_code: int,
                       output_code: int) -> int:
    """The schedule code of `auto_decision`."""
    return auto_decision(kind, dim, x_shape, w_shape, out_shape, n, input_code, output_code)[0]


@functools.lru_cache(maxsize=4096)
def _decide(kind, dim, x_shape, w_shape, out_shape, n, input_code, output_code, spec, rate, may_decline):
    try:
        r = _query(kind, dim, x_shape, w_shape, out_shape, n, input_code, output_code, spec, rate)
    except ValueError as e:
        if "argument: machine " in str(e):  # `Machine::from_spec`: a bad description, not an untimeable call
            source = MACHINE_VAR if os.environ.get(MACHINE_VAR, "").strip() else "COMMFUSE_CPU_LINK"
            raise ValueError(f"commfuse: schedule='auto' cannot use the machine description from {source}: {e}") \
                from None
        return 0, "the cost model cannot time this call; the library's default schedule"
    choice = r["choice"]
    code = 5 | (int(choice[len("tiled("):-1]) << 8) if choice.startswith("tiled(") else \
        {"ring": 1, "bidirectional": 2}.get(choice, 0)
    fused, unfused = r["schedules"].get(choice), r["schedules"].get("sequential")
    if n == 1 or fused is None or unfused is None:
        return code, f"{choice}, the cost model's pick"
    gain = unfused - fused
    overhead = call_overhead_s(spec, n)
    if may_decline and gain <= overhead:
        return _UNFUSED, (f"unfused: the model predicts {_us(gain)} of gain from fusing ({choice}), less than a "
                          f"fused call's fixed cost of {_us(overhead)} over {n} devices")
    return code, f"{choice}: predicted {_us(gain)} faster than unfused (fixed cost {_us(overhead)})"


# A fused call's fixed cost over XLA's own collective and dot on the GPU
# presets: measured on an H100 (GPU.md: 16 us per call, one GPU, small GEMMs).
_GPU_CALL_OVERHEAD_S = 16e-6


def call_overhead_s(spec: str, n: int) -> float:
    """What a fused call costs beyond jax.lax's collective and dot, whatever
    its size: measured on this host's CPU devices (`cpu_here`, once per
    process and group size), or as measured on an H100 for the GPU presets."""
    if not spec.startswith("cpu_here"):
        return _GPU_CALL_OVERHEAD_S
    return _cpu_call_overhead_s(n)


@functools.lru_cache(maxsize=None)
def _cpu_call_overhead_s(n: int) -> float:
    """Times a reduce-scatter matmul too small for its compute or transfers to
    count, fused and as jax.lax's collective and dot, over `n` CPU devices
    (the fastest of 7 interleaved runs of 20 calls each); the difference, at
    least 0.
    Measured on a thread of its own: the caller is usually tracing (inside a
    jit or a shard_map body), and JAX's trace and mesh contexts are the
    calling thread's."""
    import threading

    result = []

    def measure():
        try:
            result.append(_measure_cpu_call_overhead_s(n))
        except Exception as e:  # noqa: BLE001 - no figure: auto then always fuses
            result.append(e)

    thread = threading.Thread(target=measure, name="commfuse-calibration")
    thread.start()
    thread.join()
    if isinstance(result[0], Exception):
        import traceback; traceback.print_exception(result[0])
        return 0.0
    return result[0]


def _measure_cpu_call_overhead_s(n: int) -> float:
    import time

    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from . import _matmul_reduce_scatter

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

    fused = compiled(lambda a, b: _matmul_reduce_scatter.matmul_reduce_scatter(a, b, "i", schedule="ring"))
    plain = compiled(lambda a, b: jax.lax.psum_scatter(a @ b, "i", tiled=True))
    # Interleaved, the fastest of each: the least disturbed by other work on the host.
    times = [(per_call(fused), per_call(plain)) for _ in range(7)]
    return max(0.0, min(t for t, _ in times) - min(t for _, t in times))


def _print(r: dict, x: tuple, w: tuple) -> None:
    m = r["machine"]
    lines = [f"commfuse.explain: {r['op']} x{list(x)} w{list(w)} over n={r['n']} ({r['dtype']}) on {m['name']} "
             f"({m['peak_flops'] * m['efficiency'] / 1e12:.3g} TFLOP/s, {m['link_bytes_per_s'] / 1e9:.3g} GB/s "
             f"{m['topology']}, {m['latency_s'] * 1e6:.3g} us)"]
    for name, t in r["schedules"].items():
        mark = "  <- chosen" if name == r["choice"] else ""
        lines.append(f"  {name:<14} {_us(t):>12}  {t / r['floor']:.2f}x floor{mark}")
    lines.append(f"  floor = max(T_compute {_us(r['t_compute'])}, T_comm {_us(r['t_comm'])}) = {_us(r['floor'])}")
    lines.append(f"  schedule='auto' runs: {r['decision_reason']}")
    lines.append(f"  plan of rank 0 under {r['choice']}:")
    for lane in ("compute", "comm"):
        steps = r["plan"][lane]
        shown = [f"#{s['id']} {s['action']} [{_us(s['start'])}..{_us(s['end'])}]" for s in steps[:8]]
        more = f" ... ({len(steps) - 8} more)" if len(steps) > 8 else ""
        lines.append(f"    {lane:<7}: " + ("; ".join(shown) or "(none)") + more)
    print("\n".join(lines))
