"""A Flax NNX transformer block, tensor-parallel the way Flax's GSPMD guide
writes it, trained plain and through ``commfuse.overlap``.

Run as ``python -m commfuse.examples.nnx_tp [--steps 5]`` (needs the
``examples`` extra: ``pip install ".[examples]"`` for flax and optax).

No shard_map: the parameters carry their shardings
(``nnx.with_partitioning``: q/k/v and the MLP's first weight column-parallel
over ``model``, the output projections row-parallel), the batch is sharded
over ``data``, activations are pinned with ``with_sharding_constraint``, and
``jax.jit`` partitions the step. ``commfuse.overlap(train_step)`` replaces
its dots with ``commfuse.matmul``; once the shardings are known each becomes
the fused op they call for (here the row-parallel products' all-reduce over
``model``, forward and backward, and the data-parallel weight gradients'
all-reduce over ``data``). The example prints both runs' losses, the fused
ops in the compiled step, and each product's choice.
"""

from __future__ import annotations

import argparse
import os
import sys


def _host_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def build(mesh, *, d=64, heads=4, ff=128, seed=0):
    """The model and optimizer, created sharded on `mesh` (axes data, model)."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    init = nnx.initializers.lecun_normal()

    def linear(i, o, spec, rngs):
        return nnx.Linear(i, o, use_bias=False, kernel_init=nnx.with_partitioning(init, spec), rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm1 = nnx.LayerNorm(d, rngs=rngs)
            self.q, self.k, self.v = (linear(d, d, (None, "model"), rngs) for _ in range(3))
            self.o = linear(d, d, ("model", None), rngs)
            self.norm2 = nnx.LayerNorm(d, rngs=rngs)
            self.up = linear(d, ff, (None, "model"), rngs)
            self.down = linear(ff, d, ("model", None), rngs)

        def __call__(self, x):
            def constrain(a, *spec):
                return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

            b, s, _ = x.shape
            h = self.norm1(x)
            q, k, v = (constrain(proj(h), "data", None, "model").reshape(b, s, heads, d // heads)
                       for proj in (self.q, self.k, self.v))
            scores = jax.numpy.einsum("bqhk,bthk->bhqt", q, k) * (d // heads) ** -0.5
            ctx = jax.numpy.einsum("bhqt,bthk->bqhk", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, d)
            x = x + constrain(self.o(constrain(ctx, "data", None, "model")), "data", None, None)
            up = constrain(jax.nn.gelu(self.up(self.norm2(x))), "data", None, "model")
            return x + constrain(self.down(up), "data", None, None)

    @nnx.jit
    def create():
        model = Block(nnx.Rngs(seed))
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_named_sharding(state, mesh)))
        return model

    with jax.set_mesh(mesh):
        model = create()
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    return model, optimizer


def train_step_fn():
    """The pure train step: (graphdef, state, x, y) -> (loss, new state)."""
    import jax.numpy as jnp
    from flax import nnx

    def train_step(graphdef, state, x, y):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    return train_step


def run(steps: int = 5, *, data: int = 2, model_axis: int = 4, batch: int = 8, seq: int = 16, d: int = 64,
        schedule: str = "auto", report: bool = False):
    """Trains plain and overlapped from the same start; returns (plain losses,
    overlapped losses, fused ops in the compiled overlapped step, its report)."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import commfuse

    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((data, model_axis), ("data", "model"), axis_types=auto,
                         devices=jax.devices()[:data * model_axis])
    rng = np.random.default_rng(0)
    batch_sharding = NamedSharding(mesh, P("data", None, None))
    x = jax.device_put(rng.standard_normal((batch, seq, d)).astype(np.float32), batch_sharding)
    y = jax.device_put(np.tanh(rng.standard_normal((batch, seq, d))).astype(np.float32), batch_sharding)
    step = train_step_fn()
    results = {}
    for name, wrap in (("plain", lambda f: f), ("overlap", lambda f: commfuse.overlap(f, schedule=schedule, report=report))):
        model, optimizer = build(mesh, d=d)
        graphdef, state = nnx.split((model, optimizer))
        wrapped = wrap(step)
        jitted = jax.jit(lambda s, a, b, _w=wrapped, _g=graphdef: _w(_g, s, a, b))
        losses = []
        with jax.set_mesh(mesh):
            for _ in range(steps):
                loss, state = jitted(state, x, y)
                losses.append(float(loss))
            text = jitted.lower(state, x, y).compile().as_text()
        results[name] = (losses, text.count('custom_call_target="commfuse_collective_matmul'),
                         getattr(wrapped, "last_report", []))
    plain, fused = results["plain"], results["overlap"]
    return plain[0], fused[0], fused[1], fused[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", default="auto",
                        help="given to every fused op (auto: the cost model's pick, which on CPU at these sizes is "
                             "mostly XLA's own collective; ring fuses every one)")
    parser.add_argument("--report", action="store_true", help="print overlap's report")
    args = parser.parse_args(argv)
    _host_devices(8)
    try:
        import flax  # noqa: F401
        import optax  # noqa: F401
    except ImportError as e:
        print(f"commfuse.examples.nnx_tp needs flax and optax: pip install \".[examples]\" ({e})", file=sys.stderr)
        return 2
    plain, fused, count, report = run(args.steps, schedule=args.schedule, report=args.report)
    print("Flax NNX block, mesh data=2 x model=4 on 8 CPU devices, jit + NamedSharding (no shard_map), "
          f"schedule={args.schedule!r}")
    print(f"{'step':>4} {'plain loss':>12} {'overlap loss':>13}")
    for i, (a, b) in enumerate(zip(plain, fused)):
        print(f"{i:>4} {a:>12.6f} {b:>13.6f}")
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain, fused))
    print(f"largest relative loss difference: {worst:.2e}")
    print(f"fused ops in the compiled overlapped step (after partitioning): {count}")
    for line in report:
        if line.startswith("overlap[partitioned]"):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
