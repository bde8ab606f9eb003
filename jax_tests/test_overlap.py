"""commfuse.overlap: plain jax.lax collective + matmul pairs inside shard_map
bodies are rewritten into commfuse's fused ops, with the same results.

Every test builds a function from plain ``jax.lax`` collectives, checks that
``overlap(f)`` gives ``f``'s results (tolerances of conftest) and, where a
rewrite is expected, that the traced program holds the commfuse primitive and
no longer the matched collective.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

import commfuse
from conftest import assert_close, make_mesh, mesh1d, place, rand

try:
    from commfuse import overlap
except ImportError:  # until __init__ exports it
    from commfuse._overlap import overlap

FUSED_PRIMITIVE = "commfuse_collective_matmul"


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    yield from _walk(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    yield from _walk(sub)


def primitive_counts(fn, *args) -> dict:
    """How often each primitive occurs in the traced program (nested jaxprs included)."""
    counts: dict = {}
    for eqn in _walk(jax.make_jaxpr(fn)(*args).jaxpr):
        counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
    return counts


def fused_count(counts) -> int:
    """Fused ops in the program (the primitive's name has been commfuse_<op> in older builds)."""
    return sum(n for name, n in counts.items() if name == FUSED_PRIMITIVE or name.startswith("commfuse_"))


def shard(body, mesh, in_specs, out_specs):
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs)


def check(f, args, *, gone=(), fused=1, dtype=None, report=False):
    """``overlap(f)`` matches ``f``, and holds ``fused`` fused ops more and ``fused`` fewer of the
    ``gone`` collectives."""
    g = overlap(f, report=report)
    before, after = primitive_counts(f, *args), primitive_counts(g, *args)
    assert fused_count(after) - fused_count(before) == fused, (after, g.last_report)
    if gone:
        n_before = sum(before.get(name, 0) for name in gone)
        assert sum(after.get(name, 0) for name in gone) == n_before - fused, (gone, before, after, g.last_report)
    want = jax.tree.map(np.asarray, f(*args))
    got = jax.tree.map(np.asarray, g(*args))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _same(a, b, dtype)
    return g


def _same(got, want, dtype):
    if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want)
    else:
        assert_close(got, want, dtype)


def rewrites(g):
    return [line for line in g.last_report if " rewrote " in line]


def misses(g):
    return [line for line in g.last_report if " no match: " in line]


@pytest.fixture(scope="module")
def mesh4():
    return mesh1d(4, "x")


# --------------------------------------------------------------------------
# all_gather -> dot_general
# --------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["rows", "x_contract_first", "w_transposed", "swapped", "leading_gather1"])
def test_all_gather_matmul(mesh4, rng, case):
    if case == "rows":                # all_gather(x, 0) @ w
        shapes, spec, gdim = ((8, 16), (16, 12)), P("x"), 0
        mm = lambda xg, w: xg @ w
    elif case == "x_contract_first":  # x contracts its first dim: a transpose is inserted
        shapes, spec, gdim = ((16, 8), (16, 12)), P(None, "x"), 1
        mm = lambda xg, w: jnp.einsum("kd,kf->df", xg, w)
    elif case == "w_transposed":      # xg @ w.T, w contracts its last dim
        shapes, spec, gdim = ((8, 16), (12, 16)), P("x"), 0
        mm = lambda xg, w: jax.lax.dot_general(xg, w, (((1,), (1,)), ((), ())))
    elif case == "swapped":           # w @ xg.T: the gathered operand on the right
        shapes, spec, gdim = ((8, 16), (12, 16)), P("x"), 0
        mm = lambda xg, w: jax.lax.dot_general(w, xg, (((1,), (1,)), ((), ())))
    else:                             # x [b, s, d] gathered along s
        shapes, spec, gdim = ((2, 8, 16), (16, 12)), P(None, "x"), 1
        mm = lambda xg, w: xg @ w

    def body(x, w):
        return mm(jax.lax.all_gather(x, "x", axis=gdim, tiled=True), w)

    x = place(rand(shapes[0], rng=rng), mesh4, spec)
    w = place(rand(shapes[1], rng=rng), mesh4, P())
    f = shard(body, mesh4, (spec, P()), spec)
    g = check(f, (x, w), gone=("all_gather",))
    # w @ xg.T is xg-as-weight: matmul_all_gather
    op = "matmul_all_gather" if case == "swapped" else "all_gather_matmul"
    assert len(rewrites(g)) == 1 and f"commfuse.{op}(" in rewrites(g)[0], g.last_report


