"""commfuse.plan: the logical names it reads or infers, the rules it gives
the mesh axes, the search under a memory limit (on compiled programs, with
abstract arguments), and the plan it returns: placed, applied, saved."""

from __future__ import annotations

import json
import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import commfuse
from commfuse._planner import corpus, hooks, logical
from commfuse._planner.space import Candidate, baselines, factorizations

DEVICES = 8


def test_mesh_spec_maps_logical_names_as_flax_does():
    """`hooks.mesh_spec` (for code without Flax) is Flax's
    ``logical_to_mesh_axes`` on random rules and names."""
    rng = random.Random(0)
    names = ["batch", "length", "embed", "mlp", "heads", "vocab"]
    axes = [None, "data", "fsdp", "tensor", ("data", "fsdp"), ("fsdp", "tensor")]
    for _ in range(2000):
        rules = tuple((rng.choice(names), rng.choice(axes)) for _ in range(rng.randint(0, 6)))
        picked = tuple(n if rng.random() > 0.2 else None for n in rng.sample(names, rng.randint(1, 4)))
        assert tuple(hooks.mesh_spec(picked, rules)) == tuple(nn.logical_to_mesh_axes(picked, rules)), (picked, rules)


def test_candidates_rules_give_the_layouts_people_train_with():
    assert len(factorizations(8)) == 10
    assert all(np.prod([n for _, n in m]) == 8 for m in factorizations(8))
    b = baselines(8)
    assert b["DP"].sizes == {"data": 8, "fsdp": 1, "tensor": 1}
    assert b["TP+SP"].sizes["tensor"] == 8 and b["TP+SP"].sequence_parallel
    assert b["FSDPxTP"].sizes == {"data": 1, "fsdp": 4, "tensor": 2}
    assert baselines(64)["TP+SP"].sizes == {"data": 8, "fsdp": 1, "tensor": 8}
    fsdp_tp = Candidate((("data", 2), ("fsdp", 2), ("tensor", 2)), sequence_parallel=True)
    rules = fsdp_tp.rules()
    # Parameters: embed over fsdp, the tensor-parallel dims over tensor.
    assert tuple(hooks.mesh_spec(("embed", "mlp"), rules)) == ("fsdp", "tensor")
    assert tuple(hooks.mesh_spec(("vocab", "embed"), rules)) == ("tensor", "fsdp")
    # The residual stream: batch over data and fsdp, its sequence over tensor (SP).
    assert tuple(hooks.mesh_spec(("batch", "length", "act_embed"), rules)) == (("data", "fsdp"), "tensor", None)
    # Inside a block the sequence is whole and the features over tensor.
    assert tuple(hooks.mesh_spec(("batch", "act_length", "act_mlp"), rules)) == (("data", "fsdp"), None, "tensor")


def test_flax_names_are_read_and_optimizer_state_takes_them():
    case = corpus.build("gpt_linen", "test", abstract=True)
    names = logical.names_of(case.step, case.args)
    leaves, flax_names, _ = logical.leaves_with_names(case.args)
    assert len(names) == len(leaves)
    assert {n.source for n in names} <= {"flax", "batch", "none"}
    assert all(n.source == "flax" for n, leaf in zip(names[:-1], leaves[:-1]) if np.ndim(leaf) >= 2)
    assert names[-1] == logical.Names(("batch", None), "batch")


def test_nnx_sharding_metadata_is_read():
    nnx = pytest.importorskip("flax.nnx")
    with nnx.use_eager_sharding(False):
        layer = nnx.Linear(16, 32, rngs=nnx.Rngs(0),
                           kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
                           bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)))
    _, state = nnx.split(layer)
    batch = jnp.ones((8, 16))

    def step(state, x):
        return jnp.sum(x @ state["kernel"].value + state["bias"].value)

    names = logical.names_of(step, (state, batch))
    leaves, _, _ = logical.leaves_with_names((state, batch))
    by_shape = {np.shape(leaf): n for leaf, n in zip(leaves, names)}
    assert by_shape[(16, 32)] == logical.Names(("embed", "mlp"), "flax")
    assert by_shape[(32,)] == logical.Names(("mlp",), "flax")
    assert by_shape[(8, 16)] == logical.Names(("batch", None), "batch")


