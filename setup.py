"""Builds the Rust library (`cargo build --release`, through setuptools-rust)
into the package as a plain shared library: Python loads it with ctypes and
registers its XLA FFI handlers with jax.ffi, so no Python bindings are needed."""

import os

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import Binding, RustExtension


class PlatformWheel(bdist_wheel):
    """The library is loaded with ctypes, not imported as an extension module:
    one wheel per platform serves every Python (py3-none-<platform>)."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


features = [f for f in os.environ.get("COMMFUSE_FEATURES", "").split(",") if f]

setup(
    rust_extensions=[
        RustExtension(
            "commfuse._commfuse",
            path="Cargo.toml",
            binding=Binding.NoBinding,
            features=features,
            py_limited_api=False,
            # Always optimised: an editable (`pip install -e .`) debug build
            # multiplies 100x slower.
            debug=False,
        )
    ],
    cmdclass={"bdist_wheel": PlatformWheel},
    zip_safe=False,
)
