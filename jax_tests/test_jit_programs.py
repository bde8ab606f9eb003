"""Programs sharded by ``jax.jit`` alone (``jax_tests/programs/jit_*``):
``commfuse.matmul`` through ``commfuse.overlap`` gives the plain program's
numbers and gradients, and the compiled program holds the fused ops its
shardings call for, forward and backward. Also `_matmul.choose`, the rule
that reads the shardings, case by case."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import commfuse
from commfuse import _matmul
from conftest import assert_close
from programs import all_jit_programs, collectives, make_mesh, value_and_grads

PROGRAMS = all_jit_programs()
TARGET = 'custom_call_target="commfuse_collective_matmul'


def fused_in(compiled_text: str) -> int:
    return compiled_text.count(TARGET)


def _loss(fn):
    return lambda *args: fn(*args)[0]


def _setup(program, seed):
    mesh = make_mesh(program.mesh, axis_type=program.axis_type)
    scope = jax.set_mesh(mesh) if program.axis_type == "Explicit" else contextlib.nullcontext()
    with scope:
        fn, args = program.build(mesh, np.random.default_rng(seed))
    return mesh, scope, fn, args


def _close(got, want, what):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(np.asarray(g), np.asarray(w), np.float32, rtol=2e-4, err_msg=what)


def test_the_jit_corpus_has_every_program_shape():
    assert {p.name for p in PROGRAMS} >= {"jit_tp_sp_mlp", "jit_tp_attention", "jit_fsdp_mlp", "jit_fsdp_tp_mlp",
                                          "jit_explicit_mlp"}


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_jit_program_matches_plain_and_fuses_after_partitioning(program):
    mesh, scope, fn, args = _setup(program, 7)
    with jax.set_mesh(mesh):
        overlapped = commfuse.overlap(fn)
        fused = jax.jit(overlapped)
        _close(fused(*args), jax.jit(fn)(*args), f"{program.name}: outputs")
        text = fused.lower(*args).compile().as_text()
    # The program holds what the report says each product became ...
    assert fused_in(text) == _reported_calls(overlapped), (overlapped.last_partitioned, text)
    # ... and that is what the program's docstring derives.
    assert fused_in(text) == program.fused, text


def _reported_calls(overlapped) -> int:
    """The fused calls the report's decisions add up to: each partitioned
    `commfuse.matmul` as many as it became (`Partitioned.fused`)."""
    return sum(p.fused for p in overlapped.last_partitioned)


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_jit_program_gradients_match_plain_and_fuse(program):
    mesh, scope, fn, args = _setup(program, 11)
    with jax.set_mesh(mesh):
        want = jax.jit(value_and_grads(program, fn, args))(*args)
        # Differentiating commfuse.matmul (its VJP: the same op, partitioned) ...
        got = jax.jit(value_and_grads(program, commfuse.overlap(fn), args))(*args)
        _close(got, want, f"{program.name}: grad(overlap(f))")
        # ... and rewriting the differentiated program (JAX's transposed dots).
        overlapped = commfuse.overlap(value_and_grads(program, fn, args))
        rewritten = jax.jit(overlapped)
        _close(rewritten(*args), want, f"{program.name}: overlap(grad(f))")
        text = rewritten.lower(*args).compile().as_text()
    assert fused_in(text) == _reported_calls(overlapped), (overlapped.last_partitioned, text)
    assert fused_in(text) == program.grad_fused, text


def test_overlap_reports_each_replacement_and_what_it_became_after_partitioning():
    program = next(p for p in PROGRAMS if p.name == "jit_tp_sp_mlp")
    mesh, _, fn, args = _setup(program, 3)
    fused = commfuse.overlap(fn, schedule="ring")
    fused(*args)
    report = "\n".join(fused.last_report)
    assert report.count("-> commfuse.matmul#") == 2, report
    assert "all_gather_matmul over ('tp',), dimension 1; ran as all_gather_matmul: ring" in report, report
    assert "matmul_reduce_scatter over ('tp',), dimension 1; ran as matmul_reduce_scatter: ring" in report, report
    assert "no shard_map" not in report


def test_a_sharding_the_rule_cannot_fuse_falls_back_with_the_same_numbers():
    mesh = make_mesh({"a": 2, "b": 4})
    rng = np.random.default_rng(5)
    # x's contraction over `a`, w's over `b`: no one collective makes the product.
    x = jax.device_put(rng.standard_normal((16, 32), np.float32), NamedSharding(mesh, P(None, "a")))
    w = jax.device_put(rng.standard_normal((32, 8), np.float32), NamedSharding(mesh, P("b", None)))
    fn = jax.jit(lambda x, w: commfuse.matmul(x, w, schedule="ring"))
    with _matmul.watching() as seen:
        got = fn(x, w)
    assert_close(np.asarray(got), np.asarray(x) @ np.asarray(w), np.float32)
    assert fused_in(fn.lower(x, w).compile().as_text()) == 0
    assert any(e.choice.op == "fallback" and "sharded over ('a',) and w's over ('b',)" in e.choice.why for e in seen)
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(commfuse.matmul(x, w) ** 2), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), argnums=(0, 1)))(x, w)
    _close(grads, want, "fallback gradients")


def test_matmul_outside_jit_on_one_device_and_inside_shard_map_is_jnp_matmul():
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((3, 5, 4), np.float32), rng.standard_normal((4, 6), np.float32)
    assert_close(np.asarray(commfuse.matmul(x, w)), x @ w, np.float32)
    mesh = make_mesh({"i": 4})
    a, b = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 12), np.float32)
    body = jax.shard_map(lambda a, b: commfuse.matmul(a, b), mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
    assert_close(np.asarray(jax.jit(body)(a, b)), a @ b, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_matmul_dtypes_and_preferred_element_type(dtype):
    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(4)
    x = jax.device_put(rng.standard_normal((32, 16)).astype(dtype), NamedSharding(mesh, P("tp", None)))
    w = jax.device_put(rng.standard_normal((16, 8)).astype(dtype), NamedSharding(mesh, P(None, "tp")))
    got = jax.jit(lambda x, w: commfuse.matmul(x, w, preferred_element_type=np.float32))(x, w)
    assert got.dtype == np.float32
    assert_close(np.asarray(got), np.asarray(x, np.float32) @ np.asarray(w, np.float32), dtype)


def test_matmul_names_the_bad_argument():
    x, w = jnp.ones((4, 3)), jnp.ones((5, 2))
    with pytest.raises(ValueError, match=r"commfuse.matmul: `x` contracts its last dim \(3\) with `w`'s first \(5\)"):
        commfuse.matmul(x, w)
    with pytest.raises(ValueError, match=r"commfuse.matmul: `w` must be 2-D"):
        commfuse.matmul(x, jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"commfuse.matmul: unknown schedule 'tiled'"):
        commfuse.matmul(x, jnp.ones((3, 2)), schedule="tiled")
    with pytest.raises(TypeError, match=r"commfuse.matmul: unsupported dtype"):
        commfuse.matmul(x.astype(jnp.int32), jnp.ones((3, 2), jnp.int32))


# --------------------------------------------------------------------------
# The rule, case by case (no compilation)
# --------------------------------------------------------------------------
MESH = {"dp": 2, "tp": 4}
X3, W = (8, 64, 32), (32, 64)


def _choose(x_spec, w_spec, out_spec, x_shape=X3, w_shape=W):
    return _matmul.choose(MESH, x_shape, w_shape, x_spec, w_spec, out_spec)


@pytest.mark.parametrize("x_spec, w_spec, out_spec, op, axes, dimension, psum", [
    # Megatron SP: x's sequence over tp, w's columns over tp -> gather x's rows.
    ((("dp",), ("tp",), ()), ((), ("tp",)), (("dp",), (), ("tp",)), "all_gather_matmul", ("tp",), 1, ()),
    # Row-parallel with SP: contraction over tp, result's sequence over tp.
    ((("dp",), (), ("tp",)), (("tp",), ()), (("dp",), ("tp",), ()), "matmul_reduce_scatter", ("tp",), 1, ()),
    # Scatter of the result's columns (a column-split gradient).
    (((), (), ("tp",)), (("tp",), ()), ((), (), ("tp",)), "matmul_reduce_scatter", ("tp",), 2, ()),
    # Row-parallel without SP: all-reduce.
    ((("dp",), (), ("tp",)), (("tp",), ()), (("dp",), (), ()), "matmul_all_reduce", ("tp",), 0, ()),
    # FSDP: w's rows (contraction) over dp, x's batch over dp.
    ((("dp",), (), ()), (("dp",), ()), (("dp",), (), ()), "matmul_all_gather", ("dp",), 0, ()),
    # FSDP: w's columns over dp, the result's not.
    ((("dp",), (), ()), ((), ("dp",)), (("dp",), (), ()), "matmul_all_gather", ("dp",), 1, ()),
    # Weight gradient of the SP gather: x's rows (the contraction) over (dp, tp), dy's over dp.
    (((), (), ("dp", "tp")), (("dp",), ("tp",)), ((), (), ("tp",)), "all_gather_matmul", ("tp",), 2, ("dp",)),
    # Nothing to communicate.
    ((("dp",), (), ()), ((), ("tp",)), (("dp",), (), ("tp",)), "local", (), 0, ()),
    # FSDP's weight gradient beside data parallelism: the contraction over (dp, tp), the result's rows
    # scattered over tp, then summed over dp.
    (((), (), ("dp", "tp")), (("dp", "tp"), ()), (("tp",), (), ()), "matmul_reduce_scatter", ("tp",), 0, ("dp",)),
])
def test_choose_picks_the_collective_the_shardings_need(x_spec, w_spec, out_spec, op, axes, dimension, psum):
    choice = _choose(x_spec, w_spec, out_spec)
    assert (choice.op, choice.axes, choice.dimension, choice.psum_axes) == (op, axes, dimension, psum), choice


def test_a_weight_gather_beside_an_activation_collective_is_xlas_and_the_other_fused():
    """FSDP weights beside sequence parallelism: one op over both axes
    where the dot has its form, and otherwise the weight is gathered by XLA
    first (the operand sharding the choice asks for), the sequence gather
    (or reduce-scatter) is the fused op."""
    # w's rows gathered over dp and x's sequence over tp (SP x FSDP
    # column-parallel): the op over both axes, and where it does not run,
    # XLA's gather of w then the fused gather of x's rows.
    both = _choose(((), ("tp",), ()), (("dp",), ("tp",)), ((), (), ("tp",)))
    assert (both.op, both.axes, both.dimension, both.w_spec) == ("all_gather_both_matmul", ("dp", "tp"), 1,
                                                                 (("dp",), ("tp",))), both
    gather = both.otherwise
    assert (gather.op, gather.axes, gather.dimension, gather.w_spec) == ("all_gather_matmul", ("tp",), 1,
                                                                         ((), ("tp",))), gather
    assert "w gathered over ('dp',) by XLA first" in gather.describe()
    # w's columns gathered over dp and the rows scattered over tp (FSDP x TP
    # row-parallel): the op over both axes, and where it does not run, XLA's
    # gather of w then the fused reduce-scatter.
    both = _choose(((), (), ("tp",)), (("tp",), ("dp",)), ((), ("tp",), ()))
    assert (both.op, both.axes, both.dimension, both.w_spec) == ("all_gather_matmul_reduce_scatter", ("dp", "tp"),
                                                                 1, (("tp",), ("dp",))), both
    scatter = both.otherwise
    assert (scatter.op, scatter.axes, scatter.dimension, scatter.w_spec) == ("matmul_reduce_scatter", ("tp",), 1,
                                                                             (("tp",), ())), scatter


def test_a_gathered_contraction_beside_a_reduce_scatter_is_one_op_over_both_axes():
    """A weight gradient of sequence-parallel activations for an FSDP
    weight: the contraction (tokens) sharded over (dp, tp) on one operand
    and over dp on the other, the result reduce-scattered over dp. As JAX's
    transpose writes it (dyᵀ @ h: w's contraction gathered, the result's
    columns scattered) and as hᵀ @ dy (x's contraction gathered, its rows
    scattered): the gather-contract-scatter op over (tp, dp), and where it
    does not run, XLA's gather of the contraction then the fused
    reduce-scatter."""
    # hᵀ @ dy: x [32, 64] its contraction over (dp, tp), w [64, 64] over dp; the result's rows over dp.
    x_form = _matmul.choose(MESH, (32, 64), (64, 64), ((), ("dp", "tp")), (("dp",), ()), (("dp",), ()))
    assert (x_form.op, x_form.axes, x_form.dimension, x_form.psum_axes) == (
        "all_gather_contract_matmul_reduce_scatter", ("tp", "dp"), 0, ()), x_form
    scatter = x_form.otherwise
    assert (scatter.op, scatter.axes, scatter.dimension, scatter.x_spec) == (
        "matmul_reduce_scatter", ("dp",), 0, ((), ("dp",))), scatter
    assert "x's contraction gathered over ('tp',) by XLA first" in scatter.describe()
    # dyᵀ @ h: x [64, 64] its contraction over dp, w [64, 32] over (dp, tp); the result's columns over dp.
    w_form = _matmul.choose(MESH, (64, 64), (64, 32), ((), ("dp",)), (("dp", "tp"), ()), ((), ("dp",)))
    assert (w_form.op, w_form.axes, w_form.dimension, w_form.psum_axes) == (
        "all_gather_contract_matmul_reduce_scatter", ("tp", "dp"), 1, ()), w_form
    assert w_form.otherwise.op == "matmul_reduce_scatter" and w_form.otherwise.w_spec == (("dp",), ()), w_form


def test_a_flat_token_sp_fsdp_step_under_ring_leaves_xla_only_the_loss_sum():
    # jit_sp_fsdp_flat_tokens's step, gradients in the parameters' layout: under "ring" each of its 6 products
    # is one op over both axes (two-gather, two-axis, gather-contract-scatter), plain XLA gathers 8 times.
    program = next(p for p in PROGRAMS if p.name == "jit_sp_fsdp_flat_tokens")
    mesh, scope, fn, args = _setup(program, 13)
    with jax.set_mesh(mesh):
        step = value_and_grads(program, fn, args)
        overlapped = commfuse.overlap(step, schedule="ring")
        _close(jax.jit(overlapped)(*args), jax.jit(step)(*args), "ring")
        counts = collectives(jax.jit(overlapped).lower(*args).compile().as_text())
        plain = collectives(jax.jit(step).lower(*args).compile().as_text())
    assert plain.get("all-gather", 0) >= 6, plain
    assert counts == {"all-reduce": 1, "commfuse": 6}, counts
    ops = sorted(p.choice.op for p in overlapped.last_partitioned)
    assert ops == ["all_gather_both_matmul"] * 2 + ["all_gather_contract_matmul_reduce_scatter"] * 2 + [
        "all_gather_matmul_reduce_scatter"] * 2, ops


@pytest.mark.parametrize("x_spec, w_spec, out_spec, why", [
    (((), (), ("dp",)), (("tp",), ()), ((), (), ()), "x's contraction is sharded over ('dp',) and w's over ('tp',)"),
    (((), ("tp",), ()), ((), ()), ((), (), ("dp",)), "more than one collective"),
    ((("tp",), (), ()), ((), ()), (("dp",), (), ()), "x's dim 0 is sharded over ('tp',) and the result's over ('dp',)"),
    (((), (), ()), ((), ()), (("dp",), (), ()), "the result is scattered over ('dp',) but the contraction is sharded over ()"),
])
def test_choose_falls_back_where_no_one_fused_op_fits(x_spec, w_spec, out_spec, why):
    choice = _choose(x_spec, w_spec, out_spec)
    assert choice.op == "fallback" and why in choice.why, choice
    # The fallback's operands: what a local dot of the result's shard needs.
    assert choice.x_spec == out_spec[:-1] + ((),) and choice.w_spec == ((), out_spec[-1])


def test_choose_falls_back_on_dims_that_do_not_divide():
    choice = _choose((("dp",), ("tp",), ()), ((), ("tp",)), (("dp",), (), ("tp",)), x_shape=(2, 66, 32))
    assert choice.op == "fallback" and "does not divide" in choice.why
    # The result's rows scattered over tp, 10 of them over 4 devices (x's are whole): XLA pads, a fused op cannot.
    choice = _choose(((), (), ("tp",)), (("tp",), ()), ((), ("tp",), ()), x_shape=(2, 10, 32))
    assert choice.op == "fallback" and "the result's dim 1 (10) does not divide over ('tp',)" in choice.why


def test_partial_auto_shard_map_is_rewritten_with_the_same_numbers():
    """A shard_map over `tp` only (`dp` left to the partitioner), as MoE and
    ring-attention code writes them: the gather + dot in its body is fused."""
    mesh = make_mesh({"dp": 2, "tp": 4})
    rng = np.random.default_rng(8)
    x = jax.device_put(rng.standard_normal((2, 64, 32), np.float32), NamedSharding(mesh, P("dp", "tp", None)))
    w = jax.device_put(rng.standard_normal((32, 64), np.float32), NamedSharding(mesh, P(None, "tp")))

    def f(x, w):
        body = lambda a, b: jax.lax.all_gather(a, "tp", axis=1, tiled=True) @ b  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp")),
                             out_specs=P(None, None, "tp"), axis_names={"tp"})(x, w)

    fused = jax.jit(commfuse.overlap(f, schedule="ring"))
    _close(fused(x, w), jax.jit(f)(x, w), "partial-auto outputs")
    assert fused_in(fused.lower(x, w).compile().as_text()) == 1
    loss = lambda g: lambda x, w: jnp.sum(g(x, w) ** 2)  # noqa: E731
    _close(jax.jit(jax.grad(loss(commfuse.overlap(f, schedule="ring")), argnums=(0, 1)))(x, w),
           jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w), "partial-auto gradients")


def test_matmul_takes_a_bare_partition_spec_as_out_sharding_under_set_mesh():
    """As ``jnp.matmul`` does on explicit axes: the spec names the mesh in context."""
    mesh = make_mesh({"data": 2, "model": 4}, axis_type="Explicit")
    rng = np.random.default_rng(9)
    with jax.set_mesh(mesh):
        h = jax.device_put(rng.standard_normal((8, 64)).astype(np.float32), P("data", "model"))
        w = jax.device_put(rng.standard_normal((64, 32)).astype(np.float32), P("model", None))
        want = jax.jit(lambda h, w: jnp.matmul(h, w, out_sharding=P("data", None)))(h, w)
        fused = jax.jit(lambda h, w: commfuse.matmul(h, w, out_sharding=P("data", None), schedule="ring"))
        got = fused(h, w)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        assert got.sharding.spec == want.sharding.spec
        assert fused_in(fused.lower(h, w).compile().as_text()) == 1
    with pytest.raises(ValueError, match="out_sharding=.*no"):
        commfuse.matmul(jnp.ones((8, 4)), jnp.ones((4, 2)), out_sharding=P("data", None))


@pytest.mark.parametrize("schedule", ["auto", "ring"])
def test_a_nested_jit_keeps_its_shardings(schedule):
    """Inlined by the rewrite, a nested ``jax.jit``'s ``in_shardings`` and
    ``out_shardings`` still lay out its operands and results (under `auto`
    at this size nothing fuses, and the program is the plain one)."""
    mesh = make_mesh({"fsdp": 2, "tp": 2})
    rng = np.random.default_rng(10)
    x = jax.device_put(rng.standard_normal((4, 8, 16)).astype(np.float32), NamedSharding(mesh, P("fsdp")))
    w = jax.device_put(rng.standard_normal((16, 16)).astype(np.float32), NamedSharding(mesh, P()))
    proj = jax.jit(lambda h, w: h @ w, in_shardings=(NamedSharding(mesh, P(None, "tp")), None),
                   out_shardings=NamedSharding(mesh, P(None, "tp", None)))

    def f(x, w):
        return jnp.tanh(proj(x, w))

    want = jax.jit(f)(x, w)
    got = jax.jit(commfuse.overlap(f, schedule=schedule))(x, w)
    assert got.sharding.spec == want.sharding.spec == P(None, "tp")
    _close(got, want, "nested jit")


def test_the_report_follows_the_layout_each_call_compiled():
    """One overlapped function called on two layouts of the same shapes: each
    call's report and `last_partitioned` say what that layout's product
    became (called directly), or the latest compile's (under a caller's jit,
    which runs a compiled layout without telling anyone)."""
    mesh = make_mesh({"fsdp": 2, "tp": 2})
    fused = commfuse.overlap(lambda x, w: x @ w, schedule="ring")
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 32)).astype(np.float32)
    local, all_reduce = (P("fsdp", None), P(None, "tp")), (P(None, "tp"), P("tp", None))
    local_again = (P("fsdp"), P(None, "tp"))  # the same layout spelled shorter: JAX does not compile it again

    def check(call, layout, op):
        sx, sw = layout
        _close(call(jax.device_put(x, NamedSharding(mesh, sx)), jax.device_put(w, NamedSharding(mesh, sw))),
               x @ w, op)
        assert [p.choice.op for p in fused.last_partitioned] == [op], fused.last_report
        assert sum("overlap[partitioned]" in line for line in fused.last_report) == 1, fused.last_report

    for _ in range(2):
        check(fused, local, "local")
        check(fused, all_reduce, "matmul_all_reduce")
        check(fused, local_again, "local")
    outer = jax.jit(fused)  # one trace, a compile per layout: each compile's lines replace the last one's
    check(outer, local, "local")
    check(outer, all_reduce, "matmul_all_reduce")


def test_jax_export_of_fused_ops_as_docs_api_says():
    """Named fused ops export once their custom-call target is allowed, and
    run; a fused jit-level product (a custom_partitioning) does not export."""
    from jax import export

    from commfuse import _native

    mesh = make_mesh({"tp": 4})
    rng = np.random.default_rng(13)
    x = jax.device_put(rng.standard_normal((16, 8)).astype(np.float32), NamedSharding(mesh, P("tp")))
    w = jax.device_put(rng.standard_normal((8, 8)).astype(np.float32), NamedSharding(mesh, P(None, "tp")))
    named = jax.jit(jax.shard_map(lambda x, w: commfuse.all_gather_matmul(x, w, "tp", schedule="ring"), mesh=mesh,
                                  in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
    allowed = [export.DisabledSafetyCheck.custom_call(_native.CPU_TARGET)]
    exported = export.export(named, disabled_checks=allowed)(x, w)
    _close(exported.call(x, w), np.asarray(x) @ np.asarray(w), "exported named op")
    with pytest.raises(ValueError, match="compatibility guarantees"):
        export.export(named)(x, w)
    product = jax.jit(commfuse.overlap(lambda x, w: x @ w, schedule="ring"))
    x_cols = jax.device_put(np.asarray(x), NamedSharding(mesh, P(None, "tp")))
    w_rows = jax.device_put(np.asarray(w), NamedSharding(mesh, P("tp", None)))
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        export.export(product, disabled_checks=allowed)(x_cols, w_rows)


def test_explicit_axes_without_a_mesh_in_context_fuse_as_under_set_mesh():
    """``jax.make_mesh``'s axes are explicit by default, and JAX gives every
    backward dot an explicit result sharding: without ``jax.set_mesh`` those
    shardings name their own mesh, and the products fuse as under it."""
    mesh = make_mesh({"d": 2, "t": 4}, axis_type="Explicit")
    rng = np.random.default_rng(14)
    x = jax.device_put(rng.standard_normal((8, 16, 32)).astype(np.float32), NamedSharding(mesh, P("d")))
    w1 = jax.device_put(rng.standard_normal((32, 64)).astype(np.float32), NamedSharding(mesh, P(None, "t")))
    w2 = jax.device_put(rng.standard_normal((64, 32)).astype(np.float32), NamedSharding(mesh, P("t", None)))

    def loss(x, w1, w2):
        y = jnp.matmul(jax.nn.relu(x @ w1), w2, out_sharding=NamedSharding(mesh, P("d")))
        return jnp.sum(y ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    counts = []
    for scope in (contextlib.nullcontext(), jax.set_mesh(mesh)):
        with scope:
            fused = jax.jit(commfuse.overlap(grad, schedule="ring"))
            _close(fused(x, w1, w2), jax.jit(grad)(x, w1, w2), "explicit axes")
            counts.append(fused_in(fused.lower(x, w1, w2).compile().as_text()))
    assert counts[0] == counts[1] > 0, counts


def test_a_weight_gradient_scattered_over_fsdp_and_summed_over_data():
    """``einsum("bd,bf->df")`` with the batch over (data, fsdp) and the
    gradient constrained to rows over fsdp: the reduce-scatter over fsdp is
    the fused op, the sum over data XLA's."""
    mesh = make_mesh({"data": 2, "fsdp": 2})
    rng = np.random.default_rng(15)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    x = jax.device_put(rng.standard_normal((16, 32)).astype(np.float32), rows)
    dy = jax.device_put(rng.standard_normal((16, 24)).astype(np.float32), rows)

    def wgrad(x, dy):
        g = jnp.einsum("bd,bf->df", x, dy)
        return jax.lax.with_sharding_constraint(g, NamedSharding(mesh, P("fsdp")))

    fused = commfuse.overlap(wgrad, schedule="ring")
    _close(jax.jit(fused)(x, dy), np.asarray(x).T @ np.asarray(dy), "weight gradient")
    report = "\n".join(fused.last_report)
    assert "matmul_reduce_scatter over ('fsdp',), dimension 0, then psum over ('data',)" in report, report


