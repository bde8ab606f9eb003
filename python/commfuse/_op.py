"""What every fused op shares between its checks and the primitive: its
static arguments (`Static`), its decision as a value (`OpDecision`: made
before anything is traced, from shapes), one library call decided and bound
(`call`), and the differentiable wrapper each op's VJP is built with
(`differentiable`), whose backward calls are decided under the same policy
when JAX traces them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import jax
import numpy as np

from . import _abi, _compat, _fused
from ._checks import fast_f32, promoted_dtypes
from ._decide import Policy, decide
from ._decision import Call, Decision
from ._varying import vary_together


class Static(NamedTuple):
    """The non-differentiable arguments of one fused op call: its mesh axes
    and group size, its dimension, the policy its calls (and its backward's)
    are decided under, its result dtype, whether float32 GEMMs may use TF32
    on GPUs, and the forward call's decision (made before binding)."""
    axes: tuple
    ranks: int
    dimension: int
    policy: Policy
    out_dtype: np.dtype
    fast_f32: bool = True
    forward: Decision | None = None


@dataclass(frozen=True)
class OpDecision:
    """What one call of a fused op becomes, decided from its operands'
    shapes before anything is traced: its `static` arguments and the
    decisions of its library calls (`calls`), or why the op refuses these
    arguments (`refused`, with a non-strict policy; a strict one raises).
    `settled` holds what the op settled besides (its dims, its tiles)."""
    op: str
    static: Static | None
    calls: tuple = ()
    refused: str | None = None
    settled: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def fused(self) -> bool:
        return self.refused is None and bool(self.calls) and all(d.fused for d in self.calls)

    @property
    def why(self) -> str:
        if self.refused is not None:
            return self.refused
        return "; ".join(dict.fromkeys(d.describe() for d in self.calls))


def settle(op: str, x, w, *, axes, ranks: int, dimension: int, policy: Policy, precision,
           preferred_element_type) -> tuple[Static, np.dtype]:
    """The common tail of every op's checks (on shapes: arrays, tracers or
    ShapeDtypeStructs): precision and the promoted dtypes; the static
    arguments, and the operands' dtype once promoted."""
    fast = fast_f32(op, precision)
    dtype, out_dtype = promoted_dtypes(op, x.dtype, w.dtype, preferred_element_type)
    return Static(tuple(axes), ranks, dimension, policy, out_dtype, fast), dtype


def decided(op: str, strict: bool, decide_op) -> OpDecision:
    """`decide_op()` (an op's checks and decisions, on shapes), or, under a
    policy that is not `strict`, the refusal its checks raise as a value."""
    if strict:
        return decide_op()
    try:
        return decide_op()
    except (ValueError, TypeError, NotImplementedError) as e:
        return OpDecision(op, None, refused=f"commfuse.{op} refuses these operands: {e}")


def forward_call(kind, static: Static, x_shape, w_shape, dtype, *, dimension=None) -> Decision:
    """The decision of the forward library call of kind `kind` on operands of these shapes."""
    d = static.dimension if dimension is None else dimension
    return decide(Call.of(kind, static.ranks, d, x_shape, w_shape, dtype, static.out_dtype), static.policy,
                  static.axes)


def prepared_operands(op: str, x, w, decision: OpDecision):
    """`x` and `w` promoted and typed as varying together, for binding."""
    dtype, _ = promoted_dtypes(op, x.dtype, w.dtype, None)
    return vary_together(x.astype(dtype), w.astype(dtype), decision.static.axes)


def call(kind, x, w, static: Static, *, dimension=None, out_dtype=None, decision: Decision | None = None,
         scales=()):
    """One library call of `kind` on `x` and `w` (laid out for it):
    `decision` where it was made before, else decided now under the static
    policy; then bound (`_fused.bind`)."""
    d = static.dimension if dimension is None else dimension
    out_dtype = static.out_dtype if out_dtype is None else out_dtype
    this = Call.of(kind, static.ranks, d, x.shape, w.shape, x.dtype, out_dtype)
    if decision is None:
        decision = decide(this, static.policy, static.axes)
    elif decision.call != this:  # the decision made before binding is for these operands, by construction
        raise AssertionError(f"commfuse: the decision for {decision.call.describe()} bound to {this.describe()}")
    return _fused.bind(decision, x, w, axes=static.axes, scales=scales, fast_f32=static.fast_f32)


def call_static(kind, x, w, static: Static, *, dimension=None, out_dtype=None, forward=False):
    """`call` with the settings of a user's op (for its VJP's inner ops). A
    sliced or tiled op's VJP cuts the row gathers and scatters it can and
    runs the other kinds (weight gradients) with "auto"."""
    x, w = _fused.common(x, w)
    if _abi.cut_schedule(static.policy.asked) and not forward and kind not in _abi.ROW_BLOCK_KINDS:
        static = static._replace(policy=static.policy.with_asked(_abi.AUTO))
    return call(kind, x, w, static, dimension=dimension, out_dtype=out_dtype,
                decision=static.forward if forward else None)


def differentiable(kind, backward, *, dimension=None):
    """The op `kind` as a differentiable function ``(x, w, static) -> out``:
    `backward(static, (x, w), dy) -> (dx, dw)` gives its VJP, built from
    fused ops in turn."""

    @partial(jax.custom_vjp, nondiff_argnums=(2,))
    def op(x, w, static: Static):
        return call_static(kind, x, w, static, dimension=dimension, forward=True)

    op.defvjp(lambda x, w, static: (op(x, w, static), (x, w)), backward)

    def forward_or_reverse(x, w, static: Static):
        if forward_mode(x, w):
            return call_static(kind, x, w, unfused(static), dimension=dimension, forward=True)
        return op(x, w, static)

    return forward_or_reverse


def unfused(static: Static) -> Static:
    """`static` running jax.lax's own collective and dot, whatever was asked
    or imposed (forward-mode differentiation, which a custom_vjp cannot take)."""
    return static._replace(policy=static.policy._replace(asked=_abi.UNFUSED, imposed=()), forward=None)


def run_settled(op: str, decision: OpDecision, x, w, forward, differentiable):
    """An op whose decision settled its settings (`decision.settled["settings"]`,
    with the forward call's decision as `forward`) on `x` and `w`: its
    custom-VJP function `differentiable(x, w, settings)`, or under
    forward-mode differentiation, which a custom VJP cannot take, `forward`
    with its call unfused (jax.lax's collectives and dot)."""
    x, w = prepared_operands(op, x, w, decision)
    settings = decision.settled["settings"]
    if forward_mode(x, w):
        unfused = Decision(settings.forward.call, _abi.UNFUSED, "forward-mode differentiation", ())
        return forward(x, w, settings._replace(forward=unfused))
    return differentiable(x, w, settings)


def forward_mode(x, w) -> bool:
    """Whether `x` or `w` is differentiated forward (``jax.jvp``,
    ``jacfwd``, ``hessian``), which a custom_vjp cannot take: then the
    caller runs jax.lax's collective and dot, which can."""
    return _compat.traced_by("jvp", x, w)
