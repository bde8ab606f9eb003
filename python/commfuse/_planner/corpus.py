"""Training steps written as framework users write them, for `commfuse.plan`
to re-layout: three model families at a few sizes each.

``build(family, size)`` returns a `Case`: an un-jitted ``step(params,
opt_state, batch) -> (params, opt_state, loss)`` (next-token cross entropy
with f32 logits, ``optax.adamw``) and its arguments. None of the steps names
a mesh axis; what a planner may change is what the model says:

``gpt_linen``
    GPT-2-style decoder in Flax Linen: learned position embeddings,
    pre-LayerNorm blocks of causal multi-head attention and a GELU MLP,
    untied LM head. Blocks are ``nn.remat`` and stacked with ``nn.scan``
    (parameters get a leading "layers" axis). Every parameter is named with
    ``nn.with_logical_partitioning``, activations with
    ``nn.with_logical_constraint``.
``llama_jax``
    Llama-style decoder in plain JAX: RMSNorm, rotary embeddings,
    grouped-query attention, SwiGLU MLP, untied embedding and head. The
    parameters are a plain dict without names (layers stacked on a leading
    axis, run by ``jax.lax.scan`` over a ``jax.checkpoint``-ed block); only
    the residual stream between blocks is named, with `commfuse.constrain`.
    Sizes "8b" and "70b" are Llama-3's, built abstract only.
``moe_linen``
    ``gpt_linen``'s decoder with a top-2 mixture-of-experts MLP (GShard /
    Switch: one-hot dispatch and combine einsums under a capacity factor)
    and a load-balancing loss added to the loss.

Logical names. Parameters: "vocab", "embed" (d_model), "heads" (the fused
heads*head_dim of q/k/v/o), "mlp", "norm" (norm scales and biases),
"position" (learned position table), "expert"; the scanned Linen stacks add
"layers" in front. Activations use their own names, so that a rule for a
parameter name never takes a mesh axis an activation's batch needs:
"batch", "length" (the residual stream's sequence dim: between blocks and
around each sublayer's residual add; mapping it to the tensor axis is
sequence parallelism), "act_length" (the sequence dim inside attention and
the MLP: unmapped it stays whole there, as Megatron's sequence parallelism
wants), "act_embed", "act_heads", "act_mlp", "act_vocab", and for the
experts' buffers "act_expert" and "act_capacity".

The Linen parameter trees keep their ``nn.LogicallyPartitioned`` boxes
(``nn.get_partition_spec`` reads them); the steps take them boxed: Linen
unboxes on parameter access, and optax's adamw maps over the boxes (they are
pytree nodes whose leaf is the array), so gradients, adam's moments and the
updated parameters come back boxed with the same names.

Needs flax and optax (the package's ``test`` extra).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

# The same objects as `commfuse.remat_policy` and `commfuse.constrain`.
from .hooks import constrain, remat_policy

FAMILIES = ("gpt_linen", "llama_jax", "moe_linen")

# Sizes built with ShapeDtypeStruct leaves whatever `abstract` says.
_ABSTRACT_ONLY = ("8b", "70b")


@dataclass
class Case:
    """One training step and its arguments.

    ``step(params, opt_state, batch) -> (params, opt_state, loss)`` is not
    jitted; ``args`` is ``(params, opt_state, batch)``, concrete arrays or
    ``jax.ShapeDtypeStruct`` leaves (abstract builds and the large sizes);
    ``info`` holds the config and the parameter count ("params");
    ``loss(params, batch)`` is the step's loss alone.

    JAX caches a function's trace without regard to the layout the hooks
    read (`commfuse._planner.hooks.tracing`): trace a new function per
    layout (``jax.jit(lambda *a: case.step(*a))``), or a second layout
    gets the first one's trace."""
    name: str
    step: Callable
    args: tuple
    info: dict
    loss: Callable | None = None