# --------------------------------------------------------------------------
# dot_general(x, all_gather(w)): FSDP weight gathering
# --------------------------------------------------------------------------
@pytest.mark.parametrize("gdim", [0, 1])
def test_matmul_all_gather(mesh4, rng, gdim):
    w_spec = P("x", None) if gdim == 0 else P(None, "x")

    def body(x, w):
        return x @ jax.lax.all_gather(w, "x", axis=gdim, tiled=True)

    x = place(rand((8, 16), rng=rng), mesh4, P())
    w = place(rand((16, 12), rng=rng), mesh4, w_spec)
    f = shard(body, mesh4, (P(), w_spec), P(None, "x"))
    g = check(f, (x, w), gone=("all_gather",))
    assert "matmul_all_gather" in rewrites(g)[0]


# --------------------------------------------------------------------------
# dot_general -> reduce_scatter
# --------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["rows", "cols", "leading_dims", "x_contract_first"])
def test_matmul_reduce_scatter(mesh4, rng, case):
    if case == "rows":
        xs, ws, sdim, out = (16, 8), (8, 12), 0, P("x")
        mm = lambda x, w: x @ w
    elif case == "cols":             # scatter the last dim of the result
        xs, ws, sdim, out = (16, 8), (8, 12), 1, P(None, "x")
        mm = lambda x, w: x @ w
    elif case == "leading_dims":     # x [b, s, d] @ w, scatter along s
        xs, ws, sdim, out = (2, 8, 8), (8, 12), 1, P(None, "x")
        mm = lambda x, w: x @ w
    else:
        xs, ws, sdim, out = (8, 16), (8, 12), 0, P("x")
        mm = lambda x, w: jnp.einsum("kd,kf->df", x, w)

    def body(x, w):
        return jax.lax.psum_scatter(mm(x, w), "x", scatter_dimension=sdim, tiled=True)

    x = place(rand(xs, rng=rng), mesh4, P())
    w = place(rand(ws, rng=rng), mesh4, P())
    f = shard(body, mesh4, (P(), P()), out)
    g = check(f, (x, w), gone=("reduce_scatter", "psum_scatter"))
    assert "matmul_reduce_scatter" in rewrites(g)[0], g.last_report


# --------------------------------------------------------------------------
# all_to_all <-> dot_general
# --------------------------------------------------------------------------
@pytest.mark.parametrize("split,concat", [(0, 1), (1, 0)])
def test_all_to_all_matmul(mesh4, rng, split, concat):

    def body(x, w):
        return jax.lax.all_to_all(x, "x", split, concat, tiled=True) @ w

    x = place(rand((16, 8, 16), rng=rng), mesh4, P("x"))
    w = place(rand((16, 12), rng=rng), mesh4, P())
    f = shard(body, mesh4, (P("x"), P()), P("x"))
    g = check(f, (x, w), gone=("all_to_all",))
    assert "all_to_all_matmul" in rewrites(g)[0]


@pytest.mark.parametrize("split,concat", [(0, 1), (2, 0)])
def test_matmul_all_to_all(mesh4, rng, split, concat):

    def body(x, w):
        return jax.lax.all_to_all(x @ w, "x", split, concat, tiled=True)

    x = place(rand((16, 8, 16), rng=rng), mesh4, P("x"))
    w = place(rand((16, 12), rng=rng), mesh4, P())
    f = shard(body, mesh4, (P("x"), P()), P("x"))
    g = check(f, (x, w), gone=("all_to_all",))
    assert "matmul_all_to_all" in rewrites(g)[0]


