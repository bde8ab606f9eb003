"""Shared helpers for the commfuse JAX test-suite.

The suite runs on the host (CPU) platform with 16 virtual devices.  XLA reads
``XLA_FLAGS`` when JAX creates its first backend, so the flag is set here,
before anything imports jax.

Test modules import the helpers directly (``from conftest import ...``); the
most common ones are also available as fixtures.
"""

from __future__ import annotations

import os
import re
import sys

# --------------------------------------------------------------------------
# Must happen before jax is imported (and, in any case, before jax creates its
# CPU backend).  Keep whatever the user already had in XLA_FLAGS, but make the
# device count ours.
# --------------------------------------------------------------------------
NUM_HOST_DEVICES = 16
_COUNT_FLAG = "--xla_force_host_platform_device_count"
_flags = re.sub(_COUNT_FLAG + r"=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
_flags.append(f"{_COUNT_FLAG}={NUM_HOST_DEVICES}")
os.environ["XLA_FLAGS"] = " ".join(_flags)
# The suite's fused-path tests run tiny shapes, where schedule="auto" would
# (rightly) run jax.lax's collective and dot instead; the tests of that
# choice turn it back on (COMMFUSE_AUTO_UNFUSED=1).
os.environ.setdefault("COMMFUSE_AUTO_UNFUSED", "0")

import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

try:  # an editable install is the normal way; fall back to the source tree.
    import commfuse  # noqa: E402,F401
except ImportError:  # pragma: no cover - depends on the environment
    sys.path.insert(0, str(REPO_ROOT / "python"))
    import commfuse  # noqa: E402,F401

# Platform whose devices the meshes are built from.  The multi-device tests
# need many devices, which only the host platform can fake, so it is "cpu"
# unless overridden.
TEST_PLATFORM = os.environ.get("COMMFUSE_TEST_PLATFORM", "cpu")

SCHEDULES = ("ring", "bidirectional", "sequential", "auto")

# Relative tolerances, applied against max |reference| (see assert_close).
_TOLERANCES = {
    np.dtype(np.float64): 1e-10,
    np.dtype(np.float32): 1e-4,
    np.dtype(jnp.bfloat16): 2e-2,
    np.dtype(np.float16): 1e-2,
}


# --------------------------------------------------------------------------
# pytest hooks
# --------------------------------------------------------------------------
def _have_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


# COMMFUSE_REQUIRE_GPU=1 (the GPU host's check): the GPU tests fail instead
# of skipping when JAX sees no GPU.
_REQUIRE_GPU = os.environ.get("COMMFUSE_REQUIRE_GPU") == "1"


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _have_gpu() and not _REQUIRE_GPU:
        skip = pytest.mark.skip(reason="no GPU visible to JAX")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_runtest_setup(item):
    if _REQUIRE_GPU and "gpu" in item.keywords and not _have_gpu():
        pytest.fail("COMMFUSE_REQUIRE_GPU=1 but JAX sees no GPU", pytrace=False)


# The skips a machine without a GPU expects. Any other (a package missing,
# a module that cannot be imported) would hide part of the suite quietly:
# it fails the run, unless COMMFUSE_ALLOW_SKIPS=1 (a partial environment).
_EXPECTED_SKIPS = ("no GPU visible to JAX", "needs a CUDA build of the library")
_UNEXPECTED_SKIPS: list = []


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _note_skip(report):
    if report.skipped and not any(why in _skip_reason(report) for why in _EXPECTED_SKIPS):
        _UNEXPECTED_SKIPS.append(f"{report.nodeid}: {_skip_reason(report)}")


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):
    _note_skip(report)


def pytest_report_header(config):
    jaxlib = getattr(jax.lib, "__version__", "?")
    return f"commfuse tests: jax {jax.__version__}, jaxlib {jaxlib}, {NUM_HOST_DEVICES} CPU devices"


