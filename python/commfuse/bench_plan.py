"""The planner measured: ``commfuse.plan`` on CPU devices under the link
model, every candidate it compiled run and timed beside its prediction.

    python -m commfuse.bench_plan [--families gpt_linen,llama_jax,moe_linen] [--size measure]
                                  [--rounds 5] [--steps 2] [--out bench_plan_out] [--quick]

For each family of the corpus (`commfuse._planner.corpus`) and each of two
link bandwidths (the link model, ``COMMFUSE_CPU_LINK``, set so that the
plain FSDP layout's collectives take 0.5 and 2 times its compute), it plans
the step for 8 CPU devices (``machine="cpu_here"``, which prices XLA's
collectives at the link's rate, blocking the device as XLA's CPU runtime
does), with no memory limit and then with a binding one: below what the
fastest layout needs, above what some baseline needs. Then it runs every
candidate of both plans on the 8 devices: each plain layout with its
products' collectives through the link model exposed (``overlap`` with
``schedule="sequential"``: the link model throttles commfuse's transport,
not XLA's, so this is how an unfused program waits for its transfers
here), each fused one with its plan's decisions. Timing is round-robin
over the candidates (`--rounds` rounds of `--steps` steps each), medians
reported. Beside each: the predicted step, XLA's memory analysis of the
program that ran and of the one planned, and whether it fits.

It prints per family and bandwidth the table, the plan against the best
baseline that fits (measured), and three rank correlations (Spearman):
the planner's prediction against the measured step; the same with XLA's
own collectives (which the link model cannot slow) charged the link's
time; and the cost model on the program that ran (its plain products as
sequential commfuse calls, with their fixed costs) against that adjusted
step. Over all, the correlation of all candidates. Writes
``bench_plan.csv``, ``bench_plan.json``, ``bench_plan.md`` (the tables of
docs/planning.md) and, with matplotlib, ``bench_plan.png`` to `--out`.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Before JAX creates its CPU backend (a prediction's process is given its own count).
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()

import argparse
import csv
import json
import time

import jax
import numpy as np

import commfuse
from commfuse._decide import Machine
from commfuse._planner import corpus, hooks
from commfuse._planner.evaluate import Step, as_run, evaluate, layout_of, make_mesh
from commfuse._planner.host import mapped_afresh, with_measured_memory
from commfuse._planner.plan import GIB
from commfuse._planner.price import price
from commfuse._planner.space import Candidate

LINK_VAR = "COMMFUSE_CPU_LINK"
LATENCY_US = 20.0
DEVICES = 8
# Communication over compute of the plain FSDP layout at each bandwidth.
LINK_RATIOS = (0.5, 2.0)


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equally long sequences (ties averaged)."""
    def ranks(v):
        v = np.asarray(v, float)
        order = v.argsort()
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for value in np.unique(v):  # ties share their mean rank
            same = v == value
            r[same] = r[same].mean()
        return r

    if len(a) < 3:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


class Runner:
    """One candidate compiled to run on the devices: its arguments placed as
    its layout shards them, its program (plain: the products' collectives
    through the link model; fused: its decisions)."""

    def __init__(self, step: Step, args, candidate: Candidate, decisions, pool):
        self.candidate = candidate
        mesh = make_mesh(candidate, pool)
        _, specs = step.abstract(mesh, candidate.rules())
        shardings = [jax.sharding.NamedSharding(mesh, s) for s in specs]
        # Fresh buffers from host copies: the program donates them.
        leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(args)]
        self.state = jax.tree_util.tree_unflatten(step.treedef, [jax.device_put(leaf, s)
                                                                 for leaf, s in zip(leaves, shardings)])
        # What the planner priced (`as_run`): every product's collective
        # through the link model (jax.lax's own would move at memory speed
        # here, unthrottled).
        fn = as_run(step.fn, candidate, "cpu_here", decisions)
        with hooks.tracing(layout_of(candidate, mesh)):
            self.compiled = jax.jit(fn, donate_argnums=step.donate).lower(*self.state).compile()
        m = self.compiled.memory_analysis()
        self.memory_bytes = int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                                - m.alias_size_in_bytes)
        # XLA's own collectives left in the program that runs (where no fused
        # op takes the collective: two collectives on one dot, an all-reduce's
        # gather half, a norm's gradient) move at memory speed here, not at
        # the link's: their bytes, and what the link model would charge them.
        machine = Machine(with_measured_memory(Machine.named("cpu_here").spec, DEVICES))
        priced = price(self.compiled.as_text(), machine.spec, gemm_gflops=machine.gemm_gflops, collectives="blocking",
                       fresh_bytes=mapped_afresh(m.temp_size_in_bytes))
        self.xla_bytes = sum(priced.collective_bytes.values())
        self.xla_link_s = priced.by_kind["collective"]
        # The cost model on the program that runs (the plain layouts'
        # products exposed through commfuse's sequential calls, with their
        # fixed costs), which the planner's prediction of the candidate is
        # not: set against the measured step with XLA's own collectives at
        # the link's time, as this pricing charges them.
        self.predicted_as_run_s = priced.total_s
        self.times: list = []

    def run(self, steps: int) -> float:
        """`steps` steps (each on the last one's parameters and optimizer state): seconds per step."""
        params, opt_state, batch = self.state
        start = time.perf_counter()
        for _ in range(steps):
            params, opt_state, loss = self.compiled(params, opt_state, batch)
        loss.block_until_ready()
        self.state = (params, opt_state, batch)
        return (time.perf_counter() - start) / steps


