"""Decoder: both architecture styles run, packing isolates documents, logical axes are set;
scanned and unscanned blocks and every remat policy compute the same; decoding with a KV cache
gives the full pass's logits."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scone_jax.config import base_config
from scone_jax.model import accounting, layout
from scone_jax.model.transformer import Decoder, init_cache
from tests.common import assert_sums_close, largest

STYLES = {
    "gpt2": dict(norm="layernorm", mlp="gelu", position="learned", use_bias=True, tie_embeddings=True),
    "olmo": dict(norm="nonparametric_layernorm", mlp="swiglu", position="rope", use_bias=False, tie_embeddings=False),
    "rms": dict(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, tie_embeddings=True),
    # Qwen3's kind: 4 query heads over 2 key/value heads of width 16 (not d_model / heads), q/k norm, eps 1e-6;
    # with Llama 3.1's RoPE scaling over an 'original' context of 16 (so it changes these short texts)
    "qwen3": dict(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, tie_embeddings=False,
                  num_kv_heads=2, head_dim=16, qk_norm=True, norm_eps=1e-6, rope_scaling="llama3",
                  rope_scaling_factor=8.0, rope_original_max_len=16),
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


def gpt2_non_embedding_params(cfg) -> int:
    """By hand: per block the weights, biases and two LayerNorms, then the final LayerNorm."""
    d, f = cfg.d_model, cfg.d_ff
    return cfg.num_layers * (4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d) + 2 * d


def test_param_counts_match_formula():
    cfg = small_model_cfg(**STYLES["gpt2"])
    counts = accounting.param_counts(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    assert counts["embedding"] == 96 * cfg.d_model + 32 * cfg.d_model
    assert counts["non_embedding"] == gpt2_non_embedding_params(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_training_flops_per_token_match_the_formula(tied):
    """accounting's formula, by hand: 6 x (the blocks' matmul weights and parameters + one d x V output
    matmul) + attention. Tied or not, the head is one matmul: an untied head counted both as a parameter
    and as the tied table (the bug this caught: MFU 9% too high for olmo_paper.py:1b untied) fails the
    untied case."""
    cfg = small_model_cfg(**(STYLES["gpt2"] | {"tie_embeddings": tied}))
    counts = accounting.param_counts(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    d, seq = cfg.d_model, 32
    want = 6 * (gpt2_non_embedding_params(cfg) + d * cfg.vocab_size) + 12 * cfg.num_layers * seq * d
    assert accounting.decoder_flops_per_token(cfg, seq, counts["non_embedding"]) == want


def unscanned_and_scanned(cfg, model_cls=Decoder, *args):
    """The same parameters in both block layouts: an unscanned model, and a scanned one whose
    state is the unscanned state converted by layout.convert."""
    cfg_loop = cfg.copy_and_resolve_references()
    cfg_loop.scan_layers = False
    loop = model_cls(cfg_loop, *args, nnx.Rngs(0))
    cfg_scan = cfg.copy_and_resolve_references()
    cfg_scan.scan_layers = True
    scan = model_cls(cfg_scan, *args, nnx.Rngs(1))
    nnx.update(scan, layout.convert(nnx.state(loop), nnx.state(scan)))
    return loop, scan


def loss_and_grads(model, tokens, segments, positions):
    def loss(m):
        logits = m(tokens, segments, positions)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return nnx.jit(nnx.value_and_grad(loss))(model)


def packed_inputs(batch=3, seq=16):
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, 96, (batch, seq)), jnp.int32)
    segments = jnp.asarray(np.where(np.arange(seq) < seq // 2, 1, 2)[None].repeat(batch, 0), jnp.int32)
    positions = jnp.asarray(np.where(np.arange(seq) < seq // 2, np.arange(seq), np.arange(seq) - seq // 2)[None]
                            .repeat(batch, 0), jnp.int32)
    return tokens, segments, positions


@pytest.mark.parametrize("style", [pytest.param("gpt2", marks=pytest.mark.slow), "olmo"])
def test_scanned_blocks_equal_the_python_loop_in_loss_and_gradients(style):
    """One scan over stacked layers == a loop over separate blocks (fp32), with the same
    parameters moved between layouts by layout.convert. Catches layers applied in reverse
    order and a scan that feeds every layer the first layer's parameters (both seen to fail)."""
    loop, scan = unscanned_and_scanned(small_model_cfg(num_layers=3, **STYLES[style]))
    inputs = packed_inputs()
    l1, g1 = loss_and_grads(loop, *inputs)
    l2, g2 = loss_and_grads(scan, *inputs)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    back = layout.convert(g2, g1)  # scanned gradients in the loop's layout, per layer
    for (path, want), (p2, got) in zip(nnx.to_flat_state(g1), nnx.to_flat_state(back)):
        assert path == p2
        assert_sums_close(got.get_value(), want.get_value(), inputs[0].size, largest(g1), err_msg=str(path))