def build(family: str, size: str = "test", *, abstract: bool = False, seed: int = 0, batch: int | None = None) -> Case:
    """The `Case` of `family` (one of `FAMILIES`) at `size`: "test" (tiny:
    tens of ms a step on a CPU), "bench" (~10M parameters, 16 x 128 tokens:
    seconds a step on a 2-core host; parameters plus adam state outweigh
    the activations), "measure" (~1.3M parameters, 16 x 64 tokens: about
    0.2 s a step, `commfuse.bench_plan`'s), and for llama_jax also "8b" and
    "70b" (always abstract). `batch` replaces the size's global batch
    (sequences per step)."""
    if family not in _BUILDERS:
        raise ValueError(f"commfuse corpus: unknown family {family!r}; families are {FAMILIES}")
    configs, builder = _BUILDERS[family]
    if size not in configs:
        raise ValueError(f"commfuse corpus: {family} has no size {size!r}; sizes are {tuple(configs)}")
    cfg = configs[size] if batch is None else dataclasses.replace(configs[size], batch=int(batch))
    return builder(cfg, f"{family}/{size}", abstract or size in _ABSTRACT_ONLY, seed)


# --------------------------------------------------------------------------
# What the families share: data, loss, optimizer, the step
# --------------------------------------------------------------------------
def _batch(cfg, abstract: bool, seed: int) -> dict:
    """{"tokens": int32 [batch, seq + 1]}: inputs are tokens[:, :-1],
    targets tokens[:, 1:]. Random tokens: the corpus measures steps, and a
    repeated batch is still learnt (the loss falls over a few steps)."""
    shape = (cfg.batch, cfg.seq + 1)
    if abstract:
        return {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32)}
    rng = np.random.default_rng(seed + 1)
    return {"tokens": jnp.asarray(rng.integers(0, cfg.vocab, size=shape, dtype=np.int32))}


def _cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def _optimizer(cfg):
    # GPT-style adamw; decay on every parameter (no mask: a mask has to
    # mirror the boxed tree, and the corpus does not need one).
    return optax.adamw(cfg.lr, b1=0.9, b2=0.95, weight_decay=0.1)


def _make_step(loss_fn, tx):
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _case(name, cfg, init, loss_fn, abstract, seed) -> Case:
    """The Case of a family's `init(key) -> params` and `loss_fn`: params
    and adam state made concrete (jitted) or abstract (eval_shape: no
    allocation, the key included)."""
    tx = _optimizer(cfg)
    if abstract:
        params = jax.eval_shape(lambda: init(jax.random.key(seed)))
        opt_state = jax.eval_shape(tx.init, params)
    else:
        # Initialisation runs once: compiled fast rather than well (a third
        # of the compile time of the default on a CPU host).
        params = jax.jit(init, compiler_options=_FAST_COMPILE)(jax.random.key(seed))
        opt_state = jax.jit(tx.init, compiler_options=_FAST_COMPILE)(params)
    info = dataclasses.asdict(cfg)
    info["dtype"] = jnp.dtype(cfg.dtype).name
    info["params"] = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    return Case(name, _make_step(loss_fn, tx), (params, opt_state, _batch(cfg, abstract, seed)), info, loss_fn)


# --------------------------------------------------------------------------
# gpt_linen: GPT-2 in Flax Linen (and the attention moe_linen shares)
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class GptConfig:
    vocab: int
    d_model: int
    n_heads: int
    d_mlp: int
    n_layers: int
    seq: int
    batch: int
    dtype: object = jnp.float32
    lr: float = 1e-3


GPT_SIZES = {
    "test": GptConfig(vocab=256, d_model=64, n_heads=4, d_mlp=256, n_layers=2, seq=32, batch=8),
    # Parameters plus adam state (124 MB) outweigh what else a step keeps
    # (~65 MB with remat "nothing"): where memory matters.
    "bench": GptConfig(vocab=4096, d_model=384, n_heads=8, d_mlp=1536, n_layers=4, seq=128, batch=16, lr=3e-4),
    # `commfuse.bench_plan`'s: a step in about 0.2 s on 8 CPU devices of a
    # 2-core host, so that every candidate of a plan is measured in minutes.
    "measure": GptConfig(vocab=2048, d_model=128, n_heads=8, d_mlp=512, n_layers=4, seq=64, batch=16, lr=3e-4),
}

