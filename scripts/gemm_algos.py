"""Which cuBLASLt algorithm keeps a ring's per-peer GEMM pieces closest to one
GEMM: the experiment behind issue 29's "pieces at >= 0.95 of one GEMM".

A ring over N ranks cuts a rank's GEMM (bf16, m x k x n) into N pieces of
m/N rows. With the default algorithm each piece's last wave of tiles leaves
SMs idle (GPU.md, "GEMM facts": 0.80-0.85 of one GEMM at N = 8). cuBLASLt
offers many algorithms per shape (tile sizes, split-K, stages, cluster
shapes) and says how many waves each fills (`wavesCount`); this script asks
for up to 32 algorithms for the piece shape, times the N pieces with each,
and compares them with the fastest of cuBLASLt's algorithms for the whole
GEMM.

Run by scripts/gpu_device_check.py (check `gemm_facts`); prints JSON lines,
one per figure. Needs PyTorch (memory, streams, events) and the cuBLASLt it
ships; commfuse is not involved. Timing as scripts/gpu_contention.py does it:
a warm-up, then medians of rounds that alternate what they compare.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_contention import emit, interleaved, operands, warm_up  # noqa: E402

# m x k x n, bf16: Llama-3 70B/405B MLP projections at TP 8 (as gpu_contention.py), cut N ways.
CASES = [((8192, 8192, 3584), 8), ((8192, 16384, 6656), 8), ((2048, 8192, 3584), 8), ((8192, 8192, 3584), 4)]
REQUESTED = 32
WORKSPACE = 32 << 20

# cublasLt.h's values.
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "stages": 6, "cluster": 8}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def library() -> ctypes.CDLL:
    """The cuBLASLt PyTorch loaded (its wheel's), else the system's."""
    torch.zeros(1, device="cuda") @ torch.zeros(1, 1, device="cuda")  # loads cuBLAS(Lt)
    with open("/proc/self/maps") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    candidates = loaded + sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib",
                                                        "libcublasLt.so*")))
    for path in candidates + ["libcublasLt.so.13", "libcublasLt.so.12"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise OSError("no libcublasLt found")


def tile_names(lib_path: str) -> dict:
    """Tile ids -> "128x256" from a cublasLt.h next to the library, if any."""
    for header in glob.glob(os.path.join(os.path.dirname(lib_path), "..", "include", "cublasLt.h")):
        with open(header) as f:
            return {int(v): n for n, v in re.findall(r"CUBLASLT_MATMUL_TILE_(\d+x\d+)\s*=\s*(\d+)", f.read())}
    return {}


class Lt:
    def __init__(self):
        self.lib = library()
        self.handle = ctypes.c_void_p()
        self.check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.tiles = tile_names(self.lib._name)
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: cuBLAS status {status}")

    def problem(self, rows: int, k: int, n: int):
        """Descriptors of out[rows, n] = x[rows, k] @ w[k, n], row-major, as
        column-major out^T = w^T x^T (what commfuse's GEMMs do)."""
        desc = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "MatmulDescCreate")
        layouts = []
        for r, c in ((n, k), (k, rows), (n, rows)):  # w^T, x^T, out^T (column-major, ld = rows)
            layout = ctypes.c_void_p()
            self.check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), R_16BF, ctypes.c_uint64(r),
                                                           ctypes.c_uint64(c), ctypes.c_int64(r)), "LayoutCreate")
            layouts.append(layout)
        pref = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        size = ctypes.c_uint64(WORKSPACE)
        self.check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                                 ctypes.c_size_t(8)), "PreferenceSetAttribute")
        return desc, layouts, pref

    def release(self, problem) -> None:
        desc, layouts, pref = problem
        for layout in layouts:
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self.lib.cublasLtMatmulDescDestroy(desc)
        self.lib.cublasLtMatmulPreferenceDestroy(pref)

    def algorithms(self, rows: int, k: int, n: int):
        desc, (a, b, d), pref = problem = self.problem(rows, k, n)
        results = (Heuristic * REQUESTED)()
        found = ctypes.c_int()
        self.check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, pref, REQUESTED, results,
                                                           ctypes.byref(found)), "AlgoGetHeuristic")
        return problem, [results[i] for i in range(found.value) if results[i].state == 0]

    def config(self, algo: Algo) -> dict:
        out = {}
        for name, attr in CONFIG.items():
            # The attributes are integers of 2 to 8 bytes: ask the size first (a null buffer of size 0).
            needed, value = ctypes.c_size_t(), ctypes.c_uint64()
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, None, ctypes.c_size_t(0),
                                                                   ctypes.byref(needed))
            if status == 0 and 0 < needed.value <= 8:
                status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                    ctypes.byref(algo), attr, ctypes.byref(value), needed, ctypes.byref(ctypes.c_size_t()))
            out[name] = value.value if status == 0 and 0 < needed.value <= 8 else None
        out["tile"] = self.tiles.get(out["tile"], out["tile"])
        return out

    def matmul(self, problem, algo: Algo, w, x, out):
        desc, (a, b, d), _ = problem
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(alpha), ctypes.c_void_p(w.data_ptr()), a, ctypes.c_void_p(x.data_ptr()),
            b, ctypes.byref(beta), ctypes.c_void_p(out.data_ptr()), d, ctypes.c_void_p(out.data_ptr()), d,
            ctypes.byref(algo), ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "cublasLtMatmul")


def case(lt: Lt, m: int, k: int, n: int, parts: int) -> None:
    x, w, out = operands(m, k, n)
    rows = m // parts
    whole, whole_algos = lt.algorithms(m, k, n)
    piece, piece_algos = lt.algorithms(rows, k, n)
    if not whole_algos or not piece_algos:
        emit(kind="error", error=f"cuBLASLt offers no algorithm for {m}x{k}x{n} cut {parts} ways")
        return
    # The first whole-GEMM algorithm is checked against PyTorch's product, so the layouts are right.
    lt.matmul(whole, whole_algos[0].algo, w, x, out)
    reference = (x @ w).float()
    error = (out.float() - reference).abs().max().item()
    fns = {f"whole {i}": (lambda h=h: lt.matmul(whole, h.algo, w, x, out)) for i, h in enumerate(whole_algos)}

    def pieces(h):
        for p in range(parts):
            lt.matmul(piece, h.algo, w, x[p * rows:(p + 1) * rows], out[p * rows:(p + 1) * rows])

    fns.update({f"pieces {i}": (lambda h=h: pieces(h)) for i, h in enumerate(piece_algos)})
    seconds = interleaved(fns, reps=5, rounds=5)
    best_whole = min(v for name, v in seconds.items() if name.startswith("whole"))
    emit(kind="algos_whole", m=m, k=k, n=n, ms=best_whole * 1e3, default_ms=seconds["whole 0"] * 1e3,
         check_max_abs_error=error, reference_max_abs=reference.abs().max().item(), algorithms=len(whole_algos))
    for i, h in enumerate(piece_algos):
        emit(kind="algos_pieces", m=m, k=k, n=n, parts=parts, index=i, waves=h.waves, **lt.config(h.algo),
             efficiency=best_whole / seconds[f"pieces {i}"])
    lt.release(whole)
    lt.release(piece)


def main() -> int:
    if not torch.cuda.is_available():
        emit(kind="error", error="no GPU: not measured")
        return 0
    lt = Lt()
    emit(kind="device", name=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count,
         torch=torch.__version__, cublaslt=lt.lib._name)
    warm_up()
    for (m, k, n), parts in CASES:
        case(lt, m, k, n, parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
