#!/usr/bin/env bash
# The JAX test-suite on the newest JAX pip gives: Python 3.12 (jax 0.12.x),
# beside the Python 3.11 run (jax 0.10.2) of the README's test command. Both
# ends of the supported range are tested; nothing in between is assumed.
# The venv lives in target/ (ignored, rebuilt when missing); the package is
# installed into it from this checkout, so the run tests this tree.
set -euo pipefail
cd "$(dirname "$0")/.."

python312=""
if command -v pyenv >/dev/null 2>&1; then
    prefix=$(pyenv prefix "$(pyenv latest 3.12 2>/dev/null)" 2>/dev/null || pyenv prefix 3.12.1 2>/dev/null || true)
    [ -n "$prefix" ] && [ -x "$prefix/bin/python3.12" ] && python312="$prefix/bin/python3.12"
fi
if [ -z "$python312" ] && command -v python3.12 >/dev/null 2>&1; then
    python312=$(command -v python3.12)
fi
if [ -z "$python312" ]; then
    echo "scripts/pytest_newest_jax.sh: no Python 3.12 found (pyenv 3.12 or python3.12 on PATH); the" \
         "newest JAX needs it" >&2
    exit 1
fi

venv=target/venv-py312
if [ ! -x "$venv/bin/python" ]; then
    "$python312" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
# --upgrade: a venv kept from an earlier run gets the newest JAX pip has now,
# not the one it had then.
"$venv/bin/python" -m pip install --quiet --upgrade ".[test]"
"$venv/bin/python" - <<'EOF'
import sys
import jax
print(f"newest JAX: jax {jax.__version__} on Python {sys.version.split()[0]}")
major, minor = (int(p) for p in jax.__version__.split(".")[:2])
if (major, minor) < (0, 12):
    sys.exit(f"scripts/pytest_newest_jax.sh: pip gave jax {jax.__version__}; this run tests jax 0.12 or newer")
EOF
# Run from the tests' directory's parent with the installed package (not the
# source tree) on the path, as a user would have it.
exec "$venv/bin/python" -m pytest "$@"
