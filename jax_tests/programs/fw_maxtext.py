"""A MaxText-style decoder: parameters as plain pytrees (float32), the
layers stacked on a leading axis and run by ``jax.lax.scan`` over a
``jax.checkpoint``-ed layer (remat policy ``nothing_saveable`` or
``dots_saveable``), activations in bfloat16, sharded ``fsdp x tensor`` the
way MaxText's logical axis rules shard them (``embed -> fsdp``,
``mlp/heads/vocab -> tensor``, ``activation_batch -> fsdp``): NamedSharding
inputs, ``with_sharding_constraint`` on activations, ``jax.jit`` with in and
out shardings; no shard_map.

Each dense projection is MaxText's ``DenseGeneral``: the contracted axes of
the input are flattened against the leading axes of the kernel, one matmul,
reshaped back. ``matmul`` (``jnp.matmul`` by default) is that one product,
so the same program runs with ``commfuse.matmul`` in its place.
"""

from __future__ import annotations

import math

import numpy as np

MESH = {"fsdp": 2, "tensor": 2}
LAYERS, BATCH, SEQ, EMBED, HEADS, HEAD_DIM, MLP, VOCAB = 2, 4, 16, 32, 4, 8, 64, 64
DTYPE = "bfloat16"

# Logical axis -> mesh axis (MaxText's `logical_axis_rules`, trimmed).
RULES = {
    "activation_batch": "fsdp", "activation_length": None, "activation_embed": None,
    "activation_heads": "tensor", "activation_mlp": "tensor", "activation_vocab": "tensor",
    "layers": None, "embed": "fsdp", "heads": "tensor", "kv": None, "mlp": "tensor", "vocab": "tensor",
    "norm": None,
}

# Logical axes of each parameter (stacked layers first).
PARAM_AXES = {
    "token_embedder": ("vocab", "embed"),
    "decoder": {
        "pre_attention_norm": ("layers", "norm"),
        "query": ("layers", "embed", "heads", "kv"),
        "key": ("layers", "embed", "heads", "kv"),
        "value": ("layers", "embed", "heads", "kv"),
        "out": ("layers", "heads", "kv", "embed"),
        "pre_mlp_norm": ("layers", "norm"),
        "wi": ("layers", "embed", "mlp"),
        "wo": ("layers", "mlp", "embed"),
    },
    "decoder_norm": ("norm",),
    "logits_dense": ("embed", "vocab"),
}


def logical_to_spec(axes):
    from jax.sharding import PartitionSpec as P

    return P(*(RULES[a] for a in axes))


def param_shardings(mesh):
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda axes: NamedSharding(mesh, logical_to_spec(axes)), PARAM_AXES,
                        is_leaf=lambda a: isinstance(a, tuple))


def init_params(mesh, seed: int = 0):
    """float32 parameters, placed with their shardings."""
    import jax

    return jax.device_put(_numpy_params(seed), param_shardings(mesh))


def _numpy_params(seed):
    rng = np.random.default_rng(seed)
    L = LAYERS

    def dense(shape, fan_in):
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

    def norm(shape):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    params = {
        "token_embedder": dense((VOCAB, EMBED), 1.0),
        "decoder": {
            "pre_attention_norm": norm((L, EMBED)),
            "query": dense((L, EMBED, HEADS, HEAD_DIM), EMBED),
            "key": dense((L, EMBED, HEADS, HEAD_DIM), EMBED),
            "value": dense((L, EMBED, HEADS, HEAD_DIM), EMBED),
            "out": dense((L, HEADS, HEAD_DIM, EMBED), HEADS * HEAD_DIM),
            "pre_mlp_norm": norm((L, EMBED)),
            "wi": dense((L, EMBED, MLP), EMBED),
            "wo": dense((L, MLP, EMBED), MLP),
        },
        "decoder_norm": norm((EMBED,)),
        "logits_dense": dense((EMBED, VOCAB), EMBED),
    }
    return params


