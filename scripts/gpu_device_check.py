"""The GPU validation of the CUDA backend on a bare GPU host, as one table.

Run by scripts/gpu_device_check.sh (see it and GPU.md for the recipe): the
library is the `.so` built elsewhere with `--features cuda`, loaded with
ctypes, so one build serves any Python. Each row is one check: PASS, FAIL
(with why) or N/A (with why it could not run here). Writes the table to
stdout and, as markdown, to the file named by --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

ROWS: list[tuple[str, str, str]] = []


def row(check: str, status: str, detail: str = "") -> None:
    ROWS.append((check, status, " ".join(detail.split())))
    print(f"[{status}] {check}: {detail}", flush=True)


LOGS = "."


def run(cmd, timeout, env=None, log=None):
    """(exit code, combined output) of a command, a timeout being code 124;
    the whole output is kept in LOGS/`log` when named."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        code, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code, out = 124, f"{partial}\ntimed out after {timeout} s"
    if log:
        with open(os.path.join(LOGS, log), "w") as f:
            f.write(out)
    return code, out


def tail(text: str, n: int = 300) -> str:
    return text.strip()[-n:]


def check_host() -> None:
    code, out = run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total", "--format=csv,noheader"],
                    30)
    row("host", "PASS" if code == 0 else "FAIL", f"{out.strip()}; Python {platform.python_version()}")
    import jax
    import jaxlib
    row("JAX", "PASS", f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, devices {jax.devices()}")


def check_libraries() -> None:
    import commfuse
    from commfuse import _native
    row("library", "PASS" if _native.cuda_built() else "FAIL",
        f"{_native.LIBRARY_PATH} (cuda feature: {_native.cuda_built()})")
    maps = open("/proc/self/maps").read()
    for key, entry in commfuse.cuda_libraries().items():
        if entry["error"]:
            row(f"cuda_libraries()[{key!r}]", "FAIL", entry["error"])
            continue
        stem = os.path.basename(entry["path"]).split(".so")[0] + ".so"
        copies = {os.path.realpath(line.split()[-1]) for line in maps.splitlines() if f"/{stem}" in line}
        one = copies == {os.path.realpath(entry["path"])}
        row(f"cuda_libraries()[{key!r}]", "PASS" if one else "FAIL",
            f"{entry['version']} at {entry['path']}" + ("" if one else f"; copies mapped: {sorted(copies)}"))


def check_ops_and_kernels() -> None:
    """Every op kind on one GPU (a group of one) against the CPU reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import commfuse
    from commfuse import _native

    gpu_mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    cpu_mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("cpu")[:1])
    rng = np.random.default_rng(0)
    ops = {
        "all_gather_matmul": (lambda a, b: commfuse.all_gather_matmul(a, b, "x", precision="highest"),
                              (256, 128), (128, 96)),
        "matmul_reduce_scatter": (lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", precision="highest"),
                                  (256, 128), (128, 96)),
        "matmul_reduce_scatter (columns)": (
            lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x", scatter_dimension=1, precision="highest"),
            (256, 128), (128, 96)),
        "matmul_all_gather (columns)": (lambda a, b: commfuse.matmul_all_gather(a, b, "x", precision="highest"),
                                        (256, 128), (128, 96)),
        "matmul_all_gather (contraction)": (
            lambda a, b: commfuse.matmul_all_gather(a, b, "x", gather_dimension=0, precision="highest"),
            (256, 128), (128, 96)),
        "all_to_all_matmul": (lambda a, b: commfuse.all_to_all_matmul(
            a, b, "x", split_dimension=0, concat_dimension=0, precision="highest"), (256, 128), (128, 96)),
        "matmul_all_to_all": (lambda a, b: commfuse.matmul_all_to_all(
            a, b, "x", split_dimension=0, concat_dimension=0, precision="highest"), (256, 128), (128, 96)),
    }
    tolerances = {np.dtype(np.float32): 1e-4, np.dtype(jnp.bfloat16): 2e-2}
    for name, (fn, xs, ws) in ops.items():
        for dtype in (np.float32, jnp.bfloat16):
            x = rng.uniform(-1, 1, xs).astype(dtype)
            w = rng.uniform(-1, 1, ws).astype(dtype)
            outs = []
            try:
                for mesh in (gpu_mesh, cpu_mesh):
                    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
                    outs.append(np.asarray(f(x, w)).astype(np.float64))
                err = float(np.max(np.abs(outs[0] - outs[1])) / np.max(np.abs(outs[1])))
                ok = err <= tolerances[np.dtype(dtype)]
                row(f"{name} {np.dtype(dtype).name}, 1 GPU vs CPU", "PASS" if ok else "FAIL",
                    f"max error {err:.1e} of max |ref|")
            except Exception as e:  # noqa: BLE001 - every failure is a row
                row(f"{name} {np.dtype(dtype).name}, 1 GPU vs CPU", "FAIL", tail(f"{type(e).__name__}: {e}"))
    if all(float(d.compute_capability) >= 9.0 for d in jax.devices("gpu")):
        try:
            x = rng.uniform(-1, 1, (256, 128)).astype(np.float32)
            w = rng.uniform(-1, 1, (128, 96)).astype(np.float32)
            sx, sw = np.float32(np.abs(x).max() / 448), np.float32(np.abs(w).max() / 448)
            xq, wq = (x / sx).astype(jnp.float8_e4m3fn), (w / sw).astype(jnp.float8_e4m3fn)
            f = jax.jit(jax.shard_map(
                lambda a, b: commfuse.all_gather_matmul(a, b, "x", x_scale=sx, w_scale=sw,
                                                        preferred_element_type=jnp.float32),
                mesh=gpu_mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
            got = np.asarray(f(xq, wq)).astype(np.float64)
            want = (xq.astype(np.float64) * sx) @ (wq.astype(np.float64) * sw)
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            row("fp8 e4m3 all_gather_matmul, 1 GPU", "PASS" if err <= 3e-3 else "FAIL",
                f"max error {err:.1e} of max |ref| (Hopper fp8 accumulation)")
        except Exception as e:  # noqa: BLE001
            row("fp8 e4m3 all_gather_matmul, 1 GPU", "FAIL", tail(f"{type(e).__name__}: {e}"))
    else:
        row("fp8", "N/A", "needs sm_90")
    during = _native.cuda_loads_during_execute()
    row("kernels loaded before execution (INITIALIZE stage)", "PASS" if during == 0 else "FAIL",
        f"{during} device(s) loaded inside an EXECUTE call")


def check_overhead() -> None:
    """The fused op's fixed per-call cost: a group of one against XLA's dot."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import commfuse

    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    for m, k, n in [(128, 256, 256), (1024, 1024, 1024), (8192, 8192, 8192)]:
        x = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, (m, k)), jnp.bfloat16)
        w = jnp.asarray(np.random.default_rng(2).uniform(-1, 1, (k, n)), jnp.bfloat16)
        reps = 50

        def loop(op):
            def body(a, b):
                def step(i, acc):
                    return acc + op(a, b)[0, 0].astype(jnp.float32)
                return jax.lax.fori_loop(0, reps, step, jnp.float32(0))
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))

        fused = loop(lambda a, b: commfuse.all_gather_matmul(a, b, "x"))
        xla = loop(lambda a, b: jnp.matmul(a, b))
        times = {}
        for name, f in (("fused", fused), ("xla", xla)):
            f(x, w).block_until_ready()
            samples = []
            for _ in range(5):
                t = time.perf_counter()
                f(x, w).block_until_ready()
                samples.append((time.perf_counter() - t) / reps)
            times[name] = sorted(samples)[2]
        extra = (times["fused"] - times["xla"]) * 1e6
        row(f"per-call cost, bf16 {m}x{k} @ {k}x{n}", "PASS",
            f"fused {times['fused'] * 1e6:.1f} us, XLA dot {times['xla'] * 1e6:.1f} us, difference {extra:+.1f} us "
            f"({times['fused'] / times['xla']:.2f}x)")


