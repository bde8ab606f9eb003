"""Pipeline + tensor parallelism: a two-stage MLP on two meshes with
different TP layouts, trained with microbatches one-forward-one-backward,
activations and their gradients crossing stages with ``commfuse.reshard``.

Run as ``python -m commfuse.examples.pipeline [--steps 4] [--microbatches 4]``
(16 CPU devices; no extra packages).

- Stage 0 runs on devices 0-3, a 1-D mesh ``tp``: its first weight is
  column-parallel, its second row-parallel, and its output activation is
  sharded by rows over ``tp`` (sequence-parallel style).
- Stage 1 runs on devices 4-11, a 2x4 mesh ``(dp, tp)``: the activation
  arrives sharded by rows over ``dp`` and replicated over ``tp`` (what its
  column-parallel first weight needs), and the loss is computed there.
- Each transfer is started (``commfuse.reshard_start``: the source devices
  post their pieces) as soon as the array it moves is issued, and received
  (``.result()``) only when the next stage needs it: the gradient of
  microbatch i travels while stage 0 computes the forward of microbatch
  i+1, and that activation travels while stage 0 computes the backward of
  microbatch i. Only the first activation and the last gradient of a step
  have nothing to hide behind (the pipeline's fill and drain).

It prints the losses against a single-device reference of the same model and
update, the step time with ``commfuse.reshard`` and with ``jax.device_put``,
how much of the transfer time the step hides (the step against its compute
alone and its transfers alone), and writes a profile trace (``jax.profiler``,
Perfetto) of one step.
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
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import commfuse

D_MODEL, D_FF, ROWS = 256, 1024, 512  # ROWS: tokens per microbatch
LEARNING_RATE = 0.05


def stage(params, h):
    w1, w2 = params
    return h + jax.nn.gelu(h @ w1) @ w2


def loss_of(params, h, y):
    return jnp.mean((stage(params, h) - y) ** 2)


def init(rng):
    def weights():
        return (rng.standard_normal((D_MODEL, D_FF), np.float32) / np.sqrt(D_MODEL),
                rng.standard_normal((D_FF, D_MODEL), np.float32) / np.sqrt(D_FF))
    return weights(), weights()


class Pipeline:
    """The two stages' meshes, shardings and jitted steps."""

    def __init__(self, devices):
        self.mesh0 = Mesh(np.array(devices[:4]), ("tp",))
        self.mesh1 = Mesh(np.array(devices[4:12]).reshape(2, 4), ("dp", "tp"))
        s0 = lambda *spec: NamedSharding(self.mesh0, P(*spec))
        s1 = lambda *spec: NamedSharding(self.mesh1, P(*spec))
        self.params0 = (s0(None, "tp"), s0("tp", None))
        self.params1 = (s1(None, "tp"), s1("tp", None))
        self.act0 = s0("tp", None)   # stage 0's output: rows over tp
        self.act1 = s1("dp", None)   # stage 1's input: rows over dp, replicated over tp
        self.y1 = s1("dp", None)

        def forward0(p, x):
            return jax.lax.with_sharding_constraint(stage(p, x), self.act0)

        def backward0(p, x, g):  # recomputes the forward (activation checkpointing)
            return jax.vjp(stage, p, x)[1](g)[0]

        def forward_backward1(p, h, y):
            loss, (gp, gh) = jax.value_and_grad(loss_of, argnums=(0, 1))(p, h, y)
            return loss, gp, jax.lax.with_sharding_constraint(gh, self.act1)

        self.forward0 = jax.jit(forward0)
        self.backward0 = jax.jit(backward0, out_shardings=self.params0)
        self.forward_backward1 = jax.jit(forward_backward1, out_shardings=(None, self.params1, self.act1))
        self.sgd = jax.jit(lambda p, g, m: jax.tree.map(lambda a, b: a - LEARNING_RATE * b / m, p, g))

    def place(self, params0, params1, xs, ys):
        put = lambda tree, shardings: tuple(jax.device_put(a, s) for a, s in zip(tree, shardings))
        xs = [jax.device_put(x, NamedSharding(self.mesh0, P("tp", None))) for x in xs]
        ys = [jax.device_put(y, self.y1) for y in ys]
        return put(params0, self.params0), put(params1, self.params1), xs, ys

    def step(self, params0, params1, xs, ys, start):
        """One training step over the microbatches, one forward one backward.
        `start(array, sharding)` starts a transfer and returns a handle whose
        `result()` is the moved array (`commfuse.reshard_start`)."""
        m = len(xs)
        grads0 = grads1 = None
        losses = []
        activation = start(self.forward0(params0, xs[0]), self.act1)
        for i in range(m):
            loss, g1, gh = self.forward_backward1(params1, activation.result(), ys[i])
            gradient = start(gh, self.act0)  # travels during stage 0's forward of microbatch i+1
            if i + 1 < m:  # travels during stage 0's backward of microbatch i
                activation = start(self.forward0(params0, xs[i + 1]), self.act1)
            g0 = self.backward0(params0, xs[i], gradient.result())
            losses.append(loss)
            add = lambda acc, g: g if acc is None else jax.tree.map(jnp.add, acc, g)
            grads0, grads1 = add(grads0, g0), add(grads1, g1)
        params0 = self.sgd(params0, grads0, m)
        params1 = self.sgd(params1, grads1, m)
        return params0, params1, float(np.mean([float(v) for v in losses]))


