"""Cached decoding with per-token table rows gives the logits of a full forward pass."""
import jax.numpy as jnp
import numpy as np
import pytest

from scone_jax import generate, inference
from tests import serving_run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return inference.load(serving_run.exported(tmp_path_factory, "float32"))


def full_forward_logits(served, tokens):
    """The offloaded forward pass over whole sequences (one document each), no cache."""
    ones = np.ones_like(tokens)
    batch = inference.host_rows(served, {"inputs": tokens, "segment_ids": ones,
                                         "positions": np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)})
    return np.asarray(inference.batch_logits(served.decoder, {k: jnp.asarray(v) for k, v in batch.items()})), batch


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
    assert (batch["fgram_ids"][:, 6:23] >= 0).mean() > 0.3
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
