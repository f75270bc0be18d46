"""The Beam pipeline (DirectRunner) writes the very vocabulary extract_fgrams builds."""
import numpy as np
import pytest

pytest.importorskip("apache_beam")

from test_fgram_reference import planted_docs, zipf_docs  # noqa: E402

from scone_jax.fgram.beam import extract_fgrams_beam  # noqa: E402
from scone_jax.fgram.extract import extract_fgrams  # noqa: E402


def test_same_vocabulary_as_one_machine(tmp_path):
    rng = np.random.default_rng(5)
    phrases = [rng.integers(0, 300, size=n) for n in (3, 5, 6)]
    docs = zipf_docs(rng, num_docs=60, vocab_size=300, max_doc_len=80) + planted_docs(
        rng, num_docs=40, vocab_size=300, max_doc_len=80, phrases=phrases)
    args = dict(max_len=6, num_fgrams=150, min_count=3, vocab_size=300, tokenizer_fingerprint="tok")
    beam_vocab = extract_fgrams_beam(docs, output=str(tmp_path / "beam"), **args)
    local = extract_fgrams(docs, num_workers=1, **args)
    assert beam_vocab.fingerprint == local.fingerprint
    assert beam_vocab.num_fgrams == 150 and beam_vocab.lengths.max() == 6
    np.testing.assert_array_equal(beam_vocab.tokens, local.tokens)


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match=r"A document holds token id 9, outside \[0, vocab_size=5\)"):
        extract_fgrams_beam([np.array([1, 9])], output=str(tmp_path / "v"), num_fgrams=5, vocab_size=5)
    with pytest.raises(Exception, match="corpus is empty"):
        extract_fgrams_beam([np.zeros(0, np.int32)], output=str(tmp_path / "v"), num_fgrams=5, vocab_size=5)
    with pytest.raises(ValueError, match=r"max_len \(K\) = 1"):
        extract_fgrams_beam([np.array([1, 2])], output=str(tmp_path / "v"), max_len=1, num_fgrams=5, vocab_size=5)
