"""extract_fgrams against the plain rule-1 reference, on text-like and planted corpora."""
import numpy as np
import pytest
from test_fgram_reference import planted_docs, reference_fgrams, zipf_docs

from scone_jax.fgram.extract import extract_fgrams


def assert_same(vocab, expected):
    got = [(vocab.fgram(r), int(vocab.counts[r])) for r in range(vocab.num_fgrams)]
    assert got == expected
    assert (vocab.tokens[np.arange(vocab.max_len)[None, :] >= vocab.lengths[:, None]] == 0).all()


def assert_closed(vocab):
    """Every f-gram's prefixes and suffixes of length >= 2 are f-grams too (docs/method.md §1, closure)."""
    grams = {vocab.fgram(r) for r in range(vocab.num_fgrams)}
    for g in grams:
        for n in range(2, len(g)):
            assert g[:n] in grams and g[-n:] in grams, g


@pytest.fixture(scope="module")
def zipf():
    return zipf_docs(np.random.default_rng(0), num_docs=300, vocab_size=60, max_doc_len=120)


@pytest.fixture(scope="module")
def planted():
    rng = np.random.default_rng(1)
    phrases = [rng.integers(0, 500, size=n) for n in (3, 4, 5, 6, 8, 8)]
    return planted_docs(rng, num_docs=200, vocab_size=500, max_doc_len=150, phrases=phrases)


@pytest.mark.parametrize("max_len,num_fgrams,min_count", [(5, 10**6, 5), (5, 40, 5), (3, 300, 2), (8, 500, 3)])
def test_zipf_matches_reference(zipf, max_len, num_fgrams, min_count):
    vocab = extract_fgrams(zipf, max_len=max_len, num_fgrams=num_fgrams, min_count=min_count, vocab_size=60,
                           num_workers=1, chunk_tokens=997, spill_limit=300)
    expected = reference_fgrams(zipf, max_len, num_fgrams, min_count)
    assert len(expected) > 30
    assert_same(vocab, expected)
    assert_closed(vocab)
    assert vocab.tokens_counted == sum(len(d) for d in zipf)


def test_planted_matches_reference_with_workers(planted):
    vocab = extract_fgrams(iter(planted), max_len=8, num_fgrams=400, min_count=3, vocab_size=500,
                           tokenizer_fingerprint="tok1", num_workers=2, chunk_tokens=1500, spill_limit=200)
    expected = reference_fgrams(planted, 8, 400, 3)
    assert_same(vocab, expected)
    assert_closed(vocab)
    assert vocab.lengths.max() == 8 and vocab.tokenizer_fingerprint == "tok1"
    one = extract_fgrams(planted, max_len=8, num_fgrams=400, min_count=3, vocab_size=500,
                         tokenizer_fingerprint="tok1", num_workers=1)
    assert one.fingerprint == vocab.fingerprint


def test_ngrams_never_cross_documents():
    docs = [np.array([1, 2], np.int32)] * 5 + [np.array([3], np.int32), np.array([4], np.int32)] * 5
    vocab = extract_fgrams(docs, max_len=3, num_fgrams=10, min_count=1, vocab_size=5, num_workers=1)
    assert [vocab.fgram(r) for r in range(vocab.num_fgrams)] == [(1, 2)]


def test_ties_break_shorter_first_then_ids():
    docs = [np.array([5, 6, 7], np.int32), np.array([1, 2], np.int32), np.array([3, 4], np.int32)] * 3
    vocab = extract_fgrams(docs, max_len=3, num_fgrams=4, min_count=3, vocab_size=8, num_workers=1)
    assert [vocab.fgram(r) for r in range(4)] == [(1, 2), (3, 4), (5, 6), (6, 7)]
    assert vocab.counts.tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize("kwargs,message", [
    ({"max_len": 1}, "max_len \\(K\\) = 1"),
    ({"num_fgrams": 0}, "num_fgrams \\(S\\) = 0"),
    ({"min_count": 0}, "min_count = 0"),
    ({"vocab_size": 0}, "vocab_size = 0"),
])
def test_bad_arguments(kwargs, message):
    args = {"max_len": 5, "num_fgrams": 10, "min_count": 5, "vocab_size": 10} | kwargs
    with pytest.raises(ValueError, match=message):
        extract_fgrams([np.arange(5, dtype=np.int32)], num_workers=1, **args)


@pytest.mark.parametrize("docs,message", [
    ([], "corpus is empty: 0 document"),
    ([np.zeros(0, np.int32)] * 3, "corpus is empty: 3 document"),
    ([np.array([1, 2]), np.array([3, 10])], "Document 1 holds token id 10, outside \\[0, vocab_size=10\\)"),
    ([np.array([-2, 1])], "Document 0 holds token id -2"),
    ([np.array([1.5, 2.0])], "Document 0 is float64"),
    ([np.array([1, 2, 1, 3])], "No 2-gram occurs min_count=5 times"),
])
def test_bad_corpus(docs, message):
    with pytest.raises(ValueError, match=message):
        extract_fgrams(docs, num_fgrams=10, vocab_size=10, num_workers=1)


def test_the_count_cutoff_is_the_s_th_fgram_not_the_one_before():
    """Pruning between scans drops n-grams below the count of the S-th best one so far. Here S = 4 and the
    2-grams count 12, 12, 10, 6; the 3-gram (1, 2, 3) counts 8, between the 4th (6) and the 3rd (10), and
    belongs in the top 4. Caught: the cutoff read at the (S-1)-th f-gram (the 3-gram was pruned and the
    vocabulary kept (6, 7) instead; the Zipf fixtures' ties at the cutoff hide that bug)."""
    doc = lambda *t: np.array(t, np.int32)  # noqa: E731
    docs = [doc(1, 2, 3)] * 8 + [doc(1, 2)] * 4 + [doc(2, 3)] * 4 + [doc(4, 5)] * 10 + [doc(6, 7)] * 6
    expected = [((1, 2), 12), ((2, 3), 12), ((4, 5), 10), ((1, 2, 3), 8)]
    assert reference_fgrams(docs, 3, 4, 2) == expected
    vocab = extract_fgrams(docs, max_len=3, num_fgrams=4, min_count=2, vocab_size=8, num_workers=1)
    assert_same(vocab, expected)
