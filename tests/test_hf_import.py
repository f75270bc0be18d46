"""Hugging Face checkpoints into scone_jax (hf/derive.py, hf/load.py, training/state.py): logits within 1e-4 of
transformers (the reference) in fp32 on a right-padded batch for tiny random checkpoints of every family (grouped
k/v heads, head_dim != d_model / heads, tied and untied heads, every norm weight random, Llama 3.1's RoPE scaling),
loaded into a mesh that shards them; each block read once; a fresh run's state built from them; the config derived.

Deliberate bugs these tests were run against once (each made the named test fail):
  - load.stored_block ignoring a part's offset (GPT-2's c_attn: k and v read q's columns)
    (test_logits_match_transformers[gpt2-untied]);
  - load_decoder's per-array block cache dropped
    (test_each_block_is_read_once_into_its_sharding: twice the bytes, once per data replica);
  - the Llama layout mapping input_layernorm to mlp_norm and post_attention_layernorm to attn_norm
    (test_logits_match_transformers[llama-untied]: norm weights randomised, as transformers leaves them at 1);
  - _create not updating the decoder with the loaded parameters (test_a_fresh_scone_run_starts_from_the_checkpoint);
  - derive._set writing the derived value over a user's different one silently
    (test_a_model_key_set_by_the_user_that_differs_is_refused_naming_both);
  - derive.apply leaving data.add_bos at its default
    (test_documents_start_with_a_bos_as_the_checkpoints_tokenizer_starts_them[qwen3-False, gpt2-False, olmo-False]).
"""
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from scone_jax import sharding
from scone_jax.hf import derive, load as hf_load, safetensors as st
from scone_jax.hf.checkpoint_dir import HfCheckpointError
from scone_jax.training import run as run_lib, state as state_lib
from tests import hf_models

LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # short: positions 0..11 cross bands
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8}


def mesh_config(directory, scan_layers=True, **data):
    config = hf_models.import_config(directory, **data)
    config.mesh.update(dict(data=2, fsdp=2, tensor=2))
    config.model.scan_layers = scan_layers
    return config


def loaded_decoder(directory, config, by_rows=None):
    """The checkpoint's decoder as training builds it: derived config, the spec's shardings, the loader."""
    checkpoint = derive.apply(config)
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    params, report = hf_load.load_decoder(checkpoint, state_lib.abstract_with_shardings(spec)[0], by_rows=by_rows)
    return nnx.merge(spec.model_graphdef, params), params, spec, report, checkpoint


SLOW = pytest.mark.slow  # the fast tier keeps one case of each family and one of each loading route

CASES = [  # (family, tie, transformers overrides, scan_layers); 2 k/v heads for 4 query heads except GPT-2's
    pytest.param("gpt2", False, {}, True, id="gpt2-untied"),
    pytest.param("gpt2", True, {}, False, id="gpt2-tied-unscanned", marks=SLOW),
    pytest.param("llama", False, {}, True, id="llama-untied"),  # head_dim 16 != 48 / 4
    pytest.param("llama", True, {"rope_parameters": LLAMA31}, False, id="llama3.1-tied-unscanned", marks=SLOW),
    pytest.param("qwen3", False, {}, True, id="qwen3-untied", marks=SLOW),
    pytest.param("qwen3", True, {}, True, id="qwen3-tied"),
    pytest.param("qwen3", False, {"rope_parameters": YARN}, True, id="qwen3-yarn", marks=SLOW),
    pytest.param("olmo", False, {}, True, id="olmo-untied"),
    pytest.param("olmo", True, {}, False, id="olmo-tied-unscanned", marks=SLOW),
]


@pytest.mark.parametrize("family,tie,overrides,scan", CASES)
def test_logits_match_transformers(tmp_path, family, tie, overrides, scan):
    model = hf_models.save_checkpoint(str(tmp_path), family, tie=tie, **overrides)
    config = mesh_config(str(tmp_path), scan_layers=scan)
    decoder, *_ = loaded_decoder(str(tmp_path), config)
    tokens, lengths = hf_models.padded_batch()
    want = hf_models.hf_logits(model, tokens, lengths)
    assert np.abs(want).max() > 1  # logits of a few units: 1e-4 is tight
    worst = hf_models.assert_logits_match(hf_models.our_logits(decoder, tokens, lengths), want, lengths)
    print(f"{family} tie={tie} {overrides}: max |logit difference| {worst:.1e}")