def link_spec(gbytes_per_s: float) -> str:
    return f"gbytes_per_s={gbytes_per_s:.4g},latency_us={LATENCY_US:g},topology=switch"


def bandwidths(step: Step, args, pool, log) -> list:
    """The link bandwidths at which the plain FSDP layout's collectives take
    `LINK_RATIOS` times its compute: its compute measured (no link model),
    its collectives' bytes read off its compiled program."""
    os.environ.pop(LINK_VAR, None)
    fsdp = Candidate((("data", 1), ("fsdp", DEVICES), ("tensor", 1)))
    e = evaluate(step, fsdp, pool, machine="cpu_here", collectives="blocking")
    runner = Runner(step, args, fsdp, [], pool)
    runner.run(1)
    compute_s = min(runner.run(1) for _ in range(3))
    total_bytes = sum(e.priced.collective_bytes.values())
    log(f"  FSDP step without a link model: {compute_s * 1e3:.1f} ms; its collectives move {total_bytes / 1e6:.1f} MB "
        f"per device per step")
    return [total_bytes / (ratio * compute_s) / 1e9 for ratio in LINK_RATIOS]


def measure_family(family: str, size: str, rounds: int, steps: int, log) -> list:
    case = corpus.build(family, size)
    pool = jax.devices()[:DEVICES]
    rows = []
    for ratio, gbps in zip(LINK_RATIOS, bandwidths(_step_of(case), case.args, pool, log)):
        os.environ[LINK_VAR] = link_spec(gbps)
        log(f"\n{family}/{size}, link {gbps:.3g} GB/s (FSDP communication {ratio}x its compute)")
        cache: dict = {}
        free = commfuse.plan(case.step, *case.args, devices=DEVICES, machine="cpu_here", cache=cache, log=log)
        limit = binding_limit(free)
        bound = commfuse.plan(case.step, *case.args, devices=DEVICES, machine="cpu_here", memory_limit=limit,
                              cache=cache, log=log)
        log(f"  binding limit {limit / GIB * 1024:.1f} MiB per device: plan {bound.candidate.label()}")
        evaluations = {**free.evaluations, **bound.evaluations}
        step = _step_of(case)
        runners = []
        for candidate, e in evaluations.items():
            if not e.ok:
                continue
            try:
                runners.append((Runner(step, case.args, candidate, e.decisions, pool), e))
            except Exception as err:  # noqa: BLE001 - shown in the table, not measured
                log(f"  {candidate.label()}: did not run: {type(err).__name__}: {err}")
        if not runners:
            raise RuntimeError(f"{family}: no candidate ran")
        for runner, _ in runners:
            runner.run(1)  # warm-up
        for r in range(rounds):
            order = runners[r % len(runners):] + runners[:r % len(runners)]
            for runner, _ in order:
                runner.times.append(runner.run(steps))
        for runner, e in runners:
            c = runner.candidate
            rows.append({
                "family": family, "link_gbytes_per_s": gbps, "link_ratio": ratio, "label": c.label(),
                "baseline": next((name for name, pair in free.baselines.items()
                                  for way, row in pair.items() if row["label"] == c.label()), ""),
                "plan": ("free" if c == free.candidate else "") + ("bound" if c == bound.candidate else ""),
                "predicted_ms": e.predicted_s * 1e3, "measured_ms": float(np.median(runner.times)) * 1e3,
                "run_predicted_ms": runner.predicted_as_run_s * 1e3,
                "xla_mb": runner.xla_bytes / 1e6,
                "adjusted_ms": (float(np.median(runner.times)) + runner.xla_link_s) * 1e3,
                "spread_ms": float(np.subtract(*np.percentile(runner.times, [75, 25]))) * 1e3,
                "planned_mib": e.memory_bytes / 2**20, "ran_mib": runner.memory_bytes / 2**20,
                "limit_mib": limit / 2**20, "fits_limit": e.memory_bytes <= limit})
        report(rows[-len(runners):], log)
    os.environ.pop(LINK_VAR, None)
    return rows