def check_pytest(repo: str) -> None:
    """Every GPU test of the suite (`-m gpu` over jax_tests/), failing where
    JAX sees no GPU; the skips left are those one GPU cannot run (two GPUs,
    or an NCCL of 2.30+ for two ranks on one: `check_multi_rank_nccl` runs
    those), each listed with its reason."""
    env = dict(os.environ, COMMFUSE_REQUIRE_GPU="1", COMMFUSE_ALLOW_SKIPS="1")
    code, out = run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu",
                     os.path.join(repo, "jax_tests")], 540, env, "gpu_tests.log")
    summary = [line for line in out.splitlines() if " passed" in line or " failed" in line or "error" in line]
    skips = sorted({line.split(": ", 1)[-1] for line in out.splitlines() if line.startswith("SKIPPED")})
    row("every GPU test in jax_tests/ (-m gpu, COMMFUSE_REQUIRE_GPU=1)", "PASS" if code == 0 else "FAIL",
        (summary[-1] if summary else tail(out)) + ("; skipped: " + "; ".join(skips) if skips else "")
        + ("" if code == 0 else " | " + tail(
            "\n".join(line for line in out.splitlines() if line.startswith(("FAILED", "ERROR", "E "))), 800)))


def check_rust(tests: str | None) -> None:
    if not tests:
        row("Rust device tests", "N/A", "no test binary given (--rust-tests)")
        return
    code, out = run([tests, "--include-ignored", "--test-threads", "1", "backend::cuda::enqueue::tests::one_gpu"],
                    300, log="rust_device.log")
    row("Rust device test: every op kind on GPU 0 vs the CPU backend, bit for bit",
        "PASS" if code == 0 else "FAIL", tail(out))
    code, out = run([tests, "--include-ignored", "--test-threads", "1",
                     "backend::cuda::enqueue::tests::several_ranks_on_one_gpu",
                     "backend::cuda::enqueue::tests::a_rank_that_never_arrives",
                     "backend::cuda::reshard::tests::ranks_on_one_gpu"], 300, log="rust_copies_one_gpu.log")
    row("Rust device tests: 2, 4 and 8 ranks on GPU 0 over the copy transport, every op kind and schedule vs the "
        "CPU backend bit for bit; a rank that never arrives ends in DEADLINE_EXCEEDED naming it; reshard layouts "
        "between 8 ranks on GPU 0 as the planner says",
        "PASS" if code == 0 else "FAIL", tail(out))
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout.count("GPU ")
    except (OSError, subprocess.SubprocessError):
        gpus = 0
    label = "Rust device tests on all local GPUs: every op kind, and reshard layouts between two halves"
    if gpus < 2:
        row(label, "N/A", f"needs 2 or more GPUs, found {gpus}")
        return
    code, out = run([tests, "--include-ignored", "--test-threads", "1", "backend::cuda::enqueue::tests::all_local",
                     "backend::cuda::reshard::tests::gpus_move"], 600, log="rust_multi_gpu.log")
    row(label, "PASS" if code == 0 else "FAIL", tail(out))


