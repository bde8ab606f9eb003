"""The predicted time of a compiled step on a machine, per device: the
program read from its HLO text (``hlo.py``) and priced by the library's
cost model (``src/sim/step.rs``, through ``commfuse_price_step``)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _abi
from .._decide import Machine
from . import hlo

COLLECTIVES = ("async", "blocking")


@dataclass(frozen=True)
class Priced:
    """One device's step on a machine, in seconds.

    ``total_s``: the step; ``compute_s``: the compute lane's work (GEMMs,
    memory work, the compute of fused ops); ``comm_s``: communication
    (collectives, the communication of fused ops); ``exposed_comm_s``:
    ``total_s - compute_s``, what the step waits for communication;
    ``by_kind``: seconds of ``gemm``, ``memory``, ``collective`` and
    ``fused`` ops. ``collectives`` and ``collective_bytes``: per XLA
    collective kind (``"all-gather"``, ...), how many run in one step and
    their bytes (one device's larger of operand and result), loop bodies
    counted once per trip; ``fused_ops``: commfuse ops run in one step.
    ``warnings``: what the reading of the program had to guess."""
    total_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    by_kind: dict
    collectives: dict
    collective_bytes: dict
    fused_ops: int
    warnings: tuple


def price(hlo_text: str, machine: str, *, gemm_gflops: float | None = None, devices_per_node: int | None = None,
          collectives: str = "async", fresh_bytes: int = 0) -> Priced:
    """The predicted step of the compiled program in `hlo_text`
    (``compiled.as_text()``) on `machine` (``"h100_nvlink"``,
    ``"h100_cluster"``, ``"cpu_here:gbytes_per_s=0.5"``, ...: see
    ``sim::Machine::from_spec``).

    `gemm_gflops`: a measured GEMM rate (``cpu_here``'s single-thread rate;
    None: the machine's own figure). `devices_per_node`: where nodes end,
    for which groups cross them (None: the machine's ``gpus_per_node``, one
    node if it has none). `collectives`: ``"async"``, XLA's collectives
    overlap independent compute (as on GPUs), or ``"blocking"``, they hold
    the device (XLA's CPU runtime). Each fused op costs its plan's time
    and a fused call's fixed cost (`_charge_fixed_costs`). A program
    compiled for CPU devices and priced for a GPU machine drops what only
    changes precision or layout (`hlo.parse`'s `fold_layout`). `fresh_bytes`:
    what the host maps afresh for each execution (`host.mapped_afresh`),
    first written at the machine's ``touch_gbytes_per_s`` (free where the
    machine does not say it)."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
    if devices_per_node is None:
        devices_per_node = machine_devices_per_node(machine)
    program = hlo.parse(hlo_text, devices_per_node=devices_per_node, fold_layout=not machine.startswith("cpu"))
    _charge_fixed_costs(program.ops, machine)
    answer = price_ops(program.ops, machine, gemm_gflops=gemm_gflops, collectives=collectives,
                       devices=program.devices, fresh_bytes=fresh_bytes)
    calls = answer["collective_calls"]
    return Priced(
        total_s=answer["total_s"],
        compute_s=answer["compute_s"],
        comm_s=answer["comm_s"],
        exposed_comm_s=answer["exposed_comm_s"],
        by_kind=dict(answer["by_kind"]),
        collectives={kind: c["count"] for kind, c in calls.items()},
        collective_bytes={kind: c["bytes"] for kind, c in calls.items()},
        fused_ops=answer["fused_ops"],
        warnings=tuple(program.warnings),
    )


def price_ops(ops: list, machine: str, *, gemm_gflops: float | None = None, collectives: str = "async",
              devices: int | None = None, timeline: bool = False, fresh_bytes: int = 0) -> dict:
    """The library's answer for a request of `ops` (``src/sim/step.rs``):
    ``total_s``, ``compute_s``, ``comm_s``, ``exposed_comm_s``, ``by_kind``,
    ``collective_calls`` (kind -> ``{"count", "bytes"}``), ``fused_ops``,
    ``machine`` (``{"name", "devices_per_node"}``) and, with `timeline`,
    ``timeline`` (each top-level op's ``start_s`` and ``end_s``).
    ValueError with the library's reason for a request it refuses."""
    request = {"machine": machine, "collectives": collectives, "timeline": timeline, "ops": ops,
               "fresh_bytes": int(fresh_bytes)}
    if gemm_gflops is not None:
        request["gemm_gflops"] = float(gemm_gflops)
    if devices is not None:
        request["devices"] = int(devices)
    return _abi.price_step(request)


def _charge_fixed_costs(ops: list, machine: str) -> None:
    """Gives each fused op of `ops` (loop bodies and branches too) the fixed
    cost of a fused call on `machine`, as `auto` weighs it: measured on this
    host's CPU devices for ``cpu_here`` (without the link model: its
    transfers are the plan's, priced already), the GPU presets' figure else."""
    base = Machine("cpu_here") if machine.startswith("cpu_here") else Machine(machine)
    for op in ops:
        if "fused" in op:
            op["fused"]["overhead_s"] = base.call_overhead_s(int(op["fused"]["call"]["ranks"]))
        elif "loop" in op:
            _charge_fixed_costs(op["loop"]["ops"], machine)
        elif "conditional" in op:
            for branch in op["conditional"]["branches"]:
                _charge_fixed_costs(branch, machine)


def machine_devices_per_node(machine: str) -> int | None:
    """The devices per node of `machine` (its network's), None for one node."""
    return _abi.machine_summary(machine)["devices_per_node"]