def _step_of(case) -> Step:
    from commfuse._planner import logical

    names = logical.names_of(case.step, case.args)
    leaves, _, treedef = logical.leaves_with_names(case.args)
    return Step(case.step, leaves, treedef, names, (0, 1))


def binding_limit(free) -> int:
    """A memory limit that binds: below what the fastest candidate needs,
    at or above what some baseline needs, and, where one exists, one under
    which the fastest candidate that fits is no baseline (the largest such):
    the case where the plan must beat every baseline that fits."""
    ok = sorted((e for e in free.evaluations.values() if e.ok), key=lambda e: e.predicted_s)
    baseline_labels = {row["label"] for pair in free.baselines.values() for row in pair.values()}
    fastest = ok[0]
    levels = sorted({e.memory_bytes for e in ok if e.memory_bytes < fastest.memory_bytes}, reverse=True)
    fallback = None
    for limit in levels:
        fitting = [e for e in ok if e.memory_bytes <= limit]
        if not any(e.candidate.label() in baseline_labels for e in fitting):
            continue
        fallback = fallback or limit
        if fitting[0].candidate.label() not in baseline_labels:
            return limit
    return fallback if fallback is not None else fastest.memory_bytes


def report(rows: list, log) -> None:
    log(f"  {'candidate':<50} {'baseline':<8} {'pred ms':>8} {'meas ms':>8} {'+-':>6} {'XLA MB':>7} "
        f"{'+link ms':>8} {'as run':>8} {'MiB plan':>8} {'MiB ran':>8}  fits")
    for row in sorted(rows, key=lambda r: r["measured_ms"]):
        mark = {"free": " <- plan", "bound": " <- plan under the limit", "freebound": " <- plan (both)"}.get(
            row["plan"], "")
        log(f"  {row['label']:<50} {row['baseline']:<8} {row['predicted_ms']:8.1f} {row['measured_ms']:8.1f} "
            f"{row['spread_ms']:6.1f} {row['xla_mb']:7.2f} {row['adjusted_ms']:8.1f} {row['run_predicted_ms']:8.1f} "
            f"{row['planned_mib']:8.1f} "
            f"{row['ran_mib']:8.1f}  {'yes' if row['fits_limit'] else 'NO '}{mark}")
    rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    adjusted = spearman([r["predicted_ms"] for r in rows], [r["adjusted_ms"] for r in rows])
    as_run = spearman([r["run_predicted_ms"] for r in rows], [r["adjusted_ms"] for r in rows])
    log(f"  rank correlation of predicted and measured step: {rho:.2f} over {len(rows)} candidates; with XLA's own "
        f"collectives charged the link's time: {adjusted:.2f}; the model on the programs as run: {as_run:.2f}")
    for which in ("free", "bound"):
        plan = [r for r in rows if which in r["plan"]]
        fitting = [r for r in rows if r["baseline"] and (which == "free" or r["fits_limit"])]
        if plan and fitting:
            best = min(fitting, key=lambda r: r["measured_ms"])
            p = plan[0]
            log(f"  plan ({which}) measured {p['measured_ms']:.1f} ms against the best baseline that fits, "
                f"{best['label']} ({best['baseline']}) {best['measured_ms']:.1f} ms: "
                f"{best['measured_ms'] / p['measured_ms']:.2f}x")
            # XLA's own collectives move at memory speed here: with them at the link's time.
            fair = min(fitting, key=lambda r: r["adjusted_ms"])
            log(f"  plan ({which}) with XLA's own collectives charged the link's time {p['adjusted_ms']:.1f} ms, "
                f"the best baseline that fits {fair['label']} ({fair['baseline']}) {fair['adjusted_ms']:.1f} ms: "
                f"{fair['adjusted_ms'] / p['adjusted_ms']:.2f}x")


