"""The Rust library: finding it, registering its XLA FFI targets, and the few
plain C functions called through ctypes."""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import pathlib
import threading

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

lib.commfuse_set_timeout_ms.restype = None
lib.commfuse_set_timeout_ms.argtypes = [ctypes.c_uint64]
lib.commfuse_timeout_ms.restype = ctypes.c_uint64
lib.commfuse_timeout_ms.argtypes = []
lib.commfuse_set_transport.restype = ctypes.c_int32
lib.commfuse_set_transport.argtypes = [ctypes.c_char_p]
lib.commfuse_transport.restype = ctypes.c_int32
lib.commfuse_transport.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
lib.commfuse_interrupt.restype = None
lib.commfuse_site_counts.restype = None
lib.commfuse_site_counts.argtypes = [ctypes.POINTER(ctypes.c_int64)]
lib.commfuse_interrupt.argtypes = []
lib.commfuse_cuda_built.restype = ctypes.c_int32
lib.commfuse_cuda_built.argtypes = []
lib.commfuse_nccl_unique_id.restype = ctypes.c_int32
lib.commfuse_nccl_unique_id.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
lib.commfuse_cuda_set_search.restype = None
lib.commfuse_cuda_set_search.argtypes = [ctypes.c_char_p, ctypes.c_uint32]
lib.commfuse_cuda_libraries.restype = ctypes.c_int64
lib.commfuse_cuda_libraries.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
lib.commfuse_cuda_loads_during_execute.restype = ctypes.c_int64
lib.commfuse_cuda_loads_during_execute.argtypes = []
lib.commfuse_reshard_abandon.restype = ctypes.c_int64
lib.commfuse_reshard_abandon.argtypes = [ctypes.c_int64, ctypes.c_uint32]

lib.commfuse_reshard_cuda_connected.restype = ctypes.c_int32
lib.commfuse_reshard_cuda_connected.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t]
lib.commfuse_reshard_cuda_abort.restype = ctypes.c_int32
lib.commfuse_reshard_cuda_abort.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t]

CUDA_BUILT = bool(lib.commfuse_cuda_built())

CPU_TARGET = "commfuse_collective_matmul_cpu"
CUDA_TARGET = "commfuse_collective_matmul_cuda"

RESHARD_SEND_CPU_TARGET = "commfuse_reshard_send_cpu"
RESHARD_RECEIVE_CPU_TARGET = "commfuse_reshard_receive_cpu"
# `commfuse.reshard` on GPUs: its three programs (src/backend/cuda/reshard.rs).
RESHARD_CONNECT_CUDA_TARGET = "commfuse_reshard_connect_cuda"
RESHARD_SEND_CUDA_TARGET = "commfuse_reshard_send_cuda"
RESHARD_RECEIVE_CUDA_TARGET = "commfuse_reshard_receive_cuda"
# Every CUDA handler runs in both stages, registered together on first use.
CUDA_TARGETS = (CUDA_TARGET, RESHARD_CONNECT_CUDA_TARGET, RESHARD_SEND_CUDA_TARGET, RESHARD_RECEIVE_CUDA_TARGET)

# INSTANTIATE decodes a call site's attributes once per compiled instance
# and XLA keeps them with it (src/xla/state.rs); EXECUTE runs the op.
_cpu_handler = jax.ffi.pycapsule(getattr(lib, CPU_TARGET))
jax.ffi.register_ffi_target(CPU_TARGET, {"instantiate": _cpu_handler, "execute": _cpu_handler}, platform="cpu")
for _target in (RESHARD_SEND_CPU_TARGET, RESHARD_RECEIVE_CPU_TARGET):
    jax.ffi.register_ffi_target(_target, jax.ffi.pycapsule(getattr(lib, _target)), platform="cpu")


def jax_cuda_major() -> int:
    """The CUDA major of the installed JAX CUDA plugin (13 first), 0 if none."""
    for major in (13, 12):
        if importlib.util.find_spec(f"jax_cuda{major}_plugin") is not None:
            return major
    return 0


def _package_cuda_major(package: str):
    """The CUDA major of a pip ``nvidia/<package>`` directory: CUDA 13 wheels
    install into ``nvidia/cu13``, CUDA 12 ones into ``nvidia/<library>``;
    ``nvidia/nccl`` (and cuDNN's, NVSHMEM's) serve either (None)."""
    if package.startswith("cu") and package[2:].isdigit():
        return int(package[2:])
    return None if package in ("nccl", "cudnn", "nvshmem", "cusparselt") else 12


def pip_library_dirs(major: int, roots=None) -> list[str]:
    """The ``lib/`` folders of the pip ``nvidia`` packages (``nvidia/cu13/lib``,
    ``nvidia/nccl/lib``, ``nvidia/cublas/lib``, ...): where JAX's CUDA plugin
    finds its libraries; those of CUDA ``major`` first, those of another
    major last. `roots`: the ``nvidia`` namespace package's directories
    (found on ``sys.path`` when None)."""
    if roots is None:
        spec = importlib.util.find_spec("nvidia")
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
    dirs = [p / "lib" for root in roots for p in sorted(pathlib.Path(root).iterdir()) if (p / "lib").is_dir()]

    def rank(d: pathlib.Path) -> int:
        of = _package_cuda_major(d.parent.name)
        return 0 if of == major else 1 if of is None else 2
    return [str(d) for d in sorted(dirs, key=rank)]


# Handed over before the CUDA backend's first use; no library is opened here.
lib.commfuse_cuda_set_search("\n".join(pip_library_dirs(jax_cuda_major())).encode(), jax_cuda_major())


