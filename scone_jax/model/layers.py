"""Transformer building blocks (Flax NNX), each parameter tagged with logical axis names.

Logical names ('vocab', 'embed', 'heads', 'mlp', 'layers') are mapped to mesh axes in one
place, `scone_jax.sharding.LOGICAL_RULES`; the layers never see the mesh.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scone_jax.model import attention
from scone_jax.model.rope import Rope

# Variables keep their logical names as metadata; `sharding.py` turns them into
# NamedShardings and the init function is jitted with those as out_shardings, so the
# variables are created directly in place (no eager per-variable sharding needed).
nnx.use_eager_sharding(False)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_of(name: str):
    if name not in DTYPES:
        raise ValueError(f"Unknown dtype {name!r}; use one of {sorted(DTYPES)}.")
    return DTYPES[name]


def normal(std: float, axes: tuple):
    return nnx.with_partitioning(nnx.initializers.normal(std), axes)


def head_dim_of(cfg) -> int:
    """Width of one attention head: model.head_dim, where 0 means d_model // num_heads."""
    return cfg.head_dim or cfg.d_model // cfg.num_heads


def kv_heads_of(cfg) -> int:
    """Key/value heads: model.num_kv_heads, where 0 means num_heads (multi-head attention)."""
    return cfg.num_kv_heads or cfg.num_heads


def dense(d_in: int, d_out: int, axes: tuple, cfg, rngs: nnx.Rngs, std: float | None = None) -> nnx.Linear:
    """A Linear layer with compute dtype, fp32 master weights and logical axis names."""
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=cfg.use_bias,
        dtype=dtype_of(cfg.dtype),
        param_dtype=dtype_of(cfg.param_dtype),
        kernel_init=normal(std if std is not None else cfg.init_std, axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[-1:]),
        rngs=rngs,
    )


def make_norm(cfg, rngs: nnx.Rngs) -> nnx.Module:
    """LayerNorm (GPT-2), RMSNorm, or LayerNorm without scale/bias (OLMo's non-parametric); epsilon
    model.norm_eps."""
    kw = dict(epsilon=cfg.norm_eps, dtype=jnp.float32, param_dtype=dtype_of(cfg.param_dtype), rngs=rngs)
    scale = nnx.with_partitioning(nnx.initializers.ones_init(), (None,))
    if cfg.norm == "layernorm":
        bias = nnx.with_partitioning(nnx.initializers.zeros_init(), (None,))
        return nnx.LayerNorm(cfg.d_model, scale_init=scale, bias_init=bias, use_bias=cfg.use_bias, **kw)
    if cfg.norm == "rmsnorm":
        return nnx.RMSNorm(cfg.d_model, scale_init=scale, **kw)
    if cfg.norm == "nonparametric_layernorm":
        return nnx.LayerNorm(cfg.d_model, use_scale=False, use_bias=False, **kw)
    raise ValueError(
        f"Unknown model.norm={cfg.norm!r}; use 'layernorm', 'rmsnorm' or 'nonparametric_layernorm'."
    )


