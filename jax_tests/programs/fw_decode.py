"""Greedy-style decoding through a tensor-parallel MLP under ``jax.jit``:
the weights are ``NamedSharding`` inputs (``w_up`` column-parallel,
``w_down`` row-parallel over ``tp``), the decode state holds 1, 2 or 4 rows
(the batch being decoded), and each step feeds the last hidden state back:
``h <- norm(h + gelu(h @ w_up) @ w_down)``, written to an output buffer.
The loop is a ``jax.lax.fori_loop`` inside the jitted function, or a Python
loop around a jitted step (how serving code steps a KV-cache-free toy model).

``matmul`` is the product the step uses: ``jnp.matmul``, or
``commfuse.matmul`` with a schedule (the jit way in).
"""

from __future__ import annotations

import numpy as np

MESH = {"tp": 4}
D, FF = 32, 64


def init(mesh, rows: int, seed: int = 0):
    """(h0, w_up, w_down) placed on `mesh`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(seed)
    h0 = jax.device_put(rng.standard_normal((rows, D)).astype(np.float32), NamedSharding(mesh, P()))
    w_up = jax.device_put((rng.standard_normal((D, FF)) / np.sqrt(D)).astype(np.float32),
                          NamedSharding(mesh, P(None, "tp")))
    w_down = jax.device_put((rng.standard_normal((FF, D)) / np.sqrt(FF)).astype(np.float32),
                            NamedSharding(mesh, P("tp", None)))
    return h0, w_up, w_down


def make_step(mesh, matmul=None):
    """step(h, w_up, w_down) -> next h (rows replicated, hidden split over tp)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    matmul = matmul or jnp.matmul

    def step(h, w_up, w_down):
        up = jax.lax.with_sharding_constraint(jax.nn.gelu(matmul(h, w_up)), NamedSharding(mesh, P(None, "tp")))
        out = jax.lax.with_sharding_constraint(h + matmul(up, w_down), NamedSharding(mesh, P()))
        return out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + 1e-6)

    return step


def make_decode(mesh, tokens: int, matmul=None):
    """decode(h0, w_up, w_down) -> [tokens, rows, D]: a fori_loop over `step`."""
    import jax
    import jax.numpy as jnp

    step = make_step(mesh, matmul)

    def decode(h0, w_up, w_down):
        def body(i, carry):
            h, buf = carry
            h = step(h, w_up, w_down)
            return h, jax.lax.dynamic_update_index_in_dim(buf, h, i, axis=0)

        buf = jnp.zeros((tokens,) + h0.shape, h0.dtype)
        _, buf = jax.lax.fori_loop(0, tokens, body, (h0, buf))
        return buf

    return decode


def python_loop(step, h0, w_up, w_down, tokens: int):
    """The serving loop: a jitted step called once per token."""
    out, h = [], h0
    for _ in range(tokens):
        h = step(h, w_up, w_down)
        out.append(np.asarray(h))
    return np.stack(out)