def pytest_terminal_summary(terminalreporter):
    if _UNEXPECTED_SKIPS:
        terminalreporter.section("unexpected skips (they fail the run; COMMFUSE_ALLOW_SKIPS=1 lets them pass)")
        for line in _UNEXPECTED_SKIPS:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    if _UNEXPECTED_SKIPS and os.environ.get("COMMFUSE_ALLOW_SKIPS") != "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --------------------------------------------------------------------------
# Meshes and devices
# --------------------------------------------------------------------------
def devices(n: int, platform: str | None = None):
    """The first ``n`` devices of the test platform (skips if there are fewer)."""
    devs = jax.devices(platform or TEST_PLATFORM)
    if len(devs) < n:
        pytest.skip(f"needs {n} {platform or TEST_PLATFORM} devices, have {len(devs)}")
    return devs[:n]


def make_mesh(shape, names, platform: str | None = None):
    shape = tuple(shape)
    names = tuple(names)
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, devices=devices(n, platform))


def mesh1d(n: int, name: str = "x", platform: str | None = None):
    """A 1-D mesh of ``n`` devices with axis ``name``."""
    return make_mesh((n,), (name,), platform)


# --------------------------------------------------------------------------
# Running code under jit(shard_map)
# --------------------------------------------------------------------------
def place(x, mesh, spec):
    """``device_put`` ``x`` with ``NamedSharding(mesh, spec)``."""
    return jax.device_put(x, NamedSharding(mesh, spec))


def sharded_fn(fn, mesh, in_specs):
    """``jax.jit(jax.shard_map(...))`` of ``fn`` returning per-device outputs.

    Every output leaf ``y`` of ``fn`` (a per-device value inside shard_map) is
    returned as a global array of shape ``(mesh.size, *y.shape)`` whose entry
    ``i`` is the value on device ``i`` of the mesh (row-major over the mesh
    axes), whatever ``fn`` computes.  No replication or sharding semantics of
    the outputs are assumed.
    """
    all_axes = tuple(mesh.axis_names)

    def body(*args):
        return jax.tree.map(lambda y: y[None], fn(*args))

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=P(all_axes))
    )


def run_sharded(fn, mesh, in_specs, *args):
    """Run ``fn`` on ``args`` under jit(shard_map) with correctly placed inputs.

    ``args`` are global arrays (numpy or jax); each is placed with the matching
    entry of ``in_specs`` before the call.  Returns the per-device outputs as
    numpy arrays of shape ``(mesh.size, *local_shape)`` (see ``sharded_fn``).
    """
    in_specs = tuple(in_specs)
    assert len(in_specs) == len(args), "one in_spec per argument"
    placed = [place(a, mesh, s) for a, s in zip(args, in_specs)]
    out = sharded_fn(fn, mesh, in_specs)(*placed)
    return jax.tree.map(np.asarray, out)


def spec_on(ndim: int, dim: int, axis) -> P:
    """A PartitionSpec of rank ``ndim`` sharding dimension ``dim`` over ``axis``."""
    entries = [None] * ndim
    entries[dim] = axis
    return P(*entries)


# --------------------------------------------------------------------------
# The literal jax.lax definitions of the two ops (what commfuse must equal)
# --------------------------------------------------------------------------
def lax_all_gather_matmul(
    x, w, axis_name, *, gather_dimension=0, precision=None, preferred_element_type=None
):
    xg = jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    return jnp.matmul(
        xg, w, precision=precision, preferred_element_type=preferred_element_type
    )


def lax_matmul_reduce_scatter(
    x, w, axis_name, *, scatter_dimension=0, precision=None, preferred_element_type=None
):
    y = jnp.matmul(x, w, precision=precision, preferred_element_type=preferred_element_type)
    return jax.lax.psum_scatter(
        y, axis_name, scatter_dimension=scatter_dimension, tiled=True
    )


