"""The fused ops on a GPU, one rank at a time: ``python -m commfuse.bench_gpu``.

One GPU measures everything of one rank of an N-GPU ring except the wire:
the one-rank mode (``src/backend/cuda/solo.rs``) runs rank 0's real plan
with its real GEMM pieces, and what its peers would send arrives by
copy-engine copies paced to a link (``--machine``: a cost-model preset's
link, e.g. ``h100_nvlink``, ``h100_pcie`` or ``h100_nvlink:gbytes_per_s=200``).

For each transformer projection (Llama-3 70B and 405B, MLP and attention,
bfloat16), token count, N and schedule it reports, in milliseconds on the
device's clock: the fused call; one GEMM of the same total work; the paced
transfers alone; the call's GEMM pieces alone. Then the ratios
fused/max(GEMM, transfers) (1.0: nothing exposed) and fused/(GEMM +
transfers) (XLA's unfused form: its dot, then the transfers), the pieces'
efficiency (one GEMM / the pieces) and the link rate the call achieved.

Without a GPU (or with ``--predict``) the same table comes from the cost
model (``commfuse.explain``), marked as predicted.

    python -m commfuse.bench_gpu                 # the full table (GPU: about a minute)
    python -m commfuse.bench_gpu --quick         # 8k tokens only
    python -m commfuse.bench_gpu --out DIR       # also DIR/bench_gpu.csv and, with matplotlib, DIR/bench_gpu.png
    python -m commfuse.bench_gpu --trace DIR     # also a Perfetto trace of one call per case in DIR

A trace (JSON; ui.perfetto.dev opens it, ``python -m commfuse._timeline``
draws it) shows the call's lanes: the GEMM pieces on the compute lane, the
paced copies on the comm lane, and the waits between them. Measured, it is
one fused call after the timed ones, each step bracketed by CUDA timing
events on its stream (device times; the timed calls carry none); predicted,
it is the cost model's timeline of every rank.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import os
import sys

# (model, projection): (input features, output features) of the whole layer.
PROJECTIONS = {
    ("70B", "mlp"): (8192, 28672),
    ("70B", "attn"): (8192, 10240),   # q, k, v: 64 + 2 x 8 heads of 128
    ("405B", "mlp"): (16384, 53248),
    ("405B", "attn"): (16384, 18432),  # 128 + 2 x 8 heads of 128
}
OPS = ("all_gather_matmul", "matmul_reduce_scatter")
FIELDS = ["source", "model", "projection", "op", "tokens", "n", "schedule", "fused_ms", "gemm_ms", "transfers_ms",
          "pieces_ms", "fused_over_max", "fused_over_sum", "pieces_efficiency", "link_gbps", "pace_gbps"]


def cases(quick: bool):
    """(model, projection, op, tokens, n, schedule, x shape, w shape) of one rank."""
    for (model, projection), (d_in, d_out) in PROJECTIONS.items():
        for tokens in ((8192,) if quick else (2048, 8192, 16384)):
            for n in (2, 4, 8):
                for op in OPS:
                    # Column-parallel (gather the sequence, then the rank's
                    # columns) or row-parallel (the rank's part of the
                    # contraction, then scatter the sequence) as Megatron does.
                    x, w = ((tokens // n, d_in), (d_in, d_out // n)) if op == OPS[0] else \
                        ((tokens, d_out // n), (d_out // n, d_in))
                    # Two ranks have one peer: bidirectional is the ring there.
                    for schedule in ("ring", "bidirectional") if n > 2 else ("ring",):
                        yield model, projection, op, tokens, n, schedule, x, w


def gpu_available() -> bool:
    try:
        import jax
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def call_of(op, x, w, n, schedule):
    """The library's shapes of one rank's bfloat16 call."""
    import jax.numpy as jnp

    from . import _abi

    kind = _abi.Kind.ALL_GATHER_MATMUL if op == OPS[0] else _abi.Kind.MATMUL_REDUCE_SCATTER
    return _abi.call_shapes(kind, _abi.schedule_code(schedule), n, 0, x, w, jnp.bfloat16, jnp.bfloat16)


def measure(op, x, w, n, schedule, machine, reps, trace=None) -> dict:
    """One case through the library's one-rank mode on GPU 0 (and, given a
    path, its device timeline there)."""
    from . import _abi
    from ._native import lib

    request = {"call": call_of(op, x, w, n, schedule)._asdict(), "rank": 0, "machine": machine, "reps": reps}
    if trace is not None:
        request["trace"] = trace
    lib.commfuse_one_rank_bench.restype = ctypes.c_int64
    lib.commfuse_one_rank_bench.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    return json.loads(_abi._ask(lib.commfuse_one_rank_bench, json.dumps(request).encode()))


def predicted(op, x, w, n, schedule, machine, trace=None) -> dict:
    """The same figures from the cost model (and, given a path, its timeline there)."""
    from . import _abi
    from ._explain import predict

    if trace is not None:
        _abi.prepare(call_of(op, x, w, n, schedule), machine, trace=trace)
    r = predict(op, x, w, n, dtype="bfloat16", machine=machine)
    whole = ((x[0] * n, x[1]), w) if op == OPS[0] else (x, w)
    gemm = predict(OPS[0], whole[0], whole[1], 1, dtype="bfloat16", machine=machine)["schedules"]["sequential"]
    return {"fused_s": r["schedules"][schedule], "gemm_s": gemm, "transfers_s": r["parts"][schedule]["comm"],
            "pieces_s": r["parts"][schedule]["compute"], "link_bytes_per_s": float("nan"),
            "pace_bytes_per_s": r["machine"]["link_bytes_per_s"]}


def trace_name(case) -> str:
    model, projection, op, tokens, n, schedule, _, _ = case
    return f"{model}_{projection}_{op}_{tokens // 1024}k_n{n}_{schedule}.json"


def row(source, case, figures) -> dict:
    model, projection, op, tokens, n, schedule, _, _ = case
    fused, gemm, transfers, pieces = (figures[k] for k in ("fused_s", "gemm_s", "transfers_s", "pieces_s"))
    return {
        "source": source, "model": model, "projection": projection, "op": op, "tokens": tokens, "n": n,
        "schedule": schedule, "fused_ms": fused * 1e3, "gemm_ms": gemm * 1e3, "transfers_ms": transfers * 1e3,
        "pieces_ms": pieces * 1e3, "fused_over_max": fused / max(gemm, transfers),
        "fused_over_sum": fused / (gemm + transfers), "pieces_efficiency": gemm / pieces,
        "link_gbps": figures["link_bytes_per_s"] / 1e9, "pace_gbps": figures["pace_bytes_per_s"] / 1e9,
    }


def print_rows(rows) -> None:
    print(f"{'source':9} {'model':5} {'proj':4} {'op':21} {'tokens':>6} {'n':>2} {'schedule':13} {'fused':>7} "
          f"{'GEMM':>7} {'xfers':>7} {'pieces':>7} {'f/max':>6} {'f/sum':>6} {'pc.eff':>6} {'link':>6}")
    for r in rows:
        print(f"{r['source']:9} {r['model']:5} {r['projection']:4} {r['op']:21} {r['tokens']:>6} {r['n']:>2} "
              f"{r['schedule']:13} {r['fused_ms']:7.3f} {r['gemm_ms']:7.3f} {r['transfers_ms']:7.3f} "
              f"{r['pieces_ms']:7.3f} {r['fused_over_max']:6.3f} {r['fused_over_sum']:6.3f} "
              f"{r['pieces_efficiency']:6.3f} {r['link_gbps']:6.0f}", flush=True)


def plot(rows, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, op in zip(axes, OPS):
        mine = [r for r in rows if r["op"] == op and r["schedule"] == "ring"]
        labels = [f"{r['model']} {r['projection']}\n{r['tokens'] // 1024}k N={r['n']}" for r in mine]
        xs = range(len(mine))
        ax.bar([i - 0.2 for i in xs], [r["fused_over_max"] for r in mine], 0.4, label="fused / max(GEMM, transfers)")
        ax.bar([i + 0.2 for i in xs], [r["fused_over_sum"] for r in mine], 0.4, label="fused / (GEMM + transfers)")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(list(xs), labels, fontsize=6, rotation=90)
        ax.set_title(f"{op}, ring ({mine[0]['source'] if mine else ''})")
    axes[0].set_ylabel("ratio (lower is better)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8k tokens only")
    parser.add_argument("--predict", action="store_true", help="the cost model's figures even where a GPU is")
    parser.add_argument("--machine", default="h100_nvlink", help="the link the transfers are paced to (a preset)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", help="a directory for bench_gpu.csv and bench_gpu.png")
    parser.add_argument("--trace", help="a directory for one Perfetto trace (JSON) per case")
    args = parser.parse_args(argv)
    on_gpu = not args.predict and gpu_available()
    source = "measured" if on_gpu else "predicted"
    if not on_gpu:
        print(f"no GPU{' asked for' if args.predict else ' visible to JAX'}: the cost model's predictions "
              f"for {args.machine}, not measurements", flush=True)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    rows = []
    for case in cases(args.quick):
        _, _, op, _, n, schedule, x, w = case
        trace = os.path.join(args.trace, trace_name(case)) if args.trace else None
        figures = measure(op, x, w, n, schedule, args.machine, args.reps, trace) if on_gpu else \
            predicted(op, x, w, n, schedule, args.machine, trace)
        rows.append(row(source, case, figures))
    print_rows(rows)
    if args.trace:
        print(f"wrote {len(rows)} {source} traces to {args.trace}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gpu.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        if plot(rows, os.path.join(args.out, "bench_gpu.png")):
            print(f"wrote {args.out}/bench_gpu.csv and bench_gpu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