def test_scanned_parameters_carry_the_layers_axis():
    model = Decoder(small_model_cfg(num_layers=3), nnx.Rngs(0))
    kernel = model.stack.blocks.mlp.up.kernel
    assert kernel.get_value().shape == (3, 32, 64)
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("style", ["gpt2", "olmo", "qwen3"])
def test_cached_decoding_equals_the_full_forward_pass(style, scan):
    """Decoder.decode with a KV cache (a 5-token prefill, then one token per call, in a cache longer
    than the text) gives the full pass's logits: learned positions or RoPE, scanned or looped layers,
    and Qwen3's grouped-query attention with q/k norm (and llama3 RoPE scaling), whose cache holds only
    the 2 key/value heads.
    Measured max |diff| <= 9e-8 (|logits| <= 0.7). Deliberate bugs, each seen to fail here: the new
    keys written one slot late in Attention (1.3e-3 to 2.4e-3), the scanned stack handing every
    layer the first layer's cache (0.045, 0.075; the loop has no such step), and (qwen3) the key
    written into the cache before its q/k norm."""
    cfg = small_model_cfg(num_layers=3, scan_layers=scan, **STYLES[style])
    model = Decoder(cfg, nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 96, (2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), tokens.shape)
    full = model(tokens, jnp.ones_like(tokens), positions)
    cache = init_cache(cfg, 2, 16)
    heads = (2, 16) if style == "qwen3" else (4, 8)  # key/value heads, head width
    assert (cache.key.shape == (3, 2, 16, *heads)) if scan else [k.shape for k in cache.key] == [(2, 16, *heads)] * 3
    step = nnx.jit(lambda m, t, p, c: m.decode(m.embed(t), None, p, c))
    logits = []
    for start, end in [(0, 5)] + [(i, i + 1) for i in range(5, 12)]:
        h, cache = step(model, tokens[:, start:end], positions[:, start:end], cache)
        logits.append(model.logits(h))
    assert int(cache.index) == 12
    np.testing.assert_allclose(jnp.concatenate(logits, axis=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["full", pytest.param("save_dots", marks=pytest.mark.slow),
                                    pytest.param("save_qkv_proj", marks=pytest.mark.slow)])
@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_remat_policies_change_memory_not_results(policy, scan):
    """Every policy gives the loss and gradients of no remat (fp32), scanned or not."""
    cfg = small_model_cfg(scan_layers=scan)
    reference = Decoder(cfg, nnx.Rngs(0))
    remat = Decoder(small_model_cfg(scan_layers=scan, remat=policy), nnx.Rngs(0))
    inputs = packed_inputs()
    l1, g1 = loss_and_grads(reference, *inputs)
    l2, g2 = loss_and_grads(remat, *inputs)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        assert_sums_close(a, b, inputs[0].size, largest(g1))


def test_remat_policies_are_in_the_backward_program():
    """'full' recomputes every matmul of the block in the backward pass; 'save_dots' only the
    attention's batched ones (scores and mixing)."""
    inputs = packed_inputs()

    def dots(policy):
        model = Decoder(small_model_cfg(remat=policy), nnx.Rngs(0))
        graphdef, params = nnx.split(model)

        def loss(p):
            return nnx.merge(graphdef, p)(*inputs).mean()

        return jax.jit(jax.grad(loss)).lower(params).as_text().count("dot_general")

    assert dots("full") > dots("save_dots") > dots("none")  # save_dots recomputes only the attention dots


def test_unknown_remat_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="Unknown model.remat='dots'; valid policies: none, full, save_dots, save_qkv_proj"):
        Decoder(small_model_cfg(remat="dots"), nnx.Rngs(0))
