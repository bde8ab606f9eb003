"""The Rust library: finding it, registering its XLA FFI targets, and the few
plain C functions called through ctypes."""

from __future__ import annotations

import ctypes
import glob
import os
import pathlib

import jax

_HERE = pathlib.Path(__file__).resolve().parent
_TARGETS = ("all_gather_matmul", "matmul_reduce_scatter")


def _find_library() -> pathlib.Path:
    explicit = os.environ.get("COMMFUSE_LIBRARY")
    if explicit:
        return pathlib.Path(explicit)
    # Installed: setuptools-rust puts the cdylib inside the package.
    found = sorted(glob.glob(str(_HERE / "_commfuse*.so")))
    if found:
        return pathlib.Path(found[0])
    # A source checkout built with `cargo build --release`.
    built = _HERE.parent.parent / "target" / "release" / "libcommfuse.so"
    if built.exists():
        return built
    raise ImportError(
        "commfuse: the native library is missing. Install the package with "
        "`pip install .` from the repository root, or set COMMFUSE_LIBRARY to "
        "the path of libcommfuse.so."
    )


LIBRARY_PATH = _find_library()
lib = ctypes.CDLL(str(LIBRARY_PATH))

lib.commfuse_workspace_bytes.restype = ctypes.c_int64
lib.commfuse_workspace_bytes.argtypes = [ctypes.c_int32, ctypes.c_int32] + [ctypes.c_int64] * 4 + [ctypes.c_int32] * 2
lib.commfuse_set_timeout_ms.restype = None
lib.commfuse_set_timeout_ms.argtypes = [ctypes.c_uint64]
lib.commfuse_cuda_built.restype = ctypes.c_int32
lib.commfuse_cuda_built.argtypes = []

CUDA_BUILT = bool(lib.commfuse_cuda_built())


def target_name(op: str, platform: str) -> str:
    return f"commfuse_{op}_{platform}"


for _op in _TARGETS:
    _name = target_name(_op, "cpu")
    jax.ffi.register_ffi_target(_name, jax.ffi.pycapsule(getattr(lib, _name)), platform="cpu")


def workspace_bytes(op_code: int, schedule_code: int, ranks: int, block_rows: int, k: int, n: int,
                    input_code: int, output_code: int) -> int:
    size = lib.commfuse_workspace_bytes(op_code, schedule_code, ranks, block_rows, k, n, input_code, output_code)
    if size < 0:
        raise ValueError(
            f"commfuse: no workspace size for op {op_code}, schedule {schedule_code}, {ranks} ranks, "
            f"block {block_rows}x{k}, n={n}, dtypes {input_code}->{output_code}")
    return size


def set_timeout_ms(ms: int) -> None:
    lib.commfuse_set_timeout_ms(ms)
