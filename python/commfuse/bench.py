"""Schedule benchmark on CPU devices: fused schedules against XLA unfused,
under real in-process links and under the link model (COMMFUSE_CPU_LINK)
set so that T_comm is a given multiple of T_compute.

    python -m commfuse.bench [--quick | --headline] [--out bench_out] [--reps 7]

For each (op, N, shape, dtype, link, schedule) it measures the median time of
one jitted step over all devices (after a warm-up, on random inputs) and its
spread (interquartile range), timing the schedules of one case round-robin
so that the machine's slow spells hit them alike, and reports:
- T_compute: the same local matmuls with no communication: each device's N
  blocks as N commfuse GEMMs or as one, whichever is faster, over a mesh
  axis of size 1, timed in the same round-robin;
- T_comm: what the link model charges one device for the collective (for
  real links: the cost model's in-process estimate);
- the floor max(T_compute, T_comm), the exposed communication
  (time - T_compute), and the ratios to the floor, to sequential and to XLA;
- ideal: the time the cost model (`src/sim`, the plan of every rank run on
  this machine's description) gives the schedule, its GEMM rate calibrated so
  that its T_compute equals the measured one; `err` is measured/ideal - 1.
It writes a CSV and a PNG plot, and prints a short table and, last, each
performance target met or not, with the numbers behind it.
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
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import commfuse
from commfuse import _abi, _all_gather_matmul, _matmul_reduce_scatter
from commfuse._decide import Machine

LINK_VAR = "COMMFUSE_CPU_LINK"
LATENCY_US = 20.0
OPS = ("all_gather_matmul", "matmul_reduce_scatter")
# (name, schedule keyword arguments); "xla" is the pure-JAX expression.
SCHEDULES = [("xla", None), ("sequential", {}), ("sliced(2)", {"slices": 2}), ("sliced(4)", {"slices": 4}),
             ("sliced(8)", {"slices": 8}), ("ring", {}), ("bidirectional", {}), ("tiled(4)", {"tiles": 4}),
             ("auto", {})]
# (label, T_comm / T_compute or None for real links, topology, schedules run).
# The fused schedules (every one but the baselines "xla" and "sequential").
FUSED = ("sliced(2)", "sliced(4)", "sliced(8)", "ring", "bidirectional", "tiled(4)", "auto")
LINKS = [("real", None, "switch", None), ("0.75x", 0.75, "switch", None), ("1x", 1.0, "switch", None),
         ("2x", 2.0, "switch", None), ("ring-2x", 2.0, "ring", ("ring", "bidirectional"))]


def _interleaved(programs, reps):
    """{name: (median, interquartile range)} of `programs` ({name: (fn, args)}),
    each compiled and warmed up first, then timed round-robin `reps` times: a
    slow spell of this shared machine then hits every program alike instead
    of whichever was being timed."""
    for fn, args in programs.values():
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in programs}
    for _ in range(reps):
        for name, (fn, args) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: (float(np.median(t)), float(np.percentile(t, 75) - np.percentile(t, 25)))
            for name, t in times.items()}


def _schedule_kwargs(name, extra):
    return {"schedule": name.split("(")[0], **extra}


def _program(op, mesh, name, extra):
    """(step function, in_specs) of one op under one schedule."""
    fused = getattr(commfuse, op)
    if op == "all_gather_matmul":
        specs = (P("x"), P())
        lax = lambda a, b: jax.lax.all_gather(a, "x", tiled=True) @ b
    else:
        specs = (P(), P())
        lax = lambda a, b: jax.lax.psum_scatter(a @ b, "x", tiled=True)
    body = lax if name == "xla" else (lambda a, b: fused(a, b, "x", **_schedule_kwargs(name, extra)))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"))), specs


def _compute_only(op, devices, m, x, w):
    """The products each device computes, with no communication, two ways:
    its N blocks of m rows as N commfuse GEMMs (as the ring schedules run
    them), and as one GEMM of N m rows; both over a mesh axis of size 1.
    T_compute is the faster. {name: (fn, args)}."""
    mesh = jax.make_mesh((len(devices), 1), ("d", "one"), devices=devices)
    fused = getattr(commfuse, op)

    def blocks(a, b):
        return jax.numpy.concatenate([fused(a[i * m:(i + 1) * m], b, "one") for i in range(a.shape[0] // m)])

    args = _put(mesh, (x, w), (P(), P()))
    out = {}
    for name, body in (("compute:blocks", blocks), ("compute:whole", lambda a, b: fused(a, b, "one"))):
        out[name] = (jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(("d", "one")))), args)
    return out


def _put(mesh, arrays, specs):
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]


def _comm_bytes(op, n, m, k, cols, dtype):
    """Bytes one device sends (and receives) for the collective in a ring."""
    if op == "all_gather_matmul":
        return (n - 1) * m * k * np.dtype(dtype).itemsize
    return (n - 1) * m * cols * 4  # partial sums travel in f32 (the accumulator)


def _shapes(op, n, m, k, cols, dtype, schedule=_abi.AUTO):
    """One device's call of `op`, as the op's own module lays it out."""
    layout = _all_gather_matmul.layout if op == "all_gather_matmul" else _matmul_reduce_scatter.layout
    kind, dim, first, second = layout((m, k) if op == "all_gather_matmul" else (n * m, k), (k, cols), n, 0)
    return _abi.call_shapes(kind, schedule, n, dim, first, second, dtype, dtype)


def _model(op, n, m, k, cols, dtype, spec, gflops):
    """explain()'s numbers for one device's operands, without printing."""
    return _abi.prepare(_shapes(op, n, m, k, cols, dtype), spec, gflops, explain=True)["explain"]


def _auto_ran(op, n, m, k, cols, dtype):
    """The schedule "auto" ran: what it resolves to at trace time, under the link in the environment now."""
    machine = Machine.current()
    prepared = _abi.prepare(_shapes(op, n, m, k, cols, dtype), machine.spec, machine.gemm_gflops)
    return prepared["plan"]["schedule"]


def _calibrated_rate(op, n, m, k, cols, dtype, t_compute):
    """The single-thread GEMM rate that makes the model's T_compute the measured one."""
    rate = 50.0
    for _ in range(3):  # the model's per-GEMM overhead makes it not quite linear
        predicted = _model(op, n, m, k, cols, dtype, "cpu_here", rate)["t_compute"]
        rate *= predicted / t_compute
    return rate


