"""Cross-mesh resharding benchmark on CPU devices: `commfuse.reshard`'s
broadcast and direct schedules (and auto's pick) under the link model, and
with real in-process links beside `jax.device_put`.

    python -m commfuse.bench_reshard [--reps 7] [--gbytes-per-s 1.0]

Each case moves one float32 array between two meshes of the 16 CPU devices.
Times are medians of one run, the schedules of a case timed round-robin;
ratios are printed from that run. The link model (COMMFUSE_CPU_LINK,
`switch`: one in and one out port per device) throttles commfuse's transport
only, so `jax.device_put` appears with real links alone.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX creates its CPU backend
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=16"]).strip()

import argparse
import statistics
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import commfuse

LINK_VAR = "COMMFUSE_CPU_LINK"


def cases(devices):
    """(label, source sharding, destination sharding, shape)."""
    d = devices
    mesh = lambda ids, shape, names: Mesh(np.array([d[i] for i in ids]).reshape(shape), names)
    two = mesh([0, 1], (2,), ("s",))
    return [
        ("2 sources (rows) -> 4 replicated", NamedSharding(two, P("s")),
         NamedSharding(mesh(range(2, 6), (4,), ("t",)), P()), (2048, 1024)),
        ("2 sources (rows) -> 8 replicated", NamedSharding(two, P("s")),
         NamedSharding(mesh(range(2, 10), (8,), ("t",)), P()), (2048, 1024)),
        ("2 replicas -> 8 replicated", NamedSharding(two, P()),
         NamedSharding(mesh(range(2, 10), (8,), ("t",)), P()), (2048, 1024)),
        ("rows on 4 -> columns on 4", NamedSharding(mesh(range(4), (4,), ("s",)), P("s")),
         NamedSharding(mesh(range(4, 8), (4,), ("t",)), P(None, "t")), (2048, 1024)),
        ("2-D 2x2 (rows, cols) -> 2x4 (rows on dp, replicated on tp)",
         NamedSharding(mesh(range(4), (2, 2), ("a", "b")), P("a", "b")),
         NamedSharding(mesh(range(4, 12), (2, 4), ("dp", "tp")), P("dp", None)), (2048, 1024)),
    ]


def _time(fns, reps):
    for f in fns.values():
        jax.block_until_ready(f())
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def run(reps: int, gbytes_per_s: float):
    rng = np.random.default_rng(0)
    link = f"gbytes_per_s={gbytes_per_s},latency_us=20,topology=switch"
    print(f"float32; link model: {link}; ms (median of {reps}); x = ratio to direct in the same run")
    print(f"{'case':58s} {'MiB':>5s} {'direct':>8s} {'broadcast':>10s} {'auto':>8s} {'bcast x':>8s} "
          f"{'| real: device_put':>18s} {'direct':>8s} {'broadcast':>10s}")
    rows = []
    for label, src, dst, shape in cases(jax.devices()):
        x = jax.device_put(rng.standard_normal(shape, np.float32), src)
        fns = {s: (lambda s=s: commfuse.reshard(x, dst, schedule=s)) for s in ("direct", "broadcast", "auto")}
        os.environ[LINK_VAR] = link
        try:
            modelled = _time(fns, reps)
        finally:
            os.environ.pop(LINK_VAR, None)
        real = _time({"device_put": lambda: jax.device_put(x, dst), **fns}, reps)
        mib = x.nbytes / 2**20
        ratio = modelled["broadcast"] / modelled["direct"]
        rows.append((label, ratio))
        print(f"{label:58s} {mib:5.1f} {modelled['direct'] * 1e3:8.2f} {modelled['broadcast'] * 1e3:10.2f} "
              f"{modelled['auto'] * 1e3:8.2f} {ratio:8.2f} {real['device_put'] * 1e3:18.2f} "
              f"{real['direct'] * 1e3:8.2f} {real['broadcast'] * 1e3:10.2f}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--gbytes-per-s", type=float, default=1.0, help="the link model's bandwidth per port")
    args = parser.parse_args()
    run(args.reps, args.gbytes_per_s)


if __name__ == "__main__":
    main()