_INIT = nn.initializers.normal(0.02)


def _named(init, names):
    return nn.with_logical_partitioning(init, names)


def _dense(features, names, cfg, *, bias=True, name=None):
    """nn.Dense whose kernel is named `names` (in, out) and bias names[-1]."""
    return nn.Dense(
        features, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.dtype, name=name,
        kernel_init=_named(_INIT, names), bias_init=_named(nn.initializers.zeros, names[-1:]))


def _layer_norm(cfg, name):
    return nn.LayerNorm(
        epsilon=1e-5, dtype=cfg.dtype, param_dtype=cfg.dtype, name=name,
        scale_init=_named(nn.initializers.ones, ("norm",)), bias_init=_named(nn.initializers.zeros, ("norm",)))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: q/k/v/o projections over the fused
    heads*head_dim ("heads"), softmax in f32."""
    cfg: GptConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        b, s, _ = x.shape
        hd = cfg.d_model // cfg.n_heads
        heads = []
        for name in ("q", "k", "v"):
            y = _dense(cfg.n_heads * hd, ("embed", "heads"), cfg, name=name)(x)
            y = nn.with_logical_constraint(y, ("batch", "act_length", "act_heads"))
            heads.append(y.reshape(b, s, cfg.n_heads, hd))
        q, k, v = heads
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, cfg.n_heads * hd)
        out = nn.with_logical_constraint(out, ("batch", "act_length", "act_heads"))
        return _dense(cfg.d_model, ("heads", "embed"), cfg, name="o")(out)


class GeluMlp(nn.Module):
    cfg: GptConfig

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(_dense(self.cfg.d_mlp, ("embed", "mlp"), self.cfg, name="fc")(x))
        h = nn.with_logical_constraint(h, ("batch", "act_length", "act_mlp"))
        return _dense(self.cfg.d_model, ("mlp", "embed"), self.cfg, name="proj")(h)


def _residual(x):
    """The residual stream's names: its sequence dim is "length", the name a
    planner maps to the tensor axis for sequence parallelism."""
    return nn.with_logical_constraint(x, ("batch", "length", "act_embed"))


class GptBlock(nn.Module):
    """Pre-LN transformer block; the scan's body (carry = residual stream)."""
    cfg: GptConfig

    @nn.compact
    def __call__(self, x, _):
        x = _residual(x + CausalSelfAttention(self.cfg, name="attn")(_layer_norm(self.cfg, "ln1")(x)))
        x = _residual(x + GeluMlp(self.cfg, name="mlp")(_layer_norm(self.cfg, "ln2")(x)))
        return x, None


def _scanned(block, n_layers):
    """`block` remat'ed with the planner's policy and scanned over a leading
    "layers" axis of its parameters; what it returns per layer is stacked."""
    return nn.scan(
        # prevent_cse=False: inside scan there is nothing to CSE across.
        nn.remat(block, policy=remat_policy("nothing"), prevent_cse=False),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=n_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


class Embed(nn.Module):
    """Token plus learned position embeddings."""
    cfg: GptConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        x = nn.Embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype, name="wte",
                     embedding_init=_named(_INIT, ("vocab", "embed")))(tokens)
        pos = self.param("wpe", _named(_INIT, ("position", "embed")), (cfg.seq, cfg.d_model), cfg.dtype)
        return _residual(x + pos[: tokens.shape[1]].astype(cfg.dtype))


class LmHead(nn.Module):
    """Final LayerNorm and the untied projection to the vocabulary, in f32."""
    cfg: GptConfig

    @nn.compact
    def __call__(self, x):
        x = _layer_norm(self.cfg, "ln_f")(x)
        logits = nn.Dense(self.cfg.vocab, use_bias=False, dtype=jnp.float32, param_dtype=self.cfg.dtype,
                          kernel_init=_named(_INIT, ("embed", "vocab")), name="lm_head")(x)
        return nn.with_logical_constraint(logits, ("batch", "act_length", "act_vocab"))