@pytest.mark.parametrize("schedule", ["sequential", "auto"])
def test_fewer_kv_heads_than_the_tensor_axis(schedule):
    # Grouped-query attention's value projection with 2 kv heads over a
    # tensor axis of 8: XLA shards the split (kv, head_dim) dims 2 x 4, which
    # it runs, but which JAX's partitioning rules cannot name by mesh axes.
    # Regrouping the weight gradient's operand onto those dims made the
    # program fail to compile (IndivisibleError inside custom_partitioner);
    # it is now taken on the merged columns.
    mesh = make_mesh({"tensor": 8})
    b, s, d, kv, hd = 2, 16, 64, 2, 16
    rng = np.random.default_rng(3)
    x = jax.device_put(rng.standard_normal((b, s, d), np.float32), NamedSharding(mesh, P()))
    wv = jax.device_put(rng.standard_normal((d, kv * hd), np.float32) * d ** -0.5, NamedSharding(mesh, P(None, "tensor")))

    def loss(x, w):
        v = (x @ w).reshape(b, s, kv, hd)
        return jnp.sum(jnp.repeat(v, 2, axis=2) ** 2)

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, wv)
    rewritten = commfuse.overlap(jax.value_and_grad(loss, argnums=(0, 1)), schedule=schedule)
    for fn in (jax.value_and_grad(commfuse.overlap(loss, schedule=schedule), argnums=(0, 1)), rewritten):
        _close(jax.jit(fn)(x, wv), want, f"{schedule}: gradients")
    # Every dot taken as written: none on the (kv, head_dim) split.
    assert not any("taken on the operands before the reshape" in line for line in rewritten.last_report), \
        rewritten.last_report