def test_plain_jax_parameters_are_named_by_how_the_dots_use_them():
    """Llama's projections without names: q, k, v and the MLP's gate and up
    are column-parallel, o and down row-parallel, the embedding (gathered
    by token ids) vocab x embed, the head embed x vocab; adam's moments
    mirror them."""
    case = corpus.build("llama_jax", "test", abstract=True)
    names = logical.names_of(case.step, case.args)
    paths = ["/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(case.args)[0]]
    by_path = dict(zip(paths, names))
    params = {p: n for p, n in by_path.items() if p.startswith("0/")}
    assert params, paths
    inferred = {p.split("/")[-1]: n.names for p, n in params.items()}
    layers = ("layers",)
    col, row = layers + ("embed", "mlp"), layers + ("mlp", "embed")
    want = {name: col for name in ("wq", "wk", "wv", "w_gate", "w_up") if name in inferred}
    want.update({name: row for name in ("wo", "w_down") if name in inferred})
    assert len(want) >= 5, inferred
    for name, expected in want.items():
        assert inferred[name] == expected, (name, inferred[name])
    assert any(v == ("vocab", "embed") for v in inferred.values()), inferred
    assert any(v == ("embed", "vocab") for v in inferred.values()), inferred
    moments = [n for p, n in by_path.items() if p.startswith("1/") and n.names]
    assert moments and all(n.source == "mirrored" for n in moments)


def test_planning_for_more_devices_than_jax_sees_says_how():
    case = corpus.build("gpt_linen", "test", abstract=True)
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=64"):
        commfuse.plan(case.step, *case.args, devices=64)
    with pytest.raises(ValueError, match="memory_limit"):
        commfuse.plan(case.step, *case.args, devices=8, memory_limit=-1)
    with pytest.raises(ValueError, match="unknown machine"):
        commfuse.plan(case.step, *case.args, devices=8, machine="tpu_v9")


@pytest.fixture(scope="module")
def planned():
    """One plan of gpt_linen's test step for 8 devices of an H100 node, on
    abstract arguments, then again under a memory limit that binds (the
    same evaluations: nothing compiles twice)."""
    case = corpus.build("gpt_linen", "test", abstract=True)
    live = len(jax.live_arrays())
    cache: dict = {}
    kw = dict(devices=DEVICES, machine="h100_nvlink", axes=("data", "fsdp", "tensor"),
              remat=("nothing", "everything"), top=1, cache=cache)
    free = commfuse.plan(case.step, *case.args, **kw)
    fastest = min((e for e in free.evaluations.values() if e.ok), key=lambda e: e.predicted_s)
    limit = int(fastest.memory_bytes * 0.9)
    bound = commfuse.plan(case.step, *case.args, memory_limit=limit, **kw)
    allocated = len(jax.live_arrays()) - live
    return case, free, bound, limit, fastest, allocated


def test_planning_abstract_arguments_allocates_no_arrays(planned):
    *_, allocated = planned
    assert allocated == 0


def test_the_plan_is_the_fastest_candidate_that_fits(planned):
    case, free, bound, limit, fastest, _ = planned
    assert free.predicted_step_s == pytest.approx(fastest.predicted_s)
    ok = [e for e in bound.evaluations.values() if e.ok and e.memory_bytes <= limit]
    assert ok and bound.predicted_step_s == pytest.approx(min(e.predicted_s for e in ok))
    assert bound.predicted_memory_bytes <= limit < fastest.memory_bytes
    for pair in bound.baselines.values():
        for row in pair.values():
            if row["fits"]:
                assert row["predicted_s"] >= bound.predicted_step_s * (1 - 1e-9)
    # Every figure is from a compiled program: XLA's memory, the priced HLO.
    for e in free.evaluations.values():
        if e.ok:
            assert e.memory["argument"] > 0 and e.priced.compute_s > 0
    text = str(bound)
    assert "plan:" in text and "FSDP" in text and "TP+SP" in text
    assert "faster than the best baseline that fits" in bound.why or "no baseline fits" in bound.why


def test_a_plan_saves_and_loads(planned, tmp_path):
    _, _, bound, *_ = planned
    path = tmp_path / "plan.json"
    bound.to_json(path)
    again = commfuse.Plan.from_json(path)
    assert again.mesh == bound.mesh and again.rules == bound.rules and again.specs == bound.specs
    assert again.remat == bound.remat and again.fused == bound.fused
    assert [(d.call, d.schedule) for d in again.decisions] == [(d.call, d.schedule) for d in bound.decisions]
    assert json.loads(again.to_json()) == json.loads(bound.to_json())


def test_a_plan_runs_the_step_as_the_plain_step_does(planned):
    """`plan.shard` places concrete arguments as planned and `plan.apply`
    runs the step under the plan's layout: the same losses as the step on
    one device, over three steps."""
    _, free, bound, *_ = planned
    case = corpus.build("gpt_linen", "test")
    want = []
    params, opt_state, batch = case.args
    single = jax.jit(case.step)
    for _ in range(3):
        params, opt_state, loss = single(params, opt_state, batch)
        want.append(float(loss))
    for plan in (free, bound):
        fresh = corpus.build("gpt_linen", "test")
        step = plan.apply(fresh.step)
        args = plan.shard(tuple(jax.tree.map(np.asarray, fresh.args)))
        params, opt_state, batch = args
        got = []
        for _ in range(3):
            params, opt_state, loss = step(params, opt_state, batch)
            got.append(float(loss))
        assert_close(np.asarray(got), np.asarray(want), np.float32)
        sharding = jax.tree.leaves(params)[0].sharding
        assert dict(sharding.mesh.shape) == plan.mesh_shape


def _small_step():
    """A training step of one product, without the remat hook, and its abstract arguments."""
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def step(w, x):
        return w - 0.1 * jax.grad(loss)(w, x), loss(w, x)

    return step, jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32)


