"""Plan a model: ``commfuse.plan`` chooses the layout of a GPT-style Flax
Linen training step for 8 GPUs of an H100 node under a memory limit, then
the plan runs the step on this host's 8 CPU devices.

Run as ``python -m commfuse.examples.plan_model [--limit-mib 0.6]`` (needs
the ``examples`` extra: ``pip install ".[examples]"``).

The model names its parameters and activations with Flax's logical axes
(``nn.with_logical_partitioning``, ``nn.with_logical_constraint``) and lets
the planner set its blocks' remat policy (``commfuse.remat_policy``); it
names no mesh axis. Planning compiles every candidate layout for 8 devices
on abstract arguments (``jax.ShapeDtypeStruct``s: nothing is allocated) and
prices each compiled program on the target; the printed table holds the
plan and the layouts people train with. Then the same step, concrete,
is placed by the plan (``plan.shard``) and run through it (``plan.apply``):
its losses are the plain step's on one device.
"""

from __future__ import annotations

import argparse
import os
import sys


def _host_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def run(limit_mib: float, steps: int = 3, path=None):
    """Plans gpt_linen's test step for 8 H100s under `limit_mib` MiB per
    device, saves the plan to `path` (JSON) and loads it back, then trains
    `steps` steps through it and on one device: (plan, planned losses,
    plain losses)."""
    import jax
    import numpy as np

    import commfuse
    from commfuse._planner import corpus

    # What a user writes: the step and its arguments' shapes (ShapeDtypeStructs).
    case = corpus.build("gpt_linen", "test", abstract=True)
    plan = commfuse.plan(case.step, *case.args, devices=8, machine="h100_nvlink",
                         memory_limit=int(limit_mib * 2**20))
    print(plan)
    if path is not None:
        plan.to_json(path)
        plan = commfuse.Plan.from_json(path)

    # The same step on concrete arguments: placed and run as planned ...
    concrete = corpus.build("gpt_linen", "test")
    step = plan.apply(concrete.step)
    params, opt_state, batch = plan.shard(jax.tree.map(np.asarray, concrete.args))
    planned = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        planned.append(float(loss))
    # ... and plain, on one device.
    single = jax.jit(concrete.step)
    params, opt_state, batch = corpus.build("gpt_linen", "test").args
    plain = []
    for _ in range(steps):
        params, opt_state, loss = single(params, opt_state, batch)
        plain.append(float(loss))
    return plan, planned, plain


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="commfuse.plan on a Flax Linen GPT step")
    parser.add_argument("--limit-mib", type=float, default=0.6, help="memory limit per device, MiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save", default=None, help="write the plan here as JSON (and load it back)")
    args = parser.parse_args(argv)
    _host_devices(8)
    plan, planned, plain = run(args.limit_mib, args.steps, args.save)
    print(f"losses through the plan ({plan.candidate.label()}): {[round(x, 5) for x in planned]}")
    print(f"losses of the plain step on one device:           {[round(x, 5) for x in plain]}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(planned, plain))
    print(f"largest relative loss difference: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