# --------------------------------------------------------------------------
# a whole tensor-parallel MLP, leading batch dims, dtypes
# --------------------------------------------------------------------------
def _mlp(x, w1, w2):
    h = jax.lax.all_gather(x, "x", axis=1, tiled=True) @ w1
    return jax.lax.psum_scatter(jax.nn.gelu(h) @ w2, "x", scatter_dimension=1, tiled=True)


def _mlp_args(mesh, rng, dtype=np.float32):
    x = place(rand((2, 16, 8), dtype, rng=rng), mesh, P(None, "x"))
    w1 = place(rand((8, 32), dtype, rng=rng), mesh, P(None, "x"))
    w2 = place(rand((32, 8), dtype, rng=rng), mesh, P("x", None))
    return x, w1, w2


def _mlp_fn(mesh):
    return shard(_mlp, mesh, (P(None, "x"), P(None, "x"), P("x", None)), P(None, "x"))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_mlp_fully_rewritten(mesh4, rng, dtype):
    f = _mlp_fn(mesh4)
    args = _mlp_args(mesh4, rng, dtype)
    g = check(f, args, gone=("all_gather", "reduce_scatter", "psum_scatter"), fused=2, dtype=dtype)
    assert len(rewrites(g)) == 2 and not misses(g), g.last_report
    assert g(*args).dtype == np.dtype(dtype)


def test_preferred_element_type_and_precision(mesh4, rng):
    def body(x, w):
        xg = jax.lax.all_gather(x, "x", axis=0, tiled=True)
        return jnp.matmul(xg, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    x = place(rand((8, 16), jnp.bfloat16, rng=rng), mesh4, P("x"))
    w = place(rand((16, 12), jnp.bfloat16, rng=rng), mesh4, P())
    f = shard(body, mesh4, (P("x"), P()), P("x"))
    g = check(f, (x, w), gone=("all_gather",), dtype=jnp.bfloat16)
    assert g(x, w).dtype == np.float32


def test_multiple_axes(rng):
    mesh = make_mesh((2, 2), ("a", "b"))

    def body(x, w):
        return jax.lax.all_gather(x, ("a", "b"), axis=0, tiled=True) @ w

    x = place(rand((16, 8), rng=rng), mesh, P(("a", "b")))
    w = place(rand((8, 12), rng=rng), mesh, P())
    f = shard(body, mesh, (P(("a", "b")), P()), P(("a", "b")))
    g = check(f, (x, w), gone=("all_gather",))
    assert "axis_name=('a', 'b')" in rewrites(g)[0]


# --------------------------------------------------------------------------
# what must stay as it is, and the report
# --------------------------------------------------------------------------
def test_all_gather_with_two_users_is_left_alone(mesh4, rng):
    def body(x, w):
        xg = jax.lax.all_gather(x, "x", axis=0, tiled=True)
        return xg @ w + jnp.sum(xg)

    x = place(rand((8, 16), rng=rng), mesh4, P("x"))
    w = place(rand((16, 12), rng=rng), mesh4, P())
    f = shard(body, mesh4, (P("x"), P()), P("x"))
    g = check(f, (x, w), fused=0)
    assert primitive_counts(g, x, w).get("all_gather") == 1
    assert not rewrites(g)
    assert any("all_gather" in line and "not only by dot_generals" in line for line in misses(g)), g.last_report


@pytest.mark.parametrize("case", ["batch_dims", "non_tiled", "fused_op_refuses", "custom_vjp"])
def test_unmatched_reasons(mesh4, rng, case):
    if case == "batch_dims":  # a grouped matmul fuses per batch, but not a gather of its batch dim
        def body(x, w):
            return jnp.einsum("bsd,bdf->bsf", jax.lax.all_gather(x, "x", axis=0, tiled=True), w)
        xs, ws, spec, reason = (8, 8, 16), (8, 16, 4), P("x"), "batch dim of a grouped matmul"
    elif case == "non_tiled":
        def body(x, w):
            return jax.lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=False)[None]
        xs, ws, spec, reason = (16, 16), (16, 4), P("x"), "non-tiled"
    elif case == "fused_op_refuses":  # integers: the fused op raises at trace time
        def body(x, w):
            return jax.lax.all_gather(x, "x", axis=0, tiled=True) @ w
        xs, ws, spec, reason = (8, 16), (16, 4), P("x"), "refuses these operands"
    else:
        @jax.custom_vjp
        def inner(x, w):
            return jax.lax.all_gather(x, "x", axis=0, tiled=True) @ w

        inner.defvjp(lambda x, w: (inner(x, w), None), lambda _, g: (g, g))

        def body(x, w):
            return inner(x, w)
        xs, ws, spec, reason = (8, 16), (16, 4), P("x"), "inside custom_vjp_call"

    dtype = np.int32 if case == "fused_op_refuses" else np.float32
    x = place((rand(xs, rng=rng) * 8).astype(dtype), mesh4, spec)
    w = place((rand(ws, rng=rng) * 8).astype(dtype), mesh4, P())
    f = shard(body, mesh4, (spec, P()), spec)
    g = check(f, (x, w), fused=0)
    assert not rewrites(g)
    assert any(reason in line for line in misses(g)), g.last_report


