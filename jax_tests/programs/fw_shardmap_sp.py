"""A Megatron tensor- and sequence-parallel MLP block written with
``jax.shard_map`` (``check_vma=False``, as code ported from ``pmap``/older
shard_map writes it), the optimizer update inside the body: each device
holds its rows of the sequence; the block all-gathers the rows, multiplies by
its column shard of ``w_in``, applies gelu, multiplies by its row shard of
``w_out`` and reduce-scatters the rows back (``psum_scatter``); the loss is
``psum``-ed, ``jax.value_and_grad`` taken in the body, and optax's adam
(state sharded like the parameters) applied there too.

``fused=True`` writes the same body with commfuse's named ops
(``all_gather_matmul``, ``matmul_reduce_scatter``): the shard_map way in.
"""

from __future__ import annotations

import numpy as np

MESH = {"tp": 4}
ROWS, D, FF = 32, 32, 64  # rows per device, model dim, hidden dim
LR = 1e-2


def param_specs():
    from jax.sharding import PartitionSpec as P

    return {"w_in": P(None, "tp"), "b_in": P("tp"), "w_out": P("tp", None)}


def init(mesh, seed: int = 0, lr: float = LR):
    """(params, optimizer, opt_state, x, y), placed on `mesh`."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(seed)
    n = mesh.shape["tp"]
    params = {
        "w_in": (rng.standard_normal((D, FF)) / np.sqrt(D)).astype(np.float32),
        "b_in": (0.1 * rng.standard_normal((FF,))).astype(np.float32),
        "w_out": (rng.standard_normal((FF, D)) / np.sqrt(FF)).astype(np.float32),
    }
    specs = param_specs()
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    optimizer = optax.adam(lr)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_specs(optimizer, mesh, sharding=True))(params)
    rows = NamedSharding(mesh, P("tp", None))
    x = jax.device_put(rng.standard_normal((n * ROWS, D)).astype(np.float32), rows)
    y = jax.device_put(np.tanh(rng.standard_normal((n * ROWS, D))).astype(np.float32), rows)
    return params, optimizer, opt_state, x, y


def opt_specs(optimizer, mesh=None, *, sharding=False):
    """The adam state's specs: each moment as its parameter, the step count replicated."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shapes = {"w_in": (D, FF), "b_in": (FF,), "w_out": (FF, D)}
    abstract = jax.eval_shape(optimizer.init, {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in shapes.items()})
    specs = param_specs()
    if sharding:
        specs = {k: NamedSharding(mesh, v) for k, v in specs.items()}
    rest = NamedSharding(mesh, P()) if sharding else P()
    return optax.tree_map_params(optimizer, lambda _, s: s, abstract, specs, transform_non_params=lambda _: rest)


def block(params, x, *, fused: bool = False, schedule: str = "auto"):
    """The TP+SP MLP on this device's rows (inside the shard_map)."""
    import jax

    if fused:
        import commfuse

        h = commfuse.all_gather_matmul(x, params["w_in"], "tp", schedule=schedule)
        h = jax.nn.gelu(h + params["b_in"])
        return commfuse.matmul_reduce_scatter(h, params["w_out"], "tp", schedule=schedule)
    h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ params["w_in"]
    h = jax.nn.gelu(h + params["b_in"])
    return jax.lax.psum_scatter(h @ params["w_out"], "tp", scatter_dimension=0, tiled=True)


def _loss_fn(x, y, n, **kw):
    import jax
    import jax.numpy as jnp

    def loss_fn(params):
        out = x + block(params, x, **kw)
        return jax.lax.psum(jnp.sum((out - y) ** 2), "tp") / (ROWS * D * n)

    return loss_fn


def make_step(mesh, optimizer, **kw):
    """step(params, opt_state, x, y) -> (loss, params, opt_state): one shard_map
    (``fused=True, schedule=...``: commfuse's named ops in the body)."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    def body(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_loss_fn(x, y, mesh.shape["tp"], **kw))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    specs, ospecs = param_specs(), opt_specs(optimizer)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, ospecs, P("tp"), P("tp")),
                         out_specs=(P(), specs, ospecs), check_vma=False)


def make_grads(mesh, **kw):
    """(params, x, y) -> (loss, grads): the same loss's gradients, no update."""
    import jax
    from jax.sharding import PartitionSpec as P

    def body(params, x, y):
        return jax.value_and_grad(_loss_fn(x, y, mesh.shape["tp"], **kw))(params)

    specs = param_specs()
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P("tp"), P("tp")), out_specs=(P(), specs),
                         check_vma=False)
