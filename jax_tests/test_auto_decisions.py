"""``schedule="auto"`` under ``overlap``: where it fuses nothing the compiled
program is the plain one; its decisions come from figures cached per machine
(the same in every process); both orders of ``grad`` and ``overlap`` make
the same products; the report covers every product that ran, backward
included; an explicit schedule the shardings make impossible runs unfused
instead of failing inside partitioning."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import commfuse
from commfuse import _calibration
from conftest import REPO_ROOT, assert_close
from programs import all_jit_programs, all_programs, collectives, make_mesh, value_and_grads

PROGRAMS = all_jit_programs()
def _build(program, seed=0):
    mesh = make_mesh(program.mesh, axis_type=program.axis_type)
    with jax.set_mesh(mesh):
        fn, args = program.build(mesh, np.random.default_rng(seed))
    return mesh, fn, args


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_auto_that_fuses_nothing_compiles_the_plain_programs_collectives(program, declining):
    mesh, fn, args = _build(program)
    with jax.set_mesh(mesh):
        for what, f in (("forward", fn), ("gradient", value_and_grads(program, fn, args))):
            plain = collectives(jax.jit(f).lower(*args).compile().as_text())
            rewritten = collectives(jax.jit(commfuse.overlap(f)).lower(*args).compile().as_text())
            assert rewritten == plain, f"{program.name} {what}: overlap(f) {rewritten} vs plain {plain}"
        outer = value_and_grads(program, commfuse.overlap(fn), args)
        got = collectives(jax.jit(outer).lower(*args).compile().as_text())
        assert got == plain, f"{program.name}: grad(overlap(f)) {got} vs plain {plain}"
        reported = commfuse.overlap(fn)
        jax.jit(reported)(*args)
    assert any("kept dot_general" in line and "auto: " in line for line in reported.last_report), \
        "\n".join(reported.last_report)


@pytest.mark.parametrize("program", all_programs(), ids=lambda p: p.name)
def test_auto_that_fuses_nothing_in_shard_map_bodies_leaves_them_as_written(program, declining):
    """Grouped matmuls, tiles and every other rewrite included: a body in
    which auto declines every fused call compiles to the plain program's
    collectives (a per-batch or per-tile unfused form would have more)."""
    mesh = make_mesh(program.mesh)
    fn, args = program.build(mesh, np.random.default_rng(0))

    def loss(*a):
        out = fn(*a)
        return out[0] if isinstance(out, tuple) else out

    gradient = jax.value_and_grad(loss, argnums=tuple(range(len(args))))
    for what, f in (("forward", fn), ("gradient", gradient)):
        plain = collectives(jax.jit(f).lower(*args).compile().as_text())
        rewritten = collectives(jax.jit(commfuse.overlap(f)).lower(*args).compile().as_text())
        assert rewritten == plain, f"{program.name} {what}: overlap(f) {rewritten} vs plain {plain}"


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_both_orders_of_grad_and_overlap_make_the_same_fused_products(program):
    mesh, fn, args = _build(program)
    with jax.set_mesh(mesh):
        grad_of_overlap = value_and_grads(program, commfuse.overlap(fn, schedule="ring"), args)
        overlap_of_grad = commfuse.overlap(value_and_grads(program, fn, args), schedule="ring")
        outer = collectives(jax.jit(grad_of_overlap).lower(*args).compile().as_text())
        inner = collectives(jax.jit(overlap_of_grad).lower(*args).compile().as_text())
    if program.orders_differ:  # said in the program: the fused products alone are the same
        outer, inner = outer.get("commfuse", 0), inner.get("commfuse", 0)
    assert outer == inner, f"{program.name}: grad(overlap(f)) {outer} vs overlap(grad(f)) {inner}"
    assert (outer if program.orders_differ else outer.get("commfuse", 0)) == program.grad_fused


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_the_report_names_every_fused_call_of_the_compiled_gradient(program):
    mesh, fn, args = _build(program)
    fused = commfuse.overlap(fn, schedule="ring")
    with jax.set_mesh(mesh):
        step = jax.jit(value_and_grads(program, fused, args))
        text = step.lower(*args).compile().as_text()
    in_program = collectives(text).get("commfuse", 0)
    assert sum(entry.fused for entry in fused.last_partitioned) == in_program, "\n".join(fused.last_report)
    backward = [line for line in fused.last_report if line.startswith("overlap[backward]")]
    assert backward or in_program == 0, "\n".join(fused.last_report)


_DECISIONS = """
import json, os, sys
sys.path.insert(0, {tests!r})
import jax, numpy as np
import commfuse
from programs import all_jit_programs, make_mesh
lines = []
for program in all_jit_programs():
    mesh = make_mesh(program.mesh, axis_type=program.axis_type)
    with jax.set_mesh(mesh):
        fn, args = program.build(mesh, np.random.default_rng(0))
        fused = commfuse.overlap(fn)
        jax.jit(fused).lower(*args).compile()
    lines += [re.sub(r"#\\d+", "#", line) for line in fused.last_report]
