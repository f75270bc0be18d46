"""Cached decoding with per-token table rows gives the logits of a full forward pass."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scone_jax.batch import Batch
from scone_jax.model import layers, scone, transformer
from scone_jax.model.transformer import Decoder
from scone_jax.serving import generate, inference
from tests import serving_run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return inference.load(serving_run.exported(tmp_path_factory, "float32"))


OLMO_BF16 = dict(position="rope", norm="rmsnorm", mlp="swiglu", dtype="bfloat16")
TEXT = "And God said, Let there be light: and there was light. And God saw the light, that it was good"


@pytest.fixture(scope="module")
def served_olmo_bf16(tmp_path_factory):
    """An OLMo-style model (RoPE, RMSNorm, SwiGLU) computing in bfloat16, exported with a bf16 table."""
    return inference.load(serving_run.exported_variant(tmp_path_factory, "olmo_bf16", "bfloat16", **OLMO_BF16))


@pytest.fixture(scope="module")
def served_olmo(served_olmo_bf16):
    """The same export computing in float32: model.dtype only sets the compute dtype (the parameters
    are float32 master weights either way), so one export serves both tests."""
    config = served_olmo_bf16.config.copy_and_resolve_references()
    with config.unlocked():
        config.model.dtype = "float32"
    graphdef, _ = nnx.eval_shape(lambda: nnx.split(Decoder(config.model, nnx.Rngs(0)), nnx.Param))
    return dataclasses.replace(served_olmo_bf16, config=config, graphdef=graphdef)


def real_text_rows(served, length=24):
    """Two rows of real text (offset by 2 tokens) with a BOS first: f-grams end at most positions."""
    tok = served.tokenizer
    ids = np.concatenate([[tok.bos_id], tok.encode(TEXT)]).astype(np.int32)
    return np.stack([ids[:length], ids[2:length + 2]])


def full_forward_logits(served, tokens):
    """The offloaded forward pass over whole sequences (one document each), no cache."""
    ones = np.ones_like(tokens)
    batch = inference.host_rows(served, Batch(inputs=tokens, segment_ids=ones,
                                              positions=np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)))
    return np.asarray(scone.batch_logits(served.decoder, jax.tree.map(jnp.asarray, batch.for_device()))), batch


def test_decode_path_logits_equal_a_full_forward_pass(served):
    tok = served.tokenizer
    text = "And God said, Let there be light: and there was light. And God saw the light"
    ids = np.concatenate([[tok.bos_id], tok.encode(text)]).astype(np.int32)
    prompts = np.stack([ids[:8], ids[3:11]])
    out = generate.Generator(served).generate(prompts, num_tokens=12)
    tokens = out["tokens"]
    assert tokens.shape == (2, 20) and (tokens[:, :8] == prompts).all()
    full, batch = full_forward_logits(served, tokens)
    np.testing.assert_allclose(out["logits"], full[:, 7:19], rtol=1e-4, atol=1e-4)
    assert (tokens[:, 8:] == full[:, 7:19].argmax(-1)).all()  # greedy picks what the full pass ranks first


def test_teacher_forced_decoding_of_real_text_matches_fgrams_step_by_step(served):
    """Real text ends f-grams at most steps (an untrained model's own samples rarely do)."""
    tok = served.tokenizer
    text = "And God said, Let there be light: and there was light. And God saw the light, that it was good"
    ids = np.concatenate([[tok.bos_id], tok.encode(text)]).astype(np.int32)[None, :24]
    out = generate.Generator(served).generate(ids[:, :6], num_tokens=18, forced=ids[:, 6:])
    np.testing.assert_array_equal(out["tokens"], ids)
    full, batch = full_forward_logits(served, ids)
    np.testing.assert_allclose(out["logits"], full[:, 5:23], rtol=1e-4, atol=1e-4)
    assert (batch.fgram_ids[:, 6:23] >= 0).mean() > 0.3
    no_table = generate.Generator(served, use_table=False).generate(ids[:, :6], num_tokens=18, forced=ids[:, 6:])
    assert not np.allclose(no_table["logits"], out["logits"], atol=1e-3)  # the rows did reach the model


def test_sampling_is_reproducible_and_respects_top_k(served):
    prompts = np.full((3, 4), served.tokenizer.bos_id, np.int32)
    gen = generate.Generator(served, temperature=1.0, top_k=5)
    a, b = gen.generate(prompts, 6, seed=1), gen.generate(prompts, 6, seed=1)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    ranks = (a["logits"] > np.take_along_axis(a["logits"], a["tokens"][:, 4:, None], -1)).sum(-1)
    assert ranks.max() < 5
    with pytest.raises(ValueError, match="max_seq_len=32"):
        gen.generate(prompts, 40)


def test_olmo_style_decoding_equals_a_full_forward_pass(served_olmo):
    """RoPE + RMSNorm + SwiGLU in fp32: the cached path rotates each new token's query and key by its
    own position, so decode == full forward to fp32 rounding (measured max |diff| 1.9e-5).
    Catches (each tried): the one-token steps' RoPE positions one ahead of their cache slot (max
    |diff| 18.7), one behind (17.6), the query rotated one position ahead of the keys (18.3), keys
    cached without RoPE (23.3); learned positions (the GPT-2 test) cannot show any of these."""
    assert served_olmo.decoder.pos_embed is None and served_olmo.decoder.dtype == jnp.float32
    ids = real_text_rows(served_olmo)
    out = generate.Generator(served_olmo).generate(ids[:, :6], num_tokens=18, forced=ids[:, 6:])
    np.testing.assert_array_equal(out["tokens"], ids)
    full, batch = full_forward_logits(served_olmo, ids)
    assert (batch.fgram_ids[:, 6:23] >= 0).mean() > 0.3  # the steps carry table rows
    np.testing.assert_allclose(out["logits"], full[:, 5:23], rtol=1e-4, atol=1e-4)


def test_bf16_olmo_decoding_with_a_bf16_cache_equals_a_full_forward_pass(served_olmo_bf16):
    """model.dtype=bfloat16: activations and the KV cache are bf16, so the cached path (one-token
    matmuls, a cache longer than the keys written so far) rounds differently from the full pass.
    Measured on these logits (|logit| <= 16, where one bf16 ulp is 0.0625), max |diff| (mean):
    decode vs full pass 0.21 (0.021); the full bf16 pass vs the same weights in fp32 1.05 (0.10); the
    cached path with every RoPE position shifted by one, a no-op in exact arithmetic, 1.38 (0.075).
    Deliberate bugs in the cached path, each tried: one-token steps' RoPE positions one ahead of
    their cache slot 18.5 (2.07), one behind 17.4 (2.09), the query rotated one position ahead of
    the keys 18.1 (2.99), keys cached without RoPE 23.3 (3.69).
    max < 4: ~3x the largest rounding effect (1.38) and ~4x below the smallest bug (17.4); mean < 0.5:
    5x the largest rounding effect (0.10), 4x below the smallest bug (2.07)."""
    generator = generate.Generator(served_olmo_bf16)
    cache = generator.empty_cache(2, 24)
    assert {a.dtype for a in jax.tree.leaves((cache.key, cache.value))} == {jnp.dtype(jnp.bfloat16)}
    ids = real_text_rows(served_olmo_bf16)
    out = generator.generate(ids[:, :6], num_tokens=18, forced=ids[:, 6:])
    full, _ = full_forward_logits(served_olmo_bf16, ids)
    diff = np.abs(out["logits"] - full[:, 5:23])
    assert diff.max() < 4.0 and diff.mean() < 0.5, (diff.max(), diff.mean())
    assert diff.max() > 0.01  # bf16 did run: in fp32 the two paths agree to 2e-5 (test above)


@pytest.mark.parametrize("module", ["Attention", "Block", "BlockStack"])
def test_decoding_runs_the_training_modules(served, monkeypatch, module):
    """Decoding has no attention, block or stack of its own: an architecture change made only in one
    of the training modules (here: its input scaled by 1.5, standing for any new option) changes the
    full pass's logits by up to 4-10 and the cached path follows it exactly. The decoder generate.py
    used to keep next to the model (its own cached attention and block loop) failed this for all three
    (max |diff| 10.5, 4.9, 4.4); so did writing the new keys one cache slot late (18-20)."""
    cls = {"Attention": layers.Attention, "Block": layers.Block, "BlockStack": transformer.BlockStack}[module]
    ids = real_text_rows(served)
    before, _ = full_forward_logits(served, ids)
    original = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, x, *args, **kw: original(self, 1.5 * x, *args, **kw))
    full, _ = full_forward_logits(served, ids)
    assert np.abs(full - before).max() > 1.0  # the change is part of the model
    out = generate.Generator(served).generate(ids[:, :6], num_tokens=18, forced=ids[:, 6:])
    np.testing.assert_allclose(out["logits"], full[:, 5:23], rtol=1e-4, atol=1e-4)