def batch(mesh, seed: int = 0):
    """Token ids and next-token targets, batch over `fsdp`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(seed + 1)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    sharding = NamedSharding(mesh, P("fsdp", None))
    return jax.device_put(tokens[:, :-1], sharding), jax.device_put(tokens[:, 1:], sharding)


def make_model(mesh, *, matmul=None, policy: str = "nothing_saveable"):
    """forward(params, tokens) -> float32 logits; `matmul` is DenseGeneral's one product."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    matmul = matmul or jnp.matmul
    dtype = jnp.dtype(DTYPE)

    def constrain(x, *logical):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical)))

    def dense_general(x, kernel, n_contract=1):
        """x's last `n_contract` axes against the kernel's first ones (MaxText's DenseGeneral)."""
        kernel = kernel.astype(dtype)
        k = math.prod(kernel.shape[:n_contract])
        out = kernel.shape[n_contract:]
        y = matmul(x.reshape(*x.shape[:-n_contract], k), kernel.reshape(k, math.prod(out)))
        return y.reshape(*x.shape[:-n_contract], *out)

    def rms_norm(x, scale):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * scale).astype(dtype)

    def attention(x, p):
        q = constrain(dense_general(x, p["query"]), "activation_batch", "activation_length", "activation_heads", "kv")
        k = constrain(dense_general(x, p["key"]), "activation_batch", "activation_length", "activation_heads", "kv")
        v = constrain(dense_general(x, p["value"]), "activation_batch", "activation_length", "activation_heads", "kv")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(HEAD_DIM)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(dtype)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        ctx = constrain(ctx, "activation_batch", "activation_length", "activation_heads", "kv")
        return dense_general(ctx, p["out"], n_contract=2)

    def mlp(x, p):
        h = constrain(jax.nn.gelu(dense_general(x, p["wi"])), "activation_batch", "activation_length",
                      "activation_mlp")
        return dense_general(h, p["wo"])

    def decoder_layer(x, p):
        x = constrain(x, "activation_batch", "activation_length", "activation_embed")
        x = x + constrain(attention(rms_norm(x, p["pre_attention_norm"]), p),
                          "activation_batch", "activation_length", "activation_embed")
        x = x + constrain(mlp(rms_norm(x, p["pre_mlp_norm"]), p),
                          "activation_batch", "activation_length", "activation_embed")
        return x, None

    remat_layer = jax.checkpoint(decoder_layer, policy=getattr(jax.checkpoint_policies, policy), prevent_cse=False)

    def forward(params, tokens):
        x = jnp.take(params["token_embedder"].astype(dtype), tokens, axis=0)
        x = constrain(x, "activation_batch", "activation_length", "activation_embed")
        x, _ = jax.lax.scan(remat_layer, x, params["decoder"])
        x = rms_norm(x, params["decoder_norm"])
        logits = dense_general(x, params["logits_dense"])
        return constrain(logits.astype(jnp.float32), "activation_batch", "activation_length", "activation_vocab")

    return forward


def loss_fn(forward):
    import jax
    import jax.numpy as jnp

    def loss(params, tokens, targets):
        logits = forward(params, tokens)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss


def make_train_step(forward, optimizer, *, with_grads: bool = False):
    """MaxText's train_step shape: (state, batch) -> (new state, metrics);
    `with_grads` adds the gradients to the metrics (for the tests)."""
    import jax
    import optax

    loss = loss_fn(forward)

    def train_step(params, opt_state, tokens, targets):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": value, "grad_norm": optax.tree.norm(grads)}
        if with_grads:
            metrics["grads"] = grads
        return params, opt_state, metrics

    return train_step


def opt_state_shardings(optimizer, mesh):
    """The optimizer state's shardings: each moment as its parameter, the rest replicated."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _numpy_params(0))
    return optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, abstract),
                                 param_shardings(mesh), transform_non_params=lambda _: NamedSharding(mesh, P()))


def init_opt_state(optimizer, params, mesh):
    import jax

    return jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, mesh))(params)


def jit_train_step(train_step, mesh, optimizer, *, with_grads: bool = False):
    """``jax.jit`` with MaxText's in/out shardings (the state sharded as the
    parameters, the gradients in the metrics too)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    state_shardings = (param_shardings(mesh), opt_state_shardings(optimizer, mesh))
    data, replicated = NamedSharding(mesh, P("fsdp", None)), NamedSharding(mesh, P())
    metrics = {"loss": replicated, "grad_norm": replicated}
    if with_grads:
        metrics["grads"] = state_shardings[0]
    return jax.jit(train_step, in_shardings=(*state_shardings, data, data), out_shardings=(*state_shardings, metrics))