def test_report_print_and_logger(mesh4, rng, capsys, caplog):
    f = _mlp_fn(mesh4)
    args = _mlp_args(mesh4, rng)
    logger = logging.getLogger("commfuse.test_overlap")
    with caplog.at_level(logging.INFO, logger=logger.name):
        g = overlap(f, report=True, logger=logger)
        jax.block_until_ready(g(*args))
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 2 and printed == g.last_report
    assert "all_gather_matmul" in printed[0] and "gather_dimension=1" in printed[0]
    assert "matmul_reduce_scatter" in printed[1] and "scatter_dimension=1" in printed[1]
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == printed
    # a second call with the same signature reuses the compiled program: nothing new printed
    jax.block_until_ready(g(*args))
    assert capsys.readouterr().out == "" and g.last_report == printed


# --------------------------------------------------------------------------
# nested jaxprs inside the body
# --------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["jit", "checkpoint", "scan", "while", "cond"])
def test_nested_in_body(mesh4, rng, where):
    def ag_mm(x, w):
        return jax.lax.all_gather(x, "x", axis=0, tiled=True) @ w

    def body(x, w):
        if where == "jit":
            return jax.jit(ag_mm)(x, w)
        if where == "checkpoint":
            return jax.checkpoint(ag_mm)(x, w)
        if where == "scan":
            def step(c, wi):
                return c, ag_mm(x, wi)
            return jax.lax.scan(step, 0.0, w)[1].sum(0)
        if where == "while":
            def loop(carry):
                i, acc = carry
                return i + 1, acc + ag_mm(x, w)
            init = (0, jax.lax.pcast(jnp.zeros((8, 12), x.dtype), ("x",), to="varying"))
            return jax.lax.while_loop(lambda c: c[0] < 2, loop, init)[1]
        # the predicate must agree on all ranks: every rank has to reach the same fused op
        return jax.lax.cond(jnp.sum(w) > 0, ag_mm, lambda a, b: ag_mm(-a, b), x, w)

    x = place(rand((8, 16), rng=rng), mesh4, P("x"))
    ws = (3, 16, 12) if where == "scan" else (16, 12)
    w = place(rand(ws, rng=rng), mesh4, P())
    f = shard(body, mesh4, (P("x"), P()), P("x"))
    check(f, (x, w), gone=("all_gather",), fused=2 if where == "cond" else 1)


# --------------------------------------------------------------------------
# composition with jit, grad, and use as a shard_map body
# --------------------------------------------------------------------------
def test_jit_of_overlap_and_overlap_of_jit(mesh4, rng):
    f = _mlp_fn(mesh4)
    args = _mlp_args(mesh4, rng)
    want = np.asarray(f(*args))
    for g in (jax.jit(overlap(f)), overlap(jax.jit(f))):
        assert_close(np.asarray(g(*args)), want)
        counts = primitive_counts(g, *args)
        assert fused_count(counts) == 2 and "all_gather" not in counts, counts


