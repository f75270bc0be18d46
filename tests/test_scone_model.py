"""SCONE model: per-shard dedup equals the naive path; no cross-device f-gram traffic."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scone_jax import sharding, state as state_lib, steps
from scone_jax.model.scone import SconeModel
from scone_jax.steps import token_losses
from tests.common import random_batch, small_config

K, U, NUM_FGRAMS = 4, 24, 40


def scone_config(**scone_overrides):
    config = small_config()
    config.scone.update(dict(enabled=True, max_len=K, fgram_capacity=U, num_layers=1, **scone_overrides))
    return config


def random_fgrams(seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, K + 1, NUM_FGRAMS).astype(np.int32)
    tokens = rng.integers(300, 512, (NUM_FGRAMS, K)).astype(np.int32)  # ids the inputs never use
    tokens[np.arange(K)[None] >= lengths[:, None]] = 0
    return tokens, lengths


def dedup_reference(fgram_ids, vocab_tokens, vocab_lengths, num_shards):
    """Plain per-shard dedup, one row per unique f-gram (no prefix sharing): a valid input too."""
    b, t = fgram_ids.shape
    rows_tokens = np.zeros((num_shards * U, K), np.int32)
    rows_lengths = np.zeros(num_shards * U, np.int32)
    index = np.full((b, t), -1, np.int32)
    per = b // num_shards
    for s in range(num_shards):
        slots = {}
        for r in range(s * per, (s + 1) * per):
            for c in range(t):
                f = fgram_ids[r, c]
                if f >= 0:
                    slot = slots.setdefault(int(f), len(slots))
                    index[r, c] = slot * K + vocab_lengths[f] - 1  # (row, last position) slot
                    rows_tokens[s * U + slot] = vocab_tokens[f]
                    rows_lengths[s * U + slot] = vocab_lengths[f]
        assert len(slots) <= U
    return rows_tokens, rows_lengths, index


def scone_batch(num_shards, seed=0):
    batch = random_batch(seed=seed, vocab=300)
    tokens, lengths = random_fgrams()
    rng = np.random.default_rng(seed + 100)
    ids = np.where(rng.random(batch["inputs"].shape) < 0.5, rng.integers(0, 12, batch["inputs"].shape), -1)
    ids = ids.astype(np.int32)  # 12 distinct f-grams, heavily repeated, as in real text
    rows_tokens, rows_lengths, index = dedup_reference(ids, tokens, lengths, num_shards)
    batch.update(fgram_tokens=rows_tokens, fgram_lengths=rows_lengths, fgram_index=index)
    return batch, ids, tokens, lengths


def naive_losses(model, batch, ids, vocab_tokens, vocab_lengths):
    """The f-gram model on every matched position, no dedup (tests only)."""
    b, t = ids.shape
    flat = np.maximum(ids.reshape(-1), 0)
    emb = model.fgram_embeddings(jnp.asarray(vocab_tokens[flat]), jnp.asarray(vocab_lengths[flat]))
    x = model.decoder.embed(batch["inputs"])
    x = jnp.where((ids >= 0)[..., None], emb.reshape(b, t, -1), x)
    logits = model.decoder.logits(model.decoder.decode(x, batch["segment_ids"], batch["positions"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]) * batch["loss_mask"]


@pytest.mark.parametrize("num_shards", [1, 4])
def test_dedup_path_equals_naive_path_in_loss_and_gradients(num_shards):
    config = scone_config()
    config.model.tie_embeddings = False  # so T's gradient comes from the inputs alone
    model = SconeModel(config.model, config.scone, nnx.Rngs(0))
    batch, ids, tokens, lengths = scone_batch(num_shards)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}

    def dedup_loss(m):
        return token_losses(m, batch).sum()

    def naive_loss(m):
        return naive_losses(m, batch, ids, tokens, lengths).sum()

    l1, g1 = nnx.jit(nnx.value_and_grad(dedup_loss))(model)
    l2, g2 = nnx.jit(nnx.value_and_grad(naive_loss))(model)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    flat1, flat2 = nnx.to_flat_state(g1), nnx.to_flat_state(g2)
    for (p1, v1), (p2, v2) in zip(flat1, flat2):
        assert p1 == p2
        np.testing.assert_allclose(v1.get_value(), v2.get_value(), rtol=1e-4, atol=1e-5, err_msg=str(p1))
    # T gets gradient through the f-gram model too: rows of tokens seen only inside f-grams.
    table_grad = np.abs(np.asarray(g1["decoder"]["token_embed"]["embedding"].get_value())).sum(1)
    assert table_grad[np.unique(tokens[:12][tokens[:12] > 0])].min() > 0
    assert table_grad[300:].sum() > 0 and table_grad[np.setdiff1d(np.arange(300, 512), tokens[:12])].max() == 0


def test_fgram_model_ignores_right_padding():
    config = scone_config()
    model = SconeModel(config.model, config.scone, nnx.Rngs(0))
    tokens = jnp.array([[5, 6, 0, 0], [5, 6, 77, 88]], jnp.int32)
    out = model.fgram_embeddings(tokens, jnp.array([2, 2], jnp.int32))
    np.testing.assert_allclose(out[0], out[1], rtol=1e-6)
    longer = model.fgram_embeddings(tokens, jnp.array([2, 3], jnp.int32))
    assert not np.allclose(longer[0], longer[1])


def test_wider_fgram_model_is_projected_to_the_main_width():
    config = scone_config(d_model=96, num_heads=4, d_ff=192)
    model = SconeModel(config.model, config.scone, nnx.Rngs(0))
    out = model.fgram_embeddings(jnp.ones((3, K), jnp.int32), jnp.array([2, 3, 4], jnp.int32))
    assert out.shape == (3, config.model.d_model)


def compiled_hlo(mesh_shape):
    config = scone_config()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    step = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    batch, *_ = scone_batch(sharding.num_batch_shards(mesh))
    abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding.batch_sharding(mesh, v.ndim))
                      for k, v in batch.items()}
    return step.lower(state_lib.abstract_with_shardings(spec), abstract_batch).compile().as_text()


def test_no_cross_device_fgram_traffic_on_a_data_parallel_mesh():
    hlo = compiled_hlo((8, 1, 1))
    assert "all-to-all" not in hlo
    assert "all-gather" not in hlo and "collective-permute" not in hlo
    assert "all-reduce" in hlo  # gradients are still averaged


def test_fsdp_gathers_only_parameters_never_fgram_rows():
    hlo = compiled_hlo((2, 4, 1))
    gathers = re.findall(r"= (\S+) all-gather\(", hlo) + re.findall(r"= (\S+) all-to-all\(", hlo)
    assert gathers  # FSDP does gather parameters...
    forbidden = {U * k for k in range(1, 9)}  # ...but never f-gram rows (U per shard, 8 shards)
    for shape in gathers:
        dims = {int(x) for x in re.findall(r"\d+", shape.split("[")[1].split("]")[0])}
        assert not dims & forbidden, shape
