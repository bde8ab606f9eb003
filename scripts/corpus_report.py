"""Times every program of the corpus (``jax_tests/programs``) plain and
through ``commfuse.overlap`` on CPU devices, and prints one table: fused ops,
the largest relative error of the outputs, and the median step time of each.

    python scripts/corpus_report.py [--devices 8] [--scale 2] [--schedule auto] [--program NAME ...]

Each program's mesh is widened to ``--devices`` (its last axis grows);
``--scale`` multiplies its sizes; ``--program`` picks programs by name (all
by default). Times are medians of 7 runs of 5 steps, plain and overlapped
interleaved, from one run; "XLA's" counts the collectives XLA still runs
(all-gathers, reduce-scatters, all-reduces) plain -> overlapped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--schedule", default="auto")
    parser.add_argument("--program", action="append", default=None)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jax_tests"))
    import jax
    import numpy as np

    import commfuse
    from programs import all_programs, collectives, make_mesh

    def xla_collectives(jitted, inputs) -> int:
        counts = collectives(jitted.lower(*inputs).compile().as_text())
        return sum(counts.get(c, 0) for c in ("all-gather", "reduce-scatter", "all-reduce"))

    rows = []
    for program in all_programs():
        if args.program and program.name not in args.program:
            continue
        axes = dict(program.mesh)
        last = list(axes)[-1]
        axes[last] = args.devices // int(np.prod([v for k, v in axes.items() if k != last]))
        mesh = make_mesh(axes)
        fn, inputs = program.build(mesh, np.random.default_rng(0), scale=args.scale)
        plain = jax.jit(fn)
        fused = jax.jit(commfuse.overlap(fn, schedule=args.schedule))
        want, got = plain(*inputs), fused(*inputs)
        report = commfuse.overlap(fn, schedule=args.schedule)
        report(*inputs)
        count = sum(1 for line in report.last_report if "]: rewrote " in line)
        error = max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)))
                          / max(float(np.max(np.abs(np.asarray(w, np.float64)))), 1e-30))
                    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        times = {"plain": [], "overlap": []}
        for _ in range(7):
            for name, f in (("plain", plain), ("overlap", fused)):
                start = time.perf_counter()
                for _ in range(5):
                    out = f(*inputs)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - start) / 5)
        t_plain, t_fused = (sorted(times[k])[3] * 1e3 for k in ("plain", "overlap"))
        xla = f"{xla_collectives(plain, inputs)} -> {xla_collectives(fused, inputs)}"
        rows.append((program.name, axes, count, xla, error, t_plain, t_fused))
    print(f"{'program':<20} {'mesh':<20} {'fused':>5} {'XLA':>8} {'max rel err':>11} {'plain ms':>9} "
          f"{'overlap ms':>10} {'speedup':>7}")
    for name, axes, count, xla, error, t_plain, t_fused in rows:
        mesh = "x".join(f"{k}={v}" for k, v in axes.items())
        print(f"{name:<20} {mesh:<20} {count:>5} {xla:>8} {error:>11.1e} {t_plain:>9.2f} {t_fused:>10.2f} "
              f"{t_plain / t_fused:>6.2f}x")


if __name__ == "__main__":
    main()