class Gpt(nn.Module):
    """GPT-2-style decoder: tokens [B, S] -> f32 logits [B, S, vocab]."""
    cfg: GptConfig

    @nn.compact
    def __call__(self, tokens):
        x = Embed(self.cfg, name="embed")(tokens)
        x, _ = _scanned(GptBlock, self.cfg.n_layers)(self.cfg, name="layers")(x, None)
        return LmHead(self.cfg, name="head")(x)


def _build_gpt(cfg: GptConfig, name, abstract, seed) -> Case:
    model = Gpt(cfg)

    def init(key):
        return model.init(key, jnp.zeros((cfg.batch, cfg.seq), jnp.int32))["params"]

    def loss_fn(params, batch):
        tokens = batch["tokens"]
        return _cross_entropy(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])

    return _case(name, cfg, init, loss_fn, abstract, seed)


# --------------------------------------------------------------------------
# llama_jax: Llama in plain JAX
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_mlp: int
    n_layers: int
    seq: int
    batch: int
    dtype: object = jnp.float32
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    lr: float = 1e-3


LLAMA_SIZES = {
    "test": LlamaConfig(vocab=256, d_model=64, n_heads=4, n_kv_heads=2, d_mlp=192, n_layers=2, seq=32, batch=8),
    "bench": LlamaConfig(vocab=4096, d_model=384, n_heads=8, n_kv_heads=4, d_mlp=1024, n_layers=4, seq=128,
                         batch=16, lr=3e-4),
    "measure": LlamaConfig(vocab=2048, d_model=128, n_heads=8, n_kv_heads=4, d_mlp=384, n_layers=4, seq=64,
                           batch=16, lr=3e-4),
    # Llama 3 8B and 70B (global batch 8 x 4096 tokens), abstract only.
    "8b": LlamaConfig(vocab=128256, d_model=4096, n_heads=32, n_kv_heads=8, d_mlp=14336, n_layers=32, seq=4096,
                      batch=8, dtype=jnp.bfloat16, lr=3e-4),
    "70b": LlamaConfig(vocab=128256, d_model=8192, n_heads=64, n_kv_heads=8, d_mlp=28672, n_layers=80, seq=4096,
                       batch=8, dtype=jnp.bfloat16, lr=1.5e-4),
}


def llama_init(cfg: LlamaConfig, key) -> dict:
    """Parameters: a plain dict, the blocks' arrays stacked on a leading
    layer axis. Matrices are (in, out); normal(0, 1/sqrt(in)) entries."""
    L, d, f, hd = cfg.n_layers, cfg.d_model, cfg.d_mlp, cfg.d_model // cfg.n_heads
    shapes = {
        "wq": (L, d, cfg.n_heads * hd), "wk": (L, d, cfg.n_kv_heads * hd), "wv": (L, d, cfg.n_kv_heads * hd),
        "wo": (L, cfg.n_heads * hd, d), "w_gate": (L, d, f), "w_up": (L, d, f), "w_down": (L, f, d),
    }
    keys = dict(zip([*shapes, "embed", "head"], jax.random.split(key, len(shapes) + 2)))

    def normal(name, shape, fan_in):
        return (jax.random.normal(keys[name], shape, jnp.float32) * fan_in ** -0.5).astype(cfg.dtype)

    layers = {name: normal(name, shape, shape[1]) for name, shape in shapes.items()}
    layers["attn_norm"] = jnp.ones((L, d), cfg.dtype)
    layers["mlp_norm"] = jnp.ones((L, d), cfg.dtype)
    return {
        "embed": normal("embed", (cfg.vocab, d), 1.0) * 0.02,
        "layers": layers,
        "final_norm": jnp.ones((d,), cfg.dtype),
        # Small: the first logits near uniform (loss ~ log(vocab)).
        "head": normal("head", (d, cfg.vocab), 1.0) * 0.02,
    }