# Predictions for GPUs: (model size, devices, machine), each planned in a
# process of its own with that many CPU devices to compile for.
GPU_CASES = (("8b", 8, "h100_nvlink"), ("70b", 8, "h100_nvlink"), ("8b", 64, "h100_cluster"),
             ("70b", 64, "h100_cluster"))
H100_MEMORY = 80 * GIB


def predict_one(size: str, devices: int, machine: str, out: str) -> int:
    """Plans llama_jax `size` for `devices` of `machine` (this process must
    see that many devices) and writes the plan's JSON to `out`."""
    # One sequence of 4096 tokens per GPU: 8 per step on 8 GPUs, 64 on 64.
    case = corpus.build("llama_jax", size, abstract=True, batch=devices)
    plan = commfuse.plan(case.step, *case.args, devices=devices, machine=machine, memory_limit=H100_MEMORY,
                         log=lambda line: print(line, flush=True))
    print(plan)
    plan.to_json(out)
    return 0


def predict_gpus(out_dir: str) -> int:
    """The GPU predictions (`GPU_CASES`): each plan, against Megatron's
    TP+SP and FSDP as XLA compiles them, said to be predictions."""
    import subprocess

    results = []
    for size, devices, machine in GPU_CASES:
        path = os.path.join(out_dir, f"plan_llama_{size}_{devices}x{machine}.json")
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "commfuse.bench_plan", "--predict-one", size, str(devices),
                               machine, path], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"llama {size} on {devices} x {machine}: planning failed:\n{done.stderr[-2000:]}")
            continue
        plan = commfuse.Plan.from_json(path)
        results.append((size, devices, machine, plan, time.perf_counter() - start))
    print("\nPredictions (the cost model on programs compiled for CPU devices; memory from XLA's CPU buffer "
          "assignment, an estimate for a GPU's), bf16 Llama-3 training steps of one 4096-token sequence per GPU, "
          "adamw, 80 GiB per GPU:")
    print(f"  {'model':<6} {'GPUs':>4} {'machine':<13} {'plan':<44} {'step s':>7} {'GiB':>6}  "
          f"{'vs TP+SP':>9} {'vs FSDP':>9}  planned in")
    for size, devices, machine, plan, seconds in results:
        def versus(name):
            row = plan.baselines.get(name, {}).get("plain")
            if not row or row["predicted_s"] is None:
                return "-"
            fits = "" if row["fits"] else "*"
            return f"{row['predicted_s'] / plan.predicted_step_s:.2f}x{fits}"

        print(f"  {size:<6} {devices:>4} {machine:<13} {plan.candidate.label():<44} {plan.predicted_step_s:7.2f} "
              f"{plan.predicted_memory_bytes / GIB:6.1f}  {versus('TP+SP'):>9} {versus('FSDP'):>9}  {seconds:.0f} s")
    print("  (x: the baseline's predicted step over the plan's; *: the baseline does not fit 80 GiB)")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--predict-one"]:
        size, devices, machine, out = argv[1:5]
        return predict_one(size, int(devices), machine, out)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(corpus.FAMILIES))
    parser.add_argument("--size", default="measure")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="bench_plan_out")
    parser.add_argument("--quick", action="store_true", help="one family at size 'test', 2 rounds of 1 step")
    parser.add_argument("--predict-gpus", action="store_true",
                        help="plan Llama-3 8B and 70B for 8 and 64 H100s (predictions only)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.predict_gpus:
        return predict_gpus(args.out)
    if len(jax.devices()) < DEVICES:
        print(f"bench_plan needs {DEVICES} JAX devices; start it as `python -m commfuse.bench_plan`", file=sys.stderr)
        return 2
    families = ["gpt_linen"] if args.quick else args.families.split(",")
    size, rounds, steps = ("test", 2, 1) if args.quick else (args.size, args.rounds, args.steps)
    print(f"commfuse.bench_plan: jax {jax.__version__}, {DEVICES} CPU devices on {os.cpu_count()} cores, "
          f"{rounds} rounds x {steps} steps, medians")
    rows = []
    for family in families:
        rows += measure_family(family, size, rounds, steps, lambda line: print(line, flush=True))
    rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    print(f"\nall candidates: rank correlation of predicted and measured step {rho:.2f} over {len(rows)}")
    with open(os.path.join(args.out, "bench_plan.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(args.out, "bench_plan.json"), "w") as f:
        json.dump({"rows": rows, "spearman": rho, "jax": jax.__version__}, f, indent=1)
    with open(os.path.join(args.out, "bench_plan.md"), "w") as f:
        f.write(markdown(rows))
    plot(rows, os.path.join(args.out, "bench_plan.png"))
    return 0


def markdown(rows: list) -> str:
    """The summary tables for docs/planning.md: per family and link, the
    plans against the best baselines that fit, measured, and the rank
    correlations; then every candidate."""
    out = ["| family | link GB/s (FSDP comm / compute) | plan (no limit) | measured ms | best baseline | "
           "measured ms | x | limit MiB | plan under it | measured ms | best baseline that fits | measured ms | x "
           "| Spearman | Spearman, XLA's own at the link | Spearman, the model on what ran |", "|" + "---|" * 16]
    groups = {}
    for r in rows:
        groups.setdefault((r["family"], r["link_gbytes_per_s"], r["link_ratio"]), []).append(r)
    for (family, gbps, ratio), mine in groups.items():
        cells = [family, f"{gbps:.3g} ({ratio}x)"]
        for which in ("free", "bound"):
            plan = next((r for r in mine if which in r["plan"]), None)
            fitting = [r for r in mine if r["baseline"] and (which == "free" or r["fits_limit"])]
            best = min(fitting, key=lambda r: r["measured_ms"]) if fitting else None
            if which == "bound":
                cells.append(f"{mine[0]['limit_mib']:.1f}")
            cells += [plan["label"] if plan else "-", f"{plan['measured_ms']:.0f}" if plan else "-",
                      f"{best['baseline']} ({best['label'].split(', ')[-1]})" if best else "-",
                      f"{best['measured_ms']:.0f}" if best else "-",
                      f"{best['measured_ms'] / plan['measured_ms']:.2f}" if plan and best else "-"]
        cells.append(f"{spearman([r['predicted_ms'] for r in mine], [r['measured_ms'] for r in mine]):.2f}")
        cells.append(f"{spearman([r['predicted_ms'] for r in mine], [r['adjusted_ms'] for r in mine]):.2f}")
        cells.append(f"{spearman([r['run_predicted_ms'] for r in mine], [r['adjusted_ms'] for r in mine]):.2f}")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "| family | link | candidate | baseline | predicted ms | measured ms | XLA's own MB | +link ms | "
                "predicted as run ms | MiB planned | MiB ran |", "|" + "---|" * 11]
    for r in sorted(rows, key=lambda r: (r["family"], r["link_ratio"], r["measured_ms"])):
        mark = " (plan)" if r["plan"] else ""
        out.append(f"| {r['family']} | {r['link_ratio']}x | {r['label']}{mark} | {r['baseline']} | "
                   f"{r['predicted_ms']:.0f} | {r['measured_ms']:.0f} | {r['xla_mb']:.2f} | {r['adjusted_ms']:.0f} | "
                   f"{r['run_predicted_ms']:.0f} | {r['planned_mib']:.1f} | {r['ran_mib']:.1f} |")
    return "\n".join(out) + "\n"


def plot(rows: list, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot; pip install '.[bench]')")
        return
    families = sorted({r["family"] for r in rows})
    fig, axes = plt.subplots(2, len(families), figsize=(5 * len(families), 9), squeeze=False)
    # Top: the planner's prediction of each candidate against its measured
    # step; bottom: the model on the program that ran against the step with
    # XLA's own collectives at the link's time.
    panels = (("predicted_ms", "measured_ms", "planner's prediction (ms)", "measured step (ms)"),
              ("run_predicted_ms", "adjusted_ms", "the model on the program run (ms)",
               "measured + XLA's own at the link (ms)"))
    for row_axes, (px, py, xlabel, ylabel) in zip(axes, panels):
        for ax, family in zip(row_axes, families):
            for ratio, marker in zip(LINK_RATIOS, ("o", "s")):
                mine = [r for r in rows if r["family"] == family and r["link_ratio"] == ratio]
                ax.scatter([r[px] for r in mine], [r[py] for r in mine], marker=marker,
                           label=f"link {mine[0]['link_gbytes_per_s']:.2g} GB/s" if mine else "", alpha=0.7)
                for r in mine:
                    if r["plan"]:
                        ax.annotate("plan", (r[px], r[py]), fontsize=8)
            rho = spearman([r[px] for r in rows if r["family"] == family],
                           [r[py] for r in rows if r["family"] == family])
            ax.set_title(f"{family} (Spearman {rho:.2f})")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
