"""Train a small transformer block with commfuse's fused collective matmuls.

Run as ``python -m commfuse.examples.train_block [--steps 20] [--both|--fused|--unfused]``
(needs the ``examples`` extra: ``pip install ".[examples]"`` for optax and equinox).

The program fakes 8 host (CPU) devices and lays them out as a mesh
``(dp=2, tp=4)``. Per device (local sizes after the shard_map split)::

    x        [B/dp, S/tp, d]      batch over dp, sequence over tp (sequence parallelism)

    attention:  h   = layer_norm(x)                       on the local sequence rows
                qkv = gather_tp(h) @ [Wq|Wk|Wv]           column-parallel: the tp rank's heads
                o   = causal_attention(q, k, v)           local heads, whole sequence
                x  += reduce_scatter_tp(o @ Wo) + bo      row-parallel, back to sequence rows
    MLP:        x  += reduce_scatter_tp(gelu(gather_tp(layer_norm(x)) @ W1 + b1) @ W2) + b2
    readout:    pred = x @ W_head + b_head                on the local rows; loss = MSE(pred, target)

The fused program computes ``gather_tp(h) @ W`` with ``commfuse.all_gather_matmul``
and ``reduce_scatter_tp(o @ W)`` with ``commfuse.matmul_reduce_scatter``; the
unfused twin writes the same maths with ``jax.lax.all_gather`` /
``jax.lax.psum_scatter`` (and lets JAX differentiate it).

Data parallelism is ZeRO-style: every parameter *and* its Adam state is stored
split over ``dp`` (each dp rank owns 1/dp of each tensor; tensor-parallel
weights are split over tp as well), so optax updates only the local shard. In
the step, each weight is all-gathered over dp before use, and each weight
gradient is summed over dp *and* scattered back to the owner's shard
(a reduce-scatter instead of an all-reduce). In the fused program:

- A weight gradient is a matmul over the local tokens, ``dW = Xᵀ @ dY``; its
  dp reduce-scatter is fused into that matmul with
  ``commfuse.matmul_reduce_scatter(Xᵀ, dY, "dp", scatter_dimension=...)``:
  rows for the column-parallel weights (split over dp by rows), the last dim
  (a column scatter) for the row-parallel ones (split over dp by columns).
  Those are the backward rules of the two layer functions below
  (``jax.custom_vjp``); the column layers' input gradient is a fused tp
  ``matmul_reduce_scatter`` as well.
- The readout weight is replicated over tp and split over dp by columns: the
  forward is ``commfuse.matmul_all_gather(x, W_head_shard, "dp")`` (the dp
  gather overlapped with the matmul), and differentiating it through
  commfuse's own VJP gives the fused column reduce-scatter of its gradient.
- The tp-parallel weights feed an op that is already fused over tp, and one
  op fuses only one collective, so their dp gather in the forward is a plain
  ``jax.lax.all_gather``; so is the tp re-gather of the activations (or of
  dY) that a weight gradient needs in the backward (as in Megatron-LM's
  sequence parallelism). Vectors (layer-norm gains, biases) are not matmul
  operands: both programs gather them with ``jax.lax.all_gather`` and JAX's
  transpose reduce-scatters their gradients with ``psum_scatter`` (summing
  them over tp too where they are replicated over tp).

Both programs start from the same parameters (an Equinox module, initialised
from a seed) and see the same seeded synthetic data; ``run(steps, fused)``
returns the per-step losses, and ``reference_train(steps)`` trains the same
module on one device without any sharding, as a check of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import commfuse

DP, TP = "dp", "tp"
DEVICES = 8
PRIMITIVE = "commfuse_collective_matmul"  # the JAX primitive every commfuse op binds

_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class Config:
    dp: int = 2
    tp: int = 4
    batch: int = 4  # global batch, split over dp
    seq: int = 64  # split over tp between the layers
    d_model: int = 64
    heads: int = 4  # split over tp inside attention
    d_ff: int = 256
    d_out: int = 32  # width of the regression target
    learning_rate: float = 1e-2
    seed: int = 0

    def check(self) -> None:
        dp, tp = self.dp, self.tp
        problems = [
            (self.batch % dp, f"batch {self.batch} % dp {dp}"),
            (self.seq % tp, f"seq {self.seq} % tp {tp}"),
            (self.heads % tp, f"heads {self.heads} % tp {tp}"),
            (self.d_model % self.heads, f"d_model {self.d_model} % heads {self.heads}"),
            (self.d_model % (dp * tp), f"d_model {self.d_model} % (dp*tp) {dp * tp}"),
            (self.d_ff % (dp * tp), f"d_ff {self.d_ff} % (dp*tp) {dp * tp}"),
            (self.d_out % dp, f"d_out {self.d_out} % dp {dp}"),
        ]
        bad = [msg for rem, msg in problems if rem]
        if bad:
            raise ValueError("train_block: sizes must divide evenly: " + ", ".join(bad) + " is not 0")


# --------------------------------------------------------------------------
# The model: an Equinox module holding the (global, unsharded) parameters,
# whose __call__ is the single-device reference forward pass.
# --------------------------------------------------------------------------
class Block(eqx.Module):
    ln1_g: jax.Array  # [d]
    ln1_b: jax.Array  # [d]
    wq: jax.Array  # [d, d]  columns: head-major, so a tp split of columns is a split of heads
    wk: jax.Array  # [d, d]
    wv: jax.Array  # [d, d]
    wo: jax.Array  # [d, d]  rows: head-major
    bo: jax.Array  # [d]
    ln2_g: jax.Array  # [d]
    ln2_b: jax.Array  # [d]
    w1: jax.Array  # [d, f]
    b1: jax.Array  # [f]
    w2: jax.Array  # [f, d]
    b2: jax.Array  # [d]
    w_head: jax.Array  # [d, d_out]
    b_head: jax.Array  # [d_out]
    heads: int = eqx.field(static=True, default=1)

    @staticmethod
    def init(cfg: Config) -> "Block":
        """Parameters from ``cfg.seed``: weights ~ N(0, 1/fan_in); gains near 1 and
        small non-zero biases (zeros would hide a lost gradient in a test)."""
        d, f, o = cfg.d_model, cfg.d_ff, cfg.d_out
        keys = iter(jax.random.split(jax.random.key(cfg.seed), 16))

        def weight(shape):
            return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])

        def vector(n, center=0.0):
            return center + 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)

        return Block(
            ln1_g=vector(d, 1.0), ln1_b=vector(d), wq=weight((d, d)), wk=weight((d, d)),
            wv=weight((d, d)), wo=weight((d, d)), bo=vector(d), ln2_g=vector(d, 1.0),
            ln2_b=vector(d), w1=weight((d, f)), b1=vector(f), w2=weight((f, d)), b2=vector(d),
            w_head=weight((d, o)), b_head=vector(o), heads=cfg.heads,
        )

    def __call__(self, x):
        """Reference forward pass on one device: ``x [B, S, d]`` -> ``[B, S, d_out]``."""
        h = layer_norm(x, self.ln1_g, self.ln1_b)
        o = causal_attention(h @ self.wq, h @ self.wk, h @ self.wv, self.heads)
        x = x + o @ self.wo + self.bo
        h = layer_norm(x, self.ln2_g, self.ln2_b)
        x = x + jax.nn.gelu(h @ self.w1 + self.b1) @ self.w2 + self.b2
        return x @ self.w_head + self.b_head


def param_specs(cfg: Config) -> Block:
    """How each parameter (and its Adam moments) is split over the mesh.

    Tensor parallelism puts tp on the heads / hidden units; ZeRO puts dp on
    the other dim of a matrix (rows of the column-parallel weights, columns of
    the row-parallel ones and of the readout) and on vectors.
    """
    vec = P(DP)  # replicated over tp, split over dp
    return Block(
        ln1_g=vec, ln1_b=vec,
        wq=P(DP, TP), wk=P(DP, TP), wv=P(DP, TP),  # column-parallel
        wo=P(TP, DP), bo=vec,  # row-parallel
        ln2_g=vec, ln2_b=vec,
        w1=P(DP, TP), b1=P((TP, DP)),  # b1 follows w1's tp split, then dp
        w2=P(TP, DP), b2=vec,
        w_head=P(None, DP), b_head=vec,
        heads=cfg.heads,
    )


# --------------------------------------------------------------------------
# Shared maths
# --------------------------------------------------------------------------
def layer_norm(x, g, b, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * g + b


def causal_attention(q, k, v, heads: int):
    """Softmax attention of ``q, k, v [b, S, heads * dh]`` with a causal mask."""
    b, s, width = q.shape
    dh = width // heads
    q, k, v = (a.reshape(b, s, heads, dh) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh).astype(np.float32)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, width)


def make_batch(cfg: Config, step: int):
    """The synthetic task: deterministic N(0, 1) tokens, and a target each
    position must predict from itself and the previous token (so attention
    has something to learn): ``tanh(x[s] @ C + x[s-1] @ A)``."""
    teacher = np.random.default_rng([cfg.seed, 2**31])
    c = teacher.standard_normal((cfg.d_model, cfg.d_out)) / np.sqrt(cfg.d_model)
    a = teacher.standard_normal((cfg.d_model, cfg.d_out)) / np.sqrt(cfg.d_model)
    x = np.random.default_rng([cfg.seed, step]).standard_normal((cfg.batch, cfg.seq, cfg.d_model))
    prev = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    y = np.tanh(x @ c + prev @ a)
    return x.astype(np.float32), y.astype(np.float32)


def _as_varying(x, axis):
    """Types a tp-replicated value as varying over ``axis`` (its transpose is a
    psum over ``axis``). The API was renamed across JAX versions."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axis, to="varying")
    if hasattr(jax.lax, "pvary"):  # pragma: no cover - older JAX
        return jax.lax.pvary(x, axis)
    return x  # pragma: no cover - JAX without varying-axis types