def _rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def _rope(x, theta):
    """Rotary position embedding of x [B, S, heads, head_dim], rotating the
    two halves of each head (the "rotate half" layout), in f32."""
    s, hd = x.shape[1], x.shape[-1]
    freqs = theta ** (-jnp.arange(0, hd // 2, dtype=jnp.float32) / (hd // 2))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _llama_block(cfg: LlamaConfig):
    hd = cfg.d_model // cfg.n_heads

    def block(x, p):
        b, s, _ = x.shape
        h = _rms_norm(x, p["attn_norm"], cfg.norm_eps)
        q = _rope((h @ p["wq"]).reshape(b, s, cfg.n_heads, hd), cfg.rope_theta)
        k = _rope((h @ p["wk"]).reshape(b, s, cfg.n_kv_heads, hd), cfg.rope_theta)
        v = (h @ p["wv"]).reshape(b, s, cfg.n_kv_heads, hd)
        # Grouped-query attention: each kv head serves n_heads / n_kv_heads queries.
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.reshape(b, s, cfg.n_heads * hd) @ p["wo"]
        h = _rms_norm(x, p["mlp_norm"], cfg.norm_eps)
        x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        # The residual stream between blocks: what the planner may sequence-shard.
        return constrain(x, ("batch", "length", "act_embed")), None

    return block


def llama_forward(cfg: LlamaConfig, params, tokens):
    """tokens [B, S] -> f32 logits [B, S, vocab]."""
    x = constrain(params["embed"][tokens], ("batch", "length", "act_embed"))
    block = jax.checkpoint(_llama_block(cfg), policy=remat_policy("nothing"))
    x, _ = jax.lax.scan(block, x, params["layers"])
    x = _rms_norm(x, params["final_norm"], cfg.norm_eps)
    return jnp.einsum("bsd,dv->bsv", x, params["head"], preferred_element_type=jnp.float32)


def _build_llama(cfg: LlamaConfig, name, abstract, seed) -> Case:
    def loss_fn(params, batch):
        tokens = batch["tokens"]
        return _cross_entropy(llama_forward(cfg, params, tokens[:, :-1]), tokens[:, 1:])

    return _case(name, cfg, lambda key: llama_init(cfg, key), loss_fn, abstract, seed)


# --------------------------------------------------------------------------
# moe_linen: GPT decoder with a top-2 mixture-of-experts MLP, Flax Linen
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class MoeConfig:
    vocab: int
    d_model: int
    n_heads: int
    d_mlp: int  # each expert's hidden width
    n_layers: int
    seq: int
    batch: int
    n_experts: int
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01
    dtype: object = jnp.float32
    lr: float = 1e-3


MOE_SIZES = {
    "test": MoeConfig(vocab=256, d_model=64, n_heads=4, d_mlp=128, n_layers=2, seq=32, batch=8, n_experts=4),
    "bench": MoeConfig(vocab=4096, d_model=256, n_heads=8, d_mlp=512, n_layers=4, seq=128, batch=16, n_experts=8,
                       lr=3e-4),
    "measure": MoeConfig(vocab=2048, d_model=128, n_heads=8, d_mlp=256, n_layers=4, seq=64, batch=16, n_experts=8,
                         lr=3e-4),
}


def expert_capacity(cfg: MoeConfig, group_size: int) -> int:
    """Slots per expert per group: the group's top_k choices spread evenly,
    times the capacity factor. Choices past it are dropped (the token's
    residual carries it)."""
    return max(1, math.ceil(cfg.capacity_factor * group_size * cfg.top_k / cfg.n_experts))


class MoeMlp(nn.Module):
    """Top-k mixture of GELU experts. Each sequence is a group (GShard):
    its tokens' choices take an expert's slots in order, all first choices
    before any second, up to `expert_capacity`. Returns (y, aux) where aux
    is Switch's load-balancing loss E * sum_e f_e * P_e (f_e: share of
    first choices, P_e: mean router probability)."""
    cfg: MoeConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        b, s, d = x.shape
        e, k, c = cfg.n_experts, cfg.top_k, expert_capacity(cfg, x.shape[1])
        router = self.param("router", _named(_INIT, ("embed", "expert")), (d, e), cfg.dtype)
        probs = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, router, preferred_element_type=jnp.float32), axis=-1)
        gates, chosen = jax.lax.top_k(probs, k)  # [b, s, k]
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        choice = jax.nn.one_hot(chosen, e, dtype=jnp.float32)  # [b, s, k, e]

        # Slot of each choice in its expert's buffer: a running count over
        # the group with the k-th choices of all tokens after the (k-1)-th.
        by_rank = choice.transpose(0, 2, 1, 3).reshape(b, k * s, e)
        slot = ((jnp.cumsum(by_rank, axis=1) - 1.0) * by_rank).reshape(b, k, s, e).transpose(0, 2, 1, 3)
        kept = choice * (slot < c)
        slot_onehot = jax.nn.one_hot(jnp.sum(slot, axis=-1).astype(jnp.int32), c, dtype=jnp.float32)
        dispatch = jnp.einsum("bske,bskc->bsec", kept, slot_onehot)  # [b, s, e, c] of 0/1
        combine = jnp.einsum("bske,bskc,bsk->bsec", kept, slot_onehot, gates)

        buffers = ("act_expert", "batch", "act_capacity", "act_embed")
        xe = nn.with_logical_constraint(jnp.einsum("bsec,bsd->ebcd", dispatch.astype(x.dtype), x), buffers)
        w_in = self.param("w_in", _named(_INIT, ("expert", "embed", "mlp")), (e, d, cfg.d_mlp), cfg.dtype)
        w_out = self.param("w_out", _named(_INIT, ("expert", "mlp", "embed")), (e, cfg.d_mlp, d), cfg.dtype)
        h = nn.gelu(jnp.einsum("ebcd,edf->ebcf", xe, w_in))
        h = nn.with_logical_constraint(h, ("act_expert", "batch", "act_capacity", "act_mlp"))
        ye = nn.with_logical_constraint(jnp.einsum("ebcf,efd->ebcd", h, w_out), buffers)
        y = jnp.einsum("bsec,ebcd->bsd", combine.astype(x.dtype), ye)

        first_share = jnp.mean(choice[:, :, 0, :], axis=(0, 1))
        aux = e * jnp.sum(first_share * jnp.mean(probs, axis=(0, 1)))
        return y, aux