@pytest.mark.parametrize("by_rows", [False, pytest.param(True, marks=SLOW)], ids=["target_blocks", "rows_then_moved"])
def test_each_block_is_read_once_into_its_sharding(tmp_path, by_rows):
    """Over data 2 x fsdp 2 x tensor 2 every parameter is made in its spec's sharding, with the values the file
    holds in our layout (the [out, in] weights transposed), and the bytes read are the checkpoint's tensors' bytes
    once: blocks that the data axis replicates are read once, not once per device. Both ways of reading
    (load._read_sharding: the target's blocks, CPU's default; contiguous rows moved into place on the devices,
    accelerators' default). Deliberate bug: load_decoder moving a block into the target sharding only when it is
    transposed or converted: 'rows_then_moved' left the embedding in its read sharding P(('tensor', 'fsdp'))."""
    hf_models.save_checkpoint(str(tmp_path), "llama")
    config = mesh_config(str(tmp_path))
    _, params, spec, report, checkpoint = loaded_decoder(str(tmp_path), config, by_rows=by_rows)
    assert report.bytes_read == hf_load.expected_bytes(checkpoint) > 0
    flat = dict(nnx.to_flat_state(params))
    for path, shard_spec in nnx.to_flat_state(spec.shardings[0]):
        assert flat[path].get_value().sharding == shard_spec.get_value(), path
    file = st.SafetensorsFile(os.path.join(tmp_path, "model.safetensors"))
    q = np.asarray(flat[("stack", "blocks", "attn", "query", "kernel")].get_value())
    np.testing.assert_array_equal(q[1], file.read("model.layers.1.self_attn.q_proj.weight").T)
    embed = np.asarray(flat[("token_embed", "embedding")].get_value())
    np.testing.assert_array_equal(embed, file.read("model.embed_tokens.weight"))


@pytest.mark.slow  # the fast tier reads bf16 in test_hf_export's round trip
def test_a_bf16_checkpoint_loads_exactly_into_fp32_parameters(tmp_path):
    """bf16 safetensors (read without torch) become fp32 parameters holding the same values, and the logits match
    transformers' model computed in fp32 from those weights."""
    model = hf_models.save_checkpoint(str(tmp_path), "gpt2", dtype=torch.bfloat16)
    config = mesh_config(str(tmp_path))
    decoder, params, *_ , checkpoint = loaded_decoder(str(tmp_path), config)
    assert checkpoint.dtype == "BF16"
    wte = np.asarray(dict(nnx.to_flat_state(params))[("token_embed", "embedding")].get_value())
    assert wte.dtype == np.float32
    np.testing.assert_array_equal(wte, model.transformer.wte.weight.detach().numpy())  # model.float() of the bf16
    assert np.array_equal(wte.astype(ml_dtypes.bfloat16).astype(np.float32), wte)
    tokens, lengths = hf_models.padded_batch()
    hf_models.assert_logits_match(hf_models.our_logits(decoder, tokens, lengths),
                                  hf_models.hf_logits(model, tokens, lengths), lengths)