def _memory(n, m, k, cols):
    """Per device at N=n, f32: XLA's temporaries (its memory analysis) of the
    fused AG and RS (ring) and of their jax.lax expressions, and the blocks a
    rank holds in flight (on the CPU, the transport's buffers, outside XLA's
    temporaries). Printed as a table; returns its rows."""
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    rows = []
    for op in OPS:
        x = np.ones((n * m, k), np.float32)
        w = np.ones((k, cols), np.float32)
        temps = {}
        for name, extra in (("xla", None), ("ring", {})):
            fn, specs = _program(op, mesh, name, extra)
            compiled = fn.lower(*_put(mesh, (x, w), specs)).compile()
            temps[name] = compiled.memory_analysis().temp_size_in_bytes
        shapes = _shapes(op, n, m, k, cols, np.float32, _abi.SCHEDULES["ring"])
        in_flight = _abi.prepare(shapes)["plan"]["blocks_in_flight"]
        rows.append({"op": op, "N": n, "xla": temps["xla"], "fused": temps["ring"], "in_flight": in_flight})
    print(f"\nmemory per device, N={n}, {m}x{k} rows per rank, w {k}x{cols}, float32 (KiB)")
    print(f"{'op':22s} {'jax.lax temps':>13s} {'fused temps':>11s} {'ratio':>6s} {'+ in flight':>11s} {'ratio':>6s}")
    for r in rows:
        total = r["fused"] + r["in_flight"]
        print(f"{r['op']:22s} {r['xla'] / 1024:13.0f} {r['fused'] / 1024:11.0f} {r['fused'] / r['xla']:6.2f} "
              f"{total / 1024:11.0f} {total / r['xla']:6.2f}")
    return rows


