"""Soak: many fused calls and gradient steps in one process, with the
resident memory and the thread count sampled. Fails if memory grows by more
than 1% after the warm-up, or threads keep being added.

``COMMFUSE_SOAK=1`` runs 10,000 calls and 10,000 gradient steps (minutes);
otherwise a short version runs (2,000 of each). Figures are printed (-s).
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import commfuse
from conftest import P, mesh1d, place, rand

LONG = os.environ.get("COMMFUSE_SOAK") == "1"
STEPS = 10_000 if LONG else 2_000
WARM_UP = 500
SAMPLES = 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _soak(step, label: str):
    """Runs `step` STEPS times after WARM_UP; returns the figures and checks them."""
    for _ in range(WARM_UP):
        step()
    every = STEPS // SAMPLES
    rss, threads = [], []
    start = time.monotonic()
    for i in range(STEPS):
        step()
        if i % every == every - 1:
            rss.append(_rss_bytes())
            threads.append(_threads())
    took = time.monotonic() - start
    # The median of the first and last quarter of the samples: one
    # allocator's high-water step is not a leak.
    quarter = max(1, SAMPLES // 4)
    first, last = statistics.median(rss[:quarter]), statistics.median(rss[-quarter:])
    growth = (last - first) / first
    print(f"\n{label}: {STEPS} steps in {took:.1f} s ({STEPS / took:.0f}/s); RSS {first / 2**20:.1f} -> "
          f"{last / 2**20:.1f} MiB ({growth * 100:+.2f}%), max {max(rss) / 2**20:.1f} MiB; threads "
          f"{threads[0]} -> {threads[-1]} (max {max(threads)})")
    assert growth <= 0.01, f"{label}: RSS grew {growth * 100:.2f}% after the warm-up: {rss}"
    assert threads[-1] <= threads[0] + 2, f"{label}: threads keep being added: {threads}"


def _layer(mesh):
    """An FSDP x sequence-parallel layer: gathered rows in, scattered rows out."""
    def body(x, w1, w2):
        h = commfuse.all_gather_matmul(x, w1, "x", schedule="ring")
        return commfuse.matmul_reduce_scatter(jnp.tanh(h), w2, "x", schedule="bidirectional")
    return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x"))


def test_calls_and_gradient_steps_do_not_grow_memory_or_threads():
    mesh = mesh1d(4)
    x, w1, w2 = rand((4 * 16, 32), seed=1), rand((32, 64), seed=2) * 0.2, rand((64, 32), seed=3) * 0.2
    xs, w1s, w2s = place(x, mesh, P("x")), place(w1, mesh, P()), place(w2, mesh, P())
    forward = jax.jit(_layer(mesh))
    _soak(lambda: forward(xs, w1s, w2s).block_until_ready(), "calls")

    loss = lambda w1, w2: jnp.mean(_layer(mesh)(xs, w1, w2) ** 2)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    params = [w1s, w2s]

    def train_step():
        g1, g2 = grad(*params)
        params[0], params[1] = params[0] - 0.1 * g1, params[1] - 0.1 * g2
        params[1].block_until_ready()

    before = float(loss(*params))
    _soak(train_step, "gradient steps")
    assert np.isfinite(float(loss(*params))) and float(loss(*params)) < before, "training made no progress"