class MoeBlock(nn.Module):
    """Pre-LN block with the MoE MLP; the scan's body, emitting each
    layer's load-balancing loss."""
    cfg: MoeConfig

    @nn.compact
    def __call__(self, x, _):
        x = _residual(x + CausalSelfAttention(self.cfg, name="attn")(_layer_norm(self.cfg, "ln1")(x)))
        y, aux = MoeMlp(self.cfg, name="moe")(_layer_norm(self.cfg, "ln2")(x))
        return _residual(x + y), aux


class Moe(nn.Module):
    """tokens [B, S] -> (f32 logits [B, S, vocab], summed load-balancing loss)."""
    cfg: MoeConfig

    @nn.compact
    def __call__(self, tokens):
        x = Embed(self.cfg, name="embed")(tokens)
        x, aux = _scanned(MoeBlock, self.cfg.n_layers)(self.cfg, name="layers")(x, None)
        return LmHead(self.cfg, name="head")(x), jnp.sum(aux)


def _build_moe(cfg: MoeConfig, name, abstract, seed) -> Case:
    model = Moe(cfg)

    def init(key):
        return model.init(key, jnp.zeros((cfg.batch, cfg.seq), jnp.int32))["params"]

    def loss_fn(params, batch):
        tokens = batch["tokens"]
        logits, aux = model.apply({"params": params}, tokens[:, :-1])
        return _cross_entropy(logits, tokens[:, 1:]) + cfg.aux_loss_weight * aux

    return _case(name, cfg, init, loss_fn, abstract, seed)


_BUILDERS = {
    "gpt_linen": (GPT_SIZES, _build_gpt),
    "llama_jax": (LLAMA_SIZES, _build_llama),
    "moe_linen": (MOE_SIZES, _build_moe),
}
