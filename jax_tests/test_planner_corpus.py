"""The planner's corpus (commfuse._planner.corpus): each family's step
trains, gives one device's loss on 8 data-parallel devices, names what the
planner needs named, lets the planner choose its remat policy, and the
Llama-3 sizes build abstract with their published parameter counts."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from commfuse._planner import corpus
from commfuse._planner.hooks import Layout, tracing
from conftest import devices

LINEN = ("gpt_linen", "moe_linen")
PARAM_NAMES = {"layers", "vocab", "embed", "position", "heads", "mlp", "norm", "expert"}
# The steps are compiled without LLVM's optimisations: half the compile time
# of these tiny steps, which is most of this file's.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _jit(fn):
    return jax.jit(fn, compiler_options=FAST_COMPILE)


@pytest.fixture(scope="module", params=corpus.FAMILIES)
def case(request):
    return corpus.build(request.param, "test")


@pytest.fixture(scope="module")
def one_device(case):
    """Three steps on one device: (losses, params after the first step)."""
    step = _jit(case.step)
    params, opt_state, batch = jax.device_put(case.args, jax.devices()[0])
    losses, first = [], None
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, batch)
        first = params if first is None else first
        losses.append(float(loss))
    return losses, first


def _data_mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices(8))


def test_loss_is_finite_and_falls(case, one_device):
    losses, params = one_device
    assert np.all(np.isfinite(losses)), losses
    assert losses[0] > losses[1] > losses[2], losses
    # Near log(vocab) at first: the heads start small.
    assert abs(losses[0] - np.log(case.info["vocab"])) < 0.5, losses
    # The updated parameters keep the tree, Linen's boxes and their names included.
    assert jax.tree.structure(params) == jax.tree.structure(case.args[0])


def test_data_parallel_step_matches_one_device(case, one_device):
    mesh = _data_mesh()
    params, opt_state, batch = case.args
    args = (jax.device_put((params, opt_state), NamedSharding(mesh, P())),
            jax.device_put(batch, NamedSharding(mesh, P("data"))))
    step = _jit(case.step)
    losses = []
    (params, opt_state), batch = args
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)


def _is_box(x):
    return isinstance(x, nn.LogicallyPartitioned)


@pytest.mark.parametrize("abstract", [False, True])
def test_parameter_names(case, abstract):
    """Linen's parameters are all named (boxed, abstract builds too); the
    plain JAX family's are bare arrays: the planner infers their names."""
    family = case.name.split("/")[0]
    if abstract:
        case = corpus.build(family, "test", abstract=True)
    params, opt_state, _ = case.args
    boxes = jax.tree.leaves(params, is_leaf=_is_box)
    if family not in LINEN:
        assert not any(map(_is_box, boxes))
        return
    for box in boxes:
        assert _is_box(box), type(box)
        assert len(box.names) == box.value.ndim and None not in box.names, box.names
        assert set(box.names) <= PARAM_NAMES, box.names
        assert isinstance(box.value, jax.ShapeDtypeStruct if abstract else jax.Array)
    # The scanned blocks' parameters have a leading "layers" axis.
    assert all(box.names[0] == "layers" for box in jax.tree.leaves(params["layers"], is_leaf=_is_box))
    # adam's two moments are boxed alike: a planner reads their names too.
    assert sum(map(_is_box, jax.tree.leaves(opt_state, is_leaf=_is_box))) == 2 * len(boxes)


def _dots(jaxpr) -> int:
    """dot_general equations in `jaxpr` and every jaxpr nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    count += _dots(sub)
    return count


def test_the_planner_chooses_the_remat_policy(case):
    params, _, batch = case.args
    mesh = _data_mesh()

    def dots(remat):
        # A new gradient function each time: JAX caches a function's trace
        # without regard to the layout, which only the hooks read.
        grad = jax.grad(case.loss)
        with tracing(Layout(mesh, (("batch", "data"),), remat=remat)):
            return _dots(jax.make_jaxpr(grad)(params, batch).jaxpr)

    everything, nothing = dots("everything"), dots("nothing")
    assert nothing > everything, (nothing, everything)
    # Without a choice the blocks keep the model's own: "nothing".
    assert dots(None) == nothing


@pytest.mark.parametrize("size, count", [("8b", 8.0e9), ("70b", 70.6e9)])
def test_llama3_sizes_build_abstract(size, count):
    before = {id(a) for a in jax.live_arrays()}
    case = corpus.build("llama_jax", size)
    leaves = jax.tree.leaves(case.args)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert not [a for a in jax.live_arrays() if id(a) not in before]
    assert case.info["params"] == pytest.approx(count, rel=0.03)
    assert case.args[2]["tokens"].shape == (8, 4097)
    params, opt_state, loss = jax.eval_shape(case.step, *case.args)
    assert loss.shape == () and loss.dtype == np.float32
    assert jax.tree.structure(params) == jax.tree.structure(case.args[0])
