"""GEMM facts the cost model needs, measured on one GPU with PyTorch (which
the GPU hosts have; commfuse is not involved): how much of a GEMM survives
beside copy-engine copies, and how a ring's per-peer GEMM pieces compare
with one GEMM, the data the cost model's tile/wave model (`src/sim/gemm_waves.rs`) is
fitted to (GPU.md records the tables).

Run by scripts/gpu_device_check.py; prints JSON lines, one per figure.
Timing: CUDA events around back-to-back launches, after a warm-up, medians of
rounds that alternate what they compare (`interleaved`).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

SHAPES = [  # m x k x n, bf16: Llama-3 70B/405B MLP projections at TP 8 (ffn 28672/8, 53248/8), 2k-16k tokens
    (8192, 8192, 3584),
    (2048, 8192, 3584),
    (16384, 8192, 3584),
    (8192, 16384, 6656),
    (8192, 8192, 8192),
]


def emit(**figure) -> None:
    print(json.dumps(figure), flush=True)


def warm_up(seconds: float = 1.5) -> None:
    """Brings the GPU to its working clocks (an idle GPU starts slow and a
    first measurement would flatter what follows)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def interleaved(fns: dict, reps: int, rounds: int = 7) -> dict:
    """Median seconds per repetition of each of `fns`, measured in rounds
    that take them in turn (order reversed every other round), so that clock
    and temperature drift fall on all alike."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    for round_ in range(rounds):
        order = list(fns.items()) if round_ % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / 1e3 / reps)
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def operands(m: int, k: int, n: int):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return x, w, torch.empty(m, n, device="cuda", dtype=torch.bfloat16)


def pieces(m: int, k: int, n: int) -> None:
    """A ring's per-peer GEMMs (rows cut in `parts`) against one GEMM, three ways."""
    x, w, out = operands(m, k, n)
    reps = max(3, int(2e12 / (2 * m * k * n)))
    side = torch.cuda.Stream()

    def one():
        torch.matmul(x, w, out=out)

    for parts in (2, 4, 8, 16):
        rows = m // parts

        def sequential():
            for p in range(parts):
                torch.matmul(x[p * rows:(p + 1) * rows], w, out=out[p * rows:(p + 1) * rows])

        def two_streams():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            for p in range(parts):
                with torch.cuda.stream(side if p % 2 else main):
                    torch.matmul(x[p * rows:(p + 1) * rows], w, out=out[p * rows:(p + 1) * rows])
            main.wait_stream(side)

        def pairs():  # two arrived pieces multiplied together: parts/2 GEMMs of twice the rows
            for p in range(0, parts, 2):
                torch.matmul(x[p * rows:(p + 2) * rows], w, out=out[p * rows:(p + 2) * rows])

        t = interleaved({"one": one, "sequential": sequential, "two_streams": two_streams, "pairs": pairs}, reps)
        if parts == 2:
            emit(kind="gemm", m=m, k=k, n=n, ms=t["one"] * 1e3, tflops=2 * m * k * n / t["one"] / 1e12)
        for name in ("sequential", "two_streams", "pairs"):
            emit(kind="pieces", m=m, k=k, n=n, parts=parts, how=name, efficiency=t["one"] / t[name])


def rows_curve(k: int, n: int) -> None:
    """One GEMM's time against its rows (k, n fixed): the data the tile/wave
    model is fitted to (`src/sim/gemm_waves.rs`)."""
    for rows in (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192):
        x, w, out = operands(rows, k, n)
        t = interleaved({"gemm": lambda: torch.matmul(x, w, out=out)}, max(5, int(1e12 / (2 * rows * k * n))), 5)
        emit(kind="rows_curve", m=rows, k=k, n=n, us=t["gemm"] * 1e6, tflops=2 * rows * k * n / t["gemm"] / 1e12)


def sleep_rate() -> float:
    """torch.cuda._sleep's cycles per second on this GPU (for pacing copies)."""
    cycles = 10_000_000
    t = interleaved({"sleep": lambda: torch.cuda._sleep(cycles)}, 3, 3)["sleep"]
    return cycles / t


