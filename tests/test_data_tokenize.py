"""Tests for scone_jax/data/tokenize.py: parallel tokenizing in document order."""
import os
import time

import numpy as np
import pytest

from scone_jax.data import corpus, tokenize
from scone_jax.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return Tokenizer.load(tokenizer_path)


class SlowStartSource:
    """Documents as a picklable source whose document 0 takes a while, so chunk 0 finishes last."""

    def __init__(self, docs):
        self._docs = list(docs)

    def __len__(self):
        return len(self._docs)

    def __getitem__(self, index):
        if index == 0:
            time.sleep(0.5)
        return self._docs[index]


def test_encode_all_equals_a_plain_loop_for_1_and_2_workers(tok):
    """Catches merging chunks in the order they finish (futures.as_completed) instead of document order:
    chunk 0 is the slowest, so with 2 workers it would come last."""
    docs = corpus.kjv_documents("eval", 0.02)[:60] + ("", "naïve ☃ \t end")
    expected = [tok.encode(doc) for doc in docs]
    calls = []
    for workers in (1, 2):
        tokens, offsets = tokenize.encode_all(SlowStartSource(docs), tok, workers=workers, chunk_docs=7,
                                              progress=lambda d, t: calls.append((d, t)))
        assert tokens.dtype == np.int32 and offsets.dtype == np.int64
        assert offsets[0] == 0 and len(offsets) == len(docs) + 1
        assert [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == [e.tolist() for e in expected]
        # progress after each of the 9 chunks, in document order, ending at the totals
        assert [d for d, _ in calls] == [7, 14, 21, 28, 35, 42, 49, 56, 62]
        assert [t for _, t in calls] == [int(offsets[d]) for d, _ in calls]
        calls.clear()


def test_model_documents_are_bos_plus_ids_in_document_order_up_to_max_tokens(tok):
    """The stream f-gram extraction counts. Catches chunks yielded in the order they finish (chunk 0 is the
    slowest), a budget that stops at a document boundary instead of cutting the last document, and a missing
    bos (tried: each fails here)."""
    docs = corpus.kjv_documents("eval", 0.02)[:30]
    expected = [np.concatenate([[tok.bos_id], tok.encode(doc)]).tolist() for doc in docs]
    got = tokenize.model_documents(SlowStartSource(docs), tok, bos_id=tok.bos_id, chunk_docs=4)
    assert [d.tolist() for d in got] == expected
    flat = sum(expected, [])
    half = len(flat) // 2 + 1  # inside a document
    got = list(tokenize.model_documents(SlowStartSource(docs), tok, bos_id=tok.bos_id, max_tokens=half,
                                        workers=2, chunk_docs=4))
    assert np.concatenate(got).tolist() == flat[:half] and all(d.dtype == np.int32 for d in got)
    arrays = [np.array([5, 6], np.int32), np.array([7], np.int64)]  # pre-tokenized, counted without bos
    assert [d.tolist() for d in tokenize.model_documents(arrays, None, bos_id=None)] == [[5, 6], [7]]


def test_encode_documents_passes_token_arrays_through_and_names_bad_items(tok):
    source = ["in the beginning", np.array([7, 8, 9], np.int32), np.array([], np.int32)]
    tokens, lengths = tokenize.encode_documents(source, tok, 0, 3)
    first = tok.encode("in the beginning")
    assert lengths.tolist() == [len(first), 3, 0] and lengths.dtype == np.int32
    assert tokens.tolist() == first.tolist() + [7, 8, 9]
    tokens, lengths = tokenize.encode_documents(source, tok, 1, 2)
    assert tokens.tolist() == [7, 8, 9] and lengths.tolist() == [3]
    with pytest.raises(TypeError, match="Document 1 is a float"):
        tokenize.encode_documents(["a", 3.5], tok, 0, 2)


def test_empty_source_and_worker_counts(tok):
    tokens, offsets = tokenize.encode_all([], tok, workers=2)
    assert tokens.shape == (0,) and offsets.tolist() == [0]
    assert tokenize.default_workers() == len(os.sched_getaffinity(0))
    assert tokenize.resolve_workers(-1) == tokenize.default_workers()
    assert tokenize.resolve_workers(3) == 3
    with pytest.raises(ValueError, match=r"--workers=0 is not valid: use -1 \(all cores\)"):
        tokenize.resolve_workers(0, "--workers")