def test_overlap_as_shard_map_body(mesh4, rng):
    args = _mlp_args(mesh4, rng)
    specs = (P(None, "x"), P(None, "x"), P("x", None))
    f = shard(_mlp, mesh4, specs, P(None, "x"))
    body = overlap(_mlp)
    g = shard(body, mesh4, specs, P(None, "x"))
    assert_close(np.asarray(jax.jit(g)(*args)), np.asarray(f(*args)))
    assert fused_count(primitive_counts(g, *args)) == 2
    assert len(rewrites(body)) == 2 and body.last_report[0].startswith("overlap[body]"), body.last_report


def test_nothing_to_rewrite(rng):
    g = overlap(lambda x: jnp.sin(x) + x.T)
    x = rand((4, 4), rng=rng)
    assert_close(np.asarray(g(x)), np.sin(x) + x.T)
    assert g.last_report == ["overlap: the traced function has no shard_map and no dot_general outside one; "
                             "nothing was rewritten"]


def test_a_dot_outside_shard_map_becomes_commfuse_matmul(rng):
    g = overlap(lambda x: x @ x.T)
    x = rand((4, 4), rng=rng)
    assert_close(np.asarray(g(x)), x @ x.T)
    # One device: nothing to partition, so the only line is the replacement.
    assert len(g.last_report) == 1 and "-> commfuse.matmul#" in g.last_report[0], g.last_report


def _grad_case(mesh, rng, case):
    if case == "mlp":
        return _mlp_fn(mesh), _mlp_args(mesh, rng)
    if case == "replicated_operands":  # JAX puts a pvary between the dot and the psum_scatter
        def body(x, w):
            return jax.lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=True)
        specs, out, shapes = (P(), P()), P("x"), ((16, 8), (8, 12))
    else:
        def body(x, w):
            y = jax.lax.all_to_all(x, "x", 1, 0, tiled=True) @ w
            return jax.lax.all_to_all(y @ w.T, "x", 0, 1, tiled=True)
        specs, out, shapes = (P("x"), P()), P("x"), ((16, 8, 12), (12, 12))
    args = tuple(place(rand(s, rng=rng), mesh, spec) for s, spec in zip(shapes, specs))
    return shard(body, mesh, specs, out), args


@pytest.mark.parametrize("case", ["mlp", "replicated_operands", "all_to_all"])
def test_grad_through_overlap(mesh4, rng, case):
    f, args = _grad_case(mesh4, rng, case)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) ** 2)

    g = overlap(f)
    argnums = tuple(range(len(args)))
    got = jax.jit(jax.grad(loss(g), argnums=argnums))(*args)
    assert len(rewrites(g)) == (1 if case == "replicated_operands" else 2), g.last_report
    want = jax.jit(jax.grad(loss(f), argnums=argnums))(*args)
    for a, b in zip(got, want):
        assert_close(np.asarray(a), np.asarray(b))


def test_divergent_cond_is_not_rewritten(mesh4, rng):
    """A predicate that varies across ranks may send them down different branches,
    where a fused op would wait for the ranks that never come."""
    def ag_mm(x, w):
        return jax.lax.all_gather(x, "x", axis=0, tiled=True) @ w

    def body(x, w):
        return jax.lax.cond(jnp.sum(x) > 0, ag_mm, lambda a, b: ag_mm(-a, b), x, w)

    x = place(rand((8, 16), rng=rng), mesh4, P("x"))
    w = place(rand((16, 12), rng=rng), mesh4, P())
    g = overlap(shard(body, mesh4, (P("x"), P()), P("x")))
    counts = primitive_counts(g, x, w)
    assert fused_count(counts) == 0 and counts["all_gather"] == 2
    assert len(misses(g)) == 2 and all("may differ between the devices of mesh axes ('x',)" in line for line in misses(g))