class Moved:
    """A transfer that is already done (`jax.device_put`, or a replay)."""

    def __init__(self, array):
        self.array = array

    def result(self):
        return self.array


def _timed(fns, reps):
    """Wall times of each `fns[name]()` (blocked on its result), `reps` of
    each after one warm-up, the functions taking turns so that a machine
    getting busier or quieter meanwhile affects them alike."""
    times = {name: [] for name in fns}
    for _ in range(reps + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    return {name: t[1:] for name, t in times.items()}


def reference_step(params0, params1, xs, ys):
    """The same step on one device: mean loss over microbatches, mean gradients."""
    def total(p0, p1):
        return jnp.mean(jnp.stack([loss_of(p1, stage(p0, x), y) for x, y in zip(xs, ys)]))
    loss, (g0, g1) = jax.value_and_grad(total, argnums=(0, 1))(params0, params1)
    update = lambda p, g: jax.tree.map(lambda a, b: a - LEARNING_RATE * b, p, g)
    return update(params0, g0), update(params1, g1), float(loss)


def data(rng, microbatches):
    xs = [rng.standard_normal((ROWS, D_MODEL), np.float32) for _ in range(microbatches)]
    target = rng.standard_normal((D_MODEL, D_MODEL), np.float32) / np.sqrt(D_MODEL)
    return xs, [np.tanh(x @ target) for x in xs]


def run(steps=4, microbatches=4, reps=3, trace_dir="pipeline_trace", out=print):
    devices = jax.devices()
    if len(devices) < 12:
        raise SystemExit(f"the pipeline example needs 12 devices, found {len(devices)}")
    rng = np.random.default_rng(0)
    params0, params1 = init(rng)
    xs, ys = data(rng, microbatches)
    pipe = Pipeline(devices)
    reshard = lambda a, s: commfuse.reshard_start(a, s)
    device_put = lambda a, s: Moved(jax.device_put(a, s))
    p0, p1, xs_d, ys_d = pipe.place(params0, params1, xs, ys)
    r0, r1 = params0, params1
    out(f"stage 0: mesh {dict(pipe.mesh0.shape)} activations {pipe.act0.spec}; stage 1: mesh {dict(pipe.mesh1.shape)} "
        f"activations {pipe.act1.spec}; {microbatches} microbatches of {ROWS} tokens")
    losses = []
    for s in range(steps):
        p0, p1, loss = pipe.step(p0, p1, xs_d, ys_d, reshard)
        r0, r1, ref = reference_step(r0, r1, xs, ys)
        losses.append((loss, ref))
        out(f"step {s}: loss {loss:.6f}  reference {ref:.6f}  rel diff {abs(loss - ref) / abs(ref):.1e}")

    # Overlap, measured: the same step with every transfer already done
    # (compute only), and the step's transfers alone, in the same order.
    recorded = []
    def recording(a, s):
        moved = reshard(a, s).result()
        recorded.append((a, s, moved))
        return Moved(moved)
    jax.block_until_ready(pipe.step(p0, p1, xs_d, ys_d, recording)[:2])
    def compute_only():
        moved = iter([m for _, _, m in recorded])  # each transfer's result, in the order the step asks
        return pipe.step(p0, p1, xs_d, ys_d, lambda a, s: Moved(next(moved)))[:2]
    runs = _timed({
        "commfuse.reshard": lambda: pipe.step(p0, p1, xs_d, ys_d, reshard)[:2],
        "jax.device_put": lambda: pipe.step(p0, p1, xs_d, ys_d, device_put)[:2],
        "compute_only": compute_only,
        "transfers_only": lambda: [commfuse.reshard(a, s) for a, s, _ in recorded],
    }, reps)
    timings = {name: statistics.median(t) for name, t in runs.items()}
    for name in ("commfuse.reshard", "jax.device_put"):
        out(f"step time with {name:17s} {timings[name] * 1e3:8.1f} ms (median of {reps})")
    out(f"ratio reshard / device_put: {timings['commfuse.reshard'] / timings['jax.device_put']:.2f}")
    # The time the transfers add to the step, each step against the
    # compute-only run next to it (the pairs cancel the machine's drift).
    exposed = statistics.median(s - c for s, c in zip(runs["commfuse.reshard"], runs["compute_only"]))
    hidden = 1 - exposed / timings["transfers_only"]
    out(f"compute only {timings['compute_only'] * 1e3:.1f} ms, the step's {len(recorded)} transfers alone "
        f"{timings['transfers_only'] * 1e3:.1f} ms, the step {exposed * 1e3:.1f} ms longer than its compute: "
        f"{max(hidden, 0.0):.0%} of the transfer time hidden behind compute")
    timings.update(exposed=exposed, hidden=hidden)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        transfers = os.path.join(trace_dir, "reshard.pftrace")
        with commfuse.trace(transfers):
            jax.block_until_ready(pipe.step(p0, p1, xs_d, ys_d, reshard)[:2])
        out(f"each transfer's send and receive slices of one step (commfuse.trace, Perfetto): {transfers}")
        try:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                jax.block_until_ready(pipe.step(p0, p1, xs_d, ys_d, reshard)[:2])
            out(f"profile of one step (Perfetto, open at https://ui.perfetto.dev): {trace_dir}")
        except Exception as e:  # the profiler plugin is optional
            out(f"no profile written: {e}")
    return losses, timings


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--trace-dir", default="pipeline_trace")
    args = parser.parse_args()
    run(args.steps, args.microbatches, args.reps, args.trace_dir)


if __name__ == "__main__":
    main()
