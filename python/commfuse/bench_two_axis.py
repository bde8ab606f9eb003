"""The two-axis fused ops against the one-sided fusions and XLA, on 8 CPU
devices as a 2 x 4 (fsdp x tp) mesh, under the link model:

    python -m commfuse.bench_two_axis [--op gather-scatter|two-gathers|contract-scatter] [--reps 7]
                                      [--gbytes-per-s G]

``gather-scatter`` (the default) is an FSDP x TP row-parallel layer,
``psum_scatter(x @ all_gather(w, "fsdp", axis=1), "tp",
scatter_dimension=0)``, at shapes where the weight's gather and the
product's reduce-scatter move the same bytes. ``two-gathers`` is an SP x
FSDP column-parallel layer, ``all_gather(x, "tp") @ all_gather(w,
"fsdp")``, at shapes where the two gathers move the same bytes.
``contract-scatter`` is that layer's weight gradient, ``psum_scatter(
all_gather(x, "tp", axis=1) @ w, "fsdp")`` (x's columns, the contraction,
gathered; the library's gather-contract-scatter kind, which ``overlap``
runs for it), at shapes where the gather and the reduce-scatter move the
same bytes. The link
model (``COMMFUSE_CPU_LINK``, switch topology: one port out and one in per
device) throttles commfuse's transfers only; XLA's own collectives run at
memory speed, so the one-sided fusions, which leave one collective to XLA,
are also given with that collective charged the link's time ("+link").
Each way's median of `reps` interleaved rounds of one jitted step; ratios
from this one run, never asserted.

Columns: T_compute (the local product alone, every device at once: one
GEMM of the gathered operands), the link's time for each collective, and
each way's time against two floors: max(T_compute, first, second) (each
collective on links of its own) and max(T_compute, first + second) (both
through one port per device, as this link model and an NVSwitch have
them).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX creates its CPU backend
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()

import argparse
import statistics
import time
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import commfuse

LINK_VAR = "COMMFUSE_CPU_LINK"
LATENCY_US = 20.0
F, T = 2, 4


def _gather(w):
    return jax.lax.all_gather(w, "fsdp", axis=1, tiled=True)


def _scatter(y):
    return jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)


def ways():
    """(name, per-device body, collective left to XLA: "first" (the gather), "second" (the reduce-scatter),
    "both" or None) of the gather-scatter layer."""
    fused = commfuse.all_gather_matmul_reduce_scatter
    return [
        ("xla", lambda x, w: _scatter(x @ _gather(w)), "both"),
        ("two-axis ring", lambda x, w: fused(x, w, "fsdp", "tp", schedule="ring"), None),
        ("two-axis sliced(2)", lambda x, w: fused(x, w, "fsdp", "tp", schedule="ring", slices=2), None),
        ("two-axis sliced(4)", lambda x, w: fused(x, w, "fsdp", "tp", schedule="ring", slices=4), None),
        ("two-axis auto", lambda x, w: fused(x, w, "fsdp", "tp", schedule="auto"), None),
        ("two-axis sequential", lambda x, w: fused(x, w, "fsdp", "tp", schedule="sequential"), None),
        ("gather fused (ring)", lambda x, w: _scatter(commfuse.matmul_all_gather(x, w, "fsdp", gather_dimension=1,
                                                                                 schedule="ring")), "second"),
        ("reduce fused (ring)", lambda x, w: commfuse.matmul_reduce_scatter(x, _gather(w), "tp", scatter_dimension=0,
                                                                            schedule="ring"), "first"),
    ]


def _gather_x(x):
    return jax.lax.all_gather(x, "tp", axis=0, tiled=True)


def _gather_w_rows(w):
    return jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)


def two_gather_ways():
    """(name, per-device body, collective left to XLA or None) of the two-gather layer."""
    fused = commfuse.all_gather_both_matmul
    return [
        ("xla", lambda x, w: _gather_x(x) @ _gather_w_rows(w), "both"),
        ("two-gather ring", lambda x, w: fused(x, w, "tp", "fsdp", schedule="ring"), None),
        ("two-gather sliced(2)", lambda x, w: fused(x, w, "tp", "fsdp", schedule="ring", slices=2), None),
        ("two-gather sliced(4)", lambda x, w: fused(x, w, "tp", "fsdp", schedule="ring", slices=4), None),
        ("two-gather auto", lambda x, w: fused(x, w, "tp", "fsdp", schedule="auto"), None),
        ("two-gather sequential", lambda x, w: fused(x, w, "tp", "fsdp", schedule="sequential"), None),
        ("x fused (ring)", lambda x, w: commfuse.all_gather_matmul(x, _gather_w_rows(w), "tp", schedule="ring"),
         "second"),
        ("w fused (ring)", lambda x, w: commfuse.matmul_all_gather(_gather_x(x), w, "fsdp", gather_dimension=0,
                                                                   schedule="ring"), "first"),
    ]


def _gather_columns(x):
    return jax.lax.all_gather(x, "tp", axis=1, tiled=True)


def _scatter_rows_fsdp(y):
    return jax.lax.psum_scatter(y, "fsdp", scatter_dimension=0, tiled=True)


def contract_scatter_ways():
    """(name, per-device body, collective left to XLA or None) of the weight gradient."""
    from . import _all_gather_contract_matmul_reduce_scatter as contract

    def fused(schedule):
        return lambda x, w: contract.run(contract.decide(x, w, "tp", "fsdp", schedule=schedule), x, w)

    return [
        ("xla", lambda x, w: _scatter_rows_fsdp(_gather_columns(x) @ w), "both"),
        ("op ring", fused("ring"), None),
        ("op sequential", fused("sequential"), None),
        # x_all @ w = (wᵀ @ all_gather(xᵀ, "tp", axis=0))ᵀ: the contraction's gather fused.
        ("gather fused (ring)", lambda x, w: _scatter_rows_fsdp(
            commfuse.matmul_all_gather(w.T, x.T, "tp", gather_dimension=0, schedule="ring").T), "second"),
        ("reduce fused (ring)", lambda x, w: commfuse.matmul_reduce_scatter(_gather_columns(x), w, "fsdp",
                                                                            schedule="ring"), "first"),
    ]


def _time(fns, args, reps):
    for f in fns:
        jax.block_until_ready(f(*args))
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


class _Case(NamedTuple):
    """One mode's measurement: the header's shapes, its ways, the shard_map
    spec and operands, the local product alone (function, operands), and
    each collective (name, bytes, ring steps); the link's default bandwidth
    makes collective `paced` (0 or 1) as long as the local product."""
    shapes: str
    ways: list
    spec: dict
    operands: tuple
    compute: object
    compute_operands: tuple
    collectives: tuple
    paced: int


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--gbytes-per-s", type=float, default=None,
                        help="the link's bandwidth (default: one collective's bytes in T_compute)")
    parser.add_argument("--rows", type=int, default=256, help="rows of x per device")
    parser.add_argument("--op", choices=("gather-scatter", "two-gathers", "contract-scatter"),
                        default="gather-scatter")
    args = parser.parse_args(argv)
    mesh = jax.make_mesh((F, T), ("fsdp", "tp"), devices=jax.devices()[:F * T])
    case = {"gather-scatter": gather_scatter, "two-gathers": two_gathers,
            "contract-scatter": contract_scatter}[args.op](mesh, args.rows)
    _measure(case, args)


def _measure(case: _Case, args) -> None:
    """Times `case`'s ways under the link model (each checked against the
    first, XLA's) and prints them against both floors."""
    os.environ.pop(LINK_VAR, None)
    t_compute = _time([case.compute], case.compute_operands, args.reps)[0]
    gbps = args.gbytes_per_s or case.collectives[case.paced][1] / t_compute / 1e9
    t_first, t_second = (nbytes / (gbps * 1e9) + steps * LATENCY_US * 1e-6 for _, nbytes, steps in case.collectives)
    os.environ[LINK_VAR] = f"gbytes_per_s={gbps},latency_us={LATENCY_US},topology=switch"
    fns = [jax.jit(jax.shard_map(body, **case.spec)) for _, body, _ in case.ways]
    want = np.asarray(fns[0](*case.operands))
    for (name, _, _), f in zip(case.ways, fns):
        got = np.asarray(f(*case.operands))
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max()), name
    measured = _time(fns, case.operands, args.reps)
    os.environ.pop(LINK_VAR, None)

    (first, first_bytes, _), (second, second_bytes, _) = case.collectives
    own, shared = max(t_compute, t_first, t_second), max(t_compute, t_first + t_second)
    ms = lambda s: f"{s * 1e3:8.2f}"  # noqa: E731
    print(f"jax {jax.__version__}, {F} x {T} CPU devices (fsdp x tp) on {os.cpu_count()} cores; {case.shapes}, f32; "
          f"link {gbps:.4f} GB/s, {LATENCY_US:.0f} us, switch; medians of {args.reps} interleaved rounds")
    print(f"T_compute {ms(t_compute)} ms; link: {first} {ms(t_first)} ms ({first_bytes} B), {second} "
          f"{ms(t_second)} ms ({second_bytes} B)")
    print(f"floors: own links max(compute, {first}, {second}) = {ms(own)} ms; one port "
          f"max(compute, {first} + {second}) = {ms(shared)} ms")
    print(f"{'way':<22} {'ms':>8} {'+link ms':>9} {'/ own floor':>11} {'/ one-port floor':>16}")
    for (name, _, left), t in zip(case.ways, measured):
        charged = t + {"first": t_first, "second": t_second, "both": t_first + t_second, None: 0.0}[left]
        print(f"{name:<22} {ms(t)} {ms(charged):>9} {charged / own:>11.2f} {charged / shared:>16.2f}")


