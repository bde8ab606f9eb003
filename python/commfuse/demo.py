"""Tensor-parallel MLP demo: commfuse fused collective matmuls vs jax.lax.

Run as ``python -m commfuse.demo [--devices 8] [--seq 2048] [--d-model 1024]
[--d-ff 4096] [--reps 5] [--dtype float32] [--trace commfuse_demo.pftrace]``.

The demo fakes ``--devices`` host (CPU) devices, builds a 1-D mesh "tp", and
runs one MLP block with sequence parallelism:

    x  : [S/N, d]   rows of the sequence on each device
    w1 : [d, f/N]   column-sharded
    w2 : [f/N, d]   row-sharded

    fused:   h = all_gather_matmul(x, w1, "tp"); y = matmul_reduce_scatter(gelu(h), w2, "tp")
    unfused: h = all_gather(x) @ w1;             y = psum_scatter(gelu(h) @ w2)

It checks that both agree, then times them three ways:

1. real links: the host's devices exchange blocks in memory, nearly free, so
   the layer is all compute and fused vs unfused compares the GEMMs and the
   copies, not overlap;
2. under the link model (``COMMFUSE_CPU_LINK``), bandwidth set so that the
   layer's communication takes about 0.75 of its compute: the regime of a GPU
   node with NVLink at these shapes, where overlap pays. The link model
   throttles commfuse's transport only, so the fused schedule is compared
   with commfuse's own ``sequential`` schedule (the same transfers, then the
   GEMMs, as an unfused program runs them) and with the floor
   max(T_compute, T_comm);
3. the cost model's prediction (not a measurement) for an H100 NVLink node at
   the same shapes.

Then it records one fused call with ``commfuse.trace`` and writes it as a
Perfetto trace (open it at https://ui.perfetto.dev).

XLA reads ``XLA_FLAGS`` when JAX creates its first backend, so the flags are
set in ``main`` before this module touches jax (jax itself is only imported
inside the functions below; importing the ``commfuse`` package imports jax but
does not create a backend).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

_COUNT_FLAG = "--xla_force_host_platform_device_count"

# Relative (to max |unfused|) error above which the demo reports a mismatch.
_TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 2e-2, "float16": 1e-2}


def _parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m commfuse.demo",
        description="Tensor-parallel MLP forward pass: commfuse fused ops vs jax.lax.",
    )
    p.add_argument("--devices", type=int, default=8, help="host devices / mesh size (8)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length S (2048)")
    p.add_argument("--d-model", type=int, default=1024, help="model width d (1024)")
    p.add_argument("--d-ff", type=int, default=4096, help="hidden width f (4096)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (5)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(_TOLERANCE),
        help="dtype of activations and weights (float32)",
    )
    p.add_argument(
        "--schedule",
        default="auto",
        choices=["auto", "ring", "bidirectional", "sequential"],
        help="commfuse schedule (auto)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trace",
        default="commfuse_demo.pftrace",
        metavar="PATH",
        help="write a Perfetto trace of one fused call here (commfuse_demo.pftrace; '' to skip)",
    )
    p.add_argument(
        "--timeline",
        default="",
        metavar="PNG",
        help="draw one fused call under the link model as a timeline image here (needs matplotlib; "
             "docs/images/demo_timeline.png is made this way)",
    )
    args = p.parse_args(argv)
    n = args.devices
    if n < 1:
        p.error("--devices must be >= 1")
    if args.seq % n or args.d_ff % n:
        p.error(f"--seq and --d-ff must be divisible by --devices ({n})")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def _set_host_device_count(n: int) -> None:
    """Ask XLA for ``n`` host devices, keeping the other XLA_FLAGS."""
    flags = re.sub(_COUNT_FLAG + r"=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    flags.append(f"{_COUNT_FLAG}={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def _time(fn, args, reps):
    import jax

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def run(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import commfuse

    n = args.devices
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    dtype = jnp.dtype(args.dtype)

    devices = jax.devices("cpu")
    if len(devices) < n:
        print(
            f"error: need {n} CPU devices, JAX has {len(devices)}. The JAX backend "
            "was created before XLA_FLAGS could be set; run this as "
            "`python -m commfuse.demo` in a fresh process.",
            file=sys.stderr,
        )
        return 2
    mesh = jax.make_mesh((n,), ("tp",), devices=devices[:n])

    S, d, f = args.seq, args.d_model, args.d_ff
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((S, d), dtype=np.float32).astype(dtype)
    w1 = (rng.standard_normal((d, f), dtype=np.float32) / np.sqrt(d)).astype(dtype)
    w2 = (rng.standard_normal((f, d), dtype=np.float32) / np.sqrt(f)).astype(dtype)

    specs = (P("tp", None), P(None, "tp"), P("tp", None))
    xs, w1s, w2s = (
        jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w1, w2), specs)
    )

    def fused(x, w1, w2):
        h = commfuse.all_gather_matmul(x, w1, "tp", schedule=args.schedule)
        return commfuse.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", schedule=args.schedule)

    def unfused(x, w1, w2):
        h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
        return jax.lax.psum_scatter(jax.nn.gelu(h) @ w2, "tp", scatter_dimension=0, tiled=True)

    def compile_(body):
        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp", None))
        )

    f_fused, f_unfused = compile_(fused), compile_(unfused)
    flops = 2 * 2 * S * d * f  # two matmuls, whole layer

    print("commfuse demo: tensor-parallel MLP with sequence parallelism")
    print(f"  jax {jax.__version__}, {n} x {devices[0].platform} devices, mesh axis 'tp'")
    print(f"  S={S} d_model={d} d_ff={f} dtype={dtype.name} schedule={args.schedule}")
    print(f"  per device: x [{S // n}, {d}], w1 [{d}, {f // n}], w2 [{f // n}, {d}]")

    # Warm-up (compiles) and correctness.
    y_f = np.asarray(jax.block_until_ready(f_fused(xs, w1s, w2s))).astype(np.float64)
    y_u = np.asarray(jax.block_until_ready(f_unfused(xs, w1s, w2s))).astype(np.float64)
    f_fused(xs, w1s, w2s).block_until_ready()
    f_unfused(xs, w1s, w2s).block_until_ready()
    max_abs = float(np.max(np.abs(y_f - y_u)))
    scale = float(np.max(np.abs(y_u)))
    max_rel = max_abs / scale if scale > 0 else float("inf")
    ok = max_rel <= _TOLERANCE[dtype.name] and bool(np.all(np.isfinite(y_f)))

    # Interleave the timed runs so both see the same machine conditions.
    t_fused, t_unfused = [], []
    for _ in range(args.reps):
        t_fused += _time(f_fused, (xs, w1s, w2s), 1)
        t_unfused += _time(f_unfused, (xs, w1s, w2s), 1)
    med_f, med_u = statistics.median(t_fused), statistics.median(t_unfused)

    print(f"max abs error (fused vs unfused):   {max_abs:.3e}")
    print(f"max rel error (/ max |unfused|):    {max_rel:.3e}"
          f"  [{'OK' if ok else 'MISMATCH'}, tolerance {_TOLERANCE[dtype.name]:.0e}]")
    print(f"median time fused   ({args.reps} reps):   {med_f * 1e3:9.2f} ms"
          f"  ({flops / med_f / 1e9:.1f} GFLOP/s)")
    print(f"median time unfused ({args.reps} reps):   {med_u * 1e3:9.2f} ms"
          f"  ({flops / med_u / 1e9:.1f} GFLOP/s)")
    print(f"ratio unfused/fused (speedup):      {med_u / med_f:.3f}x  (> 1: fused is faster)")
    _link_model_run(args, mesh, specs, fused, (xs, w1s, w2s), med_f)
    _prediction(args, "h100_nvlink")
    if args.trace:
        with commfuse.trace(args.trace) as path:
            jax.block_until_ready(f_fused(xs, w1s, w2s))
        print(f"trace of one fused call:            {os.path.abspath(path)}"
              f"  ({os.path.getsize(path)} bytes; open at https://ui.perfetto.dev)")
    return 0 if ok else 1


# Under the link model, communication takes this fraction of compute.
_LINK_RATIO = 0.75
_LATENCY_US = 20.0


def _comm_bytes(args) -> int:
    """Bytes one device sends in the layer's two collectives over a ring:
    N-1 blocks of x (AG) and N-1 partial sums, in f32 (RS)."""
    import numpy as np

    n, rows = args.devices, args.seq // args.devices
    return (n - 1) * rows * args.d_model * (np.dtype(args.dtype).itemsize + 4)


def _link_model_run(args, mesh, specs, fused, operands, t_compute) -> None:
    """Times the fused layer and commfuse's sequential schedule with the
    link model set so that T_comm = 0.75 x T_compute (T_compute: the fused
    layer with real links, where transfers cost next to nothing)."""
    import jax

    import commfuse

    if args.devices < 2:
        return
    link = os.environ.get("COMMFUSE_CPU_LINK")
    t_comm = _LINK_RATIO * t_compute
    latency = 2 * (args.devices - 1) * _LATENCY_US * 1e-6
    gbps = _comm_bytes(args) / max(t_comm - latency, 1e-6) / 1e9
    os.environ["COMMFUSE_CPU_LINK"] = f"gbytes_per_s={gbps:.6f},latency_us={_LATENCY_US}"
    try:
        def sequential(x, w1, w2):
            h = commfuse.all_gather_matmul(x, w1, "tp", schedule="sequential")
            return commfuse.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", schedule="sequential")

        # Compiled here: "auto" picks its schedule at trace time, for the link in force.
        programs = {name: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs[0]))
                    for name, body in (("fused", fused), ("sequential", sequential))}
        times = {name: [] for name in programs}
        for fn in programs.values():
            jax.block_until_ready(fn(*operands))
        for _ in range(args.reps):
            for name, fn in programs.items():
                times[name] += _time(fn, operands, 1)
        if args.timeline:
            _draw_timeline(args, programs["fused"], operands)
    finally:
        if link is None:
            os.environ.pop("COMMFUSE_CPU_LINK")
        else:
            os.environ["COMMFUSE_CPU_LINK"] = link
    med = {name: statistics.median(t) for name, t in times.items()}
    floor = max(t_compute, t_comm)
    print(f"link model, T_comm = {_LINK_RATIO} x T_compute ({gbps:.2f} GB/s, {_LATENCY_US:.0f} us latency):")
    print(f"  T_compute {t_compute * 1e3:.2f} ms (fused, real links), T_comm {t_comm * 1e3:.2f} ms, "
          f"floor max(T_compute, T_comm) {floor * 1e3:.2f} ms")
    print(f"  fused ({args.schedule}) {med['fused'] * 1e3:9.2f} ms = {med['fused'] / floor:.3f}x floor, "
          f"{med['fused'] / med['sequential']:.3f}x sequential")
    print(f"  sequential  {med['sequential'] * 1e3:13.2f} ms = {med['sequential'] / floor:.3f}x floor "
          f"(the same transfers, then the GEMMs: what an unfused program waits)")


def _draw_timeline(args, fused, operands) -> None:
    """One fused call of the layer under the link model, traced and drawn."""
    import tempfile

    import jax

    import commfuse
    from commfuse import _timeline

    with tempfile.TemporaryDirectory() as tmp:
        with commfuse.trace(os.path.join(tmp, "trace.json")) as path:
            jax.block_until_ready(fused(*operands))
        title = (f"commfuse demo: TP+SP MLP, {args.devices} CPU devices, schedule={args.schedule}, "
                 f"link model T_comm = {_LINK_RATIO} x T_compute")
        _timeline.draw(path, args.timeline, title)
    print(f"timeline of one fused call (link model): {os.path.abspath(args.timeline)}")


def _prediction(args, machine) -> None:
    """The cost model's prediction for the layer's two fused ops on `machine`."""
    from commfuse._explain import predict

    n, rows, d, f = args.devices, args.seq // args.devices, args.d_model, args.d_ff
    if n < 2:
        return
    ops = (("all_gather_matmul", (rows, d), (d, f // n)), ("matmul_reduce_scatter", (args.seq, f // n), (f // n, d)))
    fused = sequential = floor = 0.0
    for op, x, w in ops:
        r = predict(op, x, w, n, dtype=args.dtype, machine=machine)
        fused += r["schedules"][r["choice"]]
        sequential += r["schedules"]["sequential"]
        floor += r["floor"]
    print(f"prediction (cost model, not measured) for {n} GPUs of an {machine.replace('_', ' ')} node "
          f"at these shapes:")
    print(f"  fused {fused * 1e6:.0f} us, sequential {sequential * 1e6:.0f} us ({sequential / fused:.2f}x the "
          f"fused time), floor {floor * 1e6:.0f} us ({fused / floor:.2f}x floor)")


def main(argv=None) -> int:
    args = _parse_args(argv)
    # Before anything creates a JAX backend.
    _set_host_device_count(args.devices)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