def cuda_built() -> bool:
    """Whether the library was built with the CUDA backend (the `cuda` feature)."""
    return CUDA_BUILT


_cuda_lock = threading.Lock()
_cuda_registered = False


def cuda_target() -> str:
    """The CUDA handler's target name, registered for platform "CUDA" on
    first use with the others of `CUDA_TARGETS`.

    Called when an op is lowered for CUDA, not at import: asking JAX for its
    GPUs initialises its backends, which must not happen before a user's
    ``jax.distributed.initialize``. Raises NotImplementedError saying why when
    the library was built without the ``cuda`` feature or JAX has no GPU.
    """
    global _cuda_registered
    with _cuda_lock:
        if _cuda_registered:
            return CUDA_TARGET
        if not CUDA_BUILT:
            raise NotImplementedError(
                f"the library {LIBRARY_PATH} was built without the `cuda` feature (cargo's "
                "--no-default-features); the default build has it")
        try:
            gpus = jax.devices("gpu")
        except RuntimeError as e:
            raise NotImplementedError(f"JAX has no CUDA backend ({e})") from e
        if not gpus:
            raise NotImplementedError("JAX sees no GPU")
        for target in CUDA_TARGETS:
            try:
                # INITIALIZE sets up each device (kernels compiled to CUBIN and
                # loaded) before the executable runs; EXECUTE runs the op.
                handler = jax.ffi.pycapsule(getattr(lib, target))
                jax.ffi.register_ffi_target(target, {"initialize": handler, "execute": handler}, platform="CUDA")
            except Exception as e:  # an old jaxlib, a missing CUDA plugin: say so at lowering
                raise NotImplementedError(f"registering {target} for CUDA failed: {e}") from e
        _cuda_registered = True
        return CUDA_TARGET


def reshard_cuda_connected(devices) -> bool:
    """Whether the GPU reshard communicator of these device ids (the union
    of two meshes) is live and connected."""
    ids = (ctypes.c_int64 * len(devices))(*devices)
    return bool(lib.commfuse_reshard_cuda_connected(ids, len(devices)))


def reshard_cuda_abort(devices) -> bool:
    """Aborts the GPU reshard communicator of these device ids; whether there was one."""
    ids = (ctypes.c_int64 * len(devices))(*devices)
    return bool(lib.commfuse_reshard_cuda_abort(ids, len(devices)))


def cuda_libraries() -> dict:
    """The CUDA libraries as the CUDA backend finds them (see ``commfuse.cuda_libraries``)."""
    size = 4096
    while True:
        out = ctypes.create_string_buffer(size)
        n = lib.commfuse_cuda_libraries(out, size)
        if n < 0:
            raise RuntimeError("commfuse: listing the CUDA libraries failed")
        if n < size:
            break
        size = n + 1
    found = {}
    for line in out.value.decode(errors="replace").splitlines():
        key, path, version, _how, error = line.split("\t")
        found[key] = {"path": path or None, "version": version or None, "error": error or None}
    return found


def site_counts() -> dict:
    """How this process kept its fused ops' call sites (src/call.rs,
    ``counts``): ``instances`` whose state XLA keeps (one per compiled
    instance of a fused call), ``from_instances`` sites decoded into them
    (one per instance and device), ``from_map`` sites decoded into the
    process's map (where XLA keeps no instance state)."""
    out = (ctypes.c_int64 * 3)()
    lib.commfuse_site_counts(out)
    return dict(zip(("instances", "from_instances", "from_map"), (int(v) for v in out)))


def cuda_loads_during_execute() -> int:
    """Devices whose kernels were loaded inside an execution, not before it (should be 0)."""
    return int(lib.commfuse_cuda_loads_during_execute())


NCCL_ID_BYTES = 128


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (``ncclGetUniqueId``'s 128 bytes), made by the library.

    Raises NotImplementedError when the library was built without the ``cuda``
    feature or cannot load NCCL, RuntimeError on any other NCCL failure.
    """
    out = ctypes.create_string_buffer(NCCL_ID_BYTES)
    error = ctypes.create_string_buffer(512)
    code = lib.commfuse_nccl_unique_id(out, NCCL_ID_BYTES, error, len(error))
    if code == 0:
        return out.raw
    message = error.value.decode(errors="replace")
    if code == 1:
        raise NotImplementedError(message)
    raise RuntimeError(f"commfuse: making an NCCL unique id failed: {message}")


def set_timeout_ms(ms: int) -> None:
    lib.commfuse_set_timeout_ms(ms)


def set_transport(name) -> bool:
    """Sets the GPU transport by name (``None``: back to ``COMMFUSE_TRANSPORT``);
    False for a name the library does not know."""
    return lib.commfuse_set_transport(None if name is None else str(name).encode()) == 0


def transport() -> str:
    """The GPU transport a call would use now: ``auto``, ``copies`` or
    ``nccl``; ValueError when ``COMMFUSE_TRANSPORT`` is malformed."""
    out = ctypes.create_string_buffer(256)
    if lib.commfuse_transport(out, len(out)) != 0:
        raise ValueError(out.value.decode())
    return out.value.decode()


def interrupt() -> None:
    """Ends every wait across devices under way now (see ``_interrupt``)."""
    lib.commfuse_interrupt()


def timeout_ms() -> int:
    """The deadline of cross-device waits in milliseconds, as the library sees
    it now (``configure``'s value, else ``COMMFUSE_TIMEOUT_S``, else the
    default; a malformed variable reads as the default here, and the op's
    first call reports it)."""
    return int(lib.commfuse_timeout_ms())