def multi_rank_nccl() -> str | None:
    """The NCCL of 2.30 or later that COMMFUSE_MULTI_RANK_NCCL names, once it
    exists: it may still be being built beside the first checks, so this
    waits for it, bounded by COMMFUSE_MULTI_RANK_NCCL_WAIT_S (default 0)."""
    nccl = os.environ.get("COMMFUSE_MULTI_RANK_NCCL")
    waited = time.monotonic() + float(os.environ.get("COMMFUSE_MULTI_RANK_NCCL_WAIT_S", "0"))
    while nccl and not os.path.exists(nccl) and time.monotonic() < waited:
        time.sleep(2)
    return nccl if nccl and os.path.exists(nccl) else None


def check_multi_rank_nccl(tests: str | None, repo: str) -> None:
    """Two ranks on GPU 0 over NCCL, in one process (the Rust device test) and
    in two jax.distributed processes: needs an NCCL of 2.30 or later, named
    by COMMFUSE_MULTI_RANK_NCCL (pip's 2.28 refuses several ranks on one GPU).
    (`multi_rank_nccl`)."""
    nccl = multi_rank_nccl()
    rust = "Rust device test: 2 ranks on GPU 0 over NCCL, every op kind and schedule vs the CPU backend bit for bit"
    jax_label = ("two ranks on one GPU (two jax.distributed processes, NCCL_MULTI_RANK_GPU_ENABLE=1): ring and "
                 "sequential against plain, and a peer that never arrives ends in DEADLINE_EXCEEDED")
    if not nccl:
        why = "COMMFUSE_MULTI_RANK_NCCL names no NCCL 2.30+ (pip's NCCL refuses several ranks on one GPU)"
        row(rust, "N/A", why)
        row(jax_label, "N/A", why)
        return
    if tests:
        env = dict(os.environ, COMMFUSE_CUDA_LIBRARY_PATH=nccl, NCCL_MULTI_RANK_GPU_ENABLE="1")
        code, out = run([tests, "--include-ignored", "--test-threads", "1",
                         "backend::cuda::enqueue::tests::two_ranks_on_one_gpu"], 240, env, "rust_nccl_one_gpu.log")
        row(rust, "PASS" if code == 0 else "FAIL", f"NCCL at {nccl}: " + tail(out))
    else:
        row(rust, "N/A", "no test binary given (--rust-tests)")
    # Preloaded too, so that XLA's own collectives in those processes use the same NCCL.
    env = dict(os.environ, COMMFUSE_TEST_SHARED_GPU="1", COMMFUSE_TIMEOUT_S="60", COMMFUSE_CUDA_LIBRARY_PATH=nccl,
               LD_PRELOAD=nccl)
    code, out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-m", "gpu",
                     os.path.join(repo, "jax_tests", "test_gpu.py"), "-k", "two_processes or missing_peer"], 400, env,
                    "two_ranks_one_gpu.log")
    row(jax_label, "PASS" if code == 0 else "FAIL", tail(out, 600))


