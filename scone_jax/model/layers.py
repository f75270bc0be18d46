"""Transformer building blocks (Flax NNX), each parameter tagged with logical axis names.

Logical names ('vocab', 'embed', 'heads', 'mlp', 'layers') are mapped to mesh axes in one
place, `scone_jax.sharding.LOGICAL_RULES`; the layers never see the mesh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

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
    """LayerNorm (GPT-2), RMSNorm, or LayerNorm without scale/bias (OLMo's non-parametric)."""
    kw = dict(epsilon=1e-5, dtype=jnp.float32, param_dtype=dtype_of(cfg.param_dtype), rngs=rngs)
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


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding on [B, T, N, H] with per-token positions [B, T]."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq  # [B, T, half]
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head causal self-attention restricted to tokens of the same segment (document)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim or cfg.d_model // cfg.num_heads
        self.use_rope = cfg.position == "rope"
        self.rope_theta = cfg.rope_theta
        inner = self.num_heads * self.head_dim
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.query = dense(cfg.d_model, inner, ("embed", "heads"), cfg, rngs)
        self.key = dense(cfg.d_model, inner, ("embed", "heads"), cfg, rngs)
        self.value = dense(cfg.d_model, inner, ("embed", "heads"), cfg, rngs)
        self.out = dense(inner, cfg.d_model, ("heads", "embed"), cfg, rngs, std=out_std)

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, self.num_heads, self.head_dim)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        if self.use_rope:
            q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = (causal[None] & same_segment)[:, None]  # [B, 1, T, T]
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k).astype(jnp.float32) / jnp.sqrt(self.head_dim)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        y = jnp.einsum("bnqk,bknh->bqnh", probs, v).reshape(b, t, -1)
        return self.out(y)


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
            h = jax.nn.silu(self.gate(x)) * self.up(x)
        else:
            h = jax.nn.gelu(self.up(x))
        return self.down(h)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.attn_norm = make_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = make_norm(cfg, rngs)
        self.mlp = Mlp(cfg, rngs)

    def __call__(self, x, segment_ids, positions):
        dtype = x.dtype
        x = x + self.attn(self.attn_norm(x).astype(dtype), segment_ids, positions).astype(dtype)
        return x + self.mlp(self.mlp_norm(x).astype(dtype)).astype(dtype)
