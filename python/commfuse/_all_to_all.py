"""all_to_all_matmul and matmul_all_to_all (Ulysses sequence parallelism):
``all_to_all(x) @ w`` and ``all_to_all(x @ w)``, each rank sending block j
straight to rank j, one block per step. The first multiplies its own block
while the others travel (nothing exposed at the head); the second multiplies
the block for each peer just before sending it and its own block last
(nothing but one copy exposed at the tail).

Blocks are laid out contiguously ([N, ...] stacks) in XLA around the call.

VJP: d/dx of each is the other with the split and concat dims swapped and
wᵀ (fused where that op's constraints hold, else through the pure-JAX
reference); d/dw is computed from the reference expression (unfused)."""

from __future__ import annotations

import math
from functools import partial

import jax

from . import _checks, _fused, _op, reference
from ._abi import Kind
from ._decide import Policy
from ._op import OpDecision

A2A_MM = "all_to_all_matmul"
MM_A2A = "matmul_all_to_all"


def _decide(op, x, w, axis_name, split_dimension, concat_dimension, schedule, precision, preferred_element_type,
            policy: Policy) -> OpDecision:
    def checked():
        axes, ranks = _checks.axis_group(op, axis_name)
        if x.ndim < 2 or w.ndim != 2:
            _checks.check_matmul_operands(op, x, w)  # the rank errors, before the dims are read
        split = _checks.normalize_dimension(op, "split_dimension", split_dimension, x.ndim,
                                            allow_last=op == MM_A2A)
        concat = _checks.normalize_dimension(op, "concat_dimension", concat_dimension, x.ndim, allow_last=True)
        # all_to_all_matmul contracts after the exchange, which widens x's last dim when it concatenates there.
        widens = op == A2A_MM and concat == x.ndim - 1
        _checks.check_matmul_operands(op, x, w, x_factor=ranks if widens else 1)
        size = w.shape[1] if split == x.ndim - 1 else x.shape[split]
        if size % ranks:
            raise ValueError(
                f"commfuse.{op}: split_dimension {split} has size {size}, which is not divisible by the size "
                f"{ranks} of axis {axis_name!r}")
        asked = policy.with_asked(_checks.check_schedule(op, schedule))
        static, dtype = _op.settle(op, x, w, axes=axes, ranks=ranks, dimension=0, policy=asked,
                                   precision=precision, preferred_element_type=preferred_element_type)
        layout = layout_all_to_all_matmul if op == A2A_MM else layout_matmul_all_to_all
        kind, _, first, second = layout(x.shape, w.shape, ranks, split, concat)
        forward = _op.forward_call(kind, static, first, second, dtype)
        return OpDecision(op, static._replace(forward=forward), (forward,), settled={"dims": (split, concat)})

    return _op.decided(op, policy.strict, checked)


def all_to_all_matmul(x, w, axis_name, *, split_dimension, concat_dimension, schedule="auto", precision=None,
                      preferred_element_type=None):
    """Returns ``jax.lax.all_to_all(x, axis_name, split_dimension, concat_dimension, tiled=True) @ w``.

    ``split_dimension`` is any dim of ``x`` but the last (the contraction);
    ``concat_dimension`` any dim (concatenating along the last one
    accumulates ``block_q @ w[rows q]``).
    """
    decision = decide_all_to_all_matmul(x, w, axis_name, split_dimension=split_dimension,
                                        concat_dimension=concat_dimension, schedule=schedule, precision=precision,
                                        preferred_element_type=preferred_element_type)
    return run_all_to_all_matmul(decision, x, w)


def matmul_all_to_all(x, w, axis_name, *, split_dimension, concat_dimension, schedule="auto", precision=None,
                      preferred_element_type=None):
    """Returns ``jax.lax.all_to_all(x @ w, axis_name, split_dimension, concat_dimension, tiled=True)``.

    ``split_dimension`` and ``concat_dimension`` are any dims of the result
    (splitting the last one sends column blocks of ``x @ w``).
    """
    decision = decide_matmul_all_to_all(x, w, axis_name, split_dimension=split_dimension,
                                        concat_dimension=concat_dimension, schedule=schedule, precision=precision,
                                        preferred_element_type=preferred_element_type)
    return run_matmul_all_to_all(decision, x, w)


def decide_all_to_all_matmul(x, w, axis_name, *, split_dimension, concat_dimension, schedule="auto", precision=None,
                             preferred_element_type=None, policy: Policy = Policy()) -> OpDecision:
    """What ``all_to_all_matmul(x, w, ...)`` runs as, from shapes (see `_op.OpDecision`)."""
    return _decide(A2A_MM, x, w, axis_name, split_dimension, concat_dimension, schedule, precision,
                   preferred_element_type, policy)


def decide_matmul_all_to_all(x, w, axis_name, *, split_dimension, concat_dimension, schedule="auto", precision=None,
                             preferred_element_type=None, policy: Policy = Policy()) -> OpDecision:
    """What ``matmul_all_to_all(x, w, ...)`` runs as, from shapes (see `_op.OpDecision`)."""
    return _decide(MM_A2A, x, w, axis_name, split_dimension, concat_dimension, schedule, precision,
                   preferred_element_type, policy)


def run_all_to_all_matmul(decision: OpDecision, x, w):
    x, w = _op.prepared_operands(A2A_MM, x, w, decision)
    dims, static = decision.settled["dims"], decision.static
    if _op.forward_mode(x, w):
        return _a2a_matmul_impl(x, w, dims, _op.unfused(static))
    return _a2a_matmul(x, w, dims, static)


