"""The Rust crate's module structure: no module uses a module that uses it
back, and the module map (docs/how-it-works.md) names every module there is."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_no_module_uses_a_module_that_uses_it_back():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "module_cycles.py")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_module_map_names_every_module():
    section = (ROOT / "docs" / "how-it-works.md").read_text()
    src = ROOT / "src"
    top = [p.stem if p.is_file() else p.name for p in src.iterdir() if p.name not in ("lib.rs",)]
    missing = [name for name in top if f"src/{name}" not in section]
    cuda = [p.stem for p in (src / "backend" / "cuda").glob("*.rs") if p.stem not in ("mod", "emulate")]
    missing += [f"backend/cuda/{name}" for name in cuda if not re.search(rf"`{name}(\.rs)?`", section)]
    assert not missing, f"the module map in docs/how-it-works.md does not name {missing}"