def gather_scatter(mesh, m) -> _Case:
    """The FSDP x TP layer: x [m, kb] per device (its rows over fsdp, its columns over tp), w [kb, c] (its rows over tp,
    its columns over fsdp); the result's rows over (fsdp, tp)."""
    # The gather moves (F-1) kb*c, the reduce-scatter F (T-1) (m/T) c: equal for kb = F (T-1) m / (T (F-1)).
    kb, c = F * (T - 1) * m // (T * (F - 1)), 256
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((F * m, T * kb), np.float32), NamedSharding(mesh, P("fsdp", "tp")))
    w = jax.device_put(rng.standard_normal((T * kb, F * c), np.float32) / kb, NamedSharding(mesh, P("tp", "fsdp")))
    spec = dict(mesh=mesh, in_specs=(P("fsdp", "tp"), P("tp", "fsdp")), out_specs=P(("fsdp", "tp")))
    # The local product alone: each device's whole product at once, w already gathered.
    w_full = jax.device_put(np.asarray(w).reshape(T, kb, F * c).repeat(F, axis=0).reshape(F * T * kb, F * c),
                            NamedSharding(mesh, P(("fsdp", "tp"))))
    compute = jax.jit(jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("fsdp", "tp"), P(("fsdp", "tp"))),
                                    out_specs=P(("fsdp", "tp"))))
    collectives = (("gather", (F - 1) * kb * c * 4, F - 1), ("reduce-scatter", F * (T - 1) * (m // T) * c * 4,
                                                             F * (T - 1)))
    return _Case(f"x per device [{m}, {kb}], w per device [{kb}, {c}]", ways(), spec, (x, w), compute, (x, w_full),
                 collectives, paced=1)


def two_gathers(mesh, m) -> _Case:
    """The SP x FSDP layer: x [m, F*kb] per device (rows over tp), w [kb, c] (rows over fsdp)."""
    # x's gather moves (T-1) m F kb, w's (F-1) kb c: equal for c = (T-1) m F / (F-1).
    kb, c = m, (T - 1) * m * F // (F - 1)
    rng = np.random.default_rng(0)
    x_spec, w_spec = P(("fsdp", "tp")), P("fsdp", "tp")
    x = jax.device_put(rng.standard_normal((F * T * m, F * kb), np.float32), NamedSharding(mesh, x_spec))
    w = jax.device_put(rng.standard_normal((F * kb, T * c), np.float32) / kb, NamedSharding(mesh, w_spec))
    spec = dict(mesh=mesh, in_specs=(x_spec, w_spec), out_specs=P("fsdp", "tp"))
    # The local product alone: both operands already gathered.
    x_full = jax.device_put(np.asarray(x), NamedSharding(mesh, P("fsdp")))
    w_full = jax.device_put(np.asarray(w), NamedSharding(mesh, P(None, "tp")))
    compute = jax.jit(jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("fsdp"), P(None, "tp")),
                                    out_specs=P("fsdp", "tp")))
    collectives = (("x's gather", (T - 1) * m * F * kb * 4, T - 1), ("w's gather", (F - 1) * kb * c * 4, F - 1))
    return _Case(f"x per device [{m}, {F * kb}] (rows over tp), w per device [{kb}, {c}] (rows over fsdp)",
                 two_gather_ways(), spec, (x, w), compute, (x_full, w_full), collectives, paced=0)


