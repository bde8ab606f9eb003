"""``commfuse.explain``: what the cost model (``src/sim``) predicts for one call.

The Rust library simulates every candidate schedule's plan on all ``n`` ranks
of a machine description (GEMM roofline, link bandwidth and latency, switch or
ring topology, one compute and one comm lane per device) and picks the fastest.
The call is laid out by the op's own module (its ``layout`` function, which
its call path uses too) and asked through ``_abi.prepare``.
"""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np

from . import _abi, _all_gather_matmul, _all_to_all, _matmul_all_gather, _matmul_reduce_scatter, _native
from ._decide import Machine, judge, may_decline, us


def _layout(op: str, x: tuple, w: tuple, n: int, dimension: int):
    """(kind, dimension, first shape, second shape) of the library call `op` makes."""
    if op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_gather", "matmul_all_reduce") and (
            len(x) < 2 or len(w) != 2):
        raise ValueError(f"commfuse.explain: {op}: x must have rank >= 2 and w rank 2, got x {x}, w {w}")
    if op == "all_gather_matmul":
        return _all_gather_matmul.layout(x, w, n, dimension)
    if op == "matmul_reduce_scatter":
        return _matmul_reduce_scatter.layout(x, w, n, dimension, axis_name=f"n={n}")
    if op == "matmul_all_gather":
        return _matmul_all_gather.layout(x, w, n, dimension)
    if op == "matmul_all_reduce":  # x's rows, all dims but the last
        return _abi.Kind.MATMUL_ALL_REDUCE, 0, (int(np.prod(x[:-1])), x[-1]), w
    if op == "all_gather_matmul_reduce_scatter":
        # Over two axes: n = F x T devices, `dimension` = F (the gather axis's size).
        if dimension < 1 or n % dimension:
            raise ValueError(f"commfuse.explain: {op}: dimension is the gather axis's size, which must divide "
                             f"n = {n}; got {dimension}")
        return _abi.Kind.ALL_GATHER_MATMUL_REDUCE_SCATTER, dimension, w, (int(np.prod(x[:-1])), x[-1])
    if op == "all_gather_contract_matmul_reduce_scatter":
        # Over two axes: n = F x T devices, `dimension` = F (the scatter axis's size); x [F*kq, m], w [T*m, c].
        if dimension < 1 or n % dimension or len(x) != 2 or len(w) != 2:
            raise ValueError(f"commfuse.explain: {op}: x and w must be 2-D and dimension the scatter axis's size, "
                             f"which must divide n = {n}; got x {x}, w {w}, dimension {dimension}")
        return _abi.Kind.ALL_GATHER_CONTRACT_MATMUL_REDUCE_SCATTER, dimension, x, w
    if op == "all_gather_both_matmul":
        # Over two axes: n = F x T devices, `dimension` = F (w's gather axis's size).
        if dimension < 1 or n % dimension:
            raise ValueError(f"commfuse.explain: {op}: dimension is the size of w's gather axis, which must divide "
                             f"n = {n}; got {dimension}")
        return _abi.Kind.ALL_GATHER_BOTH_MATMUL, dimension, (int(np.prod(x[:-1])), x[-1]), w
    if op in ("all_to_all_matmul", "matmul_all_to_all"):
        # x is given as the blocks for each of the n peers, stacked: [n, rows, k].
        if len(x) != 3 or x[0] != n or len(w) != 2:
            raise ValueError(f"commfuse.explain: {op}: x must be [n, rows, k] (blocks for each of the {n} peers) "
                             f"and w 2-D, got x {x}, w {w}")
        layout = (_all_to_all.layout_all_to_all_matmul if op == "all_to_all_matmul"
                  else _all_to_all.layout_matmul_all_to_all)
        return layout((n * x[1], x[2]), w, n, 0, 0)
    raise ValueError(f"commfuse.explain: unknown op {op!r}; expected all_gather_matmul, matmul_reduce_scatter, "
                     "matmul_all_gather, matmul_all_reduce, all_gather_matmul_reduce_scatter, all_gather_both_matmul, "
                     "all_gather_contract_matmul_reduce_scatter, all_to_all_matmul or matmul_all_to_all")


def explain(op: str, x_shape, w_shape, n: int, *, dimension: int = 0, dtype="float32", machine: str = "cpu_here",
            gemm_gflops: float | None = None, trace=None) -> dict:
    """Prints the plan the cost model picks for ``op`` over ``n`` devices and
    the predicted time of every schedule, and returns the numbers (see
    ``predict``, which gives them without printing)."""
    result = predict(op, x_shape, w_shape, n, dimension=dimension, dtype=dtype, machine=machine,
                     gemm_gflops=gemm_gflops, trace=trace)
    _print(result, tuple(int(d) for d in x_shape), tuple(int(d) for d in w_shape))
    return result


