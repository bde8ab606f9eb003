"""The contract with the library (``python/commfuse/_abi.py`` and
``src/abi.rs``): the same tables on both sides, one trace-time answer per
call, and each op's layout the one its call path binds."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commfuse
from commfuse import _abi, _all_gather_matmul, _all_to_all, _matmul_all_gather, _matmul_reduce_scatter, _native
from conftest import P, assert_close, mesh1d, place, rand


def test_python_and_the_library_have_the_same_tables():
    tables = _abi.tables()
    assert tables["kinds"] == {k.name: int(k) for k in _abi.Kind}
    assert tables["schedules"] == _abi.SCHEDULES
    assert tables["chunks_shift"] == _abi.CHUNKS_SHIFT
    assert tables["dtypes"] == {d.name: c for d, c in _abi.CODES.items()}
    assert set(tables["limits"]) == {"max_ranks", "max_chunks", "max_cut_blocks", "max_elements"}
    assert set(tables["kind_info"]) == {k.name for k in _abi.Kind}
    assert _abi.ROW_BLOCK_KINDS == {_abi.Kind.ALL_GATHER_MATMUL, _abi.Kind.MATMUL_REDUCE_SCATTER}
    assert _abi.CUT_KINDS == _abi.ROW_BLOCK_KINDS | {_abi.Kind.MATMUL_ALL_REDUCE}
    # Each kind's operand names are the ones its errors use (`abi::KINDS` order).
    for kind, info in tables["kind_info"].items():
        travelling_w = info["op"] in ("matmul_all_gather", "all_gather_matmul_reduce_scatter")
        assert info["operands"] == (["w", "x"] if travelling_w else ["x", "w"]), kind
    # The attributes the lowering writes are the contract's.
    assert {"kind", "site", "schedule", "dimension", "mesh_devices", "mesh_shape", "axes"} <= set(_abi.ATTRIBUTES)


def test_schedule_codes_round_trip_through_names():
    for name, code in _abi.SCHEDULES.items():
        if name in _abi.CUT_SCHEDULES:
            assert _abi.schedule_name(_abi.schedule_code(name, 7)) == f"{name}(7)"
        else:
            assert _abi.schedule_name(_abi.schedule_code(name)) == name


def test_prepare_answers_shape_schedule_workspaces_and_plan():
    call = _abi.call_shapes(_abi.Kind.ALL_GATHER_MATMUL, _abi.SCHEDULES["ring"], 4, 0, (8, 16), (16, 4), jnp.bfloat16,
                     jnp.bfloat16)
    r = _abi.prepare(call)
    assert r["out"] == [32, 4] and r["schedule_name"] == "ring"
    # In flight: the ring's two receive slots and the own block it sends, 8x16 bf16 each.
    assert r["plan"] == {"schedule": "ring", "steps": r["plan"]["steps"], "exchanges": 3, "slots": 2,
                         "blocks_in_flight": 3 * 8 * 16 * 2}
    # bf16 on CPU converts to f32 copies; the GPU multiplies bf16 as it is.
    assert r["workspace"]["cpu"] > r["workspace"]["cuda"] > 0
    with pytest.raises(ValueError, match=r"`w` must be 2-D \[16, n\]"):
        _abi.prepare(call._replace(w=(8, 4)))


def _bound_kinds(op, x, w, **kwargs):
    """The kinds and dimensions the op's call path binds, from its jaxpr."""
    mesh = mesh1d(4)
    f = jax.shard_map(lambda a, b: op(a, b, "x", schedule="ring", **kwargs), mesh=mesh, in_specs=(P(), P()),
                      out_specs=P(), check_vma=False)
    jaxpr = jax.make_jaxpr(f)(jnp.zeros(x, jnp.float32), jnp.zeros(w, jnp.float32))
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "commfuse_collective_matmul":
                found.append((eqn.params["kind"], eqn.params["dimension"],
                              tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)))
            for p in eqn.params.values():
                if hasattr(p, "eqns"):  # a Jaxpr
                    walk(p)
                elif hasattr(getattr(p, "jaxpr", None), "eqns"):  # a ClosedJaxpr
                    walk(p.jaxpr)
    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("op,layout,x,w,kwargs", [
    (commfuse.all_gather_matmul, _all_gather_matmul.layout, (2, 6, 8), (8, 4), dict(gather_dimension=1)),
    (commfuse.matmul_reduce_scatter, _matmul_reduce_scatter.layout, (8, 8), (8, 4), dict(scatter_dimension=0)),
    (commfuse.matmul_reduce_scatter, _matmul_reduce_scatter.layout, (3, 8), (8, 8), dict(scatter_dimension=-1)),
    (commfuse.matmul_all_gather, _matmul_all_gather.layout, (6, 8), (8, 2), dict(gather_dimension=1)),
    (commfuse.matmul_all_gather, _matmul_all_gather.layout, (6, 8), (2, 4), dict(gather_dimension=0)),
    (commfuse.all_to_all_matmul, _all_to_all.layout_all_to_all_matmul, (8, 6), (6, 4),
     dict(split_dimension=0, concat_dimension=0)),
    (commfuse.matmul_all_to_all, _all_to_all.layout_matmul_all_to_all, (3, 8), (8, 8),
     dict(split_dimension=1, concat_dimension=0)),
])
def test_each_ops_layout_is_what_its_call_path_binds(op, layout, x, w, kwargs):
    (kind, dimension, first, second), = [layout(x, w, 4, *kwargs.values())]
    bound = _bound_kinds(op, x, w, **kwargs)
    assert bound and bound[0] == (kind, dimension, first, second), bound