def beside_copies(m: int, k: int, n: int, rates_gbps: list, cycles_per_s: float) -> None:
    """A GEMM's throughput while another stream copies device to device with
    copy engines (cudaMemcpyAsync), paced by sleeps to a link's rate (None:
    unpaced), against the same GEMM loop alone in alternate rounds; and the
    copy rate achieved over the copies' own window. The sleeps are kernels:
    they wait for a free SM while the GEMM holds them, so paced copies run
    less beside the GEMM than their rate says; the unpaced row is the
    measure of contention."""
    x, w, out = operands(m, k, n)
    chunk = 8 << 20
    src = torch.randn(chunk // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    reps = max(10, int(2e13 / (2 * m * k * n)))
    copy_alone = interleaved({"copy": lambda: dst.copy_(src)}, 50, 3)["copy"]
    gemm_alone = interleaved({"gemm": lambda: torch.matmul(x, w, out=out)}, reps, 3)["gemm"]
    copier = torch.cuda.Stream()
    for rate in rates_gbps:
        gap = 0.0 if rate is None else max(0.0, chunk / (rate * 1e9) - copy_alone)
        copies = int(1.3 * gemm_alone * reps / (copy_alone + gap)) + 1
        alone, beside, achieved = [], [], []
        for round_ in range(5):
            for with_copies in ((False, True) if round_ % 2 == 0 else (True, False)):
                torch.cuda.synchronize()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                if with_copies:
                    with torch.cuda.stream(copier):
                        ev[2].record()
                        for _ in range(copies):
                            dst.copy_(src)
                            if gap:
                                torch.cuda._sleep(int(gap * cycles_per_s))
                        ev[3].record()
                ev[0].record()
                for _ in range(reps):
                    torch.matmul(x, w, out=out)
                ev[1].record()
                torch.cuda.synchronize()
                (beside if with_copies else alone).append(ev[0].elapsed_time(ev[1]))
                if with_copies:
                    achieved.append(copies * chunk / (ev[2].elapsed_time(ev[3]) / 1e3) / 1e9)
        emit(kind="beside_copies", m=m, k=k, n=n, target_gbps=rate, achieved_gbps=sorted(achieved)[2],
             gemm_kept=sorted(alone)[2] / sorted(beside)[2])


def nccl_rank(rank: int) -> int:
    """One of two processes on GPU 0 (NCCL 2.30+, NCCL_MULTI_RANK_GPU_ENABLE=1):
    rank 0 runs a GEMM loop alone and beside send/receive with rank 1 on
    another stream, in alternate rounds; rank 1 only exchanges. Point-to-point
    messages only (a send/receive-only NCCL build serves it)."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda:0"))
    peer = 1 - rank
    chunk = 4 << 20
    send_buf = torch.randn(chunk // 2, device="cuda", dtype=torch.bfloat16)
    recv_buf = torch.empty_like(send_buf)
    control = torch.zeros(1, device="cuda", dtype=torch.float32)
    side = torch.cuda.Stream()

    def exchange(times: int) -> None:
        with torch.cuda.stream(side):
            for _ in range(times):
                ops = [dist.P2POp(dist.isend, send_buf, peer), dist.P2POp(dist.irecv, recv_buf, peer)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

    def instruction(value: float) -> None:
        control.fill_(value)
        dist.send(control, 1)

    if rank == 1:
        while True:
            dist.recv(control, 0)
            times = int(control.item())
            if times <= 0:
                break
            exchange(times)
            torch.cuda.synchronize()
        dist.destroy_process_group()
        return 0
    warm_up(1.0)
    m, k, n = 8192, 8192, 3584
    x, w, out = operands(m, k, n)
    reps = 40
    instruction(20)
    exchange(20)
    torch.cuda.synchronize()
    start = time.perf_counter()
    instruction(20)
    exchange(20)
    torch.cuda.synchronize()
    per_exchange = (time.perf_counter() - start) / 20
    gemm_alone = interleaved({"gemm": lambda: torch.matmul(x, w, out=out)}, reps, 3)["gemm"]
    times = int(1.3 * gemm_alone * reps / per_exchange) + 1
    alone, beside, rates = [], [], []
    for round_ in range(5):
        for with_nccl in ((False, True) if round_ % 2 == 0 else (True, False)):
            torch.cuda.synchronize()
            if with_nccl:
                instruction(times)
                t0 = time.perf_counter()
                exchange(times)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                torch.matmul(x, w, out=out)
            e1.record()
            torch.cuda.synchronize()
            (beside if with_nccl else alone).append(e0.elapsed_time(e1))
            if with_nccl:
                rates.append(times * chunk / (time.perf_counter() - t0) / 1e9)
    instruction(0)
    emit(kind="beside_nccl", m=m, k=k, n=n, gemm_kept=sorted(alone)[2] / sorted(beside)[2],
         achieved_gbps=sorted(rates)[2], nccl=".".join(map(str, torch.cuda.nccl.version())))
    dist.destroy_process_group()
    return 0


def beside_nccl(nccl: str) -> None:
    """Runs `nccl_rank` in two processes on GPU 0 with the NCCL at `nccl`."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_MULTI_RANK_GPU_ENABLE="1",
               LD_PRELOAD=nccl)
    # Each rank in a session of its own, writing to a file: one deadline for
    # both, and on it the whole process group is killed (no rank left behind
    # holding the GPU, no pipe left undrained).
    logs = [open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"nccl_rank{r}.log"), "w+") for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, __file__, "--nccl-rank", str(r)], env=env, stdout=log,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r, log in zip((0, 1), logs)]
    deadline = time.monotonic() + 120
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, 9)
                except ProcessLookupError:
                    pass
            break
    outs = []
    for p, log in zip(procs, logs):
        p.wait()
        log.seek(0)
        outs.append(log.read() + ("" if p.returncode == 0 else f"\n(exit {p.returncode})"))
        log.close()
    figures = [line for line in outs[0].splitlines() if line.startswith("{")]
    if figures:
        print(figures[-1], flush=True)
    else:
        emit(kind="error", error="GEMM beside NCCL: " + " | ".join(o.strip()[-400:] for o in outs))


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--nccl-rank":
        return nccl_rank(int(sys.argv[2]))
    if not torch.cuda.is_available():
        emit(kind="error", error="no CUDA device visible to PyTorch")
        return 1
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    emit(kind="device", name=props.name, sms=sms, torch=torch.__version__)
    warm_up()
    cycles_per_s = sleep_rate()
    for m, k, n in SHAPES[:2]:
        beside_copies(m, k, n, [450.0, 200.0, 64.0, None], cycles_per_s)
    rows_curve(8192, 3584)
    for m, k, n in SHAPES:
        pieces(m, k, n)
    nccl = os.environ.get("COMMFUSE_MULTI_RANK_NCCL")
    if nccl and os.path.exists(nccl):
        beside_nccl(nccl)
    else:
        emit(kind="error", error=f"GEMM beside NCCL not measured: no NCCL 2.30+ at COMMFUSE_MULTI_RANK_NCCL={nccl!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