def _gather_dp(v, axis=0):
    return jax.lax.all_gather(v, DP, axis=axis, tiled=True)


# --------------------------------------------------------------------------
# The two sets of collective matmuls. x is [b, s, d] (local batch and
# sequence rows), h/o/u are [b, S, n] (whole sequence, local columns).
# --------------------------------------------------------------------------
class Unfused:
    """Plain jax.lax collectives; JAX differentiates them (the transpose of the
    dp all_gather of a weight is the psum_scatter of its gradient)."""

    @staticmethod
    def column(x, w_shard):  # w_shard [d/dp, n] -> [b, S, n]
        return jax.lax.all_gather(x, TP, axis=1, tiled=True) @ _gather_dp(w_shard, 0)

    @staticmethod
    def row(h, w_shard):  # w_shard [n, d/dp] -> [b, s, d]
        y = h @ _gather_dp(w_shard, 1)
        return jax.lax.psum_scatter(y, TP, scatter_dimension=1, tiled=True)

    @staticmethod
    def head(x, w_shard):  # w_shard [d, o/dp] -> [b, s, o]
        return x @ _gather_dp(w_shard, 1)


@jax.custom_vjp
def _fused_column(x, w_shard):
    return _fused_column_fwd(x, w_shard)[0]


def _fused_column_fwd(x, w_shard):
    w = _gather_dp(w_shard, 0)  # [d, n]
    return commfuse.all_gather_matmul(x, w, TP, gather_dimension=1), (x, w)


