"""The planner's candidates: how the devices factor over the mesh axes,
whether activations between blocks are sequence-sharded, the blocks' remat
policy, and whether the step runs through ``overlap`` (each product's fused
form and schedule decided by the cost model on the target machine, or left
unfused), with the logical axis rules each candidate gives the step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .logical import ACT_TENSOR, PARAM_TENSOR

AXES = ("data", "fsdp", "tensor")


@dataclass(frozen=True)
class Candidate:
    """One layout of the step. `mesh`: ``((axis, size), ...)`` in the order
    of the mesh's axes (the last varies fastest over the devices: on a
    multi-node machine, inside a node); `sequence_parallel`: the residual
    stream between blocks sharded over "tensor" along its sequence;
    `remat`: the blocks' policy (None: the step's own); `fused`: the step
    through ``overlap(schedule="auto")`` for the target machine."""
    mesh: tuple
    sequence_parallel: bool = False
    remat: str | None = None
    fused: bool = False

    @property
    def sizes(self) -> dict:
        return dict(self.mesh)

    def rules(self) -> tuple:
        """Flax-style logical axis rules: ``((logical name, mesh axes or None), ...)``
        in order of precedence (see `hooks.mesh_spec`)."""
        size = self.sizes
        batch = tuple(a for a in ("data", "fsdp") if size.get(a, 1) > 1)
        rules = [("batch", batch or None)]
        tensor = size.get("tensor", 1) > 1
        if tensor and self.sequence_parallel:
            rules.append(("length", "tensor"))
        rules += [("layers", None), ("norm", None), ("act_embed", None)]
        if size.get("fsdp", 1) > 1:
            rules.append(("embed", "fsdp"))
        if size.get("expert", 1) > 1:
            rules += [("expert", "expert"), ("act_expert", "expert")]
        if tensor:
            rules += [(name, "tensor") for name in PARAM_TENSOR + ACT_TENSOR]
        if size.get("sequence", 1) > 1:
            rules.append(("length", "sequence"))
        return tuple(rules)

    def label(self) -> str:
        mesh = " x ".join(f"{a}{n}" for a, n in self.mesh if n > 1) or "one device"
        parts = [mesh]
        if self.sequence_parallel:
            parts.append("SP")
        parts.append(f"remat={self.remat or 'own'}")
        parts.append("fused" if self.fused else "plain")
        return ", ".join(parts)

    def with_(self, **changes) -> "Candidate":
        return Candidate(**{**self.__dict__, **changes})


def factorizations(devices: int, axes=AXES) -> list[tuple]:
    """Every way `devices` factors over `axes` (sizes >= 1, product `devices`), as mesh tuples."""
    out = []

    def divisors(n):
        return [d for d in range(1, n + 1) if n % d == 0]

    for sizes in itertools.product(*[divisors(devices)] * len(axes)):
        if _prod(sizes) == devices:
            out.append(tuple(zip(axes, sizes)))
    return out


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def baselines(devices: int, axes=AXES) -> dict:
    """The layouts people train with, as candidates of `axes` (each with the
    step's own remat): pure data parallelism, FSDP (ZeRO-3), Megatron's
    tensor parallelism with sequence parallelism (within a node of 8 at
    most, data parallel across), and FSDP x TP (TP 2 on one node of up to
    8, TP 8 across nodes)."""
    def mesh(**sizes):
        """The mesh of these sizes, None where it needs an axis not among `axes`."""
        if any(n > 1 and a not in axes for a, n in sizes.items()):
            return None
        return tuple((a, sizes.get(a, 1)) for a in axes)

    tp = min(devices, 8)
    fsdp_tp = 2 if devices <= 8 else 8
    layouts = {"DP": (mesh(data=devices), False), "FSDP": (mesh(fsdp=devices), False),
               "TP+SP": (mesh(data=devices // tp, tensor=tp), True)}
    if devices % fsdp_tp == 0 and devices // fsdp_tp > 1:
        layouts["FSDPxTP"] = (mesh(fsdp=devices // fsdp_tp, tensor=fsdp_tp), False)
    return {name: Candidate(m, sequence_parallel=sp) for name, (m, sp) in layouts.items() if m is not None}