def run_matmul_all_to_all(decision: OpDecision, x, w):
    x, w = _op.prepared_operands(MM_A2A, x, w, decision)
    dims, static = decision.settled["dims"], decision.static
    if _op.forward_mode(x, w):
        return _matmul_a2a_impl(x, w, dims, _op.unfused(static))
    return _matmul_a2a(x, w, dims, static)


def layout_all_to_all_matmul(x_shape, w_shape, ranks: int, split_dimension: int, concat_dimension: int) -> tuple:
    """The library call all_to_all_matmul makes on one device's operands of
    these shapes: (kind, its dimension, the first operand's shape, the
    second's). x's blocks go stacked [N, rows, k]; concatenating along the
    contraction accumulates."""
    block = list(x_shape)
    block[split_dimension] //= ranks
    stacked = (ranks, math.prod(block[:-1]), x_shape[-1])
    kind = Kind.ALL_TO_ALL_MATMUL_CONTRACT if concat_dimension == len(x_shape) - 1 else Kind.ALL_TO_ALL_MATMUL
    return kind, 0, stacked, tuple(w_shape)


def layout_matmul_all_to_all(x_shape, w_shape, ranks: int, split_dimension: int, concat_dimension: int) -> tuple:
    """As `layout_all_to_all_matmul`, for matmul_all_to_all: splitting the
    result's last dim sends column blocks of the product of x's rows."""
    if split_dimension == len(x_shape) - 1:
        return Kind.MATMUL_ALL_TO_ALL_COLS, 0, (math.prod(x_shape[:-1]), x_shape[-1]), tuple(w_shape)
    block = list(x_shape)
    block[split_dimension] //= ranks
    return Kind.MATMUL_ALL_TO_ALL, 0, (ranks, math.prod(block[:-1]), x_shape[-1]), tuple(w_shape)


def _a2a_matmul_impl(x, w, dims, static):
    split, concat = dims
    n = static.ranks
    kind, _, stacked_shape, _ = layout_all_to_all_matmul(x.shape, w.shape, n, split, concat)
    blocks = _fused.stack_blocks(x, split, n)                        # [N, *block]
    out = _op.call_static(kind, blocks.reshape(stacked_shape), w, static, forward=True)
    if kind == Kind.ALL_TO_ALL_MATMUL_CONTRACT:
        return out.reshape(blocks.shape[1:-1] + (w.shape[1],))
    return _fused.concat_blocks(out.reshape(blocks.shape[:-1] + (w.shape[1],)), concat)


def _matmul_a2a_impl(x, w, dims, static):
    split, concat = dims
    n = static.ranks
    kind, _, first_shape, _ = layout_matmul_all_to_all(x.shape, w.shape, n, split, concat)
    if kind == Kind.MATMUL_ALL_TO_ALL_COLS:
        out = _op.call_static(kind, x.reshape(first_shape), w, static, forward=True)
        received = out.reshape((n,) + x.shape[:-1] + (w.shape[1] // n,))
    else:
        blocks = _fused.stack_blocks(x, split, n)
        out = _op.call_static(kind, blocks.reshape(first_shape), w, static, forward=True)
        received = out.reshape(blocks.shape[:-1] + (w.shape[1],))
    return _fused.concat_blocks(received, concat)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _a2a_matmul(x, w, dims, static):
    return _a2a_matmul_impl(x, w, dims, static)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_a2a(x, w, dims, static):
    return _matmul_a2a_impl(x, w, dims, static)


def _fwd(impl):
    return lambda x, w, dims, static: (impl(x, w, dims, static), (x, w))


def _reference_vjp(ref, x, w, dims, static, dy):
    split, concat = dims
    # In the op's result dtype (bf16 operands may ask for f32 products), as the cotangent is.
    f = lambda a, b: ref(a, b, static.axes, split_dimension=split, concat_dimension=concat,
                         preferred_element_type=static.out_dtype)
    return jax.vjp(f, x, w)[1](dy.astype(static.out_dtype))


def _a2a_matmul_bwd(dims, static, residuals, dy):
    x, w = residuals
    split, concat = dims
    _, dw = _reference_vjp(_ref_a2a_matmul, x, w, dims, static, dy)
    # all_to_all is linear: dx = all_to_all⁻¹(dY @ wᵀ), the dual op with the dims swapped.
    dy, wt = _fused.common(dy, w.T)
    dx = _matmul_a2a_impl(dy, wt, (concat, split), static._replace(out_dtype=x.dtype, forward=None))
    return dx, dw.astype(w.dtype)


def _matmul_a2a_bwd(dims, static, residuals, dy):
    x, w = residuals
    split, concat = dims
    dx, dw = _reference_vjp(_ref_matmul_a2a, x, w, dims, static, dy)
    if concat != x.ndim - 1:
        # dx = all_to_all⁻¹(dY) @ wᵀ: the dual op (its split may not be the last dim).
        dy, wt = _fused.common(dy, w.T)
        dx = _a2a_matmul_impl(dy, wt, (concat, split), static._replace(out_dtype=x.dtype, forward=None))
    return dx.astype(x.dtype), dw.astype(w.dtype)


def _ref_a2a_matmul(x, w, axes, **dims):
    return reference.all_to_all_matmul(x, w, axes, **dims)


def _ref_matmul_a2a(x, w, axes, **dims):
    return reference.matmul_all_to_all(x, w, axes, **dims)


_a2a_matmul.defvjp(_fwd(_a2a_matmul_impl), _a2a_matmul_bwd)
_matmul_a2a.defvjp(_fwd(_matmul_a2a_impl), _matmul_a2a_bwd)