def _fused_column_bwd(res, dy):  # dy [b, S, n]
    x, w = res
    # dx = reduce_scatter_tp(dy @ wᵀ) back onto the sequence rows: fused.
    dx = commfuse.matmul_reduce_scatter(dy, w.T, TP, scatter_dimension=1)
    # dW = Σ_tokens xᵀ dy needs the whole sequence of x again (a plain tp
    # gather), then the sum over dp scattered by rows to the owners: fused.
    xg = jax.lax.all_gather(x, TP, axis=1, tiled=True).reshape(-1, x.shape[-1])
    dw_shard = commfuse.matmul_reduce_scatter(xg.T, dy.reshape(-1, dy.shape[-1]), DP, scatter_dimension=0)
    return dx, dw_shard


_fused_column.defvjp(_fused_column_fwd, _fused_column_bwd)


@jax.custom_vjp
def _fused_row(h, w_shard):
    return _fused_row_fwd(h, w_shard)[0]


def _fused_row_fwd(h, w_shard):
    w = _gather_dp(w_shard, 1)  # [n, d]
    return commfuse.matmul_reduce_scatter(h, w, TP, scatter_dimension=1), (h, w)


def _fused_row_bwd(res, dy):  # dy [b, s, d]
    h, w = res
    # Both gradients need dY for the whole sequence: gather it over tp once
    # and use it twice (fusing the gather into dh would gather dY twice).
    dyg = jax.lax.all_gather(dy, TP, axis=1, tiled=True)  # [b, S, d]
    dh = dyg @ w.T
    # dW = Σ_tokens hᵀ dyg, summed over dp and scattered by columns (the dp
    # split of a row-parallel weight): a fused column reduce-scatter.
    dw_shard = commfuse.matmul_reduce_scatter(
        h.reshape(-1, h.shape[-1]).T, dyg.reshape(-1, dyg.shape[-1]), DP, scatter_dimension=1)
    return dh, dw_shard


_fused_row.defvjp(_fused_row_fwd, _fused_row_bwd)


