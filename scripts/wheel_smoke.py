"""The wheel a user installs, checked in the venv it was installed into
(`.ci/run` builds it, repairs it to a manylinux wheel and installs it into a
fresh venv per Python): the package loads its own library from site-packages,
a fused op runs on CPU devices against jnp, and the CUDA backend (in the
default build) finds pip's CUDA libraries of each major with their versions.

    python scripts/wheel_smoke.py --cuda-roots 12=DIR,13=DIR

Each DIR is a `pip install --target` of that major's nvidia packages; each
major is checked in a fresh process (a library is loaded once per process).
Exits non-zero, saying what failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_OP = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import json, pathlib, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import commfuse
lib = pathlib.Path(commfuse.LIBRARY_PATH).resolve()
assert "site-packages" in lib.parts, f"commfuse loaded {lib}, not the installed wheel's library"
mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
x = jax.random.normal(jax.random.key(0), (32, 16))
w = jax.random.normal(jax.random.key(1), (16, 8))
# A schedule asked for (auto would rightly leave a product this small to jax.lax): the
# installed library's fused op runs.
f = jax.jit(jax.shard_map(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule="ring"), mesh=mesh,
                          in_specs=(P("x", None), P()), out_specs=P("x")))
assert "commfuse_collective_matmul_cpu" in f.lower(x, w).compile().as_text(), "no fused op in the program"
# Every device holds the whole product: four copies, stacked.
for block in np.asarray(f(x, w)).reshape(4, 32, 8):
    np.testing.assert_allclose(block, np.asarray(x @ w), rtol=1e-5, atol=1e-5)
print(json.dumps({"library": str(lib), "jax": jax.__version__}))
"""

_CUDA = """
import json, commfuse
print(json.dumps(commfuse.cuda_libraries()))
"""


def run(script: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"wheel smoke test failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda-roots", default="", help="MAJOR=DIR,... pip installs of the nvidia packages")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("COMMFUSE_LIBRARY", "PYTHONPATH", "COMMFUSE_CUDA_LIBRARY_PATH")}
    ran = run(_OP, env)
    print(f"wheel smoke: all_gather_matmul on 4 CPU devices matches jnp (jax {ran['jax']}, {ran['library']})")
    for entry in filter(None, args.cuda_roots.split(",")):
        major, root = entry.split("=", 1)
        root = os.path.realpath(root)
        found = run(_CUDA, dict(env, PYTHONPATH=root))
        for key in ("cublas", "cublasLt", "nccl", "nvrtc"):
            lib = found.get(key) or {}
            if lib.get("error") is not None or not os.path.realpath(lib.get("path") or "").startswith(root + os.sep):
                sys.exit(f"wheel smoke: CUDA {major}: {key} not found in {root}: {lib}")
            want = "2" if key == "nccl" else major
            if lib["version"].split(".")[0] != want:
                sys.exit(f"wheel smoke: CUDA {major}: {key} is version {lib['version']}")
        print(f"wheel smoke: CUDA {major}: " + ", ".join(f"{k} {found[k]['version']}" for k in
                                                        ("cublas", "cublasLt", "nccl", "nvrtc")))


if __name__ == "__main__":
    main()
