"""Flax NNX, written as Flax's own sharding guide writes it: a transformer
block (attention + MLP) whose parameters carry their partitioning
(``nnx.with_partitioning``) on a ``data x model`` mesh, created sharded under
``nnx.jit``, trained with optax through ``nnx.Optimizer`` by an ``nnx.jit``
train step that updates the model and the optimizer in place
(``optimizer.update(model, grads)``), its loss from ``nnx.value_and_grad``.

``NoisyBlock`` adds the state a real model carries besides its parameters:
``nnx.BatchNorm`` running statistics, a step counter (an ``nnx.BatchStat``
bumped on every call) and ``nnx.Dropout`` drawing from ``nnx.Rngs`` (its
RNG count advances every step).

Flax is imported inside the functions: ``programs/__init__`` imports every
module of this package, and the rest of the suite runs without flax.
"""

from __future__ import annotations

import numpy as np

MESH = {"data": 2, "model": 2}
BATCH, SEQ, D, HEADS, FF = 8, 8, 32, 4, 64
LR = 1e-2


def _classes(mesh):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    kernel_init = nnx.initializers.lecun_normal()

    def constrain(a, *spec):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

    def linear(din, dout, spec, rngs, *, use_bias=False):
        return nnx.Linear(din, dout, use_bias=use_bias, kernel_init=nnx.with_partitioning(kernel_init, spec),
                          bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (spec[1],)), rngs=rngs)

    class Attention(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.q = linear(D, D, (None, "model"), rngs)
            self.k = linear(D, D, (None, "model"), rngs)
            self.v = linear(D, D, (None, "model"), rngs)
            self.o = linear(D, D, ("model", None), rngs)

        def __call__(self, x):
            b, s, _ = x.shape
            q, k, v = (constrain(proj(x), "data", None, "model").reshape(b, s, HEADS, D // HEADS)
                       for proj in (self.q, self.k, self.v))
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
            causal = jnp.tril(jnp.ones((s, s), bool))
            probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
            ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, D)
            return constrain(self.o(constrain(ctx, "data", None, "model")), "data", None, None)

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = linear(D, FF, (None, "model"), rngs, use_bias=True)
            self.down = linear(FF, D, ("model", None), rngs)

        def __call__(self, x):
            h = constrain(nnx.gelu(self.up(x)), "data", None, "model")
            return constrain(self.down(h), "data", None, None)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm1 = nnx.LayerNorm(D, rngs=rngs)
            self.attn = Attention(rngs)
            self.norm2 = nnx.LayerNorm(D, rngs=rngs)
            self.mlp = MLP(rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class NoisyBlock(nnx.Module):
        """An MLP block with batch statistics, a step counter and dropout."""

        def __init__(self, rngs: nnx.Rngs):
            self.up = linear(D, FF, (None, "model"), rngs)
            self.bn = nnx.BatchNorm(FF, momentum=0.9, use_running_average=False,
                                    scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("model",)),
                                    bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
                                    rngs=rngs)
            self.drop = nnx.Dropout(0.25, rngs=rngs)
            self.down = linear(FF, D, ("model", None), rngs)
            self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.calls[...] += 1
            h = constrain(self.up(x), "data", None, "model")
            h = self.drop(nnx.gelu(self.bn(h)))
            return x + constrain(self.down(h), "data", None, None)

    return Block, NoisyBlock


def create(mesh, *, noisy: bool = False, seed: int = 0, lr: float = LR):
    """(model, optimizer), created sharded on `mesh` the way Flax's guide does."""
    import jax
    import optax
    from flax import nnx

    Block, NoisyBlock = _classes(mesh)
    cls = NoisyBlock if noisy else Block

    @nnx.jit
    def create_sharded_model():
        model = cls(rngs=nnx.Rngs(params=seed, dropout=seed + 1))
        state = nnx.state(model)
        pspecs = nnx.get_partition_spec(state)
        nnx.update(model, jax.lax.with_sharding_constraint(state, pspecs))
        return model

    with jax.set_mesh(mesh):
        model = create_sharded_model()
        optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
    return model, optimizer


def batch(mesh, seed: int = 0):
    """Inputs and regression targets, sharded over `data`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(seed)
    sharding = NamedSharding(mesh, P("data", None, None))
    x = rng.standard_normal((BATCH, SEQ, D)).astype(np.float32)
    y = np.tanh(rng.standard_normal((BATCH, SEQ, D))).astype(np.float32)
    return jax.device_put(x, sharding), jax.device_put(y, sharding)


def loss_fn(model, x, y):
    import jax.numpy as jnp

    return jnp.mean((model(x) - y) ** 2)


def train_step(model, optimizer, x, y):
    """One step, in place: the model's and the optimizer's state change."""
    from flax import nnx

    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def value_and_grads(model, x, y):
    """Loss and gradients, no update (the gradients as an nnx.State)."""
    from flax import nnx

    return nnx.value_and_grad(loss_fn)(model, x, y)
