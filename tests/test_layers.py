"""model/layers.py against plain references written from the published definitions (Hugging Face's Qwen3 and
Llama modules): grouped-query attention with Qwen3's q/k norm placed after the projections and before RoPE,
and model.norm_eps in every norm."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scone_jax.config import base_config
from scone_jax.model import layers
from scone_jax.model.transformer import Decoder

B, T, D = 2, 10, 32


def qwen3_cfg(**overrides):
    cfg = base_config().model
    cfg.update(dict(vocab_size=96, d_model=D, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=64,
                    norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, qk_norm=True, norm_eps=0.25,
                    attention="reference"))
    cfg.update(overrides)
    return cfg


def rms_norm(x, scale, eps):
    """Qwen3RMSNorm / LlamaRMSNorm: x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def hf_rope(x, positions, theta):
    """Hugging Face's rotate-half RoPE on [B, T, N, H]: inv_freq = 1 / theta^(2i / H), emb = cat(freqs, freqs),
    x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1)."""
    h = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, h, 2) / h)
    emb = np.concatenate([positions[..., None] * inv_freq] * 2, axis=-1)[:, :, None]  # [B, T, 1, H]
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return x * np.cos(emb) + np.concatenate([-x2, x1], axis=-1) * np.sin(emb)


def attention_formula(attn, x, positions, cfg):
    """Qwen3Attention's forward, written out: q/k/v projections, q_norm/k_norm per head, RoPE, each key/value
    head repeated over its group (repeat_kv), causal softmax(q k / sqrt(H)) v, output projection; float64."""
    h, n, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    weight = lambda m: np.asarray(m.kernel[...], np.float64)  # noqa: E731
    q = (x @ weight(attn.query)).reshape(B, T, n, h)
    k = (x @ weight(attn.key)).reshape(B, T, kv, h)
    v = (x @ weight(attn.value)).reshape(B, T, kv, h)
    q = rms_norm(q, np.asarray(attn.query_norm.scale[...]), cfg.norm_eps)
    k = rms_norm(k, np.asarray(attn.key_norm.scale[...]), cfg.norm_eps)
    q, k = hf_rope(q, positions, cfg.rope_theta), hf_rope(k, positions, cfg.rope_theta)
    k, v = np.repeat(k, n // kv, axis=2), np.repeat(v, n // kv, axis=2)
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(h)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.einsum("bnqk,bknh->bqnh", probs, v).reshape(B, T, n * h)
    return y @ weight(attn.out)


def random_scales(module, rng):
    """Norm scales away from HF's initial ones, so a misplaced or swapped norm changes the result."""
    params = nnx.state(module, nnx.Param)
    params = jax.tree.map(lambda x: jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype) if x.ndim == 1 else x, params)
    nnx.update(module, params)


def test_grouped_attention_with_qk_norm_matches_qwen3s_definition():
    """layers.Attention (4 query heads over 2 key/value heads, head_dim 16 != d_model / heads, q/k norm with
    random scales, norm_eps 0.25 so the epsilon matters) against attention_formula, fp32 vs float64, atol 2e-5
    on outputs of size ~1. Deliberate bugs, each seen to fail here: the q/k norms applied after RoPE instead of
    before (a rotation keeps the RMS but not a per-dimension scale), the norm's epsilon fixed at 1e-6, the key
    normalised with query_norm, and key/value heads grouped n % K."""
    cfg = qwen3_cfg(init_std=0.5)  # outputs of size ~1
    attn = layers.Attention(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    random_scales(attn, rng)
    assert np.ptp(np.asarray(attn.query_norm.scale[...])) > 0.5
    assert attn.key.kernel[...].shape == (D, 2 * 16) and attn.query.kernel[...].shape == (D, 4 * 16)
    assert attn.key.kernel.get_metadata()["out_sharding"] == ("embed", "heads")
    assert attn.query_norm.scale[...].shape == attn.key_norm.scale[...].shape == (16,)
    x = rng.normal(0, 0.3, (B, T, D))
    positions = np.stack([np.arange(T), np.arange(3, T + 3)])
    got = attn(jnp.asarray(x, jnp.float32), jnp.ones((B, T), jnp.int32), jnp.asarray(positions, jnp.int32))
    want = attention_formula(attn, x, positions, cfg)
    assert 0.5 < np.abs(want).max() < 10
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)


