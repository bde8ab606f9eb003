"""Every child script the test-suite runs in a subprocess compiles, here, on
any host: the tests that run them may be skipped (no GPU, one GPU), and a
syntax error in a skipped test's script would hide until a GPU host runs it.
A child script is a module-level string named ``*_SCRIPT`` in a test module."""

from __future__ import annotations

import importlib
import pathlib

import pytest

_MODULES = sorted(p.stem for p in pathlib.Path(__file__).parent.glob("test_*.py"))


def _scripts():
    for name in _MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if attr.endswith("_SCRIPT") and isinstance(value, str):
                yield pytest.param(name, attr, value, id=f"{name}.{attr}")


_FOUND = list(_scripts())


def test_the_gpu_child_scripts_are_found():
    # The GPU tests' scripts are the ones a CPU host never runs.
    found = {p.id for p in _FOUND}
    assert {"test_gpu._MISSING_PEER_SCRIPT", "test_gpu._TWO_PROCESS_SCRIPT"} <= found, found


@pytest.mark.parametrize("module,name,text", _FOUND)
def test_child_script_compiles(module, name, text):
    compile(text, f"{module}.{name}", "exec")