def test_pvary_between_the_pair(rng):
    """On a 2-D mesh JAX puts a pvary between the all_gather over one axis and the
    dot with a weight varying over the other (and between dot and psum_scatter)."""
    mesh = make_mesh((2, 2), ("a", "b"))

    def body(x, w1, w2):
        h = jax.lax.all_gather(x, "a", axis=0, tiled=True) @ w1
        return jax.lax.psum_scatter(h @ w2, "b", scatter_dimension=0, tiled=True)

    x = place(rand((8, 16), rng=rng), mesh, P("a"))
    w1 = place(rand((16, 8), rng=rng), mesh, P(None, "b"))
    w2 = place(rand((4, 12), rng=rng), mesh, P())
    f = shard(body, mesh, (P("a"), P(None, "b"), P()), P(("a", "b")))
    assert primitive_counts(f, x, w1, w2)["pvary"] >= 2
    g = check(f, (x, w1, w2), gone=("all_gather", "reduce_scatter"), fused=2)
    assert len(rewrites(g)) == 2, g.last_report


def test_check_vma_false(mesh4, rng):
    f = jax.shard_map(_mlp, mesh=mesh4, in_specs=(P(None, "x"), P(None, "x"), P("x", None)),
                      out_specs=P(None, "x"), check_vma=False)
    g = check(f, _mlp_args(mesh4, rng), gone=("all_gather", "reduce_scatter"), fused=2)
    assert len(rewrites(g)) == 2, g.last_report


def test_pytrees_kwargs_and_static_arguments(mesh4, rng):
    x, w1, w2 = _mlp_args(mesh4, rng)

    def f(params, x, *, scale, act="gelu"):
        def body(x, w1, w2):
            h = jax.lax.all_gather(x, "x", axis=1, tiled=True) @ w1
            h = jax.nn.gelu(h) if act == "gelu" else jax.nn.relu(h)
            return jax.lax.psum_scatter((h * scale) @ w2, "x", scatter_dimension=1, tiled=True)

        out = shard(body, mesh4, (P(None, "x"), P(None, "x"), P("x", None)), P(None, "x"))(
            x, params["w1"], params["w2"])
        return {"y": out, "n": params["w1"].shape[0]}

    params = {"w1": w1, "w2": w2}
    g = overlap(f)
    for act in ("gelu", "relu"):
        got, want = g(params, x, scale=2.0, act=act), f(params, x, scale=2.0, act=act)
        assert got["n"] == want["n"] == 8 and isinstance(got["n"], int)
        assert_close(np.asarray(got["y"]), np.asarray(want["y"]))
        assert len(rewrites(g)) == 2, g.last_report


@pytest.mark.parametrize("schedule", ["ring", "unfused"])
def test_named_scopes_and_source_lines_reach_the_rewritten_program(mesh4, rng, schedule):
    """Profiles and HLO dumps of the overlapped program name the user's
    ``jax.named_scope``s, in shard_map bodies (the fused op in its dot's
    scope) and outside them, whether or not anything was fused."""
    x, w1, w2 = _mlp_args(mesh4, rng)

    def body(x, w1, w2):
        with jax.named_scope("sp_up_projection"):
            h = jax.lax.all_gather(x, "x", axis=1, tiled=True) @ w1
        return jax.lax.psum_scatter(jax.nn.gelu(h) @ w2, "x", scatter_dimension=1, tiled=True)

    sharded = shard(body, mesh4, (P(None, "x"), P(None, "x"), P("x", None)), P(None, "x"))

    def step(x, w1, w2):
        with jax.named_scope("loss_head"):
            return jnp.sum(jnp.tanh(sharded(x, w1, w2)))

    for fn in (sharded, step):
        want = jax.jit(fn).lower(x, w1, w2).as_text(debug_info=True)
        got = jax.jit(overlap(fn, schedule=schedule)).lower(x, w1, w2).as_text(debug_info=True)
        for scope in ("sp_up_projection", "loss_head"):
            assert (scope in got) == (scope in want), (scope, schedule)
        assert "sp_up_projection" in got