def check_one_rank(tests: str | None, repo: str) -> None:
    """The one-rank mode (src/backend/cuda/solo.rs): rank 0 and N-1 of N alone
    on GPU 0 bit for bit (the Rust device test), then the benchmark's quick
    table (python -m commfuse.bench_gpu --quick), one row per case."""
    label = "Rust device test: one rank of N = 2, 4, 8 alone on GPU 0, peers' messages paced, every op kind and " \
            "schedule vs the CPU backend bit for bit"
    if tests:
        code, out = run([tests, "--include-ignored", "--test-threads", "1",
                         "backend::cuda::solo_device::tests::one_rank_of_n"], 300, log="rust_one_rank.log")
        row(label, "PASS" if code == 0 else "FAIL", tail(out))
    else:
        row(label, "N/A", "no test binary given (--rust-tests)")
    out_dir = os.path.join(LOGS, "bench_gpu")
    traces = os.path.join(out_dir, "traces")
    code, out = run([sys.executable, "-m", "commfuse.bench_gpu", "--quick", "--out", out_dir, "--trace", traces], 400,
                    log="bench_gpu.log")
    if code != 0 or not os.path.exists(os.path.join(out_dir, "bench_gpu.csv")):
        row("one-rank benchmark (python -m commfuse.bench_gpu --quick)", "FAIL", tail(out))
        return
    import csv

    with open(os.path.join(out_dir, "bench_gpu.csv")) as f:
        cases = sum(1 for _ in csv.DictReader(f))
    check_traces(traces, cases)
    with open(os.path.join(out_dir, "bench_gpu.csv")) as f:
        for r in csv.DictReader(f):
            if r["source"] != "measured":
                row("one-rank benchmark", "FAIL", "no GPU: the benchmark fell back to the cost model")
                return
            row(f"one rank: {r['model']} {r['projection']} {r['op']} {int(r['tokens']) // 1024}k tokens N={r['n']} "
                f"{r['schedule']}", "PASS",
                f"fused {float(r['fused_ms']):.3f} ms, GEMM {float(r['gemm_ms']):.3f}, transfers "
                f"{float(r['transfers_ms']):.3f}, pieces {float(r['pieces_ms']):.3f}; fused/max "
                f"{float(r['fused_over_max']):.3f}, fused/sum {float(r['fused_over_sum']):.3f}, pieces' efficiency "
                f"{float(r['pieces_efficiency']):.3f}; link {float(r['link_gbps']):.0f} of {float(r['pace_gbps']):.0f} GB/s")