def contract_scatter(mesh, kq) -> _Case:
    """The weight gradient: x [F*kq, m] per device (its columns over tp), w [T*m, c]; dw [kq, c] (rows over fsdp)."""
    m = 128
    # The gather moves (T-1) F kq m, the reduce-scatter (F-1) kq c: equal for c = (T-1) F m / (F-1).
    c = (T - 1) * F * m // (F - 1)
    rng = np.random.default_rng(0)
    spec_in = P("fsdp", "tp")
    x = jax.device_put(rng.standard_normal((F * F * kq, T * m), np.float32), NamedSharding(mesh, spec_in))
    w = jax.device_put(rng.standard_normal((F * T * m, T * c), np.float32) / m, NamedSharding(mesh, spec_in))
    spec = dict(mesh=mesh, in_specs=(spec_in, spec_in), out_specs=spec_in)
    # The local product alone: x's columns already gathered.
    x_full = jax.device_put(np.asarray(x), NamedSharding(mesh, P("fsdp")))
    compute = jax.jit(jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("fsdp"), spec_in),
                                    out_specs=spec_in))
    collectives = (("x's gather", (T - 1) * F * kq * m * 4, T - 1), ("reduce-scatter", (F - 1) * kq * c * 4, F - 1))
    return _Case(f"x per device [{F * kq}, {m}] (columns over tp), w per device [{T * m}, {c}], dw [{kq}, {c}] "
                 "(rows over fsdp)", contract_scatter_ways(), spec, (x, w), compute, (x_full, w), collectives,
                 paced=1)


if __name__ == "__main__":
    sys.exit(main())
