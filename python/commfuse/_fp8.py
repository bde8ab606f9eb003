"""Fused ops on fp8 operands (CUDA, sm_90+): forward only, with their scales."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ._abi import Kind
from ._op import Static, call
from ._varying import vary_together


def fp8_call(kind: "Kind", x, w, scales, *, axes, ranks: int, dimension: int, policy):
    """One fused op on fp8 operands (checked by `fp8_scales`): forward only."""
    x_scale, w_scale, out_dtype = scales
    x_scale, w_scale = (jnp.asarray(s, np.float32) for s in (x_scale, w_scale))  # a Python number, or f32
    x, w = vary_together(x, w, axes)
    return _fp8_op(Kind(kind), x, w, x_scale, w_scale, Static(tuple(axes), ranks, dimension, policy, out_dtype))


@partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _fp8_op(kind, x, w, x_scale, w_scale, static):
    return call(kind, x, w, static, scales=(x_scale, w_scale))


def _fp8_bwd(kind, static, residuals, dy):
    raise NotImplementedError(
        f"commfuse ({kind.name.lower()}): gradients of fp8 operands are not defined; differentiate through "
        "your own casts (e.g. quantise inside the function and pass the high-precision values to jax.grad "
        "with a straight-through estimator)")


_fp8_op.defvjp(lambda kind, x, w, xs, ws, static: (_fp8_op(kind, x, w, xs, ws, static), None), _fp8_bwd)