@pytest.mark.slow  # builds a whole SCONE run (its f-grams extracted, its state compiled)
def test_a_fresh_scone_run_starts_from_the_checkpoint(tmp_path):
    """run.build (FRESH) of a SCONE run with model.init_from_hf: the decoder's parameters are the checkpoint's, the
    optimizer's moments zeros of their shapes, the f-gram model exactly the random one a run without the
    checkpoint starts with."""
    hf_dir = str(tmp_path / "hf")
    hf_models.save_checkpoint(hf_dir, "gpt2")
    config = hf_models.import_config(hf_dir)
    config.scone.update(dict(enabled=True, max_len=3, fgram_capacity=64, num_layers=1, num_fgrams=500, min_count=2,
                             extract_max_tokens=20_000))
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])  # one device: the state compiles in half the time
    run = run_lib.build(config, str(tmp_path / "w"), mesh, start=run_lib.FRESH)
    decoder, *_ = loaded_decoder(hf_dir, _with(config, "scone.enabled", False))
    model, optimizer = nnx.merge(run.spec.graphdef, run.state)
    for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(model.decoder, nnx.Param)),
                                      nnx.to_flat_state(nnx.state(decoder, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(got.get_value()), np.asarray(want.get_value()), err_msg=str(path))
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(nnx.state(optimizer, nnx.optimizer.OptState))
               if np.asarray(x).ndim)
    random = state_lib.init_state(_with(config, "model.init_from_hf", ""), run.spec)
    for a, b in zip(jax.tree.leaves(nnx.state(model.fgram_model)), jax.tree.leaves(random[0]["fgram_model"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _with(config, key, value):
    """A copy of `config` with one key changed."""
    changed = config.copy_and_resolve_references()
    section, name = key.split(".")
    changed[section][name] = value
    return changed


def test_the_config_follows_the_checkpoint_and_its_tokenizer(tmp_path):
    """The model section is the checkpoint's (vocabulary = its rows, not the tokenizer's size rounded up), the
    tokenizer is its tokenizer.json with tokenizer_config.json's special tokens; derived twice it is the same."""
    hf_models.save_checkpoint(str(tmp_path), "llama")
    config = hf_models.import_config(str(tmp_path))
    derive.apply(config)
    m, d = config.model, config.data
    assert (m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.norm, m.mlp, m.position, m.use_bias,
            m.tie_embeddings) == (hf_models.VOCAB, 48, 2, 4, 80, "rmsnorm", "swiglu", "rope", False, False)
    assert d.tokenizer_path == os.path.join(str(tmp_path), "tokenizer.json")
    assert (d.bos_token, d.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    before = config.to_dict()
    derive.apply(config)
    assert config.to_dict() == before


def test_a_model_key_set_by_the_user_that_differs_is_refused_naming_both(tmp_path):
    hf_models.save_checkpoint(str(tmp_path), "gpt2")
    config = hf_models.import_config(str(tmp_path))
    config.model.d_model = 64
    with pytest.raises(HfCheckpointError) as e:
        derive.apply(config)
    text = str(e.value)
    assert "model.d_model=64 conflicts with" in text and "model.d_model=48" in text and "\n" not in text, text
    same = hf_models.import_config(str(tmp_path))
    same.model.d_model, same.model.num_layers = 48, 2  # the checkpoint's own values: fine
    derive.apply(same)
    assert same.model.d_model == 48


@pytest.mark.skipif("add_bos" not in hf_models.base_config().data, reason="data.add_bos comes with the decoder's "
                    "branch (arch); merged together")
@pytest.mark.parametrize("family,add_bos", [("llama", True), ("qwen3", False), ("gpt2", False), ("olmo", False)])
def test_documents_start_with_a_bos_as_the_checkpoints_tokenizer_starts_them(tmp_path, family, add_bos):
    """data.add_bos follows tokenizer_config.json's add_bos_token (Qwen3's and OLMo's say False), else whether
    tokenizer.json's template puts a special token first (Llama 3's does, GPT-2's has no template); and the
    pipeline's first row then starts with the bos or with the document."""
    from scone_jax.data import pipeline, tokenizer as tokenizer_lib

    hf_models.save_checkpoint(str(tmp_path), family)
    config = hf_models.import_config(str(tmp_path))
    derive.apply(config)
    assert config.data.add_bos is add_bos
    tokenizer = tokenizer_lib.Tokenizer.load(config.data.tokenizer_path, tokenizer_lib.special_tokens_of(config.data))
    first = pipeline.batch_builder(config.data, tokenizer)(0).inputs[0, 0]
    if family != "gpt2":  # GPT-2's bos is its eos: nothing tells it from the document's first id
        assert bool(first == tokenizer.bos_id) is add_bos