def test_a_step_without_the_remat_hook_keeps_its_own():
    step, w, x = _small_step()
    plan = commfuse.plan(step, w, x, devices=DEVICES, axes=("data", "tensor"), top=1)
    assert any("no commfuse.remat_policy" in note for note in plan.notes)
    assert plan.remat in (None, "nothing")


def test_on_cpu_devices_a_candidate_is_priced_as_it_runs_there():
    # The link model slows commfuse's transport, not XLA's collectives: on
    # CPU devices a plain layout's products run as commfuse calls
    # (`evaluate.as_run`) and are priced so, their fixed costs included; on
    # a GPU machine the same layout is XLA's program.
    step, w, x = _small_step()
    fused_ops = {}
    for machine in ("cpu_here", "h100_nvlink"):
        plan = commfuse.plan(step, w, x, devices=DEVICES, axes=("data", "tensor"), top=1, machine=machine)
        fused_ops[machine] = {e.candidate: e.priced.fused_ops for e in plan.evaluations.values()
                              if e.ok and not e.candidate.fused and e.candidate.sizes.get("tensor", 1) > 1}
    # (A layout whose products need no collective has no call to make.)
    assert any(n > 0 for n in fused_ops["cpu_here"].values()), fused_ops
    assert fused_ops["h100_nvlink"] and all(n == 0 for n in fused_ops["h100_nvlink"].values()), fused_ops

def test_temporaries_the_host_maps_afresh_are_priced_in_a_plan():
    # A step whose backward keeps a [65536 / 8, 1024] f32 activation (32 MiB
    # per device) has temporaries glibc maps afresh every step; a step of
    # 32 x 64 rows has none. Only the large one pays their first write, and
    # only where the machine has a rate for it.
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def step(w, x):
        return w - 0.1 * jax.grad(loss)(w, x), loss(w, x)

    large = (jax.ShapeDtypeStruct((64, 1024), jnp.float32), jax.ShapeDtypeStruct((65536, 64), jnp.float32))
    small = _small_step()[1:]
    sharing = max(DEVICES / commfuse._abi.machine_summary("cpu_here")["shared_processors"], 1.0)
    extra = {}
    for name, args in (("large", large), ("small", small)):
        memory = {}
        for touch in (0, 1):
            machine = f"cpu_here:mem_gbytes_per_s=40,touch_gbytes_per_s={touch}"
            plan = commfuse.plan(step, *args, devices=DEVICES, axes=("data",), top=1, machine=machine)
            memory[touch] = {c.label(): e.priced.by_kind["memory"] for c, e in plan.evaluations.items() if e.ok}
        assert memory[0] and memory[0].keys() == memory[1].keys()
        extra[name] = [memory[1][c] - memory[0][c] for c in memory[0]]
    # At 1 GB/s per unshared device, at least 32 MiB each.
    assert all(e >= (32 << 20) / 1e9 * sharing for e in extra["large"]), extra
    assert all(e == 0 for e in extra["small"]), extra
