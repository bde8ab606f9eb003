"""The CPU link model (COMMFUSE_CPU_LINK): throttled transfers show in wall
time as the model says, results do not change, and a malformed value is an
error naming the variable and the field.

Bounds are generous: the machine may be loaded and has two cores. The model
only ever delays a message (the receiver sleeps until its stamped arrival),
so the lower bound is firm; the upper bound leaves room for scheduling.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import commfuse
from conftest import P, assert_close, lax_all_gather_matmul, mesh1d, place, rand, sharded_fn

N = 4
M, K, NO = 256, 256, 64          # per-rank x [M, K] f32: 256 KiB travels per ring step
BLOCK_BYTES = M * K * 4
VAR = "COMMFUSE_CPU_LINK"


def _setup(schedule="ring"):
    mesh = mesh1d(N)
    x = rand((N * M, K), seed=1)
    w = rand((K, NO), seed=2)
    specs = (P("x", None), P(None, None))
    fused = sharded_fn(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule=schedule), mesh, specs)
    reference = sharded_fn(lambda a, b: lax_all_gather_matmul(a, b, "x"), mesh, specs)
    args = (place(x, mesh, specs[0]), place(w, mesh, specs[1]))
    return fused, reference, args


def _median_time(fn, args, repeats=3):
    times = []
    out = None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args)
        out.block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), np.asarray(out)


def test_wall_time_follows_the_link_model_and_results_are_unchanged(monkeypatch):
    fused, reference, args = _setup()
    monkeypatch.delenv(VAR, raising=False)
    fused(*args).block_until_ready()  # compile and warm up at full speed
    base, out_fast = _median_time(fused, args)

    gbytes_per_s, latency_us = 0.005, 2000
    monkeypatch.setenv(VAR, f"gbytes_per_s={gbytes_per_s},latency_us={latency_us},topology=switch")
    # The ring sends one block per step, N-1 steps in a chain: each pays the
    # latency and the block's time on the ports.
    model = (N - 1) * (BLOCK_BYTES / (gbytes_per_s * 1e9) + latency_us * 1e-6)
    slow, out_slow = _median_time(fused, args)
    print(f"full speed {base * 1e3:.1f} ms, link model {slow * 1e3:.1f} ms, model comm {model * 1e3:.1f} ms")
    assert slow >= 0.9 * model, (slow, model)
    assert slow <= base + 1.5 * model + 0.25, (slow, base, model)

    np.testing.assert_array_equal(out_slow, out_fast)
    assert_close(out_slow, np.asarray(reference(*args)))

    # Read when the program runs: unsetting it restores full speed without recompiling.
    monkeypatch.delenv(VAR)
    again, _ = _median_time(fused, args)
    assert again < slow - 0.5 * model, (again, slow)


def test_both_neighbours_of_a_ring_topology_carry_data_at_once(monkeypatch):
    # Bidirectional sends to both neighbours each step: under a ring of links
    # both go at full bandwidth, under a switch they share the out port.
    fused, _, args = _setup("bidirectional")
    monkeypatch.delenv(VAR, raising=False)
    fused(*args).block_until_ready()
    per_block = BLOCK_BYTES / 0.005e9
    monkeypatch.setenv(VAR, "gbytes_per_s=0.005,topology=ring")
    ring, _ = _median_time(fused, args)
    monkeypatch.setenv(VAR, "gbytes_per_s=0.005,topology=switch")
    switch, _ = _median_time(fused, args)
    print(f"bidirectional N={N}: ring links {ring * 1e3:.1f} ms, switch {switch * 1e3:.1f} ms")
    # N=4: exchanges of 2 and 1 blocks. Ring: 2 block times; switch: 3.
    assert ring >= 0.9 * 2 * per_block
    assert switch >= 0.9 * 3 * per_block
    assert ring < switch


@pytest.mark.parametrize("value, field", [
    ("gbytes_per_s=fast", "gbytes_per_s=fast"),
    ("gbytes_per_s=1,topology=torus", "topology=torus"),
    ("speed=3", "speed=3"),
])
def test_a_malformed_value_is_an_error_naming_the_variable_and_field(monkeypatch, value, field):
    fused, _, args = _setup()
    monkeypatch.delenv(VAR, raising=False)
    fused(*args).block_until_ready()
    monkeypatch.setenv(VAR, value)
    with pytest.raises(Exception, match=VAR) as info:
        fused(*args).block_until_ready()
    assert f"bad field `{field}`" in str(info.value)
    assert "INVALID_ARGUMENT" in str(info.value) or "invalid argument" in str(info.value)
