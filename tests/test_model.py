"""Decoder: both architecture styles run, packing isolates documents, logical axes are set."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scone_jax.config import base_config
from scone_jax.model import accounting
from scone_jax.model.transformer import Decoder

STYLES = {
    "gpt2": dict(norm="layernorm", mlp="gelu", position="learned", use_bias=True, tie_embeddings=True),
    "olmo": dict(norm="nonparametric_layernorm", mlp="swiglu", position="rope", use_bias=False, tie_embeddings=False),
    "rms": dict(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, tie_embeddings=True),
}


def small_model_cfg(**overrides):
    cfg = base_config().model
    cfg.update(dict(vocab_size=96, d_model=32, num_layers=2, num_heads=4, d_ff=64, max_seq_len=32))
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("style", sorted(STYLES))
def test_packed_sequence_losses_equal_documents_run_alone(style):
    model = Decoder(small_model_cfg(**STYLES[style]), nnx.Rngs(0))
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 96, n) for n in (7, 12, 5)]
    tokens = np.concatenate(docs)[None]
    segments = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)])[None]
    positions = np.concatenate([np.arange(len(d)) for d in docs])[None]
    packed = model(jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions))[0]
    start = 0
    for d in docs:
        alone = model(jnp.asarray(d[None]), jnp.ones((1, len(d)), jnp.int32), jnp.arange(len(d))[None])[0]
        np.testing.assert_allclose(packed[start:start + len(d)], alone, rtol=2e-5, atol=2e-5)
        start += len(d)


def test_logits_are_causal():
    model = Decoder(small_model_cfg(), nnx.Rngs(0))
    tokens = np.arange(10)[None] % 96
    seg, pos = np.ones((1, 10), np.int32), np.arange(10)[None]
    full = model(jnp.asarray(tokens), seg, pos)
    changed = tokens.copy()
    changed[0, 7] = 50
    other = model(jnp.asarray(changed), seg, pos)
    np.testing.assert_allclose(full[0, :7], other[0, :7], rtol=1e-6)
    assert not np.allclose(full[0, 7:], other[0, 7:])


def test_every_parameter_matrix_has_logical_axes():
    model = Decoder(small_model_cfg(**STYLES["olmo"]), nnx.Rngs(0))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = var.get_metadata().get("out_sharding")
        if var.get_value().ndim >= 2:
            assert names is not None and len(names) == var.get_value().ndim, path


def test_bfloat16_compute_keeps_fp32_master_weights():
    model = Decoder(small_model_cfg(dtype="bfloat16"), nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    assert {v.dtype for v in jax.tree.leaves(params)} == {np.dtype("float32")}
    logits = model(jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None])
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_param_counts_match_formula():
    cfg = small_model_cfg(**STYLES["gpt2"])
    counts = accounting.param_counts(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    d, f, layers = cfg.d_model, cfg.d_ff, cfg.num_layers
    per_layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # weights, biases, two LayerNorms
    assert counts["embedding"] == 96 * d + 32 * d
    assert counts["non_embedding"] == layers * per_layer + 2 * d
