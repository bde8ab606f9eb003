"""The Rust library: finding it, registering its XLA FFI targets, and the few
plain C functions called through ctypes."""

from __future__ import annotations

import ctypes
import glob
import os
import pathlib

import jax

_HERE = pathlib.Path(__file__).resolve().parent


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

_I64P = ctypes.POINTER(ctypes.c_int64)
lib.commfuse_workspace_bytes.restype = ctypes.c_int64
lib.commfuse_workspace_bytes.argtypes = [ctypes.c_int64] * 4 + [_I64P, ctypes.c_size_t] * 3 + [
    ctypes.c_uint32, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_size_t]
lib.commfuse_set_timeout_ms.restype = None
lib.commfuse_set_timeout_ms.argtypes = [ctypes.c_uint64]
lib.commfuse_cuda_built.restype = ctypes.c_int32
lib.commfuse_cuda_built.argtypes = []

CUDA_BUILT = bool(lib.commfuse_cuda_built())
CPU_TARGET = "commfuse_collective_matmul_cpu"

jax.ffi.register_ffi_target(CPU_TARGET, jax.ffi.pycapsule(getattr(lib, CPU_TARGET)), platform="cpu")


def workspace_bytes(kind: int, schedule: int, ranks: int, dimension: int, x_shape, w_shape, out_shape,
                    input_code: int, output_code: int) -> int:
    """Bytes of workspace the Rust plan needs for this call."""
    def dims(shape):
        return (ctypes.c_int64 * max(1, len(shape)))(*shape), len(shape)

    error = ctypes.create_string_buffer(512)
    size = lib.commfuse_workspace_bytes(kind, schedule, ranks, dimension, *dims(x_shape), *dims(w_shape),
                                        *dims(out_shape), input_code, output_code, error, len(error))
    if size < 0:
        raise ValueError(error.value.decode(errors="replace"))
    return size


def set_timeout_ms(ms: int) -> None:
    lib.commfuse_set_timeout_ms(ms)
