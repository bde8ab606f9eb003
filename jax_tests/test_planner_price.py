"""A compiled step priced per device (``commfuse._planner``): the program
read from its HLO text (``hlo.py``: collectives, products, loops, commfuse's
fused ops) and timed by the library's cost model on a machine
(``price.py``, ``src/sim/step.rs``). Programs are compiled by ``jax.jit``
on 8 of the CPU devices; what the reading finds is checked against the
text and the shardings, and the prices against each other and
``commfuse.explain``."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import commfuse
from commfuse._decide import Machine
from commfuse._explain import predict
from commfuse._planner import hlo
from commfuse._planner.price import price, price_ops
from conftest import devices

F32 = 4


def auto_mesh(shape, names):
    """A mesh with Auto axes (jax 0.10's make_mesh defaults to Explicit) on the first devices."""
    return jax.make_mesh(tuple(shape), tuple(names), axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=devices(math.prod(shape)))


def arg(mesh, shape, spec, dtype=jnp.float32):
    """An abstract argument sharded over `mesh` by `spec`."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def compiled_text(fn, *args) -> str:
    """The per-device program ``jax.jit(fn)`` compiles for `args`, as text."""
    return jax.jit(fn).lower(*args).compile().as_text()


def in_text(text: str, opcode: str) -> int:
    """Instructions of `opcode` (or its async start) in an HLO text."""
    return len(re.findall(rf"\s{re.escape(opcode)}(?:-start)?\(", text))


def ops_of(ops, key):
    """The ops of `ops` with cost `key`, loop bodies and branches included."""
    found = []
    for op in ops:
        if key in op:
            found.append(op[key])
        for inner in [op["loop"]["ops"]] if "loop" in op else op.get("conditional", {}).get("branches", []):
            found.extend(ops_of(inner, key))
    return found


def fsdp_mlp(dtype=jnp.float32):
    """A forward MLP under FSDP over 8 devices: batch and both weights
    sharded on their rows, so the partitioner gathers each weight."""
    mesh = auto_mesh((8,), ("fsdp",))
    rows = NamedSharding(mesh, P("fsdp", None))

    def mlp(x, w1, w2):
        h = jax.lax.with_sharding_constraint(jax.nn.relu(x @ w1), rows)
        return jax.lax.with_sharding_constraint(h @ w2, rows)

    b, d, f = 512, 64, 128
    args = (arg(mesh, (b, d), P("fsdp", None), dtype), arg(mesh, (d, f), P("fsdp", None), dtype),
            arg(mesh, (f, d), P("fsdp", None), dtype))
    return compiled_text(mlp, *args), d * f + f * d


def dp_grads(n, dtype=jnp.float32):
    """The weight gradients of an MLP under data parallelism over `n`
    devices (8 rows of the batch each): XLA all-reduces them."""
    mesh = auto_mesh((n,), ("data",))

    def loss(w1, w2, x):
        return jnp.mean(jnp.square(jax.nn.relu(x @ w1) @ w2).astype(jnp.float32))

    d, f = 64, 128
    args = (arg(mesh, (d, f), P(), dtype), arg(mesh, (f, d), P(), dtype), arg(mesh, (8 * n, d), P("data"), dtype))
    return compiled_text(jax.grad(loss, argnums=(0, 1)), *args), d * f + f * d


def test_fsdp_gathers_each_weight_once_at_full_size():
    text, weight_elements = fsdp_mlp()
    program = hlo.parse(text)
    gathers = [op for op in ops_of(program.ops, "collective") if op["kind"] == "all-gather"]
    assert len(gathers) == in_text(text, "all-gather") == 2
    assert {g["ranks"] for g in gathers} == {8} and not any(g["crosses_nodes"] for g in gathers)
    # Each gather's larger side is its result: the whole weight.
    assert sum(g["bytes"] for g in gathers) == weight_elements * F32
    assert len(ops_of(program.ops, "gemm")) == in_text(text, "dot") == 2
    assert hlo.op_counts(program.ops)["all-gather"] == 2
    priced = price(text, "h100_nvlink")
    assert priced.collectives["all-gather"] == 2 and priced.collectives["all-reduce"] == 0
    assert priced.collective_bytes["all-gather"] == weight_elements * F32
    assert priced.fused_ops == 0 and priced.warnings == ()
    assert priced.total_s >= max(priced.compute_s, priced.comm_s) > 0
    assert priced.exposed_comm_s == pytest.approx(priced.total_s - priced.compute_s)
    assert sum(priced.by_kind.values()) == pytest.approx(priced.compute_s + priced.comm_s)


def measured_spec(monkeypatch, tmp_path, spec, devices, fastest=None):
    """`host.with_measured_memory(spec, devices)` with a calibration cache
    of its own in `tmp_path`, the op's timings given by `fastest` (None: measured)."""
    from commfuse import _calibration
    from commfuse._planner import host

    monkeypatch.setenv(_calibration.CACHE_VAR, str(tmp_path))
    if fastest is not None:
        monkeypatch.setattr(host, "_fastest", fastest)
    _calibration.forget()
    try:
        return host.with_measured_memory(spec, devices)
    finally:
        _calibration.forget()


def spec_fields(spec):
    return dict(field.split("=") for field in spec.split(":", 1)[1].split(","))


def test_the_memory_rates_measured_price_back_what_was_measured(monkeypatch, tmp_path):
    from commfuse._planner import host

    # The op in place takes 2 ms, into a fresh output 10 ms, on each of 8 devices.
    spec = measured_spec(monkeypatch, tmp_path, "cpu_here:gbytes_per_s=1", 8,
                         lambda x, in_place: 0.002 if in_place else 0.010)
    fields = spec_fields(spec)
    assert fields["gbytes_per_s"] == "1" and set(fields) == {"gbytes_per_s", *host.KEYS}
    stream = 2 * host.STREAM_SAMPLE_BYTES  # read and written once
    overhead = 5e-6 * max(8 / commfuse._abi.machine_summary("cpu_here")["shared_processors"], 1.0)
    streamed = price_ops([{"memory": {"bytes": stream}}], spec, devices=8)["total_s"]
    assert streamed - overhead == pytest.approx(0.002, rel=1e-3)
    # The fresh output's first write is what it took beyond the op in place.
    touched = price_ops([], spec, devices=8, fresh_bytes=host.TOUCH_SAMPLE_BYTES)["total_s"]
    assert touched == pytest.approx(0.008, rel=1e-3)
    # A description that sets a rate keeps it, and the other is measured.
    kept = spec_fields(measured_spec(monkeypatch, tmp_path, "cpu_here:mem_gbytes_per_s=3", 8,
                                     lambda x, in_place: 0.002 if in_place else 0.010))
    assert kept["mem_gbytes_per_s"] == "3" and "touch_gbytes_per_s" in kept


def test_a_first_write_too_small_to_measure_costs_nothing(monkeypatch, tmp_path):
    from commfuse._planner import host

    # A fresh output 1% slower than the op in place: no first write measured.
    spec = measured_spec(monkeypatch, tmp_path, "cpu_here", 8, lambda x, in_place: 0.0100 if in_place else 0.0101)
    assert spec_fields(spec)["touch_gbytes_per_s"] == "0"
    assert price_ops([], spec, devices=8, fresh_bytes=host.TOUCH_SAMPLE_BYTES)["total_s"] == 0.0
    # More devices than JAX has: nothing measured, the model's assumptions stand.
    assert measured_spec(monkeypatch, tmp_path, "cpu_here", 10**4) == "cpu_here"


def test_this_hosts_memory_rates_are_measured_on_its_cpu_devices(monkeypatch, tmp_path):
    spec = measured_spec(monkeypatch, tmp_path, "cpu_here", 2)
    fields = spec_fields(spec)
    Machine.checked(spec)
    assert 0 < float(fields["mem_gbytes_per_s"]) < 1e4 and 0 <= float(fields["touch_gbytes_per_s"]) < 1e4


def test_a_machine_descriptions_overrides_are_read_and_added_in_order():
    m = Machine("cpu_here: gbytes_per_s=1 ,latency_us=20")
    assert m.fields == {"gbytes_per_s": "1", "latency_us": "20"}
    # Added after the ones it has; one it sets keeps its value.
    added = m.with_fields(mem_gbytes_per_s="4", gbytes_per_s=9)
    assert added.spec == "cpu_here:gbytes_per_s=1,latency_us=20,mem_gbytes_per_s=4"
    assert Machine("h100_nvlink").across_nodes().spec == "h100_nvlink:across_nodes=1"
    assert Machine("h100_nvlink").fields == {}
    Machine.checked(added.spec)


def test_temporaries_the_host_maps_afresh_cost_their_first_write():
    from commfuse._planner import host

    # glibc maps allocations from 32 MiB on anew each time; smaller ones are reused.
    assert host.mapped_afresh(host.MAPPED_FROM_BYTES - 1) == 0
    assert host.mapped_afresh(host.MAPPED_FROM_BYTES) == host.MAPPED_FROM_BYTES
    text, _ = fsdp_mlp()
    machine, fresh = "cpu_here:gemm_gflops=50,touch_gbytes_per_s=2", 10**8
    without, with_fresh = (price(text, machine, fresh_bytes=b, collectives="blocking") for b in (0, fresh))
    # 8 devices share the host's cores: each maps at its share of the rate.
    cores = commfuse._abi.machine_summary("cpu_here")["shared_processors"]
    first_write = fresh / 2e9 * max(8 / cores, 1.0)
    assert with_fresh.by_kind["memory"] - without.by_kind["memory"] == pytest.approx(first_write)
    assert with_fresh.total_s - without.total_s == pytest.approx(first_write)
    # Without a measured rate (the preset, a GPU) nothing is mapped afresh.
    for machine in ("cpu_here", "h100_nvlink"):
        assert price(text, machine, fresh_bytes=fresh).total_s == price(text, machine).total_s


def test_an_overlappable_collective_is_cheaper_async_than_blocking():
    # The second weight's gather does not wait for the first product.
    text, _ = fsdp_mlp()
    overlapped, blocking = (price(text, "h100_nvlink", collectives=c) for c in ("async", "blocking"))
    assert overlapped.total_s < blocking.total_s
    assert overlapped.exposed_comm_s < blocking.exposed_comm_s
    assert blocking.total_s == pytest.approx(blocking.compute_s + blocking.comm_s)
    assert overlapped.by_kind == pytest.approx(blocking.by_kind)
    with pytest.raises(ValueError, match="collectives"):
        price(text, "h100_nvlink", collectives="sometimes")


def test_dp_all_reduces_the_gradients_and_more_devices_cost_more():
    text8, weight_elements = dp_grads(8)
    text4, _ = dp_grads(4)
    for text, n in ((text8, 8), (text4, 4)):
        reduces = [op for op in ops_of(hlo.parse(text).ops, "collective") if op["kind"] == "all-reduce"]
        assert len(reduces) == in_text(text, "all-reduce") >= 1
        assert {r["ranks"] for r in reduces} == {n}
        # However XLA combines them, every gradient is reduced once (f32).
        assert sum(r["bytes"] for r in reduces) == weight_elements * F32
    eight, four = price(text8, "h100_nvlink"), price(text4, "h100_nvlink")
    assert eight.collective_bytes["all-reduce"] == four.collective_bytes["all-reduce"] == weight_elements * F32
    assert eight.by_kind["collective"] > four.by_kind["collective"]
    assert eight.by_kind["gemm"] == pytest.approx(four.by_kind["gemm"])


def test_groups_crossing_nodes_cost_more():
    text, _ = dp_grads(8)
    inside = price(text, "h100_cluster", devices_per_node=8)
    across = price(text, "h100_cluster", devices_per_node=4)
    assert across.by_kind["collective"] > inside.by_kind["collective"]
    assert across.total_s > inside.total_s
    # The cluster's own nodes hold 8 devices.
    assert price(text, "h100_cluster").total_s == inside.total_s
    assert all(op["crosses_nodes"] for op in ops_of(hlo.parse(text, devices_per_node=4).ops, "collective"))
    # A custom network, on a machine that has none.
    slow = price(text, "h100_nvlink:gpus_per_node=4,net_gbytes_per_s=5")
    assert slow.by_kind["collective"] > across.by_kind["collective"]
    with pytest.raises(ValueError, match="crosses nodes"):
        price(text, "h100_nvlink", devices_per_node=4)
    with pytest.raises(ValueError, match="unknown machine"):
        price(text, "tpu_v9")


def test_groups_along_either_mesh_axis_are_read_from_the_text():
    mesh = auto_mesh((2, 4), ("data", "model"))

    def sums(x):
        return jax.lax.psum(x, "data"), jax.lax.psum(x, "model")

    body = jax.shard_map(sums, mesh=mesh, in_specs=P("data", "model"), out_specs=(P(None, "model"), P("data")))
    text = compiled_text(body, arg(mesh, (16, 32), P("data", "model")))
    reduces = [op for op in ops_of(hlo.parse(text, devices_per_node=4).ops, "collective")
               if op["kind"] == "all-reduce"]
    assert len(reduces) == in_text(text, "all-reduce")
    # Over "data" the groups are {0, 4}, {1, 5}, ...: across nodes of 4; over "model" they are not.
    assert sorted((r["ranks"], r["crosses_nodes"]) for r in reduces) == [(2, True), (4, False)]


def test_a_scan_over_layers_is_a_loop_of_its_trip_count():
    layers, d = 4, 128
    mesh = auto_mesh((8,), ("fsdp",))

    def stack(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    text = compiled_text(stack, arg(mesh, (64, d), P("fsdp", None)), arg(mesh, (layers, d, d), P(None, "fsdp", None)))
    program = hlo.parse(text)
    loops = [op for op in program.ops if "loop" in op]
    assert [loop["loop"]["trip_count"] for loop in loops] == [layers]
    gathers = in_text(text, "all-gather")
    assert gathers >= 1 and len(ops_of(loops[0]["loop"]["ops"], "collective")) == gathers
    priced = price(text, "h100_nvlink")
    assert priced.collectives["all-gather"] == layers * gathers
    # Each layer's weight, gathered whole.
    assert priced.collective_bytes["all-gather"] == layers * d * d * F32
    # Without XLA's known trip count, the condition's bound gives it.
    stripped = re.sub(r'"known_trip_count":\{[^}]*\}', '"unknown":{}', text)
    assert stripped != text
    again = hlo.parse(stripped)
    assert [op["loop"]["trip_count"] for op in again.ops if "loop" in op] == [layers] and not again.warnings


def test_a_loop_without_a_readable_bound_runs_once_and_says_so():
    text = """HloModule m, num_partitions=1

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %e = f32[8]{0} exponential(%v)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %e)
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %k = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%j, %k), direction=LT
}

ENTRY %main (a: f32[8]) -> (s32[], f32[8]) {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %a)
  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
}
"""
    program = hlo.parse(text)
    assert program.ops == [{"deps": [], "loop": {"trip_count": 1, "ops": [{"deps": [], "memory": {"bytes": 32}}]}}]
    assert len(program.warnings) == 1 and program.warnings[0].startswith("while w:")


def test_a_conditional_is_priced_at_its_costliest_branch():
    def either(x, w):
        return jax.lax.cond(x.sum() > 0, lambda: (x @ w) @ w, lambda: x * 2)

    text = compiled_text(either, jax.ShapeDtypeStruct((256, 256), jnp.float32),
                         jax.ShapeDtypeStruct((256, 256), jnp.float32))
    (conditional,) = [op["conditional"] for op in hlo.parse(text).ops if "conditional" in op]
    assert sorted(len(ops_of(branch, "gemm")) for branch in conditional["branches"]) == [0, 2]
    one = price_ops([{"gemm": {"batch": 1, "m": 256, "k": 256, "n": 256, "input": "float32",
                               "output": "float32"}}], "h100_nvlink")
    assert price(text, "h100_nvlink").by_kind["gemm"] == pytest.approx(2 * one["total_s"])


def test_bf16_products_are_priced_as_bf16_where_the_cpu_widens_them():
    # XLA's CPU compiler may compute bf16 dots in f32 between converts.
    text, _ = dp_grads(8, jnp.bfloat16)
    gemms = ops_of(hlo.parse(text).ops, "gemm")
    assert len(gemms) == in_text(text, "dot") >= 4
    assert {g["input"] for g in gemms} == {"bfloat16"}


def overlapped_block():
    """A TP-SP MLP block through ``commfuse.overlap(schedule="ring")`` under
    jit on a (dp 2, tp 4) mesh: an all_gather_matmul and a
    matmul_reduce_scatter over tp after partitioning."""
    mesh = auto_mesh((2, 4), ("dp", "tp"))

    def block(x, w1, w2):
        h = jax.lax.with_sharding_constraint(jnp.einsum("bsd,df->bsf", x, w1), NamedSharding(mesh, P("dp", None, "tp")))
        return jax.lax.with_sharding_constraint(jax.nn.gelu(h) @ w2, NamedSharding(mesh, P("dp", "tp", None)))

    args = (arg(mesh, (4, 256, 128), P("dp", "tp", None)), arg(mesh, (128, 512), P(None, "tp")),
            arg(mesh, (512, 128), P("tp", None)))
    with jax.set_mesh(mesh):
        return jax.jit(commfuse.overlap(block, schedule="ring")).lower(*args).compile().as_text()


def test_commfuse_calls_are_fused_ops_priced_as_explain_predicts():
    text = overlapped_block()
    targets = text.count('custom_call_target="commfuse_collective_matmul')
    fused = ops_of(hlo.parse(text).ops, "fused")
    assert len(fused) == targets == 2
    calls = {f["call"]["kind"]: f["call"] for f in fused}
    ops = {0: "all_gather_matmul", 4: "matmul_reduce_scatter"}
    assert set(calls) == set(ops)
    for call in calls.values():
        assert (call["ranks"], call["schedule"], call["input"], call["output"]) == (4, 1, 11, 11)
    # Over tp the groups are {0..3} and {4..7}: across nodes of 2, not of 4.
    assert all(f["crosses_nodes"] for f in ops_of(hlo.parse(text, devices_per_node=2).ops, "fused"))
    assert not any(f["crosses_nodes"] for f in ops_of(hlo.parse(text, devices_per_node=4).ops, "fused"))
    priced = price(text, "h100_nvlink")
    assert priced.fused_ops == 2 and priced.collectives == dict.fromkeys(priced.collectives, 0)
    explained = 0.0
    for kind, call in calls.items():
        ring = predict(ops[kind], call["x"], call["w"], 4, dimension=call["dimension"],
                       machine="h100_nvlink")["schedules"]["ring"]
        alone = price_ops([{"fused": {"call": call}}], "h100_nvlink")
        assert alone["total_s"] == pytest.approx(ring, rel=1e-9)
        explained += ring
    # Each call also pays a fused call's fixed cost, as auto weighs it.
    overhead = Machine("h100_nvlink").call_overhead_s(4)
    assert overhead > 0
    assert priced.by_kind["fused"] == pytest.approx(explained + 2 * overhead, rel=1e-9)
    # Across nodes the same calls take longer.
    assert price(text, "h100_cluster", devices_per_node=2).by_kind["fused"] > priced.by_kind["fused"]


@pytest.mark.parametrize("text, groups", [
    ("{{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("{}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("mesh['a'=2,'b'=4] {'b'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh[a=2,b=4] {a}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['a'=2,'b'=4] {'a','b'}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ("mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['a'=2,'b'=2], device_ids=([2,2]<=[2,2]T(1,0)) {'b'}", [[0, 2], [1, 3]]),
    ("mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'a'}", [[3, 1], [2, 0]]),
])
def test_every_form_of_replica_groups_expands(text, groups):
    assert hlo.replica_groups(text, 8) == groups


def test_fused_attributes_decode_from_the_mlir_dictionary():
    config = ("{axes = dense<1> : tensor<1xi64>, dimension = 1 : i64, kind = 0 : i64, mesh_devices = dense<[0, 1, 2, "
              "3, 4, 5, 6, 7]> : tensor<8xi64>, mesh_shape = dense<[2, 4]> : tensor<2xi64>, schedule = 1 : i64, "
              "site = 1 : i64, local = array<i64: 3, 4>, splat = dense<2> : tensor<2x2xi64>}")
    assert hlo._mlir_dict(config) == {"axes": [1], "dimension": 1, "kind": 0, "mesh_devices": list(range(8)),
                                      "mesh_shape": [2, 4], "schedule": 1, "site": 1, "local": [3, 4],
                                      "splat": [2, 2, 2, 2]}


def test_types_and_bad_text():
    assert hlo.type_bytes("(f32[8,128]{1,0}, bf16[4]{0}, /*index=2*/pred[], token[])") == 8 * 128 * 4 + 8 + 1
    assert hlo.arrays("f32[<=16,3]{1,0}") == [("f32", (16, 3))]
    # Attributes split at top-level commas only: not inside brackets or quoted strings.
    assert hlo._split_top_level(', a={1,2}, b="x,\\"(y", c=(1,2)') == ['a={1,2}', 'b="x,\\"(y"', 'c=(1,2)']
    with pytest.raises(ValueError, match="ENTRY"):
        hlo.parse("not hlo")
    with pytest.raises(ValueError, match="devices_per_node"):
        hlo.parse("", devices_per_node=0)
    assert hlo.op_counts([]) == {}
