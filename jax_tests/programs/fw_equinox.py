"""Equinox, written as Equinox's own docs write it: an ``eqx.Module``
transformer block (multi-head attention + MLP from ``eqx.nn.Linear``) that
maps one sequence, ``jax.vmap``-ed over the batch; trained with optax by an
``eqx.filter_jit`` step whose loss comes from ``eqx.filter_value_and_grad``;
the model sharded tensor-parallel over ``model`` (q/k/v/up column-parallel,
o/down row-parallel) and the batch over ``data`` with ``eqx.filter_shard``
(a pytree of ``NamedSharding`` matching the model's arrays).

Equinox is imported inside the functions (see ``fw_nnx``).
"""

from __future__ import annotations

import numpy as np

MESH = {"data": 2, "model": 2}
BATCH, SEQ, D, HEADS, FF = 8, 8, 32, 4, 64
LR = 1e-2


def _classes():
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    class Attention(eqx.Module):
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        o: eqx.nn.Linear
        heads: int = eqx.field(static=True)

        def __init__(self, d, heads, *, key):
            kq, kk, kv, ko = jax.random.split(key, 4)
            self.q = eqx.nn.Linear(d, d, use_bias=False, key=kq)
            self.k = eqx.nn.Linear(d, d, use_bias=False, key=kk)
            self.v = eqx.nn.Linear(d, d, use_bias=False, key=kv)
            self.o = eqx.nn.Linear(d, d, key=ko)
            self.heads = heads

        def __call__(self, x):  # x: [seq, d]
            s, d = x.shape
            q, k, v = (jax.vmap(proj)(x).reshape(s, self.heads, d // self.heads) for proj in (self.q, self.k, self.v))
            scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(d // self.heads)
            scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
            ctx = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(s, d)
            return jax.vmap(self.o)(ctx)

    class MLP(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, d, ff, *, key):
            ku, kd = jax.random.split(key)
            self.up = eqx.nn.Linear(d, ff, key=ku)
            self.down = eqx.nn.Linear(ff, d, key=kd)

        def __call__(self, x):
            return jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attn: Attention
        norm2: eqx.nn.LayerNorm
        mlp: MLP

        def __init__(self, *, key):
            ka, km = jax.random.split(key)
            self.norm1 = eqx.nn.LayerNorm(D)
            self.attn = Attention(D, HEADS, key=ka)
            self.norm2 = eqx.nn.LayerNorm(D)
            self.mlp = MLP(D, FF, key=km)

        def __call__(self, x):
            x = x + self.attn(jax.vmap(self.norm1)(x))
            return x + self.mlp(jax.vmap(self.norm2)(x))

    return Block


def shardings(model, mesh):
    """A pytree of NamedSharding for the model's arrays: Megatron's tensor parallelism over `model`."""
    import equinox as eqx
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicated = NamedSharding(mesh, P())
    column, row, column_bias = (NamedSharding(mesh, P("model", None)), NamedSharding(mesh, P(None, "model")),
                                NamedSharding(mesh, P("model")))
    spec = jax.tree.map(lambda _: replicated, eqx.filter(model, eqx.is_array))
    return eqx.tree_at(
        lambda m: (m.attn.q.weight, m.attn.k.weight, m.attn.v.weight, m.attn.o.weight,
                   m.mlp.up.weight, m.mlp.up.bias, m.mlp.down.weight),
        spec, (column, column, column, row, column, column_bias, row))


def create(mesh, *, seed: int = 0, lr: float = LR):
    """(model, model_shardings, optimizer, opt_state), placed on `mesh`."""
    import equinox as eqx
    import jax
    import optax

    model = _classes()(key=jax.random.PRNGKey(seed))
    model_shardings = shardings(model, mesh)
    model = eqx.filter_shard(model, model_shardings)
    optimizer = optax.adam(lr)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    return model, model_shardings, optimizer, opt_state


def batch(mesh, seed: int = 0):
    import equinox as eqx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SEQ, D)).astype(np.float32)
    y = np.tanh(rng.standard_normal((BATCH, SEQ, D))).astype(np.float32)
    data = NamedSharding(mesh, P("data"))
    return eqx.filter_shard(x, data), eqx.filter_shard(y, data)


def loss_fn(model, x, y):
    import jax
    import jax.numpy as jnp

    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_step(optimizer, model_shardings, data_sharding):
    """The train step (undecorated: the test wraps it in eqx.filter_jit, with or without overlap)."""
    import equinox as eqx

    def step(model, opt_state, x, y):
        x, y = eqx.filter_shard((x, y), data_sharding)
        model = eqx.filter_shard(model, model_shardings)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        model = eqx.filter_shard(model, model_shardings)
        return loss, model, opt_state

    return step


def value_and_grads(model, x, y):
    import equinox as eqx

    return eqx.filter_value_and_grad(loss_fn)(model, x, y)
