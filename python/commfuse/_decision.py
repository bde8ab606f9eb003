"""What a library call is and what it runs as, as values: a `Call` (one
fused op's kind, group size and operand shapes, in the kind's layout) and
the `Decision` made for it before anything is traced (the schedule it runs,
or jax.lax's own collective and dot, and why). `_decide` makes decisions;
`_fused.bind` runs them; `overlap`'s report, `commfuse.explain` and
`commfuse.plan` read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import _abi
from ._checks import check_cut
from ._abi import Kind
from ._unfused import ALL_TO_ALL_KINDS


class Call(NamedTuple):
    """One library call as shapes: the op `kind`, its group of `ranks`, its
    gathered or scattered `dimension`, its two operands' shapes in the
    kind's layout (`_abi.Kind`) and dtypes. Hashable: decisions are cached
    and imposed by call."""
    kind: Kind
    ranks: int
    dimension: int
    x: tuple
    w: tuple
    dtype: np.dtype
    out_dtype: np.dtype

    @classmethod
    def of(cls, kind, ranks: int, dimension: int, x_shape, w_shape, dtype, out_dtype) -> "Call":
        return cls(Kind(kind), int(ranks), int(dimension), tuple(int(d) for d in x_shape),
                   tuple(int(d) for d in w_shape), np.dtype(dtype), np.dtype(out_dtype))

    @property
    def op(self) -> str:
        return self.kind.name.lower()

    @property
    def empty(self) -> bool:
        return 0 in self.x or 0 in self.w

    def shapes(self, schedule: int) -> _abi.CallShapes:
        """The library's description of this call under `schedule`."""
        return _abi.call_shapes(self.kind, schedule, self.ranks, self.dimension, self.x, self.w, self.dtype,
                                self.out_dtype)

    def describe(self) -> str:
        return f"{self.op} x{list(self.x)} w{list(self.w)} over {self.ranks} ({self.dtype.name})"


# The schedule of a call with no elements: nothing runs (the result is zeros).
NONE = -1


@dataclass(frozen=True)
class Decision:
    """What `call` runs as: `schedule` (a fused schedule's code,
    `_abi.UNFUSED` for jax.lax's own collective and dot, or `NONE` for an
    empty problem), and `why`. `out_shape` and `workspace` (bytes on the
    CPU and CUDA backends) are the library's answer for that schedule;
    `recut`: a sliced or tiled schedule run on x's rows laid out as a
    matrix (its workspace is the flattened call's, decided when it runs).
    `predicted` holds the cost model's seconds for the fused pick
    and the unoverlapped baseline where it timed them."""
    call: Call
    schedule: int
    why: str
    out_shape: tuple
    workspace: tuple = (0, 0)
    recut: bool = False
    predicted: tuple | None = None

    @property
    def fused(self) -> bool:
        return self.schedule not in (_abi.UNFUSED, NONE)

    @property
    def schedule_name(self) -> str:
        return "none" if self.schedule == NONE else _abi.schedule_name(self.schedule)

    def describe(self) -> str:
        return f"{self.call.op}: {self.schedule_name} ({self.why})"


def as_asked(call: Call, schedule: int, why: str = "as asked") -> Decision:
    """The decision to run `call` under `schedule`: the library's answer
    for it ("auto" without a machine: the library's own rule), ValueError
    with the reason where it refuses. A sliced or tiled schedule on rows that are not x's first dim
    of a matrix runs on the rows laid out as one (`recut`)."""
    empty = empty_decision(call)
    if empty is not None:
        return empty
    if _abi.cut_schedule(schedule):
        check_cut(call.kind, call.x, call.dimension, call.ranks, schedule)
    # (A two-axis call's dimension is its first axis's size, and its operands are laid out already: the
    # chunks cut w's columns (gather-scatter) or x's row blocks (two gathers).)
    two_axis = call.kind in (Kind.ALL_GATHER_MATMUL_REDUCE_SCATTER, Kind.ALL_GATHER_BOTH_MATMUL)
    recut = bool(_abi.cut_schedule(schedule)) and not two_axis and (len(call.x) != 2 or call.dimension != 0)
    if recut:
        out = tuple(_abi.prepare(call.shapes(_abi.UNFUSED))["out"])
        return Decision(call, schedule, why, out, (0, 0), True)
    prepared = _abi.prepare(call.shapes(schedule))
    # "auto" without a machine (fp8): the library's own rule picks.
    return Decision(call, int(prepared["schedule"]), why, tuple(prepared["out"]), _workspace(prepared))


def with_answer(call: Call, schedule: int, why: str, prepared: dict) -> Decision:
    """A decision from the library's answer `prepared` (for "auto": its
    pick, with the cost model's times)."""
    model = prepared.get("model") or {}
    predicted = (model.get("pick_s"), model.get("sequential_s")) if model else None
    workspace = _workspace(prepared) if schedule not in (_abi.UNFUSED, NONE) else (0, 0)
    return Decision(call, schedule, why, tuple(prepared["out"]), workspace, False, predicted)


def empty_decision(call: Call) -> Decision | None:
    """The decision for a call with an operand without elements (then so
    is its result), else None: nothing to multiply or move. The result is
    zeros, as jax.lax's dot gives for an empty contraction; jax.lax's
    all_to_all takes empty blocks (and its gradient keeps the operands JAX
    needs to lower it), so those kinds run it unfused."""
    if not call.empty:
        return None
    out = tuple(_abi.prepare(call.shapes(_abi.UNFUSED))["out"])
    schedule = _abi.UNFUSED if call.kind in ALL_TO_ALL_KINDS else NONE
    return Decision(call, schedule, "an operand or the result has no elements", out)


def _workspace(prepared: dict) -> tuple:
    return (int(prepared["workspace"]["cpu"]), int(prepared["workspace"]["cuda"]))