def make_head_norm(cfg, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """Qwen3's q/k norm: RMSNorm over one head's width (a learned scale [head_dim], epsilon model.norm_eps)."""
    scale = nnx.with_partitioning(nnx.initializers.ones_init(), (None,))
    return nnx.RMSNorm(head_dim_of(cfg), epsilon=cfg.norm_eps, dtype=jnp.float32,
                       param_dtype=dtype_of(cfg.param_dtype), scale_init=scale, rngs=rngs)


class KVCache(NamedTuple):
    """Keys and values of the tokens decoded so far, so each decoding step runs only its new tokens.

    key, value: [B, S, K, H] for one layer (S slots, K = the key/value heads, model.num_kv_heads); a block
    stack holds one per layer, stacked to [layers, B, S, K, H] when its layers are scanned, a tuple of
    per-layer arrays otherwise
    (transformer.init_cache). index: int32 scalar, the slot of the first new token, shared by all layers.
    engram: one [B, S, d] buffer per Engram layer of the decoder (model/engram.py), () without Engram."""
    key: jax.Array
    value: jax.Array
    index: jax.Array
    engram: tuple = ()


class Attention(nnx.Module):
    """Multi-head causal self-attention restricted to tokens of the same segment (document);
    the scores are computed by model/attention.py's implementation named by cfg.attention.

    Grouped-query attention with cfg.num_kv_heads: `key` and `value` project to num_kv_heads heads, and
    query head n reads key/value head n // (num_heads / num_kv_heads). With cfg.qk_norm, `query_norm` and
    `key_norm` (RMSNorm over each head's width, Qwen3) follow the projections, before RoPE.

    With a KVCache (decoding), the new tokens' keys and values are written into it at cache.index. A
    call with several tokens is a prefill: it starts the cache (cache.index must be 0), and its tokens
    attend among themselves through the training implementation (flash / splash / cuDNN: no [T, T]
    score buffer for a long prompt). A one-token step attends over the cache (attention.cached_attention).
    The projections and RoPE are the ones training runs, so the paths cannot drift apart."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.num_heads = cfg.num_heads
        self.num_kv_heads = kv_heads_of(cfg)
        self.head_dim = head_dim_of(cfg)
        self.rope = Rope.of(cfg, self.head_dim) if cfg.position == "rope" else None
        self.implementation = cfg.attention
        attention.check(cfg.attention)
        inner, kv_inner = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.query = dense(cfg.d_model, inner, ("embed", "heads"), cfg, rngs)
        self.key = dense(cfg.d_model, kv_inner, ("embed", "heads"), cfg, rngs)
        self.value = dense(cfg.d_model, kv_inner, ("embed", "heads"), cfg, rngs)
        self.out = dense(inner, cfg.d_model, ("heads", "embed"), cfg, rngs, std=out_std)
        self.query_norm = make_head_norm(cfg, rngs) if cfg.qk_norm else None
        self.key_norm = make_head_norm(cfg, rngs) if cfg.qk_norm else None

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, cache: KVCache | None = None):
        """[B, T, d] -> [B, T, d]; with `cache`, (that, the cache with these T tokens written). Cached rows
        are one document each: segment_ids is not read then."""
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, -1, self.head_dim)  # noqa: E731
        q, k, v = (checkpoint_name(split(proj(x)), name)
                   for proj, name in ((self.query, "query_proj"), (self.key, "key_proj"), (self.value, "value_proj")))
        if self.query_norm is not None:
            q, k = _normed(self.query_norm, q), _normed(self.key_norm, k)
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)
        if cache is None:
            y = attention.attention(q, k, v, segment_ids, implementation=self.implementation)
            return checkpoint_name(self.out(y.reshape(b, t, -1)), "attention_out")
        key = jax.lax.dynamic_update_slice(cache.key, k.astype(cache.key.dtype), (0, cache.index, 0, 0))
        value = jax.lax.dynamic_update_slice(cache.value, v.astype(cache.value.dtype), (0, cache.index, 0, 0))
        if t > 1:  # prefill from slot 0: one document per row
            y = attention.attention(q, k, v, jnp.ones((b, t), jnp.int32), implementation=self.implementation,
                                    packed=False)
        else:
            y = attention.cached_attention(q, key, value, cache.index)
        return self.out(y.reshape(b, t, -1)), KVCache(key, value, cache.index + t)


class Mlp(nnx.Module):
    """GELU MLP (GPT-2) or SwiGLU (OLMo); d_ff is the hidden width in both cases."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.swiglu = cfg.mlp == "swiglu"
        if cfg.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"Unknown model.mlp={cfg.mlp!r}; use 'gelu' or 'swiglu'.")
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.up = dense(cfg.d_model, cfg.d_ff, ("embed", "mlp"), cfg, rngs)
        self.gate = dense(cfg.d_model, cfg.d_ff, ("embed", "mlp"), cfg, rngs) if self.swiglu else None
        self.down = dense(cfg.d_ff, cfg.d_model, ("mlp", "embed"), cfg, rngs, std=out_std)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.swiglu:
            h = _recomputed(lambda g, u: jax.nn.silu(g) * u)(self.gate(x), self.up(x))
        else:
            h = _recomputed(jax.nn.gelu)(self.up(x))
        return self.down(h)


def _recomputed(fn):
    """fn that keeps only its inputs for the backward pass and recomputes the rest there.

    For cheap elementwise work between matmuls (activations, norms): left alone, autodiff
    keeps every intermediate (GELU's tanh approximation: five [tokens, d_ff] tensors; a
    LayerNorm: several fp32 [tokens, d] ones), and under a scan over layers each of them is a
    stacked [layers, ...] buffer. Recomputing costs a few elementwise passes; on TPU that is
    free next to the memory traffic it saves."""
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


def _normed(norm: nnx.Module, x: jax.Array) -> jax.Array:
    """norm(x) in fp32, cast back to x's dtype; only x is kept for the backward pass."""
    return nnx.remat(lambda n, y: n(y).astype(y.dtype), policy=jax.checkpoint_policies.nothing_saveable)(norm, x)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.attn_norm = make_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = make_norm(cfg, rngs)
        self.mlp = Mlp(cfg, rngs)

    def __call__(self, x, segment_ids, positions, cache: KVCache | None = None):
        """With `cache` (decoding), returns (x, updated cache): see Attention."""
        dtype = x.dtype
        if cache is None:
            x = x + self.attn(_normed(self.attn_norm, x), segment_ids, positions).astype(dtype)
        else:
            a, cache = self.attn(_normed(self.attn_norm, x), segment_ids, positions, cache)
            x = x + a.astype(dtype)
        x = x + self.mlp(_normed(self.mlp_norm, x)).astype(dtype)
        return x if cache is None else (x, cache)
