"""The trace's JSON form and the timeline drawn from it (the demo's `--timeline`)."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import commfuse


def _json_trace(path):
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    f = jax.jit(jax.shard_map(lambda a, b: commfuse.all_gather_matmul(a, b, "x", schedule="ring"), mesh=mesh,
                              in_specs=(P("x", None), P()), out_specs=P("x")))
    x, w = jax.random.normal(jax.random.key(0), (32, 16)), jax.random.normal(jax.random.key(1), (16, 8))
    jax.block_until_ready(f(x, w))
    with commfuse.trace(path) as written:
        jax.block_until_ready(f(x, w))
    return written, {d.id for d in mesh.devices.flat}


def test_a_trace_to_a_json_path_is_a_chrome_trace_of_the_same_slices(tmp_path):
    path, devices = _json_trace(tmp_path / "t.json")
    slices = json.loads(open(path).read())["traceEvents"]
    cats = {e["cat"] for e in slices}
    assert {"matmul", "exchange", "send", "recv", "call"} <= cats, cats
    assert {e["pid"] for e in slices if e["cat"] == "matmul"} == devices
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["tid"] in (0, 1) for e in slices)


def test_a_json_trace_draws_as_a_timeline(tmp_path):
    pytest.importorskip("matplotlib", reason="drawing the timeline needs matplotlib (the bench extra)")
    from commfuse import _timeline

    path, _ = _json_trace(tmp_path / "t.json")
    _timeline.draw(path, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