def predict(op: str, x_shape, w_shape, n: int, *, dimension: int = 0, dtype="float32", machine: str = "cpu_here",
            gemm_gflops: float | None = None, trace=None) -> dict:
    """What the cost model predicts for ``op`` over ``n`` devices: the plan
    it picks and the time of every schedule.

    ``x_shape`` and ``w_shape`` are one device's operands as the op takes them
    (``op(x, w, axis)`` inside ``shard_map``); ``dimension`` is the gathered or
    scattered dim (``all_gather_matmul_reduce_scatter``: the size F of its
    gather axis, ``n`` being F x T; ``all_gather_both_matmul``: the size F of
    w's gather axis; ``all_gather_contract_matmul_reduce_scatter``, x
    ``[F*kq, m]`` and w ``[T*m, c]``: the size F of its scatter axis). ``machine`` names a preset: ``"h100_nvlink"``,
    ``"h200_nvlink"``, ``"h100_pcie"``, ``"h100_cluster"`` (nodes of 8; a
    group inside one: ``"h100_cluster:across_nodes=1"`` for one spanning
    nodes), or ``"cpu_here"`` (this host's CPU devices; the link model in
    ``COMMFUSE_CPU_LINK`` applies, and ``gemm_gflops``, a measured
    single-thread GEMM rate, calibrates it). A preset may carry overrides:
    ``"h100_pcie:gbytes_per_s=50,latency_us=10"``.

    Returns a dict: ``memory`` (bytes: ``workspace_cpu`` and
    ``workspace_cuda``, what XLA gives the call on each backend;
    ``blocks_in_flight``, the most the blocks of one rank hold at once (on
    the CPU, transport buffers outside the workspace); ``unfused_temporaries``,
    what the unfused jax.lax expression materializes: the gathered operand or
    the whole product), ``schedules`` (name -> predicted seconds), ``choice`` (the
    fastest fused schedule), ``decision`` (what ``schedule="auto"`` runs: the
    choice, or ``"unfused"`` where the predicted gain is below a fused call's
    fixed cost) and ``decision_reason``, ``t_compute`` (the per-peer pieces'
    GEMMs and sums, no communication), ``t_gemm`` (the local product as one
    GEMM, what the unfused form multiplies), ``t_comm``, ``floor`` =
    max(t_gemm, t_comm): the pieces' last-wave loss shows as distance to it,
    ``machine`` (its figures), ``plan`` (rank 0's steps per lane with their
    predicted start and end) and ``transport`` (how the ranks' blocks would
    move: ``"host"`` between CPU devices; on GPUs of one process ``"copies"``,
    copy engines, unless ``commfuse.configure(transport="nccl")`` or
    ``COMMFUSE_TRANSPORT=nccl`` asks for NCCL, which groups spanning processes
    always take).

    ``trace``, a path, also gets the predicted timeline of ``choice`` as a
    Perfetto trace (JSON where it ends in ``.json``; open it at
    ui.perfetto.dev): a process per device, a thread per lane, each step a
    slice at its predicted start and end, and a wait where a step waits for
    the other lane, as ``commfuse.trace`` records real runs.
    """
    x, w = tuple(int(d) for d in x_shape), tuple(int(d) for d in w_shape)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"commfuse.explain: n must be a positive int, got {n!r}")
    name = jnp.dtype(dtype).name
    if jnp.dtype(dtype) not in _abi.DTYPE_CODES:
        raise ValueError(f"commfuse.explain: unsupported dtype {name}; expected one of "
                         f"{', '.join(d.name for d in _abi.DTYPE_CODES)}")
    try:
        target = Machine.checked(machine)
    except ValueError as e:
        raise ValueError(f"commfuse.explain: {e}") from None
    if gemm_gflops is not None and not float(gemm_gflops) > 0:
        raise ValueError(f"commfuse.explain: gemm_gflops must be positive, got {gemm_gflops!r}")
    rate = float(gemm_gflops) if gemm_gflops is not None else target.gemm_gflops
    kind, dim, first, second = _layout(op, x, w, n, int(dimension))
    shapes = _abi.call_shapes(kind, _abi.AUTO, n, dim, first, second, jnp.dtype(dtype), jnp.dtype(dtype))
    try:
        prepared = _abi.prepare(shapes, target.spec, rate, explain=True, trace=trace)
    except ValueError as e:
        raise ValueError(f"commfuse.explain: {e}") from None
    result = dict(prepared["explain"])
    result["op"] = op
    result["memory"] = {
        "workspace_cpu": prepared["workspace"]["cpu"],
        "workspace_cuda": prepared["workspace"]["cuda"],
        "blocks_in_flight": prepared["plan"]["blocks_in_flight"],
        "unfused_temporaries": unfused_temporaries(op, x, w, n, jnp.dtype(dtype).itemsize, int(dimension)),
    }
    # What schedule="auto" runs: the same judgement as the ops' (`_decide.judge`).
    code, why = judge(prepared, n, target, may_decline())
    result["decision"] = "unfused" if code == _abi.UNFUSED else result["choice"]
    result["decision_reason"] = why
    result["transport"] = "host" if machine.startswith("cpu") else \
        ("nccl" if _native.transport() == "nccl" else "copies")
    return result