def check_traces(traces: str, cases: int) -> None:
    """The benchmark's device timelines: one per case (`cases`), each with
    the GEMM pieces on the compute lane and the paced copies on the comm
    lane, every slice inside its call's."""
    import json

    label = "one-rank device timelines (bench_gpu --trace): pieces on the compute lane, copies on the comm lane"
    names = sorted(os.listdir(traces)) if os.path.isdir(traces) else []
    faults = []
    for name in names:
        slices = [e for e in json.load(open(os.path.join(traces, name)))["traceEvents"] if e.get("ph") == "X"]
        calls = {(e["pid"], e["tid"]): e for e in slices if e["cat"] == "call"}

        def outside(e):
            call = calls.get((e["pid"], e["tid"]))
            return call is None or e["ts"] < call["ts"] - 1 or e["ts"] + e["dur"] > call["ts"] + call["dur"] + 1

        if not any(e["name"] == "matmul" and e["tid"] == 0 for e in slices) or \
                not any(e["name"] == "exchange" and e["tid"] == 1 for e in slices):
            faults.append(f"{name}: a lane without its steps")
        elif any(outside(e) for e in slices):
            faults.append(f"{name}: a slice outside its call")
    if len(names) != cases:
        faults.append(f"{len(names)} traces for {cases} cases")
    row(label, "FAIL" if faults else "PASS", "; ".join(faults[:3]) or f"{len(names)} traces in {traces}")


def figures(out: str):
    """The figures a measuring script printed: its JSON lines with a "kind"."""
    import json

    for line in out.splitlines():
        try:
            f = json.loads(line)
        except ValueError:
            continue
        if isinstance(f, dict) and "kind" in f:
            yield f


def check_gemm_facts(repo: str) -> None:
    """scripts/gpu_contention.py: a GEMM beside copy-engine copies, and a ring's
    per-peer GEMM pieces against one GEMM (figures, not pass/fail)."""
    code, out = run([sys.executable, os.path.join(repo, "scripts", "gpu_contention.py")], 300, log="gemm_facts.log")
    for f in figures(out):
        shape = f"{f.get('m')}x{f.get('k')}x{f.get('n')}"
        if f["kind"] == "gemm":
            row(f"GEMM bf16 {shape}", "PASS", f"{f['ms']:.3f} ms, {f['tflops']:.0f} TFLOP/s")
        elif f["kind"] == "beside_copies":
            target = "unpaced" if f["target_gbps"] is None else f"paced to {f['target_gbps']:.0f} GB/s"
            row(f"GEMM bf16 {shape} beside copy-engine copies {target}", "PASS",
                f"GEMM keeps {f['gemm_kept']:.3f} of its throughput; copies moved {f['achieved_gbps']:.0f} GB/s")
        elif f["kind"] == "pieces":
            row(f"{f['parts']} per-peer pieces of {shape}, {f['how']}", "PASS",
                f"{f['efficiency']:.3f} of one GEMM")
        elif f["kind"] == "rows_curve":
            row(f"GEMM bf16 {shape} alone", "PASS", f"{f['us']:.1f} us, {f['tflops']:.0f} TFLOP/s")
        elif f["kind"] == "beside_nccl":
            row(f"GEMM bf16 {shape} beside NCCL {f['nccl']} send/receive, 2 ranks on this GPU", "PASS",
                f"GEMM keeps {f['gemm_kept']:.3f} of its throughput; NCCL moved {f['achieved_gbps']:.1f} GB/s each way")
        elif f["kind"] == "error":
            row("GEMM facts", "N/A" if "not measured" in f["error"] else "FAIL", f["error"])
        elif f["kind"] == "device":
            row("GEMM facts: device", "PASS", f"{f['name']}, {f['sms']} SMs, torch {f['torch']}")
    if code != 0:
        row("scripts/gpu_contention.py", "FAIL", tail(out))
    check_gemm_algorithms(repo)


