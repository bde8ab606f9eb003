"""What ``schedule="auto"`` runs: the cost model's pick (``src/sim``) on the
machine the program runs on, resolved at trace time through ``_abi.prepare``
so that the workspace and the plan agree; or jax.lax's own collective and
dot where the pick's predicted gain over the unoverlapped baseline is not
clearly (`MARGIN` times) more than a fused call's fixed cost.

Every figure a decision rests on is either a preset (the GPU machines) or
measured once per machine and cached (`_calibration`): the same program on
the same machine gets the same decisions in every process.

Under ``jax.jit`` (``overlap``'s rewrite of dots outside shard_map bodies)
the shardings are known only when XLA partitions the program, too late to
leave a dot as the user wrote it. So `decide_dot` judges a dot at trace
time, from its global shapes and the mesh: a dot it declines stays XLA's
own (the compiled program is then the plain one), a dot it fuses runs the
model's best fused schedule whatever the partitioner asks for.
"""

from __future__ import annotations

import ctypes
import math
import os

import jax

from . import _abi, _calibration
from ._native import lib

MACHINES = ("cpu_here", "h100_nvlink", "h200_nvlink", "h100_pcie")
MACHINE_VAR = "COMMFUSE_MACHINE"
LINK_VAR = "COMMFUSE_CPU_LINK"
# Whether `auto` may run a call unfused where the model predicts no gain
# (`COMMFUSE_AUTO_UNFUSED=0` makes it always fuse: the test-suite's fused-path
# tests run tiny shapes, which would otherwise never fuse).
AUTO_UNFUSED_VAR = "COMMFUSE_AUTO_UNFUSED"
# A call fuses when the predicted gain is more than this many times its fixed
# cost: a decision near the break-even point would flip with the noise in the
# figures, and buy nothing either way.
MARGIN = 1.5

lib.commfuse_cpu_gemm_gflops.restype = ctypes.c_double
lib.commfuse_cpu_gemm_gflops.argtypes = []


def cpu_gemm_gflops() -> float:
    """This host's single-thread f32 GEMM rate (GFLOP/s), measured once per machine."""
    return _calibration.figure("cpu_gemm_gflops", lambda: float(lib.commfuse_cpu_gemm_gflops()))


def may_decline() -> bool:
    return os.environ.get(AUTO_UNFUSED_VAR, "1") != "0"


def default_machine() -> str:
    """The machine `schedule="auto"` plans for: ``COMMFUSE_MACHINE`` if set (a
    preset, optionally with overrides), else by JAX's default backend: this
    host's CPU devices under the link model in ``COMMFUSE_CPU_LINK``, or the
    GPU preset matching the device kind (H200, H100 PCIe, else H100 NVLink)."""
    spec = os.environ.get(MACHINE_VAR, "").strip()
    if spec:
        return spec
    if jax.default_backend() == "cpu":
        link = os.environ.get(LINK_VAR, "").strip()
        return f"cpu_here:{link}" if link else "cpu_here"
    kind = jax.devices()[0].device_kind.lower()
    if "h200" in kind:
        return "h200_nvlink"
    return "h100_pcie" if "pcie" in kind else "h100_nvlink"


def machine_rate(spec: str) -> float | None:
    """The measured GEMM rate a machine description takes (`cpu_here` only)."""
    return cpu_gemm_gflops() if spec.startswith("cpu_here") else None


def _prepared(shapes: _abi.CallShapes, spec: str) -> dict:
    try:
        return _abi.prepare(shapes, spec, machine_rate(spec))
    except ValueError as e:
        if "machine " not in str(e):
            raise
        source = MACHINE_VAR if os.environ.get(MACHINE_VAR, "").strip() else LINK_VAR
        raise ValueError(f"commfuse: schedule='auto' cannot use the machine description from {source}: {e}") \
            from None


def resolve(shapes: _abi.CallShapes, measure_overhead, *, decline: bool = True) -> tuple:
    """(prepared, schedule code, why) for an ``auto`` call: the library's
    answer on `default_machine()`, and the schedule to run, the model's pick
    or `_abi.UNFUSED` (see `decide`; never unfused when not `decline`).
    `measure_overhead(n)` times a fused call's fixed cost on this host's CPU
    devices (`call_overhead_s`)."""
    spec = default_machine()
    prepared = _prepared(shapes, spec)
    code, why = decide(prepared, shapes.ranks, spec, measure_overhead, decline and may_decline())
    return prepared, code, why


