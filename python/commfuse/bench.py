"""Schedule benchmark on CPU devices: fused schedules against XLA unfused,
under real in-process links and under the link model (COMMFUSE_CPU_LINK)
set so that T_comm is a given multiple of T_compute.

    python -m commfuse.bench [--quick] [--out bench_out]

For each (op, N, shape, dtype, link, schedule) it measures the median time of
one jitted step over all devices (after a warm-up, on random inputs) and its
spread, and reports T_compute (the same local matmuls with no communication),
T_comm (what the link model charges one device for the collective), the
floor max(T_compute, T_comm), the exposed communication (time - T_compute)
and the ratios to the floor and to XLA unfused. It writes a CSV and a PNG
plot and prints a short table last.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX creates its CPU backend
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()

import argparse
import csv
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import commfuse

LINK_VAR = "COMMFUSE_CPU_LINK"
LATENCY_US = 20.0


def _median_and_spread(fn, args, reps):
    jax.block_until_ready(fn(*args))  # compile and warm up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    times = np.array(times)
    return float(np.median(times)), float(np.percentile(times, 75) - np.percentile(times, 25))


def _programs(op, mesh, schedule, slices):
    """(step function, in_specs) of one op under one schedule ("xla" = unfused)."""
    if op == "all_gather_matmul":
        specs, out = (P("x"), P()), P("x")
        if schedule == "xla":
            body = lambda a, b: jax.lax.all_gather(a, "x", tiled=True) @ b
        else:
            kw = {"slices": slices} if schedule == "sliced" else {}
            body = lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule=schedule, **kw)
    else:
        specs, out = (P(), P()), P("x")
        if schedule == "xla":
            body = lambda a, b: jax.lax.psum_scatter(a @ b, "x", tiled=True)
        else:
            kw = {"slices": slices} if schedule == "sliced" else {}
            body = lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", schedule=schedule, **kw)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out)), specs


def _compute_only(op, mesh, n):
    """The same local matmuls with no communication."""
    if op == "all_gather_matmul":
        body = lambda a, b: jnp.concatenate([a] * n) @ b
        specs = (P("x"), P())
    else:
        body = lambda a, b: a @ b
        specs = (P(), P())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"))), specs


def _inputs(op, mesh, n, m, k, cols, dtype, rng):
    rows = n * m  # AG: the global x; RS: each rank's x holds all N blocks
    x = rng.uniform(-1, 1, (rows, k)).astype(dtype)
    w = rng.uniform(-1, 1, (k, cols)).astype(dtype)
    return x, w


def _comm_bytes(op, n, m, k, cols, dtype):
    """Bytes one device sends (and receives) for the collective in a ring."""
    if op == "all_gather_matmul":
        return (n - 1) * m * k * np.dtype(dtype).itemsize
    return (n - 1) * m * cols * 4  # partial sums travel in f32 (the accumulator)


def run(quick: bool, out_dir: str, reps: int):
    rng = np.random.default_rng(0)
    devices = jax.devices()
    ranks_list = [4] if quick else [4, 8]
    shapes = [(128, 512, 512)] if quick else [(128, 512, 512), (256, 512, 1024), (256, 1024, 1024)]
    dtypes = [np.float32] if quick else [np.float32, jnp.bfloat16]
    ratios = [None, 0.75, 1.0, 2.0]
    schedules = [("xla", 0), ("sequential", 0)] + [("sliced", k) for k in (2, 4, 8)] + [
        ("ring", 0), ("bidirectional", 0), ("auto", 0)]
    rows = []
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        for n in ranks_list:
            mesh = jax.make_mesh((n,), ("x",), devices=devices[:n])
            for (m, k, cols) in shapes:
                for dtype in dtypes:
                    x, w = _inputs(op, mesh, n, m, k, cols, dtype, rng)
                    compute_fn, specs = _compute_only(op, mesh, n)
                    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
                    os.environ.pop(LINK_VAR, None)
                    t_compute, _ = _median_and_spread(compute_fn, args, reps)
                    comm_bytes = _comm_bytes(op, n, m, k, cols, dtype)
                    xla_time = None
                    for ratio in ratios:
                        if ratio is None:
                            os.environ.pop(LINK_VAR, None)
                            t_comm, link = None, "real"
                        else:
                            t_comm = ratio * t_compute
                            steps = n - 1
                            gbps = comm_bytes / max(t_comm - steps * LATENCY_US * 1e-6, 1e-9) / 1e9
                            os.environ[LINK_VAR] = f"gbytes_per_s={gbps:.6f},latency_us={LATENCY_US},topology=switch"
                            link = f"{ratio}x"
                        for schedule, slices in schedules:
                            if schedule == "xla" and ratio is not None:
                                continue  # the link model throttles commfuse's transport only
                            name = f"sliced({slices})" if schedule == "sliced" else schedule
                            try:
                                fn, specs = _programs(op, mesh, schedule, slices)
                                args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
                                t, spread = _median_and_spread(fn, args, reps)
                            except (ValueError, TypeError) as e:  # e.g. a schedule this build lacks
                                print(f"skip {op} {name}: {e}", file=sys.stderr)
                                continue
                            if schedule == "xla":
                                xla_time = t
                            floor = max(t_compute, t_comm or 0.0)
                            rows.append({
                                "op": op, "N": n, "shape": f"{m}x{k}x{cols}", "dtype": np.dtype(dtype).name,
                                "link": link, "schedule": name, "median_ms": t * 1e3, "spread_ms": spread * 1e3,
                                "t_compute_ms": t_compute * 1e3,
                                "t_comm_ms": None if t_comm is None else t_comm * 1e3,
                                "floor_ms": floor * 1e3, "exposed_ms": (t - t_compute) * 1e3,
                                "vs_floor": t / floor,
                                "vs_xla": None if (xla_time is None or ratio is not None) else t / xla_time,
                            })
                            print(f"{op:22s} N={n} {m}x{k}x{cols} {np.dtype(dtype).name:8s} link={link:5s} "
                                  f"{name:14s} {t * 1e3:9.2f} ms  floor x{t / floor:5.2f}", flush=True)
    os.environ.pop(LINK_VAR, None)
    os.makedirs(out_dir, exist_ok=True)
    _write_csv(rows, os.path.join(out_dir, "bench.csv"))
    _plot(rows, os.path.join(out_dir, "bench.png"))
    _print_table(rows)


def _write_csv(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def _plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install '.[bench]')")
        return
    panels = sorted({(r["op"], r["N"], r["shape"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3 * len(panels)), squeeze=False)
    for ax, (op, n, shape, dtype) in zip(axes[:, 0], panels):
        sel = [r for r in rows if (r["op"], r["N"], r["shape"], r["dtype"]) == (op, n, shape, dtype)]
        links = sorted({r["link"] for r in sel}, key=lambda s: (s != "real", s))
        names = list(dict.fromkeys(r["schedule"] for r in sel))
        width = 0.8 / max(1, len(links))
        for i, link in enumerate(links):
            times = [next((r["median_ms"] for r in sel if r["link"] == link and r["schedule"] == s), np.nan)
                     for s in names]
            ax.bar(np.arange(len(names)) + i * width, times, width, label=f"link {link}")
        ax.set_xticks(np.arange(len(names)) + width * (len(links) - 1) / 2, names, fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(f"{op} N={n} {shape} {dtype}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


def _print_table(rows):
    print("\nop                     N  shape          dtype    link  schedule        median  floor  x floor  x xla")
    for r in rows:
        if r["dtype"] != "float32" or r["link"] not in ("real", "0.75x"):
            continue
        xla = "" if r["vs_xla"] is None else f"{r['vs_xla']:.2f}"
        print(f"{r['op']:22s} {r['N']:2d} {r['shape']:14s} {r['dtype']:8s} {r['link']:5s} {r['schedule']:14s} "
              f"{r['median_ms']:7.1f} {r['floor_ms']:6.1f} {r['vs_floor']:7.2f}  {xla}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one N, one shape, float32 only")
    parser.add_argument("--out", default="bench_out", help="folder for bench.csv and bench.png")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    run(args.quick, args.out, args.reps)


if __name__ == "__main__":
    main()