class Fused:
    """commfuse's fused ops (see the module docstring for which collective each fuses)."""

    column = staticmethod(_fused_column)
    row = staticmethod(_fused_row)

    @staticmethod
    def head(x, w_shard):
        # x [b, s, d] @ gather_dp(W_head) [d, o]; commfuse's VJP reduce-scatters
        # dW over dp (fused, by columns). The weight is replicated over tp;
        # typing it as varying over tp makes JAX sum its gradient over tp.
        # (commfuse's VJP needs that done by the caller: with x varying over
        # tp and w not, jax.grad fails, "the manual axis types do not match".)
        return commfuse.matmul_all_gather(x, _as_varying(w_shard, TP), DP, gather_dimension=1)


def local_forward(p: Block, x, ops):
    """One device's forward pass on its shards: ``x [b, s, d]`` -> ``[b, s, d_out]``."""
    g = _gather_dp
    h = layer_norm(x, g(p.ln1_g), g(p.ln1_b))
    # One column-parallel matmul for q, k and v: this rank's heads of each.
    qkv = ops.column(h, jnp.concatenate([p.wq, p.wk, p.wv], axis=1))  # [b, S, 3 * d/tp]
    q, k, v = jnp.split(qkv, 3, axis=-1)
    o = causal_attention(q, k, v, p.heads * q.shape[-1] // x.shape[-1])  # this rank's heads
    x = x + ops.row(o, p.wo) + g(p.bo)
    h = layer_norm(x, g(p.ln2_g), g(p.ln2_b))
    u = jax.nn.gelu(ops.column(h, p.w1) + g(p.b1))
    x = x + ops.row(u, p.w2) + g(p.b2)
    return ops.head(x, p.w_head) + g(p.b_head)


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------
def optimizer(cfg: Config):
    # Adam is elementwise, so updating each dp shard on its own is exactly the
    # update of the whole tensor (a global-norm clip would need a psum).
    return optax.adam(cfg.learning_rate)


def _state_specs(opt, params, specs):
    """Specs of the optax state: the parameters' specs for the moments (any
    subtree shaped like the parameters), replicated for scalars (the count)."""
    shape = jax.eval_shape(opt.init, params)
    return jax.tree.map(
        lambda node: specs if isinstance(node, Block) else P(),
        shape, is_leaf=lambda node: isinstance(node, Block))


def mesh_for(cfg: Config, devices=None):
    devices = list(devices if devices is not None else jax.devices("cpu"))
    n = cfg.dp * cfg.tp
    if len(devices) < n:
        raise RuntimeError(
            f"train_block needs {n} devices, JAX has {len(devices)}. On CPU set "
            f"XLA_FLAGS={_COUNT_FLAG}={n} before JAX starts (running this module with "
            "`python -m commfuse.examples.train_block` does that).")
    return jax.make_mesh((cfg.dp, cfg.tp), (DP, TP), devices=devices[:n])


class Trainer:
    """The jitted shard_map programs of one version (fused or unfused)."""

    def __init__(self, cfg: Config, fused: bool, mesh):
        cfg.check()
        self.cfg, self.fused, self.mesh = cfg, fused, mesh
        self.opt = optimizer(cfg)
        self.specs = param_specs(cfg)
        ops = Fused if fused else Unfused
        data = P(DP, TP, None)
        n_total = cfg.batch * cfg.seq * cfg.d_out

        def loss_fn(p, x, y):
            err = local_forward(p, x, ops) - y
            return jax.lax.psum(jnp.sum(jnp.square(err)), (DP, TP)) / n_total

        def step(p, state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(p, x, y)  # grads: this rank's shards
            updates, state = self.opt.update(grads, state, p)
            return optax.apply_updates(p, updates), state, loss

        params0 = Block.init(cfg)
        self.state_specs = _state_specs(self.opt, params0, self.specs)

        def smap(f, in_specs, out_specs):
            return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

        self.step = smap(step, (self.specs, self.state_specs, data, data), (self.specs, self.state_specs, P()))
        self._init_state = smap(self.opt.init, (self.specs,), self.state_specs)
        self._data_spec = data

    def place(self, tree, specs):
        return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(self.mesh, s)), tree, specs)

    def initial(self):
        params = self.place(Block.init(self.cfg), self.specs)
        return params, self._init_state(params)

    def batch(self, step: int):
        x, y = make_batch(self.cfg, step)
        return self.place((x, y), (self._data_spec, self._data_spec))

    def count_fused_ops(self) -> int:
        """How many commfuse ops one (fused or unfused) training step issues."""
        params, state = self.initial()
        jaxpr = jax.make_jaxpr(self.step)(params, state, *self.batch(0))
        return count_primitive(jaxpr.jaxpr, PRIMITIVE)


