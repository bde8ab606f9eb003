"""The one-rank GPU benchmark's path without a GPU (`python -m commfuse.bench_gpu`):
the cost model's predictions for the same table, said to be predictions;
and its request reaching the library, which answers clearly without a GPU."""

import csv
import subprocess
import sys

import pytest

from commfuse import bench_gpu


def test_without_a_gpu_the_table_is_the_cost_models_and_says_so(tmp_path):
    traces = tmp_path / "traces"
    out = subprocess.run([sys.executable, "-m", "commfuse.bench_gpu", "--quick", "--predict", "--out", str(tmp_path),
                          "--trace", str(traces)], capture_output=True, text=True, timeout=300, check=True).stdout
    assert "the cost model's predictions for h100_nvlink, not measurements" in out
    assert f"wrote 40 predicted traces to {traces}" in out
    rows = list(csv.DictReader(open(tmp_path / "bench_gpu.csv")))
    # 4 projections x 2 ops x (N=2 ring, N=4 and 8 ring and bidirectional), 8k tokens.
    assert len(rows) == 4 * 2 * 5
    assert {r["source"] for r in rows} == {"predicted"}
    for r in rows:
        fused, gemm, transfers = (float(r[k]) for k in ("fused_ms", "gemm_ms", "transfers_ms"))
        # No schedule beats the floor, nor exposes more than the sum of both.
        assert fused >= 0.99 * max(gemm, transfers), r
        assert float(r["fused_over_max"]) == pytest.approx(fused / max(gemm, transfers), rel=1e-6)
        assert 0.2 < float(r["pieces_efficiency"]) <= 1.01, r
    # The per-peer pieces of a Llama-70B MLP projection at N = 8 lose their last wave.
    (mlp,) = [r for r in rows if (r["model"], r["projection"], r["op"], r["n"], r["schedule"]) ==
              ("70B", "mlp", "all_gather_matmul", "8", "ring")]
    assert float(mlp["pieces_efficiency"]) < 0.9


def test_the_cases_are_the_transformer_projections_one_rank_holds():
    cases = list(bench_gpu.cases(quick=False))
    assert len(cases) == 4 * 3 * 2 * 5
    for model, projection, op, tokens, n, schedule, x, w in cases:
        d_in, d_out = bench_gpu.PROJECTIONS[(model, projection)]
        if op == "all_gather_matmul":
            assert (x, w) == ((tokens // n, d_in), (d_in, d_out // n))
        else:
            assert (x, w) == ((tokens, d_out // n), (d_out // n, d_in))


def test_the_library_answers_a_one_rank_request_without_a_gpu_with_the_reason():
    if any(d.platform == "gpu" for d in __import__("jax").devices()):
        pytest.skip("a GPU is visible: scripts/gpu_device_check.sh runs the measured path")
    with pytest.raises(ValueError) as e:
        bench_gpu.measure("all_gather_matmul", (64, 32), (32, 16), 2, "ring", "h100_nvlink", 1)
    message = str(e.value)
    # Either the CUDA backend is absent from this build, or the driver is.
    assert "cuda" in message.lower(), message
    from commfuse import _native

    if _native.cuda_built():
        # The request is read before any device is touched.
        with pytest.raises(ValueError, match="machine"):
            bench_gpu.measure("all_gather_matmul", (64, 32), (32, 16), 2, "ring", "no_such_machine", 1)


def test_a_predicted_trace_per_case_shows_every_rank_s_pieces_copies_and_waits(tmp_path):
    import json

    case = next(c for c in bench_gpu.cases(quick=True) if c[2:6] == ("all_gather_matmul", 8192, 8, "ring"))
    path = tmp_path / bench_gpu.trace_name(case)
    _, _, op, _, n, schedule, x, w = case
    figures = bench_gpu.predicted(op, x, w, n, schedule, "h100_nvlink", str(path))
    slices = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    assert {e["pid"] for e in slices} == set(range(n))
    for device in range(n):
        mine = [e for e in slices if e["pid"] == device]
        # A ring's all-gather-matmul: n GEMM pieces on the compute lane, n - 1 exchanges on the comm lane.
        assert sum(e["name"] == "matmul" and e["tid"] == 0 for e in mine) == n
        assert sum(e["name"] == "exchange" and e["tid"] == 1 for e in mine) == n - 1
        # The call's slice on the compute lane lasts the predicted fused time (the ranks are alike).
        (call,) = [e for e in mine if e["name"] == op and e["tid"] == 0]
        assert call["dur"] == pytest.approx(figures["fused_s"] * 1e6, rel=1e-3)
