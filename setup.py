"""Builds the Rust library (`cargo build --release`, through setuptools-rust)
into the package as a plain shared library: Python loads it with ctypes and
registers its XLA FFI handlers with jax.ffi, so no Python bindings are needed."""

import os

from setuptools import setup
from setuptools_rust import Binding, RustExtension

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
    zip_safe=False,
)