print(json.dumps(lines))
""".replace("import json, os, sys", "import json, os, re, sys")


def test_decisions_are_the_same_in_every_process_from_figures_cached_per_machine(tmp_path):
    env = dict(os.environ, COMMFUSE_AUTO_UNFUSED="1", COMMFUSE_CACHE_DIR=str(tmp_path),
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    script = _DECISIONS.format(tests=str(REPO_ROOT / "jax_tests"))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1]
    assert any("auto: " in line or "partitioned" in line for line in runs[0])
    cached = list(tmp_path.glob("calibration-*.json"))
    assert len(cached) == 1
    figures = json.loads(cached[0].read_text())["figures"]
    assert figures["cpu_gemm_gflops"] > 0 and any(k.startswith("cpu_call_overhead_s/") for k in figures)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_an_explicit_schedule_the_shardings_make_impossible_runs_unfused_and_says_so(rows):
    """A decode step: 1-4 tokens over 8 devices cannot be cut into a ring's blocks."""
    mesh = make_mesh({"tp": 8})
    d, f = 32, 128
    rng = np.random.default_rng(rows)
    w1 = jax.device_put(rng.normal(size=(d, f)).astype(np.float32) / 6, NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put(rng.normal(size=(f, d)).astype(np.float32) / 11, NamedSharding(mesh, P("tp", None)))
    h = jax.device_put(rng.normal(size=(rows, d)).astype(np.float32), NamedSharding(mesh, P()))

    def explicit(h, w1, w2):
        return commfuse.matmul(jax.nn.gelu(commfuse.matmul(h, w1, schedule="ring")), w2, schedule="ring")

    def plain(h, w1, w2):
        return jax.nn.gelu(h @ w1) @ w2

    want = jax.jit(plain)(h, w1, w2)
    assert_close(np.asarray(jax.jit(explicit)(h, w1, w2)), np.asarray(want), np.float32)
    fused = commfuse.overlap(plain, schedule="ring")
    assert_close(np.asarray(jax.jit(fused)(h, w1, w2)), np.asarray(want), np.float32)
    said = [line for line in fused.last_report if "cannot run on these shards" in line]
    assert said and f"x has {rows} rows" in said[0], "\n".join(fused.last_report)


def test_a_kept_dot_says_why_and_a_fused_one_is_counted(monkeypatch):
    """The report line of a dot auto keeps names the model's figures; with
    COMMFUSE_AUTO_UNFUSED=0 the same dot fuses."""
    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "0")
    mesh = make_mesh({"tp": 4})
    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("tp", None)))
    w = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P(None, "tp")))
    fused = commfuse.overlap(lambda x, w: x @ w)
    jax.jit(fused)(x, w)
    assert sum(entry.fused for entry in fused.last_partitioned) == 1, "\n".join(fused.last_report)