def count_primitive(jaxpr, name: str) -> int:
    """Occurrences of primitive ``name`` in ``jaxpr`` and every jaxpr nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    count += count_primitive(inner, name)
    return count


def train(steps: int = 20, fused: bool = True, *, cfg: Config | None = None, devices=None,
          log=None) -> tuple[list[float], Block]:
    """Trains ``steps`` steps of the fused (or unfused) program. Returns the
    loss of each step (computed before that step's update) and the final
    parameters (global arrays, sharded as ``param_specs``)."""
    cfg = cfg or Config()
    trainer = Trainer(cfg, fused, mesh_for(cfg, devices))
    params, state = trainer.initial()
    losses = []
    for i in range(steps):
        params, state, loss = trainer.step(params, state, *trainer.batch(i))
        losses.append(float(loss))
        if log is not None:
            log(i, losses[-1])
    return losses, params


def run(steps: int = 20, fused: bool = True, **kwargs) -> list[float]:
    """The per-step losses of ``train(steps, fused, **kwargs)``."""
    return train(steps, fused, **kwargs)[0]


def reference_train(steps: int = 20, *, cfg: Config | None = None) -> tuple[list[float], Block]:
    """The same training on one device with no sharding at all (a check of
    both programs): per-step losses and final parameters."""
    cfg = cfg or Config()
    opt = optimizer(cfg)

    @jax.jit
    def step(p, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.square(p(x) - y)))(p)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    params = Block.init(cfg)
    state = opt.init(params)
    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, *make_batch(cfg, i))
        losses.append(float(loss))
    return losses, params


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------
def _parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m commfuse.examples.train_block",
        description="Train a transformer block on a (dp=2, tp=4) mesh of 8 CPU devices: "
                    "commfuse fused collective matmuls vs plain jax.lax collectives.")
    p.add_argument("--steps", type=int, default=20, help="training steps (20)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--both", dest="which", action="store_const", const="both",
                       help="train both versions and compare their losses (default)")
    which.add_argument("--fused", dest="which", action="store_const", const="fused",
                       help="train only the commfuse version")
    which.add_argument("--unfused", dest="which", action="store_const", const="unfused",
                       help="train only the plain jax.lax version")
    p.set_defaults(which="both")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def _set_host_device_count(n: int) -> None:
    flags = re.sub(_COUNT_FLAG + r"=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    flags.append(f"{_COUNT_FLAG}={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def main(argv=None) -> int:
    args = _parse_args(argv)
    _set_host_device_count(DEVICES)  # before anything creates JAX's CPU backend
    cfg = Config()
    try:
        mesh_for(cfg)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    versions = ["fused", "unfused"] if args.which == "both" else [args.which]
    print(f"train_block: jax {jax.__version__}, equinox {eqx.__version__}, optax {optax.__version__}")
    print(f"  mesh (dp={cfg.dp}, tp={cfg.tp}); batch {cfg.batch}, seq {cfg.seq}, d_model {cfg.d_model}, "
          f"heads {cfg.heads}, d_ff {cfg.d_ff}, d_out {cfg.d_out}; adam lr {cfg.learning_rate}")
    losses = {}
    for name in versions:
        t0 = time.perf_counter()
        losses[name] = run(args.steps, name == "fused", cfg=cfg)
        elapsed = time.perf_counter() - t0
        print(f"  {name}: {args.steps} steps in {elapsed:.1f} s (with compilation)")
    mesh = mesh_for(cfg)
    if "fused" in versions:
        n_ops = Trainer(cfg, True, mesh).count_fused_ops()
        print(f"  the fused step issues {n_ops} commfuse ops ({PRIMITIVE})")
    both = len(versions) == 2
    print("step  " + "  ".join(f"{name:>12}" for name in versions) + ("  |difference|" if both else ""))
    for i in range(args.steps):
        row = "  ".join(f"{losses[name][i]:12.6f}" for name in versions)
        if both:
            row += f"  {abs(losses['fused'][i] - losses['unfused'][i]):12.3e}"
        print(f"{i:4d}  {row}")
    ok = True
    for name in versions:
        if not losses[name][-1] < losses[name][0]:
            print(f"{name}: the loss did not decrease ({losses[name][0]:.6f} -> {losses[name][-1]:.6f})")
            ok = False
    if both:
        diff = max(abs(a - b) for a, b in zip(losses["fused"], losses["unfused"]))
        print(f"max |fused - unfused| loss difference over {args.steps} steps: {diff:.3e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