@pytest.mark.parametrize("schedule", ["ring", "bidirectional"])
def test_an_fsdp_tp_row_parallel_product_under_jit_is_one_op_over_both_axes(schedule):
    # h's contraction and w's rows over tp, w's columns over fsdp, the result
    # sequence-parallel: under ring one fused op runs both collectives; the
    # op has no bidirectional schedule, so there XLA gathers w and the
    # reduce-scatter is fused.
    mesh = make_mesh({"fsdp": 2, "tp": 4})
    rng = np.random.default_rng(17)
    h = jax.device_put(rng.standard_normal((4, 16, 32), np.float32), NamedSharding(mesh, P("fsdp", None, "tp")))
    w = jax.device_put(rng.standard_normal((32, 24), np.float32) / 6, NamedSharding(mesh, P("tp", "fsdp")))

    def layer(h, w):
        y = jax.lax.with_sharding_constraint(h @ w, NamedSharding(mesh, P("fsdp", "tp", None)))
        return jnp.mean(y * y), y

    ov = commfuse.overlap(layer, schedule=schedule)
    _close(jax.jit(ov)(h, w), jax.jit(layer)(h, w), f"{schedule}: outputs")
    counts = collectives(jax.jit(ov).lower(h, w).compile().as_text())
    report = "\n".join(ov.last_report)
    if schedule == "ring":
        assert "all-gather" not in counts and "reduce-scatter" not in counts and counts["commfuse"] == 1, counts
        assert "all_gather_matmul_reduce_scatter over ('fsdp', 'tp'), dimension 1" in report, report
    else:
        assert counts.get("all-gather") == 1 and counts["commfuse"] == 1, counts
        assert "matmul_reduce_scatter over ('tp',), dimension 1" in report, report
    want = jax.jit(jax.grad(_loss(layer), argnums=(0, 1)))(h, w)
    _close(jax.jit(jax.grad(_loss(ov), argnums=(0, 1)))(h, w), want, f"{schedule}: gradients")