def unfused_temporaries(op: str, x: tuple, w: tuple, n: int, itemsize: int, dimension: int = 0) -> int:
    """Bytes of the intermediate the unfused jax.lax expression of `op`
    materializes on one device: the gathered operand (all_gather(x) @ w,
    x @ all_gather(w)), the whole product before it is scattered
    (psum_scatter(x @ w), psum(x @ w)), the exchanged operand or product
    (all-to-all), or for the ops over two axes (`dimension` the first's
    size F of n = F x T) the gathered w and the product before its scatter,
    or both gathered operands."""
    size = lambda shape: int(np.prod(shape)) * itemsize
    rows = int(np.prod(x[:-1]))
    if op == "all_gather_matmul_reduce_scatter":
        return dimension * (size(w) + rows * w[1] * itemsize)
    if op == "all_gather_both_matmul":
        return n // dimension * size(x) + dimension * size(w)
    if op == "all_gather_contract_matmul_reduce_scatter":  # the gathered x, and the product before its scatter
        return n // dimension * size(x) + x[0] * w[1] * itemsize
    if op == "all_gather_matmul":
        return n * size(x)
    if op == "matmul_all_gather":
        return n * size(w)
    if op in ("matmul_reduce_scatter", "matmul_all_reduce"):
        return rows * w[1] * itemsize
    if op == "all_to_all_matmul":
        return size(x)
    return rows * w[1] * itemsize  # matmul_all_to_all: the product before it is exchanged


_TRANSPORTS = {
    "host": "host memory between CPU devices",
    "copies": "copy engines (device-to-device copies ordered by events; NCCL for groups spanning processes)",
    "nccl": "NCCL send/receive",
}


def _print(r: dict, x: tuple, w: tuple) -> None:
    m = r["machine"]
    lines = [f"commfuse.explain: {r['op']} x{list(x)} w{list(w)} over n={r['n']} ({r['dtype']}) on {m['name']} "
             f"({m['peak_flops'] * m['efficiency'] / 1e12:.3g} TFLOP/s, {m['link_bytes_per_s'] / 1e9:.3g} GB/s "
             f"{m['topology']}, {m['latency_s'] * 1e6:.3g} us)"]
    # "chosen" only where auto runs it: where auto declines, the mark says so.
    chosen = "  <- chosen" if r["decision"] == r["choice"] else "  <- fastest fused (auto runs unfused)"
    for name, t in r["schedules"].items():
        mark = chosen if name == r["choice"] else ""
        lines.append(f"  {name:<14} {us(t):>12}  {t / r['floor']:.2f}x floor{mark}")
    lines.append(f"  floor = max(one whole GEMM {us(r['t_gemm'])}, T_comm {us(r['t_comm'])}) = {us(r['floor'])}; "
                 f"the per-peer pieces' compute T_compute = {us(r['t_compute'])}")
    lines.append(f"  schedule='auto' runs: {r['decision_reason']}")
    lines.append(f"  transfers: {_TRANSPORTS[r['transport']]}")
    mem, kib = r["memory"], lambda b: f"{b / 1024:.0f} KiB"
    lines.append(f"  memory per device: workspace {kib(mem['workspace_cpu'])} (CPU) / {kib(mem['workspace_cuda'])} "
                 f"(CUDA), blocks in flight {kib(mem['blocks_in_flight'])}; the unfused jax.lax expression's "
                 f"temporaries {kib(mem['unfused_temporaries'])}")
    lines.append(f"  plan of rank 0 under {r['choice']}:")
    for lane in ("compute", "comm"):
        steps = r["plan"][lane]
        shown = [f"#{s['id']} {s['action']} [{us(s['start'])}..{us(s['end'])}]" for s in steps[:8]]
        more = f" ... ({len(steps) - 8} more)" if len(steps) > 8 else ""
        lines.append(f"    {lane:<7}: " + ("; ".join(shown) or "(none)") + more)
    print("\n".join(lines))