def without_bos(served):
    """`served` as a bundle of a run trained with data.add_bos=False would load (its stored config says so)."""
    config = served.config.copy_and_resolve_references()
    with config.unlocked():
        config.data.add_bos = False
    return dataclasses.replace(served, config=config)


@pytest.mark.parametrize("add_bos", [True, False])
def test_the_prompt_follows_the_bundles_add_bos(served, monkeypatch, capsys, add_bos):
    """`generate --prompt=TEXT` decodes from [bos] + ids, or from the ids alone when the bundle's run had
    data.add_bos=False (data/prompt.py); the printed text is the prompt and its continuation either way.
    Caught: the program's old prompt, bos prepended whatever the bundle says (the no-bos case)."""
    import types

    from scone_jax.data import prompt as prompt_lib

    bundle_served = served if add_bos else without_bos(served)
    monkeypatch.setattr(inference, "load", lambda *a, **k: bundle_served)
    prompts = []
    original = generate.Generator.generate
    monkeypatch.setattr(generate.Generator, "generate",
                        lambda self, p, *a, **k: prompts.append(np.asarray(p)) or original(self, p, *a, **k))
    value = types.SimpleNamespace
    args = value(export=value(value="bundle"), prompt=value(value="And God said"), num_tokens=value(value=4),
                 num_samples=value(value=1), temperature=value(value=0.0), top_k=value(value=0), top_p=value(value=1.0),
                 seed=value(value=0),
                 table=value(value="ram"), max_table_bytes=value(value=None))
    generate.run(args)
    tok = served.tokenizer
    ids = list(tok.encode("And God said"))
    assert prompts[0].tolist() == [([tok.bos_id] if add_bos else []) + ids]
    assert prompt_lib.prompt_ids(tok, "", False).tolist() == [tok.eos_id]  # no text, no bos: the previous eos
    assert capsys.readouterr().out.startswith("And God said")