@pytest.mark.parametrize("shapes", [(8, 8, 131072), (64, 512, 512), (512, 64, 64)])
def test_auto_makes_the_same_products_in_both_orders_of_grad_and_overlap(shapes, monkeypatch, tmp_path):
    """A dot auto declines keeps a backward whose products are judged one by
    one, as overlap(grad(f)) judges them (the first shape: the forward is
    declined, a weight gradient fused)."""
    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "1")
    monkeypatch.setenv(_calibration.CACHE_VAR, str(tmp_path))
    _calibration.forget()
    figures = {"cpu_gemm_gflops": 50.0, **{f"cpu_call_overhead_s/{n}": 20e-6 for n in range(2, 17)}}
    _calibration.path().write_text(json.dumps({"figures": figures}))
    m, k, n = shapes
    mesh = make_mesh({"i": 8})
    x = jax.device_put(jnp.ones((m, k)), NamedSharding(mesh, P("i", None)))
    w = jax.device_put(jnp.ones((k, n)), NamedSharding(mesh, P(None, "i")))

    def f(x, w):
        return jnp.sum(jnp.tanh(x @ w))

    with jax.set_mesh(mesh):
        outer = jax.jit(jax.grad(commfuse.overlap(f), argnums=(0, 1))).lower(x, w).compile().as_text()
        inner = jax.jit(commfuse.overlap(jax.grad(f, argnums=(0, 1)))).lower(x, w).compile().as_text()
    assert collectives(outer) == collectives(inner)
    _calibration.forget()


@pytest.mark.parametrize("tp", [1, 2])
def test_auto_keeps_pairs_over_an_axis_of_one_device_as_written(tp, monkeypatch, tmp_path):
    """A data x tp mesh with tp = 1 (a model run without tensor parallelism):
    XLA drops the collectives over tp, and a fused call would only add its
    fixed cost, so auto keeps the pairs as written even where the fixed cost
    is taken to be nothing (with tp = 2 it then fuses them)."""
    monkeypatch.setenv("COMMFUSE_AUTO_UNFUSED", "1")
    monkeypatch.setenv(_calibration.CACHE_VAR, str(tmp_path))
    _calibration.forget()
    figures = {f"cpu_call_overhead_s/{n}": 0.0 for n in range(1, 17)}
    figures["cpu_gemm_gflops"] = 50.0
    _calibration.path().write_text(json.dumps({"figures": figures}))
    try:
        mesh = make_mesh({"data": 2, "tp": tp})
        rng = np.random.default_rng(3)
        x = jax.device_put(rng.standard_normal((4, 8 * tp, 64)).astype(np.float32),
                           NamedSharding(mesh, P("data", "tp")))
        w1 = jax.device_put(rng.standard_normal((64, 256)).astype(np.float32), NamedSharding(mesh, P(None, "tp")))
        w2 = jax.device_put(rng.standard_normal((256, 64)).astype(np.float32), NamedSharding(mesh, P("tp", None)))

        def body(x, w1, w2):
            h = jax.lax.all_gather(x, "tp", axis=1, tiled=True) @ w1
            return jax.lax.psum_scatter(jnp.tanh(h) @ w2, "tp", scatter_dimension=1, tiled=True)

        spec = P("data", "tp")
        fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, P(None, "tp"), P("tp", None)), out_specs=spec)
        rewritten = commfuse.overlap(fn)
        assert_close(np.asarray(jax.jit(rewritten)(x, w1, w2)), np.asarray(jax.jit(fn)(x, w1, w2)), np.float32)
        fused = collectives(jax.jit(rewritten).lower(x, w1, w2).compile().as_text()).get("commfuse", 0)
        report = "\n".join(rewritten.last_report)
        if tp == 1:
            assert fused == 0 and report.count("a group of one device has no communication to hide") == 2, report
        else:
            assert fused == 2, report
    finally:
        _calibration.forget()
