"""The measured figures ``schedule="auto"`` decides by, measured once per
machine and kept on disk, so that the same program on the same machine gets
the same decisions in every process.

A figure (this host's GEMM rate, a fused call's fixed cost over N of its CPU
devices) is measured robustly the first time a process needs it — the median
of several rounds, each the fastest of interleaved repetitions — and written
to ``$COMMFUSE_CACHE_DIR`` (default ``~/.cache/commfuse``) in a file named by
what the figures depend on: the CPU model and core count, the JAX and jaxlib
versions, and the library build. Every later process reads it. A file that
cannot be written (a read-only home) leaves the figures in this process only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import platform
import statistics
import tempfile
import threading

import jax

from . import _native

CACHE_VAR = "COMMFUSE_CACHE_DIR"
_LOCK = threading.Lock()
_MEMORY: dict = {}   # this process's figures, by name


def cache_dir() -> pathlib.Path:
    explicit = os.environ.get(CACHE_VAR, "").strip()
    if explicit:
        return pathlib.Path(explicit)
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "commfuse"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint() -> dict:
    """What the figures depend on."""
    library = pathlib.Path(_native.LIBRARY_PATH)
    try:
        stat = library.stat()
        build = f"{stat.st_size}-{int(stat.st_mtime)}"
    except OSError:
        build = "unknown"
    import jaxlib

    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "machine": platform.machine(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "library": build}


def path() -> pathlib.Path:
    """The file of this machine's figures."""
    key = json.dumps(fingerprint(), sort_keys=True)
    return cache_dir() / f"calibration-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _load(file: pathlib.Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("figures", {}) if isinstance(data, dict) else {}


def _store(file: pathlib.Path, figures: dict) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=file.parent, prefix=".calibration-", delete=False) as tmp:
            json.dump({"fingerprint": fingerprint(), "figures": figures}, tmp, indent=1, sort_keys=True)
        os.replace(tmp.name, file)  # atomic: a reader sees the old file or the new one
    except OSError:
        pass


def figure(name: str, measure) -> float:
    """The figure `name`: this process's, else the machine's cached one, else
    ``measure()`` (once, then cached; an exception is raised, not cached).
    `measure` runs on a thread of its own: callers are usually tracing, and
    JAX's trace and mesh contexts are the calling thread's. Processes take
    turns on the file (a lock beside it), so a figure is measured once."""
    with _LOCK:
        if name in _MEMORY:
            return _MEMORY[name]
        file = path()
        with _file_lock(file):
            cached = _load(file)
            if name not in cached:
                cached[name] = _measure_off_thread(measure)
                _store(file, cached)
        _MEMORY[name] = float(cached[name])
        return _MEMORY[name]


def remember(name: str, value: float) -> None:
    """`value` as figure `name` for this process only (not written)."""
    with _LOCK:
        _MEMORY[name] = value


@contextlib.contextmanager
def _file_lock(file: pathlib.Path):
    """An exclusive lock on ``file``'s lock file, while held; none where the
    cache folder cannot be written (then each process measures for itself)."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        handle = open(file.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass  # no locking here: at worst two processes measure the same figure
        yield


def _measure_off_thread(measure) -> float:
    result = []

    def run():
        try:
            result.append(float(measure()))
        except Exception as e:  # noqa: BLE001 - reported to the caller below
            result.append(e)

    thread = threading.Thread(target=run, name="commfuse-calibration")
    thread.start()
    thread.join()
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def robust(sample, rounds: int = 5) -> float:
    """The median of `rounds` calls of `sample()`: one disturbed round (other
    work on the host) moves it nowhere."""
    return statistics.median(sample() for _ in range(rounds))


def forget() -> None:
    """Drops this process's figures (the file stays): tests that write their own."""
    with _LOCK:
        _MEMORY.clear()
