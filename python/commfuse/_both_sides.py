"""A dot with a collective on each side: a gather feeding it over one mesh
axis and a sum (``psum``) or reduce-scatter of its result over another —
FSDP weights gathered into a tensor-parallel product, or sequence-parallel
activations gathered into a weight gradient that data parallelism sums.

The ways to run it, timed by the cost model (`choose`):

* ``gather``: the gather fused with the dot, the sum exposed after it;
* ``reduce``: the sum fused with the dot, the gather exposed before it;
* ``tiles``: the gathered operand cut into T tiles along a dim that the
  result keeps; each tile is one fused gather-and-multiply (moving 1/T of
  the operand, so the gather moves no more in all), and each tile's result
  is summed by XLA's own collective while the next tile's fused op runs
  (no data dependence between them). Only the last tile's sum is exposed;
* ``two_axis``: where the dot is ``psum_scatter(x @ all_gather(w, A,
  axis=1), B)`` (an FSDP x TP row-parallel layer), one fused op over both
  axes (``commfuse.all_gather_matmul_reduce_scatter``): w's blocks travel
  round A while each block's partial sums leave round B.

A dot whose two operands are gathered over two axes (``all_gather(x, B) @
all_gather(w, A)``, an SP x FSDP column-parallel layer) is timed by
`choose_two_gathers`: x's gather fused (w's exposed before it), w's fused
(x's exposed), or one op over both axes (``commfuse.all_gather_both_matmul``).

`Tiling` says how the operand is cut and the tiles' results put back.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from . import _abi, _explain
from ._decide import Machine, may_decline, us

TILES = (4, 2)


@dataclass(frozen=True)
class Tiling:
    """How the gathered operand (before its gather) is cut: along `dim`,
    into `count` tiles. `interleaved`: `dim` is the gathered dim itself, so
    tile t is sub-block t of every rank's block, and its result along
    `out_dim` comes out as ``[rank, sub-block]``; otherwise the tiles are
    contiguous and their results are concatenated along `out_dim`."""
    dim: int
    count: int
    out_dim: int        # the result's dim (after the chain's transposes) `dim` becomes
    interleaved: bool
    ranks: int          # of the gather

    def tile(self, a, t: int):
        size = a.shape[self.dim] // self.count
        return jax.lax.slice_in_dim(a, t * size, (t + 1) * size, axis=self.dim)

    def combine(self, parts: list):
        if not self.interleaved:
            return jnp.concatenate(parts, axis=self.out_dim)
        d = self.out_dim
        split = [p.reshape(p.shape[:d] + (self.ranks, p.shape[d] // self.ranks) + p.shape[d + 1:]) for p in parts]
        stacked = jnp.stack(split, axis=d + 1)  # [.., rank, tile, sub-block, ..]
        return stacked.reshape(parts[0].shape[:d] + (-1,) + parts[0].shape[d + 1:])


def find_tiling(operand_shape, gather_dim: int, free_dims: list, out_dim_of, scatter_dim, ranks: int):
    """A `Tiling` of the gathered operand (local shape `operand_shape`), or
    (None, why). `free_dims`: its dims the dot keeps, `out_dim_of(d)` the
    result dim each becomes (after the chain's transposes); `scatter_dim`:
    the result dim a reduce-scatter splits (None for a sum), which a tiling
    must not cut."""
    for interleaved in (False, True):
        for d in free_dims:
            if (d == gather_dim) != interleaved:
                continue
            out = out_dim_of(d)
            if out is None or out == scatter_dim:
                continue
            count = next((c for c in TILES if operand_shape[d] % c == 0 and operand_shape[d] >= c), None)
            if count is not None:
                return Tiling(d, count, out, interleaved, ranks), None
    return None, "no dim of the gathered operand that the result keeps (and does not scatter) splits into tiles"


def choose(op: str, x_shape, w_shape, n_gather: int, dimension: int, reduce_kind: str, n_reduce: int,
           reduce_x_shape, reduce_w_shape, tiles: int | None, dtype, machine: Machine | None = None,
           decline: bool = True, two_axis: tuple | None = None) -> tuple[list, str]:
    """(the ways fastest first, why) by the cost model: "gather", "reduce",
    "tiles" (given a count of `tiles`) and, given `two_axis`, "two_axis".
    `op` is the gather's fused op
    on the whole operands (one device's shapes), `reduce_kind` the sum's
    ("psum" or "psum_scatter", over `n_reduce` ranks) on the dot as the
    reduce side's fused op takes it. The sum's time alone is its
    reduce-scatter's transfers (twice that for a psum: reduce-scatter, then
    all-gather), on `machine` (None: the one the program runs on); a fused
    call's fixed cost counts where "auto" may `decline` to fuse.
    `two_axis`: the dot has the form of an op over both axes, given as
    ``(op, x_shape, w_shape, dimension)`` of its library call over the
    devices of both axes: that op is timed too, as "two_axis", where the
    cost model can time it."""
    machine = machine or Machine.current()
    devices = n_gather * n_reduce
    gather = _explain.predict(op, x_shape, w_shape, n_gather, dimension=dimension, dtype=dtype, machine=machine.spec,
                              gemm_gflops=_rate_in_step(machine, n_gather, devices))
    reduce = _explain.predict("matmul_reduce_scatter", reduce_x_shape, reduce_w_shape, n_reduce, dtype=dtype,
                              machine=machine.spec)
    t_c, t_g = gather["t_compute"], gather["t_comm"]
    t_r = reduce["t_comm"] * (2 if reduce_kind == "psum" else 1)
    # A fused call's fixed cost, as measured for the devices of both axes:
    # each way runs on all of them at once (one group per other axis's index).
    fixed = machine.call_overhead_s(devices) if decline and may_decline() else 0.0
    times = {
        "gather": max(t_c, t_g) + t_r + fixed,
        "reduce": t_g + max(t_c, t_r) + fixed,
    }
    if tiles:
        times["tiles"] = max(t_c, t_g) + t_r / tiles + tiles * fixed
    if two_axis:
        both_op, both_x, both_w, both_dimension = two_axis
        try:
            both = _explain.predict(both_op, both_x, both_w, devices, dimension=both_dimension, dtype=dtype,
                                    machine=machine.spec)
        except (ValueError, TypeError, KeyError):
            both = None  # the other ways are timed without it
        if both is not None:
            # By its plan's predicted time (its adds and every exchange's
            # cost in it), against the others' ideal overlap: it is taken
            # only where it wins even so.
            times["two_axis"] = both["schedules"][both["choice"]] + fixed
    order = sorted(times, key=times.get)
    why = (f"predicted {', '.join(f'{k} {us(v)}' for k, v in times.items())} (compute {us(t_c)}, gather "
           f"{us(t_g)}, {reduce_kind} {us(t_r)})")
    return order, why


def choose_two_gathers(x_shape, w_shape, x_ranks: int, w_ranks: int, dtype, machine: Machine | None = None,
                       decline: bool = True) -> tuple[list, str]:
    """(the ways fastest first, why) by the cost model for ``all_gather(x,
    B) @ all_gather(w, A)``, x ``[m, F*kb]`` and w ``[kb, c]`` one device's
    operands, B of `x_ranks` T and A of `w_ranks` F: "x" (x's gather fused
    in ``all_gather_matmul``, w's gather exposed before it), "w" (w's fused
    in ``matmul_all_gather`` on the contraction, x's exposed) and
    "two_gathers" (``all_gather_both_matmul``, both in one op, by its
    plan's predicted time). An exposed gather costs its transfers'
    time; a fused call's fixed cost counts where "auto" may `decline`."""
    machine = machine or Machine.current()
    devices = x_ranks * w_ranks
    (m, k), (kb, c) = x_shape, w_shape
    rate = dict(dtype=dtype, machine=machine.spec)
    x_side = _explain.predict("all_gather_matmul", (m, k), (k, c), x_ranks,
                              gemm_gflops=_rate_in_step(machine, x_ranks, devices), **rate)
    w_side = _explain.predict("matmul_all_gather", (x_ranks * m, k), (kb, c), w_ranks, dimension=0,
                              gemm_gflops=_rate_in_step(machine, w_ranks, devices), **rate)
    both = _explain.predict("all_gather_both_matmul", (m, k), (kb, c), devices, dimension=w_ranks, **rate)
    t_x, t_w = x_side["t_comm"], w_side["t_comm"]
    fixed = machine.call_overhead_s(devices) if decline and may_decline() else 0.0
    times = {
        "x": t_w + max(x_side["t_compute"], t_x) + fixed,
        "w": t_x + max(w_side["t_compute"], t_w) + fixed,
        "two_gathers": both["schedules"][both["choice"]] + fixed,
    }
    order = sorted(times, key=times.get)
    why = (f"predicted {', '.join(f'{k} {us(v)}' for k, v in times.items())} (x's gather {us(t_x)}, w's gather "
           f"{us(t_w)})")
    return order, why


def _rate_in_step(machine: Machine, ranks: int, devices: int) -> float | None:
    """The GEMM rate to price a call over `ranks` of a step's `devices` at:
    CPU devices share this host's cores, and the cost model shares them
    among a call's ranks only, while in the step every device computes at
    once (None: the machine's own rate, where devices do not share)."""
    if not machine.is_cpu:
        return None
    cores = _abi.machine_summary(machine.spec)["shared_processors"]
    if not cores:
        return None
    return machine.gemm_gflops * max(1.0, ranks / cores) / max(1.0, devices / cores)
