"""SCONE model: the production batch layout equals the naive path; no cross-device f-gram traffic."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scone_jax import sharding
from scone_jax.model.scone import SconeModel
from scone_jax.training import state as state_lib, steps
from scone_jax.model.scone import token_losses
from tests.common import assert_sums_close, largest, small_config
from tests.scone_batches import K, device_arrays, production_batch


def scone_config(**scone_overrides):
    config = small_config(num_layers=1)  # one block: what is compared is independent of depth
    config.scone.update(dict(enabled=True, max_len=K, fgram_capacity=48, num_layers=1, **scone_overrides))
    return config


def naive_losses(model, batch, vocab):
    """Every matched position runs its own f-gram (the global id's tokens) through the f-gram
    model: no dedup, no prefix sharing, no groups (the plain reference; tests only)."""
    ids = batch.fgram_ids
    b, t = ids.shape
    flat = np.maximum(ids.reshape(-1), 0)
    emb = model.fgram_embeddings(jnp.asarray(vocab.tokens[flat]), jnp.asarray(vocab.lengths[flat]))
    x = model.decoder.embed(batch.inputs)
    x = jnp.where((ids >= 0)[..., None], emb.reshape(b, t, -1), x)
    logits = model.decoder.logits(model.decoder.decode(x, batch.segment_ids, batch.positions))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets) * batch.loss_mask


# Deliberate bugs in the f-gram arrays the model reads; each must move the loss far outside
# the equivalence tolerance (checked below, so the equivalence test is known to bite).
def _whole_fgram_everywhere(b):
    """Every matched position reads its row's last token: the maximal f-gram, not its own prefix."""
    index = b.fgram_slot.copy()
    groups, capacity, k = b.fgram_tokens.shape
    row = index // k
    group = np.arange(len(index))[:, None] // (len(index) // groups)
    last = b.fgram_lengths[group, np.minimum(row, capacity - 1)] - 1
    return b.replace(fgram_slot=np.where(index >= 0, row * k + last, -1).astype(np.int32))


def _shift_slot(b):
    """Each slot one row further on (the next maximal f-gram of the group)."""
    index = b.fgram_slot
    capacity, k = b.fgram_tokens.shape[1:]
    return b.replace(fgram_slot=np.where(index >= 0, (index + k) % (capacity * k), -1).astype(np.int32))


def _swap_groups(b):
    """Groups 0 and 1 exchange their f-gram rows (two shards' rows swapped)."""
    order = np.arange(b.fgram_tokens.shape[0])
    order[:2] = [1, 0]
    return b.replace(fgram_tokens=b.fgram_tokens[order], fgram_lengths=b.fgram_lengths[order])


CORRUPTIONS = {"whole_fgram_everywhere": _whole_fgram_everywhere, "shift_slot": _shift_slot,
               "swap_groups": _swap_groups}


@nnx.jit
def per_token_losses(model, batch):
    return token_losses(model, batch)


@nnx.jit
def loss_and_grads(model, batch):
    return nnx.value_and_grad(lambda m: token_losses(m, batch).sum())(model)


@pytest.mark.parametrize("num_shards,capacity,micro_batches", [
    pytest.param(1, 96, 1, marks=pytest.mark.slow), pytest.param(2, 48, 1, marks=pytest.mark.slow),
    pytest.param(4, 24, 1, marks=pytest.mark.slow), (2, 48, 2)])
def test_production_layout_equals_the_naive_path_in_loss_and_gradients(num_shards, capacity, micro_batches):
    """FgramBatcher's batch (per-group dedup, prefix sharing, slots) through SconeModel equals
    running the f-gram model at every matched position, in the loss and in every gradient (fp32).
    Catches: reading the whole maximal f-gram at every position instead of its prefix, a slot
    shifted by one row, two shards' rows swapped (each asserted below to move the loss by far
    more than the tolerance)."""
    config = scone_config()
    config.model.tie_embeddings = False  # so T's gradient comes from the inputs alone
    model = SconeModel(config.model, config.scone, nnx.Rngs(0))
    host, vocab = production_batch(num_shards, capacity, micro_batches)
    assert (host.fgram_ids >= 0).mean() > 0.2 and (host.fgram_lengths > 0).sum() < host.fgram_unique.sum()
    batch = device_arrays(host)
    l1, g1 = loss_and_grads(model, batch)
    def naive_loss(m):
        per_token = naive_losses(m, host, vocab)
        return per_token.sum(), per_token

    (l2, naive), g2 = nnx.jit(nnx.value_and_grad(naive_loss, has_aux=True))(model)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    flat1, flat2 = nnx.to_flat_state(g1), nnx.to_flat_state(g2)
    assert len(flat1) == len(flat2)
    for (p1, v1), (p2, v2) in zip(flat1, flat2):
        assert p1 == p2
        assert_sums_close(v1.get_value(), v2.get_value(), host.inputs.size, largest(g2), err_msg=str(p1))
    # T gets gradient through the f-gram model too: rows of tokens seen only inside f-grams.
    table_grad = np.abs(np.asarray(g1["decoder"]["token_embed"]["embedding"].get_value())).sum(1)
    in_fgrams = np.unique(vocab.tokens[np.unique(host.fgram_ids[host.fgram_ids >= 0])])
    assert table_grad[in_fgrams[in_fgrams >= 300]].min() > 0
    assert table_grad[340:].max() == 0
    naive = np.asarray(naive)
    np.testing.assert_allclose(per_token_losses(model, batch), naive, atol=2e-5)
    for name, corrupt in CORRUPTIONS.items():
        if name == "swap_groups" and host.fgram_tokens.shape[0] < 2:
            continue
        bad = np.asarray(per_token_losses(model, device_arrays(corrupt(host))))
        assert np.abs(bad - naive).max() > 0.05, name  # per-token losses agree to 2e-5 above


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


def test_fgram_model_blocks_share_the_main_models_attention_kind():
    """fgram_block_config (docs/training.md): the f-gram model's blocks keep the main model's key/value heads,
    q/k norm and norm epsilon (not RoPE or its scaling: it has K learned positions), also with heads of its own (8 query heads over the main model's 2 key/value
    heads); config.validate refuses f-gram heads that are no multiple of them, naming both keys. Caught: the
    f-gram model's key/value heads reset to its own head count (its key kernel 8 heads wide)."""
    from scone_jax import config as config_lib
    from scone_jax.model.fgram_model import fgram_block_config

    config = scone_config(num_heads=8)
    with config.unlocked():
        config.model.update(dict(num_kv_heads=2, qk_norm=True, norm_eps=1e-6, position="rope", rope_scaling="yarn",
                                 rope_scaling_factor=4.0))
    config_lib.validate(config)
    block = fgram_block_config(config.model, config.scone)
    assert (block.num_heads, block.num_kv_heads, block.qk_norm, block.norm_eps) == (8, 2, True, 1e-6)
    assert (block.position, block.rope_scaling) == ("learned", "none")  # K learned positions: nothing to scale
    model = SconeModel(config.model, config.scone, nnx.Rngs(0))
    attn = model.fgram_model.stack.blocks.attn
    assert attn.key.kernel[...].shape == (1, 64, 2 * 8) and attn.query.kernel[...].shape == (1, 64, 8 * 8)
    assert attn.key_norm.scale[...].shape == (1, 8)
    out = model.fgram_embeddings(jnp.ones((3, K), jnp.int32), jnp.array([2, 3, 4], jnp.int32))
    assert out.shape == (3, 64) and np.isfinite(np.asarray(out)).all()
    with config.unlocked():
        config.scone.num_heads = 6
        config.model.num_kv_heads = 4
    with pytest.raises(ValueError, match=r"^scone.num_heads=6 is not a multiple of model.num_kv_heads=4, which the "
                                         r"f-gram model shares. Fix: a multiple of it, or 0"):
        config_lib.validate(config)


def compiled_hlo(mesh_shape):
    config = scone_config()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    step = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    batch, _ = production_batch(sharding.num_batch_shards(mesh), 48)
    batch = device_arrays(batch)
    abstract_batch = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding.batch_sharding(mesh)), batch)
    return step.lower(state_lib.abstract_with_shardings(spec), abstract_batch).compile().as_text()


def test_no_cross_device_fgram_traffic_on_a_data_parallel_mesh():
    hlo = compiled_hlo((8, 1, 1))
    assert "all-to-all" not in hlo
    assert "all-gather" not in hlo and "collective-permute" not in hlo
    assert "all-reduce" in hlo  # gradients are still averaged


@pytest.mark.slow
def test_fsdp_gathers_only_parameters_never_fgram_rows():
    hlo = compiled_hlo((2, 4, 1))
    gathers = re.findall(r"= (\S+) all-gather\(", hlo) + re.findall(r"= (\S+) all-to-all\(", hlo)
    assert gathers  # FSDP does gather parameters...
    forbidden = {48 * k for k in range(1, 9)}  # ...but never f-gram rows (48 per shard, 8 shards)
    for shape in gathers:
        dims = {int(x) for x in re.findall(r"\d+", shape.split("[")[1].split("]")[0])}
        assert not dims & forbidden, shape