def test_without_qk_norm_there_are_no_norm_parameters():
    attn = layers.Attention(qwen3_cfg(qk_norm=False), nnx.Rngs(0))
    assert attn.query_norm is None and attn.key_norm is None
    assert not any("norm" in str(path) for path, _ in nnx.to_flat_state(nnx.state(attn, nnx.Param)))


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "nonparametric_layernorm"])
def test_norm_eps_sets_the_epsilon_of_every_norm(norm):
    """model.norm_eps (0.25, large enough to matter against inputs of RMS ~0.3) in make_norm against the
    formulas (LayerNorm: (x - mean) / sqrt(var + eps) * scale + bias; RMSNorm: x / sqrt(mean(x^2) + eps) *
    scale), and in every norm of a decoder: the blocks', the final one and the q/k norms. Caught: make_norm's
    epsilon left at the old fixed 1e-5 (every style), and the q/k norms built with nnx.RMSNorm's default."""
    cfg = qwen3_cfg(norm=norm, use_bias=norm == "layernorm")
    module = layers.make_norm(cfg, nnx.Rngs(0))
    random_scales(module, np.random.default_rng(1))
    x = np.random.default_rng(2).normal(0, 0.3, (3, D))
    got = np.asarray(module(jnp.asarray(x, jnp.float32)))
    if norm == "rmsnorm":
        want = rms_norm(x, np.asarray(module.scale[...]), 0.25)
    else:
        want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 0.25)
        if norm == "layernorm":
            want = want * np.asarray(module.scale[...]) + np.asarray(module.bias[...])
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    decoder = Decoder(cfg, nnx.Rngs(0))
    norms = [m for _, m in nnx.iter_modules(decoder) if isinstance(m, (nnx.LayerNorm, nnx.RMSNorm))]
    assert len(norms) == 5  # attention and MLP norms, q and k norms (scanned: one module each), the final norm
    assert {m.epsilon for m in norms} == {0.25}


def test_default_norm_eps_is_the_old_fixed_epsilon():
    """Configs saved before model.norm_eps existed get 1e-5, the epsilon every norm had (saved_config)."""
    assert base_config().model.norm_eps == 1e-5
    assert layers.make_norm(base_config().model, nnx.Rngs(0)).epsilon == 1e-5


def test_the_kv_cache_holds_only_the_key_value_heads():
    """init_cache: [layers, B, S, num_kv_heads, head_dim] (scanned) or one [B, S, K, H] per layer; cache_bytes (what
    tools/aot_compile.py --decode_context prints) is the arrays' size: 2 x 2 x 2 x 8 x 2 x 16 x 2 bytes in bf16.
    Caught: the cache sized by num_heads (twice the bytes here)."""
    from scone_jax.model.transformer import cache_bytes, init_cache

    cfg = qwen3_cfg(dtype="bfloat16")
    cache = init_cache(cfg, 2, 8)
    assert cache.key.shape == (2, 2, 8, 2, 16) and cache.key.dtype == jnp.bfloat16
    assert cache_bytes(cfg, 2, 8) == cache.key.nbytes + cache.value.nbytes == 2 * 2 * 2 * 8 * 2 * 16 * 2
    cfg.scan_layers = False
    assert [v.shape for v in init_cache(cfg, 2, 8).value] == [(2, 8, 2, 16)] * 2


@pytest.mark.parametrize("overrides,message", [
    (dict(num_heads=4, num_kv_heads=3), r"^model.num_kv_heads=3 does not divide model.num_heads=4: each key/value "
                                        r"head serves an equal group of query heads. Fix: a divisor"),
    (dict(num_kv_heads=-1), r"^model.num_kv_heads=-1 is not valid: it must be >= 0"),
    (dict(norm_eps=0.0), r"^model.norm_eps=0.0 is not valid: it must be > 0"),
])
def test_bad_attention_settings_are_one_line_errors(overrides, message):
    from scone_jax import config as config_lib
    from tests.common import small_config

    config = small_config(**overrides)
    with pytest.raises(ValueError, match=message):
        config_lib.validate(config)