def decide(prepared: dict, n: int, spec: str, measure_overhead, may_decline: bool) -> tuple:
    """(code, why): the model's pick, or unfused where its predicted gain
    over the unoverlapped baseline is not `MARGIN` times a fused call's fixed cost."""
    if n == 1 and may_decline:
        # XLA drops a collective over one device; a fused call would only add its fixed cost.
        return _abi.UNFUSED, "unfused: a group of one device has no communication to hide"
    model = prepared.get("model")
    if model is None:
        return prepared["schedule"], "the cost model cannot time this call; the library's default schedule"
    pick, fused, unfused = model["pick"], model["pick_s"], model["sequential_s"]
    if n == 1 or fused is None or unfused is None:
        return prepared["schedule"], f"{pick}, the cost model's pick"
    gain = unfused - fused
    if not may_decline:
        return prepared["schedule"], f"{pick}: predicted {us(gain)} faster than unfused"
    overhead = call_overhead_s(spec, n, measure_overhead)
    if gain <= MARGIN * overhead:
        return _abi.UNFUSED, (f"unfused: the model predicts {us(gain)} of gain from fusing ({pick}), not "
                              f"{MARGIN}x a fused call's fixed cost of {us(overhead)} over {n} devices")
    return prepared["schedule"], f"{pick}: predicted {us(gain)} faster than unfused (fixed cost {us(overhead)})"


def us(seconds) -> str:
    if seconds is None:
        return "?"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


# A fused call's fixed cost over XLA's own collective and dot on the GPU
# presets: measured on an H100 (GPU.md: 16 us per call, one GPU, small GEMMs).
_GPU_CALL_OVERHEAD_S = 16e-6


def call_overhead_s(spec: str, n: int, measure_overhead) -> float:
    """What a fused call costs beyond jax.lax's collective and dot, whatever
    its size: measured on this host's CPU devices (`cpu_here`, once per
    machine and group size, see `_calibration`), or as measured on an H100
    for the GPU presets. 0 (auto then fuses) where it cannot be measured."""
    if not spec.startswith("cpu_here"):
        return _GPU_CALL_OVERHEAD_S
    # Under the link model the fused call's transfers take modelled time:
    # a figure of its own.
    name = f"cpu_call_overhead_s/{n}" + spec[len("cpu_here"):]
    try:
        return _calibration.figure(name, lambda: max(0.0, _calibration.robust(lambda: measure_overhead(n))))
    except Exception:  # noqa: BLE001 - no figure (kept for this process only): auto then fuses
        _calibration.remember(name, 0.0)
        return 0.0


# ----------------------------------------------------------------------------
# Dots under jax.jit, judged before partitioning
# ----------------------------------------------------------------------------
def decide_dot(m: int, k: int, n: int, dtype, out_dtype, mesh_axes: dict | None, devices: int,
               measure_overhead) -> tuple[bool, str]:
    """Whether to fuse ``x [m, k] @ w [k, n]`` (global shapes) of a program
    sharded by jit, and why. The shardings are unknown yet, so the product is
    judged in the layout of tensor parallelism with sequence parallelism,
    split over all `devices` with its collective over the largest mesh axis
    (all devices if no mesh is known): once gathering the rows (``[m/D, k] @
    [k, n/T]`` on each of D devices, over T ranks), once reduce-scattering
    them (``[m T/D, k/T] @ [k/T, n]``). It fuses when both pay."""
    if not may_decline():
        return True, "auto with COMMFUSE_AUTO_UNFUSED=0"
    sizes = [s for s in (mesh_axes or {}).values() if s > 1]
    ranks = max(sizes) if sizes else devices
    if ranks <= 1:
        return False, "a mesh of one device: no collective to hide"
    if m % devices or k % ranks or n % ranks or (m * ranks) % devices:
        return False, (f"its shapes ({m}x{k} @ {k}x{n}) do not split over the {devices} devices with a "
                       f"collective over {ranks}: judged by XLA")
    rows, rows_gathered = m // devices, m * ranks // devices
    layouts = (("all_gather_matmul", _abi.Kind.ALL_GATHER_MATMUL, (rows, k), (k, n // ranks)),
               ("matmul_reduce_scatter", _abi.Kind.MATMUL_REDUCE_SCATTER, (rows_gathered, k // ranks),
                (k // ranks, n)))
    spec = default_machine()
    verdicts = []
    for op, kind, x_shape, w_shape in layouts:
        shapes = _abi.call_shapes(kind, _abi.AUTO, ranks, 0, x_shape, w_shape, dtype, out_dtype)
        code, why = decide(_prepared(shapes, spec), ranks, spec, measure_overhead, True)
        verdicts.append((code != _abi.UNFUSED, f"as {op} over {ranks}: {why}"))
    fuse = all(ok for ok, _ in verdicts)
    return fuse, "; ".join(why for _, why in verdicts)


def mesh_of_trace() -> tuple[dict | None, int]:
    """The mesh axes in scope (``jax.set_mesh``), if any, and the device count they span."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None, jax.device_count()
    axes = dict(mesh.shape)
    return axes, math.prod(axes.values())
