"""The corpus of real-world program shapes (``jax_tests/programs``): each runs
plain and through ``commfuse.overlap`` with the same numbers and gradients,
and ``overlap`` fuses as many ops as the program says, forward and in the
differentiated program."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import commfuse
from conftest import assert_close
from programs import all_programs, make_mesh

PROGRAMS = all_programs()


def _loss(fn):
    def loss(*args):
        out = fn(*args)
        return out[0] if isinstance(out, tuple) else out
    return loss


def _fused(report) -> int:
    return sum(1 for line in report if "]: rewrote " in line)


def _close(got, want, what):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(np.asarray(g), np.asarray(w), np.float32, rtol=2e-4, err_msg=what)


def test_the_corpus_has_every_program_shape():
    assert {p.name for p in PROGRAMS} >= {"fsdp_mlp", "tp_attention", "fsdp_tp_layer", "linears", "moe",
                                          "train_step"}


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_program_matches_plain_and_fuses(program):
    mesh = make_mesh(program.mesh)
    fn, args = program.build(mesh, np.random.default_rng(7))
    fused = commfuse.overlap(fn)
    _close(fused(*args), jax.jit(fn)(*args), f"{program.name}: outputs")
    assert _fused(fused.last_report) == program.fused, "\n".join(fused.last_report)


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_program_gradients_match_plain_and_fuse(program):
    mesh = make_mesh(program.mesh)
    fn, args = program.build(mesh, np.random.default_rng(11))
    argnums = tuple(range(len(args)))
    want = jax.jit(jax.grad(_loss(fn), argnums=argnums))(*args)
    # Differentiating the rewritten program (the fused ops' own VJPs) ...
    got = jax.jit(jax.grad(_loss(commfuse.overlap(fn)), argnums=argnums))(*args)
    _close(got, want, f"{program.name}: grad(overlap(f))")
    # ... and rewriting the differentiated program (JAX's backward collectives).
    rewritten = commfuse.overlap(jax.grad(_loss(fn), argnums=argnums))
    _close(rewritten(*args), want, f"{program.name}: overlap(grad(f))")
    assert _fused(rewritten.last_report) == program.grad_fused, "\n".join(rewritten.last_report)
