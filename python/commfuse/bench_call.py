"""The per-call cost of a fused op against XLA's own collective and dot, on
CPU devices: ``python -m commfuse.bench_call [--devices 8] [--rounds 7]``.

For each group size N (2, 4, 8) and shape (a tiny and a medium gather-matmul
and matmul-reduce-scatter), one jitted shard_map program per way: the
fused op (ring), and jax.lax's collective and dot. Each round times 200 calls
of each way, interleaved, each call waited for (the latency of one call: a
queue of hundreds of 8-device programs stalls JAX's own CPU runtime, with or
without commfuse); the table gives the medians over the rounds, the
difference per call and the ratio. Ratios from one run, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SHAPES = {  # name -> (rows per device, k, n)
    "tiny": (64, 16, 16),
    "medium": (256, 256, 256),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()

    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import commfuse

    print(f"jax {jax.__version__}, Python {sys.version.split()[0]}, {jax.device_count()} CPU devices, "
          f"{os.cpu_count()} cores; medians of {args.rounds} rounds x {args.calls} calls, interleaved, each waited for")
    print(f"{'op':<22} {'shape':<8} {'N':>2} {'fused us':>9} {'xla us':>9} {'+us/call':>9} {'ratio':>6}")
    rng = np.random.default_rng(0)
    for n in (2, 4, 8):
        if n > jax.device_count():
            continue
        mesh = jax.make_mesh((n,), ("i",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
        for shape_name, (m, k, cols) in SHAPES.items():
            cases = {
                "all_gather_matmul": (
                    (rng.standard_normal((m * n, k)).astype(np.float32), rng.standard_normal((k, cols))
                     .astype(np.float32)),
                    (P("i"), P()), P("i"),
                    lambda a, b: commfuse.all_gather_matmul(a, b, "i", schedule="ring"),
                    lambda a, b: jax.lax.all_gather(a, "i", tiled=True) @ jax.lax.pcast(b, ("i",), to="varying")),
                "matmul_reduce_scatter": (
                    (rng.standard_normal((m * n, k * n)).astype(np.float32), rng.standard_normal((k * n, cols))
                     .astype(np.float32)),
                    (P(None, "i"), P("i")), P("i"),
                    lambda a, b: commfuse.matmul_reduce_scatter(a, b, "i", schedule="ring"),
                    lambda a, b: jax.lax.psum_scatter(a @ b, "i", tiled=True)),
            }
            for op, (arrays, in_specs, out_specs, fused_body, plain_body) in cases.items():
                programs = []
                for body in (fused_body, plain_body):
                    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
                    f(*arrays).block_until_ready()
                    programs.append(f)
                times = [[], []]
                for _ in range(args.rounds):
                    for i, f in enumerate(programs):
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            f(*arrays).block_until_ready()
                        times[i].append((time.perf_counter() - start) / args.calls)
                fused, plain = (statistics.median(t) * 1e6 for t in times)
                print(f"{op:<22} {shape_name:<8} {n:>2} {fused:9.0f} {plain:9.0f} {fused - plain:+9.0f} "
                      f"{fused / plain:6.2f}")


if __name__ == "__main__":
    main()
