"""Times every program of the framework corpus (``jax_tests/programs/fw_*``)
plain and through ``commfuse.overlap`` (schedules ``auto`` and ``ring``) on
CPU devices, and prints one table: the fused products of each schedule, the
largest relative error of the outputs against the plain run, and the median
step time of each way.

    python scripts/framework_report.py [--rounds 7] [--steps 5] [--only NAME]

``auto`` runs with the cost model's veto on (``COMMFUSE_AUTO_UNFUSED=1``,
the default outside the test suite, set here whatever the environment says),
so at these sizes it may keep products unfused where ``ring`` fuses them.

Fused products are counted as ``jax_tests/test_frameworks.py`` counts them:
in programs sharded by ``jax.jit`` (NNX, MaxText, Equinox, decode), the
``commfuse.matmul`` calls that ran fused once partitioned, heard through
``commfuse._matmul.watching()`` while the first step compiles (afresh:
``jax.clear_caches()`` first; a later step that compiles again, for the new
state's types, is not counted twice); in shard_map programs (TP+SP, MoE), the ``]: rewrote `` lines of the
overlap'd function's ``last_report``.

Errors: training programs compare the loss curve of the first ``WARMUP``
steps (each way from the same initial state), forward programs their
outputs; per output, max |got - plain| / max |plain|. Times: the median over
``--rounds`` rounds of ``--steps`` steps each, the three ways interleaved
within a round (their order rotating from round to round), after the warm-up
steps (which compile). Training programs carry their state from step to
step (parameters and optimizer state; NNX's in place). A way that raises
shows its exception in the last column instead of stopping the script.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import statistics
import sys
import time
import traceback

DEVICES = 8
WARMUP = 3           # steps run (and compared) before timing; the first compiles
MAXTEXT_LR = 3e-3    # as jax_tests/test_frameworks.py trains the MaxText decoder
DECODE_ROWS, DECODE_TOKENS = 4, 8
WAYS = ("plain", "auto", "ring")


class Program:
    """A framework program: its mesh (for the table), the context its steps run
    in, how its fused products are counted, and `make(schedule)` -> (step, fn):
    `step()` runs one step (carrying state) and returns what is compared;
    `fn` is the function overlap wrapped (None when plain)."""

    def __init__(self, mesh: dict, make, *, counted: str, context=contextlib.nullcontext):
        self.mesh, self.make, self.counted, self.context = mesh, make, counted, context


# --------------------------------------------------------------------------
# The programs, built from jax_tests/programs/fw_*.py
# --------------------------------------------------------------------------
def _wrap(fn, schedule):
    import commfuse

    return fn if schedule is None else commfuse.overlap(fn, schedule=schedule)


def nnx_program(noisy: bool):
    import jax
    from flax import nnx
    from programs import fw_nnx, make_mesh

    mesh = make_mesh(fw_nnx.MESH)
    x, y = fw_nnx.batch(mesh)

    def make(schedule):
        model, optimizer = fw_nnx.create(mesh, noisy=noisy)
        fn = _wrap(fw_nnx.train_step, schedule)
        jitted = nnx.jit(fn)
        return (lambda: jitted(model, optimizer, x, y)), fn

    return Program(fw_nnx.MESH, make, counted="partitioned", context=lambda: jax.set_mesh(mesh))


def maxtext_program():
    import optax
    from programs import fw_maxtext, make_mesh

    mesh = make_mesh(fw_maxtext.MESH)
    optimizer = optax.adamw(MAXTEXT_LR)
    tokens, targets = fw_maxtext.batch(mesh)

    def make(schedule):
        fn = _wrap(fw_maxtext.make_train_step(fw_maxtext.make_model(mesh), optimizer), schedule)
        jitted = fw_maxtext.jit_train_step(fn, mesh, optimizer)
        params = fw_maxtext.init_params(mesh)
        state = [params, fw_maxtext.init_opt_state(optimizer, params, mesh)]

        def step():
            state[0], state[1], metrics = jitted(state[0], state[1], tokens, targets)
            return metrics["loss"]

        return step, fn

    return Program(fw_maxtext.MESH, make, counted="partitioned")


def equinox_program():
    import equinox as eqx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from programs import fw_equinox, make_mesh

    mesh = make_mesh(fw_equinox.MESH)
    x, y = fw_equinox.batch(mesh)

    def make(schedule):
        model, model_shardings, optimizer, opt_state = fw_equinox.create(mesh)
        fn = _wrap(fw_equinox.make_step(optimizer, model_shardings, NamedSharding(mesh, P("data"))), schedule)
        jitted = eqx.filter_jit(fn)
        state = [model, opt_state]

        def step():
            loss, state[0], state[1] = jitted(state[0], state[1], x, y)
            return loss

        return step, fn

    return Program(fw_equinox.MESH, make, counted="partitioned")


def sp_program():
    import jax
    from programs import fw_shardmap_sp, make_mesh

    mesh = make_mesh(fw_shardmap_sp.MESH)

    def make(schedule):
        params, optimizer, opt_state, x, y = fw_shardmap_sp.init(mesh)
        fn = _wrap(fw_shardmap_sp.make_step(mesh, optimizer), schedule)
        jitted = jax.jit(fn)
        state = [params, opt_state]

        def step():
            loss, state[0], state[1] = jitted(state[0], state[1], x, y)
            return loss

        return step, fn

    return Program(fw_shardmap_sp.MESH, make, counted="rewrites")


def moe_program(name: str):
    import jax
    from programs import fw_moe, make_mesh

    build, axes = {"ep": (fw_moe.make_ep, fw_moe.EP_MESH), "ep_tp": (fw_moe.make_ep_tp, fw_moe.EP_TP_MESH)}[name]
    fn, args = build(make_mesh(axes))

    def make(schedule):
        wrapped = _wrap(fn, schedule)
        jitted = jax.jit(wrapped)
        return (lambda: jitted(*args)), wrapped

    return Program(axes, make, counted="rewrites")


def decode_program():
    import jax
    from programs import fw_decode, make_mesh

    mesh = make_mesh(fw_decode.MESH)
    args = fw_decode.init(mesh, DECODE_ROWS)

    def make(schedule):
        fn = _wrap(fw_decode.make_decode(mesh, DECODE_TOKENS), schedule)
        jitted = jax.jit(fn)
        return (lambda: jitted(*args)), fn

    return Program(fw_decode.MESH, make, counted="partitioned")


PROGRAMS = {
    "nnx": ("NNX train step", lambda: nnx_program(noisy=False)),
    "nnx_noisy": ("NNX noisy model (BatchNorm, dropout, counter)", lambda: nnx_program(noisy=True)),
    "maxtext": ("MaxText decoder train step (scan + remat, bf16)", maxtext_program),
    "equinox": ("Equinox train step", equinox_program),
    "sp": ("shard_map TP+SP step, adam in the body", sp_program),
    "moe_ep": ("MoE expert-parallel forward", lambda: moe_program("ep")),
    "moe_ep_tp": ("MoE expert x tensor forward", lambda: moe_program("ep_tp")),
    "decode": (f"TP decode, fori_loop, {DECODE_ROWS} rows x {DECODE_TOKENS} tokens", decode_program),
}


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------
def _ran_fused(entry) -> bool:
    return entry.fused > 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _rel_error(got: list, want: list) -> float:
    """Largest over outputs of max |got - want| / max |want| (outputs stacked over the warm-up steps)."""
    import numpy as np

    error = 0.0
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return float("inf")
        error = max(error, float(np.max(np.abs(g - w), initial=0.0)) / max(float(np.max(np.abs(w), initial=0.0)),
                                                                            1e-30))
    return error


def measure(program: Program, rounds: int, steps: int) -> dict:
    """{way: {"fused", "outputs", "times", "error"}} for plain, auto and ring."""
    import jax
    import numpy as np

    from commfuse import _matmul

    results = {way: {"fused": None, "outputs": None, "times": [], "error": None} for way in WAYS}
    runs = {}
    with program.context():
        jax.clear_caches()  # every way below compiles afresh: the partitioner runs (and reports) again
        for way in WAYS:
            schedule = None if way == "plain" else way
            try:
                step, fn = program.make(schedule)
                # One compile counted: a later step may compile again (new state's types).
                with _matmul.watching() as seen:
                    outputs = [[np.asarray(leaf) for leaf in jax.tree.leaves(step())]]  # traces and compiles
                for _ in range(WARMUP - 1):
                    outputs.append([np.asarray(leaf) for leaf in jax.tree.leaves(step())])
                results[way]["outputs"] = [np.stack(leaves) for leaves in zip(*outputs)]
                if schedule is not None:
                    if program.counted == "rewrites":
                        results[way]["fused"] = sum(1 for line in getattr(fn, "last_report", ())
                                                    if "]: rewrote " in line)
                    else:
                        results[way]["fused"] = sum(1 for entry in seen if _ran_fused(entry))
                runs[way] = step
            except Exception as exc:  # noqa: BLE001 - shown in the table
                results[way]["error"] = _first_line(exc)
                if os.environ.get("FRAMEWORK_REPORT_TRACEBACK"):
                    traceback.print_exc()
        for r in range(rounds):
            order = list(runs)
            order = order[r % len(order):] + order[:r % len(order)]
            for way in order:
                try:
                    start = time.perf_counter()
                    for _ in range(steps):
                        out = runs[way]()
                    jax.block_until_ready(out)
                    results[way]["times"].append((time.perf_counter() - start) / steps)
                except Exception as exc:  # noqa: BLE001 - shown in the table
                    results[way]["error"] = _first_line(exc)
                    del runs[way]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timing rounds (the median is reported)")
    parser.add_argument("--steps", type=int, default=5, help="steps per way per round")
    parser.add_argument("--only", action="append", choices=list(PROGRAMS), metavar="NAME",
                        help=f"run only this program (repeatable): {', '.join(PROGRAMS)}")
    args = parser.parse_args()

    # XLA reads XLA_FLAGS when JAX creates its first backend: before anything imports jax.
    flag = "--xla_force_host_platform_device_count"
    flags = re.sub(flag + r"=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{flag}={DEVICES}"])
    os.environ["COMMFUSE_AUTO_UNFUSED"] = "1"  # auto with the cost model's veto on
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jax_tests"))
    import jax

    import commfuse  # noqa: F401 - imported before the programs build anything

    print(f"jax {jax.__version__}, Python {platform.python_version()}, {jax.device_count()} "
          f"{jax.default_backend()} devices, COMMFUSE_AUTO_UNFUSED=1, {args.rounds} rounds x {args.steps} steps")
    sys.stdout.flush()

    rows = []
    for name in args.only or PROGRAMS:
        _, build = PROGRAMS[name]
        start = time.perf_counter()
        try:
            program = build()
        except Exception as exc:  # noqa: BLE001 - shown in the table
            rows.append((name, {}, None, _first_line(exc), time.perf_counter() - start))
            continue
        results = measure(program, args.rounds, args.steps)
        rows.append((name, program.mesh, results, None, time.perf_counter() - start))

    print(f"{'program':<10} {'mesh':<16} {'fused':>5} {'fused':>5} {'max rel err':>11} {'max rel err':>11} "
          f"{'plain':>8} {'auto':>8} {'ring':>8} {'auto/':>6} {'ring/':>6}  error")
    print(f"{'':<10} {'':<16} {'auto':>5} {'ring':>5} {'auto':>11} {'ring':>11} "
          f"{'ms':>8} {'ms':>8} {'ms':>8} {'plain':>6} {'plain':>6}")
    for name, axes, results, failure, _ in rows:
        mesh = "x".join(f"{k}={v}" for k, v in axes.items())
        if results is None:
            print(f"{name:<10} {mesh:<16} {'':>5} {'':>5} {'':>11} {'':>11} {'':>8} {'':>8} {'':>8} {'':>6} "
                  f"{'':>6}  {failure}")
            continue
        plain = results["plain"]
        fused, errors, times, ratios = {}, {}, {}, {}
        for way in WAYS:
            r = results[way]
            fused[way] = "-" if r["fused"] is None else str(r["fused"])
            errors[way] = ("-" if r["outputs"] is None or plain["outputs"] is None
                           else f"{_rel_error(r['outputs'], plain['outputs']):.1e}")
            times[way] = statistics.median(r["times"]) * 1e3 if r["times"] else None
        for way in ("auto", "ring"):
            ratios[way] = (f"{times[way] / times['plain']:.2f}x" if times[way] is not None and times["plain"]
                           else "-")
        shown = {way: "-" if times[way] is None else f"{times[way]:.2f}" for way in WAYS}
        failures = "; ".join(f"{way}: {results[way]['error']}" for way in WAYS if results[way]["error"])
        print(f"{name:<10} {mesh:<16} {fused['auto']:>5} {fused['ring']:>5} {errors['auto']:>11} "
              f"{errors['ring']:>11} {shown['plain']:>8} {shown['auto']:>8} {shown['ring']:>8} "
              f"{ratios['auto']:>6} {ratios['ring']:>6}  {failures}".rstrip())
    for name, *_ in rows:
        print(f"  {name:<10} {PROGRAMS[name][0]}")
    print(f"total {sum(row[-1] for row in rows):.0f} s")


if __name__ == "__main__":
    main()
