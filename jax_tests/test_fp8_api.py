"""fp8 front end on CPU: every misuse and the missing backend are TypeErrors
at trace time naming the argument; the CUDA lowering (with the backend
check faked) passes the two scales and asks for a K-major `w`; gradients
are NotImplementedError. The numerics are GPU tests (test_gpu.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commfuse
from commfuse import _checks, _native
from conftest import mesh1d, place, rand, sharded_fn, spec_on
from jax.sharding import PartitionSpec as P

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
OPS = [commfuse.all_gather_matmul, commfuse.matmul_reduce_scatter]


def _operands(x_dtype=E4, w_dtype=E4, seed=0):
    x = rand((2 * 32, 32), np.float32, seed=seed).astype(x_dtype)
    w = rand((32, 16), np.float32, seed=seed + 1).astype(w_dtype)
    return x, w


SPECS = (spec_on(2, 0, "x"), P())


def _traced(body, x, w):
    """`body` in jit(shard_map) over 2 CPU devices, traced (not run)."""
    mesh = mesh1d(2)
    return jax.jit(sharded_fn(body, mesh, SPECS)).trace(place(x, mesh, SPECS[0]), place(w, mesh, SPECS[1]))


def _trace(op, x, w, **kwargs):
    return _traced(lambda a, b: op(a, b, "x", **kwargs), x, w)


@pytest.mark.parametrize("op", OPS)
def test_fp8_operands_on_cpu_are_a_type_error_naming_the_operands(op):
    x, w = _operands()
    with pytest.raises(TypeError, match=r"`x` and `w` are float8_e4m3fn.*CUDA.*sm_90"):
        _trace(op, x, w, x_scale=np.float32(0.5), w_scale=np.float32(2.0))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("missing", ["x_scale", "w_scale"])
def test_a_missing_scale_is_a_type_error_naming_it(op, missing):
    x, w = _operands()
    scales = {"x_scale": np.float32(1.0), "w_scale": np.float32(1.0)}
    del scales[missing]
    with pytest.raises(TypeError, match=f"`{missing}`"):
        _trace(op, x, w, **scales)


@pytest.mark.parametrize("bad", [np.ones((1,), np.float32), np.float16(1.0), np.ones((2, 2), np.float32)])
def test_a_scale_that_is_not_a_float32_scalar_is_a_type_error(bad):
    x, w = _operands()
    with pytest.raises(TypeError, match="`w_scale` must be a float32 scalar"):
        _trace(commfuse.all_gather_matmul, x, w, x_scale=np.float32(1.0), w_scale=bad)


@pytest.mark.parametrize("op", OPS)
def test_scales_with_other_operands_are_a_type_error(op):
    x, w = rand((64, 32), np.float32, seed=3), rand((32, 16), np.float32, seed=4)
    with pytest.raises(TypeError, match="`x_scale` is for fp8 operands"):
        _trace(op, x, w, x_scale=np.float32(1.0))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("x_dtype,w_dtype,message", [
    (E4, E5, "unsupported dtype combination"),
    (E5, E4, "unsupported dtype combination"),
    (E5, E5, "both float8_e5m2"),
    (E4, np.float32, "unsupported dtype combination"),
])
def test_mixed_or_e5m2_formats_are_a_type_error(op, x_dtype, w_dtype, message):
    x, w = _operands(x_dtype, w_dtype)
    with pytest.raises(TypeError, match=message):
        _trace(op, x, w, x_scale=np.float32(1.0), w_scale=np.float32(1.0))


@pytest.mark.parametrize("out", [np.float64, E4])
def test_an_fp8_result_type_other_than_bf16_f16_f32_is_a_type_error(out):
    x, w = _operands()
    with pytest.raises(TypeError, match="preferred_element_type must be bfloat16"):
        _trace(commfuse.all_gather_matmul, x, w, x_scale=np.float32(1.0), w_scale=np.float32(1.0),
               preferred_element_type=out)


@pytest.fixture
def pretend_cuda(monkeypatch):
    """The trace-time backend check passes and the CUDA target 'exists', so
    the lowering can be inspected on a machine without a GPU."""
    monkeypatch.setattr(_checks, "_require_fp8_backend", lambda op, dtype: None)
    monkeypatch.setattr(_native, "cuda_target", lambda: _native.CUDA_TARGET)


@pytest.mark.parametrize("op,dimension_kw", [(commfuse.all_gather_matmul, "gather_dimension"),
                                             (commfuse.matmul_reduce_scatter, "scatter_dimension")])
def test_the_cuda_lowering_passes_the_scales_and_a_k_major_w(pretend_cuda, op, dimension_kw):
    x, w = _operands()
    # Traced scales are allowed: computed inside the program.

    def body(a, b):
        return op(a, b, "x", x_scale=jnp.float32(0.5) * 2, w_scale=jnp.max(jnp.abs(b.astype(jnp.float32))),
                  preferred_element_type=jnp.float16)

    traced = _traced(body, x, w)
    assert traced.out_info.dtype == np.float16
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if _native.CUDA_TARGET in line)
    assert re.search(r"\(%\S+, %\S+, %\S+, %\S+\)", call), call  # x, w, x_scale, w_scale
    assert "f8E4M3FN" in call and "tensor<f32>" in call, call
    layouts = re.search(r"operand_layouts = \[(.*?)\]\s*,\s*result_layouts", call).group(1)
    assert re.findall(r"dense<\[?([\d, ]*)\]?>", layouts)[:2] == ["1, 0", "0, 1"], layouts


@pytest.mark.parametrize("op", OPS)
def test_gradients_of_the_fp8_path_are_not_implemented(pretend_cuda, op):
    x, w = _operands()

    def loss(a, b):
        out = op(a, b, "x", x_scale=np.float32(1.0), w_scale=np.float32(1.0))
        return jax.lax.psum(out.astype(jnp.float32).sum(), "x")

    with pytest.raises(NotImplementedError, match="differentiate through your own casts"):
        _traced(jax.grad(loss), x, w)


def test_fp8_lowered_for_cpu_devices_is_a_type_error(pretend_cuda):
    x, w = _operands()
    with pytest.raises(TypeError, match="fp8 operands need CUDA devices"):
        _trace(commfuse.all_gather_matmul, x, w, x_scale=np.float32(1.0), w_scale=np.float32(1.0)).lower()


def test_the_column_scatter_takes_no_fp8(pretend_cuda):
    x, w = rand((64, 32), np.float32).astype(E4), rand((32, 16), np.float32).astype(E4)
    with pytest.raises(NotImplementedError, match="row scatter_dimension"):
        _trace(commfuse.matmul_reduce_scatter, x, w, scatter_dimension=1, x_scale=np.float32(1.0),
               w_scale=np.float32(1.0))
