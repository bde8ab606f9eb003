"""Mixture-of-experts layers inside ``jax.shard_map``, as expert-parallel
MoE code (GShard / Switch style, einsum dispatch) writes them.

``make_ep``: experts over ``ep`` (two per device). Each device routes its own
tokens (top-1 router with a capacity), dispatches them with an einsum
(``dot``: tokens x one-hot dispatch mask -> ``[experts, capacity, d]``),
``all_to_all``s the expert dim over ``ep``, runs its experts' FFN as grouped
matmuls (``einsum`` with the expert dim as a batch dim), ``all_to_all``s the
results back and combines them (another einsum, weighted by the gate).

``make_ep_tp``: experts over ``ep`` and each expert's FFN tensor-parallel
over ``tp`` with sequence-parallel tokens: after the expert ``all_to_all``
the tokens of the ``tp`` group are all-gathered, the up projection is
column-parallel, the down projection row-parallel, and its grouped product is
``psum_scatter``-ed back to each device's tokens before the return
``all_to_all``.
"""

from __future__ import annotations

import numpy as np

EP_MESH = {"ep": 4}
EP_TP_MESH = {"ep": 2, "tp": 2}
TOKENS, D, FF, EXPERTS_PER_DEVICE, CAPACITY = 16, 16, 32, 2, 8


def _route(x, w_router, experts):
    """Top-1 routing with a capacity: (dispatch mask [t, e, c], combine weights [t, e, c])."""
    import jax
    import jax.numpy as jnp

    logits = x @ w_router
    probs = jax.nn.softmax(logits, axis=-1)
    expert = jnp.argmax(logits, axis=-1)
    onehot = jax.nn.one_hot(expert, experts, dtype=x.dtype)
    position = (jnp.cumsum(onehot, axis=0) - 1.0) * onehot  # slot of each token in its expert
    keep = onehot * (position < CAPACITY)
    dispatch = keep[:, :, None] * jax.nn.one_hot(position.astype(jnp.int32), CAPACITY, dtype=x.dtype)
    gate = jnp.sum(probs * onehot, axis=-1)
    return dispatch, dispatch * gate[:, None, None]


def _init(mesh, rng, experts, ff):
    return {
        "router": (rng.standard_normal((D, experts)) / np.sqrt(D)).astype(np.float32),
        "w_in": (rng.standard_normal((experts, D, ff)) / np.sqrt(D)).astype(np.float32),
        "w_out": (rng.standard_normal((experts, ff, D)) / np.sqrt(ff)).astype(np.float32),
    }


def make_ep(mesh, seed: int = 0):
    """(fn, args): fn(x, y, params) -> (loss, out); experts over `ep`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["ep"]
    experts = n * EXPERTS_PER_DEVICE
    rng = np.random.default_rng(seed)

    def moe(x, y, params):
        dispatch, combine = _route(x, params["router"], experts)
        dispatched = jnp.einsum("tec,td->ecd", dispatch, x)                       # [E, C, d]
        routed = jax.lax.all_to_all(dispatched, "ep", 0, 1, tiled=True)           # [E/n, n*C, d]
        h = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", routed, params["w_in"]))       # grouped matmul
        out = jnp.einsum("ecf,efd->ecd", h, params["w_out"])                      # grouped matmul
        back = jax.lax.all_to_all(out, "ep", 1, 0, tiled=True)                    # [E, C, d]
        y_hat = x + jnp.einsum("tec,ecd->td", combine, back)
        return jax.lax.psum(jnp.mean((y_hat - y) ** 2), "ep") / n, y_hat

    params = _init(mesh, rng, experts, FF)
    specs = {"router": P(), "w_in": P("ep"), "w_out": P("ep")}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    rows = NamedSharding(mesh, P("ep"))
    x = jax.device_put(rng.standard_normal((n * TOKENS, D)).astype(np.float32), rows)
    y = jax.device_put(rng.standard_normal((n * TOKENS, D)).astype(np.float32), rows)
    fn = jax.shard_map(moe, mesh=mesh, in_specs=(P("ep"), P("ep"), specs), out_specs=(P(), P("ep")))
    return fn, (x, y, params)


def make_ep_tp(mesh, seed: int = 0):
    """(fn, args): experts over `ep`, each expert's FFN tensor-parallel over `tp`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n_ep, n_tp = mesh.shape["ep"], mesh.shape["tp"]
    experts = n_ep * EXPERTS_PER_DEVICE
    rng = np.random.default_rng(seed)

    def moe(x, y, params):
        dispatch, combine = _route(x, params["router"], experts)
        dispatched = jnp.einsum("tec,td->ecd", dispatch, x)                       # [E, C, d]
        routed = jax.lax.all_to_all(dispatched, "ep", 0, 1, tiled=True)           # [E/ep, ep*C, d]
        tokens = jax.lax.all_gather(routed, "tp", axis=1, tiled=True)             # the tp group's tokens
        h = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", tokens, params["w_in"]))       # column-parallel
        partial = jnp.einsum("ecf,efd->ecd", h, params["w_out"])                  # row-parallel
        out = jax.lax.psum_scatter(partial, "tp", scatter_dimension=1, tiled=True)
        back = jax.lax.all_to_all(out, "ep", 1, 0, tiled=True)                    # [E, C, d]
        y_hat = x + jnp.einsum("tec,ecd->td", combine, back)
        return jax.lax.psum(jnp.mean((y_hat - y) ** 2), ("ep", "tp")) / (n_ep * n_tp), y_hat

    params = _init(mesh, rng, experts, FF)
    specs = {"router": P(), "w_in": P("ep", None, "tp"), "w_out": P("ep", "tp", None)}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    rows = NamedSharding(mesh, P(("ep", "tp")))
    x = jax.device_put(rng.standard_normal((n_ep * n_tp * TOKENS, D)).astype(np.float32), rows)
    y = jax.device_put(rng.standard_normal((n_ep * n_tp * TOKENS, D)).astype(np.float32), rows)
    fn = jax.shard_map(moe, mesh=mesh, in_specs=(P(("ep", "tp")), P(("ep", "tp")), specs),
                       out_specs=(P(), P(("ep", "tp"))))
    return fn, (x, y, params)