def _lowered(platform):
    mesh = mesh1d(4)
    x = jax.ShapeDtypeStruct((32, 16), jnp.bfloat16, sharding=jax.NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((16, 8), jnp.bfloat16, sharding=jax.NamedSharding(mesh, P()))
    f = jax.jit(jax.shard_map(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule="ring"), mesh=mesh,
                              in_specs=(P("x"), P()), out_specs=P("x")))
    return f.trace(x, w).lower(lowering_platforms=(platform,)).as_text()


def test_each_platform_lowers_its_own_workspace(monkeypatch):
    r = _abi.prepare(_abi.call_shapes(_abi.Kind.ALL_GATHER_MATMUL, _abi.SCHEDULES["ring"], 4, 0, (8, 16), (16, 8),
                               jnp.bfloat16, jnp.bfloat16))

    def workspace_bytes(text, target):
        call = next(line for line in text.splitlines() if target in line)
        return int(re.search(r"tensor<(\d+)xui8>", call).group(1))

    assert workspace_bytes(_lowered("cpu"), _native.CPU_TARGET) == r["workspace"]["cpu"]
    monkeypatch.setattr(_native, "cuda_target", lambda: _native.CUDA_TARGET)
    assert workspace_bytes(_lowered("cuda"), _native.CUDA_TARGET) == r["workspace"]["cuda"]


def test_xla_keeps_each_fused_calls_decoded_site_with_its_compiled_instance():
    """XLA instantiates each compiled fused call once, and the handler keeps
    the call's attributes decoded as the instance's state
    (``src/xla/state.rs``): each device's calls decode their site from it
    once, and the process's map is never used."""
    mesh = mesh1d(4)
    x = place(rand((32, 16), seed=1), mesh, P("x"))
    w = place(rand((16, 8), seed=2), mesh, P())
    v = place(rand((32, 8), seed=3), mesh, P(None, "x"))
    u = place(rand((8, 8), seed=4), mesh, P("x"))

    def body(a, b, c, d):
        return (commfuse.all_gather_matmul(a, b, "x", schedule="ring"),
                commfuse.matmul_reduce_scatter(c, d, "x", schedule="ring"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P(None, "x"), P("x")),
                              out_specs=(P("x"), P("x"))))
    before = _native.site_counts()
    for _ in range(3):
        gathered, scattered = jax.block_until_ready(f(x, w, v, u))
    after = _native.site_counts()
    assert {k: after[k] - before[k] for k in after} == {"instances": 2, "from_instances": 2 * 4, "from_map": 0}
    xs, ws, vs, us = (np.asarray(a, np.float64) for a in (x, w, v, u))
    assert_close(gathered, np.concatenate([xs @ ws] * 4), np.float32)
    assert_close(scattered, vs @ us, np.float32)