def test_prompts_of_lengths_in_one_cache_size_share_one_compiled_step(served, monkeypatch):
    """Prompts of 6 and 9 tokens with 10 new tokens fill 16 and 19 cache slots, both rounded up to 64: the
    one-token step is traced once for both (a prompt set of 40 lengths compiled 40 steps before), the prefills
    once each, and each prompt still decodes exactly what the full forward pass gives it. Caught: the cache sized
    by the tokens it holds (the one-token step then traced again for the second length)."""
    traced = []
    hidden_states = scone.hidden_states

    def counting(decoder, batch, cache=None):
        if cache is not None:  # the generator's steps, not the full pass compared with
            traced.append(batch.inputs.shape)
        return hidden_states(decoder, batch, cache)

    monkeypatch.setattr(scone, "hidden_states", counting)
    generator = generate.Generator(served)
    ids = real_text_rows(served)
    for p in (6, 9):
        out = generator.generate(ids[:, :p], num_tokens=10, forced=ids[:, p:p + 10])
        full, _ = full_forward_logits(served, ids[:, :p + 10])
        np.testing.assert_allclose(out["logits"], full[:, p - 1:p + 9], rtol=1e-4, atol=1e-4)
    assert sorted(traced) == [(2, 1), (2, 6), (2, 9)]
    assert generate.cache_slots(16) == generate.cache_slots(64) == 64 and generate.cache_slots(65) == 128


def test_row_r_draws_token_i_with_fold_in_of_its_key_and_i(served):
    """The documented key schedule (Generator.generate): row r draws its new token i from the logits that chose it
    with fold_in(row_keys[r], i), the prompt's first token included (i = 0); generate_batch's per-sample keys rest
    on it. Checked against generate.sample called with those keys by hand. Caught: the prefill drawing with
    fold_in(key, 1), the key of the next token (the samples then stayed reproducible and batch-independent)."""
    prompts = np.full((2, 4), served.tokenizer.bos_id, np.int32)
    row_keys = jax.random.split(jax.random.key(7), 2)
    out = generate.Generator(served, temperature=1.0).generate(prompts, 4, row_keys=row_keys)
    for r in range(2):
        for i in range(4):
            key = jax.random.fold_in(row_keys[r], i)
            want = generate.sample(jnp.asarray(out["logits"][r, i]), key, 1.0)
            assert out["tokens"][r, 4 + i] == int(want), (r, i)


def test_the_printed_sample_keeps_the_space_between_prompt_and_continuation(served, monkeypatch, capsys):
    """`generate` prints the prompt and its continuation decoded together. A SentencePiece continuation that opens
    with a word ('\u2581unto') decoded on its own drops its leading space: caught, the old
    `prompt + decode(new)` printing 'And God saidunto them'; and a continuation cut at eos."""
    import types

    tok = served.tokenizer
    prompt = "And God said"
    continuation = [int(i) for i in tok.encode("And God said unto them")][len(tok.encode(prompt)):]
    assert tok.id_to_token(continuation[0]).startswith("\u2581")  # the case that lost its space
    monkeypatch.setattr(inference, "load", lambda *a, **k: served)

    def forced(self, prompts, num_tokens, **kwargs):
        new = np.asarray([continuation + [tok.eos_id] + continuation], np.int32)
        return {"tokens": np.concatenate([prompts, new], 1), "seconds_per_token": None}

    monkeypatch.setattr(generate.Generator, "generate", forced)
    value = types.SimpleNamespace
    args = value(export=value(value="bundle"), prompt=value(value=prompt), num_tokens=value(value=4),
                 num_samples=value(value=1), temperature=value(value=0.0), top_k=value(value=0), top_p=value(value=1.0),
                 seed=value(value=0), table=value(value="ram"), max_table_bytes=value(value=None))
    generate.run(args)
    assert capsys.readouterr().out == "And God said unto them\n"
