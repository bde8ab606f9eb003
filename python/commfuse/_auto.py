"""What ``schedule="auto"`` runs: the cost model's pick (``src/sim``) on the
machine the program runs on, resolved at trace time through ``_abi.prepare``
so that the workspace and the plan agree; or jax.lax's own collective and
dot where the pick's predicted gain over the unoverlapped baseline is
smaller than a fused call's fixed cost."""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import jax

from . import _abi
from ._native import lib

MACHINES = ("cpu_here", "h100_nvlink", "h200_nvlink", "h100_pcie")
MACHINE_VAR = "COMMFUSE_MACHINE"
LINK_VAR = "COMMFUSE_CPU_LINK"
# Whether `auto` may run a call unfused where the model predicts no gain
# (`COMMFUSE_AUTO_UNFUSED=0` makes it always fuse: the test-suite's fused-path
# tests run tiny shapes, which would otherwise never fuse).
AUTO_UNFUSED_VAR = "COMMFUSE_AUTO_UNFUSED"

lib.commfuse_cpu_gemm_gflops.restype = ctypes.c_double
lib.commfuse_cpu_gemm_gflops.argtypes = []


def cpu_gemm_gflops() -> float:
    """This host's single-thread f32 GEMM rate (GFLOP/s), measured once per process."""
    return float(lib.commfuse_cpu_gemm_gflops())


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


def prepare(shapes: _abi.Call, measure_overhead) -> tuple:
    """(prepared, schedule code, why) for an ``auto`` call: the library's
    answer on `default_machine()`, and the schedule to run, the model's pick
    or `_abi.UNFUSED` (see `decide`). `measure_overhead(n)` times a fused
    call's fixed cost on this host's CPU devices (`call_overhead_s`)."""
    spec = default_machine()
    try:
        prepared = _abi.prepare(shapes, spec, machine_rate(spec))
    except ValueError as e:
        if "machine " not in str(e):
            raise
        source = MACHINE_VAR if os.environ.get(MACHINE_VAR, "").strip() else LINK_VAR
        raise ValueError(f"commfuse: schedule='auto' cannot use the machine description from {source}: {e}") \
            from None
    code, why = decide(prepared, shapes.ranks, spec, measure_overhead,
                       os.environ.get(AUTO_UNFUSED_VAR, "1") != "0")
    return prepared, code, why


def decide(prepared: dict, n: int, spec: str, measure_overhead, may_decline: bool) -> tuple:
    """(code, why): the model's pick, or unfused where its predicted gain
    over the unoverlapped baseline is below a fused call's fixed cost."""
    model = prepared.get("model")
    if model is None:
        return prepared["schedule"], "the cost model cannot time this call; the library's default schedule"
    pick, fused, unfused = model["pick"], model["pick_s"], model["sequential_s"]
    if n == 1 or fused is None or unfused is None:
        return prepared["schedule"], f"{pick}, the cost model's pick"
    gain = unfused - fused
    overhead = call_overhead_s(spec, n, measure_overhead)
    if may_decline and gain <= overhead:
        return _abi.UNFUSED, (f"unfused: the model predicts {us(gain)} of gain from fusing ({pick}), less than a "
                              f"fused call's fixed cost of {us(overhead)} over {n} devices")
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
    process and group size), or as measured on an H100 for the GPU presets."""
    if not spec.startswith("cpu_here"):
        return _GPU_CALL_OVERHEAD_S
    return _cpu_call_overhead_s(n, measure_overhead)


@functools.lru_cache(maxsize=None)
def _cpu_call_overhead_s(n: int, measure_overhead) -> float:
    """`measure_overhead(n)`, at least 0, measured on a thread of its own:
    the caller is usually tracing (inside a jit or a shard_map body), and
    JAX's trace and mesh contexts are the calling thread's. 0 (auto then
    always fuses) if it cannot be measured."""
    result = []

    def measure():
        try:
            result.append(max(0.0, measure_overhead(n)))
        except Exception:  # noqa: BLE001 - no figure: auto then always fuses
            result.append(0.0)

    thread = threading.Thread(target=measure, name="commfuse-calibration")
    thread.start()
    thread.join()
    return result[0]