def run(quick: bool, out_dir: str, reps: int, headline: bool = False):
    rng = np.random.default_rng(0)
    devices = jax.devices()
    ranks_list = [4] if quick else [4, 8]
    # (rows M, contraction k, columns): each device multiplies M rows in all,
    # N blocks of m = M / N rows (AG: its own and N-1 received; RS: the
    # partials of all N blocks), so the work per device is the same for N = 4 and 8.
    shapes = [(1024, 512, 1024)] if quick or headline else [(1024, 512, 1024), (2048, 512, 512), (1024, 1024, 1024)]
    dtypes = [np.float32] if quick or headline else [np.float32, np.dtype("bfloat16")]
    links = [link for link in LINKS if link[0] != "ring-2x"] if headline else LINKS
    rows = []
    for op in OPS:
        for n in ranks_list:
            mesh = jax.make_mesh((n,), ("x",), devices=devices[:n])
            for (total, k, cols) in shapes:
                m = total // n
                for dtype in dtypes:
                    os.environ.pop(LINK_VAR, None)
                    x = rng.uniform(-1, 1, (n * m, k)).astype(dtype)  # AG: global x; RS: each device's x
                    w = rng.uniform(-1, 1, (k, cols)).astype(dtype)
                    compute = _compute_only(op, devices[:n], m, x, w)
                    # The link model's bandwidth is set from a first measurement of T_compute.
                    t_set = min(t for t, _ in _interleaved(compute, 3).values())
                    comm_bytes = _comm_bytes(op, n, m, k, cols, dtype)
                    # Compiled once per case; "auto" again per link, as it picks its schedule at trace time.
                    built = {}
                    for link, ratio, topology, only in links:
                        if ratio is None:
                            os.environ.pop(LINK_VAR, None)
                            spec = "cpu_here"
                        else:
                            gbps = comm_bytes / max(ratio * t_set - (n - 1) * LATENCY_US * 1e-6, 1e-9) / 1e9
                            text = f"gbytes_per_s={gbps:.6f},latency_us={LATENCY_US},topology={topology}"
                            os.environ[LINK_VAR] = text
                            spec = f"cpu_here:{text}"
                        programs = dict(compute)
                        for name, extra in SCHEDULES:
                            if (only and name not in only) or (name == "xla" and ratio is not None):
                                continue  # the link model throttles commfuse's transport only
                            if name not in built or name == "auto":
                                fn, specs = _program(op, mesh, name, extra)
                                built[name] = (fn, _put(mesh, (x, w), specs))
                            programs[name] = built[name]
                        measured = _interleaved(programs, reps)
                        t_compute = min(measured.pop("compute:blocks")[0], measured.pop("compute:whole")[0])
                        rate = _calibrated_rate(op, n, m, k, cols, dtype, t_compute)
                        model = _model(op, n, m, k, cols, dtype, spec, rate)
                        t_comm = model["t_comm"] if ratio is None else ratio * t_set
                        floor = max(t_compute, t_comm)
                        auto = _auto_ran(op, n, m, k, cols, dtype)
                        for name, (t, spread) in measured.items():
                            ideal = model["schedules"].get(auto if name == "auto" else name)
                            rows.append({
                                "op": op, "N": n, "shape": f"{total}x{k}x{cols}", "dtype": np.dtype(dtype).name,
                                "link": link, "schedule": name, "median_ms": t * 1e3, "spread_ms": spread * 1e3,
                                "t_compute_ms": t_compute * 1e3, "t_comm_ms": t_comm * 1e3, "floor_ms": floor * 1e3,
                                "exposed_ms": (t - t_compute) * 1e3, "vs_floor": t / floor,
                                "vs_sequential": t / measured["sequential"][0] if "sequential" in measured else None,
                                "vs_xla": t / measured["xla"][0] if "xla" in measured else None,
                                "ideal_ms": None if ideal is None else ideal * 1e3,
                                "model_err": None if ideal is None or name == "xla" else t / ideal - 1,
                                "auto_picked": auto if name == "auto" else "",
                            })
                            print(f"{op:22s} N={n} {total}x{k}x{cols} {np.dtype(dtype).name:8s} link={link:7s} "
                                  f"{name:14s} {t * 1e3:8.2f} ms  x floor {t / floor:5.2f}", flush=True)
    os.environ.pop(LINK_VAR, None)
    os.makedirs(out_dir, exist_ok=True)
    _write_csv(rows, os.path.join(out_dir, "bench.csv"))
    _plot(rows, os.path.join(out_dir, "bench.png"))
    _print_table(rows)
    memory = [] if quick else _memory(8, 256, 1024, 1024)
    _print_targets(rows, memory)


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
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3 * len(panels)), squeeze=False)
    for ax, (op, n, shape, dtype) in zip(axes[:, 0], panels):
        sel = [r for r in rows if (r["op"], r["N"], r["shape"], r["dtype"]) == (op, n, shape, dtype)]
        links = list(dict.fromkeys(r["link"] for r in sel))
        names = list(dict.fromkeys(r["schedule"] for r in sel))
        width = 0.8 / max(1, len(links))
        for i, link in enumerate(links):
            times = [next((r["median_ms"] for r in sel if r["link"] == link and r["schedule"] == s), np.nan)
                     for s in names]
            ax.bar(np.arange(len(names)) + i * width, times, width, label=f"link {link}")
        ax.set_xticks(np.arange(len(names)) + width * (len(links) - 1) / 2, names, fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(f"{op} N={n} {shape} {dtype} (T_compute {sel[0]['t_compute_ms']:.1f} ms)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def _print_table(rows):
    print("\nfloat32, real links and T_comm = 0.75 x T_compute (switch); times in ms")
    print(f"{'op':22s} {'N':>2s} {'shape':13s} {'link':6s} {'schedule':14s} {'median':>7s} {'floor':>6s} "
          f"{'xfloor':>6s} {'xseq':>5s} {'xxla':>5s} {'ideal':>7s} {'err':>6s}")
    for r in rows:
        if r["dtype"] != "float32" or r["link"] not in ("real", "0.75x"):
            continue
        print(f"{r['op']:22s} {r['N']:2d} {r['shape']:13s} {r['link']:6s} {r['schedule']:14s} "
              f"{r['median_ms']:7.1f} {r['floor_ms']:6.1f} {r['vs_floor']:6.2f} {_fmt(r['vs_sequential'], '5.2f'):>5s} "
              f"{_fmt(r['vs_xla'], '5.2f'):>5s} {_fmt(r['ideal_ms'], '7.1f'):>7s} "
              f"{_fmt(r['model_err'] and 100 * r['model_err'], '+5.0f'):>5s}%")


def _print_targets(rows, memory=()):
    """The performance targets, one line each: met or not, with the numbers behind it."""
    by = {(r["op"], r["N"], r["shape"], r["dtype"], r["link"], r["schedule"]): r for r in rows}
    cases = sorted({k[:4] for k in by})
    lines = []

    def check(label, ok, detail):
        lines.append(f"{'met' if ok else 'not met'}  {label}: {detail}")

    for case in cases:
        op, n, shape, dtype = case
        get = lambda link, s: by.get(case + (link, s))
        tag = f"{op} N={n} {shape} {dtype}"
        if dtype == "float32" and get("0.75x", "ring"):
            fused = min((get("0.75x", s) for s in ("ring", "bidirectional")), key=lambda r: r["median_ms"])
            fused = min((get("0.75x", s) for s in FUSED if get("0.75x", s)), key=lambda r: r["median_ms"])
            check(f"{tag} 0.75x fused <= 1.05 floor", fused["vs_floor"] <= 1.05,
                  f"{fused['schedule']} {fused['vs_floor']:.3f}")
            seq = fused["median_ms"] / get("0.75x", "sequential")["median_ms"]
            check(f"{tag} 0.75x fused <= 0.65 sequential", seq <= 0.65, f"{seq:.3f}")
            sliced = fused["median_ms"] / get("0.75x", "sliced(4)")["median_ms"]
            check(f"{tag} 0.75x fused < sliced(4)", sliced < 1, f"{sliced:.3f}")
        for link in ("1x", "2x"):
            for s in ("sequential", "sliced(2)", "sliced(4)", "sliced(8)", "ring", "bidirectional", "tiled(4)"):
                r = get(link, s)
                if r and r["model_err"] is not None:
                    check(f"{tag} {link} {s} within 10% of ideal", abs(r["model_err"]) <= 0.10,
                          f"{100 * r['model_err']:+.1f}%")
            step, tile = get(link, "ring"), get(link, "tiled(4)")
            if step and tile:
                check(f"{tag} {link} tiled(4) closer to the floor than ring", tile["vs_floor"] < step["vs_floor"],
                      f"{tile['vs_floor']:.3f} vs {step['vs_floor']:.3f}")
        ring, bidi = get("ring-2x", "ring"), get("ring-2x", "bidirectional")
        if ring and bidi:
            check(f"{tag} topology=ring: bidirectional beats ring", bidi["median_ms"] < ring["median_ms"],
                  f"{bidi['median_ms']:.1f} vs {ring['median_ms']:.1f} ms")
        xla = get("real", "xla")
        if xla:
            fused = min((get("real", s) for s in FUSED if get("real", s)), key=lambda r: r["median_ms"])
            check(f"{tag} real links: fused <= 0.90 XLA", fused["vs_xla"] <= 0.90,
                  f"{fused['schedule']} {fused['vs_xla']:.3f}")
    for r in memory:
        ratio, total = r["fused"] / r["xla"], (r["fused"] + r["in_flight"]) / r["xla"]
        check(f"{r['op']} N={r['N']} temporaries <= 0.4 jax.lax's", ratio <= 0.4,
              f"{ratio:.3f} (with the transport's blocks in flight {total:.3f})")
    errors = [abs(r["model_err"]) for r in rows if r["model_err"] is not None and r["link"] != "real"]
    if errors:
        within = sum(e <= 0.15 for e in errors)
        lines.append(f"cost model under the link model: {within}/{len(errors)} cases within 15% "
                     f"(median |err| {100 * np.median(errors):.1f}%, max {100 * max(errors):.1f}%)")
    met = sum(line.startswith("met") for line in lines)
    print(f"\ntargets: {met} met, {sum(line.startswith('not met') for line in lines)} not met")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one N, one shape, float32 only")
    parser.add_argument("--out", default="bench_out", help="folder for bench.csv and bench.png")
    parser.add_argument("--headline", action="store_true",
                        help="the headline table: N=4 and 8, one shape, float32, real links and the 0.75x/1x/2x "
                             "link model, every schedule, and the memory table (under 10 minutes)")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    run(args.quick, args.out, args.reps, args.headline)


if __name__ == "__main__":
    main()
