"""commfuse.explain: the cost model's predictions for one call, printed and returned."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest

import commfuse
from commfuse import _abi
from conftest import P

MACHINES = ["cpu_here", "h100_nvlink", "h200_nvlink", "h100_pcie"]

CASES = [
    # (op, x, w, n, dimension)
    ("all_gather_matmul", (512, 1024), (1024, 2048), 4, 0),
    ("all_gather_matmul", (2, 128, 256), (256, 512), 8, 1),
    ("matmul_reduce_scatter", (4096, 1024), (1024, 1024), 8, 0),
    ("matmul_reduce_scatter", (256, 1024), (1024, 2048), 4, -1),
    ("all_gather_matmul", (256, 128), (512, 256), 4, -1),
    ("matmul_all_gather", (256, 512), (512, 128), 4, 1),
    ("matmul_all_gather", (256, 512), (128, 256), 4, 0),
    ("all_to_all_matmul", (4, 128, 256), (256, 256), 4, 0),
    ("matmul_all_to_all", (8, 64, 256), (256, 128), 8, 0),
    ("matmul_all_reduce", (2, 1024, 1024), (1024, 512), 4, 0),
]


def check_consistent(r, *, exact=False):
    times = r["schedules"]
    assert times and all(t > 0 and math.isfinite(t) for t in times.values())
    # The floor is one whole GEMM (or the pieces, were they ever faster) or
    # the transfers alone.
    assert r["t_gemm"] <= r["t_compute"] * (1 + 1e-9)
    assert r["floor"] == pytest.approx(max(r["t_gemm"], r["t_comm"]))
    for name, t in times.items():
        assert r["floor"] <= t * (1 + 1e-9), (name, t, r["floor"])
    # The fastest is the fastest; auto's choice is an overlapped schedule, the
    # fastest of them up to the margin a tiled one must win by.
    assert times[r["fastest"]] == min(times.values())
    # (An all-reduce's chunks are what overlap its gather half: sliced counts.)
    chunked = ("tiled", "sliced") if r["op"] == "matmul_all_reduce" else ("tiled",)
    overlapped = {k: t for k, t in times.items() if k in ("ring", "bidirectional") or k.startswith(chunked)}
    assert r["choice"] in overlapped
    assert times[r["choice"]] <= min(overlapped.values()) / 0.97 * (1 + 1e-9)
    # Sequential is its compute plus its communication: no overlap, except
    # that a sequential all-to-all copies each received block in while the
    # next one travels.
    seq = times["sequential"]
    parts = r["parts"]["sequential"]
    # On a host (cpu_here) each message is also copied out and in by the
    # processors the GEMMs share, which neither part counts.
    copies = 1.1 if r["machine"]["name"] == "cpu_here" else 1 + 1e-9
    if "all_to_all" in r["op"]:
        assert max(parts["compute"], parts["comm"]) <= seq <= (parts["compute"] + parts["comm"]) * copies
    elif r["machine"]["name"] == "cpu_here":
        assert parts["compute"] + parts["comm"] <= seq * (1 + 1e-9) <= (parts["compute"] + parts["comm"]) * copies
    else:
        assert seq == pytest.approx(parts["compute"] + parts["comm"], rel=0.02), (seq, parts)
    # T_compute and T_comm are the least of any schedule's compute-only and
    # communication-only times (bidirectional pays half the latencies, and on
    # a ring uses twice the links), so sequential takes at least their sum.
    assert set(r["parts"]) == set(times)
    assert r["t_compute"] == min(p["compute"] for p in r["parts"].values())
    assert r["t_comm"] == min(p["comm"] for p in r["parts"].values())
    if exact:
        assert r["t_compute"] + r["t_comm"] <= seq * (1 + 1e-9) <= (r["t_compute"] + r["t_comm"]) * copies
    # The plan of the chosen schedule is there, per lane, with times inside the prediction.
    plan = r["plan"]
    steps = plan["compute"] + plan["comm"]
    assert steps
    assert all(0 <= s["start"] <= s["end"] <= times[r["choice"]] * (1 + 1e-9) for s in steps)


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-n{c[3]}-d{c[4]}")
def test_numbers_are_consistent(case, machine, capsys):
    op, x, w, n, dimension = case
    r = commfuse.explain(op, x, w, n, dimension=dimension, machine=machine,
                         gemm_gflops=20.0 if machine == "cpu_here" else None)
    # Where latency is negligible against the bytes (this host's in-process
    # links), sequential is T_compute + T_comm (plus the host copies).
    check_consistent(r, exact=machine == "cpu_here")
    out = capsys.readouterr().out
    assert "floor" in out and "one whole GEMM" in out and r["choice"] in out
    # "chosen" marks the schedule auto runs, and only where it runs one.
    assert ("<- chosen" in out) == (r["decision"] == r["choice"])
    for name in r["schedules"]:
        assert name in out


def test_row_gathers_and_scatters_compare_every_schedule(capsys):
    r = commfuse.explain("all_gather_matmul", (1024, 4096), (4096, 4096), 8, dtype="bfloat16",
                         machine="h100_nvlink")
    assert set(r["schedules"]) == {"sequential", "ring", "bidirectional", "sliced(2)", "sliced(4)", "sliced(8)",
                                   "tiled(2)", "tiled(4)", "tiled(8)"}
    assert r["dtype"] == "bfloat16"
    # A large GEMM on NVLink: overlap hides the transfers, slicing leaves its head exposed.
    assert r["choice"] in ("ring", "bidirectional")
    assert r["schedules"][r["choice"]] <= 1.05 * max(r["t_compute"], r["t_comm"])
    # ... but its 8 pieces of 128 rows lose their last waves against one GEMM
    # of 1024, which is the floor.
    assert r["t_gemm"] < r["t_compute"] and r["floor"] == pytest.approx(r["t_gemm"])
    assert r["schedules"][r["choice"]] < r["schedules"]["sliced(4)"]
    assert r["schedules"][r["choice"]] <= 0.8 * r["schedules"]["sequential"]
    out = capsys.readouterr().out
    assert "plan of rank 0" in out and "matmul" in out and "exchange" in out


def test_bidirectional_wins_on_a_comm_bound_ring():
    r = commfuse.explain("all_gather_matmul", (512, 4096), (4096, 256), 8, dtype="bfloat16",
                         machine="h100_pcie:topology=ring")
    check_consistent(r)
    assert r["machine"]["topology"] == "ring"
    assert r["t_comm"] > r["t_compute"]
    assert r["schedules"]["bidirectional"] < 0.8 * r["schedules"]["ring"]
    assert r["choice"] == "bidirectional"


def test_cpu_here_follows_the_link_model_and_the_measured_rate(monkeypatch):
    case = ("matmul_reduce_scatter", (1024, 512), (512, 512), 4)
    monkeypatch.delenv("COMMFUSE_CPU_LINK", raising=False)
    fast = commfuse.explain(*case, gemm_gflops=40.0)
    slow = commfuse.explain(*case, gemm_gflops=10.0)
    assert slow["t_compute"] == pytest.approx(4 * fast["t_compute"], rel=0.05)
    monkeypatch.setenv("COMMFUSE_CPU_LINK", "gbytes_per_s=0.5,latency_us=20,topology=switch")
    linked = commfuse.explain(*case, gemm_gflops=40.0)
    assert linked["machine"]["link_bytes_per_s"] == pytest.approx(0.5e9)
    assert linked["machine"]["latency_s"] == pytest.approx(20e-6)
    assert linked["t_comm"] > fast["t_comm"]
    check_consistent(linked)


@pytest.mark.parametrize("kwargs, message", [
    (dict(op="all_reduce_matmul"), "unknown op"),
    (dict(machine="tpu_v5"), "unknown machine"),
    (dict(machine="h100_pcie:topology=torus"), "topology"),
    (dict(dtype="int32"), "unsupported dtype"),
    (dict(n=0), "n must be"),
    (dict(w_shape=(100, 64)), "contract"),
    (dict(dimension=3), "out of range"),
    (dict(gemm_gflops=-1.0), "gemm_gflops"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, message):
    args = dict(op="all_gather_matmul", x_shape=(64, 128), w_shape=(128, 64), n=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        commfuse.explain(args.pop("op"), args.pop("x_shape"), args.pop("w_shape"), args.pop("n"), **args)


def _lowered_schedule_codes(op, x, w, n):
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    specs = (P("x"), P()) if op is commfuse.all_gather_matmul else (P(), P())
    f = jax.jit(jax.shard_map(lambda a, b: op(a, b, "x"), mesh=mesh, in_specs=specs, out_specs=P("x")))
    args = [jax.ShapeDtypeStruct(shape, np.float32, sharding=jax.NamedSharding(mesh, spec))
            for shape, spec in zip((x, w), specs)]
    text = f.lower(*args).as_text()
    return [int(c) for c in re.findall(r"schedule = (\d+) : i64", text)]


@pytest.mark.parametrize("spec, op, x, w, want", [
    # Comm-bound on a ring of PCIe links: both directions.
    ("h100_pcie:topology=ring", commfuse.all_gather_matmul, (4 * 512, 4096), (4096, 256), "bidirectional"),
    # Comm-bound on slow in-process links: tiles hide all but one tile's compute.
    ("cpu_here:gbytes_per_s=0.05,gemm_gflops=50", commfuse.matmul_reduce_scatter, (1024, 512), (512, 512),
     "tiled(8)"),
    # An all-reduce on slow links: chunks hide both rings behind the next chunk's products.
    ("cpu_here:gbytes_per_s=0.05,gemm_gflops=50", commfuse.matmul_all_reduce, (8192, 4096), (4096, 4096),
     "sliced(8)"),
])
def test_auto_runs_the_schedule_the_model_picks(monkeypatch, spec, op, x, w, want, capsys):
    monkeypatch.setenv("COMMFUSE_MACHINE", spec)
    n = 4
    local_x = (x[0] // n, x[1]) if op is commfuse.all_gather_matmul else x
    r = commfuse.explain(op.__name__, local_x, w, n, machine=spec)
    assert r["choice"] == want
    name, _, chunks = want.rstrip(")").partition("(")
    code = _abi.schedule_code(name, int(chunks)) if chunks else _abi.SCHEDULES[name]
    assert _lowered_schedule_codes(op, x, w, n) == [code]


def test_a_bad_machine_description_for_auto_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("COMMFUSE_MACHINE", "h100-nvlink")  # '-' for '_'
    with pytest.raises(ValueError, match=r"COMMFUSE_MACHINE.*unknown machine \"h100-nvlink\""):
        _lowered_schedule_codes(commfuse.all_gather_matmul, (4 * 64, 128), (128, 64), 4)


def test_memory_puts_the_workspace_beside_the_unfused_temporaries(capsys):
    # all_gather(x) @ w gathers 8 blocks of 256x1024 f32 (8 MiB). The chosen
    # schedule holds its receive slots (ring 2, bidirectional 4: a block each)
    # and sends its own block; the CPU workspace holds the packed w (1024x512
    # f32, 2 MiB), the CUDA one the receive slots.
    r = commfuse.explain("all_gather_matmul", (256, 1024), (1024, 512), 8, machine="h100_nvlink")
    mib = 1 << 20
    slots = {"ring": 2, "bidirectional": 4}[r["choice"]]
    assert r["memory"]["unfused_temporaries"] == 8 * mib
    assert r["memory"]["blocks_in_flight"] == (slots + 1) * mib
    assert r["memory"]["workspace_cuda"] == slots * mib
    assert r["memory"]["workspace_cpu"] == 2 * mib
    assert "the unfused jax.lax expression's temporaries 8192 KiB" in capsys.readouterr().out
    # psum_scatter(x @ w) materializes the whole product: 2048x512 f32.
    r = commfuse.explain("matmul_reduce_scatter", (2048, 1024), (1024, 512), 8, machine="h100_nvlink")
    assert r["memory"]["unfused_temporaries"] == 4 * mib


def test_explain_says_how_the_blocks_move(monkeypatch, capsys):
    monkeypatch.delenv("COMMFUSE_TRANSPORT", raising=False)
    shapes = ("all_gather_matmul", (256, 1024), (1024, 512), 8)
    assert commfuse.explain(*shapes, machine="cpu_here")["transport"] == "host"
    assert commfuse.explain(*shapes, machine="h100_nvlink")["transport"] == "copies"
    assert "copy engines" in capsys.readouterr().out
    commfuse.configure(transport="nccl")
    try:
        assert commfuse.explain(*shapes, machine="h100_nvlink")["transport"] == "nccl"
        assert "NCCL send/receive" in capsys.readouterr().out
    finally:
        commfuse.configure(transport=None)


def test_a_predicted_trace_shows_each_device_s_steps_at_the_predicted_times(tmp_path, capsys):
    path = tmp_path / "predicted.json"
    r = commfuse.explain("all_gather_matmul", (512, 4096), (4096, 256), 8, dtype="bfloat16",
                         machine="h100_pcie:topology=ring", trace=path)
    import json

    slices = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    assert {e["pid"] for e in slices} == set(range(8)), "a process per device"
    plan = r["plan"]
    for lane, tid in (("compute", 0), ("comm", 1)):
        # Device 0's steps of this lane, in order, at the times explain gives
        # (the trace's clock starts at the first slice; microseconds).
        mine = [e for e in slices if e["pid"] == 0 and e["tid"] == tid and e["name"] not in ("wait", "all_gather_matmul")]
        assert [e["args"]["step"] for e in mine] == [s["id"] for s in plan[lane]]
        for e, s in zip(mine, plan[lane]):
            assert e["ts"] == pytest.approx(s["start"] * 1e6, abs=1e-2)
            assert e["dur"] == pytest.approx((s["end"] - s["start"]) * 1e6, abs=1e-2)
    # Comm-bound: some matmul waits for its block, shown as a wait on the compute lane.
    assert any(e["name"] == "wait" and e["tid"] == 0 for e in slices)
    # Asked again, it is written again (the answers without a trace are cached, not this).
    path.unlink()
    commfuse.explain("all_gather_matmul", (512, 4096), (4096, 256), 8, dtype="bfloat16",
                     machine="h100_pcie:topology=ring", trace=path)
    assert path.exists()
    # Without ".json": a Perfetto protobuf, not JSON.
    commfuse.explain("all_gather_matmul", (512, 4096), (4096, 256), 8, dtype="bfloat16", machine="h100_pcie",
                     trace=tmp_path / "predicted.pftrace")
    data = (tmp_path / "predicted.pftrace").read_bytes()
    assert data and not data.lstrip().startswith(b"{")


def test_where_auto_declines_no_schedule_is_marked_chosen(monkeypatch, capsys):
    # The suite makes auto always fuse (conftest); a user's auto weighs the
    # gain against a fused call's fixed cost, which a tiny call never pays.
    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "1")
    r = commfuse.explain("matmul_reduce_scatter", (64, 16), (16, 64), 4)
    out = capsys.readouterr().out
    assert r["decision"] == "unfused", r["decision_reason"]
    assert "<- chosen" not in out and "<- fastest fused (auto runs unfused)" in out