def check_gemm_algorithms(repo: str) -> None:
    """scripts/gemm_algos.py: per-peer pieces with each of cuBLASLt's
    algorithms against the fastest whole GEMM (figures, not pass/fail): the
    default's efficiency, the best one's and what it is."""
    code, out = run([sys.executable, os.path.join(repo, "scripts", "gemm_algos.py")], 300, log="gemm_algos.log")
    best = {}
    for f in figures(out):
        if f["kind"] == "algos_whole":
            # bf16 results of k-long sums: a wrong layout is off by the size of the values themselves.
            right = f["check_max_abs_error"] <= 2e-2 * f["reference_max_abs"]
            row(f"cuBLASLt, whole GEMM bf16 {f['m']}x{f['k']}x{f['n']}", "PASS" if right else "FAIL",
                f"fastest of {f['algorithms']} algorithms {f['ms']:.3f} ms (heuristic's first {f['default_ms']:.3f}); "
                f"max |error| vs torch {f['check_max_abs_error']:.3g} of values up to {f['reference_max_abs']:.3g}")
        elif f["kind"] == "algos_pieces":
            key = (f["m"], f["k"], f["n"], f["parts"])
            if f["index"] == 0:
                best[key] = {"default": f, "best": f}
            elif key in best and f["efficiency"] > best[key]["best"]["efficiency"]:
                best[key]["best"] = f
        elif f["kind"] == "error":
            row("cuBLASLt algorithms", "N/A" if "not measured" in f["error"] else "FAIL", f["error"])
    describe = lambda f: (f"{f['efficiency']:.3f} (tile {f['tile']}, split-K {f['splitk']}, stages {f['stages']}, "
                          f"cluster {f['cluster']}, {f['waves']:.2f} waves)")
    for (m, k, n, parts), b in best.items():
        row(f"cuBLASLt, {parts} per-peer pieces of {m}x{k}x{n}", "PASS",
            f"heuristic's first {describe(b['default'])}; best {describe(b['best'])}")
    if code != 0:
        row("scripts/gemm_algos.py", "FAIL", tail(out))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_check_table.md")
    parser.add_argument("--rust-tests", default=None)
    parser.add_argument("--logs", default=".", help="directory for the full logs of the subprocess checks")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks (names as in CHECKS)")
    args = parser.parse_args()
    global LOGS
    LOGS = args.logs
    os.makedirs(LOGS, exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The Rust device tests first, while this process's JAX client (check_host's) is idle.
    checks = {
        "host": check_host,
        "rust": lambda: check_rust(args.rust_tests),
        "one_rank": lambda: check_one_rank(args.rust_tests, repo),
        "multi_rank_nccl": lambda: check_multi_rank_nccl(args.rust_tests, repo),
        "gemm_facts": lambda: check_gemm_facts(repo),
        "libraries": check_libraries,
        "ops": check_ops_and_kernels,
        "overhead": check_overhead,
        "pytest": lambda: check_pytest(repo),
    }
    unknown = set(args.only or ()) - set(checks)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; there are {list(checks)}")
    for name, check in checks.items():
        if args.only is not None and name not in args.only:
            continue
        try:
            check()
        except Exception as e:  # noqa: BLE001 - a broken check is a FAIL row, the others still run
            row(name, "FAIL", tail(f"{type(e).__name__}: {e}"))
    lines = ["| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c} | {s} | {d.replace('|', '/')} |" for c, s, d in ROWS]
    table = "\n".join(lines)
    print("\n" + table)
    with open(args.out, "w") as f:
        f.write(table + "\n")
    return 1 if any(s == "FAIL" for _, s, _ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
