#!/usr/bin/env python
"""Fuzzes ``commfuse.overlap`` with random programs (``jax_tests/generative.py``).

    python scripts/generative_overlap.py --count 500 --seed 0
    python scripts/generative_overlap.py --replay 1234        # one program, with its reports

Program ``i`` of a run has seed ``--seed + i``; each is checked plain
against ``overlap(f)`` (schedules "ring" and "auto"), ``overlap(grad(loss))``
and ``grad(overlap(loss))``: no exception from commfuse, the same numbers,
every deliberately built collective + dot pair fused, no internal error
swallowed into the report. Each failure is printed with its seed; the first
of each class (its signature) is shrunk (ops removed while it still fails
the same way) and described. The exit code is 1 if anything failed.

The programs run in a worker process: one that dies (XLA aborts the process
on some internal errors) is reported as a crash of the program it was
running, and a new worker goes on with the next seed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setup_env():
    """Before jax is imported: the host devices the meshes need, "auto" fusing every candidate."""
    count_flag = "--xla_force_host_platform_device_count"
    flags = re.sub(count_flag + r"=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{count_flag}=8"])
    os.environ["COMMFUSE_AUTO_UNFUSED"] = "0"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's partitioner warnings
    sys.path.insert(0, str(ROOT / "jax_tests"))
    try:
        import commfuse  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "python"))


_setup_env()


def _variants(text):
    import generative as G
    variants = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in variants if v not in G.VARIANTS + G.MORE_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; expected some of {G.VARIANTS + G.MORE_VARIANTS}")
    return variants


# ----------------------------------------------------------------------------
# The worker: runs seeds, one JSON line per event on stdout
# ----------------------------------------------------------------------------
def _worker(first: int, last: int, variants) -> int:
    import generative as G

    def emit(**kw):
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    for seed in range(first, last):
        emit(start=seed)
        t0 = time.time()
        try:
            prog, failures, invalid = G.run_seed(seed, variants=variants)
        except Exception as e:  # noqa: BLE001 - a generator bug: say so, keep going
            emit(seed=seed, error=G._exc_line(e), time=time.time() - t0)
            continue
        emit(seed=seed, time=time.time() - t0, invalid=invalid, mode=prog.mode, ops=len(prog.specs),
             expect=prog.expect, desc=prog.describe(),
             failures=[dict(variant=f.variant, kind=f.kind, detail=f.detail, signature=f.signature)
                       for f in failures])
    emit(done=True)
    return 0


def _shrink_worker(seed: int, variant: str, signature: str, budget: int) -> int:
    import generative as G

    prog = G.build(G.generate(seed))
    failures, _ = G.check(prog, variants=(variant,))
    match = [f for f in failures if f.signature == signature]
    if not match:
        print("(the failure did not reproduce on its own)")
        return 0
    small = G.shrink(G.build(G.generate(seed)), match[0], budget=budget)
    again = [f for f in G.check(small, variants=(variant,))[0] if f.signature == signature]
    print(small.describe())
    print(f"specs: {small.specs}")
    if again:
        print(f"fails with: {again[0]}")
    return 0


# ----------------------------------------------------------------------------
# The supervisor
# ----------------------------------------------------------------------------
def _crash_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:  # XLA's fatal check / a Python fatal error
        if re.match(r"^F\d{4} ", ln) or "Fatal Python error" in ln or "Segmentation fault" in ln:
            return re.sub(r"^F\d{4} [\d:.]+\s+\d+ ", "", ln)[:300]
    return (lines[-1] if lines else "no output")[:300]


def _run_workers(args, variants, on_result):
    """Runs seeds [seed, seed+count) in workers; calls on_result(dict) per program."""
    me = str(pathlib.Path(__file__).resolve())
    start, end = args.seed, args.seed + args.count
    t_start = time.time()
    while start < end:
        if args.time_limit is not None and time.time() - t_start > args.time_limit:
            print(f"time limit reached at seed {start}", flush=True)
            return start
        remaining = None if args.time_limit is None else max(1.0, args.time_limit - (time.time() - t_start))
        cmd = [sys.executable, me, "--worker", "--seed", str(start), "--count", str(end - start),
               "--variants", ",".join(variants)]
        errf = tempfile.TemporaryFile("w+")  # the worker's stderr: the last words of one that dies
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True)
        current, finished = None, False
        try:
            for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "start" in msg:
                    current = msg["start"]
                elif msg.get("done"):
                    finished = True
                else:
                    on_result(msg)
                    current = None
                    start = msg["seed"] + 1
                    if args.time_limit is not None and time.time() - t_start > args.time_limit:
                        proc.kill()
                        break
            proc.wait(timeout=remaining)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if finished or (args.time_limit is not None and time.time() - t_start > args.time_limit):
            errf.close()
            if not finished:
                print(f"time limit reached at seed {start}", flush=True)
            return start
        errf.seek(0)
        stderr = errf.read()
        errf.close()
        if current is None:  # died outside a program: give up
            print(f"worker exited ({proc.returncode}) outside any program:\n{stderr[-2000:]}", flush=True)
            return start
        on_result({"seed": current, "crash": _crash_line(stderr), "returncode": proc.returncode})
        start = current + 1
    return start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=100, help="programs to run (default 100)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first program (default 0)")
    ap.add_argument("--replay", type=int, default=None, help="run one program (this seed) and print its reports")
    ap.add_argument("--no-shrink", action="store_true", help="do not shrink the first failure of each class")
    ap.add_argument("--shrink-budget", type=int, default=30, help="checks spent shrinking one failure")
    ap.add_argument("--variants", default="overlap ring,overlap auto,overlap(grad) ring,grad(overlap) ring",
                    help="comma-separated, of: overlap ring, overlap auto, overlap(grad) ring, grad(overlap) ring, "
                         "overlap bidirectional, overlap sequential, overlap(grad) auto, grad(overlap) auto "
                         "(default: the first 4)")
    ap.add_argument("--time-limit", type=float, default=None, help="stop starting programs after this many s")
    ap.add_argument("--quiet", action="store_true", help="no line per passing program")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shrink-one", nargs=3, metavar=("SEED", "VARIANT", "SIGNATURE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    variants = _variants(args.variants)
    if args.worker:
        return _worker(args.seed, args.seed + args.count, variants)
    if args.shrink_one:
        seed, variant, signature = args.shrink_one
        return _shrink_worker(int(seed), variant, signature, args.shrink_budget)
    if args.replay is not None:
        return _replay(args.replay, variants)

    import jax
    print(f"jax {jax.__version__}, python {sys.version.split()[0]}; seeds {args.seed}..{args.seed + args.count - 1}",
          flush=True)
    t0 = time.time()
    classes: dict[str, list] = {}
    stats = {"ran": 0, "invalid": 0, "failed": 0, "time": 0.0}

    def on_result(msg):
        seed = msg["seed"]
        if "crash" in msg:
            stats["ran"] += 1
            stats["failed"] += 1
            f = {"variant": "process", "kind": "crash", "detail": f"the process died ({msg['returncode']}): "
                 f"{msg['crash']}", "signature": "crash | " + re.sub(r"\d+", "N", msg["crash"])[:160]}
            new = f["signature"] not in classes
            classes.setdefault(f["signature"], []).append((seed, f, None))
            print(f"seed {seed}: FAIL [crash] {f['detail']}" + (" (first of its class)" if new else ""), flush=True)
            return
        if "error" in msg:
            stats["invalid"] += 1
            print(f"seed {seed}: GENERATOR ERROR {msg['error']}", flush=True)
            return
        stats["ran"] += 1
        stats["time"] += msg["time"]
        if msg["invalid"]:
            stats["invalid"] += 1
            print(f"seed {seed}: skipped (invalid program: {msg['invalid']})", flush=True)
            return
        if not msg["failures"]:
            if not args.quiet:
                print(f"seed {seed}: ok ({msg['time']:.1f}s, {msg['mode']}, {msg['ops']} ops, "
                      f"{msg['expect']} deliberate dots)", flush=True)
            return
        stats["failed"] += 1
        for f in msg["failures"]:
            new = f["signature"] not in classes
            classes.setdefault(f["signature"], []).append((seed, f, msg["desc"]))
            print(f"seed {seed}: FAIL [{f['kind']}] {f['variant']}: {f['detail']}", flush=True)
            if new:
                print("    " + msg["desc"].replace("\n", "\n    "), flush=True)

    _run_workers(args, variants, on_result)
    elapsed = time.time() - t0
    print(f"\n{stats['ran']} programs in {elapsed:.0f}s ({stats['time']:.0f}s in checks; {stats['invalid']} skipped "
          f"as invalid), {stats['failed']} failed, {len(classes)} failure classes", flush=True)
    me = str(pathlib.Path(__file__).resolve())
    for n, (sig, items) in enumerate(classes.items(), 1):
        seed, f, desc = items[0]
        seeds = sorted({s for s, _, _ in items})
        where = sorted({it[1]["variant"] for it in items})
        print(f"\n=== class {n}: {sig}\n    {len(items)} failures, seeds {seeds[:12]}"
              f"{' ...' if len(seeds) > 12 else ''}; in {', '.join(where)}")
        print(f"    first: seed {seed}: [{f['kind']}] {f['variant']}: {f['detail']}")
        if f["kind"] != "crash" and not args.no_shrink:
            try:
                out = subprocess.run([sys.executable, me, "--shrink-one", str(seed), f["variant"], sig,
                                      "--shrink-budget", str(args.shrink_budget)],
                                     capture_output=True, text=True, timeout=1800)
                text = out.stdout.strip() or f"(shrinking died: {_crash_line(out.stderr)})"
            except subprocess.TimeoutExpired:
                text = "(shrinking timed out)"
            print("    minimal program:\n      " + text.replace("\n", "\n      "), flush=True)
        elif desc:
            print("    program:\n      " + desc.replace("\n", "\n      "))
        else:
            print(f"    program: python {pathlib.Path(me).relative_to(ROOT)} --replay {seed}")
    return 1 if classes else 0


def _replay(seed: int, variants) -> int:
    import commfuse
    import generative as G
    import jax

    prog = G.build(G.generate(seed))
    print(prog.describe())
    print("specs:", prog.specs, flush=True)
    failures, invalid = G.check(prog, variants=variants)
    if invalid:
        print("INVALID (the plain program fails):", invalid)
        return 2
    args = prog.args
    argnums = tuple(range(len(args)))
    for variant in variants:
        schedule = variant.split(" ")[-1]
        print(f"\n--- report of {variant}")
        try:
            if variant.startswith("overlap("):
                ov = commfuse.overlap(jax.grad(prog.loss, argnums=argnums), schedule=schedule)
                ov(*args)
            elif variant.startswith("grad("):
                ov = commfuse.overlap(prog.loss, schedule=schedule)
                jax.jit(jax.grad(ov, argnums=argnums))(*args)
            else:
                ov = commfuse.overlap(prog.fn, schedule=schedule)
                ov(*args)
            print("\n".join(ov.last_report))
        except Exception as e:  # noqa: BLE001
            print("raised", G._exc_line(e))
    print("\n--- failures")
    for f in failures:
        print(" ", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