# --------------------------------------------------------------------------
# Inputs and comparisons
# --------------------------------------------------------------------------
def rand(shape, dtype=np.float32, seed=0, *, rng=None):
    """Uniform(-1, 1) values (never all zeros) from a seeded numpy RNG."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    a = rng.uniform(-1.0, 1.0, size=tuple(shape))
    return a.astype(np.dtype(dtype))


def tolerance(dtype) -> float:
    return _TOLERANCES[np.dtype(dtype)]


def assert_close(actual, desired, dtype=None, *, rtol=None, err_msg=""):
    """Compare ``actual`` to ``desired`` relative to max |desired|.

    Both are compared in float64 (exact for every supported dtype).  The
    tolerance is ``rtol``, else the one of ``dtype``, else that of the less
    precise of the two arrays' dtypes; the absolute tolerance is ``rtol * max|desired|``, so elements
    near zero are judged against the magnitude of the whole result.
    """
    actual = np.asarray(actual)
    desired = np.asarray(desired)
    assert actual.shape == desired.shape, (
        f"shape mismatch: got {actual.shape}, expected {desired.shape}. {err_msg}"
    )
    if rtol is None:
        if dtype is not None:
            rtol = tolerance(dtype)
        else:  # the less precise of the two
            rtol = max(tolerance(actual.dtype), tolerance(desired.dtype))
    a64 = actual.astype(np.float64)
    d64 = desired.astype(np.float64)
    assert np.all(np.isfinite(d64)), "reference has non-finite values"
    assert np.all(np.isfinite(a64)), f"result has non-finite values. {err_msg}"
    scale = float(np.max(np.abs(d64))) if d64.size else 0.0
    scale = max(scale, np.finfo(np.float32).tiny)
    np.testing.assert_allclose(
        a64, d64, rtol=rtol, atol=rtol * scale, equal_nan=False, err_msg=err_msg
    )


def varying_axes(value):
    """The set of mesh axes a traced value is typed as varying over, or None
    if this JAX version does not expose that information."""
    aval = jax.typeof(value)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and getattr(mat, "varying", None) is not None:
        return frozenset(mat.varying)
    return None


def enable_x64():
    """Context manager enabling float64 (public API across JAX versions)."""
    ctx = getattr(jax, "enable_x64", None)
    if ctx is not None:
        return ctx(True)
    from jax.experimental import enable_x64 as _legacy  # older JAX

    return _legacy()


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------
@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test id (stable across runs)."""
    seed = abs(hash_str(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)


def hash_str(s: str) -> int:
    # Python's hash() is salted per process; use a stable one.
    h = 0
    for ch in s.encode():
        h = (h * 131 + ch) % (2**61 - 1)
    return h


@pytest.fixture
def x64():
    with enable_x64():
        yield


@pytest.fixture
def restore_commfuse_timeout():
    """Puts commfuse's timeout back to the environment's (or the default) afterwards."""
    yield
    commfuse.configure(timeout_s=None)


@pytest.fixture
def declining(monkeypatch, tmp_path):
    """``auto`` with its veto on and this machine's figures replaced by a
    fused call costing a second: it declines every product (a cache of its
    own in `tmp_path`, so the machine's figures are not touched)."""
    from commfuse import _calibration

    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "1")
    monkeypatch.setenv(_calibration.CACHE_VAR, str(tmp_path))
    _calibration.forget()
    figures = {f"cpu_call_overhead_s/{n}": 1.0 for n in range(2, 17)}
    figures["cpu_gemm_gflops"] = 50.0
    _calibration.path().write_text(__import__("json").dumps({"figures": figures}))
    yield
    _calibration.forget()


def rewrites_as_written(fn, args, fused: int, why: str = ""):
    """`overlap(fn)` (every candidate it can, "ring") gives `fn`'s numbers
    with `fused` rewrites; with none, its report says `why`."""
    import commfuse

    rewritten = commfuse.overlap(fn, schedule="ring")
    np.testing.assert_allclose(np.asarray(jax.jit(rewritten)(*args)), np.asarray(jax.jit(fn)(*args)),
                               rtol=1e-5, atol=1e-5)
    report = "\n".join(rewritten.last_report)
    assert report.count("rewrote") == fused, report
    if not fused:
        assert why in report, report
